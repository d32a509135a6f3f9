"""What 02's executor reports of a step, counted from outside: StepRecord(executor) wraps the
executor's methods on that one object, so nothing in 02 calls it but the line that makes it.

    StepRecord      each action's start and end, each boundary's wait, the messages and bytes sent,
                    and (ActivationMeter) the activation memory; result() is the step's StepResult
    ActivationMeter what autograd saves for each microbatch in flight, counted as it is saved (a
                    saved-tensors hook), not estimated

The meter counts after each action and at each boundary:
  - what each forward saved for its backward, until that backward ran (a saved-tensors hook);
  - each stage output still held after its send completed (with Megatron's deallocation, nothing);
    an output waiting to be sent, or in flight, is not counted, as 02 always counted it;
  - with 06's split backward, from a microbatch's I to its W, what W still needs (its X and dY).
"""
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps

import torch
import torch.distributed as dist


@dataclass
class StepResult:
    loss: object  # the global mean loss on the rank holding the last stage, else None
    events: list  # [(start_s, end_s, action)] in the order they ran
    peak_activation_bytes: int  # most bytes saved for backward (plus kept outputs) at a boundary
    messages: int
    bytes_sent: int
    waits: list = field(default_factory=list)  # [(start_s, end_s, n_ops)]: each batched exchange


def around(obj, name, before=None, after=None):
    """Wrap obj.name (a method, on this one object) with calls before and after it, given its arguments."""
    fn = getattr(obj, name, None)
    if fn is None:
        return

    @wraps(fn)
    def wrapped(*args):
        if before:
            before(*args)
        out = fn(*args)
        if after:
            after(*args)
        return out
    setattr(obj, name, wrapped)


class StepRecord:
    """One executor's figures, step after step: the timeline of its actions and waits on `clock`
    from `t0` (05's --trace sets both, on this class, for its one step; else each run starts its own
    clock), the messages it sent and their bytes, and its ActivationMeter's peak."""

    clock, t0 = time.perf_counter, None

    def __init__(self, ex):
        def start(*_):
            self.events, self.waits, self.messages, self.bytes_sent = [], [], 0, 0
            self.origin = self.clock() if self.t0 is None else self.t0

        def timed(name, add):
            fn = getattr(ex, name)

            @wraps(fn)
            def wrapped(*args):
                begin = self.clock() - self.origin
                out = fn(*args)
                add(begin, self.clock() - self.origin, *args)
                return out
            setattr(ex, name, wrapped)

        def count(ops):
            sends = [op.tensor for op in ex.p2p if op.op is dist.isend]
            self.messages, self.bytes_sent = self.messages + len(sends), self.bytes_sent + sum(
                t.numel() * t.element_size() for t in sends)

        around(ex, "run", before=start)
        timed("act", lambda s, e, a, k: self.events.append((s, e, a)))
        timed("wait", lambda s, e, ops: self.waits.append((s, e, len(ops))))
        around(ex, "post", after=count)
        self.meter = ActivationMeter(ex)  # after the timing: its measuring is not an action's time

    def result(self, loss):
        return StepResult(loss, self.events, self.meter.peak, self.messages, self.bytes_sent, self.waits)


class ActivationMeter:
    """The activation bytes a rank holds for backward: what autograd saves (parameters excluded)
    for each microbatch in flight, plus each stage output still held after it was sent; every
    storage counted once. `peak` is the most seen at any boundary or after any action. Made with
    an executor, it counts that executor's runs; made with (chunks, outputs), it is a plain
    instrument: forward(key) around a forward, measure() when wanted."""

    def __init__(self, chunks, outputs=None):
        executor = chunks if hasattr(chunks, "plan") else None
        self.executor, chunks = executor, executor.chunks if executor else chunks
        self.params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
        self._outputs, self.saved, self.unsent, self.peak = outputs, {}, set(), 0
        if executor:
            self._attach(executor)

    @property
    def outputs(self):
        return self.executor.outputs if self.executor else self._outputs

    @contextmanager
    def forward(self, key):
        """Count what autograd saves while microbatch `key`'s forward runs."""
        saved = self.saved[key] = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in self.params:
                saved[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def measure(self):
        live = {}
        for saved in self.saved.values():  # microbatches in flight (and, from 06's I to its W, what W needs)
            live.update(saved)
        for key, y in self.outputs.items():
            if y.dim() and key not in self.unsent:
                live[y.untyped_storage().data_ptr()] = y.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(live.values()))

    def _attach(self, ex):
        """Wrap ex's run (a fresh count each step), act and wait (measure after them), run_F (what its
        forward saves; its output, if it is sent, counted from when the send completed), run_B (its
        microbatch no longer in flight), sent, and 06's run_I and run_W (what W keeps, from I to W)."""
        remote = {m for kind, *step in ex.plan if kind == "post" for side, _, m in step[0] if side == "send"}

        def forward(a, k):
            with self.forward((a.chunk, a.mb)):
                run_F(a, k)
            if ("act", k + 1, a.mb) in remote:  # waiting to be sent: counted once its send completed
                self.unsent.add((a.chunk, a.mb))

        def fresh(*_):
            self.saved, self.unsent, self.peak = {}, set(), 0

        run_F, ex.run_F = ex.run_F, forward
        around(ex, "run", before=fresh)
        for name in ("act", "wait"):
            around(ex, name, after=lambda *_: self.measure())
        around(ex, "run_B", before=lambda a, k: self.saved.pop((a.chunk, a.mb), None))
        around(ex, "run_I", after=lambda a, k: self.saved.__setitem__((a.chunk, a.mb), ex.split.held((a.chunk, a.mb))))
        around(ex, "run_W", after=lambda a, k: self.saved.pop((a.chunk, a.mb)))
        around(ex, "sent", after=lambda msg: self.unsent.discard((ex.schedule.where[msg[1] - 1][1], msg[2]))
               if msg[0] == "act" else None)
