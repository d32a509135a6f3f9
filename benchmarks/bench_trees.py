"""One step of 01's GPT, as the trainer builds it (optimize()), from two checkouts, timed side by side:
is a restructure free? Each checkout runs in a child process of its own (their plumbing/ packages
differ, so they cannot share one); a round asks each for the median of 9 forward + backward steps
of the same model and batch, the two in turn, who goes first alternating. Prints both medians and
the per-round ratio this/other: its median and quartiles. One thread a child, tp = 1.

Run it (from the repository root; CPU):
    git worktree add /tmp/before <commit>                       # the tree to compare against
    python benchmarks/bench_trees.py --other /tmp/before        # 100 rounds, the main job's GPT-2
    python benchmarks/bench_trees.py --other /tmp/before --rounds 30 --n-layer 8 --n-embd 128
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import importlib, json, statistics, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
tp = importlib.import_module("01_tensor_parallel")
layers, C, B = (int(a) for a in sys.argv[2:5])
cfg = tp.GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=4, n_embd=C)
model = tp.optimize(tp.GPT(cfg, seed=0))
gen = torch.Generator().manual_seed(0)
idx, targets = (torch.randint(0, 256, (B, 64), generator=gen) for _ in range(2))
targets[:, :5] = -100  # masked targets, as the trainer's batches have


def step():
    model(idx, targets)[1].backward()
    model.zero_grad(set_to_none=True)


for _ in range(5):
    step()
print("ready", flush=True)
for _ in sys.stdin:
    times = []
    for _ in range(9):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps(statistics.median(times)), flush=True)
'''


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--other", required=True, help="the checkout to compare against (a directory with 01_tensor_parallel.py)")
    p.add_argument("--this", default=ROOT, help="this checkout (default: the one this script is in)")
    p.add_argument("--rounds", type=int, default=100, help="rounds, each 9 steps of each tree (default 100, at least 4)")
    p.add_argument("--n-layer", type=int, default=4, help="GPT-2 blocks (default 4, the main job's)")
    p.add_argument("--n-embd", type=int, default=64, help="channels, a multiple of 4 heads (default 64)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences of 64 tokens a step (default 8)")
    return p


def check(args):
    """Every flag checked before a child starts: the message names the flag, the value and the rule."""
    for flag, path in (("--other", args.other), ("--this", args.this)):
        if not os.path.isfile(os.path.join(path, "01_tensor_parallel.py")):
            raise SystemExit(f"bench_trees: {flag} {path!r} is not a checkout: it has no 01_tensor_parallel.py")
    if args.rounds < 4:
        raise SystemExit(f"bench_trees: --rounds {args.rounds}: at least 4 (the quartiles need them)")
    for flag, value in (("--n-layer", args.n_layer), ("--batch-size", args.batch_size)):
        if value < 1:
            raise SystemExit(f"bench_trees: {flag} {value}: must be at least 1")
    if args.n_embd < 4 or args.n_embd % 4:
        raise SystemExit(f"bench_trees: --n-embd {args.n_embd}: must be a positive multiple of the 4 heads")


def main(argv=None):
    args = parser().parse_args(argv)
    check(args)
    shape = [str(args.n_layer), str(args.n_embd), str(args.batch_size)]
    kids = {name: subprocess.Popen([sys.executable, "-c", CHILD, path, *shape], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, cwd=path)
            for name, path in (("this", args.this), ("other", args.other))}
    try:
        for name, kid in kids.items():
            if kid.stdout.readline().strip() != "ready":
                raise SystemExit(f"bench_trees: the {name} tree's child did not build its model "
                                 f"(exit {kid.wait()}); its error is above")
        times, ratios = {"this": [], "other": []}, []
        for r in range(args.rounds):
            for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
                kids[name].stdin.write("step\n")
                kids[name].stdin.flush()
                times[name].append(json.loads(kids[name].stdout.readline()))
            ratios.append(times["this"][-1] / times["other"][-1])
    finally:
        for kid in kids.values():
            kid.stdin.close()
            kid.wait()
    low, _, high = statistics.quantiles(ratios, n=4)
    print(f"GPT-2 {args.n_layer} layers, C={args.n_embd}, B={args.batch_size}, T=64, tp=1, optimize(); "
          f"{args.rounds} rounds of 9 steps each")
    print(f"step medians: this {statistics.median(times['this']) * 1e3:.2f} ms, "
          f"other {statistics.median(times['other']) * 1e3:.2f} ms")
    print(f"this/other per round: median {statistics.median(ratios):.3f}, quartiles {low:.3f} to {high:.3f}")


if __name__ == "__main__":
    main()
