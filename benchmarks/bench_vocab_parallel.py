"""Vocabulary parallelism: 07's step (Algorithms 1 and 2) against 05's 1F1B, with a large vocabulary.

One step without the optimizer, on 02's executor with 05's switches (01's optimize(), background
sends): the output layer and the embedding on the last and first stage (05), or spread over both
ranks as 07's S and T passes and input layer. The sides alternate in one run; before timing,
their loss and gradient norm are checked equal. Then 07's simulated figures for the same model:
what the balance predicts. benchmarks/README.md has the method.

Run it (from the repository root; it starts its own ranks, do not use torchrun):
    python benchmarks/bench_vocab_parallel.py                     # pp=2, V=32768
    python benchmarks/bench_vocab_parallel.py --vocab-size 1024 --repeats 7
"""
import importlib
import time

import torch
import torch.distributed as dist

import harness
from harness import gpt3d, pipeline, tensor_parallel

vp = importlib.import_module("07_vocab_parallel")
TOLERANCES = {"loss": 1e-5, "grad norm": 1e-4}  # float32: the same sums over 2 vocabulary slices, not 1


def side(cfg, full, pipe, groups, microbatches, shape):
    """A step of pipe on this rank (05's 1F1B when pipe has no vocab), and its squared gradient sum."""
    pp, rank = dist.get_world_size(groups.pp), dist.get_rank(groups.pp)
    chunks = pipeline.build_chunks(cfg, pp, rank, 1, groups.tp, pipe.placement, init=False, dtype=torch.float32)
    for c in chunks:
        tensor_parallel.optimize(c).load_full_state_dict(full)
    pipe.prepare(chunks, groups, full)  # 07: the vocabulary spread over every rank; 05's 1F1B: nothing
    spread = isinstance(pipe, vp.VocabSchedule)

    def step():
        for c in chunks:
            c.zero_grad(set_to_none=True)
        res = pipeline.execute(pipe, chunks, groups.pp, microbatches, pipeline.Wire(shape),
                               exchange=pipeline.BackgroundSends())
        if not spread:
            pipeline.sync_tied_embeddings(chunks, groups.embed)
        return res

    def figures():
        res = step()
        sq = sum(float(p.grad.double().pow(2).sum()) for c in chunks for n, p in c.named_parameters()
                 if gpt3d.counts_in_norm(p, c, groups.tp))  # the tied copy once
        out = torch.tensor([sq, float(res.loss) if res.loss is not None else 0.0], dtype=torch.float64)
        dist.all_reduce(out)
        return out[0].sqrt().item(), out[1].item()
    return step, figures


def worker(env, cfg, args):
    m, b, T = args.microbatches, args.microbatch_size, args.seq_len
    full, gen = harness.start(cfg, args.seed)
    microbatches = pipeline.split_batch(*torch.randint(cfg.vocab_size, (2, m * b, T), generator=gen), m)
    pipes = {"05 1F1B": vp.zero_bubble.pipeline_schedule("1f1b", env.world_size, m)}
    pipes.update({f"07 Alg. {3 - k}": vp.vocab_schedule("1f1b", env.world_size, m, k) for k in (2, 1)})
    groups = gpt3d.new_groups(env, pipes["07 Alg. 1"].grid(env.world_size, 1, 1))
    groups.embed = dist.new_group([0, env.world_size - 1])
    sides, figs = {}, {}
    for name, pipe in pipes.items():
        sides[name], check = side(cfg, full, pipe, groups, microbatches, (b, T, cfg.n_embd))
        figs[name] = check()
    ref = figs["05 1F1B"]
    checks = {name: {"grad norm": harness.rel(f[0], ref[0]), "loss": harness.rel(f[1], ref[1])}
              for name, f in figs.items()}
    if not harness.agree(all(harness.within(c, TOLERANCES) for c in checks.values())):
        return {"same": False, "checks": checks}
    return {"same": True, "checks": checks, "rounds": harness.alternate(sides, args.repeats, args.steps, sweeps=True)}


def main():
    parser = harness.parser(__doc__, repeats=5, steps=4, warmup=0, vocab_size=32768, block_size=128,
                            n_layer=4, n_head=4, n_embd=128)
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (CPU ranks started here)")
    parser.add_argument("--microbatches", type=int, default=8, help="m")
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--seq-len", type=int, default=64, help="T")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    args = parser.parse_args()
    cfg = harness.model_config(args)
    pipeline.split_layers(cfg.n_layer, args.pp)
    print(f"config: {cfg}; float32, tied embeddings; pp={args.pp}, m={args.microbatches} of "
          f"{args.microbatch_size} x {args.seq_len}; torch {torch.__version__}")
    t0 = time.perf_counter()
    results = harness.launch(worker, args.pp, cfg, args, timeout_s=args.timeout, deadline_s=args.deadline)
    worst = {name: {k: max(r["checks"][name][k] for r in results) for k in TOLERANCES} for name in results[0]["checks"]}
    if not harness.guard("same function, relative to 05's (worst rank):", worst, TOLERANCES,
                         all(r["same"] for r in results)):
        return False
    rounds = results[0]["rounds"]
    print(f"\nstep time, in sweeps: {harness.time_table(rounds, args.pp)}")
    for name in ("07 Alg. 1", "07 Alg. 2"):
        print("  " + harness.pair_line(rounds, name, "05 1F1B"))
    demo = type("Args", (), dict(pp=args.pp, tp=1, microbatches=args.microbatches, seq_len=args.seq_len,
                                 batch_size=args.microbatches * args.microbatch_size))
    fig = vp.balance(cfg, demo.pp, 1, demo.microbatches, args.microbatch_size, args.seq_len, cfg.vocab_size)
    plain, spread = fig["sims"]
    print(f"07's simulated 1F1B step for this model (Table 4's FLOPs, equal speed per FLOP): "
          f"{spread.step_time / plain.step_time:.3f} of 05's")
    print(f"(took {time.perf_counter() - t0:.0f} s)")
    return True


if __name__ == "__main__":
    harness.run_main(main)
