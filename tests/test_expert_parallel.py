"""09: mixture-of-experts layers over expert-parallel ranks, with MoE Parallel Folding.

Tolerances. Float64 throughout; the serial model with experts is the same class with no groups. An
expert-parallel rank runs the same GEMMs on other batches of rows (an expert's rows arrive from every
rank, in another order) and sums the same terms in another order (a bias gradient over its rows, a
token's k weighted outputs, an all-reduce's tree): each result is within a few float64 ulps of the
serial one, 1e-15 relative for one step; TOL = 1e-10 leaves room for AdamW's division by sqrt(v) over
a few steps and is still 10^5 below the smallest real error (a token sent to the wrong expert, a
gradient summed over the wrong ranks, a missing 1/dp). With context parallelism (08's ring under the
fold tp x cp -> ep) attention's softmax is merged block by block (the online-softmax rule) and a loss
is summed per rank before it is divided by the count: again other orders of the same float64 sums,
a few ulps, far below 1e-10, while a wrong scale (the auxiliary loss's gradient not multiplied by cp
as the loss is, its sums not taken over tp x cp) is O(1e-3) relative or more. dispatch . combine
with identity experts is exact: it moves rows and adds x / 2 + x / 2.
"""
import contextlib
import io
import dataclasses
import os
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import TOL, gpt3d, load, run_script, script_output, tensor_parallel
from plumbing import gpt2
from plumbing.launch import gather_rows

moe_mod = load("09_expert_parallel")
cpar = load("08_context_parallel")
planner = load("planner")
F64 = torch.float64
CFG = tensor_parallel.GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=16)


# ----------------------------------------------------------------------------------------------
# The router and the auxiliary loss, serially


def test_the_router_takes_the_top_k_of_the_softmax_and_renormalises_them_as_mixtral():
    x, w = torch.randn(10, 16, dtype=F64), torch.randn(6, 16, dtype=F64)
    probs, weights, chosen = moe_mod.route(x, w, 2)
    assert torch.allclose(probs, torch.softmax(x @ w.T, -1), rtol=0, atol=1e-15)
    assert torch.equal(chosen, probs.argsort(-1, descending=True)[:, :2])
    # Mixtral's renormalised probabilities are Megatron's softmax over the k chosen logits
    assert torch.allclose(weights, torch.softmax((x @ w.T).gather(1, chosen), -1), rtol=0, atol=1e-15)
    assert torch.allclose(weights.sum(-1), torch.ones(10, dtype=F64), rtol=0, atol=1e-15)


def test_the_auxiliary_loss_is_1_at_an_even_load_and_E_when_one_expert_takes_every_token():
    E, N = 4, 8
    even = torch.full((N, E), 1 / E, dtype=F64)
    spread = torch.arange(N)[:, None] % E  # top-1, two tokens per expert
    assert moe_mod.load_balancing_loss(even, spread, None).item() == pytest.approx(1, abs=1e-15)
    one = torch.zeros(N, E, dtype=F64)
    one[:, 2] = 1
    assert moe_mod.load_balancing_loss(one, torch.full((N, 1), 2), None).item() == pytest.approx(E, abs=1e-15)


def test_the_auxiliary_loss_joins_the_backward_inside_the_layer_as_if_it_were_added_to_the_loss():
    moe = moe_mod.MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=0.5)
    full = moe_mod.moe_state_dict(CFG, moe, 3, dtype=F64, random_all=True)
    idx = torch.randint(CFG.vocab_size, (2, 2, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    for inside in (True, False):
        model = moe_mod.with_experts(tensor_parallel.GPT(CFG, init=False, dtype=F64), moe)
        model.load_full_state_dict(full)
        for layer in moe_mod.moe_layers(model):
            layer.aux_scale = 0.5 if inside else 0.0
        loss = model(idx[0], idx[1])[1]
        (loss if inside else loss + 0.5 * sum(layer.aux for layer in moe_mod.moe_layers(model))).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert tensor_parallel.max_rel_diff(grads[0][n], grads[1][n]) <= TOL, n
    router = "transformer.h.0.mlp.router.weight"
    assert grads[0][router].abs().max() > 0  # the aux loss moves the router (checked not to be vacuous)


# ----------------------------------------------------------------------------------------------
# The fold: the experts' grid over attention's ranks


def test_the_fold_puts_ep_across_attentions_tp_and_dp_with_etp_fastest_and_the_same_pipeline():
    grid = moe_mod.fold(gpt3d.rank_grid(8, tp=2, dp=2, pp=2), ep=4)
    assert grid["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and grid["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # one ep group per stage: its tp x dp block
    assert grid["edp"] == [[r] for r in range(8)] and grid["etp"] == [[r] for r in range(8)]
    assert sorted(grid["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    grid = moe_mod.fold(gpt3d.rank_grid(8, tp=4, dp=2), ep=2, etp=2)  # etp fastest, then ep, then edp
    assert grid["etp"][:2] == [[0, 1], [2, 3]] and grid["ep"][:2] == [[0, 2], [1, 3]]
    assert grid["edp"][:2] == [[0, 4], [1, 5]]


def test_a_fold_that_does_not_fit_a_stage_is_refused():
    with pytest.raises(ValueError, match=r"--ep 4 x --etp 1 = 4 does not divide a pipeline stage's tp x dp = 2"):
        moe_mod.fold(gpt3d.rank_grid(4, tp=2, dp=1, pp=2), ep=4)
    with pytest.raises(ValueError, match=r"--ep 4 x --etp 1 = 4 does not divide a pipeline stage's tp x cp x dp = 2"):
        moe_mod.fold(cpar.rank_grid(4, tp=1, cp=2, dp=1, pp=2), ep=4)


def test_the_fold_onto_08s_grid_puts_each_ep_group_on_a_tp_x_cp_block_in_megatrons_order():
    # the world of 8: attention tp 2 x cp 2 x dp 2, experts etp 1 x ep 4 x edp 2 (tp-cp-ep-dp-pp)
    grid = moe_mod.fold(cpar.rank_grid(8, tp=2, cp=2, dp=2), ep=4)
    assert grid["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and grid["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # 08's: dense gradients over dp x cp
    assert grid["tp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]] == grid["ep"]  # a microbatch's tokens, one all-to-all
    assert grid["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # expert gradients over the two dp replicas
    grid = moe_mod.fold(cpar.rank_grid(8, tp=1, cp=2, dp=2, pp=2), ep=2)  # ep over cp, the pipeline shared
    assert grid["ep"] == grid["cp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and grid["tp_cp"] == grid["cp"]
    assert sorted(grid["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]


# ----------------------------------------------------------------------------------------------
# Float64 parity with the serial model: one forward and backward, every rank's loss, auxiliary loss and
# gradients (router, experts, dense), at ep 2 and 4, top-1 and top-2, folded over tp and dp, uneven


def _parity(env, cases):
    out = []
    for name, layout, moe in cases:
        args = SimpleNamespace(**{"tp": 1, "cp": 1, "dp": env.world_size, "ep": 1, "etp": 1,
                                  "sequence_parallel": False, "uneven": False, "ignored": 0, **layout})
        attention = cpar.rank_grid(env.world_size, args.tp, args.cp, args.dp) if args.cp > 1 else \
            gpt3d.rank_grid(env.world_size, args.tp, args.dp)
        groups = gpt3d.new_groups(env, moe_mod.fold(attention, args.ep, args.etp))
        full = moe_mod.moe_state_dict(CFG, moe, 7, dtype=F64, random_all=True)
        if args.uneven:  # every token the same at the layers' input: they all choose the same k experts
            for i in range(CFG.n_layer):
                full[f"transformer.h.{i}.ln_2.weight"] *= 1e-6
                gen = torch.Generator().manual_seed(i)
                full[f"transformer.h.{i}.ln_2.bias"] = torch.randn(CFG.n_embd, dtype=F64, generator=gen)
        gen = torch.Generator().manual_seed(11)
        idx, targets = torch.randint(CFG.vocab_size, (2, 2 * args.dp, 8), generator=gen)
        targets[0, :args.ignored] = -100  # tokens not counted, all on one cp rank's blocks
        diffs, _, _, model = moe_mod.against_serial(env, CFG, moe, args, groups, full, idx, targets)
        counts = [layer.plan.counts for layer in moe_mod.moe_layers(model)]
        out.append((name, max(diffs.values()), sorted(diffs, key=diffs.get)[-1], counts))
    return out


TOP = lambda k, **kw: moe_mod.MoEConfig(num_experts=4, top_k=k, aux_loss_coeff=0.1, **kw)  # noqa: E731
PARITY = {
    2: [("ep 2 over dp 2, top-1", dict(ep=2), TOP(1)),
        ("ep 2 over tp 2, top-2", dict(tp=2, dp=1, ep=2), TOP(2))],
    4: [("ep 4 over dp 4, top-1", dict(ep=4), TOP(1)),
        ("tp 2 x dp 2 -> ep 4, top-2", dict(tp=2, dp=2, ep=4), TOP(2)),
        ("tp 2 x dp 2 -> ep 4 with sequence parallelism, top-1", dict(tp=2, dp=2, ep=4, sequence_parallel=True), TOP(1)),
        ("tp 2 x dp 2 -> ep 2 x edp 2, top-2", dict(tp=2, dp=2, ep=2), TOP(2)),
        ("uneven: every token to the same 2 of 4 experts, ep 4", dict(ep=4, uneven=True), TOP(2)),
        ("uneven, top-1, over tp 2 x dp 2 -> ep 4", dict(tp=2, dp=2, ep=4, uneven=True), TOP(1))],
}


@pytest.mark.parametrize("world", PARITY)
def test_the_expert_parallel_model_equals_serial_in_float64(run_ranks, world):
    for rank in run_ranks(_parity, world, PARITY[world]):
        for (name, worst, what, counts), (_, layout, moe) in zip(rank, PARITY[world]):
            assert worst <= TOL, (name, what, worst)
            if layout.get("uneven"):  # one expert got every token (each layer), another none at all
                for layer in counts:
                    assert max(layer) * moe.top_k == sum(layer) and min(layer) == 0, (name, layer)


FOLDED_CP = [  # 08's context parallelism under the fold: each rank holds T/cp of every sequence (Megatron's split)
    ("tp 2 x cp 2 -> ep 4, top-2", dict(tp=2, cp=2, dp=1, ep=4), TOP(2)),
    ("tp 2 x cp 2 -> ep 4 with sequence parallelism, uncounted targets, top-1",
     dict(tp=2, cp=2, dp=1, ep=4, sequence_parallel=True, ignored=3), TOP(1)),
    ("tp 2 x cp 2 -> ep 2 x edp 2, uncounted targets, top-2", dict(tp=2, cp=2, dp=1, ep=2, ignored=5), TOP(2)),
    ("cp 2 x dp 2 -> ep 4, uneven, top-1", dict(cp=2, dp=2, ep=4, uneven=True), TOP(1)),
    ("tp 2 x cp 2 -> etp 2 x ep 2, top-2", dict(tp=2, cp=2, dp=1, ep=2, etp=2), TOP(2))]


def test_the_fold_of_tp_2_x_cp_2_onto_ep_4_equals_serial_in_float64(run_ranks):
    for rank in run_ranks(_parity, 4, FOLDED_CP):
        for (name, worst, what, counts), (_, layout, moe) in zip(rank, FOLDED_CP):
            assert worst <= TOL, (name, what, worst)
            share = 2 * 8 // (layout.get("tp", 1) * layout["cp"])  # of its replica's 2 sequences of T = 8
            assert all(sum(layer) == share * moe.top_k for layer in counts), (name, counts)  # each routes T/(tp cp)


# ----------------------------------------------------------------------------------------------
# The dispatcher alone: identity experts give the input back exactly, every token counted once


def _identity(env):
    group, E, k = dist.group.WORLD, 8, 2
    N = 5 + 3 * env.rank  # a different number of tokens on every rank
    tokens = torch.arange(N, dtype=F64)[:, None] * 10 + env.rank  # token t of rank r: 10 t + r, in each column
    x = tokens.repeat(1, 4) + torch.arange(4, dtype=F64) / 8
    gen = torch.Generator().manual_seed(env.rank)
    chosen = torch.stack([torch.randperm(E - 2, generator=gen)[:k] for _ in range(N)])  # experts 6, 7: none
    rows, plan = moe_mod.dispatch(x, chosen, E, group)
    back = moe_mod.combine(rows, torch.full((N, k), 0.5, dtype=F64), plan, group)  # x / 2 + x / 2 = x, exactly
    received = sorted(rows[:, 0].tolist())
    sent = torch.tensor([(t * 10 + env.rank) * E + e for t in range(N) for e in chosen[t].tolist()], dtype=F64)
    everyone = torch.cat(gather_rows(sent)).long()  # every rank's (token, expert) pairs
    mine = E // env.world_size * env.rank, E // env.world_size * (env.rank + 1)
    expected = sorted(float(p // E) for p in everyone.tolist() if mine[0] <= p % E < mine[1])
    return torch.equal(back, x), received == expected, sum(plan.recv), len(expected)


def test_dispatch_then_combine_with_identity_experts_returns_the_input_exactly_and_counts_every_token_once(run_ranks):
    for exact, once, got, want in run_ranks(_identity, 4):
        assert exact and once and got == want


# ----------------------------------------------------------------------------------------------
# After the concept: a capacity factor, and experts tensor-parallel over etp ranks


CAPACITY = [("capacity 0.5 (pairs dropped), tp 2 x dp 2 -> ep 4", dict(tp=2, dp=2, ep=4), TOP(2, capacity_factor=0.5)),
            ("capacity 1.0, sequence parallel, ep 4", dict(tp=2, dp=2, ep=4, sequence_parallel=True),
             TOP(1, capacity_factor=1.0)),
            ("capacity 4 (none dropped), dp 4 -> ep 2", dict(ep=2), TOP(2, capacity_factor=4.0)),
            ("etp 2 x ep 2 over tp 2 x dp 2, top-2", dict(tp=2, dp=2, ep=2, etp=2), TOP(2)),
            ("etp 2 x edp 2, sequence parallel", dict(tp=2, dp=2, ep=1, etp=2, sequence_parallel=True), TOP(1)),
            ("etp 2 with capacity 0.5", dict(tp=2, dp=2, ep=2, etp=2), TOP(2, capacity_factor=0.5))]


def test_capacity_and_etp_equal_a_serial_model_under_the_same_rule(run_ranks):
    for rank in run_ranks(_parity, 4, CAPACITY):
        for name, worst, what, counts in rank:
            assert worst <= TOL, (name, what, worst)
            if name.startswith("capacity 0.5"):  # a rank's 8 tokens x 2: capacity ceil(0.5 x 8 x 2 / 4) = 2 each
                assert all(sum(layer) <= 8 for layer in counts), counts  # of its 16 pairs, at most 8 kept
            if name.startswith("capacity 4"):  # 16 tokens x 2, capacity 16 each: nothing dropped
                assert all(sum(layer) == 32 for layer in counts), counts


def test_the_capacity_keeps_each_experts_first_pairs_in_token_order_per_group():
    chosen = torch.tensor([[0], [0], [1], [0], [0], [0]])  # two groups of 3 tokens (T = 3, 1 sequence... of 6)
    slots, cap = moe_mod.kept_slots(chosen, 2, 1.0, torch.tensor([0, 0, 0, 1, 1, 1]), 2)
    assert cap == 2  # ceil(1.0 x 3 x 1 / 2)
    # (expert, group, place) -> (e G + g) cap + place: expert 0 group 0 places 0, 1; expert 1 group 0 place 0 ->
    # slot (1 x 2 + 0) x 2 = 4; expert 0 group 1: places 0, 1 (slots 2, 3), its third pair dropped
    assert slots.tolist() == [0, 1, 4, 2, 3, -1]


# ----------------------------------------------------------------------------------------------
# The trainer: 05's loop with experts, several AdamW steps against the same model at ep = 1


TRAIN_CFG = tensor_parallel.GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=16)
BASE = moe_mod.TrainConfig(tp=1, pp=1, dp=1, batch_size=8, microbatches=2, seq_len=16, steps=3, lr=1e-2, min_lr=1e-3,
                           warmup_steps=1, grad_clip=0.5, dtype="float64", eval_every=0, bucket_numel=500,
                           timeout_s=30, num_experts=4, top_k=2, moe_every=2, aux_loss_coeff=0.1)


def _train(env, layouts):
    out = []
    for layout in layouts:
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            run = moe_mod.train(env, TRAIN_CFG, replace(BASE, **layout), quiet=True)
        out.append((run["losses"], run["norms"]))
    return out


# (layout on 4 ranks, the serial run's microbatches: a replica's m microbatches are m of the serial run's dp m)
TRAINED = [(dict(tp=2, pp=2, ep=2), 2),  # ep over attention's tp, 1F1B
           (dict(pp=2, dp=2, ep=2, zero1=True), 4),  # ep over dp, ZeRO-1 over dp (dense) and edp = 1 (experts)
           (dict(tp=2, dp=2, ep=4, sequence_parallel=True, recompute="full"), 4),  # the fold
           (dict(pp=2, dp=2, ep=1, zero1=True, schedule="zb-h1"), 4),  # experts over edp = 2, ZB-H1's split
           (dict(tp=2, pp=2, ep=1, etp=2, virtual_stages=2), 2)]  # etp 2 over tp, interleaved 1F1B


def test_the_trainer_with_experts_equals_the_same_model_at_ep_1_over_several_adamw_steps(run_ranks):
    runs = run_ranks(_train, 4, [layout for layout, _ in TRAINED])[0]
    serial = run_ranks(_train, 1, [dict(microbatches=m) for m in sorted({m for _, m in TRAINED})])[0]
    ref = dict(zip(sorted({m for _, m in TRAINED}), serial))
    for (layout, m), (losses, norms) in zip(TRAINED, runs):
        assert len(losses) == 3 and losses[-1] < losses[0]
        want = torch.tensor(ref[m][0] + ref[m][1])
        assert tensor_parallel.max_rel_diff(torch.tensor(losses + norms), want) <= TOL, (layout, losses, ref[m])


# (layout on 4 ranks with 08's context parallelism: each rank T/cp of every sequence; the serial run's microbatches)
TRAINED_CP = [(dict(tp=2, cp=2, ep=4), 2),  # the fold tp 2 x cp 2 -> ep 4: a microbatch's tokens in one all-to-all
              (dict(cp=2, pp=2, ep=2, recompute="lightseq"), 2),  # ep over cp, 1F1B, LightSeq's kept attention
              (dict(cp=2, dp=2, ep=4, zero1=True, cp_attention="ulysses"), 4)]  # ZeRO-1 over dp x cp and edp = 1


@pytest.mark.full_grid(covered_by=["test_the_trainer_with_experts_equals_the_same_model_at_ep_1_over_several_adamw_steps",
                                   "test_the_fold_of_tp_2_x_cp_2_onto_ep_4_equals_serial_in_float64"],
                       why="9 s: the trainer with experts, and experts folded over cp, are each held by a faster test")
def test_the_trainer_with_experts_and_cp_equals_the_same_model_at_ep_1_over_several_adamw_steps(run_ranks):
    runs = run_ranks(_train, 4, [layout for layout, _ in TRAINED_CP])[0]
    ms = sorted({m for _, m in TRAINED_CP})
    ref = dict(zip(ms, run_ranks(_train, 1, [dict(microbatches=m) for m in ms])[0]))
    for (layout, m), (losses, norms) in zip(TRAINED_CP, runs):
        assert len(losses) == 3 and losses[-1] < losses[0]
        want = torch.tensor(ref[m][0] + ref[m][1])
        assert tensor_parallel.max_rel_diff(torch.tensor(losses + norms), want) <= TOL, (layout, losses, ref[m])


# ----------------------------------------------------------------------------------------------
# Checkpoints: experts redistributed across ep (and etp), AdamW's state kept


def _resharded(env, root):
    quiet = lambda **kw: moe_mod.train(env, TRAIN_CFG, replace(BASE, tp=2, dp=2, microbatches=1, **kw),  # noqa: E731
                                       quiet=True)["losses"]
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        whole = quiet(ep=4, steps=4)
        quiet(ep=4, steps=2, save=f"{root}/a")
        again = quiet(ep=4, steps=4, resume=f"{root}/a")  # the same layout: continued bit for bit
        middle = quiet(ep=2, steps=4, resume=f"{root}/a/step_00000002", save=f"{root}/b", save_every=1,
                       zero1=True)  # ep 4 -> 2, and AdamW's state in ZeRO-1 shards: dense over dp, experts over edp
        chain = quiet(ep=1, etp=2, steps=4, resume=f"{root}/b/step_00000003")  # -> ep 1, each expert over etp 2
    return whole, again, middle[:1] + chain


def _one_rank(env, root):
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        return moe_mod.train(env, TRAIN_CFG, replace(BASE, microbatches=2, steps=4, resume=root), quiet=True)["losses"]


def test_a_checkpoint_reshards_from_ep_4_to_2_to_1_and_continues_bit_for_bit_in_its_own_layout(run_ranks, tmp_path):
    whole, again, chain = run_ranks(_resharded, 4, str(tmp_path))[0]
    assert again == whole[2:]  # exactly: the same layout reads its own shards, streams included
    assert len(chain) == 2 and tensor_parallel.max_rel_diff(torch.tensor(chain), torch.tensor(whole[2:])) <= TOL
    manifest = (tmp_path / "b" / "step_00000003" / "manifest.json").read_text()
    assert '"ep": 2' in manifest and '"name": "experts"' in manifest
    resumed = run_ranks(_one_rank, 1, str(tmp_path / "a"))[0]  # 4 ranks' experts onto one: ep 1, world 1
    assert tensor_parallel.max_rel_diff(torch.tensor(resumed), torch.tensor(whole[2:])) <= TOL


def _resharded_cp(env, root):
    quiet = lambda **kw: moe_mod.train(env, TRAIN_CFG, replace(BASE, **kw), quiet=True)["losses"]  # noqa: E731
    folded = dict(tp=2, cp=2, ep=4)  # the fold tp 2 x cp 2 -> ep 4, m = 2
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        whole = quiet(steps=4, **folded)
        quiet(steps=2, save=f"{root}/a", **folded)
        again = quiet(steps=4, resume=f"{root}/a", **folded)  # the same layout: continued bit for bit
        across = quiet(steps=4, resume=f"{root}/a", tp=2, dp=2, ep=2, microbatches=1)  # cp 2 -> 1, ep 4 -> 2
    return whole, again, across


@pytest.mark.full_grid(covered_by=["test_a_checkpoint_reshards_from_ep_4_to_2_to_1_and_continues_bit_for_bit_in_its_own_layout",
                                   "test_a_checkpoint_crosses_cp_2_to_1_and_back_and_continues_bit_identically_in_its_own_layout",
                                   "test_the_fold_of_tp_2_x_cp_2_onto_ep_4_equals_serial_in_float64"],
                       why="13 s: experts' resharding, cp's resharding and the fold itself are each held by a faster test")
def test_a_checkpoint_of_the_tp_x_cp_fold_continues_bit_for_bit_and_reshards_to_cp_1(run_ranks, tmp_path):
    whole, again, across = run_ranks(_resharded_cp, 4, str(tmp_path))[0]
    assert again == whole[2:]  # exactly
    assert len(across) == 2 and tensor_parallel.max_rel_diff(torch.tensor(across), torch.tensor(whole[2:])) <= TOL
    manifest = (tmp_path / "a" / "step_00000002" / "manifest.json").read_text()
    assert '"cp": 2' in manifest and '"ep": 4' in manifest


# ----------------------------------------------------------------------------------------------
# Upcycling a dense GPT-2, and what a model with experts refuses


def _upcycled(env, path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        dense = gpt3d.train(env, TRAIN_CFG, replace(gpt3d.TrainConfig(**{f.name: getattr(BASE, f.name) for f in
                                                                        dataclasses.fields(gpt3d.TrainConfig)}),
                                                    steps=1, init_from=path), quiet=True)["losses"]
        ours = moe_mod.train(env, TRAIN_CFG, replace(BASE, steps=1, init_from=path), quiet=True)["losses"]
    return dense, ours, out.getvalue()


def test_an_upcycled_model_starts_as_the_dense_gpt2_it_came_from_and_says_so(run_ranks, tmp_path):
    path = str(tmp_path / "dense.pt")
    full = tensor_parallel.init_state_dict(TRAIN_CFG, 3, dtype=F64, random_all=True)
    gpt2.export_state_dict(TRAIN_CFG, full, "bytes", path)
    dense, ours, said = run_ranks(_upcycled, 1, path)[0]
    # every expert is the layer's MLP and the k weights sum to 1: the same function, to rounding
    assert abs(ours[0] - dense[0]) / dense[0] <= TOL and ours[0] != 0
    assert re.search(r"upcycling: each of the 4 experts of layers \[0, 2\] starts as .*dense.pt's MLP", said), said


def _saved(env, root):
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        moe_mod.train(env, TRAIN_CFG, replace(BASE, steps=1, save=root), quiet=True)


BAD = {  # the trainer's flags and the demo's, each refused in a sentence before anything starts
    "E not divisible by ep": (["--train", "--num-experts", "6", "--ep", "4"], "--num-experts 6 is not divisible by --ep 4"),
    "top-k above E": (["--train", "--num-experts", "4", "--top-k", "5"], "--top-k 5: each token goes to between 1 and"),
    "top-k 0": (["--top-k", "0"], "--top-k 0: each token goes to between 1 and"),
    "ep x etp not dividing a stage": (["--train", "--ep", "2", "--etp", "4", "--num-experts", "4"],
                                      "--ep 2 x --etp 4 = 8 does not divide tp x dp = 2 x 2"),
    "a demo fold that does not fit": (["--ep", "3", "--num-experts", "6"], "--ep 3 x --etp 1 = 3 does not divide"),
    "capacity 0": (["--train", "--capacity-factor", "0"], "--capacity-factor must be positive, got 0.0"),
    "capacity below 0": (["--capacity-factor", "-1"], "--capacity-factor must be positive, got -1.0"),
    "sampling": (["--train", "--sample", "hi", "--resume", "x"], "--sample reads the weights into 01's serial GPT-2"),
    "a GPT-2 export": (["--train", "--export-hf", "out", "--resume", "x"], "--export-hf writes a Hugging Face GPT-2, "
                                                                           "and GPT-2 has no experts"),
    "the dense planner": (["--train", "--plan", "1T"], "--plan estimates 05's dense GPT-2"),
    "CUDA graphs": (["--train", "--tp", "1", "--pp", "1", "--dp", "1", "--cuda-graphs"], "--cuda-graphs: the dispatcher"),
    "a flag the layout ignores": (["--train", "--print-layout", "--steps", "3"], "--print-layout does not use --steps"),
    # with 08's context parallelism
    "ep x etp not dividing tp x cp x dp": (["--train", "--tp", "1", "--cp", "2", "--dp", "1", "--ep", "4",
                                            "--num-experts", "4"], "--ep 4 x --etp 1 = 4 does not divide tp x cp x dp = "
                                                                   "1 x 2 x 1"),
    "zero bubble with cp": (["--train", "--tp", "1", "--cp", "2", "--dp", "1", "--schedule", "zb-h1"],
                            "--schedule zb-h1 with --cp 2: 08's ring runs in 05's 1F1B and interleaved 1F1B"),
    "zero bubble with lightseq": (["--train", "--tp", "1", "--dp", "1", "--recompute", "lightseq", "--schedule", "zb-v"],
                                  "--schedule zb-v with --recompute lightseq"),
    "a seq-len the tp x cp ranks cannot route": (["--train", "--cp", "2", "--dp", "1", "--cp-schedule", "contiguous",
                                                  "--seq-len", "34"], "--seq-len 34 is not divisible by tp=2 x cp=2"),
    "a demo seq-len that Megatron's split cannot cut": (["--tp", "1", "--cp", "2", "--seq-len", "30"],
                                                        "--seq-len 30: --cp 2 cuts each sequence into Megatron's 2 cp"),
    "a demo capacity with cp": (["--cp", "2", "--dp", "1", "--capacity-factor", "1"],
                                "--capacity-factor 1 with --cp 2: the demo's serial reference drops"),
    "a demo dropout with cp": (["--cp", "2", "--dp", "1", "--dropout", "0.1"], "--dropout 0.1 with --cp 2"),
    "08's training flag to the demo": (["--cp-schedule", "lightseq"], "--cp-schedule is a flag of training, not of "
                                                                      "the demo"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_refused_by_name_before_anything_starts(case):
    args, message = BAD[case]
    proc = run_script("09_expert_parallel.py", *args, timeout=30)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_05_refuses_a_checkpoint_with_experts_by_name(run_ranks, tmp_path):
    run_ranks(_saved, 1, str(tmp_path / "moe"))
    model = ["--n-layer", 4, "--n-head", 2, "--n-embd", 16, "--block-size", 16, "--seq-len", 16, "--batch-size", 8]
    for args, message in ((["--resume", tmp_path / "moe", "--tp", "1", "--pp", "1", "--dp", "1", *model],
                           "was written with a GPT-2 with experts (num_experts=4, moe_every=2) (this run 01's GPT-2)"),
                          (["--resume", tmp_path / "moe", "--export-hf", tmp_path / "hf"],
                           "--export-hf: the checkpoint"),
                          (["--resume", tmp_path / "moe", "--sample", "hi"],
                           "holds a GPT-2 with experts (num_experts=4, moe_every=2), and 01's GPT-2 has no experts")):
        proc = run_script("05_3d_gpt.py", *args, timeout=60)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("args", [["--help"], ["--train", "--help"]], ids=["demo", "train"])
def test_help_lists_the_experts_flags(args):
    proc = run_script("09_expert_parallel.py", *args, timeout=30)
    assert proc.returncode == 0 and "--num-experts" in proc.stdout and "--capacity-factor" in proc.stdout, proc.stderr


def test_print_layout_draws_both_grids_and_the_fold():
    proc = run_script("09_expert_parallel.py", "--train", "--print-layout", "--tp", 2, "--dp", 2, "--pp", 2, "--ep", 4,
                      "--num-experts", 8, timeout=30)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "ep groups:  [[0, 1, 2, 3], [4, 5, 6, 7]]" in out and "dp groups:  [[0, 2], [1, 3], [4, 6], [5, 7]]" in out
    assert "an ep group spans 2 tp group(s) and 2 dp replica(s)" in out and "active per token" in out


def test_print_layout_draws_08s_grid_and_the_fold_of_tp_x_cp_onto_ep():
    proc = run_script("09_expert_parallel.py", "--train", "--print-layout", "--tp", 2, "--cp", 2, "--dp", 2, "--pp", 2,
                      "--ep", 4, "--num-experts", 8, timeout=30)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "attention: tp 2 x cp 2 x dp 2 x pp 2 (08's grid" in out and "experts:   etp 1 x ep 4 x edp 2 x pp 2" in out
    assert "tp x cp groups: [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]" in out
    assert "ep groups:      [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]" in out
    assert "dp x cp groups: [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]" in out
    assert "spans 2 tp group(s), 2 cp rank(s) of each sequence and 1 dp replica(s) of attention (each ep group is " \
           "one tp x cp block); expert gradients are summed over edp, dense ones over dp x cp" in out


# ----------------------------------------------------------------------------------------------
# The demo


def test_the_demo_passes_and_prints_the_grids_the_routing_the_bytes_and_the_auxiliary_loss():
    proc = script_output("09_expert_parallel.py", timeout=120)  # test_docs' run too, made once
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.rstrip().endswith("tolerance 1e-10)") and "\nPASS: worst relative difference" in out
    assert "the fold: an ep group spans 2 tp group(s) and 2 dp replica(s)" in out
    assert re.search(r"rank +e0 +e1 .* received", out) and "auxiliary loss" in out
    measured, formula = (float(x.replace(",", "")) for x in re.search(
        r"every rank and MoE layer: ([\d,]+) measured, ([\d,]+) by the planner", out).groups())
    assert 0.5 < measured / formula < 1.5  # the router's own routing, near the uniform one's figure


# ----------------------------------------------------------------------------------------------
# The planner's figures for a model with experts


def test_the_planner_counts_the_model_with_experts_exactly_and_its_flops_reduce_to_eq_3():
    spec = planner.ModelSpec(4, 16, 2, 97, 16)
    for E, k, every in ((4, 2, 2), (8, 1, 1), (1, 1, 1)):
        e = planner.MoESpec(E, k, every)
        model = moe_mod.with_experts(tensor_parallel.GPT(replace(CFG, n_layer=4), device="meta"),
                                     moe_mod.MoEConfig(num_experts=E, top_k=k, moe_every=every))
        total, active = planner.moe_params(spec, e)
        assert total == sum(p.numel() for p in model.parameters())
        per_expert = 8 * 16 * 16 + 5 * 16  # a GPT-2 MLP: c_fc (4C, C) + 4C, c_proj (C, 4C) + C
        assert total - active == len(range(0, 4, every)) * (E - k) * per_expert
    one = planner.MoESpec(1, 1, 10**9)  # layer 0 alone has experts, one of them: the dense MLP and a router
    paper = planner.ModelSpec(24, 2304, 24, 51200, 2048)
    assert planner.moe_flops_per_token(paper, one) == pytest.approx(  # eq. 3 without recomputation, per token,
        planner.flops_per_iteration(paper, 1, "none") / paper.seq_len + 3 * 2 * 2304, rel=1e-12)  # + the router


def test_the_planner_puts_fewer_experts_on_each_rank_as_ep_grows():
    m, e = planner.ModelSpec(24, 2048, 16, 51200, 2048), planner.MoESpec(64, 8, 1)
    L = planner.Layout(2, 4, 8, 512, b=1)
    mem = [planner.moe_memory_per_rank(m, e, L, ep) for ep in (1, 2, 4, 8, 16)]
    assert mem == sorted(mem, reverse=True) and mem[0] / mem[-1] > 4
    assert planner.moe_alltoall_bytes(1024, 2, 1, 256) == 0  # ep = 1: nothing leaves the rank
    assert planner.moe_alltoall_bytes(1024, 2, 4, 256, elt=4) == 4 * 1024 * 2 * 3 / 4 * 256 * 4
