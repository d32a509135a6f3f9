"""The slowest grids run a representative part by default and every case under --full-grid (conftest.py).

A grid's kept cases are named by id, so a renamed case must not quietly leave a grid running nothing: a
test checks every keep id against the whole suite's cases. Naming one case by id runs that case.
"""
import ast
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import COLLECTED, ROOT, grid_selection, kept


def _item(name, case=None, keep=None, full_grid=False):
    marks = {"grid": None if keep is None else SimpleNamespace(kwargs={"keep": keep}),
             "full_grid": SimpleNamespace(kwargs={"covered_by": ["test_plain"]}) if full_grid else None}
    item = SimpleNamespace(originalname=name, path=ROOT / "tests" / "test_x.py", get_closest_marker=marks.get,
                           nodeid=f"tests/test_x.py::{name}" + (f"[{case}]" if case is not None else ""))
    if case is not None:
        item.callspec = SimpleNamespace(id=case)
    return item


def test_a_grid_keeps_the_cases_it_names_and_every_other_test_runs():
    plain, single = _item("test_plain"), _item("test_params", "a")  # unmarked: always kept
    grid = [_item("test_grid", case, keep=["2", "8"]) for case in ("1", "2", "4", "8")]
    kept, dropped = grid_selection([plain, single, *grid])
    assert kept == [plain, single, grid[1], grid[3]] and dropped == [grid[0], grid[2]]


def test_a_grid_collected_in_part_runs_the_cases_asked_for():
    grid = [_item("test_grid", case, keep=["2", "8"]) for case in ("1", "4")]  # e.g. test_grid[1] named by id
    assert grid_selection(grid) == (grid, [])


def test_a_full_grid_test_runs_only_when_named():
    plain, slow = _item("test_plain"), _item("test_slow", full_grid=True)
    assert grid_selection([plain, slow]) == ([plain], [slow])
    assert grid_selection([plain, slow], named=["tests/test_x.py::test_slow"]) == ([plain, slow], [])


def test_every_kept_id_names_a_case_of_its_grid(pytestconfig):
    # Every case of the suite: those this session collected when it collected the whole suite (CI's run:
    # its collection, before any deselection, is what --full-grid collects), else a collection of its own.
    collected = pytestconfig.stash.get(COLLECTED, None)
    if collected is None:
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "--full-grid", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout[-800:] + out.stderr[-800:]
        collected = out.stdout.splitlines()
    cases = {}
    for line in collected:
        if "::" in line and "[" in line:
            name, case = line.split("[", 1)
            cases.setdefault(name, set()).add(case[:-1])
    marks = re.findall(r"@pytest\.mark\.grid\(keep=(\[.*?\])\)\n(?:[@# ].*\n)*def (\w+)\(", "".join(
        f"\n# {p.name}\n" + p.read_text() for p in sorted((ROOT / "tests").glob("test_*.py"))))
    assert len(marks) >= 14  # every marked grid of the suite is found (14 when the loss contract and simt landed)
    for keep, func in marks:
        ids = next(ids for name, ids in cases.items() if name.endswith("::" + func))
        unmatched = [k for k in ast.literal_eval(keep) if not any(kept(i, [k]) for i in ids)]
        assert not unmatched, (func, unmatched)
    # Every test a full_grid mark names in covered_by is one that CI runs: defined, and not full_grid itself.
    defined, slow = set(), {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                defined.add(node.name)
                for d in node.decorator_list:
                    if isinstance(d, ast.Call) and ast.unparse(d.func) == "pytest.mark.full_grid":
                        kw = {k.arg: k.value for k in d.keywords}
                        assert set(kw) == {"covered_by", "why"}, (node.name, set(kw))
                        slow[node.name] = ast.literal_eval(kw["covered_by"])
    assert len(slow) >= 4  # every full_grid test of the suite is found (4 when they were marked)
    for name, covered in slow.items():
        assert covered and all(c in defined and c not in slow for c in covered), (name, covered)


@pytest.mark.parametrize("flags, selected", [([], "3/6 tests collected (3 deselected)"), (["--full-grid"], "6 tests collected")])
def test_pytest_itself_deselects_the_rest_of_a_grid_unless_full_grid(flags, selected):
    target = "tests/test_data_parallel.py::test_naive_bucketed_and_zero1_equal_serial_over_10_adamw_steps"
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", target, *flags],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and selected in out.stdout, out.stdout[-800:] + out.stderr[-800:]
