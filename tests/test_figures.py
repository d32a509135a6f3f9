"""scripts/figures.py and plumbing/charts.py: the course's figures come from the simulator and from real
CPU runs, say what they should, and are the ones docs/DIAGRAMS.md shows, as text and as the SVGs
committed in docs/figures/.

Exact comparisons throughout: the bubble is a Fraction from 02's simulator, the activation bytes
are counted (not timed) by 02's ActivationMeter, the grid and the ZeRO-1 partition are integers,
and every SVG but one is compared byte for byte with what the script draws today; only the overlap
figure is timed, and for it only its structure is checked. Each figure's data is made once for the
whole file (the `data` fixture): the memory figure runs 4 CPU ranks, the overlap figure 2.
"""
import importlib.util
import xml.etree.ElementTree as ET
from fractions import Fraction

import pytest

from conftest import ROOT
from plumbing import charts

DIAGRAMS = (ROOT / "docs" / "DIAGRAMS.md").read_text()
SVG_DIR = ROOT / "docs" / "figures"
SVGS = sorted(path.stem for path in SVG_DIR.glob("*.svg"))  # the committed figures
TIMED = "overlap"  # a real run's times: its SVG differs on every run
NS = {"svg": "http://www.w3.org/2000/svg"}


@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data(figures):
    """data(name): the figure's data as the script makes it, made once per file (the overlap run
    with 2 steps, not 3: one to warm up is enough for its structure)."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = figures.overlap_data(steps=2) if name == "overlap" else figures.FIGURES[name][0]()
        return made[name]
    return get


def svg_of(figures, data, name):
    return figures.FIGURES[name][2](data(name))


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


def test_the_simulated_bubble_equals_the_formula_for_every_m_and_v_and_the_doc_shows_this_table(figures, data):
    bubble = data("bubble")
    for v, rows in bubble.items():
        assert [(m, s) for m, s, _ in rows] == [(m, Fraction(3, v * m)) for m, _, _ in rows]  # pp = 4
    text = figures.tidy(figures.bubble_text(bubble))
    assert "every simulated bubble equals its formula" in text and "  32 |           3/32     3/32" in text
    assert text in DIAGRAMS


def test_activation_memory_per_stage_follows_the_microbatches_in_flight_and_the_doc_shows_it(figures, data):
    memory = data("memory")  # pp = 4, m = 8, on 4 CPU ranks
    gpipe, ofob, inter = memory.values()
    assert ofob[0] * 2 == gpipe[0]  # 1F1B keeps pp = 4 of GPipe's m = 8 microbatches on stage 0
    assert ofob == sorted(ofob, reverse=True)  # and pp - stage on stage `stage`: less further down
    assert all(o < i < g for o, i, g in zip(ofob, inter, gpipe))  # interleaving pays for its bubble
    assert figures.tidy(figures.memory_text(memory)) in DIAGRAMS


def test_the_overlap_figure_is_a_real_run_whose_buckets_launch_during_backward(figures, data):
    start, end, events, n = data("overlap")
    launch = {i: t for kind, i, t in events if kind == "launch"}
    done = {i: t for kind, i, t in events if kind == "done"}
    assert sorted(launch) == sorted(done) == list(range(n)) and n > 2
    assert all(launch[i] <= done[i] for i in range(n)) and launch[0] < end  # the first one overlaps backward
    text = figures.overlap_text((start, end, events, n))
    assert sum(line.startswith("bucket ") for line in text.splitlines()) == n
    assert "launched before backward finished" in text


def test_the_grid_and_the_zero1_partition_are_drawn_from_05_and_04_and_the_doc_shows_them(figures, data):
    grid = figures.tidy(figures.grid_text())
    assert "replica 0  | rank 0  rank 1 | --> | rank 4  rank 5 |" in grid
    assert "dp groups, a column of a box (the gradient all-reduce): [[0, 2], [1, 3], [4, 6], [5, 7]]" in grid
    assert grid in DIAGRAMS
    z = data("zero")
    for i, (lo, hi) in enumerate(z["buckets"]):
        assert [z["shards"][q][i] for q in range(4)] == [(lo + q * (hi - lo) // 4, lo + (q + 1) * (hi - lo) // 4)
                                                          for q in range(4)]
    assert figures.tidy(figures.zero_text(z)) in DIAGRAMS


def test_the_1f1b_and_interleaved_timelines_share_one_time_scale_with_the_formulas_bubbles(figures, data):
    pp, m, v, runs = data("schedules")  # pp = 4, m = 8, v = 2
    one, inter = runs.values()
    assert (one.bubble, inter.bubble) == (Fraction(pp - 1, m), Fraction(pp - 1, v * m))
    assert one.step_time > inter.step_time  # the same work, v times less fill and drain
    assert figures.tidy(figures.schedules_text((pp, m, v, runs))) in DIAGRAMS


def test_the_operators_text_copies_are_what_the_script_prints(figures):
    for text in (figures.f_and_g_text(), figures.sequence_parallel_text()):
        assert figures.tidy(text) in DIAGRAMS
    # Korthikanti et al. 2022, Figure 5: g all-gathers T into the tensor-parallel region, g-bar reduce-scatters it out
    ops = {name: (fn, fwd, bwd) for name, fn, fwd, bwd in figures.SP_OPS}
    assert ops == {"g": ("gather_from_sp", "all-gather T", "reduce-scatter T"),
                   "g-bar": ("reduce_scatter_to_sp", "reduce-scatter T", "all-gather T")}


# ----------------------------------------------------------------------------------------------
# The SVGs in docs/figures: regenerated by the script, embedded in docs/DIAGRAMS.md


def test_every_figure_has_a_committed_svg_and_every_committed_svg_is_a_figure(figures):
    assert SVGS == sorted(figures.FIGURES)


@pytest.mark.parametrize("name", [n for n in SVGS if n != TIMED])
def test_each_committed_svg_is_byte_for_byte_what_the_script_draws_today(figures, data, name):
    committed = (SVG_DIR / f"{name}.svg").read_bytes()
    assert committed == svg_of(figures, data, name).encode("utf-8"), \
        f"docs/figures/{name}.svg is not what the code draws today: python3 scripts/figures.py {name}"


@pytest.mark.parametrize("name", SVGS)
def test_each_svg_is_xml_with_a_title_a_white_page_and_a_fixed_width(name):
    root = ET.parse(SVG_DIR / f"{name}.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    width, height = int(root.get("width")), int(root.get("height"))
    assert 800 <= width <= 960 and root.get("viewBox") == f"0 0 {width} {height}"
    assert root.find("svg:title", NS).text.strip()  # what slide tools and screen readers show
    page = root.find("svg:rect", NS)  # the first drawn element: a white page under everything
    assert (page.get("width"), page.get("height"), page.get("fill")) == (str(width), str(height), "white")
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert root.find("svg:title", NS).text in texts  # the title is drawn, too
    assert all(int(t.get("font-size")) >= 11 for t in root.iter("{http://www.w3.org/2000/svg}text"))


def overlap_rows(svg):
    """(bucket bars, bucket row labels, backward bars) of an overlap SVG."""
    root = ET.fromstring(svg)
    rects = list(root.iter("{http://www.w3.org/2000/svg}rect"))
    labels = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text") if t.text.startswith("bucket ")]
    return ([r for r in rects if r.get("class") == "bucket"], labels,
            [r for r in rects if r.get("class") == "backward"])


def test_the_overlap_svg_draws_backward_and_one_bar_per_bucket_of_a_real_run(figures, data):
    n = data("overlap")[3]
    bars, labels, backward = overlap_rows(svg_of(figures, data, "overlap"))
    assert len(bars) == len(labels) == n > 2 and len(backward) == 1
    assert labels == [f"bucket {i}" for i in range(n)] and all(float(r.get("width")) > 0 for r in bars)
    # The committed one is another run (the times differ), of the same model and buckets.
    assert [len(x) for x in overlap_rows((SVG_DIR / "overlap.svg").read_text(encoding="utf-8"))] == [n, n, 1]


def test_the_timelines_svg_draws_every_action_of_both_schedules_with_its_microbatch(figures, data):
    pp, m, v, runs = data("schedules")
    root = ET.fromstring(svg_of(figures, data, "schedules"))
    boxes = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("class") in ("F", "B")]
    assert len(boxes) == 2 * pp * m * (1 + v)  # a forward and a backward per microbatch, stage and chunk
    assert sum(r.get("class") == "F" for r in boxes) == len(boxes) // 2
    assert len({r.get("fill") for r in boxes}) == 4  # forward and backward, first and second chunk


def test_docs_diagrams_embeds_every_svg_by_its_relative_path():
    for name in SVGS:
        assert f"](figures/{name}.svg)" in DIAGRAMS, name


# ----------------------------------------------------------------------------------------------
# The command line: text always, SVGs unless --no-svg


def test_the_command_line_prints_each_figure_and_writes_its_svg_where_asked(figures, tmp_path):
    lines = []
    assert figures.main(["grid", "f-and-g", "--svg-dir", str(tmp_path)], out=lines.append) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f-and-g.svg", "grid.svg"]
    for name in ("grid", "f-and-g"):
        assert (tmp_path / f"{name}.svg").read_bytes() == (SVG_DIR / f"{name}.svg").read_bytes()
        assert any(line.startswith(f"=== {name} ===") for line in lines)
    assert f"wrote {tmp_path / 'grid.svg'}\n" in lines
    assert figures.tidy(figures.grid_text()) in "".join(lines)


def test_no_svg_prints_the_text_and_writes_nothing(figures, tmp_path):
    lines = []
    assert figures.main(["grid", "--no-svg", "--svg-dir", str(tmp_path / "none")], out=lines.append) == 0
    assert not (tmp_path / "none").exists() and lines[0].startswith("=== grid ===")


def test_08s_ring_step_and_balance_figures_come_from_its_lists_and_the_doc_shows_them(figures, data):
    sched, step, msgs = data("ring-step")  # Megatron's split, cp = 4, step 1: kv from the visitor only
    assert step == 1 and all(src == (dst - 1) % 4 and kind == "kv" for src, dst, kind, _ in msgs)
    assert figures.tidy(figures.ring_step_text(data("ring-step"))) in DIAGRAMS
    factors = {name: data(f"balance-{name}")[1].factor for name in ("contiguous", "megatron", "lightseq")}
    assert factors == {"contiguous": Fraction(7, 4), "megatron": 1, "lightseq": Fraction(5, 4)}
    for name in factors:
        text = figures.tidy(figures.balance_text(data(f"balance-{name}")))
        assert f"balance factor {float(factors[name]):.2f}" in text and text in DIAGRAMS
    assert "  q3   0.1  3.2  3.1  3.0" in figures.balance_text(data("balance-lightseq"))  # rank 0 helps rank 3


def test_the_fold_and_the_dispatch_are_drawn_from_09_and_the_doc_shows_them(figures, data):
    fold = figures.tidy(figures.fold_text(data("fold")))
    assert "ep groups:  [[0, 1, 2, 3], [4, 5, 6, 7]]" in fold and "ep rank e holds experts 0: 0-1" in fold
    assert fold in DIAGRAMS
    d = data("dispatch")
    for r, q in enumerate(d["ranks"]):  # every pair sent once, every row received once: what the counts say
        assert sum(q["send"]) == d["N"] * d["k"] and sum(q["recv"]) == len(q["rows"]) == sum(q["blocks"])
        mine = range(r * d["E"] // d["ep"], (r + 1) * d["E"] // d["ep"])
        want = sorted(10 * s + t for s, other in enumerate(d["ranks"]) for t, es in enumerate(other["chosen"])
                      for e in es if e in mine)
        assert sorted(q["rows"]) == want
    svg = svg_of(figures, data, "dispatch")
    assert svg.count('class="travel"') == d["ep"] * d["N"] * d["k"]  # a line for every row that travels
    assert figures.tidy(figures.dispatch_text(d)) in DIAGRAMS


def test_the_fold_onto_08s_grid_is_drawn_from_09_with_each_ep_group_a_tp_x_cp_block(figures, data):
    grid, _ = data("fold-cp")
    assert grid["ep"] == grid["tp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and grid["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    fold = figures.tidy(figures.fold_text(data("fold-cp")))
    assert "attention: tp 2 x cp 2 x dp 2 x pp 1 (08's grid" in fold and "(each ep group is one tp x cp block)" in fold
    assert fold in DIAGRAMS
    svg = svg_of(figures, data, "fold-cp")
    assert svg.count('class="ep"') == 2 and "attention: t1 · c1 · d1" in svg


# ----------------------------------------------------------------------------------------------
# Sizes: every figure at other sizes (an exam's variant), refused before anything runs when it cannot be drawn


def slide_ready(svg):
    """The checks every committed SVG passes (above), on an SVG's text: its root."""
    root = ET.fromstring(svg)
    width, height = int(root.get("width")), int(root.get("height"))
    assert 800 <= width <= 960 and root.get("viewBox") == f"0 0 {width} {height}" and height > 0
    page = root.find("svg:rect", NS)
    assert (page.get("width"), page.get("height"), page.get("fill")) == (str(width), str(height), "white")
    assert root.find("svg:title", NS).text in [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    return root


def test_every_figure_has_its_sizes_and_the_defaults_are_the_committed_figures(figures):
    assert sorted(figures.SIZED) == sorted(figures.FIGURES) == SVGS
    help_text = figures.sizes_epilog()  # --help's list, from the same table
    for name, sizes in figures.SIZED.items():
        assert figures.variant(name, sizes) == f"{name}.svg"
        assert f"    {name:<19}" + " ".join(f"--{k} {v}" for k, v in sizes.items()) in help_text


def test_schedules_at_pp_8_and_m_16_draws_8_rows_and_every_pass_with_the_formulas_bubbles(figures, tmp_path):
    lines = []
    assert figures.main(["schedules", "--pp", "8", "--m", "16", "--svg-dir", str(tmp_path)], out=lines.append) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["schedules-pp8-m16.svg"]  # the committed name is left alone
    svg = (tmp_path / "schedules-pp8-m16.svg").read_text(encoding="utf-8")
    root = slide_ready(svg)
    assert svg != (SVG_DIR / "schedules.svg").read_text(encoding="utf-8")
    rows = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text") if t.text.startswith("rank ")]
    assert rows == [f"rank {r}" for r in range(8)] * 2  # 8 rows for each of the two schedules
    boxes = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("class") in ("F", "B")]
    assert len(boxes) == 2 * 8 * 16 * (1 + 2)  # a forward and a backward per microbatch, stage and chunk
    text = "".join(lines)
    assert "bubble 7/16 = (pp-1)/m" in text and "bubble 7/32 = (pp-1)/(v m)" in text


def test_the_bubble_at_another_pp_equals_the_formula_at_that_pp(figures):
    make, text, svg = figures.figure("bubble", pp=8)
    data = make()
    assert [m for m, _, _ in data[1]] == [8, 16, 24, 32, 48, 64]  # pp, 2 pp, ... 8 pp: 03's lists need m % pp = 0
    for v, rows in data.items():
        assert [s for _, s, _ in rows] == [Fraction(7, v * m) for m, _, _ in rows]
    assert "pp=8" in text(data) and "every simulated bubble equals its formula" in text(data)
    root = slide_ready(svg(data))
    assert len([c for c in root.iter("{http://www.w3.org/2000/svg}circle") if c.get("class") == "simulated"]) == 18


@pytest.mark.parametrize("name,sizes", [("grid", dict(tp=4, pp=1)), ("f-and-g", dict(tp=4)),
                                        ("ring-step", dict(cp=3, step=2)), ("balance-lightseq", dict(cp=5)),
                                        ("fold", dict(tp=1, dp=4)), ("fold-cp", dict(dp=1, pp=2, experts=4))])
def test_the_figures_without_ranks_draw_a_different_valid_figure_at_other_sizes(figures, name, sizes):
    make, text, svg = figures.figure(name, **sizes)
    data = make()
    drawn = svg(data)
    slide_ready(drawn)
    assert drawn != (SVG_DIR / f"{name}.svg").read_text(encoding="utf-8")
    if name == "grid":  # tp 4 x dp 2 x pp 1: a tp group of 4 in each of 2 rows
        assert "tp groups, a row of a stage (adjacent ranks, one node: NVLink): [[0, 1, 2, 3], [4, 5, 6, 7]]" in drawn
    if name == "balance-lightseq":
        assert len(data[1].totals) == 5 and sum(data[1].totals) == Fraction(5 * 5, 2)  # cp^2/2 blocks of work
    if name == "ring-step":
        assert all(src == (dst - 2) % 3 for src, dst, _, _ in data[2])  # step 2: from the rank 2 before


def refusal(figures, argv, capsys):
    """main(argv)'s refusal: its message (argparse's, exit status 2), nothing drawn."""
    with pytest.raises(SystemExit) as exit_:
        figures.main(argv, out=lambda line: pytest.fail(f"drew before refusing: {line}"))
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,said", [
    (["schedules", "--pp", "1"], "schedules: --pp 1: must be at least 2"),  # below a size's least
    (["schedules", "--m", "10"], "schedules: --m 10: must be a multiple of --pp 4"),  # 03's interleaving's rule
    (["ring-step", "--cp", "5"], "ring-step: --cp 5: at most 4"),  # the figure's width
    (["ring-step", "--step", "4"], "ring-step: --step 4: must be 1 to cp - 1 = 3"),
    (["grid", "--pp", "3"], "grid: --pp 3: pp x tp = 3 x 2 ranks a row is 1020 px wide: at most 800 px"),
    (["fold", "--ep", "2"], "fold: --ep 2: must be tp x dp = 4"),  # a size against another
    (["dispatch", "--experts", "6", "--ep", "4"], "dispatch: --experts 6: must be a multiple of --ep 4"),
    (["memory", "--pp", "3", "--m", "6"], "memory: --pp 3: pp x v = 3 x 2 must divide the model's 8 layers"),
    (["grid", "--m", "16"], "--m 16: not a size of grid (it is one of schedules, memory)"),  # no figure asked takes it
    (["schedules", "--pp", "8", "--m", "16"], "give --svg-dir (or --no-svg)"),  # a variant into docs/figures: no
])
def test_a_size_a_figure_cannot_take_is_refused_by_flag_value_and_rule_before_anything_runs(figures, capsys,
                                                                                            monkeypatch, argv, said):
    monkeypatch.setattr(figures, "launch", lambda *a, **k: pytest.fail("ranks started before the refusal"))
    assert said in refusal(figures, argv, capsys)


def test_a_size_that_only_some_of_the_figures_take_is_said_for_the_others(figures, tmp_path):
    lines = []
    assert figures.main(["grid", "f-and-g", "--pp", "1", "--no-svg"], out=lines.append) == 0
    assert "(f-and-g takes no --pp: drawn at its own sizes)\n" in lines
    assert "world 4 = tp 2 x dp 2 x pp 1" in "".join(lines)


def test_the_figures_with_ranks_run_them_at_the_asked_sizes(figures):
    make, text, svg = figures.figure("memory", pp=2, m=4)  # 2 CPU ranks
    memory = make()
    gpipe, ofob, inter = memory.values()
    assert len(gpipe) == 2 and ofob[0] * 2 == gpipe[0]  # 1F1B keeps pp = 2 of GPipe's m = 4 on stage 0
    assert "pp=2, m=4" in text(memory) and slide_ready(svg(memory)) is not None
    make, text, svg = figures.figure("dispatch", experts=6, topk=3, tokens=5)  # ep = 2 CPU ranks
    d = make()
    assert (d["E"], d["k"], d["N"]) == (6, 3, 5)
    for q in d["ranks"]:
        assert sum(q["send"]) == 5 * 3 and sum(q["recv"]) == len(q["rows"])  # every pair sent once
    drawn = svg(d)
    assert drawn.count('class="travel"') == 2 * 5 * 3 and slide_ready(drawn) is not None
