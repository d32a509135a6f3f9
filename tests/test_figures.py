"""scripts/figures.py and plumbing/charts.py: the course's figures come from the simulator and from real
CPU runs, say what they should, and are the ones docs/DIAGRAMS.md shows.

Exact comparisons throughout: the bubble is a Fraction from 02's simulator, the activation bytes
are counted (not timed) by 02's ActivationMeter, the grid and the ZeRO-1 partition are integers;
only the overlap timeline is timed, and for it only its structure is checked. matplotlib is
optional: the PNG path is run with a stand-in pyplot that records each call, and the path without
it too.
"""
import importlib.util
from fractions import Fraction

import pytest

from conftest import ROOT
from plumbing import charts

DIAGRAMS = (ROOT / "docs" / "DIAGRAMS.md").read_text()


@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------
# The terminal charts


def test_bars_share_one_scale_and_headings_have_no_bar():
    text = charts.bars([("stage 0", None), ("  a", 100), ("  b", 50), ("  c", 0)], width=10)
    assert text.splitlines() == ["stage 0", "  a |##########| 100", "  b |#####     | 50", "  c |          | 0"]


def test_the_bucket_timeline_draws_backward_each_launch_and_each_completion_on_one_axis():
    events = [("ready", 3, 1.000), ("launch", 0, 1.001), ("ready", 2, 1.004), ("done", 0, 1.006),
              ("ready", 1, 1.007), ("launch", 1, 1.009), ("ready", 0, 1.010), ("launch", 2, 1.012),
              ("done", 1, 1.012), ("done", 2, 1.016)]
    lines = charts.bucket_timeline(1.0, 1.010, events, 3, width=17).splitlines()
    assert lines[0] == " " * 19 + "|0.0" + " " * 10 + "16.0|  ms after backward began"
    # One column per ms: backward runs over columns 0-10, a '|' where a gradient arrives.
    assert lines[1] == "backward           ||===|==|==|      | 0.0 to 10.0"
    assert lines[2] == "bucket 0           | L----D          | launched 1.0, done by 6.0"
    assert lines[3] == "bucket 1           |         L--D    | launched 9.0, done by 12.0"
    assert lines[4] == "bucket 2           |            L---D| launched 12.0, done by 16.0"
    assert lines[5] == "2 of 3 launched before backward finished"


def test_a_bucket_never_launched_and_one_not_seen_done_are_said_so():
    lines = charts.bucket_timeline(0.0, 1.0, [("launch", 0, 0.5)], 2, width=11).splitlines()
    assert lines[2].endswith("| launched 500.0") and "L" in lines[2] and "D" not in lines[2]
    assert lines[3].endswith("| never launched") and lines[-1] == "1 of 2 launched before backward finished"


# ----------------------------------------------------------------------------------------------
# The figures, and the copies of them in docs/DIAGRAMS.md


def test_the_simulated_bubble_equals_the_formula_for_every_m_and_v_and_the_doc_shows_this_table(figures):
    data = figures.bubble_data()
    for v, rows in data.items():
        assert [(m, s) for m, s, _ in rows] == [(m, Fraction(3, v * m)) for m, _, _ in rows]  # pp = 4
    text = figures.tidy(figures.bubble_text(data))
    assert "every simulated bubble equals its formula" in text and "  32 |           3/32     3/32" in text
    assert text in DIAGRAMS


def test_activation_memory_per_stage_follows_the_microbatches_in_flight_and_the_doc_shows_it(figures):
    data = figures.memory_data()  # pp = 4, m = 8, on 4 CPU ranks
    gpipe, ofob, inter = data.values()
    assert ofob[0] * 2 == gpipe[0]  # 1F1B keeps pp = 4 of GPipe's m = 8 microbatches on stage 0
    assert ofob == sorted(ofob, reverse=True)  # and pp - stage on stage `stage`: less further down
    assert all(o < i < g for o, i, g in zip(ofob, inter, gpipe))  # interleaving pays for its bubble
    assert figures.tidy(figures.memory_text(data)) in DIAGRAMS


def test_the_overlap_figure_is_a_real_run_whose_buckets_launch_during_backward(figures):
    start, end, events, n = figures.overlap_data(steps=2)
    launch = {i: t for kind, i, t in events if kind == "launch"}
    done = {i: t for kind, i, t in events if kind == "done"}
    assert sorted(launch) == sorted(done) == list(range(n)) and n > 2
    assert all(launch[i] <= done[i] for i in range(n)) and launch[0] < end  # the first one overlaps backward
    text = figures.overlap_text((start, end, events, n))
    assert sum(line.startswith("bucket ") for line in text.splitlines()) == n
    assert "launched before backward finished" in text


def test_the_grid_and_the_zero1_partition_are_drawn_from_05_and_04_and_the_doc_shows_them(figures):
    grid = figures.tidy(figures.grid_text())
    assert "replica 0  | rank 0  rank 1 | --> | rank 4  rank 5 |" in grid
    assert "dp groups, a column of a box (the gradient all-reduce): [[0, 2], [1, 3], [4, 6], [5, 7]]" in grid
    assert grid in DIAGRAMS
    z = figures.zero_data()
    for i, (lo, hi) in enumerate(z["buckets"]):
        assert [z["shards"][q][i] for q in range(4)] == [(lo + q * (hi - lo) // 4, lo + (q + 1) * (hi - lo) // 4)
                                                          for q in range(4)]
    assert figures.tidy(figures.zero_text(z)) in DIAGRAMS


# ----------------------------------------------------------------------------------------------
# The command line: PNGs with matplotlib, text without


class FakePyplot:
    """Records every call on the figure and axes; savefig writes the file (a PNG stand-in)."""

    def __init__(self):
        self.calls = []

    def subplots(self, *args, **kwargs):
        return self.Recorder(self.calls), self.Recorder(self.calls)

    def close(self, fig):
        pass

    class Recorder:
        def __init__(self, calls):
            self.calls = calls

        def __getattr__(self, method):
            def call(*args, **kwargs):
                self.calls.append((method, args, kwargs))
                if method == "savefig":
                    with open(args[0], "w") as f:
                        f.write("png")
                return [self] if method == "plot" else None
            return call

        def get_color(self):
            return "C0"


def test_with_matplotlib_each_plot_is_a_png_with_the_formula_beside_the_points(figures, tmp_path, monkeypatch, capsys):
    plt = FakePyplot()
    monkeypatch.setattr(figures, "pyplot", lambda: plt)
    assert figures.main(["bubble", "grid", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "bubble.png").read_text() == "png" and not (tmp_path / "grid.png").exists()
    plots = [(args[2], kw["label"]) for name, args, kw in plt.calls if name == "plot"]
    assert [style for style, _ in plots] == ["-", "o"] * 3  # per v: the formula's line, then the simulated points
    assert plots[0][1] == "(pp-1)/(v m), v=1" and plots[-1][1] == "simulated, v=4"
    assert f"wrote {tmp_path / 'bubble.png'}" in capsys.readouterr().out


def test_without_matplotlib_the_text_is_printed_and_an_explicit_out_fails(figures, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(figures, "pyplot", lambda: None)
    assert figures.main(["grid"]) == 0
    out = capsys.readouterr().out
    assert "=== grid ===" in out and "pip install matplotlib" in out
    assert figures.main(["grid", "--out", str(tmp_path)]) == 1 and not list(tmp_path.iterdir())
