"""The launcher never hangs, and bad input is refused on every rank before any collective."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, load, run_script
from plumbing.launch import RankFailure, launch

tensor_parallel = load("01_tensor_parallel")


def run(*args, timeout=120, fresh=False):
    proc = run_script(*args, timeout=timeout, fresh=fresh)
    return proc, proc.seconds


# ----------------------------------------------------------------------------------------------
# The launcher.


def _rank_and_sum(env):
    x = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(x)
    return env.rank, env.world_size, x.item()


def test_launch_returns_every_ranks_result_in_rank_order(run_ranks):
    assert run_ranks(_rank_and_sum, 3) == [(r, 3, 6.0) for r in range(3)]


def _rank1_raises(env):
    if env.rank == 1:
        raise RuntimeError("boom on rank one")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a partner that never comes


def test_a_failing_rank_fails_the_run_with_its_traceback_and_stops_the_others():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as err:
        launch(_rank1_raises, 2, timeout_s=30)
    msg = str(err.value)
    assert "rank 1 failed" in msg and "boom on rank one" in msg and "_rank1_raises" in msg
    # Rank 0 either saw its partner's connection close or was stopped; it did not wait it out.
    assert "stopped ranks [0]" in msg or "rank 0 also failed" in msg
    assert time.monotonic() - t0 < 15  # well inside the 30 s collective timeout


def _rank1_dies(env):
    if env.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def test_a_killed_rank_fails_the_run_with_its_exit_code():
    with pytest.raises(RankFailure, match="rank 1 died with exit code -9"):
        launch(_rank1_dies, 2, timeout_s=30)


def _rank1_stalls(env):
    if env.rank == 1:
        time.sleep(8)
    dist.all_reduce(torch.ones(1))


def test_collectives_time_out_instead_of_hanging():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="(?s)rank 0 failed.*[Tt]imed out"):
        launch(_rank1_stalls, 2, timeout_s=2)
    assert time.monotonic() - t0 < 7  # rank 0 gave up after its 2 s timeout, not after rank 1


def _forever(env):
    while True:
        time.sleep(0.1)


def test_a_run_past_its_deadline_is_stopped():
    with pytest.raises(RankFailure, match="the run failed:\npassed its deadline of 2 s"):
        launch(_forever, 2, deadline_s=2)


# ----------------------------------------------------------------------------------------------
# Bad input: every rank raises a ValueError naming the constraint and the values, and no
# collective of ours has run when it does.

SMALL = dict(vocab_size=50, block_size=16, n_layer=1, n_head=4, n_embd=16)


def _bad(env, case):
    cfg = tensor_parallel.GPTConfig(**{**SMALL, **case.get("cfg", {})})
    with tensor_parallel.trace_comm() as log:
        try:
            group = tensor_parallel.new_tp_group(env, case.get("tp", 2))
            model = tensor_parallel.GPT(cfg, group, sequence_parallel=case.get("sp", False))
            model(case.get("idx", torch.zeros(2, 8, dtype=torch.long) + 3))
        except ValueError as e:
            return str(e), list(log)  # returned, not raised: every rank reports for itself
    return "no error", list(log)


BAD = {
    "n_head not divisible by tp": (dict(cfg=dict(n_head=3, n_embd=12)), "n_head=3 must be divisible by tp=2"),
    "n_embd not divisible by n_head": (dict(cfg=dict(n_embd=18)), "n_embd=18 must be divisible by n_head=4"),
    "tp larger than the world": (dict(tp=4), "tp=4 must be between 1 and the world size 2"),
    "sequence longer than block_size": (dict(idx=torch.ones(2, 17, dtype=torch.long)),
                                        "sequence length T=17 exceeds block_size=16"),
    "token id >= vocab_size": (dict(idx=torch.tensor([[1, 50]])), "got min=1, max=50"),
    "negative token id": (dict(idx=torch.tensor([[-1, 7]])), "token ids must lie in [0, vocab_size=50)"),
    "T not divisible by tp under sequence parallelism": (
        dict(sp=True, idx=torch.ones(2, 7, dtype=torch.long)), "needs T=7 divisible by tp=2"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_raises_on_every_rank_before_any_collective(run_ranks, case):
    kwargs, message = BAD[case]
    for error, collectives in run_ranks(_bad, 2, kwargs):
        assert message in error
        assert collectives == []


def test_the_demo_exits_nonzero_within_seconds_on_bad_input():
    proc, seconds = run("01_tensor_parallel.py", "--tp", "4", "--n-head", "6", "--n-embd", "48")
    assert proc.returncode == 1
    assert "n_head=6 must be divisible by tp=4" in proc.stderr
    assert seconds < 30


# ----------------------------------------------------------------------------------------------
# The demo proves itself, locally and under torchrun (gloo on CPU: the same code path as NCCL).


def test_the_demo_passes_and_counts_two_all_reduces_per_layer_each_way():
    proc, _ = run("01_tensor_parallel.py")
    assert proc.returncode == 0, proc.stderr
    assert "layer 0: 2 forward and 2 backward collectives" in proc.stdout
    assert "PASS" in proc.stdout


def test_the_demo_runs_unchanged_under_torchrun():
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc, _ = run(*torchrun, "01_tensor_parallel.py", "--sequence-parallel", fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PASS" in proc.stdout and "world=2" in proc.stdout


def test_the_readme_baseline_example_runs_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    code = text.split("## Use it as a correctness baseline")[1].split("```python\n")[1].split("```")[0]
    script = tmp_path / "example.py"
    script.write_text(code.replace("/path/to/this/repo", str(ROOT)))
    proc, _ = run(str(script), fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
