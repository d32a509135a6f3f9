"""scripts/: prepare_data.py writes the .bin the trainer reads (and its sidecar), and refuses bad paths
by name; plot_metrics.py plots the last record of each step, with or without matplotlib, and refuses
bad metrics files by line number.

The scripts run as subprocesses of sys.executable from the repository root, as a user runs them
(each takes tens of milliseconds: neither imports torch). The optional packages, tiktoken and
matplotlib, are replaced by small fakes placed first on PYTHONPATH, so every path is tested
whatever this machine has installed. All comparisons are exact: ids and bytes are integers.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from plumbing.tokenizer import tokenizer_of

SCRIPTS = ROOT / "scripts"


def run_script(name, *args, fakes=None, timeout=10):
    """python3 scripts/NAME ARGS from the repository root; fakes: a folder put first on PYTHONPATH."""
    env = dict(os.environ)
    if fakes:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(fakes), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def import_script(name):
    """scripts/NAME.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fakes(tmp_path, files):
    """A folder of stand-ins for optional packages: {relative path: source}."""
    folder = tmp_path / "fakes"
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def refused(proc, *names):
    """Exit code 1, every name in the message, and no traceback."""
    return proc.returncode == 1 and all(str(n) in proc.stderr for n in names) and "Traceback" not in proc.stderr


NO_TIKTOKEN = {"tiktoken.py": "raise ImportError('tiktoken: absent (a test stand-in)')\n"}
# Each word becomes 1000 + its length: ids no real tokenizer gives, so they prove where they came from.
FAKE_TIKTOKEN = {"tiktoken.py": (
    "class _Gpt2:\n"
    "    n_vocab = 50257\n"
    "    def encode_ordinary(self, text):\n"
    "        return [1000 + len(word) for word in text.split()]\n"
    "def get_encoding(name):\n"
    "    assert name == 'gpt2', name\n"
    "    return _Gpt2()\n")}


# ----------------------------------------------------------------------------------------------
# prepare_data.py: the .bin and its sidecar


def test_ids_are_written_as_uint16_little_endian_with_no_header(tmp_path):
    prepare_data = import_script("prepare_data")
    ids = [0, 1, 255, 256, 50256, 65535]
    prepare_data.write_bin(ids, tmp_path / "x.bin")
    assert (tmp_path / "x.bin").read_bytes() == b"".join(i.to_bytes(2, "little") for i in ids)
    assert prepare_data.read_bin(tmp_path / "x.bin") == ids


def test_bytes_round_trip_through_the_bin_the_trainer_reads(tmp_path):
    text = "alice has 3 apples.\ncafé ☕ naïve\n".encode("utf-8")  # multi-byte UTF-8 and newlines
    (tmp_path / "t.txt").write_bytes(text)
    # tiktoken present: --tokenizer bytes must not use it
    proc = run_script("prepare_data.py", tmp_path / "t.txt", "--tokenizer", "bytes",
                      fakes=fakes(tmp_path, FAKE_TIKTOKEN))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "t.bin"
    assert out.stat().st_size == 2 * len(text)
    assert bytes(import_script("prepare_data").read_bin(out)) == text
    # 05's reader (plumbing/data.py): memory-mapped uint16
    ids = torch.from_file(str(out), shared=False, size=os.path.getsize(out) // 2, dtype=torch.uint16)
    assert ids.to(torch.int32).tolist() == list(text)
    assert json.loads((tmp_path / "t.json").read_text()) == {
        "format": "uint16-le token ids, no header", "tokenizer": "bytes", "vocab_size": 256,
        "tokens": len(text), "source": str(tmp_path / "t.txt")}
    assert tokenizer_of(str(out)) == "bytes"  # the trainer reads the sidecar to decode samples
    assert f"python3 05_3d_gpt.py --data {out} --vocab-size 256" in proc.stdout
    assert "tiktoken is not installed" not in proc.stdout


def test_auto_without_tiktoken_writes_bytes_and_says_pip_install_tiktoken(tmp_path):
    (tmp_path / "t.txt").write_text("hello world\n")
    proc = run_script("prepare_data.py", tmp_path / "t.txt", fakes=fakes(tmp_path, NO_TIKTOKEN))
    assert proc.returncode == 0, proc.stderr
    assert "tiktoken is not installed, so byte-level tokens were written" in proc.stdout
    assert "pip install tiktoken" in proc.stdout
    assert json.loads((tmp_path / "t.json").read_text())["tokenizer"] == "bytes"
    assert (tmp_path / "t.bin").stat().st_size == 2 * len("hello world\n")


@pytest.mark.parametrize("flag", [[], ["--tokenizer", "gpt2"]], ids=["auto", "gpt2"])
def test_gpt2_ids_come_from_tiktoken_and_train_with_vocab_50304(tmp_path, flag):
    (tmp_path / "t.txt").write_text("one three fives")
    proc = run_script("prepare_data.py", tmp_path / "t.txt", "-o", tmp_path / "o.bin", *flag,
                      fakes=fakes(tmp_path, FAKE_TIKTOKEN))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "o.bin"
    ids = torch.from_file(str(out), shared=False, size=os.path.getsize(out) // 2, dtype=torch.uint16)
    assert ids.to(torch.int32).tolist() == [1003, 1005, 1005]
    meta = json.loads((tmp_path / "o.json").read_text())
    assert (meta["tokenizer"], meta["vocab_size"], meta["tokens"]) == ("gpt2", 50257, 3)
    assert tokenizer_of(str(out)) == "gpt2"
    assert "--vocab-size 50304" in proc.stdout  # 50257 padded to a multiple of 64, as nanoGPT does


def test_gpt2_without_tiktoken_fails_naming_the_flag_and_the_install(tmp_path):
    (tmp_path / "t.txt").write_text("hello")
    proc = run_script("prepare_data.py", tmp_path / "t.txt", "--tokenizer", "gpt2",
                      fakes=fakes(tmp_path, NO_TIKTOKEN))
    assert refused(proc, "--tokenizer gpt2 needs the tiktoken package", "pip install tiktoken"), proc.stderr
    assert not (tmp_path / "t.bin").exists()


def test_gpt2_refuses_a_file_that_is_not_utf8_rather_than_guess(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"caf\xe9\n")  # Latin-1
    proc = run_script("prepare_data.py", tmp_path / "t.txt", "--tokenizer", "gpt2",
                      fakes=fakes(tmp_path, FAKE_TIKTOKEN))
    assert refused(proc, "byte 3 is 0xe9", "--tokenizer bytes"), proc.stderr


BAD_PATHS = {  # case: (arguments, {w} the folder of files, what the message names)
    "missing input": (["{w}/missing.txt"], ["missing.txt", "does not exist"]),
    "directory input": (["{w}/."], ["is a directory"]),
    "empty input": (["{w}/empty.txt"], ["empty.txt", "is empty"]),
    "output equals input": (["{w}/data.bin", "-o", "{w}/data.bin"], ["data.bin", "would overwrite the input"]),
    "output equals a text input": (["{w}/t.txt", "-o", "{w}/t.txt"], ["t.txt", "must end in .bin"]),
    "bin input, default output": (["{w}/data.bin"], ["data.bin", "would overwrite the input"]),
    "sidecar equals input": (["{w}/notes.json"], ["notes.json", "would overwrite the input"]),
    "missing output directory": (["{w}/t.txt", "-o", "{w}/no/x.bin"], ["no/x.bin", "does not exist"]),
    "output not .bin": (["{w}/t.txt", "-o", "{w}/t.tok"], ["t.tok", "must end in .bin"]),
    "output a directory": (["{w}/t.txt", "-o", "{w}/dir.bin"], ["dir.bin", "is a directory"]),
}


@pytest.mark.parametrize("case", BAD_PATHS)
def test_bad_paths_are_refused_by_name_before_anything_is_written(tmp_path, case):
    args, names = BAD_PATHS[case]
    work = tmp_path / "work"
    work.mkdir()
    (work / "t.txt").write_text("hello")
    (work / "data.bin").write_bytes(b"\x01\x00")
    (work / "notes.json").write_text("{}")
    (work / "empty.txt").write_text("")
    (work / "dir.bin").mkdir()
    before = {p.name: p.is_file() and p.read_bytes() for p in work.iterdir()}
    proc = run_script("prepare_data.py", *[a.format(w=work) for a in args])
    assert refused(proc, *names), proc.stderr
    assert {p.name: p.is_file() and p.read_bytes() for p in work.iterdir()} == before


# ----------------------------------------------------------------------------------------------
# prepare_data.py --sft: prompt/response pairs, and the mask 05's --loss-mask reads (issue 41)

PAIRS = [{"prompt": "2 plus 3 is ", "response": "5."}, {"prompt": "q: hi\n", "response": "café"}]


def _jsonl(path, rows, blank=True):
    path.write_text("\n".join(json.dumps(r) for r in rows) + ("\n\n" if blank else "\n"))  # a blank line skipped
    return path


def test_sft_pairs_become_the_bin_and_a_mask_that_counts_the_response_and_its_end_of_text(tmp_path):
    proc = run_script("prepare_data.py", _jsonl(tmp_path / "p.jsonl", PAIRS), "--sft", "--tokenizer", "bytes")
    assert proc.returncode == 0, proc.stderr
    prepare_data = import_script("prepare_data")
    ids, mask = prepare_data.read_bin(tmp_path / "p.bin"), list((tmp_path / "p.mask").read_bytes())
    want_ids, want_mask = [], []
    for pair in PAIRS:
        prompt, response = pair["prompt"].encode(), pair["response"].encode()
        want_ids += [*prompt, *response, 0]  # 0: the byte-level end-of-text
        want_mask += [0] * len(prompt) + [1] * (len(response) + 1)
    assert (ids, mask) == (want_ids, want_mask)
    meta = json.loads((tmp_path / "p.json").read_text())
    assert (meta["tokens"], meta["loss_mask"], meta["pairs"], meta["separator"]) == (len(ids), str(tmp_path / "p.mask"),
                                                                                    2, 0)
    assert (f"and its loss mask {tmp_path / 'p.mask'} (2 pairs; {sum(want_mask)} of the {len(ids)} targets counted"
            in proc.stdout), proc.stdout
    assert (f"python3 05_3d_gpt.py --data {tmp_path / 'p.bin'} --loss-mask {tmp_path / 'p.mask'} --vocab-size 256"
            in proc.stdout), proc.stdout
    # the trainer's loader reads the pair of files: a target is counted exactly under a response
    from plumbing import data
    tokens = data.load_tokens(str(tmp_path / "p.bin"), 256, 4, str(tmp_path / "p.mask"))
    assert tokens.mask[0:len(ids)].tolist() == want_mask


def test_sft_under_gpt2_ends_each_response_with_endoftext_50256(tmp_path):
    proc = run_script("prepare_data.py", _jsonl(tmp_path / "p.jsonl", [{"prompt": "one two", "response": "three"}]),
                      "--sft", "--tokenizer", "gpt2", fakes=fakes(tmp_path, FAKE_TIKTOKEN))
    assert proc.returncode == 0, proc.stderr
    assert import_script("prepare_data").read_bin(tmp_path / "p.bin") == [1003, 1003, 1005, 50256]
    assert (tmp_path / "p.mask").read_bytes() == bytes([0, 0, 1, 1])


BAD_PAIRS = {  # case: (the JSONL's text, what the message says)
    "a line that is not JSON": ('{"prompt": "a", "response": "b"}\n{"prompt": \n',
                                "the input {src!r}, line 2 is not JSON (Expecting value: line 1 column 12 (char 11))"),
    "a line that is a list": ('\n["a", "b"]\n', "the input {src!r}, line 2 is a JSON list, not an object; --sft "
                                                 "reads one {{\"prompt\": ..., \"response\": ...}} object a line"),
    "a line without its response": ('{"prompt": "a", "answer": "b"}\n', "the input {src!r}, line 1 has no 'response' "
                                    "field (it has 'prompt', 'answer'); each line is {{\"prompt\": ..., "
                                    "\"response\": ...}}"),
    "a line without its prompt": ('{"response": "b"}\n', "line 1 has no 'prompt' field (it has 'response')"),
    "a prompt that is a number": ('{"prompt": 3, "response": "b"}\n', "the input {src!r}, line 1: 'prompt' is a "
                                                                      "JSON int, not text"),
    "a response that is null": ('{"prompt": "a", "response": null}\n', "line 1: 'response' is a JSON NoneType, "
                                                                       "not text"),
    "a line that is not UTF-8": ('{"prompt": "a", "response": "b"}\n{"prompt": "\xe9"}\n'.encode("latin-1"),
                                 "the input {src!r}, line 2: byte 12 of the line is 0xe9, not UTF-8"),
    "no pair at all": ("\n  \n\n", "the input {src!r} holds no prompt/response pair"),
}


@pytest.mark.parametrize("case", BAD_PAIRS)
def test_a_bad_jsonl_line_is_refused_by_its_number_and_nothing_is_written(tmp_path, case):
    text, message = BAD_PAIRS[case]
    src = tmp_path / "p.jsonl"
    src.write_bytes(text if isinstance(text, bytes) else text.encode())
    prepare_data = import_script("prepare_data")
    with pytest.raises(prepare_data.Refused) as e:
        prepare_data.prepare(str(src), str(tmp_path / "p.bin"), "bytes", say=None, sft=True)
    assert message.format(src=str(src)) in str(e.value), str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


def test_sft_refuses_a_mask_that_would_replace_a_file_it_did_not_write(tmp_path):
    (tmp_path / "p.mask").write_bytes(b"mine")
    proc = run_script("prepare_data.py", _jsonl(tmp_path / "p.jsonl", PAIRS), "--sft", "--tokenizer", "bytes")
    assert refused(proc, "-o's mask", "p.mask"), proc.stderr
    assert (tmp_path / "p.mask").read_bytes() == b"mine" and not (tmp_path / "p.bin").exists()


def test_help_names_every_flag_with_its_default_and_choices():
    text = " ".join(run_script("prepare_data.py", "--help").stdout.split())  # argparse wraps lines
    for expected in ["-o OUT.bin", "--output", "default: the input with its suffix replaced by .bin",
                     "{auto,bytes,gpt2}", "default: auto", "vocab-size", "--sft", "OUT.mask", "--loss-mask"]:
        assert expected in text, expected


# ----------------------------------------------------------------------------------------------
# plot_metrics.py

# Records every call on the figure and axes; savefig writes them to the path, as JSON, so the test
# can read back what would have been drawn.
FAKE_MATPLOTLIB = {
    "matplotlib/__init__.py": "BACKEND = []\ndef use(name):\n    BACKEND.append(name)\n",
    "matplotlib/pyplot.py": (
        "import json\n"
        "CALLS = []\n"
        "class _Recorder:\n"
        "    def __getattr__(self, method):\n"
        "        def call(*args, **kwargs):\n"
        "            CALLS.append([method, args, kwargs])  # tuples become JSON lists\n"
        "            if method == 'savefig':\n"
        "                with open(args[0], 'w') as f:\n"
        "                    json.dump(CALLS, f, default=str)\n"
        "        return call\n"
        "def subplots(*args, **kwargs):\n"
        "    return _Recorder(), _Recorder()\n"
        "def close(*args):\n"
        "    pass\n")}
NO_MATPLOTLIB = {"matplotlib/__init__.py": "raise ImportError('matplotlib: absent (a test stand-in)')\n"}


def resumed_metrics(tmp_path):
    """Steps 0-2, then a run resumed at step 1 rewrites steps 1-2 (without step 1's eval)."""
    path = tmp_path / "m.jsonl"
    records = [dict(step=0, loss=5.0, lr=1e-3), dict(step=1, loss=4.0, eval_loss=4.5), dict(step=2, loss=3.5),
               dict(step=1, loss=3.0), dict(step=2, loss=2.0, eval_loss=2.5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_png_plots_the_last_record_of_each_step(tmp_path):
    path = resumed_metrics(tmp_path)
    proc = run_script("plot_metrics.py", path, "-o", tmp_path / "loss.png", fakes=fakes(tmp_path, FAKE_MATPLOTLIB))
    assert proc.returncode == 0 and f"wrote {tmp_path / 'loss.png'}" in proc.stdout, proc.stderr
    calls = json.loads((tmp_path / "loss.png").read_text())
    plots = [(kw.get("label"), *args[:2]) for name, args, kw in calls if name == "plot"]
    assert plots == [("train loss", [0, 1, 2], [5.0, 3.0, 2.0]), ("eval loss", [2], [2.5])]
    assert [args for name, args, _ in calls if name == "plot"][1][2] == "o"  # eval: markers only
    said = {name: args[0] for name, args, _ in calls if name in ("set_xlabel", "set_ylabel", "set_title")}
    assert said["set_xlabel"] == "step" and said["set_ylabel"] == "loss" and str(path) in said["set_title"]
    assert not any(name == "set_yscale" for name, _, _ in calls)


def test_the_default_output_is_the_metrics_file_as_png_and_log_sets_a_log_axis(tmp_path):
    path = resumed_metrics(tmp_path)
    proc = run_script("plot_metrics.py", path, "--log", fakes=fakes(tmp_path, FAKE_MATPLOTLIB))
    assert proc.returncode == 0 and f"wrote {tmp_path / 'm.png'}" in proc.stdout, proc.stderr
    calls = json.loads((tmp_path / "m.png").read_text())
    assert ["set_yscale", ["log"], {}] in calls


def test_without_matplotlib_the_chart_is_drawn_in_the_terminal_with_the_install_hint(tmp_path):
    path = resumed_metrics(tmp_path)
    proc = run_script("plot_metrics.py", path, fakes=fakes(tmp_path, NO_MATPLOTLIB))
    assert proc.returncode == 0, proc.stderr  # a look at the curve was asked for, and given
    assert "* train loss" in proc.stdout and "o eval loss" in proc.stdout
    assert "matplotlib is not installed" in proc.stderr and "pip install matplotlib" in proc.stderr
    assert not (tmp_path / "m.png").exists()


def test_without_matplotlib_an_explicit_output_fails_after_the_chart(tmp_path):
    path = resumed_metrics(tmp_path)
    proc = run_script("plot_metrics.py", path, "-o", tmp_path / "x.png", fakes=fakes(tmp_path, NO_MATPLOTLIB))
    assert proc.returncode == 1 and "* train loss" in proc.stdout and "pip install matplotlib" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x.png").exists()


BAD_METRICS = {  # case: (file contents or None for no file, what the message names)
    "missing file": (None, ["cannot read", "m.jsonl"]),
    "empty file": ("\n", ["m.jsonl", "is empty"]),
    "not JSON": ('{"step": 0, "loss": 1}\n{"step": 1, "lo\n', ["line 2: not JSON"]),
    "no step": ('{"step": 0, "loss": 1}\n\n{"loss": 1}\n', ["line 3: a record needs 'step' and 'loss'"]),
    "no loss": ('{"step": 0}\n', ["line 1: a record needs 'step' and 'loss'"]),
    "not an object": ('[0, 1.5]\n', ["line 1: a record needs"]),
    "loss not a number": ('{"step": 0, "loss": "1.5"}\n', ["line 1: loss '1.5'"]),
    "step not whole": ('{"step": 0.5, "loss": 1}\n', ["line 1: step 0.5"]),
}


@pytest.mark.parametrize("case", BAD_METRICS)
def test_bad_metrics_files_are_refused_with_the_line_number(tmp_path, case):
    text, names = BAD_METRICS[case]
    path = tmp_path / "m.jsonl"
    if text is not None:
        path.write_text(text)
    proc = run_script("plot_metrics.py", path, fakes=fakes(tmp_path, FAKE_MATPLOTLIB))
    assert refused(proc, *names), proc.stderr
    assert not (tmp_path / "m.png").exists()


def test_an_output_that_would_overwrite_the_metrics_or_has_no_directory_is_refused(tmp_path):
    path = resumed_metrics(tmp_path)
    mpl = fakes(tmp_path, FAKE_MATPLOTLIB)
    assert refused(run_script("plot_metrics.py", path, "-o", path, fakes=mpl), path, "would overwrite")
    assert refused(run_script("plot_metrics.py", path, "-o", tmp_path / "no" / "l.png", fakes=mpl),
                   tmp_path / "no", "does not exist")
