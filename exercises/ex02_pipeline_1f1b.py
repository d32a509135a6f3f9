"""Exercises on 02_pipeline_1f1b.py: the lesson's pipeline loops, and the tied embedding.

You write 02's lesson: the loop each stage runs for one step of the batch, GPipe's (02.1) and
1F1B's (02.2), from the lesson's pieces, which are given (02's own: call them as pipeline.X):
    pipeline.loss_weights(microbatches)          each microbatch mean's weight (its share of the counted targets)
    pipeline.recv_from(src, like, pp_group)      dist.recv from stage src (None where there is no such stage)
    pipeline.send_to(t, dst, pp_group)           dist.send to stage dst (nothing where there is none)
    pipeline.send_recv(t, peer, like, pp_group)  send to and receive from stage peer, as one batch
    pipeline.forward_step(stage, mb, x, weight, losses) -> (input, output)
    pipeline.backward_step(input, output, dy) -> the input's gradient
    pipeline.sum_tied_grads(stage, pp_group)     after the last backward (02.3 writes it)
The autograder runs your loop on CPU ranks (one stage each: 02's stage_model, the serial model's
weights), float64, on a batch whose microbatches count unequal numbers of targets (one none), and
compares the loss and every gradient with the serial model's (1e-10). It also watches the order in
which your loop runs the forwards and backwards and waits for messages, and says where it leaves
the schedule (a warm-up too short makes two neighbours wait for each other: it is stopped there).

    python3 -m exercises check 02              # your functions
    python3 -m exercises check 02.2            # one exercise
    python3 -m exercises check 02 --solution   # 02's own functions
"""
import importlib

import torch.distributed as dist  # noqa: F401 (dist.get_rank(pp_group), dist.get_world_size(pp_group))

pipeline = importlib.import_module("02_pipeline_1f1b")


# ----------------------------------------------------------------------------------------------
# 02.1 GPipe (Huang et al. 2019; Narayanan et al. 2021, Section 2.2.1 and Figure 3)


def gpipe_step(stage, microbatches, pp_group=None, weights=None):
    """GPipe on this rank's stage s of pp (s = dist.get_rank(pp_group)): every microbatch forward in
    order (receive its input from stage s - 1, forward it, send the output to s + 1), all m kept in
    flight; then each backward in the same order, microbatch 0 first (receive the output's gradient
    from s + 1, backward, send the input's gradient to s - 1); then sum_tied_grads. What travels
    between stages is shaped (b, T, C) like next(stage.parameters()).new_empty(*idx.shape, stage.cfg.n_embd).
    weights: each microbatch mean's (None: pipeline.loss_weights(microbatches)). Returns the
    step's loss (the weighted means' sum) on the last stage (stage.post_process), else None."""
    raise NotImplementedError("02.1 gpipe_step: every forward (receive, forward, send), then every backward in "
                              "the same order. Read Narayanan et al. 2021, Section 2.2.1 (Figure 3); then run: "
                              "python3 -m exercises check 02.1")


# ----------------------------------------------------------------------------------------------
# 02.2 1F1B, PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
# Training"; Narayanan et al. 2021, Section 2.2.1 and Figure 4, top)


def one_f_one_b_step(stage, microbatches, pp_group=None, weights=None):
    """1F1B on this rank's stage s of pp, m microbatches, in three loops (gpipe_step's contract):
      warm-up: forwards only, as many as it takes microbatch 0 to reach the last stage and its
               gradient to come back here (how many for stage s? for the last stage?), at most m;
      steady:  forward the next new microbatch, then backward the oldest in flight: its output goes
               to s + 1 and its gradient comes back in one send_recv (send forward, receive
               backward), and the input's gradient goes to s - 1 with the next microbatch's input
               received in one send_recv (send backward, receive forward);
      drain:   the backwards left, oldest first; then sum_tied_grads.
    At most pp - s microbatches are ever in flight. Returns the loss on the last stage, else None."""
    raise NotImplementedError("02.2 one_f_one_b_step: how many forwards must stage s run before a gradient can "
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

    stage: this rank's stage (02's stage_model: a Stage, 01's ParallelGPT cut to its layers); the first stage
    and the last hold a copy, stage.transformer.wte.weight, whose .grad is what that copy received
    (the lookup's part on the first, the output layer's on the last). Update .grad in place. At
    pp = 1 the one stage holds both uses in one weight, and autograd has already added them. The
    lesson's own messages: send_recv(tensor, peer, like, pp_group) sends and receives at once."""
    raise NotImplementedError("02.3 sum_tied_grads: which stages hold a copy of wte, and what has each "
                              "copy's gradient missed? Read Shoeybi et al. 2019, Section 3 (the shared "
                              "embedding); then run: "
                              "python3 -m exercises check 02.3")
