"""Charts in the terminal, with no plotting package (and no torch: scripts/plot_metrics.py imports
this without it).

    ascii_chart({"train loss": ("*", [(step, loss), ...])})   curves on one grid: 05's loss chart
    bars([(label, value), ...])                               horizontal bars on one scale
    pipeline_timeline(timeline)                               02's schedules: one row per rank, as the
                                                              paper's Figures 3 and 4 draw them
    bucket_timeline(start, end, events, n_buckets)            04's BucketedDDP: backward, and when
                                                              each bucket's reduction was launched
                                                              (and, if known, seen done), on one time axis

scripts/plot_metrics.py draws the loss curves as a PNG when matplotlib is installed, and
scripts/figures.py the bubble, memory and overlap figures.
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
    # Halved before subtracting: the span of -1e308 to 1e308 is finite only that way.
    col = lambda x: round((x / 2 - x0 / 2) / ((x1 / 2 - x0 / 2) or 1) * (width - 1))  # noqa: E731
    row = lambda y: height - 1 - round((y / 2 - y0 / 2) / ((y1 / 2 - y0 / 2) or 1) * (height - 1))  # noqa: E731
    grid = [[" "] * width for _ in range(height)]
    for label, (marker, _) in series.items():
        columns = {}
        for x, y in points[label]:
            columns.setdefault(col(x), []).append(y)
        for c, ys in columns.items():
            grid[row(sum(y / len(ys) for y in ys))][c] = marker  # the mean, with no sum that overflows
    labels = {0: f"{y1:.3g}", height // 2: f"{y0 / 2 + y1 / 2:.3g}", height - 1: f"{y0:.3g}"}
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


def bars(rows, width=48, value=lambda v: f"{v:,.0f}"):
    """Horizontal bars, one per (label, number), on one scale: the largest fills `width` columns.
    A row (label, None) is a heading with no bar. value(number) is the text after each bar."""
    numbers = [v for _, v in rows if v is not None]
    top = max(numbers, default=0) or 1
    pad = max((len(label) for label, v in rows if v is not None), default=0)
    lines = []
    for label, v in rows:
        if v is None:
            lines.append(label)
            continue
        n = round(v / top * width) if math.isfinite(v) and v > 0 else 0
        lines.append(f"{label:<{pad}} |{'#' * n}{' ' * (width - n)}| {value(v)}")
    return "\n".join(lines)


def bucket_timeline(start, end, events, n_buckets, width=64):
    """04's BucketedDDP.events on one time axis, in milliseconds from `start` (the start of the
    last backward; `end` its end). events: ("ready", parameter index, t) as each gradient arrives,
    ("launch", bucket, t) as each bucket's reduction starts, and, when they were recorded,
    ("done", bucket, t) when it was seen finished. One row for backward ('=' while it runs, a '|'
    where a gradient arrived), then one per bucket: 'L' at its launch, '-' while it runs, 'D' when
    it was seen done. The last line counts the buckets launched before backward ended."""
    times = [t for _, _, t in events] + [start, end]
    t0, t1 = min(times), max(times)
    scale = (width - 1) / ((t1 - t0) or 1)
    col = lambda t: min(width - 1, max(0, round((t - t0) * scale)))  # noqa: E731
    ms = lambda t: f"{1e3 * (t - start):.1f}"  # noqa: E731
    launch = {i: t for kind, i, t in events if kind == "launch"}
    done = {i: t for kind, i, t in events if kind == "done"}
    row = [" "] * width
    for c in range(col(start), col(end) + 1):
        row[c] = "="
    for kind, _, t in events:
        if kind == "ready":
            row[col(t)] = "|"
    lines = [" " * 19 + "|" + ms(t0).ljust(width // 2) + ms(t1).rjust(width - width // 2) + "|  ms after backward began",
             f"{'backward':<19}|{''.join(row)}| {ms(start)} to {ms(end)}"]
    for i in range(n_buckets):
        row = [" "] * width
        if i in launch:
            first = col(launch[i])
            last = min(width - 1, max(col(done[i]), first + 1)) if i in done else first  # D beside L, not on it
            for c in range(first, last + 1):
                row[c] = "-"
            row[first] = "L"
            if i in done:
                row[last] = "D"
        when = (f"launched {ms(launch[i])}" if i in launch else "never launched") + \
            (f", done by {ms(done[i])}" if i in done else "")
        lines.append(f"{f'bucket {i}':<19}|{''.join(row)}| {when}")
    early = sum(t < end for t in launch.values())
    lines.append(f"{early} of {n_buckets} launched before backward finished")
    return "\n".join(lines)


def pipeline_timeline(timeline, width=100, end=None):
    """A pipeline's timeline [(start, end, action)] per rank, one row each as in Narayanan et al.'s
    Figures 3 and 4: forwards are written F<mb> padded with spaces, backwards B<mb> padded with '='
    (06's I<mb> too, and W<mb> with '-'), idle time '.'; odd model chunks (03) in lower case, f<mb>
    and b<mb>. `end` fixes the time at the right edge, so that two timelines can share one scale."""
    end = end or max(e for tl in timeline for _, e, _ in tl) or 1
    scale = width / float(end)
    rows = []
    for r, tl in enumerate(timeline):
        row = ["."] * width
        for s, e, a in tl:
            lo, hi = round(s * scale), max(round(e * scale), round(s * scale) + 1)
            name = (a.kind if a.chunk % 2 == 0 else a.kind.lower()) + str(a.mb)
            row[lo:hi] = name.ljust(hi - lo, {"F": " ", "W": "-"}.get(a.kind, "="))[: hi - lo]
        rows.append(f"rank {r} |{''.join(row)[:width]}|")
    return "\n".join(rows)
