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
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import harness
from harness import data_parallel, tensor_parallel

# The same function, in float32: both sides run the same kernels on the same data; only the
# reduction differs (other bucket boundaries; ZeRO-1 reduce-scatters where DDP all-reduces), so gloo
# sums an element's dp contributions in another order. Two checks (benchmarks/README.md has more):
#  1. Step 1's reduced gradients, every element this rank holds: max |ours - peer| / max |peer| per
#     tensor <= GRAD_RTOL. Another order moves an element by an ulp or so of the summands (float32:
#     6e-8); a missing 1/dp or an unreduced bucket is off by 0.5 or more.
#  2. Every parameter after --check-steps AdamW steps: max |ours - peer| <= PARAM_TOL_LR x lr.
#     AdamW moves every element by about lr whatever its gradient's scale, and where a gradient
#     nearly cancels across ranks an ulp is a visible part of it (measured at dp=4: 1.2e-3 lr, so a
#     plain 1e-5 relative tolerance would fail on rounding alone); a stale ZeRO shard, an update
#     applied twice or a wrong gradient moves elements by ~lr. AdamW hides a gradient's scale,
#     hence check 1. Both were seen to fail on purpose-made bugs (no 1/dp; no all-gather).
GRAD_RTOL = 1e-6
PARAM_TOL_LR = 1e-2
ELEMENT_BYTES = 4  # float32


# ----------------------------------------------------------------------------------------------
# The two sides


def build(name, cfg, full, group, args, zero):
    """One side: its model, optimizer, ddp, and step(x, y, after_reduction=None), one full training
    step that returns the loss and records its phases' wall times in .phases (this rank's clock).
    after_reduction(side), if given, runs once the gradients are reduced and before the optimizer
    (the check reads the gradients there; never while timing)."""
    model = harness.gpt(cfg, full)
    if name == "ours":
        ddp = data_parallel.BucketedDDP(model.parameters(), group, args.bucket_numel, zero=zero)
        opt = data_parallel.FlatAdamW(ddp, lr=args.lr, weight_decay=args.weight_decay) if zero else \
            torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        forward, finish, zero_grad = model, ddp.finish, ddp.zero_grad
    else:
        # bucket_cap_mb given explicitly: DDP then caps its first bucket at it too (only the default,
        # bucket_cap_mb=None, i.e. 25 MiB, comes with a smaller 1 MiB first bucket; so in 2.11-2.13).
        # DDP closes a bucket once it reaches the cap and never splits a parameter, so its buckets
        # end up slightly larger than ours; rank 0 prints both layouts, DDP's as it really ran.
        ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mib(args),
                                      gradient_as_bucket_view=args.gradient_as_bucket_view)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, process_group=group,
                                      parameters_as_bucket_view=args.zero_bucket_view, lr=args.lr,
                                      weight_decay=args.weight_decay) if zero else \
            torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        forward, finish, zero_grad = ddp, (lambda: None), (lambda: opt.zero_grad(set_to_none=True))
    side = SimpleNamespace(name=name, model=model, optimizer=opt, ddp=ddp, phases={})

    def step(x, y, after_reduction=None):
        marks = [time.perf_counter()]

        def mark(phase):
            marks.append(time.perf_counter())
            side.phases.setdefault(phase, []).append(marks[-1] - marks[-2])

        _, loss = forward(x, y)
        mark("forward")
        loss.backward()  # ours: the hooks launch each bucket's reduction as it completes; DDP waits
        mark("backward")  # for its all-reduces at the end of backward
        finish()  # ours: the last launches, and the waits; DDP: nothing left (the tables line up)
        mark("finish")
        if after_reduction:
            after_reduction(side)
        opt.step()  # ZeRO-1: also the all-gather (ours) or broadcasts (peer) of the updated parameters
        mark("optimizer")
        zero_grad()
        mark("zero_grad")
        return loss.detach()

    side.step = step
    return side


def bucket_mib(args):
    return args.bucket_numel * ELEMENT_BYTES / 2**20


def ddp_bucket_numels(cfg, full, group, args, x, y):
    """The element counts of DDP's buckets with our cap, read through a comm hook on a throwaway
    DDP (a hook would slow the timed one). DDP rebuilds its buckets in gradient-ready order after
    the first backward, so the second backward shows the layout that is timed."""
    ddp = DistributedDataParallel(harness.gpt(cfg, full), process_group=group, bucket_cap_mb=bucket_mib(args))
    seen = []

    def recording_allreduce(state, bucket):
        seen.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(group, recording_allreduce)
    for _ in range(2):
        seen.clear()
        ddp(x, y)[1].backward()
    return list(seen)


# ----------------------------------------------------------------------------------------------
# Same function, then timing.


def batches_for_rank(cfg, args, dp, rank, n):
    """n global batches (dp x B sequences); this rank's rows of each. Same seed on every rank."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    out = []
    for _ in range(n):
        idx, targets = torch.randint(cfg.vocab_size, (2, dp * args.batch_size, args.seq_len), generator=gen)
        out.append(data_parallel.shard_batch(idx, targets, dp, rank))
    return out


def our_grads(side):
    """Name -> (this rank's reduced gradient, flat, from the buffer; mask of the elements it holds)."""
    ddp = side.ddp
    held = torch.zeros(ddp.grad_buffer.numel(), dtype=torch.bool)
    for i in range(len(ddp.buckets)):
        held[slice(*ddp.shard_range(i))] = True  # every element without ZeRO
    return {name: (ddp.main_grad(p).reshape(-1).clone(), held[ddp.offsets[p]:ddp.offsets[p] + p.numel()])
            for name, p in side.model.named_parameters()}


def peer_grads(side):
    return {name: p.grad.detach().reshape(-1).clone() for name, p in side.model.named_parameters()}


def check_same(ours, peer, batches, lr):
    """Train both on the same batches. Returns, as the worst over all ranks: the first step's
    gradient difference (relative, per tensor), the final parameter difference in units of lr,
    and the same relative per tensor (for information); and the losses."""
    grads = {}

    def grab(side):
        grads[side.name] = our_grads(side) if side is ours else peer_grads(side)

    losses = []
    for k, (x, y) in enumerate(batches):
        after = grab if k == 0 else None
        losses.append((ours.step(x, y, after).item(), peer.step(x, y, after).item()))
    grad_rel = max(tensor_parallel.max_rel_diff(g[held], grads["peer"][name][held])
                   for name, (g, held) in grads["ours"].items() if held.any())
    theirs = dict(peer.model.named_parameters())
    pairs = [(p.detach(), theirs[name].detach()) for name, p in ours.model.named_parameters()]
    param_lr = max((a - b).abs().max().item() for a, b in pairs) / lr
    param_rel = max(tensor_parallel.max_rel_diff(a, b) for a, b in pairs)
    worst = torch.tensor([grad_rel, param_lr, param_rel], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(("grad_rel", "param_lr", "param_rel"), worst.tolist())), losses


def run_part(env, cfg, args, full, group, part):
    """Check, then time, ours against the peer for one part ("dp" or "zero"); this rank's figures."""
    zero, dp = part == "zero", env.world_size
    ours, peer = (build(name, cfg, full, group, args, zero) for name in ("ours", "peer"))
    batches = batches_for_rank(cfg, args, dp, env.rank, args.check_steps)
    diffs, losses = check_same(ours, peer, batches, args.lr)
    result = {"diffs": diffs, "losses": losses, "our_buckets": [hi - lo for lo, hi in ours.ddp.buckets],
              "same": diffs["grad_rel"] <= GRAD_RTOL and diffs["param_lr"] <= PARAM_TOL_LR}
    # Optimizer state after a step (the moments exist from the first step on); FlatAdamW counts its
    # own, ZeroRedundancyOptimizer holds this rank's AdamW in .optim.
    result["state_bytes"] = {
        "ours": ours.optimizer.state_bytes() if zero else data_parallel.optimizer_state_bytes(ours.optimizer),
        "peer": data_parallel.optimizer_state_bytes(peer.optimizer.optim if zero else peer.optimizer)}
    if not result["same"]:
        return result

    x, y = batches[0]  # timing reuses one batch: the data does not change the work
    sides = [ours, peer]
    steps = {side.name: (lambda side=side: side.step(x, y)) for side in sides}
    if args.profile:  # a few steps: one is too noisy on a shared machine
        result["tables"] = harness.profiles(steps, args.profile_rows, steps=3, title=f"{part} dp={dp}, ")
    for _ in range(args.warmup):  # the check steps warmed up too (DDP has rebuilt its buckets)
        for step in steps.values():
            step()
    for side in sides:
        side.phases.clear()  # the breakdown covers the timed steps only
    result["rounds"] = harness.alternate(steps, args.repeats, args.steps)
    # Phase medians over the timed steps, this rank's own clock: "where does the time go".
    result["phases"] = {s.name: {k: statistics.median(v) for k, v in s.phases.items()} for s in sides}
    return result


def worker(env, cfg, args):
    full, _ = harness.start(cfg, args.seed)
    x, y = batches_for_rank(cfg, args, env.world_size, env.rank, 1)[0]
    return {"ddp_buckets": ddp_bucket_numels(cfg, full, dist.group.WORLD, args, x, y),
            "parts": {part: run_part(env, cfg, args, full, dist.group.WORLD, part) for part in args.parts}}


# ----------------------------------------------------------------------------------------------
# Report and command line (rank 0 prints; per-rank figures come back through launch's results).


def fmt_buckets(numels):
    """Element counts of a bucket layout, runs of equal sizes collapsed: "7 buckets: 6 x 524,288 + ..."."""
    runs = []
    for n in numels:
        if runs and runs[-1][1] == n:
            runs[-1][0] += 1
        else:
            runs.append([1, n])
    body = " + ".join(f"{k} x {n:,}" if k > 1 else f"{n:,}" for k, n in runs)
    return f"{len(numels)} bucket{'s' if len(numels) > 1 else ''}: {body}"


def report(cfg, args, dp, results):
    r0 = results[0]
    n_params = sum(t.numel() for t in tensor_parallel.init_state_dict(cfg, 0).values())
    print(f"\n=== dp={dp}: {dp} gloo ranks x 1 thread on {os.cpu_count()} cores"
          + (" (ranks time-share the cores)" if dp > (os.cpu_count() or 1) else ""))
    print(f"per-rank batch B={args.batch_size} T={args.seq_len}, {n_params:,} parameters, float32; "
          f"bucket {args.bucket_numel:,} elements = {bucket_mib(args):g} MiB")
    print(f"  ours: {fmt_buckets(r0['parts'][args.parts[0]]['our_buckets'])} (a parameter may span two)")
    print(f"  DDP:  {fmt_buckets(r0['ddp_buckets'])} (in all-reduce order, after its rebuild)")
    rows, ok = [], True
    for part in args.parts:
        res = r0["parts"][part]
        label = {"dp": "DP (DDP + AdamW)", "zero": "ZeRO-1 (DDP + ZeroRedundancyOptimizer)"}[part]
        print(f"\n--- {part}: ours against {label}")
        l_ours, l_peer = res["losses"][-1]
        d = res["diffs"]
        print(f"same function, from the same weights on the same batches (worst over ranks):\n"
              f"  step-1 reduced gradients  {d['grad_rel']:.1e}  max |ours - peer| / max |peer| per tensor "
              f"(tolerance {GRAD_RTOL:g})\n"
              f"  parameters after {args.check_steps} steps {d['param_lr']:.1e} x lr  max |ours - peer| "
              f"(tolerance {PARAM_TOL_LR:g} x lr); {d['param_rel']:.1e} relative per tensor\n"
              f"  last loss ours {l_ours:.7f} peer {l_peer:.7f}")
        ok &= harness.verdict(res["same"], f"{GRAD_RTOL:g} and {PARAM_TOL_LR:g} x lr")
        if not res["same"]:
            continue
        rounds = res["rounds"]
        print(harness.time_table(rounds, dp, f" (after {args.check_steps} check and {args.warmup} warm-up steps)"))
        print("  " + harness.pair_line(rounds, "ours", "peer", goal=1.0 if part == "dp" else None))
        for table in res.get("tables", {}).values():
            print(table)
        ph = res["phases"]
        names = list(ph["ours"])
        print(f"  phases, median ms on rank 0: {'':3s}" + " ".join(f"{n:>9s}" for n in names))
        for side in ("ours", "peer"):
            print(f"  {side:32s}" + " ".join(f"{ph[side][n] * 1e3:9.1f}" for n in names))
        sb = {side: [r["parts"][part]["state_bytes"][side] for r in results] for side in ("ours", "peer")}
        plain = 2 * ELEMENT_BYTES * n_params  # AdamW's exp_avg and exp_avg_sq of every parameter
        print(f"  optimizer state bytes per rank (plain AdamW: {plain:,}; /dp = {plain // dp:,}):")
        for side in ("ours", "peer"):
            print(f"    {side}  " + "  ".join(f"{b:,}" for b in sb[side]) +
                  f"   (largest {max(sb[side]) / plain:.3f} of plain)")
        r = harness.ratios(rounds, "ours", "peer")
        rows.append((part, harness.median_of(rounds, "ours"), harness.median_of(rounds, "peer"), r["medians"],
                     statistics.median(r["rounds"]), r["cpu"], max(sb["ours"]), max(sb["peer"])))
    return ok, rows


def print_summary(summary):
    print("\n=== summary: median wall ms per step (slowest rank); ratios ours/peer of the wall medians, "
          "of the per-round wall medians, of the CPU medians; largest optimizer state on any rank, bytes")
    print(f"  {'dp':>3s} {'part':5s} {'ours':>8s} {'peer':>8s} {'ratio':>6s} {'rounds':>6s} {'CPU':>6s} "
          f"{'state ours':>12s} {'state peer':>12s}")
    for dp, rows in summary:
        for part, mo, mp, ratio, rounds, cpu, so, sp in rows:
            print(f"  {dp:3d} {part:5s} {mo * 1e3:8.1f} {mp * 1e3:8.1f} {ratio:6.3f} {rounds:6.3f} {cpu:6.3f} "
                  f"{so:12,d} {sp:12,d}")


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
    parser.add_argument("--gradient-as-bucket-view", action="store_true",
                        help="peer DDP option: gradients are views into its buckets (no copy)")
    parser.add_argument("--zero-bucket-view", action="store_true",
                        help="peer ZeroRedundancyOptimizer option parameters_as_bucket_view "
                             "(one broadcast per rank instead of one per parameter)")
    args = parser.parse_args()
    cfg = harness.model_config(args)
    print(f"config: {cfg}\ntorch {torch.__version__}, {os.cpu_count()} CPU cores; AdamW lr={args.lr} "
          f"weight_decay={args.weight_decay}; peer DDP gradient_as_bucket_view={args.gradient_as_bucket_view}, "
          f"ZeroRedundancyOptimizer parameters_as_bucket_view={args.zero_bucket_view}")
    ok, summary, t0 = True, [], time.monotonic()
    for dp in args.dp:
        good, rows = report(cfg, args, dp, harness.launch(worker, dp, cfg, args, timeout_s=300.0,
                                                          deadline_s=args.deadline))
        ok &= good
        summary.append((dp, rows))
    print_summary(summary)
    print(f"\n{'PASS' if ok else 'FAIL'} (same-function checks); total {time.monotonic() - t0:.0f} s")
    return ok


if __name__ == "__main__":
    harness.run_main(main)
