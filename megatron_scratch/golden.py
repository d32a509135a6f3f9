"""Golden values: a tiny GPT-2's float64 loss and per-parameter gradient figures, written as plain JSON
(json.load reads it; no pickle, nothing executed on load), for a system that cannot import us and for
our own tests (tests/test_reference.py recomputes tests/golden/tiny_gpt2.json serially and at tp=2).

    python3 -m megatron_scratch.golden --config tiny --out tests/golden/tiny_gpt2.json [--overwrite]

regenerates it, deliberately: an existing file is refused without --overwrite, so a change in what
the model computes shows as a failing test first and a new file only by choice.

What the file holds: the config, the seed of the weights (megatron_scratch.reference.init_weights),
the tokens and targets themselves (two positions masked with ignore_index), the loss, and for every
parameter its gradient's norm and its dot product with a fixed probe, cos(0.7 j) over its elements j
in row-major order (a norm alone would not see a gradient permuted or of the wrong sign).

The tolerance, RTOL = 1e-12, and why: every figure is float64. Another machine (its BLAS, its SIMD
width, its thread count) or another layout (tp=2 splits the matmuls' sums over ranks) adds the same
terms in another order, ~1e-15 relative for a model this small; 1e-12 leaves three orders of
magnitude for that and is still six below what any real mistake does (a missing all-reduce, a wrong
shard or mask moves a loss or a gradient norm by 1e-4 or more). Each figure is compared on its own
scale: the loss and a norm relative to themselves, a probe's dot relative to its largest possible
size, |g| |probe| (Cauchy-Schwarz), so a gradient that is 0 in math (the key bias's: softmax is
shift-invariant; its figures are 1e-17 noise) passes with both sides' noise, as testing.assert_close's
floor does.
"""
import argparse
import json
import math
import os
import sys

import torch

RTOL = 1e-12
CONFIGS = {"tiny": dict(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32)}
SEED, BATCH, SEQ, DATA_SEED, IGNORE_INDEX = 0, 2, 8, 1, -100


def probe(numel):
    """The fixed probe a gradient is dotted with: cos(0.7 j), j = 0 .. numel-1, float64."""
    return torch.cos(0.7 * torch.arange(numel, dtype=torch.float64))


def batch(cfg):
    """(tokens, targets), (BATCH, SEQ) each, from DATA_SEED; targets[0, :2] = IGNORE_INDEX (not counted)."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    tokens, targets = torch.randint(cfg.vocab_size, (2, BATCH, SEQ), generator=gen)
    targets[0, :2] = IGNORE_INDEX
    return tokens, targets


def figures(result):
    """{"loss": float, "grads": {name: {"norm": float, "probe": float}}} of a LossAndGrads."""
    grads = {}
    for name, g in result.grads.items():
        g = g.double().reshape(-1)
        grads[name] = {"norm": g.norm().item(), "probe": torch.dot(g, probe(g.numel())).item()}
    return {"loss": result.loss.item(), "grads": grads}


def compute(config="tiny", tp=1):
    """The golden file's contents, computed now: serially (tp=1) or by 01's tensor parallelism (tp > 1)."""
    from megatron_scratch import reference
    if config not in CONFIGS:
        raise ValueError(f"--config {config!r}: the golden configs are {', '.join(CONFIGS)}")
    cfg = reference.gpt_config(**CONFIGS[config], tp=tp)
    full = reference.init_weights(cfg, seed=SEED)
    tokens, targets = batch(cfg)
    if tp == 1:
        result = reference.serial_loss_and_grads(cfg, full, tokens, targets, ignore_index=IGNORE_INDEX)
    else:
        result = reference.tp_loss_and_grads(cfg, full, tokens, targets, tp=tp, ignore_index=IGNORE_INDEX)
    return {"about": "megatron_scratch's golden values: float64 loss and gradient figures of a tiny GPT-2 "
                     "(megatron_scratch/golden.py says what each is and how it is compared)",
            "command": f"python3 -m megatron_scratch.golden --config {config} --out FILE",
            "torch": torch.__version__, "dtype": "float64", "rtol": RTOL,
            "config": CONFIGS[config], "seed": SEED,
            "weights": "megatron_scratch.reference.init_weights(cfg, seed=seed): float64, random_all=True",
            "ignore_index": IGNORE_INDEX, "tokens": tokens.tolist(), "targets": targets.tolist(),
            **figures(result)}


def differences(got, want, rtol=RTOL):
    """Sentences, the worst first, for every figure of got (a golden dict) beyond rtol of want's on its
    own scale (the module docstring); [] when all agree. Keys missing on either side are differences."""
    out = []

    def check(what, g, w, scale):
        bad = abs(g - w) - rtol * scale
        if not (bad <= 0):  # NaN too
            out.append((bad if bad == bad else math.inf,
                        f"{what}: got {g!r}, golden {w!r} (|diff| {abs(g - w):.3g} > rtol {rtol:g} x {scale:.3g})"))

    check("loss", got["loss"], want["loss"], abs(want["loss"]))
    for name in sorted(set(got["grads"]) | set(want["grads"])):
        if name not in got["grads"] or name not in want["grads"]:
            out.append((math.inf, f"{name}: {'missing from the computed' if name in want['grads'] else 'not in the golden'} "
                                  f"gradients"))
            continue
        g, w = got["grads"][name], want["grads"][name]
        numel = math.prod(_shape(want, name))
        check(f"{name} gradient norm", g["norm"], w["norm"], w["norm"])
        check(f"{name} gradient probe", g["probe"], w["probe"], w["norm"] * probe(numel).norm().item())
    return [s for _, s in sorted(out, key=lambda x: -x[0])]


def _shape(golden, name):
    from megatron_scratch import tensor_parallel
    cfg = tensor_parallel.GPTConfig(**golden["config"])
    return dict(tensor_parallel.GPT(cfg, device="meta").named_parameters())[name].shape


def load(path):
    """The golden dict of a file: json.load, nothing else (no pickle, no code)."""
    with open(path) as f:
        return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m megatron_scratch.golden", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--out", required=True, help="the JSON file to write (tests/golden/tiny_gpt2.json)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing file (a deliberate regeneration)")
    args = ap.parse_args(argv)
    if os.path.exists(args.out) and not args.overwrite:
        ap.error(f"--out {args.out} exists: regenerating golden values is deliberate, add --overwrite")
    data = compute(args.config)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: loss {data['loss']!r}, {len(data['grads'])} gradients")


if __name__ == "__main__":
    sys.exit(main())
