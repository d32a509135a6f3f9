"""exercises/: the autograder is honest. Every exercise passes against the numbered file's own
functions, fails against its untouched stub as "not implemented" with the stub's hint, and every
planted mistake fails with the diagnosis written beside it; the diagnoses themselves (a tp-fold
gradient, a flipped sign, a known wrong answer) are checked on hand-made tensors.

Tolerance: the checks compare with the serial model in float64 to 1e-10, for the reasons given in
test_tensor_parallel.py (a parallel piece only reorders additions, ~1e-15; a bug is O(1)).
The ranks are forked in-process by plumbing.launch (as the autograder always does); one test runs
the real command line, `python3 -m exercises check 01`, as a student would.
"""
import inspect
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, load

exercises = load("exercises")
autograder = load("exercises.autograder")
cli = load("exercises.__main__")
ALL = [e for f in exercises.FILES for e in exercises.exercises(f)]
BY_KEY = {e.key: e for e in ALL}
PLANTED = {p.name: (e, p) for e in ALL for p in e.planted}


def test_two_to_four_exercises_per_numbered_file_and_twelve_to_sixteen_in_the_course():
    counts = {f: len(exercises.exercises(f)) for f in exercises.FILES}
    assert all(2 <= n <= 4 for n in counts.values()), counts
    course = [e for e in ALL if e.file <= "05"]  # the four weeks (01-05); a later chapter's come after them
    assert 12 <= len(course) <= 16
    assert [e.key for e in ALL] == sorted(e.key for e in ALL) and len(BY_KEY) == len(ALL)
    assert all(len(e.title) <= 58 for e in ALL)  # one line each in `check`'s table


def test_the_exercises_readme_names_every_exercise():
    text = (ROOT / "exercises" / "README.md").read_text()
    assert all(e.key in text for e in ALL)


def test_every_stub_function_exists_with_a_docstring_and_every_exercise_cites_a_reading():
    for e in ALL:
        module = exercises.stub(e.file)
        for name in e.functions:
            assert len(getattr(module, name).__doc__ or "") > 20, (e.key, name)  # a class: its contract
        assert re.search(r"et al\. 20\d\d", e.reading), e.key


def _left_to_write(module):
    """{exercise key: the stub's functions and methods that raise its NotImplementedError}, read from
    the stub's source: "copy_to_tp" if it is given, "CopyToTP.forward" if a method raises."""
    out = {}
    for name, obj in vars(module).items():
        if getattr(obj, "__module__", None) != module.__name__:
            continue  # imported, not the stub's own
        members = [(f"{name}.{m}", v.__func__ if isinstance(v, staticmethod) else v)
                   for m, v in vars(obj).items() if isinstance(v, staticmethod) or inspect.isfunction(v)] \
            if isinstance(obj, type) else [(name, obj)] if inspect.isfunction(obj) else []
        for qualified, fn in members:
            for key in re.findall(r'NotImplementedError\("(\d\d\.\d) ', inspect.getsource(fn)):
                out.setdefault(key, set()).add(qualified)
    return out


def test_exercises_list_names_exactly_what_each_stub_leaves_to_write(capsys):
    # What raises in a stub is what the student writes; `list` names that, and nothing the stub gives.
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    listed = dict(re.findall(r"^  (\d\d\.\d) .*\n +write: (.*); read: ", out, re.M))
    assert set(listed) == set(BY_KEY)
    for file in exercises.FILES:
        raising = _left_to_write(exercises.stub(file))
        assert set(raising) == {e.key for e in ALL if e.file == file}, (file, raising)
        for key, names in raising.items():
            named = set(re.findall(r"([\w.]+?)(?: and (\.\w+))?(?:,| \(in place of [^)]*\)|$)", listed[key]))
            written = set()
            for first, second in named:
                written.add(first)
                if second:
                    written.add(first.rsplit(".", 1)[0] + second)
            assert written == names, (key, listed[key], names)


def _signature(fn):
    """The parameters' names and kinds, and which have defaults (a default's value may be its own)."""
    return [(p.name, p.kind, p.default is p.empty) for p in inspect.signature(fn).parameters.values()]


def test_every_stub_has_the_signature_of_the_numbered_files_piece_it_replaces():
    for e in ALL:
        module = exercises.stub(e.file)
        for name, solution in e.reference().items():
            if solution is None:  # a piece with no function of its own in the numbered file
                continue
            mine = getattr(module, name)
            if isinstance(solution, type):  # an autograd Function: forward and backward alike
                assert isinstance(mine, type) and issubclass(mine, torch.autograd.Function), (e.key, name)
                for method in ("forward", "backward"):
                    assert _signature(getattr(mine, method)) == _signature(getattr(solution, method)), \
                        (e.key, name, method)
            else:
                assert _signature(mine) == _signature(solution), (e.key, name)


def test_01s_pieces_are_graded_inside_01s_model_on_its_default_path():
    # Each planted mistake of 01 also shows in the whole GPT-2, built as 01's demo builds it: the
    # student's pieces are what 01's own layers and loss call.
    for name in ("g_backward_all_reduces", "f_backward_identity", "bias_before_reduce", "cross_entropy_local_sum",
                 "gather_backward_splits"):
        e, planted = PLANTED[name]
        result = autograder.grade(e, {**e.reference(), **planted.impl()})
        assert any(line.startswith("in the whole model") for line in result.lines), (name, result.lines)


@pytest.mark.parametrize("key", list(BY_KEY))
def test_every_exercise_passes_against_the_numbered_files_own_functions(key):
    e = BY_KEY[key]
    result = autograder.grade(e, e.reference())
    assert result.status == "pass", (key, result.lines)


@pytest.mark.parametrize("key", list(BY_KEY))
def test_every_exercise_fails_against_its_untouched_stub_as_not_implemented_with_its_hint(key):
    e = BY_KEY[key]
    result = autograder.grade(e, exercises.student_impl(e))
    assert result.status == "not implemented", (key, result.lines)
    (hint,) = result.lines
    assert hint.startswith(key + " "), hint  # the stub's own words, naming the exercise
    assert re.search(r"Read .*(et al\. 20\d\d)", hint), hint  # the reading
    assert f"python3 -m exercises check {key}" in hint, hint  # and the command to run


@pytest.mark.parametrize("name", list(PLANTED))
def test_every_planted_mistake_fails_with_its_diagnosis(name):
    e, planted = PLANTED[name]
    result = autograder.grade(e, {**e.reference(), **planted.impl()})
    assert result.status == "fail", (name, result.status, result.lines)
    assert any(planted.expect in line for line in result.lines), (name, planted.expect, result.lines)


def test_every_numbered_file_has_a_planted_mistake_and_g_backward_all_reducing_is_one():
    assert {e.file for e, _ in PLANTED.values()} == set(exercises.FILES)
    e, planted = PLANTED["g_backward_all_reduces"]
    result = autograder.grade(e, {**e.reference(), **planted.impl()})
    text = "\n".join(result.lines)
    assert "g's backward is the identity" in text  # the operator alone
    assert "is tp=2 x too large: summed over the ranks once too often: did a backward all-reduce twice?" in text


# ----------------------------------------------------------------------------------------------
# The diagnosis, on tensors made by hand


def test_compare_names_a_factor_a_sign_zeros_a_shape_a_known_mistake_or_how_far_off():
    want = torch.randn(4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert autograder.compare(want + 1e-14, want) is None  # float64 reordering: a match
    assert autograder.compare(2 * want, want, factors={"tp": 2}) == ("tp x too large", "is tp=2 x too large")
    assert autograder.compare(want / 4, want, factors={"dp": 4}) == ("dp x too small", "is dp=4 x too small")
    assert autograder.compare(3 * want, want)[1] == "is 3 x what it should be"
    assert autograder.compare(-want, want)[0] == "sign"
    assert autograder.compare(torch.zeros_like(want), want)[0] == "zero"
    assert autograder.compare(None, want)[0] == "missing"
    assert autograder.compare(want[:2], want)[1] == "has shape (2, 5), expected (4, 5)"
    assert autograder.compare(want * float("nan"), want)[0] == "nonfinite"
    wrong = want.clone()
    wrong[0] += 1
    assert autograder.compare(wrong, want, suspects=[(wrong.clone(), "the first row moved")]) == \
        ("suspect", "the first row moved")
    kind, words = autograder.compare(wrong, want)
    assert kind == "other" and "5 of 20 entries differ" in words and ("(too large)" in words or "(too small)" in words)


def test_differences_put_the_most_telling_first_and_append_the_hint_of_their_kind():
    want = torch.ones(3, dtype=torch.float64)
    lines = autograder.differences([("a", want + torch.tensor([0.0, 0.0, 1.0]), want), ("b", 2 * want, want)],
                                   {"tp x too large": "summed twice?"}, factors={"tp": 2})
    assert lines[0] == "b is tp=2 x too large: summed twice?" and lines[1].startswith("a is off by")


def _hangs(env):
    group = autograder.new_group([0, 1])
    if env.rank == 0:  # rank 1 never joins this all-reduce
        torch.distributed.all_reduce(torch.ones(1), group=group)
    else:
        import time
        time.sleep(30)


def test_a_collective_only_some_ranks_call_ends_as_an_error_saying_so(monkeypatch):
    monkeypatch.setattr(autograder, "COLLECTIVE_TIMEOUT_S", 3)
    monkeypatch.setattr(autograder, "DEADLINE_S", 20)
    e = autograder.Exercise("00.1", "hang", "a hang", (), "nobody et al. 2000", lambda impl: autograder.ranks(_hangs, 2),
                            lambda: {})
    result = autograder.grade(e, {})
    assert result.status == "error" and "every rank of a group must call the same collectives" in result.lines[1]


def test_a_student_function_that_raises_is_an_error_naming_the_exception():
    e = BY_KEY["02.1"]
    result = autograder.grade(e, {"gpipe": lambda pp, m, stage: 1 / 0})
    assert result.status == "error" and "gpipe(1, 1, 0) raised ZeroDivisionError" in result.lines[0]


def _torch_not_implemented(pp, m, stage):
    raise NotImplementedError("an operator without a kernel for this dtype")  # not a stub's hint


def test_a_not_implemented_error_that_is_not_a_stubs_hint_is_an_error_not_a_stub():
    result = autograder.grade(BY_KEY["02.1"], {"gpipe": _torch_not_implemented})
    assert result.status == "error" and "an operator without a kernel" in result.lines[0]


# ----------------------------------------------------------------------------------------------
# The command line


def test_check_solution_and_planted_exit_0_and_an_unknown_name_exits_2(capsys):
    assert cli.main(["check", "03", "05.1", "--solution"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 3 and "3 of 3 pass" in out
    assert cli.main(["check", "02", "--planted", "warmup_too_short"]) == 0  # caught, as it should be
    assert "the autograder caught it" in capsys.readouterr().out
    assert cli.main(["check", "07"]) == 2 and "unknown file '07'" in capsys.readouterr().err
    assert cli.main(["check", "02.9"]) == 2 and "no exercise '02.9'" in capsys.readouterr().err
    assert cli.main(["list"]) == 0 and "planted g_backward_all_reduces" in capsys.readouterr().out


def test_python3_m_exercises_check_01_lists_each_stub_as_not_implemented_with_its_hint():
    proc = subprocess.run([sys.executable, "-m", "exercises", "check", "01"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    out = proc.stdout
    assert out.count("not implemented  (") == 4 and "0 of 4 pass, 4 not implemented" in out
    out = re.sub(r"\n +", " ", out)  # the hints are wrapped: join their lines
    for key in ("01.1", "01.2", "01.3", "01.4"):
        assert f"python3 -m exercises check {key}" in out
    assert "Shoeybi et al. 2019, Section 3" in out and "Korthikanti et al. 2022, Section 4.2.2" in out
