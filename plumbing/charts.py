"""A chart in the terminal, with no plotting package: the loss curve at the end of training.

    print(ascii_chart({"train loss": ("*", [(step, loss), ...]), "eval loss": ("o", [...])}))

scripts/plot_metrics.py draws the same curves as a PNG when matplotlib is installed.
"""
import math


def ascii_chart(series, width=64, height=12, x_label="step"):
    """Plot each series {label: (marker, [(x, y), ...])} on one grid, y from the lowest value at the
    bottom to the highest at the top; several points in one column are averaged, so a long run
    draws a clean line. Non-finite values are left out (and said so in the legend)."""
    points = {k: [(x, y) for x, y in pts if math.isfinite(y)] for k, (_, pts) in series.items()}
    every = [p for pts in points.values() for p in pts]
    if not every:
        return "(no finite values to plot)"
    x0, x1 = min(x for x, _ in every), max(x for x, _ in every)
    y0, y1 = min(y for _, y in every), max(y for _, y in every)
    col = lambda x: round((x - x0) / ((x1 - x0) or 1) * (width - 1))  # noqa: E731
    row = lambda y: height - 1 - round((y - y0) / ((y1 - y0) or 1) * (height - 1))  # noqa: E731
    grid = [[" "] * width for _ in range(height)]
    for label, (marker, _) in series.items():
        columns = {}
        for x, y in points[label]:
            columns.setdefault(col(x), []).append(y)
        for c, ys in columns.items():
            grid[row(sum(ys) / len(ys))][c] = marker
    labels = {0: f"{y1:.3g}", height // 2: f"{(y0 + y1) / 2:.3g}", height - 1: f"{y0:.3g}"}
    pad = max(len(t) for t in labels.values())
    lines = [f"{labels.get(r, ''):>{pad}} |{''.join(grid[r])}" for r in range(height)]
    lines.append(" " * pad + " +" + "-" * width)
    left, right = f"{x0:g}", f"{x1:g}"
    middle = x_label.center(width - len(left) - len(right))
    lines.append(" " * (pad + 2) + left + middle + right)
    dropped = {k: len(pts) - len(points[k]) for k, (_, pts) in series.items()}
    lines.append(" " * (pad + 2) + "   ".join(
        f"{marker} {label}" + (f" ({dropped[label]} non-finite left out)" if dropped[label] else "")
        for label, (marker, _) in series.items()))
    return "\n".join(lines)
