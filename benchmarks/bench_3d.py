"""3D step time: our tp x pp x dp trainer (05_3d_gpt.py) against PyTorch's own 3D composition.

One full training step of 05's trainer (tp=2 x pp=2 x dp=2, 8 CPU ranks) against PyTorch's
composition on a 3-D DeviceMesh (DTensor TP, DDP or FSDP2, pipelining); ours also without
scatter/gather.
benchmarks/README.md has what each side runs, the checks and the method.

Run it (from the repository root; it starts its own ranks, do not use torchrun):
    python benchmarks/bench_3d.py                        # default: about 2-2.5 minutes on 2 cores
    python benchmarks/bench_3d.py --profile              # plus where the time goes on rank 0
    python benchmarks/bench_3d.py --contenders ours torch-ddp --repeats 7
"""
import contextlib
import functools
import itertools
import logging
import math
import os
import statistics
import time
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

import bench_tp  # the peer's model: plain serial stage modules and torchtitan's TP plan
import harness
from harness import gpt3d, pipeline, rel
from plumbing.checks import check_config
from plumbing.data import global_batch, load_tokens, replica_batch, split_tokens
from plumbing.trace import StepTrace, trace_comm

CONTENDERS = ("ours", "ours-nosg", "torch-ddp", "torch-fsdp")
# --profile's phases after the pipeline: the spans that 05's train_step opens (TorchRun.step opens
# the same), by the start of their names.
SPANS = {"tied emb": "tied-embedding", "DP reduce": "data-parallel", "clip": "global gradient norm",
         "AdamW": "AdamW", "loss": "loss all-reduce"}

# float32 throughout. The layouts only reorder sums (sharded GEMMs, m microbatches against one
# batch, a different all-reduce tree), so the step-1 loss agrees to ~1e-7 and the gradient norm
# to ~1e-6. Step 2 goes through AdamW, whose first update is about lr * sign(g): an element whose
# gradient is ~0 can move by lr on one side and not the other, so step 2 gets a looser bound. A real
# mistake (a missing 1/m or 1/dp, an unsynchronised tied weight, a replicated weight counted twice
# in the norm, a wrong head layout) shows up at 1e-3 or more.
LOSS_RTOL = (1e-5, 1e-4)  # step 1, step 2
NORM_RTOL = (1e-4, 1e-3)


# ----------------------------------------------------------------------------------------------
# torch's side: bench_tp's PeerStage per pipeline rank (parameter names as 01's, so one full state
# dict loads both sides), TP inside a stage, DDP or FSDP2 across replicas, pipelining across
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
        stage = bench_tp.PeerStage(cfg, layers, first=pp_rank == 0, last=pp_rank == pp - 1)
        stage.load_full(full)
        parallelize_module(stage, mesh["tp"], bench_tp.tp_plan(stage, loss))
        # Which parameters tp splits (each rank holds a different slice) and which it replicates:
        # read now, before DDP turns the DTensors into local tensors.
        self.tp_split = {n for n, p in stage.named_parameters()
                         if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)}
        if data_parallel == "ddp":
            # With device_mesh (not process_group) DDP knows the parameters are TP DTensors: it
            # swaps them for their local shards (what it reduces) and wraps those back into
            # DTensors in a forward pre-hook. With process_group= it fails (NOTES.md).
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
        decay = [p for p in self.params.values() if p.dim() >= 2]  # 05's weight-decay groups
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                      {"params": gpt3d.no_decay(self.params.values()), "weight_decay": 0.0}],
                                     lr=tc.lr, betas=(0.9, 0.95))

    def clip(self):
        """The global gradient norm (every element once) and clipping to tc.grad_clip."""
        sq = torch.zeros((), dtype=torch.float32)
        fsdp = any(isinstance(p.grad, DTensor) for p in self.params.values())
        if not fsdp:
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
            for params in _by_grad_mesh(self.in_norm.values()).values():
                sq += get_total_norm([p.grad for p in params]).full_tensor() ** 2
        dist.all_reduce(sq, group=self.pp_group)  # the stages hold different layers
        norm = sq.sqrt()
        if not fsdp:
            clip_grads_with_norm_(list(self.params.values()), self.tc.grad_clip, norm)
        else:  # clip_grads_with_norm_ multiplies by a coefficient, a DTensor on each gradient's mesh
            for mesh, params in _by_grad_mesh(self.params.values()).items():
                replicated = DTensor.from_local(norm, mesh, [Replicate()] * mesh.ndim)
                clip_grads_with_norm_(params, self.tc.grad_clip, replicated)
        return float(norm)

    def shared_loss(self, losses):
        """The batch's mean loss on every rank (the sum of the microbatch means / m: equal tokens)."""
        t = torch.zeros((), dtype=torch.float64)
        if losses is not None and dist.get_rank(self.tp_group) == 0:
            t += torch.stack([(x.to_local() if isinstance(x, DTensor) else x).detach() for x in losses]).sum()
        for group in (self.tp_group, self.pp_group, self.dp_group):
            dist.all_reduce(t, group=group)
        return float(t) / dist.get_world_size(self.dp_group)

    def step(self, idx, targets, lr, trace=None):
        """One training step on the whole replica batch, which the schedule cuts into m
        microbatches along dim 0 (the same rows as 02's split_batch): (the batch's mean loss, the
        gradient norm, None). trace, a plumbing.trace.StepTrace, gets the spans that 05's
        train_step opens after its pipeline."""
        span = trace.span if trace else (lambda name, category: contextlib.nullcontext())
        st, losses = self.stage, [] if self.stage.last else None
        # loss_parallel must also cover the backward, which the schedule runs inside
        with loss_parallel() if self.loss_kind == "parallel" else contextlib.nullcontext():
            self.schedule.step(*((idx,) if st.first else ()), target=targets if st.last else None,
                               losses=losses, return_outputs=False)
        with span("tied-embedding all-reduce", "collective"):  # as 02's sync_tied_embeddings
            for name in ("wte.weight", "lm_head.weight"):  # the first and the last stage's copy
                if name in self.params and self.embed_group is not None:
                    g = self.params[name].grad
                    dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=self.embed_group)
        with span("data-parallel gradient reduction", "collective"):
            pass  # DDP and FSDP2 reduce inside the pipeline, on the last backward: an empty phase
        with span("global gradient norm and clipping", "collective"):
            norm = self.clip()
        with span("AdamW", "optimizer"):
            for g in self.opt.param_groups:
                g["lr"] = lr
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        with span("loss all-reduce", "collective"):
            loss = self.shared_loss(losses)
        return loss, norm, None


def _by_grad_mesh(params):
    """{mesh: [parameters whose DTensor gradient lives on it]}, for FSDP2."""
    out = {}
    for p in params:
        if p.grad is not None:
            out.setdefault(p.grad.device_mesh, []).append(p)
    return out


# ----------------------------------------------------------------------------------------------
# A contender's step(trace=None): one training step on the next batch of the built-in corpus.


def stepper(train, tokens, tc, dp_rank):
    """train(idx, targets, lr, trace) -> (loss, grad norm, ours: 02's StepResult), on batch 0, 1,
    2... in turn: every contender keeps training on the same batches in the same order."""
    batches = itertools.count()

    def step(trace=None):
        i = next(batches)
        idx, targets = replica_batch(tokens, i, tc, dp_rank)
        if trace:
            trace.start()
        return train(idx, targets, gpt3d.lr_at(i, tc), trace)
    return step


def phases(step, n):
    """--profile: the medians over n steps, on this rank and (max) on the slowest, of the pipeline
    (from the start to the first of SPANS), each of SPANS, the step's CPU time, and the compute
    inside the pipeline (ours: 02's F and B actions)."""
    per = []
    for _ in range(n):
        trace = StepTrace(torch.device("cpu"))
        dist.barrier()
        c0 = time.process_time()
        step(trace)
        cpu = time.process_time() - c0
        after = [(s, e, name) for s, e, name, _ in trace.spans if name.startswith(tuple(SPANS.values()))]
        compute = [e - s for s, e, _, kind in trace.spans if kind == "compute"]
        per.append([min(s for s, _, _ in after)] + [sum(e - s for s, e, name in after if name.startswith(prefix))
                                                    for prefix in SPANS.values()]
                   + [cpu, sum(compute) if compute else math.nan])
    med = torch.tensor([statistics.median(col) for col in zip(*per)], dtype=torch.float64)
    worst = med.clone()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return med.tolist(), worst.tolist()


# ----------------------------------------------------------------------------------------------
# The worker


def check_mesh_order(env, mesh, grid):
    """init_device_mesh's (pp, dp, tp) mesh must give every rank the same groups as 04's grid."""
    for kind in ("tp", "dp", "pp"):
        theirs = dist.get_process_group_ranks(mesh[kind].get_group())
        ours = next(g for g in grid[kind] if env.rank in g)
        if theirs != ours:  # the same ranks in the same order: group rank i is the same rank
            raise RuntimeError(f"rank {env.rank}: mesh {kind} group {theirs} != rank_grid's {ours}")


def serial_reference(cfg, tc, tokens, full):
    """Step 1 on one serial GPT-2 on the whole global batch: its loss and gradient norm."""
    model = harness.gpt(cfg, full)
    idx, targets = global_batch(tokens, 0, tc)
    loss = model(idx, targets)[1]
    loss.backward()
    return loss.item(), float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), tc.grad_clip))


def worker(env, cfg, tc, args):
    # FSDP2's gradient norm on the (dp, tp) mesh warns once per rank that it reduces the two mesh
    # dimensions one after the other; NOTES.md notes it, the output does not need it 8 times.
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
    full, _ = harness.start(cfg, tc.seed + 1)
    steps = {}
    for name in args.contenders:
        if name.startswith("ours"):
            run = gpt3d.build(env, cfg, replace(tc, scatter_gather=name == "ours"), groups)
            for chunk in run.chunks:  # through the parameters' views of the flat buffer, before
                chunk.load_full_state_dict(full)  # the optimizer has any state
            train = functools.partial(gpt3d.train_step, run)
        else:
            train = TorchRun(cfg, tc, mesh, full, name.split("-")[1], args.loss, groups.embed).step
        steps[name] = stepper(train, tokens, tc, dist.get_rank(groups.dp))

    # Same function: two steps of each from the same weights on batches 0 and 1.
    check = {name: [step()[:2] for _ in range(2)] for name, step in steps.items()}
    serial = serial_reference(cfg, tc, tokens, full) if env.rank == 0 else None
    ref = check[args.contenders[0]]
    diffs = {name: [(rel(l, rl), rel(n, rn)) for (l, n), (rl, rn) in zip(c, ref)] for name, c in check.items()}
    ok = all(d[s][0] <= LOSS_RTOL[s] and d[s][1] <= NORM_RTOL[s] for d in diffs.values() for s in range(2))
    if serial is not None:
        ok &= all(rel(c[0][0], serial[0]) <= LOSS_RTOL[0] and rel(c[0][1], serial[1]) <= NORM_RTOL[0]
                  for c in check.values())
    result = {"check": check, "serial": serial, "diffs": diffs, "same": harness.agree(ok)}
    if not result["same"]:
        return result if env.rank == 0 else None
    result["rounds"] = harness.alternate(steps, args.repeats, args.steps, args.warmup, sweeps=True)

    # p2p traffic of one step of ours, with scatter/gather on and off: rank 0's, and all ranks'.
    result["traffic"] = {}
    for name in ("ours", "ours-nosg"):
        if name in steps:
            res = steps[name]()[2]
            both = torch.tensor([res.messages, res.bytes_sent], dtype=torch.float64)
            dist.all_reduce(both)
            result["traffic"][name] = ((res.messages, res.bytes_sent), tuple(both.tolist()))
    if args.profile:
        result["phases"] = {name: phases(step, args.profile_steps) for name, step in steps.items()}
        result["profiles"] = harness.profiles(steps, args.profile_rows)
        result["tp_comm"] = {}
        for name in ("ours", "ours-nosg"):
            if name in steps:  # 01's layers log their own collectives (not 02's p2p, 04's or 05's)
                with trace_comm() as log:
                    steps[name]()
                result["tp_comm"][name] = (len(log), sum(c.nbytes for c in log))
    return result if env.rank == 0 else None


# ----------------------------------------------------------------------------------------------
# Report and command line


def report(cfg, tc, args, res, seconds):
    say, b = print, tc.batch_size // (tc.dp * tc.microbatches)
    say(f"config: {cfg}")
    say(f"tp={tc.tp} pp={tc.pp} dp={tc.dp}, B={tc.batch_size} (b={b}, m={tc.microbatches} per replica), "
        f"T={tc.seq_len}, float32, 1F1B; torch {torch.__version__}, {tc.tp * tc.pp * tc.dp} gloo ranks x 1 "
        f"thread on {os.cpu_count()} cores; torch loss: {args.loss}{'; ours: ZeRO-1' if tc.zero1 else ''}")
    say("\nsame function: steps 1 and 2 from the same weights on the same batches")
    if res["serial"]:
        say(f"  serial (whole batch) step 1: loss {res['serial'][0]:.7f}  grad norm {res['serial'][1]:.6f}")
    for name, c in res["check"].items():
        d = res["diffs"][name]
        say(f"  {name:10s} loss {c[0][0]:.7f} {c[1][0]:.7f}  norm {c[0][1]:.6f} {c[1][1]:.6f}   "
            f"rel. diff to {args.contenders[0]}: loss {d[0][0]:.1e} {d[1][0]:.1e}, norm {d[0][1]:.1e} {d[1][1]:.1e}")
    if not harness.verdict(res["same"], f"loss {LOSS_RTOL[0]:g} / {LOSS_RTOL[1]:g}, grad norm {NORM_RTOL[0]:g} / "
                           f"{NORM_RTOL[1]:g}, step 1 / 2, relative; step 1 also against the serial model"):
        return False

    rounds, world = res["rounds"], tc.tp * tc.pp * tc.dp
    say(f"\n{harness.time_table(rounds, world, f' in sweeps ({args.warmup} warm-up step(s) of each per round)')}")
    say(f"  the fastest a step could be here is its CPU spread over the {min(os.cpu_count(), world)} usable cores")
    say("ratios (goal: ours <= 0.7 x torch):")
    for a, other in (("ours", "torch-ddp"), ("ours", "torch-fsdp"), ("ours", "ours-nosg")):
        if a in rounds[0] and other in rounds[0]:
            say("  " + harness.pair_line(rounds, a, other))

    if res["traffic"]:
        say("\np2p of one step of ours (02's StepResult), scatter/gather on and off:")
        for name, ((m0, b0), (ma, ba)) in res["traffic"].items():
            say(f"  {name:10s} rank 0: {int(m0)} messages x {b0 / max(m0, 1):,.0f} bytes; all ranks: "
                f"{int(ma)} messages, {ba:,.0f} bytes")
        # torch's pipelining has no scatter/gather: each tp rank is a pipeline of its own
        say(f"  torch pipelining sends the whole stage output from every tp rank: "
            f"{b * tc.seq_len * cfg.n_embd * 4:,} bytes per message")

    if "phases" in res:
        say(f"\nphases on rank 0 (median of {args.profile_steps} steps; in brackets: the slowest rank), ms:")
        say("  " + f"{'':10s} " + " ".join(f"{p:>15s}" for p in ("pipeline", *SPANS, "step CPU")) + "  F+B actions")
        for name, (mine, worst) in res["phases"].items():
            cells = " ".join(f"{a * 1e3:6.1f} [{w * 1e3:6.1f}]" for a, w in zip(mine[:-1], worst[:-1]))
            extra = "" if math.isnan(mine[-1]) else f"  {mine[-1] * 1e3:.1f} [{worst[-1] * 1e3:.1f}]"
            say(f"  {name:10s} {cells}{extra}")
        say("  step CPU: process time of the whole step; F+B actions: ours only, the summed durations of "
            "02's forward and\n  backward actions (TP collectives included), the rest of 'pipeline' is "
            "waiting at p2p boundaries")
        for name, (n, nbytes) in res["tp_comm"].items():
            say(f"  {name}: 01's TP layers ran {n} collectives in one step on rank 0, {nbytes / 2**20:.2f} MiB")
        for table in res["profiles"].values():
            say(table)
    say(f"\n(the run took {seconds:.0f} s)")
    return True


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
    cfg = harness.model_config(args, needs_numpy="torch.distributed.pipelining")
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
