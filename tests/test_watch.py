"""When a rank is slow, stuck or dead, the run names it first (plumbing/watch.py, health.py, the
launcher's report), rehearsed with --rehearse-fault on the default 8 CPU ranks as a user would."""
import os
import queue
import re
import statistics
import sys
import tempfile
import threading
import time

import pytest

from conftest import ROOT, run_script

SMALL = ["--n-layer", "2", "--batch-size", "8", "--microbatches", "2", "--seq-len", "16", "--block-size", "16",
         "--eval-every", "0", "--no-check"]  # 05's check before training: test_lesson_05 and the main job's tests


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


STRAGGLERS = {
    "slow rank 3": (["--tp", "1", "--pp", "2", "--dp", "2"], ["--rehearse-fault", "slow:3:50"], [3]),
    "no fault": (["--tp", "1", "--pp", "2", "--dp", "2"], [], []),
    "slow rank 1, tp 2": (["--tp", "2", "--pp", "1", "--dp", "2"], ["--rehearse-fault", "slow:1:100"], [1]),
}


# CI names one slowed rank on one layout (tp 2: its partner waits in every tp collective and must not be
# named; 5-6 s a run), the same code path on pp 2 under --full-grid; the healthy run, naming no one, always.
@pytest.mark.grid(keep=["no fault", "slow rank 1, tp 2"])
@pytest.mark.parametrize("layout,fault,named", list(STRAGGLERS.values()), ids=list(STRAGGLERS))
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


class _Store:
    """The side channel's calls the watchdog makes, on a dict."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def test_a_record_its_heartbeat_has_not_rewritten_lately_is_not_diagnosed_until_it_is_silent(monkeypatch, tmp_path):
    # Issue 36: a hang report blamed a rank whose record was old news (its heartbeat thread starved of
    # the CPU on a loaded machine). Rank 0 waits for rank 1 in an all-reduce; rank 1's record, which
    # says it is outside communication, is not rewritten: between STALE_S and SILENT_S it is not
    # trusted, and after SILENT_S rank 1 is silent.
    import json
    from plumbing import watch
    now = [100.0]
    monkeypatch.setattr(watch.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(watch.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    store, beats = _Store(), {0: 0, 1: 0}

    def beat(*ranks):
        for r in ranks:
            beats[r] += 1
            groups = {"0,1": [2, 1, "all_reduce"]} if r == 0 else {"0,1": [1, 1, None]}
            store.set(watch.KEY.format(r), json.dumps(dict(step=3, phase="training", groups=groups, waiting_for=[],
                                                           state="running", progress=7, beat=beats[r])))

    dog = watch.Watchdog(store, 2, 1.0, str(tmp_path / "stacks"))
    beat(0, 1)
    assert dog.check() is None  # nothing quiet yet
    now[0] += 1.5
    beat(0)  # rank 0's heartbeat goes on; rank 1's record is 1.5 s old
    assert dog.check() is None
    now[0] += 0.7
    beat(0)
    d = dog.check()  # rank 1's record is 2.2 s old: silent
    assert d is not None and d.culprits == [1] and d.kind == "silent", d


# ----------------------------------------------------------------------------------------------
# An asynchronous backend (issue 35, item 3). NCCL returns from a collective at once, having queued
# it on the device; the host waits later, where it first reads a result (the gradient norm's
# float(), the loss's), outside any wrapped call. Here a CPU stand-in: a backend whose collectives
# queue the real (gloo) one on a "stream" (a thread that runs its queue in order, as a device does)
# and return at once, and a host that reads only after waiting for the stream, where NCCL blocks.


class _Stream(threading.Thread):
    """A device's stream: runs what is queued on it, in order, on its own thread."""

    def __init__(self):
        super().__init__(daemon=True)
        self.queue, self.error = queue.Queue(), None
        self.start()

    def run(self):
        while True:
            fn = self.queue.get()
            try:
                fn()
            except BaseException as e:  # a timed-out collective: raised where the host waits
                self.error = e
            self.queue.task_done()

    def synchronize(self):  # the host waits for the device (what float() of a CUDA tensor does)
        self.queue.join()
        if self.error:
            raise self.error


class _Mark:
    """A point in the stream's work (a CUDA event's stand-in): done once the stream has passed it."""

    def __init__(self, stream):
        self.reached, self.at = threading.Event(), None
        stream.queue.put(self._reach)

    def _reach(self):
        self.at = time.perf_counter()
        self.reached.set()

    def done(self):
        return self.reached.is_set()

    def seconds_to(self, later):
        return later.at - self.at


def _async_group(stream):
    """A process group of every rank whose all_reduce queues gloo's on the stream and returns at once."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _create_work_from_future

    class QueuedGroup(dist.ProcessGroup):
        def __init__(self, inner, rank, world):
            super().__init__(rank, world)
            self.inner = inner

        def allreduce(self, tensors, opts=None):
            stream.queue.put(lambda: self.inner.allreduce(tensors).wait())
            done = torch.futures.Future()
            done.set_result(tensors)
            return _create_work_from_future(done)  # its wait() returns at once, as NCCL's does on the host

        def getBackendName(self):
            return "queued"

    dist.Backend.register_backend("queued", lambda store, rank, world, timeout: QueuedGroup(
        dist.ProcessGroupGloo(store, rank, world, timeout), rank, world), devices=["cpu"])
    return dist.new_group(list(range(dist.get_world_size())), backend="queued")


def _async_steps(env, steps, device_ms, hang_at=None):
    """Each step: device work (device_ms[rank] on the stream), an all-reduce that returns at once, and
    the host's read of its result; rank 1's host stops for good at step hang_at, before its all-reduce."""
    import torch
    import torch.distributed as dist
    from plumbing import watch
    from plumbing.launch import side_channel
    stream = _Stream()
    group = _async_group(stream)
    getattr(watch, "ASYNC_BACKENDS", {})["queued"] = lambda: _Mark(stream)  # how to mark the stream's work
    recorder = watch.Recorder(env.rank).install()
    beats = watch.start(env, side_channel(), recorder, 0, None)  # the heartbeat; the launcher watches
    for step in range(steps):
        recorder.begin_step(step)
        while env.rank == 1 and step == hang_at:
            time.sleep(0.1)  # alive, outside communication
        stream.queue.put(lambda: time.sleep(device_ms[env.rank] / 1e3))  # the step's compute, on the device
        x = torch.ones(1)
        dist.all_reduce(x, group=group)
        stream.synchronize()  # where the host first reads the result, and waits
        assert float(x) == env.world_size
        recorder.end_step()
    watch.stop(beats, recorder)
    return recorder.busy_ms


def test_on_a_backend_whose_collectives_return_at_once_the_hang_is_seen_where_the_host_waits():
    from plumbing.launch import RankFailure, Watch, launch
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        launch(_async_steps, 2, 6, {0: 5, 1: 5}, 3, timeout_s=30, deadline_s=60, watch=Watch(1.5, lambda r: f"r{r}"))
    text = str(failure.value)
    assert time.monotonic() - t0 < 20, text  # the hang report, not the collective timeout (30 s)
    assert text.startswith("hang: no rank made progress for 1.5 s. rank 1 (r1): rank 1 is not in any collective "
                           "(at step 3, training); rank 0 waits for it in all_reduce on group [0,1]"), text


def test_on_a_backend_whose_collectives_return_at_once_busy_time_leaves_out_the_wait_on_the_device():
    from plumbing import health
    from plumbing.launch import launch
    busy = launch(_async_steps, 2, 8, {0: 10, 1: 90}, timeout_s=30, deadline_s=60)
    medians = {r: statistics.median(b[2:]) for r, b in enumerate(busy)}  # the first steps warm up
    # Rank 0 computes 10 ms and waits ~80 ms on the device for rank 1, its host blocked meanwhile in
    # the read; its busy time is its own 10 ms (plus the host's overhead), not the 90 ms step.
    assert medians[0] < 45 and medians[1] > 80, medians
    assert health.stragglers(medians, {0: 0, 1: 0}) == [1], medians


# ----------------------------------------------------------------------------------------------
# Under torchrun (issue 36, section 3 and 6): a dead, stopped or hung rank is named first, its
# stacks go to a temporary directory, and torchrun's --max-restarts resumes. Four CPU ranks (tp 1,
# pp 2, dp 2) of one torchrun agent; each job is found by a marker in its processes' environment,
# since torchrun starts each rank in a session of its own.

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
TORCHRUN_FLAGS = ["--tp", "1", "--pp", "2", "--dp", "2", *SMALL, "--timeout-s", "60"]


def torchrun(ranks, *args, launcher=(), timeout=120):
    marker = f"WATCH_TEST_JOB={os.getpid()}-{time.monotonic_ns()}"
    env = {"OMP_NUM_THREADS": "1", marker.split("=")[0]: marker.split("=")[1]}  # one thread a rank, as locally
    proc = run_script(*TORCHRUN, str(ranks), *launcher, "05_3d_gpt.py", *args, fresh=True, timeout=timeout, env=env)
    deadline = time.monotonic() + 5
    while (left := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.leftover = left
    return proc


def _processes_with(marker):
    """Live processes whose environment holds marker."""
    found, needle = [], b"\0" + marker.encode() + b"\0"
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = b"\0" + f.read()
            except OSError:
                continue
            if state != "Z" and needle in environ:
                found.append(int(entry))
    return found


def first_error(text):
    return next((line for line in text.replace("\r", "\n").splitlines() if line.startswith("error: ")), None)


def ours_raised(text):
    """Whether any of our files appears in a traceback (torchrun's agent prints its own)."""
    return f'File "{ROOT}' in text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_under_torchrun_a_killed_rank_is_named_first_with_its_signal_and_step():
    proc = torchrun(4, *TORCHRUN_FLAGS, "--steps", "10", "--rehearse-fault", "kill:3:4")
    assert proc.returncode != 0 and not proc.leftover, proc.stderr[-3000:]
    # Each surviving rank says it, before torchrun's agent stops it (SIGTERM is held off meanwhile).
    assert re.fullmatch(r"error: rank 3 died \((killed by SIGKILL|its process is gone)\) at step 4; rank [012] of 4 "
                        r"stopped as its consequence: a collective failed because a peer rank is gone\.",
                        first_error(proc.stderr) or ""), proc.stderr[-3000:]
    assert not ours_raised(proc.stderr)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_under_torchrun_a_rank_stalled_past_the_collective_timeout_is_named_first_not_a_peer_that_did_not_answer():
    # As the local launcher's test_robustness case: --hang-s 0 (no hang report), rank 0 sleeps 5 s at its
    # first step, past the 1.5 s timeout of rank 1's receive from it. Rank 1 used to say only "a peer rank
    # is gone ... or did not answer"; now it names rank 0 first, from every rank's record on the side
    # channel, in the local report's words, and no traceback of ours.
    proc = torchrun(2, "--tp", "1", "--pp", "2", "--dp", "1", *SMALL, "--steps", "4", "--timeout-s", "1.5",
                    "--hang-s", "0", "--rehearse-fault", "slow:0:5000", timeout=60)
    assert proc.returncode != 0 and not proc.leftover, proc.stderr[-3000:]
    assert (first_error(proc.stderr) or "") == (
        "error: rank 0 (tp 0, dp 0, pp 0) lagged: it is not in any collective (at step 0, training), and rank 1's "
        "point-to-point exchange with rank 0 timed out after 1.5 s (the launch's timeout, which bounds every "
        "collective), waiting for it"), proc.stderr[-3000:]
    assert "did not answer" not in proc.stderr and not ours_raised(proc.stderr), proc.stderr[-3000:]


class _Side(_Store):
    """The side channel's calls that a timed-out rank makes under torchrun (launch._lost_peer), on a dict."""

    def append(self, key, value):
        self.data[key] = self.data.get(key, b"") + value.encode()

    def compare_set(self, key, expected, value):
        if self.data.get(key, b"").decode() == expected:
            self.data[key] = value.encode()


def _lost_peer(monkeypatch, side, error, rank=1, world=2, meanwhile=lambda: None):
    """launch._lost_peer's failure on a fake side channel, no peer found gone on this host (its search
    takes 2 s, and meanwhile() happens in them), the clock the watch's (its waits pass at once)."""
    from plumbing import launch as launching
    from plumbing import watch
    now = [100.0]
    monkeypatch.setattr(watch.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(watch.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(launching, "_gone_peer", lambda side, rank: (now.__setitem__(0, now[0] + 2.0), meanwhile(),
                                                                     side.get(launching.GONE_KEY).decode()
                                                                     if side.check([launching.GONE_KEY]) else None)[2])
    try:
        raise error
    except RuntimeError as e:
        return str(launching._lost_peer(e, side, rank, world, 1.5))


def _put(side, rank, beat=1, **rec):
    import json
    from plumbing import watch
    side.set(watch.KEY.format(rank), json.dumps(dict(dict(step=0, phase="training", groups={}, waiting_for=[],
                                                          state="running", progress=3, beat=beat), **rec)))


TIMED_OUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1500ms for recv operation")


def test_under_torchrun_a_timed_out_rank_names_the_rank_its_records_say_it_waited_for_and_tells_its_victims(monkeypatch):
    from plumbing import launch as launching
    side = _Side()
    _put(side, 0)  # computing, outside communication
    _put(side, 1, failed={"waiting_for": [0]})  # its receive from rank 0 timed out
    said = _lost_peer(monkeypatch, side, TIMED_OUT, meanwhile=lambda: _put(side, 0, beat=2))  # rank 0 answers
    assert said.startswith("rank 0 (0) lagged: it is not in any collective (at step 0, training), and rank 1's "
                           "point-to-point exchange with rank 0 timed out after 1.5 s"), said
    assert side.get(launching.GONE_KEY) == b"rank 0 lagged (the timeout report above)"
    # A rank whose collective then loses rank 1 (its connection closed) names rank 0 first, from that claim.
    lost = _lost_peer(monkeypatch, side, RuntimeError("Connection closed by peer"), rank=2, world=3)
    assert lost.startswith("rank 0 lagged (the timeout report above) at step 0; rank 2 of 3 stopped as its "
                           "consequence: a collective failed because a peer rank is gone: it stopped when its wait for "
                           "the lagging rank timed out."), lost


def test_under_torchrun_a_rank_whose_heartbeat_stopped_between_the_two_reads_is_said_to_have_stopped_answering(
        monkeypatch):
    side = _Side()
    _put(side, 0)
    _put(side, 1, failed={"waiting_for": [0]})
    said = _lost_peer(monkeypatch, side, TIMED_OUT, meanwhile=lambda: _put(side, 1, beat=2, failed={"waiting_for": [0]}))
    assert said.startswith("rank 0 (0) lagged: it stopped answering (no record within the deadline), and rank 1's"), said


@pytest.mark.parametrize("records", ["none", "no failed", "not a record", "a bad failed", "store gone",
                                     "store gone between the reads"])
def test_under_torchrun_a_timed_out_rank_without_usable_records_says_what_it_said_before_at_once(monkeypatch, records):
    # No watch (another chapter), records that do not say what it waited in, or a side channel gone:
    # the sentence it always said, with no wait beyond the peer search's, and no new error.
    side = _Side()
    if records != "none":
        _put(side, 0)
        _put(side, 1, **({"failed": {"groups": {"0,1": "x"}}} if records == "a bad failed" else {}))
    if records == "not a record":
        side.set("watch/rank/1", "{")
    def gone(*a):
        raise RuntimeError("Connection reset by peer")

    def close():
        side.get = side.check = gone
    if records == "store gone":
        close()
    if records == "store gone between the reads":
        _put(side, 1, failed={"waiting_for": [0]})
    t0 = time.monotonic()
    said = _lost_peer(monkeypatch, side, TIMED_OUT, meanwhile=close if records.endswith("reads") else lambda: None)
    assert time.monotonic() - t0 < 2
    assert said.startswith("rank 1 of 2 stopped: a collective failed because a peer rank is gone (its process or "
                           "node died, or it failed) or did not answer within the 1.5 s timeout"), said


def test_the_timeout_report_keeps_a_victim_that_ended_since_in_the_wait_its_record_says_failed():
    # Rank 3's receive from rank 1 timed out; rank 1 had timed out in its all-reduce with rank 0 and
    # ended (silent now); rank 0 computes. The end is rank 0, through rank 1, not rank 1.
    from plumbing.watch import timeout_report
    records = {0: dict(step=2, phase="training", groups={"0,1": [2, 2, None]}, waiting_for=[], state="running"),
               1: dict(step=2, phase="training", groups={"0,1": [3, 3, None]}, waiting_for=[], state="silent",
                       failed={"groups": {"0,1": [3, 2, "all_reduce"]}}),
               3: dict(step=2, phase="training", groups={}, waiting_for=[], state="running",
                       failed={"waiting_for": [1]})}
    said = timeout_report(records, 4, 3, lambda r: f"at {r}", 1.5)
    assert said.startswith("rank 0 (at 0) lagged: it is not in any collective (at step 2, training), and rank 3's "
                           "point-to-point exchange with rank 1 timed out"), said
    assert said.endswith("waiting for it through rank 1"), said
    records[3]["failed"] = {"groups": {"0,1,2,3": [1, 0]}}  # not as _fail writes it (the store is open to all)
    assert timeout_report(records, 4, 3, str, 1.5) is None


def test_on_an_asynchronous_backend_the_collective_the_device_waits_in_is_kept_as_failed():
    # NCCL: the host meets a timeout where it reads a result, outside any wrapped call; note_failure
    # keeps what the device waited in then (the queue's head), as a blocking backend's wrapper does.
    from plumbing import watch

    class Mark:
        def __init__(self, done):
            self.reached = done

        def done(self):
            return self.reached

    marks = iter([Mark(True), Mark(False)])  # the device has reached the all-reduce, not passed it
    recorder = watch.Recorder(1)
    recorder.names[None], recorder.marker_of[None] = "0,1", lambda: next(marks)
    recorder._wrap("all_reduce", lambda *a, **k: None)(object())
    assert recorder.failed is None and recorder.record()["groups"] == {"0,1": [1, 0, "all_reduce"]}
    assert recorder.note_failure() == {"groups": {"0,1": [1, 0, "all_reduce"]}}
    records = {0: dict(step=0, groups={"0,1": [0, 0, None]}, waiting_for=[], state="running"),
               1: dict(recorder.record(), failed=recorder.failed)}
    assert watch.timeout_report(records, 2, 1, str, 1.5).startswith("rank 0 (0) lagged: it is not in any collective")
    idle = watch.Recorder(1)
    assert idle.note_failure() is None and "failed" not in idle.record()  # in nothing: nothing kept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_under_torchrun_a_stopped_rank_0_is_named_by_its_deputy_long_before_the_timeout():
    before = set(os.listdir(ROOT))
    proc = torchrun(4, *TORCHRUN_FLAGS, "--steps", "10", "--rehearse-fault", "stop:0:3", "--hang-s", "3")
    assert proc.returncode != 0 and not proc.leftover, proc.stderr[-3000:]
    assert proc.seconds < 60, proc.seconds  # the report, not the 60 s collective timeout (and no 30 s wait
    # for the agent's SIGKILL of the stopped rank: the reporter ends it)
    line = first_error(proc.stderr) or ""
    assert line.startswith("error: hang: no rank made progress for 3 s. rank 0 (tp 0, dp 0, pp 0): rank 0 stopped "
                           "answering"), proc.stderr[-3000:]
    stacks = re.search(r"Python stacks?\b[^:]*: (\S+)/rank<N>\.txt", line)[1]
    assert os.path.dirname(stacks) == tempfile.gettempdir() and os.path.exists(os.path.join(stacks, "rank1.txt"))
    assert set(os.listdir(ROOT)) == before and not ours_raised(proc.stderr)


@pytest.mark.full_grid(covered_by=["test_under_torchrun_a_stopped_rank_0_is_named_by_its_deputy_long_before_the_timeout",
                                   "test_a_hung_rank_is_named_with_its_group_collective_and_stack_long_before_the_timeout"],
                       why="19 s: torchrun's stacks directory is held by the deputy test, the hung rank's report by the local one")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_under_torchrun_a_hung_ranks_stacks_go_to_a_temporary_directory_not_the_working_one():
    before = set(os.listdir(ROOT))
    proc = torchrun(4, *TORCHRUN_FLAGS, "--steps", "10", "--rehearse-fault", "hang:2:3", "--hang-s", "3")
    assert proc.returncode != 0 and not proc.leftover, proc.stderr[-3000:]
    line = first_error(proc.stderr) or ""
    assert line.startswith("error: hang: no rank made progress for 3 s. rank 2 (tp 0, dp 0, pp 1): rank 2 is not in "
                           "any collective (at step 3, rehearsed hang at step 3)"), proc.stderr[-3000:]
    stacks = re.search(r"Python stacks?\b[^:]*: (\S+)/rank<N>\.txt", line)[1]
    assert os.path.dirname(stacks) == tempfile.gettempdir()
    assert "in rehearse" in open(os.path.join(stacks, "rank2.txt")).read()
    assert set(os.listdir(ROOT)) == before  # no ./hang-<pid>/ in the checkout


@pytest.mark.full_grid(covered_by=["test_a_restart_after_a_killed_rank_resumes_from_the_snapshot_and_every_loss_is_bit_identical",
                                   "test_under_torchrun_a_killed_rank_is_named_first_with_its_signal_and_step"],
                       why="23 s: the resume is held by the local launcher's restart, torchrun's fault path by the killed-rank test")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_torchruns_max_restarts_resumes_a_killed_rank_and_every_loss_is_bit_identical(tmp_path):
    # torchrun keeps one store for the job; the restarted ranks' keys go under a prefix of their own,
    # or they read the dead attempt's gloo addresses ("Connection refused").
    import json
    common = ["--tp", "1", "--pp", "2", "--dp", "1", *SMALL, "--steps", "10", "--timeout-s", "60"]
    proc = torchrun(2, *common, "--snapshot-every", "1", "--snapshot-dir", tmp_path / "snap", "--rehearse-fault",
                    "kill:1:4", "--metrics", tmp_path / "restarted.jsonl", launcher=["--max-restarts", "1"])
    assert proc.returncode == 0 and not proc.leftover, proc.stderr[-3000:]
    assert "error: rank 1 died" in proc.stderr and "resumed from" in proc.stdout, proc.stderr[-3000:] + proc.stdout[-1500:]
    whole = run_script("05_3d_gpt.py", *common, "--metrics", tmp_path / "whole.jsonl")
    assert whole.returncode == 0, whole.stderr[-2000:]
    losses = [[json.loads(line)["loss"] for line in open(tmp_path / name)] for name in ("restarted.jsonl", "whole.jsonl")]
    assert len(losses[0]) == 10 and losses[0] == losses[1]  # bit for bit
