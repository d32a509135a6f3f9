"""3D step time: our tp x pp x dp trainer (05_3d_gpt.py) against PyTorch's own 3D composition.

One full training step of 05's trainer (tp=2 x pp=2 x dp=2, 8 CPU ranks) against PyTorch's
composition on a 3-D DeviceMesh (DTensor TP, DDP or FSDP2, pipelining); ours also without
scatter/gather. benchmarks/README.md has what each side runs, the checks and the method.

Run it (from the repository root; it starts its own ranks, do not use torchrun):
    python benchmarks/bench_3d.py                        # default: about 2-2.5 minutes on 2 cores
    python benchmarks/bench_3d.py --profile              # plus where the time goes on rank 0
    python benchmarks/bench_3d.py --contenders ours torch-ddp --repeats 7
"""
import functools
import itertools
import logging
import os
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
from plumbing.data import load_tokens, replica_batch, split_tokens

CONTENDERS = ("ours", "ours-nosg", "torch-ddp", "torch-fsdp")

# Each contender's loss and global gradient norm at steps 1 and 2, relative to the first
# contender's. float32 throughout. The layouts only reorder sums (sharded GEMMs, m microbatches
# against one batch, another all-reduce tree), so the step-1 loss agrees to ~1e-7 and the norm to
# ~1e-6. Step 2 follows AdamW's first update, about lr * sign(g): an element whose gradient is ~0
# can move by lr on one side and not the other, hence a looser bound. A real mistake (a missing
# 1/m or 1/dp, an unsynchronised tied weight, a replicated weight counted twice in the norm, a
# wrong head layout) shows up at 1e-3 or more.
TOLERANCES = {"loss 1": 1e-5, "loss 2": 1e-4, "norm 1": 1e-4, "norm 2": 1e-3}


# ----------------------------------------------------------------------------------------------
# torch's side: bench_tp's PeerStage per pipeline rank (parameter names as 01's, so one full state
# dict loads both sides), TP inside a stage, DDP or FSDP2 across replicas, pipelining across
# stages, then clipping and AdamW.


class TorchRun:
    """This rank's stage of PyTorch's 3D composition and its optimizer; step() mirrors 05's
    train_step: pipeline, tied embeddings, clipping, AdamW, the batch's mean loss on every rank."""

    def __init__(self, cfg, tc, mesh, full, data_parallel, embed_group):
        pp_group = mesh["pp"].get_group()
        pp, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        layers = pipeline.split_layers(cfg.n_layer, pp)[pp_rank]
        stage = bench_tp.PeerStage(cfg, layers, first=pp_rank == 0, last=pp_rank == pp - 1)
        stage.load_full(full)
        parallelize_module(stage, mesh["tp"], bench_tp.tp_plan(stage))
        # Which parameters tp splits: read before DDP turns the DTensors into local tensors.
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
        self.stage, self.tc, self.embed_group = stage, tc, embed_group
        self.tp_group, self.pp_group, self.dp_group = (mesh[k].get_group() for k in ("tp", "pp", "dp"))
        self.pipeline = PipelineStage(module, pp_rank, pp, torch.device("cpu"), group=pp_group)
        m = tc.microbatches
        # The loss_fn: a microbatch's mean cross-entropy (the vocab-parallel one under
        # loss_parallel()) divided by m, as ours weights each microbatch by its token share; and
        # scale_grads=False, for torch's default (gradients divided by m after the last backward)
        # misses the TP parameters under DDP: its forward pre-hook sets them back as plain DTensor
        # attributes, out of stage.parameters() (NOTES.md; the norm check catches it).
        self.schedule = Schedule1F1B(self.pipeline, m, scale_grads=False,
                                     loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()) / m)
        # Taken before the first forward (see above): the tensors that receive the gradients.
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
        """The batch's mean loss on every rank (the sum of the microbatch means / m: equal tokens),
        in one all-reduce, as 05's: one rank per replica contributes."""
        t = torch.zeros((), dtype=torch.float64)
        if losses is not None and dist.get_rank(self.tp_group) == 0:
            t += torch.stack([(x.to_local() if isinstance(x, DTensor) else x).detach() for x in losses]).sum()
        dist.all_reduce(t)
        return float(t) / dist.get_world_size(self.dp_group)

    def step(self, idx, targets, lr):
        """One training step on the whole replica batch, which the schedule cuts into m
        microbatches along dim 0 (the same rows as 02's split_batch): (the batch's mean loss, the
        gradient norm, None)."""
        st, losses = self.stage, [] if self.stage.last else None
        with loss_parallel():  # it must also cover the backward, which the schedule runs inside
            self.schedule.step(*((idx,) if st.first else ()), target=targets if st.last else None,
                               losses=losses, return_outputs=False)
        for name in ("wte.weight", "lm_head.weight"):  # the first and the last stage's copy of wte
            if name in self.params and self.embed_group is not None:  # as 02's sync_tied_embeddings
                g = self.params[name].grad
                dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=self.embed_group)
        # (DDP and FSDP2 reduced the gradients inside the pipeline, on the last backward.)
        norm = self.clip()
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return self.shared_loss(losses), norm, None


def _by_grad_mesh(params):
    """{mesh: [parameters whose DTensor gradient lives on it]}, for FSDP2."""
    out = {}
    for p in params:
        if p.grad is not None:
            out.setdefault(p.grad.device_mesh, []).append(p)
    return out


# ----------------------------------------------------------------------------------------------
# The worker


def stepper(train, tokens, tc, dp_rank):
    """A contender's step(): train(idx, targets, lr) -> (loss, grad norm, ...) on batch 0, 1, 2...
    of the built-in corpus in turn, as every contender."""
    batches = itertools.count()

    def step():
        i = next(batches)
        return train(*replica_batch(tokens, i, tc, dp_rank), gpt3d.lr_at(i, tc))
    return step


def worker(env, cfg, tc, args):
    # FSDP2's norm on the (dp, tp) mesh warns on every rank that it reduces one dimension at a time.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    grid = gpt3d.rank_grid(env.world_size, tc.tp, tc.dp, tc.pp)
    groups = gpt3d.new_groups(env, grid, tc.timeout_s)
    mesh = init_device_mesh("cpu", (tc.pp, tc.dp, tc.tp), mesh_dim_names=("pp", "dp", "tp"))
    for kind in ("tp", "dp", "pp"):  # the same groups on both sides, ranks in the same order
        if dist.get_process_group_ranks(mesh[kind].get_group()) not in grid[kind]:
            raise RuntimeError(f"rank {env.rank}: the device mesh's {kind} group is none of 05's rank_grid")
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
            train = TorchRun(cfg, tc, mesh, full, name.split("-")[1], groups.embed).step
        steps[name] = stepper(train, tokens, tc, dist.get_rank(groups.dp))

    # Same function: two steps of each from the same weights on batches 0 and 1.
    check = {name: [step()[:2] for _ in range(2)] for name, step in steps.items()}
    ref = check[args.contenders[0]]
    diffs = {name: {f"{kind} {s + 1}": rel(c[s][k], ref[s][k]) for k, kind in enumerate(("loss", "norm"))
                    for s in range(2)} for name, c in check.items()}  # "loss 1": step 1's loss, ...
    same = harness.agree(all(harness.within(d, TOLERANCES) for d in diffs.values()))
    result = {"check": ref, "diffs": diffs, "same": same}
    if same:
        result["rounds"] = harness.alternate(steps, args.repeats, args.steps, args.warmup, sweeps=True)
        result["tables"] = harness.profiles(steps, args.profile_rows) if args.profile else {}
    return result if env.rank == 0 else None


# ----------------------------------------------------------------------------------------------
# Report and command line


def report(cfg, tc, args, res):
    b = tc.batch_size // (tc.dp * tc.microbatches)
    print(f"config: {cfg}")
    print(f"tp={tc.tp} pp={tc.pp} dp={tc.dp}, B={tc.batch_size} (b={b}, m={tc.microbatches} per replica), "
          f"T={tc.seq_len}, float32, 1F1B; torch {torch.__version__}, {tc.tp * tc.pp * tc.dp} gloo ranks x 1 "
          f"thread on {os.cpu_count()} cores")
    (l1, n1), (l2, n2) = res["check"]
    if not harness.guard(f"\nsame function, steps 1 and 2 from the same weights on the same batches, relative to "
                         f"{args.contenders[0]} (loss {l1:.7f}, {l2:.7f}; gradient norm {n1:.6f}, {n2:.6f}):",
                         res["diffs"], TOLERANCES, res["same"]):
        return False
    rounds, world = res["rounds"], tc.tp * tc.pp * tc.dp
    print(f"\n{harness.time_table(rounds, world, f' in sweeps ({args.warmup} warm-up step(s) of each per round)')}")
    print("ratios (goal: ours <= 0.6 x torch):")
    for a, other in (("ours", "torch-ddp"), ("ours", "torch-fsdp"), ("ours", "ours-nosg")):
        if a in rounds[0] and other in rounds[0]:
            print("  " + harness.pair_line(rounds, a, other))
    for table in res["tables"].values():
        print(table)
    return True


def main():
    parser = harness.parser(__doc__, repeats=5, steps=6, warmup=1, deadline=900.0, vocab_size=256,
                            block_size=64, n_layer=4, n_head=4, n_embd=128)
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS),
                        help="the first is the reference of the loss check; ratios need 'ours'")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch B")
    parser.add_argument("--microbatches", type=int, default=4, help="m per replica")
    parser.add_argument("--seq-len", type=int, default=64, help="T")
    args = parser.parse_args()
    cfg = harness.model_config(args, pipelining=True)
    tc = gpt3d.TrainConfig(tp=args.tp, pp=args.pp, dp=args.dp, batch_size=args.batch_size,
                           microbatches=args.microbatches, seq_len=args.seq_len, dtype="float32", eval_every=0)
    check_config(cfg, tc, tc.tp * tc.pp * tc.dp)  # refuse bad sizes before forking
    load_tokens("", cfg.vocab_size, tc.seq_len)  # the corpus is cached; the ranks inherit it
    results = harness.launch(worker, tc.tp * tc.pp * tc.dp, cfg, tc, args, timeout_s=tc.timeout_s,
                             deadline_s=args.deadline)
    return report(cfg, tc, args, results[0])


if __name__ == "__main__":
    harness.run_main(main)
