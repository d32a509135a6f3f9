"""09's lesson: one dispatch and one combine (MoE, in moe_gpt's blocks, run by lesson_step on every rank as a
replica) equals the serial model with experts (the same class with no group, serial_step), and the machine
(MoELayer in with_experts' GPT-2, folded onto the lesson's layout by prove_machine) equals the lesson.

The batch counts unequal numbers of targets: rank 0's rows one target, rank 1's none (its loss weighs 0 and
its auxiliary loss is 0, not 0/0), the last row two targets fewer. The auxiliary loss's coefficient is 0.1, ten
times the demo's, so that a mistake in the router's gradient shows in the router's gradient and the loss.

Tolerances, float64, max|a - b| / max|b| over the loss, the auxiliary loss and every gradient this rank holds:
- the lesson against serial, 1e-10: expert parallelism only moves rows between ranks and sums the replicas'
  gradients in another order (a few ulps, ~1e-16; the demo's worst is ~1e-15); an expert's gradient summed over
  the wrong ranks, or experts placed on the ranks of others, is O(1e-1) or more;
- the machine against the lesson, 1e-12: the same float64 operations on the same rows, in another order only
  where the machine's loss weighs a replica's count by n and the lesson's by n / world, ~1e-16 (the demo:
  ~5e-16); the margin is for a collective that sums in another order, still far below a mistake.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import gpt3d, load, tensor_parallel

moe_mod = load("09_expert_parallel")
CFG = tensor_parallel.GPTConfig(vocab_size=53, block_size=16, n_layer=2, n_head=2, n_embd=16)


def _batch(world, T=8, rows=2):
    """(idx, targets) of rows x world sequences: rank 0's rows count one target, rank 1's none, the last row
    two fewer."""
    gen = torch.Generator().manual_seed(11)
    idx, targets = torch.randint(CFG.vocab_size, (2, rows * world, T), generator=gen)
    targets[:rows].fill_(-100)[0, 3] = 5
    if world > 1:
        targets[rows:2 * rows] = -100
    targets[-1, :2] = -100
    return idx, targets


def _lesson_and_machine(env, E, k, ep, moe_every=1, plant=None):
    """On every rank: (the lesson against serial, the machine against the lesson, None when planted)."""
    if plant == "expert gradients over the ep group":  # summed over ranks holding other experts, not edp
        grid = moe_mod.expert_grid
        moe_mod.expert_grid = lambda world, ep: {**grid(world, ep), "edp": grid(world, ep)["ep"]}  # this fork only
    elif plant == "experts on the next rank":  # rank r holds the experts that dispatch sends to rank r + 1
        moe_mod.rank_of = lambda g: 0 if g is None else (dist.get_rank(g) + 1) % dist.get_world_size(g)
    world = env.world_size
    moe = moe_mod.MoEConfig(num_experts=E, top_k=k, moe_every=moe_every, aux_loss_coeff=0.1)
    full = moe_mod.moe_state_dict(CFG, moe, 7, dtype=torch.float64, random_all=True)
    idx, targets = _batch(world)
    groups = gpt3d.new_groups(env, moe_mod.expert_grid(world, ep))
    serial, lesson = (moe_mod.moe_gpt(CFG, moe, g, full) for g in (None, groups.ep))
    ref = moe_mod.serial_step(serial, idx, targets, world, moe.aux_loss_coeff)
    got = moe_mod.lesson_step(lesson, idx.chunk(world)[env.rank], targets.chunk(world)[env.rank], groups.edp,
                              moe.aux_loss_coeff)
    diffs = [tensor_parallel.max_rel_diff(got, ref)] + [tensor_parallel.max_rel_diff(p.grad, serial.get_parameter(n).grad)
                                                         for n, p in lesson.named_parameters()]
    if plant:
        return max(diffs), None
    return max(diffs), moe_mod.prove_machine(env, CFG, moe, SimpleNamespace(ep=ep), full, (idx, targets), got, lesson)


CASES = [(1, 4, 2, 1), (2, 4, 1, 2), (2, 4, 2, 2), (2, 2, 2, 2), (4, 8, 2, 4), (4, 4, 2, 2), (4, 4, 1, 4)]


@pytest.mark.grid(keep=["2-4-2-2", "4-4-2-2"])
@pytest.mark.parametrize("world,E,k,ep", CASES, ids=lambda x: str(x))
def test_one_dispatch_and_combine_equals_serial_and_the_machine_equals_it(run_ranks, world, E, k, ep):
    """world ranks, E experts, top-k, over ep groups of ep ranks (edp = world / ep of each expert; ep 1 at world 1
    is the serial layer, and E = k = 2 sends every token to both experts)."""
    for r, (lesson, machine) in enumerate(run_ranks(_lesson_and_machine, world, E, k, ep)):
        assert lesson <= 1e-10, f"the lesson, world {world} E={E} top-{k} ep={ep}, rank {r}: {lesson:.2e} from serial"
        assert machine <= 1e-12, f"the machine, world {world} E={E} top-{k} ep={ep}, rank {r}: {machine:.2e}"


def test_a_layer_without_experts_between_two_with_them_equals_serial(run_ranks):
    """moe_every 2: block 0's MLP has experts, block 1's is 01's dense ParallelMLP, averaged over every rank."""
    for lesson, machine in run_ranks(_lesson_and_machine, 2, 4, 2, 2, 2):
        assert lesson <= 1e-10 and machine <= 1e-12, (lesson, machine)


@pytest.mark.parametrize("plant", ["expert gradients over the ep group", "experts on the next rank"])
def test_a_planted_mistake_in_the_lesson_fails_against_serial(run_ranks, plant):
    """An expert's gradient summed over its ep group (ranks holding other experts) instead of its edp group, or
    each rank holding the experts that dispatch sends to the next rank: O(1e-1) or more from serial, not 1e-10."""
    out = run_ranks(_lesson_and_machine, 2, 4, 2, 2, 1, plant)
    assert min(lesson for lesson, _ in out) > 1e-2, (plant, out)
