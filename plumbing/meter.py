"""The activation memory 02's executor reports: what autograd saves for each microbatch in flight,
counted as it is saved (a saved-tensors hook), not estimated. An instrument, not the schedule:
ActivationMeter(executor) wraps the executor's methods on that one object, so nothing in 02 calls
it but the line that makes it. It counts after each action and at each boundary:
  - what each forward saved for its backward, until that backward ran (a saved-tensors hook);
  - each stage output still held after its send completed (with Megatron's deallocation, nothing);
    an output waiting to be sent, or in flight, is not counted, as 02 always counted it;
  - with 06's split backward, from a microbatch's I to its W, what W still needs (its X and dY).
"""
from contextlib import contextmanager
from functools import wraps

import torch


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
        microbatch no longer in flight), sent, and 06's run_I and run_W."""
        remote = {m for kind, *step in ex.plan if kind == "post" for side, _, m in step[0] if side == "send"}

        def around(name, before=None, after=None):
            fn = getattr(ex, name, None)
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
            setattr(ex, name, wrapped)

        def forward(a, k):
            with self.forward((a.chunk, a.mb)):
                run_F(a, k)
            if ("act", k + 1, a.mb) in remote:  # waiting to be sent: counted once its send completed
                self.unsent.add((a.chunk, a.mb))

        def fresh(*_):
            self.saved, self.unsent, self.peak = {}, set(), 0

        run_F, ex.run_F = ex.run_F, forward
        around("run", before=fresh)
        for name in ("act", "wait"):
            around(name, after=lambda *_: self.measure())
        around("run_B", before=lambda a, k: self.saved.pop((a.chunk, a.mb), None))
        around("run_I", after=lambda a, k: self.saved.__setitem__((a.chunk, a.mb), ex.split.held((a.chunk, a.mb))))
        around("run_W", after=lambda a, k: self.saved.pop((a.chunk, a.mb)))
        around("sent", after=lambda msg: self.unsent.discard((ex.schedule.where[msg[1] - 1][1], msg[2]))
               if msg[0] == "act" else None)
