"""The slowest grids run a representative part by default and every case under --full-grid (conftest.py).

A grid's kept cases are named by id, so a renamed case must not quietly leave a grid running nothing:
that is an error at collection. Checked on stand-in items, and once on a real file through pytest itself.
"""
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT, grid_selection


def _item(name, case=None, keep=None):
    mark = None if keep is None else SimpleNamespace(kwargs={"keep": keep})
    item = SimpleNamespace(originalname=name, path=ROOT / "tests" / "test_x.py", get_closest_marker=lambda _: mark)
    if case is not None:
        item.callspec = SimpleNamespace(id=case)
    return item


def test_a_grid_keeps_the_cases_it_names_and_every_other_test_runs():
    plain, single = _item("test_plain"), _item("test_params", "a")  # unmarked: always kept
    grid = [_item("test_grid", case, keep=["2", "8"]) for case in ("1", "2", "4", "8")]
    kept, dropped = grid_selection([plain, single, *grid])
    assert kept == [plain, single, grid[1], grid[3]] and dropped == [grid[0], grid[2]]


def test_a_kept_id_that_names_no_case_is_an_error_naming_the_grid_and_its_cases():
    grid = [_item("test_grid", case, keep=["2", "16"]) for case in ("1", "2")]
    with pytest.raises(pytest.UsageError, match=r"test_x.py::test_grid: grid\(keep=...\) names \['16'\], which are "
                                                r"not among its cases \['1', '2'\]"):
        grid_selection(grid)


@pytest.mark.parametrize("flags, selected", [([], "3/6 tests collected (3 deselected)"), (["--full-grid"], "6 tests collected")])
def test_pytest_itself_deselects_the_rest_of_a_grid_unless_full_grid(flags, selected):
    target = "tests/test_data_parallel.py::test_naive_bucketed_and_zero1_equal_serial_over_10_adamw_steps"
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", target, *flags],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and selected in out.stdout, out.stdout[-800:] + out.stderr[-800:]
