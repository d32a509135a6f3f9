"""What 05's trainer adds to 04's machine for a pipeline, after the concept: 05 turns both on
(--overlap-grad-reduce, and --overlap-param-gather with ZeRO-1, the defaults). MegaScale (Jiang et
al. 2024, Section 3.3) overlaps the data-parallel reduce-scatter with the last microbatch's backward
and the all-gather with the first microbatch's forward so.

    PipelineDDP        04's BucketedDDP for a pipeline chunk: each bucket reduced during its chunk's
                       last backward (a gradient is final at its own m-th accumulation)
    OverlappedGather   04's FlatAdamW whose ZeRO-1 all-gathers run on into the next forward

Both subclass 04's machine, so this module imports 04; 04 names them too (its module __getattr__
imports this module on first use), so `data_parallel.PipelineDDP` is where it was.
"""
import importlib

data_parallel = importlib.import_module("04_data_parallel")


class PipelineDDP(data_parallel.BucketedDDP):
    """BucketedDDP for a pipeline chunk. Before: a step's last microbatch sets sync for the whole
    model, but in a pipeline each chunk runs its m backwards at its own times. Now: a gradient is final
    at its own m-th accumulation, so each bucket launches during its chunk's last backward; and the
    buckets of `hold` (the tied embedding, which the other stage's copy is added into after backward)
    wait for finish()."""

    def __init__(self, params, group, bucket_numel, microbatches, hold=(), **kwargs):
        super().__init__(params, group, bucket_numel, **kwargs)
        self.microbatches, self.held = microbatches, {i for p in hold for i in self.buckets_of[p]}
        for i in self.held:  # one count more than its parameters: launched by finish() only
            self.counts[i] += 1
            self.pending[i] += 1

    def zero_grad(self):
        super().zero_grad()
        self.seen = dict.fromkeys(self.params, 0)

    def final(self, p):
        self.seen[p] += 1
        return self.sync and self.seen[p] == self.microbatches


class OverlappedGather(data_parallel.FlatAdamW):
    """FlatAdamW whose ZeRO-1 all-gathers run into the next forward. Before: step() waits for every
    gather. Now: step() returns with them in flight, first layers first, and each module registered
    with wait_before_forward() waits for its own weights' buckets only (Megatron's overlap_param_gather)."""

    def after_step(self):
        pass

    def wait_before_forward(self, module, params):
        """Make each forward of `module` first wait for the gathers of the buckets holding `params`."""
        buckets = {i for p in params for i in self.ddp.buckets_of[p]}  # found once, not at every forward
        module.register_forward_pre_hook(lambda *_: self.wait_gather(buckets))

    def wait_in_forward(self, chunks):
        """wait_before_forward on 01's GPT chunks: each block for its own weights; each chunk, first, for
        the rest; and each module outside the blocks for its own (07 calls its embedding on its own)."""
        for c in chunks:
            rest = [p for n, p in c.named_parameters() if not n.startswith("transformer.h.")]
            self.wait_before_forward(c, rest)
            for m in [*(m for n, m in c.transformer.items() if n != "h"), *c.transformer.h.values()]:
                self.wait_before_forward(m, list(m.parameters()))
