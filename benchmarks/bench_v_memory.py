"""Activation memory of 06's V schedules: V-Half and V-Min (Qi et al. 2024, "Pipeline Parallelism with
Controllable Memory", Section 3) measured against 1F1B's, in bytes (not time).

pp CPU ranks (gloo) run one step of 1F1B (02), V-Half and V-Min (06) on a tiny GPT in float64, one
transformer layer per V chunk by default (n_layer = 2pp); each is checked against the serial model
(loss and every gradient within 1e-10; exit 1 otherwise). Then, per schedule, the max over ranks of
the measured peak stored activation bytes (02's ActivationMeter: what autograd saves, and from I to
W what W keeps) as a share of 1F1B's max, beside the table's 1/2 or 1/3, the authors' closed form
(1F1B p microbatches, V-Half (p+2)//2, V-Min (p+4)//3), 06's simulator at M_W = M_B/2 and M_W = M_B,
and a byte model: each chunk's own measured bytes of one microbatch (M_B from F to I, M_W from I to W)
summed over the rank's list in order. The byte model is the measured peak; where the measured share
exceeds the simulated one at M_W = M_B, it is rank 0, which holds both ends of the V (the embedding;
the last layer, the final LayerNorm, the logits and the loss): the excess is printed in bytes.

Run it (from the repository root; it starts its own ranks, do not use torchrun):
    python benchmarks/bench_v_memory.py                     # pp=4, m from the steady state
    python benchmarks/bench_v_memory.py --pp 8
    python benchmarks/bench_v_memory.py --pp 32 --deadline 3000
"""
import importlib
import time
from fractions import Fraction

import torch
import torch.distributed as dist

import harness
from harness import pipeline, tensor_parallel
from plumbing import cli
from plumbing.launch import gather_numbers
from plumbing.meter import ActivationMeter
from plumbing.reference import pipeline_reference

zb = importlib.import_module("06_zero_bubble")
NAMES = ("1f1b", "v-half", "v-min")
TABLE = {"v-half": (Fraction(1, 2), lambda p: (p + 2) // 2), "v-min": (Fraction(1, 3), lambda p: (p + 4) // 3)}
TOL = 1e-10  # float64, the same sums in another order (~1e-15); a lost or doubled microbatch is O(1/m)


def chunk_bytes(cfg, pipe, chunks, rank, micro):
    """([(M_B, M_W)] of each of this rank's chunks, handed): per microbatch, what a chunk's forward saves
    for backward and (split chunks) what W still needs after I; handed, the bytes of the output this
    rank hands to its own next chunk (the V's turn, on rank pp-1; else 0). Run after the step, on its
    chunks (W's gradients then land in .grad: the check against serial is done by then)."""
    out, handed, (idx, targets) = [], 0, micro
    for c, chunk in enumerate(chunks):
        k, key = pipe.placement(pipe.pp, c, rank), ("probe", c)
        x = idx if k == 0 else torch.randn(*idx.shape, cfg.n_embd, dtype=torch.float64, requires_grad=True)
        meter = ActivationMeter(chunks, {})
        with meter.forward(key):
            y = chunk(x, targets if k == pipe.S - 1 else None)
        m_b = sum(meter.saved[key].values())
        if k < pipe.S - 1 and pipe.where[k + 1][0] == rank:
            handed = y.untyped_storage().nbytes()
        y, dy = (y[1], None) if k == pipe.S - 1 else (y, torch.ones_like(y))
        split = getattr(pipe, "split", None)
        if split is None:
            torch.autograd.backward(y, dy)
            out.append((m_b, 0))
            continue
        with split.input(key):
            torch.autograd.backward(y, dy)
        out.append((m_b, sum(split.held(key).values())))
        split.weight(key)
    return out, handed


def byte_model(acts, sizes, handed=0):
    """The peak of this rank's list in order, each chunk's F adding its M_B, I trading it for M_W, W
    (and 1F1B's B) freeing it: peak_memory with each chunk's own bytes. handed: the output chunk 0
    hands to chunk 1 on this rank is the next chunk's saved input until that chunk's I (counted once,
    in its M_B), then the executor's alone, kept for chunk 0's backward until chunk 0's I."""
    live = peak = 0
    for a in acts:
        m_b, m_w = sizes[a.chunk]
        live += {"F": m_b, "B": -m_b, "I": m_w - m_b, "W": -m_w}[a.kind]
        live += handed * (a.kind == "I") * (1 if a.chunk == 1 else -1)
        peak = max(peak, live)
    return peak


def worker(env, cfg, args):
    pp, m = env.world_size, args.microbatches
    ref = pipeline_reference(cfg, args, m, env.device, unequal=True)
    embed_group = dist.new_group([0, pp - 1])
    rows = {}
    for name in NAMES:
        pipe = zb.pipeline_schedule(name, pp, m)
        worst, result, chunks = zb.run_schedule(env, cfg, pipe, ref, embed_group)
        sizes, handed = chunk_bytes(cfg, pipe, chunks, env.rank, ref[0][0])
        flat = [worst, result.peak_activation_bytes, byte_model(pipe.lists[env.rank], sizes, handed)]
        flat += [x for s in sizes for x in s] + [0, 0] * (2 - len(sizes)) + [handed]
        rows[name] = gather_numbers(flat)  # per rank: worst, measured, byte model, M_B0, M_W0, M_B1, M_W1, handed
        if env.rank == 0:
            print(f"  {pipe.name}: run, {max(r[0] for r in rows[name]):.1e} against serial", flush=True)
    return rows


def simulated(pp, m):
    """{name: (max chunks over ranks at M_W = M_B/2, at M_W = M_B)}; 1F1B's in chunks of half a stage."""
    out = {}
    for name in NAMES:
        lists = zb.pipeline_schedule(name, pp, m).lists
        unit = 2 if name == "1f1b" else 1  # 1F1B's unit is a whole stage: two chunks
        out[name] = tuple(unit * max(zb.peak_memory(a, w) for a in lists) for w in (Fraction(1, 2), Fraction(1)))
    return out


def steady_m(pp):
    """The least m from which every schedule's simulated peak (both w_shares) stays the same, up to 2pp."""
    last = simulated(pp, 2 * pp)
    m = 2 * pp
    while m > 1 and simulated(pp, m - 1) == last:
        m -= 1
    return m


def report(args, pp, m, rows):
    ok = all(max(r[0] for r in rows[n]) <= TOL for n in NAMES)
    print(f"\nagainst the serial model, float64 (loss and every gradient, worst rank): "
          + ", ".join(f"{n} {max(r[0] for r in rows[n]):.1e}" for n in NAMES) + f"  {'PASS' if ok else 'FAIL'} "
          f"(tolerance {TOL:g})")
    if not ok:
        return False
    sim, one = simulated(pp, m), max(r[1] for r in rows["1f1b"])
    one_rank = [r[1] for r in rows["1f1b"]].index(one)
    print(f"\npeak stored activation bytes, max over ranks, as a share of 1F1B's ({one:,.0f} B, rank {one_rank}); "
          f"pp={pp} m={m}:")
    print(f"  {'schedule':9s} {'measured':>9s} {'table':>6s} {'authors':>8s} {'sim M_W=M_B/2':>14s} "
          f"{'sim M_W=M_B':>12s} {'byte model':>11s}  peak rank, bytes")
    for name in NAMES:
        peaks = [r[1] for r in rows[name]]
        top = max(peaks)
        share, form = TABLE.get(name, (Fraction(1), lambda p: p))
        half, whole = (Fraction(x, sim["1f1b"][0]) for x in sim[name])
        model = max(r[2] for r in rows[name])
        print(f"  {name:9s} {top / one:9.4f} {str(share):>6s} {form(pp) / pp:8.4f} {float(half):14.4f} "
              f"{float(whole):12.4f} {model / one:11.4f}  rank {peaks.index(top)}, {top:,.0f}"
              f"{'' if model == top else '  (byte model DIFFERENT)'}")
        ok &= model == top
    for name in ("v-half", "v-min"):  # rank 0's excess: its two chunks' bytes against a middle rank's
        r0, mid = rows[name][0], rows[name][pp // 2]
        lists = zb.pipeline_schedule(name, pp, m).lists
        flat = byte_model(lists[0], [(mid[3], mid[4]), (mid[5], mid[6])])
        peaks = [r[1] for r in rows[name]]
        print(f"  {name}: a middle rank's chunk holds M_B {mid[3]:,.0f} B and M_W {mid[4]:,.0f} B a microbatch "
              f"(M_W/M_B {mid[4] / mid[3]:.3f}); rank 0's chunk 0 (embedding + layers) {r0[3]:,.0f}/{r0[4]:,.0f}, "
              f"chunk 1 (layers + final LayerNorm, logits, loss) {r0[5]:,.0f}/{r0[6]:,.0f}\n"
              f"    rank 0 measured {r0[1]:,.0f} B; with a middle rank's chunk sizes it would hold {flat:,.0f}: "
              f"both ends of the V add {r0[1] - flat:,.0f} B = {(r0[1] - flat) / one:.4f} of 1F1B's peak; "
              f"the other ranks' max {max(peaks[1:]) / one:.4f}")
    return ok


def parser():
    p = cli.make_parser(__doc__)
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (CPU ranks started here), at least 2")
    p.add_argument("--microbatches", type=int, default=None,
                   help="m (default: the least m from which every schedule's simulated peak stays the same)")
    p.add_argument("--microbatch-size", type=int, default=1, help="sequences per microbatch")
    p.add_argument("--seq-len", type=int, default=16, help="T")
    p.add_argument("--seed", type=int, default=1234, help="weights and batch")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per collective")
    p.add_argument("--deadline", type=float, default=1200.0, help="seconds before the run is stopped")
    cli.add_dataclass_args(p, tensor_parallel.GPTConfig, "model (default --n-layer: 2 x pp, a layer per V chunk)",
                           vocab_size=32, block_size=16, n_layer=None, n_head=2, n_embd=32)
    return p


def main():
    args = parser().parse_args()
    if args.pp < 2:
        raise ValueError(f"--pp {args.pp}: a V needs at least 2 ranks")
    args.n_layer = 2 * args.pp if args.n_layer is None else args.n_layer
    if args.n_layer < 2 * args.pp or args.n_layer % (2 * args.pp):
        raise ValueError(f"--n-layer {args.n_layer}: the V cuts the model into 2 x pp = {2 * args.pp} stages, and "
                         f"n_layer is not a multiple of them")
    steady = steady_m(args.pp)
    args.microbatches = steady if args.microbatches is None else args.microbatches
    for flag, value in (("--microbatches", args.microbatches), ("--microbatch-size", args.microbatch_size)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    cfg = harness.model_config(args)
    args.batch_size = args.microbatches * args.microbatch_size
    pp, m = args.pp, args.microbatches
    print(f"config: {cfg}; float64; pp={pp} gloo CPU ranks, m={m} microbatches of {args.microbatch_size} x "
          f"{args.seq_len} tokens; torch {torch.__version__}")
    print(f"06's simulated peaks stop growing from m = {steady}"
          + ("" if m >= steady else f": m = {m} is below it, the shares are not the steady state's"))
    t0 = time.perf_counter()
    rows = harness.launch(worker, pp, cfg, args, timeout_s=args.timeout, deadline_s=args.deadline)[0]
    ok = report(args, pp, m, rows)
    print(f"(pp={pp} took {time.perf_counter() - t0:.0f} s)\n{'PASS' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    harness.run_main(main)
