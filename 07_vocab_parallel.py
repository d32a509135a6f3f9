"""07 - Vocabulary parallelism: the vocabulary layers spread over every pipeline rank (Yeung et al.
2024, "Balancing Pipeline Parallelism with Vocabulary Parallelism": its Algorithms 1 and 2).

What this file adds on top of 02-06: with pp > 1 the first stage holds the input embedding and the
last one the output layer and the loss, whose work and weights grow with V (6 b s h V FLOPs and 2 h V
bytes against a layer's b s h (72 h + 12 s) and 24 h^2: the paper's Table 4). For a large
vocabulary the last stage is the pipeline's slowest and fullest, and every other stage waits for it
(Figure 1). Here the vocabulary is cut over all pp x tp ranks instead:
  - The lesson, read first: vocab_stage (02's stage without its vocabulary layers; on every rank its
    rows of wte, V padded to a multiple of pp tp: rank i = r tp + t holds rows [i n, (i + 1) n),
    n = V_pad / (pp tp), serving the input lookup and the tied output layer, so the tie is local),
    output_layer (one microbatch's S and T, Algorithm 1, every collective inline: X broadcast from the
    last stage; output_s_pass, S: the slice's logits, their max all-reduced, then their sum of exponentials
    and the target's logit, the first barrier; output_t_pass, T: the slice's gradient from the softmax, its
    rows' gradient and its share of X's, whose all-reduce is the second barrier) and vocab_1f1b_step
    (02's 1F1B over its lesson pieces, the input layer around it: lookups all-reduced before, the
    gradient broadcast back after; each backward's gradient from its microbatch's output layer,
    which every rank runs just before it would receive that gradient).
  - The machine, read second, which the trainer runs:
    - the passes (VocabularyPasses): the input layer reduced to the first stage; S and T as two
      actions a microbatch; Algorithm 2 with one barrier: S also computes X's gradient from its own
      slice's softmax, and the statistics' all-reduce rescales and sums it;
    - the schedules: S and T are actions of 02's lists, inserted into 1F1B or 06's ZB-H1, ZB-V, V-Half as
      data (insert_passes); 02's validator knows that they wait for the last stage or for every rank,
      and that their collectives go in the same order everywhere. Each barrier costs one more warm-up
      microbatch: rank r holds pp - r + barriers microbatches of 1F1B in flight, not pp - r;
    - the barriers' all-reduces run on a thread of their own, in the order issued, while the pipeline
      goes on (the CPU's stand-in for the paper's second stream, Figure 5): a pass waits for one only
      when it needs its result.
05's training loop runs it all: --train, with --vocab-barriers and --schedule.

Run it:
    python 07_vocab_parallel.py                          # pp=4 x tp=2: 8 CPU ranks, m=5
    python 07_vocab_parallel.py --pp 2 --tp 1 --microbatches 2 --large-vocab 32768
    python 07_vocab_parallel.py --schedule v-half        # 1F1B and 06's V-Half, each rank's balance
    python 07_vocab_parallel.py --train --tp 2 --pp 2 --dp 2 --vocab-barriers 1 --steps 50
    torchrun --nproc-per-node 8 07_vocab_parallel.py     # one rank per GPU

The demo runs the lesson against the serial model in float64 on a batch whose microbatches count
unequal numbers of targets, one none (loss and every gradient within 1e-10); then the machine: for
the model's vocabulary and a large one, each stage's parameter bytes, its compute per microbatch and
its memory (microbatches in flight, logits held), with and without vocabulary parallelism, and the
simulated step time of both; 1F1B, ZB-H1 and ZB-V with both algorithms against the serial model
(1e-10, V padded), 1F1B's against the lesson too (1e-12); it exits 1 on a mismatch. With --schedule
v-half, 1F1B and V-Half run, and each rank's compute and activations, simulated and measured, are
printed as max/min over ranks (the paper's "perfect balance" is 1.00 in both), with each gap's reason.
tests/test_lesson_07.py holds the lesson to serial; tests/test_vocab_parallel.py adds 10 AdamW steps.
"""
import concurrent.futures
import dataclasses
import functools
import importlib
import itertools
import math
import queue
import threading
from collections import Counter
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

from plumbing import cli, command, demos
from plumbing.launch import gather_numbers, printer, run_main
from plumbing.reference import pipeline_reference

tensor_parallel = importlib.import_module("01_tensor_parallel")
pipeline = importlib.import_module("02_pipeline_1f1b")
gpt3d = importlib.import_module("05_3d_gpt")
zero_bubble = importlib.import_module("06_zero_bubble")
Action = pipeline.Action


# ----------------------------------------------------------------------------------------------
# The lesson: the vocabulary layers over every rank, and each microbatch's output layer as S and T with
# every collective inline, inside 02's 1F1B over its lesson pieces. The world is pp x tp ranks (05's
# grid, tp fastest: rank r tp + t is stage r's tp rank t), the vocabulary group all of them; every rank
# holds the batch's microbatches [(idx, targets)]. Dropout is off, as in every float64 check.


def vocab_stage(cfg, groups, **factory):
    """This rank's part: stage r's blocks (02's Stage of split_layers' range r, over its tp group), with
    no vocabulary layer; wpe on the first stage and ln_f on the last; and on every rank its rows of wte, the
    padded vocabulary cut over the vocabulary group (01's VocabParallelEmbedding), which serve the input
    lookup and the tied output layer alike: the tie is local, no embedding group."""
    r, pp = dist.get_rank(groups.pp), dist.get_world_size(groups.pp)
    stage = pipeline.Stage(cfg, pipeline.split_layers(cfg.n_layer, pp)[r], False, False, group=groups.tp,
                           **factory)  # (b, T, C) in and out
    if r == 0:
        stage.transformer["wpe"] = torch.nn.Embedding(cfg.block_size, cfg.n_embd, **factory)
    if r == pp - 1:
        stage.transformer["ln_f"] = tensor_parallel.LayerNorm(cfg.n_embd, groups.tp, **factory)
    n = dist.get_world_size(groups.vocab)  # pp x tp: rank i holds rows [i V_pad / n, (i + 1) V_pad / n)
    stage.transformer["wte"] = tensor_parallel.VocabParallelEmbedding(
        cfg.vocab_size, tensor_parallel.padded_vocab_size(cfg.vocab_size, n), cfg.n_embd, groups.vocab, **factory)
    return stage


def output_layer(stage, x, targets, n, groups):
    """One microbatch's output layer on every rank of the vocabulary group, Algorithm 1: X broadcast from the
    last stage (x: its ln_f(output) (b, T, C), None elsewhere), then S and T; targets (b, T), each counted one
    weighing 1 / n. Returns (the weighted loss, known on every rank; X's gradient (b, T, C), the last's to use)."""
    shard, vocab, (b, T), C = stage.transformer.wte, groups.vocab, targets.shape, stage.cfg.n_embd
    last = dist.get_world_size(vocab) - tensor_parallel.tp_size(groups.tp)  # the last stage's first rank
    X = x.detach().reshape(b * T, C) if x is not None else shard.weight.new_empty(b * T, C)  # N = b T rows
    dist.broadcast(X, dist.get_global_rank(vocab, last), group=vocab)  # X to every rank
    loss, softmax = output_s_pass(shard, X, targets.reshape(-1), n, stage.cfg.vocab_size, vocab)  # the first barrier
    return loss, output_t_pass(shard, X, *softmax, vocab).view(b, T, C)  # the second


def output_s_pass(shard, X, t, n, V, vocab):
    """S on this rank's slice of wte (shard: rows [start, start + per_rank)) for X (N, C), targets t (N,): the
    logits, their max all-reduced, then their sums of exponentials and the target's logit (the first barrier).
    Returns (the weighted loss, every rank's; what T needs: exp (N, per_rank), total (N,), w, local, mine)."""
    W = shard.weight.detach()
    rows = torch.arange(shard.start, shard.start + shard.per_rank, device=W.device)
    logits = (X @ W.T).masked_fill(rows >= V, -math.inf)  # a padded row (>= V) never a token
    top = tensor_parallel.all_reduce(logits.max(dim=1).values, vocab, dist.ReduceOp.MAX)  # (N,) the global max
    exp = (logits - top[:, None]).exp()  # below 1 on every rank: no overflow; a padded row's 0
    counted, local = t != -100, t - shard.start
    mine = counted & (local >= 0) & (local < shard.per_rank)  # the target's logit is in this slice
    local = local.masked_fill(~mine, 0)
    picked = logits.gather(1, local[:, None]).squeeze(1).masked_fill(~mine, 0)
    total, picked = tensor_parallel.all_reduce(torch.stack([exp.sum(1), picked]), vocab)  # (N,) each, summed
    w = counted.to(X.dtype) / n
    return ((total.log() + top - picked) * w).sum(), (exp, total, w, local, mine)  # log sum exp - target's logit


def output_t_pass(shard, X, exp, total, w, local, mine, vocab):
    """T: d loss / d logits = (softmax - onehot) w on this slice's columns, back through its GEMM: its rows'
    gradient added to shard.weight.grad; returns X's (N, C), every slice's share all-reduced (the second barrier)."""
    grad = exp / total[:, None] * w[:, None]
    grad[torch.arange(X.shape[0], device=X.device), local] -= mine * w
    dW = grad.T @ X  # (per_rank, C): this rank's rows
    shard.weight.grad = dW if shard.weight.grad is None else shard.weight.grad + dW
    return tensor_parallel.all_reduce(grad @ shard.weight.detach(), vocab)


def vocab_1f1b_step(stage, microbatches, groups):
    """02's one_f_one_b_step over the pipeline group, the vocabulary layers on every rank. Before it the input
    layer: each rank looks every token up in its rows (zeros for the others'), the sums all-reduced, the first
    stage adding wpe. Each backward's gradient comes from its microbatch's output layer, which every rank runs
    just before it would receive that gradient (the last stage: right after its forward), so that the collectives
    go in one order everywhere, microbatch 0's first. After it the input layer's backward: the first stage's input
    gradients broadcast to every rank, each through its own lookups. Returns the loss on the last stage, else None."""
    s, pp, m, g = dist.get_rank(groups.pp), dist.get_world_size(groups.pp), len(microbatches), groups.pp
    first, last, (b, T) = s == 0, s == pp - 1, microbatches[0][0].shape
    n = max(sum(int((t != -100).sum()) for _, t in microbatches), 1)  # the batch's counted targets
    out, flight, losses = next(stage.parameters()).new_empty(b, T, stage.cfg.n_embd), [], []  # (b, T, C) travels
    part = stage.transformer.wte(torch.cat([idx for idx, _ in microbatches]))  # (B, T, C): each rank's rows'
    tokens = part.detach()  # share, summed over the vocabulary group (01's g: the identity in backward)
    if first:
        embedded = tokens + stage.transformer.wpe(torch.arange(T, device=tokens.device))
        inputs = [x.detach() for x in embedded.chunk(m)]  # the first stage's inputs: leaves, for their gradients

    def forward(i, x):  # F_i: 02's forward_step of the blocks; on the last stage, then ln_f
        x, y = pipeline.forward_step(stage, microbatches[i], inputs[i] if first else x, None, None)  # no loss
        flight.append((x, stage.transformer.ln_f(y) if last else y))

    def output(j):  # microbatch j's output layer, on every rank: its loss kept, the last stage's gradient
        loss, grad = output_layer(stage, flight[0][1] if last else None, microbatches[j][1], n, groups)
        losses.append(loss)
        return grad

    warmup = min(pp - s - 1, m)  # 1F1B's warm-up
    for i in range(warmup):
        forward(i, pipeline.recv_from(s - 1, out, g))
        pipeline.send_to(flight[-1][1], s + 1, g)
    x = pipeline.recv_from(s - 1, out, g) if warmup < m else None
    for i in range(warmup, m):  # steady: forward microbatch i, then backward the oldest in flight
        forward(i, x)
        grad = output(i - warmup)
        dy = pipeline.send_recv(flight[-1][1], s + 1, out, g)  # send forward, receive backward (last: None)
        dx = pipeline.backward_step(*flight.pop(0), grad if last else dy)
        if i + 1 < m:  # send backward, receive forward: the next microbatch's input
            x = pipeline.send_recv(dx, s - 1, out, g)
        else:
            pipeline.send_to(dx, s - 1, g)
    while flight:  # drain: the backwards left, oldest first (never on the last stage)
        output(m - len(flight))
        x, y = flight.pop(0)
        pipeline.send_to(pipeline.backward_step(x, y, pipeline.recv_from(s + 1, out, g)), s - 1, g)
    grad = torch.cat([x.grad for x in inputs]) if first else torch.empty_like(part)  # (B, T, C)
    if first:
        embedded.backward(grad)  # wpe's gradient
    dist.broadcast(grad, dist.get_global_rank(groups.vocab, 0), group=groups.vocab)  # from the first stage
    part.backward(grad)  # this rank's rows' gradient from the input layer, added to the output layer's
    return sum(losses) if last else None


# ----------------------------------------------------------------------------------------------
# Demo: the lesson against the serial model, then the machine below against the lesson; float64, the
# same weights and the same batch, whose microbatches count unequal numbers of targets (one none).


def demo(env, cfg, args):
    pp, tp, m, say = args.pp, args.tp, args.microbatches, printer(env)
    if pp * tp != env.world_size:  # checked before the first collective
        raise ValueError(f"the world size {env.world_size} does not match pp={pp} x tp={tp}")
    microbatches, full, ref_loss, ref_grads = ref = pipeline_reference(cfg, args, m, env.device, unequal=True)
    say(f"{cfg}\npp={pp} tp={tp} m={m} global batch B={args.batch_size} T={args.seq_len} float64, "
        f"world={env.world_size} ({dist.get_backend()})")
    say(f"targets counted per microbatch: {[int((t != -100).sum()) for _, t in microbatches]}")
    groups = gpt3d.new_groups(env, {**gpt3d.rank_grid(env.world_size, tp, 1, pp), "vocab": [list(range(pp * tp))]})
    stage = vocab_stage(cfg, groups, dtype=torch.float64, device=env.device)
    stage.transformer.wte.weight.split_group = groups.vocab  # its rows cut over pp x tp (plumbing/shards)
    stage.load_full_state_dict(full)  # the serial model's weights
    lesson = vocab_1f1b_step(stage, microbatches, groups), stage.full_grads()
    worst = demos.worst_difference(lesson, ref_loss, ref_grads)
    say(f"the lesson, vocab_1f1b_step (Algorithm 1, V = {cfg.vocab_size} over {pp * tp} ranks): max relative "
        f"difference against serial (loss and every gradient): {worst:.2e} {'PASS' if worst <= 1e-10 else 'FAIL'} "
        f"(tolerance 1e-10)")
    ok = prove_machine(env, cfg, args, ref, lesson, say) and worst <= 1e-10
    say(f"\n{'PASS' if ok else 'FAIL'}")
    return ok


# ----------------------------------------------------------------------------------------------
# Read second: the machine, which the trainer runs. Where the weights live: one slice of the
# vocabulary per rank, input and output layer alike


def spread_vocabulary(cfg, chunks, vocab_group, divisible_by=1):
    """Take the vocabulary layers out of 02's chunks and give this rank its rows of wte, in chunk 0
    under wte's own name (so that 04's buckets and the checkpoints see it as before). The first
    stage's chunk then takes token embeddings, not ids; the last one's forward ends at ln_f."""
    like = next(chunks[0].parameters())
    for c in chunks:
        if "wte" in c.transformer:
            del c.transformer["wte"]
        if c.pre_process:
            c.embed = c.embed_positions  # (b, T, C) in: the input layer's reduced sums
        if c.post_process:
            del c.lm_head  # it was wte's copy: the output layer is S and T now
            c.head = functools.partial(_final_norm, c)
    n = dist.get_world_size(vocab_group)  # pp x tp; its rank i = r tp + t (05's grid: tp fastest)
    shard = tensor_parallel.VocabParallelEmbedding(cfg.vocab_size, tensor_parallel.padded_vocab_size(
        cfg.vocab_size, n, divisible_by), cfg.n_embd, vocab_group, dtype=like.dtype, device=like.device)
    shard.weight.split_group = vocab_group  # split over pp x tp, not its chunk's tp (plumbing/shards)
    shard.forward = functools.partial(own_rows, shard)  # 01's forward without its g: the sums go to the first stage
    chunks[0].transformer["wte"] = shard
    return shard


def own_rows(shard, idx):
    """01's VocabParallelEmbedding before its g: this rank's rows for its own ids, zeros for the others'."""
    local = idx - shard.start
    other = (local < 0) | (local >= shard.per_rank)
    return F.embedding(local.masked_fill(other, 0), shard.weight).masked_fill(other[..., None], 0)


def _final_norm(chunk, x, targets=None, ignore_index=-100):
    return chunk.transformer.ln_f(x)  # X, the output layer's input: (b, T, C), T/tp with sp


# ----------------------------------------------------------------------------------------------
# The passes: the input layer around the step, S and T (Algorithms 1 and 2) per microbatch


class VocabularyPasses:
    """This rank's part of the vocabulary layers, which VocabExecutor runs: start and finish are the
    input layer, s_pass and t_pass the output layer's S and T; input, output and output_grad are
    where the first and last stages meet them. barriers: 2 is Algorithm 1, 1 is Algorithm 2."""

    def __init__(self, shard, chunks, groups, pipe, barriers, ignore_index=-100):
        self.shard, self.barriers, self.ignore_index = shard, barriers, ignore_index
        self.group, self.tp_group, self.pp_group, self.p2p = groups.vocab, groups.tp, groups.pp, groups.vocab_p2p
        rank = dist.get_rank(groups.pp)
        last = pipe.where[pipe.S - 1][0]  # the last stage's rank; stage 0 is rank 0's
        self.first, self.last, self.last_rank = rank == 0, rank == last, last
        self.sp, self.pp = chunks[0].sp, dist.get_world_size(groups.pp)
        rows = torch.arange(shard.start, shard.start + shard.per_rank, device=shard.weight.device)
        self.padding = rows >= shard.weight.tp_full  # padded rows: never a token
        self.stream = Stream(shard.weight.device)

    def start(self, microbatches, norm):
        """The input layer: every microbatch's tokens looked up in this rank's rows, the sums
        reduced along the pipeline to the first stage and over its tp ranks. norm: 02's (num, den)
        of each microbatch: each of its counted tokens weighs num / den."""
        self.training, m = torch.is_grad_enabled(), len(microbatches)
        self.part = self.shard(torch.cat([idx for idx, _ in microbatches]))  # (B, T, C), this rank's share
        total = self.part.detach().clone()
        dist.reduce(total, dist.get_global_rank(self.pp_group, 0), group=self.pp_group)
        if self.first:
            total = tensor_parallel.all_reduce(total, self.tp_group)
            self.inputs = [x.detach().requires_grad_(self.training) for x in total.chunk(m)]
        self.targets = [t.reshape(-1) for _, t in microbatches]  # (b T,) each
        self.weights = [(t != self.ignore_index).to(total.dtype) * (num / den if den else 0.0)
                        for t, (num, den) in zip(self.targets, norm)]
        b, T, C = *microbatches[0][0].shape, total.shape[-1]
        self.shape, self.sent_shape = (b, T, C), (b, T // tensor_parallel.tp_size(self.tp_group) if self.sp else T, C)
        self.x, self.saved, self.stats, self.grads, self.sends = {}, {}, {}, {}, []

    def input(self, mb):
        return self.inputs[mb]  # the first stage's input: (b, T, C)

    def output(self, mb, y):
        """The last stage's output X, handed to every other rank of its pipeline for S."""
        self.x[mb] = y.detach()
        self.sends += [dist.isend(self.x[mb], dist.get_global_rank(self.p2p, r), group=self.p2p)
                       for r in range(self.pp) if r != self.last_rank]

    def s_pass(self, mb):
        """S: this slice's logits and their statistics; their all-reduce is the first barrier."""
        x = self.x.pop(mb) if self.last else self._receive()
        x = tensor_parallel.gather(x, self.tp_group, 1) if self.sp else x  # the whole sequence
        x = rearrange(x, "b T C -> (b T) C").requires_grad_(self.training and self.barriers == 2)
        weight = self.shard.weight  # (V_pad / (pp tp), C)
        logits = F.linear(x, weight).masked_fill(self.padding, -math.inf)  # (N, V_pad / (pp tp))
        y = logits.detach().float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.detach()
        # A slice of padding only has no finite logit: its max is taken as the lowest float, so that
        # its exponentials and its rescaling below are 0, not NaN.
        top = y.max(dim=1).values.clamp_min(torch.finfo(y.dtype).min)
        local = self.targets[mb] - self.shard.start
        mine = (self.targets[mb] != self.ignore_index) & (local >= 0) & (local < y.shape[1])
        local = local.masked_fill(~mine, 0)
        picked = y.gather(1, local[:, None]).squeeze(1).masked_fill(~mine, 0)  # the target's logit
        exp = y.sub_(top[:, None]).exp_()  # in place: T needs the logits' graph, not their values
        sums = [exp.sum(1), picked]  # (N,) each
        if self.barriers == 1 and self.training:  # Algorithm 2: X's gradient before the statistics,
            w = weight.detach().to(y.dtype)  # from this slice's softmax, as exp(y - top) W and onehot W
            sums += [exp @ w, w[local] * mine[:, None]]  # (N, C) each
        self.stats[mb] = self.stream.submit(self._statistics, top, sums)
        self.saved[mb] = logits, exp, top, x, local, mine

    def _statistics(self, top, sums):
        """The barrier (on the stream): the global max, then one all-reduce of the sums, each rank's
        rescaled from its own max to the global one. Returns (max, sum of exp, target logit, ...)."""
        top_all = tensor_parallel.all_reduce(top, self.group, dist.ReduceOp.MAX)
        scale = (top - top_all).exp()  # (N,)
        sums = [sums[0] * scale, sums[1]] + ([sums[2] * scale[:, None], sums[3]] if len(sums) > 2 else [])
        flat = tensor_parallel.all_reduce(torch.cat([s.reshape(-1) for s in sums]), self.group)
        return (top_all, *[p.view_as(s) for p, s in zip(flat.split([s.numel() for s in sums]), sums)])

    def t_pass(self, mb):
        """T: (softmax - onehot) of this slice, weighted, back through its GEMM: the rows' gradient
        (and, in Algorithm 1, this slice's share of X's: its all-reduce is the second barrier)."""
        logits, exp, top, x, local, mine = self.saved.pop(mb)
        top_all, total = self.stats[mb].result()[:2]  # waits for every rank's S
        w = self.weights[mb]
        grad = exp.mul_(((top - top_all).exp() / total * w)[:, None])  # the softmax, weighted, in place
        grad[torch.arange(len(local), device=grad.device), local] -= mine * w  # minus the one-hot target
        torch.autograd.backward(logits, grad.to(logits.dtype))
        if self.barriers == 2:
            self.grads[mb] = self.stream.submit(tensor_parallel.all_reduce, x.grad, self.group)

    def output_grad(self, mb):
        """The gradient the last stage's backward starts from: X's, summed over every rank."""
        if self.barriers == 2:
            grad = self.grads.pop(mb).result()
        else:  # Algorithm 2: (sum of exp(y - max) W / sum of exp - onehot W), weighted
            _, total, _, expw, onehot = self.stats[mb].result()
            grad = self.weights[mb][:, None] * (expw / total[:, None] - onehot)
        grad = grad.view(self.shape)
        return (tensor_parallel.split(grad, self.tp_group, 1) if self.sp else grad).to(self.shard.weight.dtype)

    def _receive(self):
        x = torch.empty(self.sent_shape, dtype=self.shard.weight.dtype, device=self.shard.weight.device)
        dist.recv(x, dist.get_global_rank(self.p2p, self.last_rank), group=self.p2p)  # in S's order
        return x

    def finish(self):
        """The loss (every rank has the statistics; the last stage's rank returns it, as 02's
        executor does), then the input layer's backward: the first stage's input gradients
        broadcast along the pipeline, and each rank's rows' share through its lookup."""
        for work in self.sends + list(self.grads.values()):  # Algorithm 1's other ranks never read theirs
            work.wait() if hasattr(work, "wait") else work.result()
        loss = sum(((total.log() + top - picked) * w).sum() for w, (top, total, picked, *_) in
                   zip(self.weights, (self.stats[mb].result() for mb in range(len(self.weights)))))
        if self.training:
            grad = torch.cat([x.grad for x in self.inputs]) if self.first else torch.empty_like(self.part)
            dist.broadcast(grad, dist.get_global_rank(self.pp_group, 0), group=self.pp_group)
            torch.autograd.backward(self.part, grad)
        return loss.detach().to(self.shard.weight.dtype) if self.last else None


# ----------------------------------------------------------------------------------------------
# The schedules as data: S and T inserted into a schedule's lists (the paper's Figure 10, for 1F1B),
# and how 02 runs them


def warm_up(acts, n):
    """acts with every forward n places earlier among the other actions (each kind's order kept):
    n more microbatches in flight, so that the last stage can wait out n barriers."""
    forwards, rest, count = [a for a in acts if a.kind == "F"], [], 0
    for a in acts:  # every other action, with the number of forwards before it
        count += a.kind == "F"
        if a.kind != "F":
            rest.append((min(count + n, len(forwards)), a))
    out, seen = [], 0
    for before, a in rest:
        out += forwards[seen:before]
        seen = max(seen, before)
        out.append(a)
    return out + forwards[seen:]


def insert_passes(base, m, barriers, warm=None):
    """Every rank's list of `base` (a 05 PipelineSchedule) with S and T added. The lists, with
    `warm` (unset: `barriers`) more warm-up forwards, are simulated at the paper's equal times (t_F = 1, t_B = 2,
    halved per chunk of ZB-V). On every rank S_i goes before the first action that starts once the
    last stage's F of microbatch i has ended, and T_i before the first that starts once the last
    stage's next action has ended: each barrier has a pass of slack to hide in. The passes are in
    the same order on every rank."""
    t, warm = Fraction(1, base.v), replace(base, lists=[warm_up(acts, warm or barriers) for acts in base.lists])
    sim = pipeline.simulate(warm, t, 2 * t, times={"I": t, "W": t})
    last = base.where[base.S - 1]
    timeline = sim.timeline[last[0]]
    at = {a.mb: j for j, (_, _, a) in enumerate(timeline) if a.kind == "F" and a.chunk == last[1]}

    def slack(i):  # the end of the last stage's action after F_i, unless that is B_i, fed by T_i (m = 1)
        j = at[i] + 1
        return timeline[j - (barriers == 2 and timeline[j][2] in (Action("B", i, last[1]), Action("I", i, last[1])))][1]

    passes = sorted([(timeline[at[i]][1], Action("S", i)) for i in range(m)] +  # once X_i exists
                    [(slack(i), Action("T", i)) for i in range(m)],  # T_{i-1} before S_i, T_i after
                    key=lambda p: (p[0], p[1].mb + (p[1].kind == "T") / 2))
    out = []
    for timeline in sim.timeline:
        acts, j = [], 0
        for start, _, a in timeline:
            while j < len(passes) and passes[j][0] <= start:
                acts.append(passes[j][1])
                j += 1
            acts.append(a)
        out.append(acts + [p[1] for p in passes[j:]])
    return out


def vocab_kinds(kinds, grad_from):
    """kinds with S and T: S_i waits for the last stage's F_i (its output X_i), T_i for S_i on every
    rank (the statistics' all-reduce); and the last stage's backward (B, or 06's I) for `grad_from`
    on every rank, whose all-reduce brings X_i's gradient. They are collectives: every rank runs them,
    once a microbatch, in the same order."""
    def last(a, r, s):
        return s.where[s.S - 1]

    def every(kind):
        return lambda a, r, s: [(q, Action(kind, a.mb)) for q in range(s.pp)]

    back = "I" if "I" in kinds else "B"
    return {**kinds, "S": pipeline.Kind(None, waits=lambda a, r, s: [(last(a, r, s)[0], Action("F", a.mb, last(a, r, s)[1]))]),
            "T": pipeline.Kind(None, "S", waits=every("S")),
            back: replace(kinds[back], waits=lambda a, r, s: every(grad_from)(a, r, s) if (r, a.chunk) == last(a, r, s)
                          else [])}


class VocabExecutor(zero_bubble.SplitExecutor):
    """06's executor (02's with I and W) with the vocabulary layers: the input layer around the step,
    the first stage's input from it, the last stage's output to it and its gradient from it, S and
    T as actions. 07's plan runs S and T while a boundary's messages travel."""

    def __init__(self, passes, *args):
        super().__init__(*args)
        self.passes = passes

    def run(self, microbatches, valid=None, norm=None, ignore_index=-100):
        valid = valid or [int((t != ignore_index).sum()) for _, t in microbatches]
        norm = norm or [(1, sum(valid))] * len(valid)
        self.passes.start(microbatches, norm)
        result = super().run(microbatches, valid, norm)
        result.loss = self.passes.finish()
        return result

    def input(self, mb):
        return self.passes.input(mb)

    def output(self, mb, y):
        self.passes.output(mb, y)
        return y

    def output_grad(self, mb):
        return self.passes.output_grad(mb)

    def run_S(self, a, k):
        self.passes.s_pass(a.mb)

    def run_T(self, a, k):
        self.passes.t_pass(a.mb)


@dataclass
class VocabSchedule(zero_bubble.ZeroBubbleSchedule):
    """06's schedule (1F1B, ZB-H1 or ZB-V) with S and T: its own groups (grid), the vocabulary spread
    over the chunks (prepare), its executor, and plans whose passes run during a boundary (plan)."""
    barriers: int = 2
    divisible_by: int = 1  # V_pad a multiple of it times pp tp (05's trainer: 128, Megatron's, for aligned GEMMs)
    passes: object = field(default=None, repr=False)  # this rank's VocabularyPasses, once prepared

    def grid(self, world, tp, dp):
        """05's grid with the vocabulary groups: each replica's pp x tp ranks, and a second group per
        pipeline (the last stage's output sent to every rank). The embedding is tied on each rank
        (one slice of wte serves input and output alike): no embedding group."""
        grid = dict(super().grid(world, tp, dp), embed=[])
        grid["vocab"] = [sorted(r for g in grid["pp"] for r in g if r // tp % dp == d) for d in range(dp)]
        grid["vocab_p2p"] = [list(g) for g in grid["pp"]]
        return grid

    def prepare(self, chunks, groups, full):
        shard = spread_vocabulary(chunks[0].cfg, chunks, groups.vocab, self.divisible_by)
        tensor_parallel.load_full_state_dict(shard, {"weight": full["transformer.wte.weight"]}, groups.vocab)
        self.passes = VocabularyPasses(shard, chunks, groups, self, self.barriers)
        if "I" in self.kinds:  # 06's split, for ZB-H1 and ZB-V
            super().prepare(chunks)

    def executor(self, chunks, pp_group, wire, exchange=None, deallocate=True):
        return VocabExecutor(self.passes, self.split, self, chunks, pp_group, wire, exchange, deallocate)

    def forward_only(self):
        return replace(self, lists=[[Action(a.kind, a.mb, a.chunk) for a in acts if a.kind in "FS"]
                                    for acts in self.lists])

    def plan(self, rank):
        """06's plan of the pipeline's own actions, with S and T put back in: a pass between two
        actions runs inside the boundary between them, after its messages are posted and before they
        are waited for, so that the boundary stays one batch (sends cut from receives could deadlock)
        and the passes never wait for the pipeline's messages."""
        own = replace(self, lists=[[a for a in acts if a.kind not in "ST"] for acts in self.lists])
        steps, due, n = super(VocabSchedule, own).plan(rank), {}, 0  # due[i]: passes before own action i
        for a in self.lists[rank]:
            if a.kind in "ST":
                due.setdefault(n, []).append(a)
            else:
                n += 1
        out, n = [], 0
        for step in steps:
            if step[0] == "run" and n in due:  # no boundary before this action: the passes first
                out += [("run", a, 0) for a in due.pop(n)]
            out.append(step)
            if step[0] == "post" and n in due:  # the boundary before action n: the passes inside it
                out += [("run", a, 0) for a in due.pop(n)]
            n += step[0] == "run"
        return out + [("run", a, 0) for a in due.pop(n, [])]


def validate(pipe, m):
    """02's validation of the pipeline's own actions; then S and T: each once a microbatch on every
    rank, T after S, in the same order everywhere (they are collectives); then every plan, with the
    passes and what they wait for, free of deadlock (02's check_plans)."""
    own = {k: v for k, v in pipe.kinds.items() if k not in "ST"}
    pipeline.check_lists(replace(pipe, lists=[[a for a in acts if a.kind not in "ST"] for acts in pipe.lists],
                                 kinds=own), m)
    first = [a for a in pipe.lists[0] if a.kind in "ST"]
    for r, acts in enumerate(pipe.lists):
        order = [a for a in acts if a.kind in "ST"]
        want, have = Counter(Action(k, i) for k in "ST" for i in range(m)), Counter(order)
        for a in want - have:
            raise pipeline.ScheduleError(f"rank {r} never runs {a}")
        for a in have - want:
            raise pipeline.ScheduleError(f"rank {r} runs {a} more often than once, or it does not exist")
        for i in range(m):
            if order.index(Action("T", i)) < order.index(Action("S", i)):
                raise pipeline.ScheduleError(f"rank {r} runs T{i} before S{i}")
        if order != first:  # collectives: gloo and NCCL match them by order
            n = next(i for i, (x, y) in enumerate(zip(order, first)) if x != y)
            raise pipeline.ScheduleError(f"rank {r} issues its collectives in another order than rank 0: the "
                                         f"{n}th is {order[n]} there, {first[n]} on rank 0")
    pipeline.check_plans(pipe)


def vocab_schedule(name, pp, m, barriers, divisible_by=1):
    """05's PipelineSchedule of 06's "1f1b", "zb-h1", "zb-v" or "v-half" with the vocabulary passes: Algorithm 1
    (barriers=2: X's gradient after T) or 2 (barriers=1: after S); V padded to a multiple of
    divisible_by times pp tp."""
    base = zero_bubble.pipeline_schedule(name, pp, m)
    # A repeated block (06's V-Half) runs two forwards a repetition: one more forward in flight splits a
    # repetition, and its chunks wait on each other (simulated bubble 0.77, not 0.29, at pp 4, m 8). Two.
    warm = 2 if name in zero_bubble.V_SCHEDULES else barriers
    return VocabSchedule(insert_passes(base, m, barriers, warm), base.placement,
                         vocab_kinds(base.kinds, "T" if barriers == 2 else "S"),
                         name=f"{base.name} + vocabulary parallelism, Algorithm {3 - barriers}", bubble=base.bubble,
                         times={**base.times, "S": 0, "T": 0}, lockstep=getattr(base, "lockstep", False),
                         barriers=barriers, divisible_by=divisible_by)


# ----------------------------------------------------------------------------------------------
# The demo's machine part: the balance, simulated for two vocabularies, then every schedule against
# the serial model and 1F1B's against the lesson


def balance(cfg, pp, tp, m, b, T, V, barriers=2):
    """Each stage's parameters (all its tp ranks), compute per microbatch (forward + backward, in
    units of one layer's: Table 4's b s h (72 h + 12 s)) and peak memory, without and with
    vocabulary parallelism, and the simulated 1F1B steps (layers' times from the same FLOPs)."""
    h, l = cfg.n_embd, cfg.n_layer // pp
    layer = b * T * h * (24 * h + 4 * T)  # a layer's forward; its backward is twice that
    out, inp = 2 * b * T * h * V / layer, b * T * h / layer  # the output layer's forward, the lookup's
    rows, spread = tensor_parallel.padded_vocab_size(V, tp), tensor_parallel.padded_vocab_size(V, pp * tp) // pp
    plain_f = [l + inp * (r == 0) + out * (r == pp - 1) for r in range(pp)]
    s_t, t_t = (out / pp, 2 * out / pp) if barriers == 2 else (2 * out / pp, out / pp)  # 3 GEMMs either way
    vocab = vocab_schedule("1f1b", pp, m, barriers)
    sims = (pipeline.simulate(pipeline.Schedule([pipeline.one_f_one_b(pp, m, r) for r in range(pp)]), plain_f,
                              [2 * f for f in plain_f]),
            pipeline.simulate(vocab, l + inp / pp, 2 * (l + inp / pp), times={"S": s_t, "T": t_t}))
    params = []
    for r in range(pp):  # on "meta": nothing is allocated
        chunk = pipeline.build_chunks(dataclasses.replace(cfg, vocab_size=V), pp, r, device="meta")[0]
        own = sum(p.numel() for n, p in chunk.named_parameters() if n != "transformer.wte.weight")
        params.append((own + rows * h * ("wte" in chunk.transformer), own + spread * h))
    logits = [[b * T * rows * (r == pp - 1) for r in range(pp)],  # softmax saved from F to B on the last stage
              [b * T * spread * logits_held(acts) for acts in vocab.lists]]  # every rank, from S to T
    return dict(params=params, compute=[(3 * f, 3 * l + (s_t + t_t + 3 * inp / pp)) for f in plain_f], sims=sims,
                logits=logits, barriers=barriers)


def logits_held(acts):
    """The most microbatches whose logits a rank holds at once: past S and not yet past T."""
    return max(itertools.accumulate((a.kind == "S") - (a.kind == "T") for a in acts))


def run_step(env, cfg, pipe, groups, ref, steps=None):
    """One forward and backward of pipe on this rank, float64: the worst difference from serial, and
    (loss or None, {name: full gradient}) of this rank's chunks; the step's StepResult appended to steps."""
    microbatches, full, ref_loss, ref_grads = ref
    rank = dist.get_rank(groups.pp)
    chunks = pipeline.build_chunks(cfg, pipe.pp, rank, pipe.v, groups.tp, pipe.placement, init=False,
                                   dtype=torch.float64, device=env.device)
    for c in chunks:
        c.load_full_state_dict(full)
    pipe.prepare(chunks, groups, full)
    result = pipeline.execute(pipe, chunks, groups.pp, microbatches, pipeline.Wire((*microbatches[0][0].shape,
                                                                                   cfg.n_embd)))
    grads = {n: g for c in chunks for n, g in c.full_grads().items()}
    diffs = [tensor_parallel.max_rel_diff(g, ref_grads[n]) for n, g in grads.items()]
    worst = max(diffs + ([tensor_parallel.max_rel_diff(result.loss, ref_loss)] if result.loss is not None else []))
    if steps is not None:
        steps.append(result)
    return worst, (result.loss, grads)


def prove_machine(env, cfg, args, ref, lesson, say):
    """The balance simulated for two vocabularies; then every schedule with both algorithms against the
    serial model, and 1F1B's against the lesson (its loss and every gradient, this rank's)."""
    pp, tp, m = args.pp, args.tp, args.microbatches
    if env.rank == 0:
        b, T = args.batch_size // args.microbatches, args.seq_len
        steps = [demos.report_balance(say, cfg, args, V, balance(cfg, args.pp, args.tp, args.microbatches, b, T, V))
                 for V in (cfg.vocab_size, args.large_vocab)]
        say(f"\nV {cfg.vocab_size:,} -> {args.large_vocab:,}: the simulated step grows {steps[1][0] / steps[0][0]:.2f}x "
            f"without vocabulary parallelism, where every stage waits for the last one's output layer,\nand "
            f"{steps[1][1] / steps[0][1]:.2f}x with it, where every rank does 1/{pp * tp} of it (Table 4: the "
            f"output layer is 6 b s h V FLOPs)")
    say(f"\n=== executed against the serial model, float64, V = {cfg.vocab_size} padded to "
        f"{tensor_parallel.padded_vocab_size(cfg.vocab_size, pp * tp)} over {pp * tp} ranks ===")
    groups, ok, runs = None, True, {}
    for name in ("1f1b", "zb-h1", "zb-v") if args.schedule == "all" else ("1f1b", args.schedule):
        for barriers in (2, 1):
            pipe = vocab_schedule(name, pp, m, barriers)
            validate(pipe, m)
            groups = groups or gpt3d.new_groups(env, pipe.grid(env.world_size, tp, 1))
            worst, got = run_step(env, cfg, pipe, groups, ref, steps := [])
            rows = gather_numbers([worst, sum(e - s for s, e, _ in steps[0].events), steps[0].peak_activation_bytes],
                                  device=env.device)
            worst, runs[name, barriers] = max(x[0] for x in rows), (pipe, [x[1:] for x in rows[::tp]])  # tp rank 0's
            ok &= worst <= 1e-10
            say(f"{pipe.name}: max relative difference (loss and every gradient) {worst:.2e} "
                f"{'PASS' if worst <= 1e-10 else 'FAIL'} (tolerance 1e-10)")
            if name == "1f1b":  # the lesson's stages: the same parameters on each rank
                same = demos.worst_difference(got, *lesson)
                ok &= same <= 1e-12
                say(f"  the machine (VocabSchedule, VocabExecutor, VocabularyPasses) against the lesson's "
                    f"vocab_1f1b_step: {same:.2e} {'PASS' if same <= 1e-12 else 'FAIL'} (tolerance 1e-12)")
    if args.schedule == "v-half":
        ok &= report_v_half_balance(cfg, args, runs, say)
    last, kinds = vocab_schedule("1f1b", pp, m, 2).lists, vocab_kinds(pipeline.KINDS, "T")
    say(f"\n1F1B with Algorithm 1 on rank {pp - 1}, the last stage: {' '.join(map(str, last[-1][:12]))} ...\n"
        f"  S_i follows the last stage's F_i, T_i the action after it, and B_i comes later still: each barrier's\n"
        f"  all-reduce has a pass to hide in (rank 0 holds {pipeline.peak_in_flight(last[0], kinds)} microbatches in flight: "
        f"pp + 2, at most m = {m})")
    return ok


def v_half_balance(cfg, T, pipe, barriers):
    """Each rank's compute and activations, simulated from pipe's lists (vocabulary parallelism in 1F1B
    or V-Half): its busy time in one layer's forward (F = I = W = 1 a layer, S and T as balance()
    times them) and its peak activations in layer-microbatches (06's peak_memory, M_W = M_B / 2)."""
    h, per_chunk = cfg.n_embd, Fraction(cfg.n_layer, pipe.pp * pipe.v)
    out = Fraction(2 * cfg.vocab_size, 24 * h + 4 * T) / pipe.pp  # a rank's slice of the output layer's forward
    s_t, t_t = (out, 2 * out) if barriers == 2 else (2 * out, out)
    sim = pipeline.simulate(pipe, per_chunk, 2 * per_chunk, times={"I": per_chunk, "W": per_chunk, "S": s_t, "T": t_t})
    return ([sim.step_time - idle for idle in sim.idle],
            [zero_bubble.peak_memory(acts, Fraction(1, 2)) * per_chunk for acts in pipe.lists])


def report_v_half_balance(cfg, args, runs, say):
    """The paper's claim (Yeung et al. 2024, abstract): with V-Half, vocabulary parallelism balances
    compute and memory perfectly, a max/min over ranks of 1.00 in both. Printed for both algorithms,
    simulated (v_half_balance) and measured (runs: {(name, barriers): (pipe, [(busy s, peak bytes)]
    per stage)}), beside 1F1B's. True when V-Half's simulated compute is balanced and its
    activations, simulated and measured, are more balanced than 1F1B's."""
    ratio, ok = lambda xs: float(max(xs) / min(xs)) if min(xs) else float("inf"), True  # noqa: E731
    say(f"\n=== balance across ranks (Yeung et al. 2024: V-Half with vocabulary parallelism has \"perfect balance\": "
        f"max/min over ranks 1.00 in compute and memory) ===")
    for barriers in (2, 1):
        figs = {}
        for name in ("1f1b", "v-half"):
            pipe, measured = runs[name, barriers]
            compute, memory = v_half_balance(cfg, args.seq_len, pipe, barriers)
            busy, peak = zip(*measured)
            figs[name] = [ratio(compute), ratio(busy), ratio(memory), ratio(peak)]
            say(f"{pipe.name}:\n  compute per rank, simulated (a layer's forward = 1) "
                f"{[f'{float(x):.2f}' for x in compute]}: max/min {figs[name][0]:.2f}; measured busy ms "
                f"{[f'{1e3 * b:.1f}' for b in busy]}: {figs[name][1]:.2f}\n  activations per rank, simulated "
                f"(layers x microbatches) {[f'{float(x):g}' for x in memory]}: {figs[name][2]:.2f}; measured bytes "
                f"{[int(x) for x in peak]}: {figs[name][3]:.2f}; logits held from S to T: "
                f"{[logits_held(acts) for acts in pipe.lists]} microbatches")
        ok &= figs["v-half"][0] == 1 and figs["v-half"][2] < figs["1f1b"][2] and figs["v-half"][3] < figs["1f1b"][3]
    say("  compute: every rank runs its layers' F, I and W and 1/pp of the vocabulary in both, so both are 1.00 "
        "simulated;\n    measured, the ranks share this machine's cores: the gap is the machine's, not the schedule's\n"
        "  activations: 1F1B's rank r holds pp - r + barriers microbatches (at most m); V-Half's ranks about the "
        "same, above 1.00\n    by 06's period-6 block (each rank's two lifespans fill their repetitions differently, "
        "half a chunk at most), and\n    measured, by what W keeps (about a whole microbatch's activations here, "
        "not half) and rank 0's two ends of the V")
    return ok


# ----------------------------------------------------------------------------------------------
# After the concept: the paper's second stream (Figure 5), on which the barriers' collectives run
# while the pipeline goes on


class Stream:
    """The paper's second stream (Figure 5): the vocabulary group's collectives, run one at a time in
    the order submitted, which is the order the passes run, the same on every rank (validate checks
    it). submit(fn, *args) returns a Future; a pass waits only when it reads a result. On a GPU, fn
    runs on this thread, on a CUDA stream of its own: NCCL enqueues its collectives without blocking
    the host, and every rank issues them, and its pipeline's sends and receives, in one order, its
    plan's (two threads enqueueing onto one device could interleave them differently on two ranks,
    each waiting for the other). On a CPU gloo blocks the host in a collective, so fn runs on a
    thread of its own (gloo matches each group's collectives by order; its groups wait on no other)."""

    def __init__(self, device):
        self.cuda = torch.cuda.Stream(device) if device.type == "cuda" else None
        if not self.cuda:
            self.jobs = queue.SimpleQueue()
            threading.Thread(target=self._work, daemon=True, name="vocabulary collectives").start()

    def submit(self, fn, *args):
        future = concurrent.futures.Future()
        if not self.cuda:
            self.jobs.put((future, fn, args))
            return future
        self.cuda.wait_stream(torch.cuda.current_stream())  # its inputs, computed on the compute stream
        with torch.cuda.stream(self.cuda):
            out = fn(*args)  # enqueued; the collectives' results are ready when this stream gets there
        return _OnStream(out, self.cuda)

    def _work(self):
        while True:
            future, fn, args = self.jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # raised again where the result is wanted
                future.set_exception(e)


class _OnStream:
    """A result computed on another CUDA stream: result() makes the current stream wait for it."""

    def __init__(self, out, stream):
        self.out, self.stream = out, stream

    def result(self):
        current = torch.cuda.current_stream()
        current.wait_stream(self.stream)
        for t in (self.out if isinstance(self.out, tuple) else (self.out,)):
            t.record_stream(current)  # made on the other stream, read on this one: not freed early
        return self.out


# ----------------------------------------------------------------------------------------------
# After the concept: the demo's flags, the trainer's (--train: 05's loop, with --vocab-barriers and
# --schedule), the command line.


@dataclass
class DemoConfig:
    microbatches: int = 5  # m, microbatches the batch is cut into
    batch_size: int | None = None  # global batch B, in sequences (unset: 2 m)
    seq_len: int = 32  # T, tokens per sequence
    seed: int = 1234  # for the weights and the batch
    pp: int = 4  # pipeline stages
    tp: int = 2  # tensor-parallel ranks per stage: pp x tp CPU ranks started here, or torchrun's world
    large_vocab: int = 32768  # the second vocabulary of the simulated figures
    schedule: Literal["all", "v-half"] = "all"  # all: 1F1B, ZB-H1, ZB-V; v-half: 1F1B and V-Half, their balance


@dataclass
class VocabParallel:
    vocab_barriers: Literal[1, 2] = 2  # 2: Algorithm 1 (statistics, then X's gradient); 1: Algorithm 2 (both at once)
    schedule: Literal["1f1b", "zb-h1", "zb-v", "v-half"] = "1f1b"  # the schedule the passes go into (zb-*, v-half: 06's)


@dataclass
class TrainConfig(VocabParallel, gpt3d.TrainConfig):
    """05's flags, --vocab-barriers and --schedule."""


def parser():
    p = cli.demo_parser(__doc__, DemoConfig, tensor_parallel.GPTConfig, vocab_size=1001, block_size=64, n_layer=8,
                        n_head=4, n_embd=64)
    p.add_argument("--train", action="store_true", help="train with 05's loop instead: every flag of 05, and "
                   "--vocab-barriers 1|2, --schedule (see --train --help)")
    return p


def schedule_of(tc):
    """The trainer's seam (05's train and main): the schedule with the vocabulary passes."""
    return vocab_schedule(tc.schedule, tc.pp, tc.microbatches, tc.vocab_barriers, gpt3d.VOCAB_DIVISIBLE_BY)


def train(env, cfg, tc, quiet=False):
    """05's training loop on one rank, with vocabulary parallelism."""
    return gpt3d.train(env, cfg, tc, quiet, schedule_of)


def start_demo(cfg, args):
    if cfg.n_layer % (2 * args.pp):  # refused before any rank starts, as every other flag is
        raise ValueError(f"--n-layer {cfg.n_layer}: the demo runs ZB-V, which cuts the model into 2 x pp = "
                         f"{2 * args.pp} stages, and n_layer is not divisible by them")
    return all(tensor_parallel.launch(demo, args.pp * args.tp, cfg, args))


def main():
    return command.later_chapter(parser, VocabParallel, "vocabulary parallelism (07)", TrainConfig, schedule_of,
                                 start_demo)


if __name__ == "__main__":
    run_main(main)
