"""Data-parallel overlap inside the pipeline: 05's training step with each overlap switch on and off.

05_3d_gpt.train_step at tp=1 x pp=2 x dp=2 (4 CPU ranks; --pp and --dp change it), one pair of runs
per part, same model, weights, batches and buckets; only the switch differs:
  dp      plain data parallelism, --overlap-grad-reduce on against off: each gradient bucket
          reduced during the last backward of its chunk, or every bucket after the pipeline flush;
  zero    ZeRO-1, both switches on against both off;
  gather  ZeRO-1 with the reduction overlapped, --overlap-param-gather on against off: the updated
          weights' all-gather runs on into the next step's forward, or is waited for in the step.
A switch changes when a collective starts, never what it adds, so both runs of a pair must produce
the same losses bit for bit (checked over --check-steps steps before anything is timed). A timed call
is --steps-per-call steps and then a wait for any gather still in flight, so the gather overlap
hides the steps-per-call - 1 gathers it can and pays for the last one; the method is harness.py's.

Run it (from the repository root; it starts its own CPU ranks, do not use torchrun):
    python benchmarks/bench_dp_overlap.py                     # every part, about 2 minutes on 2 cores
    python benchmarks/bench_dp_overlap.py --parts dp --repeats 11 --profile
"""
import os
import time

import torch.distributed as dist

import harness
from harness import gpt3d
from plumbing.checks import check_config
from plumbing.data import load_tokens, replica_batch, split_tokens

PARTS = {  # part: (the switches on, the switches off)
    "dp": (dict(), dict(overlap_grad_reduce=False)),
    "zero": (dict(zero1=True), dict(zero1=True, overlap_grad_reduce=False, overlap_param_gather=False)),
    "gather": (dict(zero1=True), dict(zero1=True, overlap_param_gather=False)),
}


def train_config(args, **switches):
    return gpt3d.TrainConfig(tp=1, pp=args.pp, dp=args.dp, batch_size=args.batch_size, microbatches=args.microbatches,
                             seq_len=args.seq_len, dtype="float32", bucket_numel=args.bucket_numel,
                             eval_every=0, timeout_s=300.0, seed=args.seed, **switches)


def run_part(env, cfg, args, part, groups, tokens):
    """The part's two runs on this rank: the check's losses and, if they agree, the timed rounds."""
    tcs = {name: train_config(args, **sw) for name, sw in zip(("on", "off"), PARTS[part])}
    runs = {name: gpt3d.build(env, cfg, tc, groups) for name, tc in tcs.items()}
    dp_rank = dist.get_rank(groups.dp)
    batches = [replica_batch(tokens, i, tcs["on"], dp_rank) for i in range(max(args.check_steps, args.steps_per_call))]
    losses = {}
    for name, run in runs.items():  # one after the other: a run's gathers never overlap the other's step
        losses[name] = [gpt3d.train_step(run, *batches[i], 1e-3)[0] for i in range(args.check_steps)]
        run.opt.wait_gather()
    result = {"losses": losses, "same": harness.agree(losses["on"] == losses["off"])}
    if not result["same"]:
        return result

    def call(run):
        for i in range(args.steps_per_call):
            gpt3d.train_step(run, *batches[i], 1e-3)
        run.opt.wait_gather()  # the last gather is paid for here, inside the timed call

    calls = {name: (lambda run=run: call(run)) for name, run in runs.items()}
    if args.profile:
        result["tables"] = harness.profiles(calls, args.profile_rows, title=f"{part}, ")
    waits = {name: exposed_waits(run) for name, run in runs.items()}
    result["rounds"] = harness.alternate(calls, args.repeats, args.steps, warmup=args.warmup)
    result["waits"] = {name: {k: w[k] / w["steps"] for k in ("finish", "wait_gather")} for name, w in waits.items()}
    result["buckets"] = len(runs["on"].ddp.buckets)
    result["held"] = len(runs["on"].ddp.held)
    return result


def exposed_waits(run):
    """Where the switches act, on this rank's clock: the seconds spent in ddp.finish() (the
    reduction's tail, after the pipeline; once per train step) and in opt.wait_gather() (wherever
    it waits), summed."""
    spent = {"finish": 0.0, "wait_gather": 0.0, "steps": 0}
    for obj, name in ((run.ddp, "finish"), (run.opt, "wait_gather")):
        def clocked(*args, real=getattr(obj, name), name=name):
            t0 = time.perf_counter()
            real(*args)
            spent[name] += time.perf_counter() - t0
            spent["steps"] += name == "finish"
        setattr(obj, name, clocked)
    return spent


def worker(env, cfg, args):
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, tp=1, dp=args.dp, pp=args.pp), 300.0)
    tokens = split_tokens(load_tokens("", cfg.vocab_size, args.seq_len), args.seq_len)[0]
    return {part: run_part(env, cfg, args, part, groups, tokens) for part in args.parts}


def report(args, results):
    ok, rows = True, []
    for part in args.parts:
        res = results[0][part]
        on, off = (" ".join(f"{x:.6f}" for x in res["losses"][k]) for k in ("on", "off"))
        print(f"\n--- {part}: switches {PARTS[part][0] or 'on (defaults)'} against {PARTS[part][1]}")
        print(f"same function: losses over {args.check_steps} steps, on: {on}\n{'':31s}off: {off}")
        ok &= harness.verdict(res["same"], "bit-identical losses")
        if not res["same"]:
            continue
        print(f"  rank 0: {res['buckets']} buckets of {args.bucket_numel:,} elements, {res['held']} held for "
              f"the tied embedding")
        print(harness.time_table(res["rounds"], len(results), f" ({args.steps_per_call} train steps + a wait each)"))
        print("  " + harness.pair_line(res["rounds"], "on", "off"))
        for name in ("on", "off"):  # on each rank's own clock
            ms = {k: " ".join(f"{r[part]['waits'][name][k] * 1e3:6.2f}" for r in results)
                  for k in ("finish", "wait_gather")}
            print(f"  {name:3s} mean ms per train step, rank by rank: in ddp.finish() {ms['finish']}; "
                  f"in opt.wait_gather() {ms['wait_gather']}")
        for table in res.get("tables", {}).values():
            print(table)
        r = harness.ratios(res["rounds"], "on", "off")
        rows.append((part, harness.median_of(res["rounds"], "on"), harness.median_of(res["rounds"], "off"),
                     r["medians"], r["paired"][1], r["cpu"]))
    print("\n=== summary: median wall ms per timed call (slowest rank), on/off: ratio of the medians, "
          "median paired ratio, CPU ratio")
    for part, mon, moff, ratio, paired, cpu in rows:
        print(f"  {part:6s} on {mon * 1e3:8.1f}  off {moff * 1e3:8.1f}  {ratio:6.3f}  {paired:6.3f}  {cpu:6.3f}")
    return ok


def main():
    parser = harness.parser(__doc__, repeats=7, steps=2, warmup=1, vocab_size=256, block_size=64, n_layer=4,
                            n_head=4, n_embd=128)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS), help="which pairs")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (tp is 1)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch B, in sequences")
    parser.add_argument("--microbatches", type=int, default=4, help="m per replica")
    parser.add_argument("--seq-len", type=int, default=64, help="T")
    parser.add_argument("--bucket-numel", type=int, default=20_000, help="elements per gradient bucket")
    parser.add_argument("--check-steps", type=int, default=3, help="steps of the same-function check")
    parser.add_argument("--steps-per-call", type=int, default=2, help="train steps per timed call")
    args = parser.parse_args()
    cfg = harness.model_config(args)
    world = args.pp * args.dp
    check_config(cfg, train_config(args), world)  # refused here, before any rank starts
    print(f"config: {cfg}\n05's train step, tp=1 x pp={args.pp} x dp={args.dp} ({world} gloo ranks x 1 thread on "
          f"{os.cpu_count()} cores), float32, B={args.batch_size}, m={args.microbatches}, T={args.seq_len}")
    t0 = time.monotonic()
    ok = report(args, harness.launch(worker, world, cfg, args, timeout_s=300.0, deadline_s=args.deadline))
    print(f"\n{'PASS' if ok else 'FAIL'} (same-function checks); total {time.monotonic() - t0:.0f} s")
    return ok


if __name__ == "__main__":
    harness.run_main(main)
