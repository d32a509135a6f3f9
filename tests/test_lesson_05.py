"""05's lesson: ptd_p_step, one PTD-P step built from 01's, 02's and 04's lessons, equals the serial model at
every layout; the machine (build, train_step) equals the lesson; the main job's check (demo) says so.

The global batch (B = dp x 3 microbatches x 2 rows) is masked by plumbing.reference.unequal_counts over its
dp x 3 microbatches: replica 0's first microbatch counts none and the last replica's last one half a row
fewer, so replicas and microbatches count unequal numbers of targets: averaging the replicas' own means
(1/dp), a 0/0 for the empty microbatch, or a missed tied-embedding sum all show.

Tolerances, float64, max|a - b| / max|b| over the loss, every gradient and every weight after AdamW:
- the lesson against serial, 1e-10, over 3 AdamW steps: a layout only changes where each sum is taken and
  in which order (tp's all-reduces, the microbatches' accumulation, the dp mean), a few ulps (~1e-15 on
  the gradients); AdamW's division by sqrt(v) + eps amplifies that for elements whose gradient is near
  eps (1e-8), to ~1e-14 on the weights at tp > 1. A planted mistake is off by > 1e-3;
- the machine against the lesson, 1e-12: the same sums in another order (pre-divided buckets, 01's
  overlapped linears and merged loss reductions, 04's flat AdamW), so ~1e-14 at most (the weights, as above).
"""
import pytest
import torch
import torch.distributed as dist

from conftest import load
from plumbing.reference import unequal_counts
from plumbing.shards import max_rel_diff

tensor_parallel, pipeline, gpt3d = load("01_tensor_parallel"), load("02_pipeline_1f1b"), load("05_3d_gpt")
LAYOUTS = [(1, 1, 2), (2, 1, 1), (1, 2, 1), (2, 2, 2)]  # (tp, pp, dp)


def _plant(plant):
    """Install a mistake in this rank's fork only."""
    if plant == "replicas 1/dp":  # each replica's own mean (02's loss_weights), the replicas averaged
        step = pipeline.one_f_one_b_step
        pipeline.one_f_one_b_step = lambda stage, micro, pp_group=None, weights=None: step(stage, micro, pp_group)
    elif plant == "no tied sum":
        pipeline.sum_tied_grads = lambda stage, pp_group=None: None


def _lesson_steps(env, layout, steps, plant=None):
    """On every rank: (the lesson against serial over `steps` AdamW steps, the machine against the lesson
    on the first), each the largest relative difference on this rank."""
    _plant(plant)
    tp, pp, dp = layout
    m, dt = gpt3d.CHECK_M, torch.float64
    cfg = tensor_parallel.GPTConfig(vocab_size=97, block_size=8, n_layer=2 * pp, n_head=2 * tp, n_embd=8 * tp)
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, tp, dp, pp), 20)
    full = tensor_parallel.init_state_dict(cfg, 3, dtype=dt, random_all=True)
    serial = tensor_parallel.GPT(cfg, None, init=False, dtype=dt)
    stage = pipeline.stage_model(cfg, groups.pp, group=groups.tp, dtype=dt)
    for model in (serial, stage):
        model.load_full_state_dict(full)
    ref_opt, opt = gpt3d.adamw(serial.parameters()), gpt3d.adamw(stage.parameters())
    lesson, machine = 0.0, None
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        idx, targets = torch.randint(cfg.vocab_size, (2, dp * m * 2, 8), generator=gen)
        unequal_counts(targets, dp * m)
        ref_opt.zero_grad()
        ref_loss = serial(idx, targets)[1]
        ref_loss.backward()
        ref_opt.step()
        before = stage.full_state_dict()  # for the machine: this step's weights
        loss = gpt3d.ptd_p_step(stage, opt, idx, targets, groups, m)
        got = loss, stage.full_grads(), stage.full_state_dict()
        diffs = [max_rel_diff(g, serial.get_parameter(n).grad) for n, g in got[1].items()]
        diffs += [max_rel_diff(w, serial.get_parameter(n).detach()) for n, w in got[2].items()]
        lesson = max([lesson, *diffs] + ([max_rel_diff(loss, ref_loss.detach())] if loss is not None else []))
        if step == 0:
            tc = gpt3d.TrainConfig(tp=tp, pp=pp, dp=dp, timeout_s=20)
            machine = gpt3d.prove_machine(env, cfg, tc, groups, (idx, targets, before), got)
    return lesson, machine


def _counts(dp):
    targets = unequal_counts(torch.zeros(dp * gpt3d.CHECK_M * 2, 8, dtype=torch.long), dp * gpt3d.CHECK_M)
    return [[int((t != -100).sum()) for t in r.chunk(gpt3d.CHECK_M)] for r in targets.chunk(dp)]


def test_the_batch_counts_unequally_over_replicas_and_microbatches_with_an_empty_one():
    assert _counts(2) == [[0, 16, 16], [16, 16, 12]]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "tp{}-pp{}-dp{}".format(*x))
def test_the_lesson_equals_serial_over_adamw_steps_and_the_machine_equals_the_lesson(run_ranks, layout):
    tp, pp, dp = layout
    for r, (lesson, machine) in enumerate(run_ranks(_lesson_steps, tp * pp * dp, layout, 3)):
        assert lesson <= 1e-10, f"ptd_p_step at tp={tp} pp={pp} dp={dp}, rank {r}: {lesson:.2e} from serial"
        assert machine <= 1e-12, f"train_step at tp={tp} pp={pp} dp={dp}, rank {r}: {machine:.2e} from the lesson"


@pytest.mark.parametrize("plant,layout", [("replicas 1/dp", (1, 1, 2)), ("no tied sum", (1, 2, 1))])
def test_a_planted_mistake_fails_against_serial(run_ranks, plant, layout):
    """The replicas' own means averaged (they count 32 and 44 targets), or the tied embedding's two copies
    not summed: the lesson is far from serial, not 1e-10."""
    out = run_ranks(_lesson_steps, layout[0] * layout[1] * layout[2], layout, 1, plant)
    assert max(lesson for lesson, _ in out) > 1e-3, plant


def _demo(env, plant=None):
    _plant(plant)
    return gpt3d.demo(env, gpt3d.TrainConfig(tp=2, pp=2, dp=2, timeout_s=20), lambda *a: None)


def test_the_main_jobs_check_passes_at_the_default_layout_and_fails_on_every_rank_with_a_planted_mistake(run_ranks):
    assert run_ranks(_demo, 8) == [True] * 8
    assert run_ranks(_demo, 8, "replicas 1/dp") == [False] * 8
