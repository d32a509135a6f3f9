"""megatron_scratch.convert: Hugging Face GPT-2 <-> our full state dict, the fused QKV layout, and our
pipeline lists <-> torch.distributed.pipelining's pipeline_order (issue 42, point 3).

Tolerances: the conversions are exact. Each moves or transposes tensors and renames actions, so
their comparisons are torch.equal and ==; the HF mapping the tests compare against is written out
here by hand, independent of convert.py and plumbing/gpt2.py. Each equality is also shown failing on
a planted mistake (a Conv1D left untransposed, the naive contiguous QKV cut, torch's own off-by-one in
Schedule1F1B's IR, a B written as torch's I), so none passes vacuously. torch's runtime running our
lists is compared with one process's autograd in float64 at the kit's defaults (rtol 1e-10, atol
1e-12): the same gradients summed over microbatches in another order, ~1e-16. Cost: about 2 s.
"""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from conftest import PIPELINE_CFG, load
from megatron_scratch import convert, reference
from megatron_scratch.testing import RankFailure, assert_close, compare_state

pipeline, interleaved, zb = load("02_pipeline_1f1b"), load("03_interleaved"), load("06_zero_bubble")
tensor_parallel = load("01_tensor_parallel")
CFG = reference.gpt_config(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32)
FULL = reference.init_weights(CFG, seed=3)


# ----------------------------------------------------------------------------------------------
# Hugging Face GPT-2.

def hf_by_hand(full, n_layer, n_positions):
    """GPT2LMHeadModel's state dict as transformers writes it, mapped here key by key: Conv1D weights
    (in, out), lm_head tied, and the causal-mask buffers older versions keep in it."""
    hf = {"transformer.wte.weight": full["transformer.wte.weight"], "transformer.wpe.weight": full["transformer.wpe.weight"],
          "transformer.ln_f.weight": full["transformer.ln_f.weight"], "transformer.ln_f.bias": full["transformer.ln_f.bias"],
          "lm_head.weight": full["transformer.wte.weight"].clone()}
    for i in range(n_layer):
        h = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            hf[h + ln + ".weight"], hf[h + ln + ".bias"] = full[h + ln + ".weight"], full[h + ln + ".bias"]
        for lin in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            hf[h + lin + ".weight"] = full[h + lin + ".weight"].T.contiguous()  # Conv1D: (in, out)
            hf[h + lin + ".bias"] = full[h + lin + ".bias"]
        hf[h + "attn.bias"] = torch.tril(torch.ones(n_positions, n_positions)).view(1, 1, n_positions, n_positions)
        hf[h + "attn.masked_bias"] = torch.tensor(-1e4)
    return hf


def test_hf_to_full_and_back_equal_a_mapping_written_by_hand():
    hf = hf_by_hand(FULL, CFG.n_layer, CFG.block_size)
    full = convert.from_hf(hf, CFG)
    assert list(full) != [] and set(full) == set(FULL)
    assert all(torch.equal(full[k], FULL[k]) for k in FULL)
    back = convert.to_hf(full, CFG)
    want = {k: v for k, v in hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # buffers: none written
    assert set(back) == set(want) and all(torch.equal(back[k], want[k]) for k in want)
    assert all(back[k].is_contiguous() for k in back)
    unprefixed = {k.removeprefix("transformer."): v for k, v in hf.items() if k != "lm_head.weight"}  # GPT2Model's keys
    assert all(torch.equal(convert.from_hf(unprefixed, CFG)[k], FULL[k]) for k in FULL)
    # planted: a Conv1D weight left as nn.Linear's is caught (square c_proj would pass by shape alone)
    planted = dict(hf, **{"transformer.h.1.attn.c_proj.weight": FULL["transformer.h.1.attn.c_proj.weight"]})
    assert not torch.equal(convert.from_hf(planted, CFG)["transformer.h.1.attn.c_proj.weight"],
                           FULL["transformer.h.1.attn.c_proj.weight"])


def test_hf_conversion_refuses_what_is_not_cfgs_gpt2_naming_the_tensor():
    hf = hf_by_hand(FULL, CFG.n_layer, CFG.block_size)
    with pytest.raises(ValueError, match=r"lm_head.weight differs from transformer.wte.weight"):
        convert.from_hf(dict(hf, **{"lm_head.weight": hf["lm_head.weight"] + 1}), CFG)
    with pytest.raises(ValueError, match=r"transformer.h.0.mlp.c_fc.weight: \(32, 64\) instead of \(128, 32\)"):
        convert.from_hf(dict(hf, **{"transformer.h.0.mlp.c_fc.weight": torch.zeros(64, 32)}), CFG)
    with pytest.raises(ValueError, match=r"n_layer=3, but the weights hold 2 layers"):
        convert.from_hf(hf, dataclasses.replace(CFG, n_layer=3))
    with pytest.raises(ValueError, match=r"transformer.wpe.weight .*finite"):
        convert.from_hf(dict(hf, **{"transformer.wpe.weight": torch.full((16, 32), float("nan"))}), CFG)
    with pytest.raises(ValueError, match=r"to_hf: full does not fit cfg .*transformer.ln_f.bias: missing"):
        convert.to_hf({k: v for k, v in FULL.items() if k != "transformer.ln_f.bias"}, CFG)
    with pytest.raises(ValueError, match=r"from_hf: hf_state_dict must be a dict of names to tensors"):
        convert.from_hf([1, 2], CFG)


# ----------------------------------------------------------------------------------------------
# The fused QKV layout.

def test_split_qkv_of_a_shard_is_its_heads_of_q_k_and_v_and_merge_inverts_it():
    nh, C = CFG.n_head, CFG.n_embd
    hs = C // nh
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn.bias"):
        full = FULL[name]
        Q, K, V = full[:C], full[C:2 * C], full[2 * C:]  # GPT-2's [Q; K; V], head h at rows h*hs ..
        assert all(torch.equal(a, b) for a, b in zip(convert.split_qkv(full, nh), (Q, K, V)))
        for tp in (1, 2, 4):
            shards = [reference.tp_shard(FULL, CFG, tp, r)[name] for r in range(tp)]  # what 01 loads
            for r, shard in enumerate(shards):
                assert torch.equal(convert.qkv_shard(full, nh, tp, r), shard)
                heads = range(r * nh // tp, (r + 1) * nh // tp)
                q, k, v = convert.split_qkv(shard, nh, tp, heads=True)
                for j, h in enumerate(heads):  # head by head, sliced from the full tensor
                    for got, W in ((q, Q), (k, K), (v, V)):
                        assert torch.equal(got[j], W[h * hs:(h + 1) * hs])
                assert torch.equal(convert.merge_qkv(q, k, v, heads=True), shard)
                assert torch.equal(convert.merge_qkv(*convert.split_qkv(shard, nh, tp)), shard)
            assert torch.equal(convert.qkv_unshard(shards, nh), full)
        # planted: the naive cut (rank 0 takes the first 3C/2 rows) is not rank 0's shard
        assert not torch.equal(full.chunk(2, dim=0)[0], convert.qkv_shard(full, nh, 2, 0))


def test_split_qkv_refuses_a_tp_that_does_not_divide_the_heads_and_a_wrong_size():
    w = FULL["transformer.h.0.attn.c_attn.weight"]
    with pytest.raises(ValueError, match=r"split_qkv: tp=3 must divide n_head=4"):
        convert.split_qkv(w, 4, 3)
    with pytest.raises(ValueError, match=r"dim 0 of size 95 must be 3 x 4 heads \(n_head=4 / tp=1\).*not divisible by 12"):
        convert.split_qkv(w[:95], 4)
    with pytest.raises(ValueError, match=r"n_head=0 must be a whole number of at least 1"):
        convert.split_qkv(w, 0)
    with pytest.raises(ValueError, match=r"qkv_shard: rank=2 must be below tp=2"):
        convert.qkv_shard(w, 4, 2, 2)
    with pytest.raises(ValueError, match=r"merge_qkv: q, k and v must have one shape"):
        convert.merge_qkv(w[:32], w[:32], w[:16])


# ----------------------------------------------------------------------------------------------
# Pipeline schedules: ours <-> torch's pipeline_order. torch's orders are built from stand-in stages
# (the attributes its constructors read), never run, as tests/test_zero_bubble.py does.

def torch_order(name, pp, m, v=1):
    from torch.distributed.pipelining import schedules
    stages = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * v, submod=None,
                              stage_index_to_group_rank=None) for _ in range(v)]
    cls = getattr(schedules, name)
    return cls(stages[0] if v == 1 and name in ("ScheduleGPipe", "Schedule1F1B") else stages, m).pipeline_order


def compute_only(order):  # torch's IR without its idle slots and gradient reductions, as tuples
    return {r: [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in acts
                if a is not None and a.computation_type.value != "REDUCE_GRAD"] for r, acts in order.items()}


def ours(name, pp, m, v=1):
    if name == "ScheduleGPipe":
        return pipeline.Schedule([pipeline.gpipe(pp, m, r) for r in range(pp)])
    if name == "Schedule1F1B":
        return pipeline.Schedule([pipeline.one_f_one_b(pp, m, r) for r in range(pp)])
    return interleaved.InterleavedSchedule([interleaved.interleaved(pp, m, r, v) for r in range(pp)])


def fix_1f1b_last_rank(order, pp):
    """torch 2.13's Schedule1F1B IR numbers its last rank's forwards F1..Fm: shifted down by one."""
    return {r: [(s, k, mb - 1 if r == pp - 1 and k == "F" else mb) for s, k, mb in acts] for r, acts in order.items()}


CASES = [("ScheduleGPipe", pp, m, 1) for pp in (1, 2, 3, 4) for m in (1, 3, 8)] + \
        [("Schedule1F1B", pp, m, 1) for pp in (1, 2, 3, 4, 6) for m in range(pp, 3 * pp + 1)] + \
        [("ScheduleInterleaved1F1B", pp, m, v) for pp in (2, 3, 4) for v in (2, 3) for m in (pp, 2 * pp, 4 * pp)]


def test_our_lists_become_torchs_pipeline_order_and_torchs_become_ours():
    for name, pp, m, v in CASES:
        want = compute_only(torch_order(name, pp, m, v))
        if name == "Schedule1F1B":
            want = fix_1f1b_last_rank(want, pp)
        schedule = ours(name, pp, m, v)
        assert compute_only(convert.to_torch_order(schedule)) == want, (name, pp, m, v)
        back = convert.from_torch_order(torch_order(name, pp, m, v) if name != "Schedule1F1B" else
                                        convert.to_torch_order(schedule))
        assert back == schedule.lists, (name, pp, m, v)  # Action equality: kind, mb, chunk
        pipeline.validate(interleaved.InterleavedSchedule(back), m)  # torch's order runs on our executor's plan
    # GPipe's and 1F1B's own orders end each rank with REDUCE_GRAD: reduce_grad=True writes it there too
    for name in ("ScheduleGPipe", "Schedule1F1B"):
        got = convert.to_torch_order(ours(name, 3, 5), reduce_grad=True)
        want = torch_order(name, 3, 5)
        if name == "Schedule1F1B":
            want = {r: want[r] for r in range(2)} | {2: got[2]}  # the last rank: torch's off-by-one, below
        assert {r: list(map(str, a)) for r, a in got.items()} == {r: list(map(str, a)) for r, a in want.items()}


def test_torchs_1f1b_ir_numbers_its_last_ranks_forwards_from_1_and_nothing_else_differs():
    # The bug issue 42 reports (torch 2.13): the last rank's IR reads F1..Fm where it runs F0..Fm-1.
    for pp in (1, 2, 4):
        m = 2 * pp
        got = compute_only(torch_order("Schedule1F1B", pp, m))
        last = [mb for _, k, mb in got[pp - 1] if k == "F"]
        assert last == list(range(1, m + 1)), last  # if torch fixes it, this fails: drop fix_1f1b_last_rank then
        ours_order = compute_only(convert.to_torch_order(ours("Schedule1F1B", pp, m)))
        assert ours_order != got and ours_order == fix_1f1b_last_rank(got, pp)
        assert all(ours_order[r] == got[r] for r in range(pp - 1))


def test_zero_bubbles_v_placement_and_its_i_and_w_convert_too():
    pipe = zb.pipeline_schedule("zb-v", 3, 6)
    want = compute_only(torch_order("ScheduleZBVZeroBubble", 3, 6, 2))
    assert compute_only(convert.to_torch_order(pipe)) == want
    assert convert.from_torch_order(torch_order("ScheduleZBVZeroBubble", 3, 6, 2), placement=zb.v_shape) == pipe.lists


def test_the_csv_strings_of_torchs_ir_read_back_and_what_we_lack_is_refused():
    from torch.distributed.pipelining.schedules import _Action, _ComputationType
    schedule = ours("ScheduleInterleaved1F1B", 2, 4, 2)
    rows = {r: [str(a) for a in acts] for r, acts in convert.to_torch_order(schedule).items()}  # _dump_csv's cells
    assert rows[0][:3] == ["0F0", "0F1", "2F0"]
    assert convert.from_torch_order(rows) == schedule.lists
    with pytest.raises(ValueError, match=r"rank 1's 2F0 runs stage 2, which placement looped puts on another rank "
                                         r"\(rank 1 holds stages \[1, 3\] of pp=2\)"):
        convert.from_torch_order({0: ["0F0"], 1: ["2F0"]})
    overlap = _Action(0, _ComputationType.OVERLAP_F_B, None, (_Action(0, _ComputationType.FORWARD, 1),))
    with pytest.raises(ValueError, match=r"is OVERLAP_F_B, which has no Action of ours"):
        convert.from_torch_order({0: [overlap]})
    with pytest.raises(ValueError, match=r"the ranks must be 0 \.\. 1, got \[0, 2\]"):
        convert.from_torch_order({0: [], 2: []})
    with pytest.raises(ValueError, match=r"rank 0's 'F0' is not an Action of kind F, B, I, W"):
        convert.to_torch_order([["F0"]])


# ----------------------------------------------------------------------------------------------
# torch's own runtime runs our lists: to_torch_order's IR given to _PipelineScheduleRuntime (in memory,
# and written as the CSV its _load_csv reads), float64 gradients against one process's autograd.

D = 6


def _layers(n):  # the same n stages in every process: Linear then tanh, float64
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(D, D, dtype=torch.float64), torch.nn.Tanh()) for _ in range(n)]


def _data(m):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2 * m, D, generator=g, dtype=torch.float64) for _ in range(2))


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _torch_runs_ours(env, name, pp, v, m, csv_dir):
    import csv
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    mods, ids = _layers(pp * v), [c * pp + env.rank for c in range(v)]
    like = torch.empty(2, D, dtype=torch.float64)  # shapes given: torch's inference sends pickles, which need numpy
    stages = [PipelineStage(mods[s], s, pp * v, torch.device("cpu"), input_args=like if s == 0 else
                            like.clone().requires_grad_(), output_args=like, output_grads=like, input_grads=like)
              for s in ids]
    runtime = _PipelineScheduleRuntime(stages, m, loss_fn=_mse)  # scale_grads: the mean over microbatches
    order = convert.to_torch_order(ours(name, pp, m, v))
    if csv_dir:
        path = f"{csv_dir}/schedule.csv"
        if env.rank == 0:
            with open(path, "w", newline="") as f:
                csv.writer(f).writerows(order[r] for r in range(pp))  # as _dump_csv writes: str(_Action) cells
        torch.distributed.barrier()
        runtime._load_csv(path)
    else:
        runtime._prepare_schedule_with_comms(order)
    x, y = _data(m)
    runtime.step(*([x] if env.rank == 0 else []), target=y)
    return {f"{s}.{n}": p.grad for s in ids for n, p in mods[s].named_parameters()}


@pytest.mark.parametrize("name,pp,v,m,how", [("ScheduleInterleaved1F1B", 2, 2, 4, "csv"), ("ScheduleInterleaved1F1B", 2, 2, 4, "ir"),
                                             ("Schedule1F1B", 3, 1, 3, "ir"), ("ScheduleGPipe", 2, 1, 3, "csv"),
                                             ("ScheduleInterleaved1F1B", 3, 2, 6, "ir")],
                         ids=lambda x: str(x))
def test_torchs_runtime_runs_our_lists_to_the_serial_gradients(run_ranks, tmp_path, name, pp, v, m, how):
    got = {}
    for part in run_ranks(_torch_runs_ours, pp, name, pp, v, m, str(tmp_path) if how == "csv" else None):
        got.update(part)
    mods = _layers(pp * v)
    x, y = _data(m)
    (sum(_mse(torch.nn.Sequential(*mods)(a), b) for a, b in zip(x.chunk(m), y.chunk(m))) / m).backward()
    compare_state(got, {f"{s}.{n}": p.grad for s in range(pp * v) for n, p in mods[s].named_parameters()})


def test_a_planted_mistake_in_the_ir_fails_on_torchs_runtime(run_ranks, monkeypatch):
    # our B written as torch's I (the input's gradient only): torch's runtime refuses the IR, naming it
    monkeypatch.setitem(convert.KINDS_TO_TORCH, "B", "BACKWARD_INPUT")
    with pytest.raises(RankFailure, match=r"stage 0: I and W must have equal counts"):
        test_torchs_runtime_runs_our_lists_to_the_serial_gradients(run_ranks, None, "Schedule1F1B", 2, 1, 2, "ir")


# And the other way: torch's own pipeline_order, read back by from_torch_order, run by 02's executor on
# GPT-2 chunks, gives the serial model's loss and gradients (float64, the kit's defaults).

def _ours_runs_torchs(env, name, v, m):
    import torch.distributed as dist
    from conftest import lesson_reference
    pp = env.world_size
    cfg = dataclasses.replace(PIPELINE_CFG, n_layer=pp * v)
    _, _, full, (ref_loss, ref_grads), micro = lesson_reference(cfg, m)
    lists = convert.from_torch_order(torch_order(name, pp, m, v))
    embed_group = dist.new_group([0, pp - 1]) if pp > 1 else None
    chunks, result = pipeline.pipeline_step(cfg, interleaved.InterleavedSchedule(lists), dist.group.WORLD, embed_group,
                                            full, micro)
    got = {n: p.grad for c in chunks for n, p in c.named_parameters()}
    compare_state(got, {n: ref_grads[n] for n in got})
    if result.loss is not None:
        assert_close(result.loss, ref_loss, name="loss")
    return sorted(got)


@pytest.mark.parametrize("name,pp,v,m", [("ScheduleInterleaved1F1B", 2, 2, 4), ("ScheduleGPipe", 2, 1, 3),
                                         ("ScheduleInterleaved1F1B", 3, 2, 6)], ids=lambda x: str(x))
def test_our_executor_runs_torchs_own_order_to_the_serial_loss_and_gradients(run_ranks, name, pp, v, m):
    held = run_ranks(_ours_runs_torchs, pp, name, v, m)
    every = reference.init_weights(dataclasses.replace(PIPELINE_CFG, n_layer=pp * v))
    assert set().union(*held) == set(every)  # each parameter compared on some rank
