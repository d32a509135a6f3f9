"""Exercises on 04_data_parallel.py: data parallelism, from the naive all-reduce to ZeRO-1.

dp replicas of the model each see 1/dp of the batch; their gradients are averaged, so that they
stay identical and train exactly like one model on the whole batch. The autograder runs 2 replicas
on CPU ranks with 04's own demo machinery (train_replica), your function in place of 04's, and
compares the gradients and several AdamW steps with serial training on the whole batch (float64).

    python3 -m exercises check 04              # your functions
    python3 -m exercises check 04 --solution   # 04's own functions
"""
import importlib

import torch.distributed as dist  # noqa: F401 (for your code)

tensor_parallel = importlib.import_module("01_tensor_parallel")  # reduce_scatter_single, all_gather_single


# ----------------------------------------------------------------------------------------------
# 04.1 Naive data parallelism (Li et al. 2020, "PyTorch Distributed", the naive gradient reduction)


def allreduce_gradients(params, group):
    """After backward: every parameter's .grad (in place) becomes the average over the dp replicas
    in `group`. Each replica's loss is the mean over its own rows of the batch. Parameters whose
    .grad is None are left alone."""
    raise NotImplementedError("04.1 allreduce_gradients: a sum over the replicas, and then? Read Li et al. "
                              "2020, its design section on gradient reduction; then run: python3 -m exercises check 04.1")


# ----------------------------------------------------------------------------------------------
# 04.2 A bucket's reduction, launched from the gradient hook (Li et al. 2020, bucketing and
# overlapping computation with communication)
#
# BucketedDDP (04) keeps every gradient in one flat buffer, self.grad_buffer, laid out in reverse
# parameter order and cut into buckets: self.buckets[i] = (lo, hi), element offsets. Its
# post-accumulate-grad hook, _on_grad, writes each gradient into the buffer (already divided by dp)
# and, when the last gradient of bucket i has arrived, calls self._launch(i): this function.
# finish(), after backward, launches any bucket still waiting (all of them with overlap=False),
# then waits for every self.works[i].


def launch_bucket(self, i):
    """BucketedDDP._launch: start the reduction of bucket i and return at once, while backward goes on.

    Without ZeRO-1 (self.zero false): sum the bucket's elements of self.grad_buffer over
    self.group, in place, asynchronously; store self.works[i] = (the work handle, None).
    With ZeRO-1: reduce-scatter them instead, into a new tensor `shard` of (hi - lo) / self.dp
    elements (this rank's part; 01 has the collective: tensor_parallel.reduce_scatter_single, as
    torch 2.11-2.13 name it), and store self.works[i] = (the work handle, shard): finish() copies
    the shard into the buffer at self.shard_range(i) once the work is done.
    You may also record self.events.append(("launch", i, self.clock())) for 04's timeline."""
    raise NotImplementedError("04.2 BucketedDDP._launch: which slice of the flat buffer, which collective, and "
                              "what makes it not wait? Read Li et al. 2020 on gradient bucketing and overlap; "
                              "then run: python3 -m exercises check 04.2")


# ----------------------------------------------------------------------------------------------
# 04.3 ZeRO-1: the optimizer state partitioned over the replicas (Rajbhandari et al. 2020, ZeRO-DP
# stage 1, P_os; Megatron's distributed optimizer)


def shard_range(self, i):
    """BucketedDDP.shard_range: the elements [a, b) of bucket i (self.buckets[i] = (lo, hi)) whose
    optimizer state this rank keeps. Without ZeRO-1 (self.zero false) that is the whole bucket;
    with ZeRO-1 the bucket's length is a multiple of self.dp, and the dp ranks of self.group own
    equal, disjoint parts of it, in rank order (dist.get_rank(self.group))."""
    raise NotImplementedError("04.3 BucketedDDP.shard_range: which 1/dp of bucket i is this rank's? Read "
                              "Rajbhandari et al. 2020 on P_os (ZeRO-DP stage 1); then run: python3 -m exercises "
                              "check 04.3")


def all_gather_params(ddp):
    """The end of ZeRO-1's optimizer step: each rank has just updated the weights of its own shard
    of every bucket, in ddp.param_buffer (the flat buffer every parameter is a view of); now every
    rank needs every rank's updated shard. For each bucket i (ddp.buckets[i] = (lo, hi)), gather the
    ranks' shards (ddp.shard_range(i)) into ddp.param_buffer[lo:hi] over ddp.group. (01's
    tensor_parallel.all_gather_single(out, mine, group=...) is the collective; its input must not
    be a view of its output.)"""
    raise NotImplementedError("04.3 all_gather_params: every rank updated only its own 1/dp. Read Rajbhandari "
                              "et al. 2020 on P_os (ZeRO-DP stage 1); then run: python3 -m exercises check 04.3")
