"""Issue 47's rule, tested by a trace: read-first code calls only read-first code (of its chapter and the
earlier ones), torch, einops and Python's own functions; `demo` itself may call plumbing (it is exempt
as a caller).

    python3 tests/lesson_trace.py OUT 03_interleaved.py [flags]   # run 03's demo, traced; OUT/<process>.json
    violations(OUT)                                                # the calls that break the rule, named

Every process of the demo is traced: the script's own, and each rank that plumbing/launch.py forks from it
(a rank is a fork of the launching process, so the profiler installed here, sys.setprofile for this thread
and threading.setprofile for the threads started later, is already installed in it). The rank's entry point
is wrapped, here and only here (the product's path is untouched and pays nothing): the wrapper starts the
rank's record empty and writes it, OUT/rank<R>.json, before the rank reports to the launching process,
whether its worker returned or raised. The script's own record is OUT/main.json, written as it exits.

What is recorded: a call of a repository function (a code object from a .py file under the repository's
root, tests/ excluded) that is not on the allowed set, whose nearest repository caller on the stack is on
it; it is the lesson's call when every repository frame from that caller up to a demo is on the set too (the
same read-first code run by the machine, by a serial reference or under a meter, plumbing's, is recorded
but not as the lesson's). The nearest: frames of torch, einops, the standard library, dataclasses' generated
methods (their file is "<string>"), tests/ and comprehensions (3.12 inlines most of them; 3.11 does not) are
passed through, so a call made through nn.Module.__call__, an autograd Function or a map() still names the
read-first function that made it. A closure or lambda of code off the set (a hook a meter registers, a
wrapper put in torch's place) is a value handed over, not a name one calls: neither it nor
what it calls is counted. The allowed set of chapter N: the names on the "Read first" lists of docs/GUIDE.md
(the "Read first, in this order." paragraph of each chapter's section) for chapters 01 to N, each resolved in its own file by `ast` as tests/test_budgets.py
resolves them (a top-level function, class or assignment; `Class.method` that method alone), decorators
included; a class covers every function defined inside it, a function the functions and lambdas nested in
it, as their code objects' first lines fall inside its span. Each chapter's `demo` is exempt as a caller
(its own code object and its comprehensions: what it launches and prints with), not the functions nested
in it. The profiler's work is a dictionary look-up per Python call; a call off the set walks the stack.

Also recorded, as "ran": the names of the chapter's own read-first list whose code the lesson ran (called from
a demo through read-first code only; each name's first such call walks the stack, the rest cost a look-up).
tests/test_lesson_trace.py requires every name that holds code to have run: the demo cannot leave the lesson
idle and do its work with the machine, and a list cannot name code the lesson does not run.
"""
import ast
import json
import os
import re
import runpy
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "GUIDE.md"


def chapter_files(root=ROOT):
    return {p.name[:2]: p for p in sorted(Path(root).glob("0[1-9]_*.py"))}


def guide_lists(text, kinds=("Read first",)):
    """{chapter: {kind: [names]}} of a guide's text: in each "## 0N_name.py" section, the backticked names of the
    paragraph that opens "**<kind>...**" (to the next bold heading), for each kind asked; a "Read second" list
    leaves out the names its paragraph repeats from the read-first one (tests/test_budgets.py's chapter_lists
    reads the same). The section's paragraphs are its only lists: each name is named once, with what it does."""
    out = {}
    parts = re.split(r"\n## (0\d)_[a-z0-9_]+\.py\b[^\n]*\n", text)
    for ch, body in zip(parts[1::2], parts[2::2]):
        body, out[ch] = "\n" + body.split("\n## ")[0], {}
        found = {}
        for kind in dict.fromkeys(("Read first", *kinds)):
            m = re.search(rf"\n\*\*{re.escape(kind)}[^*]*\*\*(.*?)(?=\n\*\*[A-Z]|\Z)", body, re.S)
            if m:
                found[kind] = re.findall(r"`([A-Za-z_][\w.]*)`", m.group(1))
        for kind in kinds:
            if kind in found:
                out[ch][kind] = [n for n in found[kind] if kind == "Read first" or n not in found.get("Read first", [])]
    return out


def read_first_lists(guide=None):
    """{chapter: [names]}: the "Read first" lists of docs/GUIDE.md (or of the guide text given)."""
    lists = guide_lists(GUIDE.read_text() if guide is None else guide)
    return {ch: kinds.get("Read first", []) for ch, kinds in lists.items()}


def name_spans(path):
    """{name: (first line, last line)} of a file's top-level functions, classes and assignments, and of each
    class's methods as `Class.method`; decorators included."""
    out = {}
    for n in ast.parse(Path(path).read_text()).body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[n.name] = (min([n.lineno] + [d.lineno for d in n.decorator_list]), n.end_lineno)
            for m in n.body if isinstance(n, ast.ClassDef) else []:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{n.name}.{m.name}"] = (min([m.lineno] + [d.lineno for d in m.decorator_list]), m.end_lineno)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            for target in n.targets if isinstance(n, ast.Assign) else [n.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out.setdefault(name.id, (n.lineno, n.end_lineno))
    return out


def allowed_set(ch, root=ROOT):
    """({file: [(first, last) lines]} of the read-first names of chapters 01..ch, {file: demo's first line},
    [(first, last, name)] of chapter ch's own read-first names), from root's docs/GUIDE.md and numbered files."""
    lists, files = read_first_lists((Path(root) / "docs" / "GUIDE.md").read_text()), chapter_files(root)
    allowed, demos, own = {}, {}, []
    for c in sorted(files):
        if c > ch:
            break
        where = name_spans(files[c])
        names = [n for n in dict.fromkeys(lists.get(c, [])) if n in where]
        allowed[str(files[c])] = [where[n] for n in names]
        if "demo" in lists.get(c, []) and "demo" in where:
            demos[str(files[c])] = where["demo"][0]
        if c == ch:
            own = [(*where[n], n) for n in names]
    return allowed, demos, own


def runnable_names(ch, root=ROOT):
    """Chapter ch's read-first names that hold code a demo can run (a function, or a class defining one),
    `demo` excepted: each must run, in its demo's lesson, for the trace to pass (a list cannot name what
    the lesson leaves to the machine)."""
    lists, path = read_first_lists((Path(root) / "docs" / "GUIDE.md").read_text()), chapter_files(root)[ch]
    tree, out = ast.parse(path.read_text()), []
    defs = (ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = {n.name: n for n in tree.body if isinstance(n, (*defs, ast.ClassDef))}
    nodes.update({f"{c.name}.{m.name}": m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body
                  if isinstance(m, defs)})
    for name in dict.fromkeys(lists.get(ch, [])):
        node = nodes.get(name)
        if name != "demo" and node is not None and any(isinstance(n, defs) for n in ast.walk(node)):
            out.append(name)
    return out


# ----------------------------------------------------------------------------------------------
# The profiler: installed once in the script's process, inherited by every forked rank.

FREE, REPO, ALLOWED, EXEMPT, HANDED = 0, 1, 2, 3, 4  # a code object's kind
COMPREHENSIONS = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}  # 3.12 inlines the first three
_kinds, _records, _state, _own = {}, {}, {}, {}  # _own: a code object of chapter ch's own list -> its name


def _kind(code):
    name = code.co_filename
    kind = FREE
    if code.co_name in COMPREHENSIONS:
        pass  # its function's own code, on every Python: passed through to the function that runs it
    elif name.startswith(_state["root"]) and not name.startswith(_state["tests"]) and name.endswith(".py"):
        line = code.co_firstlineno
        if _state["demos"].get(name) == line and code.co_name == "demo":
            kind = EXEMPT
        elif any(a <= line <= b for a, b in _state["allowed"].get(name, ())):
            kind = ALLOWED
            if name == _state["own_file"]:
                _own[code] = next(n for a, b, n in _state["own"] if a <= line <= b)
        else:  # a closure or lambda of other code: a value handed over (a hook, a wrapper), not a name one calls
            kind = HANDED if "<locals>" in getattr(code, "co_qualname", "") else REPO
    _kinds[code] = kind
    return kind


def _profile(frame, event, arg, _kinds=_kinds, _kind=_kind, _records=_records):
    if event != "call":
        return
    code = frame.f_code
    kind = _kinds.get(code)
    if kind is None:
        kind = _kind(code)
    if kind != REPO:
        if kind == EXEMPT:
            _records["demo"] = _records.get("demo", 0) + 1  # the demo ran here (the rank ran the lesson)
        elif kind == ALLOWED and code in _own and _own[code] not in _records.setdefault("ran", set()):
            if _in_lesson(frame.f_back):  # once a name is seen run by the lesson, it costs a set look-up
                _records["ran"].add(_own[code])
        return
    caller = frame.f_back
    while caller is not None:
        k = _kinds.get(caller.f_code)
        if k is None:
            k = _kind(caller.f_code)
        if k:
            break
        caller = caller.f_back
    if caller is None or k != ALLOWED:
        return
    # The lesson's call only: every repository frame from the caller up to a demo is read-first (no machine,
    # no plumbing, such as a reference model or a meter's hook, runs the read-first code that made it).
    up = caller.f_back
    while up is not None:
        k = _kinds.get(up.f_code)
        if k is None:
            k = _kind(up.f_code)
        if k == EXEMPT or k == REPO or k == HANDED:
            break
        up = up.f_back
    pair = (caller.f_code, code, up is None or k == EXEMPT)
    _records[pair] = _records.get(pair, 0) + 1


def _in_lesson(frame):
    """Whether every repository frame from frame up to a demo is read-first, and a demo is there."""
    while frame is not None:
        k = _kinds.get(frame.f_code)
        if k is None:
            k = _kind(frame.f_code)
        if k == EXEMPT:
            return True
        if k == REPO or k == HANDED:
            return False
        frame = frame.f_back
    return False


def install(ch, out, root=ROOT):
    """Trace this process, and every rank launch() forks from it, against chapter ch's allowed set; root: the
    repository (another one for the tracer's own test)."""
    root = Path(root).resolve()
    allowed, demos, own = allowed_set(ch, root)
    _state.update(root=str(root) + os.sep, tests=str(root / "tests") + os.sep, allowed=allowed, demos=demos,
                  out=Path(out), where=root, own=own, own_file=str(chapter_files(root)[ch]))
    Path(out).mkdir(parents=True, exist_ok=True)
    from plumbing import launch
    rank_main = launch._local_rank_main

    def traced_rank_main(rank, world, pipe, worker, args, *rest):
        def traced(env, *a):
            _records.clear()  # this rank's own calls, not the launching process's before the fork
            try:
                return worker(env, *a)
            finally:
                write(f"rank{rank}", world=world)  # before the rank reports (the launcher then may stop it)
        traced.__name__ = getattr(worker, "__name__", "worker")
        return rank_main(rank, world, pipe, traced, args, *rest)

    launch._local_rank_main = traced_rank_main
    threading.setprofile(_profile)
    sys.setprofile(_profile)


def _where(code):
    return f"{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name} " \
           f"({os.path.relpath(code.co_filename, _state['where'])}:{code.co_firstlineno})"


def write(process, **extra):
    records = sorted([_where(a), _where(b), lesson, n] for (a, b, lesson), n in
                     (item for item in _records.items() if item[0] not in ("demo", "ran")))
    path = _state["out"] / f"{process}.json"
    path.write_text(json.dumps({"process": process, "pid": os.getpid(), **extra, "demo_calls": _records.get("demo", 0),
                                "calls": records, "ran": sorted(_records.get("ran", ()))}))


def records(out):
    """{process: its record} of every process's file in directory out: "calls" [[caller, callee, in the lesson,
    count]], "demo_calls", "ran" (the chapter's own read-first names the lesson ran), and for a rank "world"."""
    return {(rec := json.loads(f.read_text()))["process"]: rec for f in sorted(Path(out).glob("*.json"))}


def violations(out):
    """Sorted lines "caller (file:line) -> callee (file:line)": the calls every process recorded in the lesson."""
    return sorted({f"{a} -> {b}" for rec in records(out).values() for a, b, lesson, _ in rec["calls"] if lesson})


def run(ch, out, script, argv, root=ROOT):
    """Run script (a chapter's file) as __main__ with argv, traced; main.json written as it exits."""
    sys.argv = [str(script), *argv]
    sys.path[0] = str(Path(script).resolve().parent)
    install(ch, out, root)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        write("main")


if __name__ == "__main__":
    root = ROOT
    if sys.argv[1:2] == ["--root"]:
        root = Path(sys.argv[2])
        del sys.argv[1:3]
    if len(sys.argv) < 3:
        sys.exit("usage: python3 tests/lesson_trace.py [--root DIR] OUT 0N_chapter.py [its flags]")
    out, script, *argv = sys.argv[1:]
    sys.path.insert(1, str(ROOT))  # plumbing, for the launcher's rank entry point
    run(Path(script).name[:2], out, Path(root) / script, argv, root)
