"""Plot the loss curves of a --metrics file: a PNG with matplotlib, an ASCII chart without it.

    python3 05_3d_gpt.py --metrics metrics.jsonl                 # one JSON line per step
    python3 scripts/plot_metrics.py metrics.jsonl                # metrics.png
    python3 scripts/plot_metrics.py metrics.jsonl -o loss.png --log

Each line of the file is one step's JSON record: step, loss, lr, grad_norm, tokens_per_s, time_s,
and eval_loss on eval steps; only step and loss are needed. A resumed run appends, rewriting the
steps from the one it resumed at, so the last record of each step wins. The figure: the train loss
as a line, the eval loss as markers, step across, loss up (--log: a log scale), titled with the
file's name; its format follows -o's suffix (.png, or .pdf, .svg).

matplotlib is optional (pip install matplotlib). Without it the same curves are drawn in the
terminal (the chart 05 prints at the end of a run), followed by one line saying how to get the PNG.

Exit codes:
    0  the PNG was written; or, without matplotlib and without -o, the ASCII chart was printed
       (a look at the curve was asked for, and given)
    1  without matplotlib but with -o: the chart is printed, but the file that was asked for does
       not exist, and a script waiting for it must know; or a refusal, one line and no traceback:
       a metrics file that is missing, unreadable, empty or not a regular file (a FIFO would wait
       for a writer forever), a line that is not JSON or a record without a numeric step and loss
       (its line number named), an -o in a missing directory, equal to the metrics file, not a
       regular file, or an existing file without --overwrite
    2  a usage error
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing.charts import ascii_chart  # noqa: E402  (the repository root, put on the path above)
from plumbing.paths import check_outputs, fresh, regular_file  # noqa: E402


class Refused(Exception):
    """A bad metrics file or output path: main prints the message and exits 1."""


# ----------------------------------------------------------------------------------------------
# Reading: the last record of each step


def is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)  # NaN counts: a diverged run


def read_metrics(path):
    """{step: record}, sorted by step, keeping the last record of each step."""
    try:
        regular_file(path, "the metrics file")
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:  # the latter first: it is a ValueError too
        raise Refused(f"cannot read the metrics file {path!r}: {getattr(e, 'strerror', None) or e}") from None
    except ValueError as e:
        raise Refused(str(e)) from None
    records = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise Refused(f"{path}, line {n}: not JSON: {line[:60]!r}") from None
        if not isinstance(record, dict) or "step" not in record or "loss" not in record:
            raise Refused(f"{path}, line {n}: a record needs 'step' and 'loss' (05_3d_gpt.py --metrics "
                          "writes both)")
        step, loss, ev = record["step"], record["loss"], record.get("eval_loss", 0.0)
        if not (is_number(step) and math.isfinite(step) and step == int(step)):
            raise Refused(f"{path}, line {n}: step {step!r} is not a whole number")
        if not (is_number(loss) and is_number(ev)):
            raise Refused(f"{path}, line {n}: loss {loss!r} and eval_loss {ev!r} must be numbers")
        records[int(step)] = record  # a later record of the same step replaces it: a resumed run
    if not records:
        raise Refused(f"the metrics file {path!r} is empty: no records to plot")
    return dict(sorted(records.items()))


def series(records):
    """[(step, train loss)], [(step, eval loss)] of the kept records."""
    train = [(s, r["loss"]) for s, r in records.items()]
    evals = [(s, r["eval_loss"]) for s, r in records.items() if "eval_loss" in r]
    return train, evals


# ----------------------------------------------------------------------------------------------
# Drawing: a PNG with matplotlib, else the terminal


def plot_file(records, out, title, log=False):
    """Save the curves to `out`; False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # a file, not a window: works over ssh and on a cluster
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train, evals = series(records)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([s for s, _ in train], [x for _, x in train], label="train loss")
    if evals:  # markers, not a line: eval steps are sparse and may be uneven after a resume
        ax.plot([s for s, _ in evals], [x for _, x in evals], "o", label="eval loss")
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    try:
        fig.savefig(fresh(out), dpi=120, bbox_inches="tight")
    except OSError as e:
        raise Refused(f"cannot write {out!r}: {e.strerror or e}") from None
    except (ValueError, OverflowError) as e:  # a suffix it has no format for; a span it cannot scale
        raise Refused(f"matplotlib cannot draw these curves into {out!r} ({e}); without -o the chart is drawn "
                      f"in the terminal") from None
    finally:
        plt.close(fig)
    return True


def check_output(out, metrics, overwrite=False):
    if os.path.exists(out) and os.path.samefile(out, metrics):
        raise Refused(f"the output {out!r} would overwrite the metrics file; give another -o")
    try:  # an existing file is replaced only with --overwrite; never a FIFO or a checkpoint's file
        check_outputs([("-o", out)], overwrite=overwrite)
    except ValueError as e:
        raise Refused(str(e)) from None
    if not os.path.splitext(out)[1]:  # matplotlib would append .png, and "wrote OUT" would be wrong
        raise Refused(f"the output {out!r} has no suffix; give -o a name such as loss.png")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise Refused(f"the output's directory {os.path.dirname(out)!r} does not exist (for {out!r})")


# ----------------------------------------------------------------------------------------------
# The command line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", help="the JSON-lines file that 05_3d_gpt.py --metrics wrote")
    parser.add_argument("-o", "--output", metavar="OUT.png",
                        help="the figure to write; its suffix picks the format "
                             "(default: the metrics file with its suffix replaced by .png)")
    parser.add_argument("--log", action="store_true", help="a logarithmic loss axis (default: linear)")
    parser.add_argument("--overwrite", action="store_true", help="let -o replace an existing file")
    args = parser.parse_args(argv)
    out = args.output or os.path.splitext(args.metrics)[0] + ".png"
    try:
        records = read_metrics(args.metrics)
        check_output(out, args.metrics, args.overwrite)
        if plot_file(records, out, f"loss: {args.metrics}", args.log):
            print(f"wrote {out} ({len(records)} steps)")
            return 0
    except Refused as e:
        print(f"plot_metrics.py: error: {e}", file=sys.stderr)
        return 1
    train, evals = series(records)
    print(ascii_chart({"train loss": ("*", train), **({"eval loss": ("o", evals)} if evals else {})}))
    print(f"matplotlib is not installed, so the chart is above instead of in {out}: pip install matplotlib",
          file=sys.stderr)
    return 1 if args.output else 0


if __name__ == "__main__":
    sys.exit(main())
