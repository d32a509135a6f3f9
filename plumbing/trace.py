"""Traces: every collective as it runs, and timelines as Chrome trace JSON, which chrome://tracing
and ui.perfetto.dev open offline (Perfetto runs in the browser and uploads nothing).

    with trace_comm(model) as log:  ...   every collective run in the block, as a Collective,
                                         named by the layer of model that ran it
    write_chrome_trace(path, [(process, [(track, [(start_s, end_s, name, category)])])])
    write_timelines(path, {name: per-rank [(start, end, action)]})   02's and 03's schedules
    StepTrace        one training step's timeline on this rank (05's --trace): compute, waits for
                     point-to-point messages, collectives and data-parallel buckets, each a span
"""
import json
import sys
import threading
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plumbing import paths
from plumbing.launch import gather_json

# ----------------------------------------------------------------------------------------------
# Collectives, observed from outside: while trace_comm() is on, torch.distributed's collectives are
# wrapped so that each call is logged, and module hooks say which layer ran it, forward or backward.
# Nothing in the numbered files names its collectives: they call torch.distributed as they would.

_PATCHED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
            "reduce_scatter_single")


@dataclass(frozen=True)
class Collective:
    """One collective as trace_comm() saw it."""
    op: str  # "all-reduce", "all-reduce (max)", "all-gather" or "reduce-scatter"
    module: str  # the innermost traced module running it ("" outside them)
    direction: str  # "forward" or "backward"
    operator: str  # the class whose code issued it: CopyToTP (f), ReduceFromTP (g), ...
    shape: tuple  # this rank's tensor: the reduced one, or the shard gathered or scattered
    nbytes: int  # the whole tensor's bytes: the reduced one, or the gathered / scattered one
    start: float  # the clock at the call, and when it was done (an async one: at its wait())
    end: float

    @property
    def where(self):
        return f"{self.module or '(model)'} {self.direction}".strip()


@contextmanager
def trace_comm(*modules, clock=time.perf_counter, groups=None):
    """Record each collective torch.distributed runs in the block as a Collective (a list, yielded),
    named by the innermost of `modules`' submodules running it. groups: record only those on these
    process groups (None: all). clock reads the time (05's --trace passes its StepTrace's: on a GPU,
    CUDA events, so spans are device time)."""
    log, stack, hooks, originals = [], [], [], {}

    def push(name, direction):
        return lambda *_: stack.append((name, direction))

    def pop(name, direction):
        def hook(*_):
            if (name, direction) in stack:  # the last such entry, wherever it is
                del stack[len(stack) - 1 - stack[::-1].index((name, direction))]
        return hook

    for root in modules:
        for name, m in root.named_modules():
            hooks += [m.register_forward_pre_hook(push(name, "forward")),
                      m.register_forward_hook(pop(name, "forward")),
                      m.register_full_backward_pre_hook(push(name, "backward")),
                      m.register_full_backward_hook(pop(name, "backward"))]

    def wrap(fn_name, fn):
        def traced(*args, **kwargs):
            group, async_op = kwargs.get("group"), kwargs.get("async_op", False)
            if getattr(_local, "inside", False) or (groups is not None and group not in groups):
                return fn(*args, **kwargs)
            op, shape, nbytes = _describe(fn_name, args, kwargs)
            operator, direction = _issuer()
            module, stacked = stack[-1] if stack else ("", "")
            start, _local.inside = clock(), True
            try:
                work = fn(*args, **kwargs)
            finally:
                _local.inside = False
            entry = dict(op=op, module=module, direction=direction or stacked, operator=operator,
                         shape=shape, nbytes=nbytes, start=start)
            if async_op:
                return _TracedWork(work, log, entry, clock)
            log.append(Collective(**entry, end=clock()))
            return work
        return traced

    for fn_name in _PATCHED:
        if hasattr(dist, fn_name):
            originals[fn_name] = getattr(dist, fn_name)
            setattr(dist, fn_name, wrap(fn_name, originals[fn_name]))
    try:
        with warnings.catch_warnings():  # a module whose inputs are token ids gets no input gradient:
            warnings.filterwarnings("ignore", "Full backward hook is firing")  # torch says so, each time
            yield log
    finally:
        for fn_name, fn in originals.items():
            setattr(dist, fn_name, fn)
        for h in hooks:
            h.remove()


_local = threading.local()  # inside a traced call: a collective it calls is part of it, not another


def _describe(fn_name, args, kwargs):
    """(op, this rank's shape, the whole tensor's bytes) of a call of torch.distributed.fn_name."""
    if fn_name == "all_reduce":
        x = args[0]
        op = kwargs.get("op", dist.ReduceOp.SUM)
        return "all-reduce" + (" (max)" if op == dist.ReduceOp.MAX else ""), tuple(x.shape), x.numel() * x.element_size()
    out, x = args[0], args[1]
    if "gather" in fn_name:  # x: this rank's shard; out: every rank's, stacked along dim 0
        return "all-gather", tuple(x.shape), out.numel() * out.element_size()
    return "reduce-scatter", tuple(out.shape), x.numel() * x.element_size()


def _issuer():
    """(class, "forward" / "backward" / "") of the nearest caller that is a method of a class
    (CopyToTP.backward, ReduceFromTP.forward, ScatterGather.unpack, ...), skipping module-level helpers."""
    frame = sys._getframe(2)
    while frame is not None:
        parts = frame.f_code.co_qualname.split(".")
        if len(parts) >= 2 and "<locals>" not in parts and frame.f_code.co_filename != __file__:
            return parts[-2], parts[-1] if parts[-1] in ("forward", "backward") else ""
        frame = frame.f_back
    return "", ""


class _TracedWork:
    """An async collective's work: logged, from its launch, when it is waited for."""

    def __init__(self, work, log, entry, clock):
        self.work, self.log, self.entry, self.clock, self.logged = work, log, entry, clock, False

    def wait(self, *args):
        out = self.work.wait(*args)
        if not self.logged:
            self.log.append(Collective(**self.entry, end=self.clock()))
            self.logged = True
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)


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
    with paths.create_new(paths.fresh(path), "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def write_timelines(path, timelines, seconds_per_unit=1e-6):
    """{name: per-rank [(start, end, action)]} as one trace: a process per name, a track per rank,
    a slice per action, named str(action), its category action.kind."""
    write_chrome_trace(path, [(name, [(f"rank {r}", [(s * seconds_per_unit, e * seconds_per_unit, str(a), a.kind)
                                                     for s, e, a in tl]) for r, tl in enumerate(per_rank)])
                              for name, per_rank in timelines.items()])


_ABSENT = object()  # an attribute observe() found on the class, not the object: deleted again after


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
        self.spans += [(c.start - self.t0, c.end - self.t0, f"{c.op} {c.operator} {c.where}", "tp collective")
                       for c in collectives]

    @contextmanager
    def observe(self, run, trainer):
        """One train_step of 05's `run` (its module `trainer`), timed from outside: 02's executor on this
        clock (its actions and exchanges), 01's tp collectives named by layer (trace_comm), 04's bucket
        reductions, and a span for each of the tied-embedding sync, the rest of the data-parallel
        reduction, clipping, the loss all-reduce and the optimizer step. Nothing in the step takes the
        trace: its functions are wrapped while it runs, and put back after."""
        pipeline, ddp, opt, collectives = trainer.pipeline, run.ddp, run.opt, []
        zero = " and ZeRO-1 all-gather" if run.tc.zero1 else ""

        def spanned(fn, name, category, after=lambda: None):
            def wrapped(*args, **kwargs):
                with self.span(name, category):
                    out = fn(*args, **kwargs)
                after()
                return out
            return wrapped

        def forward_backward(*args, **kwargs):
            with trace_comm(*run.chunks, clock=self.clock, groups=[run.groups.tp]) as log:
                graph = getattr(run.forward_backward, "mode", None) == "step"
                with self.span("forward + backward (one CUDA graph)", "compute") if graph else nullcontext():
                    self.result = eager(*args, **kwargs)
            collectives.extend(log)
            return self.result

        eager, ddp.clock = run.forward_backward, self.clock  # the buckets' events on this clock
        patches = [(pipeline.StepRecord, "clock", self.clock), (pipeline.StepRecord, "t0", self.t0),
                   (run, "forward_backward", forward_backward),
                   (pipeline, "sync_tied_embeddings", spanned(pipeline.sync_tied_embeddings,
                                                              "tied-embedding all-reduce", "collective")),
                   (ddp, "finish", spanned(ddp.finish, "data-parallel gradient reduction", "collective",
                                           lambda: self.add_pipeline(self.result, collectives, ddp.events))),
                   (trainer, "clip_gradients", spanned(trainer.clip_gradients, "global gradient norm and clipping",
                                                       "collective")),
                   (trainer, "shared_loss", spanned(trainer.shared_loss, "loss all-reduce", "collective")),
                   (opt, "step", spanned(opt.step, "AdamW" + zero, "optimizer"))]
        saved = [(obj, name, obj.__dict__.get(name, _ABSENT)) for obj, name, _ in patches]
        try:
            for obj, name, value in patches:
                setattr(obj, name, value)
            yield
        finally:
            for obj, name, value in reversed(saved):
                delattr(obj, name) if value is _ABSENT else setattr(obj, name, value)
            ddp.clock = time.perf_counter

    def write(self, path, title, track_names, group=None):
        """Gather every rank's spans (a collective: every rank calls it); rank 0 writes the file."""
        if self.gpu:
            torch.cuda.synchronize(self.device)  # every event has happened
        spans = [(self.seconds(s), self.seconds(e), name, cat) for s, e, name, cat in self.spans]
        every = gather_json(sorted(spans), group, self.device)
        if dist.get_rank(group) == 0:
            write_chrome_trace(path, [(title, list(zip(track_names, every)))])
