"""scripts/: the token-file writer round-trips, and the metrics plot works with and without
matplotlib. Optional packages (tiktoken, matplotlib) are replaced by small fakes on PYTHONPATH, so
each path is tested whatever this machine has installed; exact equality throughout (ids, bytes).
"""
import json
import os
import subprocess
import sys

import torch

from conftest import ROOT


def script(name, *args, pythonpath=None, timeout=60):
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


def fake_module(tmp_path, files):
    """A folder of modules that stand in for optional packages (on PYTHONPATH, before site)."""
    folder = tmp_path / "fakes"
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


NO_TIKTOKEN = {"tiktoken.py": "raise ImportError('not installed (a test stand-in)')\n"}
FAKE_TIKTOKEN = {"tiktoken.py": (
    "class _Bpe:\n"
    "    n_vocab = 50257\n"
    "    def encode_ordinary(self, text):\n"
    "        return [1000 + len(w) for w in text.split()]\n"
    "def get_encoding(name):\n"
    "    assert name == 'gpt2'\n"
    "    return _Bpe()\n")}


# ----------------------------------------------------------------------------------------------
# prepare_data.py


def test_bytes_round_trip_through_the_bin_the_trainer_reads(tmp_path):
    text = "alice has 3 apples.\ncafé ☕\n".encode()
    (tmp_path / "t.txt").write_bytes(text)
    proc = script("prepare_data.py", tmp_path / "t.txt", pythonpath=fake_module(tmp_path, NO_TIKTOKEN))
    assert proc.returncode == 0, proc.stderr
    assert "tiktoken is not installed" in proc.stdout and "pip install tiktoken" in proc.stdout
    assert "--data" in proc.stdout and "--vocab-size 256" in proc.stdout
    out = tmp_path / "t.bin"
    assert out.stat().st_size == 2 * len(text)
    ids = torch.from_file(str(out), shared=False, size=len(text), dtype=torch.uint16)  # 05's reader
    assert bytes(ids.to(torch.int32).tolist()) == text
    meta = json.loads((tmp_path / "t.json").read_text())
    assert meta["tokenizer"] == "bytes" and meta["vocab_size"] == 256 and meta["tokens"] == len(text)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import prepare_data
        assert prepare_data.read_bin(out) == list(text)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_gpt2_tokens_come_from_tiktoken_when_it_is_installed(tmp_path):
    (tmp_path / "t.txt").write_text("one three fives")
    proc = script("prepare_data.py", tmp_path / "t.txt", pythonpath=fake_module(tmp_path, FAKE_TIKTOKEN))
    assert proc.returncode == 0, proc.stderr
    ids = torch.from_file(str(tmp_path / "t.bin"), shared=False, size=3, dtype=torch.uint16).tolist()
    assert ids == [1003, 1005, 1005]
    assert json.loads((tmp_path / "t.json").read_text())["tokenizer"] == "gpt2"
    assert "--vocab-size 50304" in proc.stdout


def test_gpt2_without_tiktoken_says_how_to_get_it(tmp_path):
    (tmp_path / "t.txt").write_text("hello")
    proc = script("prepare_data.py", tmp_path / "t.txt", "--tokenizer", "gpt2",
                  pythonpath=fake_module(tmp_path, NO_TIKTOKEN))
    assert proc.returncode == 1 and "--tokenizer gpt2 needs the tiktoken package: pip install tiktoken" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_paths_are_refused_by_name(tmp_path):
    (tmp_path / "t.txt").write_text("hello")
    (tmp_path / "empty.txt").write_text("")
    cases = [([tmp_path / "missing.txt"], "missing.txt' is not a readable file"),
             ([tmp_path], "(it is a directory)"),
             ([tmp_path / "empty.txt"], "empty.txt' is empty"),
             ([tmp_path / "t.txt", "-o", tmp_path / "t.txt"], "would overwrite the input"),
             ([tmp_path / "t.txt", "-o", tmp_path / "no" / "x.bin"], "does not exist")]
    for args, message in cases:
        proc = script("prepare_data.py", *args)
        assert proc.returncode == 1 and message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------
# plot_metrics.py

FAKE_MATPLOTLIB = {
    "matplotlib/__init__.py": "def use(backend):\n    pass\n",
    "matplotlib/pyplot.py": (
        "import json\n"
        "class _Ax:\n"
        "    def __init__(self): self.lines = []\n"
        "    def plot(self, x, y, *fmt, label=None): self.lines.append((label, list(x), list(y)))\n"
        "    def set_yscale(self, s): pass\n"
        "    def set(self, **kw): pass\n"
        "    def legend(self): pass\n"
        "class _Fig:\n"
        "    def savefig(self, path, **kw):\n"
        "        open(path, 'w').write(json.dumps(_AX.lines))\n"
        "_AX = _Ax()\n"
        "def subplots(**kw): return _Fig(), _AX\n"
        "def close(fig): pass\n")}


def _metrics(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [dict(step=0, loss=5.0), dict(step=1, loss=4.0, eval_loss=4.5), dict(step=1, loss=3.0),
             dict(step=2, loss=2.0, eval_loss=2.5)]  # step 1 twice: a resumed run appended
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_the_png_plots_the_last_record_of_each_step(tmp_path):
    path = _metrics(tmp_path)
    proc = script("plot_metrics.py", path, "-o", tmp_path / "loss.png",
                  pythonpath=fake_module(tmp_path, FAKE_MATPLOTLIB))
    assert proc.returncode == 0 and f"wrote {tmp_path / 'loss.png'}" in proc.stdout, proc.stderr
    lines = json.loads((tmp_path / "loss.png").read_text())
    assert lines[0] == ["train loss", [0, 1, 2], [5.0, 3.0, 2.0]]
    assert lines[1] == ["eval loss", [2], [2.5]]  # step 1's eval was overwritten by its rerun


def test_without_matplotlib_the_chart_is_drawn_in_the_terminal(tmp_path):
    path = _metrics(tmp_path)
    nomp = fake_module(tmp_path, {"matplotlib/__init__.py": "raise ImportError('stand-in')\n"})
    proc = script("plot_metrics.py", path, pythonpath=nomp)
    assert proc.returncode == 0 and "* train loss" in proc.stdout
    assert "pip install matplotlib" in proc.stderr
    proc = script("plot_metrics.py", path, "-o", tmp_path / "x.png", pythonpath=nomp)
    assert proc.returncode == 1  # a PNG was asked for and cannot be made


def test_malformed_metrics_are_refused_with_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "loss": 1}\nnot json\n')
    proc = script("plot_metrics.py", bad)
    assert proc.returncode == 1 and "line 2: not JSON" in proc.stderr and "Traceback" not in proc.stderr
    bad.write_text('{"loss": 1}\n')
    assert "line 1: a record needs 'step' and 'loss'" in script("plot_metrics.py", bad).stderr
    assert "cannot read" in script("plot_metrics.py", tmp_path / "none.jsonl").stderr
