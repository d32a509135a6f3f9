"""09 - Expert parallelism: a GPT-2 with mixture-of-experts layers, its experts spread over ep ranks,
and MoE Parallel Folding (Liu et al. 2025, "MoE Parallel Folding: Heterogeneous Parallelism Mappings
for Efficient Large-Scale MoE Model Training with Megatron Core", arXiv:2504.14960).

What this file adds on top of 01-05 (and 08): a fifth dimension. Every moe_every-th block's MLP
becomes E experts (each a GPT-2 MLP, 01's ParallelMLP) and a router that sends each token to k of them.
  - The lesson, read first: one dispatch and one combine as plain code (MoE), every collective inline.
    The router: a linear layer to E logits, softmax, the top k, their k probabilities renormalised to
    sum to 1 (Mixtral's convention, Jiang et al. 2024, and Megatron's default, a softmax over the k
    chosen logits, which is the same function). Then, as Megatron's and torchtitan's dispatchers do:
    (1) sort this rank's (token, expert) pairs by expert, (2) exchange the counts with an all-to-all,
    (3) send the tokens with an uneven all-to-all, (4) run each local expert once on the rows it
    received from every rank, (5) combine: the reverse all-to-all, then each row weighted by its router
    probability and added back in its token's place. The all-to-all's backward is the reverse
    all-to-all (AllToAll). Dropless: every token goes where it is sent. The auxiliary loss (aux_loss):
    Switch's and GShard's E sum_i f_i P_i over the microbatch's counted tokens, with --aux-loss-coeff
    (0: off). Every rank is a replica of the dense model on its rows of the batch; the experts'
    gradients are summed over edp (the ranks holding the same experts), the dense ones over every rank.
  - The machine, read second, which the trainer runs: the same layer as MoELayer over Plan, dispatch
    and combine, with the seams the rest needs, and parallel folding: attention keeps 05's tp x dp x pp
    grid (08's tp x cp x dp x pp with context parallelism); the experts get their own etp x ep x edp x
    pp grid over the same ranks (fold), both in Megatron's order tp-cp-ep-dp-pp, the pipeline groups
    the same in both (checked). So an ep group may span attention's tp and dp groups (tp 2 x dp 2 ->
    ep 4), or its tp and cp groups (tp 2 x cp 2 -> ep 4: a sequence's tokens meet in one all-to-all),
    and the load-balancing loss is summed over the tp x cp ranks that split a microbatch. Expert
    gradients are summed over edp, dense ones over dp x cp, both divided by dp x cp.
The serial MoE layer is the same class with no groups, as tp = 1 is the serial GPT-2. After the
concept: a capacity factor (tokens over an expert's capacity dropped, the rest padded to a fixed
shape, as GShard and Switch do), experts tensor-parallel over etp > 1 ranks (01's sequence-parallel
pair inside each expert), and the trainer's seam (05's loop), checkpoints that reshard experts, and
upcycling a dense GPT-2. With --cp, 08's seams make each rank hold T/cp of every sequence first.

Run it:
    python 09_expert_parallel.py                     # tp 2 x dp 2 -> ep 4: 4 CPU ranks, E = 8, top-2
    python 09_expert_parallel.py --tp 1 --dp 4 --ep 2 --top-k 1 --num-experts 4
    python 09_expert_parallel.py --tp 2 --cp 2 --dp 1 --ep 4 # tp 2 x cp 2 -> ep 4: 08's split
    python 09_expert_parallel.py --train --num-experts 4 --top-k 2 --ep 4 --tp 2 --dp 2 --pp 2
    python 09_expert_parallel.py --train --print-layout --tp 2 --dp 2 --pp 2 --ep 4
    python 09_expert_parallel.py --train --tp 2 --cp 2 --dp 1 --pp 2 --ep 4 --num-experts 4
    torchrun --nproc-per-node 4 09_expert_parallel.py    # one rank per GPU

The demo runs the lesson (each of the tp x cp x dp ranks a replica on its B / world rows, the experts
over ep) against the serial model with experts in float64: loss, auxiliary loss and every gradient,
PASS at 1e-10, else exit 1; then the machine on the lesson's layout against the lesson (1e-12). Then
the machine at the flags' fold: both grids and the fold, the tokens each rank routes to each expert
and each rank receives, the all-to-all bytes against the planner's formula, the auxiliary loss, and
the serial and expert-parallel models' loss and every gradient (router, experts, dense weights),
worst relative difference, PASS at 1e-10, else exit 1.
"""
import importlib
import math
import sys
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from plumbing import cli, shards
from plumbing.checks import check_expert_demo, check_experts, check_router
from plumbing.checkpoint import EXTENSIONS
from plumbing.experts import draw_fold, report_experts, report_routing, train_action  # the figures, the actions
from plumbing.experts import LAYOUT_FLAGS, NOT_FOR_EXPERTS, plan_figures  # noqa: F401 (re-exported)
from plumbing.launch import gather_numbers, printer, run_main

tensor_parallel = importlib.import_module("01_tensor_parallel")
data_parallel = importlib.import_module("04_data_parallel")
gpt3d = importlib.import_module("05_3d_gpt")
zero_bubble = importlib.import_module("06_zero_bubble")
context = importlib.import_module("08_context_parallel")
size_of, rank_of = tensor_parallel.tp_size, tensor_parallel.tp_rank  # of a group (None: 1 and 0)


# ----------------------------------------------------------------------------------------------
# The lesson: one dispatch and one combine, as plain code. Every rank is a replica of the dense model
# (01's ParallelGPT, no group) on its rows of the batch; each MoE layer's E experts are spread over the
# ep ranks of its ep group, E / ep each. Every collective of the layer is in this section.


class AllToAll(torch.autograd.Function):
    """All-to-all forward (send[j] rows to rank j, recv[j] rows from it); the reverse all-to-all backward:
    each gradient row goes back to the rank its row came from, as f's backward is g's forward."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def exchange(x, send, recv, group):
    """The uneven all-to-all itself: send[j] rows of x to rank j, recv[j] rows from it, in rank order."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def all_to_all(x, send, recv, group):
    return x if size_of(group) == 1 else AllToAll.apply(x, send, recv, group)


def aux_loss(probs, chosen, E):
    """Switch's load-balancing loss E sum_i f_i P_i over these N tokens, probs (N, E), chosen (N, k): f_i the
    share of the N k choices that went to expert i, P_i expert i's mean probability. 1 when the load is even;
    below E/k always, since a token picks k different experts (f_i <= 1/k) and the P_i sum to 1."""
    N, k = chosen.shape
    f = torch.bincount(chosen.flatten(), minlength=E).to(probs.dtype) / max(N * k, 1)
    return E * (f * probs.sum(0) / max(N, 1)).sum()


class MoE(nn.Module):
    """A block's MLP as a router and E experts (01's ParallelMLP, no group), of which this rank holds E / ep:
    experts.<e> for its e. group None (ep = 1): the serial layer, every expert here. keep (B, T): the tokens
    whose target counts, set before each forward; the auxiliary loss (aux) is over them (docs/LOSS.md)."""

    def __init__(self, cfg, E, k, group=None, **factory):
        super().__init__()
        self.E, self.k, self.group, self.keep, self.aux = E, k, group, None, None
        self.router = nn.Linear(cfg.n_embd, E, bias=False, **factory)
        n, r = E // size_of(group), rank_of(group)
        self.experts = nn.ModuleDict({str(e): tensor_parallel.ParallelMLP(cfg, None, **factory)
                                      for e in range(r * n, (r + 1) * n)})

    def forward(self, x):  # (B, T, C)
        B, T, C = x.shape
        ep, n, k = size_of(self.group), self.E // size_of(self.group), self.k
        tokens = rearrange(x, "B T C -> (B T) C")  # N = B T
        # The router: softmax over E, the top k, their probabilities renormalised to sum to 1 (Mixtral's)
        probs = F.softmax(self.router(tokens), dim=-1)  # (N, E)
        top, chosen = probs.topk(k, dim=-1)  # (N, k) each
        weights = top / top.sum(-1, keepdim=True)
        keep = self.keep.flatten()
        self.aux = aux_loss(probs[keep], chosen[keep], self.E)
        # 1. Permute: the N k (token, choice) pairs sorted by expert; expert e lives on ep rank e // n, so
        #    each rank's rows are one block, ordered by its local experts. Pair p is token p // k.
        order = chosen.flatten().argsort(stable=True)
        # 2. The counts first: this rank's pairs for each expert go to its rank, and each rank's for my n
        #    experts come back, at s n + l for rank s's pairs for my l-th, so every rank knows what arrives.
        counts = torch.bincount(chosen.flatten(), minlength=self.E)  # (E,)
        got = all_to_all(counts, [n] * ep, [n] * ep, self.group)  # (ep n,)
        send, recv = counts.view(ep, n).sum(1).tolist(), got.view(ep, n).sum(1).tolist()
        # 3. Dispatch: the tokens, an uneven all-to-all
        rows = all_to_all(tokens[order // k], send, recv, self.group)  # (sum(recv), C)
        # 4. Each local expert once, on its rows from every rank; the outputs back in the rows' places
        blocks = list(rows.split(got.tolist()))
        for l, expert in enumerate(self.experts.values()):
            mine = blocks[l::n]
            blocks[l::n] = expert(torch.cat(mine)).split([len(b) for b in mine])
        # 5. Combine: the reverse all-to-all, then unpermute: each row weighted by its router probability and
        #    added into its token's place
        back = all_to_all(torch.cat(blocks), recv, send, self.group)  # (N k, C), in `order`
        y = torch.zeros_like(tokens).index_add(0, order // k, back * weights.flatten()[order, None])
        return rearrange(y, "(B T) C -> B T C", B=B)


def moe_gpt(cfg, moe, group, full, device="cpu"):
    """01's ParallelGPT, whole on this rank, every moe_every-th block's MLP an MoE layer over the ep group
    (None: the serial model), loaded from the full float64 weights (the head tied to wte)."""
    model = tensor_parallel.ParallelGPT(cfg, None, dtype=torch.float64, device=device)
    for i, block in model.transformer.h.items():
        if int(i) % moe.moe_every == 0:
            block.mlp = MoE(cfg, moe.num_experts, moe.top_k, group, dtype=torch.float64, device=device)
    weights = {**full, "lm_head.weight": full["transformer.wte.weight"]}
    model.load_state_dict({name: weights[name] for name in model.state_dict()})
    return model


def expert_grid(world, ep):
    """The experts' groups over every rank: ep groups of consecutive ranks (together they hold all E
    experts, E / ep each), and edp groups, every ep-th rank: the ranks that hold the same experts."""
    return {"ep": [list(range(s, s + ep)) for s in range(0, world, ep)],
            "edp": [list(range(e, world, ep)) for e in range(ep)]}


def lesson_step(model, x, y, edp, coeff):
    """One forward and backward of this rank's replica on its rows x, y (B / world, T): its mean loss weighs
    its counted targets over the world's (04's replica_loss_weights), plus coeff times each MoE layer's
    auxiliary loss over its counted tokens; then naive data parallelism (04): a dense gradient averaged
    over every rank, an expert's summed over its edp group and divided by the world too (the all-to-all's
    backward brought it every token of its ep group). Returns the world's loss and mean auxiliary loss."""
    layers, world = [b.mlp for b in model.transformer.h.values() if isinstance(b.mlp, MoE)], dist.get_world_size()
    for layer in layers:
        layer.keep = y != -100
    loss = model(x, y)[1] * data_parallel.replica_loss_weights([(x, y)], dist.group.WORLD)[0]
    aux = sum(layer.aux for layer in layers)
    (loss + coeff * aux).backward()
    named = list(model.named_parameters())
    data_parallel.allreduce_gradients([p for name, p in named if ".experts." not in name], dist.group.WORLD)
    for p in [p for name, p in named if ".experts." in name]:
        dist.all_reduce(p.grad, group=edp)
        p.grad /= world
    return tensor_parallel.all_reduce(torch.stack([loss.detach(), aux.detach()]), dist.group.WORLD) / world


def serial_step(model, idx, targets, world, coeff):
    """The serial model's (group None) forward and backward on the batch, each rank's rows in turn: their
    loss weighs their counted targets over the batch's, their auxiliary loss 1 / world. Returns the same."""
    layers, n = [b.mlp for b in model.transformer.h.values() if isinstance(b.mlp, MoE)], (targets != -100).sum()
    total = 0
    for x, y in zip(idx.chunk(world), targets.chunk(world)):
        for layer in layers:
            layer.keep = y != -100
        loss = model(x, y)[1] * (y != -100).sum() / n
        aux = sum(layer.aux for layer in layers) / world
        (loss + coeff * aux).backward()
        total = total + torch.stack([loss.detach(), aux.detach()])
    return total


def demo(env, cfg, args):
    say, moe, world = printer(env), MoEConfig.of(args), env.world_size
    attention = context.rank_grid(world, args.tp, args.cp, args.dp) if args.cp > 1 else \
        gpt3d.rank_grid(world, args.tp, args.dp)  # 08's grid with cp, else 05's
    grid = fold(attention, args.ep, args.etp)  # before any collective
    groups, lesson_groups = gpt3d.new_groups(env, grid), gpt3d.new_groups(env, expert_grid(world, args.ep))
    cp = f" cp={args.cp}" if args.cp > 1 else ""
    say(f"{cfg}\n{moe}\ntp={args.tp}{cp} dp={args.dp} -> etp={args.etp} ep={args.ep} "
        f"edp={world // (args.ep * args.etp)}, B={args.batch_size} T={args.seq_len} float64, "
        f"world={world} ({dist.get_backend()})")
    full = moe_state_dict(cfg, moe, args.seed, dtype=torch.float64, random_all=True)
    gen = torch.Generator().manual_seed(args.seed + 1)
    idx, targets = torch.randint(cfg.vocab_size, (2, args.batch_size, args.seq_len), generator=gen)
    # Counted unevenly (docs/LOSS.md): replica 0 counts one target, the last row loses its first third.
    targets.chunk(args.dp)[0].fill_(-100)[0, 1] = 3
    targets[-1, :args.seq_len // 3] = -100
    # The lesson, each rank a replica on its B / world rows, against the serial model
    serial, lesson = (moe_gpt(cfg, moe, g, full, env.device) for g in (None, lesson_groups.ep))
    ref = serial_step(serial, idx.to(env.device), targets.to(env.device), world, moe.aux_loss_coeff)
    rows = [t.chunk(world)[env.rank].to(env.device) for t in (idx, targets)]
    got = lesson_step(lesson, *rows, lesson_groups.edp, moe.aux_loss_coeff)
    diffs = [shards.max_rel_diff(got, ref)] + [shards.max_rel_diff(p.grad, serial.get_parameter(n).grad)
                                               for n, p in lesson.named_parameters()]
    taught = max(x[0] for x in gather_numbers([max(diffs)], device=env.device))
    say(f"the lesson (each rank a replica on B/{world} of the rows, its MoE layers' experts over ep {args.ep}) "
        f"against serial (loss, auxiliary loss, every gradient): {taught:.2e} {'PASS' if taught <= 1e-10 else 'FAIL'} "
        f"(tolerance 1e-10)")
    proof = prove_machine(env, cfg, moe, args, full, (idx, targets), got, lesson)
    say(f"the machine (MoELayer, folded onto tp 1 x dp {world} -> ep {args.ep}) against the lesson (loss, auxiliary "
        f"loss, every gradient): {proof:.2e} {'PASS' if proof <= 1e-12 else 'FAIL'} (tolerance 1e-12)\n")
    say(draw_fold(grid))
    diffs, (ref_loss, ref_aux), (loss, aux), model = against_serial(env, cfg, moe, args, groups, full, idx, targets)
    worst = max(x[0] for x in gather_numbers([max(diffs.values())], device=env.device))
    report_routing(env, say, cfg, args, model, moe_layers(model))
    say(f"\nloss: serial {ref_loss:.12f}  expert-parallel {loss:.12f}\nauxiliary loss (the sum over "
        f"{len(moe_layers(model))} MoE layers; each 1 when the load is even, up to E/k = {moe.num_experts / moe.top_k:g} when "
        f"every token picks the same {moe.top_k}): serial {ref_aux:.12f}  expert-parallel {aux:.12f}")
    largest = sorted(diffs.items(), key=lambda x: -x[1])[:3]
    say("rank 0's largest differences: " + ", ".join(f"{n} {d:.1e}" for n, d in largest))
    say(f"\n{'PASS' if worst <= 1e-10 else 'FAIL'}: worst relative difference over every rank {worst:.2e} "
        f"(loss, auxiliary loss, every gradient: router, experts, dense weights; tolerance 1e-10)")
    return taught <= 1e-10 and proof <= 1e-12 and worst <= 1e-10


# ----------------------------------------------------------------------------------------------
# The machine, read second: the lesson's layer in the general form the trainer and the demo's fold run,
# and parallel folding. The router (Mixtral's convention) and the load-balancing loss (Switch, GShard),
# its sums over the ranks that split a microbatch's tokens


def route(x, weight, k):
    """x (N, C) tokens -> (probs (N, E) of every expert, weights (N, k) of the k chosen, chosen (N, k)):
    softmax over E, the top k, their probabilities renormalised to sum to 1."""
    logits = F.linear(x, weight)  # (N, E); in float32 when the weights are bf16 (Megatron's router too)
    check_router(logits, weight, x)  # top-k of NaN would pick any expert, with NaN weights: refused
    probs = F.softmax(logits.float() if logits.element_size() < 4 else logits, dim=-1)  # (N, E)
    top, chosen = probs.topk(k, dim=-1)  # (N, k) each, the likeliest first
    return probs, top / top.sum(-1, keepdim=True), chosen


def load_balancing_loss(probs, chosen, group, keep=None):
    """E sum_i f_i P_i (Switch Transformer, eq. 4; GShard's, with f_i over the k choices): f_i the share of
    the N k choices that went to expert i, P_i the mean probability of expert i. 1 when the load is even.
    The tokens split over `group` (the tp ranks of a microbatch, tp x cp with 08) are summed over it first, so
    that this is the loss of the whole microbatch, as the serial model computes it; g's backward keeps its
    gradient local. keep (N,): the tokens whose target counts, f_i and P_i over them alone (docs/LOSS.md)."""
    N, E = probs.shape
    if keep is None:
        n = N * size_of(group)  # the microbatch's tokens
    else:  # the microbatch's counted tokens
        probs, chosen = probs * keep[:, None], chosen[keep]
        n = tensor_parallel.all_reduce(keep.sum().to(probs.dtype), group).clamp(min=1)
    counts = tensor_parallel.all_reduce(torch.bincount(chosen.flatten(), minlength=E).to(probs.dtype), group)
    P = tensor_parallel.reduce_from_tp(probs.sum(0), group) / n  # g: all-reduce forward, identity backward
    return E * (counts / (n * chosen.shape[1]) * P).sum()


class WithAuxLoss(torch.autograd.Function):
    """y unchanged forward; backward: y's gradient, and `scale` as the auxiliary loss's, so that the loss
    joins the backward here, where it was computed, not at the pipeline's end (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale, ctx.dtype = scale, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=ctx.dtype, device=grad.device), None


# ----------------------------------------------------------------------------------------------
# The token dispatcher (Megatron's all-to-all dispatcher): steps 1-3 in dispatch, 4 in the layer, 5 in combine


@dataclass
class Plan:
    """What combine needs to undo dispatch: the pairs' order, and the rows sent to and from each rank."""
    order: torch.Tensor  # (pairs,): the (token, choice) pairs sorted by expert; pair p is token p // k
    k: int
    send: list  # rows to each ep rank
    recv: list  # rows from each ep rank
    blocks: list  # rows received from rank s for local expert l, at s * (E / ep) + l
    counts: list  # this rank's pairs sent to each expert


def dispatch(x, chosen, E, group):
    """Steps 1-3: this rank's N tokens x (N, C) to the ranks holding the experts they chose, chosen (N, k);
    expert e lives on ep rank e // (E / ep). Returns (the rows received, from rank 0's first, each
    rank's ordered by local expert; the Plan)."""
    ep, k = size_of(group), chosen.shape[1]
    pairs = chosen.flatten()  # (N k,): token t's choices at t k ... t k + k - 1
    order = pairs.argsort(stable=True)  # 1. sorted by expert, each expert's pairs in token order
    counts = torch.bincount(pairs, minlength=E)  # (E,): this rank's pairs per expert
    blocks = all_to_all(counts, [E // ep] * ep, [E // ep] * ep, group)  # 2. each rank's, for my experts
    counts, blocks, n = counts.tolist(), blocks.tolist(), E // ep  # the sizes, on the host
    send, recv = ([sum(c[s * n:(s + 1) * n]) for s in range(ep)] for c in (counts, blocks))
    return all_to_all(x[order // k], send, recv, group), Plan(order, k, send, recv, blocks, counts)  # 3. uneven


def combine(ys, weights, plan, group):
    """Step 5: the experts' rows back to the ranks they came from (the reverse all-to-all), each weighted by
    its router probability, weights (N, k), and added into its token's place: (N, C)."""
    back = all_to_all(ys, plan.recv, plan.send, group)  # (pairs, C), in plan.order
    w = weights.flatten()[plan.order, None].to(back.dtype)
    return back.new_zeros(weights.shape[0], back.shape[1]).index_add(0, plan.order // plan.k, back * w)


class MoELayer(nn.Module):
    """A block's MLP replaced by a router and E experts (01's ParallelMLP each), of which this rank holds
    E / ep: experts.<e> for its e. groups (05's Groups, or None: the serial layer): tp, the ranks that
    split one microbatch's tokens (with 08, tp_cp: tp the ranks that split a cp rank's T/cp); ep; etp,
    over which each expert is tensor-parallel; edp, the ranks holding the same experts. sp: the block runs
    sequence parallelism (its tokens are split already)."""

    def __init__(self, cfg, moe, groups=None, sp=False, **factory):
        super().__init__()
        g = lambda kind: getattr(groups, kind, None)  # noqa: E731
        self.tokens, self.ep, self.etp, self.sp = g("tp"), g("ep"), g("etp"), sp
        self.microbatch = g("tp_cp") or self.tokens  # every rank holding some of a microbatch's tokens
        self.E, self.k, self.aux_scale, self.aux = moe.num_experts, moe.top_k, moe.aux_loss_coeff, None
        self.counted = None  # (B, T) bool: the tokens whose target counts, set per microbatch (counted_tokens)
        self.router = nn.Linear(cfg.n_embd, self.E, bias=False, **factory)  # replicated: a dense weight
        n = self.E // size_of(self.ep)
        self.experts = nn.ModuleDict({str(e): tensor_parallel.ParallelMLP(cfg, self.etp, size_of(self.etp) > 1,
                                                                          **factory)
                                      for e in range(rank_of(self.ep) * n, (rank_of(self.ep) + 1) * n)})
        for p in self.experts.parameters():
            p.split_group = self.etp  # split over etp, not over the block's tp (plumbing/shards.py)
            if g("edp") is not None:
                p.replica_group = g("edp")  # its gradient summed over edp, not dp (04's BucketedDDP)

    def forward(self, x):  # (B, T, C), or (B, T/tp, C) with sequence parallelism
        split = size_of(self.tokens) > 1 and not self.sp  # the tp ranks hold the same tokens:
        x = tensor_parallel.scatter_to_sp(x, self.tokens) if split else x  # each routes T/tp of them
        B, T, C = x.shape
        tokens = rearrange(x, "B T C -> (B T) C")
        weight = tensor_parallel.copy_to_tp(self.router.weight, self.tokens)  # f: each tp rank, its tokens
        probs, weights, chosen = route(tokens, weight, self.k)
        keep = self.counted
        if keep is not None and size_of(self.tokens) > 1:  # this tp rank's T/tp of them
            keep = keep.chunk(size_of(self.tokens), 1)[rank_of(self.tokens)]
        self.aux = load_balancing_loss(probs, chosen, self.microbatch, None if keep is None else keep.reshape(-1))
        xs, plan = self.dispatch(tokens, chosen, T)
        y = self.combine(self.run_experts(xs, plan), weights, plan)  # (B T, C)
        if self.aux_scale and torch.is_grad_enabled():
            y = WithAuxLoss.apply(y, self.aux, self.aux_scale)
        y = rearrange(y, "(B T) C -> B T C", B=B)
        return gather_tokens(y, self.tokens) if split else y

    def dispatch(self, tokens, chosen, T):  # steps 1-3 (CapacityLayer's drop and pad them, by T's groups)
        xs, self.plan = dispatch(tokens, chosen, self.E, self.ep)  # the plan kept for the demo's figures
        return xs, self.plan

    def combine(self, ys, weights, plan):  # step 5
        return combine(ys, weights, plan, self.ep)

    def run_experts(self, xs, plan):
        """Step 4: each local expert on the rows every rank sent it, in one batch; the rows back in place."""
        n = len(self.experts)
        blocks = list(xs.split(plan.blocks))  # block s n + l: from rank s, for local expert l
        for l, expert in enumerate(self.experts.values()):
            mine = range(l, len(blocks), n)
            ys = expert_forward(expert, torch.cat([blocks[i] for i in mine]), self.etp)
            for i, y in zip(mine, ys.split([blocks[i].shape[0] for i in mine])):
                blocks[i] = y
        return torch.cat(blocks)


class GatherTokens(torch.autograd.Function):
    """All-gather T forward; backward: this rank's slice of the gradient, which every tp rank holds whole
    (the tokens' way back to the tp ranks that hold them all; scatter_to_sp was their way in)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return tensor_parallel.gather(x, group, 1)

    @staticmethod
    def backward(ctx, grad):
        return tensor_parallel.split(grad, ctx.group, 1), None


gather_tokens = GatherTokens.apply


# ----------------------------------------------------------------------------------------------
# Parallel folding (Liu et al. 2025): the experts' grid over the same ranks as attention's


def fold(grid, ep=1, etp=1):
    """05's grid of attention (tp, dp, pp, embed: rank_grid), or 08's (with cp; its "dp" is dp x cp), with,
    over the same ranks, the experts' etp x ep x edp x pp, edp = tp cp dp / (etp ep): Megatron's order,
    etp fastest, then ep, edp, pp. Both cut the ranks into the same pipeline stages, so that a stage's
    attention and experts share ranks. With cp, tp_cp: the tp x cp ranks that split a microbatch's tokens."""
    pp, world = len(grid["pp"][0]), sum(map(len, grid["pp"]))
    inner = world // pp  # a stage's ranks: tp x dp of them (tp x cp x dp)
    if inner % (ep * etp):
        raise ValueError(f"--ep {ep} x --etp {etp} = {ep * etp} does not divide a pipeline stage's "
                         f"{'tp x cp x dp' if 'cp' in grid else 'tp x dp'} = {inner} ranks (the world {world} / pp "
                         f"{pp}): the experts' grid folds onto those ranks")
    edp = inner // (ep * etp)
    rank = lambda t, e, d, p: p * inner + (d * ep + e) * etp + t  # noqa: E731
    etp_groups = [[rank(t, e, d, p) for t in range(etp)] for p in range(pp) for d in range(edp) for e in range(ep)]
    ep_groups = [[rank(t, e, d, p) for e in range(ep)] for p in range(pp) for d in range(edp) for t in range(etp)]
    edp_groups = [[rank(t, e, d, p) for d in range(edp)] for p in range(pp) for e in range(ep) for t in range(etp)]
    expert_pp = [[rank(t, e, d, p) for p in range(pp)] for d in range(edp) for e in range(ep) for t in range(etp)]
    if sorted(expert_pp) != sorted(grid["pp"]):  # the fold's one rule: the pipeline is shared
        raise ValueError(f"the experts' pipeline groups {expert_pp} are not attention's {grid['pp']}")
    if "cp" in grid:  # a cp group's ranks and their tp groups hold one microbatch's tokens between them
        tp_of = {r: g for g in grid["tp"] for r in g}
        blocks = {tuple(sorted(r for c in g for r in tp_of[c])) for g in grid["cp"]}
        grid = dict(grid, tp_cp=[list(b) for b in sorted(blocks)])
    return dict(grid, etp=etp_groups, ep=ep_groups, edp=edp_groups)


def with_experts(model, moe, groups=None, token_groups=1):
    """Replace the MLP of every moe_every-th block of `model` (01's GPT, or a pipeline chunk of it: global
    layer i, i % moe_every == 0) by an MoELayer (CapacityLayer with a capacity factor, of token_groups).
    groups None: the serial model. Returns the model; its full weights are the model's with experts."""
    for i, block in model.transformer.h.items():
        if int(i) % moe.moe_every == 0:
            factory = dict(dtype=block.ln_2.weight.dtype, device=block.ln_2.weight.device)
            block.mlp = CapacityLayer(model.cfg, moe, groups, model.sp, token_groups, **factory) \
                if moe.capacity_factor else MoELayer(model.cfg, moe, groups, model.sp, **factory)
    whole = lambda: with_experts(tensor_parallel.GPT(model.cfg, device="meta"), moe)  # noqa: E731
    model.load_full_state_dict = lambda full: shards.load_full_state_dict(model, full, model.group, whole)
    return model


def moe_layers(model):
    return [b.mlp for b in model.transformer.h.values() if isinstance(b.mlp, MoELayer)]


# ----------------------------------------------------------------------------------------------
# The machine's part of the demo: the serial model with experts against the expert-parallel one at the
# flags' fold, and the machine against the lesson, float64, one forward and backward


def machine_step(env, cfg, moe, args, groups, full, idx, targets):
    """This rank's part of the expert-parallel model (with_experts over groups: args' tp, cp and dp), one forward
    and backward on its replica's rows: its auxiliary losses join inside the layers (WithAuxLoss), and its
    gradients are reduced as 04's naive data parallelism does, experts over edp, the rest over dp (dp x cp:
    08's step). The loss is the batch's per-token mean and each replica's aux loss is over its counted tokens
    (docs/LOSS.md). Returns ((the loss, the mean auxiliary loss), the model)."""
    dt, dp, cp = full["transformer.wte.weight"].dtype, args.dp, getattr(args, "cp", 1)
    n = int((targets != -100).sum())  # each counted target: 1/n
    model = with_experts(tensor_parallel.GPT(cfg, groups.tp, sequence_parallel=args.sequence_parallel, init=False,
                                             dtype=dt, device=env.device), moe, groups)
    if cp > 1:  # 08's seams: this rank's T/cp of each sequence (Megatron's split), ring attention, its loss
        context.context_parallel(model, context.megatron(cp), groups.cp)
    model.load_full_state_dict(full)
    for layer in moe_layers(model):  # 08's step multiplies the loss by cp for backward: the aux loss too
        layer.aux_scale = moe.aux_loss_coeff * cp
    rows = dist.get_rank(groups.dp) // cp  # this replica's rows (08's dp groups are its dp x cp ranks)
    x, y = idx.chunk(dp)[rows].to(env.device), targets.chunk(dp)[rows].to(env.device)
    counted_tokens(model, y, context.megatron(cp) if cp > 1 else None, rank_of(groups.cp) if cp > 1 else 0)
    loss = model(x, y)[1] * (1 if cp > 1 else int((y != -100).sum())) / n  # this rank's summed losses, over n
    aux = sum(layer.aux for layer in moe_layers(model)).detach()
    (loss * dp * cp).backward()  # averaged over dp x cp below; the auxiliary losses' gradients join inside
    for p in model.parameters():  # data parallelism, naive (04): experts over edp, the rest over dp (x cp)
        dist.all_reduce(p.grad, group=getattr(p, "replica_group", groups.dp))
        p.grad /= dp * cp  # 08: summed over cp (each rank's share of the loss), averaged over dp
    both = torch.stack([loss.detach() * dp, aux / cp]).double().to(env.device)  # a tp x cp block's ranks: one aux
    return tensor_parallel.all_reduce(both, groups.dp).cpu() / dp, model


def against_serial(env, cfg, moe, args, groups, full, idx, targets):
    """One forward and backward of the serial model with experts, on each replica's rows with its auxiliary
    losses added to the loss, and machine_step's of this rank's part of the expert-parallel one. Returns
    ({what: relative difference}, serial (loss, aux), parallel (loss, aux), the parallel model)."""
    dt, dp = full["transformer.wte.weight"].dtype, args.dp
    serial = with_experts(tensor_parallel.GPT(cfg, init=False, dtype=dt), moe, token_groups=args.tp)
    serial.load_full_state_dict(full)
    for layer in moe_layers(serial):
        layer.aux_scale = 0.0  # the serial reference adds its auxiliary losses to the loss itself
    ref, n = torch.zeros(2, dtype=torch.float64), int((targets != -100).sum())  # each counted target: 1/n
    for rows_idx, rows_targets in zip(idx.chunk(dp), targets.chunk(dp)):  # each replica's rows
        counted_tokens(serial, rows_targets)
        loss = serial(rows_idx, rows_targets)[1] * (int((rows_targets != -100).sum()) / n)
        aux = sum(layer.aux for layer in moe_layers(serial)) / dp
        (loss + moe.aux_loss_coeff * aux).backward()
        ref += torch.stack([loss.detach(), aux.detach()]).double()
    got, model = machine_step(env, cfg, moe, args, groups, full, idx, targets)
    named = dict(serial.named_parameters())
    diffs = {what: (abs(got[i] - ref[i]) / abs(ref[i])).item() for i, what in enumerate(("loss", "aux"))}
    diffs.update({"grad " + n: tensor_parallel.max_rel_diff(g.cpu(), named[n].grad)
                  for n, g in model.full_grads().items()})
    return diffs, ref.tolist(), got.tolist(), model


def prove_machine(env, cfg, moe, args, full, batch, got, lesson):
    """The demo's machine part: machine_step on the lesson's layout (tp 1 x dp world folded onto ep: each rank
    a replica, the same experts on each rank as the lesson's), dropless and etp 1 as the lesson is, on the same
    weights and batch. Returns the worst relative difference over every rank from the lesson's loss, auxiliary
    loss and every gradient the lesson's rank holds (got: the lesson's (loss, aux); lesson: its model)."""
    world = env.world_size
    flags = SimpleNamespace(**{**vars(args), "tp": 1, "cp": 1, "dp": world, "etp": 1, "sequence_parallel": False})
    groups = gpt3d.new_groups(env, fold(gpt3d.rank_grid(world, 1, world), args.ep))
    both, model = machine_step(env, cfg, replace(moe, capacity_factor=None), flags, groups, full, *batch)
    grads = model.full_grads()
    diffs = [shards.max_rel_diff(both, got.cpu())] + [shards.max_rel_diff(grads[n].cpu(), p.grad.cpu())
                                                      for n, p in lesson.named_parameters()]
    return max(x[0] for x in gather_numbers([max(diffs)], device=env.device))


# ----------------------------------------------------------------------------------------------
# After the concept: experts tensor-parallel over etp > 1 ranks. Each rank of an etp group receives
# other rows (its own ep group's), so the expert runs 01's sequence-parallel pair, the paper's g and
# g-bar in f's and g's places (01's ParallelMLP with sp): the rows all-gathered into c_fc, the outputs
# reduce-scattered out of c_proj, as Megatron's expert-tensor-parallel dispatcher does.


def expert_forward(expert, rows, etp):
    """One expert (01's ParallelMLP over etp) on its rows (n, C): with etp > 1 as a (1, n, C) sequence,
    every rank's padded with zero rows to the most any holds (the gather needs one size)."""
    if size_of(etp) == 1:
        return expert(rows)
    n = torch.tensor([rows.shape[0]], device=rows.device)
    most = int(tensor_parallel.all_reduce(n, etp, dist.ReduceOp.MAX))
    padded = torch.cat([rows, rows.new_zeros(most - rows.shape[0], rows.shape[1])])  # zeros: no gradient
    return expert(padded[None])[0, :rows.shape[0]]


# ----------------------------------------------------------------------------------------------
# After the concept: a capacity factor (GShard, Lepikhin et al. 2020, Section 2.2; Switch, Fedus et al.
# 2022, Section 2.2). Each expert takes at most capacity = ceil(cf N k / E) of the N k pairs a rank
# routes, the first in token order (GShard's); the rest are dropped (that token gets nothing from that
# expert: the residual carries it), and every expert's rows are padded to the capacity, so that every
# all-to-all has one fixed shape whatever the routing. How it differs from serial: which pairs drop
# depends on which tokens share a capacity, here a rank's (per microbatch). The serial model equals the
# parallel one under the same rule over the same groups of tokens (GShard's groups): with tp > 1, its
# sequence cut into tp runs (token_groups = tp), as the tp ranks cut it.


def capacity_of(n_tokens, k, E, cf):
    """The most pairs one expert takes of the n_tokens k that one group routes (Megatron's get_capacity)."""
    return math.ceil(cf * n_tokens * k / E)


def kept_slots(chosen, E, cf, group, G):
    """Where each (token, choice) pair of chosen (N, k) goes in the padded rows, laid out (expert, group,
    place): its slot, or -1 if it is dropped. group (N,): each token's group, 0 to G - 1, N / G tokens each.
    A pair keeps its place when fewer than the capacity earlier pairs of its group chose its expert."""
    N, k = chosen.shape
    cap = capacity_of(N // G, k, E, cf)
    pairs, of = chosen.flatten(), group.repeat_interleave(k)  # (N k,) each
    key = pairs * G + of  # (expert, group) of each pair
    order = key.argsort(stable=True)  # token order within each (expert, group)
    ranked = torch.arange(len(key), device=key.device) - torch.searchsorted(key[order], key[order])
    place = torch.empty_like(ranked).scatter_(0, order, ranked)  # each pair's place in its run
    return torch.where(place < cap, key * cap + place, -1), cap


class CapacityLayer(MoELayer):
    """MoELayer with a capacity factor: dispatch() drops and pads, so that each all-to-all carries E / ep
    x capacity rows to each rank, whatever the routing; combine() reads the kept pairs' rows back.
    token_groups: the groups of the sequence that each have a capacity (the serial reference of tp ranks)."""

    def __init__(self, cfg, moe, groups=None, sp=False, token_groups=1, **factory):
        super().__init__(cfg, moe, groups, sp, **factory)
        self.cf, self.token_groups = moe.capacity_factor, token_groups

    def dispatch(self, tokens, chosen, T):
        (N, k), G, ep = chosen.shape, self.token_groups, size_of(self.ep)
        group = torch.arange(N, device=tokens.device) % T // (T // G)  # tokens are (B T): cut T into G runs
        slots, cap = kept_slots(chosen, self.E, self.cf, group, G)
        kept = (slots >= 0).nonzero().squeeze(1)  # (pairs kept,)
        rows = tokens.new_zeros(self.E * G * cap, tokens.shape[1]).index_add(0, slots[kept], tokens[kept // k])
        per = self.E // ep * G * cap  # rows to each rank: its experts' padded rows
        counts = torch.bincount(chosen.flatten()[kept], minlength=self.E).tolist()
        self.plan = Plan(kept, k, [per] * ep, [per] * ep, [G * cap] * (ep * (self.E // ep)), counts)
        self.plan.slots = slots[kept]
        return all_to_all(rows, self.plan.send, self.plan.recv, self.ep), self.plan

    def combine(self, ys, weights, plan):
        back = all_to_all(ys, plan.recv, plan.send, self.ep)[plan.slots]  # (pairs kept, C)
        w = weights.flatten()[plan.order, None].to(back.dtype)
        return back.new_zeros(weights.shape[0], back.shape[1]).index_add(0, plan.order // plan.k, back * w)


# ----------------------------------------------------------------------------------------------
# After the concept: the model's flags, its full weights (drawn, or upcycled from a dense GPT-2)


@dataclass
class MoEConfig:
    num_experts: int = 8  # E, experts in each MoE layer, each a GPT-2 MLP
    top_k: int = 2  # k, experts each token is sent to (its k router probabilities renormalised to sum to 1)
    moe_every: int = 1  # layer i has experts in place of its MLP when moe_every divides i (Megatron's --moe-layer-freq)
    capacity_factor: float | None = None  # unset: dropless; else each expert takes ceil(cf N k / E) of a rank's N k pairs at most
    aux_loss_coeff: float = 0.01  # the load-balancing loss's coefficient (Switch's 1e-2; 0: off)

    @classmethod
    def of(cls, flags):
        """The model's MoE fields out of any flags that hold them (the demo's, the trainer's)."""
        return cls(**{name: getattr(flags, name) for name in MoEConfig.__dataclass_fields__})

    def check_relations(self, cfg, world=None):
        """plumbing/checks.py's check_config asks a chapter's flags for their own relations here."""
        check_experts(self, cfg.n_embd)


def moe_state_dict(cfg, moe, seed, dtype=torch.float32, random_all=False):
    """The full weights of the GPT-2 with experts from a seed, GPT-2's initialisation (01's init_state_dict)."""
    meta = with_experts(tensor_parallel.GPT(cfg, device="meta"), moe)
    return shards.init_full(meta.named_parameters(), cfg.n_layer, seed, dtype, random_all)


def expert_weights(cfg, moe, dense, seed, upcycle=False):
    """The full weights of the model with experts, from a dense GPT-2's (05 loaded them: the seed's, or
    --init-from's): its own weights as they are; the routers drawn from the seed, and the experts too, or
    (upcycle) each a copy of the MLP its layer had (Komatsuzaki et al. 2023, "Sparse Upcycling"): dropless,
    the upcycled model then computes what the dense one did, its k weights summing to 1."""
    meta = dict(with_experts(tensor_parallel.GPT(cfg, device="meta"), moe).named_parameters())
    like = dense["transformer.wte.weight"]
    new = [(n, p) for n, p in meta.items() if n not in dense]
    drawn = shards.init_full(new, cfg.n_layer, seed + 1, like.dtype)
    mlp = lambda n: n.replace(".experts." + n.split(".experts.")[1].split(".")[0], "")  # noqa: E731
    return {n: dense[n] if n in dense else dense[mlp(n)] if upcycle and ".experts." in n else drawn[n].to(like.device)
            for n in meta}


# ----------------------------------------------------------------------------------------------
# After the concept: the trainer's seam (05's loop runs ExpertSchedule: --train) and its checkpoints


@dataclass
class Experts(MoEConfig):
    ep: int = 1  # expert-parallel size: each of its ranks holds num_experts / ep experts (folded onto tp x cp x dp)
    etp: int = 1  # each expert tensor-parallel over this many ranks; ep x etp must divide tp x cp x dp
    schedule: Literal["1f1b", "zb-h1", "zb-v"] = "1f1b"  # 05's 1F1B (interleaved with --virtual-stages) or 06's
    aux_loss_counts_all: bool = False  # the router's statistics over every token, not only those whose target counts


@dataclass
class TrainConfig(Experts, context.TrainConfig):
    """05's flags, 08's (context parallelism, off at cp = 1) and the experts'."""
    cp: int = 1  # context-parallel size (08): the ranks each sequence is split over (rank order tp, cp, dp, pp)
    dp: int = 2  # data-parallel replicas (05's default; 08's is 1, beside its cp = 2)
    cuda_graphs: bool | None = False  # never with experts: the all-to-alls' sizes are read on the host each step

    def check_relations(self, cfg, world=None):
        """08's relations (its split, attention and recompute), then the experts' (check_experts), with the one
        pair not composed: 06's split backward with 08's executor."""
        context.TrainConfig.check_relations(self, cfg, world)
        check_experts(self, cfg.n_embd)

    def extension(self):
        """What a checkpoint records of the model beyond GPT-2's (plumbing/checkpoint.py's EXTENSIONS)."""
        return dict(name="experts", file="09_expert_parallel.py",
                    model=dict(num_experts=self.num_experts, moe_every=self.moe_every),
                    layout=dict(ep=self.ep, etp=self.etp))


@dataclass
class ExpertSchedule(zero_bubble.ZeroBubbleSchedule):
    """05's 1F1B or interleaved 1F1B, or 06's ZB-H1 or ZB-V, on chunks with experts: grid() folds the experts'
    groups onto 05's; prepare() puts the experts in, their weights drawn from the seed or each upcycled from the
    MLP it replaces (--init-from), and each layer's load-balancing loss weighted 1/m, a microbatch's share (cp/m
    with 08: its executor multiplies each rank's share of the loss by cp for backward, as 08's step does)."""
    tc: object = None

    def grid(self, world, tp, dp):
        return fold(super().grid(world, tp, dp), self.tc.ep, self.tc.etp)

    def executor(self, chunks, pp_group, wire, exchange=None, deallocate=True):
        return counting(super().executor(chunks, pp_group, wire, exchange, deallocate), self)

    def prepare(self, chunks, groups, full):
        tc, moe = self.tc, MoEConfig.of(self.tc)
        self.cp_rank = rank_of(getattr(groups, "cp", None))  # whose positions of a sequence (08)
        weights = expert_weights(chunks[0].cfg, moe, full, tc.seed, upcycle=bool(tc.init_from))
        for c in chunks:
            with_experts(c, moe, groups).load_full_state_dict(weights)
            for layer in moe_layers(c):
                layer.aux_scale = moe.aux_loss_coeff * tc.cp / tc.microbatches
        if dist.get_rank() == 0:  # 05's summary counts the dense model: what the experts add, first
            report_experts(chunks[0].cfg, moe, tc)
        if "I" in self.kinds:  # 06's backward split, last: it takes over the experts' linear layers too
            super().prepare(chunks)


@dataclass
class ContextExpertSchedule(ExpertSchedule, context.ContextParallelSchedule):
    """ExpertSchedule on 08's ContextParallelSchedule (1F1B or interleaved 1F1B): grid() folds the experts onto
    08's tp x cp x dp x pp grid (ExpertSchedule's fold of 08's rank_grid, by the classes' order), prepare() puts
    the experts in, then 08's seams (its tokens at their positions, ring attention, its head); 08's executor
    weights each rank's share of the loss and carries T/cp rows; 08's replica is the rank's dp coordinate."""

    def prepare(self, chunks, groups, full):
        ExpertSchedule.prepare(self, chunks, groups, full)
        context.ContextParallelSchedule.prepare(self, chunks, groups, full)

    def executor(self, chunks, pp_group, wire, exchange=None, deallocate=True):
        return counting(context.ContextParallelSchedule.executor(self, chunks, pp_group, wire, exchange, deallocate),
                        self)


def counted_tokens(model, targets, split=None, rank=0):
    """Tell model's MoE layers which tokens of the next forward count: target not -100, at this rank's
    positions of 08's split; the load-balancing loss is over those. targets None: every token."""
    keep = None if targets is None else targets != -100
    if keep is not None and split is not None:
        keep = keep[:, context.positions(split, rank, keep.shape[1], keep.device)]
    for layer in moe_layers(model):
        layer.counted = keep


def counting(executor, schedule):
    """executor whose every action first tells its chunk which tokens count (--aux-loss-counts-all: all)."""
    act = executor.act

    def act_counted(a, k):
        if torch.is_grad_enabled() and not schedule.tc.aux_loss_counts_all:  # the eval adds no aux loss
            counted_tokens(executor.chunks[a.chunk], executor.micro[a.mb][1], getattr(schedule, "ring", None),
                           getattr(schedule, "cp_rank", 0))
        act(a, k)
    executor.act = act_counted
    return executor


def schedule_of(tc):
    """The trainer's seam (05's train and main): the schedule --schedule names, its chunks given experts; with
    --cp (or --recompute lightseq, 08's ring at cp = 1 too) 08's schedule, with experts."""
    if tc.cp > 1 or tc.recompute == "lightseq":
        base = context.context_schedule(tc)
        return ContextExpertSchedule(base.lists, base.placement, base.kinds, name=f"{base.name}, experts over "
                                     f"ep={tc.ep}", cp=base.cp, ring=base.ring, attention=base.attention,
                                     recompute=base.recompute, tc=tc)
    base = gpt3d.interleaved_schedule(tc) if tc.schedule == "1f1b" else \
        zero_bubble.pipeline_schedule(tc.schedule, tc.pp, tc.microbatches)
    return ExpertSchedule(base.lists, base.placement, base.kinds, name=f"{base.name}, experts over ep={tc.ep}",
                          bubble=base.bubble, times=base.times, lockstep=getattr(base, "lockstep", False), tc=tc)


def train(env, cfg, tc, quiet=False):
    """05's training loop on one rank, with experts."""
    return gpt3d.train(env, cfg, tc, quiet, schedule_of)


EXTENSIONS["experts"] = lambda model, ext: with_experts(model, MoEConfig(**ext["model"], top_k=1))  # checkpoints


# ----------------------------------------------------------------------------------------------
# After the concept: the demo's flags and command line (its actions and figures: plumbing/experts.py)


@dataclass
class DemoConfig(MoEConfig):
    tp: int = 2  # attention's tensor-parallel size
    cp: int = 1  # context-parallel size (08): each sequence split over cp ranks, Megatron's split into 2 cp blocks
    dp: int = 2  # attention's data-parallel replicas: tp x cp x dp CPU ranks started here, or torchrun's world
    ep: int = 4  # expert-parallel size: each of its ranks holds num_experts / ep experts
    etp: int = 1  # each expert tensor-parallel over this many ranks; ep x etp must divide tp x cp x dp
    sequence_parallel: bool = False  # attention's tp ranks hold T/tp of the tokens (else each routes T/tp of its copy)
    batch_size: int = 4  # B, global, in sequences: B / dp per replica
    seq_len: int = 32  # T, tokens per sequence
    seed: int = 1234  # for the weights and the batch

    def check_relations(self, cfg, world=None):
        """check_experts; with cp, what 08's split and the exact comparison with serial need
        (plumbing/checks.py's check_expert_demo)."""
        check_expert_demo(self, cfg)


def parser():
    p = cli.demo_parser(__doc__, DemoConfig, tensor_parallel.GPTConfig, vocab_size=1001, block_size=64, n_layer=2,
                        n_head=4, n_embd=64)
    p.add_argument("--train", action="store_true", help="train with 05's loop instead: every flag of 05, and the "
                   "experts' (see --train --help)")
    return p


def start_demo(cfg, args):
    return all(tensor_parallel.launch(demo, args.tp * args.cp * args.dp, cfg, args))


def train_parser():
    """05's trainer's flags, 08's (--cp 1: off) and the experts' (the router's --top-k replaces sampling's)."""
    p = context.train_parser()
    p.conflict_handler = "resolve"
    cli.add_dataclass_args(p, Experts, "mixture of experts (09)")
    p.set_defaults(cp=TrainConfig.cp, dp=TrainConfig.dp)
    return p


def main():
    """With --train, 05's trainer with 08's flags and the experts' (plumbing/command.py), after the actions it
    does otherwise for experts (train_action); without, the demo."""
    if "--train" in sys.argv[1:]:
        if train_action([a for a in sys.argv[1:] if a != "--train"], train_parser, TrainConfig, schedule_of,
                        MoEConfig.of):
            return True
        sys.argv.remove("--train")
        return gpt3d.main(train_parser, TrainConfig, schedule_of)
    cfg, args = cli.demo_args(parser(), train_parser=train_parser())
    return start_demo(cfg, args)


if __name__ == "__main__":
    run_main(main)
