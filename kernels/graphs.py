"""CUDA graphs: record a stage's forward and backward once, then replay them.

A GPT layer on a small per-GPU slice launches a few dozen kernels whose work is shorter than
their launch; a CUDA graph records the launches once and replays them with one call, so the CPU
stops being the bottleneck (Megatron-LM captures each layer's forward and backward with
Transformer Engine's make_graphed_callables). Two ways of using them here:

  StageGraphs  per pipeline stage and microbatch (any pp, dp; tp = 1). Each chunk's forward and
               backward become graphs via torch.cuda.make_graphed_callables. The executor (02)
               still runs the schedule and does every send and receive between replays: no
               communication is inside a graph. With tp > 1 a chunk's forward contains the
               tensor-parallel all-reduces, so it is not captured here.
  StepGraph    the whole forward + backward of a step as one graph, when tp = pp = dp = 1.
  Graphed      05's seam: its forward_backward, replayed through either of them. A capture that
               fails (an operation that cannot be captured, as torch's embedding backward above
               3,072 token ids per microbatch: pytorch issue 82886) is said in one sentence, and
               that rank trains eagerly from then on.

Static buffers. A graph reads its input from, and writes its output and everything autograd saves
for backward to, fixed addresses. A microbatch holds those until its backward ran, so microbatches
in flight at the same time need their own copies: slots() reads the schedule (pure data) and gives
each (chunk, microbatch) the lowest free copy. Each copy has its own sample input tensors (torch
uses them as the static input buffer, which each replay overwrites: shared, slot 1's forward would
overwrite the input that slot 0's backward still reads) and is captured with its own memory pool,
since graphs sharing a pool are only safe when replayed in capture order, which a 1F1B schedule
is not.

Static gradients. Each captured backward writes every parameter's gradient into its own output
buffer before autograd adds it into .grad, so a stage holds one gradient-sized buffer per slot
(Megatron accumulates into the main gradient inside the capture instead): pp copies on the first
stage of 1F1B. The GPU check's stage-v4 item (scripts/gpu_check.py) measures what that costs.

Random numbers. Dropout draws from the default CUDA generator, which PyTorch registers with every
capture: each replay advances its Philox offset, so every replay draws fresh masks (01's TPRandom
is off at tp = 1 precisely so that nothing swaps generator states inside a capture). The fused
dropout kernel reads its seed through a pointer from a tensor drawn inside the graph, for the
same reason.
"""

import torch
import torch.distributed as dist
import torch.nn as nn


def slots(actions):
    """{(chunk, mb): slot} and {chunk: number of slots} for one rank's action list: a forward
    takes the lowest slot its chunk has free, its backward frees it. Forward-only lists (eval)
    never free: every microbatch gets its own slot."""
    used, assigned, count = {}, {}, {}
    for a in actions:
        key = (a.chunk, a.mb)
        if a.kind == "F":
            taken = used.setdefault(a.chunk, set())
            s = min(set(range(len(taken) + 1)) - taken)
            taken.add(s)
            assigned[key] = s
            count[a.chunk] = max(count.get(a.chunk, 0), s + 1)
        elif a.kind == "B":
            used[a.chunk].discard(assigned[key])
    return assigned, count


class _Slot(nn.Module):
    """One capturable copy of a chunk's forward; make_graphed_callables patches this wrapper's
    forward, not the chunk's. The last chunk returns only the loss: capturing the logits as an
    output would allocate, and run backward through, a (B, T, V) gradient of zeros."""

    def __init__(self, chunk, last):
        super().__init__()
        self.chunk, self.last = chunk, last

    def forward(self, x, *targets):
        out = self.chunk(x, *targets)
        return out[1] if self.last else out


class GraphedChunk(nn.Module):
    """A chunk for 02's executor, whose calls replay the captured graphs: its k-th call in a step is
    the k-th forward of this chunk in the rank's list, so it knows the microbatch, hence the slot."""

    def __init__(self, chunk, graphed, slot_per_call, last):
        super().__init__()
        self.chunk, self.graphed, self.slot_per_call, self.last, self.calls = chunk, graphed, slot_per_call, last, 0

    def forward(self, x, targets=None):
        slot = self.slot_per_call[self.calls % len(self.slot_per_call)]
        self.calls += 1
        if self.last:
            return None, self.graphed[slot](x, targets)  # the shape of GPT's (logits, loss); logits not kept
        return self.graphed[slot](x)


class StageGraphs:
    """This rank's chunks, each captured once per slot; .chunks replace them in 02's executor, whose
    forward calls replay the forward graphs; autograd then replays the matching backward graph when
    the executor runs that microbatch's backward."""

    def __init__(self, chunks, actions, last, samples):
        """last: the chunk index holding the loss (None if not on this rank); samples[c]: example
        (x, targets) of chunk c's real shapes and dtypes (x requires grad unless it is token ids)."""
        slot_of, counts = slots(actions)
        self.chunks = []
        for c, chunk in enumerate(chunks):
            graphed = []
            for _ in range(counts.get(c, 0)):  # separate calls: separate memory pools (see the docstring)
                # Each slot its own sample tensors: they become the graph's static input buffers,
                # which every replay overwrites, and the microbatch in a slot holds until its backward.
                x, targets = (t.detach().clone().requires_grad_(t.requires_grad) for t in samples[c])
                args = (x, targets) if c == last else (x,)
                graphed.append(torch.cuda.make_graphed_callables(_Slot(chunk, c == last), args))
            order = [slot_of[c, a.mb] for a in actions if a.kind == "F" and a.chunk == c]
            self.chunks.append(GraphedChunk(chunk, graphed, order, c == last))
        self.captured = sum(len(g.graphed) for g in self.chunks)


class Graphed:
    """05's forward_backward(run, micro, valid, norm), replayed from CUDA graphs captured at the
    first step, when real batches give the shapes (the one seam 05 has for graphs). mode "stage":
    StageGraphs' chunks through 02's executor, nothing left in flight (a graph rewrites its outputs at
    its next replay); "step": the whole step as one StepGraph, for tp = pp = dp = 1."""

    def __init__(self, mode, eager, result):
        self.mode, self.eager, self.result, self.graph = mode, eager, result, None

    def __call__(self, run, micro, valid, norm=None):
        if self.mode is None:  # a capture failed: eager from then on
            return self.eager(run, micro, valid, norm)
        if self.graph is None:
            try:
                self.graph = self.capture(run, micro)
            except Exception as e:  # noqa: BLE001 (whatever the capture raised, training goes on eagerly)
                return self.fall_back(run, micro, valid, norm, e)
        if self.mode == "step":
            return self.result(self.graph.replay(micro), [], 0, 0, 0)
        return self.eager(run, micro, valid, norm, chunks=self.graph.chunks, plain=True)

    def capture(self, run, micro):
        if self.mode == "step":
            run.ddp.sync = False  # the hooks ran at capture: the buckets are reduced after it, in finish()
            return StepGraph(run.chunks[0], micro, run.ddp, per_token=run.tc.loss_normalization == "token")
        pp_rank, v = dist.get_rank(run.groups.pp), len(run.chunks)
        samples = {c: (micro[0][0] if c == 0 and pp_rank == 0 else torch.randn(
            run.act_shape, dtype=run.dtype, device=run.env.device, requires_grad=True), micro[0][1])
            for c in range(v)}
        return StageGraphs(run.chunks, run.schedule, v - 1 if pp_rank == run.tc.pp - 1 else None, samples)

    def fall_back(self, run, micro, valid, norm, error):
        """Some operations cannot be captured: above 3,072 token ids per microbatch, for one, torch's
        embedding backward sorts them and synchronises inside (pytorch issue 82886). This rank then
        trains eagerly, as with --no-cuda-graphs, from this very step. What the failed capture left
        behind is undone first: its warm-up ran the gradient hooks (the step graph's with sync off),
        so their bookkeeping is reset, and side-stream work is waited for."""
        what = "the whole step" if self.mode == "step" else "the stage's chunks"
        while error.__cause__ or error.__context__:  # the first failure: capture_end's error follows it
            error = error.__cause__ or error.__context__
        # The first line: torch's CUDA errors add lines of advice (CUDA_LAUNCH_BLOCKING=1, ...) below.
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"CUDA graphs: capturing {what} failed on rank {dist.get_rank()} ({reason}); this rank trains "
              f"without graphs from this step on, as with --no-cuda-graphs", flush=True)
        if run.env.device.type == "cuda":
            torch.cuda.synchronize(run.env.device)
        self.mode, self.graph = None, None
        run.ddp.sync = True
        run.ddp.zero_grad()
        return self.eager(run, micro, valid, norm)


class StepGraph:
    """The whole step's forward and backward over m microbatches, for tp = pp = dp = 1. The
    gradients go wherever the parameters' hooks put them (04's flat buffer); the loss is the
    token-weighted mean (per_token; else the microbatches' means, averaged: docs/LOSS.md), computed
    on the device so that nothing reads a value back in the graph."""

    WARMUP = 3  # eager iterations on a side stream before capture, as torch.cuda.graph requires

    def __init__(self, chunk, micro, ddp, ignore_index=-100, per_token=True):
        self.chunk, self.ddp, self.ignore_index, self.per_token = chunk, ddp, ignore_index, per_token
        self.static = [(i.clone(), t.clone()) for i, t in micro]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP):
                self._step()
                ddp.zero_grad()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self._step()
        # The hooks ran once, at capture; a replay repeats their writes but not their bookkeeping.
        # Parameters that got no gradient then get none at any replay.
        self.unused = set(ddp.unwritten)
        ddp.zero_grad()

    def _step(self):
        valid = [t != self.ignore_index for _, t in self.static]
        n_valid = sum(v.sum() for v in valid)
        total = torch.zeros((), device=self.static[0][0].device, dtype=torch.float32)
        for (idx, targets), v in zip(self.static, valid):
            loss = self.chunk(idx, targets)[1] * (v.sum() / n_valid if self.per_token else 1 / len(valid))
            loss.backward()
            total += loss.detach().float()
        return total

    def replay(self, micro):
        """Copy the microbatches in, replay; returns the loss (a device scalar)."""
        for (idx, targets), (i, t) in zip(self.static, micro):
            idx.copy_(i)
            targets.copy_(t)
        self.graph.replay()
        self.ddp.unwritten = set(self.unused)  # as if the hooks had run: every used gradient written
        return self.loss
