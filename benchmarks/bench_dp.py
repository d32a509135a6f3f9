"""Data-parallel step time and ZeRO-1 memory: 04_data_parallel.py against PyTorch's own.

One training step of 04's bucketed DP against DDP, and of 04's ZeRO-1 against DDP +
ZeroRedundancyOptimizer, same model, weights, batch and buckets; with the optimizer state per rank.
benchmarks/README.md has what each side runs, the checks and the method.

Run it (from the repository root; CPU only, it starts its own ranks: not under torchrun):
    python benchmarks/bench_dp.py                        # dp=2 and dp=4, both parts: 40 s idle,
                                                         # ~2 min on a busy 2-core machine
    python benchmarks/bench_dp.py --repeats 21           # tighter medians (the results' run)
    python benchmarks/bench_dp.py --dp 2 --parts dp --repeats 7 --steps 5
    python benchmarks/bench_dp.py --bucket-numel 262144  # 1 MiB buckets on both sides
    python benchmarks/bench_dp.py --dp 2 --parts dp --profile   # where each step's time goes
    python benchmarks/bench_dp.py --gradient-as-bucket-view --zero-bucket-view  # peer's fast options
"""
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import harness
from harness import data_parallel, tensor_parallel

# What "the same function" means here, in float32. Both sides run the same forward and backward
# kernels on the same data; only the gradient reduction differs: the buckets have other boundaries
# (and ZeRO-1 reduce-scatters where DDP all-reduces), so gloo adds up an element's dp contributions
# in another order. Two checks, and the run refuses to time a pair that fails either:
#  1. The reduced gradients of the first step (same weights, same batch), every element this rank
#     holds (ours under ZeRO-1: its shard of each bucket): max |ours - peer| / max |peer| per
#     tensor <= GRAD_RTOL. Another summation order changes an element by an ulp or so of the
#     summands (float32: 6e-8; at dp=2 the sums are bit-equal, as a + b = b + a); a missing 1/dp
#     or a bucket left unreduced (the local gradient) is off by 0.5 or more.
#  2. Every parameter after --check-steps AdamW steps: max |ours - peer| <= PARAM_TOL_LR x lr.
#     AdamW normalizes the gradient: every element moves by about lr per step whatever its
#     gradient's scale (lr g / (|g| + eps) at the first step). Where an element's gradient nearly
#     cancels across ranks, down towards eps = 1e-8, an ulp of the summands is a visible part of g
#     and that element's update moves by a small fraction of lr (measured with the defaults at
#     dp=4: 1.2e-3 lr, 2e-5 of the largest entry of the tensor concerned, so a plain 1e-5
#     relative tolerance would fail on rounding alone). A stale or unsynchronised ZeRO shard, an update
#     applied twice or a wrong gradient moves elements by ~lr: a hundred times the tolerance.
#     AdamW hides a gradient's scale (a missing 1/dp barely changes the update), which is why
#     check 1 exists. Both checks were seen to fail on purpose-made bugs (no 1/dp; no all-gather).
GRAD_RTOL = 1e-6
PARAM_TOL_LR = 1e-2
ELEMENT_BYTES = 4  # float32


# ----------------------------------------------------------------------------------------------
# The two sides. Each is a model plus a step() that runs one full training step and returns the
# loss; step() also records the wall time of its phases, for the breakdown.


class Side:
    def __init__(self, name, kind, model, step_fn, optimizer, ddp=None):
        self.name, self.kind, self.model, self.step_fn = name, kind, model, step_fn
        self.optimizer, self.ddp = optimizer, ddp
        self.phases = {}  # phase name -> list of seconds, this rank only

    def step(self, x, y, after_reduction=None):
        """One training step; after_reduction(self), if given, runs once the gradients are reduced
        and before the optimizer (the check reads the gradients there; never while timing)."""
        marks = [("start", time.perf_counter())]

        def mark(name):
            marks.append((name, time.perf_counter()))
            if name == "finish" and after_reduction is not None:
                after_reduction(self)

        loss = self.step_fn(x, y, mark)
        for (_, t0), (name, t1) in zip(marks, marks[1:]):
            self.phases.setdefault(name, []).append(t1 - t0)
        return loss


def new_model(cfg, full):
    model = tensor_parallel.GPT(cfg, None, init=False, dtype=torch.float32)
    model.load_full_state_dict(full)
    return model


def build_ours(cfg, full, group, args, zero):
    model = new_model(cfg, full)
    ddp = data_parallel.BucketedDDP(model.parameters(), group, args.bucket_numel, zero=zero)
    if zero:
        opt = data_parallel.FlatAdamW(ddp, lr=args.lr, weight_decay=args.weight_decay)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def step(x, y, mark):
        _, loss = model(x, y)
        mark("forward")
        loss.backward()  # the hooks launch each bucket's reduction as it completes
        mark("backward")
        ddp.finish()  # the last launches, and the waits
        mark("finish")
        opt.step()  # ZeRO-1: also the all-gather of the updated parameters
        mark("optimizer")
        ddp.zero_grad()
        mark("zero_grad")
        return loss.detach()

    return Side("ours", "zero" if zero else "dp", model, step, opt, ddp)


def build_peer(cfg, full, group, args, zero):
    model = new_model(cfg, full)
    # bucket_cap_mb given explicitly: DDP then caps its first bucket at it too (only the default,
    # bucket_cap_mb=None, i.e. 25 MiB, comes with a smaller 1 MiB first bucket; so in 2.11-2.13).
    # DDP closes a bucket once it reaches the cap and never splits a parameter, so its buckets
    # end up slightly larger than ours; rank 0 prints both layouts, DDP's as it really ran.
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mib(args),
                                  gradient_as_bucket_view=args.gradient_as_bucket_view)
    if zero:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                      process_group=group,
                                      parameters_as_bucket_view=args.zero_bucket_view,
                                      lr=args.lr, weight_decay=args.weight_decay)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def step(x, y, mark):
        _, loss = ddp(x, y)
        mark("forward")
        loss.backward()  # DDP waits for its all-reduces at the end of backward
        mark("backward")
        mark("finish")  # nothing left to wait for: an empty phase, so the tables line up
        opt.step()  # ZeroRedundancyOptimizer: also the broadcasts of the updated parameters
        mark("optimizer")
        opt.zero_grad(set_to_none=True)
        mark("zero_grad")
        return loss.detach()

    return Side("peer", "zero" if zero else "dp", model, step, opt, ddp)


def bucket_mib(args):
    return args.bucket_numel * ELEMENT_BYTES / 2**20


def ddp_bucket_numels(cfg, full, group, args, x, y):
    """The element counts of DDP's buckets with our cap, read through a comm hook on a throwaway
    DDP (a hook would slow the timed one). DDP rebuilds its buckets in gradient-ready order after
    the first backward, so the second backward shows the layout that is timed."""
    ddp = DistributedDataParallel(new_model(cfg, full), process_group=group, bucket_cap_mb=bucket_mib(args))
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
        a, b = ddp.shard_range(i)  # every element without ZeRO
        held[a:b] = True
    return {name: (ddp.grad_buffer[ddp.offsets[p]:ddp.offsets[p] + p.numel()].clone(),
                   held[ddp.offsets[p]:ddp.offsets[p] + p.numel()])
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
    zero = part == "zero"
    dp = env.world_size
    ours = build_ours(cfg, full, group, args, zero)
    peer = build_peer(cfg, full, group, args, zero)
    batches = batches_for_rank(cfg, args, dp, env.rank, args.check_steps)
    diffs, losses = check_same(ours, peer, batches, args.lr)
    same = diffs["grad_rel"] <= GRAD_RTOL and diffs["param_lr"] <= PARAM_TOL_LR
    result = {"diffs": diffs, "losses": losses, "same": same}
    # Optimizer state after a step (the moments exist from the first step on).
    if zero:
        result["state_bytes"] = {"ours": ours.optimizer.state_bytes(),
                                 "peer": data_parallel.optimizer_state_bytes(peer.optimizer.optim)}
    else:
        result["state_bytes"] = {"ours": data_parallel.optimizer_state_bytes(ours.optimizer),
                                 "peer": data_parallel.optimizer_state_bytes(peer.optimizer)}
    result["our_buckets"] = [hi - lo for lo, hi in ours.ddp.buckets]
    if not result["same"]:
        return result

    x, y = batches[0]  # timing reuses one batch: the data does not change the work
    sides = [ours, peer]
    steps = {side.name: (lambda side=side: side.step(x, y)) for side in sides}
    if args.profile:  # a few steps: one is too noisy on a shared machine
        result["tables"] = {name: harness.profile_table(step, args.profile_rows, steps=3)
                            for name, step in steps.items()}
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
    group = dist.group.WORLD
    # random_all: non-zero biases and LayerNorm weights, so the check exercises them as well.
    full = tensor_parallel.init_state_dict(cfg, args.seed, dtype=torch.float32, random_all=True)
    out = {"parts": {}}
    x, y = batches_for_rank(cfg, args, env.world_size, env.rank, 1)[0]
    out["ddp_buckets"] = ddp_bucket_numels(cfg, full, group, args, x, y)
    for part in args.parts:
        out["parts"][part] = run_part(env, cfg, args, full, group, part)
    return out


# ----------------------------------------------------------------------------------------------
# Report (rank 0 of each launch prints; per-rank figures come back through launch's results).


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
    rows = []
    ok = True
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
        if not res["same"]:
            print("FAIL: the two differ; refusing to time different functions")
            ok = False
            continue
        rounds = res["rounds"]
        print(f"timing: {args.repeats} rounds x {args.steps} steps of each (after {args.check_steps} check and "
              f"{args.warmup} warm-up steps), ms per step:\n{harness.time_table(rounds, dp)}")
        print("  " + harness.pair_line(rounds, "ours", "peer", goal=1.0 if part == "dp" else None))
        med = {k: harness.median_of(rounds, k) for k in ("ours", "peer")}
        ratio = med["ours"] / med["peer"]
        cpu_ratio = harness.median_of(rounds, "ours", 1) / harness.median_of(rounds, "peer", 1)
        per_round = [statistics.median(t[0] for t in r["ours"]) / statistics.median(t[0] for t in r["peer"])
                     for r in rounds]
        for name, table in res.get("tables", {}).items():
            print(f"\n--- profile of 3 {name} steps ({part}, dp={dp}), rank 0\n{table}")
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
        rows.append((part, med["ours"], med["peer"], ratio, statistics.median(per_round), cpu_ratio,
                     max(sb["ours"]), max(sb["peer"])))
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
    print(f"config: {cfg}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores; AdamW lr={args.lr} "
          f"weight_decay={args.weight_decay}; peer DDP gradient_as_bucket_view="
          f"{args.gradient_as_bucket_view}, ZeroRedundancyOptimizer parameters_as_bucket_view="
          f"{args.zero_bucket_view}")
    ok, summary = True, []
    t0 = time.monotonic()
    for dp in args.dp:
        results = harness.launch(worker, dp, cfg, args, timeout_s=300.0, deadline_s=args.deadline)
        good, rows = report(cfg, args, dp, results)
        ok &= good
        summary.append((dp, rows))
    print_summary(summary)
    print(f"\n{'PASS' if ok else 'FAIL'} (same-function checks); total {time.monotonic() - t0:.0f} s")
    return ok


if __name__ == "__main__":
    harness.run_main(main)
