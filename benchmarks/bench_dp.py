"""Data-parallel step time and ZeRO-1 memory: 04_data_parallel.py against PyTorch's own.

One training step of 04's bucketed DP against DDP, and of 04's ZeRO-1 against DDP +
ZeroRedundancyOptimizer, same model, weights, batch and buckets; with the optimizer state per rank.
benchmarks/README.md has what each side runs, the checks and the method.

Run it (from the repository root; CPU only, it starts its own ranks: not under torchrun):
    python benchmarks/bench_dp.py                        # dp=2 and dp=4, both parts
    python benchmarks/bench_dp.py --repeats 21           # tighter medians (the results' run)
    python benchmarks/bench_dp.py --dp 2 --parts dp --profile   # where each step's time goes
"""
import os
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import harness
from harness import data_parallel, tensor_parallel
from plumbing import demos

# The same function, in float32: only the reduction differs (other bucket boundaries; ZeRO-1
# reduce-scatters where DDP all-reduces), so gloo sums an element's dp contributions in another
# order (benchmarks/README.md has the reasoning and the measured values):
#  grad: step 1's reduced gradients, every element this rank holds, max |ours - peer| / max |peer|
#     per tensor: another order moves an element by an ulp (6e-8); a missing 1/dp by 0.5 or more;
#  params/lr: every parameter after --check-steps AdamW steps, max |ours - peer| in units of lr: an
#     ulp of a nearly cancelling gradient moves an element by ~1e-3 lr; a stale ZeRO shard or a
#     wrong gradient by ~lr. AdamW hides a gradient's scale, hence the first check.
TOLERANCES = {"grad": 1e-6, "params/lr": 1e-2}
ELEMENT_BYTES = 4  # float32


# ----------------------------------------------------------------------------------------------
# The two sides, the same-function check, the timing


def build(name, cfg, full, group, args, zero):
    """One side: its model, optimizer, ddp, and step(x, y, after_reduction=None), one full training
    step that returns the loss. after_reduction(side), if given, runs once the gradients are
    reduced, before the optimizer (the check reads the gradients there; never while timing)."""
    model = harness.gpt(cfg, full)
    adamw = {"lr": args.lr, "weight_decay": args.weight_decay}
    if name == "ours":
        ddp = data_parallel.BucketedDDP(model.parameters(), group, args.bucket_numel, zero=zero)
        opt = data_parallel.FlatAdamW(ddp, **adamw) if zero else torch.optim.AdamW(model.parameters(), **adamw)
        forward, finish, zero_grad = model, ddp.finish, ddp.zero_grad
    else:
        # Given explicitly, bucket_cap_mb caps DDP's first bucket too (only the default comes with a
        # 1 MiB first bucket). DDP never splits a parameter: its buckets are slightly larger (NOTES.md).
        cap_mib = args.bucket_numel * ELEMENT_BYTES / 2**20
        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=cap_mib)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, process_group=group,
                                      **adamw) if zero else torch.optim.AdamW(ddp.parameters(), **adamw)
        forward, finish, zero_grad = ddp, (lambda: None), (lambda: opt.zero_grad(set_to_none=True))
    side = SimpleNamespace(name=name, model=model, optimizer=opt, ddp=ddp)

    def step(x, y, after_reduction=None):
        _, loss = forward(x, y)
        loss.backward()  # ours: the hooks launch each bucket's reduction as it completes; DDP waits
        finish()  # for its all-reduces at the end of backward. Ours: the last launches, and the waits
        if after_reduction:
            after_reduction(side)
        opt.step()  # ZeRO-1: also the all-gather (ours) or broadcasts (peer) of the updated parameters
        zero_grad()
        return loss.detach()

    side.step = step
    return side


def batches_for_rank(cfg, args, dp, rank, n):
    """n global batches (dp x B sequences); this rank's rows of each. Same seed on every rank."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    shape = (2, dp * args.batch_size, args.seq_len)  # (idx and targets, B, T)
    batches = [torch.randint(cfg.vocab_size, shape, generator=gen) for _ in range(n)]
    return [data_parallel.shard_batch(idx, targets, dp, rank) for idx, targets in batches]


def reduced_grads(side):
    """Name -> this rank's reduced gradient, flat; ours with the mask of the elements it holds, read
    from the flat buffer, where under ZeRO-1 a rank holds only its shard of each bucket."""
    if side.name == "peer":
        return {name: p.grad.detach().reshape(-1).clone() for name, p in side.model.named_parameters()}
    ddp = side.ddp
    held = torch.zeros(ddp.grad_buffer.numel(), dtype=torch.bool)
    for i in range(len(ddp.buckets)):
        held[slice(*ddp.shard_range(i))] = True  # every element without ZeRO
    return {name: (ddp.main_grad(p).reshape(-1).clone(), held[ddp.offsets[p]:ddp.offsets[p] + p.numel()])
            for name, p in side.model.named_parameters()}


def check_same(ours, peer, batches, lr):
    """Train both on the same batches. Returns the worst over all ranks of the first step's gradient
    difference (relative, per tensor) and of the final parameter difference in units of lr; and
    the losses."""
    grads, losses = {}, []
    for k, (x, y) in enumerate(batches):
        grab = (lambda side: grads.update({side.name: reduced_grads(side)})) if k == 0 else None
        losses.append((ours.step(x, y, grab).item(), peer.step(x, y, grab).item()))
    grad_rel = max(tensor_parallel.max_rel_diff(g[held], grads["peer"][name][held])
                   for name, (g, held) in grads["ours"].items() if held.any())
    theirs = dict(peer.model.named_parameters())
    param_lr = max((p - theirs[name]).detach().abs().max().item()
                   for name, p in ours.model.named_parameters()) / lr
    worst = torch.tensor([grad_rel, param_lr], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(TOLERANCES, worst.tolist())), losses


def run_part(env, cfg, args, full, part):
    """Check, then time, ours against the peer for one part ("dp" or "zero"); this rank's figures."""
    zero, dp = part == "zero", env.world_size
    ours, peer = (build(name, cfg, full, dist.group.WORLD, args, zero) for name in ("ours", "peer"))
    batches = batches_for_rank(cfg, args, dp, env.rank, args.check_steps)
    diffs, losses = check_same(ours, peer, batches, args.lr)
    result = {"diffs": diffs, "losses": losses, "same": harness.within(diffs, TOLERANCES)}
    # Optimizer state after the check steps; ZeroRedundancyOptimizer holds this rank's AdamW in .optim.
    result["state_bytes"] = {
        "ours": demos.optimizer_state_bytes(ours.optimizer),
        "peer": demos.optimizer_state_bytes(peer.optimizer.optim if zero else peer.optimizer)}
    if not result["same"]:
        return result

    x, y = batches[0]  # timing reuses one batch: the data does not change the work
    steps = {side.name: (lambda side=side: side.step(x, y)) for side in (ours, peer)}
    if args.profile:  # a few steps: one is too noisy on a shared machine
        result["tables"] = harness.profiles(steps, args.profile_rows, steps=3, title=f"{part} dp={dp}, ")
    # The check steps warmed both up too (DDP has rebuilt its buckets after the first).
    result["rounds"] = harness.alternate(steps, args.repeats, args.steps, args.warmup)
    return result


def worker(env, cfg, args):
    full, _ = harness.start(cfg, args.seed)
    return {part: run_part(env, cfg, args, full, part) for part in args.parts}


# ----------------------------------------------------------------------------------------------
# Report and command line (rank 0 prints; per-rank figures come back through launch's results).


def report(cfg, args, dp, results):
    n_params = sum(t.numel() for t in tensor_parallel.init_state_dict(cfg, 0).values())
    plain = 2 * ELEMENT_BYTES * n_params  # AdamW's exp_avg and exp_avg_sq of every parameter
    print(f"\n=== dp={dp}: {dp} gloo ranks x 1 thread on {os.cpu_count()} cores; per-rank batch "
          f"B={args.batch_size} T={args.seq_len}, {n_params:,} parameters, float32; buckets of "
          f"{args.bucket_numel:,} elements (DDP: bucket_cap_mb {args.bucket_numel * ELEMENT_BYTES / 2**20:g})")
    ok = True
    for part in args.parts:
        res = results[0][part]
        label = {"dp": "DP (DDP + AdamW)", "zero": "ZeRO-1 (DDP + ZeroRedundancyOptimizer)"}[part]
        l_ours, l_peer = res["losses"][-1]
        print(f"\n--- {part}: ours against {label}")
        ok &= harness.guard(f"same function over {args.check_steps} steps from the same weights (last loss ours "
                            f"{l_ours:.7f}, peer {l_peer:.7f}):", {"worst rank": res["diffs"]}, TOLERANCES,
                            res["same"])
        if not res["same"]:
            continue
        rounds = res["rounds"]
        print(harness.time_table(rounds, dp, f" (after {args.check_steps} check steps and {args.warmup} warm-up "
                                             f"steps of each per round)"))
        print("  " + harness.pair_line(rounds, "ours", "peer", goal=0.95 if part == "dp" else None))
        largest = {side: max(r[part]["state_bytes"][side] for r in results) for side in ("ours", "peer")}
        print(f"  optimizer state of the largest rank: ours {largest['ours']:,} bytes ({largest['ours'] / plain:.3f} "
              f"of plain AdamW's {plain:,}), peer {largest['peer']:,} ({largest['peer'] / plain:.3f})")
        for table in res.get("tables", {}).values():
            print(table)
    return ok


def main():
    parser = harness.parser(__doc__, repeats=7, steps=2, warmup=2, deadline=900.0, vocab_size=512,
                            block_size=128, n_layer=4, n_head=4, n_embd=256)
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="data-parallel sizes, one run each")
    parser.add_argument("--parts", nargs="+", choices=["dp", "zero"], default=["dp", "zero"],
                        help="dp: BucketedDDP vs DDP; zero: ZeRO-1 vs ZeroRedundancyOptimizer")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128, help="T")
    parser.add_argument("--bucket-numel", type=int, default=2**19,
                        help="elements per bucket, ours; DDP gets bucket_cap_mb = this x 4 bytes")
    parser.add_argument("--check-steps", type=int, default=3, help="steps of the same-function check")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    args = parser.parse_args()
    cfg = harness.model_config(args)
    print(f"config: {cfg}\ntorch {torch.__version__}, {os.cpu_count()} CPU cores; AdamW lr={args.lr} "
          f"weight_decay={args.weight_decay}; the peers at their defaults")
    ok, t0 = True, time.monotonic()
    for dp in args.dp:
        ok &= report(cfg, args, dp, harness.launch(worker, dp, cfg, args, timeout_s=300.0, deadline_s=args.deadline))
    print(f"\n{'PASS' if ok else 'FAIL'} (same-function checks); total {time.monotonic() - t0:.0f} s")
    return ok


if __name__ == "__main__":
    harness.run_main(main)
