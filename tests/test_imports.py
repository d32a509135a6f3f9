"""plumbing/__init__'s rule, measured in fresh interpreters: no import cycle between the numbered
files and plumbing. A plumbing module imports at import only numbered files that do not import it
at import (a cycle would leave one of the two half-initialised, depending on which came first)."""
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "plumbing").glob("*.py") if p.stem != "__init__")
CHAPTERS = sorted(p.stem for p in ROOT.glob("0[1-9]_*.py"))

PROBE = """
import importlib, json, os, sys
root, out = os.getcwd(), {}
for name in sys.argv[1:]:  # each from a clean slate: every module of this repository forgotten, torch kept
    for k in [k for k, v in sys.modules.items() if (getattr(v, "__file__", None) or "").startswith(root + os.sep)]:
        del sys.modules[k]
    importlib.import_module(name)
    out[name] = sorted(k for k, v in sys.modules.items() if k.startswith("plumbing.") or
                       os.path.basename(getattr(v, "__file__", None) or "")[:2] in {"01", "02", "03", "04", "05",
                                                                                   "06", "07", "08", "09"})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def closures():
    """What importing each plumbing module and each numbered file loads, every one from a clean slate."""
    names = [f"plumbing.{m}" for m in MODULES] + CHAPTERS
    out = subprocess.run([sys.executable, "-c", PROBE, *names], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return {k: set(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def cycles(closures):
    """(module, chapter) pairs where each loads the other at import."""
    return [(m, c) for m in MODULES for c in CHAPTERS
            if c in closures[f"plumbing.{m}"] and f"plumbing.{m}" in closures[c]]


def test_no_plumbing_module_and_numbered_file_import_each_other_at_import(closures):
    assert cycles(closures) == []


def test_a_cycle_would_be_seen(closures):  # the check above can fail: 01 made to load checkpoint.py at import
    planted = {**closures, "01_tensor_parallel": closures["01_tensor_parallel"] | {"plumbing.checkpoint"}}
    assert ("checkpoint", "01_tensor_parallel") in cycles(planted)


def test_the_modules_the_docstring_names_as_importing_01_or_02_do(closures):
    for m in ("checkpoint", "gpt2", "sample", "report"):
        assert closures[f"plumbing.{m}"] & {"01_tensor_parallel", "02_pipeline_1f1b"}, m
        assert not any(f"plumbing.{m}" in closures[c] for c in CHAPTERS[:4]), m
