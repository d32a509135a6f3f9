"""Exercises on 09_expert_parallel.py's lesson: one dispatch and one combine, and the load-balancing loss.

Every rank is a replica of the dense GPT-2 on its rows of the batch; each MoE layer's E experts are
spread over the ep ranks of its group, E / ep each (expert e on ep rank e // (E / ep)). The
autograder puts your pieces in place of 09's and runs 09's own moe_gpt and lesson_step on 4 CPU
ranks (ep 4, top-2, and ep 2, top-1) against the serial model with experts, float64: the loss, the
auxiliary loss and every gradient, to 1e-10. Your layer is run alone first (which rows each expert
receives, the output, every gradient); your loss on known routings first.

    python3 -m exercises check 09              # your functions
    python3 -m exercises check 09 --solution   # 09's own functions

Call 09's pieces through the module (experts.all_to_all, experts.aux_loss, experts.size_of), so that
each exercise is graded alone: while 09.1 is graded, experts.aux_loss is the grader's formula.
"""
import importlib

import torch  # noqa: F401 (for your code)
import torch.nn.functional as F  # noqa: F401 (for your code)
from einops import rearrange  # noqa: F401 (for your code)

experts = importlib.import_module("09_expert_parallel")  # all_to_all, aux_loss, size_of, rank_of; MoE's __init__
tensor_parallel = importlib.import_module("01_tensor_parallel")


# ----------------------------------------------------------------------------------------------
# 09.1 One dispatch and one combine: the lesson's MoE layer (Megatron's all-to-all token dispatcher)


class MoE(experts.MoE):
    """09's MoE layer with your forward: a block's MLP as a router (self.router, a linear layer to E
    logits) and the E / ep experts this rank holds (self.experts, keyed by their global ids e as
    strings, in order), over self.group (None: every expert here); self.E, self.k; self.keep (B, T)
    the tokens whose target counts, set before each forward."""

    def forward(self, x):
        """x (B, T, C) -> (B, T, C), and self.aux set. The router: softmax over E, the top k, their k
        probabilities renormalised to sum to 1; self.aux = experts.aux_loss(probs, chosen, E) over the
        kept tokens. Then, the N = B T tokens' N k (token, choice) pairs (pair p is token p // k):
          1. sorted by expert, stably (each rank's rows one block, ordered by its local experts);
          2. the counts per expert (E of them) in an all-to-all of their own (experts.all_to_all(
             counts, [E / ep] * ep, [E / ep] * ep, group)), so that every rank learns what arrives: the
             rows it sends each rank and receives from each;
          3. the rows, each pair's token, in the uneven all-to-all;
          4. each local expert once, on its rows from every rank;
          5. the reverse all-to-all, then each row weighted by its router probability and added back
             into its token's place."""
        raise NotImplementedError("09.1 MoE.forward: sort the pairs by expert, exchange the counts, then the rows; "
                                  "run each expert once; send back and weight. Read Liu et al. 2025 (MoE Parallel "
                                  "Folding: its token dispatcher) and 09's lesson section; then run: python3 -m "
                                  "exercises check 09.1")


# ----------------------------------------------------------------------------------------------
# 09.2 The auxiliary load-balancing loss (Switch Transformer, eq. 4; GShard)


def aux_loss(probs, chosen, E):
    """Switch's load-balancing loss E sum_i f_i P_i over these N tokens, probs (N, E), chosen (N, k): f_i the
    share of the N k choices that went to expert i, P_i expert i's mean probability. 1 when the load is even;
    below E/k always, since a token picks k different experts (f_i <= 1/k) and the P_i sum to 1. Over no
    token (a replica whose targets are all ignored) it is 0."""
    raise NotImplementedError("09.2 aux_loss: f_i from the counts, P_i from the probabilities; and over no token? "
                              "Read Fedus et al. 2022 (Switch), Section 2.2, eq. 4; then run: python3 -m exercises "
                              "check 09.2")
