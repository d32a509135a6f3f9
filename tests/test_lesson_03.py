"""03's lesson: interleaved_step equals the serial model, and the machine (interleaved's lists, run by
InterleavedSchedule through 02's pipeline_step) equals it.

The batch's microbatches count unequal numbers of targets (plumbing.reference.unequal_counts:
microbatch 0 counts none when m > 1, the last one half a row fewer), so a loss weighted 1/m per
microbatch, or a 0/0 for the empty one, shows. Every case runs the lesson's blocking loop to its
end on real gloo ranks: that it returns at all is the proof that its boundaries do not deadlock
(a collective that waits past conftest's COLLECTIVE_TIMEOUT_S fails the test).

Tolerances, float64, max|a - b| / max|b| over the loss and every gradient:
- the lesson against serial, 1e-10: a pipeline only changes where each layer runs and the order in
  which the microbatches' gradients are added (a few ulps, ~1e-15); weighting the microbatches 1/m
  moves the loss and the gradients by ~1e-1, a missed tied-embedding sum by a whole gradient term,
  chunks laid out rank-major (rank r holding v consecutive stages) runs the layers out of order;
- the machine against the lesson, 1e-12: the same operations in the same order on the same weights
  and batch, so equal to the bit today (0.0); the margin is for a reduction of another order (the
  tied embedding: an all-reduce over two ranks there, 02's swap and add here).
"""
import pytest
import torch
import torch.distributed as dist

from conftest import PIPELINE_CFG, load, lesson_reference, unequal_batch, worst_of

tensor_parallel, pipeline, interleaved = load("01_tensor_parallel"), load("02_pipeline_1f1b"), load("03_interleaved")


def _rank_major(n_layer, pp, v, rank):  # rank r holds v consecutive virtual stages: not interleaving
    ranges = pipeline.split_layers(n_layer, pp * v)
    return ranges[rank * v:(rank + 1) * v]


def _lesson_and_machine(env, v, m, plant=None):
    """On every rank: (the lesson against serial, the machine against the lesson)."""
    if plant == "weights 1/m":
        pipeline.loss_weights = lambda mbs, ignore_index=-100: [1 / len(mbs)] * len(mbs)  # this fork only
    elif plant == "no tied sum":
        pipeline.sum_tied_grads = lambda stage: None
    elif plant == "rank-major chunks":
        interleaved.chunk_layers = _rank_major
    pp = env.world_size
    cfg = tensor_parallel.GPTConfig(**{**PIPELINE_CFG.__dict__, "n_layer": pp * v})
    idx, targets, full, ref, micro = lesson_reference(cfg, m)
    chunks = interleaved.chunk_models(cfg, v, dtype=torch.float64)
    for chunk in chunks:
        chunk.load_full_state_dict(full)
    lesson = interleaved.interleaved_step(chunks, micro), {n: p.grad for c in chunks for n, p in c.named_parameters()}
    if plant:  # the machine is not planted: only the lesson against serial
        return worst_of(lesson, ref), None
    embed_group = dist.new_group([0, pp - 1]) if pp > 1 else None
    schedule = interleaved.InterleavedSchedule([interleaved.interleaved(pp, m, s, v) for s in range(pp)])
    chunks, result = pipeline.pipeline_step(cfg, schedule, dist.group.WORLD, embed_group, full, micro)
    machine = result.loss, {n: p.grad for c in chunks for n, p in c.named_parameters()}
    return worst_of(lesson, ref), worst_of(machine, lesson)


CASES = [(2, 2, 2), (2, 2, 4), (2, 3, 4), (2, 4, 2), (4, 2, 4), (4, 2, 8), (4, 3, 4), (1, 2, 2), (1, 3, 3),
         (2, 1, 3), (4, 1, 5)]  # (pp, v, m); v = 1 is 02's 1F1B, which takes any m


@pytest.mark.grid(keep=["2-2-4", "4-2-8", "1-3-3", "2-1-3"])
@pytest.mark.parametrize("pp,v,m", CASES, ids=lambda x: str(x))
def test_interleaved_1f1b_as_a_loop_equals_serial_and_the_machine_equals_it(run_ranks, pp, v, m):
    for r, (lesson, machine) in enumerate(run_ranks(_lesson_and_machine, pp, v, m)):
        assert lesson <= 1e-10, f"interleaved_step, pp={pp} v={v} m={m}, rank {r}: {lesson:.2e} from serial"
        assert machine <= 1e-12, f"the machine, pp={pp} v={v} m={m}, rank {r}: {machine:.2e} from the lesson"


@pytest.mark.parametrize("plant", ["weights 1/m", "no tied sum", "rank-major chunks"])
def test_a_planted_mistake_fails_against_serial(run_ranks, plant):
    """Each microbatch's mean weighted 1/m (its counts are 0, 32, 32, 24), the tied embedding's two
    copies not summed, or rank r holding stages 2r and 2r + 1: the lesson is O(1e-1) from serial, not 1e-10."""
    out = run_ranks(_lesson_and_machine, 2, 2, 4, plant)
    assert max(lesson for lesson, _ in out) > 1e-3, plant


def _refusal(env, v, m):
    """interleaved_step's refusal of m, and the p2p batches it posted first (none), on every rank."""
    posted, post = [], dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: posted.append(ops) or post(ops)  # this fork only
    cfg = tensor_parallel.GPTConfig(**{**PIPELINE_CFG.__dict__, "n_layer": env.world_size * v})
    idx, targets = unequal_batch(cfg, m)
    chunks = interleaved.chunk_models(cfg, v, dtype=torch.float64)
    try:
        interleaved.interleaved_step(chunks, list(zip(idx.chunk(m), targets.chunk(m))))
    except ValueError as e:
        return str(e), len(posted)
    return None, len(posted)


def test_an_m_the_machine_refuses_the_lesson_refuses_in_the_same_words_before_any_message(run_ranks):
    with pytest.raises(ValueError) as machine:
        interleaved.interleaved(2, 3, 0, 2)
    assert "m=3 must be divisible by pp=2" in str(machine.value)
    for said, posted in run_ranks(_refusal, 2, 2, 3):
        assert (said, posted) == (str(machine.value), 0)
