"""Zero-bubble schedules: ours (06_zero_bubble.py) against our 1F1B and torch's zero-bubble runtime.

One step without the optimizer of our 1F1B (02), ZB-H1 and ZB-V (06, run by 02's executor with
06's backward split), and of torch.distributed.pipelining's ScheduleInterleavedZeroBubble (one
stage per rank: ZB-H1) and ScheduleZBVZeroBubble over the same chunk modules, all alternating in
one run; then each of ours against 02's simulator fed the run's own action times.
benchmarks/README.md has the method.

Run it (from the repository root; it starts its own ranks, do not use torchrun):
    python benchmarks/bench_zero_bubble.py                      # pp=2, m=8
    python benchmarks/bench_zero_bubble.py --pp 4 --repeats 7
"""
import importlib
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

import harness
from bench_pipeline import LastStageOutput
from harness import pipeline, tensor_parallel
from plumbing import demos

zb = importlib.import_module("06_zero_bubble")
TORCH = {"zb-h1": ScheduleInterleavedZeroBubble, "zb-v": ScheduleZBVZeroBubble}

# Torch's against ours, relative, float32: the same modules and loss code; torch computes each
# weight's gradient with autograd.grad from the captured output gradients, ours with one GEMM
# (06's W): the same sums in another order (~1e-7). A lost W is a whole microbatch's term (1/m).
TOLERANCES = {"loss": 1e-6, "grad": 1e-5}


def chunks_of(cfg, full, pipe, rank, split):
    """This rank's chunks for pipe, optimize()d as 05's, with 06's backward split (ours) or not (torch,
    which splits the backward itself)."""
    chunks = pipeline.build_chunks(cfg, pipe.pp, rank, pipe.v, placement=pipe.placement, init=False,
                                   dtype=torch.float32)
    for c in chunks:
        tensor_parallel.optimize(c).load_full_state_dict(full)
    if split:
        pipe.prepare(chunks)  # 06's split for ZB-H1 and ZB-V: the executor then runs I and W on these chunks
    return chunks


def torch_step(name, chunks, pipe, rank, m, idx, targets, vocab_size):
    """torch's zero-bubble schedule over these chunks, placed as ours (its V mapping is ours)."""
    pp, stages = len(pipe.lists), []
    S = pp * len(chunks)
    for c, chunk in enumerate(chunks):
        k = pipe.placement(pp, c, rank)
        stages.append(PipelineStage(LastStageOutput(chunk) if k == S - 1 else chunk, k, S, torch.device("cpu"),
                                    group=dist.group.WORLD))

    def loss_fn(logits, target):
        return tensor_parallel.vocab_parallel_cross_entropy(logits, target, None, vocab_size,
                                                            sums=tensor_parallel.merged_sums)

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
    return (None if loss is None else float(loss)), {(c, n): p.grad.detach().clone() for c, chunk in enumerate(chunks)
                                                      for n, p in chunk.named_parameters()}


def worker(env, cfg, args):
    pp, rank, m, b, T = env.world_size, env.rank, args.microbatches, args.microbatch_size, args.seq_len
    full, gen = harness.start(cfg, args.seed)
    idx, targets = torch.randint(cfg.vocab_size, (2, m * b, T), generator=gen)
    microbatches, shape = pipeline.split_batch(idx, targets, m), (b, T, cfg.n_embd)
    embed_group = dist.new_group([0, pp - 1])
    pipes = {name: zb.pipeline_schedule(name, pp, m) for name in ("1f1b", "zb-h1", "zb-v")}
    sides, chunk_of, ours = {}, {}, {}
    for name, pipe in pipes.items():
        pipeline.validate(pipe, m)
        chunks = chunks_of(cfg, full, pipe, rank, split=True)
        ours[name] = ours_step(chunks, pipe, microbatches, shape)
        sides[f"ours {name}"], chunk_of[f"ours {name}"] = (lambda run=ours[name]: run().loss), (chunks, pipe)
        if name in TORCH:
            chunks = chunks_of(cfg, full, pipe, rank, split=False)
            sides[f"torch {name}"] = torch_step(name, chunks, pipe, rank, m, idx, targets, cfg.vocab_size)
            chunk_of[f"torch {name}"] = chunks, pipe
    for side, step in sides.items():  # torch's first step infers and exchanges shapes
        for _ in range(1 + args.warmup):
            grads_after(step, *chunk_of[side], embed_group)
    checks = {}
    for name in TORCH:
        (l_ours, g_ours), (l_peer, g_peer) = (grads_after(sides[f"{who} {name}"], *chunk_of[f"{who} {name}"],
                                                          embed_group) for who in ("ours", "torch"))
        checks[name] = {"loss": 0.0 if l_ours is None else harness.rel(l_peer, l_ours),
                        "grad": harness.worst_rel(g_peer, g_ours)}
    if not harness.agree(all(harness.within(c, TOLERANCES) for c in checks.values())):
        return {"same": False, "checks": checks}
    zero = lambda side: [c.zero_grad(set_to_none=True) for c in chunk_of[side][0]]  # noqa: E731  (untimed)
    rounds = harness.alternate(sides, args.repeats, args.steps, sweeps=True, setup=zero)
    fed = {}
    for name, pipe in pipes.items():
        events = [e for _ in range(args.repeats * args.steps) for e in (zero(f"ours {name}"), ours[name]())[1].events]
        fed[name] = demos.fed_simulator(pipeline, env, events, pipe, shape)
    return {"same": True, "checks": checks, "rounds": rounds, "fed": fed}


def report(args, pp, results):
    print(f"\n=== pp={pp}: {pp} gloo ranks x 1 thread; m={args.microbatches} microbatches of "
          f"{args.microbatch_size} x {args.seq_len} tokens ===")
    worst = {name: {k: max(r["checks"][name][k] for r in results) for k in TOLERANCES} for name in TORCH}
    if not harness.guard("same function, torch's relative to ours (worst rank):", worst, TOLERANCES,
                         all(r["same"] for r in results)):
        return False
    rounds = results[0]["rounds"]
    print(f"\nstep time, in sweeps: {harness.time_table(rounds, pp)}")
    for a, b in [("ours zb-h1", "ours 1f1b"), ("ours zb-v", "ours 1f1b"), ("ours zb-h1", "torch zb-h1"),
                 ("ours zb-v", "torch zb-v")]:
        print("  " + harness.pair_line(rounds, a, b))
    for name, (step, t_f, t_b, t_comm) in results[0]["fed"].items():
        measured = harness.median_of(rounds, f"ours {name}")
        per_rank = lambda ts: "/".join(f"{x * 1e3:.2f}" for x in ts)  # noqa: E731
        print(f"  ours {name}/02's simulator fed this run's ms (per rank t_f {per_rank(t_f)}, t_b {per_rank(t_b)}; "
              f"p2p {t_comm * 1e3:.3f}): {measured * 1e3:.1f}/{step * 1e3:.1f} = {measured / step:.3f}")
    return True


def main():
    parser = harness.parser(__doc__, repeats=5, steps=3, warmup=0, vocab_size=512, block_size=128,
                            n_layer=8, n_head=4, n_embd=128)
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (CPU ranks started here)")
    parser.add_argument("--microbatches", type=int, default=8, help="m")
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--seq-len", type=int, default=64, help="T")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    args = parser.parse_args()
    cfg = harness.model_config(args, pipelining=True)
    pipeline.split_layers(cfg.n_layer, 2 * args.pp)  # ZB-V's 2 pp stages, refused before any rank starts
    print(f"config: {cfg}; float32, tied embeddings; torch {torch.__version__}")
    t0 = time.perf_counter()
    ok = report(args, args.pp, harness.launch(worker, args.pp, cfg, args, timeout_s=args.timeout,
                                              deadline_s=args.deadline))
    print(f"(pp={args.pp} took {time.perf_counter() - t0:.0f} s)")
    return ok


if __name__ == "__main__":
    harness.run_main(main)
