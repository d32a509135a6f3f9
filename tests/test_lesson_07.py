"""07's lesson: vocab_1f1b_step (02's 1F1B with the vocabulary layers over every pp x tp rank: the input
layer's lookups around it, each microbatch's output layer, S and T of Algorithm 1 in output_layer) equals
the serial model, and the machine (vocab_schedule's 1F1B lists with either algorithm, run by VocabSchedule
through VocabExecutor and VocabularyPasses) equals it.

The batch's microbatches count unequal numbers of targets (plumbing.reference.unequal_counts: microbatch 0
counts none when m > 1, the last one half a row fewer), so a weight of 1/m per microbatch, or a 0/0 for the
empty one, shows. Small vocabularies pad: V = 5 over 4 ranks is 8 rows, rank 3's slice all padding (its
maximum is minus infinity: the global one must come from the others), and V = 3 over 4 ranks leaves rank 3
one padded row. Every case runs the lesson's blocking loop to its end on real gloo ranks: that it returns
at all is the proof that its collectives and messages do not deadlock (a collective that waits past
conftest's COLLECTIVE_TIMEOUT_S fails the test).

Tolerances, float64, max|a - b| / max|b| over the loss and every gradient:
- the lesson against serial, 1e-10: vocabulary parallelism sums the softmax over pp x tp slices and a
  row of wte's gradient from the input and output layers in another order than the serial model (a few
  ulps, ~1e-15; pp = tp = 1 is the serial model's arithmetic, 0.0). Each planted mistake, at pp = tp = 2,
  m = 2, moves the loss or the gradients by more than 1e-2 (measured: each rank's own maximum taken
  for the global one adds exponentials of different bases, 4e-2 to 7e-2, small because the logits of
  a 0.02-scaled model differ little between slices; the input layer's lookups left unsummed feed the
  first stage rank 0's rows alone, ~1; X's gradient left unsummed gives the last stage its own
  slice's share only, ~1.3);
- the machine against the lesson, 1e-12: the same sums, in another order where the machine rescales
  each slice's sums from its own maximum (Algorithm 2 also its share of X's gradient) and reduces the
  input layer over the pipeline then tp (~1e-15); the margin is for that order alone.
"""
import pytest
import torch
import torch.distributed as dist

from conftest import PIPELINE_CFG, load, lesson_reference, worst_of

tensor_parallel, gpt3d, vp = load("01_tensor_parallel"), load("05_3d_gpt"), load("07_vocab_parallel")


def _plant(plant):
    """This fork's all_reduce (01's, which the lesson calls) made wrong in one way: one of its collectives skipped."""
    reduce = tensor_parallel.all_reduce

    def skipped(x, group, op=dist.ReduceOp.SUM):
        if plant == "the maximum left per rank" and op == dist.ReduceOp.MAX:
            return x
        if plant == "the lookups left unsummed" and x.dim() == 3:  # (B, T, C): the input layer's sums
            return x
        if plant == "X's gradient left unsummed" and x.dim() == 2 and x.shape[1] == PIPELINE_CFG.n_embd:  # (N, C)
            return x
        return reduce(x, group, op)

    tensor_parallel.all_reduce = skipped


def _lesson_and_machine(env, pp, tp, m, V, plant=None):
    """On every rank: (the lesson against serial, [the machine against the lesson, Algorithm 1 and 2])."""
    cfg = PIPELINE_CFG if V == PIPELINE_CFG.vocab_size else tensor_parallel.GPTConfig(
        **{**vars(PIPELINE_CFG), "vocab_size": V})
    idx, targets, full, ref, micro = lesson_reference(cfg, m)
    grid = {**gpt3d.rank_grid(env.world_size, tp, 1, pp), "vocab": [list(range(env.world_size))]}
    groups = gpt3d.new_groups(env, grid)
    stage = vp.vocab_stage(cfg, groups, dtype=torch.float64)
    stage.transformer.wte.weight.split_group = groups.vocab
    stage.load_full_state_dict(full)
    if plant:
        _plant(plant)
    lesson = vp.vocab_1f1b_step(stage, micro, groups), stage.full_grads()
    if plant:  # the machine is not planted: only the lesson against serial
        return worst_of(lesson, ref), []
    machine, machine_groups = [], None
    for barriers in (2, 1):
        pipe = vp.vocab_schedule("1f1b", pp, m, barriers)
        machine_groups = machine_groups or gpt3d.new_groups(env, pipe.grid(env.world_size, tp, 1))
        _, got = vp.run_step(env, cfg, pipe, machine_groups, (micro, full, *ref))
        machine.append(worst_of(got, lesson))
    return worst_of(lesson, ref), machine


# (pp, tp, m, V): pp x tp ranks; m < pp; pp = 1 (the vocabulary over tp alone); padded slices (V = 5, 3)
CASES = [(2, 1, 2, 97), (2, 1, 4, 97), (4, 1, 2, 97), (4, 1, 5, 3), (2, 2, 3, 97), (2, 2, 2, 5), (1, 2, 3, 97),
         (1, 1, 2, 97)]


@pytest.mark.grid(keep=["2-1-4-97", "2-2-2-5"])
@pytest.mark.parametrize("pp,tp,m,V", CASES, ids=lambda x: str(x))
def test_the_vocabulary_over_every_rank_equals_serial_and_the_machine_equals_it(run_ranks, pp, tp, m, V):
    for r, (lesson, machine) in enumerate(run_ranks(_lesson_and_machine, pp * tp, pp, tp, m, V)):
        assert lesson <= 1e-10, f"vocab_1f1b_step, pp={pp} tp={tp} m={m} V={V}, rank {r}: {lesson:.2e} from serial"
        for barriers, same in zip((2, 1), machine):
            assert same <= 1e-12, f"the machine, {barriers} barriers, pp={pp} tp={tp} m={m} V={V}, rank {r}: " \
                                  f"{same:.2e} from the lesson"


@pytest.mark.parametrize("plant", ["the maximum left per rank", "the lookups left unsummed",
                                   "X's gradient left unsummed"])
def test_a_planted_mistake_fails_against_serial(run_ranks, plant):
    """Each rank's own maximum taken for the global one, the input layer's lookups not summed over the ranks,
    or X's gradient not summed over the slices: O(1e-2) or more from serial on some rank, not 1e-10."""
    out = run_ranks(_lesson_and_machine, 4, 2, 2, 2, 97, plant)
    assert max(lesson for lesson, _ in out) > 1e-2, (plant, out)
