"""02's lesson: gpipe_step and one_f_one_b_step equal the serial model, and the machine equals them.

The batch's microbatches count unequal numbers of targets (plumbing.reference.unequal_counts:
microbatch 0 counts none when m > 1, the last one half a row fewer), so a loss weighted 1/m per
microbatch, or a 0/0 for the empty one, shows.

Tolerances, float64, max|a - b| / max|b| over the loss and every gradient:
- the lesson against serial, 1e-10: a pipeline only changes where each layer runs and the order in
  which the microbatches' gradients are added (a few ulps, ~1e-15); weighting the microbatches 1/m
  moves the loss and the gradients by ~1e-1, a missed tied-embedding sum by a whole gradient term;
- the machine (02's execute) against the lesson, 1e-12: the same operations in the same order on the
  same weights and batch, so equal to the bit today (0.0); the margin is for a reduction of another
  order (the tied embedding: an all-reduce over two ranks there, a swap and an add here).
"""
import pytest
import torch
import torch.distributed as dist

from conftest import PIPELINE_CFG as CFG, load, unequal_batch, worst_of

tensor_parallel, pipeline = load("01_tensor_parallel"), load("02_pipeline_1f1b")
LESSONS = {"gpipe": "gpipe_step", "1f1b": "one_f_one_b_step"}


def batch(m, rows=2, T=16, seed=5):
    return unequal_batch(CFG, m, rows, T, seed)


def _lesson_and_machine(env, m, plant=None):
    """On every rank: {schedule: (the lesson against serial, the machine against the lesson)}."""
    if plant == "weights 1/m":
        pipeline.loss_weights = lambda mbs, ignore_index=-100: [1 / len(mbs)] * len(mbs)  # this fork only
    elif plant == "no tied sum":
        pipeline.sum_tied_grads = lambda stage, pp_group=None: None
    idx, targets = batch(m)
    full = tensor_parallel.init_state_dict(CFG, 0, dtype=torch.float64, random_all=True)
    serial = tensor_parallel.GPT(CFG, None, init=False, dtype=torch.float64)
    serial.load_full_state_dict(full)
    loss = serial(idx, targets)[1]
    loss.backward()
    ref = loss.detach(), {n: p.grad for n, p in serial.named_parameters()}
    micro, pp = list(zip(idx.chunk(m), targets.chunk(m))), env.world_size
    embed_group = dist.new_group([0, pp - 1]) if pp > 1 else None
    out = {}
    for name, step in LESSONS.items():
        stage = pipeline.stage_model(CFG, dtype=torch.float64)
        stage.load_full_state_dict(full)
        lesson = getattr(pipeline, step)(stage, micro), {n: p.grad for n, p in stage.named_parameters()}
        schedule = pipeline.Schedule([pipeline.SCHEDULES[name](pp, m, s) for s in range(pp)])
        chunks, result = pipeline.pipeline_step(CFG, schedule, dist.group.WORLD, embed_group, full, micro)
        machine = result.loss, {n: p.grad for n, p in chunks[0].named_parameters()}
        out[name] = worst_of(lesson, ref), worst_of(machine, lesson)
    return out


def test_the_batch_counts_unequally_with_an_empty_microbatch():
    counts = [int((t != -100).sum()) for t in batch(4)[1].chunk(4)]
    assert counts == [0, 32, 32, 24]


@pytest.mark.grid(keep=["2-1", "2-3", "4-2", "4-5"])
@pytest.mark.parametrize("pp,m", [(pp, m) for pp in (2, 4) for m in range(1, 6)], ids=lambda x: str(x))
def test_gpipe_and_1f1b_as_loops_equal_serial_and_the_machine_equals_them(run_ranks, pp, m):
    for r, out in enumerate(run_ranks(_lesson_and_machine, pp, m)):
        for name, (lesson, machine) in out.items():
            assert lesson <= 1e-10, f"{LESSONS[name]}, pp={pp} m={m}, rank {r}: {lesson:.2e} from serial"
            assert machine <= 1e-12, f"{name} on the machine, pp={pp} m={m}, rank {r}: {machine:.2e} from the lesson"


@pytest.mark.parametrize("plant", ["weights 1/m", "no tied sum"])
def test_a_planted_mistake_fails_against_serial(run_ranks, plant):
    """Each microbatch's mean weighted 1/m (its counts are 0, 32, 32, 24), or the tied embedding's two
    copies not summed: the lesson is O(1e-1) away from serial, not 1e-10."""
    out = run_ranks(_lesson_and_machine, 2, 4, plant)
    for name in LESSONS:
        assert max(o[name][0] for o in out) > 1e-3, (plant, name)
