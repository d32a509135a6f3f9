"""The chapters' structure, checked where reading can miss it: communication is named from outside
the concept code, so no layer, operator or Function of 01-04 carries a tracing tag."""
import ast

import pytest

from conftest import ROOT

CHAPTERS = ["01_tensor_parallel.py", "02_pipeline_1f1b.py", "03_interleaved.py", "04_data_parallel.py"]


def tags(path):
    """(line, what) for every parameter, attribute or keyword argument named `tag` in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.arg) and node.arg == "tag":
            found.append((node.lineno, "parameter"))
        elif isinstance(node, ast.Attribute) and node.attr == "tag":
            found.append((node.lineno, "attribute"))
        elif isinstance(node, ast.keyword) and node.arg == "tag":
            found.append((node.lineno, "keyword argument"))
    return found


@pytest.mark.parametrize("name", CHAPTERS)
def test_no_layer_operator_or_function_of_01_to_04_carries_a_tracing_tag(name):
    assert tags(ROOT / name) == []


def test_the_tag_finder_finds_each_kind_of_tag(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f(x, tag=''):\n    self.tag = tag\n    return g(x, tag='loss')\n")
    assert tags(planted) == [(1, "parameter"), (2, "attribute"), (3, "keyword argument")]


# ----------------------------------------------------------------------------------------------
# A later chapter extends an earlier one from outside (issue 32): 02 knows only F and B, its
# executor is small, and 05's train is the loop.


def _functions(path):
    return {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_02_knows_only_f_and_b_no_function_takes_a_later_chapters_parameter_and_execute_is_small():
    src = (ROOT / "02_pipeline_1f1b.py").read_text()
    tree = ast.parse(src)
    kinds = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "KINDS")
    assert sorted(k.value for k in kinds.value.keys) == ["B", "F"]
    for name, fn in _functions(ROOT / "02_pipeline_1f1b.py").items():
        args = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        assert not args & {"vocab", "split", "grad_from", "lockstep"}, name
    execute = _functions(ROOT / "02_pipeline_1f1b.py")["execute"]
    assert len(execute.args.args + execute.args.kwonlyargs) <= 8 and execute.end_lineno - execute.lineno < 70
    for later in ('"I"', '"W"', '"S"', '"T"', "I and W", "S and T"):  # no later kind named, even in prose
        assert later not in src, later


def test_05s_train_is_at_most_60_lines():
    train = _functions(ROOT / "05_3d_gpt.py")["train"]
    assert train.end_lineno - train.lineno + 1 <= 60
