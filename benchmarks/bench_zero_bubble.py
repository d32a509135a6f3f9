"""Zero-bubble schedules: ours (06_zero_bubble.py) against our 1F1B and torch's zero-bubble runtime.

One step without the optimizer of our 1F1B (02), ZB-H1, ZB-V, V-Half, V-Min and DualPipeV (06, run
by 02's executor with 06's backward split), and of torch.distributed.pipelining's
ScheduleInterleavedZeroBubble (one stage per rank: ZB-H1), ScheduleZBVZeroBubble and
ScheduleDualPipeV over the same chunk modules, all alternating in one run; each rank's peak
activation bytes; then each of ours against 02's simulator fed the run's own action times.
DualPipeV is first checked against torch's in float64 (loss and every gradient, 1e-10).
benchmarks/README.md has the method.

Run it (from the repository root; it starts its own ranks, do not use torchrun):
    python benchmarks/bench_zero_bubble.py                      # pp=2, m=8
    python benchmarks/bench_zero_bubble.py --pp 4 --repeats 7
    python benchmarks/bench_zero_bubble.py --schedules dualpipev --repeats 9   # DualPipeV against torch's only
"""
import importlib
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, ScheduleDualPipeV, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)

import harness
from bench_pipeline import LastStageOutput
from harness import pipeline, tensor_parallel
from plumbing import demos

zb = importlib.import_module("06_zero_bubble")
TORCH = {"zb-h1": ScheduleInterleavedZeroBubble, "zb-v": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
SCHEDULES = ("zb-h1", "zb-v", "v-half", "v-min", "dualpipev")  # each timed with 1F1B, the base

# Torch's against ours, relative, float32: the same modules and loss code; torch computes each
# weight's gradient with autograd.grad from the captured output gradients, ours with one GEMM
# (06's W): the same sums in another order (~1e-7). A lost W is a whole microbatch's term (1/m).
TOLERANCES = {"loss": 1e-6, "grad": 1e-5}
# DualPipeV first in float64, ours against torch's: the same sums in another order (~1e-15); a lost,
# doubled or misplaced microbatch moves a gradient by O(1/m).
TOLERANCES_64 = {"loss": 1e-10, "grad": 1e-10}


class SavedBytes:
    """torch's side's peak activation bytes: what autograd saves for backward (parameters
    excluded, every storage once), from its save until autograd lets it go (a weakref on the saved
    tensor), sampled at each save. 02's ActivationMeter counts ours the same way (and cannot be
    nested with this one: only the innermost saved-tensors hook runs), so ours is read from its
    StepResult. Neither counts a stage output kept only by the runtime: ours frees it once sent
    (Megatron's deallocation), torch keeps it in its forward cache until the backward."""

    def __init__(self, chunks):
        self.params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
        self.live, self.now, self.peak = {}, 0, 0

    def pack(self, t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self.params or not st.nbytes():
            return t
        if ptr not in self.live:
            self.live[ptr] = [st.nbytes(), 0]
            self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
        self.live[ptr][1] += 1
        weakref.finalize(t, self.release, ptr)
        return t

    def release(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if not entry[1]:
            self.now -= entry[0]
            del self.live[ptr]

    def run(self, step):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            step()
        return self.peak


def chunks_of(cfg, full, pipe, rank, split, dtype=torch.float32):
    """This rank's chunks for pipe, optimize()d as 05's, with 06's backward split (ours) or not (torch,
    which splits the backward itself)."""
    chunks = pipeline.build_chunks(cfg, pipe.pp, rank, pipe.v, placement=pipe.placement, init=False,
                                   dtype=dtype)
    for c in chunks:
        tensor_parallel.optimize(c).load_full_state_dict(full)
    if split:
        pipe.prepare(chunks)  # 06's split for ZB-H1 and ZB-V: the executor then runs I and W on these chunks
    return chunks


def torch_step(name, chunks, pipe, rank, m, idx, targets, cfg):
    """torch's zero-bubble schedule over these chunks, placed as ours (its V mapping is ours). Every
    stage's shapes are given (static mode): torch's inference would pickle them through numpy,
    which torch's CPU wheel does not install; given, the run needs no numpy."""
    pp, stages, vocab_size = len(pipe.lists), [], cfg.vocab_size
    S, (b, T), dtype = pp * len(chunks), (idx.shape[0] // m, idx.shape[1]), next(chunks[0].parameters()).dtype
    hidden = torch.empty(b, T, cfg.n_embd, dtype=dtype)
    for c, chunk in enumerate(chunks):
        k = pipe.placement(pp, c, rank)
        x = torch.empty(b, T, dtype=idx.dtype) if k == 0 else hidden.clone().requires_grad_()
        y = torch.empty(b, T, vocab_size, dtype=dtype) if k == S - 1 else hidden
        stages.append(PipelineStage(LastStageOutput(chunk) if k == S - 1 else chunk, k, S, torch.device("cpu"),
                                    input_args=x, output_args=y, output_grads=None if k == S - 1 else y,
                                    input_grads=None if k == 0 else x, group=dist.group.WORLD))

    def loss_fn(logits, target):
        return tensor_parallel.vocab_parallel_cross_entropy(logits, target, None, vocab_size)

    schedule = TORCH[name](stages, m, loss_fn=loss_fn, scale_grads=True)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def step():
        losses = [] if last else None
        schedule.step(*((idx,) if first else ()), target=targets if last else None, losses=losses,
                      return_outputs=False)
        return torch.stack(losses).mean() if last else None
    return step


def ours_step(chunks, pipe, microbatches, shape):
    return lambda: pipeline.execute(pipe, chunks, dist.group.WORLD, microbatches, pipeline.Wire(shape),
                                    exchange=pipeline.BackgroundSends())


def grads_after(step, chunks, pipe, embed_group):
    for c in chunks:
        c.zero_grad(set_to_none=True)
    loss = step()
    pipeline.sync_tied_embeddings(chunks, embed_group if pipe.where[pipe.S - 1][0] else None)
    grads = {(c, n): p.grad.detach().clone() for c, chunk in enumerate(chunks) for n, p in chunk.named_parameters()}
    return (None if loss is None else float(torch.as_tensor(loss).detach())), grads


def check_64(env, cfg, args, embed_group):
    """DualPipeV, ours against torch's, float64: the same weights (float64, the bench's seed) and
    batch, one step each; the worst relative difference of the loss and of every gradient."""
    pp, m, b, T = env.world_size, args.microbatches, args.microbatch_size, args.seq_len
    full = tensor_parallel.init_state_dict(cfg, args.seed, dtype=torch.float64, random_all=True)
    gen = torch.Generator().manual_seed(args.seed + 2)
    idx, targets = torch.randint(cfg.vocab_size, (2, m * b, T), generator=gen)
    pipe = zb.pipeline_schedule("dualpipev", pp, m)
    ours = chunks_of(cfg, full, pipe, env.rank, split=True, dtype=torch.float64)
    peer = chunks_of(cfg, full, pipe, env.rank, split=False, dtype=torch.float64)
    run = ours_step(ours, pipe, pipeline.split_batch(idx, targets, m), (b, T, cfg.n_embd))
    (l_ours, g_ours), (l_peer, g_peer) = (grads_after(lambda: run().loss, ours, pipe, embed_group),
                                          grads_after(torch_step("dualpipev", peer, pipe, env.rank, m, idx, targets, cfg),
                                                      peer, pipe, embed_group))
    return {"loss": 0.0 if l_ours is None else harness.rel(l_peer, l_ours), "grad": harness.worst_rel(g_peer, g_ours)}


def worker(env, cfg, args):
    pp, rank, m, b, T = env.world_size, env.rank, args.microbatches, args.microbatch_size, args.seq_len
    embed_group = dist.new_group([0, pp - 1])
    check64 = check_64(env, cfg, args, embed_group) if "dualpipev" in args.schedules else None
    if check64 is not None and not harness.agree(harness.within(check64, TOLERANCES_64)):
        return {"same": False, "check64": check64, "checks": {}}
    full, gen = harness.start(cfg, args.seed)
    idx, targets = torch.randint(cfg.vocab_size, (2, m * b, T), generator=gen)
    microbatches, shape = pipeline.split_batch(idx, targets, m), (b, T, cfg.n_embd)
    pipes = {name: zb.pipeline_schedule(name, pp, m) for name in ("1f1b", *args.schedules)}
    sides, chunk_of, ours = {}, {}, {}
    for name, pipe in pipes.items():
        pipeline.validate(pipe, m)
        chunks = chunks_of(cfg, full, pipe, rank, split=True)
        ours[name] = ours_step(chunks, pipe, microbatches, shape)
        sides[f"ours {name}"], chunk_of[f"ours {name}"] = (lambda run=ours[name]: run().loss), (chunks, pipe)
        if name in TORCH:
            chunks = chunks_of(cfg, full, pipe, rank, split=False)
            sides[f"torch {name}"] = torch_step(name, chunks, pipe, rank, m, idx, targets, cfg)
            chunk_of[f"torch {name}"] = chunks, pipe
    for side, step in sides.items():  # torch's first step runs its warm-up vote (the shapes are given)
        for _ in range(1 + args.warmup):
            grads_after(step, *chunk_of[side], embed_group)
    checks = {}
    for name in (n for n in TORCH if n in pipes):
        (l_ours, g_ours), (l_peer, g_peer) = (grads_after(sides[f"{who} {name}"], *chunk_of[f"{who} {name}"],
                                                          embed_group) for who in ("ours", "torch"))
        checks[name] = {"loss": 0.0 if l_ours is None else harness.rel(l_peer, l_ours),
                        "grad": harness.worst_rel(g_peer, g_ours)}
    if not harness.agree(all(harness.within(c, TOLERANCES) for c in checks.values())):
        return {"same": False, "check64": check64, "checks": checks}
    zero = lambda side: [c.zero_grad(set_to_none=True) for c in chunk_of[side][0]]  # noqa: E731  (untimed)
    peaks = {}  # each side's peak activation bytes on this rank, one untimed step: ours 02's meter, torch SavedBytes
    for side in sides:
        zero(side)
        dist.barrier()
        name = side.split()[1]
        peaks[side] = ours[name]().peak_activation_bytes if side.startswith("ours") else \
            SavedBytes(chunk_of[side][0]).run(sides[side])
    peaks = dict(zip(peaks, zip(*demos.gather_numbers(list(peaks.values())))))  # side -> (bytes per rank)
    rounds = harness.alternate(sides, args.repeats, args.steps, sweeps=True, setup=zero)
    fed = {}
    for name, pipe in (pipes.items() if args.fed else ()):
        events = [e for _ in range(args.repeats * args.steps) for e in (zero(f"ours {name}"), ours[name]())[1].events]
        fed[name] = demos.fed_simulator(pipeline, env, events, pipe, shape)
    return {"same": True, "check64": check64, "checks": checks, "rounds": rounds, "fed": fed, "peaks": peaks}


def report(args, pp, results):
    print(f"\n=== pp={pp}: {pp} gloo ranks x 1 thread; m={args.microbatches} microbatches of "
          f"{args.microbatch_size} x {args.seq_len} tokens ===")
    r0 = results[0]
    if r0["check64"] is not None:
        worst = {k: max(r["check64"][k] for r in results) for k in TOLERANCES_64}
        if not harness.guard("DualPipeV in float64, torch's ScheduleDualPipeV relative to ours (worst rank):",
                             {"dualpipev": worst}, TOLERANCES_64, harness.within(worst, TOLERANCES_64)):
            return False
    torch_names = [n for n in TORCH if n in r0["checks"]]
    worst = {name: {k: max(r["checks"][name][k] for r in results) for k in TOLERANCES} for name in torch_names}
    if not harness.guard("same function, float32, torch's relative to ours (worst rank):", worst, TOLERANCES,
                         all(r["same"] for r in results)):
        return False
    rounds = r0["rounds"]
    print(f"\nstep time, in sweeps: {harness.time_table(rounds, pp)}")
    names = [side.split()[1] for side in rounds[0] if side.startswith("ours") and side != "ours 1f1b"]
    for a, b in [*((f"ours {n}", "ours 1f1b") for n in names), *((f"ours {n}", f"torch {n}") for n in torch_names)]:
        print("  " + harness.pair_line(rounds, a, b))
    if "dualpipev" in torch_names:
        per = lambda side: " ".join(f"{t[0] * 1e3:.1f}" for rnd in rounds for t in rnd[side])  # noqa: E731
        print(f"  per-iteration wall ms (slowest rank), in the order run:\n    ours dualpipev:  {per('ours dualpipev')}"
              f"\n    torch dualpipev: {per('torch dualpipev')}")
    peaks = r0["peaks"]
    print("\npeak activation bytes per rank, one untimed step (ours: 02's ActivationMeter; torch: what autograd "
          "saves, SavedBytes;\n  neither counts stage outputs the runtime keeps: ours frees them once sent, torch "
          "keeps them until their backward):")
    for side, per_rank in peaks.items():
        share = ", ".join(f"{x / max(peaks['ours 1f1b']):.2f}" for x in per_rank)
        print(f"  {side:16s} {[int(x) for x in per_rank]}  ({share} of ours 1F1B's peak)")
    for name, (step, t_f, t_b, t_comm) in r0["fed"].items():
        measured = harness.median_of(rounds, f"ours {name}")
        per_rank = lambda ts: "/".join(f"{x * 1e3:.2f}" for x in ts)  # noqa: E731
        print(f"  ours {name}/02's simulator fed this run's ms (per rank t_f {per_rank(t_f)}, t_b {per_rank(t_b)}; "
              f"p2p {t_comm * 1e3:.3f}): {measured * 1e3:.1f}/{step * 1e3:.1f} = {measured / step:.3f}")
    return True


def main():
    parser = harness.parser(__doc__, repeats=5, steps=3, warmup=0, vocab_size=512, block_size=128,
                            n_layer=8, n_head=4, n_embd=128)
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (CPU ranks started here)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES),
                        help="06's schedules timed with our 1F1B (and torch's, where it has one)")
    parser.add_argument("--no-fed", dest="fed", action="store_false",
                        help="skip 02's simulator fed the run's action times (a smoke run)")
    parser.add_argument("--microbatches", type=int, default=8, help="m")
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--seq-len", type=int, default=64, help="T")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    args = parser.parse_args()
    cfg = harness.model_config(args)  # torch's stages get their shapes: no numpy needed
    if args.microbatches < args.pp:
        raise ValueError(f"--microbatches {args.microbatches}: torch's zero-bubble schedules need at least --pp "
                         f"{args.pp}")
    if "dualpipev" in args.schedules and args.microbatches < 2 * args.pp:
        raise ValueError(f"--microbatches {args.microbatches}: --schedules dualpipev needs at least as many "
                         f"microbatches as its 2 x pp = {2 * args.pp} stages")
    pipeline.split_layers(cfg.n_layer, 2 * args.pp)  # the V's 2 pp stages, refused before any rank starts
    print(f"config: {cfg}; float32, tied embeddings; torch {torch.__version__}")
    t0 = time.perf_counter()
    ok = report(args, args.pp, harness.launch(worker, args.pp, cfg, args, timeout_s=args.timeout,
                                              deadline_s=args.deadline))
    print(f"(pp={args.pp} took {time.perf_counter() - t0:.0f} s)")
    return ok


if __name__ == "__main__":
    harness.run_main(main)
