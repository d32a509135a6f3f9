"""The autograder's machinery, shared by every file's checks (checks_01.py ... checks_05.py).

    Exercise        one piece of a numbered file: the functions a student writes, where they go in
                    the real machinery, the check that grades them, the reading and the planted bugs
    grade(ex, impl) run ex's check on impl (the student's functions, the reference's or a planted
                    bug's) and return a Grade: pass, fail (with the reasons), not implemented (with
                    the stub's hint) or error (the exception, and on which rank; or the time limit
                    it ran past, and where)
    time_limit(s)   a block that raises TimeLimit after s seconds: an endless loop ends, said so
    compare(...)    how a tensor differs from the serial model's: None if it does not, else what
                    kind of difference and a sentence (zero, sign flipped, tp x too large, ...)
    guarded(ex, impl)  impl with every student callable wrapped so that what it returns is checked as it
                    returns (None, the wrong number of gradients, a gradient's shape or dtype, an input
                    written in place): a Mistake, said at the student's file and line with the rule
    installed(...)  the student's functions put in place of the numbered file's, in the launching
                    process; the ranks are forked from it and inherit them (plumbing.launch forks)
    ranks(fn, n)    plumbing.launch.launch with short timeouts, so a deadlocked exercise ends

Every check compares with the serial model in float64, as tests/ does. Its reference is computed in
the launching process before anything is installed, so a student's function can never change the
answer it is compared with.
"""
import ast
import contextlib
import dis
import functools
import importlib
import inspect
import linecache
import os
import re
import signal
import sys
import textwrap
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist

from plumbing.launch import RankFailure, launch

TOL = 1e-10  # float64: parallel pieces only reorder additions (~1e-15); a real bug is O(1)
COLLECTIVE_TIMEOUT_S = 20  # a rank waiting on a collective that the others never call gives up
DEADLINE_S = 120  # the whole launch, whatever happens
MAX_REASONS = 4  # a failing check lists this many reasons, then counts the rest
STUB = re.compile(r"\d\d\.\d ")  # a stub's NotImplementedError starts with its exercise: "01.2 ..."


def numbered(name):
    """A numbered file as a module (its name starts with a digit, so importlib)."""
    return importlib.import_module(name)


# ----------------------------------------------------------------------------------------------
# Exercises and their grades


@dataclass
class Planted:
    """A known-wrong answer and what the autograder must say about it (tests/test_exercises.py)."""
    name: str  # e.g. "g_backward_all_reduces"
    what: str  # the mistake, in words
    impl: Callable  # () -> {function name: wrong function}; functions not named come from the reference
    expect: str  # a phrase the autograder's failure must contain
    # The failure names the planted line, the one marked "# the mistake" in the planted function's source:
    # a mistake the guard catches (see guarded) as the function returns, at the student's own line.
    at_line: bool = False


@dataclass
class Exercise:
    key: str  # "01.2": file and number
    name: str  # "linears"
    title: str  # one line
    functions: tuple  # the names the student writes in the stub file
    reading: str  # the paper section it implements
    check: Callable  # check(impl) -> [reasons it fails]; impl: {name: function}
    reference: Callable  # () -> impl of the numbered file's own functions: the solution
    planted: list = field(default_factory=list)
    # The numbered file's piece each of `functions` stands in for, where its name differs
    # ("ColumnParallelLinear.forward" for column_parallel_forward); () when every name is the same.
    replaces: tuple = ()

    @property
    def file(self):
        return self.key.split(".")[0]


@dataclass
class Grade:
    status: str  # "pass", "fail", "not implemented" or "error"
    lines: list  # the reasons (fail), the hint (not implemented) or the exception (error)


class TimeLimit(BaseException):
    """An exercise ran past its time limit. A BaseException, so that a student's `except Exception`
    inside the loop cannot swallow it."""


@contextlib.contextmanager
def time_limit(seconds):
    """Raise TimeLimit in this block after `seconds` (SIGALRM; the main thread only, else no limit).
    A timer already running (a test's own deadline) is put back afterwards, less the time spent."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeLimit(seconds)

    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    outer = signal.setitimer(signal.ITIMER_REAL, seconds)[0]
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 0.001))


def grade(exercise, impl, time_limit_s=None):
    """Run the exercise's check on impl; turn what happens into a Grade. The serial references run
    here on one thread, as each rank does: the models are tiny, and on a busy 2-core machine a
    second thread that spins waiting for a core makes them 10 to 100 times slower. time_limit_s:
    a check still running then is an error, naming the time limit and, when the loop was in this
    process, the line it was on (on ranks, the launch stops them: a loop or a collective). impl is
    guarded (see guarded): a function that returns what breaks a rule fails at its own line."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _student_files.clear()
    _student_files.update(_files_of(impl))
    try:
        with time_limit(time_limit_s):
            return _grade(exercise, guarded(exercise, impl))
    except TimeLimit as e:
        return Grade("error", [f"it ran past its time limit of {time_limit_s:g} s: " + _stuck(e)])
    finally:
        torch.set_num_threads(threads)


def _stuck(error):
    """Where a check was when its time ran out: the innermost line outside torch and the grading
    machinery (the student's loop), or, on ranks, what can keep them there."""
    ours = (os.path.dirname(torch.__file__), os.path.dirname(__file__) + os.sep + "autograder.py",
            os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plumbing"))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(ours)
              and "multiprocessing" not in f.filename and "contextlib" not in f.filename]
    on_ranks = any(f.filename.endswith(os.path.join("plumbing", "launch.py"))
                   for f in traceback.extract_tb(error.__traceback__))
    if frames and not on_ranks:
        f = frames[-1]
        return f"an endless loop? It was at {f.filename}:{f.lineno} in {f.name}: {f.line}"
    return ("its ranks were stopped: an endless loop in your function, or a rank waiting for a collective "
            "that the others never call")


def _grade(exercise, impl):
    try:
        reasons = exercise.check(impl)
    except NotImplementedError as e:  # a stub's, whose hint starts with its exercise ("01.2 ..."), or torch's
        if STUB.match(str(e)):
            return Grade("not implemented", [str(e)])
        return Grade("error", [f"NotImplementedError: {e}"] + _where(e))
    except Mistake as e:  # what a student's function returned broke a rule: said at its line
        return Grade("fail", [str(e)])
    except StudentError as e:
        if isinstance(e.__cause__, Mistake):
            return Grade("fail", [str(e.__cause__)])
        return Grade("error", [str(e)] + _where(e.__cause__ or e))
    except RankFailure as e:
        return _rank_failure(str(e))
    except Exception as e:  # noqa: BLE001 - a student's function may raise anything: say what and where
        return Grade("error", [f"{type(e).__name__}: {e}"] + _where(e))
    return Grade("fail", reasons) if reasons else Grade("pass", [])


def _where(e):
    """Where an exception was raised: the innermost line of the student's files if it passed through
    them, else the innermost line (the grader's own, then said to be where it used the student's
    results, not a traceback to read)."""
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if f.filename in _student_files]
    if mine:
        f = mine[-1]
        return [f"  at {_short_path(f.filename)}:{f.lineno} in {f.name}: {(f.line or '').strip()}"]
    if frames:
        f = frames[-1]
        return [f"  at {_short_path(f.filename)}:{f.lineno} in {f.name}, where the check used what your functions "
                f"returned or did"]
    return []


def _rank_failure(text):
    """A rank raised: NotImplementedError is a stub, a timeout a collective some ranks never called, a
    Mistake what a student's function returned (said at its line)."""
    hint = re.search(r"NotImplementedError: (\d\d\.\d .*)", text)
    if hint:
        return Grade("not implemented", [hint.group(1).strip()])
    mistake = re.search(r"^(?:[\w.]+\.)?Mistake: (.*)$", text, re.M)
    if mistake:
        rank = re.match(r"(ranks? [\d, ]+)", text)
        return Grade("fail", [(f"{rank.group(1).strip()}: " if rank else "") + mistake.group(1).strip()])
    first = text.splitlines()[0] if text else "a rank failed"
    if "passed its deadline" in text:  # the launch's own deadline: nothing timed out, something ran on
        return Grade("error", [f"the check ran past its {DEADLINE_S} s deadline on its ranks, which were stopped: an "
                               f"endless loop in your function, or a rank waiting for a collective that the others "
                               f"never call"])
    tail = [line for line in text.splitlines() if line.strip()]
    last = next((line for line in reversed(tail) if not line.startswith(("rank ", "stopped ", "  "))), "")
    lines = [f"{first} {last.strip()}".strip()]
    if re.search(r"[Tt]imed? ?out|deadline|[Cc]onnection (closed|reset)", text):
        lines.append("a collective timed out: every rank of a group must call the same collectives in "
                     "the same order (did only some ranks all-reduce, or one rank wait for another?)")
    where = re.findall(r'File "([^"]*)", line (\d+), in (\w+)\n(.*)', text)
    mine = [w for w in where if w[0] in _student_files]
    if mine:
        lines.append("  at {}:{} in {}: {}".format(_short_path(mine[-1][0]), *mine[-1][1:3], mine[-1][3].strip()))
    elif where:
        ours = [w for w in where if "exercises" + os.sep in w[0]] or where
        lines.append("  at {}:{} in {}, where the check used what your functions returned or did".format(
            _short_path(ours[-1][0]), *ours[-1][1:3]))
    return Grade("error", lines)


# ----------------------------------------------------------------------------------------------
# Guarding the student's functions: what each returns is checked as it returns, and a broken rule
# is said at the student's own line, before the grader uses the value (and would crash on it)


class Mistake(Exception):
    """What a student's function returned breaks a rule (None, the wrong number of gradients, a
    gradient of the wrong shape or dtype, an input written in place): one line, naming the
    student's file and line, what came back and the rule."""


ALL_REDUCE_RULE = "`dist.all_reduce` works in place and returns None"
NEW_TENSOR = ("compute into a new tensor (x * s, not x.mul_(s); x.masked_fill, not x.masked_fill_; 01's all_reduce(x, "
              "group) returns the sum in a new one, where `dist.all_reduce` writes into x)")
_student_files = set()  # the files the graded functions are defined in (grade sets it)


def guarded(exercise, impl):
    """impl with every callable wrapped, transparently while nothing is wrong: an autograd Function
    by a subclass whose forward and backward check what they return (guarded_function), a function
    by one that checks it leaves its tensor arguments as they were and returns a value where the
    numbered file's piece always does (guarded_callable). A broken rule raises Mistake."""
    try:
        reference = exercise.reference()
    except Exception:  # noqa: BLE001 - no reference to learn from: the rules that need none still hold
        reference = {}
    out = {}
    for name, obj in impl.items():
        if isinstance(obj, type) and issubclass(obj, torch.autograd.Function):
            out[name] = guarded_function(obj)
        elif inspect.isfunction(obj):
            out[name] = guarded_callable(obj, _always_returns(reference.get(name)))
        else:
            out[name] = obj
    return out


def _files_of(impl):
    codes = []
    for obj in impl.values():
        if isinstance(obj, type):
            codes += [getattr(v, "__code__", None) for v in vars(obj).values()]
            codes += [getattr(getattr(obj, m, None), "__code__", None) for m in ("forward", "backward")]
        else:
            codes.append(getattr(obj, "__code__", None))
    return {c.co_filename for c in codes if c is not None}


def _short_path(path):
    """A path under the current directory relative to it (exercises/ex01_tensor_parallel.py), else whole."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


_SURE = (ast.Call, ast.Attribute, ast.Subscript, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Tuple, ast.List,
         ast.ListComp, ast.Dict, ast.DictComp, ast.Set, ast.SetComp, ast.GeneratorExp, ast.JoinedStr)


def _always_returns(fn):
    """Whether fn (the numbered file's piece) returns a value on every path, read from its source:
    its body ends in a return or a raise and every return gives an expression that cannot be None
    (a call, a tuple, an arithmetic ...; a bare name such as 05's `return loss`, None on every stage
    but the last, may be None). False when unsure (a body that only raises, as a stub's, says nothing), so that no None is called a mistake wrongly."""
    if fn is None or not inspect.isfunction(fn):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body \
            or not isinstance(node.body[-1], (ast.Return, ast.Raise)):
        return False

    def returns(n):  # every Return under n, outside nested functions and classes
        for child in ast.iter_child_nodes(n):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, ast.Return):
                yield child
            yield from returns(child)
    found = list(returns(node))  # none: the piece only raises (a stub, as in the student copy): unsure
    return bool(found) and all(isinstance(r.value, _SURE) or (isinstance(r.value, ast.Constant) and
                                                              r.value.value is not None) for r in found)


@functools.lru_cache(maxsize=None)
def _return_lines(code):
    """The lines of code's return instructions (the implicit one at the end counts too)."""
    return frozenset(i.positions.lineno for i in dis.get_instructions(code)
                     if i.opname in ("RETURN_VALUE", "RETURN_CONST") and i.positions and i.positions.lineno)


def _call(fn, args, kwargs, watch=()):
    """fn(*args, **kwargs), the line it returned from, and the first of watch (see _watched) that it
    wrote in place, with the line of fn's that did (a call on that line, if the write was in a
    function it called): (out, line, None or (name, line)). The return line is read from fn's code
    when it has one return and nothing is watched; else a trace of fn's own frame sees it (another
    tracer running, a debugger's, is left alone: the write is then said at the return line)."""
    code = fn.__code__
    lines = _return_lines(code)
    if (len(lines) == 1 and not watch) or sys.gettrace() is not None:
        out = fn(*args, **kwargs)
        line = min(lines, default=code.co_firstlineno)
        changed = _changed(watch)
        return out, line, None if changed is None else (changed, line)
    seen, found = [], []

    def local(frame, event, arg):
        if watch and not found and event in ("line", "return"):
            changed = _changed(watch)
            if changed is not None:
                found.append((changed, seen[-1] if seen else frame.f_lineno))
        if event in ("line", "return"):
            seen.append(frame.f_lineno)
        return local

    def calls(frame, event, arg):
        if frame.f_code is code:
            frame.f_trace_lines = bool(watch)
            return local
        return None

    sys.settrace(calls)
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.settrace(None)
    return out, seen[-1] if seen else code.co_firstlineno, found[0] if found else None


def _watched(named):
    """[(name, tensor, its version, a copy)] of the tensors among named [(name, value)]: what _changed
    compares with (the version counter misses a collective's write, so the values are compared too)."""
    return [(n, a, a._version, a.detach().clone()) for n, a in named if isinstance(a, torch.Tensor)]


def _changed(watch):
    """The name of the first watched tensor written since it was watched, or None."""
    for name, t, version, copy in watch:
        if t._version != version:
            return name
        now = t.detach()
        if now.shape != copy.shape or not bool(((now == copy) | (now != now) & (copy != copy)).all()):
            return name
    return None


def _at(fn, line, what):
    """"exercises/ex01_tensor_parallel.py:52 in CopyToTP.backward (return ...)": the student's line."""
    path = fn.__code__.co_filename
    source = linecache.getline(path, line).strip()
    return f"{_short_path(path)}:{line} in {what}" + (f" ({source})" if source else "")


def _inputs_of(fn, args, kwargs, skip=0):
    """[(name, value)] of fn's arguments, named by its signature (past the first `skip`)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    out = [(names[i] if i < len(names) else f"argument {i + 1}", a) for i, a in enumerate(args)][skip:]
    return out + list(kwargs.items())


def guarded_callable(fn, always_returns):
    """fn, checked as it returns: a tensor argument written in place (its version counter moved), and
    None where the numbered file's piece always returns a value. A Mistake names fn's line."""
    what = fn.__qualname__

    @functools.wraps(fn)
    def student(*args, **kwargs):
        out, line, written = _call(fn, args, kwargs, _watched(_inputs_of(fn, args, kwargs)))
        if out is None and always_returns:
            raise Mistake(f"{_at(fn, line, what)}: it returned None, but the piece it stands in for always returns "
                          f"a value: return the result ({ALL_REDUCE_RULE}, as do torch.distributed's other "
                          f"collectives and 01's all_gather_single: return the tensor they wrote)")
        if written:
            raise Mistake(f"{_at(fn, written[1], what)}: it wrote into its argument {written[0]} in place: a "
                          f"function leaves the tensors it is given as they are, since its caller uses them again: "
                          f"{NEW_TENSOR}")
        return out
    student.__autograder_student__ = fn
    return student


def guarded_function(cls):
    """A subclass of the autograd Function cls whose forward and backward call cls's and check what
    comes back. forward: not None, and no input written in place unless marked (ctx.mark_dirty).
    backward: one gradient per input of forward (None for the inputs that are not tensors, a tensor
    for each input that needs a gradient), each of its input's shape and dtype, and the incoming
    gradients left as they were. Functions in the new style (forward without ctx, setup_context)
    are left as they are."""
    if cls.setup_context is not torch.autograd.Function.setup_context:
        return cls
    forward, backward = cls.forward, cls.backward
    name = cls.__name__

    def guarded_forward(ctx, *args):
        inputs = _inputs_of(forward, (ctx, *args), {}, skip=1)
        ctx._autograder_inputs = [(n, isinstance(a, torch.Tensor), tuple(a.shape) if isinstance(a, torch.Tensor)
                                   else None, getattr(a, "dtype", None)) for n, a in inputs]
        tensors = _watched(inputs)
        out, line, written = _call(forward, (ctx, *args), {}, tensors)
        if out is None:
            raise Mistake(f"{_at(forward, line, name + '.forward')}: forward returned None: it returns its output; "
                          f"{ALL_REDUCE_RULE} (01's all_reduce(x, group) returns the sum in a new tensor)")
        dirty = getattr(ctx, "dirty_tensors", None) or ()
        if written and not any(t is d for n, t, *_ in tensors if n == written[0] for d in dirty):
            raise Mistake(f"{_at(forward, written[1], name + '.forward')}: forward wrote into its input "
                          f"{written[0]} in place: forward leaves its inputs as they are (autograd and the caller "
                          f"still use them; ctx.mark_dirty says otherwise): {NEW_TENSOR}")
        return out

    def guarded_backward(ctx, *grads):
        out, line, written = _call(backward, (ctx, *grads), {}, _watched(_inputs_of(backward, (ctx, *grads), {}, 1)))
        inputs = getattr(ctx, "_autograder_inputs", None)
        problem = _gradient_problem(out, inputs, ctx.needs_input_grad) if inputs is not None else None
        if problem:
            raise Mistake(f"{_at(backward, line, name + '.backward')}: backward {problem}")
        if written:
            raise Mistake(f"{_at(backward, written[1], name + '.backward')}: backward wrote into the gradient it "
                          f"was given ({written[0]}) in place: autograd may hand that tensor to other functions too, "
                          f"so backward leaves it as it is: {NEW_TENSOR}")
        return out

    return type(name, (cls,), {"forward": staticmethod(guarded_forward), "backward": staticmethod(guarded_backward),
                               "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                               "__doc__": cls.__doc__, "__autograder_student__": cls})


def _gradient_problem(out, inputs, needs):
    """What is wrong with backward's result out, given forward's inputs [(name, is a tensor, shape,
    dtype)]; None if nothing is."""
    names = ", ".join(n for n, *_ in inputs)
    rule = (f"backward returns one gradient per input of forward ({len(inputs)}: {names}), None for those that "
            f"are not tensors")
    if out is None:
        return f"returned None: {rule}; {ALL_REDUCE_RULE}"
    grads = out if isinstance(out, tuple) else (out,)
    if len(grads) < len(inputs) or any(g is not None for g in grads[len(inputs):]):
        return f"returned {len(grads)} gradient{'s' * (len(grads) != 1)} for forward's {len(inputs)} inputs: {rule}"
    for (n, is_tensor, shape, dtype), g, need in zip(inputs, grads, needs):
        if not is_tensor:
            if g is not None:
                return f"returned a {type(g).__name__} as the gradient of {n}, which is not a tensor: {rule}"
        elif g is None:
            if need:
                return f"returned None as the gradient of {n}, a tensor that needs one: {rule}; {ALL_REDUCE_RULE}"
        elif not need:  # autograd drops it: a tensor that needs no gradient (the targets) may get anything
            continue
        elif not isinstance(g, torch.Tensor):
            return f"returned a {type(g).__name__} as the gradient of {n}: a gradient is a tensor, or None"
        elif tuple(g.shape) != shape:
            return (f"returned a gradient of shape {tuple(g.shape)} for {n}, whose shape is {shape}: a gradient has "
                    f"the shape of the input it stands for")
        elif g.dtype != dtype:
            return (f"returned a {g.dtype} gradient for {n}, which is {dtype}: a gradient has the dtype of the input "
                    f"it stands for (autograd would cast it without a word, and float64 checks lose their digits)")
    return None


# ----------------------------------------------------------------------------------------------
# Putting functions into the machinery


@contextlib.contextmanager
def installed(*replacements):
    """Set each (owner, attribute, value) for the duration of the block, then restore the original.
    The owner is a numbered module or one of its classes; ranks forked inside the block see the
    new values, since fork copies this process."""
    saved, missing = [], object()
    try:
        for owner, attr, value in replacements:
            # A class's own attribute, not one it inherits: restoring must not copy it down.
            saved.append((owner, attr, vars(owner).get(attr, missing) if isinstance(owner, type) else getattr(owner, attr)))
            setattr(owner, attr, value)
        yield
    finally:
        for owner, attr, value in reversed(saved):
            if value is missing:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)


def new_group(ranks_in_it):
    """dist.new_group with the autograder's collective timeout (a group's own timeout, not the
    default group's, bounds the collectives on it)."""
    return dist.new_group(ranks_in_it, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def grid_groups(env, grid):
    """The grader's own process groups of a grid ({"tp": [[ranks], ...], ...}, as 05's rank_grid gives):
    every group created on every rank in the same order (dist.new_group is collective over the world),
    this rank's of each kind returned by name (None for a kind it is in no group of). A check that needs
    groups builds them so, never with a numbered file's new_groups, which an exercise may be grading."""
    made = [(kind, members, new_group(members)) for kind in grid for members in grid[kind]]
    return SimpleNamespace(**{kind: next((g for k, members, g in made if k == kind and env.rank in members), None)
                              for kind in grid})


def tp_group(env):
    """Every rank of this launch in one tensor-parallel group, with the autograder's timeout."""
    return numbered("01_tensor_parallel").new_tp_group(env, env.world_size, timeout_s=COLLECTIVE_TIMEOUT_S)


def ranks(body, n, *args):
    """Run body(env, *args) on n fork-started CPU ranks (gloo); every rank's result, in rank order."""
    warm()
    return launch(body, n, *args, timeout_s=COLLECTIVE_TIMEOUT_S, deadline_s=DEADLINE_S)


def warm(meta=False):
    """Import here, once, what torch imports lazily on first use, so that the forked ranks inherit it
    instead of each importing it again (seconds per rank on a busy 2-core machine): the first
    backward imports sympy; with meta, the first random fill on the meta device (01's
    init_state_dict, which 05's build calls) imports torch's compiler."""
    if "autograd" not in _warmed:
        torch.ones(1, dtype=torch.float64, requires_grad=True).sum().backward()
        _warmed.add("autograd")
    if meta and "meta" not in _warmed:
        torch.empty(1, device="meta").normal_()
        _warmed.add("meta")


_warmed = set()


def called(fn, *args, what):
    """fn(*args), with a NotImplementedError passed on unchanged and any other exception turned into
    one sentence naming `what` was being called (for pure checks, run in this process)."""
    try:
        return fn(*args)
    except (NotImplementedError, Mistake):
        raise
    except Exception as e:  # noqa: BLE001
        raise StudentError(f"{what} raised {type(e).__name__}: {e}") from e


class StudentError(RuntimeError):
    """The student's function raised while a pure check called it."""


# ----------------------------------------------------------------------------------------------
# Comparing with the serial model


def rel(a, b):
    """max |a - b| / max |b|: relative to the tensor's scale, as tests/ compares."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def compare(got, want, tol=TOL, factors=None, suspects=()):
    """None when got equals want to tol, else (kind, words) saying how it differs.

    factors: {"tp": 2} names the integers a scaled answer is checked against ("is tp=2 x too
    large"). suspects: [(tensor, words)]: known wrong answers, tried first; if got equals one of
    them, its words are the diagnosis (kind "suspect"). kind is one of missing, shape, nonfinite,
    zero, suspect, "<factor> x too large" / "<factor> x too small" (say "tp x too large"), scaled
    (by another number), sign, other: the kinds are listed in KINDS, the most telling first."""
    if got is None:
        return "missing", "is missing (None): no gradient reached it"
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    scale = want.abs().max().item() if want.numel() else 0.0
    if got.shape == want.shape and (rel(got, want) <= tol or (scale == 0 and got.abs().max().item() == 0)):
        return None
    for candidate, words in suspects:
        if candidate is not None and candidate.shape == got.shape and torch.isfinite(got).all() \
                and rel(got, candidate.double()) <= 1e-8:
            return "suspect", words
    if got.shape != want.shape:
        return "shape", f"has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not torch.isfinite(got).all():
        return "nonfinite", "holds NaN or inf"
    if got.abs().max().item() <= tol * scale:
        return "zero", f"is zero everywhere (expected max |x| = {scale:.3g})"
    alpha = (got * want).sum().item() / max((want * want).sum().item(), 1e-300)
    if rel(got, alpha * want) <= 1e-8:  # a scalar multiple of the right answer
        if abs(alpha + 1) <= 1e-6:
            return "sign", "has the wrong sign (it is minus the expected)"
        for name, k in (factors or {}).items():
            if k > 1 and abs(alpha - k) <= 1e-6 * k:
                return f"{name} x too large", f"is {name}={k} x too large"
            if k > 1 and abs(alpha - 1 / k) <= 1e-6:
                return f"{name} x too small", f"is {name}={k} x too small"
        return "scaled", f"is {alpha:.4g} x what it should be"
    differ = int(((got - want).abs() > tol * max(scale, 1e-300)).sum())
    ratio = got.norm().item() / max(want.norm().item(), 1e-300)
    size = "too large" if ratio > 1.001 else "too small" if ratio < 0.999 else "about the right size"
    return "other", (f"is off by {rel(got, want):.2e} relative (tolerance {tol:g}): {differ} of "
                     f"{got.numel()} entries differ; its norm is {ratio:.3g} x the expected ({size})")


KINDS = ("suspect", "missing", "shape", "nonfinite", "zero", "sign", "x too large", "x too small", "scaled",
         "other")


def differences(pairs, hints=None, **kw):
    """[(what, got, want[, suspects])] -> ["what words: hint"] for every pair that differs, the most
    telling kinds first (a known mistake, a scalar multiple, ...; see KINDS). hints maps a kind (see
    compare) to the advice that follows it."""
    out = []
    for what, got, want, *extra in pairs:
        found = compare(got, want, suspects=extra[0] if extra else (), **kw)
        if found:
            kind, words = found
            hint = (hints or {}).get(kind)
            text = f"{what}: {words}" if kind == "suspect" else f"{what} {words}"
            rank = next(i for i, k in enumerate(KINDS) if kind == k or kind.endswith(k))
            out.append((rank, text + (f": {hint}" if hint else "")))
    return [text for _, text in sorted(out, key=lambda x: x[0])]


def merged(results):
    """Every rank's reasons (results[r] is rank r's list), a reason that several ranks give written
    once: "ranks 0, 1: ..."."""
    seen = {}
    for r, reasons in enumerate(results):
        for text in reasons:
            seen.setdefault(text, []).append(r)
    return [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {text}" for text, rs in seen.items()]


def first(reasons, limit=MAX_REASONS):
    """At most `limit` reasons, then one line counting the rest."""
    reasons = list(reasons)
    if len(reasons) <= limit:
        return reasons
    return reasons[:limit] + [f"... and {len(reasons) - limit} more"]


# ----------------------------------------------------------------------------------------------
# Weights and batches for the checks: random everywhere (biases and LayerNorms too), so that a bias
# added twice or a missing LayerNorm gradient cannot hide behind zeros or ones.


def random_weights(cfg, seed, module=None):
    """A full float64 state dict for GPT(cfg): normal weights (std 0.1), biases and LayerNorm
    shifts around 0, LayerNorm gains around 1. Built on the CPU from the parameters' names (not on
    the meta device, whose first use imports torch's compiler: seconds in every forked rank)."""
    tensor_parallel = numbered("01_tensor_parallel")
    module = module or tensor_parallel.GPT(cfg, None, init=False, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    full = {}
    for name, p in module.named_parameters():
        t = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.1
        full[name] = t + 1 if ".ln_" in name and name.endswith(".weight") else t
    return full


def token_batch(cfg, B, T, seed, ignored=0):
    """(idx, targets), each (B, T); the first `ignored` targets of row 0 are ignore_index."""
    gen = torch.Generator().manual_seed(seed)
    idx, targets = torch.randint(cfg.vocab_size, (2, B, T), generator=gen)
    targets[0, :ignored] = -100
    return idx, targets
