"""Exercises on 01_tensor_parallel.py: write the pieces of tensor parallelism yourself.

Each class or function below has the name, the signature and the contract of the piece of
01_tensor_parallel.py it stands in for; its body raises NotImplementedError until you write it. Then:

    python3 -m exercises check 01              # your pieces, inside 01's real machinery
    python3 -m exercises check 01.3            # one exercise
    python3 -m exercises check 01 --solution   # the same checks on 01's own pieces

The autograder puts your piece in place of 01's in the launching process (01's own copy_to_tp then
applies your CopyToTP, 01's layers call them as they are, on the paper's path), forks 2 CPU ranks
(gloo) that inherit it, and compares the tensor-parallel GPT-2 with the serial one built from the
same float64 weights and batch: every rank, every tensor. A failure names the rank, the tensor, how
far off it is and in which direction ("is tp=2 x too large"), and what usually causes that.

Each exercise is graded on its own: where one exercise needs another's piece (the linears need f
and g), use 01's, so that a mistake in one is not counted twice.
Collectives: 01's, as its own pieces use them: tensor_parallel.all_reduce(x, group) returns the sum
over the group in a new tensor (op=dist.ReduceOp.MAX for the maximum), gather(x, group, dim) and
reduce_scatter(x, group, dim) below. (torch.distributed's dist.all_reduce works in place and
returns nothing useful.)
Shapes: B batch, T sequence, C channels, V vocabulary; tp = tp_size(group) ranks, this one tp_rank(group).
"""
import importlib
import math  # noqa: F401 (for your code)

import torch
import torch.distributed as dist  # noqa: F401 (for your code)
import torch.nn.functional as F  # noqa: F401 (for your code)

tensor_parallel = importlib.import_module("01_tensor_parallel")
tp_size, tp_rank, all_reduce = tensor_parallel.tp_size, tensor_parallel.tp_rank, tensor_parallel.all_reduce


# ----------------------------------------------------------------------------------------------
# 01.1 f and g (Shoeybi et al. 2019, Section 3 and Figure 3)
#
# A column-parallel layer needs the same input X on every rank; a row-parallel layer leaves each
# rank with a partial sum of the output. f enters the tensor-parallel region, g leaves it, and each
# is the other's transpose: what one does in forward, the other does in backward. 01's wrappers,
# copy_to_tp(x, group) and reduce_from_tp(x, group), apply them when tp > 1; the layers call those.


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


# ----------------------------------------------------------------------------------------------
# 01.2 The column- and row-parallel linear layers (Shoeybi et al. 2019, Section 3, the MLP: A split
# by columns, B by rows, so that the GeLU between them needs no communication)
#
# These are the layers' forward methods, without sequence parallelism (the
# autograder keeps 01's own forward for layers built with those). Use 01's f and g:
# tensor_parallel.copy_to_tp(x, group) and tensor_parallel.reduce_from_tp(y, group).


def column_parallel_forward(self, x):
    """ColumnParallelLinear.forward: Y_i = X A_i^T + b_i on rank i, with no communication in forward.

    self.weight (n_out/tp, n_in): this rank's rows of the full weight; self.bias (n_out/tp,), or
    None (the output layer, tied to the token embedding, has none); self.group. x (B, T, n_in), the
    same on every rank. Returns this rank's (B, T, n_out/tp)."""
    raise NotImplementedError("01.2 ColumnParallelLinear.forward: where does the input's gradient get summed? "
                              "Read Shoeybi et al. 2019, Section 3 (the MLP block, Figure 3a); then run: "
                              "python3 -m exercises check 01.2")


def row_parallel_forward(self, x):
    """RowParallelLinear.forward: Y = sum_i X_i A_i^T + b, the sum over the ranks.

    self.weight (n_out, n_in/tp): this rank's columns of the full weight; self.bias (n_out,), the
    same on every rank; self.group. x (B, T, n_in/tp): this rank's slice (a column-parallel
    layer's output). Returns (B, T, n_out), the same on every rank."""
    raise NotImplementedError("01.2 RowParallelLinear.forward: when is the bias added, before or after the sum "
                              "over the ranks? Read Shoeybi et al. 2019, Section 3 (the MLP block, Figure 3a); "
                              "then run: python3 -m exercises check 01.2")


# ----------------------------------------------------------------------------------------------
# 01.3 The vocab-parallel cross-entropy (Shoeybi et al. 2019, Section 3, the output embedding: the
# logits stay split by vocabulary and only per-token numbers cross ranks, not B T V logits)
#
# 01's vocab_parallel_cross_entropy(logits, target, group, n_vocab, ignore_index=-100)
# reshapes the logits to (N, V_pad/tp) and the targets to (N,) (N = B T rows) and applies this
# Function; its backward is written by hand, as 01's is: the gradient needs no communication.


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """F.cross_entropy(full logits[:, :n_vocab], target, ignore_index=ignore_index) from this rank's
    vocab slice of the logits, with two all-reduces: of one number per row, then of two."""

    @staticmethod
    def forward(ctx, logits, target, group, n_vocab, ignore_index):
        """logits (N, V_pad/tp): this rank holds columns [rank * V_pad/tp, (rank + 1) * V_pad/tp) of
        the full logits; columns >= n_vocab are padding (V_pad rounds V up to a multiple of tp) and
        are never a possible token. target (N,): token ids, or ignore_index for rows that do not
        count. Returns the mean loss over the counted rows (0 if none counts), the same on every rank.

        Steps:
          1. padded columns to -inf;
          2. each row's maximum over the whole vocabulary: all_reduce(..., op=dist.ReduceOp.MAX);
             subtracting it only keeps exp() finite on every rank (the loss does not depend on it);
          3. the target's logit minus the max: only the rank whose columns hold the target has it,
             the others put 0;
          4. the sum of exp(logit - max) over this rank's columns;
          5. the two sums over the ranks in one all-reduce: stack (3) and (4) into (2, N) and
             all_reduce that (Megatron's cross-entropy sends them so; the check counts the calls);
          6. loss per row = log(sum) - (target logit - max), averaged over the rows that count.
        Save for backward (ctx.save_for_backward) what the gradient needs."""
        raise NotImplementedError("01.3 _VocabParallelCrossEntropy.forward: three numbers per row cross the ranks "
                                  "(the max, the target logit, the sum of exponentials). Read Shoeybi et al. 2019, "
                                  "Section 3 (the output embedding); then run: python3 -m exercises check 01.3")

    @staticmethod
    def backward(ctx, grad):
        """grad: the loss's upstream gradient (a scalar). Returns (the gradient of this rank's
        logits (N, V_pad/tp), None, None, None, None): on each counted row, softmax minus the
        one-hot of the target, restricted to this rank's columns, times grad / the number of counted
        rows; 0 on the others. Every rank has what it needs from forward: no communication."""
        raise NotImplementedError("01.3 _VocabParallelCrossEntropy.backward: the gradient of the mean cross-entropy "
                                  "is softmax - one-hot, per counted row. Read Shoeybi et al. 2019, Section 3 (the "
                                  "output embedding); then run: python3 -m exercises check 01.3")


# ----------------------------------------------------------------------------------------------
# 01.4 Sequence parallelism's pair (Korthikanti et al. 2022, Section 4.2.2 and Figure 5)
#
# Outside the tensor-parallel regions (LayerNorm, dropout) each rank holds T/tp of the sequence.
# Entering a region, g all-gathers T; leaving it, g-bar reduce-scatters T (the paper's Figure 5
# names them so: they take f's and g's places). As with f and g, each
# one's backward is the other collective. 01's layers call gather_from_sp(x, group) and
# reduce_scatter_to_sp(x, group), which are these Functions' apply. The collectives are 01's (at
# tp = 1 each returns x):

SEQ = tensor_parallel.SEQ  # activations are (B, T, C): T is dim 1
gather = tensor_parallel.gather  # gather(x, group, dim): every rank's x, concatenated along dim in rank order
reduce_scatter = tensor_parallel.reduce_scatter  # (x, group, dim): the sum over the ranks, this rank's slice of dim


class GatherFromSP(torch.autograd.Function):
    """Sequence parallelism's g (in f's place): all-gather T in forward; reduce-scatter T in backward."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("01.4 GatherFromSP.forward: (B, T/tp, C) in, (B, T, C) out. Read Korthikanti "
                                  "et al. 2022, Section 4.2.2; then run: python3 -m exercises check 01.4")

    @staticmethod
    def backward(ctx, grad):  # grad (B, T, C); returns (gradient of x, None)
        raise NotImplementedError("01.4 GatherFromSP.backward: every rank used the whole gathered tensor. Read "
                                  "Korthikanti et al. 2022, Section 4.2.2; then run: python3 -m exercises check 01.4")


class ReduceScatterToSP(torch.autograd.Function):
    """Sequence parallelism's g-bar (in g's place): reduce-scatter T in forward; all-gather T in backward."""

    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("01.4 ReduceScatterToSP.forward: (B, T, C) partial sums in, this rank's "
                                  "(B, T/tp, C) of the total out. Read Korthikanti et al. 2022, Section 4.2.2; "
                                  "then run: python3 -m exercises check 01.4")

    @staticmethod
    def backward(ctx, grad):  # grad (B, T/tp, C); returns (gradient of x, None)
        raise NotImplementedError("01.4 ReduceScatterToSP.backward: each rank's partial sum fed every slice. Read "
                                  "Korthikanti et al. 2022, Section 4.2.2; then run: python3 -m exercises check 01.4")
