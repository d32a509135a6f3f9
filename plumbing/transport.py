"""How the pipeline machine's boundary tensors travel, after the concept (02 re-exports each name, and
03 and 05-09 use them as 02's: pipeline.Wire and so on). 02's Executor posts a boundary's messages
through an Exchange and sends each tensor through a Wire:

    Exchange          a boundary's messages posted as one batch (batch_isend_irecv), then all waited for
    Wire(shape)       a boundary tensor travels as itself (05's ScatterGather subclasses it to send 1/tp)
    BackgroundSends   an Exchange whose sends stay in flight until the next boundary (MegaScale's overlap)
"""
from dataclasses import dataclass

import torch.distributed as dist


class Exchange:
    """A boundary's messages posted as one batch, then all waited for; wait returns those sent (now free)."""

    def post(self, ops):
        return dist.batch_isend_irecv(ops)

    def wait(self, works, ops, sent):
        for work in works:
            work.wait()
        return sent

    def flush(self):  # at the step's end: sends still in flight, once complete (BackgroundSends)
        return []


@dataclass
class Wire:
    """A boundary tensor travels as itself, in buffers of `shape` (05's ScatterGather sends 1/tp)."""
    shape: tuple

    def pack(self, t):
        return t

    def unpack(self, buf):
        return buf


class BackgroundSends(Exchange):
    """Exchange, with the sends left in flight. Before: a boundary waits for its sends as for its
    receives, so a rank whose peer is busy idles until that peer posts the matching receive. Now: it
    waits for its receives only; its sends complete while the next action runs, and are waited for at
    the next boundary or the step's end (MegaScale, Jiang et al. 2024, Section 3.3). check_plans'
    rendezvous model is the conservative one, so what validates runs either way. NCCL returns one
    handle for a whole batch: there the sends are waited for with the receives (gloo: one per op)."""

    def __init__(self):
        self.in_flight = []  # [(work, message)] from the previous boundary

    def wait(self, works, ops, sent):
        if len(works) != len(ops):  # NCCL: one work for the whole batch
            for work in works:
                work.wait()
            return self.flush() + sent
        for work, op in zip(works, ops):
            if op.op is not dist.isend:
                work.wait()
        done = self.flush()  # the previous boundary's sends: they had its actions' time to complete
        self.in_flight = list(zip([w for w, op in zip(works, ops) if op.op is dist.isend], sent))
        return done

    def flush(self):
        for work, _ in self.in_flight:
            work.wait()
        done, self.in_flight = [msg for _, msg in self.in_flight], []
        return done
