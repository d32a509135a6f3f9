"""01_tensor_parallel: every tensor-parallel piece computes the same function as its serial twin.

Tolerance: everything runs in float64 and is compared as max|a - b| / max|b| <= 1e-10. Splitting
a matmul or a sum across ranks only reorders additions, which costs a few float64 ulps (~1e-15)
per reduction; a real bug (a bias added tp times, a wrong shard, a missing all-reduce) is O(1).
Weights, biases, LayerNorm parameters and inputs are all random, never zeros or ones, so that
such bugs cannot hide. The optimization that optimize() turns on (overlap_input_grad: the
column-parallel backward's asynchronous all-reduce) changes when the same sums travel, never what
is summed: the same tolerance holds with it on and off, and a reduction lost or waited for too late
is O(1).
"""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import ROOT, load
from plumbing.trace import trace_comm

tensor_parallel = load("01_tensor_parallel")
TOL = 1e-10
F64 = torch.float64
CFG = tensor_parallel.GPTConfig(vocab_size=101, block_size=32, n_layer=2, n_head=4, n_embd=32, dropout=0.0)


def rel(a, b):
    return tensor_parallel.max_rel_diff(a, b)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def randomize(module, seed):
    """Poison every parameter of a serial module with random values; return its full state dict."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) * 0.3)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# ----------------------------------------------------------------------------------------------
# The blocks, each against a serial twin built from the same class with group=None.
# Each entry: (make(group, sp), input layout, output layout). Layouts: "full" replicated,
# "T" split along the sequence when sp is on (else full), "C" split along the last dim, "QKV" its three
# thirds each split along the last dim, this rank's slices of Q, K and V side by side (01's c_attn).

BLOCKS = {
    "ColumnParallelLinear": (lambda g, sp: tensor_parallel.ColumnParallelLinear(32, 48, g, sp, dtype=F64), "T", "C"),
    "ColumnParallelLinear(fused=3)": (
        lambda g, sp: tensor_parallel.ColumnParallelLinear(32, 96, g, sp, fused=3, dtype=F64), "T", "QKV"),
    "RowParallelLinear": (lambda g, sp: tensor_parallel.RowParallelLinear(48, 32, g, sp, dtype=F64), "C", "T"),
    "LayerNorm": (lambda g, sp: tensor_parallel.LayerNorm(32, g, sp, dtype=F64), "T", "T"),
    "ParallelMLP": (lambda g, sp: tensor_parallel.ParallelMLP(CFG, g, sp, dtype=F64), "T", "T"),
    "ParallelAttention": (
        lambda g, sp: tensor_parallel.ParallelAttention(CFG, g, sp, dtype=F64), "T", "T"),
    "Block": (lambda g, sp: tensor_parallel.Block(CFG, g, sp, dtype=F64), "T", "T"),
}


def _local(t, layout, sp, tp, rank):
    if layout == "C":
        return t.chunk(tp, -1)[rank]
    if layout == "QKV":
        return torch.cat([third.chunk(tp, -1)[rank] for third in t.chunk(3, -1)], -1)
    if layout == "T" and sp:
        return t.chunk(tp, 1)[rank]
    return t


def set_overlap(module, on):
    """overlap_input_grad on every column-parallel layer inside module (optimize(), as 05 does)."""
    return tensor_parallel.optimize(module, overlap_input_grad=on)


def _compare_blocks(env, tp, overlap):
    group = tensor_parallel.new_tp_group(env, tp)
    rank = tensor_parallel.tp_rank(group)
    diffs = {}
    for sp in (False, True):
        for i, (name, (make, lin, lout)) in enumerate(BLOCKS.items()):
            serial = make(None, False)
            full = randomize(serial, seed=10 + i)
            block = set_overlap(make(group, sp), overlap)
            tensor_parallel.load_full_state_dict(block, full, group)
            n_in = 48 if lin == "C" else 32
            x = randn(2, 8, n_in, seed=100 + i).requires_grad_()
            y = serial(x)
            dy = randn(*y.shape, seed=200 + i)  # a random upstream gradient, not ones
            y.backward(dy)
            x_local = _local(x.detach(), lin, sp, tp, rank).clone().requires_grad_()
            y_local = block(x_local)
            y_local.backward(_local(dy, lout, sp, tp, rank))
            key = f"{name} sp={sp}"
            diffs[key + " forward"] = rel(y_local, _local(y.detach(), lout, sp, tp, rank))
            diffs[key + " input grad"] = rel(x_local.grad, _local(x.grad, lin, sp, tp, rank))
            ref = {n: p.grad for n, p in serial.named_parameters()}
            for n, g in tensor_parallel.gather_full(block, group, grads=True).items():
                diffs[f"{key} grad {n}"] = rel(g, ref[n])
    return diffs


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_block_matches_its_serial_twin_forward_input_and_weight_grads(run_ranks, tp, overlap):
    for diffs in run_ranks(_compare_blocks, tp, tp, overlap):
        bad = {k: v for k, v in diffs.items() if not v <= TOL}
        assert not bad, f"tp={tp}: differences above {TOL}: {bad}"
        assert len(diffs) > 60  # every block, both modes, forward + input grad + each weight grad


# ----------------------------------------------------------------------------------------------
# The conjugate operators, checked by what they do to values and gradients on each rank.


def _conjugates(env):
    group, tp, r = env_group(env)
    x = randn(2, 4, 8, seed=1)
    out = {}
    for name in ("copy_to_tp", "reduce_from_tp",
                 "scatter_to_sp", "gather_from_sp", "reduce_scatter_to_sp"):
        xi = (x * (r + 1)).requires_grad_()  # and so does each rank's input
        y = getattr(tensor_parallel, name)(xi, group)
        y.backward(randn(*y.shape, seed=3 + r))  # each rank's upstream gradient differs
        out[name] = (y.detach(), xi.grad)
    return out


def env_group(env):
    group = tensor_parallel.new_tp_group(env, env.world_size)
    return group, env.world_size, env.rank


def test_conjugate_operators_do_what_their_contracts_say(run_ranks):
    tp = 2
    res = run_ranks(_conjugates, tp)
    xs = [randn(2, 4, 8, seed=1) * (r + 1) for r in range(tp)]
    gs = {name: [randn(*res[r][name][0].shape, seed=3 + r) for r in range(tp)] for name in res[0]}
    total_x, total = sum(xs), lambda name: sum(gs[name])
    for r in range(tp):
        y, g = res[r]["copy_to_tp"]  # f: identity forward, all-reduce backward
        assert torch.equal(y, xs[r]) and rel(g, total("copy_to_tp")) <= TOL
        y, g = res[r]["reduce_from_tp"]  # g: all-reduce forward, identity backward
        assert rel(y, total_x) <= TOL and torch.equal(g, gs["reduce_from_tp"][r])
        y, g = res[r]["scatter_to_sp"]  # split T forward, all-gather T backward
        assert torch.equal(y, xs[r].chunk(tp, 1)[r]) and torch.equal(g, torch.cat(gs["scatter_to_sp"], 1))
        y, g = res[r]["gather_from_sp"]  # all-gather T forward, reduce-scatter T backward
        assert torch.equal(y, torch.cat(xs, 1))
        assert rel(g, total("gather_from_sp").chunk(tp, 1)[r]) <= TOL
        y, g = res[r]["reduce_scatter_to_sp"]  # reduce-scatter T forward, all-gather T backward
        assert rel(y, total_x.chunk(tp, 1)[r]) <= TOL
        assert torch.equal(g, torch.cat(gs["reduce_scatter_to_sp"], 1))


# ----------------------------------------------------------------------------------------------
# Vocab-parallel cross-entropy against F.cross_entropy on the full, unpadded logits.


def _cross_entropy(env, V, ignore_index):
    group, tp, r = env_group(env)
    V_pad = tensor_parallel.padded_vocab_size(V, tp)
    N = 24
    full = randn(N, V, seed=5) * 3
    target = torch.randint(V, (N,), generator=torch.Generator().manual_seed(6))
    target[::5] = ignore_index  # some positions are ignored
    padded = torch.cat([full, torch.full((N, V_pad - V), 1e4, dtype=F64)], 1)  # poison the padding
    local = padded.chunk(tp, 1)[r].clone().requires_grad_()
    with trace_comm() as log:
        loss = tensor_parallel.vocab_parallel_cross_entropy(local, target, group, V, ignore_index=ignore_index)
    dloss = 0.7  # a non-unit upstream gradient
    loss.backward(torch.tensor(dloss, dtype=F64))
    ref_in = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_in, target, ignore_index=ignore_index)
    ref.backward(torch.tensor(dloss, dtype=F64))
    ref_grad = torch.cat([ref_in.grad, torch.zeros(N, V_pad - V, dtype=F64)], 1).chunk(tp, 1)[r]
    return rel(loss.detach(), ref.detach()), rel(local.grad, ref_grad), local.grad, V_pad, \
        [(c.op, c.operator, c.shape) for c in log]


@pytest.mark.parametrize("tp,V,ignore_index", [(1, 10, -100), (2, 10, -100), (4, 10, -100),
                                                (4, 13, 3), (4, 3, -100)])
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy_with_padding_and_ignore_index(
        run_ranks, tp, V, ignore_index):
    N = 24
    # The max has its own all-reduce (MAX); the target logits and the sums of exponentials share
    # one of (2, N). None at tp=1.
    ce = "_VocabParallelCrossEntropy"
    want = [] if tp == 1 else [("all-reduce (max)", ce, (N,)), ("all-reduce", ce, (2, N))]
    for r, (dloss, dgrad, grad, V_pad, log) in enumerate(run_ranks(_cross_entropy, tp, V, ignore_index)):
        assert log == want
        assert dloss <= TOL and dgrad <= TOL, (r, dloss, dgrad)
        start = r * (V_pad // tp)
        pad_cols = [c for c in range(grad.shape[1]) if start + c >= V]
        assert torch.all(grad[:, pad_cols] == 0)  # padded logits get no gradient
    # V=3 at tp=4 pads to 4: the last rank holds nothing but padding, and the loss still matches.


def test_padded_vocab_size_rounds_up_to_a_multiple_of_tp_times_divisor():
    assert tensor_parallel.padded_vocab_size(50257, 1) == 50257
    assert tensor_parallel.padded_vocab_size(50257, 2) == 50258
    assert tensor_parallel.padded_vocab_size(50257, 4, divisible_by=128) == 50688  # 99 * 512
    assert tensor_parallel.padded_vocab_size(3, 4) == 4


# ----------------------------------------------------------------------------------------------
# Dropout random streams.


def _rng(env):
    group, tp, r = env_group(env)
    torch.manual_seed(0)  # the default stream is seeded alike on every rank
    rng = tensor_parallel.TPRandom(0, tensor_parallel.tp_rank(group), "cpu")
    before = torch.rand(4)
    with rng.fork():
        forked = torch.rand(4)
    after = torch.rand(4)
    torch.manual_seed(0)
    plain = torch.rand(8)  # the same draws with no fork in between
    # Attention: give every head the same weights, so the heads differ only by their dropout mask.
    cfg = tensor_parallel.GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.5)
    # GPT, the machine, gives each block's attention its dropout and the tracked stream (the lesson has none).
    attention = lambda g: tensor_parallel.GPT(cfg, g, init=False, dtype=F64, rng=rng).transformer.h["0"].attn  # noqa: E731
    serial = attention(None)
    full = randomize(serial, 3)
    w = full["c_attn.weight"].view(3, 2, 4, 8)
    full["c_attn.weight"] = w[:, :1].expand(3, 2, 4, 8).reshape(24, 8)
    b = full["c_attn.bias"].view(3, 2, 4)
    full["c_attn.bias"] = b[:, :1].expand(3, 2, 4).reshape(24)
    attn = attention(group)
    tensor_parallel.load_full_state_dict(attn, full, group)
    heads = []
    attn.c_proj.register_forward_pre_hook(lambda m, args: heads.append(args[0].detach()))
    attn(randn(2, 8, 8, seed=4))
    # The residual stream of a whole model with dropout on stays identical across tp ranks.
    model = tensor_parallel.GPT(cfg, group, seed=1, dtype=F64)
    hidden = []
    model.transformer.h["0"].register_forward_hook(lambda m, a, out: hidden.append(out.detach()))
    torch.manual_seed(5)
    model(torch.randint(11, (2, 8), generator=torch.Generator().manual_seed(0)))
    return before, forked, after, plain, heads[0], hidden[0]


def test_dropout_differs_across_tp_ranks_inside_tp_regions_and_matches_on_replicated_activations(run_ranks):
    (b0, f0, a0, p0, h0, x0), (b1, f1, a1, p1, h1, x1) = run_ranks(_rng, 2)
    assert torch.equal(b0, b1) and torch.equal(a0, a1)  # default stream: same on both ranks
    assert not torch.equal(f0, f1)  # tracked stream: seeded by tp rank
    assert torch.equal(torch.cat([b0, a0]), p0)  # fork() leaves the default stream untouched
    assert h0.shape == h1.shape and not torch.equal(h0, h1)  # same head weights, different masks
    assert torch.equal(x0, x1)  # replicated residual stream: identical masks on every rank


# ----------------------------------------------------------------------------------------------
# Weights: master weight then split, and back.


def _round_trip(env):
    group, tp, r = env_group(env)
    cfg = tensor_parallel.GPTConfig(vocab_size=1001, block_size=16, n_layer=2, n_head=4, n_embd=16)
    full = tensor_parallel.init_state_dict(cfg, 3, dtype=F64, random_all=True)
    model = tensor_parallel.GPT(cfg, group, init=False, dtype=F64)
    model.load_full_state_dict(full)
    back = model.full_state_dict()
    from_seed = tensor_parallel.GPT(cfg, group, seed=9, dtype=F64).full_state_dict()
    # Fused QKV: rank r holds rows [q_r; k_r; v_r], each C/tp rows, not a contiguous block.
    C, w = 16, full["transformer.h.0.attn.c_attn.weight"]
    expect = torch.cat([w[j * C + r * C // tp: j * C + (r + 1) * C // tp] for j in range(3)])
    qkv_ok = torch.equal(model.transformer.h["0"].attn.c_attn.weight.detach(), expect)
    return full, back, from_seed, qkv_ok


@pytest.mark.parametrize("tp", [2, 4])
def test_full_state_dict_splits_and_gathers_back_bit_equal(run_ranks, tp):
    cfg = tensor_parallel.GPTConfig(vocab_size=1001, block_size=16, n_layer=2, n_head=4, n_embd=16)
    serial_from_seed = tensor_parallel.GPT(cfg, None, seed=9, dtype=F64).state_dict()
    for full, back, from_seed, qkv_ok in run_ranks(_round_trip, tp):
        assert qkv_ok
        assert full.keys() == back.keys()
        for k in full:
            assert torch.equal(full[k], back[k]), k  # 1001 is not divisible by tp: padding stripped
            assert torch.equal(from_seed[k], serial_from_seed[k]), k  # seed -> same model at any tp


# ----------------------------------------------------------------------------------------------
# The whole model, over several AdamW steps.


def _whole_model(env, sp, switches, steps):
    group, tp, r = env_group(env)
    full = tensor_parallel.init_state_dict(CFG, 4, dtype=F64, random_all=True)
    serial = tensor_parallel.GPT(CFG, None, init=False, dtype=F64)
    model = tensor_parallel.optimize(tensor_parallel.GPT(CFG, group, sequence_parallel=sp, init=False, dtype=F64),
                                     **switches)
    serial.load_full_state_dict(full)
    model.load_full_state_dict(full)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (serial, model)]
    gen = torch.Generator().manual_seed(7)
    diffs = {}
    for step in range(steps):
        idx = torch.randint(CFG.vocab_size, (3, 16), generator=gen)
        targets = torch.randint(CFG.vocab_size, (3, 16), generator=gen)
        ref_logits, ref_loss = serial(idx, targets)
        logits, loss = model(idx, targets)
        ref_loss.backward()
        loss.backward()
        diffs[f"step {step} loss"] = rel(loss.detach(), ref_loss.detach())
        diffs[f"step {step} logits"] = rel(model.full_logits(logits.detach()), ref_logits.detach())
        ref_grads = {n: p.grad for n, p in serial.named_parameters()}
        for n, g in model.full_grads().items():
            diffs[f"step {step} grad {n}"] = rel(g, ref_grads[n])
        for opt in opts:
            opt.step()
            opt.zero_grad()
        ref_params = serial.state_dict()
        for n, p in model.full_state_dict().items():
            diffs[f"step {step} param {n}"] = rel(p, ref_params[n])
    return diffs


SWITCHES = {"optimized": {}, "plain": dict(overlap_input_grad=False)}


@pytest.mark.grid(keep=['4-sp-on-optimized', '4-sp-off-plain', '2-sp-on-plain', '1-sp-off-optimized'])
@pytest.mark.parametrize("switches", ["optimized", "plain"])
@pytest.mark.parametrize("sp", [False, True], ids=["sp-off", "sp-on"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_gpt2_equals_serial_gpt2_loss_grads_and_10_adamw_steps(run_ranks, tp, sp, switches):
    steps = 10
    for diffs in run_ranks(_whole_model, tp, sp, SWITCHES[switches], steps):
        bad = {k: v for k, v in diffs.items() if not v <= TOL}
        assert not bad, bad
        assert sum("grad" in k for k in diffs) == steps * len(tensor_parallel.init_state_dict(CFG, 0))


# ----------------------------------------------------------------------------------------------
# The overlap itself: what runs while each collective is in flight, and who can replace f.

GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class CountGemms(TorchDispatchMode):
    """Counts the matrix multiplications run under it (backward's too: CPU autograd runs them on
    this thread), so that a clock reading this count tells which GEMMs ran inside a traced span."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in GEMMS
        return func(*args, **(kwargs or {}))


def _spans(env, sp, overlap):
    group, tp, r = env_group(env)
    model = set_overlap(tensor_parallel.GPT(CFG, group, sequence_parallel=sp, dtype=F64), overlap)
    idx = torch.randint(CFG.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    gemms = CountGemms()
    with gemms, trace_comm(model, clock=lambda: gemms.n) as log:  # a span's "time" is GEMMs run during it
        model(idx, idx)[1].backward()
    return [(c.op, c.where, c.shape, c.end - c.start) for c in log]


@pytest.mark.parametrize("sp", [False, True], ids=["sp-off", "sp-on"])
def test_column_parallel_backward_computes_the_weight_gradient_while_its_reduction_is_in_flight(run_ranks, sp):
    on, off = (run_ranks(_spans, 2, sp, overlap)[0] for overlap in (True, False))
    assert [c[:3] for c in on] == [c[:3] for c in off]  # the same collectives, in the same order
    column = [c for c in on if c[1].endswith(("c_attn backward", "c_fc backward", "lm_head backward"))]
    assert len(column) == 2 * CFG.n_layer + 1  # every column-parallel layer, and the output layer
    assert all(c[0] == ("reduce-scatter" if sp else "all-reduce") for c in column)
    # Overlapped: exactly the weight gradient's GEMM runs between the launch and the wait; waited
    # for in the open (off), none does. Every other collective is synchronous either way.
    assert all(c[3] == 1 for c in column) and all(c[3] == 0 for c in off)
    assert all(c[3] == 0 for c in on if c not in column)


def _replaced_f(env, overlap):
    group, tp, r = env_group(env)
    calls = []

    def f(x, group):  # a grader's stand-in for a student's copy_to_tp
        calls.append(tuple(x.shape))
        return original(x, group)

    original, tensor_parallel.copy_to_tp = tensor_parallel.copy_to_tp, f  # in this forked rank only
    model = set_overlap(tensor_parallel.GPT(CFG, group, dtype=F64), overlap)
    idx = torch.randint(CFG.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    model(idx, idx)[1].backward()
    return calls


def _student_cross_entropy(env):
    group, tp, r = env_group(env)
    calls = []

    def ce(logits, target, group, n_vocab, ignore_index=-100):  # 01's signature
        calls.append(n_vocab)
        return original(logits, target, group, n_vocab, ignore_index)

    original, tensor_parallel.vocab_parallel_cross_entropy = tensor_parallel.vocab_parallel_cross_entropy, ce
    model = tensor_parallel.GPT(CFG, group, dtype=F64)
    idx = torch.randint(CFG.vocab_size, (3, 16), generator=torch.Generator().manual_seed(1))
    return model(idx, idx)[1].item(), calls == [CFG.vocab_size]


def test_a_replaced_f_takes_effect_with_the_overlap_off_and_a_replaced_cross_entropy_is_called(run_ranks):
    # A grader that replaces copy_to_tp in the module (exercises/ replace CopyToTP, which it calls)
    # takes effect: in the paper's path (the default) every column-parallel layer (2 per block, and the
    # output layer) calls it; with the overlap on, none does.
    off = run_ranks(_replaced_f, 2, False)[0]
    assert off == [(3, 16, CFG.n_embd)] * (2 * CFG.n_layer + 1)
    assert run_ranks(_replaced_f, 2, True)[0] == []
    assert all(loss > 0 and called for loss, called in run_ranks(_student_cross_entropy, 2))


# ----------------------------------------------------------------------------------------------
# What 01's demo configuration runs: the paper's path, and nothing else.


def _functions_run(env, sp, optimized):
    """How many times each autograd Function of 01 ran in one forward + backward of the demo's model
    (the demo's sizes, tp = 2), its forward and its backward counted apart."""
    group, tp, r = env_group(env)
    counts = {}
    functions = [tensor_parallel.CopyToTP, tensor_parallel.ReduceFromTP, tensor_parallel.ScatterToSP,
                 tensor_parallel.GatherFromSP, tensor_parallel.ReduceScatterToSP,
                 tensor_parallel.OverlappedColumnLinear, tensor_parallel._VocabParallelCrossEntropy]
    for fn in functions:  # counted in this forked rank only
        for step in ("forward", "backward"):
            def counted(*args, _real=getattr(fn, step), _key=f"{fn.__name__}.{step}"):
                counts[_key] = counts.get(_key, 0) + 1
                return _real(*args)
            setattr(fn, step, staticmethod(counted))
    cfg = tensor_parallel.parser().parse_args([])  # the demo's model flags, as it runs with none given
    cfg = tensor_parallel.GPTConfig(**{k: getattr(cfg, k) for k in ("vocab_size", "block_size", "n_layer",
                                                                     "n_head", "n_embd", "dropout")})
    model = tensor_parallel.GPT(cfg, group, sequence_parallel=sp, dtype=F64)
    if optimized:
        tensor_parallel.optimize(model)
    idx = torch.randint(cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    model(idx, idx)[1].backward()
    return counts


@pytest.mark.parametrize("sp", [False, True], ids=["sp-off", "sp-on"])
def test_the_demo_runs_f_and_g_and_with_sp_its_operators_and_the_overlapped_linear_only_when_asked(run_ranks, sp):
    L = 2  # the demo's n_layer
    counts = run_ranks(_functions_run, 2, sp, False)[0]
    columns = 2 * L + 1  # c_attn and c_fc in each block, and the output layer
    if sp:  # sp's g into each column-parallel layer, its g-bar out of each row-parallel one, the split after
        # the embeddings; f (CopyToTP) on each replicated parameter used on T/tp tokens: 2 LayerNorm
        # parameters x (2 L + 1) LayerNorms, and each row-parallel bias
        want = {"GatherFromSP.forward": columns, "GatherFromSP.backward": columns,
                "ReduceScatterToSP.forward": 2 * L, "ReduceScatterToSP.backward": 2 * L,
                "ScatterToSP.forward": 1, "ScatterToSP.backward": 1,
                "CopyToTP.forward": 2 * (2 * L + 1) + 2 * L, "CopyToTP.backward": 2 * (2 * L + 1) + 2 * L,
                "ReduceFromTP.forward": 1, "ReduceFromTP.backward": 1}  # g: the vocab-parallel embedding
    else:  # f before each column-parallel layer, g after each row-parallel layer and the embedding
        want = {"CopyToTP.forward": columns, "CopyToTP.backward": columns,
                "ReduceFromTP.forward": 2 * L + 1, "ReduceFromTP.backward": 2 * L + 1}
    want.update({"_VocabParallelCrossEntropy.forward": 1, "_VocabParallelCrossEntropy.backward": 1})
    assert counts == want
    optimized = run_ranks(_functions_run, 2, sp, True)[0]
    assert optimized["OverlappedColumnLinear.forward"] == columns  # asked for: it replaces f (or sp's g)
    assert "CopyToTP.forward" not in optimized or sp


def test_sequence_parallelism_names_its_all_gather_g_and_its_reduce_scatter_g_bar_as_korthikantis_figure_5():
    # Korthikanti et al. 2022, Figure 5: "g is all-gather in the forward pass and reduce-scatter in the
    # backward pass; g-bar is reduce-scatter in the forward pass and all-gather in the backward pass".
    from plumbing.demos import PAPER_NAMES
    assert PAPER_NAMES["GatherFromSP"] == "g" and PAPER_NAMES["ReduceScatterToSP"] == "g-bar"
    assert "all-gather T in forward; reduce-scatter T in backward" in tensor_parallel.GatherFromSP.__doc__
    assert tensor_parallel.GatherFromSP.__doc__.startswith("Sequence parallelism's g ")
    assert "reduce-scatter T in forward; all-gather T in backward" in tensor_parallel.ReduceScatterToSP.__doc__
    assert tensor_parallel.ReduceScatterToSP.__doc__.startswith("Sequence parallelism's g-bar ")


def test_01s_fused_qkv_split_where_c_attn_is_built_is_the_split_every_shard_gets():
    # 01 shows the split in a comment beside c_attn, a worked example (issue 47: a reader went to plumbing to
    # learn it); plumbing/shards.split_full does it for every fused parameter: the two must be the same rows.
    from einops import rearrange
    src = " ".join(line.strip().lstrip("#").strip() for line in (ROOT / "01_tensor_parallel.py").read_text().splitlines())
    assert fused_qkv_example_problems(src) == []
    C, tp = 8, 2
    w = torch.arange(3 * C * C, dtype=F64).reshape(3 * C, C)
    weight = tensor_parallel._mark_split(torch.empty(3 * C // tp, C), 0, 3 * C, fused=3)  # rank i's c_attn shard
    for i in range(tp):
        shard = rearrange(w, "(three tp c) C -> tp (three c) C", three=3, tp=tp)[i]
        assert torch.equal(tensor_parallel.split_full(w, weight, tp, i), shard)
        assert torch.equal(shard, torch.cat([q.chunk(tp)[i] for q in w.chunk(3)]))  # [Q_i; K_i; V_i]


def fused_qkv_example_problems(src):
    """What 01's worked example of the fused QKV split ("E.g. C = 4 (2 heads), tp = 2: of the full (12, 4) weight,
    Q rows 0-3, K 4-7, V 8-11, rank 0 holds 0-1, 4-5, 8-9, rank 1 ...") gets wrong against split_full."""
    import re
    found = re.search(r"E\.g\. C = (\d+) \((\d+) heads\), tp = (\d+): of the full \((\d+), (\d+)\) weight, Q rows "
                      r"(\S+), K (\S+), V (\S+), rank 0 holds ([\d, -]+), rank 1 ([\d, -]+)\.", src)
    if not found:
        return ["no worked example of the fused QKV split beside c_attn"]
    C, heads, tp, rows, cols = (int(x) for x in found.groups()[:5])
    rows_of = lambda text: [r for a, b in (part.split("-") for part in text.split(", ")) for r in range(int(a), int(b) + 1)]  # noqa: E731
    w = torch.arange(3 * C, dtype=F64)[:, None].expand(3 * C, C)  # row r holds r
    weight = tensor_parallel._mark_split(torch.empty(3 * C // tp, C), 0, 3 * C, fused=3)
    problems = [] if (rows, cols) == (3 * C, C) and C % heads == 0 and tp == 2 else [f"the full weight of C={C} is ({3 * C}, {C})"]
    for name, text, want in zip("QKV", found.groups()[5:8], range(3)):
        if rows_of(text.rstrip(",")) != list(range(want * C, (want + 1) * C)):
            problems.append(f"{name} rows {text}")
    for i, text in enumerate(found.groups()[8:]):
        if rows_of(text) != [int(r) for r in tensor_parallel.split_full(w, weight, tp, i)[:, 0]]:
            problems.append(f"rank {i} holds {text}; split_full gives {tensor_parallel.split_full(w, weight, tp, i)[:, 0].tolist()}")
    return problems


def test_a_wrong_fused_qkv_example_fails():
    src = " ".join(line.strip().lstrip("#").strip() for line in (ROOT / "01_tensor_parallel.py").read_text().splitlines())
    for old, new in (("rank 0 holds 0-1, 4-5, 8-9", "rank 0 holds 0-1, 2-3, 4-5"), ("rank 1 2-3, 6-7", "rank 1 6-7, 2-3"),
                     ("K 4-7", "K 4-8"), ("(12, 4)", "(12, 3)")):
        assert old in src and fused_qkv_example_problems(src.replace(old, new)), (old, new)
