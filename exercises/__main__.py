"""python3 -m exercises: grade the stubs, the numbered files' own functions, or a planted mistake.

Exit code: 0 when every exercise graded passes (with --planted: when the planted mistake fails with
the diagnosis it should get), 1 otherwise, 2 on a usage error.
"""
import argparse
import os
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from exercises import FILES, exercises, student_impl, writes  # noqa: E402
from exercises.autograder import grade  # noqa: E402


def select(names):
    """["01", "02.1", "all"] -> the Exercise records, in order; a ValueError names an unknown one."""
    out = []
    for name in names:
        files = list(FILES) if name == "all" else [name.split(".")[0]]
        if any(f not in FILES for f in files):
            raise ValueError(f"unknown file {name!r}: give 01 to 05, an exercise such as 01.3, or all")
        chosen = [e for f in files for e in exercises(f) if name in ("all", f, e.key)]
        if not chosen:
            raise ValueError(f"no exercise {name!r}: `python3 -m exercises list` shows them")
        out += [e for e in chosen if e not in out]
    return out


def show(exercise, result, seconds, out):
    status = {"pass": "PASS", "fail": "FAIL", "not implemented": "not implemented", "error": "ERROR"}[result.status]
    out(f"  {exercise.key} {exercise.title:<58} {status:>15}  ({seconds:.1f} s)")
    for line in result.lines:
        out(textwrap.fill(line, 100, initial_indent="       ", subsequent_indent="         "))


def check(args, out=print):
    chosen = select(args.what)
    if args.planted:
        return planted(chosen, args.planted, out)
    counts, by_file = {}, {}
    for e in chosen:
        by_file.setdefault(e.file, []).append(e)
    for file, group in by_file.items():
        source = f"{FILES[file][0]}.py's own functions" if args.solution else f"exercises/{FILES[file][1]}.py"
        out(f"{FILES[file][0]}.py: grading {source}")
        for e in group:
            start = time.perf_counter()
            result = grade(e, e.reference() if args.solution else student_impl(e))
            show(e, result, time.perf_counter() - start, out)
            counts[result.status] = counts.get(result.status, 0) + 1
    total = sum(counts.values())
    out(f"{counts.get('pass', 0)} of {total} pass" + "".join(
        f", {n} {status}" for status, n in counts.items() if status != "pass"))
    return counts.get("pass", 0) == total


def planted(chosen, name, out):
    found = [(e, p) for e in chosen for p in e.planted if p.name == name]
    if not found:
        names = ", ".join(p.name for e in chosen for p in e.planted)
        raise ValueError(f"no planted mistake {name!r} among the exercises chosen; they have: {names}")
    e, p = found[0]
    out(f"planted in {e.key} ({e.title}): {p.what}")
    start = time.perf_counter()
    result = grade(e, {**e.reference(), **p.impl()})
    show(e, result, time.perf_counter() - start, out)
    caught = result.status == "fail" and any(p.expect in line for line in result.lines)
    out(f"the autograder {'caught it' if caught else 'did NOT catch it'} (expected a failure saying "
        f"{p.expect!r})")
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
    parser = argparse.ArgumentParser(prog="python3 -m exercises", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="grade exercises: 01 ... 05, one such as 01.3, or all")
    c.add_argument("what", nargs="+", help="01 ... 05, an exercise such as 01.3, or all")
    how = c.add_mutually_exclusive_group()
    how.add_argument("--solution", action="store_true", help="grade the numbered files' own functions")
    how.add_argument("--planted", metavar="NAME", help="grade a planted mistake (list shows their names)")
    sub.add_parser("list", help="every exercise, what it asks and its planted mistakes")
    args = parser.parse_args(argv)
    try:
        ok = list_exercises() if args.command == "list" else check(args)
    except ValueError as e:
        print(f"python3 -m exercises: error: {e}", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
