"""Exercises on 03_interleaved.py: virtual stages, and the lesson's interleaved 1F1B loop.

The model is cut into pp * v chunks; each rank holds v of them, and a microbatch crosses every rank
v times. 03.1 says which layers a rank holds (03's chunk_layers); 03.2 is the lesson's loop,
interleaved_step, run on CPU ranks (v = 2 chunks each, the serial model's weights, float64, on a
batch whose microbatches count unequal numbers of targets, one none) against the serial model's loss
and every gradient (1e-10), its forwards, backwards and receives watched against the paper's order.

    python3 -m exercises check 03              # your functions
    python3 -m exercises check 03 --solution   # 03's own functions

Try 03.1 by hand first, and read the order 03.2 runs (03's own chunk_and_microbatch, given):
    python3 -c "import exercises.ex03_interleaved as e; print(e.chunk_layers(16, 4, 2, 0))"
    python3 -c "import exercises.ex03_interleaved as e; print([e.interleaved.chunk_and_microbatch(k, 2, 2) for k in range(8)])"
"""
import importlib

import torch.distributed as dist  # noqa: F401 (dist.get_rank(), dist.get_world_size())

pipeline = importlib.import_module("02_pipeline_1f1b")  # forward_step, backward_step, loss_weights, sum_tied_grads
interleaved = importlib.import_module("03_interleaved")  # chunk_and_microbatch, exchange (the lesson's, given)


# ----------------------------------------------------------------------------------------------
# 03.1 Which layers each rank holds (Narayanan et al. 2021, Section 2.2.2: "each device is assigned
# multiple chunks", e.g. layers 1, 2, 9, 10 on the first of 4 devices with 16 layers and v = 2)


def chunk_layers(n_layer, pp, v, rank):
    """The layer ranges of rank's v chunks, chunk 0 first: [range, ...], 0-based, contiguous within a
    chunk. The model's n_layer layers are cut into pp * v equal virtual stages, in order; virtual
    stage k runs on rank k % pp as its chunk k // pp. n_layer is a multiple of pp * v."""
    raise NotImplementedError("03.1 chunk_layers: virtual stage k = chunk * pp + rank. Read Narayanan et al. "
                              "2021, Section 2.2.2; then run: python3 -m exercises check 03.1")


# ----------------------------------------------------------------------------------------------
# 03.2 The interleaved 1F1B loop (Narayanan et al. 2021, Section 2.2.2 and Figure 4, bottom)


def interleaved_step(chunks, microbatches):
    """Interleaved 1F1B on this rank's v chunks (rank r of pp = the world; chunk c is virtual stage
    k = c pp + r of S = pp v; m = len(microbatches), a multiple of pp; v = 1 is 02's one_f_one_b_step).

    Order: the rank's n = m v forwards, the k-th being interleaved.chunk_and_microbatch(k, pp, v)
    (groups of pp microbatches through chunk 0, then chunk 1, ...), and its n backwards likewise
    (forward=False: chunk v - 1 first). Steps: the warm-up's forwards, one a step (how many before
    rank r's first backward? microbatch 0 must go through its earlier chunks, then reach the last
    stage and come back: at most n); then steady steps, each one new forward and the oldest
    backward, run back to back with no messages between (with v chunks, a boundary there can make two
    ranks wait on each other); then the drain's backwards, one a step.
    Messages: before each step, one interleaved.exchange(sends, receives, box, like): the previous
    step's outputs sent (a forward's to stage k + 1, a backward's input gradient to stage k - 1, keyed
    (kind, stage, microbatch), kind that of the action that will read it) and this step's inputs
    received into box (from rank (r -+ 1) mod pp), and one more exchange after the last step for its
    sends. pipeline.forward_step and pipeline.backward_step do the arithmetic (the weights from
    pipeline.loss_weights); at pp = 1 outputs are handed over on the rank, no messages. At the end
    the tied embedding: pipeline.sum_tied_grads on the chunk holding a copy (pp > 1; at pp = 1 both
    copies are on this rank: add them). Returns the loss on rank pp - 1, else None."""
    raise NotImplementedError("03.2 interleaved_step: the warm-up (how far is rank r from the last stage, twice, "
                              "plus a round of pp per extra chunk?), the steady pairs, the drain, an exchange "
                              "before each step. Read Narayanan et al. 2021, Section 2.2.2 (Figure 4); then run: "
                              "python3 -m exercises check 03.2")
