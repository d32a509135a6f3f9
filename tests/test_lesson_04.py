"""04's lesson: naive, DDP and ZeRO1 train like serial training, and the machine equals them.

The batches are 04's demo's (training_reference): about half the targets masked, and unevenly over
the replicas: replica 0 counts a single target, replica 1's first microbatch none. So a loss
weighted by each replica's own count (the means' mean: 1/dp a replica) is O(1e-1) off serial's
per-token mean, and a microbatch counting none must weigh 0, not 0/0.

Tolerances, float64, max|a - b| / max|b| over every step's loss (the first one the forward loss of the
untouched weights) and every parameter after the steps:
- the lesson against serial, 1e-10: data parallelism sums the replicas' gradients in another order (a
  few ulps, ~1e-16), and AdamW's division by sqrt(v) grows such ulps in parameters with tiny
  gradients to ~1e-13 over 3 steps; a wrong weighting, a bucket reduced before its last gradient or
  a shard not gathered is O(1e-3) or more;
- the machine (BucketedDDP, FlatAdamW through train_replica) against the lesson, 1e-12: the same
  float64 operations on the same numbers, equal to the bit on gloo today (0.0); the margin is for a
  collective that sums in another order (ZeRO-1: the machine reduce-scatters its padded buckets, the
  lesson all-reduces its own), ulps that AdamW may grow as above, still far below a mistake.
"""
from argparse import Namespace

import pytest
import torch.distributed as dist

from conftest import load

tensor_parallel, data_parallel = load("01_tensor_parallel"), load("04_data_parallel")
CFG = tensor_parallel.GPTConfig(vocab_size=53, block_size=16, n_layer=1, n_head=2, n_embd=16)
MODES = ("naive", "bucketed", "zero1")


def _args(dp, bucket_numel, microbatches=2, steps=3):
    return Namespace(dp=dp, bucket_numel=bucket_numel, microbatches=microbatches, steps=steps, batch_size=4 * dp,
                     seq_len=8, lr=1e-2, seed=7)


def _lesson_and_machine(env, args, plant=None):
    """On every rank: {mode: (the lesson against serial, the machine against the lesson)}."""
    if plant == "1/dp weighting":  # each replica's own per-token mean, averaged over dp: the means' mean
        def own_mean(microbatches, group, ignore_index=-100):
            valid = [int((t != ignore_index).sum()) for _, t in microbatches]
            return [v / sum(valid) if v else 0.0 for v in valid]
        data_parallel.replica_loss_weights = own_mean  # this fork only
    elif plant == "bucket before its last gradient":
        data_parallel.DDP.hook = _early_hook
    elif plant == "no all-gather":
        data_parallel.dist = _NoAllGather()  # the lesson's module sees a dist whose all_gather does nothing
    elif plant == "machine: one shard everywhere":
        data_parallel.BucketedDDP.shard_range = _same_shard_everywhere
    group = dist.new_group(list(range(env.world_size)))
    batches, full, ref_losses, ref_params = data_parallel.training_reference(CFG, args)
    out = {}
    for mode in MODES:
        lesson = data_parallel.train_lesson(env, CFG, args, mode, group, full, batches)
        machine = data_parallel.train_replica(env, CFG, args, mode, group, full, batches)[:2]
        out[mode] = (data_parallel.differences(lesson, (ref_losses, ref_params)),
                     data_parallel.differences(machine, lesson))
    return out


def _early_hook(self, p):
    """DDP.hook with a bucket reduced as soon as its FIRST gradient is in (and waited for at once, so that
    the mistake is the same on every run): the gradients after it stay this replica's own."""
    self.view(p).add_(p.grad.reshape(-1), alpha=1 / self.dp)
    p.grad = None
    if self.sync:
        for i in self.buckets_of[p]:
            self.pending[i] -= 1
            if self.pending[i] == sum(i in b for b in self.buckets_of.values()) - 1:
                dist.all_reduce(self.grads[self.buckets[i][0]:self.buckets[i][1]], group=self.group)


class _NoAllGather:
    """torch.distributed, but all_gather leaves its outputs as they were."""

    def __getattr__(self, name):
        return (lambda *a, **k: None) if name == "all_gather" else getattr(dist, name)


def _same_shard_everywhere(self, i):
    lo, hi = self.buckets[i]
    return (lo, lo + (hi - lo) // self.dp) if self.zero else (lo, hi)


def test_the_replicas_count_unequally_one_a_single_target_one_a_microbatch_of_none():
    args = _args(4, 1000)
    batches = data_parallel.training_reference(CFG, args)[0]
    counts = data_parallel.counted(batches[0][1], 4, 2)
    assert sum(counts[0]) == 1 and counts[1][0] == 0 and len({sum(c) for c in counts}) == 4, counts


@pytest.mark.grid(keep=["2-100", "2-1000000", "4-1000"])
@pytest.mark.parametrize("dp,bucket_numel", [(dp, b) for dp in (2, 4) for b in (100, 1000, 10 ** 6)],
                         ids=lambda x: str(x))
def test_naive_ddp_and_zero1_equal_serial_and_the_machine_equals_them(run_ranks, dp, bucket_numel):
    """Buckets of 100 elements (smaller than a weight: a parameter spans several), 1,000 (buckets split
    parameters) and 10^6 (one bucket, launched by the last gradient of backward)."""
    for r, out in enumerate(run_ranks(_lesson_and_machine, dp, _args(dp, bucket_numel))):
        for mode, (lesson, machine) in out.items():
            assert lesson <= 1e-10, f"the lesson, {mode}, dp={dp} bucket={bucket_numel}, rank {r}: {lesson:.2e}"
            assert machine <= 1e-12, f"the machine, {mode}, dp={dp} bucket={bucket_numel}, rank {r}: {machine:.2e}"


def test_accumulating_over_four_microbatches_with_one_counting_none_equals_serial(run_ranks):
    for out in run_ranks(_lesson_and_machine, 2, _args(2, 300, microbatches=4, steps=2)):
        assert all(lesson <= 1e-10 and machine <= 1e-12 for lesson, machine in out.values()), out


@pytest.mark.parametrize("plant,fails", [("1/dp weighting", MODES), ("bucket before its last gradient", MODES[1:]),
                                         ("no all-gather", MODES[2:])])
def test_a_planted_mistake_in_the_lesson_fails_against_serial(run_ranks, plant, fails):
    """Each replica's own mean weighted 1/dp (replica 0's single target then weighs as much as all of
    another replica's), a bucket all-reduced at its first gradient, or ZeRO1's updated shards not gathered:
    the lesson is O(1e-3) or more from serial in the modes that run the planted code, not 1e-10."""
    out = run_ranks(_lesson_and_machine, 2, _args(2, 1000), plant)
    for mode in fails:
        assert min(o[mode][0] for o in out) > 1e-3, (plant, mode, [o[mode] for o in out])


def test_a_planted_mistake_in_the_machine_fails_against_the_lesson(run_ranks):
    """Every rank's FlatAdamW owning the first 1/dp of each bucket: the machine's zero1 leaves the rest
    of the weights as they were, O(1e-3) from the lesson, while its other modes still equal it."""
    for o in run_ranks(_lesson_and_machine, 2, _args(2, 1000), "machine: one shard everywhere"):
        assert o["zero1"][1] > 1e-3 and o["bucketed"][1] <= 1e-12 and o["zero1"][0] <= 1e-10, o
