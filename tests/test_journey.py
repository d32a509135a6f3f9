"""A new user's journey: help for every flag, saves that say so, sampling, traces, the loss chart,
and nothing that depends on what happens to be installed.

Sampling is compared exactly (==): greedy decoding is a sequence of argmaxes of the same float32
logits, computed by the same model on the same inputs, so nothing may differ at all.
"""
import argparse
import ast
import dataclasses
import json
import re
import sys

import pytest
import torch

from conftest import ROOT, load, run_script

tensor_parallel = load("01_tensor_parallel")
gpt3d = load("05_3d_gpt")
from plumbing import charts, cli, sample  # noqa: E402

FILES = ["01_tensor_parallel", "02_pipeline_1f1b", "03_interleaved", "04_data_parallel", "05_3d_gpt", "06_zero_bubble",
         "07_vocab_parallel"]


def run(script, *args, timeout=120):
    return run_script(script, *args, timeout=timeout)


# ----------------------------------------------------------------------------------------------
# --help


@pytest.mark.parametrize("name", FILES)
def test_every_flag_has_one_line_of_help_with_its_default_and_choices(name):
    parser = load(name).parser()
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0]
        assert action.help and len(action.help) > 3, f"{name} {flag} has no help"
        if action.choices:
            assert "{" + ",".join(map(str, action.choices)) + "}" in text, (name, flag)
    for line in re.findall(r"\n  (--[\w-]+)[^\n]*", text):  # each flag's line in the output
        assert line in text
    assert "(default: " in text and "Run it" in text


def test_a_config_field_without_a_comment_is_refused_when_the_parser_is_built():
    @dataclasses.dataclass
    class Config:
        documented: int = 1  # a comment
        silent: int = 2

    with pytest.raises(TypeError, match="Config.silent has no comment"):
        cli.add_dataclass_args(argparse.ArgumentParser(), Config)


def test_a_literal_field_offers_its_choices_and_refuses_others():
    proc = run("05_3d_gpt.py", "--kernel-path", "fast", timeout=30)
    assert proc.returncode == 2 and "--kernel-path: invalid choice: 'fast'" in proc.stderr
    assert "'auto', 'cuda', 'reference'" in proc.stderr


# ----------------------------------------------------------------------------------------------
# The loss chart


def test_the_ascii_chart_puts_the_highest_value_top_left_and_the_lowest_bottom_right():
    text = charts.ascii_chart({"train loss": ("*", [(i, 5.0 - i) for i in range(5)]),
                               "eval loss": ("o", [(2, 3.5), (4, float("nan"))])}, width=20, height=5)
    rows = text.splitlines()
    assert rows[0].startswith("5 |*") and rows[4].rstrip().endswith("*")
    assert rows[4].startswith("1 |")
    assert "o" in rows[1] or "o" in rows[2]  # 3.5 sits between
    assert "* train loss" in text and "o eval loss (1 non-finite left out)" in text
    assert charts.ascii_chart({"x": ("*", [(0, 1.0)])})  # a single point does not divide by zero
    assert charts.ascii_chart({"x": ("*", [])}) == "(no finite values to plot)"


# ----------------------------------------------------------------------------------------------
# Sampling


SMALL = tensor_parallel.GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)


def test_greedy_sampling_equals_an_argmax_loop_written_out():
    model = tensor_parallel.GPT(SMALL, None, seed=3)
    prompt = torch.tensor([list(b"ab")])
    got = sample.generate(model, prompt, 20, top_k=1)
    ids = prompt
    with torch.no_grad():
        for _ in range(20):  # past block_size: only the last 16 tokens are seen
            logits, _ = model(ids[:, -SMALL.block_size:])
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, ids)


def _export(tmp_path, cfg=SMALL, tokenizer="bytes"):
    path = tmp_path / "model.pt"
    full = tensor_parallel.init_state_dict(cfg, seed=5)
    torch.save({**full, "_config": dataclasses.asdict(cfg), "_tokenizer": tokenizer}, path)
    return str(path)


def test_sampling_repeats_with_its_seed_and_decodes_bytes_to_text(tmp_path):
    weights = _export(tmp_path)
    args = ["--init-from", weights, "--sample", "alice has", "--max-new-tokens", "12", "--top-k", "40"]
    first, again = run("05_3d_gpt.py", *args, timeout=60), run("05_3d_gpt.py", *args, timeout=60)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout == again.stdout
    assert "\nalice has" in first.stdout  # the prompt, then its continuation, as text
    other = run("05_3d_gpt.py", *args, "--seed", "7", timeout=60)
    assert other.stdout != first.stdout


BAD_SAMPLING = {
    "an empty prompt": (["--sample", ""], "--sample: the prompt is empty"),
    "a prompt longer than block_size": (["--sample", "x" * 17], "the prompt is 17 tokens, longer than the model's block_size=16"),
    "a byte outside the vocabulary": (["--vocab", "128", "--sample", "caf\u00e9"], "outside the model's vocabulary of 128 tokens"),
    "temperature zero": (["--sample", "ab", "--temperature", "0"], "--temperature must be positive (for greedy decoding use --top-k 1), got 0.0"),
    "a negative temperature": (["--sample", "ab", "--temperature", "-1"], "--temperature must be positive (for greedy decoding use --top-k 1), got -1.0"),
    "top-k beyond the vocabulary": (["--sample", "ab", "--top-k", "300"], "--top-k must be between 0 (all tokens) and the vocabulary size 256, got 300"),
    "no new tokens": (["--sample", "ab", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    "ids that are not numbers": (["--tokenizer", "ids", "--sample", "hello"], "this model reads token ids, written as numbers"),
    "no weights": (["--no-weights", "--sample", "ab"], "--sample needs weights: --resume DIR"),
}


@pytest.mark.parametrize("case", BAD_SAMPLING, ids=list(BAD_SAMPLING))
def test_bad_sampling_input_is_refused_with_the_flag_named(case, tmp_path):
    args, message = BAD_SAMPLING[case]
    cfg, tokenizer = SMALL, "bytes"
    if args[0] == "--vocab":
        cfg, args = dataclasses.replace(SMALL, vocab_size=int(args[1])), args[2:]
    if args[0] == "--tokenizer":
        tokenizer, args = args[1], args[2:]
    weights = [] if args[0] == "--no-weights" else ["--init-from", _export(tmp_path, cfg, tokenizer)]
    proc = run("05_3d_gpt.py", *weights, *[a for a in args if a != "--no-weights"], timeout=60)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------
# A run of a parallel layout: saves say so, the trace has a track per rank, and its checkpoint
# samples and exports, naming the step.


def test_a_parallel_run_says_what_it_saved_traces_each_rank_and_its_checkpoint_samples(tmp_path):
    ckpt, trace = tmp_path / "ckpt", tmp_path / "step.json"
    small = ["--tp", "2", "--pp", "2", "--dp", "1", "--n-layer", "2", "--batch-size", "8",
             "--microbatches", "2", "--seq-len", "16", "--block-size", "16", "--eval-every", "0"]
    proc = run("05_3d_gpt.py", *small, "--steps", "4", "--save", str(ckpt), "--save-every", "2",
               "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step in (2, 4):
        assert re.search(rf"saved step {step} to {re.escape(str(ckpt))}/step_0000000{step}: "
                         rf"[\d.]+ MB in [\d.]+ s", proc.stdout + proc.stderr), proc.stdout
    assert re.search(r"\n +\| *\*", proc.stdout) and "* train loss" in proc.stdout  # the chart
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(tracks) == [0, 1, 2, 3] and tracks[3] == "rank 3: tp 1, dp 0, pp 1"
    kinds = {(e["tid"], e["cat"]) for e in events if e["ph"] == "X"}
    for rank in range(4):
        assert {(rank, "compute"), (rank, "p2p wait"), (rank, "tp collective"), (rank, "collective")} <= kinds
    sampled = run("05_3d_gpt.py", "--resume", str(ckpt), "--sample", "alice", "--max-new-tokens", "5",
                  timeout=60)
    assert sampled.returncode == 0 and "sampling from step 4 of" in sampled.stdout, sampled.stderr[-2000:]
    exported = run("05_3d_gpt.py", "--resume", str(ckpt), "--export-state-dict", str(tmp_path / "m.pt"),
                   timeout=60)
    assert "exported step 4 of" in exported.stdout


# ----------------------------------------------------------------------------------------------
# Nothing depends on what happens to be installed.


def test_library_code_uses_no_object_collectives_and_no_numpy():
    sources = [ROOT / f"{name}.py" for name in FILES]
    sources += [p for folder in ("plumbing", "kernels", "exercises") for p in sorted((ROOT / folder).glob("*.py"))]
    for path in sources:
        text = path.read_text()
        for forbidden in ("_object(", ".numpy(", "import numpy", ".tobytes("):
            assert forbidden not in text, f"{path.name} uses {forbidden}"


OPTIONAL = {"tiktoken", "safetensors", "matplotlib"}  # imported under try/except ImportError only


def _imports(tree):
    """(top-level module, imported under a try that catches ImportError?) for every import."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                getattr(h.type, "id", None) in ("ImportError", "ModuleNotFoundError") for h in node.handlers):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((a.name.split(".")[0], id(node) in guarded) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split(".")[0], id(node) in guarded


def test_every_import_is_the_standard_library_a_requirement_ours_or_optional_and_guarded():
    required = {re.split(r"[<>=]", line)[0].strip() for line in
                (ROOT / "requirements.txt").read_text().splitlines() if line.strip()}
    ours = {"plumbing", "kernels", "exercises", "megatron_scratch", "conftest"} | {
        p.stem for folder in (ROOT, ROOT / "tests", ROOT / "scripts", ROOT / "benchmarks") for p in folder.glob("*.py")}
    paths = [ROOT / f"{name}.py" for name in FILES]
    for folder in ("plumbing", "kernels", "exercises", "megatron_scratch", "tests", "scripts"):
        paths += sorted((ROOT / folder).glob("*.py"))
    for path in paths:
        for module, guarded in _imports(ast.parse(path.read_text())):
            if module in sys.stdlib_module_names or module in required or module in ours:
                continue
            assert module in OPTIONAL and guarded, f"{path.relative_to(ROOT)} imports {module}, which " \
                f"requirements.txt does not list (optional packages go under try/except ImportError)"
