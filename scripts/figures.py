"""The course's figures, computed from the simulator and from real CPU runs: text in the terminal
always, and a PNG beside it when matplotlib is installed.

    python3 scripts/figures.py                      # every figure; PNGs in figures/ with matplotlib
    python3 scripts/figures.py bubble memory        # some of them
    python3 scripts/figures.py --out /tmp/figs      # PNGs elsewhere
    python3 scripts/figures.py --no-png             # text only

The figures (docs/DIAGRAMS.md shows each and says what it means):
    bubble   the pipeline bubble against m for v = 1, 2, 4 (pp = 4): 02's simulate() on 03's lists,
             beside the formula (pp - 1)/(v m); exact fractions
    memory   peak stored activation bytes per stage for GPipe, 1F1B and interleaved 1F1B, measured by
             02's executor (its ActivationMeter) on pp = 4 CPU ranks
    overlap  04's BucketedDDP on dp = 2 CPU ranks: backward, and each bucket's reduction, launched
             during backward and seen done, on one time axis (a real run: the times vary)
    grid     05's rank grid for tp = 2 x dp = 2 x pp = 2, drawn as stages of replicas of tp groups
    zero     ZeRO-1's partition of the flat gradient buffer of a real BucketedDDP (dp = 4): which
             rank keeps the optimizer state of which elements of each bucket
The loss curve of a run is scripts/plot_metrics.py's (from 05's --metrics).

Exit code 0; 1 with -o/--out given and a PNG asked for but matplotlib missing (text printed anyway).
"""
import argparse
import importlib
import os
import sys
import textwrap
import time
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from plumbing.charts import ascii_chart, bars, bucket_timeline  # noqa: E402
from plumbing.launch import launch  # noqa: E402

tensor_parallel = importlib.import_module("01_tensor_parallel")
pipeline = importlib.import_module("02_pipeline_1f1b")
interleaved = importlib.import_module("03_interleaved")
data_parallel = importlib.import_module("04_data_parallel")
gpt3d = importlib.import_module("05_3d_gpt")


# ----------------------------------------------------------------------------------------------
# bubble: the simulator, exact


def bubble_data(pp=4, ms=(4, 8, 12, 16, 24, 32), vs=(1, 2, 4)):
    """{v: [(m, simulated bubble, formula)]}: 02's simulate() on 03's interleaved lists (v = 1 is
    1F1B), every chunk taking 1/v of a stage's time (t_f = 1/v, t_b = 2/v)."""
    out = {}
    for v in vs:
        lists = lambda m: [interleaved.interleaved(pp, m, s, v) for s in range(pp)]  # noqa: E731
        out[v] = [(m, pipeline.simulate(lists(m), pp, Fraction(1, v), Fraction(2, v)).bubble,
                   Fraction(pp - 1, v * m)) for m in ms]
    return out


def bubble_text(data, pp=4):
    vs = list(data)
    head = (f"{'m':>4} " + "".join(f"| v={v}: simulated  formula   " for v in vs)).rstrip()
    lines = [f"pipeline bubble (idle / busy) against m, pp={pp}: 02's simulate() on 03's lists, beside "
             f"(pp - 1)/(v m)", head, "-" * len(head)]
    for i, (m, _, _) in enumerate(data[vs[0]]):
        cells = "".join(f"| {str(sim):>14} {str(f):>8}{'  ' if sim == f else ' !'} " for sim, f in
                        ((data[v][i][1], data[v][i][2]) for v in vs))
        lines.append(f"{m:>4} {cells}".rstrip())
    lines.append("every simulated bubble equals its formula" if all(s == f for rows in data.values()
                                                                     for _, s, f in rows) else "MISMATCH (!)")
    chart = ascii_chart({f"v={v}": (str(v)[0], [(m, float(s)) for m, s, _ in rows]) for v, rows in data.items()},
                        height=10, x_label="m (microbatches)")
    return "\n".join(lines) + "\n\n" + chart


def bubble_png(data, path, plt, pp=4):
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for v, rows in data.items():
        ms = [m for m, _, _ in rows]
        line = ax.plot(ms, [float(f) for _, _, f in rows], "-", label=f"(pp-1)/(v m), v={v}")[0]
        ax.plot(ms, [float(s) for _, s, _ in rows], "o", color=line.get_color(), label=f"simulated, v={v}")
    ax.set_xlabel("m (microbatches)")
    ax.set_ylabel("bubble (idle / busy)")
    ax.set_title(f"Pipeline bubble, pp={pp}: the simulator on the schedules' lists")
    ax.legend()
    return _save(fig, path, plt)


def weights(cfg, dtype):
    """Full weights for GPT(cfg) from a seed. Not 01's init_state_dict, whose first call imports
    torch's compiler (seconds): the figures need shapes and finite values, nothing more."""
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(p.shape, generator=gen, dtype=dtype) * 0.02 for n, p in
            tensor_parallel.GPT(cfg, None, init=False, dtype=dtype).named_parameters()}


# ----------------------------------------------------------------------------------------------
# memory: the executor's ActivationMeter on pp CPU ranks

MEMORY_CFG = tensor_parallel.GPTConfig(vocab_size=97, block_size=16, n_layer=8, n_head=2, n_embd=16)


def _memory(env, full, m, rows, v_interleaved):
    cfg, pp = MEMORY_CFG, env.world_size
    gen = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(cfg.vocab_size, (2, m * rows, cfg.block_size), generator=gen)
    micro = pipeline.split_batch(idx, targets, m)
    out = {}
    for name, v, make in (("GPipe", 1, pipeline.gpipe), ("1F1B", 1, pipeline.one_f_one_b),
                          (f"interleaved v={v_interleaved}", v_interleaved,
                           lambda pp_, m_, s: interleaved.interleaved(pp_, m_, s, v_interleaved))):
        chunks = pipeline.build_chunks(cfg, pp, env.rank, v, init=False, dtype=torch.float64)
        for c in chunks:
            c.load_full_state_dict(full)
        res = pipeline.execute(make(pp, m, env.rank), chunks, dist.group.WORLD, micro, (rows, cfg.block_size, cfg.n_embd))
        out[name] = res.peak_activation_bytes
    return out


def memory_data(pp=4, m=8, rows=2, v=2):
    """{schedule: [peak stored activation bytes of stage 0, 1, ...]}, from one step of each on pp
    CPU ranks (float64, outputs deallocated once sent, as Megatron does)."""
    full = weights(MEMORY_CFG, torch.float64)  # made here: the ranks inherit them
    per_rank = launch(_memory, pp, full, m, rows, v)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def memory_text(data, pp=4, m=8):
    rows = []
    for s in range(pp):
        rows.append((f"stage {s}", None))
        rows += [(f"  {name}", data[name][s]) for name in data]
    names = list(data)
    ratio = data[names[1]][0] / data[names[0]][0]
    return (f"peak stored activation bytes per stage, pp={pp}, m={m} (02's ActivationMeter on a real CPU run, "
            f"float64):\n{bars(rows)}\n1F1B / GPipe on stage 0: {ratio:.3f} (pp/m = {pp / m:.3f}): GPipe keeps "
            f"all m microbatches' activations, 1F1B at most pp - stage;\ninterleaving keeps more on the first "
            f"stage ((v+1) pp - 1 chunks of 1/v stage) for its smaller bubble")


def memory_png(data, path, plt, pp=4, m=8):
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / len(data)
    for k, (name, values) in enumerate(data.items()):
        ax.bar([s + k * width for s in range(pp)], [x / 1024 for x in values], width, label=name)
    ax.set_xticks([s + width * (len(data) - 1) / 2 for s in range(pp)])
    ax.set_xticklabels([f"stage {s}" for s in range(pp)])
    ax.set_ylabel("peak stored activations (KiB)")
    ax.set_title(f"Activation memory per stage, pp={pp}, m={m} (measured, CPU)")
    ax.legend()
    return _save(fig, path, plt)


# ----------------------------------------------------------------------------------------------
# overlap: 04's bucketed reduction, timed on dp CPU ranks


class TimedDDP(data_parallel.BucketedDDP):
    """04's BucketedDDP that also notes ("done", bucket, t) when it first sees a bucket's reduction
    finished: it polls at every gradient hook, and after backward until all are done."""

    def _on_grad(self, p):
        super()._on_grad(p)
        self.poll()

    def poll(self):
        now = time.perf_counter()
        seen = {i for kind, i, _ in self.events if kind == "done"}
        for i, (work, _) in list(self.works.items()):
            if i not in seen and work.is_completed():
                self.events.append(("done", i, now))

    def finish(self):
        while any(not w.is_completed() for w, _ in self.works.values()):
            self.poll()
        self.poll()
        super().finish()  # launches the buckets no hook launched, and waits
        self.poll()


OVERLAP_CFG = tensor_parallel.GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64)


def _overlap(env, full, bucket_numel, steps):
    cfg = OVERLAP_CFG
    group = dist.new_group(list(range(env.world_size)))
    model = tensor_parallel.GPT(cfg, None, init=False, dtype=torch.float32)
    model.load_full_state_dict(full)
    ddp = TimedDDP(model.parameters(), group, bucket_numel)
    gen = torch.Generator().manual_seed(env.rank)
    for _ in range(steps):  # the last step is the one drawn: the first ones warm up
        idx, targets = torch.randint(cfg.vocab_size, (2, 8, cfg.block_size), generator=gen)
        ddp.zero_grad()
        loss = model(idx, targets)[1]
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        ddp.finish()
    return start, end, ddp.events, len(ddp.buckets)


def overlap_data(dp=2, bucket_numel=20000, steps=3):
    """Rank 0's (start, end, events, n_buckets) of its last backward."""
    full = weights(OVERLAP_CFG, torch.float32)
    return launch(_overlap, dp, full, bucket_numel, steps)[0]


def overlap_text(data, dp=2):
    start, end, events, n = data
    return (f"04's BucketedDDP on dp={dp} CPU ranks (rank 0, the last of 3 steps; {n} buckets): L = the bucket's "
            f"all-reduce launched from the gradient hook,\nD = first seen done; '|' on the backward row = a "
            f"gradient arrived. Buckets fill in reverse parameter order, as backward produces them.\n"
            + bucket_timeline(start, end, events, n))


def overlap_png(data, path, plt):
    start, end, events, n = data
    ms = lambda t: 1e3 * (t - start)  # noqa: E731
    fig, ax = plt.subplots(figsize=(8, 0.5 * n + 1.8))
    ax.broken_barh([(0, ms(end))], (n, 0.8), color="tab:gray")
    launch_at = {i: t for kind, i, t in events if kind == "launch"}
    done_at = {i: t for kind, i, t in events if kind == "done"}
    for i, t in launch_at.items():
        ax.broken_barh([(ms(t), max(ms(done_at.get(i, t)) - ms(t), 0.05))], (n - 1 - i, 0.8), color="tab:blue")
    ax.set_yticks([n + 0.4] + [n - 1 - i + 0.4 for i in range(n)])
    ax.set_yticklabels(["backward"] + [f"bucket {i}" for i in range(n)])
    ax.set_xlabel("ms after backward began")
    ax.set_title("Bucketed gradient all-reduce overlapping backward (04, measured on CPU)")
    return _save(fig, path, plt)


# ----------------------------------------------------------------------------------------------
# grid and zero: pictures of a layout


def grid_text(tp=2, dp=2, pp=2):
    """05's rank_grid, drawn: a box per pipeline stage, a row per replica, the tp group in each row."""
    grid = gpt3d.rank_grid(tp * dp * pp, tp, dp, pp)
    width = len(f"rank {tp * dp * pp - 1}") + 2
    inner = tp * width
    lead = " " * 11
    box = lead + "     ".join("+" + "-" * inner + "+" for _ in range(pp))
    lines = [f"world {tp * dp * pp} = tp {tp} x dp {dp} x pp {pp}; rank = (p dp + d) tp + t (05's rank_grid)", "",
             lead + "     ".join(f"{f'stage {p}':^{inner + 2}}" for p in range(pp)), box]
    for d in range(dp):
        rows = ["|" + "".join(f"{f'rank {r}':^{width}}" for r in grid["tp"][p * dp + d]) + "|" for p in range(pp)]
        lines.append(f"{f'replica {d}':<11}" + " --> ".join(rows))
    lines += [box, f"tp groups, a row in a box (one node: NVLink): {grid['tp']}",
              f"dp groups, a column of a box (the gradient all-reduce): {grid['dp']}",
              f"pp groups, along the arrows (point-to-point): {grid['pp']}",
              f"embed groups, the first and the last stage (the tied embedding): {grid['embed']}"]
    return "\n".join(lines)


ZERO_CFG = tensor_parallel.GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)


def _zero(env, bucket_numel):
    model = tensor_parallel.GPT(ZERO_CFG, None, init=False, dtype=torch.float32)  # its layout, not its values
    names = {p: n for n, p in model.named_parameters()}
    ddp = data_parallel.BucketedDDP(model.parameters(), dist.group.WORLD, bucket_numel, zero=True)
    params = [(names[p], ddp.offsets[p], p.numel()) for p in reversed(ddp.params)]
    return ddp.buckets, [ddp.shard_range(i) for i in range(len(ddp.buckets))], params, len(ddp.grad_buffer)


def zero_data(dp=4, bucket_numel=2000):
    per_rank = launch(_zero, dp, bucket_numel)
    buckets, _, params, total = per_rank[0]
    return dict(dp=dp, buckets=buckets, shards=[r[1] for r in per_rank], params=params, total=total)


def zero_text(z, width=64):
    dp, total = z["dp"], z["total"]
    per = total / width
    bar = "".join(str(next(q for q in range(dp) if any(a <= c * per < b for a, b in z["shards"][q])))
                  for c in range(width))
    lines = [f"ZeRO-1 over dp={dp}: 04's flat gradient buffer of a one-layer GPT-2 ({total:,} elements, padded",
             f"to a multiple of dp), in reverse parameter order, cut into buckets of {z['buckets'][0][1]:,}; each bucket "
             f"is split",
             "into dp equal shards, and rank q keeps the AdamW state (and, for bf16, the fp32 master weights)",
             "of its shard only.", "",
             f"buffer |{bar}|  (a digit per {per:,.0f} elements: the rank that owns them)"]
    for i, (lo, hi) in enumerate(z["buckets"]):
        shards = "  ".join(f"rank {q} [{z['shards'][q][i][0]:,}, {z['shards'][q][i][1]:,})" for q in range(dp))
        held = [n.replace("transformer.", "") for n, o, k in z["params"] if o < hi and lo < o + k]
        lines.append(f"bucket {i} [{lo:,}, {hi:,}): {shards}")
        lines += textwrap.wrap("holds " + ", ".join(held), 100, initial_indent=" " * 11, subsequent_indent=" " * 17)
    owned = [sum(b - a for a, b in z["shards"][q]) for q in range(dp)]
    lines.append(f"elements owned per rank: {owned} (of {total:,}: 1/dp each); after its AdamW step, every")
    lines.append("rank all-gathers the updated weights of every shard")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The command line


def _save(fig, path, plt):
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def pyplot():
    """matplotlib.pyplot, or None when matplotlib is not installed (it is optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files, not windows
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def tidy(text):
    """No blanks at the ends of lines: the figures are copied into docs/DIAGRAMS.md, whose editors
    strip them, and a test compares the two."""
    return "\n".join(line.rstrip() for line in text.splitlines())


FIGURES = {  # name: (data, text, png or None)
    "bubble": (bubble_data, bubble_text, bubble_png),
    "memory": (memory_data, memory_text, memory_png),
    "overlap": (overlap_data, overlap_text, overlap_png),
    "grid": (lambda: None, lambda _: grid_text(), None),
    "zero": (zero_data, zero_text, None),
}


def main(argv=None, out=print):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figures", nargs="*", choices=[[]] + list(FIGURES), metavar="FIGURE",
                        help=f"any of {', '.join(FIGURES)} (default: all)")
    parser.add_argument("-o", "--out", help="the folder for the PNGs (default: figures/)")
    parser.add_argument("--no-png", action="store_true", help="text only, even with matplotlib")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny models: a second thread only waits for a core (the ranks use one too)
    plt = None if args.no_png else pyplot()
    folder = args.out or "figures"
    if plt:
        os.makedirs(folder, exist_ok=True)
    for name in args.figures or list(FIGURES):
        make, text, png = FIGURES[name]
        data = make()
        out(f"=== {name} ===\n{tidy(text(data))}\n")
        if plt and png:
            out(f"wrote {png(data, os.path.join(folder, name + '.png'), plt)}\n")
    if plt is None and not args.no_png:
        out("matplotlib is not installed, so only the text is above: pip install matplotlib for the PNGs")
        return 1 if args.out else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
