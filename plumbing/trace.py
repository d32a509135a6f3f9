"""Traces: every collective as it runs, and timelines as Chrome trace JSON, which chrome://tracing
and ui.perfetto.dev open offline (Perfetto runs in the browser and uploads nothing).

    with trace_comm() as log:  ...   every collective 01 runs in the block, as a Collective
    write_chrome_trace(path, [(process, [(track, [(start_s, end_s, name, category)])])])
    write_timelines(path, {name: per-rank [(start, end, action)]})   02's and 03's schedules
    StepTrace        one training step's timeline on this rank (05's --trace): compute, waits for
                     point-to-point messages, collectives and data-parallel buckets, each a span
"""
import contextlib
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plumbing.launch import gather_json

# ----------------------------------------------------------------------------------------------
# Collectives: 01 runs each one inside recorded(), which logs it while trace_comm() is on.

_log, _clock = None, time.perf_counter  # the list trace_comm() fills, and how it reads the time


@dataclass(frozen=True)
class Collective:
    """One collective as trace_comm() saw it; the tag names the layer and forward or backward."""
    op: str
    tag: str
    shape: tuple
    nbytes: int
    start: float  # the clock before and after it
    end: float


@contextmanager
def trace_comm(clock=time.perf_counter):
    """Record every collective of 01 as a Collective while the block runs. clock reads the time
    (05's --trace passes its StepTrace's: on a GPU, CUDA events, so spans are device time)."""
    global _log, _clock
    _log, _clock = [], clock
    try:
        yield _log
    finally:
        _log, _clock = None, time.perf_counter


def recorded(op, x, tag):
    """Around one collective on tensor x: logged, with its bytes and times, while trace_comm() is
    on. Off, it costs one comparison: 01 wraps every collective in it, on the hot path."""
    return _OFF if _log is None else _Recorder(op, x, tag)


class _Recorder:
    def __init__(self, op, x, tag):
        self.op, self.x, self.tag = op, x, tag

    def __enter__(self):
        self.start = _clock()

    def __exit__(self, *exc):
        x = self.x
        _log.append(Collective(self.op, self.tag, tuple(x.shape), x.numel() * x.element_size(), self.start, _clock()))


_OFF = contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# Chrome traces


def write_chrome_trace(path, processes):
    """Write [(process name, [(track name, [(start_s, end_s, name, category), ...])])] as a Chrome
    trace: each process a group of tracks (say, one per rank), each span one slice. Times are in
    seconds, written in microseconds as the format wants."""
    events = []
    for pid, (process, tracks) in enumerate(processes):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}})
        for tid, (track, spans) in enumerate(tracks):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": track}})
            events += [{"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
                        "ts": float(s) * 1e6, "dur": float(e - s) * 1e6}
                       for s, e, name, cat in spans]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def write_timelines(path, timelines, seconds_per_unit=1e-6):
    """{name: per-rank [(start, end, action)]} as one trace: a process per name, a track per rank,
    a slice per action, named str(action), its category action.kind."""
    write_chrome_trace(path, [(name, [(f"rank {r}", [(s * seconds_per_unit, e * seconds_per_unit, str(a), a.kind)
                                                     for s, e, a in tl]) for r, tl in enumerate(per_rank)])
                              for name, per_rank in timelines.items()])


class StepTrace:
    """Spans of one step on this rank, timed from `t0` (set after a barrier, so ranks line up).
    On a GPU each reading of the clock records a CUDA event on the current stream and returns its
    number; write() turns numbers into seconds once the step is done. So a span is the device's
    work, not its launch, and nothing waits for the device in between (overlap stays visible)."""

    def __init__(self, device):
        self.device, self.spans, self.t0 = device, [], 0.0
        self.gpu, self.events = device.type == "cuda", []

    def clock(self):
        if not self.gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        return float(len(self.events) - 1)

    def seconds(self, offset):
        """A span edge (a clock reading minus t0) in seconds after t0."""
        if not self.gpu:
            return offset
        start = self.events[int(self.t0)]
        return start.elapsed_time(self.events[round(self.t0 + offset)]) / 1e3

    def start(self):
        dist.barrier()  # every rank's clock starts together
        self.t0 = self.clock()
        return self

    @contextmanager
    def span(self, name, category):
        start = self.clock()
        yield
        self.spans.append((start - self.t0, self.clock() - self.t0, name, category))

    def add_pipeline(self, result, collectives, buckets=()):
        """The executor's actions and exchanges (timed from t0 already), 01's collectives, and 04's
        bucket reductions (BucketedDDP.events on this clock, called after its finish()): each from its
        launch to now, by when it has completed."""
        now = self.clock() - self.t0
        self.spans += [(t - self.t0, now, f"bucket {i} reduction (launched; complete by the end of finish)",
                        "dp collective") for kind, i, t in buckets if kind == "launch"]
        self.spans += [(s, e, str(a), "compute") for s, e, a in result.events]
        self.spans += [(s, e, f"p2p exchange ({n} ops)", "p2p wait") for s, e, n in result.waits]
        self.spans += [(c.start - self.t0, c.end - self.t0, f"{c.op} {c.tag}", "tp collective")
                       for c in collectives]

    def write(self, path, title, track_names, group=None):
        """Gather every rank's spans (a collective: every rank calls it); rank 0 writes the file."""
        if self.gpu:
            torch.cuda.synchronize(self.device)  # every event has happened
        spans = [(self.seconds(s), self.seconds(e), name, cat) for s, e, name, cat in self.spans]
        every = gather_json(sorted(spans), group, self.device)
        if dist.get_rank(group) == 0:
            write_chrome_trace(path, [(title, list(zip(track_names, every)))])
