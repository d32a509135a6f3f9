"""The activation memory 02's executor reports: what autograd saves for each microbatch in flight,
counted as it is saved (a saved-tensors hook), not estimated. An instrument, not the schedule: the
executor calls forward(key) around each forward, measure() at each boundary and after each action,
and keeps `unsent` (outputs whose send is still in flight) up to date. With 06's split backward,
saved[key] holds, from a microbatch's I to its W, the tensors W still needs instead.
"""
from contextlib import contextmanager

import torch


class ActivationMeter:
    """The activation bytes a rank holds for backward: what autograd saves (parameters excluded)
    for each microbatch in flight, plus each stage output still held after it was sent; every
    storage counted once. `peak` is the most seen at any boundary or after any action."""

    def __init__(self, chunks, outputs):
        self.params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
        self.outputs, self.saved, self.unsent, self.peak = outputs, {}, set(), 0

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
