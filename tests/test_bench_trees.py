"""benchmarks/bench_trees.py: one step of this checkout against another's, rounds alternated."""
import re

import pytest

from conftest import ROOT, run_script


def test_this_checkout_against_itself_is_level_and_prints_both_medians():
    proc = run_script("benchmarks/bench_trees.py", "--other", ROOT, "--rounds", "4", "--n-layer", "1",
                      "--n-embd", "32", "--batch-size", "2", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1 layers, C=32, B=2, T=64, tp=1, optimize(); 4 rounds of 9 steps each" in proc.stdout
    assert re.search(r"step medians: this [\d.]+ ms, other [\d.]+ ms", proc.stdout), proc.stdout
    ratio = re.search(r"this/other per round: median ([\d.]+), quartiles ([\d.]+) to ([\d.]+)", proc.stdout)
    assert ratio and float(ratio[2]) <= float(ratio[1]) <= float(ratio[3]), proc.stdout
    assert 0.2 < float(ratio[1]) < 5, proc.stdout  # the same code both sides: level, up to a shared machine's noise


@pytest.mark.parametrize("args, message", [
    (["--other", "/nonexistent"], "--other '/nonexistent' is not a checkout: it has no 01_tensor_parallel.py"),
    (["--rounds", "3"], "--rounds 3: at least 4"),
    (["--n-layer", "0"], "--n-layer 0: must be at least 1"),
    (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["--n-embd", "30"], "--n-embd 30: must be a positive multiple of the 4 heads"),
])
def test_each_bad_flag_is_refused_by_name_before_a_child_starts(args, message):
    argv = args if args[0] == "--other" else ["--other", ROOT, *args]
    proc = run_script("benchmarks/bench_trees.py", *argv, timeout=30)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
