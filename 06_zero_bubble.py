"""06 - Zero-bubble pipelines: the backward split in two (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism", Sections 2 and 6).

What this file adds on top of 02-05: a backward is two computations that depend on different things.
For a linear layer Y = X W^T + b, I, the gradient of the input (dX = dY W; Qi et al. call it B, and
here B is 02's whole backward, I + W), is what the previous stage waits for; W, the gradient of the
weights (dW = dY^T X), nobody waits for until the optimizer. Running W later, in the time a rank
would otherwise sit idle, shrinks the pipeline's bubble.
  - The lesson, read first: SplitLinear (a linear layer whose backward is I alone, X and dY kept),
    split_linears (02's stage with every linear layer split), weight_grads (W of one microbatch) and
    zb_h1_step, ZB-H1 (Section 2.1) as the loop one writes on a whiteboard over 02's lesson pieces:
    02's one_f_one_b_step with each B cut to I, its dX sent at once, and rank s's Ws deferred while
    at most s wait, the ones left filling the cooldown where 1F1B's rank s idles. Idle per rank
    (pp-1)(t_F + t_I - t_W), a third of 1F1B's at equal times, with no more memory than 1F1B on
    rank 0: (pp-r) M_B + r M_W on rank r.
  - The machine, read second, which 07 and 09 build on:
    - BackwardSplit: every linear layer's backward computes dX at I and keeps X and dY for W, which
      accumulates dW through autograd, so each weight's gradient hook (04's buckets) fires once per
      microbatch, at W; the tied output layer stays in I, its weight being the embedding's;
    - zb_h1 (the lesson's order as a list of 02's Actions) and zb_v (Section 6): two chunks per rank
      in a V (chunk 0 is stage r, chunk 1 stage 2pp-1-r), so the first and last stage share rank 0;
      at equal times no rank idles inside its own span, with pp M_B of memory (2pp chunks of half a
      stage) on every rank. The lists are torch's own (ScheduleInterleavedZeroBubble at one stage
      per rank, ScheduleZBVZeroBubble), action for action (tests/test_zero_bubble.py);
    - 02 runs them unchanged: ZeroBubbleSchedule gives its Schedule the kinds I and W (KINDS), an
      Executor that runs them (SplitExecutor) and, for ZB-V, plans whose receives are posted in
      lockstep with their senders (ZeroBubbleSchedule.receives). 05's training loop runs them too
      (--train, --schedule).

Run it:
    python 06_zero_bubble.py                            # pp=4 CPU ranks, m=8: 1F1B, ZB-H1, ZB-V
    python 06_zero_bubble.py --pp 2 --microbatches 6
    python 06_zero_bubble.py --train --tp 2 --pp 2 --dp 2 --schedule zb-v --steps 50
    torchrun --nproc-per-node 4 06_zero_bubble.py       # one rank per GPU

The demo runs the lesson against the serial model in float64 on a batch whose microbatches count
unequal numbers of targets, one none (loss and every gradient within 1e-10); then the machine: it
draws 1F1B, ZB-H1 and ZB-V simulated on one time scale (t_F = t_I = t_W), prints each rank's idle
time, the bubble and the peak memory beside the paper's formulas, runs all three on the same model
against the serial model (1e-10) with their measured timelines and activation bytes, ZB-H1 against
the lesson too (1e-12), and exits 1 on a mismatch or a formula that fails.
"""
import contextlib
import functools
import importlib
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import timedelta
from fractions import Fraction
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plumbing import cli, command, demos
from plumbing.charts import pipeline_timeline
from plumbing.launch import printer, run_main
from plumbing.reference import pipeline_reference

tensor_parallel = importlib.import_module("01_tensor_parallel")
pipeline = importlib.import_module("02_pipeline_1f1b")
gpt3d = importlib.import_module("05_3d_gpt")
Action = pipeline.Action


# ----------------------------------------------------------------------------------------------
# The lesson: the backward split in two, and ZB-H1 as the loop one writes on a whiteboard, over 02's
# lesson pieces. Rank s is stage s of pp (02's stage_model); each holds the microbatches [(idx, targets)].


class SplitLinear(torch.autograd.Function):
    """Y = X W^T + b whose backward is I alone: dX = dY W (I is what Qi et al. call B) and the bias's
    gradient now; the weight gets none here: (weight, X, dY) is appended to `kept`, for W."""

    @staticmethod
    def forward(ctx, x, weight, bias, kept):  # x (..., n_in), weight (n_out, n_in)
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.kept = weight, bias, kept
        return F.linear(x, weight, bias)  # (..., n_out)

    @staticmethod
    def backward(ctx, dy):  # dy (..., n_out)
        x, = ctx.saved_tensors
        ctx.kept.append((ctx.weight, x, dy))  # what W needs: dW = dY^T X waits
        db = None if ctx.bias is None else dy.flatten(0, -2).sum(0)
        return dy @ ctx.weight, None, db, None  # dX (..., n_in); None: no gradient for the weight yet


def split_linears(stage, kept):
    """Every linear layer of this stage (01's column- and row-parallel ones, the tied output layer too)
    computes through SplitLinear: 01's forwards with F.linear replaced. Its Is append to kept."""
    def column(m, x):  # 01's ColumnParallelLinear.forward: f, then the linear layer
        return SplitLinear.apply(tensor_parallel.enter_tp(x, m.group, m.sp), m.weight, m.bias, kept)

    def row(m, x):  # 01's RowParallelLinear.forward: the linear layer, then g, then the bias
        y = tensor_parallel.exit_tp(SplitLinear.apply(x, m.weight, None, kept), m.group, m.sp)
        return y + tensor_parallel.sp_param(m.bias, m.group, m.sp)

    for m in stage.modules():
        if isinstance(m, tensor_parallel.ColumnParallelLinear):
            m.forward = functools.partial(column, m)
        elif isinstance(m, tensor_parallel.RowParallelLinear):
            m.forward = functools.partial(row, m)


def weight_grads(kept):
    """W of one microbatch: dW = dY^T X for each linear layer its I kept, added to the weight's gradient."""
    for weight, x, dy in kept:
        dw = dy.flatten(0, -2).T @ x.flatten(0, -2)  # (n_out, n_in): summed over the microbatch's b T tokens
        weight.grad = dw if weight.grad is None else weight.grad + dw


def zb_h1_step(stage, microbatches):
    """ZB-H1 (Qi et al. Section 2.1) on this rank's stage: 02's one_f_one_b_step with each backward cut
    to I, whose dX is sent at once, every message 1F1B's (W sends none). Rank s then runs the oldest W
    while more than s wait: deferring s of them costs s M_W of memory, and the s left run after the
    drain, where 1F1B's rank s idles while the last input gradients travel on down to rank 0. Returns
    the loss on the last stage, else None."""
    s, pp, m = dist.get_rank(), dist.get_world_size(), len(microbatches)
    w, losses, flight, kept, waiting = pipeline.loss_weights(microbatches), [], [], [], []
    split_linears(stage, kept)
    out = next(stage.parameters()).new_empty(*microbatches[0][0].shape, stage.cfg.n_embd)  # (b, T, C) travels

    def input_grad(dy):  # I of the oldest microbatch in flight: its dX, and its W queued
        dx = pipeline.backward_step(*flight.pop(0), dy)
        waiting.append(kept.copy())
        kept.clear()
        return dx

    def run_ws_beyond(n):  # W of the oldest microbatches, while more than n wait
        while len(waiting) > n:
            weight_grads(waiting.pop(0))

    warmup = min(pp - s - 1, m)  # 1F1B's warm-up
    for i in range(warmup):
        flight.append(pipeline.forward_step(stage, microbatches[i], pipeline.recv_from(s - 1, out), w[i], losses))
        pipeline.send_to(flight[-1][1], s + 1)
    x = pipeline.recv_from(s - 1, out) if warmup < m else None
    for i in range(warmup, m):  # steady: F of microbatch i, I of the oldest in flight, then a deferred W
        flight.append(pipeline.forward_step(stage, microbatches[i], x, w[i], losses))
        dx = input_grad(pipeline.send_recv(flight[-1][1], s + 1, out))  # send forward, receive backward
        if i + 1 < m:  # send dX at once, receive the next forward's input
            x = pipeline.send_recv(dx, s - 1, out)
        else:
            pipeline.send_to(dx, s - 1)
        run_ws_beyond(s)
    while flight:  # drain: the Is left, each dX sent at once, then a deferred W
        pipeline.send_to(input_grad(pipeline.recv_from(s + 1, out)), s - 1)
        run_ws_beyond(s)
    run_ws_beyond(0)  # the s Ws left, while ranks s - 1, ..., 0 run their last Is
    pipeline.sum_tied_grads(stage)
    return sum(losses) if stage.post_process else None


# ----------------------------------------------------------------------------------------------
# Demo: the lesson against the serial model, then the machine below against the lesson; float64, the
# same weights and the same batch, whose microbatches count unequal numbers of targets (one none).


def demo(env, cfg, args):
    pp, m, say = args.pp, args.microbatches, printer(env)
    pipeline.check_world(pp, env.world_size)  # every check runs before the first collective
    microbatches, full, ref_loss, ref_grads = ref = pipeline_reference(cfg, args, m, env.device, unequal=True)
    say(f"{cfg}\npp={pp} m={m} global batch B={args.batch_size} T={args.seq_len} float64, "
        f"world={env.world_size} ({dist.get_backend()})")
    say(f"targets counted per microbatch: {[int((t != -100).sum()) for _, t in microbatches]}")
    stage = pipeline.stage_model(cfg, dtype=torch.float64, device=env.device)
    stage.load_full_state_dict(full)  # the serial model's weights
    lesson = zb_h1_step(stage, microbatches), {n: p.grad for n, p in stage.named_parameters()}
    worst = demos.worst_difference(lesson, ref_loss, ref_grads)
    say(f"the lesson, zb_h1_step: max relative difference against serial (loss and every gradient): "
        f"{worst:.2e} {'PASS' if worst <= 1e-10 else 'FAIL'} (tolerance 1e-10)")
    return prove_machine(env, cfg, args, ref, lesson, say) and worst <= 1e-10


# ----------------------------------------------------------------------------------------------
# Read second: the machine, which 07 and 09 build on. The backward split (Section 2), B = I + W for
# each linear layer Y = X W^T + b, with each weight's gradient accumulated through autograd at W.


class DeferredWeightGrad(torch.autograd.Function):
    """F.linear(x, weight, bias) whose backward is I's half: dX = dY W and the bias's sum of dY now,
    X and dY kept for W. The weight comes in detached (and its layer, not the parameter itself), so
    autograd has no edge to it: nothing is accumulated into it at I and its gradient hook does not
    fire (returning None for it would fire the hook, with no gradient)."""

    @staticmethod
    def forward(ctx, x, weight, bias, linear, split):  # x (..., n_in), weight (n_out, n_in)
        ctx.save_for_backward(x, weight)
        ctx.linear, ctx.split, ctx.bias = linear, split, bias is not None
        return F.linear(x, weight, bias)  # (..., n_out)

    @staticmethod
    def backward(ctx, dy):  # dy (..., n_out)
        x, weight = ctx.saved_tensors
        ctx.split.keep(ctx.linear.weight, x, dy)
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.bias else None
        return dy @ weight, None, db, None, None  # dX (..., n_in)


class BackwardSplit:
    """Installs DeferredWeightGrad in every column- and row-parallel layer of a rank's chunks (the
    tied output layer aside), and runs I and W for 02's executor: input(key) is the context of I's
    backward for key = (chunk, microbatch), held(key) the storage it kept, weight(key) is W."""

    def __init__(self, chunks):
        self.kept, self.key = {}, None
        for c in chunks:
            for m in c.modules():
                if isinstance(m, tensor_parallel.ColumnParallelLinear) and m is not getattr(c, "lm_head", None):
                    m.forward = functools.partial(self._column, m)
                elif isinstance(m, tensor_parallel.RowParallelLinear):
                    m.forward = functools.partial(self._row, m)

    def _linear(self, linear, x, bias):
        return DeferredWeightGrad.apply(x, linear.weight.detach(), bias, linear, self)

    def _column(self, linear, x):  # 01's ColumnParallelLinear.forward, with the split linear
        return self._linear(linear, tensor_parallel.enter_tp(x, linear.group, linear.sp), linear.bias)

    def _row(self, linear, x):  # 01's RowParallelLinear.forward, likewise
        y = tensor_parallel.exit_tp(self._linear(linear, x, None), linear.group, linear.sp)
        return y + tensor_parallel.sp_param(linear.bias, linear.group, linear.sp)

    @contextlib.contextmanager
    def input(self, key):
        self.key, self.kept[key] = key, []
        try:
            yield
        finally:
            self.key = None

    def keep(self, param, x, dy):
        if self.key is None:
            raise RuntimeError("a backward through a split linear layer ran outside an I action: with a "
                               "BackwardSplit installed, run the schedule through SplitExecutor (ZeroBubbleSchedule.executor)")
        self.kept[self.key].append((param, x, dy))

    def held(self, key):
        """{storage: bytes} of what W of key still needs: each layer's X and dY (the meter counts it)."""
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for _, x, dy in self.kept[key] for t in (x, dy)}

    def weight(self, key):
        """W: dW = dY^T X for each layer, accumulated into .grad through autograd, so that each
        weight's post-accumulate hook fires now, once (04's buckets count it)."""
        grads = {}
        for param, x, dy in self.kept.pop(key):
            dw = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (n_out, n_in)
            grads[param] = grads[param] + dw if param in grads else dw
        torch.autograd.backward(list(grads), list(grads.values()))


# ----------------------------------------------------------------------------------------------
# The schedules as data (Sections 2.1 and 6), torch's lists; a placement is part of each.


def v_shape(pp, chunk, rank):
    """The V placement: chunk 0 of rank r is stage r, chunk 1 is stage 2pp-1-r."""
    return rank if chunk == 0 else 2 * pp - 1 - rank


def zb_h1(pp, m, stage):
    """ZB-H1: 1F1B with each B replaced by I; rank `stage` runs W of microbatch i - stage right after
    I of microbatch i, and the Ws left over at the end. Deferring them by `stage` fills the cooldown
    bubble while holding only `stage` microbatches' M_W more than 1F1B: the same peak on rank 0."""
    acts = []
    for a in pipeline.one_f_one_b(pp, m, stage):
        if a.kind == "F":
            acts.append(a)
            continue
        acts.append(Action("I", a.mb))
        if a.mb >= stage:
            acts.append(Action("W", a.mb - stage))
    return acts + [Action("W", i) for i in range(max(m - stage, 0), m)]


def zb_v(pp, m, stage):
    """ZB-V on rank `stage` (r): forwards of chunk 0 until microbatch 0, down the V and back up, reaches
    chunk 1 here; then F, I and W of both chunks in turn; then the remaining Is and Ws. Built for
    n = max(m, 2pp - 1) microbatches, the fewest that fill the V, and cut to the m that exist."""
    r, n, done, acts = stage, max(m, 2 * pp - 1), Counter(), []

    def run(*steps):  # ("F", 0): the next forward of chunk 0, and so on
        for kind, chunk in steps:
            acts.append(Action(kind, done[kind, chunk], chunk))
            done[kind, chunk] += 1

    run(*[("F", 0)] * (2 * (pp - r) - 1))  # warmup: chunk 0 alone, while microbatch 0 goes down...
    for _ in range(r):
        run(("F", 1), ("F", 0))  # ...and back up to here: chunk 1 of the ranks below r fills first
    for _ in range(pp - r):
        run(("F", 1), ("I", 1), ("W", 1))  # chunk 1's backward starts at once: it follows the bottom
    while done["F", 0] < n or done["F", 1] < done["F", 0]:  # steady state
        run(*[("F", 0)] * (done["F", 0] < n), ("I", 0), ("W", 0), ("F", 1), ("I", 1), ("W", 1))
    for _ in range(r):  # cooldown: the input gradients the ranks below wait for, first
        run(("I", 0), ("I", 1))
    for _ in range(pp - r):
        run(("I", 0), ("W", 0))
    run(*[("W", 1)] * (done["I", 1] - done["W", 1]), *[("W", 0)] * (done["I", 0] - done["W", 0]))
    return [a for a in acts if a.mb < m]


# ----------------------------------------------------------------------------------------------
# Controllable memory (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", Section 3): a
# V schedule as one building block repeated. The block gives each pass of microbatch 0 a time slot
# (t_F = t_I = t_W = 1 slot a chunk); microbatch j's passes run j * 6 slots later, so each rank runs
# its 6 passes (F, I, W of its two chunks) once every 6 slots, in 6 different residues mod 6.
# Memory is set by the block's lifespans (F to W of each chunk: alive across repetitions of the
# block), the bubble by how long one block is from its first pass to its last.

PERIOD = 6  # slots between two microbatches' blocks: the passes of a rank's two chunks


def v_rank(pp, k):
    """The rank of stage k in the V (v_shape's inverse)."""
    return k if k < pp else 2 * pp - 1 - k


def v_block(pp, spread):
    """The building block, {(kind, stage): slot}: every pass as early as its dependencies allow
    (F after the previous stage's F, I after the next stage's I, W after its I) in a residue mod
    PERIOD its rank has free. spread: slots between stages' Fs down the V's first leg and between
    their Is back up its second: 1 is V-Min (the shortest lifespans: about a third of 1F1B's
    memory), 2 V-Half (longer lifespans, about half of 1F1B's memory, a shorter bubble)."""
    S, used, at = 2 * pp, [set() for _ in range(pp)], {}

    def place(kind, k, t):
        while t % PERIOD in used[v_rank(pp, k)]:
            t += 1
        used[v_rank(pp, k)].add(t % PERIOD)
        at[kind, k] = t

    for k in range(S):
        place("F", k, 0 if k == 0 else at["F", k - 1] + (spread if k < pp else 1))
    for k in reversed(range(S)):
        place("I", k, at["F", k] + 1 if k == S - 1 else at["I", k + 1] + (spread if k >= pp else 1))
    for r in range(pp):  # each rank's two Ws, in the order of their Is, in its two residues left
        for k in sorted((r, S - 1 - r), key=lambda k: at["I", k]):
            place("W", k, at["I", k] + 1)
    return at


def check_block(pp, block):
    """Refuses a block that cannot repeat: a pass before what it waits for, or two passes of a rank
    in one residue mod PERIOD (the repetitions would collide)."""
    S = 2 * pp
    for k in range(S):
        waits = [("F", k, "F", k - 1)] * (k > 0) + [("I", k, "F", k), ("W", k, "I", k)] + [("I", k, "I", k + 1)] * (k < S - 1)
        for kind, stage, dep, of in waits:
            if block[kind, stage] <= block[dep, of]:
                raise pipeline.ScheduleError(f"block: {kind} of stage {stage} at slot {block[kind, stage]} does not "
                                             f"wait for {dep} of stage {of} at slot {block[dep, of]}")
    for r in range(pp):
        slots = [block[kind, k] % PERIOD for kind in "FIW" for k in (r, S - 1 - r)]
        if len(set(slots)) < len(slots):
            raise pipeline.ScheduleError(f"block: rank {r} has two passes in one residue mod {PERIOD}: {slots}")


def v_repeat(pp, m, rank, block):
    """Rank's list: the block repeated for microbatches 0..m-1, microbatch j's passes j * PERIOD slots
    later, run in the order of their slots. Repeating a checked block needs no search, so nothing can
    stall: every pass keeps the order its slot gave it (02's simulator then squeezes the empty slots)."""
    passes = [(block[kind, k] + j * PERIOD, Action(kind, j, c)) for c, k in enumerate((rank, 2 * pp - 1 - rank))
              for kind in "FIW" for j in range(m)]
    return [a for _, a in sorted(passes, key=lambda p: p[0])]


def fill_with_ws(pp, lists):
    """The paper's reordering after the squeeze (Qi et al. 2024, Section 3): at equal times, a rank whose
    next pass must wait runs its oldest W whose I is done instead, filling the block's warm-up and
    cool-down gaps. Every pass takes one step, so nothing else starts later; memory only falls."""
    S, done, todo, out, t = 2 * pp, {}, [list(acts) for acts in lists], [[] for _ in lists], 0

    def ready(r, a):
        k = v_shape(pp, a.chunk, r)
        waits = {"F": [("F", k - 1)] * (k > 0), "I": [("F", k)] + [("I", k + 1)] * (k < S - 1), "W": [("I", k)]}
        return all(done.get((kind, stage, a.mb), t + 1) <= t for kind, stage in waits[a.kind])

    while any(todo):
        if t > 6 * S * sum(map(len, lists)):
            raise pipeline.ScheduleError(f"fill_with_ws: the lists stall at step {t}")
        for r, acts in enumerate(todo):
            i = 0 if acts and ready(r, acts[0]) else next((i for i, a in enumerate(acts) if a.kind == "W" and ready(r, a)), None)
            if i is not None:
                out[r].append(acts.pop(i))
                done[out[r][-1].kind, v_shape(pp, out[r][-1].chunk, r), out[r][-1].mb] = t + 1
        t += 1
    return out


def lifespan_peak(pp, block, rank, w_share):
    """The lifespan arithmetic: the most chunks' activations rank holds at once in the steady state,
    each chunk held whole from its F to its I and w_share of it from I to W, summed over the
    repetitions of the block alive at each slot (peak_memory's figure once m fills the pipeline)."""
    def held(t):
        return sum(sum(1 if s < block["I", k] else w_share if s < block["W", k] else 0  # whole, then W's share
                       for s in range(t % PERIOD, block["W", k], PERIOD) if s >= block["F", k])  # alive at slot t
                   for k in (rank, 2 * pp - 1 - rank))
    start = max(block["W", k] for k in (rank, 2 * pp - 1 - rank))  # by then every repetition overlaps
    return max(held(t) for t in range(start, start + PERIOD))


# The authors' table (Qi et al. 2024, Section 3; their Hugging Face space sail/pipeline-parallelism-
# with-controllable-memory), activation memory in microbatches of a whole stage (M_B): 1F1B p, V-Half
# (p+2)//2, V-Min (p+4)//3; lifespan_peak's in those units is its chunks / 2. A limit as pp grows, not
# a bound at small pp: the shares 1/2 and 1/3 come within 10% late.
AUTHORS_FORM = {"1f1b": lambda p: p, "v-half": lambda p: (p + 2) // 2, "v-min": lambda p: (p + 4) // 3}


def lifespan_share(name, pp, w_share):
    """The lifespan arithmetic's most held over the ranks, as a share of 1F1B's pp microbatches (2pp chunks)."""
    block = v_block(pp, V_SCHEDULES[name][1])
    return max(lifespan_peak(pp, block, r, w_share) for r in range(pp)) / (2 * pp)


def within_a_tenth(name, share, w_share, upto=40):
    """(the first pp, the pp from which every pp up to upto) whose lifespan share is within 10% of share
    (None: not by upto)."""
    near = [lifespan_share(name, pp, w_share) <= share * Fraction(11, 10) for pp in range(2, upto + 1)]
    first = next((pp for pp, ok in zip(range(2, upto + 1), near) if ok), None)
    since = next((pp for pp in range(2, upto + 1) if all(near[pp - 2:])), None)
    return first, since


def block_idle_bound(block):
    """The most a rank idles in a repeated building block (Qi et al. 2024, "Pipeline Parallelism with
    Controllable Memory", Section 3): only in its warm-up and cool-down, at most the block's span
    less one period, in 02's time (a slot is half a stage's pass); 02's simulator may squeeze the
    block's empty slots, never stretch them."""
    return Fraction(max(block.values()) + 1 - PERIOD, 2)


def dualpipe_v(pp, m, rank):
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V on pp ranks, torch's ScheduleDualPipeV), on the
    V placement: F of chunk 0 while microbatch 0 goes down; F of both chunks; I, W, F of chunk 1;
    then its steady state, pairs of a forward and a whole backward (B) of the other chunk that
    DualPipe overlaps (F&B: one's communication hidden under the other's compute), marked steady so
    that 02's groups run each pair back to back, as one group (on CPU they run one after the other,
    not overlapped); then B and the I/W split again in its cooldown. Needs m >= 2pp."""
    if m < 2 * pp:
        raise ValueError(f"--microbatches {m}: --schedule dualpipev needs at least as many microbatches as its "
                         f"2 x pp = {2 * pp} stages (m >= 2pp)")
    done, acts, waiting = Counter(), [], []

    def run(kind, chunk, steady=False):
        key = "I" if kind == "B" else kind  # a whole B counts as its chunk's I and W
        acts.append(Action(kind, done[key, chunk], chunk, steady))
        done[key, chunk] += 1
        if kind == "B":
            done["W", chunk] += 1
        elif kind == "I":
            waiting.append(acts[-1])

    def weight():  # the oldest W an I left
        if waiting:
            a = waiting.pop(0)
            acts.append(Action("W", a.mb, a.chunk))
            done["W", a.chunk] += 1

    def pair(f, b, split=False):  # F of chunk f overlapped with B of chunk b
        run("F", f, not split)
        run("B", b, not split)

    for _ in range(2 * (pp - rank - 1)):
        run("F", 0)
    for _ in range(rank + 1):
        run("F", 0), run("F", 1)
    for _ in range(pp - rank - 1):
        run("I", 1), weight(), run("F", 1)
    for i in range(m - 2 * pp + rank + 1):
        pair(0, 1, split=i == 0 and rank == pp - 1)  # the last rank's first pair is not overlapped
        pair(1, 0)
    for _ in range(pp - rank - 1):
        run("B", 1), pair(1, 0)
    split = False
    for i in range(rank + 1):  # from the middle on, the I/W split again
        split |= i == (rank + 1) // 2 and rank % 2 == 1
        run("I" if split else "B", 1)
        split |= i == (rank + 1) // 2 and rank % 2 == 0
        run("I" if split else "B", 0)
    for _ in range(pp - rank - 1):
        weight(), run("I" if split else "B", 0)
    for _ in range(rank + 1):
        weight()
    return acts


def split_whole_backwards(acts):
    """What runs a list with whole backwards: each B as its I then its W, back to back (an overlapped
    B's I stays paired with its F: steady)."""
    return [b for a in acts for b in ([Action("I", a.mb, a.chunk, a.steady), Action("W", a.mb, a.chunk)]
                                      if a.kind == "B" else [a])]


V_SCHEDULES = {"v-half": ("V-Half", 2), "v-min": ("V-Min", 1)}  # name: (its name, v_block's spread)


def v_schedule(name, pp, m):
    """pipeline_schedule's "v-half", "v-min" (the block checked and repeated) and "dualpipev" (its
    whole backwards split): on the V, their receives posted in lockstep, as ZB-V's."""
    if name == "dualpipev":
        lists, label = [split_whole_backwards(dualpipe_v(pp, m, r)) for r in range(pp)], "DualPipeV"
    else:
        label, block = V_SCHEDULES[name][0], v_block(pp, V_SCHEDULES[name][1])
        check_block(pp, block)
        lists = fill_with_ws(pp, [v_repeat(pp, m, r, block) for r in range(pp)])
    return ZeroBubbleSchedule(lists, v_shape, name=label, bubble=f"of {label}", times={"I": 1, "W": 1}, lockstep=True)


# ----------------------------------------------------------------------------------------------
# How 02 runs them: I and W as kinds of action, with their executor; receives posted in lockstep.


KINDS = {"F": pipeline.KINDS["F"], "I": pipeline.Kind("grad", "F"), "W": pipeline.Kind(None, "I")}  # B = I + W


class SplitExecutor(pipeline.Executor):
    """02's Executor with I and W: I is B's backward inside the split's input() context (the weights'
    gradients kept, not computed), W computes them. (02's activation meter counts what W still
    needs, from I to W: BackwardSplit.held.)"""

    def __init__(self, split, *args):
        super().__init__(*args)
        self.split = split

    def run_I(self, a, k):  # receive the output's gradient -> input gradients -> send, as B does
        with self.split.input((a.chunk, a.mb)):
            self.run_B(a, k)

    def run_W(self, a, k):  # the weights' gradients I left: no messages
        self.split.weight((a.chunk, a.mb))


@dataclass
class ZeroBubbleSchedule(gpt3d.PipelineSchedule):
    """A schedule with I and W (KINDS) for 02 and 05: prepare() splits the chunks' backward, and
    executor() runs I and W. lockstep: post each receive when, with every rank's list run in lockstep,
    its sender sends it (see posted)."""
    kinds: dict = field(default_factory=lambda: KINDS)
    lockstep: bool = False
    split: object = field(default=None, repr=False)  # this rank's BackwardSplit, once prepared

    def prepare(self, chunks, groups=None, full=None):
        self.split = BackwardSplit(chunks)  # last: it takes over the linears' forwards (05's build)

    def executor(self, chunks, pp_group, wire, exchange=None, deallocate=True):
        return SplitExecutor(self.split, self, chunks, pp_group, wire, exchange, deallocate)

    def receives(self, rank, groups):
        """02 posts a receive at the boundary before the group that needs it. In ZB-V, activations
        (chunk 0) and gradients (chunk 1) travel the same way between two ranks, and in that order a
        rank could wait for a message its peer sends after one this rank has not posted yet. With
        lockstep, a receive is posted at the boundary this rank has reached when its sender sends it
        (torch's pipelining lowers its schedules so too): receives are posted in the order sent, and
        every boundary's sends and receives meet their peers' at the same round."""
        if not self.lockstep:
            return super().receives(rank, groups)
        sent, ran = lockstep_rounds(self)
        posted = {}  # group -> [(the order its sender sent it in, the receive)]
        for group in groups:
            for recv in self.remote(rank, group, self.needs, "recv"):
                at = next(g for g, t in enumerate(ran[rank]) if t > sent[recv[2]][0])
                posted.setdefault(at, []).append((sent[recv[2]][1], recv))
        return {g: [recv for _, recv in sorted(recvs)] for g, recvs in posted.items()}


def lockstep_rounds(schedule):
    """Every rank's list run in rounds: in each round each rank runs its next group of actions
    (Schedule.groups) if the messages they wait for were sent in an earlier round. Returns ({message:
    (round, n)}, n counting the messages in the order sent; [the round each group ran in, per rank])."""
    pp, groups = schedule.pp, [schedule.groups(r) for r in range(schedule.pp)]
    sent, ran, t = {}, [[] for _ in range(pp)], 0
    while any(len(ran[r]) < len(groups[r]) for r in range(pp)):
        now, moved = {}, False
        for r in range(pp):
            group = groups[r][len(ran[r])] if len(ran[r]) < len(groups[r]) else []
            inputs = [schedule.needs(a, schedule.stage(r, a.chunk)) for a in group]
            if group and all(got is None or schedule.where[got[1]][0] == r or got[0] in sent for got in inputs):
                ran[r].append(t)
                moved = True
                for a in group:
                    out = schedule.produces(a, schedule.stage(r, a.chunk))  # (message, its stage) or None
                    now.update({out[0]: (t, len(sent) + len(now))} if out else {})
        if not moved:
            raise pipeline.ScheduleError("deadlock: in lockstep, no rank can run its next action")
        sent.update(now)
        t += 1
    return sent, ran


def pipeline_schedule(name, pp, m):
    """05's PipelineSchedule of "1f1b", "zb-h1", "zb-v" (or v_schedule's): every rank's list and how they run.
    ZB-V sends activations (chunk 0) and gradients (chunk 1) the same way between two ranks, so
    its receives are posted in lockstep with their senders; ZB-H1's are not mixed."""
    if name == "1f1b":
        return gpt3d.PipelineSchedule([pipeline.one_f_one_b(pp, m, r) for r in range(pp)], name="1F1B")
    if name in (*V_SCHEDULES, "dualpipev"):
        return v_schedule(name, pp, m)
    if name == "zb-h1":
        return ZeroBubbleSchedule([zb_h1(pp, m, r) for r in range(pp)], name="ZB-H1", bubble="(pp-1)/(3m)",
                                  times={"I": 1, "W": 1})
    return ZeroBubbleSchedule([zb_v(pp, m, r) for r in range(pp)], v_shape, name="ZB-V", bubble="of ZB-V",
                              times={"I": 1, "W": 1}, lockstep=True)


# ----------------------------------------------------------------------------------------------
# Read second: the demo's machine part. The three schedules simulated against their formulas, then run
# against the serial model, ZB-H1 against the lesson too.


def peak_memory(actions, w_share):
    """The most microbatches' activations (x chunks) held at once, when I frees all but w_share of a
    microbatch's and W the rest (1F1B's peak_in_flight at w_share = 0)."""
    live = peak = 0
    for a in actions:
        live += {"F": 1, "B": -1, "I": w_share - 1, "W": -w_share}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


def simulate(pipe, t=1, overlap=False):
    """02's simulator on pipe's lists with t_F = t_I = t_W = t per stage (half of it per chunk of
    ZB-V); its memory peaks with M_W = M_B / 2 (what W keeps, as a share of a microbatch's activations).
    overlap: DualPipeV's F&B pairs charged overlapped, max(t_F, t_B) = t_B each (overlapped's P: 0)."""
    t = Fraction(t, pipe.v)
    sim = pipeline.simulate(overlapped(pipe) if overlap else pipe, t, 2 * t, times={"I": t, "W": t, "P": 0})
    return sim, [peak_memory(acts, Fraction(1, 2)) for acts in pipe.lists]


def overlapped(pipe):
    """pipe as 02's simulator would run DualPipe's F&B overlapped (one pass's compute hiding the
    other's): each steady pair, an F and a whole backward (its I steady, then its W), becomes the
    backward, then the F as a kind "P" timed max(t_F, t_B) - t_B, so the pair costs max(t_F, t_B),
    not t_F + t_B, and the F's output leaves when the pair ends. P sends what F sends ("act"), and
    I waits for either on its stage."""
    lists = []
    for acts in pipe.lists:
        out, i = [], 0
        while i < len(acts):
            f, b, w = (acts[i:i + 3] + [None, None])[:3]
            paired = f.kind == "F" and f.steady and b and b.kind == "I" and b.steady and w and w.kind == "W"
            out += [b, w, Action("P", f.mb, f.chunk, True)] if paired else [f]
            i += 3 if paired else 1
        lists.append(out)
    kinds = {**pipe.kinds, "P": pipe.kinds["F"], "I": replace(pipe.kinds["I"], after="act")}
    return replace(pipe, lists=lists, kinds=kinds)


def run_schedule(env, cfg, pipe, ref, embed_group):
    """One step of pipe on this rank against the serial reference: (worst difference, StepResult, chunks)."""
    microbatches, full, ref_loss, ref_grads = ref
    chunks = pipeline.build_chunks(cfg, pipe.pp, env.rank, pipe.v, placement=pipe.placement, init=False,
                                   dtype=torch.float64, device=env.device)
    for c in chunks:
        c.load_full_state_dict(full)
    pipe.prepare(chunks)
    dist.barrier()  # the ranks start together, so their measured timelines line up
    result = pipeline.execute(pipe, chunks, dist.group.WORLD, microbatches, pipeline.Wire((*microbatches[0][0].shape,
                                                                                          cfg.n_embd)))
    pipeline.sync_tied_embeddings(chunks, embed_group if pipe.where[pipe.S - 1][0] else None)  # ZB-V: both on rank 0
    return pipeline.differences(chunks, result, ref_loss, ref_grads), result, chunks


def prove_machine(env, cfg, args, ref, lesson, say):
    """The figures against the paper's formulas; each schedule run against serial; ZB-H1 against the lesson."""
    pp, m = args.pp, args.microbatches
    embed_group = dist.new_group([0, pp - 1], timeout=timedelta(seconds=60)) if pp > 1 else None
    pipes = {name: pipeline_schedule(name, pp, m) for name in ("1f1b", "zb-h1", "zb-v")}
    sims = {name: simulate(pipe) for name, pipe in pipes.items()}
    end = max(sim.step_time for sim, _ in sims.values())
    say("\n=== simulated: t_F = t_I = t_W = 1 per stage (ZB-V: 1/2 per chunk, chunk 1 in lower case) ===")
    for name, (sim, _) in sims.items():
        say(f"{pipes[name].name}:\n{pipeline_timeline(sim.timeline, 150, end)}")
    (one, one_mem), (h1, h1_mem), (zv, zv_mem) = sims["1f1b"], sims["zb-h1"], sims["zb-v"]
    formulas = [  # (what, simulated, the paper's formula, where it holds)
        ("1F1B idle per rank", one.idle, [(pp - 1) * 3] * pp, "(pp-1)(t_F+t_I+t_W)"),
        ("ZB-H1 idle per rank", h1.idle, [pp - 1] * pp, "(pp-1)(t_F+t_I-t_W), m >= pp"),
        ("ZB-V idle inside each rank's span", zv.span_idle, [0] * pp, "0, m >= 2pp-1"),
        ("bubble, 1F1B", one.bubble, Fraction(pp - 1, m), "(pp-1)/m"),
        ("bubble, ZB-H1", h1.bubble, Fraction(pp - 1, 3 * m), "(pp-1)/(3m): a third, m >= pp"),
        ("peak memory, 1F1B", one_mem, [pp - r for r in range(pp)], "(pp-r) M_B"),
        ("peak memory, ZB-H1", h1_mem, [pp - r + Fraction(r, 2) for r in range(pp)],
         "(pp-r) M_B + r M_W <= pp M_B, m >= pp"),
        ("peak memory, ZB-V (chunks)", zv_mem, [2 * pp] * pp, "2pp half-stage chunks = pp M_B, m >= 2pp-1"),
    ]
    ok, show = True, lambda x: str([str(y) for y in x]).replace("'", "") if isinstance(x, list) else str(x)  # noqa: E731
    say("\nthe paper's figures, simulated (memory in M_B, a stage's activations of one microbatch; M_W = M_B/2 assumed):")
    for what, got, want, formula in formulas:
        out_of_range = "m >= pp" in formula and m < pp or "2pp-1" in formula and m < 2 * pp - 1
        ok &= got == want or out_of_range
        verdict = "(equal)" if got == want else "(m out of the formula's range)" if out_of_range else "(DIFFERENT)"
        say(f"  {what:36s} {show(got):28s} formula {formula} = {show(want)}  {verdict}")
    say(f"  simulated step time: 1F1B {one.step_time}, ZB-H1 {h1.step_time}, ZB-V {zv.step_time}")
    say("\n=== executed against the serial model, float64 ===")
    measured = {}
    for name, pipe in pipes.items():
        pipeline.validate(pipe, m)
        worst, result, chunks = run_schedule(env, cfg, pipe, ref, embed_group)
        ranks = demos.gather_figures(env, pipe.lists, worst, result, result)
        worst = max(r.worst for r in ranks)
        ok &= worst <= 1e-10
        measured[name] = ranks
        say(f"{pipe.name}: max relative difference (loss and every gradient) {worst:.2e} "
            f"{'PASS' if worst <= 1e-10 else 'FAIL'} (tolerance 1e-10); measured timeline:\n"
            f"{pipeline_timeline([r.events for r in ranks], 150)}")
        if name == "zb-h1":
            same = demos.worst_difference((result.loss, {n: p.grad for n, p in chunks[0].named_parameters()}), *lesson)
            ok &= same <= 1e-12
            say(f"the machine (zb_h1's lists through SplitExecutor) against the lesson's zb_h1_step (loss and every "
                f"gradient): {same:.2e} {'PASS' if same <= 1e-12 else 'FAIL'} (tolerance 1e-12)")
    peaks = {name: [r.peak_bytes for r in ranks] for name, ranks in measured.items()}
    say("\npeak stored activation bytes per rank (outputs deallocated; ZB: X and dY kept for W counted):")
    for name in pipes:
        say(f"  {pipes[name].name:6s} {peaks[name]}  ({', '.join(f'{a / b:.2f}' for a, b in zip(peaks[name], peaks['1f1b']))} of 1F1B's)")
    extra = [a - b for a, b in zip(peaks["zb-h1"], peaks["1f1b"])]
    m_w = extra[1] if pp > 1 else 0  # what W keeps of one microbatch: X and dY of each linear layer
    say(f"  ZB-H1 holds r M_W more than 1F1B on rank r: {extra} = r x {m_w:,}  "
        f"{'(equal)' if extra == [r * m_w for r in range(pp)] else '(DIFFERENT)'}\n  measured, M_W is close to M_B here (the simulation assumed M_B/2): W "
        f"keeps each linear layer's X and dY, and what B needs beyond them, the attention's\n  s^2 terms "
        f"(Korthikanti's 5as^2b of 34sbh + 5as^2b a layer), is small at T={args.seq_len}; so ZB-H1's later ranks "
        f"hold nearly pp M_B,\n  rank 0 no more than 1F1B's")
    if env.device.type == "cpu":
        say(f"  measured timelines are not the simulated ones: here {pp} ranks share this machine's cores")
    ok &= prove_v_schedules(env, cfg, args, ref, embed_group, sims["1f1b"], peaks["1f1b"], say)
    demos.write_trace(env, args.trace, {pipes[n].name: ranks for n, ranks in measured.items()}, say)
    say(f"\n{'PASS' if ok else 'FAIL'}")
    return ok


def prove_v_schedules(env, cfg, args, ref, embed_group, one_f_one_b, one_bytes, say):
    """V-Half, V-Min (a building block repeated) and DualPipeV: simulated peak memory per rank against
    1F1B's beside the table's 1/2 and 1/3, the bubble against the block (it idles in its warm-up and
    cool-down only) and beside the table's fraction of 1F1B's, each run against serial."""
    pp, m, (one, one_mem), ok = args.pp, args.microbatches, one_f_one_b, True
    say("\n=== V schedules with controllable memory (Qi et al. 2024) and DualPipeV, t_F = t_I = t_W ===")
    say(f"memory in chunks (half a stage's activations of one microbatch; M_W = M_B/2), as a share of 1F1B's peak "
        f"(its rank 0's); 1F1B per rank: "
        f"{[2 * x for x in one_mem]}; bubble: 02's, total idle / total busy; 1F1B's B = (pp-1)/m = {one.bubble}")
    for name, share, table in (("v-half", Fraction(1, 2), "B/2"), ("v-min", Fraction(1, 3), "2B/3 (+O(pp))"),
                               ("dualpipev", None, None)):
        if name == "dualpipev" and m < 2 * pp:
            say(f"  DualPipeV: not run, m = {m} < 2pp = {2 * pp} (it needs a microbatch per stage)")
            continue
        pipe = pipeline_schedule(name, pp, m)
        sim, mem = simulate(pipe)
        ratios = ", ".join(f"{float(a / (2 * max(one_mem))):.2f}" for a in mem)  # of 1F1B's peak, its rank 0's
        if share is not None:
            block = v_block(pp, V_SCHEDULES[name][1])
            arithmetic = [lifespan_peak(pp, block, r, Fraction(1, 2)) for r in range(pp)]
            say(f"  {pipe.name}: peak {[str(x) for x in mem]} = {ratios} of 1F1B's (the table: {share}); lifespan "
                f"arithmetic {'(same)' if mem == arithmetic or m < 2 * pp else '(DIFFERENT)'}, at most 1F1B's "
                f"rank 0 x {share} + 2 = {2 * pp * share + 2}: {'yes' if max(mem) <= 2 * pp * share + 2 else 'NO'}")
            twice, wide = simulate(pipeline_schedule(name, pp, 2 * m))[1], simulate(pipeline_schedule(name, 8, 24))[1]
            form, mine = AUTHORS_FORM[name](pp), Fraction(max(arithmetic)) / 2  # in microbatches of a whole stage
            ok &= mine <= form
            near = [within_a_tenth(name, share, w) for w in (Fraction(1, 2), 1)]
            say(f"    the authors' form (microbatches of a stage): {form} = {form / pp:.3f} of 1F1B's {pp}; the lifespan "
                f"arithmetic {mine} = {float(mine / pp):.3f}, {'the same' if mine == form else 'less' if mine < form else 'MORE'}"
                f"; within 10% of {share} (pp <= 40): first at pp {near[0][0]}, every pp from {near[0][1]}\n"
                f"    (at M_W = M_B, what the meter measures here: {lifespan_share(name, pp, 1):.3f} at this pp; first at pp "
                f"{near[1][0]}, every pp from {near[1][1]})")
            say(f"    the table's {share} is a limit as pp grows, not reached here: the peak is the steady state's ("
                f"{'the same' if twice == mem else 'not yet the same'} at m = {2 * m}), within a chunk or two of "
                f"{share} of 1F1B's 2pp chunks\n    (at pp 8: {float(max(wide) / 16):.2f}); measured adds what W keeps "
                f"(about M_B here, not the M_B/2 simulated), and on rank 0 both ends of the V")
            # A repeated block idles in its warm-up and cool-down only: on every rank alike, the same at m + 1.
            more, _ = simulate(pipeline_schedule(name, pp, m + 1))
            span = block_idle_bound(block)
            same = len(set(sim.idle)) == 1 and more.idle == sim.idle and sim.idle[0] <= span
            ok &= same and max(mem) <= 2 * pp * share + 2
            form = one.idle[0] * (1 - share)  # B/2 and 2B/3 of 1F1B's idle 3(pp-1), at equal times
            exact = sim.idle[0] == form if name == "v-half" else abs(sim.idle[0] - form) <= Fraction(1, 2)
            say(f"    idle per rank {sim.idle[0]} on every rank, at m + 1 too, within the block's span less a period "
                f"({span}): {'yes' if same else 'NO'}; bubble {sim.bubble} = {float(sim.bubble / one.bubble):.2f} of "
                f"1F1B's B, its Ws moved into the gaps (fill_with_ws); the table's {table} = idle {form}: "
                f"{('equal' if name == 'v-half' else 'within half a pass') if exact else 'NOT met at this pp'}")
        else:
            over, _ = simulate(pipe, overlap=True)  # DeepSeek's PP/2 is pp; a chunk's F = W = 1/2, B = 1, F&B = max(F, B)
            formula = (pp - 1) * (1 + 1 - 3 * Fraction(1, 2))  # (PP/2-1)(F&B + B - 3W)
            ok &= max(over.idle) == formula
            say(f"  DualPipeV: peak {[str(x) for x in mem]} = {ratios} of 1F1B's; idle per rank {[str(x) for x in sim.idle]}"
                f" with F&B back to back (as it runs here);\n    charged overlapped (F&B = max(F, B), simulate(overlap="
                f"True)): {[str(x) for x in over.idle]}, the most {max(over.idle)} = DeepSeek's (PP/2-1)(F&B + B - 3W) = "
                f"{formula}: {'yes' if max(over.idle) == formula else 'NO'}")
        pipeline.validate(pipe, m)
        worst, result, chunks = run_schedule(env, cfg, pipe, ref, embed_group)
        ranks = demos.gather_figures(env, pipe.lists, worst, result, result)
        worst = max(r.worst for r in ranks)
        ok &= worst <= 1e-10
        peak = [r.peak_bytes for r in ranks]
        say(f"    against serial (loss and every gradient): {worst:.2e} {'PASS' if worst <= 1e-10 else 'FAIL'} "
            f"(tolerance 1e-10); measured peak activation bytes {peak} = "
            f"{', '.join(f'{a / max(one_bytes):.2f}' for a in peak)} of 1F1B's peak")
    return ok


# ----------------------------------------------------------------------------------------------
# After the concept: the demo's flags, the trainer's (--train: 05's loop, with --schedule), the
# command line.


@dataclass
class DemoConfig(pipeline.PipelineDemoConfig):
    pp: int = 4  # pipeline ranks: CPU ranks started here, or torchrun's world


@dataclass
class ZeroBubble:
    schedule: Literal["zb-h1", "zb-v", "v-half", "v-min", "dualpipev"] = "zb-v"  # 06's schedule: ZB-H1, or a V: ZB-V, V-Half, V-Min, DualPipeV


@dataclass
class TrainConfig(ZeroBubble, gpt3d.TrainConfig):
    """05's flags and --schedule."""


def parser():
    p = cli.demo_parser(__doc__, DemoConfig, tensor_parallel.GPTConfig, vocab_size=1001, block_size=64, n_layer=8,
                        n_head=4, n_embd=64)
    p.add_argument("--train", action="store_true", help="train with 05's loop instead: every flag of 05, and "
                   "--schedule zb-h1|zb-v|v-half|v-min|dualpipev (see --train --help)")
    return p


def schedule_of(tc):
    """The trainer's seam (05's train and main): --schedule's PipelineSchedule."""
    return pipeline_schedule(tc.schedule, tc.pp, tc.microbatches)


def train(env, cfg, tc, quiet=False):
    """05's training loop on one rank, with --schedule's pipeline schedule."""
    return gpt3d.train(env, cfg, tc, quiet, schedule_of)


def start_demo(cfg, args):
    if cfg.n_layer % (2 * args.pp):  # refused before any rank starts, as every other flag is
        raise ValueError(f"--n-layer {cfg.n_layer}: ZB-V cuts the model into 2 x pp = {2 * args.pp} stages, and "
                         f"n_layer is not divisible by them")
    return all(tensor_parallel.launch(demo, args.pp, cfg, args))


def main():
    return command.later_chapter(parser, ZeroBubble, "zero bubble (06)", TrainConfig, schedule_of, start_demo)


if __name__ == "__main__":
    run_main(main)
