"""exercises/: a check's own collectives use the device its run is on, so that the checks run under
NCCL (a torchrun launch on GPUs), which takes no CPU tensors, as they do under gloo.

No GPU here: the run's device is pretended to be another one ("meta"), and the gather is stubbed to
record the device it is asked for, then to gather on the CPU as gloo needs.
"""
from dataclasses import replace

import torch

from conftest import load

checks_04 = load("exercises.checks_04")


class Gathered(Exception):
    """Stops the check once its gather has been seen: the rest of it is not what is tested."""


def _zero1_check_on(env, ref, device):
    real, asked = checks_04.gather_numbers, []

    def gather(values, group=None, device="cpu"):
        asked.append(str(device))
        real(values, group)  # both ranks take part, as in the check
        raise Gathered

    checks_04.gather_numbers = gather  # this forked rank's module only
    try:
        checks_04._zero(replace(env, device=torch.device(device)), ref)
    except Gathered:
        pass
    return asked


def test_the_zero1_check_gathers_the_shard_ranges_on_the_runs_device(run_ranks):
    ref = checks_04.reference()
    assert run_ranks(_zero1_check_on, 2, ref, "meta") == [["meta"], ["meta"]]
