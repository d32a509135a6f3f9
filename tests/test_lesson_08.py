"""08's lesson: one ring (pass_on, OneRing, ring_gpt, ring_step) equals the serial model, and the
machine (context_parallel's model through step, every split) equals the lesson.

Every case runs the lesson's blocking ring to its end on real gloo ranks: that it returns at all is
the proof that its hops, forward and the reverse ring in backward, do not deadlock (a collective
that waits past conftest's COLLECTIVE_TIMEOUT_S fails the test). The batch's targets are masked
unevenly: a third of the first row, and the whole of the first rank's block of the second, so one
rank's share of the second row counts nothing and each rank's count differs.

Tolerances, float64, max|a - b| / max|b| over the loss and every gradient:
- the lesson against serial, 1e-10: the ring sums each query row's attention over cp blocks in
  another order, each rescaled once by the running log-sum-exp (a few ulps, ~1e-15); the causal
  mask left off the rank's own block, the ring run the wrong way round (each rank meets the wrong
  blocks), or a merge that keeps the larger log-sum-exp instead of adding the two parts moves the
  loss and the gradients by 1e-2 or more;
- the machine against the lesson, 1e-12: both exact, differing only in the order of their sums and
  the machine's max-and-sum State against the lesson's log-sum-exp (~1e-15).
"""
import pytest
import torch

from conftest import load, worst_of

tensor_parallel, context = load("01_tensor_parallel"), load("08_context_parallel")
CFG = tensor_parallel.GPTConfig(vocab_size=97, block_size=24, n_layer=2, n_head=2, n_embd=16)


def _batch(cp, T, B=2, seed=7):
    gen = torch.Generator().manual_seed(seed)
    idx, targets = torch.randint(CFG.vocab_size, (2, B, T), generator=gen)
    targets[0, :T // 3] = -100  # uneven counts over the ranks
    targets[1 % B, :T // cp] = -100  # the first rank's block of this row counts nothing
    return idx, targets


def _lesson_and_machine(env, T, plant=None):
    """On every rank (one ring of the whole world): (the lesson against serial, the machine against the lesson)."""
    if plant == "no causal mask":
        context.block_scores = lambda q, k, own: q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # this fork only
    elif plant == "the wrong way round":
        def backwards(group, *ts):  # each tensor sent to the previous rank, the next one's received
            r, cp = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
            got = [torch.empty_like(t.contiguous()) for t in ts]
            ops = [torch.distributed.P2POp(torch.distributed.isend, t.contiguous(), (r - 1) % cp) for t in ts]
            ops += [torch.distributed.P2POp(torch.distributed.irecv, g, (r + 1) % cp) for g in got]
            for w in torch.distributed.batch_isend_irecv(ops):
                w.wait()
            return got
        context.pass_on = backwards
    elif plant == "merge by the larger":
        torch.logaddexp = torch.maximum  # the lesson's merge alone calls it (serial: SDPA in C++)
    group, cp = torch.distributed.group.WORLD, env.world_size
    idx, targets = _batch(cp, T)
    full = tensor_parallel.init_state_dict(CFG, 0, dtype=torch.float64, random_all=True)
    serial = tensor_parallel.ParallelGPT(CFG, dtype=torch.float64)
    serial.load_full_state_dict(full)
    loss = serial(idx, targets)[1]
    loss.backward()
    ref = loss.detach(), {n: p.grad for n, p in serial.named_parameters()}
    model = context.ring_gpt(CFG, group, dtype=torch.float64)
    model.load_full_state_dict(full)
    lesson = context.ring_step(model, idx, targets, group), {n: p.grad for n, p in model.named_parameters()}
    if plant:  # the machine is not planted: only the lesson against serial
        return worst_of(lesson, ref), None
    worst = 0.0
    for name, make in context.SPLITS.items():
        if T % make(cp).n:
            continue
        machine = context.context_parallel(tensor_parallel.GPT(CFG, None, init=False, dtype=torch.float64), make(cp),
                                           group)
        machine.load_full_state_dict(full)
        loss = context.step(machine, idx, targets, group, group)[1]
        worst = max(worst, worst_of((loss, {n: p.grad for n, p in machine.named_parameters()}), lesson))
    return worst_of(lesson, ref), worst


CASES = [(1, 8), (2, 8), (2, 12), (3, 12), (4, 8), (4, 16), (4, 24)]  # (cp, T)


@pytest.mark.grid(keep=["2-12", "4-16"])
@pytest.mark.parametrize("cp,T", CASES, ids=lambda x: str(x))
def test_one_ring_equals_serial_and_the_machine_equals_it(run_ranks, cp, T):
    for r, (lesson, machine) in enumerate(run_ranks(_lesson_and_machine, cp, T)):
        assert lesson <= 1e-10, f"ring_step, cp={cp} T={T}, rank {r}: {lesson:.2e} from serial"
        assert machine <= 1e-12, f"the machine, cp={cp} T={T}, rank {r}: {machine:.2e} from the lesson"


@pytest.mark.parametrize("plant", ["no causal mask", "the wrong way round", "merge by the larger"])
def test_a_planted_mistake_fails_against_serial(run_ranks, plant):
    """Each query seeing its own block's later keys, each rank meeting block (r + s) mod cp at step s
    (its own ring's hops reversed), or the merge keeping the larger log-sum-exp: far from 1e-10."""
    out = run_ranks(_lesson_and_machine, 4, 16, plant)
    assert max(lesson for lesson, _ in out) > 1e-3, plant


def _refusal(env):
    try:
        model = context.ring_gpt(CFG, torch.distributed.group.WORLD, dtype=torch.float64)
        context.ring_step(model, *_batch(1, 9), torch.distributed.group.WORLD)
    except ValueError as e:
        return str(e)


def test_a_sequence_that_does_not_split_into_cp_blocks_is_refused_before_any_message(run_ranks):
    assert run_ranks(_refusal, 2) == ["ring_step: T=9 tokens do not split into cp=2 equal blocks"] * 2
