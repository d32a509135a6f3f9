"""06's lesson: zb_h1_step (the backward split into I and W, and ZB-H1's loop over 02's lesson pieces)
equals the serial model, runs ZB-H1's list action for action, and the machine (zb_h1's lists run by
ZeroBubbleSchedule through SplitExecutor) equals it.

The batch's microbatches count unequal numbers of targets (plumbing.reference.unequal_counts:
microbatch 0 counts none when m > 1, the last one half a row fewer), so a loss weighted 1/m per
microbatch, or a 0/0 for the empty one, shows. Every case runs the lesson's blocking loop to its
end on real gloo ranks: that it returns at all is the proof that its messages do not deadlock
(a collective that waits past conftest's COLLECTIVE_TIMEOUT_S fails the test).

Tolerances, float64, max|a - b| / max|b| over the loss and every gradient:
- the lesson against serial, 1e-10: a pipeline with the backward split only changes where each
  layer runs, when each dW = dY^T X is computed and the order in which the microbatches' gradients
  are added (a few ulps, ~1e-15); a W never run loses its microbatch's weight gradients (all of them a
  relative difference of 1), so forgetting rank s's last s (those left after the drain) moves the
  gradients by their microbatches' share (0.37 and 0.47 on the two ranks at pp=2, m=4, the tied
  embedding's sum carrying it to rank 0); an I that also accumulates dW doubles them (1.01);
- the machine against the lesson, 1e-12: the same operations on the same weights and batch; the
  lesson also defers the tied output layer's W, which the machine keeps in I, so the embedding's
  gradient may add its terms in another order (~1e-16; 0.0 in these cases today).
"""
import pytest
import torch
import torch.distributed as dist

from conftest import PIPELINE_CFG, load, lesson_reference, worst_of

pipeline, zb = load("02_pipeline_1f1b"), load("06_zero_bubble")


def _i_with_dw(ctx, dy):  # SplitLinear.backward that also gives the weight its gradient: W then adds it again
    x, = ctx.saved_tensors
    ctx.kept.append((ctx.weight, x, dy))
    db = None if ctx.bias is None else dy.flatten(0, -2).sum(0)
    return dy @ ctx.weight.detach(), dy.flatten(0, -2).T @ x.flatten(0, -2), db, None


def _lesson_and_machine(env, m, plant=None):
    """On every rank: (the lesson against serial, the machine against the lesson, the lesson's order of F, I
    and W as (kind, microbatch), the machine's zb_h1 list for this rank)."""
    order, forward, backward, weight = [], pipeline.forward_step, pipeline.backward_step, zb.weight_grads
    count = {"F": 0, "I": 0, "W": 0}

    def log(kind):
        order.append((kind, count[kind]))  # each kind runs its microbatches in order (02's FIFO of flight)
        count[kind] += 1

    pipeline.forward_step = lambda *a: log("F") or forward(*a)  # this fork only
    pipeline.backward_step = lambda *a: log("I") or backward(*a)
    forgot = plant == "last Ws forgotten"  # rank s's s Ws left after the drain: zb_h1_step without its last flush
    zb.weight_grads = lambda kept: log("W") or (None if forgot and count["W"] > m - env.rank else weight(kept))
    if plant == "I keeps dW too":
        zb.SplitLinear.backward = staticmethod(_i_with_dw)
    pp, cfg = env.world_size, PIPELINE_CFG  # 4 layers: pp in 1, 2, 4
    idx, targets, full, ref, micro = lesson_reference(cfg, m)
    stage = pipeline.stage_model(cfg, dtype=torch.float64)
    stage.load_full_state_dict(full)
    lesson = zb.zb_h1_step(stage, micro), {n: p.grad for n, p in stage.named_parameters()}
    listed = [(a.kind, a.mb) for a in zb.zb_h1(pp, m, env.rank)]
    if plant:  # the machine is not planted: only the lesson against serial
        return worst_of(lesson, ref), None, order, listed
    embed_group = dist.new_group([0, pp - 1]) if pp > 1 else None
    schedule = zb.pipeline_schedule("zb-h1", pp, m)
    _, result, chunks = zb.run_schedule(env, cfg, schedule, (micro, full, *ref), embed_group)
    machine = result.loss, {n: p.grad for n, p in chunks[0].named_parameters()}
    return worst_of(lesson, ref), worst_of(machine, lesson), order, listed


CASES = [(2, 2), (2, 4), (2, 5), (4, 4), (4, 8), (4, 2), (1, 3), (2, 1), (4, 6)]  # (pp, m); m < pp included


@pytest.mark.grid(keep=["2-4", "4-6", "1-3"])
@pytest.mark.parametrize("pp,m", CASES, ids=lambda x: str(x))
def test_zb_h1_as_a_loop_equals_serial_runs_zb_h1s_list_and_the_machine_equals_it(run_ranks, pp, m):
    for r, (lesson, machine, order, listed) in enumerate(run_ranks(_lesson_and_machine, pp, m)):
        assert lesson <= 1e-10, f"zb_h1_step, pp={pp} m={m}, rank {r}: {lesson:.2e} from serial"
        assert order == listed, f"zb_h1_step, pp={pp} m={m}, rank {r}: ran {order}, zb_h1 lists {listed}"
        assert machine <= 1e-12, f"the machine, pp={pp} m={m}, rank {r}: {machine:.2e} from the lesson"


@pytest.mark.parametrize("plant", ["last Ws forgotten", "I keeps dW too"])
def test_a_planted_mistake_fails_against_serial(run_ranks, plant):
    """Rank s's last s Ws never run (the deferred ones, left after the drain), or I accumulating dW as B
    would and W adding it again (twice the weights' gradients): the lesson is O(1e-1) from serial, not 1e-10."""
    out = run_ranks(_lesson_and_machine, 2, 4, plant)
    assert max(lesson for lesson, *_ in out) > 1e-2, plant
