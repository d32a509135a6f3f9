"""Plot the loss curves of a --metrics file: a PNG with matplotlib, an ASCII chart without it.

    python3 05_3d_gpt.py --metrics metrics.jsonl
    python3 scripts/plot_metrics.py metrics.jsonl -o loss.png      # pip install matplotlib

Each line of the file is one step's JSON record (step, loss, lr, grad_norm, tokens_per_s, time_s,
and eval_loss on eval steps). A resumed run appends, so a step can appear twice: the last record
of each step wins. Without matplotlib the curves are drawn in the terminal and the script says how
to get the PNG; it exits 1 only if -o was asked for. A missing or malformed file is refused with
its line number, exit code 1.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing.charts import ascii_chart  # noqa: E402  (the repository root, put on the path above)


def read_metrics(path):
    """{step: record}, the last record of each step, from a JSON-lines file."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror or e}") from None
    records = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}, line {n}: not JSON: {line[:60]!r}") from None
        if not isinstance(record, dict) or "step" not in record or "loss" not in record:
            raise ValueError(f"{path}, line {n}: a record needs 'step' and 'loss'")
        records[int(record["step"])] = record
    if not records:
        raise ValueError(f"{path} holds no records")
    return dict(sorted(records.items()))


def series(records):
    train = [(s, r["loss"]) for s, r in records.items()]
    evals = [(s, r["eval_loss"]) for s, r in records.items() if "eval_loss" in r]
    return train, evals


def plot_png(records, out, title, log=False):
    """The curves as a PNG, or False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    train, evals = series(records)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([s for s, _ in train], [x for _, x in train], label="train loss")
    if evals:
        ax.plot([s for s, _ in evals], [x for _, x in evals], "o", label="eval loss")
    if log:
        ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.legend()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("metrics", help="the JSON-lines file 05_3d_gpt.py --metrics wrote")
    parser.add_argument("-o", "--output", help="the PNG to write (default: the metrics file with .png)")
    parser.add_argument("--log", action="store_true", help="a logarithmic loss axis")
    args = parser.parse_args()
    try:
        records = read_metrics(args.metrics)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = args.output or os.path.splitext(args.metrics)[0] + ".png"
    if plot_png(records, out, os.path.basename(args.metrics), args.log):
        print(f"wrote {out}")
        return 0
    train, evals = series(records)
    print(ascii_chart({"train loss": ("*", train), **({"eval loss": ("o", evals)} if evals else {})}))
    print("matplotlib is not installed, so the chart is above instead of in a PNG: pip install matplotlib",
          file=sys.stderr)
    return 1 if args.output else 0


if __name__ == "__main__":
    sys.exit(main())
