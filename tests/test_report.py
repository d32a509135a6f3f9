"""plumbing/report: on a GPU the end report prints the measured peak memory beside the start-up
estimate (the GPU checklist's G12 reads it); on a CPU, where torch counts no allocations, nothing.
The training loop's Ctrl-C handler interrupts once and then ignores the launcher's copy.

No GPU here: torch.cuda.max_memory_allocated and the gather across ranks are stubbed, and the run
is a stand-in holding only what report() reads.
"""
from types import SimpleNamespace

import torch

from conftest import TRAINER_BASE, TRAINER_CFG
from plumbing import report
from plumbing.launch import RankEnv

MiB = 2**20
OUT = dict(losses=[5.5, 5.25], evals=[], start=0, bytes_per_message=64, peak_activation_bytes=1000)
ESTIMATE = dict(weights=1 * MiB, gradients=2 * MiB, optimizer=3 * MiB, activations=4 * MiB)  # 10 MiB


def end_report(device, monkeypatch, peaks):
    """The lines report() says on rank 0 of two, whose peaks (bytes) are `peaks`, on `device`."""
    run = SimpleNamespace(tc=TRAINER_BASE, cfg=TRAINER_CFG, dtype=torch.float32, wire=None,
                          env=RankEnv(0, len(peaks), 0, torch.device(device)))
    asked = []

    def max_memory_allocated(dev=None):
        asked.append(dev)
        return peaks[0]

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", max_memory_allocated)
    monkeypatch.setattr(report, "gather_numbers", lambda values, device="cpu": [[p] for p in peaks])
    monkeypatch.setattr(report, "memory_estimate", lambda run, spec: ESTIMATE, raising=False)
    monkeypatch.setattr(report, "sum_probe", lambda run, forward_only: None)  # no pipeline to probe here
    lines = []
    report.report(run, OUT, 2.0, lines.append, forward_only=None)
    return lines, asked


def test_on_a_gpu_the_end_report_prints_the_measured_peak_beside_the_estimate(monkeypatch):
    lines, asked = end_report("cuda:0", monkeypatch, peaks=[12 * MiB, 30 * MiB])
    memory = [line for line in lines if line.startswith("memory")]
    assert memory == ["memory    rank 0, measured peak (torch.cuda.max_memory_allocated): 12.00 MiB, estimated "
                      "10.00 MiB (weights, gradients, optimizer and activations at start-up); the fullest rank, "
                      "1: 30.00 MiB"]
    assert asked == [torch.device("cuda:0")]  # this rank's own device, not whichever is current


def test_on_a_cpu_the_end_report_says_nothing_of_a_peak_it_cannot_measure(monkeypatch):
    lines, asked = end_report("cpu", monkeypatch, peaks=[12 * MiB, 30 * MiB])
    assert asked == [] and not [line for line in lines if "peak (torch.cuda" in line or line.startswith("memory")]
    assert any(line.startswith("peak stored activation bytes") for line in lines)  # the rest is there


def test_after_a_ctrl_c_the_loop_ignores_the_second_one_the_launcher_passes_on():
    """The terminal signals every rank and the launcher passes Ctrl-C on as well: the loop's first
    SIGINT raises Interrupted, and closing the loop must leave SIGINT ignored, not restore a handler
    that would raise again while the rank reports where it stopped (a traceback, seen once in CI)."""
    import os
    import signal
    from plumbing.launch import Interrupted
    before = signal.signal(signal.SIGINT, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("restored")))
    try:
        progress = report.Progress(RankEnv(1, 2, 1, torch.device("cpu")), TRAINER_BASE, 1.0, 0, torch.float64)
        loop, raised = iter(progress), None
        try:
            for step in loop:
                os.kill(os.getpid(), signal.SIGINT)
        except Interrupted as e:
            raised = str(e)
        loop.close()  # the generator's finally, as when the rank's frame unwinds
        assert raised == f"interrupted at step 0 of {TRAINER_BASE.steps}"
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's copy: ignored, no exception
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_loop_that_ends_normally_puts_the_previous_handler_back():
    import signal
    mine = lambda *a: None  # noqa: E731
    before = signal.signal(signal.SIGINT, mine)
    try:
        for step in report.Progress(RankEnv(1, 2, 1, torch.device("cpu")), TRAINER_BASE, 1.0, 0, torch.float64):
            assert signal.getsignal(signal.SIGINT) != mine
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_process_killed_holding_a_bar_lock_does_not_hang_the_next_runs_bars():
    """tqdm's default lock is one semaphore shared by every process forked after the first bar: a
    process SIGKILLed while it held it (a bar's refresh as a run is stopped) left it held, and every
    later bar in those processes waited forever in a futex before its first step. CI saw this as
    trainer runs forked from one pytest session hanging idle one after another, after test_report
    had made a bar in-process. Here, in a fresh interpreter (so this session's own lock is not the
    one left held): a bar made there, a child killed holding tqdm's lock, then a forked child makes
    05's progress bar and prints a note above it; it must finish, not hang."""
    import subprocess
    import sys
    from pathlib import Path
    code = """if True:
        import os, signal, sys, time
        import torch
        from tqdm import tqdm
        from conftest import TRAINER_BASE
        from plumbing import report
        from plumbing.launch import RankEnv
        tqdm(range(1), disable=True)  # this process makes tqdm's shared lock, as test_report did
        holder = os.fork()
        if holder == 0:
            tqdm.get_lock().acquire()
            time.sleep(60)
        time.sleep(0.3)
        os.kill(holder, signal.SIGKILL)  # killed while it holds the lock
        os.waitpid(holder, 0)
        child = os.fork()
        if child == 0:
            progress = report.Progress(RankEnv(0, 1, 0, torch.device("cpu")), TRAINER_BASE, 1.0, 0, torch.float64,
                                       quiet=False)
            progress.note("a note above the bar")
            for step in progress:
                pass
            os._exit(0)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                sys.exit(os.waitstatus_to_exitcode(status))
            time.sleep(0.05)
        os.kill(child, signal.SIGKILL)
        sys.exit("the forked bar hung on the lock the killed process held")
    """
    tests = Path(__file__).parent
    proc = subprocess.run([sys.executable, "-c", code], cwd=tests.parent, capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, "PYTHONPATH": f"{tests}:{tests.parent}"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "a note above the bar" in proc.stderr + proc.stdout


def test_a_piped_bar_writes_each_refresh_on_a_line_of_its_own(monkeypatch, capsys):
    """Piped to a file, tqdm's carriage returns made one line of every refresh (fresh reader 62 met a log line
    of every step). Piped, the bar writes whole lines, at most every PIPED_REFRESH_S, and its last state at the end;
    in a terminal it is tqdm's own."""
    import io
    stream = io.StringIO()  # not a terminal
    monkeypatch.setattr(report.sys, "stderr", stream)
    monkeypatch.setattr(report, "PIPED_REFRESH_S", 0)  # every refresh, to see each on its own line
    progress = report.Progress(RankEnv(0, 1, 0, torch.device("cpu")), TRAINER_BASE, 1.0, 0, torch.float64)
    for step in progress:
        progress.log(dict(step=step, loss=5.0 - step, lr=1e-3, grad_norm=1.0, time_s=0.5))
    progress.bar.close()
    text = stream.getvalue()
    lines = text.splitlines()
    assert isinstance(progress.bar.fp._wrapped, report._Lines) and "\r" not in text, repr(text[:300])
    assert all(line == line.rstrip() and line for line in lines), lines
    assert lines[-1].startswith(f"train: 100%") and f"{TRAINER_BASE.steps}/{TRAINER_BASE.steps}" in lines[-1], lines
    assert f"loss={5.0 - (TRAINER_BASE.steps - 1):.3f}" in lines[-1] and len(lines) >= 2, lines

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    tty = Terminal()
    monkeypatch.setattr(report.sys, "stderr", tty)
    progress = report.Progress(RankEnv(0, 1, 0, torch.device("cpu")), TRAINER_BASE, 1.0, 0, torch.float64)
    assert not progress.piped and progress.bar.fp._wrapped is tty  # tqdm wraps its stream
