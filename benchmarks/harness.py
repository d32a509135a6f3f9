"""What every benchmark shares: the numbered files, the same-function guard, alternation, ratios.

Ours and the peer run the same function, checked before anything is timed (a pair that differs is
refused); then they alternate in one run, so that a machine whose load drifts slows both alike
(benchmarks/README.md says why):

    rounds = alternate({"ours": step_a, "peer": step_b}, repeats=7, steps=8)   # every rank
    print(pair_line(rounds, "ours", "peer"))                                     # rank 0
"""
import importlib
import importlib.util
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from plumbing import cli  # noqa: E402  (the repository root is on the path from here on)
from plumbing.launch import launch, run_main  # noqa: E402, F401  (the scripts' launcher and exit)

tensor_parallel = importlib.import_module("01_tensor_parallel")  # the names start with a digit
pipeline = importlib.import_module("02_pipeline_1f1b")
interleaved = importlib.import_module("03_interleaved")
data_parallel = importlib.import_module("04_data_parallel")
gpt3d = importlib.import_module("05_3d_gpt")


# ----------------------------------------------------------------------------------------------
# The same function


def start(cfg, seed):
    """The full (serial) state dict every side loads, float32, biases and LayerNorms random too (so
    that the guard exercises them), and the generator of the batches."""
    full = tensor_parallel.init_state_dict(cfg, seed, dtype=torch.float32, random_all=True)
    return full, torch.Generator().manual_seed(seed + 1)


def gpt(cfg, full, group=None, sequence_parallel=False, **switches):
    """01's GPT over `group` (None: the serial model), the weights of `full`, optimize()d as 05's."""
    model = tensor_parallel.GPT(cfg, group, sequence_parallel=sequence_parallel, init=False)
    model.load_full_state_dict(full)
    return tensor_parallel.optimize(model, **switches)


def rel(a, b):
    """|a - b| / |b| of two numbers (tensors: tensor_parallel.max_rel_diff)."""
    return abs(a - b) / max(abs(b), 1e-30)


def worst_rel(grads, ref):
    """The worst max_rel_diff over the tensors of ref (name -> tensor); inf if the names differ."""
    if set(grads) != set(ref):
        return math.inf
    return max(tensor_parallel.max_rel_diff(grads[name], ref[name]) for name in ref)


def agree(ok, group=None):
    """True on every rank iff ok is True on every rank: a tensor all-reduce, nothing pickled."""
    flag = torch.tensor([1.0 if ok else 0.0], dtype=torch.float64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def within(diffs, tolerances):
    """Whether every difference (name -> value) is within its tolerance (name -> bound)."""
    return all(diffs[name] <= bound for name, bound in tolerances.items())


def verdict(ok, tolerances):
    """Print the same-function guard's verdict (rank 0); False: the pair is not timed."""
    print(f"  all within tolerance ({tolerances})" if ok else
          f"FAIL: beyond tolerance ({tolerances}); refusing to time different functions")
    return ok


def guard(title, rows, tolerances, ok):
    """Print the same-function guard (rank 0): under a title, each row's differences (label ->
    {name: value}), then the verdict against the tolerances. Returns ok; False: not timed."""
    print(title)
    for label, diffs in rows.items():
        print(f"  {label:12s} " + "  ".join(f"{name} {value:.1e}" for name, value in diffs.items()))
    return verdict(ok, ", ".join(f"{name} {bound:g}" for name, bound in tolerances.items()))


# ----------------------------------------------------------------------------------------------
# Timing


def timed(step, n=1, setup=None):
    """n calls of step(), each after setup() (untimed) and a barrier: per call this rank's (wall,
    CPU) seconds."""
    out = []
    for _ in range(n):
        if setup:
            setup()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        out.append((time.perf_counter() - t0, time.process_time() - c0))
    return out


def combine(block):
    """Per step: the slowest rank's wall time and the CPU time summed over ranks. Called after the
    timed steps, so the reduction itself is not timed."""
    wall, cpu = (torch.tensor(col, dtype=torch.float64) for col in zip(*block))
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return list(zip(wall.tolist(), cpu.tolist()))


def alternate(contenders, repeats, steps, warmup=0, sweeps=False, setup=None, measure=None):
    """Time every contender (name -> step()) in turn. Each of `repeats` rounds runs `warmup` untimed
    steps of each, then a block of `steps` steps of each, the first contender rotating between
    rounds, or (sweeps=True) `steps` sweeps of one step of each, the order rotating every sweep (two
    contenders' steps run back to back). setup(name) runs untimed before each timed step. Returns
    per round {name: [(wall, CPU) per step]} combined over the ranks; given measure(step, n)
    (bench_kernels, one process), {name: [what measure returned]}."""
    names, rounds = list(contenders), []
    for r in range(repeats):
        for name in names:
            for _ in range(warmup):
                contenders[name]()
        raw = {name: [] for name in names}
        for i in range(steps if sweeps else 1):
            k = (r * steps + i if sweeps else r) % len(names)
            for name in names[k:] + names[:k]:
                n = 1 if sweeps else steps
                raw[name] += measure(contenders[name], n) if measure else \
                    timed(contenders[name], n, setup and (lambda name=name: setup(name)))
        rounds.append(raw if measure else {name: combine(block) for name, block in raw.items()})
    return rounds


def median_of(rounds, name, col=0):
    """The median over every timed step of `name` of one column: 0 wall, 1 CPU."""
    return statistics.median(t[col] for rnd in rounds for t in rnd[name])


def ratios(rounds, a, b):
    """a against b: the ratio of the wall medians, the quartiles of the paired ratios (steps run
    back to back), the ratio of the CPU medians and the ratio of each round's wall medians."""
    paired = sorted(x[0] / y[0] for rnd in rounds for x, y in zip(rnd[a], rnd[b]))
    return {"medians": median_of(rounds, a) / median_of(rounds, b),
            "paired": statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3,
            "cpu": median_of(rounds, a, 1) / median_of(rounds, b, 1),
            "rounds": [statistics.median(t[0] for t in rnd[a]) / statistics.median(t[0] for t in rnd[b])
                       for rnd in rounds]}


def pair_line(rounds, a, b, goal=None):
    """a against b in one line; the paired ratio is the better gauge on a loaded machine."""
    r = ratios(rounds, a, b)
    q, per_round = r["paired"], r["rounds"]
    return (f"{a}/{b}: {r['medians']:.3f} of the medians; paired {q[1]:.3f} [{q[0]:.2f}, {q[2]:.2f}]; "
            f"CPU {r['cpu']:.3f}; rounds, median {statistics.median(per_round):.3f}: "
            + " ".join(f"{x:.2f}" for x in per_round) + (f"  (goal <= {goal:g})" if goal else ""))


def time_table(rounds, ranks, note=""):
    """Milliseconds per step of every contender: wall median, min, max, and the CPU median."""
    first = next(iter(rounds[0].values()))
    lines = [f"{len(rounds)} rounds x {len(first)} timed steps of each{note}, ms per step:",
             f"  {'':12s} {'median':>8s} {'min':>8s} {'max':>8s} {'CPU':>8s}   "
             f"(wall = slowest of {ranks} ranks; CPU summed over them)"]
    for name in rounds[0]:
        w = [t[0] for rnd in rounds for t in rnd[name]]
        lines.append(f"  {name:12s} {statistics.median(w) * 1e3:8.1f} {min(w) * 1e3:8.1f} {max(w) * 1e3:8.1f} "
                     f"{median_of(rounds, name, 1) * 1e3:8.1f}")
    return "\n".join(lines)


def profiles(contenders, rows, steps=1, setup=None, title=""):
    """{name: torch.profiler's table of `steps` calls of that contender (after setup(name) and a
    barrier), its top `rows` by self CPU time}, on every rank."""
    tables = {}
    for name, step in contenders.items():
        if setup:
            setup(name)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        tables[name] = (f"\n--- torch.profiler, {steps} step{'s' if steps > 1 else ''} of {title}{name}, "
                        f"rank 0, top {rows} by self CPU time\n"
                        + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    return tables


# ----------------------------------------------------------------------------------------------
# The command line


def parser(doc, repeats, steps, warmup, deadline=600.0, **model_defaults):
    """The flags every benchmark has, and the model's (01's GPTConfig) with its own defaults; the
    docstring's "Run it" commands are the --help epilog."""
    p = cli.make_parser(doc)
    p.add_argument("--repeats", type=int, default=repeats, help="rounds; who goes first rotates")
    p.add_argument("--steps", type=int, default=steps, help="timed steps of each contender per round")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps of each per round")
    p.add_argument("--seed", type=int, default=1234, help="weights and batches")
    p.add_argument("--profile", action="store_true", help="also print where the time goes (rank 0)")
    p.add_argument("--profile-rows", type=int, default=15, help="rows of each profiler table")
    p.add_argument("--deadline", type=float, default=deadline, help="seconds before a run is stopped")
    cli.add_dataclass_args(p, tensor_parallel.GPTConfig, "model", **model_defaults)
    return p


def model_config(args, pipelining=False):
    """The GPTConfig of the flags, refusing before any rank starts: torchrun (the CPU ranks are our
    own), dropout (the sides would draw other masks), --seq-len > --block-size; and with a peer on
    torch.distributed.pipelining, no numpy (it passes objects through it) or --microbatches < --pp."""
    if "RANK" in os.environ:
        raise ValueError("run this directly, not under torchrun: it starts its own CPU ranks")
    cfg = cli.from_args(tensor_parallel.GPTConfig, args)
    if cfg.dropout:
        raise ValueError(f"--dropout {cfg.dropout}: the two sides would draw other masks; use 0")
    if getattr(args, "seq_len", 0) > cfg.block_size:
        raise ValueError(f"--seq-len {args.seq_len} exceeds --block-size {cfg.block_size}")
    if pipelining and importlib.util.find_spec("numpy") is None:
        raise ValueError("torch.distributed.pipelining passes Python objects between ranks through numpy, which "
                         "torch's CPU wheel does not install: pip install -r benchmarks/requirements.txt")
    if pipelining and args.microbatches < max(args.pp if isinstance(args.pp, list) else [args.pp]):
        raise ValueError(f"torch's Schedule1F1B needs --microbatches >= --pp; got {args.microbatches} and {args.pp}")
    return cfg
