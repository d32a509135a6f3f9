"""01's and 02's communication optimizations, each on against off, in one run, alternating.

  TP, 01 on tp gloo ranks, one forward + backward of the GPT (no optimizer):
      on        tensor_parallel.optimize(model): as 05 trains
      tp-wait   optimize(model, overlap_input_grad=False): f's all-reduce (sp: reduce-scatter) after
                the whole linear backward, with nothing left to hide behind
  PP, 02's executor on pp gloo ranks, one step of each schedule (no optimizer):
      background   exchange=pipeline.BackgroundSends(), as 05: a boundary waits for its receives only
      waited       the plain pipeline.Exchange() (execute's default): every send waited at its boundary

Before anything is timed, each pair is checked to compute the same loss and gradients (a switch
changes when a rank waits or how numbers travel, not what is computed). A ratio below 1 means the
switch on is faster. benchmarks/README.md has the method (harness.alternate, pair_line).

Run it (from the repository root; CPU only, it starts its own ranks):
    python benchmarks/bench_overlap.py                          # tp=2, then pp=2 (GPipe and 1F1B)
    python benchmarks/bench_overlap.py --sequence-parallel      # the reduce-scatter instead
    python benchmarks/bench_overlap.py --only pp --repeats 11
"""
import torch
import torch.distributed as dist

import harness
from harness import pipeline, rel, tensor_parallel
from plumbing.trace import trace_comm

# float32. The overlapped linear computes dX, dW and db with the same GEMMs as autograd's linear
# but sums db in its own order (a few ulps); the background sends move the same bytes. A real difference (a lost reduction) is O(1).
TOLERANCES = {"loss": 1e-6, "grad": 1e-5}
TP_SWITCHES = {"on": {}, "tp-wait": {"overlap_input_grad": False}}


def tp_step(model, idx, targets):
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)[1]
    loss.backward()
    return loss


def tp_worker(env, cfg, args):
    group = tensor_parallel.new_tp_group(env, args.tp)
    full, gen = harness.start(cfg, args.seed)
    idx, targets = (torch.randint(cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen) for _ in "ab")
    models, losses, grads, counts = {}, {}, {}, {}
    for name, switches in TP_SWITCHES.items():
        models[name] = harness.gpt(cfg, full, group, args.sequence_parallel, **switches)
        with trace_comm() as log:
            losses[name] = tp_step(models[name], idx, targets).item()
        counts[name], grads[name] = len(log), models[name].full_grads()
    diffs = {name: {"loss": rel(losses[name], losses["on"]), "grad": harness.worst_rel(grads[name], grads["on"])}
             for name in models if name != "on"}
    same = harness.agree(all(harness.within(d, TOLERANCES) for d in diffs.values()))
    steps = {name: (lambda m=m: tp_step(m, idx, targets)) for name, m in models.items()}
    rounds = harness.alternate(steps, args.repeats, args.steps, args.warmup, sweeps=True) if same else None
    return {"same": same, "diffs": diffs, "collectives": counts, "rounds": rounds}


def pp_worker(env, cfg, args):
    pp, m, b = env.world_size, args.microbatches, args.microbatch_size
    full, gen = harness.start(cfg, args.seed)
    idx, targets = (torch.randint(cfg.vocab_size, (m * b, args.seq_len), generator=gen) for _ in "ab")
    micro, shape = pipeline.split_batch(idx, targets, m), (b, args.seq_len, cfg.n_embd)
    chunks = pipeline.build_chunks(cfg, pp, env.rank, init=False, dtype=torch.float32)
    for c in chunks:  # 01's optimizations on, as 05 (and harness.gpt)
        tensor_parallel.optimize(c).load_full_state_dict(full)

    def zero(_=None):
        for c in chunks:
            c.zero_grad(set_to_none=True)

    out = {}
    for name in args.schedules:
        schedule = pipeline.Schedule([pipeline.SCHEDULES[name](pp, m, r) for r in range(pp)])
        steps = {side: (lambda ex=ex: pipeline.execute(schedule, chunks, dist.group.WORLD, micro, pipeline.Wire(shape),
                                                       exchange=ex()))
                 for side, ex in (("background", pipeline.BackgroundSends), ("waited", pipeline.Exchange))}
        grads = {}
        for side, step in steps.items():
            zero()
            step()
            grads[side] = {n: p.grad.clone() for c in chunks for n, p in c.named_parameters()}
        diffs = {"grad": harness.worst_rel(grads["background"], grads["waited"])}
        same = harness.agree(diffs["grad"] <= TOLERANCES["grad"])
        rounds = harness.alternate(steps, args.repeats, args.steps, args.warmup, sweeps=True, setup=zero) \
            if same else None
        out[name] = {"same": same, "diffs": diffs, "rounds": rounds}
    return out


def report_tp(args, r):
    print(f"\nTP: tp={args.tp} B={args.batch_size} T={args.seq_len} sequence_parallel={args.sequence_parallel}"
          f" float32; collectives per step: " + ", ".join(f"{n} {c}" for n, c in r["collectives"].items()))
    if not harness.guard("same function as 'on' (rank 0; grad: the worst max |a - b| / max |b|):", r["diffs"],
                         TOLERANCES, r["same"]):
        return False
    print(harness.time_table(r["rounds"], args.tp, " (one step per sweep, order rotating)"))
    print("  " + harness.pair_line(r["rounds"], "on", "tp-wait"))
    return True


def report_pp(args, results):
    for name, r in results[0].items():
        print(f"\nPP: pp={args.pp} {name}, m={args.microbatches} microbatches of {args.microbatch_size}, "
              f"T={args.seq_len}, float32")
        rows = {f"rank {k}": x[name]["diffs"] for k, x in enumerate(results)}
        if not harness.guard("same function, background against waited:", rows, {"grad": TOLERANCES["grad"]},
                             r["same"]):
            return False
        print(harness.time_table(r["rounds"], args.pp, " (one step per sweep, order rotating)"))
        print("  " + harness.pair_line(r["rounds"], "background", "waited"))
    return True


def main():
    parser = harness.parser(__doc__, repeats=7, steps=8, warmup=2, vocab_size=512, block_size=128,
                            n_layer=4, n_head=4, n_embd=256)
    parser.add_argument("--only", choices=["tp", "pp"], help="run one of the two (default: both)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size = local CPU ranks")
    parser.add_argument("--sequence-parallel", action="store_true", help="TP with sequence parallelism")
    parser.add_argument("--batch-size", type=int, default=8, help="B, for TP")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages = local CPU ranks")
    parser.add_argument("--schedules", nargs="+", choices=list(pipeline.SCHEDULES), default=["gpipe", "1f1b"])
    parser.add_argument("--microbatches", type=int, default=8, help="m, for PP")
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences per microbatch, for PP")
    parser.add_argument("--seq-len", type=int, default=128, help="T")
    args = parser.parse_args()
    cfg = harness.model_config(args)  # --seq-len within --block-size too
    pipeline.split_layers(cfg.n_layer, args.pp)  # refused before any rank starts
    print(f"config: {cfg}; torch {torch.__version__}, gloo ranks x 1 thread")
    ok = True
    if args.only in (None, "tp"):
        ok = report_tp(args, harness.launch(tp_worker, args.tp, cfg, args, timeout_s=120.0,
                                            deadline_s=args.deadline)[0])
    if ok and args.only in (None, "pp"):
        ok = report_pp(args, harness.launch(pp_worker, args.pp, cfg, args, timeout_s=120.0,
                                            deadline_s=args.deadline))
    return ok


if __name__ == "__main__":
    harness.run_main(main)
