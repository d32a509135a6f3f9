"""python3 -m exercises: grade the stubs, the numbered files' own functions, or a planted mistake.

    python3 -m exercises check 02 --file my_02.py     # your functions from another file
    python3 -m exercises check 01 --time-limit 30     # each exercise's limit, in seconds (default 120)
    python3 -m exercises check all --json results.json   # also a Gradescope-style results.json

The numbered files with exercises: {files}.
A function of yours that returns what breaks a rule (None, the wrong number of gradients, a gradient
of the wrong shape or dtype, an input written in place) fails at your own line, with the rule.

Exit code: 0 when every exercise graded passes (with --planted: when the planted mistake fails with
the diagnosis it should get), 1 otherwise (a stub file that does not import is said in one line,
naming the file and the line), 2 on a usage error.
"""
import argparse
import ast
import importlib.util
import inspect
import io
import json
import os
import re
import sys
import textwrap
import time
import tokenize
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from exercises import FILES, exercises, stub, student_impl, writes  # noqa: E402
from exercises.autograder import DEADLINE_S, Grade, TimeLimit, grade, time_limit  # noqa: E402


class CannotGrade(Exception):
    """The student's file does not import (a syntax error, an exception, an endless loop at import)."""


def load_impl(exercise, file=None, limit_s=None):
    """The student's functions for an exercise: from its stub in exercises/, or from file. Importing
    runs the student's module, so its errors (and an endless loop at import) are said here, naming
    the file and the line, rather than as a traceback or as some later failure."""
    where = file or os.path.join("exercises", FILES[exercise.file][1] + ".py")
    try:
        with time_limit(limit_s):
            if file is None:
                return student_impl(exercise)
            module = _modules.get(file)
            if module is None:
                spec = importlib.util.spec_from_file_location(f"student_{exercise.file}", file)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                _modules[file] = module
    except SyntaxError as e:
        raise CannotGrade(f"{e.filename or where}:{e.lineno}: {e.msg}: the file does not import, so none of its "
                          f"exercises can be graded") from None
    except TimeLimit:
        raise CannotGrade(f"{where}: importing it ran past the {limit_s:g} s time limit (an endless loop at the top "
                          f"level of the file?)") from None
    except SystemExit as e:  # sys.exit() at its top level: it would end the grading as a success, or not
        raise CannotGrade(f"{where} does not import: it calls sys.exit({e.code!r}) at its top level (keep such "
                          f"code under `if __name__ == \"__main__\":`)") from None
    except Exception as e:  # noqa: BLE001 - the student's module may raise anything at import
        frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.basename(f.filename) ==
                  os.path.basename(where)]
        at = f" (at line {frames[-1].lineno}: {frames[-1].line})" if frames else ""
        raise CannotGrade(f"{where} does not import: {type(e).__name__}: {e}{at}") from None
    missing = [name for name in exercise.functions if not hasattr(module, name)]
    if missing:
        stub = os.path.join("exercises", FILES[exercise.file][1] + ".py")
        raise CannotGrade(f"{file} has no {', '.join(missing)}: write {exercise.key}'s functions there, with the "
                          f"names and signatures of the stubs in {stub}")
    return {name: getattr(module, name) for name in exercise.functions}


_modules = {}  # a --file imported once


def not_written(exercise, impl):
    """The reasons a submission is the reference rather than the student's (None if it is not): a
    function or autograd Function that IS the numbered file's own object (imported or re-exported),
    a class whose methods are the reference's (a subclass that writes nothing), or one whose source
    is the reference's (copied: the same statements, whatever the spacing and comments; for a piece
    under SHORT nodes, such as f and g, whose every right answer has the same statements, the same
    docstrings and comments too). In the student copy the numbered file's pieces are the stubs
    themselves, and are not compared."""
    reference, numbered, stub_file = exercise.reference(), FILES[exercise.file][0], FILES[exercise.file][1]
    reasons = []
    for name in exercise.functions:
        mine, theirs = impl[name], reference[name]
        if (exercise.key, name) in _stubbed or _is_stub(theirs):
            continue
        # A class's methods to write: the stub's own (09.1's MoE stub subclasses 09's and writes forward alone)
        stubbed = getattr(stub(exercise.file), name, None)
        methods = _own_methods(stubbed) if isinstance(stubbed, type) and isinstance(theirs, type) else None
        if methods and all(_is_stub(_function(theirs, m)) for m in methods if m in vars(theirs)):
            continue  # the student copy: those methods of the numbered class are the stubs themselves
        if mine is theirs or (isinstance(mine, type) and isinstance(theirs, type) and any(
                getattr(mine, m, None) is getattr(theirs, m) for m in methods or _own_methods(theirs))):
            reasons.append(f"{exercise.key}: {name} is {numbered}.py's own (imported, not written): write it in "
                           f"{stub_file}.py")
        elif _statements(mine, methods) is not None and _statements(mine, methods) == _statements(theirs, methods) \
                and (_size(theirs, methods) >= SHORT or any(_words(theirs, methods))
                     and _words(mine, methods) == _words(theirs, methods)):
            reasons.append(f"{exercise.key}: {name} is a copy of {numbered}.py's own (its source is the "
                           f"reference's): write it yourself in {stub_file}.py")
    return reasons


def lend_students_pieces():
    """In the student copy (python3 -m exercises student-repo) the numbered files' pieces are stubs,
    so the serial model a check computes first, and a later exercise's machinery, would stop at a
    stub the student has already written in exercises/ex0N_*.py. Returns [(exercise, owner,
    attribute, the stub's value, the student's)] for each: _check puts in the student's pieces of
    the other exercises while it grades one, and keeps that one's own stubs, so that no check
    compares a student's piece with itself (05.1's expected grid is the module's rank_grid). A
    function is lent by attribute (its module's, or its class's), an autograd Function by its
    methods, set on the class itself (every alias of its apply runs them). In the instructor's copy
    nothing is a stub: nothing is lent. A stub file that does not import lends nothing."""
    lent = []
    for file in FILES:
        for e in exercises(file):
            reference = e.reference()
            if not any(_is_stub(reference[name]) for name in e.functions):
                continue
            try:
                impl = student_impl(e)
            except Exception:  # noqa: BLE001 - said when that file is graded
                continue
            for name in e.functions:
                theirs, mine = reference[name], impl[name]
                if not _is_stub(theirs):
                    continue
                _stubbed.add((e.key, name))
                if isinstance(theirs, type):
                    lent += [(e.key, theirs, m, inspect.getattr_static(theirs, m), inspect.getattr_static(mine, m))
                             for m in _own_methods(theirs) if m in vars(mine)]
                    continue
                owner = sys.modules[theirs.__module__]
                *path, last = theirs.__qualname__.split(".")
                for part in path:
                    owner = getattr(owner, part)
                # a checks module may lend a piece within its contract only (checks_01's LENT: 01.2's linears
                # without sequence parallelism)
                mine = getattr(importlib.import_module(f"exercises.{FILES[file][2]}"), "LENT", {}).get(
                    name, lambda fn: fn)(mine)
                static = isinstance(inspect.getattr_static(owner, last), staticmethod)
                lent.append((e.key, owner, last, inspect.getattr_static(owner, last),
                             staticmethod(mine) if static else mine))
    return lent


_stubbed = set()  # (exercise, name) whose numbered piece is a stub, lent the student's: not compared


def _own_methods(cls):
    return [m for m, v in vars(cls).items() if isinstance(v, (staticmethod, classmethod)) or inspect.isfunction(v)]


# AST nodes: a body this small (f's and g's, 3 statements, 14 to 32 nodes; 05.2's loop, 69) is written alike,
# to the names, by many who write it right: there the same statements alone do not say "copied"
SHORT = 70


def _functions(obj, methods=None):
    return [_function(obj, m) for m in sorted(methods or _own_methods(obj))] if isinstance(obj, type) else [obj]


def _size(obj, methods=None):
    """The number of AST nodes in obj's statements (a class's: its methods'), docstrings included."""
    try:
        return sum(1 for fn in _functions(obj, methods)
                   for s in ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body for _ in ast.walk(s))
    except Exception:  # noqa: BLE001 - no source to be had: not short, so the statements decide
        return SHORT


def _words(obj, methods=None):
    """The docstrings (a class's own, and its methods') and the comments, each line stripped: what a
    copy brings with it and one's own answer to a short piece does not (there the statements are the
    same for every right answer: the stub's names, one way to write it)."""
    words = [obj.__doc__ or ""] if isinstance(obj, type) else []
    for fn in _functions(obj, methods):
        words.append(fn.__doc__ or "")
        try:
            source = textwrap.dedent(inspect.getsource(fn))
        except Exception:  # noqa: BLE001
            continue
        words += [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    return [" ".join(w.split()) for w in words]


def _statements(obj, methods=None):
    """What obj's source does, without its docstring, comments or layout: for a function the dump of
    its body's statements, for a class each method's (read from the methods, whose code knows its
    file, as a class loaded from a --file does not). None if the source is not to be had."""
    if isinstance(obj, type):
        methods = [(m, _statements(_function(obj, m))) for m in sorted(methods or _own_methods(obj))]
        return None if not methods or any(b is None for _, b in methods) else methods
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(obj))).body[0]
    except Exception:  # noqa: BLE001 - no source to be had: nothing to compare
        return None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    stmts = node.body
    if stmts and isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant) and \
            isinstance(stmts[0].value.value, str):
        stmts = stmts[1:]  # the docstring
    return [ast.dump(s) for s in stmts]


def _function(cls, name):
    value = inspect.getattr_static(cls, name)
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _is_stub(obj):
    """Whether the numbered file's piece is itself a stub (the student copy): its body, or each of its
    methods', only raises NotImplementedError."""
    functions = [_function(obj, m) for m in _own_methods(obj)] if isinstance(obj, type) else [obj]
    def raises(fn):
        try:
            node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        except Exception:  # noqa: BLE001 - no source to be had (built in, made at run time): not a stub
            return False
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return False
        stmts = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        return len(stmts) == 1 and isinstance(stmts[0], ast.Raise) and "NotImplementedError" in ast.dump(stmts[0])
    return bool(functions) and all(raises(f) for f in functions)


def select(names):
    """["01", "02.1", "all"] -> the Exercise records, in order; a ValueError names an unknown one."""
    out = []
    for name in names:
        files = list(FILES) if name == "all" else [name.split(".")[0]]
        if any(f not in FILES for f in files):
            raise ValueError(f"unknown file {name!r}: give one of {', '.join(FILES)}, an exercise such as 01.3, "
                             f"or all")
        chosen = [e for f in files for e in exercises(f) if name in ("all", f, e.key)]
        if not chosen:
            raise ValueError(f"no exercise {name!r}: `python3 -m exercises list` shows them")
        out += [e for e in chosen if e not in out]
    return out


def show(exercise, result, seconds, out):
    status = STATUS[result.status]
    out(f"  {exercise.key} {exercise.title:<58} {status:>15}  ({seconds:.1f} s)")
    for line in result.lines:
        out(textwrap.fill(line, 100, initial_indent="       ", subsequent_indent="         ",
                          break_long_words=False, break_on_hyphens=False))  # a path stays whole


def check(args, out=print):
    chosen = select(args.what)
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            raise ValueError(f"--json {args.json}: no folder {folder} to write it in")
    start, rows = time.perf_counter(), []  # rows: (exercise, Grade, seconds, output's extra lines)
    try:
        ok = planted(chosen, args.planted, out, rows) if args.planted else _check(args, chosen, out, rows)
    except CannotGrade as e:  # the file does not import: every exercise not graded yet fails, saying why
        if args.json:
            failed = Grade("error", [str(e)])
            rows += [(x, failed, 0.0, []) for x in chosen if x not in [r[0] for r in rows]]
            write_json(args.json, rows, time.perf_counter() - start)
        raise
    if args.json:
        write_json(args.json, rows, time.perf_counter() - start)
        out(f"wrote {args.json}")
    return ok


def _check(args, chosen, out, rows):
    counts, by_file = {}, {}
    for e in chosen:
        by_file.setdefault(e.file, []).append(e)
    if args.file and (args.solution or len(by_file) > 1):
        raise ValueError("--file holds one numbered file's exercises: give them alone (e.g. check 02 --file x.py), "
                         "without --solution")
    if args.file and not os.path.isfile(args.file):
        raise ValueError(f"--file {args.file}: no such file")
    lent = [] if args.solution else lend_students_pieces()
    for file, group in by_file.items():
        source = f"{FILES[file][0]}.py's own functions" if args.solution else \
            args.file or f"exercises/{FILES[file][1]}.py"
        out(f"{FILES[file][0]}.py: grading {source}")
        for e in group:
            start = time.perf_counter()
            for key, owner, attr, stub_value, students in lent:  # the others' pieces, never this one's own
                setattr(owner, attr, stub_value if key == e.key else students)
            impl = e.reference() if args.solution else load_impl(e, args.file, args.time_limit)
            copied = [] if args.solution else not_written(e, impl)
            result = grade(e, impl, args.time_limit)
            if copied:  # refused by name, and graded too, so that the student's own pieces get their diagnosis
                result = Grade("fail", copied + result.lines)
            elif lent and result.status == "not implemented" and result.lines[0][:4] != e.key \
                    and "the student copy does not have" not in result.lines[0]:
                result = Grade("not implemented", result.lines + [
                    f"(this check runs {result.lines[0][:4]}'s piece too: write that first)"])
            elif lent and result.status == "not implemented" and not any(_is_stub(f) for f in impl.values()) \
                    and "the student copy does not have" not in result.lines[0]:
                result = Grade("not implemented", result.lines + [
                    f"(your {', '.join(e.functions)} is written, but this check needs {FILES[e.file][0]}.py's own, "
                    f"which the student copy does not have: it is graded in the instructor's copy, with "
                    f"--file {FILES[e.file][1]}.py)"])
            seconds = time.perf_counter() - start
            show(e, result, seconds, out)
            rows.append((e, result, seconds, []))
            counts[result.status] = counts.get(result.status, 0) + 1
    total = sum(counts.values())
    out(f"{counts.get('pass', 0)} of {total} pass" + "".join(
        f", {n} {status}" for status, n in counts.items() if status != "pass"))
    return counts.get("pass", 0) == total


STATUS = {"pass": "PASS", "fail": "FAIL", "not implemented": "not implemented", "error": "ERROR"}
POINTS = 1.0  # the max_score in results.json of an exercise no handout gives points to
HANDOUT_ROW = re.compile(r"^\| (\d\d\.\d) \| [^|]+ \| (\d+) \|\s*$", re.M)  # | 01.1 | f and g | 10 |


def handout_points(folder=None):
    """{exercise key: its points}, from the exercise tables of docs/course/week*.md: the handouts are
    the one place a teacher sets them, and results.json gives the same."""
    folder = folder or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "course")
    points = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if re.fullmatch(r"week\d+\.md", name):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                points.update((key, float(n)) for key, n in HANDOUT_ROW.findall(f.read()))
    return points


def results(rows, seconds, points=None):
    """The Gradescope-style results (exercises/README.md gives the schema): one test per exercise
    graded, all its points if it passes, else 0 (its handout's points; POINTS where no handout
    names it); its output is what `check` prints for it."""
    points = handout_points() if points is None else points
    tests = []
    for e, result, took, extra in rows:
        passed, worth = result.status == "pass", points.get(e.key, POINTS)
        tests.append({"name": f"{e.key} {e.title}", "score": worth if passed else 0.0, "max_score": worth,
                      "status": "passed" if passed else "failed",
                      "output": "\n".join(extra + [f"{STATUS[result.status]} ({took:.1f} s)"] + result.lines)})
    return {"score": sum(t["score"] for t in tests), "max_score": sum(t["max_score"] for t in tests),
            "tests": tests, "execution_time": round(seconds, 3)}


def write_json(path, rows, seconds):
    """results(rows, seconds) to path, whole or not at all (written beside it, then moved over it)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(results(rows, seconds), f, indent=2)
        f.write("\n")
    os.replace(temporary, path)


def planted(chosen, name, out, rows):
    found = [(e, p) for e in chosen for p in e.planted if p.name == name]
    if not found:
        names = ", ".join(p.name for e in chosen for p in e.planted)
        raise ValueError(f"no planted mistake {name!r} among the exercises chosen; they have: {names}")
    e, p = found[0]
    out(f"planted in {e.key} ({e.title}): {p.what}")
    start = time.perf_counter()
    from exercises.student_repo import PLANTED_GONE
    if any(_is_stub(f) for f in e.reference().values()):  # the student copy: neither reference nor planted code
        raise ValueError(f"--planted {name}: {PLANTED_GONE}")
    result = grade(e, {**e.reference(), **p.impl()})
    seconds = time.perf_counter() - start
    show(e, result, seconds, out)
    caught = result.status == "fail" and any(p.expect in line for line in result.lines)
    verdict = (f"the autograder {'caught it' if caught else 'did NOT catch it'} (expected a failure saying "
               f"{p.expect!r})")
    out(verdict)
    rows.append((e, result, seconds, [f"planted {p.name}: {p.what}", verdict]))  # the planted code's grade
    return caught


def list_exercises(out=print):
    for file in FILES:
        out(f"{FILES[file][0]}.py (exercises/{FILES[file][1]}.py)")
        for e in exercises(file):
            out(f"  {e.key} {e.title}")
            out(f"       write: {writes(e)}; read: {e.reading}")
            for p in e.planted:
                out(f"       planted {p.name}: {p.what}")
    return True


def main(argv=None):
    files = ", ".join(FILES)  # the exercise table's files, so that the help cannot leave one out
    example = next(e.key for f in FILES for e in exercises(f))
    parser = argparse.ArgumentParser(prog="python3 -m exercises", description=__doc__.format(files=files),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help=f"grade exercises: a numbered file ({files}), an exercise such as {example}, "
                                     f"or all")
    c.add_argument("what", nargs="+", help=f"a numbered file ({files}), an exercise such as {example} (`list` "
                                           f"shows them), or all")
    how = c.add_mutually_exclusive_group()
    how.add_argument("--solution", action="store_true", help="grade the numbered files' own functions")
    how.add_argument("--planted", metavar="NAME", help="grade a planted mistake (list shows their names)")
    c.add_argument("--file", metavar="PATH", help="grade the functions in PATH instead of exercises/ex0N_*.py "
                   "(one numbered file's exercises)")
    c.add_argument("--json", metavar="PATH", help="also write the results to PATH as a Gradescope-style "
                   "results.json (exercises/README.md gives its schema)")
    c.add_argument("--time-limit", metavar="S", type=float, default=DEADLINE_S,
                   help=f"seconds each exercise may take before it is stopped as an error (default: {DEADLINE_S})")
    sub.add_parser("list", help="every exercise, what it asks and its planted mistakes")
    s = sub.add_parser("student-repo", help="write the repository for students to OUT: the exercises' pieces "
                                            "replaced by their stubs in the numbered files, without docs/ANSWERS.md, "
                                            "tests/ and the planted mistakes (exercises/README.md)")
    s.add_argument("out", metavar="OUT", help="a new or empty folder outside the repository")
    args = parser.parse_args(argv)
    if args.command == "check" and not 0 < args.time_limit <= 86400:
        parser.error(f"--time-limit must be positive and at most 86400 (seconds), got {args.time_limit:g}")
    try:
        if args.command == "student-repo":
            from exercises import student_repo
            ok = student_repo.main(args.out)
        else:
            ok = list_exercises() if args.command == "list" else check(args)
    except ValueError as e:
        print(f"python3 -m exercises: error: {e}", file=sys.stderr)
        return 2
    except CannotGrade as e:
        print(f"python3 -m exercises: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while grading: one line, not a traceback
        print("\npython3 -m exercises: interrupted", file=sys.stderr)
        return 130
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
