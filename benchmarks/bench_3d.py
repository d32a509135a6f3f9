"""3D step time: our tp x pp x dp trainer (05_3d_gpt.py) against PyTorch's own 3D composition.

One full training step of 05's trainer (tp=2 x pp=2 x dp=2, 8 CPU ranks) against PyTorch's
composition on a 3-D DeviceMesh (DTensor TP, DDP or FSDP2, pipelining); ours also without
scatter/gather.
benchmarks/README.md has what each side runs, the checks and the method.

Run it (from the repository root; it starts its own ranks, do not use torchrun):
    python benchmarks/bench_3d.py                        # default: about 2-2.5 minutes on 2 cores
    python benchmarks/bench_3d.py --profile              # plus where the time goes on rank 0
    python benchmarks/bench_3d.py --contenders ours torch-ddp --repeats 7
    python benchmarks/bench_3d.py --loss gathered        # peer: gathered logits, plain loss
    python benchmarks/bench_3d.py --zero1                # ours with ZeRO-1 (FlatAdamW)
"""
import contextlib
import logging
import math
import os
import statistics
import time
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

import bench_tp  # the peer's transformer block: plain nn modules, head-major fused QKV
import harness
from harness import gpt3d, pipeline, tensor_parallel
from plumbing.checks import check_config
from plumbing.data import global_batch, load_tokens, replica_batch, split_tokens
from plumbing.trace import trace_comm

CONTENDERS = ("ours", "ours-nosg", "torch-ddp", "torch-fsdp")

# float32 throughout. The layouts only reorder sums (sharded GEMMs, m microbatches against one
# batch, a different all-reduce tree), so the step-1 loss agrees to ~1e-7 and the gradient norm
# to ~1e-6. Step 2 goes through AdamW, whose first update is about lr * sign(g): an element whose
# gradient is ~0 can move by lr on one side and not the other, so step 2 gets a looser bound. A real
# mistake (a missing 1/m or 1/dp, an unsynchronised tied weight, a replicated weight counted twice
# in the norm, a wrong head layout) shows up at 1e-3 or more.
LOSS_RTOL = (1e-5, 1e-4)  # step 1, step 2
NORM_RTOL = (1e-4, 1e-3)


# ----------------------------------------------------------------------------------------------
# torch's side, the model: plain serial nn.Linear / nn.Embedding / nn.LayerNorm stage modules, the
# layers parallelize_module knows how to shard; the blocks are bench_tp's PeerBlock. Parameter
# names follow 01's GPT ("transformer." dropped), so one full state dict loads both.


class TorchStage(nn.Module):
    """One pipeline stage of GPT-2: the embeddings on the first, ln_f and the output layer (a copy
    of wte, as in Megatron) on the last. Returns the hidden state, or on the last stage the logits
    (torch's schedule applies the loss_fn to them)."""

    def __init__(self, cfg, layers, first, last):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleDict({str(i): bench_tp.PeerBlock(cfg, "fused") for i in layers})
        if last:
            self.ln_f = nn.LayerNorm(cfg.n_embd, eps=1e-5)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.h.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x

    @torch.no_grad()
    def load_full(self, full, cfg):
        """Copy this stage's part of 01's full (serial) state dict in."""
        hs = cfg.n_embd // cfg.n_head
        for name, p in self.named_parameters():
            src = "transformer.wte.weight" if name == "lm_head.weight" else "transformer." + name
            t = full[src]
            if ".attn.c_attn." in name:  # 01 stores (three nh hs); here it is head-major
                t = rearrange(t, "(three nh hs) ... -> (nh three hs) ...", three=3, hs=hs)
            p.copy_(t)


def tp_plan(stage, loss):
    """torchtitan's TP plan without sequence parallelism: every Linear sharded, norms replicated."""
    plan = {}
    if stage.first:
        # Vocab rows split, lookups masked, one all-reduce: the same as 01's VocabParallelEmbedding.
        plan["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if stage.last:
        # parallel: keep the logits vocab-sharded as a DTensor for loss_parallel(); gathered:
        # all-gather them into plain replicated logits for a plain cross-entropy.
        parallel = loss == "parallel"
        plan["lm_head"] = ColwiseParallel(input_layouts=Replicate(),
                                          output_layouts=Shard(-1) if parallel else Replicate(),
                                          use_local_output=not parallel)
    for i in stage.h:
        plan.update({f"h.{i}.attn.c_attn": ColwiseParallel(), f"h.{i}.attn.c_proj": RowwiseParallel(),
                     f"h.{i}.mlp.c_fc": ColwiseParallel(), f"h.{i}.mlp.c_proj": RowwiseParallel()})
    return plan


# ----------------------------------------------------------------------------------------------
# torch's side, the composition: TP inside a stage, DDP or FSDP2 across replicas, pipelining across
# stages, then clipping and AdamW.


def microbatch_loss(m):
    """The loss_fn: a microbatch's mean cross-entropy divided by m, so that the summed gradients
    are the batch mean's (what ours does: each microbatch loss weighted by its token share).
    Under loss_parallel() F.cross_entropy dispatches to the vocab-parallel cross-entropy."""
    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) / m
    return loss_fn


class TorchRun:
    """This rank's stage of PyTorch's 3D composition and its optimizer; step() mirrors 05's
    train_step: pipeline, tied embeddings, clipping, AdamW, the batch's mean loss on every rank."""

    def __init__(self, cfg, tc, mesh, full, data_parallel, loss, embed_group):
        pp_group = mesh["pp"].get_group()
        pp, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        layers = pipeline.split_layers(cfg.n_layer, pp)[pp_rank]
        stage = TorchStage(cfg, layers, first=pp_rank == 0, last=pp_rank == pp - 1)
        stage.load_full(full, cfg)
        parallelize_module(stage, mesh["tp"], tp_plan(stage, loss))
        # Which parameters tp splits (each rank holds a different slice) and which it replicates:
        # read now, before DDP turns the DTensors into local tensors.
        self.tp_split = {n for n, p in stage.named_parameters()
                         if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)}
        if data_parallel == "ddp":
            # With device_mesh (not process_group) DDP knows the parameters are TP DTensors: it
            # swaps them for their local shards (what it reduces) and wraps those back into
            # DTensors in a forward pre-hook. With process_group= it fails (3d_results.md).
            module = DistributedDataParallel(stage, device_mesh=mesh["dp"])
        else:
            for block in stage.h.values():
                fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
            module = fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=False)
        self.stage, self.tc, self.loss_kind, self.embed_group = stage, tc, loss, embed_group
        self.tp_group, self.pp_group, self.dp_group = (mesh[k].get_group() for k in ("tp", "pp", "dp"))
        self.pipeline = PipelineStage(module, pp_rank, pp, torch.device("cpu"), group=pp_group)
        # The loss is divided by m before backward, and scale_grads=False. torch's default (a mean
        # loss, scale_grads=True: the gradients divided by m after the last backward) is wrong
        # with DDP + TP: DDP's forward pre-hook puts the DTensor parameters (TP weights, row-parallel
        # biases) back as plain DTensor attributes, so they drop out of stage.parameters() after
        # the first forward and scale_grads skips them (their gradients come out m times too
        # large; the norm check catches it).
        self.schedule = Schedule1F1B(self.pipeline, tc.microbatches, loss_fn=microbatch_loss(tc.microbatches),
                                     scale_grads=False)
        # Taken now, before the first forward (see above): these are the tensors that receive the
        # gradients, that DDP reduces and that AdamW updates.
        self.params = dict(stage.named_parameters())
        # The last stage's lm_head is the first stage's wte again: counted once in the norm.
        self.in_norm = {n: p for n, p in self.params.items() if not (n == "lm_head.weight" and not stage.first)}
        decay = [p for p in self.params.values() if p.dim() >= 2]
        no_decay = [p for p in self.params.values() if p.dim() < 2]  # 05's weight-decay groups
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=tc.lr, betas=(0.9, 0.95))

    def pipeline_step(self, idx, targets):
        """The whole replica batch in; the schedule cuts it into m microbatches along dim 0 (the
        same rows as 02's split_batch). Returns the microbatch losses on the last stage."""
        st = self.stage
        losses = [] if st.last else None
        ctx = loss_parallel() if self.loss_kind == "parallel" else contextlib.nullcontext()
        with ctx:  # loss_parallel must also cover the backward, which the schedule runs inside
            self.schedule.step(*((idx,) if st.first else ()), target=targets if st.last else None,
                               losses=losses, return_outputs=False)
        return losses

    def sync_tied(self):
        """Sum the two wte copies' gradients (first and last stage), as 02's sync_tied_embeddings."""
        for name in ("wte.weight", "lm_head.weight"):
            if name in self.params and self.embed_group is not None:
                g = self.params[name].grad
                dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=self.embed_group)

    def clip(self):
        """The global gradient norm (every element once) and clipping to tc.grad_clip."""
        sq = torch.zeros((), dtype=torch.float32)
        if all(not isinstance(p.grad, DTensor) for p in self.in_norm.values()):
            # DDP: local gradients, already averaged over dp. tp-split ones differ per tp rank and
            # all count; tp-replicated ones count on tp rank 0 only.
            split = [p.grad for n, p in self.in_norm.items() if n in self.tp_split]
            sq += get_total_norm(split) ** 2
            if dist.get_rank(self.tp_group) == 0:
                sq += get_total_norm([p.grad for n, p in self.in_norm.items() if n not in self.tp_split]) ** 2
            dist.all_reduce(sq, group=self.tp_group)
        else:
            # FSDP2: DTensor gradients on the dp mesh (norms, biases of row-parallel layers) or the
            # (dp, tp) mesh (tp-split weights); DTensor ops do not mix meshes, so one norm per mesh,
            # each the full stage's, identical on every rank of the (dp, tp) plane.
            by_mesh = {}
            for p in self.in_norm.values():
                by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
            for grads in by_mesh.values():
                sq += get_total_norm(grads).full_tensor() ** 2
        dist.all_reduce(sq, group=self.pp_group)  # the stages hold different layers
        norm = sq.sqrt()
        if all(not isinstance(p.grad, DTensor) for p in self.params.values()):
            clip_grads_with_norm_(list(self.params.values()), self.tc.grad_clip, norm)
        else:
            for mesh, params in _params_by_grad_mesh(self.params.values()).items():
                replicated = DTensor.from_local(norm, mesh, [Replicate()] * mesh.ndim)
                clip_grads_with_norm_(params, self.tc.grad_clip, replicated)
        return float(norm)

    def optimizer_step(self, lr):
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def shared_loss(self, losses):
        """The batch's mean loss on every rank (the sum of the microbatch means / m: equal tokens)."""
        t = torch.zeros((), dtype=torch.float64)
        if losses is not None and dist.get_rank(self.tp_group) == 0:
            t += torch.stack([(x.to_local() if isinstance(x, DTensor) else x).detach() for x in losses]).sum()
        for group in (self.tp_group, self.pp_group, self.dp_group):
            dist.all_reduce(t, group=group)
        return float(t) / dist.get_world_size(self.dp_group)

    def step(self, idx, targets, lr):
        losses = self.pipeline_step(idx, targets)
        self.sync_tied()
        norm = self.clip()
        self.optimizer_step(lr)
        return self.shared_loss(losses), norm


def _params_by_grad_mesh(params):
    """{mesh: [parameters whose DTensor gradient lives on it]}, for FSDP2: clip_grads_with_norm_
    multiplies the gradients by a coefficient, which must be a DTensor on the same mesh."""
    out = {}
    for p in params:
        if p.grad is not None:
            out.setdefault(p.grad.device_mesh, []).append(p)
    return out


# ----------------------------------------------------------------------------------------------
# Our side: 05 as it is. A contender's step(step_index) runs one training step on batch
# `step_index` of the built-in corpus and returns (loss, grad norm, extra).


def ours_step(run, tokens):
    def step(i):
        dp_rank = dist.get_rank(run.groups.dp)
        idx, targets = replica_batch(tokens, i, run.tc, dp_rank)
        loss, norm, res = gpt3d.train_step(run, idx, targets, gpt3d.lr_at(i, run.tc))
        return loss, norm, (res.messages, res.bytes_sent)
    return step


def torch_step(trun, tc, tokens):
    def step(i):
        idx, targets = replica_batch(tokens, i, tc, dist.get_rank(trun.dp_group))
        loss, norm = trun.step(idx, targets, gpt3d.lr_at(i, tc))
        return loss, norm, None
    return step


def load_ours(run, full):
    """Other starting weights for ours after build(): copied into the flat parameter buffer through
    the parameters' views, before the optimizer has any state."""
    for c in run.chunks:
        c.load_full_state_dict(full)


# ----------------------------------------------------------------------------------------------
# Measuring


def ours_phases(run, tokens, i):
    """05's train_step, call for call, with a clock between the phases (only for --profile; the
    comparison times train_step itself). Also the compute time inside the pipeline (the sum of
    the F and B actions' durations, from 02's StepResult.events)."""
    tc, groups = run.tc, run.groups
    idx, targets = replica_batch(tokens, i, tc, dist.get_rank(groups.dp))
    t = [time.perf_counter()]
    micro = pipeline.split_batch(idx.to(run.env.device), targets.to(run.env.device), tc.microbatches)
    run.ddp.sync = False
    res = pipeline.execute(run.schedule, run.chunks, groups.pp, micro, run.act_shape, wire=run.wire)
    t.append(time.perf_counter())
    pipeline.sync_tied_embeddings(run.chunks, groups.embed, grad_of=run.ddp.main_grad)
    t.append(time.perf_counter())
    run.ddp.finish()
    t.append(time.perf_counter())
    gpt3d.clip_gradients(run.opt, run.chunks, groups, tc.grad_clip, tc.zero1)
    t.append(time.perf_counter())
    for g in run.opt.optimizer.param_groups:
        g["lr"] = gpt3d.lr_at(i, tc)
    run.opt.step()
    run.ddp.zero_grad()
    t.append(time.perf_counter())
    gpt3d.shared_loss(res.loss, run)
    t.append(time.perf_counter())
    compute = sum(e - s for s, e, _ in res.events)
    return [b - a for a, b in zip(t, t[1:])], compute


def torch_phases(trun, tokens, i):
    """TorchRun.step with a clock between the same phases (DDP/FSDP2 reduce inside the pipeline
    step, on the last backward, so the DP column is empty here)."""
    tc = trun.tc
    idx, targets = replica_batch(tokens, i, tc, dist.get_rank(trun.dp_group))
    t = [time.perf_counter()]
    losses = trun.pipeline_step(idx, targets)
    t.append(time.perf_counter())
    trun.sync_tied()
    t.append(time.perf_counter())
    t.append(time.perf_counter())  # no separate DP reduction
    trun.clip()
    t.append(time.perf_counter())
    trun.optimizer_step(gpt3d.lr_at(i, tc))
    t.append(time.perf_counter())
    trun.shared_loss(losses)
    t.append(time.perf_counter())
    return [b - a for a, b in zip(t, t[1:])], None


PHASES = ("pipeline", "tied emb", "DP reduce", "clip", "AdamW", "loss")


# ----------------------------------------------------------------------------------------------
# The worker


def check_mesh_order(env, mesh, grid):
    """init_device_mesh's (pp, dp, tp) mesh must give every rank the same groups as 04's grid."""
    for kind in ("tp", "dp", "pp"):
        theirs = dist.get_process_group_ranks(mesh[kind].get_group())
        ours = next(g for g in grid[kind] if env.rank in g)
        if theirs != ours:  # the same ranks in the same order: group rank i is the same rank
            raise RuntimeError(f"rank {env.rank}: mesh {kind} group {theirs} != rank_grid's {ours}")


def worker(env, cfg, tc, args):
    # FSDP2's gradient norm on the (dp, tp) mesh warns once per rank that it reduces the two mesh
    # dimensions one after the other; 3d_results.md notes it, the output does not need it 8 times.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # With --loss gathered the last FSDP2 stage returns a view (the gathered logits); FSDP2 warns
    # about in-place ops on it, and the loss_fn makes none.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    grid = gpt3d.rank_grid(env.world_size, tc.tp, tc.dp, tc.pp)
    groups = gpt3d.new_groups(env, grid, tc.timeout_s)
    mesh = init_device_mesh("cpu", (tc.pp, tc.dp, tc.tp), mesh_dim_names=("pp", "dp", "tp"))
    check_mesh_order(env, mesh, grid)
    tokens, _ = split_tokens(load_tokens("", cfg.vocab_size, tc.seq_len), tc.seq_len)
    # Random biases and LayerNorms too (05 starts them at 0 and 1), so that the check exercises
    # them from step 1. Ours is built by 05's build() and then loaded with these weights.
    full = tensor_parallel.init_state_dict(cfg, tc.seed + 1, dtype=torch.float32, random_all=True)

    contenders = {}
    for name in args.contenders:
        if name.startswith("ours"):
            run = gpt3d.build(env, cfg, replace(tc, scatter_gather=name == "ours"), groups)
            load_ours(run, full)
            contenders[name] = (run, ours_step(run, tokens))
        else:
            trun = TorchRun(cfg, tc, mesh, full, name.split("-")[1], args.loss, groups.embed)
            contenders[name] = (trun, torch_step(trun, tc, tokens))

    # Same function: two steps of each from the same weights on batches 0 and 1.
    check = {}
    for name, (_, step) in contenders.items():
        check[name] = [step(i)[:2] for i in range(2)]
    serial = serial_reference(cfg, tc, tokens, full) if env.rank == 0 else None
    ref = check[args.contenders[0]]
    diffs = {name: [(abs(l - rl) / abs(rl), abs(n - rn) / abs(rn)) for (l, n), (rl, rn) in zip(c, ref)]
             for name, c in check.items()}
    ok = all(d[s][0] <= LOSS_RTOL[s] and d[s][1] <= NORM_RTOL[s] for d in diffs.values() for s in range(2))
    if serial is not None:
        ok &= all(abs(c[0][0] - serial[0]) / serial[0] <= LOSS_RTOL[0]
                  and abs(c[0][1] - serial[1]) / serial[1] <= NORM_RTOL[0] for c in check.values())
    result = {"check": check, "serial": serial, "diffs": diffs, "same": harness.agree(ok)}
    if not result["same"]:
        return result if env.rank == 0 else None

    # Every contender keeps training on its own: batches keep coming in the same order.
    counter = {name: 2 for name in contenders}

    def next_step(name):
        contenders[name][1](counter[name])
        counter[name] += 1

    steps = {name: (lambda name=name: next_step(name)) for name in contenders}
    result["rounds"] = harness.alternate(steps, args.repeats, args.steps, args.warmup, sweeps=True)

    # p2p traffic of one step of ours, with scatter/gather on and off, over all ranks.
    traffic = {}
    for name in ("ours", "ours-nosg"):
        if name in contenders:
            _, _, (msgs, nbytes) = contenders[name][1](counter[name])
            counter[name] += 1
            both = torch.tensor([msgs, nbytes], dtype=torch.float64)
            mine = (msgs, nbytes)
            dist.all_reduce(both)
            traffic[name] = {"rank0": mine, "all": tuple(both.tolist())}
    result["traffic"] = traffic
    result["torch_act_bytes"] = torch_boundary_bytes(tc, cfg)

    if args.profile:
        result["phases"], result["profiles"], result["tp_comm"] = profile_all(env, contenders, tokens,
                                                                              counter, args)
    return result if env.rank == 0 else None


def torch_boundary_bytes(tc, cfg):
    """What torch's pipelining sends per message: the whole stage output (b, T, C), float32, from
    every tp rank (each tp rank is a pipeline of its own; torch has no scatter/gather)."""
    b = tc.batch_size // (tc.dp * tc.microbatches)
    return b * tc.seq_len * cfg.n_embd * 4


def serial_reference(cfg, tc, tokens, full):
    """Step 1 on one serial GPT-2 on the whole global batch: its loss and gradient norm."""
    model = tensor_parallel.GPT(cfg, None, init=False)
    model.load_full_state_dict(full)
    idx, targets = global_batch(tokens, 0, tc)
    loss = model(idx, targets)[1]
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), tc.grad_clip)
    return loss.item(), float(norm)


def profile_all(env, contenders, tokens, counter, args):
    """Phase times (median of --profile-steps steps, rank 0 and the slowest rank), a
    torch.profiler table of one step on rank 0, and for ours the count and bytes of 01's TP
    collectives in one step on rank 0, for each contender."""
    phases, tables, tp_comm = {}, {}, {}
    for name, (obj, step) in contenders.items():
        per = []
        for _ in range(args.profile_steps):
            dist.barrier()
            fn = ours_phases if name.startswith("ours") else torch_phases
            c0 = time.process_time()
            t, compute = fn(obj, tokens, counter[name])
            counter[name] += 1
            per.append(t + [time.process_time() - c0, compute if compute is not None else float("nan")])
        med = torch.tensor([statistics.median(col) for col in zip(*per)], dtype=torch.float64)
        worst = med.clone()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        phases[name] = (med.tolist(), worst.tolist())
        dist.barrier()
        tables[name] = harness.profile_table(lambda: step(counter[name]), args.profile_rows)
        counter[name] += 1
        if name.startswith("ours"):
            # 01's layers log their own collectives (not 02's p2p, 04's or 05's reductions).
            with trace_comm() as log:
                step(counter[name])
            counter[name] += 1
            tp_comm[name] = (len(log), sum(c.nbytes for c in log))
    return phases, tables, tp_comm


# ----------------------------------------------------------------------------------------------
# Report


def report(cfg, tc, args, res, seconds):
    say = print
    say(f"config: {cfg}")
    say(f"tp={tc.tp} pp={tc.pp} dp={tc.dp}, B={tc.batch_size} (b={tc.batch_size // (tc.dp * tc.microbatches)}, "
        f"m={tc.microbatches} per replica), T={tc.seq_len}, float32, 1F1B; torch {torch.__version__}, "
        f"{tc.tp * tc.pp * tc.dp} gloo ranks x 1 thread on {os.cpu_count()} cores; torch loss: {args.loss}"
        f"{'; ours: ZeRO-1' if tc.zero1 else ''}")
    say("\nsame function: steps 1 and 2 from the same weights on the same batches")
    if res["serial"]:
        say(f"  serial (whole batch) step 1: loss {res['serial'][0]:.7f}  grad norm {res['serial'][1]:.6f}")
    for name, c in res["check"].items():
        d = res["diffs"][name]
        say(f"  {name:10s} loss {c[0][0]:.7f} {c[1][0]:.7f}  norm {c[0][1]:.6f} {c[1][1]:.6f}   "
            f"rel. diff to {args.contenders[0]}: loss {d[0][0]:.1e} {d[1][0]:.1e}, norm {d[0][1]:.1e} {d[1][1]:.1e}")
    tol = (f"loss {LOSS_RTOL[0]:g} / {LOSS_RTOL[1]:g}, grad norm {NORM_RTOL[0]:g} / {NORM_RTOL[1]:g} "
           f"(step 1 / 2, relative)")
    if not res["same"]:
        say(f"FAIL: beyond tolerance ({tol}); not timing different functions")
        return False
    say(f"  all within tolerance: {tol}; step 1 also against the serial model")

    rounds, world = res["rounds"], tc.tp * tc.pp * tc.dp
    say(f"\n{args.repeats} rounds x {args.steps} sweeps ({args.warmup} warm-up step(s) of each per round), "
        f"ms per step:\n{harness.time_table(rounds, world)}")
    say(f"  the fastest a step could be here is its CPU spread over the {min(os.cpu_count(), world)} usable cores")
    say("ratios (goal: ours <= 0.7 x torch):")
    for a, b in (("ours", "torch-ddp"), ("ours", "torch-fsdp"), ("ours", "ours-nosg")):
        if a in rounds[0] and b in rounds[0]:
            say("  " + harness.pair_line(rounds, a, b))

    if res["traffic"]:
        say("\np2p of one step of ours (02's StepResult), scatter/gather on and off:")
        for name, t in res["traffic"].items():
            m0, b0 = t["rank0"]
            ma, ba = t["all"]
            say(f"  {name:10s} rank 0: {int(m0)} messages x {b0 / max(m0, 1):,.0f} bytes; all ranks: "
                f"{int(ma)} messages, {ba:,.0f} bytes")
        say(f"  torch pipelining sends the whole stage output from every tp rank: "
            f"{res['torch_act_bytes']:,} bytes per message")

    if "phases" in res:
        say(f"\nphases on rank 0 (median of {args.profile_steps} steps; in brackets: the slowest rank), ms:")
        say("  " + f"{'':10s} " + " ".join(f"{p:>15s}" for p in PHASES + ("step CPU",)) + "  F+B actions")
        for name, (mine, worst) in res["phases"].items():
            cells = " ".join(f"{a * 1e3:6.1f} [{b * 1e3:6.1f}]" for a, b in zip(mine[:-1], worst[:-1]))
            extra = "" if math.isnan(mine[-1]) else f"  {mine[-1] * 1e3:.1f} [{worst[-1] * 1e3:.1f}]"
            say(f"  {name:10s} {cells}{extra}")
        say("  step CPU: process time of the whole step; F+B actions: ours only, the summed durations of "
            "02's forward and\n  backward actions (TP collectives included), the rest of 'pipeline' is "
            "waiting at p2p boundaries")
        for name, (n, nbytes) in res["tp_comm"].items():
            say(f"  {name}: 01's TP layers ran {n} collectives in one step on rank 0, {nbytes / 2**20:.2f} MiB")
        for name, table in res["profiles"].items():
            say(f"\n--- torch.profiler, one step of {name}, rank 0, top {args.profile_rows} by self CPU")
            say(table)
    say(f"\n(the run took {seconds:.0f} s)")
    return True


# ----------------------------------------------------------------------------------------------
# Command line


def main():
    parser = harness.parser(__doc__, repeats=5, steps=6, warmup=1, deadline=900.0, vocab_size=256,
                            block_size=64, n_layer=4, n_head=4, n_embd=128)
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS),
                        help="the first is the reference of the loss check; ratios need 'ours'")
    parser.add_argument("--loss", choices=["parallel", "gathered"], default="parallel",
                        help="torch side: loss_parallel() on vocab-sharded logits, or gathered logits")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch B")
    parser.add_argument("--microbatches", type=int, default=4, help="m per replica")
    parser.add_argument("--seq-len", type=int, default=64, help="T")
    parser.add_argument("--zero1", action="store_true", help="ours with ZeRO-1 instead of plain DP")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps per phase breakdown")
    args = parser.parse_args()
    cfg = harness.model_config(args)
    harness.needs_numpy("torch.distributed.pipelining")
    tc = gpt3d.TrainConfig(tp=args.tp, pp=args.pp, dp=args.dp, batch_size=args.batch_size,
                           microbatches=args.microbatches, seq_len=args.seq_len, zero1=args.zero1,
                           dtype="float32", eval_every=0)
    if args.microbatches < args.pp:
        raise ValueError(f"torch's Schedule1F1B needs m >= pp; got m={args.microbatches}, pp={args.pp}")
    check_config(cfg, tc, tc.tp * tc.pp * tc.dp)  # refuse bad sizes before forking
    load_tokens("", cfg.vocab_size, tc.seq_len)  # the corpus is cached; the ranks inherit it
    t0 = time.perf_counter()
    results = harness.launch(worker, tc.tp * tc.pp * tc.dp, cfg, tc, args, timeout_s=tc.timeout_s,
                             deadline_s=args.deadline)
    return report(cfg, tc, args, results[0], time.perf_counter() - t0)


if __name__ == "__main__":
    harness.run_main(main)
