"""Expert parallelism: 09's all-to-all dispatcher over ep ranks against the same MoE layer run serially.

One MoE layer (09's MoELayer: router, E experts, top-k), forward and backward, on ep ranks of N tokens
each: each rank routes its tokens, the all-to-alls carry them to the ranks holding their experts and
back. The serial side is the same layer, with every expert, on rank 0 alone, on all ep x N tokens
(the other ranks wait at the barrier): what one rank would do without expert parallelism. Before
timing, the two must compute the same function: every rank's outputs, and the router's and every
expert's gradients. Then the all-to-all bytes the dispatcher moved, every rank's, against the
planner's formula (planner.moe_alltoall_bytes, uniform routing), dropless and with a capacity factor
(whose padding makes every all-to-all one fixed size). benchmarks/README.md has the method.

Run it (from the repository root; it starts its own ranks, do not use torchrun):
    python benchmarks/bench_experts.py                         # ep=4, E=8, top-2, 1024 tokens per rank
    python benchmarks/bench_experts.py --ep 2 --tokens 4096 --repeats 9
"""
import importlib
import math
import time
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.distributed as dist

import harness
from harness import tensor_parallel

experts = importlib.import_module("09_expert_parallel")
planner = importlib.import_module("planner")
TOLERANCES = {"output": 1e-5, "grads": 1e-4}  # float32: the same sums, the experts' rows in other batches


def layer(kind, cfg, moe, full, groups=None):
    """09's layer of `kind` over groups (None: serial, every expert), loaded with its part of full."""
    out = kind(cfg, moe, groups)
    out.load_state_dict({k: v for k, v in full.items() if k in out.state_dict()})
    return out


def worker(env, cfg, args):
    moe = experts.MoEConfig(num_experts=args.num_experts, top_k=args.top_k, aux_loss_coeff=0.0)  # a rank: its own aux
    torch.manual_seed(args.seed)
    full, gen = experts.MoELayer(cfg, moe).state_dict(), torch.Generator().manual_seed(args.seed)
    for t in full.values():  # every tensor its own draw: experts that differ, so a row run by the wrong one shows
        t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x_all = torch.randn(env.world_size, 1, args.tokens, cfg.n_embd, generator=gen)  # every rank's tokens
    w_all = torch.randn(x_all.shape, generator=gen)  # the loss: sum(y * w), so that each row has its own gradient
    groups = SimpleNamespace(tp=None, ep=dist.group.WORLD, etp=None, edp=None)  # ep = every rank
    serial, ours = layer(experts.MoELayer, cfg, moe, full), layer(experts.MoELayer, cfg, moe, full, groups)
    x, w = x_all[env.rank], w_all[env.rank]

    # same function: ours on every rank against the serial layer on all the tokens
    (serial(x_all.flatten(0, 1).view(1, -1, cfg.n_embd)) * w_all.view(1, -1, cfg.n_embd)).sum().backward()
    (ours(x) * w).sum().backward()
    ref = serial(x_all.flatten(0, 1).view(1, -1, cfg.n_embd)).detach().view_as(x_all)[env.rank]
    out = ours(x).detach()
    router = ours.router.weight.grad  # None: no gradient reached it
    router = router.clone() if router is not None else torch.full_like(ours.router.weight, math.nan)
    dist.all_reduce(router)  # each rank's tokens' share of the router's gradient
    named = dict(serial.named_parameters())
    grads = [math.inf if p.grad is None or named[n].grad is None else tensor_parallel.max_rel_diff(p.grad, named[n].grad)
             for n, p in ours.named_parameters() if "experts" in n]  # None: an expert no row reached
    diffs = {"output": tensor_parallel.max_rel_diff(out, ref),
             "grads": max(grads + [tensor_parallel.max_rel_diff(router, named["router.weight"].grad)])}
    if not harness.agree(harness.within(diffs, TOLERANCES)):
        return {"same": False, "checks": diffs}

    # the bytes of one step, every rank's, dropless and padded to a capacity
    sent = lambda p: (sum(p.send) - p.send[env.rank]) + (sum(p.recv) - p.recv[env.rank])  # noqa: E731
    padded = layer(experts.CapacityLayer, cfg, replace(moe, capacity_factor=1.0), full, groups)
    padded(x)
    rows = torch.tensor([float(sent(ours.plan)), float(sent(padded.plan))], dtype=torch.float64)
    dist.all_reduce(rows)
    elt = x.element_size()
    measured = (2 * rows * cfg.n_embd * elt).tolist()  # x2: the backward's reverse all-to-alls
    formula = planner.moe_alltoall_bytes(args.tokens, args.top_k, env.world_size, cfg.n_embd, elt) * env.world_size

    def ep_step():
        ours.zero_grad(set_to_none=True)
        (ours(x) * w).sum().backward()

    big, big_w = x_all.flatten(0, 1).view(1, -1, cfg.n_embd), w_all.view(1, -1, cfg.n_embd)

    def serial_step():
        if env.rank == 0:
            serial.zero_grad(set_to_none=True)
            (serial(big) * big_w).sum().backward()

    rounds = harness.alternate({"ep": ep_step, "serial": serial_step}, args.repeats, args.steps, args.warmup)
    return {"same": True, "checks": diffs, "rounds": rounds, "bytes": measured, "formula": formula,
            "counts": ours.plan.counts}


def main():
    parser = harness.parser(__doc__, repeats=5, steps=4, warmup=1, vocab_size=256, block_size=64, n_layer=1,
                            n_head=4, n_embd=256)
    parser.add_argument("--ep", type=int, default=4, help="expert-parallel ranks (CPU ranks started here)")
    parser.add_argument("--num-experts", type=int, default=8, help="E")
    parser.add_argument("--top-k", type=int, default=2, help="k")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens each rank routes (b T)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    args = parser.parse_args()
    cfg = harness.model_config(args)
    if args.num_experts % args.ep or not 1 <= args.top_k <= args.num_experts:
        raise ValueError(f"--num-experts {args.num_experts} must be divisible by --ep {args.ep}, and --top-k "
                         f"{args.top_k} between 1 and it")
    print(f"config: one MoE layer, C={cfg.n_embd}, E={args.num_experts}, top-{args.top_k}, {args.tokens} tokens on "
          f"each of ep={args.ep} ranks; float32, forward and backward; torch {torch.__version__}")
    t0 = time.perf_counter()
    results = harness.launch(worker, args.ep, cfg, args, timeout_s=args.timeout, deadline_s=args.deadline)
    worst = {k: max(r["checks"][k] for r in results) for k in TOLERANCES}
    if not harness.guard("same function, against the serial layer (worst rank):", {"ep": worst}, TOLERANCES,
                         all(r["same"] for r in results)):
        return False
    r0 = results[0]
    print(f"\nstep time: {harness.time_table(r0['rounds'], args.ep)}")
    print("  " + harness.pair_line(r0["rounds"], "ep", "serial"))
    dropless, padded = r0["bytes"]
    print(f"\nall-to-all bytes of one step, every rank: dropless {dropless:,.0f} (the router's own routing; rank 0 "
          f"sent {r0['counts']} pairs to the experts), with capacity factor 1.0 {padded:,.0f}; the planner's "
          f"formula at uniform routing {r0['formula']:,.0f} (dropless / formula {dropless / r0['formula']:.3f}, "
          f"padded / formula {padded / r0['formula']:.3f})")
    print(f"(took {time.perf_counter() - t0:.0f} s)")
    return True


if __name__ == "__main__":
    harness.run_main(main)
