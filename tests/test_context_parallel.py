"""08_context_parallel: the sequence split over cp ranks, ring attention, the schedules as data.

Tolerances, and why:
  - The blocks against softmax attention, one process, float64: 1e-12 relative. The online-softmax
    merge sums exp(s - m) v in another order and rescales each block once more (one rounding,
    ~1e-16 each); a lost rescaling or a block masked wrongly is off at O(1).
  - Against the serial model, float64: max|a - b| / max|b| <= 1e-10 on the loss, the logits and every
    gradient (TOL, as test_tensor_parallel.py). The attention of a row is summed over cp blocks in
    another order, each rescaled to the running max; measured ~1e-15. A token at the wrong position,
    a key block missed or counted twice, a loss divided by the wrong count is off at O(1/T) or more.
  - Schedules and their simulated work: exact (Fractions and lists).
"""
import contextlib
import dataclasses
import importlib
import json
import math
import os
import re
from dataclasses import replace
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import ROOT, TOL, TRAINER_BASE, TRAINER_CFG, load, run_script, script_output, trainer_grad_diffs

tensor_parallel = load("01_tensor_parallel")
pipeline = load("02_pipeline_1f1b")
gpt3d = load("05_3d_gpt")
cpar = importlib.import_module("08_context_parallel")
Block = cpar.Block
CFG = tensor_parallel.GPTConfig(vocab_size=97, block_size=48, n_layer=2, n_head=2, n_embd=16)


# ----------------------------------------------------------------------------------------------
# The schedules as data


@pytest.mark.parametrize("cp", range(1, 9))
def test_every_schedule_validates_and_computes_each_causal_block_once(cp):
    for name, make in cpar.SPLITS.items():
        sched = make(cp)
        cpar.validate(sched)
        blocks = [b for steps in sched.steps for blocks in steps for b in blocks]
        assert sorted(blocks, key=lambda b: (b.q, b.kv)) == [Block(i, j) for i in range(sched.n) for j in range(i + 1)]


@pytest.mark.parametrize("cp", range(2, 9))
def test_the_balance_factors_are_2_minus_1_over_cp_then_1_then_lightseqs(cp):
    ours = {name: cpar.simulate(make(cp)) for name, make in cpar.SPLITS.items()}
    assert ours["contiguous"].factor == 2 - Fraction(1, cp)  # 1.50, 1.75 and 1.875 at cp = 2, 4, 8
    assert ours["megatron"].factor == 1 and ours["megatron"].time == ours["megatron"].ideal == Fraction(cp, 2)
    # LightSeq: every rank busy at every step of cp // 2 + 1; with even cp the last step is the
    # owners' blocks at distance cp / 2, which half the ranks hold: 1 + 1/cp; with odd cp, even.
    assert ours["lightseq"].factor == (1 + Fraction(1, cp) if cp % 2 == 0 else 1)
    assert len(ours["lightseq"].work[0]) == cp // 2 + 1 < len(ours["contiguous"].work[0]) or cp == 2
    assert ours["lightseq"].time == Fraction(1, 2) + cp // 2
    for b in ours.values():  # the same attention, however it is spread
        assert sum(b.totals) == Fraction(cp * cp, 2)


def test_megatrons_split_gives_rank_i_chunks_i_and_2cp_minus_1_minus_i_and_half_a_block_every_step():
    sched = cpar.megatron(4)
    assert sched.split == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert cpar.positions(sched, 1, 16).tolist() == [2, 3, 12, 13]
    assert all(x == Fraction(1, 2) for row in cpar.simulate(sched).work for x in row)



def test_a_step_talks_only_to_its_visitor_and_results_go_home_one_exchange_later():
    for cp in (2, 3, 4, 5, 8):
        for name, make in cpar.SPLITS.items():
            sched = make(cp)
            for backward in (False, True):
                for s in range(len(sched.steps[0]) + 1):
                    for src, dst, kind, b in cpar.messages(sched, s, backward):
                        assert sched.owner[b] == (src if kind in ("kv", "q") else dst)
                        if kind in ("kv", "q"):  # borrowed at step s from the visitor
                            assert src == (dst - s) % cp
                        else:  # computed at step s - 1 for the visitor of that step
                            assert dst == (src - (s - 1)) % cp
                            assert kind in (("dq", "dkv") if backward else ("out",))


def test_lightseqs_helpers_borrow_queries_and_send_partial_results_home():
    sched = cpar.lightseq(4)
    # step 1: rank 0 has nothing of its own left (block (0, 0) was step 0's); it computes (3, 0) for rank 3
    assert sched.steps[0][1] == [Block(3, 0)]
    assert (3, 0, "q", 3) in cpar.messages(sched, 1) and (0, 3, "out", 3) in cpar.messages(sched, 2)
    assert (0, 3, "dq", 3) in cpar.messages(sched, 2, backward=True)
    assert all(kind != "q" for *_, kind, _ in sum((cpar.messages(cpar.contiguous(4), s) for s in range(5)), []))


BROKEN = {
    "a block above the diagonal": (cpar.RingSchedule("x", [[0], [1]], [[[Block(0, 0), Block(0, 1)], []],
                                                                       [[Block(1, 1)], [Block(1, 0)]]]), "not causal"),
    "a block computed twice": (cpar.RingSchedule("x", [[0], [1]], [[[Block(0, 0)], []],
                                                                   [[Block(1, 1)], [Block(1, 0), Block(1, 0)]]]),
                               "computed 2 times"),
    "a block never computed": (cpar.RingSchedule("x", [[0], [1]], [[[Block(0, 0)], []], [[Block(1, 1)], []]]),
                               r"Block\(q=1, kv=0\) is never computed"),
    "a block of a rank it does not meet": (cpar.RingSchedule("x", [[0], [1], [2]], [
        [[Block(0, 0)], [], []], [[Block(1, 1)], [Block(1, 0)], []], [[Block(2, 2)], [Block(2, 0)], [Block(2, 1)]]]),
        "at step 1 it meets rank 1"),
    "a block of two other ranks": (cpar.RingSchedule("x", [[0], [1], [2]], [
        [[Block(0, 0)], [], [Block(2, 1)]], [[Block(1, 1)], [Block(1, 0)], []], [[Block(2, 2)], [], [Block(2, 0)]]]),
        "needs ranks"),
    "ranks with different numbers of steps": (cpar.RingSchedule("x", [[0], [1]], [[[Block(0, 0)]],
                                                                                  [[Block(1, 1)], [Block(1, 0)]]]),
                                              "as many ring steps"),
    "a split of unequal shares": (cpar.RingSchedule("x", [[0, 2], [1]], [[[Block(0, 0), Block(2, 2), Block(2, 0)], []],
                                                                         [[Block(1, 1)], [Block(1, 0), Block(2, 1)]]]),
                                  "as many of the 3 blocks"),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_the_validator_refuses_a_schedule_that_is_not_causal_attention_once_on_a_ring(case):
    sched, message = BROKEN[case]
    with pytest.raises(pipeline.ScheduleError, match=message):
        cpar.validate(sched)


# ----------------------------------------------------------------------------------------------
# The blocks: FlashAttention-2's recurrences against softmax attention, one process


def _qkv(seed, B=2, nh=3, T=12, hs=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def test_blocks_merged_in_any_order_are_causal_softmax_attention_forward_and_backward():
    q, k, v = _qkv(0)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    do = torch.randn_like(ref)
    ref.backward(do)
    c, scale = 4, 1 / math.sqrt(4)
    rows = [slice(i * c, (i + 1) * c) for i in range(3)]
    with torch.no_grad():
        for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
            outs, lses = [], []
            for i in range(3):
                st = None
                for j in order:
                    if j <= i:
                        st = cpar.merge(st, cpar.block_forward(q[:, :, rows[i]], k[:, :, rows[j]], v[:, :, rows[j]],
                                                               i == j, scale))
                o, lse = cpar.finish(st)
                outs.append(o)
                lses.append(lse)
            o, lse = torch.cat(outs, 2), torch.cat(lses, 2)
            assert tensor_parallel.max_rel_diff(o, ref) <= 1e-12
        D = (do * o).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i in range(3):
            for j in range(i + 1):
                gq, gk, gv = cpar.block_backward(q[:, :, rows[i]], k[:, :, rows[j]], v[:, :, rows[j]], do[:, :, rows[i]],
                                                 lse[:, :, rows[i]], D[:, :, rows[i]], i == j, scale)
                dq[:, :, rows[i]] += gq
                dk[:, :, rows[j]] += gk
                dv[:, :, rows[j]] += gv
    for mine, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert tensor_parallel.max_rel_diff(mine, theirs) <= 1e-12


# ----------------------------------------------------------------------------------------------
# Against the serial model: every split at cp = 2, 3 and 4, float64


def _parity(env, T):
    full = tensor_parallel.init_state_dict(CFG, 5, dtype=torch.float64, random_all=True)
    gen = torch.Generator().manual_seed(7)
    idx, targets = torch.randint(CFG.vocab_size, (2, 3, T), generator=gen)
    targets[0, : T // 2 + 1] = -100  # uncounted tokens, all on the first ranks: uneven counts
    targets[2, -1] = -100
    serial = tensor_parallel.GPT(CFG, None, init=False, dtype=torch.float64)
    serial.load_full_state_dict(full)
    ref_logits, ref_loss = serial(idx, targets)
    ref_loss.backward()
    out = {}
    for name, make in cpar.SPLITS.items():
        sched = make(env.world_size)
        model = cpar.context_parallel(tensor_parallel.GPT(CFG, None, init=False, dtype=torch.float64), sched,
                                      dist.group.WORLD)
        model.load_full_state_dict(full)
        logits, loss = cpar.step(model, idx, targets, dist.group.WORLD, dist.group.WORLD)
        diffs = {"loss": tensor_parallel.max_rel_diff(loss, ref_loss.detach()),
                 "logits": tensor_parallel.max_rel_diff(cpar.gather_sequence(logits.detach(), sched, dist.group.WORLD),
                                                        ref_logits.detach())}
        diffs.update({n: tensor_parallel.max_rel_diff(p.grad, serial.get_parameter(n).grad)
                      for n, p in model.named_parameters()})
        out[name] = diffs
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_every_split_equals_serial_loss_logits_and_every_gradient(run_ranks, cp):
    T = 2 * cp * 4  # 4 tokens a block of Megatron's split
    for rank in run_ranks(_parity, cp, T):
        for name, diffs in rank.items():
            assert len(diffs) == 2 + len(list(tensor_parallel.GPT(CFG, device="meta").parameters()))
            bad = {k: d for k, d in diffs.items() if not d <= TOL}
            assert not bad, (name, cp, bad)


# ----------------------------------------------------------------------------------------------
# Composed with 05's trainer: tp (with and without sp), pp (1F1B, interleaved), dp, ZeRO-1, the
# attention cores and the recomputations; one step's loss and every gradient against serial


def _cp(**kw):
    m = kw.pop("m", 2)
    return cpar.TrainConfig(**{**dataclasses.asdict(replace(TRAINER_BASE, microbatches=m)), "cp": 2, **kw})


def _batch():
    gen = torch.Generator().manual_seed(11)
    idx, targets = torch.randint(TRAINER_CFG.vocab_size, (2, TRAINER_BASE.batch_size, TRAINER_BASE.seq_len),
                                 generator=gen)
    targets[:, :5] = -100  # every replica the same count (05's mean over replicas), the cp ranks not
    return idx, targets


def _step_grads(env, cases):
    idx, targets = _batch()
    full = tensor_parallel.init_state_dict(TRAINER_CFG, TRAINER_BASE.seed, dtype=torch.float64)
    serial = tensor_parallel.GPT(TRAINER_CFG, init=False, dtype=torch.float64)
    serial.load_full_state_dict(full)
    ref_loss = serial(idx, targets)[1]
    ref_loss.backward()
    ref = {n: p.grad for n, p in serial.named_parameters()}
    out = []
    for tc in cases:
        pipe = cpar.context_schedule(tc)
        groups = gpt3d.new_groups(env, pipe.grid(env.world_size, tc.tp, tc.dp))
        run = gpt3d.build(env, TRAINER_CFG, tc, groups, pipe)
        rows = idx.chunk(tc.dp)[pipe.replica(groups)], targets.chunk(tc.dp)[pipe.replica(groups)]
        res = gpt3d.forward_backward(run, pipeline.split_batch(*rows, tc.microbatches), None)
        pipeline.sync_tied_embeddings(run.chunks, groups.embed, grad_of=run.ddp.main_grad)
        run.ddp.finish()
        diffs = {"loss": tensor_parallel.max_rel_diff(torch.tensor(gpt3d.shared_loss(res.loss, run), dtype=torch.float64),
                                                     ref_loss.detach())}
        diffs.update(trainer_grad_diffs(run, ref, tc.zero1))
        out.append(diffs)
    return out


COMPOSED = [  # world 4, cp = 2 unless said
    _cp(tp=2), _cp(tp=2, sequence_parallel=True, cp_schedule="lightseq"), _cp(pp=2, cp_schedule="contiguous"), _cp(pp=2, virtual_stages=2, m=2), _cp(dp=2), _cp(dp=2, zero1=True),
    _cp(cp=4, cp_schedule="lightseq"), _cp(cp=4, cp_schedule="contiguous", m=1),
    _cp(dp=2, cp_attention="ulysses"), _cp(pp=2, recompute="full"), _cp(tp=2, recompute="selective"),
    _cp(dp=2, recompute="lightseq"), _cp(pp=2, recompute="lightseq", cp_schedule="lightseq"),
    _cp(tp=2, fused_kernels=True, kernel_path="reference"),  # kernels/' fused block calls 08's attention core
]


def test_composed_with_tp_sp_pp_interleaving_dp_zero1_and_each_recompute_one_step_equals_serial(run_ranks):
    for rank in run_ranks(_step_grads, 4, COMPOSED):
        for tc, diffs in zip(COMPOSED, rank):
            bad = {k: d for k, d in diffs.items() if not d <= TOL}
            assert not bad and len(diffs) > 1, (tc.tp, tc.pp, tc.dp, tc.cp, tc.cp_schedule, tc.recompute, bad)


def _trains(env, tcs, train):
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        return [train(env, TRAINER_CFG, tc, quiet=True) for tc in tcs]


def test_the_trainer_at_cp_2_and_4_follows_05_at_cp_1_over_adamw_steps(run_ranks):
    # float64: the same additions in another order each step; AdamW and the active clipping carry
    # them: ~1e-13 after 4 steps. A wrong share of the loss or gradients summed over cp without the
    # loss's factor cp is off at O(1) from the first step.
    base = replace(TRAINER_BASE, steps=4)
    ref = run_ranks(_trains, 1, [base], gpt3d.train)[0][0]
    ours = run_ranks(_trains, 4, [_cp(steps=4, dp=2, zero1=True), _cp(steps=4, cp=4, cp_schedule="lightseq"),
                                  _cp(steps=4, pp=2, virtual_stages=2, tp=1)], cpar.train)[0]
    assert max(ref["norms"]) > base.grad_clip  # the clipping acts: the norm matters
    for out in ours:
        for key in ("losses", "norms"):
            assert tensor_parallel.max_rel_diff(torch.tensor(out[key], dtype=torch.float64),
                                              torch.tensor(ref[key], dtype=torch.float64)) <= 1e-9, key


# ----------------------------------------------------------------------------------------------
# Checkpoints: cp changes no weight; a checkpoint crosses cp = 2 <-> 1 both ways, and continues
# bit-identically in the layout that wrote it


def _resumed(env, root):
    ours = lambda **kw: _cp(pp=2, **kw)  # noqa: E731  (cp 2 x pp 2: world 4)
    theirs = lambda **kw: replace(TRAINER_BASE, pp=2, dp=2, **kw)  # noqa: E731  (05: pp 2 x dp 2)
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        ref = cpar.train(env, TRAINER_CFG, ours(steps=4, save=f"{root}/08", save_every=2), quiet=True)["losses"]
        again = cpar.train(env, TRAINER_CFG, ours(steps=4, resume=f"{root}/08/step_00000002"), quiet=True)["losses"]
        in_05 = gpt3d.train(env, TRAINER_CFG, theirs(steps=4, resume=f"{root}/08/step_00000002"), quiet=True)["losses"]
        ref_05 = gpt3d.train(env, TRAINER_CFG, theirs(steps=4, save=f"{root}/05", save_every=2), quiet=True)["losses"]
        in_08 = cpar.train(env, TRAINER_CFG, ours(steps=4, resume=f"{root}/05/step_00000002"), quiet=True)["losses"]
    return ref, again, in_05, ref_05, in_08


def test_a_checkpoint_crosses_cp_2_to_1_and_back_and_continues_bit_identically_in_its_own_layout(run_ranks, tmp_path):
    ref, again, in_05, ref_05, in_08 = run_ranks(_resumed, 4, str(tmp_path))[0]
    assert again == ref[2:]  # the same layout: its own shards, random streams included, bit for bit
    for resumed, want in ((in_05, ref[2:]), (in_08, ref_05[2:])):  # another layout: float64, reordered sums
        assert tensor_parallel.max_rel_diff(torch.tensor(resumed, dtype=torch.float64),
                                            torch.tensor(want, dtype=torch.float64)) <= TOL
    manifest = json.loads((tmp_path / "08" / "step_00000002" / "manifest.json").read_text())
    assert manifest["layout"]["cp"] == 2 and manifest["world"] == 4
    assert "cp" not in json.loads((tmp_path / "05" / "step_00000002" / "manifest.json").read_text())["layout"]


# ----------------------------------------------------------------------------------------------
# Bad input: refused at start, each in a sentence naming the flag, the value and the constraint


T1 = ["--train", "--tp", "1", "--pp", "1", "--dp", "1"]
BAD = {
    "T not divisible by 2 cp": ([*T1, "--cp", "2", "--seq-len", "30"],
                                "--seq-len 30: --cp 2 with --cp-schedule megatron cuts each sequence into 4 blocks: "
                                "it must be divisible by 4"),
    "T not divisible by cp, contiguous": ([*T1, "--cp", "4", "--seq-len", "30", "--cp-schedule", "contiguous"],
                                          "--seq-len 30: --cp 4 with --cp-schedule contiguous cuts each sequence into 4 "
                                          "blocks: it must be divisible by 4"),
    "T not divisible again by tp with sp": (["--train", "--tp", "2", "--pp", "1", "--dp", "1", "--cp", "2",
                                             "--seq-len", "36", "--sequence-parallel"],
                                            "each split again over tp=2 by --sequence-parallel: it must be divisible by 8"),
    "attention dropout with cp > 1": ([*T1, "--cp", "2", "--dropout", "0.1"],
                                      "--dropout 0.1 with --cp 2: context parallelism's attention computes the "
                                      "probabilities block by block and drops none of them"),
    "the fused attention's choice with cp > 1": ([*T1, "--cp", "2", "--fused-kernels", "--kernel-path", "reference",
                                                  "--no-flash-attention"],
                                                 "--no-flash-attention with --cp 2: it chooses the fused kernels' "
                                                 "attention core, which context parallelism replaces"),
    "CUDA graphs with cp > 1": ([*T1, "--cp", "2", "--cuda-graphs"],
                                "--cuda-graphs with --cp 2: a captured stage cannot hold the ring's point-to-point"),
    "Ulysses with fewer heads than cp": ([*T1, "--cp", "4", "--cp-attention", "ulysses", "--n-head", "2",
                                          "--n-embd", "16"], "--cp-attention ulysses gives each of the cp=4 ranks"),
    "LightSeq's checkpointing with Ulysses": ([*T1, "--cp", "2", "--cp-attention", "ulysses", "--recompute", "lightseq"],
                                              "--recompute lightseq keeps ring attention's output"),
    "cp below 1": ([*T1, "--cp", "0"], "--cp must be at least 1, got 0"),
    "a schedule at cp = 1": ([*T1, "--cp", "1", "--cp-schedule", "lightseq"],
                             "--cp-schedule lightseq with --cp 1: one rank holds the whole sequence, so it would change "
                             "nothing"),
    "Ulysses at cp = 1": ([*T1, "--cp", "1", "--cp-attention", "ulysses"], "--cp-attention ulysses with --cp 1"),
    "an unknown schedule": ([*T1, "--cp-schedule", "zigzag"], "--cp-schedule: invalid choice: 'zigzag'"),
    "a training flag given to the demo": (["--cp", "2"], "--cp is a flag of training, not of the demo: add --train"),
    "sampling with cp": (["--train", "--cp", "2", "--sample", "a", "--init-from", "x.pt"], "--sample does not use --cp"),
    "a rehearsed fault beyond tp x cp x dp x pp ranks": ([*T1, "--cp", "2", "--rehearse-fault", "kill:2:1"],
                                                         "--rehearse-fault 'kill:2:1': rank 2 is not below the world "
                                                         "size 2"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_refused_by_name_before_anything_starts(case):
    args, message = BAD[case]
    proc = run_script("08_context_parallel.py", *args, timeout=30)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "train:" not in proc.stderr  # refused before training started


def test_print_layout_shows_the_cp_groups_in_megatrons_order():
    proc = run_script("08_context_parallel.py", "--train", "--print-layout", "--tp", "2", "--cp", "2", "--dp", "2",
                      "--pp", "1", timeout=30)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "world=8: tp=2 x cp=2 x dp=2 x pp=1, Megatron's order (tp fastest, then cp, then dp, then pp)" in proc.stdout
    assert "cp groups: [[0, 2], [1, 3], [4, 6], [5, 7]]" in proc.stdout
    assert "dp groups (4 ranks each, more than --dp 2): [[0, 1, 2, 3], [4, 5, 6, 7]]" not in proc.stdout
    assert "dp groups (4 ranks each, more than --dp 2): [[0, 2, 4, 6], [1, 3, 5, 7]]" in proc.stdout


def test_a_rank_is_named_by_its_place_along_every_size_cp_included():
    from plumbing import watch
    tc = _cp(tp=2, dp=2, pp=2)
    assert cpar.rank_grid(16, 2, 2, 2, 2)["cp"][0] == [0, 2]
    assert watch.coords(7, tc) == "tp 1, cp 1, dp 1, pp 0" and watch.coords(8, tc) == "tp 0, cp 0, dp 0, pp 1"
    assert watch.coords(6, replace(TRAINER_BASE, tp=2, dp=2, pp=2)) == "tp 0, dp 1, pp 1"  # 05's, as before


# ----------------------------------------------------------------------------------------------
# LightSeq's rematerialization-aware checkpointing: what it saves, counted


def _ring_forwards(env, modes):
    idx, targets = _batch()
    out = []
    real = cpar.ring_forward
    for mode in modes:
        calls = []
        cpar.ring_forward = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            tc = _cp(recompute=mode)
            pipe = cpar.context_schedule(tc)
            run = gpt3d.build(env, TRAINER_CFG, tc, gpt3d.new_groups(env, pipe.grid(env.world_size, 1, 1)), pipe)
            gpt3d.forward_backward(run, pipeline.split_batch(idx, targets, tc.microbatches), None)
            run.ddp.finish()
            left = [len(b.attn.core.args[2]) for c in run.chunks for b in c.transformer.h.values()
                    if getattr(b.attn.core, "func", None) is cpar._kept_attention]  # outputs kept, not yet used
            out.append((len(calls), {n: p.grad.clone() for c in run.chunks for n, p in c.named_parameters()}, left))
        finally:
            cpar.ring_forward = real
    return out


def test_lightseqs_checkpointing_never_reruns_the_rings_forward_where_full_recomputation_does(run_ranks):
    runs = dict(zip(("none", "full", "selective", "lightseq"),
                    run_ranks(_ring_forwards, 2, ["none", "full", "selective", "lightseq"])[0]))
    passes = TRAINER_CFG.n_layer * TRAINER_BASE.microbatches  # one ring forward per layer and microbatch
    assert {mode: calls for mode, (calls, _, _) in runs.items()} == \
        {"none": passes, "full": 2 * passes, "selective": 2 * passes, "lightseq": passes}
    assert runs["lightseq"][2] == [0] * TRAINER_CFG.n_layer  # every kept output was used, none left over
    for mode in ("full", "selective", "lightseq"):  # and the gradients are the same
        for n, g in runs[mode][1].items():
            assert tensor_parallel.max_rel_diff(g, runs["none"][1][n]) <= TOL, (mode, n)


# ----------------------------------------------------------------------------------------------
# The planner's context parallelism


def test_the_planners_cp_formulas_and_the_longest_sequence_grow_with_p():
    import planner
    m = planner.GPT2_SMALL._replace(seq_len=4096)
    b, s, h = 1, 4096, 768
    x = planner.cp_comm_bytes_per_layer(m, 2)
    assert x == dict(tp_sp=8 / 2 * 2 * s * h, ring=6 / 2 * 2 * s * h, ulysses=4 / 4 * 2 * s * 2 * h)
    assert planner.cp_comm_bytes_per_layer(m, 8, kv_heads=1)["ring"] == 6 * 7 / 8 * 2 * s * h / 12
    n = planner.params_exact(m)
    acts = [planner.cp_memory_per_gpu(m, P) - 18 * n for P in (1, 2, 4)]
    assert acts[0] == 2 * acts[1] == 4 * acts[2]  # every token's activations, 1/P of them per GPU
    longest = [planner.cp_longest_sequence(m, P, 40e9) for P in (1, 2, 4, 8)]
    assert longest == sorted(longest) and longest[3] > 5 * longest[0] and all(x % (2 * P) == 0 for x, P in
                                                                               zip(longest, (1, 2, 4, 8)))
    assert planner.cp_longest_sequence(m, 8, 40e9, tp=True) is None  # 12 heads do not split over tp = 8
    # LightSeq's checkpointing: full recomputation's FLOPs less one attention core's forward
    assert planner.flops_per_iteration(m, 8, "full") - planner.flops_per_iteration(m, 8, "lightseq") == \
        4 * 8 * s * s * h * m.n_layer
    L = planner.Layout(1, 1, 1, 8, recompute="lightseq")
    assert planner.activation_bytes_per_layer(m, L) == 2 * s * h + 2 * s * h + 4 * s * 12
    assert "cannot (12 heads over tp=8)" in planner.context_report()


# ----------------------------------------------------------------------------------------------
# What docs/GUIDE.md and docs/ANSWERS.md say of 08, against the code


def _section(doc):
    text = (ROOT / "docs" / doc).read_text()
    return " ".join(text[text.index("## 08_context_parallel.py"):].split("\n## ")[0].split())


def test_the_guide_states_the_figures_the_code_computes():
    # ANSWERS' 08 answers are on the lesson now (OneRing, ring_step): test_answers recomputes their figures.
    guide = _section("GUIDE.md")
    sims = {(name, cp): cpar.simulate(make(cp)) for name, make in cpar.SPLITS.items() for cp in (2, 4, 8)}
    contiguous = [f"{float(sims['contiguous', cp].factor):.2f}" for cp in (2, 4, 8)]
    assert contiguous == ["1.50", "1.75", "1.88"]
    assert f"({', '.join(contiguous)})" in guide
    assert sims["megatron", 4].factor == 1
    light = sims["lightseq", 4]
    assert (len(light.work[0]), light.factor, max(light.totals)) == (3, Fraction(5, 4), Fraction(5, 2))
    first = load("test_budgets").measure("08")
    assert f"{first} lines read first" in guide


# ----------------------------------------------------------------------------------------------
# The demo, and the benchmark's guard


def test_the_demo_passes_every_split_at_cp_2_and_4_and_prints_each_figure():
    proc = script_output("08_context_parallel.py", timeout=120)  # test_docs' run too, made once
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for cp, factor in ((2, "1.50"), (4, "1.75"), (8, "1.88")):
        assert f"cp={cp} contiguous: balance factor {factor}" in out and f"cp={cp} megatron  : balance factor 1.00" in out
    runs = [line for line in out.splitlines() if line.startswith("cp=") and "worst relative difference" in line]
    assert len(runs) == 6 and out.rstrip().endswith("(tolerance 1e-10)") and "\nPASS: " in out  # 2 cp x 3 splits
    assert "lightseq   forward  exchange 1: " in out and "3->0 q[3] 8,192 B" in out
    assert "cp=2: 851,440, 851,440, 851,440, 851,440  (0.50 of cp=1's)" in out  # 1/cp of cp = 1's, exactly


def test_the_benchmark_checks_torchs_ring_computes_our_function_before_timing_it():
    proc = run_script("benchmarks/bench_context_parallel.py", "--cp", "1", "2", "--seq-len", "64", "--repeats", "1",
                      "--steps", "1", "--warmup", "0", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "not timed" in proc.stdout:  # a torch without the private ring: said, and the memory still measured
        assert "pinned to torch 2.11-2.13" in proc.stdout
    else:
        assert proc.stdout.count("all within tolerance") == 2 and proc.stdout.count("ours/torch: ") == 2
    assert "cp=2: " in proc.stdout and "= 0.500 of cp=1's" in proc.stdout


def _bf16(env):
    g = torch.Generator().manual_seed(5)
    q, k, v, do = ((torch.randn(2, 2, 16, 8, generator=g, dtype=torch.float64) * 3).bfloat16().double() for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True)
    out.backward(do)
    sched = cpar.megatron(env.world_size)
    pos = cpar.positions(sched, env.rank, 16)
    mine = [t[:, :, pos].to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    o = cpar.RingAttention.apply(*mine, sched, dist.group.WORLD)
    o.backward(do[:, :, pos].to(torch.bfloat16))
    return [o.dtype == torch.bfloat16] + [tensor_parallel.max_rel_diff(a.double(), b[:, :, pos])
                                          for a, b in zip([o] + [t.grad for t in mine], [out.detach()] + [t.grad for t in ref])]


def test_bfloat16_inputs_are_computed_in_float32_and_come_back_bfloat16(run_ranks):
    # Against float64 on the same bfloat16-rounded inputs: what is left is the outputs' rounding to
    # bfloat16 (8 bits of mantissa, 2^-9 = 2e-3 relative, a few of them through the gradients): measured
    # at most 6.4e-3. The blocks' sums kept in bfloat16 are off by 2.3e-2 to 4.7e-2 here (measured).
    for rank in run_ranks(_bf16, 2):
        assert rank[0] and max(rank[1:]) <= 1e-2, rank


def test_the_memory_check_counts_a_ranks_own_tokens_so_cp_fits_what_cp_1_cannot(monkeypatch):
    from plumbing import checks
    cfg = replace(TRAINER_CFG, block_size=4096)
    one, four = (_cp(cp=cp, seq_len=4096, batch_size=8, microbatches=8) for cp in (1, 4))
    need = {}
    monkeypatch.setattr(checks, "machine_bytes", lambda device: 1)  # refused: the message says how much it needs
    for name, tc in (("cp 1", one), ("cp 4", four)):
        with pytest.raises(ValueError) as e:
            checks.check_memory(cfg, tc, torch.device("cpu"), 1)
        need[name] = float(re.search(r"of the ([\d.,]+) GiB this run needs", str(e.value))[1].replace(",", ""))
    assert need["cp 4"] < need["cp 1"] / 3  # the activations dominate here: about 1/cp of them per rank
    monkeypatch.setattr(checks, "machine_bytes", lambda device: (need["cp 4"] + need["cp 1"]) / 2 * 2**30)
    checks.check_memory(cfg, four, torch.device("cpu"), 1)  # fits
    with pytest.raises(ValueError, match="more than this machine's"):
        checks.check_memory(cfg, one, torch.device("cpu"), 1)
