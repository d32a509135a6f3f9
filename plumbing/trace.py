"""Traces: timelines as Chrome trace JSON, which chrome://tracing and ui.perfetto.dev open offline
(Perfetto runs in the browser and uploads nothing).

    write_chrome_trace(path, [(process, [(track, [(start_s, end_s, name, category)])])])
    StepTrace        one training step's timeline on this rank (05's --trace): compute, waits for
                     point-to-point messages, and collectives, each a span
"""
import json
import time
from contextlib import contextmanager

import torch

from plumbing.launch import gather_json


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


class StepTrace:
    """Spans of one step on this rank, timed from `t0` (set after a barrier, so ranks line up).
    On a GPU the clock waits for the device first, so a span is the work, not its launch."""

    def __init__(self, device):
        self.device, self.spans, self.t0 = device, [], 0.0
        self.gpu = device.type == "cuda"

    def clock(self):
        if self.gpu:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self):
        self.t0 = self.clock()

    @contextmanager
    def span(self, name, category):
        start = self.clock()
        yield
        self.spans.append((start - self.t0, self.clock() - self.t0, name, category))

    def add_pipeline(self, result, collectives):
        """The executor's actions and exchanges (timed from t0 already) and 01's collectives."""
        self.spans += [(s, e, str(a), "compute") for s, e, a in result.events]
        self.spans += [(s, e, f"p2p exchange ({n} ops)", "p2p wait") for s, e, n in result.waits]
        self.spans += [(c.start - self.t0, c.end - self.t0, f"{c.op} {c.tag}", "tp collective")
                       for c in collectives]

    def write(self, path, title, track_names, group=None):
        """Gather every rank's spans (a collective: every rank calls it); rank 0 writes the file."""
        every = gather_json(sorted(self.spans), group, self.device)
        if track_names is not None:
            write_chrome_trace(path, [(title, list(zip(track_names, every)))])
