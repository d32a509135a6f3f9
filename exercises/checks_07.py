"""The checks of 07's exercises (exercises/ex07_vocab_parallel.py), and the planted wrong answers.

Both passes are 07's lesson's (output_layer calls output_s_pass, then output_t_pass). Each is run
alone first on 4 CPU ranks, the vocabulary group all of them: V = 53 padded to 56 (rank 3's slice
holds 3 padded rows, random, so that a padded row counted shows), X (12, 8) the same on every rank,
targets on every slice and some ignored, float64. The expected answers are this file's own: the
serial cross-entropy over the whole vocabulary, with autograd's gradients of X and of the weight.
S (07.1): the loss and each statistic T needs, per rank (exp, total, w, local, mine). T (07.2), on
the statistics of this file's own S: X's gradient and the slice's weight gradient, added to a
gradient the slice already held. Then each pass inside 07's vocab_1f1b_step (pp = 2 x tp = 2, m =
2, unequal counted targets, microbatch 0 none) against the serial model, the loss and every
gradient, 1e-10; the other pass is this file's own, so each exercise is graded alone.
"""
import math

import torch
import torch.distributed as dist

from exercises.autograder import Exercise, Planted, differences, first, installed, merged, numbered, ranks, warm
from exercises.checks_02 import serial_reference

tensor_parallel = numbered("01_tensor_parallel")
gpt3d = numbered("05_3d_gpt")
vocab_parallel = numbered("07_vocab_parallel")
F64 = torch.float64
REFERENCE = {"output_s_pass": vocab_parallel.output_s_pass, "output_t_pass": vocab_parallel.output_t_pass}
V, N, C, WORLD = 53, 12, 8, 4


# ----------------------------------------------------------------------------------------------
# The grader's own passes (the other exercise's, while one is graded) and the serial answers


def grader_s(shard, X, t, n, V, vocab):
    """S, this file's way: the padded columns masked by torch.where, the target's logit by a one-hot."""
    cols = shard.start + torch.arange(shard.per_rank, device=X.device)
    z = torch.where(cols[None, :] < V, X @ shard.weight.detach().T, torch.full((), -math.inf, dtype=X.dtype))
    peak = tensor_parallel.all_reduce(z.amax(dim=1), vocab, dist.ReduceOp.MAX)
    e = torch.exp(z - peak.unsqueeze(1))
    here = (t != -100) & (t >= shard.start) & (t < shard.start + shard.per_rank)
    col = torch.where(here, t - shard.start, torch.zeros_like(t))
    hot = torch.nn.functional.one_hot(col, shard.per_rank).to(X.dtype) * here.unsqueeze(1)
    sums = tensor_parallel.all_reduce(torch.stack([e.sum(dim=1), torch.where(here, (z * hot).nansum(1), 0.0)]), vocab)
    weight = (t != -100).to(X.dtype) / n
    return (weight * (torch.log(sums[0]) + peak - sums[1])).sum(), (e, sums[0], weight, col, here)


def grader_t(shard, X, exp, total, w, local, mine, vocab):
    """T, this file's way: the softmax less a one-hot at this slice's targets, weighted."""
    hot = torch.nn.functional.one_hot(local, shard.per_rank).to(X.dtype) * mine.unsqueeze(1)
    g = (exp / total.unsqueeze(1) - hot) * w.unsqueeze(1)
    mine_dw = torch.einsum("nv,nc->vc", g, X)
    shard.weight.grad = mine_dw if shard.weight.grad is None else shard.weight.grad + mine_dw
    return tensor_parallel.all_reduce(torch.einsum("nv,vc->nc", g, shard.weight.detach()), vocab)


def _problem():
    gen = torch.Generator().manual_seed(21)
    full = torch.randn(56, C, generator=gen, dtype=F64)  # rows 53-55: padding, random
    X = torch.randn(N, C, generator=gen, dtype=F64)
    t = torch.randint(V, (N,), generator=gen)
    t[:4] = torch.tensor([2, 20, 30, 52])  # a target on every slice (14 rows each), the last next to the padding
    t[[5, 9]] = -100
    n = int((t != -100).sum()) + 3  # a microbatch of a batch: n counts the other microbatches' targets too
    return full, X, t, n


def _serial(full, X, t, n, per, padding=False):
    """The expected answers: {loss, dX, dW (56, C)} by autograd, and per rank the statistics; with padding,
    those of S with the padded rows counted (a planted mistake's)."""
    W, x = full.clone().requires_grad_(), X.clone().requires_grad_()
    logits = x @ (W if padding else W[:V]).T
    counted = t != -100
    w = counted.to(F64) / n
    lse = torch.logsumexp(logits, 1)
    loss = (w * (lse - logits.gather(1, t.clamp_min(0)[:, None])[:, 0])).sum()
    loss.backward()
    top = logits.detach().max(1).values
    padded = torch.cat([logits.detach(), torch.full((N, 56 - logits.shape[1]), -math.inf, dtype=F64)], 1)
    exp = (padded - top[:, None]).exp()
    stats = []
    for r in range(WORLD):
        s = r * per
        mine = counted & (t >= s) & (t < s + per)
        stats.append(dict(exp=exp[:, s:s + per], total=exp.sum(1), w=w, local=torch.where(mine, t - s, 0), mine=mine))
    return dict(loss=loss.detach(), dX=x.grad, dW=W.grad, stats=stats)


def _shard(full, group):
    shard = tensor_parallel.VocabParallelEmbedding(V, 56, C, group, dtype=F64)
    with torch.no_grad():
        shard.weight.copy_(full[shard.start:shard.start + shard.per_rank])
    return shard


# ----------------------------------------------------------------------------------------------
# Each pass alone, on 4 ranks


def _s_alone(env, problem, want, wrong):
    full, X, t, n = problem
    shard = _shard(full, dist.group.WORLD)
    out = vocab_parallel.output_s_pass(shard, X.clone(), t.clone(), n, V, dist.group.WORLD)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], tuple) and len(out[1]) == 5):
        return [f"output_s_pass returned {type(out).__name__}: it returns (the loss, (exp, total, w, local, mine)), "
                f"a pair whose second is the five statistics T needs"]
    loss, (exp, total, w, local, mine) = out
    mine_want, bad = want["stats"][env.rank], wrong["stats"][env.rank]
    padding = "a padded row (>= V) counted: its logit is minus infinity (07's rows >= V mask), so its exp is 0"
    local_max = ("each slice subtracted its own max: the max is the global one, all-reduced with MAX before the "
                 "exponentials, so that every slice's exponentials share one scale and sum")
    pairs = [("the loss", loss, want["loss"], [(wrong["loss"], padding)]),
             ("exp", exp, mine_want["exp"], [(bad["exp"], padding), (_local_max_exp(full, X, env.rank), local_max)]),
             ("total", total, mine_want["total"], [(bad["total"], padding)]),
             ("w", w, mine_want["w"]), ("local", local, mine_want["local"]), ("mine", mine, mine_want["mine"])]
    return differences(pairs, hints={"other": "the loss is sum_rows w (log total + max - the target's logit)"})


def _local_max_exp(full, X, r):
    per = 14
    z = X @ full[r * per:(r + 1) * per].T
    z[:, (torch.arange(per) + r * per) >= V] = -math.inf
    return (z - z.max(1, keepdim=True).values).exp()


def _t_alone(env, problem, want):
    full, X, t, n = problem
    shard = _shard(full, dist.group.WORLD)
    prior = torch.randn(shard.weight.shape, generator=torch.Generator().manual_seed(40 + env.rank), dtype=F64)
    stats = grader_s(shard, X, t, n, V, dist.group.WORLD)[1]
    shard.weight.grad = prior.clone()
    dX = vocab_parallel.output_t_pass(shard, X.clone(), *stats, dist.group.WORLD)
    s, per = shard.start, shard.per_rank
    exp, total, w, local, mine = stats
    g = (exp / total[:, None] - torch.nn.functional.one_hot(local, per) * mine[:, None]) * w[:, None]
    pairs = [("X's gradient (returned)", dX, want["dX"],
              [(g @ shard.weight.detach(), "it is this slice's share alone: X's gradient sums every slice's share, "
                                           "all-reduced over the vocabulary group (the second barrier)")]),
             ("this slice's weight gradient (shard.weight.grad)", shard.weight.grad, prior + want["dW"][s:s + per],
              [(want["dW"][s:s + per], "T replaced the gradient the slice held: add its rows' gradient to it "
                                       "(another microbatch's T, the input layer's lookups add theirs)")])]
    return differences(pairs, factors={"pp tp": WORLD})


def _alone(which, impl):
    problem = _problem()
    per = 56 // WORLD
    want, wrong = _serial(*problem, per), _serial(*problem, per, padding=True)
    name = "output_s_pass" if which == "S" else "output_t_pass"
    body, args = (_s_alone, (problem, want, wrong)) if which == "S" else (_t_alone, (problem, want))
    with installed((vocab_parallel, name, impl[name])):
        return [f"alone (V = {V} padded to 56 over {WORLD} ranks, X (12, 8), 2 targets ignored), {x}"
                for x in merged(ranks(body, WORLD, *args))]


# ----------------------------------------------------------------------------------------------
# Each pass inside 07's vocab_1f1b_step, the other the grader's


def _in_lesson(env, ref, pp, tp):
    grid = {**gpt3d.rank_grid(env.world_size, tp, 1, pp), "vocab": [list(range(env.world_size))]}
    groups = gpt3d.new_groups(env, grid)
    stage = vocab_parallel.vocab_stage(ref["cfg"], groups, dtype=F64)
    stage.transformer.wte.weight.split_group = groups.vocab
    stage.load_full_state_dict(ref["full"])
    micro = list(zip(ref["idx"].chunk(ref["m"]), ref["targets"].chunk(ref["m"])))
    loss = vocab_parallel.vocab_1f1b_step(stage, micro, groups)
    grads = stage.full_grads()
    pairs = [("the loss", loss, ref["loss"])] if loss is not None else []
    pairs += [(f"the gradient of {n}", g, ref["grads"][n]) for n, g in grads.items()]
    return differences(pairs, factors={"pp tp": pp * tp})


def in_lesson(impl, name, other):
    ref = serial_reference(2, 2, unequal=True)
    warm()
    with installed((vocab_parallel, name, impl[name]), (vocab_parallel, other[0], other[1])):
        got = merged(ranks(_in_lesson, 4, ref, 2, 2))
    return [f"in 07's vocab_1f1b_step, pp=2 x tp=2 on 4 CPU ranks, m=2, against the serial model: {x}" for x in got]


def check_s(impl):
    return first(_alone("S", impl) or in_lesson(impl, "output_s_pass", ("output_t_pass", grader_t)))


def check_t(impl):
    return first(_alone("T", impl) or in_lesson(impl, "output_t_pass", ("output_s_pass", grader_s)))


# ----------------------------------------------------------------------------------------------
# Planted wrong answers: each pass near the lesson's, with one mistake


def _s_planted(global_max=True, masked=True):
    def output_s_pass(shard, X, t, n, V, vocab):
        W = shard.weight.detach()
        rows = torch.arange(shard.start, shard.start + shard.per_rank)
        logits = (X @ W.T).masked_fill((rows >= V) & masked, -math.inf)
        top = logits.max(dim=1).values
        top = tensor_parallel.all_reduce(top, vocab, dist.ReduceOp.MAX) if global_max else top
        exp = (logits - top[:, None]).exp()
        counted, local = t != -100, t - shard.start
        mine = counted & (local >= 0) & (local < shard.per_rank)
        local = local.masked_fill(~mine, 0)
        picked = logits.gather(1, local[:, None]).squeeze(1).masked_fill(~mine, 0)
        total, picked = tensor_parallel.all_reduce(torch.stack([exp.sum(1), picked]), vocab)
        w = counted.to(X.dtype) / n
        return ((total.log() + top - picked) * w).sum(), (exp, total, w, local, mine)
    return output_s_pass


def _s_not_returned(shard, X, t, n, V, vocab):
    loss, stats = grader_s(shard, X, t, n, V, vocab)  # the mistake: computed, never returned  # noqa: F841


def _s_targets_shifted_in_place(shard, X, t, n, V, vocab):
    local = t.sub_(shard.start)  # the mistake: t itself shifted (the caller's targets)
    return grader_s(shard, X, local + shard.start, n, V, vocab)


def _t_planted(reduced=True, added=True):
    def output_t_pass(shard, X, exp, total, w, local, mine, vocab):
        grad = exp / total[:, None] * w[:, None]
        grad[torch.arange(X.shape[0]), local] -= mine * w
        dW = grad.T @ X
        shard.weight.grad = dW if shard.weight.grad is None or not added else shard.weight.grad + dW
        dX = grad @ shard.weight.detach()
        return tensor_parallel.all_reduce(dX, vocab) if reduced else dX
    return output_t_pass


def _t_not_returned(shard, X, exp, total, w, local, mine, vocab):
    dX = grader_t(shard, X, exp, total, w, local, mine, vocab)  # the mistake: computed, never returned  # noqa: F841


def _t_softmax_in_place(shard, X, exp, total, w, local, mine, vocab):
    exp.div_(total[:, None])  # the mistake: S's exp divided in place into the softmax
    return grader_t(shard, X, exp, torch.ones_like(total), w, local, mine, vocab)


EXERCISES = [
    Exercise("07.1", "s_pass", "S: the slice's logits, max and sums, the loss", ("output_s_pass",),
             "Yeung et al. 2024 (Vocabulary Parallelism), Algorithm 1: the S pass", check_s,
             lambda: {"output_s_pass": REFERENCE["output_s_pass"]},
             [Planted("s_not_returned", "output_s_pass computes the loss and statistics and returns nothing",
                      lambda: {"output_s_pass": _s_not_returned}, "it returned None", at_line=True),
              Planted("s_targets_shifted_in_place", "the targets are shifted to the slice in place (t.sub_)",
                      lambda: {"output_s_pass": _s_targets_shifted_in_place}, "in place", at_line=True),
              Planted("s_max_not_all_reduced", "each slice subtracts its own max, not the global one",
                      lambda: {"output_s_pass": _s_planted(global_max=False)}, "each slice subtracted its own max"),
              Planted("s_padding_counted", "the padded rows' logits are not masked",
                      lambda: {"output_s_pass": _s_planted(masked=False)}, "a padded row (>= V) counted")]),
    Exercise("07.2", "t_pass", "T: the slice's gradient, X's all-reduced", ("output_t_pass",),
             "Yeung et al. 2024 (Vocabulary Parallelism), Algorithm 1: the T pass", check_t,
             lambda: {"output_t_pass": REFERENCE["output_t_pass"]},
             [Planted("t_not_returned", "output_t_pass computes X's gradient and returns nothing",
                      lambda: {"output_t_pass": _t_not_returned}, "it returned None", at_line=True),
              Planted("t_softmax_in_place", "S's exp is divided in place into the softmax",
                      lambda: {"output_t_pass": _t_softmax_in_place}, "in place", at_line=True),
              Planted("t_dx_not_all_reduced", "X's gradient is this slice's share, never all-reduced",
                      lambda: {"output_t_pass": _t_planted(reduced=False)}, "this slice's share alone"),
              Planted("t_weight_grad_replaced", "T sets the slice's weight gradient instead of adding to it",
                      lambda: {"output_t_pass": _t_planted(added=False)}, "T replaced the gradient")]),
]
