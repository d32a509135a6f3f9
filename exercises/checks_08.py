"""The checks of 08's exercises (exercises/ex08_context_parallel.py), and the planted wrong answers.

08.1 is first checked alone, in this process: the blocks of random queries, keys and values merged
in several orders must be causal softmax attention (torch's own, float64, 1e-12). 08.2 is pure:
08's validate() and simulate() read the schedule for every cp up to 8 (every causal block once, a
step meeting one rank, the balance). Then each runs inside 08's ring attention in 01's GPT-2 on CPU
ranks, the sequence split over them, against the serial model: the loss, the logits and every
gradient, float64, to 1e-10 (08.1 at cp = 2 with Megatron's split and cp = 4 with LightSeq's, whose
helpers' partial results are merged at home; 08.2 at cp = 4).
"""
import math
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn.functional as F

from exercises.autograder import Exercise, Planted, called, differences, first, installed, numbered, ranks, \
    random_weights, token_batch

tensor_parallel = numbered("01_tensor_parallel")
pipeline = numbered("02_pipeline_1f1b")
cpar = numbered("08_context_parallel")
F64 = torch.float64
CFG = tensor_parallel.GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=16)
B, T = 2, 16
REFERENCE = {"block_forward": cpar.block_forward, "merge": cpar.merge, "lightseq": cpar.lightseq}


def serial_reference():
    full = random_weights(CFG, 3)
    idx, targets = token_batch(CFG, B, T, seed=4, ignored=5)
    serial = tensor_parallel.GPT(CFG, None, init=False, dtype=F64)
    serial.load_full_state_dict(full)
    logits, loss = serial(idx, targets)
    loss.backward()
    return dict(full=full, idx=idx, targets=targets, logits=logits.detach(), loss=loss.detach(),
                grads={n: p.grad for n, p in serial.named_parameters()})


def _model(env, ref, name):
    sched = cpar.SPLITS[name](env.world_size)
    model = cpar.context_parallel(tensor_parallel.GPT(CFG, None, init=False, dtype=F64), sched, dist.group.WORLD)
    model.load_full_state_dict(ref["full"])
    logits, loss = cpar.step(model, ref["idx"], ref["targets"], dist.group.WORLD, dist.group.WORLD)
    pairs = [("the loss", loss, ref["loss"]),
             ("the logits", cpar.gather_sequence(logits.detach(), sched, dist.group.WORLD), ref["logits"])]
    pairs += [(f"the gradient of {n}", p.grad, ref["grads"][n]) for n, p in model.named_parameters()]
    return differences(pairs, {"other": "compared with the serial GPT-2 on the whole sequence"})


def run(ref, cp, name):
    where = f"in 08's GPT-2 at cp={cp} ({name}'s schedule), "
    return first([where + f"rank {r}: {x}" for r, reasons in enumerate(ranks(_model, cp, ref, name))
                  for x in reasons], 3)


# ----------------------------------------------------------------------------------------------
# 08.1 block_forward and merge


def check_blocks(impl):
    fwd, merge = impl["block_forward"], impl["merge"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 4, generator=g, dtype=F64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows = [slice(4 * i, 4 * (i + 1)) for i in range(3)]
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        outs = []
        for i in range(3):
            st = None
            for j in (j for j in order if j <= i):
                part = called(fwd, q[:, :, rows[i]], k[:, :, rows[j]], v[:, :, rows[j]], i == j, 0.5,
                              what=f"block_forward(q block {i}, kv block {j}, diagonal={i == j})")
                st = called(merge, st, part, what=f"merge(..., the State of (q {i}, kv {j}))")
            outs.append(cpar.finish(st)[0])
        got = torch.cat(outs, 2)
        found = differences([(f"the attention of 3 query blocks, their kv blocks merged in the order {order}", got,
                              want, _suspects(q, k, v, rows, order))], tol=1e-12)
        if found:
            return [f"alone, one process: {x}" for x in found]
    ref = serial_reference()
    with installed((cpar, "block_forward", fwd), (cpar, "merge", merge)):
        return run(ref, 2, "megatron") or run(ref, 4, "lightseq")


def _suspects(q, k, v, rows, order):
    """Known wrong answers: the diagonal block not masked (a row sees later keys), the States added
    without rescaling."""
    full = F.scaled_dot_product_attention(q, k, v, is_causal=False)
    outs = []
    for i in range(3):
        st = None
        for j in (j for j in order if j <= i):
            st = _merge_no_rescale(st, cpar.block_forward(q[:, :, rows[i]], k[:, :, rows[j]], v[:, :, rows[j]],
                                                          i == j, 0.5))
        outs.append(cpar.finish(st)[0])
    mask = torch.ones(12, 12, dtype=torch.bool).tril() | torch.block_diag(*[torch.ones(4, 4)] * 3).bool()
    inside = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return [(full, "it is attention over every key, later ones too: the diagonal block must be causal (a row i "
                   "sees keys 0..i of its own block)"),
            (inside, "each diagonal block attends to all of itself: mask the scores above its diagonal (-inf)"),
            (torch.cat(outs, 2), "the States' sums were added as they are: each is relative to its own max, so "
                                 "rescale both to the larger one (times exp(m_a - m), exp(m_b - m)) before adding")]


# ----------------------------------------------------------------------------------------------
# 08.2 lightseq


def check_lightseq(impl):
    fn = impl["lightseq"]
    for cp in range(1, 9):
        sched = called(fn, cp, what=f"lightseq({cp})")
        if not isinstance(sched, cpar.RingSchedule):
            return [f"lightseq({cp}) returned {type(sched).__name__}: 08's RingSchedule(name, split, steps) is expected"]
        if sched.split != [[r] for r in range(cp)]:
            return [f"lightseq({cp}).split = {sched.split}: LightSeq keeps the contiguous split, [[0], [1], ...]"]
        try:
            cpar.validate(sched)
        except pipeline.ScheduleError as e:
            return [f"lightseq({cp}) is not causal attention once on a ring: {e}"]
        steps = len(sched.steps[0])
        if steps != cp // 2 + 1:
            return [f"lightseq({cp}) takes {steps} ring steps: every block at distance d <= cp // 2 runs at step d, "
                    f"a longer one on its keys' owner earlier, so cp // 2 + 1 = {cp // 2 + 1} steps"]
        factor = cpar.simulate(sched).factor
        want = 1 + Fraction(1, cp) if cp % 2 == 0 else Fraction(1)
        if cp > 1 and factor != want:
            return [f"lightseq({cp})'s busiest rank does {float(factor):.3f} x the mean work, LightSeq's does "
                    f"{float(want):.3f}: a block at distance d > cp // 2 belongs to its keys' owner, at step cp - d"]
    ref = serial_reference()
    with installed((cpar, "SPLITS", {**cpar.SPLITS, "lightseq": fn})):
        return run(ref, 4, "lightseq")


# ----------------------------------------------------------------------------------------------
# Planted wrong answers


def _merge_no_rescale(a, b):
    if a is None or b is None:
        return a or b
    return cpar.State(torch.maximum(a.m, b.m), a.l + b.l, a.acc + b.acc)


def _forward_scales_q_in_place(q, k, v, diagonal, scale):
    q.mul_(scale)  # the mistake: q is a view of the caller's queries, which it uses again
    return cpar.block_forward(q, k, v, diagonal, 1.0)


def _forward_not_returned(q, k, v, diagonal, scale):
    st = cpar.block_forward(q, k, v, diagonal, scale)  # the mistake: the State is made, never returned  # noqa: F841


def _forward_no_mask(q, k, v, diagonal, scale):
    return cpar.block_forward(q, k, v, False, scale)


def _lightseq_owner_only(cp):
    steps = [[[] for _ in range(cp // 2 + 1)] for _ in range(cp)]
    for i in range(cp):
        for j in range(i + 1):
            if i - j <= cp // 2:
                steps[i][i - j].append(cpar.Block(i, j))
    return cpar.RingSchedule("lightseq", [[r] for r in range(cp)], steps)


def _lightseq_helper_late(cp):
    steps = [[[] for _ in range(cp // 2 + 1)] for _ in range(cp)]
    for i in range(cp):
        for j in range(i + 1):
            d = i - j
            steps[i][d].append(cpar.Block(i, j)) if d <= cp // 2 else steps[j][cp // 2].append(cpar.Block(i, j))
    return cpar.RingSchedule("lightseq", [[r] for r in range(cp)], steps)


EXERCISES = [
    Exercise("08.1", "blocks", "ring attention's blocks: FlashAttention-2's recurrences", ("block_forward", "merge"),
             "Dao 2023, Algorithm 1; Li et al. 2023, Section 3.1", check_blocks,
             lambda: {"block_forward": REFERENCE["block_forward"], "merge": REFERENCE["merge"]},
             [Planted("merge_without_rescaling", "merge adds the sums without rescaling them to the larger max",
                      lambda: {"merge": _merge_no_rescale}, "rescale both to the larger one"),
              Planted("diagonal_block_unmasked", "the diagonal block attends to later keys of its own block",
                      lambda: {"block_forward": _forward_no_mask}, "mask the scores above its diagonal"),
              Planted("block_forward_scales_q_in_place", "block_forward scales the queries in place (q.mul_)",
                      lambda: {"block_forward": _forward_scales_q_in_place}, "it wrote into its argument q in place",
                      at_line=True),
              Planted("block_forward_not_returned", "block_forward makes the State and does not return it",
                      lambda: {"block_forward": _forward_not_returned}, "it returned None", at_line=True)]),
    Exercise("08.2", "lightseq", "LightSeq's balanced schedule, as data", ("lightseq",),
             "Li et al. 2023, Section 3.2", check_lightseq, lambda: {"lightseq": REFERENCE["lightseq"]},
             [Planted("lightseq_without_helpers", "only the queries' owners compute, in cp // 2 + 1 steps",
                      lambda: {"lightseq": _lightseq_owner_only}, "is never computed"),
              Planted("lightseq_helper_at_the_wrong_step", "a helper computes its block at the last step",
                      lambda: {"lightseq": _lightseq_helper_late}, "it meets rank")]),
]
