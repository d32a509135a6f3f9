"""DeepSpeed-Ulysses (Jacobs et al. 2023), 08's contrast and not its concept: the attention core as an
all-to-all of heads, which the trainer runs with --cp-attention ulysses. LightSeq (Li et al. 2023,
Section 3) argues against it, and 08 teaches the ring; 08 re-exports AllToAll, ulysses and ulysses_core.

Everything but the attention core keeps T/cp rows, as in 08; around the core an all-to-all trades rows
for heads: each rank gets the whole sequence of nh/(tp cp) heads, attends as 01 does, and a second
all-to-all gives the rows back. Per rank and layer the four all-to-alls (q, k, v in, o out) move
4 (cp-1)/cp^2 of B T C/tp, falling with cp, where the ring moves (cp-1)/cp of 2 B T C/tp, the keys and
values; but cp can be no larger than the heads a rank holds, nh/tp. It reads only a RingSchedule's
split (08's), and imports no numbered file.
"""
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plumbing.checks import check_rows


class AllToAll(torch.autograd.Function):
    """x split into cp pieces along dim `split`, piece j sent to rank j; the pieces received put side
    by side along dim `cat`, in rank order. Backward is the all-to-all the other way."""

    @staticmethod
    def forward(ctx, x, group, split, cat):
        ctx.group, ctx.split, ctx.cat = group, split, cat
        cp = dist.get_world_size(group)
        send = torch.stack(x.chunk(cp, split)).contiguous()  # (cp, ...): piece j for rank j
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=group)
        return torch.cat(got.unbind(0), cat)

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad, ctx.group, ctx.cat, ctx.split), None, None, None


def ulysses(chunk, sched, group):
    """Every block's attention core of `chunk` (already 08's context_parallel) as Ulysses' all-to-all."""
    for block in chunk.transformer.h.values():
        block.attn.core = functools.partial(ulysses_core, sched, group)


def ulysses_core(sched, group, q, k, v, p):
    """q, k, v (B, nh/tp, T/cp, hs): heads out, rows in (B, nh/(tp cp), T, hs), the rows put in true
    order (the split's order is not, for Megatron's split), causal attention, and back."""
    check_rows(sched, None, q, k, v, "ulysses_core")  # T comes from the shapes: it must split as sched does
    c = q.shape[2] * sched.cp // sched.n  # T / n rows a block
    # gathered row -> position: every rank's blocks' true positions, rank after rank (08's positions)
    order = torch.cat([torch.arange(b * c, (b + 1) * c, device=q.device) for blocks in sched.split for b in blocks])
    true = torch.argsort(order)  # position -> gathered row
    q, k, v = (AllToAll.apply(t, group, 1, 2)[:, :, true] for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return AllToAll.apply(y[:, :, order], group, 2, 1)
