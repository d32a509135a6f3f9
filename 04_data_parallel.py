"""04 - Data parallelism from scratch: naive, bucketed and overlapped, and ZeRO-1.

What this file adds on top of 01: dp replicas of the model each see 1/dp of the batch; averaging their gradients
keeps them identical and trains them like one model on the whole batch.
  - The lesson, read first, every collective inline: 1. naive (Li et al. 2020, Section 3.2): every gradient
    all-reduced after backward; 2. bucketed and overlapped (PyTorch DDP): a flat buffer in reverse parameter order
    whose buckets all-reduce asynchronously during the last microbatch's backward, each once its last gradient is in
    (no_sync before); 3. ZeRO-1 (Rajbhandari et al. 2020, stage 1): AdamW's state for 1/dp of the buffer per rank,
    then an all-gather. Each microbatch's loss weighs its counted targets over the global count (docs/LOSS.md).
  - The machine, read second, which 05-09, kernels/ and plumbing/ build on: BucketedDDP and FlatAdamW.

Run it:
    python 04_data_parallel.py                    # dp=4 CPU ranks
    python 04_data_parallel.py --dp 2 --bucket-numel 1000 --steps 5
    torchrun --nproc-per-node 8 04_data_parallel.py --dp 8

The demo trains a few AdamW steps the lesson's three ways, then the machine's, against serial training in float64 on
unevenly masked replicas (within 1e-10; the machine against the lesson, 1e-12; else exit 1), and prints when each
bucket's reduction launched, every replica's checksum and the optimizer state per rank.
"""
import importlib
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from plumbing import ddp_demo, demos  # the demo's flags, checks, serial reference and machine part; its reports
from plumbing.ddp_demo import DemoConfig, check_world, counted, differences, parser, prove_machine, training_reference
from plumbing.launch import printer, run_main
from plumbing.replicas import by_replicas  # who holds a parameter's copies: dp, or its own .replica_group (09's)

tensor_parallel = importlib.import_module("01_tensor_parallel")


# ----------------------------------------------------------------------------------------------
# Read first: the lesson and its demo. Every rank of `group` is a replica holding the whole model, on its rows of B.


def shard_batch(idx, targets, dp, dp_rank):
    """This replica's rows of the global batch (B, T)."""
    if idx.shape[0] % dp:
        raise ValueError(f"the global batch of {idx.shape[0]} sequences is not divisible by dp={dp}")
    return idx.chunk(dp)[dp_rank], targets.chunk(dp)[dp_rank]


def allreduce_gradients(params, group):
    """After backward: every gradient summed over the replicas and divided by dp, one by one."""
    dp = dist.get_world_size(group)
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dp)


def replica_loss_weights(microbatches, group, ignore_index=-100):
    """Microbatch i's mean loss weighs valid_i dp / n, n the GLOBAL batch's count of counted targets (one
    all-reduce), so that the gradients' average over dp is serial's per-token mean however unevenly the
    replicas count (docs/LOSS.md); one counting none weighs 0. A replica's own mean would not do."""
    valid = [int((t != ignore_index).sum()) for _, t in microbatches]
    n = tensor_parallel.all_reduce(torch.tensor(sum(valid), device=microbatches[0][1].device), group)
    return [v * dist.get_world_size(group) / int(n) if v else 0.0 for v in valid]


class DDP:
    """Li et al. 2020's DDP: gradients into one flat buffer, parameters in reverse order (backward's), cut into
    buckets of bucket_numel elements. A hook per parameter adds its gradient in, divided by dp; under sync (the
    last microbatch) a bucket whose last gradient is in starts its all-reduce, async, while backward goes on."""

    def __init__(self, params, group, bucket_numel):
        self.params, self.group, self.dp = list(params)[::-1], group, dist.get_world_size(group)
        self.offset, n = {}, 0
        for p in self.params:  # last layer first
            self.offset[p], n = n, n + p.numel()
        self.grads = self.params[0].new_zeros(-(-n // self.dp) * self.dp)  # padded: ZeRO-1's dp equal shards
        self.buckets = [(lo, min(lo + bucket_numel, n)) for lo in range(0, n, bucket_numel)]
        self.buckets_of = {p: [i for i, (lo, hi) in enumerate(self.buckets)
                               if lo < self.offset[p] + p.numel() and self.offset[p] < hi] for p in self.params}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.hook)
        self.sync = True  # False while accumulating: a microbatch before the step's last
        self.zero_grad()

    def view(self, p):  # p's elements of the flat gradient buffer
        return self.grads[self.offset[p]:self.offset[p] + p.numel()]

    def zero_grad(self):
        self.grads.zero_()
        self.pending, self.works = [sum(i in b for b in self.buckets_of.values()) for i in range(len(self.buckets))], []
        for p in self.params:  # the next backward writes a fresh .grad for the hook
            p.grad = None

    def hook(self, p):  # p.grad holds this microbatch's gradient
        self.view(p).add_(p.grad.reshape(-1), alpha=1 / self.dp)  # summed over dp: the average
        p.grad = None
        if not self.sync:
            return  # accumulating: no communication before the last microbatch
        for i in self.buckets_of[p]:
            self.pending[i] -= 1
            if self.pending[i] == 0:  # the bucket's last gradient: launch, and return to backward
                bucket = self.grads[self.buckets[i][0]:self.buckets[i][1]]
                self.works.append(dist.all_reduce(bucket, group=self.group, async_op=True))

    def finish(self):
        """After the last backward: wait for every bucket; each .grad is then a view of the average."""
        if any(self.pending):
            raise RuntimeError(f"buckets {[i for i, k in enumerate(self.pending) if k]} never got all gradients")
        for work in self.works:
            work.wait()
        for p in self.params:
            p.grad = self.view(p).view_as(p)


class ZeRO1:
    """ZeRO-1 (Rajbhandari et al. 2020, P_os) on a DDP's flat buffer: rank r keeps AdamW's state for its 1/dp,
    elements [r s, (r+1) s), only. step() after ddp.finish(): AdamW on that shard of the average, then an
    all-gather of every rank's updated shard into every replica (the machine reduce-scatters: half the bytes)."""

    def __init__(self, ddp, **adamw):
        self.ddp, s = ddp, len(ddp.grads) // ddp.dp
        self.lo, self.hi = dist.get_rank(ddp.group) * s, (dist.get_rank(ddp.group) + 1) * s
        self.flat = torch.zeros_like(ddp.grads)  # the parameters, laid out as the gradients
        for p in ddp.params:
            self.flat[ddp.offset[p]:ddp.offset[p] + p.numel()] = p.detach().reshape(-1)
        self.shard = self.flat[self.lo:self.hi].clone()  # what this rank's AdamW updates
        self.adamw = torch.optim.AdamW([self.shard], **adamw)  # its two moments: 1/dp of plain AdamW's

    def step(self):
        self.shard.grad = self.ddp.grads[self.lo:self.hi]
        self.adamw.step()
        dist.all_gather(list(self.flat.chunk(self.ddp.dp)), self.shard, group=self.ddp.group)  # rank r's into [r s, ..)
        for p in self.ddp.params:
            p.data.copy_(self.flat[self.ddp.offset[p]:self.ddp.offset[p] + p.numel()].view_as(p))


def train_step(model, ddp, opt, microbatches, group):
    """One AdamW step of this replica on its microbatches [(idx, targets)]: naive (ddp None) reduces every
    gradient after backward; a DDP during the last microbatch's backward. Returns the global batch's loss."""
    total = 0.0
    for i, ((x, y), w) in enumerate(zip(microbatches, replica_loss_weights(microbatches, group))):
        if ddp is not None:
            ddp.sync = i == len(microbatches) - 1  # accumulate; reduce during the last backward only
        loss = model(x, y)[1] * w
        loss.backward()
        total = total + loss.detach()
    allreduce_gradients(model.parameters(), group) if ddp is None else ddp.finish()
    opt.step()
    (opt if ddp is None else ddp).zero_grad()
    return float(tensor_parallel.all_reduce(total, group)) / dist.get_world_size(group)


def train_lesson(env, cfg, args, mode, group, full, batches):
    """One AdamW step per batch of this replica, from the full weights: "naive", "bucketed" (DDP) or "zero1"
    (DDP and ZeRO1). Returns the losses and the parameters after the steps."""
    dp, dp_rank = dist.get_world_size(group), dist.get_rank(group)
    model = tensor_parallel.ParallelGPT(cfg, None, dtype=torch.float64, device=env.device)
    model.load_state_dict({**full, "lm_head.weight": full["transformer.wte.weight"]})  # tp 1: the serial names
    ddp = None if mode == "naive" else DDP(model.parameters(), group, args.bucket_numel)
    adamw = dict(lr=args.lr, weight_decay=0.1)
    opt = ZeRO1(ddp, **adamw) if mode == "zero1" else torch.optim.AdamW(model.parameters(), **adamw)
    losses = []
    for idx, targets in batches:
        rows = shard_batch(idx.to(env.device), targets.to(env.device), dp, dp_rank)
        losses.append(train_step(model, ddp, opt, list(zip(*(t.chunk(args.microbatches) for t in rows))), group))
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}


def demo(env, cfg, args):
    dp, say = args.dp, printer(env)
    check_world(env.world_size, dp, args.batch_size, args.microbatches)  # before the first collective
    group = dist.new_group(list(range(dp)), timeout=timedelta(seconds=60))
    batches, full, ref_losses, ref_params = training_reference(cfg, args)  # the same on every rank
    say(f"{cfg}\ndp={dp} steps={args.steps} global batch B={args.batch_size} (m={args.microbatches} "
        f"microbatches per replica) T={args.seq_len} bucket={args.bucket_numel} elements, float64")
    say(f"targets counted per replica and microbatch, step 1: {counted(batches[0][1], dp, args.microbatches)}")
    ok, lessons = True, {}
    for mode in ("naive", "bucketed", "zero1"):
        lessons[mode] = train_lesson(env, cfg, args, mode, group, full, batches)
        worst = differences(lessons[mode], (ref_losses, ref_params))
        say(f"the lesson, {mode}: max relative difference against serial (the losses and every parameter after "
            f"{args.steps} steps): {worst:.2e} {'PASS' if worst <= 1e-10 else 'FAIL'} (tolerance 1e-10)")
        ok &= worst <= 1e-10
    return prove_machine(env, cfg, args, group, (batches, full, ref_losses, ref_params), lessons, say) and ok


# ----------------------------------------------------------------------------------------------
# Read second: the machine, the lesson's DDP and ZeRO1 in the general form 05-09 build on (ZeRO-1 as a reduce-scatter
# per bucket, bf16 weights with fp32 gradients and masters, replica groups, a pipeline's hooks); then train_replica.


class BucketedDDP:
    """Gradients into one flat buffer (reverse parameter order), in buckets of `bucket_numel`. Under sync (the last
    microbatch) a bucket's reduction starts once its last gradient is in (overlap=False: in finish()); zero: ZeRO-1."""

    clock = time.perf_counter  # what the events are timed by (05's --trace sets its own)

    def __init__(self, params, group, bucket_numel, zero=False, overlap=True, grad_dtype=None):
        if bucket_numel <= 0:
            raise ValueError(f"the bucket size must be positive, got bucket_numel={bucket_numel}")
        self.params = [p for p in params if p.requires_grad]
        self.group, self.dp, self.zero, self.overlap = group, dist.get_world_size(group), zero, overlap
        self.offsets, self.buckets, self.bucket_groups, total = {}, [], [], 0
        for replicas, ps in by_replicas(self.params[::-1], group).items():  # last layers first: backward's order
            start, size = total, dist.get_world_size(replicas) if zero else 1  # ZeRO: a bucket in equal shards
            for p in ps:
                self.offsets[p], total = total, total + p.numel()
            step, total = -(-bucket_numel // size) * size, start + -(-(total - start) // size) * size  # padded
            self.buckets += [(lo, min(lo + step, total)) for lo in range(start, total, step)]
            self.bucket_groups += [replicas] * (len(self.buckets) - len(self.bucket_groups))
        self.grad_buffer = torch.zeros(total, dtype=grad_dtype or self.params[0].dtype, device=self.params[0].device)
        # The parameters move into a flat buffer of the same layout (ZeRO-1 all-gathers its buckets).
        self.param_buffer = torch.zeros(total, dtype=self.params[0].dtype, device=self.params[0].device)
        self.buckets_of, self.index, self.views = {}, {p: i for i, p in enumerate(self.params)}, {}
        for p in self.params:
            lo = self.offsets[p]
            p.data = self.param_buffer[lo:lo + p.numel()].view_as(p).copy_(p.detach())
            self.views[p] = self.grad_buffer[lo:lo + p.numel()].view_as(p)
            self.buckets_of[p] = [i for i, (a, b) in enumerate(self.buckets) if a < lo + p.numel() and lo < b]
            p.register_post_accumulate_grad_hook(self._on_grad)
        self.counts = [sum(1 for p in self.params if i in self.buckets_of[p]) for i in range(len(self.buckets))]
        self.sync = True  # False while accumulating: a microbatch before the step's last
        self.zero_grad()

    def zero_grad(self):
        for p in self.params:  # the buffer is not cleared (see _on_grad)
            p.grad = None
        self.unwritten, self.pending = set(self.params), list(self.counts)
        self.works, self.events = {}, []  # events: ("ready", param index) / ("launch", bucket), at clock()

    def _on_grad(self, p):
        # Into the flat buffer (fp32 for bf16 weights), divided by dp: summed over replicas, it is their average.
        # A step's first write overwrites (DDP's trick: no clearing pass); later microbatches add.
        view = self.views[p]
        view.copy_(p.grad).mul_(1 / self.dp) if p in self.unwritten else view.add_(p.grad, alpha=1 / self.dp)
        self.unwritten.discard(p)
        p.grad = None
        if not self.final(p):
            return  # accumulating: synchronise only on the last microbatch
        self.events.append(("ready", self.index[p], self.clock()))
        for i in self.buckets_of[p]:
            self.pending[i] -= 1
            if self.pending[i] == 0 and self.overlap:
                self._launch(i)

    def final(self, p):  # whether p's gradient is now final for this step (PipelineDDP counts microbatches)
        return self.sync

    def _launch(self, i):
        bucket, group = self.grad_buffer[slice(*self.buckets[i])], self.bucket_groups[i]
        self.events.append(("launch", i, self.clock()))
        if self.zero:
            shard = bucket.new_empty(bucket.numel() // dist.get_world_size(group))
            self.works[i] = (tensor_parallel.reduce_scatter_single(shard, bucket, group, async_op=True), shard)
        else:
            self.works[i] = (dist.all_reduce(bucket, group=group, async_op=True), None)

    def finish(self):
        """Launch what is left (after a pipeline flush), wait for each bucket: .grad (ZeRO-1: the shard's) is the mean."""
        for p in self.unwritten:  # no gradient this step (unused): zero, not last step's
            self.views[p].zero_()
        for i in sorted(set(range(len(self.buckets))) - self.works.keys()):  # in order: as on every replica
            self._launch(i)
        for i, (work, shard) in self.works.items():
            work.wait()
            if shard is not None:
                self.grad_buffer[slice(*self.shard_range(i))].copy_(shard)
        for p in [] if self.zero else self.params:  # .grad: a view of the buffer, for optimizers that read it
            p.grad = self.main_grad(p) if self.grad_buffer.dtype == p.dtype else None  # bf16: FlatAdamW's fp32

    def main_grad(self, p):  # where p's gradient accumulates (divided by dp): its view of the flat buffer
        return self.views[p]

    def shard_range(self, i):  # the elements [a, b) of bucket i this rank owns: its 1/dp under ZeRO-1, else all
        (lo, hi), replicas = self.buckets[i], self.bucket_groups[i]
        n, r = (hi - lo) // dist.get_world_size(replicas), dist.get_rank(replicas)
        return (lo + r * n, lo + (r + 1) * n) if self.zero else (lo, hi)


@dataclass
class Piece:  # the elements of one parameter that this rank's optimizer owns, as views of the buffers
    param: torch.nn.Parameter  # the parameter they belong to
    weights: torch.Tensor  # in the flat parameter buffer
    master: torch.Tensor  # what AdamW updates: `weights` itself, or their fp32 copy (bf16, fp16)
    grad: torch.Tensor  # in the flat gradient buffer


class FlatAdamW:
    """AdamW over the elements of the flat buffer this rank owns: under ZeRO-1 its 1/dp of every bucket (then
    all-gathered: 1/dp of plain data parallelism's state per rank), else all. Low-precision weights get fp32 masters."""

    def __init__(self, ddp, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, no_decay=()):
        self.ddp, no_decay = ddp, {id(p) for p in no_decay}
        self.gathers, self.pieces, groups = {}, [], {True: [], False: []}  # gathers: bucket -> (work, shard)
        for i in range(len(ddp.buckets)):
            a, b = ddp.shard_range(i)
            for p in ddp.params:  # the pieces of parameters that fall into this shard
                lo, hi = max(a, ddp.offsets[p]), min(b, ddp.offsets[p] + p.numel())
                if lo < hi:
                    weights = ddp.param_buffer[lo:hi]
                    master = weights.float().clone() if weights.dtype in (torch.float16, torch.bfloat16) else weights
                    self.pieces.append(Piece(p, weights, master, ddp.grad_buffer[lo:hi]))
                    groups[id(p) not in no_decay].append(master)
        self.optimizer = torch.optim.AdamW(
            [{"params": groups[True], "weight_decay": weight_decay}, {"params": groups[False], "weight_decay": 0.0}],
            lr=lr, betas=betas, eps=eps)

    def step(self):
        self.wait_gather()  # a gather in flight writes where the masters are copied to
        for piece in self.pieces:
            piece.master.grad = piece.grad.to(piece.master.dtype)
        self.optimizer.step()
        for piece in self.pieces:  # the masters back into the weights (a tensor copied onto itself: nothing)
            piece.weights.copy_(piece.master)
        ddp = self.ddp  # ZeRO-1: every rank's shard to every rank, from the buffer's end: the first layers, used first
        for i, (lo, hi) in reversed(list(enumerate(ddp.buckets)) if ddp.zero else []):
            mine = ddp.param_buffer[slice(*ddp.shard_range(i))].clone()
            work = tensor_parallel.all_gather_single(ddp.param_buffer[lo:hi], mine, ddp.bucket_groups[i], async_op=True)
            self.gathers[i] = (work, mine)
        self.after_step()

    def after_step(self):  # the updated weights are all there when step() returns (OverlappedGather: not yet)
        self.wait_gather()

    def wait_gather(self, buckets=None):  # wait for the all-gathers in flight of `buckets` (None: every one)
        for i in (self.gathers.keys() if buckets is None else buckets) & self.gathers.keys():
            self.gathers.pop(i)[0].wait()


def train_replica(env, cfg, args, mode, group, full, batches, *, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1):
    """train_lesson on the machine: from the full weights `full`, in float64, one AdamW step of this replica
    (lr args.lr, and betas, eps, weight_decay on every parameter) per global batch (idx, targets) of
    `batches`, on its rows (shard_batch) in args.microbatches accumulation steps, in `mode`: naive (the
    lesson's allreduce_gradients), bucketed (BucketedDDP, buckets of args.bucket_numel) or zero1
    (BucketedDDP(zero=True) and FlatAdamW), each counted target weighing 1/n (replica_loss_weights).
    Returns a 5-tuple: the losses (one float a batch: the global batch's mean loss, the same on every
    replica), the parameters after the last step ({name: float64 CPU tensor}, full shapes), the last
    backward's bucket timeline ((start, end, BucketedDDP.events, number of buckets); None when naive),
    the optimizer, and the weights' checksum (demos.checksum: equal on replicas that agree to the bit)."""
    dp, dp_rank = dist.get_world_size(group), dist.get_rank(group)
    model = tensor_parallel.GPT(cfg, None, init=False, dtype=torch.float64, device=env.device)
    model.load_full_state_dict(full)
    adamw = dict(lr=args.lr, betas=betas, eps=eps, weight_decay=weight_decay)
    ddp = None if mode == "naive" else BucketedDDP(model.parameters(), group, args.bucket_numel, zero=mode == "zero1")
    opt = FlatAdamW(ddp, **adamw) if mode == "zero1" else torch.optim.AdamW(model.parameters(), **adamw)
    losses, timeline = [], None
    for idx, targets in batches:
        rows = shard_batch(idx.to(env.device), targets.to(env.device), dp, dp_rank)
        micro = list(zip(*(t.chunk(args.microbatches) for t in rows)))
        total = torch.zeros((), dtype=torch.float64, device=env.device)  # NCCL reduces device tensors only
        for i, ((x, y), w) in enumerate(zip(micro, replica_loss_weights(micro, group))):
            if ddp:
                ddp.sync = i == len(micro) - 1  # accumulate; reduce only on the last microbatch
            loss = model(x, y)[1] * w
            start = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            total += loss.detach()
        if ddp:
            ddp.finish()
            timeline = (start, end, ddp.events, len(ddp.buckets))
        else:
            allreduce_gradients(model.parameters(), group)
        opt.step()
        ddp.zero_grad() if ddp else opt.zero_grad()
        losses.append(float(tensor_parallel.all_reduce(total, group) / dp))
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}, timeline, opt, demos.checksum(model)


# ----------------------------------------------------------------------------------------------
# After the concept: PipelineDDP and OverlappedGather, 05's (MegaScale, Jiang et al. 2024, Section 3.3), subclass
# the machine in plumbing/pipeline_ddp.py; then serial training, the demo's reference.


def __getattr__(name):  # data_parallel.PipelineDDP and .OverlappedGather: plumbing/pipeline_ddp.py imports this file
    if name in ("PipelineDDP", "OverlappedGather"):
        return getattr(importlib.import_module("plumbing.pipeline_ddp"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def serial_training(cfg, args, full, batches, *, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1):
    """The reference: the same AdamW steps (lr args.lr, and betas, eps, weight_decay on every parameter)
    on one serial float64 model from `full`, one per whole batch (idx, targets) of `batches`. Returns
    (the losses, one float a batch; {name: parameter} of the model after the last step)."""
    model = tensor_parallel.GPT(cfg, None, init=False, dtype=torch.float64)
    model.load_full_state_dict(full)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=betas, eps=eps, weight_decay=weight_decay)
    losses = []
    for idx, targets in batches:
        loss = model(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


if __name__ == "__main__":
    run_main(lambda: ddp_demo.main(demo))
