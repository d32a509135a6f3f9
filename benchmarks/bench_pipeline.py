"""Pipeline schedules: ours (02_pipeline_1f1b.py, 03_interleaved.py) against torch's pipelining.

One step without the optimizer of our GPipe, 1F1B (02) and interleaved 1F1B (03) against
torch.distributed.pipelining's schedules over the very same chunk modules.
benchmarks/README.md has what each side runs, the checks and the method.

Run it (from the repository root; it starts its own ranks, do not use torchrun):
    python benchmarks/bench_pipeline.py                                  # pp=2 and pp=4, all schedules
    python benchmarks/bench_pipeline.py --pp 4 --schedules 1f1b --repeats 7
    python benchmarks/bench_pipeline.py --pp 4 --profile                 # where the time goes
"""
import functools
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)

import harness
from harness import interleaved, pipeline, rel, tensor_parallel
from plumbing import demos

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}

# The peer against ours, relative: the loss; the gradients, max |a - b| / max |b| of the worst
# tensor. float32 on both sides, same modules and same loss code; what may differ is the scaling of
# the m microbatch gradients (ours scales each loss by 1/m before backward, torch divides the sum by
# m afterwards). With m a power of two both are exact and the difference is 0; otherwise it moves
# the last bits only (~1e-7). A wrong microbatch, a missing 1/m or an unsynchronised tied weight
# shows up at 1e-2 or more.
TOLERANCES = {"loss": 1e-6, "grad": 1e-5}


# ----------------------------------------------------------------------------------------------
# The two sides of each comparison: ours is 02's executor running this rank's action list; the
# peer is below. A step returns the mean loss on the rank that holds the last stage (None
# elsewhere); the chunks, which both share, carry the gradients.


class LastStageOutput(nn.Module):
    """torch's last stage must return what its loss_fn reads: our last chunk's logits, without the
    None loss. No parameters of its own: the names and the computation are the chunk's."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        return self.chunk(x)[0]


def peer_step(name, chunks, pp, rank, m, idx, targets, vocab_size):
    """torch.distributed.pipelining over the same chunk modules: one PipelineStage per chunk (stage
    index c*pp + rank for this rank's chunk c, the same placement as ours). Returns step()."""
    S, stages = pp * len(chunks), []
    for c, chunk in enumerate(chunks):
        k = c * pp + rank
        module = LastStageOutput(chunk) if k == S - 1 else chunk
        stages.append(PipelineStage(module, k, S, torch.device("cpu"), group=dist.group.WORLD))

    def loss_fn(logits, target):  # our cross-entropy (tp=1): the same arithmetic as our last chunk
        return tensor_parallel.vocab_parallel_cross_entropy(logits, target, None, vocab_size)

    cls = TORCH_SCHEDULES[name]
    schedule = cls(stages if cls is ScheduleInterleaved1F1B else stages[0], m, loss_fn=loss_fn, scale_grads=True)
    # The whole batch goes in; torch splits it into m microbatches along dim 0, the same rows as
    # 02's split_batch. Only the first stage reads the input, only the last the target.
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def step():
        # The mean of the per-microbatch mean losses is ours (the token-weighted sum): every
        # microbatch has the same number of tokens. No merged logits: ours does not pay for them.
        losses = [] if last else None
        schedule.step(*((idx,) if first else ()), target=targets if last else None, losses=losses,
                      return_outputs=False)
        return torch.stack(losses).mean() if last else None
    return step


def zero_grads(chunks, contender=None):
    """Also harness.alternate's setup(contender): ours and the peer share the chunks."""
    for c in chunks:
        c.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------
# The worker: one launch per pp. It builds every contender, checks that ours and the peer compute
# the same loss and gradients, then times them alternately.


def actions_of(name, pp, m, rank, v):
    """Our action list for `rank`: 02's GPipe or 1F1B, or 03's interleaved 1F1B over v chunks."""
    return interleaved.interleaved(pp, m, rank, v) if name == "interleaved" else pipeline.SCHEDULES[name](pp, m, rank)


def check_same(chunks, sides, embed_group):
    """The loss and every gradient of the peer against ours (this rank's; the loss is 0 on a rank
    without the last stage). Both sides run over the same chunks, one after the other."""
    out = []
    for step in sides.values():
        zero_grads(chunks)
        loss = step()
        pipeline.sync_tied_embeddings(chunks, embed_group)
        out.append((None if loss is None else loss.item(),
                    {(c, n): p.grad.detach().clone() for c, chunk in enumerate(chunks)
                     for n, p in chunk.named_parameters()}))
    (l_ours, g_ours), (l_peer, g_peer) = out
    zero_grads(chunks)
    return {"loss": 0.0 if l_ours is None else rel(l_peer, l_ours), "grad": harness.worst_rel(g_peer, g_ours)}


def worker(env, cfg, args):
    pp, rank, m = env.world_size, env.rank, args.microbatches
    b, T = args.microbatch_size, args.seq_len
    full, gen = harness.start(cfg, args.seed)
    idx, targets = torch.randint(cfg.vocab_size, (2, m * b, T), generator=gen)
    microbatches = pipeline.split_batch(idx, targets, m)
    embed_group = dist.new_group([0, pp - 1], timeout=timedelta(seconds=args.timeout))

    chunk_sets, pairs, ours, schedules = {}, {}, {}, {}  # v -> this rank's chunks, which ours and the peer share
    for name in args.schedules:
        v = args.virtual_stages if name == "interleaved" else 1
        schedules[name] = pipeline.Schedule([actions_of(name, pp, m, r, v) for r in range(pp)])
        pipeline.validate(schedules[name], m)
        if v not in chunk_sets:
            chunk_sets[v] = pipeline.build_chunks(cfg, pp, rank, v, init=False, dtype=torch.float32)
            for c in chunk_sets[v]:  # 01's optimizations on, as 05 (and harness.gpt)
                tensor_parallel.optimize(c).load_full_state_dict(full)
        chunks, schedule = chunk_sets[v], schedules[name]
        ours[name] = lambda schedule=schedule, chunks=chunks: pipeline.execute(  # 02's optimization on, as 05
            schedule, chunks, dist.group.WORLD, microbatches, pipeline.Wire((b, T, cfg.n_embd)),
            exchange=pipeline.BackgroundSends())
        pairs[name] = chunks, {"ours": lambda run=ours[name]: run().loss,
                               "peer": peer_step(name, chunks, pp, rank, m, idx, targets, cfg.vocab_size)}

    # A torch schedule's first step infers and exchanges shapes (a real forward and backward): every
    # side runs 1 + --warmup times before the check (which changes no weight) and the timing.
    for chunks, sides in pairs.values():
        for step in sides.values():
            for _ in range(1 + args.warmup):
                zero_grads(chunks)
                step()

    checks = {name: check_same(chunks, sides, embed_group) for name, (chunks, sides) in pairs.items()}
    # Every rank must agree before any of them times anything.
    if not harness.agree(all(harness.within(c, TOLERANCES) for c in checks.values())):
        return {"same": False, "checks": checks}
    out = {"same": True, "checks": checks, "rounds": {}, "fed": {}, "profiles": []}
    for name, (chunks, sides) in pairs.items():
        zero = functools.partial(zero_grads, chunks)  # untimed, before each timed step
        out["rounds"][name] = harness.alternate(sides, args.repeats, args.steps, sweeps=True, setup=zero)
        events = [e for _ in range(args.repeats * args.steps) for e in (zero(), ours[name]())[1].events]
        out["fed"][name] = demos.fed_simulator(pipeline, env, events, schedules[name], (b, T, cfg.n_embd))
        if args.profile:
            out["profiles"] += harness.profiles(sides, args.profile_rows, setup=zero, title=f"{name} ").values()
    return out


# ----------------------------------------------------------------------------------------------
# Report and command line


def report(args, pp, results):
    print(f"\n=== pp={pp}: {pp} gloo ranks x 1 thread; m={args.microbatches} microbatches of "
          f"{args.microbatch_size} x {args.seq_len} tokens; v={args.virtual_stages} for interleaved ===")
    worst = {name: {k: max(r["checks"][name][k] for r in results) for k in TOLERANCES} for name in args.schedules}
    if not harness.guard("same function, the peer relative to ours (worst rank):", worst, TOLERANCES,
                         all(r["same"] for r in results)):
        return False
    rounds = results[0]["rounds"]  # combined over the ranks: every rank holds the same figures
    print("\nstep time (goal: ours <= 0.9 x torch), in sweeps")
    for name in args.schedules:
        print(f"{name}: {harness.time_table(rounds[name], pp)}")
        print("  " + harness.pair_line(rounds[name], "ours", "peer", goal=0.9))
        (step, t_f, t_b, t_comm), measured = results[0]["fed"][name], harness.median_of(rounds[name], "ours")
        per_rank = lambda ts: "/".join(f"{x * 1e3:.2f}" for x in ts)  # noqa: E731
        print(f"  ours/02's simulator fed this run's ms (per rank t_f {per_rank(t_f)}, t_b {per_rank(t_b)}; p2p "
              f"{t_comm * 1e3:.3f}): {measured * 1e3:.1f}/{step * 1e3:.1f} = {measured / step:.3f} (goal: within 10%)")
    for table in results[0]["profiles"]:
        print(table)
    return True


def main():
    parser = harness.parser(__doc__, repeats=5, steps=3, warmup=0, vocab_size=512, block_size=128,
                            n_layer=8, n_head=4, n_embd=128)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4],
                        help="pipeline sizes to run, one launch (pp CPU ranks) each")
    parser.add_argument("--schedules", nargs="+", choices=list(TORCH_SCHEDULES), default=list(TORCH_SCHEDULES),
                        help="which of ours against torch's")
    parser.add_argument("--virtual-stages", type=int, default=2, help="v for the interleaved schedule")
    parser.add_argument("--microbatches", type=int, default=8, help="m")
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--seq-len", type=int, default=64, help="T")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    args = parser.parse_args()
    cfg = harness.model_config(args, pipelining=True)
    v = args.virtual_stages if "interleaved" in args.schedules else 1
    for pp in args.pp:  # refuse what cannot run before starting any rank
        pipeline.split_layers(cfg.n_layer, pp * v)
        interleaved.check_interleaving(pp, args.microbatches, v)
    print(f"config: {cfg}; float32, tied embeddings; torch {torch.__version__}")
    for pp in args.pp:
        t0 = time.perf_counter()
        ok = report(args, pp, harness.launch(worker, pp, cfg, args, timeout_s=args.timeout, deadline_s=args.deadline))
        print(f"(pp={pp} took {time.perf_counter() - t0:.0f} s)")
        if not ok:
            return False
    return True


if __name__ == "__main__":
    harness.run_main(main)
