"""Exercises on 01_tensor_parallel.py: write the pieces of tensor parallelism yourself.

Each function below has the signature and the contract of the piece of 01_tensor_parallel.py it
stands in for; its body raises NotImplementedError until you write it. Then:

    python3 -m exercises check 01              # your functions, inside 01's real machinery
    python3 -m exercises check 01.3            # one exercise
    python3 -m exercises check 01 --solution   # the same checks on 01's own functions

The autograder puts your function in place of 01's in the launching process, forks 2 CPU ranks
(gloo) that inherit it, and compares the tensor-parallel GPT-2 with the serial one built from the
same float64 weights and batch: every rank, every tensor. A failure names the rank, the tensor, how
far off it is and in which direction ("is tp=2 x too large"), and what usually causes that.

Each exercise is graded on its own: where one exercise needs another's piece (the linears need f
and g), use 01's, as the code below does, so that a mistake in one is not counted twice.
Collectives: torch.distributed's, with group=group (dist.all_reduce works in place and returns
nothing useful; clone a tensor before reducing it if autograd still needs the original).
Shapes: B batch, T sequence, C channels, V vocabulary; tp = tp_size(group) ranks, this one tp_rank(group).
"""
import importlib

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: F401 (for your code)

tensor_parallel = importlib.import_module("01_tensor_parallel")
tp_size, tp_rank = tensor_parallel.tp_size, tensor_parallel.tp_rank


# ----------------------------------------------------------------------------------------------
# 01.1 f and g (Shoeybi et al. 2019, Section 3 and Figure 3)
#
# A column-parallel layer needs the same input X on every rank; a row-parallel layer leaves each
# rank with a partial sum of the output. f enters the tensor-parallel region, g leaves it, and each
# is the other's transpose: what one does in forward, the other does in backward.


class CopyToTP(torch.autograd.Function):
    """f: identity in forward, all-reduce (sum over the group) in backward."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("01.1 f's forward (CopyToTP.forward): every rank keeps using the same input. "
                                  "Read Shoeybi et al. 2019, Section 3 and Figure 3; then run: "
                                  "python3 -m exercises check 01.1")

    @staticmethod
    def backward(ctx, grad):  # returns (gradient of x, None for group)
        raise NotImplementedError("01.1 f's backward (CopyToTP.backward): each rank holds only its part of the "
                                  "input's gradient. Read Shoeybi et al. 2019, Section 3 and Figure 3; then "
                                  "run: python3 -m exercises check 01.1")


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum over the group) in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("01.1 g's forward (ReduceFromTP.forward): the output is the sum of the ranks' "
                                  "partial outputs. Read Shoeybi et al. 2019, Section 3 and Figure 3; then "
                                  "run: python3 -m exercises check 01.1")

    @staticmethod
    def backward(ctx, grad):  # returns (gradient of x, None for group)
        raise NotImplementedError("01.1 g's backward (ReduceFromTP.backward): what does each rank's partial output "
                                  "contribute to the sum? Read Shoeybi et al. 2019, Section 3 and Figure 3; "
                                  "then run: python3 -m exercises check 01.1")


def copy_to_tp(x, group, tag=""):
    """f, as 01's layers call it (given: with one rank there is nothing to do)."""
    return x if tp_size(group) == 1 else CopyToTP.apply(x, group)


def reduce_from_tp(x, group, tag=""):
    """g, as 01's layers call it (given)."""
    return x if tp_size(group) == 1 else ReduceFromTP.apply(x, group)


# ----------------------------------------------------------------------------------------------
# 01.2 The column- and row-parallel linear layers (Shoeybi et al. 2019, Section 3, the MLP: A split
# by columns, B by rows, so that the GeLU between them needs no communication)
#
# These are the layers' forward methods, without sequence parallelism or gather_output (the
# autograder keeps 01's own forward for layers built with those). Use 01's f and g:
# tensor_parallel.copy_to_tp(x, group) and tensor_parallel.reduce_from_tp(y, group).


def column_parallel_forward(self, x):
    """ColumnParallelLinear.forward: Y_i = X A_i^T + b_i on rank i, with no communication in forward.

    self.weight (n_out/tp, n_in): this rank's rows of the full weight; self.bias (n_out/tp,);
    self.group. x (B, T, n_in), the same on every rank. Returns this rank's (B, T, n_out/tp), or,
    when self.skip_bias_add, the pair (X A_i^T without the bias, self.bias) for the next op to add."""
    raise NotImplementedError("01.2 ColumnParallelLinear.forward: where does the input's gradient get summed? "
                              "Read Shoeybi et al. 2019, Section 3 (the MLP block, Figure 3a); then run: "
                              "python3 -m exercises check 01.2")


def row_parallel_forward(self, x):
    """RowParallelLinear.forward: Y = sum_i X_i A_i^T + b, the sum over the ranks.

    self.weight (n_out, n_in/tp): this rank's columns of the full weight; self.bias (n_out,), the
    same on every rank; self.group. x (B, T, n_in/tp): this rank's slice (a column-parallel
    layer's output). Returns (B, T, n_out), the same on every rank, or, when self.skip_bias_add,
    the pair (the reduced output without the bias, self.bias)."""
    raise NotImplementedError("01.2 RowParallelLinear.forward: when is the bias added, before or after the sum "
                              "over the ranks? Read Shoeybi et al. 2019, Section 3 (the MLP block, Figure 3a); "
                              "then run: python3 -m exercises check 01.2")


# ----------------------------------------------------------------------------------------------
# 01.3 The vocab-parallel cross-entropy (Shoeybi et al. 2019, Section 3, the output embedding: the
# logits stay split by vocabulary and only per-token numbers cross ranks, not B T V logits)


def vocab_parallel_cross_entropy(logits, target, group, n_vocab, ignore_index=-100, tag="loss"):
    """F.cross_entropy(full logits[..., :n_vocab], target, ignore_index) from this rank's slice.

    logits (..., V_pad/tp): this rank holds columns [rank * V_pad/tp, (rank + 1) * V_pad/tp) of the
    full logits; columns >= n_vocab are padding (V_pad rounds V up to a multiple of tp) and are
    never a possible token. target (...): token ids, or ignore_index for positions that do not count.
    Returns the mean loss over the counted positions, the same on every rank.

    Steps, with rows N = the product of the leading dims (reshape to (N, V_pad/tp) and (N,)):
      1. padded columns to -inf;
      2. each row's maximum over the whole vocabulary (an all-reduce with op=dist.ReduceOp.MAX of a
         detached tensor: subtracting it changes no gradient, it only keeps exp() finite);
      3. the target's logit: only the rank whose columns hold the target has it; the others put 0,
         and a sum over the ranks gives it to every rank;
      4. the sum of exp(logit - max) over the whole vocabulary: each rank's sum, summed over ranks;
      5. loss per row = log(sum) - (target logit - max), averaged over the rows that count.
    Sum over ranks with tensor_parallel.reduce_from_tp (g): its backward is the identity, so
    autograd then gives every rank the gradient of its own columns, softmax minus one-hot."""
    raise NotImplementedError("01.3 vocab_parallel_cross_entropy: three numbers per row cross the ranks (the "
                              "max, the target logit, the sum of exponentials). Read Shoeybi et al. 2019, "
                              "Section 3 (the output embedding); then run: python3 -m exercises check 01.3")


# ----------------------------------------------------------------------------------------------
# 01.4 Sequence parallelism's pair (Korthikanti et al. 2022, Section 4.2.2 and Figure 5)
#
# Outside the tensor-parallel regions (LayerNorm, dropout) each rank holds T/tp of the sequence.
# Entering a region, g-bar all-gathers T; leaving it, g reduce-scatters T. As with f and g, each
# one's backward is the other collective. The collectives themselves are given below.


def all_gather_seq(x, group):
    """Given. Every rank's x (B, T/tp, C), concatenated along T in rank order: (B, T, C)."""
    parts = [torch.empty_like(x) for _ in range(tp_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def reduce_scatter_seq(x, group):
    """Given. The sum over the ranks of x (B, T, C), and of it this rank's slice of T: (B, T/tp, C).
    (An all-reduce, then a slice: a real reduce-scatter moves 1/tp of the bytes; here clarity wins.)"""
    total = x.clone()
    dist.all_reduce(total, group=group)
    return total.chunk(tp_size(group), dim=1)[tp_rank(group)].contiguous()


class GatherFromSP(torch.autograd.Function):
    """g-bar: all-gather T in forward, reduce-scatter T in backward."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("01.4 GatherFromSP.forward: (B, T/tp, C) in, (B, T, C) out. Read Korthikanti "
                                  "et al. 2022, Section 4.2.2; then run: python3 -m exercises check 01.4")

    @staticmethod
    def backward(ctx, grad):  # grad (B, T, C); returns (gradient of x, None)
        raise NotImplementedError("01.4 GatherFromSP.backward: every rank used the whole gathered tensor. Read "
                                  "Korthikanti et al. 2022, Section 4.2.2; then run: python3 -m exercises check 01.4")


class ReduceScatterToSP(torch.autograd.Function):
    """g of sequence parallelism: reduce-scatter T in forward, all-gather T in backward."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("01.4 ReduceScatterToSP.forward: (B, T, C) partial sums in, this rank's "
                                  "(B, T/tp, C) of the total out. Read Korthikanti et al. 2022, Section 4.2.2; "
                                  "then run: python3 -m exercises check 01.4")

    @staticmethod
    def backward(ctx, grad):  # grad (B, T/tp, C); returns (gradient of x, None)
        raise NotImplementedError("01.4 ReduceScatterToSP.backward: each rank's partial sum fed every slice. Read "
                                  "Korthikanti et al. 2022, Section 4.2.2; then run: python3 -m exercises check 01.4")


def gather_from_sp(x, group, tag=""):
    """g-bar, as 01's layers call it (given)."""
    return x if tp_size(group) == 1 else GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x, group, tag=""):
    """g of sequence parallelism, as 01's layers call it (given)."""
    return x if tp_size(group) == 1 else ReduceScatterToSP.apply(x, group)
