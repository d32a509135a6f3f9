"""Context parallelism: 08's ring attention against torch's own, and the activations per rank.

The pair: one causal attention, forward and backward, of this rank's rows (B, nh, T/cp, hs) in
Megatron's split (rank i holds chunks i and 2cp - 1 - i, the order torch's load balancer uses):
08's ring_forward and ring_backward (FlashAttention-2's recurrences in plain torch, Megatron's
schedule) against torch's private ring, torch.distributed.tensor.experimental's
_templated_ring_attention and its backward over aten's CPU flash-attention kernel, with its load
balancing on (the same split). Private and moved between releases: pinned to torch 2.11-2.13 and
skipped, with a line saying so, where it is absent. Both sides run the same inputs; before timing,
their outputs and gradients are checked equal (float32), then they alternate in one run.

Then 08's GPT-2 forward at cp = 1, 2 and 4 with its activations counted (what autograd saves for
backward, plumbing/meter.ActivationMeter): the peak bytes per rank, expected about 1/cp of cp = 1's.

Run it (from the repository root; it starts its own ranks, do not use torchrun):
    python benchmarks/bench_context_parallel.py                  # cp = 1, 2, 4; T = 1024
    python benchmarks/bench_context_parallel.py --seq-len 2048 --repeats 7
"""
import importlib
import time

import torch
import torch.distributed as dist

import harness
from harness import tensor_parallel
from plumbing.meter import ActivationMeter

cpar = importlib.import_module("08_context_parallel")
TOLERANCES = {"out": 1e-5, "grads": 1e-4}  # float32: the same sums in another order, and torch's kernel's tiles


def torch_ring():
    """torch's private ring (forward, backward) and its options, or None where this torch lacks it."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 11) or (major, minor) > (2, 13):
        return None
    for name in ("_context_parallel._attention", "_attention"):  # 2.13 moved it; 2.11 had it in _attention
        try:
            ring = importlib.import_module("torch.distributed.tensor.experimental." + name)
            return ring._templated_ring_attention, ring._templated_ring_attention_backward, ring._cp_options
        except (ImportError, AttributeError):
            continue
    return None


def sides(q, k, v, do, sched, group, theirs):
    """Both implementations' step (forward and backward) and their results, on this rank's rows."""
    ring_fwd, ring_bwd, options = theirs
    options.enable_load_balance = sched.cp > 1  # torch's head-tail split: Megatron's
    aten = torch.ops.aten

    def ours():
        o, lse = cpar.ring_forward(q, k, v, sched, group)
        return (o, *cpar.ring_backward(q, k, v, o, lse, do, sched, group))

    def torch_side():
        o, lse = ring_fwd(group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=True)[:2]
        grads = ring_bwd(group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward, do, "grad_out", q, k, v,
                         o, lse, True, dropout_p=0.0)[:3]
        return (o, *grads)
    return {"ours": ours, "torch": torch_side}


def activations(env, cfg, args, cp, group, full):
    """Peak bytes autograd saves on this rank for one forward of 08's GPT-2 at cp (Megatron's split)."""
    model = cpar.context_parallel(tensor_parallel.GPT(cfg, None, init=False), cpar.megatron(cp), group)
    model.load_full_state_dict(full)
    idx = torch.randint(cfg.vocab_size, (2, args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(3))
    meter = ActivationMeter([model], {})
    with meter.forward(0):
        _, loss = model(idx[0], idx[1])
    meter.measure()
    loss.backward()  # the ring's backward: every rank of the group takes part
    return meter.peak


def worker(env, cfg, args, theirs):
    cp = env.world_size
    group, sched = dist.group.WORLD, cpar.megatron(cp)
    B, nh, hs, T = args.batch_size, cfg.n_head, cfg.n_embd // cfg.n_head, args.seq_len
    gen = torch.Generator().manual_seed(args.seed)
    full_qkv = torch.randn(4, B, nh, T, hs, generator=gen)
    pos = cpar.positions(sched, env.rank, T)
    q, k, v, do = (t[:, :, pos].contiguous() for t in full_qkv)  # this rank's rows, Megatron's split
    out = {"cp": cp, "peak": activations(env, cfg, args, cp, group, harness.start(cfg, args.seed)[0])}
    if theirs is None:
        return out
    contenders = sides(q, k, v, do, sched, group, theirs)
    a, b = contenders["ours"](), contenders["torch"]()
    diffs = {"out": tensor_parallel.max_rel_diff(a[0], b[0]),
             "grads": max(tensor_parallel.max_rel_diff(x, y) for x, y in zip(a[1:], b[1:]))}
    out["checks"] = diffs
    if not harness.agree(harness.within(diffs, TOLERANCES)):
        return {**out, "same": False}
    out.update(same=True, rounds=harness.alternate(contenders, args.repeats, args.steps, args.warmup, sweeps=True))
    return out


def main():
    parser = harness.parser(__doc__, repeats=5, steps=3, warmup=1, vocab_size=1024, block_size=4096, n_layer=2,
                            n_head=4, n_embd=128)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes (CPU ranks)")
    parser.add_argument("--batch-size", type=int, default=1, help="B, sequences")
    parser.add_argument("--seq-len", type=int, default=1024, help="T: divisible by 2 cp")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    args = parser.parse_args()
    cfg = harness.model_config(args)
    for cp in args.cp:
        if cp < 1 or args.seq_len % (2 * cp):
            raise ValueError(f"--seq-len {args.seq_len} must be divisible by 2 cp = {2 * cp} (--cp {cp})")
    theirs = torch_ring()
    print(f"config: {cfg}; float32; B={args.batch_size} T={args.seq_len} nh={cfg.n_head} hs={cfg.n_embd // cfg.n_head}; "
          f"torch {torch.__version__}; gloo, one thread per rank")
    if theirs is None:
        print(f"torch's ring attention: not timed (its private entry point is pinned to torch 2.11-2.13 and this is "
              f"{torch.__version__}, or it is absent)")
    t0, peaks, ok = time.perf_counter(), {}, True
    for cp in args.cp:
        results = harness.launch(worker, cp, cfg, args, theirs, timeout_s=args.timeout, deadline_s=args.deadline)
        peaks[cp] = [r["peak"] for r in results]
        if theirs is None:
            continue
        worst = {k: max(r["checks"][k] for r in results) for k in TOLERANCES}
        print(f"\n=== cp={cp}: {cp} rank{'s' if cp > 1 else ''}, {args.seq_len // cp} rows each ===")
        if not harness.guard("same function, 08's against torch's (worst rank):", {"ours/torch": worst}, TOLERANCES,
                             all(r["same"] for r in results)):
            ok = False
            continue
        rounds = results[0]["rounds"]
        print(f"attention forward + backward, in sweeps: {harness.time_table(rounds, cp)}")
        print("  " + harness.pair_line(rounds, "ours", "torch"))
    print("\npeak activation bytes per rank, 08's GPT-2 forward (what autograd saves for backward):")
    for cp, row in peaks.items():
        print(f"  cp={cp}: " + ", ".join(f"{x:,}" for x in row) + f"  = {max(row) / max(peaks[args.cp[0]]):.3f} of "
              f"cp={args.cp[0]}'s (1/cp = {args.cp[0] / cp:.3f})")
    print(f"(took {time.perf_counter() - t0:.0f} s)")
    return ok


if __name__ == "__main__":
    harness.run_main(main)
