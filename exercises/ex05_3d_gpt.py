"""Exercises on 05_3d_gpt.py: composing tensor, pipeline and data parallelism (PTD-P).

The autograder puts your function in place of 05's and runs 05's own trainer on 4 CPU ranks
(tp=2 x pp=2) against the serial GPT-2 trained on the same data with the same optimizer, in
float64: every step's loss and gradient norm, to 1e-10 (05.4: the lesson's step, against the
serial model's, at tp x pp x dp = 1 x 1 x 2 and 2 x 2 x 2).

    python3 -m exercises check 05              # your functions
    python3 -m exercises check 05 --solution   # 05's own functions

Try the grid by hand first:
    python3 -c "import exercises.ex05_3d_gpt as e; print(e.rank_grid(8, tp=2, dp=2, pp=2))"
and compare with python3 05_3d_gpt.py --print-layout --tp 2 --dp 2 --pp 2.
"""
import importlib
import math  # noqa: F401 (for your code)

import torch  # noqa: F401 (for your code)
import torch.distributed as dist  # noqa: F401 (for your code)

tensor_parallel = importlib.import_module("01_tensor_parallel")  # all_gather_single
pipeline = importlib.import_module("02_pipeline_1f1b")  # one_f_one_b_step (05.4)
data_parallel = importlib.import_module("04_data_parallel")  # shard_batch, allreduce_gradients (05.4)


# ----------------------------------------------------------------------------------------------
# 05.1 The rank grid (Narayanan et al. 2021, Section 3: tensor parallelism inside a node; Megatron
# orders the ranks tp fastest, then dp, then pp)


def rank_grid(world, tp=1, dp=1, pp=1):
    """Every process group of each kind, as lists of global ranks: {"tp": [...], "dp": [...],
    "pp": [...], "embed": [...]}. Rank (t, d, p) in tp, dp, pp coordinates is (p * dp + d) * tp + t.
    A tp group is the tp ranks that differ only in t (likewise dp, pp), ranks ascending; every group
    of a kind, in ascending order of its first rank. "embed": for every pp group, [its first rank,
    its last rank] (the stages holding the tied embedding); none at pp = 1. A world that is not
    tp * dp * pp raises ValueError naming the four numbers, before anything else."""
    raise NotImplementedError("05.1 rank_grid: which index varies fastest, and why must tp groups be adjacent "
                              "ranks? Read Narayanan et al. 2021, Section 3; then run: python3 -m exercises "
                              "check 05.1")


# ----------------------------------------------------------------------------------------------
# 05.2 Scatter/gather between pipeline stages (Narayanan et al. 2021, Section 4.1)
#
# Without sequence parallelism both tp ranks of a stage hold the same boundary tensor (b, T, C).
# Each sends only its 1/tp slice of the flattened tensor to its peer in the next stage, which
# all-gathers the slices over its tp group. These are the two methods of 05's ScatterGather; the
# object has self.tp, self.rank (this rank's place in self.tp_group), self.tp_group, self.full
# (the boundary tensor's shape) and self.shape ((b T C / tp,), the buffer that travels).


def pack(self, t):
    """ScatterGather.pack: what this rank sends, t (b, T, C) -> its 1/tp slice of t flattened,
    contiguous, of shape self.shape."""
    raise NotImplementedError("05.2 ScatterGather.pack: which slice is this rank's? Read Narayanan et al. 2021, "
                              "Section 4.1; then run: python3 -m exercises check 05.2")


def unpack(self, buf):
    """ScatterGather.unpack: what this rank received, its slice buf (b T C / tp,) -> the whole
    boundary tensor, shape self.full, from every tp rank's slice (01's all_gather_single(out, buf,
    group=...) gathers them in rank order)."""
    raise NotImplementedError("05.2 ScatterGather.unpack: the tp ranks of the receiving stage each hold one "
                              "slice. Read Narayanan et al. 2021, Section 4.1; then run: python3 -m exercises "
                              "check 05.2")


# ----------------------------------------------------------------------------------------------
# 05.3 The global gradient norm, each element of the model counted once (for clipping; Narayanan
# et al. 2021, Section 3's layout: what each rank of the grid holds)


def counts_in_norm(p, chunk, tp_group):
    """Whether this rank adds parameter p's gradient to the global norm's sum of squares (which is
    then summed over the tp and pp groups: dp replicas hold the same gradients, so they count once;
    with ZeRO-1 each holds 1/dp of the elements, and the sum runs over dp too).

    A parameter split across the tp ranks (it has the attribute tp_dim) is a different slice on each
    rank. Replicated ones (LayerNorms, row-parallel biases, the position embedding) are the same on
    every tp rank. chunk is p's model chunk: chunk.pre_process (it holds the embeddings, the first
    stage) and chunk.post_process (ln_f and the output layer, the last); the output layer is tied to
    the token embedding chunk.transformer.wte.weight, of which the last stage holds a copy."""
    raise NotImplementedError("05.3 counts_in_norm: which parameters would be counted twice: over tp, and over "
                              "pp? Read Narayanan et al. 2021, Section 3; then run: python3 -m exercises check 05.3")


# ----------------------------------------------------------------------------------------------
# 05.4 One PTD-P step, from the earlier lessons (Narayanan et al. 2021, Section 3; the loss
# contract, docs/LOSS.md)


def ptd_p_step(stage, opt, idx, targets, groups, m):
    """05's lesson: one training step on this rank. idx, targets (B, T): the GLOBAL batch, the same
    on every rank. stage: 02's stage_model over the pp group groups.pp, holding 01's layers over
    groups.tp; opt: a torch AdamW over stage's parameters; groups.dp: this rank's replicas.
    1. this replica's rows of the batch (04's data_parallel.shard_batch), cut into m microbatches;
    2. the loss contract: every counted target (label != -100) of the global batch weighs 1/n, n the
       global count (count on the host, then one all-reduce over dp). Microbatch i's mean loss then
       weighs valid_i / n; think about what 3. and 4. do to it. One counting none weighs 0;
    3. 02's pipeline.one_f_one_b_step(stage, microbatches, groups.pp, weights) (it sums the tied
       embedding's two copies too);
    4. the gradients over the replicas: 04's data_parallel.allreduce_gradients(params, groups.dp),
       which AVERAGES them; then the optimizer's step (clear the old gradients first, not after:
       the autograder reads them).
    Returns the global batch's loss on the last stage (where one_f_one_b_step returns one), else None."""
    raise NotImplementedError("05.4 ptd_p_step: what does each counted target weigh when the replicas count "
                              "unequal numbers? Read Narayanan et al. 2021, Section 3, and docs/LOSS.md; then run: "
                              "python3 -m exercises check 05.4")
