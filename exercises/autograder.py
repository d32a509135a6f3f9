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
    installed(...)  the student's functions put in place of the numbered file's, in the launching
                    process; the ranks are forked from it and inherit them (plumbing.launch forks)
    ranks(fn, n)    plumbing.launch.launch with short timeouts, so a deadlocked exercise ends

Every check compares with the serial model in float64, as tests/ does. Its reference is computed in
the launching process before anything is installed, so a student's function can never change the
answer it is compared with.
"""
import contextlib
import importlib
import os
import re
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
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
    process, the line it was on (on ranks, the launch stops them: a loop or a collective)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with time_limit(time_limit_s):
            return _grade(exercise, impl)
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
    if frames and not frames[-1].filename.endswith("launch.py"):
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
    except RankFailure as e:
        return _rank_failure(str(e))
    except Exception as e:  # noqa: BLE001 - a student's function may raise anything: say what and where
        return Grade("error", [f"{type(e).__name__}: {e}"] + _where(e))
    return Grade("fail", reasons) if reasons else Grade("pass", [])


def _where(e):
    tb = e.__traceback__
    frames = []
    while tb:
        frames.append(f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}")
        tb = tb.tb_next
    return [f"  at {frames[-1]}"] if frames else []


def _rank_failure(text):
    """A rank raised: NotImplementedError is a stub, a timeout a collective some ranks never called."""
    hint = re.search(r"NotImplementedError: (\d\d\.\d .*)", text)
    if hint:
        return Grade("not implemented", [hint.group(1).strip()])
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
    where = re.findall(r'File "([^"]*exercises/[^"]*)", line (\d+), in (\w+)', text)
    if where:
        lines.append("  at {}:{} in {}".format(*where[-1]))
    return Grade("error", lines)


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
    except NotImplementedError:
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
