"""The launcher never hangs, and bad input is refused on every rank before any collective."""
import os
import signal
import socket
import time
from datetime import timedelta

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
    # Rank 0 either saw its partner's connection close (a consequence) or was stopped; it did not
    # wait it out.
    assert "stopped ranks [0]" in msg or "ranks [0] then failed as its consequences" in msg
    assert time.monotonic() - t0 < 15  # well inside the 30 s collective timeout


def _rank1_dies(env):
    if env.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def test_a_killed_rank_fails_the_run_with_its_signal():
    with pytest.raises(RankFailure, match=r"^rank 1 died \(killed by SIGKILL\)"):
        launch(_rank1_dies, 2, timeout_s=30)


def _rank1_stalls(env):
    if env.rank == 1:
        time.sleep(8)
    dist.all_reduce(torch.ones(1))


def test_collectives_time_out_instead_of_hanging():
    # Rank 0's collective times out; rank 1, still running outside it, is the one it waited for.
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)^rank 1 hung: .*ranks \[0\] failed as its consequences.*[Tt]imed out"):
        launch(_rank1_stalls, 2, timeout_s=2)
    assert time.monotonic() - t0 < 7  # rank 0 gave up after its 2 s timeout, not after rank 1


def _rank1_stalls_again(env):
    # the collective after a slow join: it still times out at the launch's timeout_s
    if env.rank == 1:
        time.sleep(8)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_a_join_slower_than_a_short_timeout_still_joins_and_collectives_keep_that_timeout(monkeypatch):
    # Under load, 8 forked ranks once took more than --timeout-s 1.5 to reach the rendezvous, and the
    # run failed in init_process_group (DistStoreError) before training. A rank that arrives 3 s late
    # now joins (the ranks wait for each other for JOIN_S first), and the collective after it still
    # times out at 1.5 s.
    import multiprocessing
    from plumbing import launch as launching
    real = launching.loopback_interface  # called by each local rank just before it arrives

    def late():
        if multiprocessing.current_process().name == "rank1":
            time.sleep(3)
        return real()

    monkeypatch.setattr(launching, "loopback_interface", late)  # inherited by the forked ranks
    assert launch(_world_size, 2, timeout_s=1.5) == [2, 2]
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)rank 1 hung: .*[Tt]imed out"):
        launch(_rank1_stalls_again, 2, timeout_s=1.5)
    assert time.monotonic() - t0 < 3 + 1.5 + 3  # the arrival's 3 s, the 1.5 s timeout, the reports; not rank 1's 8 s


def _world_size(env):
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def _forever(env):
    while True:
        time.sleep(0.1)


def test_a_run_past_its_deadline_is_stopped():
    with pytest.raises(RankFailure, match="^the run passed its deadline of 2 s"):
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
    assert "--n-head: need n_embd=48 divisible by n_head=6, and n_head divisible by tp=4" in proc.stderr
    assert seconds < 30


# ----------------------------------------------------------------------------------------------
# The demo proves itself, locally and under torchrun (gloo on CPU: the same code path as NCCL).


def test_the_demo_passes_and_counts_two_all_reduces_per_layer_each_way():
    from test_docs import demo_output  # the run that test_docs checks the docs' excerpts against
    proc = demo_output("python3 01_tensor_parallel.py")
    assert proc.returncode == 0, proc.stderr
    assert "layer 0: 2 forward and 2 backward collectives" in proc.stdout
    assert "PASS" in proc.stdout


def test_the_demo_runs_unchanged_under_torchrun():
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc, _ = run(*torchrun, "01_tensor_parallel.py", "--sequence-parallel", fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PASS" in proc.stdout and "world=2" in proc.stdout


def test_the_readme_baseline_example_runs_as_written(tmp_path):
    # The checkout's copy, on PYTHONPATH, as `pip install -e .` puts it on the path; the script runs from
    # elsewhere. The wheel's copy runs it too (tests/test_testing_kit.py).
    text = (ROOT / "README.md").read_text()
    code = text.split("## Use it as a correctness baseline")[1].split("```python\n")[1].split("```")[0]
    assert "from megatron_scratch import tensor_parallel" in code and "sys.path" not in code
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = run_script(str(script), fresh=True, timeout=120, env={"PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_package_names_each_chapter_and_pyproject_installs_it():
    import tomllib
    import megatron_scratch
    names = {"tensor_parallel": "01_", "pipeline": "02_", "interleaved": "03_", "data_parallel": "04_", "gpt3d": "05_",
             "zero_bubble": "06_", "vocab_parallel": "07_"}
    for name, prefix in names.items():
        assert getattr(megatron_scratch, name).__name__.startswith(prefix)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "megatron_scratch" in project["tool"]["setuptools"]["packages"]
    assert all((ROOT / p.replace(".", "/") / "__init__.py").exists() for p in project["tool"]["setuptools"]["packages"])
    assert project["project"]["entry-points"]["pytest11"] == {"megatron_scratch": "megatron_scratch.pytest_plugin"}


# ----------------------------------------------------------------------------------------------
# The launcher's own input: the rank count, and under torchrun the launcher's environment. Each is
# refused before any process or group exists, naming the value.


@pytest.mark.parametrize("nprocs", [0, -3, 2.0, "2", True, None])
def test_launch_refuses_a_rank_count_that_is_not_a_whole_number_of_at_least_one(nprocs):
    called = []
    with pytest.raises(ValueError) as err:
        launch(called.append, nprocs)
    assert f"nprocs={nprocs!r} must be a whole number of ranks, at least 1" in str(err.value)
    assert called == []


LAUNCHER_ENV = {
    "RANK not a number": (dict(RANK="one", WORLD_SIZE="2"), "RANK='one' must be a whole number"),
    "WORLD_SIZE empty": (dict(RANK="0", WORLD_SIZE=""), "WORLD_SIZE='' must be a whole number"),
    "WORLD_SIZE zero": (dict(RANK="0", WORLD_SIZE="0"), "WORLD_SIZE=0 must be at least 1"),
    "RANK negative": (dict(RANK="-1", WORLD_SIZE="2"), "RANK=-1 must be at least 0"),
    "RANK outside the world": (dict(RANK="2", WORLD_SIZE="2"), "RANK=2 must be below WORLD_SIZE=2"),
    "LOCAL_RANK not a number": (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0.5"),
                                "LOCAL_RANK='0.5' must be a whole number"),
    "LOCAL_RANK negative": (dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="-2"), "LOCAL_RANK=-2 must be at least 0"),
    "RANK without WORLD_SIZE": (dict(RANK="0"), "RANK is set but WORLD_SIZE is not"),
    "WORLD_SIZE without RANK": (dict(WORLD_SIZE="4"), "WORLD_SIZE is set but RANK is not"),
}


def launcher_env(monkeypatch, **variables):
    """A launcher's environment, as MEGATRON_SCRATCH_LAUNCH=env says to read it (torchrun's own variable,
    TORCHELASTIC_RUN_ID, would also make this process die with its parent: not pytest's)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MEGATRON_SCRATCH_LAUNCH", "env")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("case", LAUNCHER_ENV, ids=list(LAUNCHER_ENV))
def test_a_malformed_launcher_variable_is_refused_by_name_before_any_group(monkeypatch, case):
    variables, message = LAUNCHER_ENV[case]
    launcher_env(monkeypatch, **variables)
    called = []
    with pytest.raises(ValueError) as err:
        launch(called.append, 2)
    assert message in str(err.value)
    assert called == [] and not dist.is_initialized()


def _clear_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MEGATRON_SCRATCH_LAUNCH"):
        monkeypatch.delenv(name, raising=False)


def test_rank_and_world_size_from_no_launcher_it_knows_are_refused_in_one_sentence(monkeypatch):
    # A CI job that exports RANK and WORLD_SIZE for its own reasons: launch ran one rank of a group that
    # never forms, silently. Now refused before any process or group, naming the variables and the choice.
    _clear_launcher(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    called = []
    with pytest.raises(ValueError) as err:
        launch(called.append, 2)
    text = str(err.value)
    assert text.startswith("RANK='0' and WORLD_SIZE='4' are set, but not by a launcher this recognises (torchrun "
                           "sets TORCHELASTIC_RUN_ID too)"), text
    assert "set MEGATRON_SCRATCH_LAUNCH=env to join that group" in text and "MEGATRON_SCRATCH_LAUNCH=local" in text
    assert "\n" not in text and called == [] and not dist.is_initialized()
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match=r"^RANK='0' is set, but not by a launcher"):
        launch(called.append, 2)


def test_the_launch_mode_says_which(monkeypatch):
    from plumbing.launch import launch_mode
    _clear_launcher(monkeypatch)
    assert launch_mode() == "local"  # nothing set: fork here
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's own: one rank of its group
    assert launch_mode() == "env"
    assert launch_mode("local") == "local"  # the argument first
    monkeypatch.setenv("MEGATRON_SCRATCH_LAUNCH", "local")
    assert launch_mode() == "local" and launch_mode("env") == "env"
    monkeypatch.setenv("MEGATRON_SCRATCH_LAUNCH", "torchrun")
    with pytest.raises(ValueError, match=r"MEGATRON_SCRATCH_LAUNCH='torchrun' must be 'env' \(this process is one"):
        launch_mode()
    with pytest.raises(ValueError, match=r"launch\(mode=...\)='both' must be 'env'"):
        launch(lambda env: None, 2, mode="both")
    _clear_launcher(monkeypatch)
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE are not set: set them, or MEGATRON_SCRATCH_LAUNCH=local"):
        launch(lambda env: None, 2, mode="env")


def test_mode_local_forks_the_ranks_whatever_rank_and_world_size_say(monkeypatch):
    _clear_launcher(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch(_rank_and_sum, 2, mode="local", timeout_s=20) == [(0, 2, 3.0), (1, 2, 3.0)]
    monkeypatch.setenv("MEGATRON_SCRATCH_LAUNCH", "local")
    assert launch(_rank_and_sum, 2, timeout_s=20) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_mode_env_joins_the_group_the_variables_describe(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _clear_launcher(monkeypatch)
    for name, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)
    assert launch(_rank_and_sum, 3, mode="env") == [(0, 1, 1.0)]  # one rank of a world of 1, not 3 forked
    assert not dist.is_initialized()


class Recorder:
    """Stands in for a torch function: records each call's arguments, returns nothing."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def test_under_torchrun_on_a_gpu_the_group_and_its_barrier_are_bound_to_local_rank(monkeypatch):
    # No GPU here: CUDA and the collectives are stood in for, to see what launch asks of them.
    # On a GPU, device_id makes NCCL connect at init and bind every group to the rank's device;
    # barrier(device_ids=...) tells NCCL's barrier which device its tensor lives on.
    launcher_env(monkeypatch, RANK="3", WORLD_SIZE="4", LOCAL_RANK="1")
    calls = {name: Recorder() for name in ("set_device", "synchronize", "init_process_group", "barrier",
                                           "destroy_process_group")}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("set_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, calls[name])
    for name in ("init_process_group", "barrier", "destroy_process_group"):
        monkeypatch.setattr(dist, name, calls[name])
    gpu = torch.device("cuda", 1)
    assert launch(lambda env: (env.rank, env.world_size, env.local_rank, env.device), 4, timeout_s=7) \
        == [(3, 4, 1, gpu)]
    assert calls["set_device"].calls == [((gpu,), {})]
    assert calls["synchronize"].calls == [((gpu,), {})]  # its collectives finished before the barrier
    assert calls["init_process_group"].calls == [
        (("nccl",), dict(rank=3, world_size=4, timeout=timedelta(seconds=7), device_id=gpu))]
    assert calls["barrier"].calls == [((), dict(device_ids=[1]))]
    assert len(calls["destroy_process_group"].calls) == 1


def test_under_torchrun_a_local_rank_beyond_the_gpus_is_refused_by_name(monkeypatch):
    launcher_env(monkeypatch, RANK="2", WORLD_SIZE="4", LOCAL_RANK="2")
    init = Recorder()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 but this node has 2 GPU\(s\)"):
        launch(lambda env: None, 4)
    assert init.calls == []


def test_under_torchrun_on_a_cpu_the_group_is_gloo_and_unbound(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher_env(monkeypatch, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init, barrier = Recorder(), Recorder()
    real_init, real_barrier = dist.init_process_group, dist.barrier
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: (init(*a, **k), real_init(*a, **k)))
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: (barrier(*a, **k), real_barrier(*a, **k)))
    assert launch(_rank_and_sum, 1) == [(0, 1, 1.0)]
    assert init.calls[0][0] == ("gloo",) and "device_id" not in init.calls[0][1]
    assert barrier.calls == [((), {})]
    assert not dist.is_initialized()  # torn down after the worker


def test_under_torchrun_a_rank_whose_peer_died_says_so_in_one_line():
    # Two ranks as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment),
    # forked from here; rank 1 kills itself after joining (_rank1_dies), rank 0 waits for it in an
    # all-reduce and must fail at once, saying a peer is gone and where.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.pipe()
    children = []
    t0 = time.monotonic()
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            signal.alarm(0)
            os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MEGATRON_SCRATCH_LAUNCH="env",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            os.environ.pop("TORCHELASTIC_RUN_ID", None)
            try:
                launch(_rank1_dies, 2, timeout_s=20)
                report = "returned"
            except BaseException as e:
                report = f"{type(e).__name__}: {e}"
            os.write(out[1], report.encode()[:4000])
            os._exit(0)
        children.append(pid)
    os.close(out[1])
    statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    report = os.read(out[0], 8000).decode()
    os.close(out[0])
    assert statuses == [0, -signal.SIGKILL]
    # The dead rank first: its process, on this host, is seen to have ended (issue 36).
    assert report.startswith("RankFailure: rank 1 died (killed by SIGKILL); rank 0 of 2 stopped as its "
                             "consequence: a collective failed because a peer rank is gone."), report
    assert "in _rank1_dies" in report, report
    assert time.monotonic() - t0 < 15  # the closed connection, not the 20 s timeout


class _Side:
    """The side channel's calls that _gone_peer makes, on a dict."""
    def __init__(self, **kv):
        self.kv = {k: v.encode() for k, v in kv.items()}

    def append(self, k, v):
        self.kv[k] = self.kv.get(k, b"") + v.encode()

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def get(self, k):
        return self.kv[k]

    def compare_set(self, k, expected, v):
        if self.kv.get(k, b"").decode() == expected:
            self.kv[k] = v.encode()


def test_a_peer_torchruns_agent_stopped_is_not_named_as_the_cause_when_the_killed_one_is_found(monkeypatch):
    """torchrun's agent SIGTERMs the ranks after a death; a rank that looks then may find the SIGTERMed
    rank 0 before the SIGKILLed rank 3 that caused it (CI saw "rank 0 died (killed by SIGTERM)" named
    first): the cause is the one not killed by SIGTERM; a SIGTERMed one only when none other is found."""
    from plumbing import launch as launching
    host = launching.HOST_KEY.format(socket.gethostname())
    side = _Side(**{host: "0:100:a;2:102:c;3:103:d;", launching.VICTIMS_KEY: ""})
    exits = {100: (signal.SIGTERM, "a"), 103: (signal.SIGKILL, "d")}  # pid: (its signal, its start time)
    monkeypatch.setattr(launching, "_process", lambda pid: ("Z", *exits[pid]) if pid in exits else ("S", None, "c"))
    assert launching._gone_peer(side, 2, wait_s=0.2) == "rank 3 died (killed by SIGKILL)"
    alone = _Side(**{host: "0:100:a;2:102:c;", launching.VICTIMS_KEY: ""})
    assert launching._gone_peer(alone, 2, wait_s=0.2) == "rank 0 died (killed by SIGTERM)"
