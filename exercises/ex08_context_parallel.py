"""Exercises on 08_context_parallel.py: ring attention's blocks, and LightSeq's balanced schedule.

The autograder puts your functions in place of 08's and runs 08's own ring attention inside 01's
GPT-2 on 2 and 4 CPU ranks (the sequence split over them), against the serial GPT-2 in float64: the
loss, the logits and every gradient, to 1e-10. Your schedule is read first without any process, by
08's validate() and simulate().

    python3 -m exercises check 08              # your functions
    python3 -m exercises check 08 --solution   # 08's own functions

Try the schedule by hand first:
    python3 -c "import exercises.ex08_context_parallel as e; print(e.lightseq(4).steps)"
and compare with python3 scripts/figures.py balance-lightseq.
"""
import importlib
import math  # noqa: F401 (for your code)

import torch  # noqa: F401 (for your code)

context_parallel = importlib.import_module("08_context_parallel")  # State, Block, RingSchedule
State, Block, RingSchedule = context_parallel.State, context_parallel.Block, context_parallel.RingSchedule


# ----------------------------------------------------------------------------------------------
# 08.1 FlashAttention-2's recurrences (Dao 2023, Algorithm 1; Li et al. 2023, Section 3.1: the
# blocks of ring attention). A partial attention of c query rows over some keys is a State: m, the
# rows' largest score so far (B, nh, c); l, the sum of exp(score - m) (B, nh, c); acc, the sum of
# exp(score - m) v (B, nh, c, hs). 08's finish(st) turns one into o = acc / l and lse = m + log l.


def block_forward(q, k, v, diagonal, scale):
    """One block's partial attention as a State: q (B, nh, c, hs) against k and v (B, nh, c, hs),
    scores q k^T * scale. diagonal: q and k are the same c positions, so row i sees keys 0..i only
    (causal inside the block); otherwise every key is earlier than every query."""
    raise NotImplementedError("08.1 block_forward: what does a row's max do for exp(), and which scores does the "
                              "diagonal block mask? Read Dao 2023 (FlashAttention-2), Algorithm 1, and Li et al. "
                              "2023, Section 3.1; then run: python3 -m exercises check 08.1")


def merge(a, b):
    """Two States of the same query rows over different keys, as one: the online-softmax rule. None
    is empty (merge(None, b) is b)."""
    raise NotImplementedError("08.1 merge: two States have different maxes; to what must both be rescaled "
                              "before adding? Read Dao 2023 (FlashAttention-2), Algorithm 1; then run: python3 -m "
                              "exercises check 08.1")


# ----------------------------------------------------------------------------------------------
# 08.2 LightSeq's balanced schedule (Li et al. 2023, Section 3.2, Figure 2): the contiguous split
# (rank r holds block r of cp), every causal block (q i, kv j), j <= i, computed exactly once, in
# cp // 2 + 1 ring steps. At step s rank r meets only rank (r - s) mod cp.


def lightseq(cp):
    """08's RingSchedule("lightseq", [[r] for r in range(cp)], steps): steps[r][s] lists the Blocks
    rank r computes at step s, cp // 2 + 1 steps for every rank. A block at distance d = i - j is
    computed at step d by its queries' owner i while d <= cp // 2; a longer one by its keys' owner j,
    at the step at which j meets i, borrowing i's queries and sending the partial result home."""
    raise NotImplementedError("08.2 lightseq: at which step does rank j meet rank i, and which ranks have run out "
                              "of work of their own by then? Read Li et al. 2023, Section 3.2; then run: python3 -m "
                              "exercises check 08.2")
