"""06_zero_bubble: the backward split, the zero-bubble schedules as data, and both run and trained.

Tolerances, and why:
  - The split on one process: exact (torch.equal). I computes dX = dY W and the bias's sum of dY,
    W computes dW = dY^T X, each with the same operation on the same operands as autograd's B.
  - Pipelines against the serial model: float64, max|a - b| / max|b| <= 1e-10, as in
    test_pipeline.py: a pipeline adds the microbatches' gradients in another order (~1e-15); a
    lost or doubled W is a whole microbatch's gradient (O(1/m)).
  - 06's trainer against 05's, float32 at tp = pp = dp = 2: relative 1e-5 on every loss. Both add
    the same terms; only where they are added may differ (each microbatch's W of a chunk runs in
    the same order as 05's B, so here the losses are in fact equal bit for bit): a float32
    rounding is 6e-8, and 4 steps of AdamW amplify it by at most a few hundred. A missed W is a
    gradient off by 1/m, a loss off at the third digit by step 2.
  - Simulated figures: exact Fractions.
"""
import contextlib
import dataclasses
import functools
import os
from collections import Counter
from dataclasses import replace
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import PIPELINE_CFG, TOL, TRAINER_BASE, TRAINER_CFG, load, pipeline_batch, run_script, script_output

tensor_parallel, pipeline, gpt3d = load("01_tensor_parallel"), load("02_pipeline_1f1b"), load("05_3d_gpt")
zb = load("06_zero_bubble")
Action = pipeline.Action


def lists(name, pp, m):
    return zb.pipeline_schedule(name, pp, m).lists


# ----------------------------------------------------------------------------------------------
# The lists are torch's, action for action


def torch_order(cls, pp, m, chunks_per_rank):
    """pipeline_order of one of torch's schedules, as {rank: [(stage, kind, microbatch)]}: built
    from stand-in stages (the attributes its constructor reads), never run."""
    stages = [SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * chunks_per_rank, submod=None,
                              stage_index_to_group_rank=None) for _ in range(chunks_per_rank)]
    order = cls(stages, m).pipeline_order
    return {r: [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in acts if a is not None]
            for r, acts in order.items()}


@pytest.mark.parametrize("name,torch_name,chunks_per_rank", [("zb-h1", "ScheduleInterleavedZeroBubble", 1),
                                                             ("zb-v", "ScheduleZBVZeroBubble", 2)])
def test_each_rank_runs_torchs_zero_bubble_list_action_for_action(name, torch_name, chunks_per_rank):
    from torch.distributed.pipelining import schedules
    compared = 0
    for pp in range(1, 7):
        for m in range(pp, 4 * pp + 1):
            try:
                want = torch_order(getattr(schedules, torch_name), pp, m, chunks_per_rank)
            except ValueError:  # torch refuses m not a multiple of its rounds (m // pp) at one stage per rank
                assert name == "zb-h1" and m % (m // pp), (pp, m)
                continue
            pipe = zb.pipeline_schedule(name, pp, m)
            got = {r: [(pipe.placement(pp, a.chunk, r), a.kind, a.mb) for a in acts] for r, acts in enumerate(pipe.lists)}
            assert got == want, (name, pp, m)
            compared += 1
    assert compared == {"zb-h1": 48, "zb-v": 69}[name]  # of the 69 (pp, m), every one torch accepts


def test_zb_h1_is_1f1b_with_b_split_and_w_deferred_by_the_rank():
    for pp in range(1, 9):
        for m in range(1, 25):
            for r, acts in enumerate(lists("zb-h1", pp, m)):
                assert [Action("B" if a.kind == "I" else a.kind, a.mb) for a in acts if a.kind != "W"] == \
                    pipeline.one_f_one_b(pp, m, r)
                at = {a: i for i, a in enumerate(acts)}
                for i in range(r, m):  # W of i - r right after I of i
                    assert at[Action("W", i - r)] == at[Action("I", i)] + 1


def test_the_v_places_chunk_0_of_rank_r_on_stage_r_and_chunk_1_on_2pp_minus_1_minus_r():
    assert [zb.v_shape(4, c, r) for c in range(2) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert zb.pipeline_schedule("zb-v", 4, 8).where[7] == (0, 1)  # the last stage beside the first
    chunks = pipeline.build_chunks(PIPELINE_CFG, 2, 0, 2, placement=zb.v_shape, device="meta")
    assert [list(c.transformer.h) for c in chunks] == [["0"], ["3"]]
    assert chunks[0].pre_process and chunks[1].post_process


# ----------------------------------------------------------------------------------------------
# 02's validator and lowering


# CI validates pp 1 to 4 (odd and even pp; m below pp, between pp and 2 pp, and past it) and pp 8, the largest
# and slowest; pp 5 to 7 (the same cases again, 40% of the sweep's time) under --full-grid.
@pytest.mark.grid(keep=["pp1", "pp2", "pp3", "pp4", "pp8"])
@pytest.mark.parametrize("pp", range(1, 9), ids=[f"pp{pp}" for pp in range(1, 9)])
def test_both_schedules_validate_for_every_pp_up_to_8_and_m_up_to_24(pp):
    for m in range(1, 25):
        for name in ("zb-h1", "zb-v"):
            pipe = zb.pipeline_schedule(name, pp, m)
            pipeline.validate(pipe, m)
            pipeline.check_plans(pipe.forward_only())  # 05's forward-only eval lists


def test_zb_v_needs_its_receives_in_lockstep_with_their_senders():
    pipe = zb.pipeline_schedule("zb-v", 2, 4)
    # chunk 0's activations and chunk 1's gradients both go from rank 0 to rank 1: in the order
    # rank 1 needs them they do not match the order rank 0 sends them
    with pytest.raises(pipeline.ScheduleError, match="rank 0 -> rank 1: message 2 is"):
        pipeline.validate(replace(pipe, lockstep=False), 4)
    pipeline.validate(pipe, 4)


def test_a_w_before_its_i_and_a_missing_w_are_refused():
    with pytest.raises(pipeline.ScheduleError, match="rank 0 runs W0 before I0"):
        pipeline.validate(zb.ZeroBubbleSchedule([[Action("F", 0), Action("W", 0), Action("I", 0)]]), 1)
    with pytest.raises(pipeline.ScheduleError, match="rank 0 never runs W0"):
        pipeline.validate(zb.ZeroBubbleSchedule([[Action("F", 0), Action("I", 0)]]), 1)


# ----------------------------------------------------------------------------------------------
# The simulator: the paper's formulas, exactly


def simulate(name, pp, m, t_f, t_i, t_w):
    return pipeline.simulate(zb.pipeline_schedule(name, pp, m), t_f, t_i + t_w, times={"I": t_i, "W": t_w})


def peak_memory(name, pp, m, w_share):
    return [zb.peak_memory(acts, w_share) for acts in lists(name, pp, m)]


TIMES = [(1, 1, 1), (2, 3, 1), (3, 2, 2), (Fraction(1, 3), Fraction(5, 7), Fraction(2, 7))]  # t_W <= t_F, t_I


@pytest.mark.parametrize("t_f,t_i,t_w", TIMES)
def test_zb_h1_idles_pp_minus_1_times_tf_plus_ti_minus_tw_per_rank_against_1f1bs_tf_plus_ti_plus_tw(t_f, t_i, t_w):
    for pp in range(1, 9):
        for m in range(pp, 25):
            assert simulate("zb-h1", pp, m, t_f, t_i, t_w).idle == [(pp - 1) * (t_f + t_i - t_w)] * pp, (pp, m)
            assert simulate("1f1b", pp, m, t_f, t_i, t_w).idle == [(pp - 1) * (t_f + t_i + t_w)] * pp, (pp, m)


def test_at_equal_times_zb_h1s_bubble_is_a_third_of_1f1bs():
    for pp in range(2, 9):
        for m in range(pp, 25):
            h1, ofob = simulate("zb-h1", pp, m, 1, 1, 1), simulate("1f1b", pp, m, 1, 1, 1)
            assert h1.bubble == ofob.bubble / 3 == Fraction(pp - 1, 3 * m)


def test_the_zb_h1_formula_holds_only_while_w_fits_beside_f_and_i():
    # The paper's formula assumes t_W <= t_F and t_W <= t_I; a longer W idles more than it says.
    for t_f, t_i, t_w in [(1, 2, 2), (2, 1, 2)]:
        assert simulate("zb-h1", 4, 8, t_f, t_i, t_w).idle[0] > 3 * (t_f + t_i - t_w)


@pytest.mark.parametrize("w_share", [0, Fraction(1, 3), 1])
def test_zb_h1_peaks_at_pp_minus_r_m_b_plus_r_m_w_on_rank_r_at_most_pp_m_b(w_share):
    for pp in range(1, 9):
        for m in range(pp, 25):
            peak = peak_memory("zb-h1", pp, m, w_share)
            assert peak == [(pp - r) + r * w_share for r in range(pp)] and max(peak) == pp, (pp, m)


@pytest.mark.parametrize("w_share", [0, Fraction(1, 3), 1])
def test_zb_v_at_equal_chunk_times_idles_nowhere_inside_a_ranks_span_and_holds_2pp_chunks(w_share):
    t = Fraction(1, 2)  # a chunk is half a stage
    for pp in range(1, 9):
        for m in range(2 * pp - 1, 25):
            sim = simulate("zb-v", pp, m, t, t, t)
            assert sim.span_idle == [0] * pp and peak_memory("zb-v", pp, m, w_share) == [2 * pp] * pp, (pp, m)
        for m in range(1, 2 * pp - 1):  # torch builds for 2pp - 1 and drops the microbatches beyond m:
            assert max(simulate("zb-v", pp, m, t, t, t).span_idle) == 2 * (2 * pp - 1 - m) * t  # the V never fills


# ----------------------------------------------------------------------------------------------
# The backward split


def test_w_computes_exactly_what_bs_weight_part_computed_and_each_hook_fires_once_at_its_pass():
    cfg = replace(PIPELINE_CFG, n_layer=2)
    full = tensor_parallel.init_state_dict(cfg, 5, dtype=torch.float64, random_all=True)
    idx, targets = pipeline_batch(1)
    serial, model = (tensor_parallel.GPT(cfg, init=False, dtype=torch.float64) for _ in range(2))
    for m in (serial, model):
        m.load_full_state_dict(full)
    serial(idx, targets)[1].backward()
    split = zb.BackwardSplit([model])
    fired = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.append((n, p.grad is not None)))
    loss = model(idx, targets)[1]
    with split.input("mb"):
        loss.backward()
    deferred = {n for n, p in model.named_parameters() if n.endswith(("c_attn.weight", "c_fc.weight", "c_proj.weight"))}
    assert {n for n, _ in fired} == set(dict(model.named_parameters())) - deferred and len(fired) + len(deferred) == \
        len(list(model.parameters()))  # LayerNorms, biases and the (tied) embedding at I, once each
    assert all(p.grad is None for n, p in model.named_parameters() if n in deferred)
    assert split.held("mb") and sum(split.held("mb").values()) > 0
    fired.clear()
    split.weight("mb")
    assert sorted(n for n, _ in fired) == sorted(deferred) and all(has for _, has in fired)
    ref = dict(serial.named_parameters())
    assert all(torch.equal(p.grad, ref[n].grad) for n, p in model.named_parameters())


def test_a_backward_outside_an_i_is_refused():
    model = tensor_parallel.GPT(replace(PIPELINE_CFG, n_layer=1), dtype=torch.float64)
    zb.BackwardSplit([model])
    with pytest.raises(RuntimeError, match="outside an I action"):
        model(*pipeline_batch(1))[1].backward()


def _activation_peaks(env, orders):
    """Peak activation bytes of each order on one rank, and what W of one microbatch keeps."""
    chunks = pipeline.build_chunks(PIPELINE_CFG, 1, 0, init=False, dtype=torch.float64)
    chunks[0].load_full_state_dict(tensor_parallel.init_state_dict(PIPELINE_CFG, 5, dtype=torch.float64))
    split, out = zb.BackwardSplit(chunks), []
    for order in orders:
        pipe = zb.ZeroBubbleSchedule([[Action(order[i], int(order[i + 1])) for i in range(0, len(order), 2)]], split=split)
        out.append(pipeline.execute(pipe, chunks, dist.group.WORLD, pipeline.split_batch(*pipeline_batch(3), 3),
                                    pipeline.Wire((2, 16, 16))).peak_activation_bytes)
    return out, sum(split.held((0, 0)).values())  # the last order left microbatch 0's W unrun


def test_the_activation_meter_counts_what_w_still_needs_from_i_to_w(run_ranks):
    (right_after, deferred, _), m_w = run_ranks(_activation_peaks, 1, ["F0I0W0F1I1W1F2I2W2", "F0I0F1I1F2I2W0W1W2",
                                                                       "F0I0"])[0]
    assert m_w > 0 and deferred == right_after + 2 * m_w  # two microbatches' X and dY beside the third's activations


# ----------------------------------------------------------------------------------------------
# The executor against the serial model, 10 AdamW steps


def _train(env, name, m, steps, background):
    pp, cfg = env.world_size, replace(PIPELINE_CFG, n_layer=2 * max(env.world_size, 2))
    pipe = zb.pipeline_schedule(name, pp, m)
    embed_group = dist.new_group([0, pp - 1]) if pipe.where[pipe.S - 1][0] else None  # ZB-V: both copies on rank 0
    full = tensor_parallel.init_state_dict(cfg, 5, dtype=torch.float64, random_all=True)
    serial = tensor_parallel.GPT(cfg, init=False, dtype=torch.float64)
    serial.load_full_state_dict(full)
    chunks = pipeline.build_chunks(cfg, pp, env.rank, pipe.v, placement=pipe.placement, init=False, dtype=torch.float64)
    for c in chunks:
        c.load_full_state_dict(full)
    pipe.prepare(chunks)
    fired, empty = Counter(), []

    def hook(name, p):
        fired[name] += 1
        empty.append(p.grad is None)

    for i, c in enumerate(chunks):  # ZB-V: both of rank 0's chunks hold a wte
        for n, p in c.named_parameters():
            p.register_post_accumulate_grad_hook(functools.partial(hook, (i, n)))
    params = [p for c in chunks for p in c.parameters()]
    opt, ref_opt = (torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1) for ps in (params, serial.parameters()))
    worst, counts = 0.0, set()
    for step in range(steps):
        idx, targets = pipeline_batch(m, seed=step)
        ref_loss = serial(idx, targets)[1]
        ref_loss.backward()
        res = pipeline.execute(pipe, chunks, dist.group.WORLD, pipeline.split_batch(idx, targets, m),
                               pipeline.Wire((2, 16, cfg.n_embd)), exchange=pipeline.BackgroundSends() if background else None)
        pipeline.sync_tied_embeddings(chunks, embed_group)
        counts |= set(fired.values())
        fired.clear()
        ref = dict(serial.named_parameters())
        worst = max([worst] + [tensor_parallel.max_rel_diff(p.grad, ref[n].grad) for c in chunks
                               for n, p in c.named_parameters()]
                    + ([tensor_parallel.max_rel_diff(res.loss, ref_loss.detach())] if res.loss is not None else []))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        worst = max([worst] + [tensor_parallel.max_rel_diff(p.detach(), ref[n].detach()) for c in chunks
                               for n, p in c.named_parameters()])
    return worst, counts, any(empty)


@pytest.mark.parametrize("pp,m,background", [(2, 3, True), (4, 6, False)])
@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_zero_bubble_equals_serial_over_10_adamw_steps_each_hook_firing_once_per_microbatch(run_ranks, name, pp, m,
                                                                                             background):
    for worst, counts, empty in run_ranks(_train, pp, name, m, 10, background):
        assert worst <= TOL
        assert counts == {m} and not empty  # every parameter's hook: m times a step, never without a gradient


# ----------------------------------------------------------------------------------------------
# The trainer: 05's loop, 05's checkpoints


def _trainers(env, tc):
    out = [gpt3d.train(env, TRAINER_CFG, tc, quiet=True)["losses"]]
    for name in ("zb-h1", "zb-v"):
        out.append(zb.train(env, TRAINER_CFG, zb.TrainConfig(**{**dataclasses.asdict(tc), "schedule": name}),
                            quiet=True)["losses"])
    return out


def test_the_trainer_at_tp_pp_dp_2_has_05s_losses_on_the_same_seed(run_ranks):
    tc = replace(TRAINER_BASE, tp=2, pp=2, dp=2, steps=4, dtype="float32")
    ref, h1, v = run_ranks(_trainers, 8, tc)[0]
    assert ref[-1] < ref[0]
    for losses in (h1, v):
        assert tensor_parallel.max_rel_diff(torch.tensor(losses), torch.tensor(ref)) <= 1e-5


def _resumed(env, root):
    zv = lambda **kw: zb.TrainConfig(**{**dataclasses.asdict(replace(TRAINER_BASE, pp=2, **kw)), "schedule": "zb-v"})  # noqa: E731
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        ref = gpt3d.train(env, TRAINER_CFG, replace(TRAINER_BASE, pp=2, steps=4, save=f"{root}/05", save_every=2),
                          quiet=True)["losses"]
        from_05 = zb.train(env, TRAINER_CFG, zv(steps=4, resume=f"{root}/05/step_00000002"), quiet=True)["losses"]
        zb.train(env, TRAINER_CFG, zv(steps=2, save=f"{root}/06"), quiet=True)
        from_06 = gpt3d.train(env, TRAINER_CFG, replace(TRAINER_BASE, pp=2, steps=4, resume=f"{root}/06"),
                              quiet=True)["losses"]
    return ref, from_05, from_06


def test_06_resumes_05s_checkpoints_and_05_resumes_06s(run_ranks, tmp_path):
    ref, from_05, from_06 = run_ranks(_resumed, 2, str(tmp_path))[0]
    for resumed in (from_05, from_06):  # steps 2 and 3, float64
        assert tensor_parallel.max_rel_diff(torch.tensor(resumed), torch.tensor(ref[2:])) <= TOL


# ----------------------------------------------------------------------------------------------
# Bad input, and the demo


BAD = {
    "zb-v with an odd split": (["--train", "--schedule", "zb-v", "--pp", "2", "--n-layer", "6"],
                               "--schedule zb-v runs two chunks per rank in a V: --n-layer 6 is not divisible by its "
                               "2 x pp = 4 stages"),
    "zb with virtual stages": (["--train", "--schedule", "zb-h1", "--virtual-stages", "2"],
                               "--virtual-stages 2: --schedule zb-h1 places its own chunks"),
    "zb with fused kernels": (["--train", "--fused-kernels"], "--fused-kernels: --schedule zb-v splits each linear"),
    "an unknown schedule": (["--train", "--schedule", "zb-h2"], "--schedule: invalid choice: 'zb-h2'"),
    "a demo pp the V cannot split": (["--pp", "8"], "--n-layer 8: ZB-V cuts the model into 2 x pp = 16 stages"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_refused_by_name_before_anything_starts(case):
    args, message = BAD[case]
    proc = run_script("06_zero_bubble.py", *args, timeout=30)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_the_demo_passes_and_prints_every_figure_beside_its_formula():
    # The demo as a reader runs it (pp 4, m 8), the run test_docs checks the guide's excerpt against: made once.
    proc = script_output("06_zero_bubble.py", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 8 simulated figures beside their formulas, and the measured M_W: r x M_W more than 1F1B on rank r
    assert proc.stdout.count("(equal)") == 9 and "(DIFFERENT)" not in proc.stdout
    # the lesson's line and the three schedules' against serial, and V-Half's, V-Min's and DualPipeV's
    # (tests/test_vschedules.py); the machine's ZB-H1 against the lesson
    assert proc.stdout.count("PASS (tolerance 1e-10)") == 7 and proc.stdout.count("PASS (tolerance 1e-12)") == 1
    assert "FAIL" not in proc.stdout and proc.stdout.rstrip().endswith("PASS")
    # V-Half and V-Min beside the authors' closed forms, (p+2)//2 and (p+4)//3 microbatches (tests/test_vschedules.py)
    for form in ("3 = 0.750 of 1F1B's 4; the lifespan arithmetic 3 = 0.750, the same; within 10% of 1/2 (pp <= 40): "
                 "first at pp 11, every pp from 19", "2 = 0.500 of 1F1B's 4; the lifespan arithmetic 2 = 0.500, the same; "
                 "within 10% of 1/3 (pp <= 40): first at pp 22, every pp from 28"):
        assert f"the authors' form (microbatches of a stage): {form}" in proc.stdout, form


# ----------------------------------------------------------------------------------------------
# benchmarks/bench_zero_bubble.py's V schedules and DualPipeV against torch's, smoke-sized (no numpy needed:
# torch's stages are given their shapes)

BENCH_SMOKE = ["--n-layer", "4", "--n-embd", "16", "--n-head", "2", "--vocab-size", "32", "--seq-len", "8",
               "--block-size", "8", "--microbatches", "4", "--microbatch-size", "1", "--repeats", "1", "--steps", "1", "--no-fed"]


def test_the_bench_times_the_v_schedules_and_dualpipev_against_torchs_after_the_float64_check():
    proc = run_script("benchmarks/bench_zero_bubble.py", "--schedules", "v-half", "v-min", "dualpipev", *BENCH_SMOKE,
                      timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "ScheduleDualPipeV relative to ours" in out and out.count("all within tolerance") == 2
    assert "all within tolerance (loss 1e-10, grad 1e-10)" in out  # the float64 check, before any timing
    for pair in ("ours v-half/ours 1f1b", "ours v-min/ours 1f1b", "ours dualpipev/ours 1f1b",
                 "ours dualpipev/torch dualpipev"):
        assert f"{pair}: " in out and "of the medians; paired" in out.split(f"{pair}: ")[1].splitlines()[0], pair
    assert "    torch dualpipev: " in out  # the per-iteration times
    for side in ("ours 1f1b", "ours v-half", "ours v-min", "ours dualpipev", "torch dualpipev"):  # 2 ranks' peaks
        line = next(x for x in out.splitlines() if x.startswith(f"  {side} ") and "of ours 1F1B's peak" in x)
        peaks = [int(x) for x in line.split("[")[1].split("]")[0].split(",")]
        assert len(peaks) == 2 and min(peaks) > 0, line


def _bench_64_with_a_doubled_microbatch(env, args):
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bench_zero_bubble as bench
    split = bench.pipeline.split_batch
    bench.pipeline.split_batch = lambda idx, targets, m: [(lambda mbs: [mbs[0], *mbs[:-1]])(split(idx, targets, m))][0]
    try:  # ours sees microbatch 0 twice and not the last: the check must see it (O(1/m))
        cfg = bench.tensor_parallel.GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.0)
        return bench.check_64(env, cfg, args, dist.new_group([0, 1]))
    finally:
        bench.pipeline.split_batch = split


@pytest.mark.full_grid(covered_by=["test_the_bench_times_the_v_schedules_and_dualpipev_against_torchs_after_the_float64_check"],
                       why="5 s (its ranks import torch's pipelining): the check it plants a mistake in runs in the smoke test")
def test_the_benchs_float64_check_sees_a_wrong_microbatch(run_ranks):
    args = SimpleNamespace(microbatches=4, microbatch_size=2, seq_len=16, seed=1234)
    for rank in run_ranks(_bench_64_with_a_doubled_microbatch, 2, args):
        assert rank["grad"] > 1e-3, rank
