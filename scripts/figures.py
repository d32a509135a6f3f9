"""The course's figures, computed from the simulator and from real CPU runs: text in the terminal,
and an SVG of each, written by hand from Python (no plotting package), for slides and docs/DIAGRAMS.md.

    python3 scripts/figures.py                       # every figure: text here, SVGs into docs/figures/
    python3 scripts/figures.py bubble memory         # some of them
    python3 scripts/figures.py --svg-dir /tmp/figs   # the SVGs elsewhere
    python3 scripts/figures.py --no-svg              # text only
    python3 scripts/figures.py schedules --pp 8 --m 16 --svg-dir /tmp/exam   # a variant, at other sizes

Every figure takes its sizes as flags (--help lists which figure takes which, and their defaults, the
committed SVGs' sizes). A variant is written as NAME-pp8-m16.svg (the sizes that differ), never into
docs/figures/; sizes a figure cannot be drawn at are refused first, naming the flag, the value and
the rule (03's m % pp = 0, the figure's width, ...).

The first command regenerates the committed docs/figures/*.svg, and tests/test_figures.py checks that
they are byte for byte what this script writes today (all but overlap.svg, a timed run that differs
every time: commit it again only when you mean to). The same calls give the same bytes: no
timestamps, coordinates rounded to 2 decimals.

The figures (docs/DIAGRAMS.md shows each and says what it means), each NAME drawn into NAME.svg:
    f-and-g            f and g in the MLP and the attention block (01; Shoeybi et al. 2019, Figure 3)
    sequence-parallel  LayerNorm and dropout on T/tp of the sequence, g into the tensor-parallel
                       region and g-bar out of it (01; Korthikanti et al. 2022, Section 4.2.2, Figure 5)
    grid               05's rank grid for tp = 2 x dp = 2 x pp = 2: its tp, dp and pp groups
    schedules          1F1B and interleaved 1F1B (v = 2) on one time scale, pp = 4, m = 8: 02's
                       simulate() on 02's and 03's lists (Narayanan et al. 2021, Figure 4)
    bubble             the pipeline bubble against m for v = 1, 2, 4 (pp = 4): 02's simulate() on 03's
                       lists, beside the formula (pp - 1)/(v m); exact fractions
    memory             peak stored activation bytes per stage for GPipe, 1F1B and interleaved 1F1B,
                       measured by 02's executor (its ActivationMeter) on pp = 4 CPU ranks
    overlap            04's BucketedDDP on dp = 2 CPU ranks: backward, and each bucket's reduction,
                       launched during backward and seen done, on one time axis (a real run: the
                       times vary)
    zero               ZeRO-1's partition of the flat gradient buffer of a real BucketedDDP (dp = 4):
                       which rank keeps the optimizer state of which elements of each bucket
    ring-step          one step of 08's ring attention (Megatron's split, cp = 4): what each rank holds,
                       meets, computes and receives (08's messages())
    balance-contiguous, balance-megatron, balance-lightseq
                       each of 08's schedules at cp = 4: which rank computes each causal block at
                       which step, and each rank's work beside the mean (08's simulate())
    fold               09's parallel folding: attention's tp 2 x dp 2 x pp 2 and the experts' ep 4 on the
                       same ranks, each rank's place in both grids and the experts it holds
    fold-cp            the same with 08's context parallelism: attention's tp 2 x cp 2 x dp 2 and the
                       experts' ep 4 x edp 2, each ep group one tp x cp block
    dispatch           one token dispatch of 09 on ep = 2 CPU ranks (E = 4, top-2): each rank's pairs
                       sorted by expert, the counts, and every row's way to the rank of its expert
The loss curve of a run is scripts/plot_metrics.py's (from 05's --metrics).
"""
import argparse
import importlib
import math
import os
import sys
import textwrap
import time
from fractions import Fraction
from xml.sax.saxutils import escape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from plumbing.charts import ascii_chart, bars, bucket_timeline, pipeline_timeline  # noqa: E402
from plumbing.launch import launch  # noqa: E402

tensor_parallel = importlib.import_module("01_tensor_parallel")
pipeline = importlib.import_module("02_pipeline_1f1b")
interleaved = importlib.import_module("03_interleaved")
data_parallel = importlib.import_module("04_data_parallel")
gpt3d = importlib.import_module("05_3d_gpt")
context_parallel = importlib.import_module("08_context_parallel")

SVG_DIR = os.path.join(ROOT, "docs", "figures")


# ----------------------------------------------------------------------------------------------
# SVG, written by hand: a few elements, the same bytes for the same calls


WIDTH = 900  # px: every figure; a slide scales it
FONT = "Helvetica, Arial, sans-serif"
INK, GREY, RULE, PALE = "#222222", "#666666", "#bbbbbb", "#f2f2f2"
# Okabe and Ito's palette, told apart with every common colour blindness.
BLUE, SKY, ORANGE, VERMILLION, GREEN, PURPLE = "#0072B2", "#56B4E9", "#E69F00", "#D55E00", "#009E73", "#CC79A7"


def num(x):
    """A number as SVG text: at most 2 decimals, no trailing zeros, never '-0', so that the bytes
    do not depend on float noise below a hundredth of a pixel."""
    text = f"{float(x):.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def text_width(text, size):
    """About how wide `text` is at font size `size` (px), for laying out labels: 0.6 of the size a
    letter, as in DejaVu Sans, a common fallback font (Helvetica and Arial are narrower)."""
    return 0.6 * size * len(text)


class Svg:
    """One picture: a white page of `width` px with a title (also its <title>, which screen readers
    and slide tools show) and an optional subtitle; height may be set once the layout is known."""

    def __init__(self, title, subtitle="", width=WIDTH, height=600):
        self.title, self.width, self.height = title, width, height
        self.body, self.arrow_colours = [], []
        self.text(width / 2, 30, title, size=19, anchor="middle", font_weight="bold")
        if subtitle:
            self.text(width / 2, 52, subtitle, size=13, anchor="middle", fill=GREY)

    def element(self, tag, content=None, **attrs):
        """<tag a="..."/>: a trailing _ in a name is dropped (class_), other _ become - (font_size)."""
        parts = [tag]
        for key, value in attrs.items():
            if value is not None:
                text = num(value) if isinstance(value, (int, float, Fraction)) else escape(str(value), {'"': "&quot;"})
                parts.append(f'{key.rstrip("_").replace("_", "-")}="{text}"')
        head = " ".join(parts)
        self.body.append(f"<{head}/>" if content is None else f"<{head}>{escape(content)}</{tag}>")

    def rect(self, x, y, w, h, fill="none", stroke=None, **attrs):
        self.element("rect", x=x, y=y, width=w, height=h, fill=fill, stroke=stroke, **attrs)

    def line(self, x1, y1, x2, y2, stroke=INK, **attrs):
        self.element("line", x1=x1, y1=y1, x2=x2, y2=y2, stroke=stroke, **attrs)

    def polyline(self, points, stroke=INK, **attrs):
        self.element("polyline", points=" ".join(f"{num(x)},{num(y)}" for x, y in points), fill="none",
                     stroke=stroke, **attrs)

    def circle(self, cx, cy, r, fill=INK, **attrs):
        self.element("circle", cx=cx, cy=cy, r=r, fill=fill, **attrs)

    def text(self, x, y, text, size=13, anchor="start", fill=INK, **attrs):
        """Text whose baseline is at y."""
        self.element("text", text, x=x, y=y, font_size=size, text_anchor=anchor if anchor != "start" else None,
                     fill=fill, **attrs)

    def label(self, x, y, text, size=13, **attrs):
        """Text centred vertically on y (a baseline a third of the size below it)."""
        self.text(x, y + 0.35 * size, text, size=size, **attrs)

    def arrow(self, x1, y1, x2, y2, colour=INK, width=1.5, both=False, **attrs):
        """A line from (x1, y1) with an arrowhead at (x2, y2), and at (x1, y1) too if `both`."""
        if colour not in self.arrow_colours:
            self.arrow_colours.append(colour)
        head = f"url(#arrow-{colour.lstrip('#')})"
        self.line(x1, y1, x2, y2, stroke=colour, stroke_width=width, marker_start=head if both else None,
                  marker_end=head, **attrs)

    def box(self, x, y, w, h, lines, fill="white", stroke=INK, colour=INK, size=13, **attrs):
        """A rounded box with lines of text centred in it; the first line in `size`, the rest smaller."""
        self.rect(x, y, w, h, fill=fill, stroke=stroke, rx=5, stroke_width=1.2, **attrs)
        sizes = [size] + [size - 2] * (len(lines) - 1)
        top = y + h / 2 - (sum(sizes) * 1.25 - 0.25 * sizes[-1]) / 2
        for text, s in zip(lines, sizes):
            self.text(x + w / 2, top + s, text, size=s, anchor="middle", fill=colour)
            top += s * 1.25

    def swatch(self, x, y, fill, text, size=13, stroke=None):
        """A legend entry: a small square of colour, then its text (y is the entry's middle)."""
        self.rect(x, y - 7, 14, 14, fill=fill, stroke=stroke, rx=2)
        self.label(x + 20, y, text, size=size)

    def render(self):
        markers = "".join(
            f'<marker id="arrow-{c.lstrip("#")}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
            f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{c}"/></marker>'
            for c in self.arrow_colours)
        w, h = num(self.width), num(self.height)
        head = [
            '<?xml version="1.0" encoding="UTF-8"?>',
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
            f'font-family="{FONT}">',
            f"<title>{escape(self.title)}</title>",
        ] + ([f"<defs>{markers}</defs>"] if markers else []) + [f'<rect width="{w}" height="{h}" fill="white"/>']
        return "\n".join(head + self.body + ["</svg>"]) + "\n"


def nice_step(span, count=5):
    """A tick spacing of 1, 2, 2.5 or 5 times a power of ten that cuts `span` into about `count`."""
    raw = span / count
    power = 10 ** math.floor(math.log10(raw))
    return next(k * power for k in (1, 2, 2.5, 5, 10) if k * power >= raw * 0.999)


class Axes:
    """A plot area `box` = (left, top, right, bottom) in px, showing x in xs = (lo, hi) and y in
    ys = (lo, hi), y upwards."""

    def __init__(self, svg, box, xs, ys):
        self.svg, self.box, self.xs, self.ys = svg, box, xs, ys

    def x(self, v):
        left, _, right, _ = self.box
        return left + (v - self.xs[0]) / (self.xs[1] - self.xs[0]) * (right - left)

    def y(self, v):
        _, top, _, bottom = self.box
        return bottom - (v - self.ys[0]) / (self.ys[1] - self.ys[0]) * (bottom - top)

    def draw(self, xticks, yticks, xlabel, ylabel, xfmt=lambda v: f"{v:g}", yfmt=lambda v: f"{v:g}"):
        """Grid lines at the y ticks, the two axes, tick labels and axis labels."""
        left, top, right, bottom = self.box
        s = self.svg
        for v in yticks:
            s.line(left, self.y(v), right, self.y(v), stroke="#e3e3e3")
            s.label(left - 8, self.y(v), yfmt(v), size=12, anchor="end", fill=GREY)
        for v in xticks:
            s.line(self.x(v), bottom, self.x(v), bottom + 5, stroke=INK)
            s.text(self.x(v), bottom + 20, xfmt(v), size=12, anchor="middle", fill=GREY)
        s.line(left, bottom, right, bottom, stroke=INK)
        s.line(left, top, left, bottom, stroke=INK)
        s.text((left + right) / 2, bottom + 42, xlabel, size=13, anchor="middle")
        s.text(left - 58, (top + bottom) / 2, ylabel, size=13, anchor="middle",
               transform=f"rotate(-90 {num(left - 58)} {num((top + bottom) / 2)})")


def ticks(lo, hi, step):
    """Every multiple of step from lo to hi (both included when they are multiples)."""
    first = math.ceil(lo / step - 1e-9)
    return [k * step for k in range(first, math.floor(hi / step + 1e-9) + 1)]


# ----------------------------------------------------------------------------------------------
# f and g in a block, and sequence parallelism's transitions: drawings of 01's operators


FG_PANELS = [  # (panel, [(box text, what it is)] inside the tensor-parallel region, per rank r)
    ("MLP", [("c_fc: X·A{r}", "column-parallel, C → 4C/tp"), ("GeLU", "4C/tp units"),
             ("c_proj: Y{r}·B{r}", "row-parallel, 4C/tp → C")]),
    ("self-attention", [("c_attn: X·A{r}", "column-parallel, C → 3C/tp"), ("attention", "nh/tp heads"),
                        ("c_proj: Y{r}·B{r}", "row-parallel, C/tp → C")]),
]
F_AND_G = [  # (name, 01's function, forward, backward, why)
    ("f", "copy_to_tp", "identity", "all-reduce", "every rank read the same X: its gradient sums the ranks' parts"),
    ("g", "reduce_from_tp", "all-reduce", "identity",
     "Z is the sum of the ranks' partial outputs; bias added once, after"),
]
SUB = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")  # A0 -> A₀


def f_and_g_text(tp=2):
    lines = [f"f and g in one transformer block, tp = {tp} (Shoeybi et al. 2019, Figure 3; 01's copy_to_tp and "
             f"reduce_from_tp); r is the rank:"]
    for name, boxes in FG_PANELS:
        inside = " -> ".join(f"{text.format(r='_r')} ({what})" for text, what in boxes)
        lines.append(f"  {name + ':':<15} X -> f -> {inside} -> g -> Z + bias, dropout")
    lines += [f"  {name}  {fn:<15} forward: {fwd:<11} backward: {bwd:<11} ({why})"
              for name, fn, fwd, bwd, why in F_AND_G]
    lines.append("per block: 2 all-reduces in forward (the g's) and 2 in backward (the f's); none inside a region")
    return "\n".join(lines)


def f_and_g_svg(_=None, tp=2):
    s = Svg(f"f and g in a transformer block, tensor parallel over tp = {tp} ranks",
            "Shoeybi et al. 2019, Figure 3 · 01_tensor_parallel.py: f = copy_to_tp, g = reduce_from_tp")
    f_colour, g_colour = GREEN, ORANGE
    xs = [(184, 170), (372, 76), (466, 170)]  # the boxes inside the region: (left, width)
    lane_h, top = 62, 78
    for k, (name, boxes) in enumerate(FG_PANELS):
        y0 = top + k * (tp * (lane_h + 8) + 50)
        s.text(16, y0 + 14, f"({'ab'[k]}) {name}", size=15, font_weight="bold")
        lanes = [y0 + 26 + r * (lane_h + 8) for r in range(tp)]
        mid = (lanes[0] + lanes[-1] + lane_h) / 2
        for r, ly in enumerate(lanes):
            s.rect(170, ly, 480, lane_h, fill=PALE, rx=6)
            s.text(178, ly + 13, f"rank {r}", size=11, fill=GREY)
            cy = ly + 36
            for i, ((x, w), (text, what)) in enumerate(zip(xs, boxes)):
                s.box(x, cy - 17, w, 34, [text.format(r=str(r).translate(SUB)), what], size=13)
                if i:
                    s.arrow(xs[i - 1][0] + xs[i - 1][1], cy, x - 2, cy)
            s.arrow(156, mid, xs[0][0] - 2, cy)  # f hands every rank the same X
            s.arrow(xs[-1][0] + xs[-1][1], cy, 666, mid)  # g sums the ranks' outputs
        s.text(410, lanes[-1] + lane_h + 14, "tensor-parallel region: no communication inside",
               size=11, anchor="middle", fill=GREY)
        s.box(16, mid - 22, 80, 44, ["X", "(B, T, C)"], size=15)
        s.arrow(96, mid, 118, mid)
        s.box(120, mid - 18, 36, 36, ["f"], fill=f_colour, stroke=f_colour, colour="white", size=17)
        s.box(668, mid - 18, 36, 36, ["g"], fill=g_colour, stroke=g_colour, colour=INK, size=17)
        s.arrow(704, mid, 726, mid)
        s.box(728, mid - 22, 156, 44, ["Z + bias, dropout", "then + residual, (B, T, C)"], size=13)
    y = top + len(FG_PANELS) * (tp * (lane_h + 8) + 50) + 6
    for name, fn, fwd, bwd, why in F_AND_G:
        colour = f_colour if name == "f" else g_colour
        s.rect(16, y - 11, 22, 22, fill=colour, rx=3)
        s.label(27, y, name, size=14, anchor="middle", fill="white" if name == "f" else INK, font_weight="bold")
        s.label(48, y, f"{name} ({fn}): forward {fwd}, backward {bwd}: {why}", size=13)
        y += 28
    s.label(16, y, "Per block: 2 all-reduces in forward (the two g's), 2 in backward (the two f's). "
                   "A = [A₀, A₁] split by columns, B = [B₀; B₁] by rows.", size=13, fill=GREY)
    s.height = y + 24
    return s.render()


SP_OPS = [  # (name, 01's function, forward, backward)
    ("g", "gather_from_sp", "all-gather T", "reduce-scatter T"),
    ("g-bar", "reduce_scatter_to_sp", "reduce-scatter T", "all-gather T"),
]


def sequence_parallel_text(tp=2):
    lines = [f"sequence parallelism, tp = {tp} (Korthikanti et al. 2022, Section 4.2.2; 01's gather_from_sp and "
             f"reduce_scatter_to_sp):",
             "  LayerNorm on (B, T/tp, C) -> g -> self-attention or MLP on (B, T, C), split as in f and g -> g-bar "
             "-> + bias, dropout, + residual on (B, T/tp, C)"]
    lines += [f"  {name:<5}  {fn:<20} forward: {fwd:<16} backward: {bwd}" for name, fn, fwd, bwd in SP_OPS]
    lines.append("an all-reduce is a reduce-scatter then an all-gather: the bytes of f and g, with LayerNorm's and "
                 "dropout's activations stored 1/tp on each rank")
    return "\n".join(lines)


def _sequence_strip(s, x, y, w, tp, rank):
    """T drawn as tp cells: the ones this rank holds filled (all of them if rank is None)."""
    cell = w / tp
    for q in range(tp):
        held = rank is None or q == rank
        s.rect(x + q * cell, y, cell, 9, fill=BLUE if held else "white", stroke=BLUE, stroke_width=1)


def sequence_parallel_svg(_=None, tp=2):
    s = Svg(f"Sequence parallelism: in and out of the tensor-parallel region, tp = {tp}",
            "Korthikanti et al. 2022, Section 4.2.2 (Figure 5) · 01_tensor_parallel.py: g = gather_from_sp, "
            "g-bar = reduce_scatter_to_sp")
    regions = [(16, 230, "sequence-parallel region", "(B, T/tp, C) on each rank", "#eaf3fa"),
               (336, 262, "tensor-parallel region", "(B, T, C) on every rank", "#fdf3e1"),
               (688, 196, "sequence-parallel region", "(B, T/tp, C) on each rank", "#eaf3fa")]
    ops = [(262, PURPLE), (614, ORANGE)]  # g and g-bar, between the regions: (left, colour), 58 px wide
    lane_h, top = 84, 116
    bottom = top + tp * (lane_h + 8)
    for x, w, name, shape, tint in regions:
        s.rect(x, 70, w, bottom - 70 + 4, fill=tint, rx=8)
        s.text(x + w / 2, 88, name, size=13, anchor="middle", font_weight="bold")
        s.text(x + w / 2, 104, shape, size=12, anchor="middle", fill=GREY)
    for r in range(tp):
        ly = top + r * (lane_h + 8)
        s.text(28, ly + 10, f"rank {r}", size=11, fill=GREY)
        boxes = [(28, 206, ["LayerNorm", f"tokens {r}·T/tp to {r + 1}·T/tp"], r),
                 (348, 238, ["self-attention or MLP", "split by heads or hidden units"], None),
                 (700, 172, ["+ bias, dropout", "+ residual"], r)]
        for x, w, lines, held in boxes:
            s.box(x, ly + 16, w, 42, lines, size=13)
            _sequence_strip(s, x + 10, ly + 66, w - 20, tp, held)
        cy = ly + 37
        for (x, _), (bx, bw, _, _) in zip(ops, boxes):
            s.arrow(bx + bw + 2, cy, x - 2, cy)  # into the operator
        for (x, _), (bx, _, _, _) in zip(ops, boxes[1:]):
            s.arrow(x + 60, cy, bx - 2, cy)  # out of it
    for (name, fn, fwd, bwd), (x, colour) in zip(SP_OPS, ops):
        s.rect(x, top + 8, 58, bottom - top - 16, fill=colour, rx=5)
        s.label(x + 29, (top + bottom) / 2, "ḡ" if name == "g-bar" else "g", size=22, anchor="middle",
                font_weight="bold", fill=INK)
    y = bottom + 30
    for (name, fn, fwd, bwd), (_, colour) in zip(SP_OPS, ops):
        s.rect(16, y - 11, 22, 22, fill=colour, rx=3)
        s.label(27, y, "ḡ" if name == "g-bar" else "g", size=15, anchor="middle", font_weight="bold")
        s.label(48, y, f"{name} ({fn}): forward {fwd}, backward {bwd}", size=13)
        y += 28
    s.swatch(16, y, BLUE, "the tokens a rank holds: T/tp of them outside the region, all T inside", stroke=BLUE)
    notes = textwrap.wrap("An all-reduce is a reduce-scatter then an all-gather: the same bytes as f and g, while "
                          "LayerNorm's and dropout's activations are stored 1/tp on each rank. LayerNorm's weight and "
                          "bias see T/tp tokens per rank: their gradients are all-reduced over tp in backward (01's "
                          "sp_param). A layer is this twice: attention, then MLP.", 114)
    for k, note in enumerate(notes):
        s.label(16, y + 30 + 20 * k, note, size=13, fill=GREY)
    s.height = y + 30 + 20 * len(notes)
    return s.render()


# ----------------------------------------------------------------------------------------------
# grid: 05's rank grid


def grid_text(tp=2, dp=2, pp=2):
    """05's rank_grid, drawn: a box per pipeline stage, a row per replica, the tp group in each row."""
    grid = gpt3d.rank_grid(tp * dp * pp, tp, dp, pp)
    width = len(f"rank {tp * dp * pp - 1}") + 2
    inner = tp * width
    lead = " " * 11
    box = lead + "     ".join("+" + "-" * inner + "+" for _ in range(pp))
    lines = [f"world {tp * dp * pp} = tp {tp} x dp {dp} x pp {pp}; rank = (p dp + d) tp + t (05's rank_grid)", "",
             lead + "     ".join(f"{f'stage {p}':^{inner + 2}}" for p in range(pp)), box]
    for d in range(dp):
        rows = ["|" + "".join(f"{f'rank {r}':^{width}}" for r in grid["tp"][p * dp + d]) + "|" for p in range(pp)]
        lines.append(f"{f'replica {d}':<11}" + " --> ".join(rows))
    lines += [box, f"tp groups, a row in a box (one node: NVLink): {grid['tp']}",
              f"dp groups, a column of a box (the gradient all-reduce): {grid['dp']}",
              f"pp groups, along the arrows (point-to-point): {grid['pp']}",
              f"embed groups, the first and the last stage (the tied embedding): {grid['embed']}"]
    return "\n".join(lines)


GRID_LEGEND = {"tp": "tp groups, a row of a stage (adjacent ranks, one node: NVLink): ",
               "dp": "dp groups, down a stage (the gradient all-reduce): ",
               "pp": "pp groups, along the arrows (point-to-point): ",
               "embed": "embedding groups, the first and the last stage (the tied wte): "}  # then the groups


def grid_svg(_=None, tp=2, dp=2, pp=2):
    """Each rank placed by its position in its own groups, as rank_grid lists them: its index in its
    tp group is t, in its dp group d, in its pp group p."""
    world = tp * dp * pp
    grid = gpt3d.rank_grid(world, tp, dp, pp)
    where = {}
    for kind in ("tp", "dp", "pp"):
        for group in grid[kind]:
            for i, r in enumerate(group):
                where.setdefault(r, {})[kind] = i
    s = Svg(f"The rank grid: world {world} = tp {tp} × dp {dp} × pp {pp}",
            f"05_3d_gpt.py's rank_grid({world}, tp={tp}, dp={dp}, pp={pp}): rank = (p·dp + d)·tp + t")
    box_w, box_h, gap, pad, pitch = 100, 44, 20, 12, 92
    inner = tp * box_w + (tp - 1) * gap + 2 * pad  # a tp group's outline
    stage_w, between = inner + 32, 96
    left = (WIDTH - (pp * stage_w + (pp - 1) * between)) / 2 + 30
    top = 76
    stage_h = 44 + dp * pitch - (pitch - box_h - 2 * 10) + 12
    at = {}  # rank -> the top left of its box
    for r in range(world):
        t, d, p = where[r]["tp"], where[r]["dp"], where[r]["pp"]
        at[r] = (left + p * (stage_w + between) + 16 + pad + t * (box_w + gap), top + 44 + d * pitch + 10)
    for p in range(pp):
        x = left + p * (stage_w + between)
        s.rect(x, top, stage_w, stage_h, fill=PALE, stroke=RULE, rx=8)
        s.text(x + stage_w / 2, top + 24, f"pipeline stage {p}", size=14, anchor="middle", font_weight="bold")
    for d in range(dp):
        s.label(left - 14, top + 44 + d * pitch + 32, f"replica {d}", size=13, anchor="end")
    for group in grid["tp"]:  # a row of a stage: adjacent ranks, one node
        x, y = at[group[0]]
        s.rect(x - pad, y - 10, inner, box_h + 20, fill="#e3f4ee", stroke=GREEN, stroke_width=2, rx=8)
    for group in grid["dp"]:  # the same (t, p) in every replica
        for a, b in zip(group, group[1:]):
            (xa, ya), (_, yb) = at[a], at[b]
            s.arrow(xa + box_w / 2, ya + box_h + 2, xa + box_w / 2, yb - 2, colour=BLUE, width=2, both=True)
    for r, (x, y) in at.items():
        s.box(x, y, box_w, box_h, [f"rank {r}", f"t{where[r]['tp']} · d{where[r]['dp']} · p{where[r]['pp']}"],
              stroke=INK, size=14)
    nxt = {g[i]: g[i + 1] for g in grid["pp"] for i in range(len(g) - 1)}  # a rank's pp peer downstream
    for group in grid["tp"]:  # one arrow per row and pair of stages carries the pp pairs of that row
        first = group[0]
        if first in nxt:
            (x, y), (x2, _) = at[first], at[nxt[first]]
            x_end, y_mid = x - pad + inner, y + box_h / 2
            s.arrow(x_end + 4, y_mid, x2 - pad - 4, y_mid, colour=ORANGE, width=2.5)
            s.text((x_end + x2 - pad) / 2, y_mid - 9, ", ".join(f"{a}→{nxt[a]}" for a in group), size=12,
                   anchor="middle", fill=INK)
    y = top + stage_h + 34
    legend = [(lambda yy: s.rect(12, yy - 8, 28, 16, fill="#e3f4ee", stroke=GREEN, stroke_width=2, rx=4),
               GRID_LEGEND["tp"] + str(grid["tp"])),
              (lambda yy: s.arrow(10, yy, 40, yy, colour=BLUE, width=1.5, both=True),
               GRID_LEGEND["dp"] + str(grid["dp"])),
              (lambda yy: s.arrow(10, yy, 40, yy, colour=ORANGE, width=2),
               GRID_LEGEND["pp"] + str(grid["pp"])),
              (lambda yy: None, GRID_LEGEND["embed"] + str(grid["embed"]))]
    for draw, text in legend:
        draw(y)
        s.label(48, y, text, size=13)
        y += 26
    s.height = y + 4
    return s.render()


# ----------------------------------------------------------------------------------------------
# schedules: 02's simulator on 1F1B's and interleaved 1F1B's lists, on one time scale


def schedules_data(pp=4, m=8, v=2):
    """(pp, m, v, {name: 02's Simulation}): a whole stage's forward takes 1 and its backward 2, and
    a chunk of 1/v of a stage 1/v of that (03's demo's times), so the two share one time scale."""
    return pp, m, v, {
        "1F1B": pipeline.simulate(pipeline.Schedule([pipeline.one_f_one_b(pp, m, s) for s in range(pp)]), 1, 2),
        f"interleaved 1F1B, v={v}": pipeline.simulate(pipeline.Schedule([interleaved.interleaved(pp, m, s, v)
                                                                         for s in range(pp)]), Fraction(1, v),
                                                       Fraction(2, v))}


def schedules_text(data, width=132):
    pp, m, v, runs = data
    end = max(sim.step_time for sim in runs.values())
    odd = "the second chunk" if v == 2 else "the odd chunks"
    out = [f"1F1B and interleaved 1F1B, pp={pp}, m={m}, on one time scale (02's simulate()): F<mb> a "
           f"forward, B<mb>== a backward,", f"lower case {odd}, '.' idle; a stage's forward takes 1, its "
           "backward 2, a chunk's 1/v of that"]
    for (name, sim), formula in zip(runs.items(), ("(pp-1)/m", "(pp-1)/(v m)")):
        out += ["", f"{name}: step time {float(sim.step_time):g}, bubble {sim.bubble} = {formula}",
                pipeline_timeline(sim.timeline, width, end)]
    return "\n".join(out)


def schedules_svg(data):
    pp, m, v, runs = data
    end = max(sim.step_time for sim in runs.values())
    s = Svg(f"1F1B and interleaved 1F1B on one time scale: pp = {pp}, m = {m}, v = {v}",
            "Narayanan et al. 2021, Figure 4 · 02's simulate() on 02's one_f_one_b and 03's interleaved lists")
    left, right = 70, WIDTH - 16
    scale = (right - left) / float(end)
    colours = {("F", 0): (BLUE, "white"), ("F", 1): (SKY, INK), ("B", 0): (VERMILLION, "white"),
               ("B", 1): (ORANGE, INK)}
    odd = "second chunk" if v == 2 else "odd chunks"  # v > 2: the colours alternate chunk by chunk
    names = {("F", 0): "forward", ("F", 1): f"forward, {odd}", ("B", 0): "backward", ("B", 1): f"backward, {odd}"}
    x = left
    for key, (fill, _) in colours.items():
        s.swatch(x, 78, fill, names[key])
        x += 36 + text_width(names[key], 13)
    s.label(x + 6, 78, "number = microbatch", size=13, fill=GREY)
    row_h, y = 26, 104
    for (name, sim), formula in zip(runs.items(), ("(pp − 1)/m", "(pp − 1)/(v·m)")):
        s.text(left, y + 14, f"{name}: step time {float(sim.step_time):g}, bubble {sim.bubble} = {formula}", size=14,
               font_weight="bold")
        y += 24
        for r, timeline in enumerate(sim.timeline):
            ry = y + r * (row_h + 4)
            s.label(left - 10, ry + row_h / 2, f"rank {r}", size=13, anchor="end")
            s.rect(left, ry, float(sim.step_time) * scale, row_h, fill="#e6e6e6")  # idle: the bubble
            for start, stop, action in timeline:
                fill, ink = colours[(action.kind, action.chunk % 2)]
                bx, bw = left + float(start) * scale, float(stop - start) * scale
                s.rect(bx, ry, bw, row_h, fill=fill, stroke="white", stroke_width=1, class_=action.kind)
                if bw >= 8:  # a number fits (always at the committed sizes; not in a big variant's chunks)
                    s.label(bx + bw / 2, ry + row_h / 2, str(action.mb), size=11 if bw < 16 else 12,
                            anchor="middle", fill=ink)
        stop_x = left + float(sim.step_time) * scale
        s.line(stop_x, y - 4, stop_x, y + pp * (row_h + 4), stroke=INK, stroke_dasharray="4 3")
        y += pp * (row_h + 4) + 18
    for t in ticks(0, float(end), 3):
        s.line(left + t * scale, y - 14, left + t * scale, y - 9, stroke=INK)
        s.text(left + t * scale, y + 4, f"{t:g}", size=12, anchor="middle", fill=GREY)
    s.line(left, y - 14, right, y - 14, stroke=INK)
    s.text((left + right) / 2, y + 24, "time: a stage's forward takes 1, its backward 2; a chunk's 1/v of that",
           size=13, anchor="middle")
    s.text(left, y + 48, "Grey is idle time, the bubble. Interleaving cuts each stage into v chunks and fills and "
           "drains the pipeline v times faster.", size=13, fill=GREY)
    s.height = y + 62
    return s.render()


# ----------------------------------------------------------------------------------------------
# bubble: the simulator, exact


def bubble_data(pp=4, ms=(4, 8, 12, 16, 24, 32), vs=(1, 2, 4)):
    """{v: [(m, simulated bubble, formula)]}: 02's simulate() on 03's interleaved lists (v = 1 is
    1F1B), every chunk taking 1/v of a stage's time (t_f = 1/v, t_b = 2/v)."""
    out = {}
    for v in vs:
        lists = lambda m: pipeline.Schedule([interleaved.interleaved(pp, m, s, v) for s in range(pp)])  # noqa: E731
        out[v] = [(m, pipeline.simulate(lists(m), Fraction(1, v), Fraction(2, v)).bubble,
                   Fraction(pp - 1, v * m)) for m in ms]
    return out


def bubble_text(data, pp=4):
    vs = list(data)
    head = (f"{'m':>4} " + "".join(f"| v={v}: simulated  formula   " for v in vs)).rstrip()
    lines = [f"pipeline bubble (idle / busy) against m, pp={pp}: 02's simulate() on 03's lists, beside "
             f"(pp - 1)/(v m)", head, "-" * len(head)]
    for i, (m, _, _) in enumerate(data[vs[0]]):
        cells = "".join(f"| {str(sim):>14} {str(f):>8}{'  ' if sim == f else ' !'} " for sim, f in
                        ((data[v][i][1], data[v][i][2]) for v in vs))
        lines.append(f"{m:>4} {cells}".rstrip())
    lines.append("every simulated bubble equals its formula" if all(s == f for rows in data.values()
                                                                     for _, s, f in rows) else "MISMATCH (!)")
    chart = ascii_chart({f"v={v}": (str(v)[0], [(m, float(s)) for m, s, _ in rows]) for v, rows in data.items()},
                        height=10, x_label="m (microbatches)")
    return "\n".join(lines) + "\n\n" + chart


def bubble_svg(data, pp=4):
    s = Svg(f"The pipeline bubble against m, pp = {pp}",
            "02's simulate() on 03's lists (points), on the formula (pp − 1)/(v·m) (lines); a chunk takes 1/v "
            "of a stage's time")
    ms = [m for m, _, _ in next(iter(data.values()))]
    top = max(float(x) for rows in data.values() for _, sim, f in rows for x in (sim, f))
    step = nice_step(top, 8)
    ax = Axes(s, (100, 80, 860, 400), (ms[0] - 1, ms[-1] + 1), (0, math.ceil(top / step - 1e-9) * step))
    ax.draw(ms, ticks(0, ax.ys[1], step), "m, microbatches per step", "bubble = idle time / busy time")
    colours = [BLUE, VERMILLION, GREEN, PURPLE, ORANGE]
    for (v, rows), colour in zip(data.items(), colours):
        curve = [ms[0] + Fraction(k, 8) for k in range(8 * (ms[-1] - ms[0]) + 1)]  # m in steps of 1/8
        s.polyline([(ax.x(m), ax.y(float(Fraction(pp - 1) / (v * m)))) for m in curve], stroke=colour, stroke_width=2)
        for m, sim, f in rows:
            s.circle(ax.x(m), ax.y(float(sim)), 5.5, fill=colour, stroke="white", stroke_width=1.5, class_="simulated")
    s.rect(562, 78, 300, 38 + 22 * len(data) + 10, fill="white", stroke=RULE, rx=4)
    y = 92
    for (v, rows), colour in zip(data.items(), colours):
        s.line(574, y, 604, y, stroke=colour, stroke_width=2)
        s.circle(589, y, 5.5, fill=colour, stroke="white", stroke_width=1.5)
        kind = "1F1B" if v == 1 else "interleaved"
        s.label(614, y, f"v = {v} ({kind}): {rows[0][1]} at m = {rows[0][0]}", size=13)
        y += 22
    s.line(574, y + 4, 604, y + 4, stroke=INK, stroke_width=2)
    s.label(614, y + 4, "line: the formula (pp − 1)/(v·m)", size=13)
    s.circle(589, y + 26, 5.5, fill=INK)
    s.label(614, y + 26, "point: simulated, an exact fraction", size=13)
    same = all(sim == f for rows in data.values() for _, sim, f in rows)
    s.text(100, 470, "Every simulated bubble equals its formula exactly." if same else
           "MISMATCH: a simulated bubble differs from its formula.", size=13, fill=GREY)
    s.height = 488
    return s.render()


def weights(cfg, dtype):
    """Full weights for GPT(cfg) from a seed. Not 01's init_state_dict, whose first call imports
    torch's compiler (seconds): the figures need shapes and finite values, nothing more."""
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(p.shape, generator=gen, dtype=dtype) * 0.02 for n, p in
            tensor_parallel.GPT(cfg, None, init=False, dtype=dtype).named_parameters()}


# ----------------------------------------------------------------------------------------------
# memory: the executor's ActivationMeter on pp CPU ranks

MEMORY_CFG = tensor_parallel.GPTConfig(vocab_size=97, block_size=16, n_layer=8, n_head=2, n_embd=16)


def _memory(env, full, m, rows, v_interleaved):
    cfg, pp = MEMORY_CFG, env.world_size
    gen = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(cfg.vocab_size, (2, m * rows, cfg.block_size), generator=gen)
    micro = pipeline.split_batch(idx, targets, m)
    out = {}
    for name, v, make in (("GPipe", 1, pipeline.gpipe), ("1F1B", 1, pipeline.one_f_one_b),
                          (f"interleaved v={v_interleaved}", v_interleaved,
                           lambda pp_, m_, s: interleaved.interleaved(pp_, m_, s, v_interleaved))):
        chunks = pipeline.build_chunks(cfg, pp, env.rank, v, init=False, dtype=torch.float64)
        for c in chunks:
            c.load_full_state_dict(full)
        res = pipeline.execute(interleaved.InterleavedSchedule([make(pp, m, r) for r in range(pp)]), chunks,
                               dist.group.WORLD, micro,
                               pipeline.Wire((rows, cfg.block_size, cfg.n_embd)))
        out[name] = res.peak_activation_bytes
    return out


def memory_data(pp=4, m=8, rows=2, v=2):
    """{schedule: [peak stored activation bytes of stage 0, 1, ...]}, from one step of each on pp
    CPU ranks (float64, outputs deallocated once sent, as Megatron does)."""
    full = weights(MEMORY_CFG, torch.float64)  # made here: the ranks inherit them
    per_rank = launch(_memory, pp, full, m, rows, v)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def memory_text(data, pp=4, m=8):
    rows = []
    for s in range(pp):
        rows.append((f"stage {s}", None))
        rows += [(f"  {name}", data[name][s]) for name in data]
    names = list(data)
    ratio = data[names[1]][0] / data[names[0]][0]
    return (f"peak stored activation bytes per stage, pp={pp}, m={m} (02's ActivationMeter on a real CPU run, "
            f"float64):\n{bars(rows)}\n1F1B / GPipe on stage 0: {ratio:.3f} (pp/m = {pp / m:.3f}): GPipe keeps "
            f"all m microbatches' activations, 1F1B at most pp - stage;\ninterleaving keeps more on the first "
            f"stage ((v+1) pp - 1 chunks of 1/v stage) for its smaller bubble")


def memory_svg(data, pp=4, m=8):
    s = Svg(f"Peak stored activations per pipeline stage, pp = {pp}, m = {m}",
            f"counted by 02's ActivationMeter in one step on {pp} CPU ranks (float64; outputs freed once sent)")
    kib = {name: [b / 1024 for b in values] for name, values in data.items()}
    top = max(max(values) for values in kib.values())
    step = nice_step(top, 7)
    ax = Axes(s, (100, 96, 860, 396), (0, pp), (0, math.ceil(top / step) * step))
    ax.draw([], ticks(0, ax.ys[1], step), "", "peak stored activations (KiB)", yfmt=lambda v: f"{v:,.0f}")
    colours = [GREY, BLUE, ORANGE, GREEN]
    n, bar_w, bar_gap = len(kib), 52, 8
    for st in range(pp):
        centre = ax.x(st + 0.5)
        s.text(centre, 396 + 22, f"stage {st}", size=13, anchor="middle")
        for k, ((name, values), colour) in enumerate(zip(kib.items(), colours)):
            x = centre - (n * bar_w + (n - 1) * bar_gap) / 2 + k * (bar_w + bar_gap)
            s.rect(x, ax.y(values[st]), bar_w, ax.y(0) - ax.y(values[st]), fill=colour, class_="bar")
            s.text(x + bar_w / 2, ax.y(values[st]) - 5, f"{values[st]:,.0f}", size=11, anchor="middle")
    x = 110
    for (name, _), colour in zip(kib.items(), colours):
        s.swatch(x, 76, colour, name)
        x += 44 + text_width(name, 13)
    names = list(data)
    ratio = data[names[1]][0] / data[names[0]][0]
    notes = [f"1F1B / GPipe on stage 0: {ratio:.3f} (pp/m = {pp / m:.3f}). GPipe keeps all m microbatches' "
             f"activations, 1F1B at most pp − stage;",
             "the last stage also keeps the logits for the loss. Interleaving keeps (v + 1)·pp − 1 chunks of 1/v "
             "stage on the first",
             "stage: the memory it pays for a v times smaller bubble."]
    for k, note in enumerate(notes):
        s.text(16, 450 + 20 * k, note, size=13, fill=GREY)
    s.height = 450 + 20 * len(notes)
    return s.render()


# ----------------------------------------------------------------------------------------------
# overlap: 04's bucketed reduction, timed on dp CPU ranks


class TimedDDP(data_parallel.BucketedDDP):
    """04's BucketedDDP that also notes ("done", bucket, t) when it first sees a bucket's reduction
    finished: it polls at every gradient hook, and after backward until all are done."""

    def _on_grad(self, p):
        super()._on_grad(p)
        self.poll()

    def poll(self):
        now = time.perf_counter()
        seen = {i for kind, i, _ in self.events if kind == "done"}
        for i, (work, _) in list(self.works.items()):
            if i not in seen and work.is_completed():
                self.events.append(("done", i, now))

    def finish(self):
        while any(not w.is_completed() for w, _ in self.works.values()):
            self.poll()
        self.poll()
        super().finish()  # launches the buckets no hook launched, and waits
        self.poll()


OVERLAP_CFG = tensor_parallel.GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64)


def _overlap(env, full, bucket_numel, steps):
    cfg = OVERLAP_CFG
    group = dist.new_group(list(range(env.world_size)))
    model = tensor_parallel.GPT(cfg, None, init=False, dtype=torch.float32)
    model.load_full_state_dict(full)
    ddp = TimedDDP(model.parameters(), group, bucket_numel)
    gen = torch.Generator().manual_seed(env.rank)
    for _ in range(steps):  # the last step is the one drawn: the first ones warm up
        idx, targets = torch.randint(cfg.vocab_size, (2, 8, cfg.block_size), generator=gen)
        ddp.zero_grad()
        loss = model(idx, targets)[1]
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        ddp.finish()
    return start, end, ddp.events, len(ddp.buckets)


def overlap_data(dp=2, bucket_numel=20000, steps=3):
    """Rank 0's (start, end, events, n_buckets) of its last backward."""
    full = weights(OVERLAP_CFG, torch.float32)
    return launch(_overlap, dp, full, bucket_numel, steps)[0]


def overlap_text(data, dp=2):
    start, end, events, n = data
    return (f"04's BucketedDDP on dp={dp} CPU ranks (rank 0, the last of 3 steps; {n} buckets): L = the bucket's "
            f"all-reduce launched from the gradient hook,\nD = first seen done; '|' on the backward row = a "
            f"gradient arrived. Buckets fill in reverse parameter order, as backward produces them.\n"
            + bucket_timeline(start, end, events, n))


def overlap_svg(data, dp=2):
    """One row for backward (a tick where each gradient arrived), one bar per bucket launched: from
    its launch to when it was first seen done (class "bucket", for tests)."""
    start, end, events, n = data
    ms = lambda t: 1e3 * (t - start)  # noqa: E731
    launched = {i: t for kind, i, t in events if kind == "launch"}
    done = {i: t for kind, i, t in events if kind == "done"}
    s = Svg("Bucketed gradient all-reduce overlapping backward: one real run",
            f"04's BucketedDDP on dp = {dp} CPU ranks, a 4-layer GPT-2; rank 0's last backward, {n} buckets; "
            f"the times vary from run to run")
    row_h, top = 22, 96
    last = max([ms(t) for _, _, t in events] + [ms(end)])
    step = nice_step(last, 8)
    ax = Axes(s, (120, top, WIDTH - 30, top + (n + 1) * row_h), (0, math.ceil(last / step) * step), (0, 1))
    bottom = ax.box[3]
    for t in ticks(0, ax.xs[1], step):
        s.line(ax.x(t), top - 4, ax.x(t), bottom, stroke="#e3e3e3")
        s.text(ax.x(t), bottom + 18, f"{t:g}", size=12, anchor="middle", fill=GREY)
    s.text((120 + WIDTH - 30) / 2, bottom + 40, "ms after backward began", size=13, anchor="middle")
    s.label(110, top + row_h / 2, "backward", size=13, anchor="end", font_weight="bold")
    s.rect(ax.x(0), top + 3, ax.x(ms(end)) - ax.x(0), row_h - 6, fill=GREY, class_="backward")
    for kind, _, t in events:
        if kind == "ready":
            s.line(ax.x(ms(t)), top + 1, ax.x(ms(t)), top + row_h - 1, stroke="white", stroke_width=1.2)
    for i in range(n):
        y = top + (i + 1) * row_h
        s.label(110, y + row_h / 2, f"bucket {i}", size=13, anchor="end")
        if i in launched:
            a = ms(launched[i])
            b = ms(done[i]) if i in done else a
            x0 = ax.x(a)
            s.rect(x0, y + 4, max(ax.x(b) - x0, 2), row_h - 8, fill=BLUE, class_="bucket")
            s.circle(x0, y + row_h / 2, 3.5, fill=VERMILLION)
    s.line(ax.x(ms(end)), top - 4, ax.x(ms(end)), bottom, stroke=INK, stroke_dasharray="4 3")
    s.text(ax.x(ms(end)), top - 8, "backward ends", size=12, anchor="middle")
    s.line(120, bottom, WIDTH - 30, bottom, stroke=INK)
    y = bottom + 68
    s.swatch(16, y, GREY, "backward running (a white tick: a gradient arrived in its hook)")
    s.swatch(16, y + 24, BLUE, "a bucket's all-reduce, from its launch (red dot, from the gradient hook) to when "
                               "the run first saw it done")
    early = sum(t < end for t in launched.values())
    s.label(16, y + 52, f"{early} of {n} launched before backward finished. On this CPU they share the cores with "
                        f"backward; on GPUs they run on the network.", size=13, fill=GREY)
    s.height = y + 70
    return s.render()


# ----------------------------------------------------------------------------------------------
# zero: ZeRO-1's partition of a real BucketedDDP's buffer


ZERO_CFG = tensor_parallel.GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)


def _zero(env, bucket_numel):
    model = tensor_parallel.GPT(ZERO_CFG, None, init=False, dtype=torch.float32)  # its layout, not its values
    names = {p: n for n, p in model.named_parameters()}
    ddp = data_parallel.BucketedDDP(model.parameters(), dist.group.WORLD, bucket_numel, zero=True)
    params = [(names[p], ddp.offsets[p], p.numel()) for p in reversed(ddp.params)]
    return ddp.buckets, [ddp.shard_range(i) for i in range(len(ddp.buckets))], params, len(ddp.grad_buffer)


def zero_data(dp=4, bucket_numel=2000):
    per_rank = launch(_zero, dp, bucket_numel)
    buckets, _, params, total = per_rank[0]
    return dict(dp=dp, buckets=buckets, shards=[r[1] for r in per_rank], params=params, total=total)


def zero_text(z, width=64):
    dp, total = z["dp"], z["total"]
    per = total / width
    bar = "".join(str(next(q for q in range(dp) if any(a <= c * per < b for a, b in z["shards"][q])))
                  for c in range(width))
    lines = [f"ZeRO-1 over dp={dp}: 04's flat gradient buffer of a one-layer GPT-2 ({total:,} elements, padded",
             f"to a multiple of dp), in reverse parameter order, cut into buckets of {z['buckets'][0][1]:,}; each bucket "
             f"is split",
             "into dp equal shards, and rank q keeps the AdamW state (and, for bf16, the fp32 master weights)",
             "of its shard only.", "",
             f"buffer |{bar}|  (a digit per {per:,.0f} elements: the rank that owns them)"]
    for i, (lo, hi) in enumerate(z["buckets"]):
        shards = "  ".join(f"rank {q} [{z['shards'][q][i][0]:,}, {z['shards'][q][i][1]:,})" for q in range(dp))
        held = [n.replace("transformer.", "") for n, o, k in z["params"] if o < hi and lo < o + k]
        lines.append(f"bucket {i} [{lo:,}, {hi:,}): {shards}")
        lines += textwrap.wrap("holds " + ", ".join(held), 100, initial_indent=" " * 11, subsequent_indent=" " * 17)
    owned = [sum(b - a for a, b in z["shards"][q]) for q in range(dp)]
    lines.append(f"elements owned per rank: {owned} (of {total:,}: 1/dp each); after its AdamW step, every")
    lines.append("rank all-gathers the updated weights of every shard")
    return "\n".join(lines)


def zero_svg(z):
    """Three rows on one scale: the parameters in the flat buffer, its buckets, and each bucket's dp
    shards coloured by the rank that owns them."""
    dp, total = z["dp"], z["total"]
    s = Svg(f"ZeRO-1: the flat gradient buffer, its buckets, and who owns which shard (dp = {dp})",
            f"04's BucketedDDP(zero=True) on {dp} CPU ranks, a one-layer GPT-2: {total:,} elements in reverse "
            f"parameter order, buckets of {z['buckets'][0][1]:,}")
    left, right = 150, WIDTH - 20
    x = lambda e: left + e / total * (right - left)  # noqa: E731
    # Parameter names above the buffer, in as many rows as they need not to overlap.
    rows_end, placed = [], []
    for name, off, k in sorted(z["params"], key=lambda p: p[1]):
        if x(off + k) - x(off) < 30:
            continue  # biases and LayerNorm weights: a tick, no name
        short = name.replace("transformer.", "")
        centre, half = (x(off) + x(off + k)) / 2, text_width(short, 11) / 2 + 4
        row = next((j for j, e in enumerate(rows_end) if e < centre - half), len(rows_end))
        rows_end[row:row + 1] = [centre + half]
        placed.append((short, centre, row))
    y_buf = 84 + 16 * len(rows_end) + 8
    for short, centre, row in placed:
        ty = y_buf - 12 - 16 * row
        s.line(centre, ty + 3, centre, y_buf, stroke=RULE)
        s.text(centre, ty, short, size=11, anchor="middle")
    s.label(left - 10, y_buf + 14, "parameters", size=13, anchor="end")
    for name, off, numel in sorted(z["params"], key=lambda p: p[1]):
        small = x(off + numel) - x(off) < 30
        s.rect(x(off), y_buf, x(off + numel) - x(off), 28, fill="#8c8c8c" if small else "#dedede", stroke="white",
               stroke_width=1.2, class_="param")
    y_b = y_buf + 44
    s.label(left - 10, y_b + 14, "buckets", size=13, anchor="end")
    for i, (lo, hi) in enumerate(z["buckets"]):
        s.rect(x(lo), y_b, x(hi) - x(lo), 28, fill="white", stroke=INK, stroke_width=1.2, class_="bucket")
        text = f"bucket {i}: [{lo:,}, {hi:,})"
        fits = [t for t in (text, f"bucket {i}", f"{i}") if text_width(t, 12) < x(hi) - x(lo) - 6]
        s.label((x(lo) + x(hi)) / 2, y_b + 14, fits[0] if fits else "", size=12, anchor="middle")
    y_s = y_b + 44
    colours = [BLUE, ORANGE, GREEN, PURPLE, SKY, VERMILLION, GREY, "#999933"]
    s.label(left - 10, y_s + 14, "owner (ZeRO-1)", size=13, anchor="end")
    for q in range(dp):
        for lo, hi in z["shards"][q]:
            colour = colours[q % len(colours)]
            s.rect(x(lo), y_s, x(hi) - x(lo), 28, fill=colour, stroke="white", stroke_width=1, class_="shard")
            if x(hi) - x(lo) > 22:
                s.label((x(lo) + x(hi)) / 2, y_s + 14, f"r{q}", size=12, anchor="middle",
                        fill="white" if colour in (BLUE, GREEN, PURPLE) else INK)
    for e in ticks(0, total, nice_step(total, 8)):
        s.line(x(e), y_s + 30, x(e), y_s + 35, stroke=INK)
        s.text(x(e), y_s + 49, f"{e:,.0f}", size=11, anchor="middle", fill=GREY)
    s.text((left + right) / 2, y_s + 68, "element of the flat buffer", size=13, anchor="middle")
    y = y_s + 96
    owned = [sum(b - a for a, b in z["shards"][q]) for q in range(dp)]
    for q in range(dp):
        s.swatch(16 + q * 216, y, colours[q % len(colours)], f"rank {q} owns {owned[q]:,} elements")
    notes = ["Parameters: the dark slivers are biases and LayerNorm weights, too small to name.",
             f"Each bucket is cut into dp = {dp} equal shards. Its gradients are reduce-scattered: rank q receives "
             "the sum of its shards only,",
             "keeps AdamW's moments (and, for bf16, fp32 master weights) for them, updates them, then all-gathers "
             "every rank's weights.",
             "A shard may cut a parameter in two: the optimizer works on flat elements, not on parameters "
             "(04's Piece)."]
    for k, note in enumerate(notes):
        s.text(16, y + 32 + 20 * k, note, size=13, fill=GREY)
    s.height = y + 32 + 20 * len(notes)
    return s.render()


# ----------------------------------------------------------------------------------------------
# Context parallelism (08): one ring step, and each schedule's causal balance, from its lists


RANK_COLOURS = [BLUE, ORANGE, GREEN, PURPLE, SKY, VERMILLION, "#999999", "#F0E442"]
SCHEDULE_NAMES = {"contiguous": "the contiguous split", "megatron": "Megatron's split", "lightseq": "LightSeq's schedule"}


def ring_step_data(cp=4, step=1, name="megatron"):
    """(schedule, step, [every message of that exchange, forward]) of 08's schedule `name` at cp."""
    sched = context_parallel.SPLITS[name](cp)
    return sched, step, context_parallel.messages(sched, step)


def ring_step_text(data):
    sched, step, msgs = data
    lines = [f"ring step {step} of 08's {sched.name} schedule, cp={sched.cp}: rank r meets its visitor (r - {step}) mod "
             f"cp and computes the causal blocks they share (08's ring(), messages())"]
    for r in range(sched.cp):
        blocks = " ".join(f"({b.q},{b.kv})" for b in sched.steps[r][step])
        got = ", ".join(f"{kind}[{b}] from rank {src}" for src, dst, kind, b in msgs if dst == r)
        lines.append(f"rank {r}: holds blocks {sched.split[r]}; visitor rank {(r - step) % sched.cp}; computes "
                     f"{blocks or 'nothing'}; receives {got or 'nothing'}")
    return "\n".join(lines)


def ring_step_svg(data):
    sched, step, msgs = data
    cp = sched.cp
    s = Svg(f"Ring attention, step {step}: each rank borrows its visitor's keys and values",
            f"08's {sched.name} split, cp = {cp}: rank r holds blocks r and 2cp − 1 − r; at step {step} it meets "
            f"rank (r − {step}) mod cp")
    w, gap, top, h = 170, 50, 90, 150
    left = (WIDTH - cp * w - (cp - 1) * gap) / 2
    xs = [left + r * (w + gap) for r in range(cp)]
    for r in range(cp):
        blocks = sched.steps[r][step]
        s.box(xs[r], top, w, h, [f"rank {r}", f"holds blocks {', '.join(map(str, sched.split[r]))}",
                                f"visitor: rank {(r - step) % cp}", "computes " + " ".join(
                                    f"({b.q},{b.kv})" for b in blocks)], stroke=RANK_COLOURS[r], size=15)
    for src, dst, kind, b in msgs:
        y = top + h / 2 + 12 * [m for m in msgs if m[1] == dst].index((src, dst, kind, b)) - 6
        if dst == (src + step) % cp and dst > src:  # to the right
            s.arrow(xs[src] + w, y, xs[dst], y, colour=RANK_COLOURS[src])
            s.text(xs[src] + w + gap / 2, y - 4, f"{kind}[{b}]", size=11, anchor="middle", fill=RANK_COLOURS[src])
        else:  # around the ring, below
            low = top + h + 30 + 16 * [m for m in msgs if m[1] < m[0]].index((src, dst, kind, b))
            s.polyline([(xs[src] + w / 2, top + h), (xs[src] + w / 2, low), (xs[dst] + w / 2 + 10, low)],
                       stroke=RANK_COLOURS[src], stroke_width=1.5)
            s.arrow(xs[dst] + w / 2 + 10, low, xs[dst] + w / 2 + 10, top + h, colour=RANK_COLOURS[src])
            s.text(xs[src] + w / 2 - 6, low - 3, f"{kind}[{b}]", size=11, anchor="end", fill=RANK_COLOURS[src])
    y = top + h + 30 + 16 * sum(1 for m in msgs if m[1] < m[0]) + 30
    s.text(WIDTH / 2, y, "kv[b]: block b's keys and values, sent by their owner for this step only; backward sends "
           "them again and their gradients home", size=13, anchor="middle", fill=GREY)
    s.height = y + 20
    return s.render()


def balance_data(name, cp=4):
    """(schedule, 08's simulate() of it) for SPLITS[name] at cp."""
    sched = context_parallel.SPLITS[name](cp)
    context_parallel.validate(sched)
    return sched, context_parallel.simulate(sched)


def balance_text(data):
    sched, sim = data
    where = {(b.q, b.kv): (r, st) for r in range(sched.cp) for st, blocks in enumerate(sched.steps[r]) for b in blocks}
    lines = [f"08's {sched.name} schedule, cp={sched.cp}: the causal blocks of the sequence's {sched.n} (query block "
             f"down, key block across), each as rank.step that computes it"]
    for i in range(sched.n):
        lines.append(f"  q{i:<2}" + "".join(f" {'%d.%d' % where[i, j] if (i, j) in where else '  . ':>4}"
                                            for j in range(sched.n)))
    lines.append("work per rank (full (T/cp)^2 blocks): " + ", ".join(f"rank {r} {t}" for r, t in enumerate(sim.totals))
                 + f"; balance factor {float(sim.factor):.2f}, {len(sim.work[0])} ring steps")
    return "\n".join(lines)


def balance_svg(data):
    sched, sim = data
    s = Svg(f"Causal balance, {SCHEDULE_NAMES[sched.name]}, cp = {sched.cp}: balance factor {float(sim.factor):.2f}",
            "each block of the causal attention coloured by the rank that computes it, labelled with its ring step; "
            "each rank's work")
    where = {(b.q, b.kv): (r, st) for r in range(sched.cp) for st, blocks in enumerate(sched.steps[r]) for b in blocks}
    size, x0, y0 = 320, 90, 95
    cell = size / sched.n
    for i in range(sched.n):
        s.label(x0 - 10, y0 + (i + 0.5) * cell, f"q{i}", size=12, anchor="end", fill=GREY)
        s.text(x0 + (i + 0.5) * cell, y0 - 8, f"kv{i}", size=12, anchor="middle", fill=GREY)
        for j in range(sched.n):
            x, y = x0 + j * cell, y0 + i * cell
            if (i, j) not in where:
                s.rect(x, y, cell, cell, fill=PALE, stroke="white")
                continue
            r, st = where[i, j]
            s.rect(x, y, cell, cell, fill=RANK_COLOURS[r], stroke="white", opacity=0.55 if i == j else 1)
            s.label(x + cell / 2, y + cell / 2, str(st), size=13, anchor="middle", fill="white" if i != j else INK)
    s.text(x0, y0 + size + 24, "a paler block is on the diagonal: half the work (causal inside it)", size=12, fill=GREY)
    ax_left, ax_right, top, bottom = 520, 810, 95, 95 + size
    most = max(max(sim.totals), 1)
    ax = Axes(s, (ax_left, top, ax_right, bottom), (-0.5, sched.cp - 0.5), (0, float(most) * 1.15))
    step = nice_step(float(most) * 1.15, 5)
    ax.draw(list(range(sched.cp)), ticks(0, ax.ys[1], step), "rank", "attention, (T/cp)² blocks",
            xfmt=lambda v: f"{int(v)}")
    for r, total in enumerate(sim.totals):
        x = ax.x(r)
        s.rect(x - 22, ax.y(float(total)), 44, ax.y(0) - ax.y(float(total)), fill=RANK_COLOURS[r], class_="work")
        s.text(x, ax.y(float(total)) - 6, str(total), size=12, anchor="middle")
    mean = float(sim.ideal)
    s.line(ax_left, ax.y(mean), ax_right, ax.y(mean), stroke=INK, stroke_dasharray="5,4")
    s.label(ax_right + 6, ax.y(mean), f"mean {sim.ideal}", size=12)
    s.text(WIDTH / 2, bottom + 70, f"busiest rank / mean = {float(sim.factor):.2f}; {len(sim.work[0])} ring steps, "
           f"in lockstep {float(sim.time):.2f} against {float(sim.ideal):.2f} if even", size=13, anchor="middle")
    s.height = bottom + 90
    return s.render()


# fold and dispatch: 09's experts, folded onto attention's ranks, and one dispatch on 2 CPU ranks


def fold_data(tp=2, dp=2, pp=2, ep=4, E=8, cp=1):
    """09's fold of 05's grid, or of 08's with cp > 1: (the grid with the experts' groups, E)."""
    attention = context_parallel.rank_grid(tp * cp * dp * pp, tp, cp, dp, pp) if cp > 1 else \
        gpt3d.rank_grid(tp * dp * pp, tp, dp, pp)
    return experts().fold(attention, ep), E


def experts():
    return importlib.import_module("09_expert_parallel")


def fold_text(data):
    grid, E = data
    ep = len(grid["ep"][0])
    return (experts().draw_fold(grid) + f"\nexperts of each MoE layer, E = {E}: ep rank e holds experts "
            + ", ".join(f"{e}: {e * E // ep}-{(e + 1) * E // ep - 1}" for e in range(ep)))


def fold_svg(data):
    """Each stage's ranks as 05 places them (a row per replica, a tp group in each row; with 08's cp a row
    per cp rank of each replica), every rank also marked with its place in the experts' grid and the
    experts it holds; an ep group's outline."""
    grid, E = data
    cp = len(grid["cp"][0]) if "cp" in grid else 1
    size = {k: len(grid[k][0]) for k in ("tp", "dp", "pp", "ep", "edp", "etp", "cp") if k in grid}
    tp, dp, pp, ep = size["tp"], size["dp"], size["pp"], size["ep"]  # dp: a row each (08's dp is dp x cp)
    place = {k: {r: i for g in grid[k] for i, r in enumerate(g)} for k in size}
    world = tp * dp * pp
    attention = f"tp {tp} × cp {cp} × dp {dp // cp}" if cp > 1 else f"tp {tp} × dp {dp}"
    s = Svg(f"Parallel folding: attention's {attention}, the experts' ep {ep}, on the same ranks",
            f"09_expert_parallel.py's fold: {'08' if cp > 1 else '05'}'s grid for attention, the experts' etp × ep × "
            f"edp over the same ranks (pp = {pp}, the same stages)")
    box_w, box_h, gap, pitch = 176, 62, 14, 94
    stage_w = tp * box_w + (tp - 1) * gap + 44
    between = (WIDTH - 40 - pp * stage_w) / max(pp - 1, 1)
    left = 20 if pp > 1 else (WIDTH - stage_w) / 2  # one stage: in the middle
    top, at = 76, {}
    for r in range(world):
        x0 = left + place["pp"][r] * (stage_w + between)
        at[r] = (x0 + 22 + place["tp"][r] * (box_w + gap), top + 60 + place["dp"][r] * pitch)
    stage_h = 60 + dp * pitch + 14
    for p in range(pp):
        x0 = left + p * (stage_w + between)
        s.rect(x0, top, stage_w, stage_h, fill=PALE, stroke=RULE, rx=8)
        s.text(x0 + stage_w / 2, top + 22, f"pipeline stage {p}", size=14, anchor="middle", font_weight="bold")
    for group in grid["ep"]:  # an ep group: every rank of it, however attention groups them
        xs, ys = [at[r][0] for r in group], [at[r][1] for r in group]
        s.rect(min(xs) - 14, min(ys) - 14, max(xs) - min(xs) + box_w + 28, max(ys) - min(ys) + box_h + 28,
               fill="#fdf0dc", stroke=ORANGE, stroke_width=2.5, rx=10, class_="ep")
    for group in grid["tp"]:  # a tp group: a row of a stage
        xs, y = [at[r][0] for r in group], at[group[0]][1]
        s.rect(min(xs) - 6, y - 6, max(xs) - min(xs) + box_w + 12, box_h + 12, fill="none", stroke=GREEN,
               stroke_width=2, rx=7, stroke_dasharray="6 3", class_="tp")
    for r, (x, y) in at.items():
        e = place["ep"][r]
        where = f"t{place['tp'][r]} · c{place['cp'][r]} · d{place['dp'][r] // cp}" if cp > 1 else \
            f"t{place['tp'][r]} · d{place['dp'][r]}"
        s.box(x, y, box_w, box_h, [f"rank {r}", f"attention: {where}",
                                   f"experts {e * E // ep}-{(e + 1) * E // ep - 1}: ep {e} · edp {place['edp'][r]}"],
              stroke=INK, size=14)
    y = top + stage_h + 34
    groups = f"cp groups: {grid['cp']}" if cp > 1 else f"dp groups: {grid['dp']}"
    legend = [(lambda yy: s.rect(12, yy - 8, 28, 16, fill="none", stroke=GREEN, stroke_width=2, rx=4,
                                 stroke_dasharray="6 3"), f"attention's tp groups: {grid['tp']}; {groups}"),
              (lambda yy: s.rect(12, yy - 8, 28, 16, fill="#fdf0dc", stroke=ORANGE, stroke_width=2, rx=4),
               f"ep groups, the all-to-all's ranks: {grid['ep']}; edp groups (expert gradients): {grid['edp']}")]
    if cp > 1:  # no outline of their own: the ep groups' here, and the columns of a stage's replicas
        legend.append((lambda yy: None, f"tp x cp groups (a microbatch's tokens): {grid['tp_cp']}; dp x cp groups "
                                        f"(dense gradients): {grid['dp']}"))
    for draw, text in legend:
        draw(y)
        s.label(48, y, text, size=13)
        y += 26
    notes = [f"An ep group takes a tp × cp block: the {tp * cp} ranks that split one microbatch's sequences as "
             f"tp {tp} × cp {cp} hold E/ep = {E // ep} experts each;",
             "dense gradients are reduced over dp × cp, expert gradients over edp (the dp replicas), both "
             "divided by dp × cp."] if cp > 1 else \
        [f"An ep group takes a whole stage's tp × dp ranks: the {tp * dp} ranks that attention splits "
         f"as tp {tp} × dp {dp} hold E/ep = {E // ep} experts each;",
         "dense gradients are reduced over dp, expert gradients over edp, both divided by dp (the "
         "replicas of the batch)."]
    for note in notes:
        s.text(16, y + 6, note, size=13, fill=GREY)
        y += 20
    s.height = y + 6
    return s.render()


def _dispatch(env, N, E, k, seed):
    gen = torch.Generator().manual_seed(seed + env.rank)
    chosen = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    x = (torch.arange(N, dtype=torch.float64) + 10 * env.rank)[:, None]  # token t of rank r: 10 r + t
    rows, plan = experts().dispatch(x, chosen, E, dist.group.WORLD)
    return dict(chosen=chosen.tolist(), order=plan.order.tolist(), counts=plan.counts, send=plan.send,
                recv=plan.recv, blocks=plan.blocks, rows=[int(v) for v in rows[:, 0].tolist()])


def dispatch_data(ep=2, N=4, E=4, k=2, seed=5):
    """Each rank's routing and plan from one real dispatch (09's, on ep CPU ranks): integers only."""
    return dict(ep=ep, N=N, E=E, k=k, ranks=launch(_dispatch, ep, N, E, k, seed))


def dispatch_text(d):
    ep, E, k, n = d["ep"], d["E"], d["k"], d["E"] // d["ep"]
    lines = [f"one dispatch, ep = {ep} ranks, E = {E} experts ({n} a rank), top-{k}, {d['N']} tokens a rank; "
             f"token r.t is token t of rank r:"]
    for r, q in enumerate(d["ranks"]):
        pairs = [(p // k, q["chosen"][p // k][p % k]) for p in q["order"]]
        lines += [f"rank {r}: tokens' experts {[f'{r}.{t}->{es}' for t, es in enumerate(q['chosen'])]}",
                  f"  1. sorted by expert: {' '.join(f'{r}.{t}->e{e}' for t, e in pairs)}",
                  f"  2. counts per expert {q['counts']}: {q['send']} rows to ranks 0-{ep - 1}; from them, per "
                  f"local expert, {q['blocks']}",
                  f"  3. received {q['recv']} rows: " + " ".join(f"{v // 10}.{v % 10}" for v in q["rows"]),
                  f"  4. expert e{r * n}..e{r * n + n - 1} each run once on their rows from every rank; 5. the reverse "
                  f"all-to-all brings each row home"]
    return "\n".join(lines)


def dispatch_svg(d):
    """Per rank, left to right: its tokens, its (token, expert) pairs sorted by expert, and the rows its
    experts received, grouped by local expert; a line for every row that travels, in its expert's colour."""
    ep, E, k, N, n = d["ep"], d["E"], d["k"], d["N"], d["E"] // d["ep"]
    colours = [BLUE, ORANGE, GREEN, PURPLE, SKY, VERMILLION, GREY, "#999933"]
    s = Svg(f"The token dispatcher: one dispatch over ep = {ep} ranks, E = {E} experts, top-{k}",
            f"09_expert_parallel.py's dispatch on {ep} CPU ranks: sort by expert, exchange the counts, the uneven "
            f"all-to-all")
    cols = {"tokens": 30, "sorted": 250, "received": 560}
    box_w, box_h, pitch = 150, 22, 28
    band = max(N * k + 1, max(sum(q["recv"]) for q in d["ranks"]) + n / 2) * pitch + 36
    top = 96
    for name, x in (("tokens (chosen experts)", cols["tokens"]), ("1. pairs sorted by expert", cols["sorted"]),
                    ("3. rows received, by local expert", cols["received"])):
        s.text(x, top - 12, name, size=13, font_weight="bold")
    where, travels = {}, []  # (source rank, pair index in its sorted order) -> its box's right end; the lines
    for r in range(ep):  # every rank's sorted pairs first: the lines to a rank start at any rank's
        q, y0 = d["ranks"][r], top + r * band
        for i, p in enumerate(q["order"]):
            where[(r, i)] = (cols["sorted"] + box_w, y0 + 10 + i * pitch + box_h / 2, q["chosen"][p // k][p % k])
    for r, q in enumerate(d["ranks"]):
        y0 = top + r * band
        s.rect(14, y0 - 4, WIDTH - 28, band - 16, fill=PALE, stroke=RULE, rx=8)
        s.text(WIDTH - 24, y0 + 14, f"rank {r}", size=14, anchor="end", font_weight="bold")
        for t, es in enumerate(q["chosen"]):
            s.box(cols["tokens"], y0 + 10 + t * pitch, box_w, box_h, [f"{r}.{t} → " + ", ".join(f"e{e}" for e in es)],
                  size=12)
        for i, p in enumerate(q["order"]):
            t, e = p // k, q["chosen"][p // k][p % k]
            y = y0 + 10 + i * pitch
            s.rect(cols["sorted"], y, box_w, box_h, fill=colours[e % len(colours)], rx=4, class_="pair")
            s.label(cols["sorted"] + box_w / 2, y + box_h / 2, f"{r}.{t} for e{e}", size=12, anchor="middle",
                    fill="white")
        s.text(cols["sorted"], y0 + 10 + len(q["order"]) * pitch + 14, f"2. counts {q['counts']}: send {q['send']}, "
               f"receive {q['recv']}", size=12, fill=GREY)
        # The rows arrive ordered (source rank, local expert): block src n + j starts at start[src n + j]; each
        # expert runs on its blocks from every rank (09's run_experts), drawn here together.
        start = [sum(q["blocks"][:i]) for i in range(len(q["blocks"]))]
        y = y0 + 10
        for j in range(n):
            s.text(cols["received"] + box_w + 12, y + box_h / 2 + 4, f"expert e{r * n + j}", size=12, fill=GREY)
            for src in range(ep):
                for i in range(q["blocks"][src * n + j]):
                    v = q["rows"][start[src * n + j] + i]
                    s.rect(cols["received"], y, box_w, box_h, fill=colours[(r * n + j) % len(colours)], rx=4,
                           class_="row")
                    s.label(cols["received"] + box_w / 2, y + box_h / 2, f"{v // 10}.{v % 10} from rank {src}", size=12,
                            anchor="middle", fill="white")
                    # its place in the sender's sorted pairs: after what src sent to lower ranks and to e < this one
                    sender = d["ranks"][src]
                    at = sum(sender["send"][:r]) + sum(q["blocks"][src * n + jj] for jj in range(j)) + i
                    x1, y1, e = where[(src, at)]
                    travels.append((x1 + 2, y1, cols["received"] - 2, y + box_h / 2, colours[e % len(colours)]))
                    y += pitch
            y += pitch / 2
    for x1, y1, x2, y2, colour in travels:
        s.line(x1, y1, x2, y2, stroke=colour, stroke_width=1.2, class_="travel")
    y = top + ep * band + 8
    for note in ["Each rank sorts its pairs by expert, so that the rows for rank j are one block; the counts' all-to-all "
                 "tells every rank how many",
                 "rows it will receive from each rank for each of its experts; the uneven all-to-all moves them, each "
                 "expert runs once on its rows,",
                 "and the reverse all-to-all (the backward of this one) brings every row back to its token, weighted by "
                 "its router probability."]:
        s.text(16, y, note, size=13, fill=GREY)
        y += 20
    s.height = y + 6
    return s.render()


# ----------------------------------------------------------------------------------------------
# The command line


def tidy(text):
    """No blanks at the ends of lines: the figures are copied into docs/DIAGRAMS.md, whose editors
    strip them, and a test compares the two."""
    return "\n".join(line.rstrip() for line in text.splitlines())


# ----------------------------------------------------------------------------------------------
# Sizes: every figure drawn at other sizes too (an exam's variant), each checked before anything runs


SIZED = {  # figure: {size: its default, the size of the committed SVG}; a figure not here has none
    "f-and-g": {"tp": 2},
    "sequence-parallel": {"tp": 2},
    "grid": {"tp": 2, "dp": 2, "pp": 2},
    "schedules": {"pp": 4, "m": 8, "v": 2},
    "bubble": {"pp": 4},
    "memory": {"pp": 4, "m": 8, "v": 2},
    "overlap": {"dp": 2},
    "zero": {"dp": 4},
    "ring-step": {"cp": 4, "step": 1},
    "balance-contiguous": {"cp": 4},
    "balance-megatron": {"cp": 4},
    "balance-lightseq": {"cp": 4},
    "fold": {"tp": 2, "dp": 2, "pp": 2, "ep": 4, "experts": 8},
    "fold-cp": {"tp": 2, "cp": 2, "dp": 2, "pp": 1, "ep": 4, "experts": 8},
    "dispatch": {"ep": 2, "experts": 4, "topk": 2, "tokens": 4},
}
SIZE_HELP = {"tp": "tensor-parallel ranks", "dp": "data-parallel replicas", "pp": "pipeline stages",
             "m": "microbatches per step", "v": "model chunks per stage (interleaving)",
             "cp": "context-parallel ranks", "step": "the ring step drawn", "ep": "expert-parallel ranks",
             "experts": "experts per MoE layer (E)", "topk": "experts per token (k)",
             "tokens": "tokens per rank"}
MAX_RANKS = 8  # the figures that run ranks (memory, overlap, zero, dispatch) start at most this many CPU processes


def size_errors(name, z):
    """Why figure `name` cannot be drawn at sizes z ({size: value}, all of its sizes): a list of
    sentences, each naming the flag, its value and the constraint (empty: it can). Checked before any
    computing, so that a bad size is refused at once, not by a stack trace from a rank."""
    errors = []

    def need(ok, size, why):  # size: the flag to blame, or None for the sizes together
        if not ok:
            flags = f"--{size} {z[size]}" if size else " ".join(f"--{k} {v}" for k, v in z.items())
            errors.append(f"{name}: {flags}: {why}")
    for size, value in z.items():  # every size is a count of at least 1 (of 2 for the parallel ones)
        low = 0 if size == "step" else 2 if size in ("cp", "ep", "m", "v", "experts") or \
            (size == "pp" and name in ("schedules", "bubble", "memory")) or \
            (size in ("tp", "dp") and name in ("f-and-g", "sequence-parallel", "overlap", "zero")) else 1
        need(value >= low, size, f"must be at least {low}")
    if errors:
        return errors
    if name in ("f-and-g", "sequence-parallel"):
        need(z["tp"] <= 8, "tp", "at most 8 (a lane per rank)")
    elif name == "grid":
        wide = z["pp"] * (120 * z["tp"] + 36) + 96 * (z["pp"] - 1)  # the stages side by side, as grid_svg lays them
        need(wide <= 800, "pp" if z["pp"] > 1 else "tp", f"pp x tp = {z['pp']} x {z['tp']} ranks a row is {wide} px "
             f"wide: at most 800 px fit the {WIDTH} px figure (pp stages of tp ranks side by side)")
        world = z["tp"] * z["dp"] * z["pp"]
        groups = gpt3d.rank_grid(world, z["tp"], z["dp"], z["pp"]) if world <= 64 else None  # integers: at once
        longest = max(text_width(head + str(groups[k]), 13) for k, head in GRID_LEGEND.items()) if groups else math.inf
        need(48 + longest <= WIDTH, None, f"the world tp x dp x pp = {world}: its groups do not fit a line of the "
             f"legend (at most {WIDTH} px)")
    elif name in ("schedules", "memory"):
        need(z["v"] <= 4, "v", "at most 4 chunks per stage")
        need(z["m"] % z["pp"] == 0, "m", f"must be a multiple of --pp {z['pp']} (03's interleaving runs "
             f"microbatches in groups of pp)")
        if name == "schedules":
            need(z["pp"] <= 16, "pp", "at most 16 (a row per rank)")
            need(z["m"] <= 64, "m", "at most 64")
            span = (z["m"] + z["pp"] - 1) * z["v"]
            need(span <= 135, "m", f"(m + pp - 1) v = {span} must be at most 135: a chunk's forward at least 2 px wide "
                 f"on the 1F1B step's time scale")
        else:
            layers = MEMORY_CFG.n_layer
            need(layers % (z["pp"] * z["v"]) == 0 and z["pp"] <= MAX_RANKS, "pp" if layers % z["pp"] else "v",
                 f"pp x v = {z['pp']} x {z['v']} must divide the model's {layers} layers (02's split_layers), "
                 f"pp at most {MAX_RANKS} CPU ranks")
            need(z["m"] <= 32, "m", "at most 32")
    elif name == "bubble":
        need(z["pp"] <= 16, "pp", "at most 16 (m runs over pp, 2 pp, ... 8 pp)")
    elif name in ("overlap", "zero"):
        need(z["dp"] <= MAX_RANKS, "dp", f"at most {MAX_RANKS} CPU ranks")
    elif name == "ring-step":
        need(z["cp"] <= 4, "cp", f"at most 4 (a {170} px box per rank side by side in {WIDTH} px)")
        need(1 <= z["step"] < z["cp"], "step", f"must be 1 to cp - 1 = {z['cp'] - 1} (step 0 exchanges nothing)")
    elif name.startswith("balance-"):
        need(z["cp"] <= 6, "cp", "at most 6 (a bar per rank on the work axis)")
    elif name in ("fold", "fold-cp"):
        block, what = (z["tp"] * z["cp"], "tp x cp") if name == "fold-cp" else (z["tp"] * z["dp"], "tp x dp")
        need(z["ep"] == block, "ep", f"must be {what} = {block}: the figure shows the fold in which an ep group is "
             f"{'one tp x cp block' if name == 'fold-cp' else 'a whole stage'}")
        need(z["experts"] % z["ep"] == 0, "experts", f"must be a multiple of --ep {z['ep']} (E/ep experts a rank)")
        need(z["pp"] * (190 * z["tp"] + 30) <= 860, "pp" if z["pp"] > 1 else "tp",
             f"pp x tp = {z['pp']} x {z['tp']} boxes a row do not fit the {WIDTH} px figure")
        rows = z["dp"] * (z["cp"] if name == "fold-cp" else 1)
        need(rows <= 8, "dp", f"{'cp x dp' if name == 'fold-cp' else 'dp'} = {rows} rows: at most 8")
    elif name == "dispatch":
        need(z["ep"] <= 4, "ep", "at most 4 CPU ranks (a band each)")
        need(z["experts"] % z["ep"] == 0 and z["experts"] <= 8, "experts", f"must be a multiple of --ep {z['ep']} and "
             f"at most 8 (a colour each)")
        need(z["topk"] <= z["experts"], "topk", f"at most --experts {z['experts']}")
        need(z["tokens"] <= 10, "tokens", "at most 10 (token t of rank r is drawn as r.t)")
    return errors


def figure(name, **sizes):
    """(data(), text(data), svg(data)) of figure `name` at `sizes` (the rest at SIZED's defaults, which
    draw the committed SVG); ValueError with size_errors' sentences if it cannot be drawn at them."""
    z = {**SIZED.get(name, {}), **sizes}
    if set(z) != set(SIZED.get(name, {})):
        raise ValueError(f"{name} takes no size {sorted(set(z) - set(SIZED.get(name, {})))}")
    errors = size_errors(name, z)
    if errors:
        raise ValueError("; ".join(errors))
    if name == "f-and-g":
        return lambda: None, lambda _: f_and_g_text(z["tp"]), lambda d: f_and_g_svg(d, tp=z["tp"])
    if name == "sequence-parallel":
        return (lambda: None, lambda _: sequence_parallel_text(z["tp"]),
                lambda d: sequence_parallel_svg(d, tp=z["tp"]))
    if name == "grid":
        return (lambda: None, lambda _: grid_text(z["tp"], z["dp"], z["pp"]),
                lambda d: grid_svg(d, z["tp"], z["dp"], z["pp"]))
    if name == "schedules":
        return lambda: schedules_data(z["pp"], z["m"], z["v"]), schedules_text, schedules_svg
    if name == "bubble":
        ms = tuple(k * z["pp"] for k in (1, 2, 3, 4, 6, 8))  # pp = 4: 4, 8, 12, 16, 24, 32
        return (lambda: bubble_data(z["pp"], ms), lambda d: bubble_text(d, z["pp"]),
                lambda d: bubble_svg(d, z["pp"]))
    if name == "memory":
        return (lambda: memory_data(z["pp"], z["m"], v=z["v"]), lambda d: memory_text(d, z["pp"], z["m"]),
                lambda d: memory_svg(d, z["pp"], z["m"]))
    if name == "overlap":
        return lambda: overlap_data(z["dp"]), lambda d: overlap_text(d, z["dp"]), lambda d: overlap_svg(d, z["dp"])
    if name == "zero":
        return lambda: zero_data(z["dp"]), zero_text, zero_svg
    if name == "ring-step":
        return lambda: ring_step_data(z["cp"], z["step"]), ring_step_text, ring_step_svg
    if name.startswith("balance-"):
        return lambda: balance_data(name[len("balance-"):], z["cp"]), balance_text, balance_svg
    if name in ("fold", "fold-cp"):
        return (lambda: fold_data(z["tp"], z["dp"], z["pp"], z["ep"], z["experts"], z.get("cp", 1)), fold_text,
                fold_svg)
    if name == "dispatch":
        return lambda: dispatch_data(z["ep"], z["tokens"], z["experts"], z["topk"]), dispatch_text, dispatch_svg
    raise KeyError(name)


FIGURES = {name: figure(name) for name in SIZED}  # name: (data, text, svg) at the committed sizes
TIMED = {"overlap"}  # a real run's times: its SVG differs on every run


def write_svg(path, svg):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(svg)
    return path


def variant(name, z):
    """The SVG's file name: NAME.svg at the committed sizes, else NAME-pp8-m16.svg (the sizes that differ),
    so that the variants of one figure can share a folder."""
    changed = "".join(f"-{k}{v}" for k, v in z.items() if v != SIZED.get(name, {}).get(k))
    return f"{name}{changed}.svg"


def sizes_epilog():
    """The help's list of which figures take which sizes, from SIZED (so it cannot drift)."""
    lines = ["sizes (each figure's defaults are the committed SVG's; other sizes draw a variant, NAME-pp8-m16.svg,",
             "into --svg-dir, which must then be given: docs/figures/ keeps the committed ones):"]
    for name, z in SIZED.items():
        lines.append(f"    {name:<19}" + " ".join(f"--{k} {v}" for k, v in z.items()))
    lines.append("e.g.: python3 scripts/figures.py schedules --pp 8 --m 16 --svg-dir /tmp/exam")
    return "\n".join(lines)


def main(argv=None, out=print):
    parser = argparse.ArgumentParser(description=__doc__, epilog=sizes_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figures", nargs="*", choices=[[]] + list(FIGURES), metavar="FIGURE",
                        help=f"any of {', '.join(FIGURES)} (default: all)")
    parser.add_argument("--svg-dir", default=None, help="the folder for the SVGs (default: docs/figures/ "
                        "of this repository, the committed ones)")
    parser.add_argument("--no-svg", action="store_true", help="text only")
    for size, what in SIZE_HELP.items():
        takers = [n for n, z in SIZED.items() if size in z]
        parser.add_argument(f"--{size}", type=int, default=None, metavar="N",
                            help=f"{what}: a size of {', '.join(takers)}")
    args = parser.parse_args(argv)
    names = args.figures or list(FIGURES)
    given = {size: getattr(args, size) for size in SIZE_HELP if getattr(args, size) is not None}
    errors, plans = [], []
    for size in given:  # a size that none of the figures asked for takes: refused, with who takes it
        if not any(size in SIZED[n] for n in names):
            takers = [n for n, z in SIZED.items() if size in z]
            errors.append(f"--{size} {given[size]}: not a size of {', '.join(names)} "
                          f"(it is one of {', '.join(takers)})")
    for name in names:
        z = {**SIZED[name], **{k: v for k, v in given.items() if k in SIZED[name]}}
        errors += size_errors(name, z)
        plans.append((name, z))
    if args.svg_dir is None and not args.no_svg and any(variant(n, z) != f"{n}.svg" for n, z in plans):
        errors.append("sizes other than the defaults draw a variant: give --svg-dir (or --no-svg); docs/figures/ "
                      "keeps the committed figures only")
    if errors:
        parser.error("\n  ".join([""] + errors))
    svg_dir = args.svg_dir or SVG_DIR
    torch.set_num_threads(1)  # tiny models: a second thread only waits for a core (the ranks use one too)
    if not args.no_svg:
        os.makedirs(svg_dir, exist_ok=True)
    for name, z in plans:
        ignored = [f"--{k}" for k in given if k not in z]
        if ignored:  # asked for another figure of this command: said, not silently dropped
            out(f"({name} takes no {', '.join(ignored)}: drawn at its own sizes)\n")
        make, text, svg = figure(name, **z)
        data = make()
        out(f"=== {name} ===\n{tidy(text(data))}\n")
        if not args.no_svg:
            path = write_svg(os.path.join(svg_dir, variant(name, z)), svg(data))
            out(f"wrote {path}" + (" (a timed run: it differs every time)" if name in TIMED else "") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
