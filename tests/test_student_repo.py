"""The student copy (python3 -m exercises student-repo OUT) holds no solution, and still runs; the
autograder refuses, by name, a submission that is the reference rather than the student's.

The copy is built once for the module (about 5 s); `check all` there and 01's demo run as a student
would run them, from the command line, in that folder.
"""
import importlib
import importlib.util
import inspect
import linecache
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from exercises import FILES, student_repo  # noqa: E402
from exercises import __main__ as cli  # noqa: E402
from exercises import exercises as exercises_of  # noqa: E402


def run(args, cwd, timeout=240):
    return subprocess.run([sys.executable, "-W", "ignore", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    out = tmp_path_factory.mktemp("course") / "student"
    done = run(["-m", "exercises", "student-repo", str(out)], ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_no_line_of_the_reference_solutions_is_in_the_student_copy(student):
    lines = student_repo.reference_lines()
    assert len(lines) > 100, f"only {len(lines)} reference lines: the grep would prove little"
    assert student_repo.leaks(str(student), lines) == []
    assert not (student / "docs" / "ANSWERS.md").exists() and not (student / "tests").exists()
    for doc in ("README.md", "docs/GUIDE.md", "docs/COURSE.md"):
        assert "ANSWERS.md)" not in (student / doc).read_text(encoding="utf-8"), doc  # no link to the key
    assert student_repo.KEY_IS_THE_INSTRUCTORS in (student / "docs" / "GUIDE.md").read_text(encoding="utf-8")


def test_the_grep_finds_the_solutions_where_they_are(tmp_path):
    # The same grep over the instructor's numbered files and planted mistakes finds them: it can fail.
    for name in ("01_tensor_parallel.py", "09_expert_parallel.py", "exercises/checks_01.py"):
        os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    found = {path for path, *_ in student_repo.leaks(str(tmp_path))}
    assert found == {"01_tensor_parallel.py", "09_expert_parallel.py", os.path.join("exercises", "checks_01.py")}


def test_check_all_on_the_untouched_stubs_says_not_implemented_for_every_exercise(student):
    keys = re.findall(r"^  (\d\d\.\d) ", run(["-m", "exercises", "list"], student).stdout, re.M)
    assert len(keys) == sum(len(exercises_of(f)) for f in FILES) >= 20
    done = run(["-m", "exercises", "check", "all"], student)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    for key in keys:
        assert re.search(rf"^  {re.escape(key)} .* not implemented  \(", done.stdout, re.M), (key, done.stdout)
    assert f"0 of {len(keys)} pass, {len(keys)} not implemented" in done.stdout


def _left_running(session):
    """The pids of processes still in a session (Linux /proc; None where there is none)."""
    if not os.path.isdir("/proc/self"):
        return None
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] not in "ZX":  # stat's field 6, the session
            found.append(int(pid))
    return found


def test_01s_demo_runs_up_to_its_first_stub_and_names_it(student):
    # The serial model runs the linears before f and g (tp = 1 calls neither), so the first stub
    # 01's demo reaches is 01.2's ColumnParallelLinear.forward. Both ranks reach it: the launcher says
    # so once, in one sentence (the exercise, the function, the student's file:line, the check to
    # run), with no rank's traceback, and stops every rank.
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "01_tensor_parallel.py"], cwd=student, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 1, stdout + stderr
    assert "Traceback" not in stderr, stderr
    last = (stdout + stderr).strip().splitlines()[-1]
    assert re.search(r"NotImplementedError: 01\.2 ColumnParallelLinear\.forward: .*python3 -m exercises check 01\.2",
                     last), last
    stub = next(n for n, line in enumerate((student / "01_tensor_parallel.py").read_text().splitlines(), 1)
                if 'raise NotImplementedError("01.2 ColumnParallelLinear.forward' in line)
    assert last.startswith(f"error: ranks 0 and 1 reached the stub of exercise 01.2, ColumnParallelLinear.forward "
                           f"(01_tensor_parallel.py:{stub}), which is not written yet: "), last
    assert stderr.count("NotImplementedError") == 1, stderr  # one sentence for the job, not one per rank
    time.sleep(0.5)
    assert _left_running(proc.pid) in (None, []), "ranks left running after the demo stopped"


def test_the_student_copy_refuses_an_out_that_is_not_empty_or_inside_the_repository(tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(student_repo.StudentRepoError, match=re.escape(str(tmp_path)) + ": it exists and is not empty"):
        student_repo.refuse(str(tmp_path))
    inside = os.path.join(ROOT, "exercises", "out")
    with pytest.raises(student_repo.StudentRepoError, match="lies inside the repository"):
        student_repo.refuse(inside)


def test_a_file_that_re_exports_01s_copy_to_tp_is_refused_by_name(tmp_path, capsys):
    mine = tmp_path / "mine.py"
    mine.write_text('import importlib\ntp = importlib.import_module("01_tensor_parallel")\n'
                    'CopyToTP, ReduceFromTP = tp.CopyToTP, tp.ReduceFromTP\n')
    assert cli.main(["check", "01.1", "--file", str(mine)]) == 1
    said = " ".join(capsys.readouterr().out.split())
    assert ("01.1: CopyToTP is 01_tensor_parallel.py's own (imported, not written): write it in "
            "ex01_tensor_parallel.py") in said


def test_a_copy_of_the_references_source_is_refused_and_the_stubs_are_not():
    tp = importlib.import_module("01_tensor_parallel")
    exercise = exercises_of("01")[0]
    namespace = {}
    source = "import torch\n" + inspect.getsource(tp.CopyToTP) + "\n" + inspect.getsource(tp.ReduceFromTP)
    exec(compile(source, os.path.join(ROOT, "tests", "copied.py"), "exec"), namespace)  # noqa: S102
    # inspect reads a method's source through linecache: give it this text under that name
    linecache.cache[os.path.join(ROOT, "tests", "copied.py")] = (len(source), None, source.splitlines(True), "x")
    said = cli.not_written(exercise, {n: namespace[n] for n in exercise.functions})
    assert said and all("is a copy of 01_tensor_parallel.py's own" in s for s in said), said
    for file in FILES:  # the untouched stubs are the student's, not the reference
        for e in exercises_of(file):
            assert cli.not_written(e, {n: getattr(importlib.import_module(f"exercises.{FILES[file][1]}"), n)
                                       for n in e.functions}) == [], e.key


OWN_F_AND_G = """\
import torch
from exercises.ex01_tensor_parallel import all_reduce, gather, reduce_scatter, SEQ


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather(x, group, SEQ)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group, SEQ), None


class ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group, SEQ)

    @staticmethod
    def backward(ctx, grad):
        return gather(grad, ctx.group, SEQ), None
"""


def test_a_students_own_f_and_g_are_not_called_a_copy_though_their_statements_are_the_references(tmp_path):
    # f, g and sequence parallelism's pair have one right answer, to the names the stub gives (3
    # statements each): a teacher's trial hand-in, written without looking, was refused as "a copy of
    # 01_tensor_parallel.py's own". A short piece is a copy only if its docstrings and comments are
    # the reference's too (as 01's class, pasted whole, is: the test above).
    path = tmp_path / "own_01.py"
    path.write_text(OWN_F_AND_G)
    spec = importlib.util.spec_from_file_location("own_01", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tp = importlib.import_module("01_tensor_parallel")
    for exercise in (exercises_of("01")[0], exercises_of("01")[3]):
        impl = {n: getattr(module, n) for n in exercise.functions}
        assert all(cli._statements(impl[n]) == cli._statements(getattr(tp, n)) for n in impl)  # the same code
        assert cli.not_written(exercise, impl) == [], exercise.key
    source = OWN_F_AND_G.replace("class CopyToTP(torch.autograd.Function):\n",
                                 "class CopyToTP(torch.autograd.Function):\n    " + repr(tp.CopyToTP.__doc__) + "\n")
    path.write_text(source)  # the same, with 01's docstring pasted in: a copy
    spec.loader.exec_module(module)
    said = cli.not_written(exercises_of("01")[0], {n: getattr(module, n) for n in ("CopyToTP", "ReduceFromTP")})
    assert said == ["01.1: CopyToTP is a copy of 01_tensor_parallel.py's own (its source is the reference's): write it "
                    "yourself in ex01_tensor_parallel.py"], said


def test_in_the_student_copy_a_written_piece_is_graded_and_a_wrong_one_fails(student, tmp_path):
    # A student who has written 01.1 to 01.3 (here: 01's own code, typed in, as the instructor's
    # copy has it) passes 01.1 there, the serial model running their 01.2 and 01.3; 01.2's own check
    # needs 01's reference linears, so it says so instead; f's backward without its all-reduce fails.
    tp = importlib.import_module("01_tensor_parallel")
    forwards = [textwrap.dedent(inspect.getsource(m)).replace("def forward(", f"def {name}(", 1) for m, name in (
        (tp.ColumnParallelLinear.forward, "column_parallel_forward"),
        (tp.RowParallelLinear.forward, "row_parallel_forward"))]
    written = "\n\n".join([(student / "exercises" / "ex01_tensor_parallel.py").read_text(encoding="utf-8"),
                           "enter_tp, exit_tp, sp_param = tensor_parallel.enter_tp, tensor_parallel.exit_tp, "
                           "tensor_parallel.sp_param",
                           inspect.getsource(tp.CopyToTP), inspect.getsource(tp.ReduceFromTP),
                           inspect.getsource(tp._VocabParallelCrossEntropy),
                           *forwards]) + "\n"
    assert "return all_reduce(grad, ctx.group), None" in written  # the line the wrong copy drops
    mine, wrong = student / "exercises" / "ex01_tensor_parallel.py", tmp_path / "wrong.py"
    original = mine.read_text(encoding="utf-8")
    wrong.write_text(written.replace("return all_reduce(grad, ctx.group), None", "return grad, None", 1))
    mine.write_text(written)
    try:
        done = run(["-m", "exercises", "check", "01.1", "01.2"], student)
        failed = run(["-m", "exercises", "check", "01.1", "--file", str(wrong)], student)
    finally:
        mine.write_text(original)
    said = " ".join(done.stdout.split())
    assert re.search(r"01\.1 f and g, the conjugate operators PASS", said), done.stdout + done.stderr
    assert "01.2 the column- and row-parallel linear layers not implemented" in said
    assert "this check needs 01_tensor_parallel.py's own, which the student copy does not have" in said
    assert failed.returncode == 1 and re.search(r"01\.1 f and g, the conjugate operators +FAIL", failed.stdout), \
        failed.stdout + failed.stderr


OWN_LINEARS = """

def column_parallel_forward(self, x):
    return F.linear(tensor_parallel.copy_to_tp(x, self.group), self.weight, self.bias)


def row_parallel_forward(self, x):
    y = tensor_parallel.reduce_from_tp(F.linear(x, self.weight), self.group)
    return y + self.bias
"""


def test_in_the_student_copy_01_4_says_what_its_whole_model_lacks_and_still_grades_its_operators(student):
    # 01.2's contract is the layers without sequence parallelism; 01.4's whole model runs the layers with
    # it. Lent to it, a student's right 01.2 gave a RuntimeError at their 01.3 line (the logits T/tp
    # rows short). Now 01.4 says, in a sentence, that it needs 01's own linears there; and a wrong
    # GatherFromSP still fails there, on the operators' own check, before the whole model.
    tp = importlib.import_module("01_tensor_parallel")
    mine = student / "exercises" / "ex01_tensor_parallel.py"
    original = mine.read_text(encoding="utf-8")
    own = OWN_F_AND_G.split("\n\n\n", 1)[1]  # the classes, without their imports
    written = "\n\n".join([original, own, inspect.getsource(tp._VocabParallelCrossEntropy), OWN_LINEARS])
    wrong = written.replace("return reduce_scatter(grad, ctx.group, SEQ), None",
                            "return grad.chunk(tp_size(ctx.group), SEQ)[tp_rank(ctx.group)], None", 1)
    assert wrong != written
    try:
        mine.write_text(written, encoding="utf-8")
        right = run(["-m", "exercises", "check", "01.4"], student)
        mine.write_text(wrong, encoding="utf-8")
        failed = run(["-m", "exercises", "check", "01.4"], student)
    finally:
        mine.write_text(original, encoding="utf-8")
    said = " ".join(right.stdout.split())
    assert "01.4 sequence parallelism's all-gather / reduce-scatter pair not implemented" in said, said
    assert "01.2 ColumnParallelLinear.forward with sequence parallelism: 01.2 asks for the layers without it" in said
    assert "write that first" not in said and "Error" not in said and said.count("the student copy does not have") == 1
    said = " ".join(failed.stdout.split())
    assert failed.returncode == 1 and re.search(r"01\.4 .* FAIL", said) and "gather_from_sp" in said, said


def test_the_handouts_in_the_student_copy_keep_each_questions_points_but_not_its_full_answer(student):
    """The rubric's "what a full answer contains" is the key to GUIDE's questions, as ANSWERS.md is: in
    the copy each question keeps its line and points, and no answer text of the instructor's handout."""
    import re
    from pathlib import Path
    from exercises import student_repo
    for week in sorted((Path(ROOT) / "docs" / "course").glob("week*.md")):
        ours, theirs = week.read_text(), (student / "docs" / "course" / week.name).read_text()
        answers = [m.group(2) for m in re.finditer(r"^(- GUIDE \d\d Q\d+ \(\d+ points?\)): (.+)$", ours, re.M)]
        assert answers, week.name  # the instructor's handout has them
        assert student_repo.FULL_ANSWERS not in theirs and student_repo.ANSWERS_KEPT in theirs, week.name
        assert not [a for a in answers if a in theirs], week.name
        kept = re.findall(r"^- GUIDE \d\d Q\d+ \(\d+ points?\)$", theirs, re.M)
        assert len(kept) == len(answers), (week.name, kept)


def test_the_student_copy_has_no_answer_key_of_the_fault_records_and_the_same_records(student, tmp_path):
    """Week 4's scripts/fault_records.py: the students keep it (a cohort's records, by --seed), not its key.
    The copy writes the instructor's bytes for a seed; its --key refuses, saying whose the key is; no
    answer of the instructor's key (seeds 0-5) and no line of the key's code is anywhere in the copy; and
    the same grep over the instructor's script finds that code (it can fail)."""
    spec = importlib.util.spec_from_file_location("fault_records_ours", os.path.join(ROOT, "scripts",
                                                                                     "fault_records.py"))
    ours = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ours)
    theirs = run(["scripts/fault_records.py", "--seed", "5"], student)
    assert theirs.returncode == 0 and theirs.stdout == ours.student_text(ours.instance(5)[0]), theirs.stderr
    refused = run(["scripts/fault_records.py", "--seed", "5", "--key"], student)
    assert refused.returncode == 1 and student_repo.KEY_REFUSED in refused.stderr, refused.stdout + refused.stderr
    assert "answer key (the teacher's" not in refused.stdout + refused.stderr
    text = "\n".join(p.read_text(encoding="utf-8") for p in student.rglob("*") if p.is_file() and p.suffix in
                     (".py", ".md", ".txt", ".json", ".sbatch"))
    for seed in range(6):
        for line in ours.key_text(ours.instance(seed)[1]).splitlines()[3:]:
            answer = line.split(": ", 1)[-1].strip()
            assert answer and answer not in text, (seed, answer)
    key_code = {line: where for line, where in student_repo.reference_lines().items() if "answer key" in where}
    assert len(key_code) >= 15, key_code  # the grep looks for the key's code, not for nothing
    assert student_repo.leaks(str(student), key_code) == []
    os.makedirs(tmp_path / "scripts")
    shutil.copy(os.path.join(ROOT, "scripts", "fault_records.py"), tmp_path / "scripts")
    assert {path for path, *_ in student_repo.leaks(str(tmp_path), key_code)} == {os.path.join("scripts",
                                                                                               "fault_records.py")}
    week4 = (student / "docs" / "course" / "week4.md").read_text(encoding="utf-8")
    assert "For the teacher" in open(os.path.join(ROOT, "docs", "course", "week4.md"), encoding="utf-8").read()
    assert "For the teacher" not in week4 and "<!-- teacher -->" not in week4 and "one stage does more work" \
        not in week4
