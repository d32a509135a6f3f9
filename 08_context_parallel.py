"""08 - Context parallelism: a long sequence split over ranks, exact (Li et al. 2023, "LightSeq:
Sequence Level Parallelism for Distributed Training of Long Context Transformers", Section 3; and
Megatron Core's and TransformerEngine's context parallelism).

What this file adds on top of 01-05: a sequence too long for one rank's memory is cut along T over
cp ranks. Everything but attention works on a token alone (the embeddings, LayerNorm, the MLP, the
loss), so each rank runs it on its own T/cp tokens; attention needs every earlier token's key and
value, so those travel.
  - The lesson, read first: one ring, the contiguous split (rank r holds block r of every sequence,
    its tokens embedded at their true positions). The keys and values go round the ring one hop a
    step (pass_on); at step s rank r attends to block (r - s) mod cp, causally masked on its own,
    skipped when later, each block merged into the running output by the log-sum-exp (the online
    softmax); backward is the reverse ring, dK and dV travelling with their block and a last hop
    bringing them home (OneRing). Each rank's loss is its tokens' sum over the whole batch's count,
    so the shares add up to the serial mean; every gradient is summed over the ring (ring_step).
  - The machine, read second, which the trainer and 09 build on: the split and the ring as data, a
    schedule being every rank's list of blocks per ring step (RingSchedule), run by one general
    ring (ring_forward, ring_backward) on FlashAttention-2's recurrences in plain torch
    (block_forward, merge, block_backward); each exchange sends only what a step needs, straight to
    the rank that needs it (LightSeq's DistAttn). Causal balance is a list: a contiguous split leaves
    the last rank 2 - 1/cp times the mean work; Megatron's and TransformerEngine's split into 2 cp
    chunks (rank i holds i and 2cp - 1 - i) evens it; LightSeq keeps the contiguous split and lets the
    ranks that finish early compute part of a busy rank's attention, sending the partial result
    home. Dense gradients are averaged over dp x cp together, the loss multiplied by cp first, as
    Megatron does.
After the concept: LightSeq's rematerialization-aware checkpointing (--recompute lightseq), and 05's
trainer with cp in the rank grid (tp fastest, then cp, dp, pp: Megatron's order); its --cp-attention
ulysses is the contrast, DeepSpeed-Ulysses' all-to-all of heads (plumbing/ulysses.py).

Run it:
    python 08_context_parallel.py                          # 4 CPU ranks: cp = 2 and cp = 4, float64
    python 08_context_parallel.py --seq-len 64 --n-layer 1 --batch-size 1
    python 08_context_parallel.py --train --cp 2 --tp 1 --pp 2 --dp 2 --steps 50
    torchrun --nproc-per-node 4 08_context_parallel.py     # one rank per GPU

The demo runs the lesson against the serial GPT-2 from the same float64 weights at cp = 2 and 4
(loss and every gradient within 1e-10); then prints the three schedules' work per rank and ring
step with their balance factors (1.50, 1.75 and 1.88 for the contiguous split at cp = 2, 4, 8), every
ring message of one layer with its bytes, runs the machine at cp = 2 and 4 with each schedule, each
against serial (1e-10) and against the lesson (1e-12), and prints every gradient's worst relative
difference and the peak activation bytes per rank at cp = 1, 2 and 4. It exits 1 on a mismatch.
"""
import contextlib
import functools
import importlib
import math
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

from plumbing import cli, demos
from plumbing.checks import check_context, check_rows, check_split
from plumbing.launch import gather_numbers, printer, run_main
from plumbing.launch import new_tp_group as cp_groups  # this rank's group of cp consecutive ranks
from plumbing.meter import ActivationMeter
from plumbing.rings import report_balance, report_messages, report_parity, validate  # the lists checked, printed
from plumbing.rings import message_bytes  # noqa: F401 (re-exported: one ring message's bytes)
from plumbing.ulysses import AllToAll, ulysses, ulysses_core  # noqa: F401 (the contrast: --cp-attention ulysses)

tensor_parallel = importlib.import_module("01_tensor_parallel")
pipeline = importlib.import_module("02_pipeline_1f1b")
gpt3d = importlib.import_module("05_3d_gpt")


# ----------------------------------------------------------------------------------------------
# The lesson: one ring, as one writes it on a whiteboard. The sequence is cut into cp contiguous
# blocks of T/cp tokens; rank r of the cp group holds block r of every sequence, so its own q, k
# and v (B, nh, T/cp, hs). Everything but attention works on a token alone, so a rank runs it on its
# own block; attention needs every earlier token's keys and values, so those go round the ring.


def pass_on(group, *ts):
    """One hop of the ring: each tensor of ts sent to the next rank, the previous rank's received in
    its place; every send and receive posted as one batch, so no rank waits for another to go first."""
    r, cp = dist.get_rank(group), dist.get_world_size(group)
    if cp == 1:  # a ring of one: the next rank and the previous are this one (gloo sends to no rank itself)
        return list(ts)
    nxt, prev = (dist.get_global_rank(group, (r + d) % cp) for d in (1, -1))
    ts = [t.contiguous() for t in ts]  # q, k, v are views of the fused projection's output
    got = [torch.empty_like(t) for t in ts]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in ts]
    ops += [dist.P2POp(dist.irecv, g, prev, group) for g in got]
    for work_ in dist.batch_isend_irecv(ops):
        work_.wait()
    return got


def block_scores(q, k, own):
    """The scores q k^T / sqrt(hs) of a block of queries against a block of keys (B, nh, T/cp, T/cp);
    on the rank's own block causal: each query sees the keys up to its own position."""
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    return scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -math.inf) if own else scores


class OneRing(torch.autograd.Function):
    """Causal attention softmax(q k^T / sqrt(hs)) v of this rank's queries (block r) over the whole
    sequence. At step s the keys and values of block (r - s) mod cp visit, one hop further each step;
    the block's part is merged into the running output by the log-sum-exp (the online softmax).
    Backward is the reverse ring: the visiting block's dK and dV travel with it, and the last hop
    brings each block's gradients home."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        r, cp = dist.get_rank(group), dist.get_world_size(group)
        out, lse = torch.zeros_like(q), q.new_full((*q.shape[:-1], 1), -math.inf)  # no key seen yet
        kb, vb = k, v  # the visiting block: at step 0, this rank's own
        for s in range(cp):
            if s > 0:
                kb, vb = pass_on(group, kb, vb)  # now block (r - s) mod cp's, from the previous rank
            src = (r - s) % cp
            if src > r:  # a later block: its keys are in every one of these queries' future
                continue
            scores = block_scores(q, kb, src == r)
            new = torch.logaddexp(lse, scores.logsumexp(-1, keepdim=True))  # log-sum-exp over every key so far
            out = torch.exp(lse - new) * out + torch.exp(scores - new) @ vb  # both parts rescaled to it
            lse = new
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, do):
        (q, k, v, out, lse), group = ctx.saved_tensors, ctx.group
        r, cp, scale = dist.get_rank(group), dist.get_world_size(group), q.shape[-1] ** -0.5
        D = (do * out).sum(-1, keepdim=True)  # rowsum(dO o): what softmax's backward needs of each row
        dq, kb, vb, dk, dv = torch.zeros_like(q), k, v, torch.zeros_like(k), torch.zeros_like(v)
        for s in range(cp):
            if s > 0:  # the visiting block and the gradients it has gathered so far, one hop on
                kb, vb, dk, dv = pass_on(group, kb, vb, dk, dv)
            src = (r - s) % cp
            if src > r:
                continue
            p = torch.exp(block_scores(q, kb, src == r) - lse)  # recomputed from the whole row's log-sum-exp
            ds = p * (do @ vb.transpose(-2, -1) - D)  # the scores' gradient
            dq += ds @ kb * scale  # dQ stays at home
            dk += ds.transpose(-2, -1) @ q * scale
            dv += p.transpose(-2, -1) @ do
        dk, dv = pass_on(group, dk, dv)  # the cp-th hop: every block's dK and dV back at its owner
        return dq, dk, dv, None


def ring_gpt(cfg, group, **factory):
    """01's ParallelGPT (tp = 1: whole, on every rank of the ring) with each block's attention run
    through the ring (ring_attention); the demo's dropout is 0."""
    model = tensor_parallel.ParallelGPT(cfg, **factory)
    for block in model.transformer.h.values():
        block.attn.forward = functools.partial(ring_attention, block.attn, group)
    return model


def ring_attention(attn, group, x):
    """01's ParallelAttention.forward with OneRing in scaled_dot_product_attention's place: x (B, T/cp, C)."""
    q, k, v = rearrange(attn.c_attn(x), "B T (three nh hs) -> three B nh T hs", three=3, hs=attn.hs)
    return attn.c_proj(rearrange(OneRing.apply(q, k, v, group), "B nh T hs -> B T (nh hs)"))


def ring_step(model, idx, targets, group):
    """One forward and backward of this rank's block of the batch (B, T) on its ring: returns the
    serial model's mean loss; every gradient ends summed over the ring's ranks."""
    r, cp, T = dist.get_rank(group), dist.get_world_size(group), idx.shape[1]
    if T % cp:  # before the first message
        raise ValueError(f"ring_step: T={T} tokens do not split into cp={cp} equal blocks")
    pos = torch.arange(r * T // cp, (r + 1) * T // cp, device=idx.device)  # block r's true positions
    tr = model.transformer
    x = tr.wte(idx[:, pos]) + tr.wpe(pos)  # (B, T/cp, C): each token at its own position's row
    for block in tr.h.values():
        x = block(x)  # LayerNorm, the projections, the MLP: token by token; attention: the ring
    logits = model.lm_head(tr.ln_f(x))  # (B, T/cp, V)
    mine = F.cross_entropy(logits.flatten(0, 1), targets[:, pos].flatten(), ignore_index=-100, reduction="sum")
    loss = mine / (targets != -100).sum().clamp(min=1)  # over the whole batch's count: the shares add to the mean
    loss.backward()
    for p in model.parameters():  # a weight's gradient is the sum over every token's: over every rank's
        dist.all_reduce(p.grad, group=group)
    return tensor_parallel.all_reduce(loss.detach(), group)


def demo(env, cfg, args):
    say, dt, T = printer(env), torch.float64, args.seq_len
    if env.world_size != 4:  # before the first collective
        raise ValueError(f"the demo runs cp = 1, 2 and 4 on 4 ranks, and this world has {env.world_size}: "
                         f"torchrun --nproc-per-node 4")
    say(f"{cfg}\nB={args.batch_size} T={T} float64, world={env.world_size} ({dist.get_backend()})")
    groups = {cp: cp_groups(env, cp) for cp in (1, 2, 4)}  # every rank creates every group, in one order
    full = tensor_parallel.init_state_dict(cfg, args.seed, dtype=dt, random_all=True)
    gen = torch.Generator().manual_seed(args.seed + 1)
    idx, targets = torch.randint(cfg.vocab_size, (2, args.batch_size, T), generator=gen).to(env.device)
    targets[0, :T // 3] = -100  # some tokens not counted, unevenly over the ranks: the first row
    targets[0, T // 3 + 1:] = -100  # counts one target alone, which one rank holds (docs/LOSS.md)
    serial = tensor_parallel.ParallelGPT(cfg, dtype=dt, device=env.device)
    serial.load_full_state_dict(full)
    ref_logits, ref_loss = serial(idx, targets)
    ref_loss.backward()
    ref = ref_loss.detach(), {n: p.grad for n, p in serial.named_parameters()}
    lessons, ok = {}, True
    for cp in (2, 4):
        model = ring_gpt(cfg, groups[cp], dtype=dt, device=env.device)
        model.load_full_state_dict(full)
        lessons[cp] = ring_step(model, idx, targets, groups[cp]), {n: p.grad for n, p in model.named_parameters()}
        worst = demos.worst_difference(lessons[cp], *ref)
        ok = ok and worst <= 1e-10
        say(f"the lesson, one ring at cp={cp}: loss {lessons[cp][0].item():.12f} (serial {ref_loss.item():.12f}), "
            f"max relative difference against serial (loss and every gradient): {worst:.2e} "
            f"{'PASS' if worst <= 1e-10 else 'FAIL'} (tolerance 1e-10)")
    return prove_machine(env, cfg, groups, (idx, targets), full, (ref_logits, *ref), lessons, say) and ok


# ----------------------------------------------------------------------------------------------
# Read second: the machine, which the trainer and 09 build on, and which the demo proves equal to the
# lesson. Its ring is general: the splits and their steps are data, each step's messages derived
# from them, so a balanced split (Megatron's, LightSeq's) is a list, not another loop.
#
# The split, and the schedules as data. The sequence is cut into n equal blocks (n = cp, or 2 cp
# for Megatron's split); split[r] lists rank r's blocks in the order of its rows. A schedule is
# every rank's list of ring steps, each a list of Blocks: at step s, rank r works with its visitor,
# the rank s places before it on the ring, (r - s) mod cp, and with nobody else.


@dataclass(frozen=True)
class Block:
    q: int  # the query block (of the sequence's n)
    kv: int  # the key and value block: q >= kv, causal (q == kv: the diagonal, half the work)


@dataclass
class RingSchedule:
    name: str
    split: list  # split[r]: the sequence blocks rank r holds, in row order
    steps: list  # steps[r][s]: the Blocks rank r computes at ring step s

    def __post_init__(self):
        self.cp, self.n = len(self.split), sum(map(len, self.split))
        self.owner = {b: r for r, blocks in enumerate(self.split) for b in blocks}


def ring(name, split):
    """At step s rank r meets (r - s) mod cp and computes every causal block between its queries
    and the visitor's keys and values: the ring attention of Megatron, TransformerEngine and torch."""
    cp = len(split)
    return RingSchedule(name, split, [[[Block(q, kv) for q in split[r] for kv in split[(r - s) % cp] if q >= kv]
                                       for s in range(cp)] for r in range(cp)])


def contiguous(cp):
    """Rank r holds block r: it attends to r + 1/2 blocks, the last rank to cp - 1/2."""
    return ring("contiguous", [[r] for r in range(cp)])


def megatron(cp):
    """Megatron's and TransformerEngine's split into 2 cp blocks: rank i holds i and 2cp - 1 - i,
    an early block and a late one, whose causal work adds up to the same on every rank."""
    return ring("megatron", [[r, 2 * cp - 1 - r] for r in range(cp)])


def lightseq(cp):
    """LightSeq's balanced schedule (its Figure 2): the contiguous split, in cp // 2 + 1 steps. The
    block (q i, kv j) at distance d = i - j is computed at step d by i, its query's owner, while
    d <= cp // 2; a longer one at step cp - d by j, which has run out of work of its own by then: j's
    visitor at that step is i, whose query it borrows, and to which it sends the partial result."""
    steps = [[[] for _ in range(cp // 2 + 1)] for _ in range(cp)]
    for i in range(cp):
        for j in range(i + 1):
            d = i - j
            steps[i][d].append(Block(i, j)) if d <= cp // 2 else steps[j][cp - d].append(Block(i, j))
    return RingSchedule("lightseq", [[r] for r in range(cp)], steps)


SPLITS = {"contiguous": contiguous, "megatron": megatron, "lightseq": lightseq}


def positions(sched, rank, T, device=None):
    """The true positions of rank's rows: its blocks of T / n tokens each, in row order."""
    check_split(sched, T, "positions")  # T // n would drop the last T mod n tokens without a word
    c = T // sched.n
    return torch.cat([torch.arange(b * c, (b + 1) * c, device=device) for b in sched.split[rank]])


def work(block):
    """A block's share of causal attention, in full (T/n)^2 blocks: the diagonal is half of one."""
    return Fraction(1, 2) if block.q == block.kv else Fraction(1)


def messages(sched, s, backward=False):
    """Exchange s, before step s: [(sender, receiver, kind, block)]. What step s borrows from a
    visitor: its keys and values ("kv") or its queries ("q": in backward with dO, the log-sum-exp and
    D = rowsum(dO o)); what step s - 1 computed for a visitor, sent home: a partial attention of its
    queries ("out"), in backward their gradient ("dq") and that of its keys and values ("dkv")."""
    out = set()
    for r in range(sched.cp):
        steps = sched.steps[r]
        for blk in steps[s] if s < len(steps) else []:  # borrowed for step s
            out |= {(sched.owner[b], r, kind, b) for kind, b in (("kv", blk.kv), ("q", blk.q)) if sched.owner[b] != r}
        for blk in steps[s - 1] if 0 < s <= len(steps) else []:  # computed for a visitor at step s - 1
            back = [("dq", blk.q), ("dkv", blk.kv)] if backward else [("out", blk.q)]
            out |= {(r, sched.owner[b], kind, b) for kind, b in back if sched.owner[b] != r}
    return sorted(out)


# ----------------------------------------------------------------------------------------------
# The blocks: FlashAttention-2's recurrences (Dao 2023, Algorithms 1 and 2) in plain torch. A
# partial attention of some query rows is a State: the running max m of their scores, the sum l of
# exp(score - m), and acc = sum of exp(score - m) v. Two States over different keys merge exactly.


@dataclass
class State:
    m: torch.Tensor  # (B, nh, c): the rows' largest score so far
    l: torch.Tensor  # noqa: E741 (B, nh, c): sum of exp(score - m)
    acc: torch.Tensor  # (B, nh, c, hs): sum of exp(score - m) v


def block_forward(q, k, v, diagonal, scale):
    """One block's partial attention: the scores of c query rows against c keys, causal inside the
    block on the diagonal (q and kv the same positions), every key earlier otherwise."""
    s = q @ k.transpose(-2, -1) * scale  # (B, nh, c, c)
    if diagonal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
    m = s.amax(-1)
    p = torch.exp(s - m[..., None])
    return State(m, p.sum(-1), p @ v)


def merge(a, b):
    """The online-softmax rule: both States rescaled to the larger max, then added. None is empty."""
    if a is None or b is None:
        return a or b
    m = torch.maximum(a.m, b.m)
    ea, eb = torch.exp(a.m - m), torch.exp(b.m - m)
    return State(m, ea * a.l + eb * b.l, ea[..., None] * a.acc + eb[..., None] * b.acc)


def finish(st):
    """The attention output o = acc / l and the rows' log-sum-exp m + log l, which backward needs."""
    return st.acc / st.l[..., None], st.m + torch.log(st.l)


def block_backward(q, k, v, do, lse, D, diagonal, scale):
    """One block's gradients from the final output's: the probabilities recomputed from the saved
    log-sum-exp, P = exp(s - lse); dV = P^T dO; dS = P (dO V^T - D), D = rowsum(dO o); dQ = dS K,
    dK = dS^T Q (each times the scale)."""
    s = q @ k.transpose(-2, -1) * scale
    if diagonal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
    p = torch.exp(s - lse[..., None])
    ds = p * (do @ v.transpose(-2, -1) - D[..., None])
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ do


# ----------------------------------------------------------------------------------------------
# Ring attention: one rank's part of the schedule, forward and backward. Each step's exchange goes
# out as one batch of point-to-point messages (every rank posts its own, so none can deadlock), then
# the step computes its blocks. Every rank sends only what it owns, straight to the rank that needs
# it (LightSeq's choice); Megatron relays the visitor's keys hop by hop, the same bytes per step.


def exchange(sched, s, group, send, like, widths, backward=False):
    """Post exchange s: send(kind, block) gives what this rank sends; returns {(kind, block): tensor}
    received, each (B, nh, c, widths[kind])."""
    rank, ops, got = dist.get_rank(group), [], {}
    for src, dst, kind, b in messages(sched, s, backward):
        if src == rank:
            ops.append(dist.P2POp(dist.isend, send(kind, b).contiguous(), dist.get_global_rank(group, dst), group))
        elif dst == rank:
            got[kind, b] = like.new_empty(*like.shape[:-1], widths[kind])
            ops.append(dist.P2POp(dist.irecv, got[kind, b], dist.get_global_rank(group, src), group))
    for work_ in dist.batch_isend_irecv(ops) if ops else []:
        work_.wait()
    return got


def ring_forward(q, k, v, sched, group):
    """This rank's rows of causal attention (B, nh, T/cp, hs) over the whole sequence: (o, lse)."""
    dtype = q.dtype  # bf16 and fp16 are computed in float32, as FlashAttention-2 keeps its sums, and travel so
    q, k, v = (t.float() if dtype in (torch.float16, torch.bfloat16) else t for t in (q, k, v))
    r, hs = dist.get_rank(group), q.shape[-1]
    check_rows(sched, r, q, k, v, "ring_forward")  # T comes from the shapes: it must split as the schedule does
    c, scale = q.shape[2] // len(sched.split[r]), 1 / math.sqrt(hs)
    rows = {b: slice(i * c, (i + 1) * c) for i, b in enumerate(sched.split[r])}  # my blocks' rows
    mine = lambda t, b: t[:, :, rows[b]]  # noqa: E731
    home, away = {}, {}  # States of my query blocks; of visitors' query blocks, computed here
    widths = {"kv": 2 * hs, "q": hs, "out": hs + 2}
    for s in range(len(sched.steps[r]) + 1):
        got = exchange(sched, s, group, lambda kind, b: {
            "kv": lambda: torch.cat([mine(k, b), mine(v, b)], -1), "q": lambda: mine(q, b),
            "out": lambda: (lambda st: torch.cat([st.acc, st.m[..., None], st.l[..., None]], -1))(away.pop(b)),
        }[kind](), q[:, :, :c], widths)
        for (kind, b), t in got.items():
            if kind == "out":  # a helper's partial attention of my queries
                home[b] = merge(home.get(b), State(t[..., -2], t[..., -1], t[..., :-2]))
        for blk in sched.steps[r][s] if s < len(sched.steps[r]) else []:
            qb = mine(q, blk.q) if blk.q in rows else got["q", blk.q]
            kb, vb = (mine(k, blk.kv), mine(v, blk.kv)) if blk.kv in rows else got["kv", blk.kv].chunk(2, -1)
            st = block_forward(qb, kb, vb, blk.q == blk.kv, scale)
            into = home if blk.q in rows else away
            into[blk.q] = merge(into.get(blk.q), st)
    o, lse = (torch.cat(t, 2) for t in zip(*(finish(home[b]) for b in sched.split[r])))
    return o.to(dtype), lse


def ring_backward(q, k, v, o, lse, do, sched, group):
    """The gradients of q, k and v from o's, over the same ring: dQ accumulates at home, dK and dV
    of a visitor's blocks travel back to it; a helper's dQ goes home too."""
    dtype = q.dtype  # in float32, as ring_forward
    q, k, v, o, do = (t.float() if dtype in (torch.float16, torch.bfloat16) else t for t in (q, k, v, o, do))
    r, hs = dist.get_rank(group), q.shape[-1]
    check_rows(sched, r, q, k, v, "ring_backward")  # T comes from the shapes: it must split as the schedule does
    c, scale = q.shape[2] // len(sched.split[r]), 1 / math.sqrt(hs)
    rows = {b: slice(i * c, (i + 1) * c) for i, b in enumerate(sched.split[r])}
    mine = lambda t, b: t[:, :, rows[b]]  # noqa: E731
    D = (do * o).sum(-1)  # (B, nh, T/cp)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    away_q, away_kv = {}, {}  # gradients of visitors' blocks computed here, to be sent home
    widths = {"kv": 2 * hs, "q": 2 * hs + 2, "dq": hs, "dkv": 2 * hs}
    for s in range(len(sched.steps[r]) + 1):
        got = exchange(sched, s, group, lambda kind, b: {
            "kv": lambda: torch.cat([mine(k, b), mine(v, b)], -1),
            "q": lambda: torch.cat([mine(q, b), mine(do, b), mine(lse, b)[..., None], mine(D, b)[..., None]], -1),
            "dq": lambda: away_q.pop(b), "dkv": lambda: away_kv.pop(b)}[kind](), q[:, :, :c], widths, True)
        for (kind, b), t in got.items():  # gradients of my blocks, computed by others
            if kind == "dq":
                dq[:, :, rows[b]] += t
            elif kind == "dkv":
                dk[:, :, rows[b]] += t[..., :hs]
                dv[:, :, rows[b]] += t[..., hs:]
        for blk in sched.steps[r][s] if s < len(sched.steps[r]) else []:
            if blk.q in rows:
                qb, dob, lseb, Db = mine(q, blk.q), mine(do, blk.q), mine(lse, blk.q), mine(D, blk.q)
            else:
                t = got["q", blk.q]
                qb, dob, lseb, Db = t[..., :hs], t[..., hs:2 * hs], t[..., -2], t[..., -1]
            kb, vb = (mine(k, blk.kv), mine(v, blk.kv)) if blk.kv in rows else got["kv", blk.kv].chunk(2, -1)
            gq, gk, gv = block_backward(qb, kb, vb, dob, lseb, Db, blk.q == blk.kv, scale)
            if blk.q in rows:  # dQ accumulates at home
                dq[:, :, rows[blk.q]] += gq
            else:
                away_q[blk.q] = away_q.get(blk.q, 0) + gq
            if blk.kv in rows:
                dk[:, :, rows[blk.kv]] += gk
                dv[:, :, rows[blk.kv]] += gv
            else:  # dK and dV travel back to their owner
                away_kv[blk.kv] = away_kv.get(blk.kv, 0) + torch.cat([gk, gv], -1)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


class RingAttention(torch.autograd.Function):
    """ring_forward, keeping what ring_backward needs: q, k, v, o and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, sched, group):
        o, lse = ring_forward(q, k, v, sched, group)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.sched, ctx.group = sched, group
        return o

    @staticmethod
    def backward(ctx, do):
        return *ring_backward(*ctx.saved_tensors, do, ctx.sched, ctx.group), None, None


# ----------------------------------------------------------------------------------------------
# The model, the loss and the gradients. 01's GPT, a whole model or a pipeline chunk of one, becomes
# this rank's part through three seams replaced on the instance: embed (its tokens, at their true
# positions), each block's attention core (RingAttention) and head (its tokens' targets, summed).


def context_parallel(chunk, sched, group):
    """Make `chunk` (01's GPT) this rank's part of the sequence split `sched` over `group`."""
    rank = dist.get_rank(group)
    if chunk.pre_process:
        chunk.embed = functools.partial(embed, chunk, sched, rank)
    for block in chunk.transformer.h.values():
        block.attn.core = functools.partial(ring_core, sched, group)
    if chunk.post_process:
        chunk.head = functools.partial(head, chunk.head, sched, rank)
    return chunk


def embed(chunk, sched, rank, idx):
    """This rank's tokens of idx (B, T): (B, T/cp, C), each with its true position's row of wpe; with
    sequence parallelism then split again over tp (T/(cp tp) rows). Dropout as 01's (cp = 1 only)."""
    pos = positions(sched, rank, idx.shape[1], idx.device)
    x = chunk.transformer.wte(idx[:, pos]) + chunk.transformer.wpe(pos)
    if chunk.sp:
        x = tensor_parallel.scatter_to_sp(x, chunk.group)
    p = chunk.cfg.dropout if chunk.training else 0.0
    with chunk.rng.fork() if p and chunk.sp else contextlib.nullcontext():
        return F.dropout(x, p, p > 0)


def ring_core(sched, group, q, k, v, p):
    """01's ParallelAttention.core, over the ring: q, k, v are (B, nh/tp, T/cp, hs); p is 0."""
    return RingAttention.apply(q, k, v, sched, group)


def head(head0, sched, rank, x, targets=None, ignore_index=-100):
    """01's head on this rank's rows, whose loss is the sum over its counted tokens (not their mean):
    divided by the whole batch's count, the ranks' shares add up to the serial model's mean."""
    if targets is None:
        return head0(x, None, ignore_index)
    mine = targets[:, positions(sched, rank, targets.shape[1], targets.device)]
    logits, loss = head0(x, mine, ignore_index)
    return logits, loss * (mine != ignore_index).sum()


def step(model, idx, targets, cp_group, grad_group):
    """One forward and backward on this rank: returns (its logits, the serial mean loss). Each rank's
    share is its sum over the count of every valid token; multiplied by cp, so that averaging the
    gradients over dp x cp (grad_group, as 04's buckets do) sums them over cp and averages over dp."""
    logits, total = model(idx, targets)
    loss = total / (targets != -100).sum().clamp(min=1)
    (loss * dist.get_world_size(cp_group)).backward()
    for p in model.parameters():  # dense gradients: averaged over dp x cp together
        dist.all_reduce(p.grad, group=grad_group)
        p.grad /= dist.get_world_size(grad_group)
    return logits, tensor_parallel.all_reduce(loss.detach(), cp_group)


# ----------------------------------------------------------------------------------------------
# The demo's machine part: the schedules' balance, the ring's messages, then the machine at cp = 2
# and 4 with each split, against serial and against the lesson, float64


def prove_machine(env, cfg, groups, batch, full, reference, lessons, say):
    """The schedules reported; context_parallel's model stepped by `step` at cp = 2 and 4, each split,
    its loss, logits and gradients against serial (1e-10) and its loss and gradients against the
    lesson at the same cp (1e-12); the peak activation bytes at cp = 1, 2 and 4."""
    (idx, targets), (ref_logits, ref_loss, ref_grads), dt = batch, reference, torch.float64
    B, T = idx.shape
    if env.rank == 0:
        report_balance(say, SPLITS, simulate, (2, 4, 8), show=4)
        report_messages(say, SPLITS, messages, cfg, B, T, 4)
    worst, peaks, against_lesson = {}, {}, 0.0
    for cp in (2, 4):
        for name, make in SPLITS.items():
            sched, group = make(cp), groups[cp]
            validate(sched)
            model = context_parallel(tensor_parallel.GPT(cfg, None, init=False, dtype=dt, device=env.device),
                                     sched, group)
            model.load_full_state_dict(full)
            logits, loss = step(model, idx, targets, group, group)
            diffs = {"loss": tensor_parallel.max_rel_diff(loss, ref_loss),
                     "logits": tensor_parallel.max_rel_diff(gather_sequence(logits.detach(), sched, group),
                                                            ref_logits.detach())}
            diffs.update({"grad " + n: tensor_parallel.max_rel_diff(p.grad, ref_grads[n])
                          for n, p in model.named_parameters()})
            everyone = gather_numbers(list(diffs.values()), device=env.device)
            for i, key in enumerate(diffs):
                worst[key] = max([worst.get(key, 0.0)] + [row[i] for row in everyone])
            lesson = demos.worst_difference((loss, {n: p.grad for n, p in model.named_parameters()}), *lessons[cp])
            against_lesson = max(against_lesson, lesson)
            say(f"cp={cp} {name:10s}: loss {loss.item():.12f} (serial {ref_loss.item():.12f}), worst relative "
                f"difference {max(max(row) for row in everyone):.2e}; from the lesson {lesson:.2e}")
    for cp in (1, 2, 4):
        sched = megatron(cp)
        model = context_parallel(tensor_parallel.GPT(cfg, None, init=False, dtype=dt, device=env.device),
                                 sched, groups[cp])
        model.load_full_state_dict(full)
        meter = ActivationMeter([model], {})
        with meter.forward(0):
            _, total = model(idx, targets)
        meter.measure()
        peaks[cp] = gather_numbers([meter.peak], device=env.device)
        total.backward()  # the ring's backward: every rank of the group takes part
    same = against_lesson <= 1e-12
    say(f"\nthe machine (context_parallel's model, every split, through step) against the lesson's ring_step at the "
        f"same cp (loss and every gradient): {against_lesson:.2e} {'PASS' if same else 'FAIL'} (tolerance 1e-12)")
    report_parity(say, worst, peaks)
    ok = max(worst.values()) <= 1e-10
    say(f"\n{'PASS' if ok and same else 'FAIL'}: worst relative difference {max(worst.values()):.2e} "
        f"(tolerance 1e-10)")
    return ok and same


# ----------------------------------------------------------------------------------------------
# After the concept: the simulator, which reads a schedule's lists as 02's reads its; the validator,
# which reads them too, is plumbing/rings.py's validate


@dataclass
class Balance:
    work: list  # work[r][s]: rank r's attention at step s, in (T/cp)^2 blocks (a diagonal one is 1/2)
    totals: list  # per rank
    factor: Fraction  # the busiest rank's work over the mean: 2 - 1/cp for the contiguous split
    time: Fraction  # the steps in lockstep: each as long as its busiest rank's work
    ideal: Fraction  # the mean work: the time if it were even


def simulate(sched):
    unit = Fraction(sched.cp, sched.n) ** 2  # a block of T/n rows is (cp/n)^2 of a (T/cp)^2 one
    w = [[sum((work(b) * unit for b in blocks), Fraction(0)) for blocks in steps] for steps in sched.steps]
    totals = [sum(row, Fraction(0)) for row in w]
    mean = sum(totals) / sched.cp
    return Balance(w, totals, max(totals) / mean, sum(max(col) for col in zip(*w)), mean)


# ----------------------------------------------------------------------------------------------
# After the concept: LightSeq's rematerialization-aware checkpointing (Section 3.3; --recompute
# lightseq). Checkpointing whole layers (--recompute full) reruns each layer's forward in backward,
# its attention too: the costliest part of a long sequence's layer (4 B T^2 C / cp FLOPs on a rank)
# and, here, the ring's whole forward exchange again. Keeping the attention's output o (and its
# log-sum-exp) beside the layer's input moves the checkpoint's boundary past it: backward reruns
# LayerNorm, the projections and the MLP (to get q, k, v and the MLP's inputs back) but never the
# attention forward; its backward takes the kept o. One more (B, T/cp, C) tensor per layer.


class Kept(torch.autograd.Function):
    """The attention core with o and lse given (kept from the first forward): what ring_backward needs."""

    @staticmethod
    def forward(ctx, q, k, v, o, lse, sched, group):
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.sched, ctx.group = sched, group
        return o.clone()

    @staticmethod
    def backward(ctx, do):
        return *ring_backward(*ctx.saved_tensors, do, ctx.sched, ctx.group), None, None, None, None


def rematerialize(chunk, sched, group):
    """Checkpoint every block of `chunk` at its input, its attention's output kept (in order, per block:
    1F1B runs a chunk's backwards in the order of its forwards)."""
    for block in chunk.transformer.h.values():
        kept, again = [], [False]
        block.attn.core = functools.partial(_kept_attention, sched, group, kept, again)
        block.forward = functools.partial(_checkpointed, block.forward, again)


def _checkpointed(forward, again, x):
    @contextlib.contextmanager
    def recomputing():
        again[0] = True
        try:
            yield
        finally:
            again[0] = False
    return gpt3d.checkpoint(forward, x, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(),
                                                                                 recomputing()))


def _kept_attention(sched, group, kept, again, q, k, v, p):
    if not torch.is_grad_enabled():  # no backward to come (the eval): nothing to keep
        return RingAttention.apply(q, k, v, sched, group)
    if again[0]:  # backward's rerun: the output kept, no ring
        o, lse = kept.pop(0)
    else:
        with torch.no_grad():
            o, lse = ring_forward(q, k, v, sched, group)
        kept.append((o, lse))
    return Kept.apply(q, k, v, o, lse, sched, group)


# ----------------------------------------------------------------------------------------------
# After the concept: 05's trainer with cp in the rank grid. Megatron's order, tp fastest, then cp,
# dp and pp: a cp group's ring stays inside a node next to tp. Gradients are averaged over dp x cp
# together, so the grid's "dp" groups (05's buckets, ZeRO-1's shards, the norm) are the dp x cp
# ranks of a (tp, pp) place, and a rank's share of the batch is its dp coordinate alone.


def rank_grid(world, tp=1, cp=1, dp=1, pp=1):
    """Every group of each kind as lists of global ranks: {"tp", "cp", "dp" (dp x cp), "pp", "embed"}."""
    if tp * cp * dp * pp != world:
        raise ValueError(f"the world size {world} does not match tp={tp} x cp={cp} x dp={dp} x pp={pp}")
    rank = lambda t, c, d, p: ((p * dp + d) * cp + c) * tp + t  # noqa: E731
    grid = {"tp": [[rank(t, c, d, p) for t in range(tp)] for p in range(pp) for d in range(dp) for c in range(cp)],
            "cp": [[rank(t, c, d, p) for c in range(cp)] for p in range(pp) for d in range(dp) for t in range(tp)],
            "dp": [[rank(t, c, d, p) for d in range(dp) for c in range(cp)] for p in range(pp) for t in range(tp)],
            "pp": [[rank(t, c, d, p) for p in range(pp)] for d in range(dp) for c in range(cp) for t in range(tp)]}
    grid["embed"] = [[g[0], g[-1]] for g in grid["pp"]] if pp > 1 else []
    return grid


@dataclass
class ContextParallelSchedule(gpt3d.PipelineSchedule):
    """05's schedule (1F1B or interleaved) on a grid with cp: prepare() makes each chunk this rank's
    part of the sequence, its executor weights the loss as step() does, and its wire carries T/cp rows."""
    cp: int = 1
    ring: object = None  # the RingSchedule (SPLITS), or None at cp = 1: 05's model as it is
    attention: str = "ring"  # or "ulysses": the all-to-all (after the concept)
    recompute: str = "none"  # 05's --recompute, or "lightseq": the attention's output kept

    def grid(self, world, tp, dp):
        grid = rank_grid(world, tp, self.cp, dp, self.pp)
        grid["embed"] = grid["embed"] if self.where[self.S - 1][0] else []
        return grid

    def replica(self, groups):
        return dist.get_rank(groups.dp) // self.cp  # the dp x cp group's rank is d cp + c

    def prepare(self, chunks, groups=None, full=None):
        for c in chunks if self.ring else []:
            context_parallel(c, self.ring, groups.cp)
            c.full_logits = functools.partial(_full_logits, c.full_logits, self.ring, groups.cp)
            if self.attention == "ulysses":
                ulysses(c, self.ring, groups.cp)
            if self.recompute == "selective":  # 05 wrapped 01's core; this one replaced it
                for block in c.transformer.h.values():
                    block.attn.core = functools.partial(gpt3d.checkpoint, block.attn.core, use_reentrant=False)
            elif self.recompute == "lightseq":
                rematerialize(c, self.ring, groups.cp)

    def executor(self, chunks, pp_group, wire, exchange=None, deallocate=True):
        if not self.ring:
            return super().executor(chunks, pp_group, wire, exchange, deallocate)
        b, T, C = wire.full if isinstance(wire, gpt3d.ScatterGather) else wire.shape
        shape = (b, T // self.cp, C)  # this rank's rows of the boundary tensor
        wire = gpt3d.ScatterGather(shape, wire.tp_group) if isinstance(wire, gpt3d.ScatterGather) else \
            pipeline.Wire(shape)
        return ContextParallelExecutor(self, chunks, pp_group, wire, exchange, deallocate)


def _full_logits(over_tp, sched, group, logits):
    """FullWeights.full_logits (over tp), then over cp: every rank's rows at their positions (B, T, V)."""
    return gather_sequence(over_tp(logits), sched, group)


class ContextParallelExecutor(pipeline.Executor):
    """02's executor weighting this rank's summed loss by num / den (05's normalization), by default as step()."""

    def run(self, microbatches, valid=None, norm=None, ignore_index=-100):
        valid = valid or [int((t != ignore_index).sum()) for _, t in microbatches]
        return super().run(microbatches, valid, norm or [(self.schedule.cp, sum(valid))] * len(valid), ignore_index)

    def output(self, mb, y):
        num, den = self.norm[mb]
        share = y[1] * (num / den if self.valid[mb] else 0.0)  # y[1]: a sum over this rank's tokens
        self.loss = share.detach() if self.loss is None else self.loss + share.detach()
        return share


def context_schedule(tc):
    """The trainer's seam (05's train and main): 05's pipeline schedule, with cp."""
    base = gpt3d.interleaved_schedule(tc)
    used = tc.cp > 1 or tc.recompute == "lightseq"
    return ContextParallelSchedule(base.lists, name=base.name + f", cp={tc.cp} ({tc.cp_schedule}, {tc.cp_attention})",
                                   cp=tc.cp, ring=SPLITS[tc.cp_schedule](tc.cp) if used else None,
                                   attention=tc.cp_attention, recompute=tc.recompute)


# ----------------------------------------------------------------------------------------------
# After the concept: the sequence gathered back, the demo's flags (its reports: plumbing/rings.py)


def gather_sequence(x, sched, group):
    """Every rank's rows (B, T/cp, ...) of x, all-gathered over group and put at their positions."""
    parts = [torch.empty_like(x) for _ in range(sched.cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    T = x.shape[1] * sched.cp
    out = x.new_empty(x.shape[0], T, *x.shape[2:])
    for r, part in enumerate(parts):
        out[:, positions(sched, r, T, x.device)] = part
    return out


@dataclass
class DemoConfig:
    batch_size: int = 2  # B, sequences
    seq_len: int = 32  # T, tokens per sequence: divisible by 2 cp = 8
    seed: int = 1234  # for the weights and the batch


@dataclass
class ContextParallel:
    cp: int = 2  # context-parallel size: the ranks each sequence is split over (rank order tp, cp, dp, pp)
    cp_schedule: Literal["megatron", "contiguous", "lightseq"] = "megatron"  # the split and its ring: Megatron's 2 cp chunks, contiguous, or LightSeq's helpers
    cp_attention: Literal["ring", "ulysses"] = "ring"  # the attention core: ring attention, or DeepSpeed-Ulysses' all-to-all of heads


RECOMPUTE = ("none", "selective", "full", "lightseq")


@dataclass
class TrainConfig(ContextParallel, gpt3d.TrainConfig):
    """05's flags, cp and its two choices, and --recompute lightseq."""
    GRID: ClassVar[tuple] = ("tp", "cp", "dp", "pp")  # the layout's sizes in rank order, fastest first (plumbing)
    recompute: Literal[RECOMPUTE] = "none"
    dp: int = 1  # 05's default is 2: with cp = 2, tp = 2 x cp = 2 x pp = 2 is 05's 8 ranks

    @property
    def sequence_split(self):  # the ranks one sequence is split over (plumbing.checks.check_memory)
        return self.cp

    def __post_init__(self):
        if self.cuda_graphs is None and self.cp > 1:  # unset: on where the layout allows; a ring's p2p is not captured
            self.cuda_graphs = False

    def check_relations(self, cfg, world=None):
        """The relations of 08's flags to the others (plumbing.checks.check_config calls it, before
        anything starts): plumbing/checks.py's check_context, each refusal naming the flag, the value and the constraint."""
        check_context(self, cfg, SPLITS)


def parser():
    p = cli.demo_parser(__doc__, DemoConfig, tensor_parallel.GPTConfig, vocab_size=1001, block_size=64, n_layer=2,
                        n_head=4, n_embd=64)
    p.add_argument("--train", action="store_true", help="train with 05's loop instead: every flag of 05, and "
                   "--cp, --cp-schedule, --cp-attention, --recompute lightseq (see --train --help)")
    return p


def train_parser():
    """05's flags, 08's, and --recompute's choice lightseq."""
    p = gpt3d.parser()
    cli.add_dataclass_args(p, ContextParallel, "context parallelism (08)")
    p.set_defaults(dp=TrainConfig.dp)
    recompute = p._option_string_actions["--recompute"]
    recompute.choices, recompute.help = RECOMPUTE, recompute.help.replace(
        "whole layers", "whole layers, or whole layers but the attention (lightseq: its output kept)")
    return p


def train(env, cfg, tc, quiet=False):
    """05's training loop on one rank, with context parallelism."""
    return gpt3d.train(env, cfg, tc, quiet, context_schedule)


def start_demo(cfg, args):
    if args.seq_len % 8:
        raise ValueError(f"--seq-len {args.seq_len}: the demo cuts it into 2 cp = 8 blocks at cp = 4; it must be "
                         f"divisible by 8")
    return all(tensor_parallel.launch(demo, 4, cfg, args))  # --dropout > 0: refused by cli.demo_args


def main():
    """With --train, 05's trainer with 08's flags (plumbing/command.py); without, the demo."""
    if "--train" in sys.argv[1:]:
        sys.argv.remove("--train")
        return gpt3d.main(train_parser, TrainConfig, context_schedule)
    cfg, args = cli.demo_args(parser(), train_parser=train_parser())
    return start_demo(cfg, args)


if __name__ == "__main__":
    run_main(main)
