"""The checks of 08's exercises (exercises/ex08_context_parallel.py), and the planted wrong answers.

Both are on 08's lesson, one ring with the contiguous split (rank r holds block r of the sequence).
08.1 (block_scores and OneRing) runs alone on cp = 2 and 4 CPU ranks first: each rank's block of
random queries, keys and values through the student's ring, against torch's own causal attention of
the whole sequence in this process (F.scaled_dot_product_attention, float64): the output and the
gradients of q, k and v, to 1e-10. Then inside 08's ring_gpt and ring_step at cp = 2 and 4 against
the serial GPT-2 (01's ParallelGPT, some targets ignored unevenly over the ranks): the loss and every
gradient, to 1e-10. 08.2 (ring_step) runs in a GPT-2 whose attention core is this file's own: the
keys and values all-gathered (an autograd Function of this file: all-gather forward, the gradient's
sum over the ring and this rank's slice backward) and torch's attention with each query's causal
mask at its true position; so 08.2 needs none of 08.1's pieces. Nothing expected is taken from the
pieces an exercise stubs: the serial model is 01's, the attention torch's.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from exercises.autograder import Exercise, Planted, differences, first, installed, merged, numbered, ranks, \
    random_weights, token_batch

tensor_parallel = numbered("01_tensor_parallel")
cpar = numbered("08_context_parallel")
F64 = torch.float64
CFG = tensor_parallel.GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=16)
B, T = 2, 16
REFERENCE = {"block_scores": cpar.block_scores, "OneRing": cpar.OneRing, "ring_step": cpar.ring_step}


def serial_reference():
    """01's serial GPT-2 (ParallelGPT, no group) on the batch: the loss, every gradient. Targets are
    ignored unevenly: row 0 counts only its last 5 of 16, so at cp = 4 blocks 0-2 of that row count none."""
    full = random_weights(CFG, 3, tensor_parallel.ParallelGPT(CFG, dtype=F64))
    idx, targets = token_batch(CFG, B, T, seed=4, ignored=T - 5)
    serial = tensor_parallel.ParallelGPT(CFG, dtype=F64)
    serial.load_full_state_dict(full)
    logits, loss = serial(idx, targets)
    loss.backward()
    each = F.cross_entropy(logits.detach().flatten(0, 1), targets.flatten(), ignore_index=-100,
                           reduction="none").view(B, T)  # every token's loss (0 where ignored)
    return dict(full=full, idx=idx, targets=targets, loss=loss.detach(), each=each,
                grads={n: p.grad for n, p in serial.named_parameters()})


def _whole_model(env, ref, build, cp):
    """ring_step on this rank's ring (the whole world) with the model `build` makes, against serial."""
    group = dist.group.WORLD
    model = build(group)
    model.load_full_state_dict(ref["full"])
    loss = cpar.ring_step(model, ref["idx"], ref["targets"], group)
    c, counted = T // cp, (ref["targets"] != -100)
    local = sum(ref["each"][:, b * c:(b + 1) * c].sum() / counted[:, b * c:(b + 1) * c].sum().clamp(min=1)
                for b in range(cp))  # each block's own mean, added: the loss of a rank that divides by its own count
    pairs = [("the loss", loss, ref["loss"],
              [(local, "is the sum of each rank's own mean: divide each rank's summed loss by the whole batch's "
                       "count of counted targets, so that the shares add up to the serial mean")])]
    for n, p in model.named_parameters():
        want = ref["grads"][n]
        suspects = []
        if n == "transformer.wpe.weight":
            suspects = [(torch.cat([p.grad[:c], torch.zeros_like(want[c:])]), "only its first T/cp rows got a "
                         "gradient: each rank's tokens go in at their true positions, r T/cp ... (r + 1) T/cp - 1")]
        pairs.append((f"the gradient of {n}", p.grad, want, suspects))
    return differences(pairs, {"cp x too small": "summed over the ring, not averaged: each rank's loss is already "
                                                 "its share of the serial mean",
                               "cp x too large": "each rank's loss is its share of the mean: do not multiply it"},
                       factors={"cp": cp})


def in_the_model(ref, build, cp, what):
    return first([f"{what} at cp={cp}, {x}" for x in merged(ranks(_whole_model, cp, ref, build, cp))], 3)


# ----------------------------------------------------------------------------------------------
# 08.1 block_scores and OneRing


def _attention(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


def _alone(env, cp):
    """This rank's block of random q, k, v (B, nh, T, hs) through OneRing, against torch's causal
    attention of the whole sequence (this process, float64): the output and the three gradients."""
    r, group = env.rank, dist.group.WORLD
    gen = torch.Generator().manual_seed(cp)
    q, k, v, do = (torch.randn(2, 3, 4 * cp, 4, generator=gen, dtype=F64) for _ in range(4))  # 4 rows a rank
    c = q.shape[2] // cp
    mine = slice(r * c, (r + 1) * c)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _attention(*whole)
    want.backward(do)
    parts = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    got = cpar.OneRing.apply(*parts, group)
    got.backward(do[:, :, mine])
    causal = torch.ones(4 * cp, 4 * cp, dtype=torch.bool).tril()
    blocks = torch.block_diag(*[torch.ones(c, c)] * cp).bool()
    later = (torch.arange(4 * cp)[None, :] // c) > (torch.arange(4 * cp)[:, None] // c)
    suspects = [(_attention(q, k, v, causal | blocks)[:, :, mine],
                 "its own block attends to all of itself: the scores of the rank's own block are causal (mask "
                 "those above the diagonal with -inf)"),
                (_attention(q, k, v, causal | later)[:, :, mine],
                 "it attends to the later blocks too: a block after this rank's is in every one of its queries' "
                 "future, and is skipped"),
                (_attention(q, k, v, torch.ones_like(causal))[:, :, mine],
                 "it is attention over every key, later ones too: the rank's own block is causal, a later one "
                 "skipped")]
    home = (r + 1) % cp  # with no last hop, block r's dK and dV are still where the ring left them
    back = slice(home * c, (home + 1) * c)
    hop = "these are block (r + 1) mod cp's dK and dV, one hop from home: the ring's cp-th hop brings them back"
    return differences([("the output", got.detach(), want.detach()[:, :, mine], suspects),
                        ("the gradient of q", parts[0].grad, whole[0].grad[:, :, mine]),
                        ("the gradient of k", parts[1].grad, whole[1].grad[:, :, mine],
                         [(whole[1].grad[:, :, back], hop)] if cp > 1 else []),
                        ("the gradient of v", parts[2].grad, whole[2].grad[:, :, mine],
                         [(whole[2].grad[:, :, back], hop)] if cp > 1 else [])])


def check_ring(impl):
    reasons = []
    with installed((cpar, "block_scores", impl["block_scores"]), (cpar, "OneRing", impl["OneRing"])):
        for cp in (2, 4):
            found = ranks(_alone, cp, cp)
            if not any(x.startswith("the output") for x in found[0]):  # rank 0 sees its own block alone
                merge = ("rank 0, which attends to its own block alone, is right: how blocks join the running output "
                         "is wrong (both parts rescaled to the new log-sum-exp before adding)")
                found = [[merge] + x if any(y.startswith("the output ") for y in x) else x for x in found]
            reasons = first([f"alone at cp={cp} (each rank's block of random q, k, v against torch's causal "
                             f"attention of the whole sequence), {x}" for x in merged(found)], 4)
            if reasons:
                return reasons
        ref = serial_reference()
        for cp in (2, 4):
            reasons = in_the_model(ref, lambda g: cpar.ring_gpt(CFG, g, dtype=F64), cp, "in 08's ring_gpt and ring_step")
            if reasons:
                return reasons
    return []


# ----------------------------------------------------------------------------------------------
# 08.2 ring_step, in a GPT-2 whose attention is this file's own


class _GatherSequence(torch.autograd.Function):
    """Every rank's block of the sequence (dim 2), in rank order; backward: the gradient summed over
    the ring, this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.r, ctx.c = group, dist.get_rank(group), x.shape[2]
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.cat(out, 2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, :, ctx.r * ctx.c:(ctx.r + 1) * ctx.c], None


def _gathered_gpt(group):
    """01's GPT (the machine, whose attention core is a seam) with a core that sees every rank's keys and
    values, each query causal at its true position r T/cp + i: the ring's answer by another road."""
    model = tensor_parallel.GPT(CFG, init=False, dtype=F64)

    def core(q, k, v, p):
        r, c = dist.get_rank(group), q.shape[2]
        keys, values = _GatherSequence.apply(k, group), _GatherSequence.apply(v, group)
        mask = torch.arange(keys.shape[2])[None, :] <= torch.arange(r * c, (r + 1) * c)[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    for block in model.transformer.h.values():
        block.attn.core = core
    return model


def check_step(impl):
    ref = serial_reference()
    with installed((cpar, "ring_step", impl["ring_step"])):
        for cp in (2, 4):
            reasons = in_the_model(ref, _gathered_gpt, cp, "ring_step in a GPT-2 whose attention gathers the sequence")
            if reasons:
                return reasons
    return []


# ----------------------------------------------------------------------------------------------
# Planted wrong answers


def _scores_unmasked(q, k, own):
    return q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # own or not


class _RingScalesQInPlace(cpar.OneRing):
    @staticmethod
    def forward(ctx, q, k, v, group):
        q.mul_(q.shape[-1] ** 0.5)  # the mistake: q is the caller's (a view of the projection's output)
        return REFERENCE["OneRing"].forward(ctx, q * q.shape[-1] ** -0.5, k, v, group)


class _RingNoRescale(cpar.OneRing):
    @staticmethod
    def forward(ctx, q, k, v, group):
        r, cp = dist.get_rank(group), dist.get_world_size(group)
        out, lse = torch.zeros_like(q), q.new_full((*q.shape[:-1], 1), -math.inf)
        kb, vb = k, v
        for s in range(cp):
            if s > 0:
                kb, vb = cpar.pass_on(group, kb, vb)
            src = (r - s) % cp
            if src > r:
                continue
            scores = cpar.block_scores(q, kb, src == r)
            new = torch.logaddexp(lse, scores.logsumexp(-1, keepdim=True))
            out = out + torch.exp(scores - new) @ vb  # the old part not rescaled to the new log-sum-exp
            lse = new
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return out


class _RingNotReturned(cpar.OneRing):
    @staticmethod
    def forward(ctx, q, k, v, group):
        out = REFERENCE["OneRing"].forward(ctx, q, k, v, group)  # noqa: F841
        ctx.group = group  # the mistake: out is made and never returned


class _RingNoLastHop(cpar.OneRing):
    @staticmethod
    def backward(ctx, do):
        (q, k, v, out, lse), group = ctx.saved_tensors, ctx.group
        r, cp, scale = dist.get_rank(group), dist.get_world_size(group), q.shape[-1] ** -0.5
        D = (do * out).sum(-1, keepdim=True)
        dq, kb, vb, dk, dv = torch.zeros_like(q), k, v, torch.zeros_like(k), torch.zeros_like(v)
        for s in range(cp):
            if s > 0:
                kb, vb, dk, dv = cpar.pass_on(group, kb, vb, dk, dv)
            src = (r - s) % cp
            if src > r:
                continue
            p = torch.exp(cpar.block_scores(q, kb, src == r) - lse)
            ds = p * (do @ vb.transpose(-2, -1) - D)
            dq += ds @ kb * scale
            dk += ds.transpose(-2, -1) @ q * scale
            dv += p.transpose(-2, -1) @ do
        return dq, dk, dv, None  # no last hop: dK and dV are still one rank short of home


class _RingThreeGradients(cpar.OneRing):
    @staticmethod
    def backward(ctx, do):
        dq, dk, dv, _ = REFERENCE["OneRing"].backward(ctx, do)
        return dq, dk, dv  # the mistake: forward had four inputs (q, k, v, group)


def _step_local_mean(model, idx, targets, group):
    r, cp, T_ = dist.get_rank(group), dist.get_world_size(group), idx.shape[1]
    pos = torch.arange(r * T_ // cp, (r + 1) * T_ // cp)
    tr = model.transformer
    x = tr.wte(idx[:, pos]) + tr.wpe(pos)
    for block in tr.h.values():
        x = block(x)
    logits = model.lm_head(tr.ln_f(x))
    loss = F.cross_entropy(logits.flatten(0, 1), targets[:, pos].flatten(), ignore_index=-100)  # its own mean
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
    return tensor_parallel.all_reduce(loss.detach(), group)


def _step_positions_from_zero(model, idx, targets, group):
    r, cp, T_ = dist.get_rank(group), dist.get_world_size(group), idx.shape[1]
    pos = torch.arange(r * T_ // cp, (r + 1) * T_ // cp)
    tr = model.transformer
    x = tr.wte(idx[:, pos]) + tr.wpe(pos - pos[0])  # every rank's block embedded at positions 0 .. T/cp - 1
    for block in tr.h.values():
        x = block(x)
    logits = model.lm_head(tr.ln_f(x))
    mine = F.cross_entropy(logits.flatten(0, 1), targets[:, pos].flatten(), ignore_index=-100, reduction="sum")
    loss = mine / (targets != -100).sum().clamp(min=1)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
    return tensor_parallel.all_reduce(loss.detach(), group)


def _step_grads_averaged(model, idx, targets, group):
    loss = REFERENCE["ring_step"](model, idx, targets, group)
    for p in model.parameters():
        p.grad /= dist.get_world_size(group)  # averaged over the ring, as data parallelism would
    return loss


EXERCISES = [
    Exercise("08.1", "ring", "one ring: the blocks' scores and ring attention", ("block_scores", "OneRing"),
             "Li et al. 2023, Section 3.1; Dao 2023, Algorithm 1 (the online softmax)", check_ring,
             lambda: {"block_scores": REFERENCE["block_scores"], "OneRing": REFERENCE["OneRing"]},
             [Planted("own_block_unmasked", "block_scores leaves the rank's own block unmasked",
                      lambda: {"block_scores": _scores_unmasked}, "its own block attends to all of itself"),
              Planted("merge_without_rescaling", "OneRing adds a block's part without rescaling the old output",
                      lambda: {"OneRing": _RingNoRescale}, "both parts rescaled to the new log-sum-exp"),
              Planted("dkv_not_sent_home", "OneRing's backward leaves out the last hop home",
                      lambda: {"OneRing": _RingNoLastHop}, "one hop from home"),
              Planted("one_ring_scales_q_in_place", "OneRing's forward scales the queries in place (q.mul_)",
                      lambda: {"OneRing": _RingScalesQInPlace}, "forward wrote into its input q in place",
                      at_line=True),
              Planted("one_ring_not_returned", "OneRing's forward makes the output and does not return it",
                      lambda: {"OneRing": _RingNotReturned}, "forward returned None", at_line=True),
              Planted("one_ring_three_gradients", "OneRing's backward returns no gradient for the group",
                      lambda: {"OneRing": _RingThreeGradients}, "one gradient per input", at_line=True)]),
    Exercise("08.2", "step", "the ring's step: true positions, the loss, the gradients", ("ring_step",),
             "Li et al. 2023, Section 3.1; Megatron Core's context parallelism", check_step,
             lambda: {"ring_step": REFERENCE["ring_step"]},
             [Planted("ring_step_local_mean", "each rank's loss is the mean of its own tokens",
                      lambda: {"ring_step": _step_local_mean}, "divide each rank's summed loss by the whole batch's"),
              Planted("ring_step_positions_from_zero", "every rank embeds its block at positions 0 .. T/cp - 1",
                      lambda: {"ring_step": _step_positions_from_zero}, "true positions"),
              Planted("ring_step_grads_averaged", "the gradients are averaged over the ring, not summed",
                      lambda: {"ring_step": _step_grads_averaged}, "summed over the ring, not averaged")]),
]
