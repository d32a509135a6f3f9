"""python3 -m exercises student-repo OUT: the repository as students get it, without the solutions.

    python3 -m exercises student-repo ../course-student   # then give students that folder (git init it)

What it writes: every file `git ls-files` lists (nothing untracked or ignored leaks), except
  - docs/ANSWERS.md, the key to GUIDE's questions (a link to it becomes a sentence saying so);
  - the handouts' rubrics' full answers (docs/course/week*.md): each question keeps its points;
    and, in any markdown, a passage between <!-- teacher --> and <!-- /teacher --> (how to grade);
  - the answer key of week 4's fault records (KEYS: scripts/fault_records.py's _key, _change and
    key_text): the copy writes the same records for the same --seed, and its --key refuses, saying so;
  - tests/: most of it needs the reference (the solution runs of test_exercises.py, the lessons'
    tests, the chapters' equality tests), so none of it is copied;
and with, in each numbered file, every piece an exercise asks for (the exercise table's functions:
`reference` in exercises/checks_0N.py names the numbered file's object) replaced by its stub's
body from exercises/ex0N_*.py: a function's body, or each method an autograd Function's stub
defines. So the chapters still import, and a demo runs up to the first stub, whose
NotImplementedError names the exercise and the function ("01.1 f's forward (CopyToTP.forward)").
The planted mistakes of exercises/checks_0N.py are near-solutions: their code is replaced by a
sentence (the instructor's copy has them), and `check --planted` there says so.

The proof (`reference_lines`, `leaks`; tests/test_student_repo.py): no line of a reference body or of
an answer key's code (stripped, longer than MIN_CHARS, and in neither the stub file nor the code the
copy keeps as it is: a later chapter may repeat an earlier one's line) is anywhere in the copy.
"""
import ast
import functools
import os
import re
import shutil
import subprocess
import textwrap

from exercises import FILES, exercises, stub

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_CHARS = 25  # shorter lines ("return grad, None") say nothing a student could not write alone
LEFT_OUT = ("docs/ANSWERS.md",)
LEFT_OUT_FOLDERS = ("tests/",)
KEY_IS_THE_INSTRUCTORS = "the answer key, which is the instructor's (it is not in the student copy)"
# Answer keys inside scripts the students keep: {path: {function: its body in the student copy}}. Week 4's
# fault records: the students' copy writes the same records for the same --seed, and --key refuses.
KEY_REFUSED = ("--key: the answer key is the teacher's, and the student copy does not have it; "
               "python3 scripts/fault_records.py --seed N (N from your teacher) writes your cohort's records")
KEYS = {"scripts/fault_records.py": {
    "_key": "return None  # the key is the teacher's: not in the student copy\n",
    "_change": "return None  # part of the key: not in the student copy\n",
    "key_text": f"raise SystemExit({KEY_REFUSED!r})\n"}}
TEACHER_ONLY = re.compile(r"\n?<!-- teacher -->.*?<!-- /teacher -->\n?", re.S)
PLANTED_GONE = ("planted mistakes are the instructor's: they are near-solutions, so the student copy "
                "does not have them")


class StudentRepoError(ValueError):
    """OUT cannot be written (it exists and is not empty, or it lies inside the repository)."""


# ----------------------------------------------------------------------------------------------
# What is replaced, and by what


def _node(tree, qualname):
    """The def or class statement of qualname ("ColumnParallelLinear.forward") in a module's tree."""
    body, node = tree.body, None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            raise LookupError(qualname)
        body = node.body
    return node


def _methods(cls_node):
    return {n.name: n for n in cls_node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


@functools.lru_cache(maxsize=None)
def replacements():
    """{numbered file's path: [(reference def node, stub def node, stub file's lines, key, name)]}: each
    function body to replace, an autograd Function being one entry per method its stub defines."""
    out = {}
    for file, (numbered, stub_module, _) in FILES.items():
        path = f"{numbered}.py"
        tree = ast.parse(_read(path))
        stub_path = os.path.join("exercises", f"{stub_module}.py")
        stub_text = _read(stub_path)
        stub_tree = ast.parse(stub_text)
        for e in exercises(file):
            reference = e.reference()
            for name in e.functions:
                qualname = reference[name].__qualname__
                ours, theirs = _node(tree, qualname), _node(stub_tree, name)
                if isinstance(ours, ast.ClassDef):
                    mine = _methods(ours)
                    pairs = [(mine[m], n) for m, n in _methods(theirs).items()]
                else:
                    pairs = [(ours, theirs)]
                out.setdefault(path, []).extend((o, t, stub_text.splitlines(), e.key, name) for o, t in pairs)
    return out


def _read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _body(node):
    """(first, last) line numbers (1-based) of a def's body."""
    return node.body[0].lineno, node.end_lineno


def kept_code():
    """The text of the code the student copy keeps as it is: the numbered files outside
    the replaced bodies, and every other tracked .py outside exercises/ and tests/ (a later chapter
    may repeat a line of an earlier one's solution: 08.1's `OneRing` opens with the line that gets the
    rank and the size of its group, as 08's machine, which students are given, does too)."""
    numbered = {f"{n}.py" for n, _, _ in FILES.values()}
    out = []
    for path in tracked():
        if path.endswith(".py") and not path.startswith(("exercises/", "tests/")):
            text = stubbed(path) if path in numbered else without_keys(path) if path in KEYS else _read(path)
            out.append(text)
    return "\n".join(out)


def reference_lines():
    """The reference solutions, as the grep looks for them: each replaced body's lines, stripped,
    longer than MIN_CHARS, that its stub file does not also have, nor the code the copy keeps as it
    is (kept_code, anywhere in a line). {line: "where it is from"}"""
    found, kept = {}, kept_code()
    for path, items in replacements().items():
        lines = _read(path).splitlines()
        for ours, _, stub_lines, key, name in items:
            in_stub = {s.strip() for s in stub_lines}
            first, last = _body(ours)
            for line in lines[first - 1:last]:
                text = line.strip()
                if len(text) > MIN_CHARS and text not in in_stub and text not in kept:
                    found.setdefault(text, f"{path}:{key} {name}")
    for path, bodies in KEYS.items():  # the answer keys' code, as the solutions' (kept: the rest of the script)
        lines, tree = _read(path).splitlines(), ast.parse(_read(path))
        for name in bodies:
            first, last = _body(_node(tree, name))
            for line in lines[first - 1:last]:
                text = line.strip()
                if len(text) > MIN_CHARS and text not in kept:
                    found.setdefault(text, f"{path}: the answer key's {name}")
    return found


@functools.lru_cache(maxsize=None)
def stubbed(path):
    """The numbered file's text with each replaced body swapped for its stub's, re-indented."""
    lines = _read(path).splitlines(keepends=True)
    items = sorted(replacements()[path], key=lambda item: -item[0].lineno)
    for ours, theirs, stub_lines, _, _ in items:
        first, last = _body(ours)
        if first == ours.lineno:
            raise ValueError(f"{path}:{first}: {ours.name}'s body is on its def line; the student copy cannot "
                             f"replace it")
        s_first, s_last = _body(theirs)
        body = textwrap.dedent("\n".join(stub_lines[s_first - 1:s_last]))
        indent = " " * ours.body[0].col_offset
        lines[first - 1:last] = [textwrap.indent(body, indent) + "\n"]
    return "".join(lines)


@functools.lru_cache(maxsize=None)
def without_keys(path):
    """A kept script's text with each function of KEYS[path] given its student body: the answer key's
    code and docstrings gone, the rest (the records, the --seed) as it is."""
    text = _read(path)
    lines, tree = text.splitlines(keepends=True), ast.parse(text)
    for name, body in sorted(KEYS[path].items(), key=lambda item: -_node(tree, item[0]).lineno):
        node = _node(tree, name)
        first, last = _body(node)  # the docstring too: _change's says what a right answer to question 3 does
        lines[first - 1:last] = [textwrap.indent(body, " " * node.body[0].col_offset)]
    return "".join(lines)


# ----------------------------------------------------------------------------------------------
# The planted mistakes, and the links to the key


def without_planted(text):
    """A checks_0N.py with each planted mistake's code gone: every top-level def or class whose
    source a Planted(...) names (its impl), body replaced by a NotImplementedError saying why; the
    EXERCISES table keeps the names, so `list` still shows the mistakes a teacher may plant."""
    tree = ast.parse(text)
    used = set()
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Planted":
            impl = call.args[2] if len(call.args) > 2 else next(k.value for k in call.keywords if k.arg == "impl")
            used |= {n.id for n in ast.walk(impl) if isinstance(n, ast.Name)}
    lines = text.splitlines(keepends=True)
    gone = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in used]
    for node in sorted(gone, key=lambda n: -n.lineno):
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        indent = " " * 4
        if isinstance(node, ast.ClassDef):
            new = f"class {node.name}:\n{indent}def __init__(self, *args, **kwargs):\n" \
                  f"{indent * 2}raise NotImplementedError({PLANTED_GONE!r})\n"
        else:
            new = f"def {node.name}(*args, **kwargs):\n{indent}raise NotImplementedError({PLANTED_GONE!r})\n"
        lines[start - 1:node.end_lineno] = [new]
    return "".join(lines)


ANSWERS_LINK = re.compile(r"\[([^\]]*)\]\((?:\.\./|docs/)?ANSWERS\.md[^)]*\)")


FULL_ANSWERS = "What a full answer contains:"
RUBRIC_ITEM = re.compile(r"^(- GUIDE \d\d Q\d+ \(\d+ points?\)):.*$")
ANSWERS_KEPT = "The full answers are the instructor's (in the instructor's copy of this handout); the points:"


def without_rubric_answers(text):
    """A week's handout with its rubric's full answers gone (they are the key to GUIDE's questions, as
    ANSWERS.md is): each "- GUIDE 0N Qk (p points): what it contains" keeps its question and points."""
    if FULL_ANSWERS not in text:
        return text
    head, tail = text.split(FULL_ANSWERS, 1)
    return head + ANSWERS_KEPT + "\n".join(RUBRIC_ITEM.sub(r"\1", line) for line in tail.split("\n"))


def without_key_links(text):
    """Markdown with each link to ANSWERS.md turned into words saying that the key is the instructor's,
    and each passage between <!-- teacher --> and <!-- /teacher --> (what a handout says to the teacher:
    how to grade, where the key is) gone."""
    return TEACHER_ONLY.sub("\n", ANSWERS_LINK.sub(KEY_IS_THE_INSTRUCTORS, text))


# ----------------------------------------------------------------------------------------------
# Writing it, and the proof


def tracked():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def refuse(out):
    """A StudentRepoError naming OUT if it cannot be written."""
    target = os.path.realpath(out)
    if target == ROOT or target.startswith(ROOT + os.sep):
        raise StudentRepoError(f"student-repo {out}: it lies inside the repository ({ROOT}): give a folder "
                               f"outside it")
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise StudentRepoError(f"student-repo {out}: it exists and is not empty: give a new or empty folder")


def write(out):
    """The student copy in OUT; returns the number of files written and of bodies replaced."""
    refuse(out)
    numbered = {f"{n}.py" for n, _, _ in FILES.values()}
    checks = {os.path.join("exercises", f"{c}.py") for _, _, c in FILES.values()}
    written = 0
    for path in tracked():
        if path in LEFT_OUT or path.startswith(LEFT_OUT_FOLDERS) or not os.path.isfile(os.path.join(ROOT, path)):
            continue
        target = os.path.join(out, path)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        if path in numbered:
            text = stubbed(path)
        elif path in KEYS:
            text = without_keys(path)
        elif path in checks:
            text = without_planted(_read(path))
        elif path.endswith(".md"):
            text = without_key_links(_read(path))
            text = without_rubric_answers(text) if path.startswith("docs/course/") else text
        else:
            shutil.copy2(os.path.join(ROOT, path), target)
            written += 1
            continue
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        shutil.copymode(os.path.join(ROOT, path), target)
        written += 1
    return written, sum(len(items) for items in replacements().values())


def leaks(out, lines=None):
    """[(path in OUT, line number, the reference line, where it is from)]: the grep of the reference
    solutions over every file of the copy."""
    lines = reference_lines() if lines is None else lines
    found = []
    for folder, _, names in os.walk(out):
        for name in names:
            path = os.path.join(folder, name)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                with open(path, "rb") as f:  # binary: the line's bytes anywhere in it
                    data = f.read()
                found += [(os.path.relpath(path, out), 0, r, w) for r, w in lines.items() if r.encode() in data]
                continue
            for n, line in enumerate(text.splitlines(), 1):
                for r, w in lines.items():
                    if r in line:
                        found.append((os.path.relpath(path, out), n, r, w))
    return found


def main(out, say=print):
    files, bodies = write(out)
    found = leaks(out)
    say(f"wrote {out}: {files} files of `git ls-files`, {bodies} bodies replaced by their stubs; left out "
        f"{', '.join(LEFT_OUT + LEFT_OUT_FOLDERS)}, the planted mistakes' code and the answer keys of "
        f"{', '.join(KEYS)}")
    for path, n, line, where in found[:20]:
        say(f"  LEAK {path}:{n}: {line!r} (from {where})")
    if found:
        say(f"{len(found)} lines of the reference solutions are in {out}: do not give it to students")
        return False
    say(f"no line of the reference solutions ({len(reference_lines())} lines) is in {out}")
    return True
