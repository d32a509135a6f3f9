"""exercises/: the autograder is honest. Every exercise passes against the numbered file's own
functions, fails against its untouched stub as "not implemented" with the stub's hint, and every
planted mistake fails with the diagnosis written beside it; the diagnoses themselves (a tp-fold
gradient, a flipped sign, a known wrong answer) are checked on hand-made tensors.

Tolerance: the checks compare with the serial model in float64 to 1e-10, for the reasons given in
test_tensor_parallel.py (a parallel piece only reorders additions, ~1e-15; a bug is O(1)).
The ranks are forked in-process by plumbing.launch (as the autograder always does); one test runs
the real command line, `python3 -m exercises check 01`, as a student would.

The guard (autograder.guarded): each planted mistake of the kinds it catches (None returned, the
wrong number of gradients, a gradient of the wrong shape, an input written in place) must fail at
the line marked "# the mistake" in the planted code's source, read here from that source, and name
no other file or line. `--json`: results.json is validated against the JSON Schema block of
exercises/README.md by a small validator here, for a passing, a failing planted and an untouched
stub run; `--help` must list every numbered file that has a stub file on disk.
"""
import inspect
import json
import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

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
    course = [e for e in ALL if e.file <= "05"]  # the four weeks' own (01-05); 06 and 07 are their extra credit
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
            if isinstance(solution, type) and issubclass(solution, torch.nn.Module):  # 09.1's MoE: the
                # numbered class with the methods the stub defines (forward), each of the same signature
                assert isinstance(mine, type) and issubclass(mine, solution), (e.key, name)
                methods = [m for m, v in vars(mine).items() if inspect.isfunction(v)]
                assert methods, (e.key, name)
                for method in methods:
                    assert _signature(getattr(mine, method)) == _signature(getattr(solution, method)), \
                        (e.key, name, method)
            elif isinstance(solution, type):  # an autograd Function: forward and backward alike
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


def _divides_by_zero(stage, microbatches, pp_group=None, weights=None):
    return 1 / 0


def test_a_student_function_that_raises_is_an_error_naming_the_exception():
    e = BY_KEY["02.1"]  # raised on its ranks
    result = autograder.grade(e, {"gpipe_step": _divides_by_zero})
    assert result.status == "error" and "ZeroDivisionError" in result.lines[0], result.lines
    assert re.search(r"at \S*test_exercises\.py:\d+ in _divides_by_zero", result.lines[1]), result.lines  # its line


def _torch_not_implemented(stage, microbatches, pp_group=None, weights=None):
    raise NotImplementedError("an operator without a kernel for this dtype")  # not a stub's hint


def test_a_not_implemented_error_that_is_not_a_stubs_hint_is_an_error_not_a_stub():
    result = autograder.grade(BY_KEY["02.1"], {"gpipe_step": _torch_not_implemented})
    assert result.status == "error" and "an operator without a kernel" in result.lines[0]


def test_a_deadlock_the_lesson_watch_does_not_see_ends_as_an_error_at_the_collective_timeout(monkeypatch):
    # 02.2's planted steady_past_the_end waits, in its last steady step, for the input of a microbatch
    # that does not exist: the watch (checks_02.Watch) stops it first. Without the watch the rank waits
    # in dist.recv for a message nobody sends, and the grader's collective timeout ends it, said so.
    checks_02 = load("exercises.checks_02")
    monkeypatch.setattr(autograder, "COLLECTIVE_TIMEOUT_S", 3)
    monkeypatch.setattr(autograder, "DEADLINE_S", 30)
    monkeypatch.setattr(checks_02.Watch, "awaits", lambda self, *args, **kwargs: None)
    e, planted = PLANTED["steady_past_the_end"]
    result = autograder.grade(e, {**e.reference(), **planted.impl()})
    assert result.status == "error" and "a collective timed out" in " ".join(result.lines), result.lines


def test_the_lesson_loops_are_graded_without_the_numbered_files_own_loop():
    # The student copy replaces 02's gpipe_step and one_f_one_b_step and 03's interleaved_step by their
    # stubs: the checks must not need them. With the numbered file's own made to raise, the reference
    # (the same code, passed as the student's) still passes: its answer is the serial model's.
    pipeline, interleaved = load("02_pipeline_1f1b"), load("03_interleaved")

    def gone(*args, **kwargs):
        raise AssertionError("the check called the numbered file's own loop")
    for key, owner, attr in (("02.1", pipeline, "gpipe_step"), ("02.2", pipeline, "one_f_one_b_step"),
                             ("03.2", interleaved, "interleaved_step")):
        e = BY_KEY[key]
        impl = e.reference()
        with autograder.installed((owner, attr, gone)):
            result = autograder.grade(e, impl)
        assert result.status == "pass", (key, result.lines)


def test_05s_lesson_pieces_are_graded_without_05s_own():
    # The student copy replaces 05's rank_grid, new_groups, adamw and ptd_p_step by their stubs: no check
    # may take its expected answer (the grid, the groups, the optimizer) from them. With all four made to
    # raise, each reference (the same code, passed as the student's) still passes.
    gpt3d = load("05_3d_gpt")

    def gone(*args, **kwargs):
        raise AssertionError("the check called 05's own lesson piece")
    pieces = ("rank_grid", "new_groups", "adamw", "ptd_p_step")
    impls = {key: BY_KEY[key].reference() for key in ("05.1", "05.2", "05.3", "05.4")}
    with autograder.installed(*[(gpt3d, name, gone) for name in pieces]):
        for key, impl in impls.items():
            result = autograder.grade(BY_KEY[key], impl)
            assert result.status == "pass", (key, result.lines)


# ----------------------------------------------------------------------------------------------
# The command line


def test_check_solution_and_planted_exit_0_and_an_unknown_name_exits_2(capsys):
    assert cli.main(["check", "03", "05.1", "--solution"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 3 and "3 of 3 pass" in out
    assert cli.main(["check", "02", "--planted", "warmup_too_short"]) == 0  # caught, as it should be
    assert "the autograder caught it" in capsys.readouterr().out
    assert cli.main(["check", "10"]) == 2 and "unknown file '10'" in capsys.readouterr().err
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


# ----------------------------------------------------------------------------------------------
# The guard: what a student's function returns is checked as it returns, and said at its own line


def _marked_line(planted):
    """(file, line) of the one line marked "# the mistake" in the source of a planted mistake's
    functions (an autograd Function's methods, or the function itself)."""
    found = []
    for obj in planted.impl().values():
        fns = [v.__func__ if isinstance(v, staticmethod) else v for v in vars(obj).values()
               if isinstance(v, staticmethod) or inspect.isfunction(v)] if isinstance(obj, type) else [obj]
        for fn in fns:
            lines, start = inspect.getsourcelines(fn)
            found += [(fn.__code__.co_filename, start + i) for i, text in enumerate(lines) if "# the mistake" in text]
    assert len(found) == 1, (planted.name, found)
    return found[0]


AT_LINE = [name for name, (e, p) in PLANTED.items() if p.at_line]


def test_the_guarded_planted_mistakes_cover_01s_functions_and_two_other_exercises():
    keys = {PLANTED[name][0].key for name in AT_LINE}
    assert {"01.1", "01.3", "01.4"} <= keys and len(keys - {"01.1", "01.3", "01.4"}) >= 2, keys
    kinds = " ".join(PLANTED[name][1].expect for name in AT_LINE)
    for rule in ("returns None", "one gradient per input", "the shape of the input", "in place"):
        assert rule in kinds, rule


@pytest.mark.parametrize("name", AT_LINE)
def test_a_guarded_mistake_is_said_at_its_planted_line_with_the_rule_and_no_traceback(name):
    # The planted line is found here, from the planted code's source (the line marked "# the
    # mistake"), not from the grader: every file:line the failure names must be that one.
    e, planted = PLANTED[name]
    path, line = _marked_line(planted)
    result = autograder.grade(e, {**e.reference(), **planted.impl()})
    text = "\n".join(result.lines)
    assert result.status == "fail" and planted.expect in text, (name, result.status, result.lines)
    named = re.findall(r"([\w./-]+\.py):(\d+)", text)
    assert named and all(path.endswith(f) and int(n) == line for f, n in named), (name, path, line, named)
    assert "Traceback" not in text and "autograder.py" not in text


STUDENT_01 = """\
    import importlib

    import torch
    import torch.distributed as dist

    tensor_parallel = importlib.import_module("01_tensor_parallel")
    ReduceFromTP = tensor_parallel.ReduceFromTP


    class CopyToTP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x

        @staticmethod
        def backward(ctx, grad):
            if grad is None:  # two returns: the line is the one that ran, seen by a trace of this frame
                return None, None
            return dist.all_reduce(grad, group=ctx.group), None
"""


def test_the_commonest_mistake_in_a_students_file_is_said_at_its_return_line_not_in_the_grader(tmp_path, capsys):
    # The case: f's backward returns the in-place dist.all_reduce (None). It crashed the
    # grader (AttributeError at exercises/checks_01.py:85); it is now a failure at the student's line.
    path = tmp_path / "my_01.py"
    path.write_text(textwrap.dedent(STUDENT_01))
    source = textwrap.dedent(STUDENT_01).splitlines()
    line = source.index("        return dist.all_reduce(grad, group=ctx.group), None") + 1
    assert cli.main(["check", "01.1", "--file", str(path), "--json", str(tmp_path / "results.json")]) == 1
    out = re.sub(r"\n +", " ", capsys.readouterr().out)
    assert f"{path}:{line} in CopyToTP.backward" in out, out
    assert "backward returns one gradient per input of forward" in out and \
        "`dist.all_reduce` works in place and returns None" in out
    assert "checks_01.py" not in out and "AttributeError" not in out and "Traceback" not in out
    (test,) = json.loads((tmp_path / "results.json").read_text())["tests"]
    assert test["status"] == "failed" and f"{path}:{line}" in test["output"]


STUDENT_05_2 = """\
    import importlib
    from datetime import timedelta

    import torch.distributed as dist

    Groups = importlib.import_module("05_3d_gpt").Groups


    def new_groups(env, grid, timeout_s=60.0):
        mine = {}
        for kind, groups in grid.items():
            LINE
        return Groups(**mine)
"""
SUBGROUPS_RIGHT = "mine[kind] = dist.new_subgroups_by_enumeration(groups, timeout=timedelta(seconds=timeout_s))[0] " \
                  "if groups else None"
SUBGROUPS_EMPTY = "mine[kind], _ = dist.new_subgroups_by_enumeration(groups, timeout=timedelta(seconds=timeout_s))"
NEEDS_A_GROUP = "mine[kind] = dist.new_group(groups[0], backend=dist.get_backend()) if groups else None"


@pytest.mark.parametrize("line, status, said", [
    (SUBGROUPS_RIGHT, "pass", None),
    (SUBGROUPS_EMPTY, "fail", "dist.new_subgroups_by_enumeration is given an empty list, which it refuses: a kind "
                              "with no group (grid['embed'] is [] at pp = 1"),
    (NEEDS_A_GROUP, "fail", "calls a torch.distributed function that needs a started process group: new_groups is "
                            "graded first on each rank in turn")], ids=["subgroups", "subgroups_empty", "get_backend"])
def test_05_2_with_torchs_group_helpers_is_graded_on_the_groups_it_makes_and_said_at_the_students_line(
        tmp_path, capsys, line, status, said):
    # The case: dist.new_subgroups_by_enumeration, which calls torch's own new_group and get_rank,
    # raised "Default process group has not been initialized" from inside torch. Used right, it passes (on
    # the recorded grids and on 4 real ranks); given 05's empty embed list at pp = 1, or beside a call that
    # needs a started group, it fails in a sentence at the student's line, with the rule.
    path = tmp_path / "my_05.py"
    text = textwrap.dedent(STUDENT_05_2).replace("LINE", line)
    path.write_text(text)
    at = [s.strip() for s in text.splitlines()].index(line) + 1
    code = cli.main(["check", "05.2", "--file", str(path)])
    out = re.sub(r"\n +", " ", capsys.readouterr().out)
    assert (code == 0) == (status == "pass") and (" PASS " if status == "pass" else " FAIL ") in out, out
    if said:
        assert f"{path}:{at}" in out and said in out, out
        assert "not been initialized" not in out and "Traceback" not in out and "checks_05.py" not in out, out


def test_the_guard_lets_a_right_answer_through_and_leaves_the_wrapped_function_as_it_was():
    e = BY_KEY["01.1"]
    impl = autograder.guarded(e, e.reference())
    assert issubclass(impl["CopyToTP"], e.reference()["CopyToTP"])  # a subclass: 01's own methods underneath
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    y = impl["CopyToTP"].apply(x, None)  # tp 1: no group needed by f's identity
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(3, dtype=torch.float64))
    fn = autograder.guarded_callable(lambda a: a * 2, always_returns=True)
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(autograder.Mistake, match="it returned None"):
        autograder.guarded_callable(lambda a: None, always_returns=True)(torch.ones(2))
    assert autograder.guarded_callable(lambda a: None, always_returns=False)(torch.ones(2)) is None


# ----------------------------------------------------------------------------------------------
# --json: results.json against the schema exercises/README.md documents; --help from the table


def _schema():
    text = (ROOT / "exercises" / "README.md").read_text()
    block = re.search(r"<!-- results\.json schema -->\n```json\n(.*?)\n```", text, re.S)
    assert block, "exercises/README.md has no results.json schema block"
    return json.loads(block.group(1))


TYPES = {"object": dict, "array": list, "string": str, "number": (int, float)}


def _violations(value, schema, where="results"):
    """What in value breaks schema (the JSON Schema keywords the README's block uses: type,
    required, additionalProperties, properties, items, enum, minimum); [] if nothing does."""
    kind = schema.get("type")
    if kind and (not isinstance(value, TYPES[kind]) or isinstance(value, bool)):
        return [f"{where} is {type(value).__name__}, not {kind}"]
    out = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where} = {value!r}, not one of {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        out.append(f"{where} = {value} < {schema['minimum']}")
    if kind == "object":
        out += [f"{where} has no {k!r}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            out += [f"{where} has {k!r}, not in the schema" for k in value if k not in schema.get("properties", {})]
        for k, sub in schema.get("properties", {}).items():
            if k in value:
                out += _violations(value[k], sub, f"{where}.{k}")
    if kind == "array":
        for i, item in enumerate(value):
            out += _violations(item, schema.get("items", {}), f"{where}[{i}]")
    return out


def _results(path):
    """results.json read, checked against the README's schema and its rules in words: score and
    max_score the sums of the tests', a test passed iff its score is its max_score: the points its
    week's handout gives it (docs/course/week*.md's exercise table, read here by its own pattern)."""
    data = json.loads(path.read_text())
    assert _violations(data, _schema()) == [], _violations(data, _schema())
    tests = data["tests"]
    assert data["score"] == sum(t["score"] for t in tests) and data["max_score"] == sum(t["max_score"] for t in tests)
    handouts = "".join(p.read_text() for p in (ROOT / "docs" / "course").glob("week*.md"))
    for t in tests:
        row = re.search(rf"^\| {re.escape(t['name'][:4])} \|.*\| (\d+) \|$", handouts, re.M)
        assert t["max_score"] == (int(row.group(1)) if row else 1), t
        assert t["score"] == (t["max_score"] if t["status"] == "passed" else 0), t
    return data


def test_the_schema_validator_finds_what_is_wrong():
    good = {"score": 1, "max_score": 1, "execution_time": 0.5,
            "tests": [{"name": "01.1 f", "score": 1, "max_score": 1, "status": "passed", "output": "PASS"}]}
    assert _violations(good, _schema()) == []
    bad = json.loads(json.dumps(good))
    bad["tests"][0]["status"] = "pass"
    del bad["execution_time"]
    bad["tests"][0]["extra"] = 1
    found = _violations(bad, _schema())
    assert len(found) == 3 and any("status" in f for f in found), found


def test_check_json_validates_for_a_passing_a_failing_planted_and_an_untouched_stub_run(tmp_path, capsys):
    path = tmp_path / "results.json"
    assert cli.main(["check", "01.1", "05.1", "--solution", "--json", str(path)]) == 0
    data = _results(path)
    assert data["score"] == data["max_score"] == 10 + 8 and [t["name"][:4] for t in data["tests"]] == ["01.1", "05.1"]
    assert all(t["status"] == "passed" and t["output"].startswith("PASS") for t in data["tests"])
    assert cli.main(["check", "01", "--planted", "g_backward_one_gradient", "--json", str(path)]) == 0  # caught
    data = _results(path)
    (test,) = data["tests"]
    assert data["score"] == 0 and test["status"] == "failed" and "one gradient per input of forward" in test["output"]
    assert cli.main(["check", "02", "--json", str(path)]) == 1  # the stubs as shipped
    data = _results(path)
    assert data["score"] == 0 and len(data["tests"]) == len(exercises.exercises("02"))
    assert all("not implemented" in t["output"] and "python3 -m exercises check 02." in t["output"]
               for t in data["tests"])
    capsys.readouterr()
    assert cli.main(["check", "02", "--json", str(tmp_path / "no" / "such" / "r.json")]) == 2
    assert "--json" in capsys.readouterr().err


def test_a_file_that_does_not_import_still_gets_a_results_json_failing_each_exercise(tmp_path, capsys):
    student, path = tmp_path / "broken.py", tmp_path / "results.json"
    student.write_text("def gpipe(pp, m, stage)\n")  # a syntax error
    assert cli.main(["check", "02", "--file", str(student), "--json", str(path)]) == 1
    data = _results(path)
    assert len(data["tests"]) == 3 and all("does not import" in t["output"] for t in data["tests"])


def test_help_names_every_numbered_file_that_has_exercises(capsys):
    # The chapters with exercises are read from the stub files on disk, not from the table the
    # help is generated from: a stub added without its table entry fails here.
    chapters = sorted({p.name[2:4] for p in (ROOT / "exercises").glob("ex[0-9][0-9]_*.py")})
    assert len(chapters) >= 7 and "08" in chapters
    helps = []
    for argv in (["--help"], ["check", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        helps.append(re.sub(r"\s+", " ", capsys.readouterr().out))
    for text in helps:
        listed = re.search(r"(\d\d(?:, \d\d)+)", text).group(1).split(", ")
        assert listed == chapters, (listed, chapters)


def test_results_json_gives_each_exercise_its_handouts_points_and_1_where_none_does(tmp_path):
    """The handouts are where a teacher sets points; results.json follows them (a planted handout)."""
    main_module = cli
    assert main_module.handout_points()["04.2"] == 15 and main_module.handout_points()["02.1"] == 8
    (tmp_path / "week1.md").write_text("| Exercise | Topic | Points |\n|---|---|---|\n| 01.1 | f and g | 7 |\n")
    (tmp_path / "notes.md").write_text("| 01.4 | not a week | 99 |\n")
    points = main_module.handout_points(str(tmp_path))
    assert points == {"01.1": 7.0}
    rows = [(e, SimpleNamespace(status=s, lines=[]), 0.1, []) for e, s in
            zip(exercises.exercises("01")[:1] + exercises.exercises("01")[3:4], ["pass", "fail"])]
    data = main_module.results(rows, 1.0, points)
    assert [(t["score"], t["max_score"]) for t in data["tests"]] == [(7.0, 7.0), (0.0, 1.0)]
    assert (data["score"], data["max_score"]) == (7.0, 8.0)
