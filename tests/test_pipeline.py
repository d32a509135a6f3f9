"""02_pipeline_1f1b: schedules are data, and running them equals the serial model.

Tolerance: float64, max|a - b| / max|b| <= 1e-10. A pipeline only changes where each layer runs
and adds the microbatch gradients in another order (a few ulps, ~1e-15); a wrong loss scale is a
factor of m, a missed tied-embedding sync a whole missing gradient term. Background sends change
only when a rank waits, never a value: the same tolerance holds with them on and off, and a send
whose buffer were freed or reused before it completed would deliver garbage (O(1), or NaN).
"""
import functools
import json
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from conftest import exchange, PIPELINE_CFG, TOL, load, pipeline_batch, pipeline_train, run_script
from plumbing.charts import pipeline_timeline
from plumbing.trace import write_timelines

tensor_parallel = load("01_tensor_parallel")
pipeline = load("02_pipeline_1f1b")
F, B = (lambda i: pipeline.Action("F", i)), (lambda i: pipeline.Action("B", i))
CFG = PIPELINE_CFG


def lists(name, pp, m):
    return pipeline.Schedule([pipeline.SCHEDULES[name](pp, m, s) for s in range(pp)])


# ----------------------------------------------------------------------------------------------
# Schedules, validator, simulator: no communication at all.


def test_the_validator_accepts_gpipe_and_1f1b_for_every_pp_up_to_8_and_m_up_to_32():
    for name in pipeline.SCHEDULES:
        for pp in range(1, 9):
            for m in range(1, 33):
                pipeline.validate(lists(name, pp, m), m)


BROKEN = {
    "a missing microbatch": ([[F(0), B(0)], [F(0), F(1), B(0), B(1)]], "rank 0 never runs F1"),
    "a microbatch run twice": ([[F(0), F(1), B(0), B(1), B(1)], [F(0), F(1), B(0), B(1)]], "more often"),
    "a backward before its forward": ([[F(0), B(1), F(1), B(0)], [F(0), F(1), B(0), B(1)]],
                                      "runs B1 before its forward"),
    "messages in another order than they are received": (
        [[F(0), F(1), B(0), B(1)], [F(1), F(0), B(0), B(1)]], "message 0 is ('act', 1, 0) when sent"),
    "a deadlocking order": ([[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]], "deadlock"),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_the_validator_rejects_hand_broken_lists(case):
    schedule, message = BROKEN[case]
    with pytest.raises(pipeline.ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipeline.validate(pipeline.Schedule(schedule), 2)


def test_1f1b_warms_up_with_pp_minus_stage_minus_one_forwards():
    for pp in range(1, 9):
        for m in range(1, 17):
            for s, acts in enumerate(lists("1f1b", pp, m).lists):
                first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
                assert first_b == min(pp - s - 1, m) + (1 if pp - s - 1 < m else 0)
                assert acts[:first_b] == [F(i) for i in range(first_b)]


@pytest.mark.parametrize("t_f,t_b", [(1, 1), (1, 2), (2, 3), (Fraction(1, 3), Fraction(5, 7))])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_the_simulated_bubble_is_exactly_pp_minus_1_over_m_for_uniform_times(name, t_f, t_b):
    for pp in range(1, 9):
        for m in range(1, 33):
            sim = pipeline.simulate(lists(name, pp, m), t_f, t_b)
            assert sim.bubble == Fraction(pp - 1, m), (pp, m)
            assert sim.step_time == (m + pp - 1) * (t_f + t_b)


def test_1f1b_keeps_at_most_pp_minus_stage_microbatches_in_flight_and_gpipe_keeps_m():
    for pp in range(1, 9):
        for m in range(1, 33):
            assert pipeline.simulate(lists("1f1b", pp, m)).peak_in_flight == [min(pp - s, m) for s in range(pp)]
            assert pipeline.simulate(lists("gpipe", pp, m)).peak_in_flight == [m] * pp


def test_communication_time_adds_to_the_step_but_not_to_the_busy_time():
    sim = pipeline.simulate(lists("1f1b", 4, 8), 1, 2, t_comm=1)
    assert sim.step_time > (8 + 3) * 3
    assert all(sim.step_time - idle == 8 * 3 for idle in sim.idle)


def test_timelines_draw_and_trace(tmp_path):
    sim = pipeline.simulate(lists("1f1b", 2, 3))
    text = pipeline_timeline(sim.timeline, width=40)
    assert text.splitlines()[0].startswith("rank 0 |F0") and "B2" in text.splitlines()[1]
    path = tmp_path / "t.json"
    write_timelines(path, {"1f1b": sim.timeline})
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 2 * 2 * 3 and {e["tid"] for e in events} == {0, 1}


# ----------------------------------------------------------------------------------------------
# The executor against the serial model.


def train_with(env, background_sends, *args):
    """conftest's pipeline_train with execute(exchange=...): patched in this rank's own
    (forked) process, so nothing outside the test sees it."""
    pipeline.execute = functools.partial(pipeline.execute, exchange=exchange(background_sends))
    return pipeline_train(env, *args)


@pytest.mark.grid(keep=['4-9-waited-sends', '4-4-background-sends', '2-5-waited-sends', '4-1-waited-sends', '1-1-background-sends'])
@pytest.mark.parametrize("background_sends", [True, False], ids=["background-sends", "waited-sends"])
@pytest.mark.parametrize("pp,m", [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (4, 1), (4, 4), (4, 9)])
def test_pipeline_equals_serial_over_10_adamw_steps_with_tied_embeddings(run_ranks, pp, m, background_sends):
    steps = 10
    for name in ("gpipe", "1f1b"):
        results = run_ranks(train_with, pp, background_sends, pipeline.SCHEDULES[name], m, steps)
        for r, (diffs, orders) in enumerate(results):
            bad = {k: v for k, v in diffs.items() if not v <= TOL and "messages" not in k}
            assert not bad, (name, r, bad)
            assert all(orders), "the executor ran another order than the schedule's list"
        assert sum("loss" in k for k in results[-1][0]) == steps  # the last stage checked the loss
        n_params = sum(len([k for k in d if k.startswith("step 0 grad")]) for d, _ in results)
        assert n_params == len(tensor_parallel.init_state_dict(CFG, 0)) + (pp > 1)  # wte on first and last


def _send_waits(env, name, m, background_sends):
    """This rank's log of one step: ("post", b) when boundary b posts its batch, ("run",) when a
    forward or backward starts, ("wait", side, b) when a send or recv of boundary b is waited for;
    and whether every sent tensor still had its storage when its send was waited for (Megatron's
    deallocation of a sent output must come after that wait)."""
    log, intact, posted = [], [], [0]
    real_batch, real_backward = dist.batch_isend_irecv, torch.autograd.backward

    class Logged:  # one op's work, logging its wait
        def __init__(self, work, op, b):
            self.work, self.op, self.b = work, op, b

        def wait(self):
            self.work.wait()
            sending = self.op.op is dist.isend
            intact.extend([self.op.tensor.untyped_storage().nbytes() > 0] if sending else [])
            log.append(("wait", "send" if sending else "recv", self.b))

    def batch(ops):
        b = posted[0]
        posted[0] += 1
        log.append(("post", b))
        return [Logged(w, op, b) for w, op in zip(real_batch(ops), ops)]

    def backward(*args, **kwargs):
        log.append(("run",))
        return real_backward(*args, **kwargs)

    # Patched in this forked rank only; the executor looks both up when it calls them.
    dist.batch_isend_irecv, torch.autograd.backward = batch, backward
    chunks = pipeline.build_chunks(CFG, env.world_size, env.rank, init=False, dtype=torch.float64)
    for c in chunks:
        c.load_full_state_dict(tensor_parallel.init_state_dict(CFG, 5, dtype=torch.float64))
        c.register_forward_pre_hook(lambda module, args: log.append(("run",)))
    idx, targets = pipeline_batch(m)
    pipeline.execute(lists(name, env.world_size, m), chunks, dist.group.WORLD, pipeline.split_batch(idx, targets, m),
                     pipeline.Wire((2, 16, CFG.n_embd)), exchange=exchange(background_sends))
    return log, intact


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_background_sends_are_waited_for_one_boundary_later_and_receives_before_the_next_action(
        run_ranks, name):
    pp, m = 2, 4
    for background in (True, False):
        for r, (log, intact) in enumerate(run_ranks(_send_waits, pp, name, m, background)):
            assert intact and all(intact), "a sent output was deallocated before its send completed"
            post = {e[1]: i for i, e in enumerate(log) if e[0] == "post"}
            first_run_after = {b: next((j for j in range(i, len(log)) if log[j] == ("run",)), len(log))
                               for b, i in post.items()}
            for i, (kind, *rest) in enumerate(log):
                if kind != "wait":
                    continue
                side, b = rest
                if side == "recv" or not background:  # its data is needed (or the switch is off)
                    assert post[b] < i < first_run_after[b], (r, background, side, b, log)
                else:  # in the background while the next actions run, retired at the next boundary
                    # (or, those of the step's last boundary, at its end)
                    assert first_run_after[b] < i < post.get(b + 2, len(log)) or first_run_after[b] == len(log)
            overlapped = sum(first_run_after[e[2]] < i for i, e in enumerate(log) if e[:2] == ("wait", "send"))
            assert overlapped >= (m - 1 if background else 0), log  # every send but perhaps the last one


def _memory(env, name, m, deallocate, background_sends):
    chunks = pipeline.build_chunks(CFG, env.world_size, env.rank, init=False, dtype=torch.float64)
    for c in chunks:
        c.load_full_state_dict(tensor_parallel.init_state_dict(CFG, 5, dtype=torch.float64))
    idx, targets = pipeline_batch(m)
    res = pipeline.execute(lists(name, env.world_size, m), chunks, torch.distributed.group.WORLD,
                           pipeline.split_batch(idx, targets, m), pipeline.Wire((2, 16, CFG.n_embd)),
                           deallocate=deallocate, exchange=exchange(background_sends))
    return res.peak_activation_bytes


def test_counted_activation_bytes_follow_the_microbatches_in_flight(run_ranks):
    pp, m, peaks = 4, 6, {}
    for background in (False, True):
        one = run_ranks(_memory, pp, "1f1b", 1, True, background)  # one microbatch in flight: the unit
        gpipe = run_ranks(_memory, pp, "gpipe", m, True, background)
        ofob = run_ranks(_memory, pp, "1f1b", m, True, background)
        kept = run_ranks(_memory, pp, "1f1b", m, False, background)
        peaks[background] = one, gpipe, ofob
        for s in range(pp):
            assert gpipe[s] == m * one[s]
            assert ofob[s] == min(pp - s, m) * one[s]
            if s < pp - 1:  # deallocation frees a (B/m, T, C) float64 output per microbatch in flight
                out, n = 2 * 16 * CFG.n_embd * 8, min(pp - s, m)
                # ... except the newest, still waiting to be sent at the peak, and with background
                # sends the one before it too, whose send is retired (and counted) a boundary later
                assert (kept[s] - ofob[s]) in ((n - background) * out, (n - 1 - background) * out)
                assert kept[s] > ofob[s] or background
        assert kept[-1] == ofob[-1]  # the last stage sends no activations
    # Outputs whose sends are in flight are not counted, as outputs waiting to be sent never were:
    # the peaks with deallocation are the same with background sends as without.
    assert peaks[True] == peaks[False]


# ----------------------------------------------------------------------------------------------
# Bad input: refused on every rank before any communication.


def _bad(env, case):
    try:
        cfg = tensor_parallel.GPTConfig(**{**CFG.__dict__, **case.get("cfg", {})})
        pp = case.get("pp", env.world_size)
        pipeline.check_world(pp, env.world_size)
        pipeline.build_chunks(cfg, pp, env.rank)
        pipeline.split_batch(*pipeline_batch(2), case.get("m", 2))
    except ValueError as e:
        return str(e)
    return "no error"


BAD = {
    "m < 1": (dict(m=0), "m=0 must be at least 1"),
    "batch not divisible by m": (dict(m=3), "global batch of 4 sequences is not divisible by m=3"),
    "pp greater than n_layer": (dict(cfg=dict(n_layer=1)), "n_layer=1 is not divisible by 2 pipeline stages"),
    "uneven split": (dict(cfg=dict(n_layer=3)), "n_layer=3 is not divisible by 2 pipeline stages"),
    "world size not matching pp": (dict(pp=4), "world size 2 does not match pp=4"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_pipeline_input_is_refused_on_every_rank(run_ranks, case):
    kwargs, message = BAD[case]
    assert all(message in e for e in run_ranks(_bad, 2, kwargs))


@pytest.mark.parametrize("args", [["--pp", "2", "--microbatches", "3"]], ids=["pp2-m3"])
def test_the_demo_passes_prints_the_timeline_and_the_exact_bubble(args, tmp_path):
    trace = tmp_path / "pipeline.json"
    proc = run_script("02_pipeline_1f1b.py", *args, "--trace", str(trace), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each schedule: the lesson against serial, the machine against serial and against the lesson
    assert proc.stdout.count("PASS") == 6 and "FAIL" not in proc.stdout and proc.stdout.count("(equal)") == 2
    assert "rank 0 |F0" in proc.stdout
    events = json.loads(trace.read_text())["traceEvents"]  # one file, the name given
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"gpipe", "1f1b"}
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}  # a track per rank
    assert f"Chrome trace of the measured steps (gpipe, 1f1b): {trace}" in proc.stdout


def test_the_demo_exits_nonzero_on_bad_input():
    proc = run_script("02_pipeline_1f1b.py", "--pp", "3")
    assert proc.returncode == 1 and "n_layer=4 is not divisible by 3 pipeline stages" in proc.stderr
