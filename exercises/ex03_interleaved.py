"""Exercises on 03_interleaved.py: virtual stages, and the interleaved 1F1B schedule as data.

The model is cut into pp * v chunks; each rank holds v of them, and a microbatch crosses every rank
v times. Your schedule is read by 02's validate() and simulate() (the bubble must be exactly
(pp - 1)/(v m)) and run through 02's pipeline_step on CPU ranks against the serial model.

    python3 -m exercises check 03              # your functions
    python3 -m exercises check 03 --solution   # 03's own functions

Try them by hand first:
    python3 -c "import exercises.ex03_interleaved as e; print(e.chunk_layers(16, 4, 2, 0))"
    python3 -c "import exercises.ex03_interleaved as e; print(' '.join(map(str, e.interleaved(2, 4, 0, 2))))"
(an Action prints as F3 for chunk 0, F3.1 for chunk 1.)
"""
import importlib

pipeline = importlib.import_module("02_pipeline_1f1b")
Action = pipeline.Action  # Action("F", mb, chunk), Action("B", mb, chunk, steady=True)


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
# 03.2 The interleaved 1F1B schedule (Narayanan et al. 2021, Section 2.2.2 and Figure 4, bottom)


def interleaved(pp, m, stage, v):
    """Rank `stage`'s list of 2 m v Actions over its v chunks (m is a multiple of pp; v = 1 is 02's
    1F1B, pipeline.one_f_one_b(pp, m, stage)).

    Order: the k-th forward of a rank runs microbatches in groups of pp: the first pp microbatches
    through chunk 0, then the same pp through chunk 1, ..., through chunk v - 1, then the next pp
    microbatches through chunk 0 again. The k-th backward follows the same order with the chunks
    reversed (v - 1 first: gradients enter at the last stage).
    Warmup: forwards before the first backward. Rank r's first backward (on its last chunk) can run
    only after the first microbatch has gone forward through every later stage and back, and after
    the first group of pp microbatches has gone through its earlier chunks: count the forwards that
    takes (at most m v).
    Then steady pairs, one new forward and the oldest backward, both marked steady=True (02's
    Schedule.plan runs such a pair back to back, with no exchange between them: with v chunks a
    boundary there can make two ranks wait on each other), and then the remaining backwards."""
    raise NotImplementedError("03.2 interleaved: the order (groups of pp microbatches per chunk) and the warmup "
                              "(how far is rank r from the last stage, twice, plus a round of pp per extra "
                              "chunk?). Read Narayanan et al. 2021, Section 2.2.2 (Figure 4); then run: "
                              "python3 -m exercises check 03.2")
