"""plumbing/health.py: which rank a hang waits for, and which rank is a straggler, as pure functions
of made-up records (the records of real runs are checked in tests/test_watch.py)."""
from conftest import ROOT
from plumbing.health import diagnose, heat_map, stragglers, waits_for


def rec(step=3, phase="forward", groups=None, waiting_for=(), state="running"):
    return dict(step=step, phase=phase, groups=groups or {}, waiting_for=list(waiting_for), state=state)


# The default 8-rank layout, tp 2 x dp 2 x pp 2: tp groups 0,1 / 2,3 / 4,5 / 6,7; dp groups 0,2 / 1,3 /
# 4,6 / 5,7; pp groups 0,4 / 1,5 / 2,6 / 3,7.


def test_a_chain_of_waits_ends_at_the_rank_outside_communication():
    # Rank 5 stopped entering collectives at step 3: rank 4 waits for it in their tp all-reduce (its
    # 7th, rank 5 entered 6); rank 0 waits for rank 4's activation (a p2p receive); rank 1 waits in
    # its 11th all-reduce with rank 0, which has entered 10. Ranks 2, 3, 6, 7 wait elsewhere.
    records = {
        0: rec(groups={"0,1": [10, 10, None]}, waiting_for=[4]),
        1: rec(groups={"0,1": [11, 10, "all_reduce"]}),
        2: rec(waiting_for=[6]), 3: rec(waiting_for=[7]),
        4: rec(groups={"4,5": [7, 6, "all_reduce"]}),
        5: rec(groups={"4,5": [6, 6, None]}, phase="backward"),
        6: rec(groups={"6,7": [7, 6, "all_reduce"]}), 7: rec(groups={"6,7": [7, 6, "all_reduce"]}),
    }
    d = diagnose(records, 8)
    assert d.culprits == [5] and d.kind == "outside communication" and d.step == 3
    assert (d.group, d.op) == ("4,5", "all_reduce")  # what the last rank before it waits in
    assert d.waiting == [0, 1, 4] and "rank 5 is not in any collective (at step 3, backward)" in d.why
    # Who waits on it directly, and in what; the others only through them.
    assert d.why.endswith("rank 4 waits for it in all_reduce on group [4,5]; ranks [0, 1] wait on them in turn")


def test_a_dead_rank_and_a_silent_one_are_named_as_such():
    records = {0: rec(groups={"0,1": [4, 3, "all_reduce"]}), 1: rec(state="dead: killed by SIGKILL")}
    d = diagnose(records, 2)
    assert d.culprits == [1] and d.kind == "dead" and "died (killed by SIGKILL)" in d.why
    d = diagnose({0: rec(groups={"0,1": [4, 3, "all_reduce"]})}, 2)  # rank 1 wrote nothing
    assert d.culprits == [1] and d.kind == "silent" and "stopped answering" in d.why


def test_a_cycle_is_ranks_calling_collectives_in_different_orders():
    # Rank 0 entered its 5th collective on group 0,1 while rank 1 is in its 3rd on group 1,2, whose
    # rank 2 waits in group 0,2 for rank 0.
    records = {0: rec(groups={"0,1": [5, 4, "all_reduce"], "0,2": [2, 2, None]}),
               1: rec(groups={"0,1": [4, 4, None], "1,2": [3, 2, "all_gather"]}),
               2: rec(groups={"1,2": [2, 2, None], "0,2": [3, 2, "broadcast"]})}
    d = diagnose(records, 3)
    assert d.kind == "cycle" and d.culprits == [0, 1, 2] and "different orders" in d.why


def test_nothing_stuck_is_no_diagnosis_and_a_finished_collective_waits_for_no_one():
    assert diagnose({0: rec(), 1: rec()}, 2).kind == "none"
    assert waits_for({0: rec(groups={"0,1": [3, 3, None]}), 1: rec(groups={"0,1": [3, 3, None]})}) == {0: set(), 1: set()}


def test_a_straggler_is_1_3_times_the_other_ranks_of_its_stage_and_20_ms_more():
    stage_of = {r: r // 4 for r in range(8)}  # 2 stages of 4 ranks
    busy = {0: 100, 1: 101, 2: 99, 3: 150, 4: 300, 5: 301, 6: 299, 7: 330}
    assert stragglers(busy, stage_of) == [3]  # 150 >= 1.3 x 100; 330 < 1.3 x 300
    assert stragglers({0: 10, 1: 10, 2: 25}, {0: 0, 1: 0, 2: 0}) == []  # 2.5x, but only 15 ms more
    assert stragglers({r: 50.0 for r in range(4)}, {r: 0 for r in range(4)}) == []
    assert stragglers({2: 30.0, 3: 80.0}, {2: 1, 3: 1}) == [3]  # two a stage: the other one is the yardstick
    assert stragglers({0: 500.0}, {0: 0}) == []  # alone in its stage: nothing to compare with


def test_the_heat_map_puts_each_rank_at_its_place_in_the_grid():
    text = heat_map({r: float(r) for r in range(8)}, tp=2, dp=2, pp=2).splitlines()
    assert text[1] == "  pp 0 tp 0 |    0.0     2.0" and text[4] == "  pp 1 tp 1 |    5.0     7.0"


def test_the_course_exercise_of_week_4_has_the_answer_it_implies():
    # docs/COURSE.md, week 4, second half: the records described there, and the answers a student
    # should reach with plumbing.health (kept here so that the exercise never drifts from the code).
    records = {0: rec(step=12, waiting_for=[4], groups={"0,1": [39, 39, None]}),
               1: rec(step=12, groups={"0,1": [40, 39, "all_reduce"], "1,3": [24, 24, None]}),
               2: rec(step=12, waiting_for=[6]), 3: rec(step=12, groups={"1,3": [25, 24, "all_reduce"]}),
               4: rec(step=12, groups={"4,5": [20, 19, "all_reduce"]}),
               5: rec(step=12, groups={"4,5": [19, 19, None], "5,7": [10, 9, "all_reduce"]}),
               6: rec(step=12, groups={"6,7": [31, 30, "all_reduce"]}),
               7: rec(step=12, phase="training", groups={"6,7": [30, 30, None], "5,7": [9, 9, None]})}
    assert waits_for(records) == {0: {4}, 1: {0}, 2: {6}, 3: {1}, 4: {5}, 5: {7}, 6: {7}, 7: set()}
    d = diagnose(records, 8)
    assert (d.culprits, d.kind, d.group, d.waiting) == ([7], "outside communication", "5,7", [0, 1, 2, 3, 4, 5, 6])
    busy = {0: 101, 1: 99, 2: 100, 3: 96, 4: 210, 5: 205, 6: 298, 7: 201}
    assert stragglers(busy, {r: r // 4 for r in range(8)}) == [6]
    assert "week 4, second half" in (ROOT / "docs" / "COURSE.md").read_text().lower()


def test_of_two_ranks_outside_communication_the_others_wait_for_the_one_quiet_longest():
    # Issue 36: rank 0 sleeps (slowed) and rank 5 computes briefly before its next collective; with
    # the watchdog's measure of how long each has made no progress, the blame goes to rank 0.
    records = {
        0: rec(groups={"0,1": [10, 10, None]}, phase="training"),
        1: rec(groups={"0,1": [11, 10, "all_reduce"]}),
        4: rec(groups={"4,5": [7, 6, "all_reduce"]}),
        5: rec(groups={"4,5": [6, 6, None]}, phase="backward"),
    }
    world = {r: records.get(r, rec()) for r in range(8)}
    assert diagnose(world, 8).culprits == [0]  # without the measure: the lowest rank waited for
    quiet = {r: dict(world[r], quiet_s=1.5 if r == 0 else 0.2) for r in range(8)}
    assert diagnose(quiet, 8).culprits == [0]
    quiet = {r: dict(world[r], quiet_s=1.5 if r == 5 else 0.2) for r in range(8)}
    d = diagnose(quiet, 8)
    assert d.culprits == [5] and d.waiting == [4] and "rank 4 waits for it in all_reduce on group [4,5]" in d.why
