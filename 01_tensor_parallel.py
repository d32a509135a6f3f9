"""01 - Tensor parallelism on an exact GPT-2 (Shoeybi et al. 2019, "Megatron-LM", Section 3), and
sequence parallelism (Korthikanti et al. 2022, Section 4.2.2).

What this file adds: the foundation, which every later file imports. Read first: the conjugate operators of
the paper's Figure 3, f (identity forward, all-reduce backward) and g (all-reduce forward, identity backward);
column- and row-parallel linear layers, a vocab-parallel embedding, a loss over the summed logits; a GPT-2
built from them in which tp=1 *is* the serial model. Read second: the paper's loss, which never gathers the
logits; sequence parallelism (the paper's g and g-bar, in f's and g's places); then the machine: GPT (a
pipeline's part, checks, dropout and its tracker, the paper's loss) and an optimization.

Run it:
    python 01_tensor_parallel.py                  # tp=2, two CPU ranks started here (gloo)
    python 01_tensor_parallel.py --tp 4 --sequence-parallel
    torchrun --nproc-per-node 8 01_tensor_parallel.py --tp 8   # one GPU per rank (NCCL)

The demo runs the serial GPT-2 and the tensor-parallel one from the same float64 weights on one batch,
prints their differences and every collective, named by its operator (f, g) and layer, and exits 1
past 1e-10 (docs/GUIDE.md explains each line).

Glossary, used in every file:
    B batch, T sequence length, C = n_embd channels, nh heads, hs = C // nh head size, V vocabulary;
    tp / pp / dp: tensor- / pipeline- / data-parallel sizes, v virtual chunks per rank, m microbatches.
"""
import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from plumbing import cli, demos
from plumbing.checks import check_model
from plumbing.data import check_targets, check_tokens  # noqa: F401 (01 re-exports check_targets)
from plumbing.launch import launch, new_tp_group, printer, run_main  # the first two: for the README
from plumbing.shards import FullWeights, gather_full, init_full, join_shards, keep_part, load_full_state_dict, \
    materialize, max_rel_diff, split_full  # noqa: F401 (01 re-exports them: tensor_parallel.split_full and so on)
from plumbing.trace import trace_comm


# ----------------------------------------------------------------------------------------------
# f and g, the conjugate operators (Figure 3). A tp group of size 1, or group=None, is no tensor
# parallelism: both are then the identity, and nothing needs torch.distributed.


class CopyToTP(torch.autograd.Function):
    """f: identity in forward, all-reduce in backward. It enters a tp region: every rank uses the
    same input, so the input's gradient is the sum of the ranks' partial gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce in forward, identity in backward. It leaves a tp region: the output is the sum
    of the ranks' partial outputs, and each partial output's gradient is the whole gradient."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x, group):  # f, before a column-parallel layer; the identity at tp = 1
    return x if tp_size(group) == 1 else CopyToTP.apply(x, group)


def reduce_from_tp(x, group):  # g, after a row-parallel layer
    return x if tp_size(group) == 1 else ReduceFromTP.apply(x, group)


def tp_size(group):
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group):
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x, group, op=dist.ReduceOp.SUM):
    """The sum (or max) of x over the group's ranks, in a new tensor: an input is never written."""
    if tp_size(group) > 1:
        dist.all_reduce(x := x.clone(), op=op, group=group)
    return x


def enter_tp(x, group, sp):  # into a column-parallel layer: f, or with sp Korthikanti's g (all-gather T; SP, below)
    return gather_from_sp(x, group) if sp else copy_to_tp(x, group)


def exit_tp(y, group, sp):  # out of a row-parallel layer: g, or with sequence parallelism its g-bar
    return reduce_scatter_to_sp(y, group) if sp else reduce_from_tp(y, group)


def sp_param(p, group, sp):  # with sp, f on a replicated parameter used on T/tp tokens: its gradient sums them
    return copy_to_tp(p, group) if sp else p


# ----------------------------------------------------------------------------------------------
# The model's config, and its layers. A split parameter carries .tp_dim (the dim it is split along), .tp_full
# (its unpadded full size there) and .tp_fused (how many split blocks it stacks: read by plumbing/shards.py).


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # V, the vocabulary (GPT-2's BPE has 50257 tokens, bytes 256)
    block_size: int = 1024  # longest sequence; size of the learned position table
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # nh, attention heads
    n_embd: int = 768  # C, channels of the residual stream (hs = C / nh per head)
    dropout: float = 0.0  # on embeddings, attention probabilities and both residual branches (GPT's; the lesson has none)


def _mark_split(p, dim, full, fused=1):
    p.tp_dim, p.tp_full, p.tp_fused = dim, full, fused
    return p


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by output columns: rank i computes f(X) A_i + b_i, its n_out/tp
    columns of Y, with no communication in forward (f is the identity there)."""

    def __init__(self, n_in, n_out, group, sp=False, fused=1, bias=True, **factory):
        super().__init__()
        tp = tp_size(group)
        if n_out % (fused * tp):
            raise ValueError(f"output size {n_out} must be divisible by {fused} x tp={tp}")
        self.group, self.sp = group, sp
        self.weight = _mark_split(nn.Parameter(torch.empty(n_out // tp, n_in, **factory)), 0, n_out, fused)
        self.bias = _mark_split(nn.Parameter(torch.empty(n_out // tp, **factory)), 0, n_out, fused) if bias else None

    def forward(self, x):  # (B, T, n_in), or (B, T/tp, n_in) with sequence parallelism
        return F.linear(enter_tp(x, self.group, self.sp), self.weight, self.bias)  # (B, T, n_out/tp)


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by input rows and X already split: Y = g(sum_i X_i A_i), then + b."""

    def __init__(self, n_in, n_out, group, sp=False, **factory):
        super().__init__()
        tp = tp_size(group)
        if n_in % tp:
            raise ValueError(f"input size {n_in} must be divisible by tp={tp}")
        self.group, self.sp = group, sp
        self.weight = _mark_split(nn.Parameter(torch.empty(n_out, n_in // tp, **factory)), 1, n_in)
        self.bias = nn.Parameter(torch.empty(n_out, **factory))

    def forward(self, x):  # (B, T, n_in/tp)
        y = exit_tp(F.linear(x, self.weight), self.group, self.sp)  # (B, T, n_out), or T/tp with sp
        return y + sp_param(self.bias, self.group, self.sp)  # after g: before it, tp biases would add up


class LayerNorm(nn.Module):
    """LayerNorm (eps 1e-5) with replicated weights; under sequence parallelism it runs on T/tp."""

    def __init__(self, n, group, sp=False, **factory):
        super().__init__()
        self.group, self.sp = group, sp
        self.weight, self.bias = nn.Parameter(torch.empty(n, **factory)), nn.Parameter(torch.empty(n, **factory))

    def forward(self, x):
        w, b = (sp_param(p, self.group, self.sp) for p in (self.weight, self.bias))
        return F.layer_norm(x, x.shape[-1:], w, b, 1e-5)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary; each rank looks up its own ids, zeros the rest, then g."""

    def __init__(self, n_vocab, n_padded, n_embd, group, **factory):
        super().__init__()
        self.group, self.per_rank = group, n_padded // tp_size(group)
        self.start = tp_rank(group) * self.per_rank  # this rank's rows: [start, start + per_rank)
        self.weight = _mark_split(nn.Parameter(torch.empty(self.per_rank, n_embd, **factory)), 0, n_vocab)

    def forward(self, idx):  # (B, T) -> (B, T, C)
        local = idx - self.start
        other = (local < 0) | (local >= self.per_rank)  # another rank's ids: zeros here, its rows there
        rows = F.embedding(local.masked_fill(other, 0), self.weight).masked_fill(other[..., None], 0)
        return reduce_from_tp(rows, self.group)


def cross_entropy(logits, target, group, n_vocab, ignore_index=-100):
    """The mean cross-entropy over the counted targets of vocab-split logits (..., V_pad/tp), the plain way: each
    rank zero-pads its slice to its place in V_pad and g sums them (the paper's loss, read second, never does)."""
    Vl, start = logits.shape[-1], tp_rank(group) * logits.shape[-1]  # this rank's columns: [start, start + Vl)
    whole = reduce_from_tp(F.pad(logits, (start, (tp_size(group) - 1) * Vl - start)), group)  # (..., V_pad)
    whole, target = whole[..., :n_vocab].flatten(0, -2), target.reshape(-1)  # the pads cut off: (B T, V)
    n_valid = (target != ignore_index).sum().clamp(min=1)  # none counted: loss 0 and no gradient, not 0/0
    return F.cross_entropy(whole, target, ignore_index=ignore_index, reduction="sum") / n_valid


class ParallelMLP(nn.Module):
    """c_fc column-parallel -> GeLU(tanh) on the shard, no communication -> c_proj row-parallel."""

    def __init__(self, cfg, group, sp=False, **factory):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, group, sp, **factory)
        self.c_proj = RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, group, sp, **factory)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # (B, T, 4C/tp) in between


class ParallelAttention(nn.Module):
    """Causal self-attention with nh/tp heads per rank: column-parallel QKV, row-parallel output."""

    def __init__(self, cfg, group, sp=False, **factory):
        super().__init__()
        C = cfg.n_embd
        # GPT-2's c_attn stacks Q, K and V (3C outputs): rank i holds its heads of each, [Q_i; K_i; V_i]
        # (fused=3), so its output's thirds are its q, k, v, (B, T, C/tp) each. E.g. C = 4 (2 heads), tp = 2:
        # of the full (12, 4) weight, Q rows 0-3, K 4-7, V 8-11, rank 0 holds 0-1, 4-5, 8-9, rank 1 2-3, 6-7, 10-11.
        self.c_attn = ColumnParallelLinear(C, 3 * C, group, sp, fused=3, **factory)
        self.c_proj = RowParallelLinear(C, C, group, sp, **factory)
        self.hs = C // cfg.n_head

    def forward(self, x):
        q, k, v = rearrange(self.c_attn(x), "B T (three nh hs) -> three B nh T hs", three=3, hs=self.hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # softmax(q k^T / sqrt(hs)) v, causal
        return self.c_proj(rearrange(y, "B nh T hs -> B T (nh hs)"))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg, group, sp=False, **factory):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, group, sp, **factory)
        self.attn = ParallelAttention(cfg, group, sp, **factory)
        self.ln_2 = LayerNorm(cfg.n_embd, group, sp, **factory)
        self.mlp = ParallelMLP(cfg, group, sp, **factory)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# ----------------------------------------------------------------------------------------------
# GPT-2. With group=None (tp=1) this is the plain serial GPT-2: the same class, not a twin.


def padded_vocab_size(n_vocab, tp, divisible_by=1):  # V up to a multiple of divisible_by tp (Section 3: 51,200)
    return -(-n_vocab // (divisible_by * tp)) * divisible_by * tp


class ParallelGPT(FullWeights, nn.Module):
    """GPT-2 over a tp group: the token and position embeddings, the blocks, ln_f, and the output layer,
    tied to wte, with cross_entropy; idx (B, T) -> logits (B, T, V_pad/tp), loss. No dropout: GPT, the machine,
    adds it (cfg.dropout), and the paper's loss (vocab_parallel_cross_entropy)."""

    def __init__(self, cfg, group=None, *, sequence_parallel=False, dtype=torch.float32, device="cpu",
                 vocab_divisible_by=1):
        super().__init__()
        tp = tp_size(group)
        self.cfg, self.group, self.sp = cfg, group, sequence_parallel and tp > 1
        factory = dict(dtype=dtype, device=device)
        V_pad = padded_vocab_size(cfg.vocab_size, tp, vocab_divisible_by)
        tr = self.transformer = nn.ModuleDict()  # keyed as GPT-2's
        tr["wte"] = VocabParallelEmbedding(cfg.vocab_size, V_pad, cfg.n_embd, group, **factory)
        tr["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd, **factory)
        tr["h"] = nn.ModuleDict({str(i): Block(cfg, group, self.sp, **factory) for i in range(cfg.n_layer)})
        tr["ln_f"] = LayerNorm(cfg.n_embd, group, self.sp, **factory)  # then the output layer, tied to wte:
        self.lm_head = ColumnParallelLinear(cfg.n_embd, V_pad, group, self.sp, bias=False, dtype=dtype, device="meta")
        self.lm_head.weight = tr["wte"].weight  # wte's, at once: hence meta above, which allocates nothing

    def forward(self, idx, targets=None, ignore_index=-100):
        x = self.embed(idx)  # (B, T, C), or (B, T/tp, C) with sp
        for block in self.transformer.h.values():
            x = block(x)
        return self.head(x, targets, ignore_index)

    def embed(self, idx):
        return self.embed_positions(self.transformer.wte(idx))

    def embed_positions(self, x):  # the token embeddings (B, T, C) plus the positions; with sp, T split
        x = x + self.transformer.wpe(torch.arange(x.shape[1], device=x.device))
        return scatter_to_sp(x, self.group) if self.sp else x  # (B, T/tp, C) with sp

    def head(self, x, targets, ignore_index=-100):
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V_pad/tp)
        if targets is None:
            return logits, None
        return logits, cross_entropy(logits, targets, self.group, self.cfg.vocab_size, ignore_index)


# ----------------------------------------------------------------------------------------------
# Demo: serial against tensor-parallel, float64, same weights, same batch.


def demo(env, cfg, args):
    group, say = new_tp_group(env, args.tp), printer(env)
    full, (idx, targets) = demos.tp_inputs(say, env, cfg, args, init_state_dict)  # float64 weights, a batch
    serial, model = (ParallelGPT(cfg, g, sequence_parallel=args.sequence_parallel, dtype=torch.float64, device=env.device)
                     .load_full_state_dict(full) for g in (None, group))  # serial, and this rank's part of tp
    ref_logits, ref_loss = serial(idx, targets)
    ref_loss.backward()
    with trace_comm(model) as log:  # every collective of one forward + backward, named by its layer
        logits, loss = model(idx, targets)
        loss.backward()
    worst = demos.report_tp(say, serial, model, (ref_logits, ref_loss), (logits, loss), (idx, targets), log, full)
    say(f"\n{'PASS' if worst <= 1e-10 else 'FAIL'}: worst relative difference {worst:.2e} (tolerance 1e-10)")
    return prove_machine(model, full, (idx, targets), say) and worst <= 1e-10


# ----------------------------------------------------------------------------------------------
# Read second: the paper's loss, which the machine (GPT) runs: the lesson's cross_entropy, never gathering the logits.


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Shoeybi et al. 2019, Section 3: the mean cross-entropy of vocab-split logits, never gathered:
    each all-reduce carries B T numbers, not B T V. The rows' maximum (MAX), then one all-reduce of
    two sums stacked: the target's logit and the sum of exponentials, both of logits less that maximum."""

    @staticmethod
    def forward(ctx, logits, target, group, n_vocab, ignore_index):
        Vl, start = logits.shape[1], tp_rank(group) * logits.shape[1]  # logits (N, V/tp): N = B T rows
        logits = logits.masked_fill(torch.arange(start, start + Vl, device=logits.device) >= n_vocab, -math.inf)  # pads
        top = all_reduce(logits.max(dim=1).values, group, dist.ReduceOp.MAX)
        shifted = logits - top[:, None]  # the global max, so exp() cannot overflow on any rank
        local, valid = target - start, target != ignore_index
        mine = valid & (local >= 0) & (local < Vl)  # the target logit is on this rank
        local = local.masked_fill(~mine, 0)
        picked = shifted.gather(1, local[:, None]).squeeze(1).masked_fill(~mine, 0)
        exp = shifted.exp()
        picked, total = all_reduce(torch.stack([picked, exp.sum(dim=1)]), group)  # both sums at once: (N,) each
        n_valid = valid.sum().clamp(min=1)  # no valid target at all: loss 0 and no gradient, not 0/0
        loss = (total.log() - picked).masked_fill(~valid, 0).sum() / n_valid
        ctx.save_for_backward(exp.div_(total[:, None]), local, mine, valid, n_valid)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, valid, n_valid = ctx.saved_tensors
        grad_logits = softmax * (valid.to(softmax.dtype) * grad / n_valid)[:, None]  # new: backward can rerun
        rows = torch.arange(len(local), device=local.device)
        grad_logits[rows, local] -= mine.to(softmax.dtype) * (grad / n_valid) * valid  # - onehot
        return grad_logits, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, group, n_vocab, ignore_index=-100):
    """F.cross_entropy(full logits[..., :n_vocab], target) from this rank's slice (..., V/tp); GPT checks target."""
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), target.reshape(-1), group, n_vocab, ignore_index)


# ----------------------------------------------------------------------------------------------
# Read second: sequence parallelism (Korthikanti et al. 2022, Section 4.2.2), what --sequence-parallel runs in
# place of f and g. Outside the tp regions (LayerNorm, dropout) each rank keeps T/tp of the activations. Into
# a region goes the paper's g (all-gather of T), out of it its g-bar (reduce-scatter of T), as Figure 5 names
# them: an all-reduce is a reduce-scatter then an all-gather, so the pair moves f's and g's bytes.

SEQ = 1  # activations are (B, T, C): sequence parallelism splits dim 1


def split(x, group, dim):
    """This rank's slice of dim."""
    return x.chunk(tp_size(group), dim)[tp_rank(group)].contiguous()


def gather(x, group, dim):
    """Every rank's x, concatenated along dim in rank order."""
    if tp_size(group) == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((tp_size(group) * x.shape[0], *x.shape[1:]))  # stacked along dim 0
    all_gather_single(out, x, group)
    return torch.cat(out.chunk(tp_size(group)), dim)


def reduce_scatter(x, group, dim):
    """The sum over the ranks of x, of which this rank keeps its slice of dim."""
    if tp_size(group) == 1:
        return x
    blocks = torch.cat(x.chunk(tp_size(group), dim))  # rank i's slice of dim moved to block i of dim 0
    out = blocks.new_empty((blocks.shape[0] // tp_size(group), *blocks.shape[1:]))
    reduce_scatter_single(out, blocks, group)
    return out


class ScatterToSP(torch.autograd.Function):
    """Keep this rank's slice of T in forward; all-gather T in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, group, SEQ)

    @staticmethod
    def backward(ctx, grad):
        return gather(grad, ctx.group, SEQ), None


class GatherFromSP(torch.autograd.Function):
    """Sequence parallelism's g (in f's place): all-gather T in forward; reduce-scatter T in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather(x, group, SEQ)

    @staticmethod
    def backward(ctx, grad):  # every rank used the whole sequence: each slice's gradient is a sum
        return reduce_scatter(grad, ctx.group, SEQ), None


class ReduceScatterToSP(torch.autograd.Function):
    """Sequence parallelism's g-bar (in g's place): reduce-scatter T in forward; all-gather T in backward."""

    @staticmethod
    def forward(ctx, x, group):  # each rank keeps its slice of the sum
        ctx.group = group
        return reduce_scatter(x, group, SEQ)

    @staticmethod
    def backward(ctx, grad):  # each rank's partial output fed every slice
        return gather(grad, ctx.group, SEQ), None


# Their lower-case names, as f's and g's; the identity at tp = 1 (split, gather, reduce_scatter return x).
scatter_to_sp, gather_from_sp, reduce_scatter_to_sp = ScatterToSP.apply, GatherFromSP.apply, ReduceScatterToSP.apply


def all_gather_single(out, x, group, async_op=False):  # after the concept: torch 2.13's name, or 2.11's
    """Every rank's x, stacked along dim 0 in rank order, into out."""
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, x, group=group, async_op=async_op)


def reduce_scatter_single(out, x, group, async_op=False):
    """The sum over the ranks of x, whose dim 0 holds tp blocks: block i of the sum to rank i's out."""
    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, x, group=group, async_op=async_op)


def init_state_dict(cfg, seed, dtype=torch.float32, random_all=False):
    """The full GPT-2 weights from a seed (plumbing.shards.init_full: GPT-2's initialisation)."""
    return init_full(GPT(cfg, device="meta").named_parameters(), cfg.n_layer, seed, dtype, random_all)


# ----------------------------------------------------------------------------------------------
# After the concept: dropout's random numbers. Replicated activations draw the same masks on every tp rank (the
# default generator), split ones (and with sp those on T/tp rows) their own: Megatron's RNG tracker (Appendix B.2).


class TPRandom:
    """A tracked generator for tp-split activations; fork() swaps it in for the default one. At
    tp=1 nothing is split (enabled=False): fork() does nothing and every mask is the default's."""

    def __init__(self, seed, rank, device, enabled=True):
        self.device, self.enabled = torch.device(device), enabled
        # 2718: Megatron's offset between the default seed and the tensor-parallel seeds.
        self.state = torch.Generator(device=self.device).manual_seed(seed + 2718 + rank).get_state()

    @contextlib.contextmanager
    def fork(self):
        if not self.enabled:
            yield
            return
        default = torch.cuda.default_generators[self.device.index or 0] if self.device.type == "cuda" \
            else torch.default_generator
        saved = default.get_state()
        default.set_state(self.state)
        try:
            yield
        finally:
            self.state = default.get_state()
            default.set_state(saved)


def block_with_dropout(block, x):
    """Block's forward with dropout on both residual branches, as GPT-2 has it; GPT installs it in each block."""
    x = x + residual_dropout(block, block.attn(block.ln_1(x)))
    return x + residual_dropout(block, block.mlp(block.ln_2(x)))


def residual_dropout(block, y):  # replicated y: the default stream; with sp each rank's slice of T: its own mask
    with block.rng.fork() if block.training and block.p and block.sp and block.rng else contextlib.nullcontext():
        return F.dropout(y, block.p, block.training and block.p > 0)


# ----------------------------------------------------------------------------------------------
# After the concept: GPT, the lesson's ParallelGPT as engineers, tests and the trainers build it (the same function).


class GPT(ParallelGPT):
    """ParallelGPT with its sizes checked, GPT-2's initialisation from `seed` unless init=False, a TPRandom a
    process (a rank's chunks share it: pass rng=), each batch checked (check_inputs=False: the caller did); a
    pipeline's part: blocks `layers`, embeddings with pre_process, ln_f, head, loss with post_process."""

    def __init__(self, cfg, group=None, *, seed=0, init=True, dtype=torch.float32, device="cpu", rng=None,
                 check_inputs=True, layers=None, pre_process=True, post_process=True, **kwargs):
        tp = check_model(cfg, tp_size(group), device)
        rng = rng or TPRandom(seed, tp_rank(group), device if device != "meta" else "cpu", enabled=tp > 1)
        whole = layers is None and pre_process and post_process
        super().__init__(cfg, group, dtype=dtype, device=device if whole else "meta", **kwargs)
        self.rng, self.pre_process, self.post_process, self.check_inputs = rng, pre_process, post_process, check_inputs
        if not whole:  # built on meta, which allocates nothing; cut to this part, then given memory
            keep_part(self, range(cfg.n_layer) if layers is None else layers, pre_process, post_process)
            materialize(self, device)
        for block in self.transformer.h.values():  # dropout, and each attention's core a seam: attention_with_core
            block.p = block.attn.p = cfg.dropout
            block.rng, block.sp, block.attn.rng = rng, self.sp, rng
            block.forward = functools.partial(block_with_dropout, block)
            block.attn.core, block.attn.forward = causal_attention, functools.partial(attention_with_core, block.attn)
        if init and device != "meta":
            self.load_full_state_dict(init_state_dict(cfg, seed, dtype=dtype))

    def forward(self, x, targets=None, ignore_index=-100):
        x = self.embed(x) if self.pre_process else x
        for block in self.transformer.h.values():
            x = block(x)
        return self.head(x, targets, ignore_index) if self.post_process else x

    def embed_positions(self, x):  # the lesson's, then dropout: with sp, each rank's slice of T its own mask
        x = super().embed_positions(x)
        p = self.cfg.dropout if self.training else 0.0
        with self.rng.fork() if p and self.sp and self.rng else contextlib.nullcontext():
            return F.dropout(x, p, p > 0)

    def embed(self, idx):
        if self.check_inputs:  # False: the caller checked the batch once, on the host
            check_tokens(idx, self.cfg, tp_size(self.group) if self.sp else 1)
        return super().embed(idx)

    def head(self, x, targets, ignore_index=-100):
        if targets is None:
            return super().head(x, None)
        check_targets(self.lm_head.weight.T, targets, self.group, self.cfg.vocab_size, ignore_index)  # before gathers
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V_pad/tp)
        upcast = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits  # the loss in fp32
        return logits, vocab_parallel_cross_entropy(upcast, targets, self.group, self.cfg.vocab_size, ignore_index)


def attention_with_core(attn, x):
    """ParallelAttention's forward, its core (softmax(q k^T / sqrt(hs)) v, causal) looked up on the instance,
    attn.core, which 05 recomputes, kernels/ fuse and 08 replaces with the ring; GPT installs it in each block."""
    q, k, v = rearrange(attn.c_attn(x), "B T (three nh hs) -> three B nh T hs", three=3, hs=attn.hs)
    p = attn.p if attn.training else 0.0
    with attn.rng.fork() if p and attn.rng else contextlib.nullcontext():
        y = attn.core(q, k, v, p)
    return attn.c_proj(rearrange(y, "B nh T hs -> B T (nh hs)"))


def causal_attention(q, k, v, p):  # the lesson's core: q, k, v (B, nh/tp, T, hs), dropout p
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)


# ----------------------------------------------------------------------------------------------
# After the concept: an optimization, the same function (test_tensor_parallel.py), which 05 turns on: optimize().


class OverlappedColumnLinear(torch.autograd.Function):
    """F.linear(enter_tp(x), weight, bias) as one autograd node: Megatron's asynchronous input-gradient
    all-reduce (MegaScale, Jiang et al. 2024, Section 3.3). Before: autograd runs the linear's whole
    backward (dX, then dW) and only then f's, so dX's all-reduce waits for dW's GEMM. Now: the backward
    launches dX's all-reduce (with sp its reduce-scatter) the moment dX is computed, and computes dW
    and db while it travels. With sp it keeps the gathered input (Megatron gathers it again instead)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sp):  # x: (B, T, n_in), or (B, T/tp, n_in) with sp
        total = gather(x, group, SEQ) if sp else x  # (B, T, n_in)
        ctx.save_for_backward(total, weight)
        ctx.group, ctx.sp, ctx.bias = group, sp, bias is not None
        return F.linear(total, weight, bias)  # (B, T, n_out/tp)

    @staticmethod
    def backward(ctx, grad):  # grad: (B, T, n_out/tp)
        total, weight = ctx.saved_tensors
        dx = grad @ weight  # this rank's part of dX: (B, T, n_in)
        if ctx.sp:  # launched, not waited for
            blocks = torch.cat(dx.chunk(tp_size(ctx.group), SEQ))  # as reduce_scatter() lays them out
            dx = blocks.new_empty((blocks.shape[0] // tp_size(ctx.group), *blocks.shape[1:]))
            work = reduce_scatter_single(dx, blocks, ctx.group, async_op=True)
        else:
            work = dist.all_reduce(dx, group=ctx.group, async_op=True)  # in place: dx is ours
        dy = grad.reshape(-1, grad.shape[-1])  # (B T, n_out/tp)
        dw = dy.T @ total.reshape(-1, total.shape[-1])  # (n_out/tp, n_in), while dX travels
        db = dy.sum(0) if ctx.bias else None
        work.wait()
        return dx, dw, db, None, None


def overlapped_forward(linear, x):
    """A ColumnParallelLinear's forward through OverlappedColumnLinear (optimize() installs it)."""
    return OverlappedColumnLinear.apply(x, linear.weight, linear.bias, linear.group, linear.sp)


def optimize(model, overlap_input_grad=True):
    """Turn the optimization above on in `model` (any module holding 01's layers); returns it."""
    for m in model.modules():
        if overlap_input_grad and isinstance(m, ColumnParallelLinear) and tp_size(m.group) > 1:
            m.forward = functools.partial(overlapped_forward, m)
    return model


def prove_machine(lesson, full, batch, say):
    """The demo's machine part: GPT as 05's trainer runs it (the paper's loss, optimize()'s overlapped input-gradient
    all-reduce), from the same full weights on the same batch, against the lesson's model: the loss and every
    gradient within 1e-12 (the losses sum in other orders; the overlap moves when dX's sum travels, not what)."""
    machine = optimize(GPT(lesson.cfg, lesson.group, sequence_parallel=lesson.sp, init=False, dtype=torch.float64,
                           device=batch[0].device)).load_full_state_dict(full)
    lesson.zero_grad()  # (the demo's timing ran it more than once)
    with trace_comm(machine) as log:  # its collectives, to show the paper's loss
        losses = [machine(*batch)[1], lesson(*batch)[1]]
        torch.autograd.backward(losses)
    want = lesson.full_grads()
    worst = max([max_rel_diff(losses[0].detach(), losses[1].detach())] +
                [max_rel_diff(g, want[n]) for n, g in machine.full_grads().items()])
    sums = [f"{c.op} of {c.shape}" for c in log if c.operator == "_VocabParallelCrossEntropy"]
    if sums:
        say(f"the machine's loss sends an {' and an '.join(sums)}: 3 numbers a token, not V_pad")
    say(f"the machine (GPT, the paper's loss, optimize()'s overlapped all-reduce) against the lesson (loss and every "
        f"gradient): {worst:.2e} {'PASS' if worst <= 1e-12 else 'FAIL'} (tolerance 1e-12)")
    return worst <= 1e-12


# ----------------------------------------------------------------------------------------------
# After the concept: the demo's command line.


@dataclass
class DemoConfig:
    tp: int = 2  # tensor-parallel size: CPU ranks started here, or torchrun's world
    sequence_parallel: bool = False  # shard the LayerNorm and dropout activations along T (Korthikanti)
    batch_size: int = 4  # B, sequences in the batch
    seq_len: int = 32  # T, tokens per sequence
    seed: int = 1234  # for the weights and the batch


def parser():
    return cli.demo_parser(__doc__, DemoConfig, GPTConfig, vocab_size=1001, block_size=64, n_layer=2,
                           n_head=4, n_embd=64)


def main():
    cfg, args = cli.demo_args(parser())  # every flag checked before any rank starts
    return all(launch(demo, args.tp, cfg, args))


if __name__ == "__main__":
    run_main(main)
