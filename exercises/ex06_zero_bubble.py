"""Exercises on 06_zero_bubble.py's lesson: the backward split in two (I and W), and ZB-H1's loop.

A linear layer's backward is two computations: I, the input's gradient dX = dY W, which the previous
stage waits for, and W, the weight's dW = dY^T X, which nobody waits for until the optimizer. 06.1
splits them; 06.2 is ZB-H1's loop, which runs each W later, where 1F1B's rank would idle.

The autograder grades 06.1 in this process, float64, against autograd's whole backward: one layer
(the output, X's and the bias's gradient at I, none for the weight yet; then the weight's at W, and
two microbatches' Ws adding up), then 01's GPT with every linear layer split (06's split_linears,
which calls your SplitLinear) against the same GPT's plain backward. It runs 06.2 on CPU ranks (one
stage each: 02's stage_model, the serial model's weights; pp = 4 at m = 6 and m = 2), float64, on a
batch whose microbatches count unequal numbers of targets (one none), against the serial model's
loss and every gradient (1e-10), and watches the order of your Fs, Is and Ws against 06's zb_h1
list: a W never before its I, and rank s's Ws deferred as ZB-H1 defers them.

    python3 -m exercises check 06              # your functions
    python3 -m exercises check 06 --solution   # 06's own functions

Call 06's and 02's pieces through the modules (zero_bubble.split_linears, zero_bubble.weight_grads,
pipeline.forward_step, ...), so that each exercise is graded alone: while 06.2 is graded, 06's
SplitLinear and weight_grads are the grader's.
"""
import importlib

import torch  # noqa: F401 (for your code)
import torch.distributed as dist  # noqa: F401 (dist.get_rank(), dist.get_world_size())
import torch.nn.functional as F  # noqa: F401 (for your code)

pipeline = importlib.import_module("02_pipeline_1f1b")  # forward_step, backward_step, recv_from, send_to, ...
zero_bubble = importlib.import_module("06_zero_bubble")  # split_linears, weight_grads


# ----------------------------------------------------------------------------------------------
# 06.1 The backward split: I now, W later (Qi et al. 2023, Section 2)


class SplitLinear(torch.autograd.Function):
    """Y = X W^T + b whose backward is I alone: dX = dY W (I is what Qi et al. call B) and the bias's
    gradient now; the weight gets none here: (weight, X, dY) is appended to `kept`, for W."""

    @staticmethod
    def forward(ctx, x, weight, bias, kept):  # x (..., n_in), weight (n_out, n_in), bias (n_out,) or None
        """Y (..., n_out), X kept for the backward, and weight, bias and kept on ctx."""
        raise NotImplementedError("06.1 SplitLinear.forward: F.linear, and what will I and W need later? Read Qi "
                                  "et al. 2023, Section 2 (B split into I and W); then run: python3 -m exercises "
                                  "check 06.1")

    @staticmethod
    def backward(ctx, dy):  # dy (..., n_out)
        """I: one gradient per input of forward (x, weight, bias, kept): dX = dY W and the bias's (summed over
        every token), None for the weight (its W comes later) and for kept; (weight, X, dY) appended to kept."""
        raise NotImplementedError("06.1 SplitLinear.backward: dX now, dW later: what must W find in kept? Read Qi "
                                  "et al. 2023, Section 2; then run: python3 -m exercises check 06.1")


def weight_grads(kept):
    """W of one microbatch: dW = dY^T X for each linear layer its I kept, added to the weight's gradient."""
    raise NotImplementedError("06.1 weight_grads: dW = dY^T X over the microbatch's tokens, added to what the "
                              "weight already holds. Read Qi et al. 2023, Section 2; then run: python3 -m "
                              "exercises check 06.1")


# ----------------------------------------------------------------------------------------------
# 06.2 ZB-H1 (Qi et al. 2023, Section 2.1: the handcrafted schedule with 1F1B's memory)


def zb_h1_step(stage, microbatches):
    """ZB-H1 (Qi et al. Section 2.1) on this rank's stage: 02's one_f_one_b_step with each backward cut
    to I, whose dX is sent at once, every message 1F1B's (W sends none). Rank s then runs the oldest W
    while more than s wait: deferring s of them costs s M_W of memory, and the s left run after the
    drain, where 1F1B's rank s idles while the last input gradients travel on down to rank 0. Returns
    the loss on the last stage, else None.

    The pieces (call them through the modules): zero_bubble.split_linears(stage, kept) once, so that
    every backward_step is an I that appends to the list kept; zero_bubble.weight_grads(entries) is W
    of the entries one I kept (a copy of kept taken after that I, then kept cleared); 02's
    loss_weights, forward_step(stage, mb, x, weight, losses), backward_step(x, y, dy), recv_from,
    send_to, send_recv (no group: the world is the pipeline), and sum_tied_grads(stage) at the end.
    What travels is shaped like next(stage.parameters()).new_empty(*idx.shape, stage.cfg.n_embd)."""
    raise NotImplementedError("06.2 zb_h1_step: 1F1B with each B cut to I; when may rank s run a W, and how many "
                              "may wait? Read Qi et al. 2023, Section 2.1 (ZB-H1, the handcrafted schedule); then run: python3 -m "
                              "exercises check 06.2")
