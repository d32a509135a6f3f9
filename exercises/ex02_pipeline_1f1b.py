"""Exercises on 02_pipeline_1f1b.py: pipeline schedules as data, and the tied embedding.

A schedule is a pure function (pp, m, stage) -> that stage's ordered list of pipeline.Action: "F3"
is the forward of microbatch 3, "B3" its backward. The autograder reads your lists with 02's own
validate() (every microbatch once each way, backward after forward, messages that can be matched
without deadlock) and simulate() (the bubble, the microbatches in flight), then runs them on CPU
ranks with 02's own pipeline_step (build the chunks, execute the lists, sync the tied embedding)
and compares the loss and every gradient with the serial model's.

    python3 -m exercises check 02              # your functions
    python3 -m exercises check 02.2            # one exercise
    python3 -m exercises check 02 --solution   # 02's own functions

Try the pure ones by hand first:
    python3 -c "import exercises.ex02_pipeline_1f1b as e; print([str(a) for a in e.one_f_one_b(4, 8, 1)])"
"""
import importlib

pipeline = importlib.import_module("02_pipeline_1f1b")
Action = pipeline.Action  # Action("F", 3) is "F3", Action("B", 3) "B3" (chunk and steady are 03's)


# ----------------------------------------------------------------------------------------------
# 02.1 GPipe (Huang et al. 2019; Narayanan et al. 2021, Section 2.2.1 and Figure 3)


def gpipe(pp, m, stage):
    """GPipe on stage `stage` of pp: the m forwards, microbatch 0 first, then the m backwards, in
    the same order. Every stage runs the same list. Returns [Action, ...] of length 2 m."""
    raise NotImplementedError("02.1 gpipe: all forwards, then all backwards. Read Narayanan et al. 2021, "
                              "Section 2.2.1 (Figure 3); then run: python3 -m exercises check 02.1")


# ----------------------------------------------------------------------------------------------
# 02.2 1F1B, PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
# Training"; Narayanan et al. 2021, Section 2.2.1 and Figure 4, top)


def one_f_one_b(pp, m, stage):
    """1F1B on stage `stage` of pp (0 is the first), m microbatches, in three phases:
      warmup: as many forwards as it takes the first microbatch to reach the last stage and its
              backward to come back here (how many is that for stage s? for the last stage?),
              capped at m;
      steady: one forward of the next new microbatch, then the backward of the oldest one in
              flight, repeated while forwards remain;
      drain:  the backwards that remain, oldest first.
    Returns [Action, ...] of length 2 m. At most pp - stage microbatches are ever in flight."""
    raise NotImplementedError("02.2 one_f_one_b: how many forwards must stage s run before a backward can "
                              "reach it? Read Narayanan et al. 2021, Section 2.2.1 (Figure 4, top); then "
                              "run: python3 -m exercises check 02.2")


# ----------------------------------------------------------------------------------------------
# 02.3 The tied embedding across stages: the output layer reuses the token embedding's weight
# (Shoeybi et al. 2019, Section 3: the input and output embeddings share one matrix), but with
# pp > 1 the first stage (the lookup) and the last stage (the output layer) each hold a copy.
# Megatron sums their gradients over an "embedding group" of those two ranks.


def sum_tied_grads(stage, pp_group=None):
    """After the stage's last backward (02's lesson calls it at the end of gpipe_step and
    one_f_one_b_step): make both copies of the tied weight hold the whole gradient, the sum of what
    each copy received.

    stage: this rank's stage (02's stage_model: 01's ParallelGPT cut to its layers); the first stage
    and the last hold a copy, stage.transformer.wte.weight, whose .grad is what that copy received
    (the lookup's part on the first, the output layer's on the last). Update .grad in place. At
    pp = 1 the one stage holds both uses in one weight, and autograd has already added them. The
    lesson's own messages: send_recv(tensor, peer, like, pp_group) sends and receives at once."""
    raise NotImplementedError("02.3 sum_tied_grads: which stages hold a copy of wte, and what has each "
                              "copy's gradient missed? Read Shoeybi et al. 2019, Section 3 (the shared "
                              "embedding); then run: "
                              "python3 -m exercises check 02.3")
