"""Exercises on 09_expert_parallel.py: the token dispatcher and the load-balancing loss.

A GPT-2 with mixture-of-experts layers: each token goes to the k experts its router chooses, and the
experts live on ep ranks, E / ep each (expert e on ep rank e // (E / ep)). The autograder runs 09's
own model on 4 CPU ranks (attention tp 2 x dp 2 folded onto ep 4, and ep 2), your function in place
of 09's, and compares the loss, the auxiliary loss and every gradient with the serial model with
experts (float64); your dispatch is also run alone, with identity experts.

    python3 -m exercises check 09              # your functions
    python3 -m exercises check 09 --solution   # 09's own functions
"""
import importlib

import torch  # noqa: F401 (for your code)
import torch.distributed as dist  # noqa: F401 (for your code)

experts = importlib.import_module("09_expert_parallel")  # all_to_all, Plan; 01's all_reduce, reduce_from_tp
tensor_parallel = importlib.import_module("01_tensor_parallel")


# ----------------------------------------------------------------------------------------------
# 09.1 The dispatch: steps 1-3 of Megatron's all-to-all token dispatcher


def dispatch(x, chosen, E, group):
    """This rank's N tokens x (N, C) to the ranks holding the experts they chose, chosen (N, k) (expert
    ids; expert e lives on rank e // (E / ep) of `group`, ep its size). Returns (rows, plan):

      1. the (token, choice) pairs, chosen.flatten() (token-major: pair p is token p // k), sorted by
         expert: order = their indices, stably sorted by expert id (token order within an expert);
      2. the counts: how many pairs this rank has for each expert (E of them), exchanged with an
         all-to-all (experts.all_to_all(counts, [E // ep] * ep, [E // ep] * ep, group)), so that this
         rank learns, for each of its own E / ep experts, how many pairs every rank sends it; as host
         lists: blocks[s * (E / ep) + l] = the rows rank s sends local expert l; send[j] = the rows
         this rank sends rank j; recv[s] = the rows it receives from rank s;
      3. the rows themselves, x's token of each pair in `order`, sent with the uneven all-to-all
         experts.all_to_all(rows, send, recv, group): rows = what this rank received, rank 0's first.

    plan = experts.Plan(order, k, send, recv, blocks, counts): what combine() needs to undo it (counts
    as a host list too). With group None (ep = 1) the all-to-alls are the identity."""
    raise NotImplementedError("09.1 dispatch: sort the pairs by expert, exchange the counts, then the rows. Read "
                              "Liu et al. 2025 (MoE Parallel Folding: its token dispatcher) and 09's docstring (its "
                              "five steps); then run: python3 -m exercises check 09.1")


# ----------------------------------------------------------------------------------------------
# 09.2 The auxiliary load-balancing loss (Switch Transformer, eq. 4; GShard)


def load_balancing_loss(probs, chosen, group, keep=None):
    """E sum_i f_i P_i over one microbatch's tokens: probs (N, E) the router's softmax over every expert
    (a tensor with gradient), chosen (N, k) the experts each token was sent to. f_i: the share of the
    microbatch's N k choices that went to expert i (no gradient); P_i: expert i's mean probability.
    1 when the load is even. The microbatch's tokens are split over `group` (the tp ranks; None: not
    split): sum the counts, the probabilities and N over it first, so that every rank returns the loss of
    the whole microbatch, the serial model's; in backward each rank's probabilities get their own
    gradient (01's g: all-reduce forward, identity backward). keep (N,) bool, or None: the tokens whose
    target is counted, over which f_i and P_i both go (docs/LOSS.md); the checks pass None."""
    raise NotImplementedError("09.2 load_balancing_loss: f_i from the counts, P_i from the probabilities, both over "
                              "the whole microbatch. Read Fedus et al. 2022 (Switch), Section 2.2, eq. 4; then run: "
                              "python3 -m exercises check 09.2")
