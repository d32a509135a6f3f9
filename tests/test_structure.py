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
