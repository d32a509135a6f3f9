"""Exercises on 07_vocab_parallel.py's lesson: the output layer's two passes over the vocabulary group.

The vocabulary is cut over every rank: rank i holds rows [start, start + per_rank) of wte (the padded
vocabulary, V_pad = a multiple of the group's size; rows >= V are padding, never a token), which the
tied output layer uses as its slice of the output weight. X, the last stage's ln_f output (N, C), has
been broadcast to every rank. 07.1 is S, the first pass: this slice's logits and the statistics that
make the loss without ever gathering the logits; 07.2 is T, the second: this slice's gradient.

The autograder runs each pass alone on 4 CPU ranks (V = 53 padded to 56, so the last slice holds 3
padded rows; some targets ignored, each rank's slice holding some targets), float64, against the serial
full-vocabulary cross-entropy and autograd: S's loss and every statistic; T's X gradient and its rows'
weight gradient, added to what the slice already held. Then inside 07's vocab_1f1b_step at pp = 2 x
tp = 2 against the serial model (the loss and every gradient, 1e-10); while one pass is graded, the
other is the grader's own, so each exercise is graded alone.

    python3 -m exercises check 07              # your functions
    python3 -m exercises check 07 --solution   # 07's own functions
"""
import importlib
import math  # noqa: F401 (for your code)

import torch  # noqa: F401 (for your code)
import torch.distributed as dist  # noqa: F401 (dist.ReduceOp.MAX)

tensor_parallel = importlib.import_module("01_tensor_parallel")  # all_reduce(x, group, op) returns a new tensor


# ----------------------------------------------------------------------------------------------
# 07.1 S: the slice's logits and their statistics (Yeung et al. 2024, Algorithm 1)


def output_s_pass(shard, X, t, n, V, vocab):
    """S on this rank's slice of wte (shard: rows [start, start + per_rank)) for X (N, C), targets t (N,): the
    logits, their max all-reduced, then their sums of exponentials and the target's logit (the first barrier).
    Returns (the weighted loss, every rank's; what T needs: exp (N, per_rank), total (N,), w, local, mine).

    shard.weight (per_rank, C), shard.start, shard.per_rank; a row >= V is padding: never a token, its
    logit minus infinity. t: -100 where a target is not counted; each counted one weighs 1 / n. vocab: the
    group (tensor_parallel.all_reduce(x, vocab, op) returns the reduced tensor, op dist.ReduceOp.MAX or SUM).
      exp   (N, per_rank): exp(logits - the global max of each row), 0 at a padded row
      total (N,): each row's sum of exponentials over every slice
      w     (N,): each row's weight, 1 / n if counted, else 0
      local (N,): the target's column in this slice (0 where it is not in this slice)
      mine  (N,) bool: whether the row's counted target is in this slice
    The loss: sum over rows of w (log total + max - the target's logit)."""
    raise NotImplementedError("07.1 output_s_pass: no rank holds every logit; which two reductions make the loss "
                              "without gathering them? Read Yeung et al. 2024, Algorithm 1 (the S pass, the "
                              "first barrier); then run: python3 -m exercises check 07.1")


# ----------------------------------------------------------------------------------------------
# 07.2 T: the slice's gradient (Yeung et al. 2024, Algorithm 1)


def output_t_pass(shard, X, exp, total, w, local, mine, vocab):
    """T: d loss / d logits = (softmax - onehot) w on this slice's columns, back through its GEMM: its rows'
    gradient added to shard.weight.grad; returns X's (N, C), every slice's share all-reduced (the second barrier).

    exp, total, w, local, mine: S's (see 07.1); leave them as they are. shard.weight.grad may already hold
    a gradient (another microbatch's, the input layer's): add to it (None: set it)."""
    raise NotImplementedError("07.2 output_t_pass: the softmax from S's statistics, the one-hot at this slice's "
                              "targets; which gradient is this rank's alone, and which a share to sum? Read Yeung "
                              "et al. 2024, Algorithm 1 (the T pass, the second barrier); then run: python3 -m "
                              "exercises check 07.2")
