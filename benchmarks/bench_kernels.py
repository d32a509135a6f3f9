"""Fused CUDA kernels and CUDA graphs (kernels/): against the unfused PyTorch they replace, on one GPU.

kernels/ on one GPU: each fused kernel against the unfused PyTorch, eager against a CUDA
graph for a launch-bound step, and 05 end to end (tokens/s, MFU). Without CUDA, a smoke run.
benchmarks/README.md has what each side runs, the checks and the method.

Run it (from the repository root; on a GPU it starts torchrun itself for the e2e section):
    python benchmarks/bench_kernels.py                  # everything: minutes, the first kernel builds included
    python benchmarks/bench_kernels.py --only kernels graphs   # where a command's time is limited,
    python benchmarks/bench_kernels.py --only e2e              # the sections one command each
"""
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import harness
import kernels  # a package beside the numbered files
import planner
from harness import ROOT, data_parallel, tensor_parallel
from kernels import bias_dropout_add as bda, bias_gelu as bg, graphs, layernorm as ln, softmax as sm

GOAL_SPEEDUP, GOAL_COPY, GOAL_GRAPHS, GOAL_MFU = 1.5, 0.70, 1.3, 0.45
# Same-function check, max |ours - peer| / max |peer| over the output and every input gradient.
# It refuses to time a broken kernel; the precise tolerances are in tests/test_kernel_*.py. fp32:
# other summation orders and tanhf/expf give ~1e-6. bf16: both round to 8 bits, at different points
# (the kernels once, from fp32; PyTorch after each op), a few ulps = ~1e-2 at worst; a wrong
# formula or mask is off by O(1).
CHECK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
P_DROP = 0.1
MODELS = {"350M": (24, 1024, 16), "1.3B": (24, 2048, 16)}  # n_layer, C, nh
VARIANTS = {"fused+graphs": ["--fused-kernels", "--cuda-graphs"],
            "unfused": ["--no-fused-kernels", "--no-cuda-graphs"]}
# The defaults that depend on the device: issue 16's sizes on a GPU, a smoke run's on a CPU.
DEVICE_DEFAULTS = {
    "cuda": dict(repeats=7, iters=10, warmup=3, shape=[8, 1024, 1024, 16], graph_steps=10,
                 graph_model=[4, 256, 4, 4, 128, 4096]),
    "cpu": dict(repeats=3, iters=3, warmup=1, shape=[2, 64, 64, 4], graph_steps=2,
                graph_model=[2, 64, 4, 2, 32, 256])}


# ----------------------------------------------------------------------------------------------
# Timing


class Timer:
    """Seconds per call; on a GPU each kernel call's device time (see the README), on a CPU the wall."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if self.cuda else None
        self.sleep_cycles = 500_000  # per queued call (~0.3 ms); doubled whenever the CPU fell behind
        self.behind = 0  # blocks where the GPU may have waited for the CPU

    def calls(self, fn, n):
        """[seconds] of each of n calls: CUDA events around each, after an L2 flush."""
        if not self.cuda:
            return [self.block(fn, 1)[0] for _ in range(n)]
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        torch.cuda.synchronize()
        torch.cuda._sleep(self.sleep_cycles * n)  # the GPU spins while the CPU queues the block
        woke = torch.cuda.Event()
        woke.record()
        for start, end in events:
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        if woke.query():  # the sleep ended before everything was queued: gaps may have been timed
            self.behind += 1
            self.sleep_cycles = min(2 * self.sleep_cycles, 50_000_000)
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in events]

    def block(self, fn, n):
        """[seconds per call] of n calls back to back, launch time included: what graphs remove."""
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
        return [(time.perf_counter() - t0) / n]


def medians(measure, sides, n, args):
    """{name: median seconds per call}: --repeats rounds of --warmup untimed calls of each side, then
    measure(side, n) of each, the first switching each round (harness.alternate), so that drift
    (clocks, other load) falls on both alike."""
    rounds = harness.alternate(sides, args.repeats, n, warmup=args.warmup, measure=measure)
    return {name: statistics.median(t for rnd in rounds for t in rnd[name]) for name in sides}


# ----------------------------------------------------------------------------------------------
# 1. Kernels


def kernel_cases(B, T, C, nh, dtype, device, mode):
    """Per family: inputs, ours, peer, the check pair and the minimum bytes forward / backward."""
    e, R = torch.empty((), dtype=dtype).element_size(), B * T

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)

    cases = []
    # Forward reads y, b, writes out; backward reads grad, y, b (z = y + b is recomputed), writes dy, db.
    y, b = randn(R, 4 * C), randn(4 * C)
    N, n = y.numel(), b.numel()
    cases.append(dict(name="bias_gelu", shape=(R, 4 * C), inputs=(y, b),
                      ours=lambda y, b: bg.bias_gelu(y, b, mode), peer=lambda y, b: F.gelu(y + b, approximate="tanh"),
                      bytes=((2 * N + n) * e, (3 * N + 2 * n) * e)))
    # Forward reads y, b, r, writes out (the mask is a hash: never stored); backward reads grad,
    # writes dy and db (d r is grad itself). Dropout masks differ between ours and torch, so the
    # check is against kernels' reference drawing the same mask from the same seed.
    y, b, r = randn(R, C), randn(C), randn(R, C)
    N, n = y.numel(), b.numel()
    cases.append(dict(name="bias_dropout_add", shape=(R, C), inputs=(y, b, r),
                      ours=lambda y, b, r: bda.bias_dropout_add(y, b, r, P_DROP, mode),
                      peer=lambda y, b, r: r + F.dropout(y + b, P_DROP, True),
                      check=(lambda *a: bda.bias_dropout_add(*a, P_DROP, mode, seed=7),
                             lambda *a: bda.bias_dropout_add(*a, P_DROP, "reference", seed=7)),
                      bytes=((3 * N + n) * e, (2 * N + n) * e)))
    # Causal: query i needs keys 0..i only, (T+1)/2T of the scores. Forward reads those, writes every
    # probability (zeros above the diagonal); backward reads grad and y there, writes every dx.
    x, scale = randn(B, nh, T, T), (C // nh) ** -0.5
    N, seen = x.numel(), x.numel() * (T + 1) / (2 * T)
    mask = sm.causal_mask(T, device)  # built once, as a model keeps it
    cases.append(dict(name="softmax", shape=(B, nh, T, T), inputs=(x,),
                      ours=lambda x: sm.scaled_masked_softmax(x, scale, mode),
                      peer=lambda x: torch.softmax((x * scale).masked_fill(mask, float("-inf")), -1),
                      bytes=((seen + N) * e, (2 * seen + N) * e)))
    # Forward reads x, w, b, writes y and the fp32 mean and rstd per row; backward reads grad, x, w,
    # mean, rstd, writes dx, dw, db. (torch's layer_norm keeps the same statistics.)
    x, w, b = randn(R, C), randn(C), randn(C)
    N = x.numel()
    cases.append(dict(name="layernorm", shape=(R, C), inputs=(x, w, b),
                      ours=lambda x, w, b: ln.layer_norm(x, w, b, 1e-5, mode),
                      peer=lambda x, w, b: F.layer_norm(x, (C,), w, b, 1e-5),
                      bytes=((2 * N + 2 * C) * e + 8 * R, (3 * N + 3 * C) * e + 8 * R)))
    return cases


def check_case(case):
    """Worst max_rel_diff over the output and every input gradient, one grad for both sides."""
    sides = case.get("check", (case["ours"], case["peer"]))
    results, g = [], None
    for fn in sides:
        out = fn(*case["inputs"])
        g = torch.randn_like(out) if g is None else g
        results.append([out.detach()] + list(torch.autograd.grad(out, case["inputs"], g)))
    return max(tensor_parallel.max_rel_diff(a.float(), b.float()) for a, b in zip(*results))


def time_case(timer, case, args):
    """{"fwd"/"bwd": {"ours"/"peer": median seconds}}. Forward runs with grad enabled (each op saves
    what its backward needs, as in training); backward re-runs one retained graph."""
    x = case["inputs"]
    fwd = {"ours": lambda: case["ours"](*x), "peer": lambda: case["peer"](*x)}
    outs = {k: f() for k, f in fwd.items()}
    g = torch.randn_like(outs["ours"])
    bwd = {k: (lambda o=o: torch.autograd.grad(o, x, g, retain_graph=True)) for k, o in outs.items()}
    return {d: medians(timer.calls, s, args.iters, args) for d, s in (("fwd", fwd), ("bwd", bwd))}


def kernels_section(args, device, timer, cuda):
    B, T, C, nh = args.shape
    mode = "cuda" if cuda else "reference"
    # The copy bandwidth, what any op can hope for: dst.copy_(src), counted 2 n (read + write).
    n = 2**30 if cuda else 2**26
    src, dst = torch.zeros(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    copy_bw = 2 * n / medians(timer.calls, {"copy": lambda: dst.copy_(src)}, args.iters, args)["copy"]
    # Checked first, both dtypes: the first call of each family builds its kernel (minutes, once),
    # and the build's messages then come before the table rather than inside it.
    cases = [(dtype, case, check_case(case)) for dtype in (torch.float32, torch.bfloat16)
             for case in kernel_cases(B, T, C, nh, dtype, device, mode)]
    print(f"\n=== kernels: ours = kernels/ with mode={mode!r}, peer = the unfused PyTorch; B={B} T={T} C={C} "
          f"nh={nh}, p={P_DROP}; {args.repeats} rounds x ({args.warmup} warm-up +) {args.iters} calls per side")
    print(f"copy bandwidth: dst.copy_(src) of {n / 2**30:g} GiB, counted 2 x {n / 2**30:g} GiB: {copy_bw / 1e9:,.0f} GB/s")
    print(f"goals: speed-up >= {GOAL_SPEEDUP}x, achieved >= {GOAL_COPY:.0%} of copy bandwidth")
    print(f"{'family':17s} {'shape':18s} {'dtype':5s} {'dir':3s} {'ours us':>9s} {'peer us':>9s} {'speed-up':>8s} "
          f"{'GB/s':>7s} {'of copy':>7s} {'1.5x':>4s} {'70%':>4s} {'check':>8s}")
    ok = True
    for dtype, case, diff in cases:
        tag = f"{case['name']:17s} {str(case['shape']):18s} {str(dtype)[6:].replace('loat', ''):5s}"
        if not diff <= CHECK_RTOL[dtype]:
            print(f"{tag} FAIL: ours and the peer differ by {diff:.1e} > {CHECK_RTOL[dtype]:g}; not timed")
            ok = False
            continue
        times = time_case(timer, case, args)
        for d, nbytes in zip(("fwd", "bwd"), case["bytes"]):
            t = times[d]
            speed, gbs = t["peer"] / t["ours"], nbytes / t["ours"]
            print(f"{tag} {d:3s} {t['ours'] * 1e6:9.1f} {t['peer'] * 1e6:9.1f} {speed:7.2f}x {gbs / 1e9:7.0f} "
                  f"{gbs / copy_bw:7.0%} {'yes' if speed >= GOAL_SPEEDUP else 'no':>4s} "
                  f"{'yes' if gbs >= GOAL_COPY * copy_bw else 'no':>4s} {diff:8.1e}", flush=True)
    print(f"paths taken: {kernels.build.report()}")
    if timer.behind:
        print(f"note: in {timer.behind} blocks the CPU had not queued every call before the GPU woke; "
              f"those figures may include launch gaps (the sleep was lengthened each time)")
    return ok


# ----------------------------------------------------------------------------------------------
# 2. CUDA graphs


def eager_step(model, micro, ignore_index=-100):
    """StepGraph._step's work run eagerly: each microbatch's token-weighted loss, then backward."""
    valid = [t != ignore_index for _, t in micro]
    n_valid = sum(v.sum() for v in valid)
    total = torch.zeros((), device=micro[0][0].device)
    for (idx, targets), v in zip(micro, valid):
        loss = model(idx, targets)[1] * (v.sum() / n_valid)
        loss.backward()
        total += loss.detach().float()
    return total


def graphs_section(args, device, timer, cuda):
    L, C, nh, B, T, V = args.graph_model
    cfg = tensor_parallel.GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=nh, n_embd=C)
    dtype = torch.bfloat16 if cuda else torch.float32
    # BucketedDDP (the trainer's gradient buffer, which StepGraph writes through its hooks) asks
    # for its group's size: a 1-rank gloo group, in this process. sync=False: nothing is reduced.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    gen = torch.Generator().manual_seed(0)
    # Two batches: the graph is captured on the first and checked and timed on the second, so a
    # replay that ignored its new input would fail the check.
    a, b = ([tuple(torch.randint(V, (2, B, T), generator=gen).to(device))] for _ in range(2))
    # A replay runs the very kernels eager runs: only atomics' order can differ (flash attention's
    # backward). A replay that reads a stale batch or misses a gradient write is off by O(1).
    rtol = CHECK_RTOL[dtype]
    print(f"\n=== CUDA graphs: one step's forward + backward (no optimizer) of GPT {cfg}, B={B} T={T} {dtype}; "
          f"eager (as the trainer without graphs: GPT.embed reads the ids back to check them) against "
          f"kernels.graphs.StepGraph.replay; {args.repeats} rounds x {args.graph_steps} steps per side\n"
          f"goal: speed-up >= {GOAL_GRAPHS}x")
    print(f"{'ops':8s} {'eager ms':>9s} {'graph ms':>9s} {'speed-up':>8s} {'check':>8s}")
    ok = True
    for name in ("pytorch", "fused"):  # built as 05 builds it: 01's GPT, optimize(), and fuse() for "fused"
        model = tensor_parallel.optimize(tensor_parallel.GPT(cfg, None, seed=0, dtype=dtype, device=device))
        if name == "fused":
            kernels.fuse(model, kernels.FusedOps("cuda" if cuda else "reference"))
        ddp = data_parallel.BucketedDDP(model.parameters(), dist.group.WORLD, 2_000_000,
                                        grad_dtype=torch.float32 if dtype == torch.bfloat16 else None)
        ddp.sync = False  # as the trainer: reduction after the step, here never

        def eager():
            loss = eager_step(model, b)
            ddp.zero_grad()
            return loss

        if not cuda:  # capture needs a GPU: time the eager side only
            t = medians(timer.block, {"eager": eager}, args.graph_steps, args)
            print(f"{name:8s} {t['eager'] * 1e3:9.2f} {'-':>9s} {'-':>8s} {'-':>8s}")
            continue
        step = graphs.StepGraph(model, a, ddp)
        loss_e = eager_step(model, b)
        grads_e = ddp.grad_buffer.clone()
        ddp.zero_grad()
        loss_g = step.replay(b)
        diff = max(tensor_parallel.max_rel_diff(loss_g, loss_e), tensor_parallel.max_rel_diff(ddp.grad_buffer, grads_e))
        ddp.zero_grad()
        if not diff <= rtol:
            print(f"{name:8s} FAIL: replay and eager differ by {diff:.1e} > {rtol:g}; not timed")
            ok = False
            continue

        def replay():
            step.replay(b)
            ddp.zero_grad()

        t = medians(timer.block, {"eager": eager, "graph": replay}, args.graph_steps, args)
        print(f"{name:8s} {t['eager'] * 1e3:9.2f} {t['graph'] * 1e3:9.2f} {t['eager'] / t['graph']:7.2f}x "
              f"{diff:8.1e}", flush=True)
    dist.destroy_process_group()
    return ok


# ----------------------------------------------------------------------------------------------
# 3. End to end: the trainer


def trainer_run(args, cuda, tmp, run):
    """One run of 05_3d_gpt.py at tp=pp=dp=1 (on a GPU under torchrun): the step times from its
    --metrics after the first `skip`, or None if it failed (said)."""
    label, variant, (L, C, nh), B, T, V, steps, skip, dtype = run
    metrics = Path(tmp) / f"{label}_{variant}.jsonl"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] if cuda else []
    cmd = [sys.executable, *launcher, "05_3d_gpt.py", "--tp", "1", "--pp", "1", "--dp", "1",
           "--n-layer", str(L), "--n-embd", str(C), "--n-head", str(nh), "--vocab-size", str(V),
           "--block-size", str(T), "--seq-len", str(T), "--batch-size", str(B), "--microbatches", "1",
           "--steps", str(steps), "--eval-every", "0", "--dtype", dtype,
           # a 1.3B model at 3e-3 (the default) may diverge within the steps; the rate costs nothing
           "--lr", "3e-4", "--min-lr", "3e-5", "--warmup-steps", "5", "--timeout-s", "600",
           "--metrics", str(metrics), *(VARIANTS[variant] if cuda else [])]
    print(f"\n$ {shlex.join(['python'] + cmd[1:])}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.e2e_timeout)
        failed = proc.returncode != 0 and "\n".join(proc.stderr.strip().splitlines()[-15:])
    except subprocess.TimeoutExpired:
        failed = f"stopped after {args.e2e_timeout} s"
    if failed or not metrics.exists():
        print(f"FAIL ({label}, {variant}):\n{failed or 'no metrics written'}")
        return None
    for line in proc.stdout.splitlines():  # what the trainer says it ran
        if line.startswith(("model ", "device ", "compute ", "kernel paths:", "CUDA graphs: capturing")):
            print(f"  {line}")
    return [json.loads(s)["time_s"] for s in metrics.read_text().splitlines()][skip:]


def e2e_section(args, device, timer, cuda):
    if cuda:
        torch.cuda.empty_cache()  # the trainer runs in its own process: hand back what we cached
    name = torch.cuda.get_device_name(device) if cuda else None
    peak = next((f for k, f in planner.PEAK_BF16_FLOPS.items() if name and k in name), None)
    print(f"\n=== end to end: 05_3d_gpt.py, tp=pp=dp=1, m=1, built-in byte corpus; peak "
          f"{peak / 1e12 if peak else 'unknown'} TFLOP/s bf16 for {name or 'CPU'}; goal MFU >= {GOAL_MFU:.0%} on 1.3B")
    print("MFU = flops_per_iteration(ModelSpec(l, h, nh, V, T), B, recompute=False) / (median time_s x peak)")
    # (label, variant, model dims, B, T, V, steps, skip, dtype) per run; on CPU one tiny smoke run.
    runs = [(m, v, MODELS[m], args.e2e_batch, args.e2e_seq, 50304, args.e2e_steps, args.e2e_skip, "bfloat16")
            for m in args.e2e_models for v in VARIANTS] if cuda else \
        [("tiny", "unfused", (2, 64, 4), 2, 64, 256, 4, 1, "float32")]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            t0 = time.monotonic()
            times = trainer_run(args, cuda, tmp, run)
            ok &= times is not None
            if times is None:
                continue
            label, variant, (L, C, nh), B, T, V, _, skip, dtype = run
            t, spec = statistics.median(times), planner.ModelSpec(L, C, nh, V, T)
            mfu = planner.flops_per_iteration(spec, B, recompute=False) / (t * peak) \
                if peak and dtype == "bfloat16" else None
            print(f"  {label} {variant}, {planner.params_exact(spec):,} parameters, B={B} T={T}: {len(times)} steps "
                  f"after the first {skip}, median {t * 1e3:.1f} ms (min {min(times) * 1e3:.1f}, max "
                  f"{max(times) * 1e3:.1f}); {B * T / t:,.0f} tokens/s; MFU {f'{mfu:.1%}' if mfu else 'n/a'}; "
                  f"run took {time.monotonic() - t0:.0f} s", flush=True)
    return ok


def main():
    cuda = torch.cuda.is_available()
    parser = harness.cli.make_parser(__doc__)
    parser.add_argument("--only", nargs="+", choices=["kernels", "graphs", "e2e"], default=["kernels", "graphs", "e2e"])
    parser.add_argument("--repeats", type=int, help="rounds of ours-then-peer / peer-then-ours")
    parser.add_argument("--iters", type=int, help="timed kernel calls per side per round")
    parser.add_argument("--warmup", type=int, help="untimed calls (steps) of each side per round")
    parser.add_argument("--shape", type=int, nargs=4, metavar=("B", "T", "C", "NH"), help="kernel shapes")
    parser.add_argument("--graph-model", type=int, nargs=6, metavar=("L", "C", "NH", "B", "T", "V"),
                        help="the graphs section's GPT and batch")
    parser.add_argument("--graph-steps", type=int, help="steps per side per round")
    parser.add_argument("--e2e-models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--e2e-batch", type=int, default=8, help="sequences per step (one micro-batch)")
    parser.add_argument("--e2e-seq", type=int, default=2048)
    parser.add_argument("--e2e-steps", type=int, default=15)
    parser.add_argument("--e2e-skip", type=int, default=3, help="first steps left out (capture, kernel builds)")
    parser.add_argument("--e2e-timeout", type=float, default=540.0, help="seconds per trainer run")
    parser.set_defaults(**DEVICE_DEFAULTS["cuda" if cuda else "cpu"])  # --help shows this device's
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    print(f"$ {shlex.join(['python', 'benchmarks/bench_kernels.py'] + sys.argv[1:])}")
    if cuda:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}")
    else:
        print(f"torch {torch.__version__}, CPU\nno CUDA device: GPU figures not measured; running the CPU smoke "
              f"version (references, small shapes)")
    torch.manual_seed(0)
    timer = Timer(device)
    t0, ok = time.monotonic(), True
    for section, fn in (("kernels", kernels_section), ("graphs", graphs_section), ("e2e", e2e_section)):
        if section in args.only:
            ok &= fn(args, device, timer, cuda)
    print(f"\n{'PASS' if ok else 'FAIL'} (same-function checks and trainer runs); total {time.monotonic() - t0:.0f} s")
    if not cuda:
        print("no CUDA device: GPU figures not measured")
    return ok


if __name__ == "__main__":
    harness.run_main(main)
