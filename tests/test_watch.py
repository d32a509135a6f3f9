"""When a rank is slow, stuck or dead, the run names it first (plumbing/watch.py, health.py, the
launcher's report), rehearsed with --rehearse-fault on the default 8 CPU ranks as a user would."""
import os
import re
import time

import pytest

from conftest import run_script

SMALL = ["--n-layer", "2", "--batch-size", "8", "--microbatches", "2", "--seq-len", "16", "--block-size", "16",
         "--eval-every", "0"]


def train(*args, timeout=60):
    t0 = time.monotonic()
    proc = run_script("05_3d_gpt.py", *SMALL, *args, timeout=timeout)
    assert not proc.leftover, f"processes left behind: {proc.leftover}"
    return proc, time.monotonic() - t0


def test_a_killed_rank_is_the_first_line_with_its_signal_and_step():
    proc, _ = train("--steps", "6", "--rehearse-fault", "kill:5:3")
    assert proc.returncode == 1
    first = next(line for line in proc.stderr.splitlines() if line.startswith("error:"))
    assert first == "error: rank 5 died (killed by SIGKILL) at step 3", proc.stderr[-2000:]
    assert "as its consequences" in proc.stderr  # its peers' lost connections follow, on one line


def test_a_hung_rank_is_named_with_its_group_collective_and_stack_long_before_the_timeout(tmp_path):
    proc, seconds = train("--steps", "6", "--rehearse-fault", "hang:5:3", "--hang-s", "3", "--timeout-s", "100")
    assert proc.returncode == 1 and seconds < 15, (seconds, proc.stderr[-2000:])
    text = proc.stderr
    assert re.search(r"rank 5 \(tp 1, dp 0, pp 1\): rank 5 is not in any collective \(at step 3", text), text[-2000:]
    assert re.search(r"rank 4 waits for it in \w+ on group \[4,5\]", text)  # its tp partner: the group, the collective
    stacks = re.search(r"Python stack: (\S+)/rank<N>\.txt", text)[1]
    assert "in rehearse" in open(os.path.join(stacks, "rank5.txt")).read()  # the line it stopped at


def test_a_stopped_rank_is_said_to_have_stopped_answering():
    proc, seconds = train("--steps", "6", "--rehearse-fault", "stop:5:3", "--hang-s", "3", "--timeout-s", "100")
    assert proc.returncode == 1 and seconds < 15
    assert "rank 5 (tp 1, dp 0, pp 1): rank 5 stopped answering" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("layout,fault,named", [
    (["--tp", "1", "--pp", "2", "--dp", "2"], ["--rehearse-fault", "slow:3:50"], [3]),
    (["--tp", "1", "--pp", "2", "--dp", "2"], [], []),
    (["--tp", "2", "--pp", "1", "--dp", "2"], ["--rehearse-fault", "slow:1:100"], [1]),
], ids=["slow rank 3", "no fault", "slow rank 1, tp 2"])
def test_a_slow_rank_and_only_it_is_named_a_straggler(layout, fault, named, tmp_path):
    import json
    proc, _ = train("--steps", "16", *layout, *fault, "--metrics", tmp_path / "m.jsonl")
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = sorted({int(r) for r in re.findall(r"straggler: rank (\d+)", proc.stdout + proc.stderr)})
    assert said == named, proc.stdout[-2000:]
    assert "busy ms per step (median)" in proc.stdout  # the heat map at the end
    lines = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    busy = lines[-1]["busy_ms_run"]  # the whole run's figures, per rank, on the last line
    assert len(busy) == 4 and all("busy_ms_run" not in line for line in lines[:-1])
    assert not named or max(range(4), key=busy.__getitem__) == named[0]


def test_the_self_check_passes_a_healthy_layout_and_names_a_slowed_rank_and_one_skipping_its_all_reduce():
    proc = run_script("05_3d_gpt.py", "--self-check")
    assert proc.returncode == 0 and "every rank, group and link answered in line" in proc.stdout, proc.stderr[-2000:]
    assert proc.stdout.count(": ok") == 4 + 4 + 4  # 4 tp groups, 4 dp groups, 4 pairs of stages
    t0 = time.monotonic()
    proc = run_script("05_3d_gpt.py", "--self-check", "--timeout-s", "3", "--rehearse-fault", "slow:3:200",
                      "--rehearse-fault", "hang:6:0")
    seconds = time.monotonic() - t0
    assert proc.returncode == 1 and seconds < 20
    assert re.search(r"rank 3 \(tp 1, dp 1, pp 0\) is slow: its matmul took", proc.stderr), proc.stderr[-2000:]
    assert "dp group [4,6] all-reduce: did not complete: rank(s) [6] never entered it" in proc.stderr
    assert "tp group [6,7] all-reduce: did not complete: rank(s) [6] never entered it" in proc.stderr


def test_a_restart_after_a_killed_rank_resumes_from_the_snapshot_and_every_loss_is_bit_identical(tmp_path):
    import json
    common = ["--tp", "1", "--pp", "2", "--dp", "2", "--steps", "12"]
    proc, _ = train(*common, "--snapshot-every", "1", "--snapshot-dir", tmp_path / "snap", "--restarts", "1",
                    "--rehearse-fault", "kill:3:7", "--metrics", tmp_path / "restarted.jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 3 died (killed by SIGKILL) at step 7" in proc.stderr
    assert re.search(r"restart 1 of 1: resuming from \S+step_00000007 at step 7; no finished step is lost", proc.stderr)
    assert "every rank, group and link answered in line" in proc.stdout  # the self-check, before the restart
    proc, _ = train(*common, "--metrics", tmp_path / "whole.jsonl")
    losses = [[json.loads(line)["loss"] for line in open(tmp_path / name)] for name in ("restarted.jsonl", "whole.jsonl")]
    assert len(losses[0]) == 12 and losses[0] == losses[1]  # bit for bit


def test_a_restart_runs_its_self_check_and_its_next_attempt_without_the_rehearsed_faults(monkeypatch, tmp_path):
    # A rehearsed hang or slow rank is a fault of the first attempt: acted out again in the self-check
    # before the restart, it would fail that check ("never entered") and no restart would happen.
    from conftest import load
    from plumbing import selfcheck, watch
    from plumbing.launch import RankFailure
    checked, attempts = [], []
    monkeypatch.setattr(selfcheck, "run", lambda tc, grid, prefix: checked.append(tc.rehearse_fault))

    def launch_run(tc):
        attempts.append(tc.rehearse_fault)
        if len(attempts) == 1:
            raise RankFailure("hang: no rank made progress for 3 s. rank 3 ...")
        return True

    tc = load("05_3d_gpt").TrainConfig(restarts=1, rehearse_fault=["hang:3:5", "slow:1:80"],
                                      snapshot_dir=str(tmp_path), snapshot_every=1)
    assert watch.with_restarts(launch_run, tc, grid=None) is True
    assert attempts == [["hang:3:5", "slow:1:80"], []] and checked == [[]]
