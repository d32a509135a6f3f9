"""The docs agree with the code: every demo excerpt, count and figure that README.md, docs/GUIDE.md
and docs/COURSE.md quote is what the code prints today, or what a test checks.

- Excerpts. Each ```text block of those files follows a comment naming the command that printed
  it, `<!-- output of: python3 02_pipeline_1f1b.py -->`. Each command runs once for this whole file
  (a demo of a few seconds on 2 cores; `demo_output` caches it) and every line of the excerpt must
  be a line of its output, in the same order. A line "..." skips output; a line ending in " ..."
  is the start of an output line. What differs from run to run is masked on both sides: times,
  bucket launch times, the measured idle time, replica checksums (weight bits, which another CPU's
  kernels may round differently) and differences from serial below 1e-10 (float64 rounding: a
  mistake would be O(1)). Measured timelines are never quoted.
- The main job, `python3 05_3d_gpt.py`, trains 200 steps in about a minute: too long for a test. Its
  start-up summary and its per-step figures (p2p bytes per message, activation bytes, the first
  loss) are checked against a run of one step. Its final figures (the last train loss, the eval
  loss, the sums probe) and the loss chart come from the full run: they are checked to be the ones
  BENCHMARKS.md records for that run, and to be quoted alike in README.md and GUIDE.md.
- Counts in the prose ("13 in all", "3/16", "9 of 9 launched", ...) are listed in CLAIMS, each with
  the words that quote it and how the code's output gives it: a doc that says another number, or
  stops saying it, fails.
- Links. Every relative link in README.md and docs/*.md names a file that exists, relative to the
  file the link is in.
"""
import difflib
import re
from dataclasses import dataclass

import pytest

from conftest import ROOT, load, script_output

DOCS = ["README.md", "docs/GUIDE.md", "docs/COURSE.md"]
MAIN_JOB = "python3 05_3d_gpt.py"
# What each command of an excerpt runs here: the cheap demos as they are, the main job for one step.
RUNS = {
    "python3 01_tensor_parallel.py": ("01_tensor_parallel.py",),
    "python3 01_tensor_parallel.py --sequence-parallel": ("01_tensor_parallel.py", "--sequence-parallel"),
    "python3 02_pipeline_1f1b.py": ("02_pipeline_1f1b.py",),
    "python3 03_interleaved.py": ("03_interleaved.py",),
    "python3 04_data_parallel.py": ("04_data_parallel.py",),
    "python3 09_expert_parallel.py": ("09_expert_parallel.py",),
    "python3 09_expert_parallel.py --tp 2 --cp 2 --dp 1": ("09_expert_parallel.py", "--tp", "2", "--cp", "2", "--dp", "1"),
    MAIN_JOB: ("05_3d_gpt.py", "--steps", "1"),  # its eval runs at the last step: the summary is the same
    "python3 06_zero_bubble.py": ("06_zero_bubble.py",),
    "python3 07_vocab_parallel.py": ("07_vocab_parallel.py",),
    "python3 08_context_parallel.py": ("08_context_parallel.py",),
}
_outputs = {}


def demo_output(command):
    """The finished run of `command` (a key of RUNS), run once per test session (conftest's
    script_output, shared with test_answers.py): a subprocess.CompletedProcess whose stdout is what
    a reader sees."""
    if command not in _outputs:
        proc = script_output(*RUNS[command], timeout=80)
        assert proc.returncode == 0, f"{command} failed:\n{proc.stderr[-3000:]}"
        _outputs[command] = proc
    return _outputs[command]


def text(doc):
    return (ROOT / doc).read_text(encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# Excerpts


@dataclass
class Excerpt:
    doc: str
    line: int  # of the fence, 1-based
    command: str
    lines: list  # the block's lines, the fence's indentation removed


def excerpts(doc):
    """Every ```text block of `doc`, with the command its comment names ("" if none)."""
    lines, found = text(doc).splitlines(), []
    for i, line in enumerate(lines):
        fence = re.fullmatch(r"( *)```text", line)
        if not fence:
            continue
        indent, before = len(fence[1]), [x for x in lines[:i] if x.strip()]
        named = re.fullmatch(r"\s*<!-- output of: (.+?) -->", before[-1]) if before else None
        body = []
        for x in lines[i + 1:]:
            if x.strip() == "```":
                break
            body.append(x[min(indent, len(x) - len(x.lstrip(" "))):])
        found.append(Excerpt(doc, i + 1, named[1] if named else "", body))
    return found


EXCERPTS = [e for doc in DOCS for e in excerpts(doc)]


def _masked_number(m):
    return "<float64 rounding>" if float(m[0]) < 1e-10 else m[0]


MASKS = [  # (pattern, replacement), applied to every line of the doc and of the output
    (re.compile(r"\b\d\.\d\de[-+]\d\d\b"), _masked_number),  # differences from serial
    (re.compile(r"\b\d+\.\d+ ms\b"), "<t> ms"),  # 01's forward+backward times
    (re.compile(r"measured idle / busy: [\d.]+"), "measured idle / busy: <x>"),  # 02, 03
    (re.compile(r"'[0-9a-f]{12}'"), "'<checksum>'"),  # 04's replicas: equal to each other is checked
    (re.compile(r"^(backward|bucket \d+)( +)\|.*$"), r"\1\2|<timeline>"),  # 04's bucket chart
    (re.compile(r"^( +)\|0\.0 .*ms after backward began$"), r"\1|<axis>"),
    (re.compile(r"^training  \d+ steps"), "training  <steps> steps"),  # 05: a run of one step
]


def mask(line):
    for pattern, replacement in MASKS:
        line = pattern.sub(replacement, line)
    return line.rstrip()


def find_in_order(quoted, printed):
    """The first quoted line (masked) that is not a line of `printed` after the previous one's
    match, with the printed line nearest to it; None if every one is there, in order."""
    out, at = [mask(x) for x in printed], 0
    for line in quoted:
        want = mask(line)
        if not want.strip() or want.strip() == "...":
            continue
        prefix = want.endswith(" ...")
        hit = next((i for i in range(at, len(out)) if (out[i].startswith(want[:-3]) if prefix else out[i] == want)),
                   None)
        if hit is None:
            near = difflib.get_close_matches(want, out[at:], n=1, cutoff=0.0)
            return want, near[0] if near else "(nothing after the previous line)"
        at = hit + 1
    return None


# The main job's lines that only its full 200-step run prints: the progress bar, the final line,
# the chart and the sums probe.
FULL_RUN = re.compile(r"^(train:|done:|sums,|\s*[\d.]* +\||\s+\+-+$|\s+0\s+step\s+\d+$|\s+\* train loss)")


def test_every_excerpt_names_the_command_that_prints_it():
    unnamed = [f"{e.doc}:{e.line}" for e in EXCERPTS if not e.command]
    assert not unnamed, f"```text blocks without a '<!-- output of: COMMAND -->' line before them: {unnamed}"
    unknown = {f"{e.doc}:{e.line}": e.command for e in EXCERPTS if e.command not in RUNS}
    assert not unknown, f"commands this file does not know how to run (add a cheap one to RUNS): {unknown}"
    assert {e.command for e in EXCERPTS} == set(RUNS), "a command of RUNS that no doc quotes: drop it"


@pytest.mark.parametrize("excerpt", EXCERPTS, ids=[f"{e.doc}:{e.line}" for e in EXCERPTS])
def test_each_excerpt_is_what_its_command_prints_today(excerpt):
    quoted = [x for x in excerpt.lines if not (excerpt.command == MAIN_JOB and FULL_RUN.match(x))]
    missing = find_in_order(quoted, demo_output(excerpt.command).stdout.splitlines())
    assert missing is None, (f"{excerpt.doc}:{excerpt.line} quotes a line that `{excerpt.command}` does not "
                             f"print (or not in this order):\n  quoted:  {missing[0]!r}\n  nearest: {missing[1]!r}")


def test_the_masks_keep_what_matters_and_a_changed_figure_fails():
    printed = ["  all-reduce       g      transformer.wte forward   (4, 32, 64)   64.0 KiB",
               "layer 0: 2 forward and 2 backward collectives; 13 in all, 643.0 KiB",
               "PASS: worst relative difference 1.32e-15 (tolerance 1e-10)"]
    assert find_in_order(["...", "layer 0: 2 forward and 2 backward collectives; 13 in all, ...",
                          "PASS: worst relative difference 2.00e-16 (tolerance 1e-10)"], printed) is None
    assert find_in_order(["layer 0: 2 forward and 2 backward collectives; 12 in all, 643.0 KiB"], printed)
    assert find_in_order(["PASS: worst relative difference 1.32e-05 (tolerance 1e-10)"], printed)
    assert find_in_order(["layer 0: 2 forward and 2 backward collectives; 13 in all, 643.0 KiB",
                          "  all-reduce       g      transformer.wte forward   (4, 32, 64)   64.0 KiB"], printed)


# ----------------------------------------------------------------------------------------------
# The main job's figures from its full run


def main_job_excerpts():
    return [e for e in EXCERPTS if e.command == MAIN_JOB]


def benchmarks_main_job():
    """BENCHMARKS.md's row for the main job: (first loss, last loss, eval loss, sums seen, of,
    held-out right, of)."""
    row = next(line for line in text("BENCHMARKS.md").splitlines() if line.startswith("| `time python 05_3d_gpt.py`"))
    losses = re.search(r"([\d.]+) → ([\d.]+), eval ([\d.]+)", row)
    sums = re.search(r"(\d+) of (\d+) seen, (\d+) of (\d+) held out", row)
    return (*losses.groups(), *sums.groups())


def test_the_main_jobs_final_figures_are_those_benchmarks_records_for_its_full_run():
    first, last, evaluated, seen, of_seen, held, of_held = benchmarks_main_job()
    short, steps = demo_output(MAIN_JOB).stdout, load("05_3d_gpt").TrainConfig().steps
    assert f"loss {first} -> " in short  # the first step's loss, which a run of one step prints too
    charts = set()
    assert main_job_excerpts(), "no doc quotes the main job any more: drop this test"
    for e in main_job_excerpts():
        block = "\n".join(e.lines)
        where = f"{e.doc}:{e.line}"
        assert f"done: {steps} steps in " in block and f"; loss {first} -> {last}; eval loss {evaluated}" in block, where
        bar = re.search(r"\| (\d+)/(\d+) \[[^\]]*loss=([\d.]+), [^\]]*eval=([\d.]+)\]", block)
        assert bar and bar.groups() == (str(steps), str(steps), last, evaluated), where
        training = re.search(r"^training  (\d+) steps", block, re.M)
        assert training is None or training[1] == str(steps), where  # masked in the comparison
        assert f"{seen}/{of_seen} right of those in the corpus, {held}/{of_held} of the held-out" in block, where
        chart = [x.rstrip() for x in e.lines if FULL_RUN.match(x) and "|" in x and not x.startswith("train:")]
        assert chart[0].split("|")[0].strip() == f"{float(first):.2f}", where  # the chart's top: the first loss
        charts.add(tuple(chart))
    assert len(charts) == 1, "README.md and GUIDE.md quote different charts of the same run"


# ----------------------------------------------------------------------------------------------
# Counts and figures quoted in the prose


def collectives(command):
    """01's list of collectives: (op, operator, layer, direction, shape, KiB) per line."""
    pattern = re.compile(r"^  (all-reduce \(max\)|all-reduce|all-gather|reduce-scatter) +(\S+) +(\S+) "
                         r"(forward|backward) +(\([\d, ]*\)) +([\d.]+) KiB$")
    return [m.groups() for m in map(pattern.match, demo_output(command).stdout.splitlines()) if m]


def ints(command, label, index=0):
    """The index-th list of integers printed after `label` by `command`."""
    found = re.findall(re.escape(label) + r"\s*\[([\d, ]+)\]", demo_output(command).stdout)
    return [int(x) for x in found[index].split(",")]


def line_with(command, pattern, index=0):
    """The groups of the index-th match of `pattern` in what `command` prints."""
    return re.findall(pattern, demo_output(command).stdout)[index]


def loss_collectives_with_the_trainers_switches():
    """(loss all-reduces, collectives in all) of 01's demo model, forward and backward at tp = 2,
    with the optimization 05's trainer turns on (tensor_parallel.optimize: --overlap-input-grad)."""
    if "optimized" not in _outputs:
        from plumbing.launch import launch
        _outputs["optimized"] = launch(_optimized_collectives, 2, timeout_s=20, deadline_s=60)[0]
    return _outputs["optimized"]


def _optimized_collectives(env):
    import torch
    from plumbing.trace import trace_comm
    tensor_parallel = load("01_tensor_parallel")
    flags = tensor_parallel.parser().parse_args([])  # the demo's model, as it runs with no flags
    cfg = tensor_parallel.GPTConfig(**{k: getattr(flags, k) for k in ("vocab_size", "block_size", "n_layer",
                                                                       "n_head", "n_embd", "dropout")})
    model = tensor_parallel.optimize(tensor_parallel.GPT(cfg, tensor_parallel.new_tp_group(env, 2),
                                                         dtype=torch.float64))
    idx = torch.randint(cfg.vocab_size, (flags.batch_size, flags.seq_len), generator=torch.Generator().manual_seed(0))
    with trace_comm(model) as log:
        model(idx, idx)[1].backward()
    return sum(c.operator == "_VocabParallelCrossEntropy" for c in log), len(log)


TP, SP, PIPE, INTER, DP = (f"python3 {n}" for n in ("01_tensor_parallel.py", "01_tensor_parallel.py --sequence-parallel",
                                                     "02_pipeline_1f1b.py", "03_interleaved.py", "04_data_parallel.py"))
ZB, VOCAB = "python3 06_zero_bubble.py", "python3 07_vocab_parallel.py"


def paper_figure(what):
    """06's figure `what` (its row of "the paper's figures"), as printed: the simulated value."""
    return re.search(rf"^  {re.escape(what)} +(\S.*?) +formula", demo_output(ZB).stdout, re.M)[1]


def entries(listed):
    """The entries of a printed list, "[9, 9, 9, 9]", as a set of strings."""
    return set(listed.strip("[]").split(", "))


def imbalance(V, index):
    """07's compute imbalance at vocabulary V printed with thousands separators: index 0 without, 1 with."""
    block = demo_output(VOCAB).stdout.split(f"=== V = {V} ")[1]
    return re.search(r"compute ([\d.]+x) -> ([\d.]+x)", block)[index + 1]


def faster(V):
    block = demo_output(VOCAB).stdout.split(f"=== V = {V} ")[1]
    return re.search(r"\(([\d.]+x) faster\)", block)[1]


def count(rows, **where):
    keys = ("op", "operator", "layer", "direction", "shape", "kib")
    return str(sum(all(row[keys.index(k)] == v for k, v in where.items()) for row in rows))


def one(values):
    """The value every row agrees on."""
    assert len(values) == 1, f"not one value: {values}"
    return values.pop()


def b_T_C_halved():
    """(b, T, C) of the main job's pipeline message, which it prints as b*T*C elements halved by tp."""
    out = demo_output(MAIN_JOB).stdout
    b, T, C = (int(re.search(pattern, out)[1]) for pattern in (r"microbatches of b=(\d+)", r" x T=(\d+) ", r" C=(\d+),"))
    whole, sent = line_with(MAIN_JOB, r"b\*T\*C = ([\d,]+) elements, /tp = ([\d,]+)")
    assert int(whole.replace(",", "")) == b * T * C == 2 * int(sent.replace(",", ""))
    return str(b), str(T), str(C)


def simulated_step(name):
    """02's simulated step time of schedule `name` at the demo's pp and m (t_f = 1, t_b = 2, as the demo draws)."""
    pipeline, (pp, m) = load("02_pipeline_1f1b"), (int(x) for x in line_with(PIPE, r"pp=(\d) m=(\d) "))
    return pipeline.simulate(pipeline.Schedule([pipeline.SCHEDULES[name](pp, m, r) for r in range(pp)])).step_time


def last_stage_activations():
    """(GPipe's last-stage peak, m, 1F1B's last-stage peak, b, T, V, b T V float64 bytes) from 02's demo: GPipe's
    last stage holds m times 1F1B's, whose one microbatch in flight holds the loss's saved (b T, V) softmax."""
    gpipe, one_f_one_b = (ints(PIPE, "outputs deallocated:", i)[-1] for i in (0, 1))
    m, B = (int(x) for x in line_with(PIPE, r"pp=\d m=(\d+) global batch B=(\d+) "))
    T, V = int(line_with(PIPE, r" T=(\d+) float64")), int(line_with(PIPE, r"vocab_size=(\d+)"))
    b = B // m
    return tuple(map(str, (gpipe if gpipe == m * one_f_one_b else "not m times 1F1B's", m, one_f_one_b, b, T, V,
                           b * T * V * 8)))


def loss_kib(command):
    """The KiB of 01's lesson's loss: its g's one all-reduce, in (model) forward."""
    return one({r[5] for r in collectives(command) if r[1] == "g" and r[2] == "(model)"})


def in_all(command):
    return line_with(command, r"; (\d+) in all, ([\d.]+) KiB")


def benchmarks(i):
    return benchmarks_main_job()[i]


@dataclass
class Claim:
    doc: str
    words: str  # a regular expression over the doc's text, whitespace collapsed; its groups are the figures
    value: object  # () -> what the code says those groups must be (a string, or a tuple of them)


CLAIMS = [
    # README.md
    Claim("README.md", r"The \*\*bubble\*\* (\S+) is \(pp - 1\)/m with pp = (\d) stages and m = (\d) microbatches",
          lambda: (line_with(MAIN_JOB, r"pipeline bubble \(pp-1\)/\(v m\) = (\S+)"),
                   *line_with(MAIN_JOB, r"pp (\d) x dp \d; 1F1B, m=(\d)"))),
    Claim("README.md", r"b·T·C = (\d+)·(\d+)·(\d+) elements, halved by scatter/gather",
          lambda: b_T_C_halved()),
    Claim("README.md", r"the loss falling from (\S+) to about (\S+)\.",
          lambda: (f"{float(benchmarks(0)):.2f}", f"{float(benchmarks(1)):.2f}")),
    Claim("README.md", r"a byte-level loss of ([\d.]+)\)", lambda: f"{float(benchmarks(1)):.2f}"),
    Claim("README.md", r"(\w+) sums \(\"1 plus 8\", .* and their mirrors\) never occur in the corpus",
          lambda: {"9": "Nine"}.get(benchmarks(6), benchmarks(6))),
    Claim("README.md", r"the same losses \(([\d.]+) to ([\d.]+)\)", lambda: (benchmarks(0), benchmarks(1))),
    # docs/GUIDE.md
    Claim("docs/GUIDE.md", r"`python3 01_tensor_parallel.py` \(tp = (\d), a (\d)-layer GPT-2 with V = (\d+), "
                           r"B = (\d+), T = (\d+)\)",
          lambda: (line_with(TP, r"tp=(\d) "), line_with(TP, r"n_layer=(\d)"), line_with(TP, r"vocab_size=(\d+)"),
                   *line_with(TP, r" B=(\d+) T=(\d+) "))),
    Claim("docs/GUIDE.md", r"2 each way per layer is the paper's Figure 3; (\d+) in all\. Each full-size one moves "
                           r"B T C float64 = ([\d.]+) KiB",
          lambda: (in_all(TP)[0], one({f"{float(r[5]):g}" for r in collectives(TP) if r[4] == "(4, 32, 64)"}))),
    Claim("docs/GUIDE.md", r"\*\*Parameters on rank 0: (\d+%)\*\*", lambda: line_with(TP, r"\((\d+%)\)")),
    Claim("docs/GUIDE.md", r"The small backward all-reduces \(([\d.]+) KiB each\)",
          lambda: next(r[5] for r in collectives(SP) if r[0] == "all-reduce" and r[3] == "backward")),
    Claim("docs/GUIDE.md", r"less the loss's ([\d.]+) KiB, ([\d.]+) is about twice ([\d.]+)\.",
          lambda: (f"{float(loss_kib(TP)):g}", f"{float(in_all(SP)[1]) - float(loss_kib(SP)):g}",
                   f"{float(in_all(TP)[1]) - float(loss_kib(TP)):g}")),
    Claim("docs/GUIDE.md", r"`python3 02_pipeline_1f1b.py` \(pp = (\d), m = (\d), a (\d)-layer GPT-2\)",
          lambda: (*line_with(PIPE, r"pp=(\d) m=(\d) "), line_with(PIPE, r"n_layer=(\d)"))),
    Claim("docs/GUIDE.md", r"the paper's formula: (\S+) for both schedules",
          lambda: line_with(PIPE, r"bubble: simulated (\S+) ") if len(set(re.findall(
              r"bubble: simulated (\S+) ", demo_output(PIPE).stdout))) == 1 else "not the same for both"),
    Claim("docs/GUIDE.md", r"GPipe holds all (\d) on every stage, 1F1B pp - stage = (\[[\d, ]+\])",
          lambda: (str(ints(PIPE, "in flight per stage (simulated):", 0)[0]) if len(set(ints(PIPE, "in flight per stage (simulated):", 0))) == 1 else "not all",
                   str(ints(PIPE, "in flight per stage (simulated):", 1)))),
    Claim("docs/GUIDE.md", r"GPipe's stage 0 holds (twice) 1F1B's \((\d+) bytes\)",
          lambda: ("twice" if ints(PIPE, "outputs deallocated:", 0)[0] == 2 * ints(PIPE, "outputs deallocated:", 1)[0]
                   else "not twice", str(ints(PIPE, "outputs deallocated:", 0)[0]))),
    Claim("docs/GUIDE.md", r"The row is (\d+) columns for the step's (\d+) time units",
          lambda: ("100", str(one({str(simulated_step(name)) for name in ("gpipe", "1f1b")})))),
    Claim("docs/GUIDE.md", r"\*\*The last stage's GPipe figure\*\* \((\d+) bytes\) is about twice the others': it is "
                           r"(\d+) microbatches of (\d+) bytes \(1F1B's last stage, with 1 in flight\), .* b T V float64 = "
                           r"(\d+) x (\d+) x (\d+) x 8 = (\d+) bytes",
          lambda: last_stage_activations()),
    Claim("docs/GUIDE.md", r"(\d+) sends from the first and last stage, (\d+) from the middle ones, b T C float64 = "
                           r"(\d+) KiB each",
          lambda: (str(ints(PIPE, "p2p messages sent per stage:")[0]), str(ints(PIPE, "p2p messages sent per stage:")[1]),
                   str(ints(PIPE, "bytes:")[0] // ints(PIPE, "p2p messages sent per stage:")[0] // 1024))),
    Claim("docs/GUIDE.md", r"`python3 03_interleaved.py` \(pp = (\d), v = (\d), m = (\d), (\d) layers\)",
          lambda: (*line_with(INTER, r"pp=(\d) v=(\d) m=(\d) "), line_with(INTER, r"n_layer=(\d)"))),
    Claim("docs/GUIDE.md", r"\*\*The bubbles\*\*: (\S+) against (\S+), both equal to their formulas",
          lambda: line_with(INTER, r"bubble: 1F1B (\S+) .*, interleaved (\S+) ")),
    Claim("docs/GUIDE.md", r"falls by less than the bubble \(([\d.]+x)\)", lambda: line_with(INTER, r"\(([\d.]+x)\)")),
    Claim("docs/GUIDE.md", r"instead of pp - 1, ([\d.]+) times as many messages",
          lambda: line_with(INTER, r"p2p messages: .*\(([\d.]+)x, expected")),
    Claim("docs/GUIDE.md", r"on rank 0, (\d+) chunks of half a stage in flight against 1F1B's (\d+) whole stages, "
                           r"([\d.]+) times the activations",
          lambda: (*line_with(INTER, r"(\d+) chunks of 1/2 stage in flight = \(v\+1\) pp - 1, against 1F1B's (\d+) "),
                   line_with(INTER, r"measured on rank 0: ([\d.]+)\)"))),
    Claim("docs/GUIDE.md", r"`python3 04_data_parallel.py` \(dp = (\d), (\d) AdamW steps, (\d) microbatches per "
                           r"replica\)",
          lambda: line_with(DP, r"dp=(\d) steps=(\d) .*\(m=(\d) microbatches per replica\)")),
    Claim("docs/GUIDE.md", r"all (\d+) launch before backward ends",
          lambda: line_with(DP, r"(\d+) of \1 launched before backward finished")),
    Claim("docs/GUIDE.md", r"ZeRO-1 keeps ([\d.]+) of plain AdamW's, 1/dp",
          lambda: line_with(DP, r"ZeRO-1 [\d,]+ bytes \(([\d.]+), 1/dp")),
    Claim("docs/GUIDE.md", r"the bubble \(pp - 1\)/\(v m\) = (\S+) from the simulator",
          lambda: line_with(MAIN_JOB, r"pipeline bubble \(pp-1\)/\(v m\) = (\S+) \(simulated")),
    Claim("docs/GUIDE.md", r"b T C elements = ([\d,]+), halved to ([\d,]+) by scatter/gather",
          lambda: line_with(MAIN_JOB, r"b\*T\*C = ([\d,]+) elements, /tp = ([\d,]+)")),
    Claim("docs/GUIDE.md", r"from ([\d.]+) \(about ln 256\) down to about ([\d.]+)\.",
          lambda: (f"{float(benchmarks(0)):.2f}", f"{float(benchmarks(1)):.2f}")),
    Claim("docs/GUIDE.md", r"`python3 06_zero_bubble.py` \(pp = (\d), m = (\d), an (\d)-layer GPT-2\)",
          lambda: (*line_with(ZB, r"pp=(\d) m=(\d) "), line_with(ZB, r"n_layer=(\d)"))),
    Claim("docs/GUIDE.md", r"the idle time per rank falls from (\d+) for 1F1B to (\d+) for ZB-H1, a third, and ZB-V idles "
                           r"nowhere inside a rank's span; the bubble from (\S+) to (\S+);",
          lambda: (one(entries(paper_figure("1F1B idle per rank"))), one(entries(paper_figure("ZB-H1 idle per rank"))),
                   paper_figure("bubble, 1F1B"), paper_figure("bubble, ZB-H1"))),
    Claim("docs/GUIDE.md", r"ZB-V holds 2pp = (\d+) half-stage chunks on every rank\. The simulated step times: 1F1B (\S+), "
                           r"ZB-H1 (\S+), ZB-V (\S+)\.",
          lambda: (one(entries(paper_figure("peak memory, ZB-V (chunks)"))),
                   *line_with(ZB, r"simulated step time: 1F1B (\S+), ZB-H1 (\S+), ZB-V (\S+)"))),
    Claim("docs/GUIDE.md", r"ZB-H1 holds exactly r M_W more than 1F1B on rank r, M_W = ([\d,]+) bytes",
          lambda: line_with(ZB, r"more than 1F1B on rank r: \[[\d, ]+\] = r x ([\d,]+)  \(equal\)")),
    Claim("docs/GUIDE.md", r"`python3 07_vocab_parallel.py` \(pp = (\d) x tp = (\d) on (\d) CPU ranks, m = (\d), an (\d)-layer "
                           r"GPT-2 with V = (\d+)\)",
          lambda: (*line_with(VOCAB, r"pp=(\d) tp=(\d) m=\d "), line_with(VOCAB, r"world=(\d) "),
                   line_with(VOCAB, r"pp=\d tp=\d m=(\d) "), line_with(VOCAB, r"n_layer=(\d)"),
                   line_with(VOCAB, r"vocab_size=(\d+)"))),
    Claim("docs/GUIDE.md", r"compute ([\d.]+x) at V = 1001 and ([\d.]+x) at V = 32768, both ([\d.]+x) with vocabulary",
          lambda: (imbalance("1,001", 0), imbalance("32,768", 0), one({imbalance("1,001", 1), imbalance("32,768", 1)}))),
    Claim("docs/GUIDE.md", r"\(02's simulator, each stage's time from the same FLOPs\): ([\d.]+x) faster at V = 1001, "
                           r"([\d.]+x) at V = 32768",
          lambda: (faster("1,001"), faster("32,768"))),
    Claim("docs/GUIDE.md", r"V padded from (\d+) to (\d+), a multiple of pp tp = (\d)",
          lambda: line_with(VOCAB, r"V = (\d+) padded to (\d+) over (\d) ranks")),
    # docs/COURSE.md
    Claim("docs/COURSE.md", r"# the (\d+) exercises", lambda: str(sum(len(load("exercises").exercises(f))
                                                                      for f in load("exercises").FILES))),
    Claim("docs/COURSE.md", r"every difference, every collective \((\d+)\)", lambda: in_all(TP)[0]),
    Claim("docs/COURSE.md", r"and why the demo lists (\d+) in all", lambda: in_all(TP)[0]),
]


def _worked_cross_entropy(env, logits, target):
    import torch
    tensor_parallel = load("01_tensor_parallel")
    group = tensor_parallel.new_tp_group(env, 2)
    mine = torch.tensor([logits], dtype=torch.float64).chunk(2, 1)[env.rank]
    return float(tensor_parallel.vocab_parallel_cross_entropy(mine, torch.tensor([target]), group, len(logits)))


def test_guide_01s_worked_cross_entropy_is_what_01s_function_and_the_arithmetic_give():
    import math
    import torch
    from plumbing.launch import launch
    prose = " ".join(text("docs/GUIDE.md").split())
    m = re.search(r"Worked, one row, V = 4, tp = 2: logits \[(\S+), (\S+) \| (\S+), (\S+)\], target (\d) .*?The MAX "
                  r"is (\S+); less it, rank 0 holds \[(\S+), (\S+)\] and rank 1 \[(\S+), (\S+)\]\. Rank 0's target "
                  r"logit is (\S+) \(not its column\), rank 1's (\S+); their sums of exponentials are ([\d.]+) and "
                  r"([\d.]+)\. The stacked all-reduce gives (\S+) and ([\d.]+), so the loss is ln [\d.]+ - \(\S+\) = "
                  r"([\d.]+), F.cross_entropy's", prose)
    assert m, "GUIDE 01's worked cross-entropy example no longer reads as this test expects"
    x = [float(v) for v in m.groups()]
    logits, t = x[:4], int(x[4])
    top = max(logits)
    shifted = [v - top for v in logits]
    halves = shifted[:2], shifted[2:]
    picked = [h[t - 2 * r] if 0 <= t - 2 * r < 2 else 0.0 for r, h in enumerate(halves)]
    sums = [sum(math.exp(v) for v in h) for h in halves]
    loss = math.log(sum(sums)) - sum(picked)
    assert x[5] == top and x[6:10] == shifted and x[10:12] == picked
    assert x[12:14] == [round(s, 3) for s in sums] and x[14] == sum(picked) and x[15] == round(sum(sums), 3)
    whole = float(torch.nn.functional.cross_entropy(torch.tensor([logits]), torch.tensor([t])))
    ours = launch(_worked_cross_entropy, 2, logits, t, timeout_s=20, deadline_s=60)
    assert x[16] == round(loss, 3) == round(whole, 3) == round(ours[0], 3) == round(ours[1], 3)


def test_the_trainers_switches_make_the_demos_collectives_two_of_them_the_loss():
    # The overlap moves when dX's all-reduce runs, not how many run: the demo's list holds for 05.
    # The machine's loss (the paper's) makes 2 all-reduces where the lesson's g makes 1, in (model): the rest is the list.
    loss, total = loss_collectives_with_the_trainers_switches()
    lesson_loss = int(count(collectives(TP), operator="g", layer="(model)"))
    assert lesson_loss == 1 and (loss, total) == (2, int(in_all(TP)[0]) - lesson_loss + 2)


@pytest.mark.parametrize("claim", CLAIMS, ids=[f"{c.doc}: {c.words[:50]}" for c in CLAIMS])
def test_each_figure_the_prose_quotes_is_what_the_code_prints(claim):
    prose = " ".join(text(claim.doc).split())
    found = re.search(claim.words, prose)
    assert found, f"{claim.doc} no longer says this (update CLAIMS with the doc): {claim.words}"
    want = claim.value()
    want = want if isinstance(want, tuple) else (want,)
    assert found.groups() == tuple(str(x) for x in want), \
        f"{claim.doc} says {found.groups()} where the code gives {want}: {found[0]!r}"


# ----------------------------------------------------------------------------------------------
# Pictures


def test_every_picture_the_docs_embed_is_a_committed_file_at_its_relative_path():
    for doc in DOCS:
        pictures = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text(doc))
        for path in pictures:
            assert not re.match(r"[a-z]+://|/", path), f"{doc}: {path} is not a relative path"
            assert (ROOT / doc).parent.joinpath(path).is_file(), f"{doc}: {path} does not exist"
    guide = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text("docs/GUIDE.md"))  # beside their files' sections
    assert {"figures/f-and-g.svg", "figures/schedules.svg"} <= set(guide)


# ----------------------------------------------------------------------------------------------
# Links


def test_every_relative_link_in_the_readme_and_docs_resolves_to_a_file():
    # A link is relative to the file it is in: `[x](docs/LOSS.md)` inside docs/GUIDE.md points at
    # docs/docs/LOSS.md. Web links and links to a heading of the same file are not files.
    docs = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    assert "docs/GUIDE.md" in docs and "docs/LOSS.md" in docs
    broken = []
    for doc in docs:
        for m in re.finditer(r"\]\(([^)\s]+)\)", text(doc)):
            target = m[1].split("#")[0]
            if re.match(r"[a-z]+:", m[1]) or not target:
                continue
            if not (ROOT / doc).parent.joinpath(target).exists():
                broken.append(f"{doc}:{text(doc)[:m.start()].count(chr(10)) + 1}: {m[1]}")
    assert not broken, "links that resolve to no file:\n" + "\n".join(broken)


# ----------------------------------------------------------------------------------------------
# docs/GUIDE.md's worked order of 03's lesson (issue 47: a reader worked it out by hand), recomputed from
# the lesson's own statements: interleaved_step's warm-up, its forwards' and backwards' order and its steps,
# run as written, over chunk_and_microbatch; then held to 03's machine (interleaved), which runs the same order.

WORKED = dict(pp=2, v=2, m=4)


def lesson_steps(pp, v, m):
    """{rank: (warm-up, [step: [(kind, chunk, microbatch)]])}: interleaved_step's own statements that build its
    steps (the warm-up, fwd and bwd, steps), taken from its source and run for each rank, no process group."""
    import ast
    import inspect
    interleaved = load("03_interleaved")
    tree = ast.parse(inspect.getsource(interleaved.interleaved_step))
    wanted = {"warmup", "fwd", "steps"}
    body = [s for s in ast.walk(tree) if isinstance(s, ast.Assign)
            and wanted & {n.id for t in s.targets for n in ast.walk(t) if isinstance(n, ast.Name)}]
    assert len(body) == 3, "03's interleaved_step no longer builds its steps in the statements this test runs"
    code = compile(ast.Module(body=body, type_ignores=[]), "interleaved_step", "exec")
    out = {}
    for r in range(pp):
        scope = dict(r=r, pp=pp, v=v, m=m, n=m * v, chunk_and_microbatch=interleaved.chunk_and_microbatch)
        exec(code, scope)  # noqa: S102 (the lesson's own three statements)
        out[r] = scope["warmup"], scope["steps"]
    return out


def worked_table(pp, v, m):
    """The Markdown table docs/GUIDE.md shows: the k-th forward's and backward's (chunk, microbatch), the same
    on every rank; then each rank's warm-up count and its steps (a steady step's F and B joined by +)."""
    interleaved, n = load("03_interleaved"), m * v
    cell = lambda kind, c, i: f"{kind}({c},{i})"  # noqa: E731
    lines = ["| k | " + " | ".join(str(k) for k in range(n)) + " |", "|---" * (n + 1) + "|"]
    for forward, kind in ((True, "F"), (False, "B")):
        lines.append(f"| {'forward' if forward else 'backward'} k | "
                     + " | ".join(cell(kind, *interleaved.chunk_and_microbatch(k, pp, v, forward)) for k in range(n)) + " |")
    lines += ["", "| rank r | warm-up 2(pp - r - 1) + (v - 1) pp | warm-up | steady (F + B) | drain |", "|---|---|---|---|---|"]
    for r, (warmup, steps) in lesson_steps(pp, v, m).items():
        parts = [steps[:warmup], steps[warmup:n], steps[n:]]
        shown = [" ".join("+".join(cell(*a) for a in step) for step in part) or "none" for part in parts]
        lines.append(f"| {r} | 2({pp} - {r} - 1) + ({v} - 1) {pp} = {warmup} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def guide_table(chapter, first_row, guide=None):
    """The Markdown table of docs/GUIDE.md's section of chapter (e.g. "03_interleaved.py") whose first row starts
    with first_row (a regex), to its first blank line not followed by another table; None if there is none."""
    section = (guide or text("docs/GUIDE.md")).split(f"\n## {chapter}")[1].split("\n## ")[0]
    found = re.search(rf"\n({first_row}.*?)\n\n(?!\|)", section + "\n\n", re.S)
    return found and found[1].strip()


def guide_worked_table(guide=None):
    return guide_table("03_interleaved.py", r"\| k \|", guide)


def test_the_guides_worked_interleaved_order_is_the_lessons():
    table = worked_table(**WORKED)
    assert guide_worked_table() == table, f"docs/GUIDE.md's 03 worked order is not the lesson's; today's:\n{table}"
    # The lesson's order is its machine's: the same actions, in each rank's order.
    interleaved = load("03_interleaved")
    for r, (_, steps) in lesson_steps(**WORKED).items():
        machine = [(a.kind, a.chunk, a.mb) for a in interleaved.interleaved(WORKED["pp"], WORKED["m"], r, WORKED["v"])]
        assert [a for step in steps for a in step] == machine, r


def test_a_changed_entry_of_the_worked_order_fails():
    guide = text("docs/GUIDE.md")
    table = guide_worked_table(guide)
    for old, new in (("F(1,0)", "F(0,1)"), ("= 4 |", "= 3 |")):
        changed = guide.replace(table, table.replace(old, new, 1))
        assert changed != guide and guide_worked_table(changed) != worked_table(**WORKED), (old, new)


# docs/GUIDE.md's worked messages of 03's lesson (issue 47: a reader worked out by hand what interleaved_step posts),
# recomputed by running interleaved_step itself on each rank, and its own exchange, with the compute, the process
# group and the batch's posting replaced by recorders (as 02's worked order below): at each step, the one batch
# its exchange posts and what the step runs. A rank's sends to a peer are, in order, what that peer receives.


class _Tensor:
    """A message's tensor: a sent one named when it is made (y, dx), a received one when the lesson hands it on."""

    def __init__(self, name="?"):
        self.name = name

    def detach(self):
        return self


def interleaved_events(pp, v, m):
    """{rank: [[posted, ran]]}: one entry per exchange interleaved_step calls (its boundary before a step, then the
    last): posted, the (tensor, "to" or "from", peer) its one batch_isend_irecv holds, in its order; ran, the F(c,i)
    and B(c,i) the step after it runs."""
    import types

    import torch
    interleaved, out = load("03_interleaved"), {}
    for r in range(pp):
        events = []
        dist = types.SimpleNamespace(get_rank=lambda r=r: r, get_world_size=lambda: pp, isend="to", irecv="from",
                                     P2POp=lambda op, t, peer: (t, op, peer),
                                     batch_isend_irecv=lambda ops, events=events: events[-1][0].extend(ops) or [])
        fake_torch = types.SimpleNamespace(empty_like=lambda like: _Tensor())
        exchange = types.FunctionType(interleaved.exchange.__code__, {**vars(interleaved), "dist": dist, "torch": fake_torch})

        def boundary(sends, receives, box, like, events=events, exchange=exchange):
            events.append([[], []])
            exchange(sends, receives, box, like)

        def forward_step(chunk, mb, x, weight, losses, events=events):
            if x is not None:
                x.name = f"x({chunk.c},{mb[1]})"
            events[-1][1].append(f"F({chunk.c},{mb[1]})")
            return (chunk.c, mb[1]), _Tensor(f"y({chunk.c},{mb[1]})")

        def backward_step(ci, y, dy, events=events):
            if dy is not None:
                dy.name = f"dy({ci[0]},{ci[1]})"
            events[-1][1].append(f"B({ci[0]},{ci[1]})")
            return _Tensor(f"dx({ci[0]},{ci[1]})")

        pipeline = types.SimpleNamespace(forward_step=forward_step, backward_step=backward_step,
                                         loss_weights=lambda mbs: [1.0] * len(mbs), sum_tied_grads=lambda chunk: None)
        scope = {**vars(interleaved), "exchange": boundary, "pipeline": pipeline, "dist": dist}
        step = types.FunctionType(interleaved.interleaved_step.__code__, scope)
        chunks = [types.SimpleNamespace(c=c, parameters=lambda: iter([torch.zeros(1)]), cfg=types.SimpleNamespace(n_embd=1))
                  for c in range(v)]
        step(chunks, [(torch.zeros(1, 1), i) for i in range(m)])
        out[r] = events
    return out


def interleaved_messages_table(pp, v, m):
    """The Markdown table docs/GUIDE.md shows: row j, each rank's step j, the batch its exchange posts before it
    ("none" where it posts nothing) and what the step runs (a steady F and B joined by +); a rank's last row, (end),
    is the loop's extra [], whose batch holds the last backward's send."""
    ranks = interleaved_events(pp, v, m)
    head = " | ".join(f"rank {r} posts | rank {r} runs" for r in ranks)
    lines = [f"| step | {head} |", "|---" * (1 + 2 * pp) + "|"]
    for j in range(max(len(events) for events in ranks.values())):
        cells = []
        for events in ranks.values():
            if j >= len(events):
                cells += ["", ""]
                continue
            posted, ran = events[j]
            batch = "[" + ", ".join(f"{t.name} {way} {peer}" for t, way, peer in posted) + "]" if posted else "none"
            cells += [batch, "+".join(ran) or "(end)"]
        lines.append(f"| {j} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def guide_interleaved_messages_table(guide=None):
    return guide_table("03_interleaved.py", r"\| step \| rank 0 posts \|", guide)


def test_the_guides_worked_interleaved_messages_are_the_lessons():
    table = interleaved_messages_table(**WORKED)
    assert guide_interleaved_messages_table() == table, \
        f"docs/GUIDE.md's 03 worked messages are not the lesson's; today's:\n{table}"
    # Each message a rank sends is, in order, the one its peer receives: y(c,i) of stage c pp + r is x(c',i) of
    # stage c pp + r + 1, dx(c,i) is dy(c',i) of stage c pp + r - 1, on that stage's rank.
    # At pp = 2 the stage before and the stage after are on the same rank: pp = 4 tells them apart.
    for run in (WORKED, dict(pp=4, v=2, m=8)):
        pp, sent, received = run["pp"], {}, {}
        for r, events in interleaved_events(**run).items():
            for t, way, peer in (message for posted, _ in events for message in posted):
                if way == "from":
                    received.setdefault((peer, r), []).append(t.name)
                    continue
                kind, c, i = re.fullmatch(r"(y|dx)\((\d+),(\d+)\)", t.name).groups()
                k = int(c) * pp + r + (1 if kind == "y" else -1)
                sent.setdefault((r, k % pp), []).append(f"{'x' if kind == 'y' else 'dy'}({k // pp},{i})")
        assert sent == received, run


def test_a_changed_entry_of_the_worked_interleaved_messages_fails():
    guide = text("docs/GUIDE.md")
    table = guide_interleaved_messages_table(guide)
    for old, new in (("x(1,0) from 1", "x(1,0) from 0"), ("dy(1,0) from 1", "dy(0,0) from 1"), ("| 12 |", "| 11 |")):
        changed = guide.replace(table, table.replace(old, new, 1))
        assert changed != guide and guide_interleaved_messages_table(changed) != interleaved_messages_table(**WORKED), (old, new)


# ----------------------------------------------------------------------------------------------
# docs/GUIDE.md's worked order of 02's 1F1B (issue 47: a reader hand-traced one_f_one_b_step's steady state),
# recomputed by running one_f_one_b_step itself on each rank, its compute and its messages replaced by recorders
# (no process group): what each rank runs, in its order, and each message it posts; the pairs a rank posts as one
# batch (send_recv) in brackets. Each rank's sends to a neighbour are, in order, what that neighbour receives.

WORKED_1F1B = dict(pp=3, m=4)


class _Received:
    """A message received; named when the lesson hands it on (x_i into F_i, dy_i into B_i)."""
    name = "?"


def one_f_one_b_events(pp, m):
    """{rank: [event]}: ("F" or "B", i), or (kind, sent, received, peer) for a message, kind "recv" (recv_from),
    "send" (send_to) or "both" (send_recv), in the order one_f_one_b_step posts them; a peer beyond the first or
    the last stage posts nothing, as the lesson's recv_from, send_to and send_recv do."""
    import types

    import torch
    pipeline, out = load("02_pipeline_1f1b"), {}
    for s in range(pp):
        events, there = [], lambda peer: 0 <= peer < pp

        def message(kind, sent, peer, receives):
            got = _Received() if receives else None
            if there(peer):
                events.append((kind, sent, got, peer))
                return got

        def forward_step(stage, mb, x, weight, losses, events=events):
            if isinstance(x, _Received):
                x.name = f"x{mb[1]}"
            events.append(("F", mb[1]))
            return mb[1], f"y{mb[1]}"

        def backward_step(i, y, dy, events=events):
            if isinstance(dy, _Received):
                dy.name = f"dy{i}"
            events.append(("B", i))
            return f"dx{i}"

        scope = {**vars(pipeline), "forward_step": forward_step, "backward_step": backward_step,
                 "recv_from": lambda src, like, g=None: message("recv", None, src, True),
                 "send_to": lambda t, dst, g=None: message("send", t, dst, False),
                 "send_recv": lambda t, peer, like, g=None: message("both", t, peer, True),
                 "sum_tied_grads": lambda stage, g=None: None,
                 "dist": types.SimpleNamespace(get_rank=lambda g=None, s=s: s, get_world_size=lambda g=None: pp)}
        step = types.FunctionType(pipeline.one_f_one_b_step.__code__, scope)
        stage = types.SimpleNamespace(parameters=lambda: iter([torch.zeros(1)]), cfg=types.SimpleNamespace(n_embd=1),
                                      post_process=s == pp - 1)
        step(stage, [(torch.zeros(1, 1), i) for i in range(m)], None, [1.0] * m)
        out[s] = events
    return out


def one_f_one_b_table(pp, m):
    """The Markdown table docs/GUIDE.md shows: per rank, its warm-up (each forward followed by another forward),
    its steady steps (a forward, then a backward) and its drain (each backward after a backward); a blocking
    receive is written with what it feeds, a send or a batch after what it follows."""
    lines = ["| rank s | warm-up pp - s - 1 | warm-up | steady (a step: F, then B) | drain |", "|---|---|---|---|---|"]
    for s, events in one_f_one_b_events(pp, m).items():
        computes = [e for e in events if e[0] in "FB"]
        phase_of = {}
        for k, e in enumerate(computes):
            before, after = computes[k - 1][0] if k else None, computes[k + 1][0] if k + 1 < len(computes) else None
            phase_of[k] = "warm-up" if e[0] == "F" and after == "F" else "drain" if e[0] == "B" and before != "F" else "steady"
        steps, pending, k = [], [], 0  # steps: [phase, [words]]
        for e in events:
            if e[0] in "FB":
                if e[0] == "F" or phase_of[k] == "drain" or not steps:
                    steps.append([phase_of[k], []])
                steps[-1][1] += pending + [f"{e[0]}{e[1]}"]
                pending, k = [], k + 1
            else:
                kind, sent, got, peer = e  # every name is known: the step has run
                words = {"recv": f"{getattr(got, 'name', '')} from {peer}", "send": f"{sent} to {peer}",
                         "both": f"[{sent} to {peer}, {getattr(got, 'name', '')} from {peer}]"}[kind]
                (pending if kind == "recv" else steps[-1][1]).append(words)
        cells = ["; ".join(", ".join(words) for phase, words in steps if phase == want) or "none"
                 for want in ("warm-up", "steady", "drain")]
        warmup = sum(phase_of[k] == "warm-up" for k in phase_of)
        lines.append(f"| {s} | {pp} - {s} - 1 = {warmup} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def guide_1f1b_table(guide=None):
    return guide_table("02_pipeline_1f1b.py", r"\| rank s \| warm-up pp - s - 1 \|", guide)


def test_the_guides_worked_1f1b_order_is_the_lessons():
    table = one_f_one_b_table(**WORKED_1F1B)
    assert guide_1f1b_table() == table, f"docs/GUIDE.md's 02 worked 1F1B order is not the lesson's; today's:\n{table}"
    # Each message a rank sends to a neighbour is, in order, the one that neighbour receives from it.
    sent, received = {}, {}
    for s, events in one_f_one_b_events(**WORKED_1F1B).items():
        for kind, t, got, peer in (e for e in events if e[0] not in "FB"):
            if t is not None:
                sent.setdefault((s, peer), []).append({"y": "x", "dx": "dy"}[t.rstrip("0123456789")] + t.lstrip("dxy"))
            if got is not None:
                received.setdefault((peer, s), []).append(got.name)
    assert sent == received


def test_a_changed_entry_of_the_worked_1f1b_order_fails():
    guide = text("docs/GUIDE.md")
    table = guide_1f1b_table(guide)
    for old, new in (("dy0 from 1]", "dy1 from 1]"), ("= 2 |", "= 3 |"), ("B0, [dx0 to 0", "[dx0 to 0")):
        changed = guide.replace(table, table.replace(old, new, 1))
        assert changed != guide and guide_1f1b_table(changed) != one_f_one_b_table(**WORKED_1F1B), (old, new)


# ----------------------------------------------------------------------------------------------
# docs/GUIDE.md's "The demo's reference." of each numbered file (issue 47: a reader opened plumbing to learn
# what "serial" is): one a section, just before "The demo.", naming first the builder of the serial model
# that the file's demo itself calls.

REFERENCE_BUILDERS = ("pipeline_reference", "training_reference", "moe_gpt", "ParallelGPT")


def demo_reference_problems(ch, guide=None):
    import ast
    path = next(ROOT.glob(f"{ch}_*.py"))
    section = (guide or text("docs/GUIDE.md")).split(f"\n## {path.name}")[1].split("\n## ")[0]
    found = re.findall(r"\n\*\*The demo's reference\.\*\*(.*?)\n\n\*\*The demo\.\*\*", section, re.S)
    if len(found) != 1:
        return [f"{path.name}: not one '**The demo's reference.**' paragraph just before '**The demo.**'"]
    demo = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "demo")
    called = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(demo) if isinstance(n, (ast.Name, ast.Attribute))}
    named = [n for n in re.findall(r"`([A-Za-z_]\w*)", found[0]) if n in REFERENCE_BUILDERS]
    if not named or named[0] not in called:
        return [f"{path.name}: its reference names {named[:1] or 'no builder'} first; its demo calls "
                f"{sorted(called & set(REFERENCE_BUILDERS))}"]
    return []


@pytest.mark.parametrize("ch", [f"0{i}" for i in range(1, 10)])
def test_each_demos_reference_is_named_as_its_demo_builds_it(ch):
    assert not demo_reference_problems(ch)


def test_a_wrong_reference_fails():
    guide = text("docs/GUIDE.md")
    wrong = guide.replace("**The demo's reference.** The serial model, `plumbing/reference.py`'s `pipeline_reference`",
                          "**The demo's reference.** The serial model, `training_reference`")
    assert wrong != guide and demo_reference_problems("02", wrong) and not demo_reference_problems("02", guide)
