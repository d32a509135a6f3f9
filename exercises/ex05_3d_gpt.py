"""Exercises on 05_3d_gpt.py: composing tensor, pipeline and data parallelism (PTD-P).

Each stubs a function of 05's lesson. 05.1's grid is checked against its definition for ten worlds;
05.2's groups first with dist.new_group recorded (no rank started: which groups each rank creates, in
which order, and which it keeps), then on 4 CPU ranks; 05.3's AdamW against one written out in the
checker, in float64, three steps; 05.4, the lesson's step, against the serial model's at
tp x pp x dp = 1 x 1 x 2 and 2 x 2 x 2.

    python3 -m exercises check 05              # your functions
    python3 -m exercises check 05 --solution   # 05's own functions

Try the grid by hand first:
    python3 -c "import exercises.ex05_3d_gpt as e; print(e.rank_grid(8, tp=2, dp=2, pp=2))"
and compare with python3 05_3d_gpt.py --print-layout --tp 2 --dp 2 --pp 2.
"""
import importlib
import math  # noqa: F401 (for your code)
from datetime import timedelta  # noqa: F401 (for your code: new_group's timeout)

import torch  # noqa: F401 (for your code)
import torch.distributed as dist  # noqa: F401 (for your code)

tensor_parallel = importlib.import_module("01_tensor_parallel")  # all_gather_single
pipeline = importlib.import_module("02_pipeline_1f1b")  # one_f_one_b_step (05.4)
data_parallel = importlib.import_module("04_data_parallel")  # shard_batch, allreduce_gradients (05.4)
Groups = importlib.import_module("05_3d_gpt").Groups  # what new_groups returns (05.2)
CHECK_LR = 1e-3  # 05's CHECK_LR: adamw's default learning rate (05.3)


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
# 05.2 The process groups (Narayanan et al. 2021, Section 3; every group passed explicitly)


def new_groups(env, grid, timeout_s=60.0):
    """Create every group of rank_grid's grid and return this rank's group of each kind: a Groups
    (05's: Groups(tp=..., dp=..., pp=..., embed=...)), embed None on a rank in no embed group.
    dist.new_group(ranks, timeout=timedelta(seconds=timeout_s)) is a collective over ALL ranks: every
    rank calls it for every group of the grid, member or not, in the same order; it returns the group
    on its members (and a placeholder elsewhere). env.rank is this rank's global rank."""
    raise NotImplementedError("05.2 new_groups: which ranks must call dist.new_group for a group that does not "
                              "hold them, and in which order? Read Narayanan et al. 2021, Section 3, and "
                              "torch.distributed.new_group's documentation; then run: python3 -m exercises check 05.2")


# ----------------------------------------------------------------------------------------------
# 05.3 The trainer's AdamW (Loshchilov and Hutter's decoupled weight decay, as GPT-2 and Megatron use
# it: no decay on biases and LayerNorms)


def adamw(params, lr=CHECK_LR):
    """A torch.optim.AdamW over params (an iterable of parameters): betas (0.9, 0.95), weight decay 0.1
    on the 2-D weights (p.dim() >= 2: the linears' and the embeddings' matrices) and none on the rest
    (biases, LayerNorms), learning rate lr. Two parameter groups."""
    raise NotImplementedError("05.3 adamw: which parameters decay, and with which betas? Read Narayanan et al. 2021, "
                              "Section 3, torch.optim.AdamW's parameter groups, and 05's TrainConfig; then run: "
                              "python3 -m exercises check 05.3")


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
