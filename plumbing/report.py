"""What 05 prints: the rank grid, the start-up summary, the end-of-run report, and the sum probe.

    print_layout(tc, grid)     --print-layout: every rank's place (tp, dp, pp, ...) and every group
    summary(run, ...)          a few grouped lines: model, data, layout, device, training, files,
                               memory and FLOPs by the planner's formulas
    report(run, out, ...)      throughput, a chart of the loss, the message size, the sum probe;
                               on a GPU, the measured peak memory beside the estimate
    sum_probe(run, forward)    how many single-digit sums greedy decoding gets right (built-in corpus)
    Progress                   the loop's progress bar, notes above it, and --metrics lines
"""
import errno
import importlib
import json
import math
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist
from tqdm import tqdm

from planner import PEAK_BF16_FLOPS, Layout, ModelSpec, activation_bytes_per_layer, flops_per_iteration, \
    layers_in_flight, params_exact
from plumbing import paths
from plumbing.charts import ascii_chart
from plumbing.checks import layout_sizes, world_size
from plumbing.data import held_out
from plumbing.tokenizer import tokenizer_of
from plumbing.data import sum_probe as probe_batches
from plumbing.launch import Interrupted, gather_numbers

pipeline = importlib.import_module("02_pipeline_1f1b")
_open = paths.create_new  # exclusive, never through a link; tests put a full disk here


class _Bar(tqdm):
    """tqdm, with a lock of this process's own and no monitor thread.

    tqdm's default lock is a multiprocessing semaphore, made by the first bar of a process and
    shared by every process forked after that. A process killed while it held it (a SIGKILL in the
    middle of a bar's refresh: a killed rank, a stopped run) left it held for good, and every later
    bar in every process sharing it waited forever, before the first step, in a futex: trainer runs
    forked from one test session hung, idle, one after another. Only rank 0 shows a bar, so no two
    processes need one lock. The monitor is a thread, and launch must not fork a running thread."""
    monitor_interval = 0
    owner = None  # the pid whose lock _Bar holds

    @classmethod
    def own_lock(cls):
        if cls.owner != os.getpid():  # a fresh lock in each process: one copied by fork may be held
            cls.set_lock(threading.RLock())
            cls.owner = os.getpid()


class _Lines:
    """The bar's stream when stderr is a pipe or a file: each refresh on a line of its own. A terminal's
    bar redraws one line with carriage returns, which a log file keeps as one line of every refresh."""

    def __init__(self, stream):
        self.stream, self.encoding = stream, getattr(stream, "encoding", None)  # tqdm draws with it

    def write(self, text):
        for part in text.replace("\n", "\r").split("\r"):
            if part.strip():
                self.stream.write(part.rstrip() + "\n")

    def flush(self):
        self.stream.flush()


PIPED_REFRESH_S = 10  # piped, the bar writes a line at most this often (and its last one at the end)


LISTED_WORLD = 4096  # --print-layout lists every rank and group up to this world; beyond, a summary


def print_layout(tc, rank_grid):
    """The rank grid (rank_grid(world, tp, dp, pp): the schedule's groups) of tc's layout, without
    starting anything (--print-layout). Up to LISTED_WORLD ranks every rank and group is listed; a
    larger world (10**9 ranks would never finish) is summarised from the grid's rule, the layout's
    sizes in order, the first fastest (05: tp, then dp, then pp), without building it: the first and
    last ranks, and each size's first and last groups."""
    sizes, world = layout_sizes(tc), world_size(tc)
    names = [k for k, _ in sizes]
    print(f"world={world}: {' x '.join(f'{k}={n}' for k, n in sizes)}, Megatron's order ({names[0]} fastest, "
          f"then {', then '.join(names[1:])})")
    print("rank" + "".join(f" {k:>{3 if i == 0 else 2}s}" for i, k in enumerate(names)))

    def coords(r):  # the rank's place along each size, fastest first
        out = []
        for _, n in sizes:
            out.append(r % n)
            r //= n
        return out

    def row(r):
        return f"{r:4d}" + "".join(f" {x:{3 if i == 0 else 2}d}" for i, x in enumerate(coords(r)))

    if world <= LISTED_WORLD:
        grid = rank_grid(world, tc.tp, tc.dp, tc.pp)
        for r in range(world):
            print(row(r))
        for kind, n in sizes + [("embed", 2)]:
            wider = grid[kind] and len(grid[kind][0]) != n  # 08's dp groups: dp x cp ranks, averaging gradients
            print(f"{kind} groups{f' ({len(grid[kind][0])} ranks each, more than --{kind} {n})' if wider else ''}: "
                  f"{grid[kind]}")
        return
    for r in [*range(4), None, *range(world - 4, world)]:
        print("   ..." if r is None else row(r))
    strides = [math.prod(n for _, n in sizes[:i]) for i in range(len(sizes))]

    def kind_of(axis):  # (how many, size, the i-th group's j-th rank): the ranks differing along axis only
        others = [i for i in range(len(sizes)) if i != axis]

        def member(i, j):
            r = j * strides[axis]
            for o in others:
                r, i = r + (i % sizes[o][1]) * strides[o], i // sizes[o][1]
            return r
        return world // sizes[axis][1], sizes[axis][1], member

    groups = {k: kind_of(i) for i, k in enumerate(names)}
    if tc.pp > 1:
        groups["embed"] = (world // tc.pp, 2, lambda i, j: groups["pp"][2](i, 0 if j == 0 else tc.pp - 1))
    else:
        print("embed groups: [] (pp = 1: the output layer is the embedding itself)")

    def show(i, size, member):
        ids = [member(i, j) for j in range(min(size, 4))]
        return f"[{', '.join(map(str, ids))}{', ..., ' + str(member(i, size - 1)) if size > 4 else ''}]"

    for kind, (count, size, member) in groups.items():
        shown = [show(0, size, member)] + ([show(count - 1, size, member)] if count > 1 else [])
        print(f"{kind} groups: {count:,} of {size:,} ranks: {' ... '.join(shown)}")


def memory_estimate(run, spec):
    """This rank's bytes by the planner's formulas: {weights, gradients, optimizer, activations}."""
    tc = run.tc
    local = sum(p.numel() for c in run.chunks for p in c.parameters())
    elt = torch.empty((), dtype=run.dtype).element_size()
    owned = sum(p.master.numel() for p in run.opt.pieces)
    masters = sum(p.master.numel() for p in run.opt.pieces if p.master is not p.weights)
    L = Layout(tc.tp, tc.pp, tc.dp, tc.batch_size, b=run.act_shape[0], v=tc.virtual_stages,
               recompute=tc.recompute, sequence_parallel=tc.sequence_parallel)
    # Korthikanti's activation bytes assume 2-byte (bf16) activations: rescale to ours.
    return dict(weights=local * elt, gradients=local * run.ddp.grad_buffer.element_size(),
                optimizer=2 * owned * max(elt, 4) + masters * 4,  # two AdamW moments, plus fp32 masters
                activations=activation_bytes_per_layer(spec, L) * layers_in_flight(spec, L) * elt / 2)


def measured_peak(env, estimate_bytes):
    """The end report's memory line on a GPU: every rank's torch.cuda.max_memory_allocated(), rank
    0's beside the start-up estimate, and the fullest rank's. A collective there: every rank calls
    it. None on a CPU, where torch does not count allocations."""
    if env.device.type != "cuda":
        return None
    peaks = [int(x[0]) for x in gather_numbers([torch.cuda.max_memory_allocated(env.device)], device=env.device)]
    fullest = max(range(len(peaks)), key=peaks.__getitem__)
    return (f"memory    rank 0, measured peak (torch.cuda.max_memory_allocated): {peaks[0] / 2**20:,.2f} MiB, "
            f"estimated {estimate_bytes / 2**20:,.2f} MiB (weights, gradients, optimizer and activations at "
            f"start-up); the fullest rank, {fullest}: {peaks[fullest] / 2**20:,.2f} MiB")


def summary(run, n_train, n_eval, say):
    """The start-up summary (rank 0): a few grouped lines, not the config's repr. Returns the FLOPs per
    iteration (Narayanan's eq. 3), which the progress bar reads too."""
    cfg, tc, env = run.cfg, run.tc, run.env
    spec = ModelSpec(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, tc.seq_len)
    flops = flops_per_iteration(spec, tc.batch_size, tc.recompute)
    local = sum(p.numel() for c in run.chunks for p in c.parameters())
    per_rank = [int(x[0]) for x in gather_numbers([local], device=env.device)]
    mem = memory_estimate(run, spec)
    sim = pipeline.simulate(run.pipe, 1, 2, times=run.pipe.times)
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    graphs = {None: "off", "stage": "per stage and microbatch", "step": "whole step"}[getattr(run.forward_backward, "mode", None)]
    data = tc.data or "the built-in corpus"
    say(f"model     GPT-2: {cfg.n_layer} layers, {cfg.n_head} heads, C={cfg.n_embd}, V={cfg.vocab_size}, "
        f"block {cfg.block_size}, dropout {cfg.dropout:g}; {params_exact(spec):,} parameters"
        + (f" (from {tc.init_from})" if tc.init_from else ""))
    say(f"data      {data}: {n_train:,} tokens to train on, {n_eval:,} held out; "
        f"{tokenizer_of(tc.data)} tokens")
    more = "".join(f" x {k} {n}" for k, n in layout_sizes(tc) if k not in ("tp", "pp", "dp"))  # a later chapter's
    say(f"layout    world {env.world_size} = tp {tc.tp} x pp {tc.pp} x dp {tc.dp}{more}; "
        f"{run.pipe.name}, "
        f"m={tc.microbatches} microbatches of b={run.act_shape[0]}; "
        f"{'ZeRO-1' if tc.zero1 else 'data parallel'}; scatter/gather {on(run.wire)}, "
        f"sequence parallel {on(tc.sequence_parallel)}, recompute {tc.recompute}")
    say(f"device    {run.dtype} on {env.device.type} ({dist.get_backend()}); kernels: {run.ops.name if run.ops else 'pytorch'}; "
        f"CUDA graphs: {graphs}")
    say(f"training  {tc.steps} steps of B={tc.batch_size} x T={tc.seq_len} = "
        f"{tc.batch_size * tc.seq_len:,} tokens; AdamW lr {tc.lr:g} -> {tc.min_lr:g} (warmup "
        f"{tc.warmup_steps}, cosine), weight decay {tc.weight_decay:g}, clip {tc.grad_clip:g}, "
        f"seed {tc.seed}; eval every {tc.eval_every or 'never'}")
    say(f"files     checkpoints: {tc.save or 'none'}"
        + (f" (every {tc.save_every} steps, keep {tc.keep})" if tc.save else "")
        + f"; resume: {tc.resume or 'no'}; metrics: {tc.metrics or 'none'}; trace: {tc.trace or 'none'}")
    say(f"memory    rank 0, estimated: weights {mem['weights'] / 2**20:.2f} MiB, gradients "
        f"{mem['gradients'] / 2**20:.2f} MiB, optimizer {mem['optimizer'] / 2**20:.2f} MiB, activations "
        f"{mem['activations'] / 2**20:.2f} MiB (Korthikanti Table 2); parameters per rank {per_rank}")
    say(f"compute   FLOPs per iteration (eq. 3): {flops:.3e}; pipeline bubble {run.pipe.bubble} = "
        f"{sim.bubble} (simulated, t_b = 2 t_f)")
    return flops


def report(run, out, wall, say, forward_only):
    """The end of training: throughput, the loss chart, the message size, and on the built-in corpus
    the sum probe (through 05's forward_only), its counts put in out["sums"]."""
    tc, cfg, losses, evals = run.tc, run.cfg, out["losses"], out["evals"]
    if not losses:
        say(f"nothing to do: {out['start']} of {tc.steps} steps were already done")
        return
    if not tc.data and cfg.vocab_size >= 128:  # the built-in corpus: what did it learn?
        out["sums"] = sum_probe(run, forward_only)
    tokens = len(losses) * tc.batch_size * tc.seq_len
    say(f"\ndone: {len(losses)} steps in {wall:.1f} s ({tokens / wall:,.0f} tokens/s); loss "
        f"{losses[0]:.3f} -> {losses[-1]:.3f}" + (f"; eval loss {evals[-1][1]:.3f}" if evals else ""))
    if out.get("skipped"):
        say(f"skipped {len(out['skipped'])} steps (no update) for a non-finite loss or gradient norm: "
            f"{', '.join(map(str, out['skipped'][:10]))}{' ...' if len(out['skipped']) > 10 else ''}")
    series = {"train loss": ("*", [(s, x) for s, x in enumerate(losses, out["start"]) if math.isfinite(x)])}
    if evals:
        series["eval loss"] = ("o", evals)
    say(ascii_chart(series))
    per_msg, elt = out["bytes_per_message"], torch.empty((), dtype=run.dtype).element_size()
    b = tc.batch_size // (tc.dp * tc.microbatches)
    say(f"p2p per message (rank 0): {per_msg:,.0f} bytes = {per_msg / elt:,.0f} elements; b*T*C = "
        f"{b * tc.seq_len * cfg.n_embd:,} elements, /tp = {b * tc.seq_len * cfg.n_embd // tc.tp:,} "
        f"({'scatter/gather on' if run.wire else 'scatter/gather off'}"
        f"{', sequence parallel' if tc.sequence_parallel else ''})")
    say(f"peak stored activation bytes on rank 0 (last step): {out['peak_activation_bytes']:,}")
    if run.env.device.type == "cuda":  # the memory checklist's figure (G12); not counted on a CPU
        spec = ModelSpec(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, tc.seq_len)  # as summary() builds it
        say(measured_peak(run.env, sum(memory_estimate(run, spec).values())))
    if "sums" in out and out["sums"] is None and tc.seq_len < PROBE_T:
        say(f"sums: not probed: a window of --seq-len {tc.seq_len} cannot hold \"9 plus 9 is 18.\" "
            f"({PROBE_T} tokens)")
    elif out.get("sums"):
        seen, of_seen, held, of_held = out["sums"]
        say(f"sums, greedy \"x plus y is\" for x, y < 10: {seen}/{of_seen} right of those in the "
            f"corpus, {held}/{of_held} of the held-out ones it never states")


PROBE_T = len("9 plus 9 is 18.")  # the probe's longest prompt and answer: a window must hold them


def sum_probe(run, forward_only):
    """How many of the 100 single-digit sums greedy decoding gets right, split into the sums the
    built-in corpus states and the held-out ones it never does: [right, of, right, of]. 05's
    forward_only(run, idx, targets, chunks) runs the pipeline; the last stage's chunk is wrapped to
    read its logits, and the counts are summed over the world. None (on every rank alike) when a
    window is too short to hold a whole prompt and its answer, or the last stage has no output layer of
    its own (07 spreads it over every rank: every rank asks, and all agree)."""
    tc, dp_rank = run.tc, run.pipe.replica(run.groups)
    head = torch.tensor(float(all(hasattr(c, "lm_head") for c in run.chunks if c.post_process)), device=run.env.device)
    dist.all_reduce(head, op=dist.ReduceOp.MIN)
    if tc.seq_len < PROBE_T or not head:
        return None
    counts = torch.zeros(4, dtype=torch.float64, device=run.env.device)  # seen right/of, held right/of
    rows_per_mb = tc.batch_size // (tc.dp * tc.microbatches)
    for idx, targets, pairs in probe_batches(tc.seq_len, tc.batch_size):
        mine = pairs[dp_rank * (tc.batch_size // tc.dp):(dp_rank + 1) * (tc.batch_size // tc.dp)]

        def score(chunk, mb, out, tgt):
            logits = chunk.full_logits(out[0])  # (b, T, V): every tp rank holds all of it
            scored = tgt != -100
            right = ((logits.argmax(-1) == tgt) | ~scored).all(-1)  # (b,): every scored token right
            if dist.get_rank(run.groups.tp) == 0:
                for ok, pair in zip(right.tolist(), mine[mb * rows_per_mb:(mb + 1) * rows_per_mb]):
                    if pair is not None:
                        k = 2 if held_out(*pair) else 0
                        counts[k] += ok
                        counts[k + 1] += 1

        rows = slice(dp_rank * tc.batch_size // tc.dp, (dp_rank + 1) * tc.batch_size // tc.dp)
        forward_only(run, idx[rows], targets[rows], [_Scored(c, score) for c in run.chunks])  # this replica's rows
    dist.all_reduce(counts)
    counts /= run.env.world_size // (tc.tp * tc.pp * tc.dp)  # ranks beyond tp x pp x dp (08's cp) scored alike
    return [int(x) for x in counts.tolist()]


class _Scored(torch.nn.Module):
    """A chunk whose forwards with targets (the last stage's, in microbatch order) are scored."""

    def __init__(self, chunk, score):
        super().__init__()
        self.chunk, self.score, self.mb = chunk, score, 0

    def forward(self, x, targets=None):
        out = self.chunk(x, targets)
        if targets is not None:
            self.score(self.chunk, self.mb, out, targets)
            self.mb += 1
        return out


class Progress:
    """The training loop's output on rank 0: a progress bar (loss, tokens/s, MFU on a GPU, the eval
    loss), notes printed above it, and one --metrics JSON line per step (appended to the file when
    a checkpoint was resumed, append=True; a new run starts it afresh). While the loop runs, Ctrl-C
    on any rank raises launch.Interrupted, "interrupted at step N of M", once."""

    def __init__(self, env, tc, flops, start, dtype, quiet=False, append=False):
        self.step, self.steps, self.save = start, tc.steps, tc.save
        self.show = env.rank == 0 and not quiet
        self.tokens = tc.batch_size * tc.seq_len
        name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else ""
        peak = next((f for gpu, f in PEAK_BF16_FLOPS.items() if gpu in name), None)
        # MFU: eq. 3's FLOPs per iteration over the step time and every GPU's dense bf16 peak.
        self.mfu_seconds = flops / (env.world_size * peak) if peak and dtype == torch.bfloat16 else None
        self.metrics = (_open(tc.metrics, "a") if append else _open(paths.fresh(tc.metrics), "w")) \
            if tc.metrics and env.rank == 0 else None
        self.metrics_path = tc.metrics
        _Bar.own_lock()
        self.piped = piped = not sys.stderr.isatty()
        self.bar = _Bar(range(start, tc.steps), initial=start, total=tc.steps, disable=not self.show,
                        desc="train", dynamic_ncols=not piped, file=_Lines(sys.stderr) if piped else None,
                        mininterval=PIPED_REFRESH_S if piped else 0.1)

    def __iter__(self):
        main = threading.current_thread() is threading.main_thread()  # only it may set handlers
        previous = signal.signal(signal.SIGINT, self._interrupt) if main else None
        try:
            for step in self.bar:
                self.step = step
                yield step
        finally:  # after a Ctrl-C it stays SIG_IGN: the launcher's copy must not cut the report short
            if main and signal.getsignal(signal.SIGINT) == self._interrupt:
                signal.signal(signal.SIGINT, previous)

    def _interrupt(self, signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # once: the launcher passes Ctrl-C on too
        kept = f"; resume from the newest checkpoint with --resume {self.save}" if self.save else ""
        raise Interrupted(f"interrupted at step {self.step} of {self.steps}{kept}")

    def note(self, text):
        if self.show:
            _Bar.own_lock()
            _Bar.write(text)

    def log(self, record, durable=False):
        """record: step, loss, lr, grad_norm, time_s, and eval_loss on eval steps. durable: fsync the
        line (before a checkpoint), not on every step."""
        record["tokens_per_s"] = self.tokens / record["time_s"]
        shown = dict(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
        if self.mfu_seconds:
            shown["mfu"] = f"{self.mfu_seconds / record['time_s']:.1%}"
        if "eval_loss" in record:
            shown["eval"] = f"{record['eval_loss']:.3f}"
        self.bar.set_postfix(shown, refresh=not self.piped)  # piped: at the bar's own refreshes
        if self.metrics:
            try:
                self.metrics.write(json.dumps(record) + "\n")
                self.metrics.flush()
                if durable:
                    os.fsync(self.metrics.fileno())
            except OSError as e:
                self._metrics_failed(e, f"writing step {record['step']}'s line")

    def close(self):
        if self.metrics:
            try:
                self.metrics.close()
            except OSError as e:
                self._metrics_failed(e, "closing it")

    def _metrics_failed(self, error, doing):
        """A --metrics file that cannot be written (a full disk, a removed mount) stops the run with
        a sentence naming it; the checkpoints saved so far are untouched (a step's line is written
        before its checkpoint)."""
        try:
            self.metrics.close()  # what is buffered is lost; closed, it is not flushed again at exit
        except OSError:
            pass
        self.metrics = None
        why = "no space left on its disk" if error.errno == errno.ENOSPC else (error.strerror or str(error))
        raise ValueError(f"--metrics {self.metrics_path}: {why}, {doing}; the run stops here, and the checkpoints it "
                         f"saved so far are intact")
