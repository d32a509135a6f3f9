"""03_interleaved: the interleaved schedule is data that 02's machinery runs unchanged.

Tolerance: float64, max|a - b| / max|b| <= 1e-10, for the reason given in test_pipeline.py (with
02's background sends on and off alike: they change when a rank waits, never a value).
"""
import functools
from fractions import Fraction

import pytest

from conftest import exchange, PIPELINE_CFG, TOL, load, pipeline_train, run_script

tensor_parallel = load("01_tensor_parallel")
pipeline = load("02_pipeline_1f1b")
interleaved = load("03_interleaved")


def legal():
    for pp in range(1, 9):
        for v in range(1, 5):
            for m in range(pp, 33, pp):
                yield pp, v, m


def lists(pp, m, v):
    return interleaved.InterleavedSchedule([interleaved.interleaved(pp, m, s, v) for s in range(pp)])


def test_the_validator_accepts_every_interleaved_list_up_to_pp_8_v_4_m_32():
    for pp, v, m in legal():
        pipeline.validate(lists(pp, m, v), m)


@pytest.mark.parametrize("t_f,t_b", [(1, 1), (1, 2), (Fraction(1, 3), Fraction(5, 7))])
def test_the_simulated_bubble_is_exactly_pp_minus_1_over_v_m_for_uniform_chunk_times(t_f, t_b):
    for pp, v, m in legal():
        assert pipeline.simulate(lists(pp, m, v), t_f, t_b).bubble == Fraction(pp - 1, v * m), (pp, v, m)


def test_v_equal_1_is_exactly_02s_1f1b():
    for pp in range(1, 9):
        for m in range(1, 33):
            for s in range(pp):
                got, want = interleaved.interleaved(pp, m, s, 1), pipeline.one_f_one_b(pp, m, s)
                assert got == want and [a.steady for a in got] == [a.steady for a in want]


def test_warmup_is_2_pp_minus_rank_minus_1_plus_v_minus_1_times_pp_capped_at_m_v():
    for pp, v, m in legal():
        if v == 1:
            continue
        for r, acts in enumerate(lists(pp, m, v).lists):
            warmup = next((i for i, a in enumerate(acts) if a.steady), len(acts) // 2)
            assert warmup == min((pp - r - 1) * 2 + (v - 1) * pp, m * v), (pp, v, m, r)
            assert all(a.kind == "F" for a in acts[:warmup])


def test_with_one_round_trip_of_warmup_instead_of_two_the_validator_finds_a_deadlock_at_v_2():
    # 03's comment: microbatch 0's gradient is back 2 (pp - r - 1) steps after rank r's first
    # last-chunk forward, and a steady pair has no boundary between its F and its B.
    def short(pp, m, r, v):  # interleaved() with (pp - r - 1) * 1 in the warm-up
        acts, good = [], interleaved.interleaved(pp, m, r, v)
        warmup = min(pp - r - 1 + (v - 1) * pp, m * v)
        forwards, backwards = [a for a in good if a.kind == "F"], [a for a in good if a.kind == "B"]
        acts = forwards[:warmup]
        for f, b in zip(forwards[warmup:], backwards):
            acts += [pipeline.Action("F", f.mb, f.chunk, steady=True), pipeline.Action("B", b.mb, b.chunk, steady=True)]
        return acts + backwards[m * v - warmup:]

    for pp in (3, 4):
        pipeline.validate(lists(pp, 2 * pp, 2), 2 * pp)
        with pytest.raises(pipeline.ScheduleError, match="deadlock: rank 0 waits to"):
            pipeline.validate(interleaved.InterleavedSchedule([short(pp, 2 * pp, r, 2) for r in range(pp)]), 2 * pp)
    with pytest.raises(pipeline.ScheduleError, match="message 4 is"):  # pp = 2: each waits for another message
        pipeline.validate(interleaved.InterleavedSchedule([short(2, 4, r, 2) for r in range(2)]), 4)


def test_forward_step_k_runs_chunk_k_mod_pp_v_div_pp_on_microbatch_k_div_pp_v_times_pp_plus_k_mod_pp():
    pp, v, m = 4, 3, 8
    for r, acts in enumerate(lists(pp, m, v).lists):
        forwards = [a for a in acts if a.kind == "F"]
        backwards = [a for a in acts if a.kind == "B"]
        for k, a in enumerate(forwards):
            assert (a.chunk, a.mb) == ((k % (pp * v)) // pp, (k // (pp * v)) * pp + k % pp)
        for k, a in enumerate(backwards):  # backwards visit the chunks in reverse
            assert (a.chunk, a.mb) == (v - 1 - (k % (pp * v)) // pp, (k // (pp * v)) * pp + k % pp)


def test_rank_r_holds_chunks_r_r_plus_pp_and_so_on():
    assert interleaved.chunk_layers(16, 4, 2, 0) == [range(0, 2), range(8, 10)]  # layers 1-2 and 9-10
    assert interleaved.chunk_layers(16, 4, 2, 3) == [range(6, 8), range(14, 16)]  # layers 7-8 and 15-16


def train_with(env, background_sends, *args):
    """conftest's pipeline_train with execute(exchange=...), patched in this forked rank only."""
    pipeline.execute = functools.partial(pipeline.execute, exchange=exchange(background_sends))
    return pipeline_train(env, *args)


@pytest.mark.grid(keep=['4-2-8-background-sends', '2-3-6-waited-sends', '4-1-4-background-sends', '1-2-2-waited-sends'])
@pytest.mark.parametrize("background_sends", [True, False], ids=["background-sends", "waited-sends"])
@pytest.mark.parametrize("pp,v,m", [(2, 2, 4), (4, 2, 8), (2, 3, 6), (4, 1, 4), (1, 2, 2)])
def test_interleaved_equals_serial_over_10_adamw_steps(run_ranks, pp, v, m, background_sends):
    make = lambda pp_, m_, s: interleaved.interleaved(pp_, m_, s, v)  # noqa: E731
    cfg = tensor_parallel.GPTConfig(**{**PIPELINE_CFG.__dict__, "n_layer": pp * v})
    results = run_ranks(train_with, pp, background_sends, make, m, 10, v, cfg)
    for r, (diffs, orders) in enumerate(results):
        bad = {k: x for k, x in diffs.items() if not x <= TOL and "messages" not in k}
        assert not bad, (r, bad)
        assert all(orders)
    # Each microbatch crosses pp*v - 1 chunk boundaries each way (1F1B: pp - 1), and with pp > 1
    # every one of them is between two ranks; with pp = 1 they are all local hand-overs.
    sent = sum(d["step 0 messages"] for d, _ in results)
    assert sent == (2 * m * (pp * v - 1) if pp > 1 else 0)


BAD = {
    "m not divisible by pp": ((4, 6, 2), "m=6 must be divisible by pp=4"),
    "v below 1": ((2, 2, 0), "v=0 must be at least 1"),
    "m below 1": ((2, 0, 2), "m=0 must be at least 1"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_interleaving_input_is_refused(case):
    (pp, m, v), message = BAD[case]
    with pytest.raises(ValueError, match=message):
        interleaved.interleaved(pp, m, 0, v)


def test_a_layer_count_that_does_not_split_into_pp_v_chunks_is_refused():
    with pytest.raises(ValueError, match="n_layer=12 is not divisible by 8 pipeline stages"):
        interleaved.chunk_layers(12, 4, 2, 0)


def test_the_demo_passes_and_reports_both_bubbles():
    proc = run_script("03_interleaved.py", "--pp", "2", "--virtual-stages", "2", "--microbatches", "4",
                      timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "interleaved 1/8 (formula (pp-1)/(v m) = 1/8)" in proc.stdout
    assert "1F1B 1/4 (formula (pp-1)/m = 1/4)" in proc.stdout and proc.stdout.rstrip().endswith("PASS")
    proc = run_script("03_interleaved.py", "--microbatches", "6")
    assert proc.returncode == 1 and "m=6 must be divisible by pp=4" in proc.stderr
