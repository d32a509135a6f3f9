"""The numbered files' demos, the part that is not the concept: timing, fingerprints, and printing
what the figures are and what they mean. Running each step stays in each file, and so does the
comparison with the serial model, but for 01's list of differences (report_tp).

    tp_inputs(say, ...)            01: its weights and batch, and what they are
    report_tp(say, ...)            01: the differences, every collective, what layer 0's count means
    report_dp(say, ...)            04: each mode's losses, checksums, bucket timeline; the state per rank
    median_seconds(fn)             01: the median time of a few calls, a demo's rough figure
    checksum(module)               04: a hash of the weights' bytes, to show replicas bit-identical
    report_pipeline(env, ...)      02, 03: one schedule's step, printed: its timelines, bubble,
                                   memory, traffic and difference from serial (02 ran and compared it)
    report_interleaving(say, ...)  03: the two schedules side by side: bubbles, messages, memory
    report_balance(say, ...)       07: each stage's parameters, compute and memory, without and with it
    fed_simulator(pipeline, ..)    bench_pipeline, bench_zero_bubble: 02's simulator fed a run's own
                                   measured times

Nothing here imports a numbered file, so that any of them can use it without an import cycle:
what a function needs of 02 it takes as an argument.
"""
import ctypes
import hashlib
import math
import time
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from plumbing import charts, trace
from plumbing.launch import gather_numbers
from plumbing.shards import max_rel_diff


# ----------------------------------------------------------------------------------------------
# 01 and 04


# The paper's name of each operator class of 01 that issues a collective, for the demo's list.
PAPER_NAMES = {"CopyToTP": "f", "ReduceFromTP": "g", "GatherFromSP": "g", "ReduceScatterToSP": "g-bar",
               "ScatterToSP": "split",
               "_VocabParallelCrossEntropy": "loss", "OverlappedColumnLinear": "f (overlapped)"}


def tp_inputs(say, env, cfg, args, init_state_dict):
    """01's demo setup, printed: the full float64 weights (init_state_dict(random_all=True): every tensor
    random, biases and LayerNorms too) and one batch (idx, targets) of B x T ids, both from --seed."""
    say(f"{cfg}\ntp={args.tp} sequence_parallel={args.sequence_parallel} B={args.batch_size} "
        f"T={args.seq_len} float64, world={env.world_size} ({dist.get_backend()})")
    full = init_state_dict(cfg, args.seed, dtype=torch.float64, random_all=True)
    gen = torch.Generator().manual_seed(args.seed + 1)
    return full, torch.randint(cfg.vocab_size, (2, args.batch_size, args.seq_len), generator=gen).to(env.device)


def report_tp(say, serial, model, reference, outputs, batch, log, full):
    """01's demo output: the two losses, the max relative difference of the loss, the logits and the
    worst gradient (serial's against the tp model's, gathered; every gradient over 1e-10 by name),
    every collective, and what they mean; then each model's forward and backward on batch (idx,
    targets) timed, the median of a few, warm.
    Returns the worst difference."""
    (ref_logits, ref_loss), (logits, loss) = reference, outputs
    diffs = {"loss": max_rel_diff(loss.detach(), ref_loss.detach()),
             "logits": max_rel_diff(model.full_logits(logits.detach()), ref_logits.detach()),
             **{"grad " + n: max_rel_diff(g, serial.get_parameter(n).grad) for n, g in model.full_grads().items()}}
    ref_loss, loss, sp, cpu = ref_loss.item(), loss.item(), model.sp, batch[0].device.type == "cpu"
    n_local, n_full = sum(p.numel() for p in model.parameters()), sum(t.numel() for t in full.values())
    times = {name: median_seconds(lambda: m(*batch)[1].backward()) for name, m in (("serial", serial), ("tp", model))}
    say(f"\nloss: serial {ref_loss:.12f}  tp {loss:.12f}")
    grads = {name: d for name, d in diffs.items() if name.startswith("grad ")}
    worst_grad = max(grads, key=grads.get)
    say("max relative difference against serial:")
    say(f"  {diffs['loss']:9.2e}  loss\n  {diffs['logits']:9.2e}  logits\n  {grads[worst_grad]:9.2e}  the worst of the "
        f"{len(grads)} gradients ({worst_grad[5:]})")
    over = [f"  {d:9.2e}  {name}  over the tolerance" for name, d in grads.items() if d > 1e-10 and name != worst_grad]
    if over:
        say("\n".join(over))
    say("\ncollectives on rank 0 for one forward + backward, in the order they ran, each with the operator\n"
        "that issued it and the layer it ran in:")
    say("\n".join(f"  {c.op:16s} {PAPER_NAMES.get(c.operator, c.operator):6s} {c.where:44s} {str(c.shape):14s} "
                   f"{c.nbytes / 1024:7.1f} KiB" for c in log))
    layer0 = [c for c in log if c.module.startswith("transformer.h.0.")]
    say(f"layer 0: {sum(c.direction == 'forward' for c in layer0)} forward and "
        f"{sum(c.direction == 'backward' for c in layer0)} backward collectives; {len(log)} in all, "
        f"{sum(c.nbytes for c in log) / 1024:.1f} KiB")
    say("  sequence parallelism turns each all-reduce of f and g into an all-gather and a reduce-\n"
        "  scatter: on the wire the pair moves the bytes of the one all-reduce it replaces (Korthikanti\n"
        "  4.2.2; the KiB column counts each whole tensor once per collective); the other backward ones sum the\n"
        "  gradients of the replicated LayerNorms and biases, each rank having seen T/tp tokens" if sp
        else "  g after each row-parallel layer in forward, f before each column-parallel layer in\n"
             "  backward: the paper's Figure 3, 2 all-reduces each way per layer")
    say(f"parameters on rank 0: {n_local:,} of {n_full:,} ({n_local / n_full:.0%})")
    say(f"forward+backward: serial {times['serial'] * 1e3:.1f} ms, tp {times['tp'] * 1e3:.1f} ms")
    if cpu and times["tp"] > times["serial"]:
        say("  tp is slower here: its ranks share this machine's cores and every collective copies\n"
            "  through loopback; on GPUs each rank has a device and NVLink (BENCHMARKS.md compares)")
    return max(diffs.values())


@dataclass
class DataParallelRun:
    """One mode of 04's demo on this rank: its losses, its worst difference from serial training,
    every replica's checksum, the last backward's bucket timeline, the optimizer state in bytes."""
    losses: list
    worst: float
    digests: list
    timeline: tuple  # (start, end, BucketedDDP.events, number of buckets), or None (naive)
    state: int
    lesson: float | None = None  # its worst difference from the lesson's run of the same mode, if compared


def report_dp(say, cfg, args, ref_losses, runs):
    """04's demo output, mode by mode, then the losses' drift and the optimizer state per rank: True if
    every mode equals serial training (1e-10) with bit-identical replicas, and the lesson (1e-12) if compared."""
    ok = True
    for mode, run in runs.items():
        good = run.worst <= 1e-10 and len(set(run.digests)) == 1
        same = run.lesson is None or run.lesson <= 1e-12
        ok &= good and same
        say(f"\n=== {mode} ===\nlosses: {' '.join(f'{x:.6f}' for x in run.losses)}  (serial: "
            f"{' '.join(f'{x:.6f}' for x in ref_losses)})")
        say(f"replica checksums: {run.digests}")
        say(f"max relative difference of the losses and every parameter after {args.steps} steps: "
            f"{run.worst:.2e} {'PASS' if good else 'FAIL'} (tolerance 1e-10)")
        if run.lesson is not None:
            say(f"the machine against the lesson's {mode} (the losses and every parameter): {run.lesson:.2e} "
                f"{'PASS' if same else 'FAIL'} (tolerance 1e-12)")
        if run.timeline:  # (start, end, events, number of buckets) of the last backward
            say(f"the last backward ('|': a gradient arrived) and each bucket's reduction (L: launched), "
                f"in ms:\n{charts.bucket_timeline(*run.timeline)}")
    say(f"\nthe losses stay near ln V = {math.log(cfg.vocab_size):.3f}: every step draws "
        f"new random tokens,\nwhich no model predicts better than uniformly, so fitting earlier "
        f"batches only costs on the next.\nThe demo checks that each mode follows serial training "
        f"exactly, not that it learns.")
    plain, zero = runs["bucketed"].state, runs["zero1"].state
    say(f"\noptimizer state per rank: plain AdamW {plain:,} bytes, ZeRO-1 {zero:,} bytes ({zero / plain:.3f}, "
        f"1/dp = {1 / args.dp:.3f})")
    say(f"\n{'PASS' if ok else 'FAIL'}")
    return ok


def optimizer_state_bytes(opt):
    """Bytes of every state tensor of a torch optimizer (AdamW's two moments; the step counters are
    scalars) or of 04's FlatAdamW (its AdamW's, and its fp32 masters of low-precision weights)."""
    if hasattr(opt, "pieces"):
        masters = sum(p.master.numel() * p.master.element_size() for p in opt.pieces if p.master is not p.weights)
        return optimizer_state_bytes(opt.optimizer) + masters
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)


def median_seconds(fn, n=5):
    """The median wall time of n calls of fn() (the demos' rough timings; benchmarks/ does better)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]


def checksum(module):
    """A 48-bit hash of every weight's bytes: equal on two replicas only if they are bit-identical."""
    h = hashlib.sha1()
    for p in module.parameters():
        t = p.detach().cpu().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))  # no numpy needed
    return int(h.hexdigest()[:12], 16)


# ----------------------------------------------------------------------------------------------
# 02 and 03


@dataclass
class RankFigures:
    """One rank's figures from a demo step, gathered to every rank as numbers (no pickling)."""
    worst: float  # max relative difference against serial, over its loss and gradients
    events: list  # [(start_s, end_s, Action)] as executed
    peak_bytes: int  # peak stored activation bytes, outputs deallocated
    peak_bytes_kept: int  # the same with outputs kept
    messages: int
    bytes_sent: int


def gather_figures(env, schedule, worst, result, kept):
    """Every rank's RankFigures from its own: `result` and `kept` are 02's StepResults of one step
    with outputs deallocated and kept."""
    flat = [worst, result.peak_activation_bytes, kept.peak_activation_bytes, result.messages, result.bytes_sent]
    flat += [t for s, e, _ in result.events for t in (s, e)]  # the i-th event is the i-th action of the list
    return [RankFigures(row[0], [(row[5 + 2 * i], row[6 + 2 * i], a) for i, a in enumerate(schedule[r])],
                        *(int(x) for x in row[1:5]))
            for r, row in enumerate(gather_numbers(flat, device=env.device))]


def differences(chunks, result, ref_loss, ref_grads):
    """02's, 03's and 06's demos: the largest relative difference of this rank's loss (on the last stage) and gradients from serial."""
    diffs = [max_rel_diff(p.grad, ref_grads[n]) for c in chunks for n, p in c.named_parameters()]
    return max(diffs + ([max_rel_diff(result.loss, ref_loss)] if result.loss is not None else []))


def verdict(worst, tolerance):
    """A check's figure as the demos print it: "1.00e-14 PASS (tolerance 1e-10)" (NaN fails)."""
    return f"{worst:.2e} {'PASS' if worst <= tolerance else 'FAIL'} (tolerance {tolerance:g})"


def worst_difference(got, ref_loss, ref_grads):
    """The largest relative difference over every rank of got = (loss or None, {name: grad}) from the reference."""
    loss, grads = got
    diffs = [max_rel_diff(g, ref_grads[n]) for n, g in grads.items()]
    worst = torch.tensor(max(diffs + ([max_rel_diff(loss, ref_loss)] if loss is not None else [])))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def report_pipeline(env, name, schedule, sim, worst, result, kept, say, t_f=1, t_b=2, end=None, width=100):
    """Print one schedule's run: its simulated and measured timelines, bubble, memory, traffic and
    difference from serial. schedule: every rank's list; sim: 02's simulate() of it. Collective:
    every rank calls it. Returns (ok, sim, every rank's RankFigures)."""
    render = charts.pipeline_timeline
    pp, m, v = len(schedule), sum(a.kind == "F" and a.chunk == 0 for a in schedule[0]), 1 + max(a.chunk for a in schedule[0])
    ranks = gather_figures(env, schedule, worst, result, kept)
    worst, formula = max(r.worst for r in ranks), Fraction(pp - 1, v * m)
    busy = sum(e - s for r in ranks for s, e, _ in r.events)
    span = max(r.events[-1][1] for r in ranks) - min(r.events[0][0] for r in ranks)
    say(f"\n=== {name}: pp={pp} v={v} m={m} ===")
    say(f"simulated timeline (t_f={t_f}, t_b={t_b} per chunk):\n{render(sim.timeline, width, end)}")
    say(f"bubble: simulated {sim.bubble} = {float(sim.bubble):.4f}, formula (pp-1)/(v m) = {formula}"
        f"  {'(equal)' if sim.bubble == formula else '(DIFFERENT)'}")
    say(f"measured timeline (this run):\n{render([r.events for r in ranks])}\n"
        f"measured idle / busy: {(pp * span - busy) / busy:.3f}")
    if env.device.type == "cpu":
        say(f"  not the simulated {float(sim.bubble):.3f}: the simulator gives every rank a device of "
            f"its own, while here\n  {pp} ranks share this machine's cores, and time spent waiting "
            f"for a core counts as idle")
    unit = "microbatches" if v == 1 else f"chunk-microbatches (a chunk is 1/{v} stage)"
    say(f"peak {unit} in flight per stage (simulated): {sim.peak_in_flight}")
    say(f"peak stored activation bytes per stage, outputs deallocated: {[r.peak_bytes for r in ranks]}")
    say(f"                                          outputs kept:        {[r.peak_bytes_kept for r in ranks]}")
    say(f"p2p messages sent per stage: {[r.messages for r in ranks]}, bytes: {[r.bytes_sent for r in ranks]}")
    say(f"max relative difference against serial (loss and every gradient): {worst:.2e} "
        f"{'PASS' if worst <= 1e-10 else 'FAIL'} (tolerance 1e-10)")
    return worst <= 1e-10 and sim.bubble == formula, sim, ranks


def write_trace(env, path, measured, say):
    """{schedule name: every rank's RankFigures} as one Chrome trace, written by rank 0 if path is set."""
    if path and env.rank == 0:
        trace.write_timelines(path, {n: [r.events for r in ranks] for n, ranks in measured.items()}, 1.0)
        say(f"\nChrome trace of the measured steps ({', '.join(measured)}): {path} "
            f"(open it in chrome://tracing or ui.perfetto.dev)")


def report_interleaving(say, pp, v, m, one, inter):
    """03's summary: the two bubbles against their formulas, the step times, the messages (v times
    more) and the memory price. one, inter: (02's Simulation, every rank's RankFigures) of 1F1B and
    interleaved 1F1B."""
    (s1, r1), (s2, r2) = one, inter
    say(f"\n=== summary ===\nbubble: 1F1B {s1.bubble} (formula (pp-1)/m = {Fraction(pp - 1, m)}), "
        f"interleaved {s2.bubble} (formula (pp-1)/(v m) = {Fraction(pp - 1, v * m)})")
    say(f"simulated step time: 1F1B {s1.step_time}, interleaved {s2.step_time} "
        f"({float(s2.step_time / s1.step_time):.3f}x)")
    msgs = [sum(r.messages for r in rs) for rs in (r1, r2)]
    nbytes = [sum(r.bytes_sent for r in rs) for rs in (r1, r2)]
    # Each microbatch crosses pp*v - 1 chunk boundaries each way instead of pp - 1: about v times.
    say(f"p2p messages: 1F1B {msgs[0]}, interleaved {msgs[1]} ({msgs[1] / max(msgs[0], 1):.2f}x, "
        f"expected (pp v - 1)/(pp - 1) = {(pp * v - 1) / max(pp - 1, 1):.2f}x); bytes {nbytes[0]} vs "
        f"{nbytes[1]} ({nbytes[1] / max(nbytes[0], 1):.2f}x)")
    say(f"peak stored activation bytes per stage: 1F1B {[r.peak_bytes for r in r1]}, "
        f"interleaved {[r.peak_bytes for r in r2]}")
    # Megatron's interleaved warmup keeps (v+1) pp - 1 chunks in flight on rank 0 (the simulator's
    # peak), each 1/v of a stage, against 1F1B's pp whole stages.
    say(f"  interleaving holds more on the first stage: {s2.peak_in_flight[0]} chunks of 1/{v} stage "
        f"in flight = (v+1) pp - 1, against 1F1B's {s1.peak_in_flight[0]} stages = pp, a ratio of "
        f"{s2.peak_in_flight[0] / (v * s1.peak_in_flight[0]):.3f}\n  (measured on rank 0: "
        f"{r2[0].peak_bytes / r1[0].peak_bytes:.3f}); the smaller bubble costs 1 + (pp-1)/(pp v) "
        f"times the activation memory (Korthikanti 4.2.3)")


def report_balance(say, cfg, args, V, fig):
    """07's figures for one vocabulary V, printed: each stage's parameters, compute and memory without
    and with vocabulary parallelism (fig: 07's balance()), the imbalance and the simulated steps; the
    timeline with vocabulary parallelism for the model's own V. Returns (step without, step with)."""
    plain, vp = fig["sims"]
    say(f"\n=== V = {V:,} (C = {cfg.n_embd}, {cfg.n_layer} layers, pp = {args.pp}, tp = {args.tp}, m = "
        f"{args.microbatches}; Algorithm 1): without | with vocabulary parallelism ===")
    say("stage   parameters (float32 MiB)   compute per microbatch (a layer's forward = 1)   microbatches in flight   "
        "logits held")
    for r in range(args.pp):
        (p0, p1), (c0, c1) = fig["params"][r], fig["compute"][r]
        say(f"  {r}      {4 * p0 / 2**20:8.3f} | {4 * p1 / 2**20:8.3f}                  {c0:8.2f} | {c1:8.2f}"
            f"                      {plain.peak_in_flight[r]:3d} | {vp.peak_in_flight[r]:3d}          "
            f"{fig['logits'][0][r]:>9,} | {fig['logits'][1][r]:,}")
    spread = lambda xs: max(xs) / min(xs)  # noqa: E731
    say(f"imbalance (fullest / emptiest stage): parameters {spread([p[0] for p in fig['params']]):.2f}x -> "
        f"{spread([p[1] for p in fig['params']]):.2f}x, compute {spread([c[0] for c in fig['compute']]):.2f}x -> "
        f"{spread([c[1] for c in fig['compute']]):.2f}x")
    say(f"simulated 1F1B step, in one layer's forward: {plain.step_time:.1f} -> {vp.step_time:.1f} "
        f"({plain.step_time / vp.step_time:.2f}x faster); in flight on rank r: pp - r -> pp - r + 2 (at most m), "
        f"one more microbatch per barrier")
    if V == cfg.vocab_size:
        say(f"simulated with vocabulary parallelism (S and T, every rank; one layer's forward = "
            f"{100 / vp.step_time:.2f} columns):\n{charts.pipeline_timeline(vp.timeline, 100)}")
    return plain.step_time, vp.step_time


def fed_simulator(pipeline, env, events, schedule, shape, rounds=21):
    """What 02's simulate() predicts for `schedule` fed a run's own times: each rank's t_f and t_b,
    the mean durations of its forwards and backwards in its `events` (02's StepResult.events of
    some steps; 06's split backward: of its I and W, and t_b their sum), and t_comm, half the median
    round trip of one boundary tensor of `shape` between ranks 0 and 1 through batch_isend_irecv, as
    02 sends it. schedule: 02's Schedule. Collective: every rank calls it.
    Returns (predicted step time, [t_f per rank], [t_b per rank], t_comm), in seconds."""
    x, trips = torch.zeros(shape, device=env.device), []
    ping_pong = {0: (dist.isend, dist.irecv), 1: (dist.irecv, dist.isend)}.get(env.rank, ()) if env.world_size > 1 else ()
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for op in ping_pong:
            for work in dist.batch_isend_irecv([dist.P2POp(op, x, 1 - env.rank)]):
                work.wait()
        if x.is_cuda:
            torch.cuda.synchronize()
        trips.append(time.perf_counter() - t0)
    mean = {k: (lambda d: sum(d) / len(d) if d else 0.0)([e - s for s, e, a in events if a.kind == k]) for k in "FBIW"}
    t_b = mean["B"] if any(a.kind == "B" for _, _, a in events) else mean["I"] + mean["W"]
    mine = [mean["F"], t_b, sorted(trips)[rounds // 2] / 2, mean["I"], mean["W"]]
    t_f, t_b, t_comm, t_i, t_w = zip(*gather_numbers(mine, device=env.device))  # each rank's row; t_comm: rank 0's
    step = pipeline.simulate(schedule, list(t_f), list(t_b), t_comm[0], times={"I": list(t_i), "W": list(t_w)}).step_time
    return step, t_f, t_b, t_comm[0]
