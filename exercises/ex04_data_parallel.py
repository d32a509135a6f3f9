"""Exercises on 04_data_parallel.py: data parallelism, from the naive all-reduce to ZeRO-1.

dp replicas of the model each see 1/dp of the batch; their gradients are averaged, so that they
stay identical and train exactly like one model on the whole batch. The autograder runs 2 replicas
on CPU ranks with 04's lesson (train_lesson), your function in place of 04's, and compares the
gradients and several AdamW steps with serial training on the whole batch (float64).

    python3 -m exercises check 04              # your functions
    python3 -m exercises check 04 --solution   # 04's own functions
"""
import importlib

import torch.distributed as dist  # noqa: F401 (for your code)

tensor_parallel = importlib.import_module("01_tensor_parallel")  # noqa: F401 (01's all_reduce, for your code)


# ----------------------------------------------------------------------------------------------
# 04.1 Naive data parallelism (Li et al. 2020, "PyTorch Distributed", the naive gradient reduction)


def allreduce_gradients(params, group):
    """After backward: every parameter's .grad (in place) becomes the average over the dp replicas
    in `group`. Each replica's loss is the mean over its own rows of the batch. Parameters whose
    .grad is None are left alone."""
    raise NotImplementedError("04.1 allreduce_gradients: a sum over the replicas, and then? Read Li et al. "
                              "2020, its design section on gradient reduction; then run: python3 -m exercises check 04.1")


# ----------------------------------------------------------------------------------------------
# 04.2 The gradient hook of the lesson's DDP (Li et al. 2020, bucketing and overlapping computation
# with communication, and no_sync for gradient accumulation)
#
# 04's DDP (the lesson) keeps every gradient in one flat buffer, self.grads, laid out in reverse
# parameter order and cut into buckets: self.buckets[i] = (lo, hi), element offsets; self.view(p) is
# p's slice of the buffer, self.buckets_of[p] the buckets p's elements fall into, and self.pending[i]
# how many of bucket i's parameters have not yet delivered this step's final gradient (zero_grad()
# resets it). Each parameter's post-accumulate-grad hook is DDP.hook: this function. finish(), after
# the last backward, waits for every handle in self.works and makes each .grad a view of the buffer.


def ddp_hook(self, p):
    """DDP.hook, called by autograd once p.grad holds this microbatch's gradient of parameter p.

    Add p.grad into p's view of the flat buffer, divided by self.dp (the replicas' sum is then their
    average), and set p.grad to None (the next microbatch's backward writes a fresh one). Only under
    self.sync (the step's last microbatch: before it, gradients only accumulate) count each of p's
    buckets down; a bucket whose count reaches 0 has all its gradients: start its all-reduce over
    self.group at once, asynchronously, and append the handle to self.works, so that backward goes on
    while it runs."""
    raise NotImplementedError("04.2 DDP.hook: add in, count down, launch without waiting. Read Li et al. 2020 "
                              "on gradient bucketing, overlap and no_sync; then run: python3 -m exercises check 04.2")


# ----------------------------------------------------------------------------------------------
# 04.3 ZeRO-1: the optimizer state partitioned over the replicas (Rajbhandari et al. 2020, ZeRO-DP
# stage 1, P_os; Megatron's distributed optimizer)
#
# 04's ZeRO1 (the lesson) sits on a DDP whose flat buffer is padded to a multiple of dp: rank r owns
# its elements [self.lo, self.hi), the r-th of dp equal shards. self.flat holds every parameter's
# elements in the buffer's layout (self.ddp.offset[p]: where p starts), self.shard this rank's
# elements, a tensor of its own, and self.adamw an AdamW over self.shard alone.


def zero1_step(self):
    """ZeRO1.step, after ddp.finish() (self.ddp.grads holds the replicas' averaged gradients).

    Give self.shard its gradient, this rank's elements of self.ddp.grads, and run self.adamw; then
    every rank needs every rank's updated shard: gather them over self.ddp.group into self.flat (rank
    q's shard at q's place; torch.distributed.all_gather into the dp chunks of self.flat does it), and
    copy each parameter p of self.ddp.params back from its elements of self.flat."""
    raise NotImplementedError("04.3 ZeRO1.step: every rank updated only its own 1/dp. Read Rajbhandari et al. "
                              "2020 on P_os (ZeRO-DP stage 1); then run: python3 -m exercises check 04.3")
