"""Exercises on 08_context_parallel.py's lesson: one ring, and the ring's step.

The sequence is cut into cp contiguous blocks; rank r of the ring holds block r of every sequence.
The autograder puts your pieces in place of 08's: 08.1 runs your ring alone on 2 and 4 CPU ranks
(each rank's block of random q, k and v against torch's causal attention of the whole sequence),
then inside 08's ring_gpt and ring_step against the serial GPT-2 (01's), float64, to 1e-10: the
loss and every gradient, some targets not counted. 08.2 runs your step in a GPT-2 whose attention
the grader gathers itself, so it needs nothing of 08.1.

    python3 -m exercises check 08              # your functions
    python3 -m exercises check 08 --solution   # 08's own functions
"""
import importlib
import math  # noqa: F401 (for your code)

import torch  # noqa: F401 (for your code)
import torch.distributed as dist  # noqa: F401 (for your code)
import torch.nn.functional as F  # noqa: F401 (for your code)

context_parallel = importlib.import_module("08_context_parallel")
tensor_parallel = importlib.import_module("01_tensor_parallel")
pass_on = context_parallel.pass_on  # one hop of the ring: each tensor to the next rank, the previous rank's back


# ----------------------------------------------------------------------------------------------
# 08.1 One ring (Li et al. 2023, Section 3.1; the online softmax of Dao 2023, Algorithm 1)


def block_scores(q, k, own):
    """The scores q k^T / sqrt(hs) of a block of queries against a block of keys (B, nh, T/cp, T/cp);
    on the rank's own block causal: each query sees the keys up to its own position."""
    raise NotImplementedError("08.1 block_scores: which scores of the rank's own block are in a query's future? "
                              "Read Li et al. 2023 (LightSeq), Section 3.1; then run: python3 -m exercises check 08.1")


class OneRing(torch.autograd.Function):
    """Causal attention softmax(q k^T / sqrt(hs)) v of this rank's queries (block r) over the whole
    sequence. At step s the keys and values of block (r - s) mod cp visit, one hop further each step;
    the block's part is merged into the running output by the log-sum-exp (the online softmax).
    Backward is the reverse ring: the visiting block's dK and dV travel with it, and the last hop
    brings each block's gradients home."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        """q, k, v (B, nh, T/cp, hs): this rank's block; returns its output (B, nh, T/cp, hs). A later
        block (r - s) mod cp > r is skipped; the running output and its log-sum-exp (B, nh, T/cp, 1)
        start empty (0 and -inf), and each block's part joins them, both rescaled to the new
        log-sum-exp. Save what backward needs (the log-sum-exp of every row, not the scores)."""
        raise NotImplementedError("08.1 OneRing.forward: to what must the old output be rescaled when a block's "
                                  "keys join it? Read Li et al. 2023, Section 3.1, and Dao 2023 (FlashAttention-2), "
                                  "Algorithm 1; then run: python3 -m exercises check 08.1")

    @staticmethod
    def backward(ctx, do):
        """dQ, dK, dV of this rank's block, and None for the group: the probabilities recomputed from
        the saved log-sum-exp, D = rowsum(dO o); dQ stays at home, dK and dV travel with the visiting
        block (pass_on), and one last hop after the loop brings them to their owner."""
        raise NotImplementedError("08.1 OneRing.backward: where is block j's dK after the ring's last step, and "
                                  "how does it get home? Read Li et al. 2023, Section 3.1 (and Dao 2023, Algorithm "
                                  "2); then run: python3 -m exercises check 08.1")


# ----------------------------------------------------------------------------------------------
# 08.2 The ring's step (Li et al. 2023, Section 3.1; Megatron Core's context parallelism: the loss)


def ring_step(model, idx, targets, group):
    """One forward and backward of this rank's block of the batch (B, T) on its ring: returns the
    serial model's mean loss; every gradient ends summed over the ring's ranks.

    model: 01's ParallelGPT whose attention core is the ring (or anything that attends over the
    ring). Embed this rank's tokens (wte) at their true positions (wpe) r T/cp ... (r + 1) T/cp - 1,
    run the blocks and the head (model.transformer.h, .ln_f, model.lm_head), take the cross-entropy
    of this rank's targets summed (ignore_index -100) over the whole batch's count of counted
    targets, backward, then every parameter's gradient summed over the group. T % cp: a ValueError."""
    raise NotImplementedError("08.2 ring_step: by what must each rank's summed loss be divided so that the ranks' "
                              "shares add up to the serial mean? Read Li et al. 2023 (LightSeq), Section 3.1; then "
                              "run: python3 -m exercises check 08.2")
