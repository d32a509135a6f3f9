"""Launching: one code path from 1 CPU process to a GPU cluster.

    launch(worker, n, *args)   under torchrun: join its group (NCCL on GPU LOCAL_RANK, else gloo)
                               and run worker(env, *args) as this one rank; otherwise fork n CPU
                               ranks here (gloo, one thread each) and return every rank's result
    launcher_ranks()           (rank, world size, local rank) from torchrun's environment, checked,
                               or None when no launcher started this process
    launch_mode()              "env" (this process is one rank of a launcher's group) or "local"
                               (fork the ranks here): the rule below, MEGATRON_SCRATCH_LAUNCH
    run_main(main)             a script's exit code: 0 if main() returned True, 1 (and the message)
                               on a RankFailure or a ValueError, so bad input never ends in a trace
                               (nor does an exercise's stub: which one, where, and its check);
                               130 and one line on Ctrl-C (Interrupted: "interrupted at step N")
    new_tp_group(env, tp)      this rank's block of tp consecutive ranks, as a process group
    printer(env)               print on rank 0 only
    gather_numbers(values)     every rank's list of numbers, by tensor collectives (no pickling)
    gather_json(obj)           every rank's JSON-able object, as UTF-8 bytes in a tensor

Nothing hangs: every collective has a timeout, and when a local rank raises or dies the others are
stopped at once and RankFailure carries that rank's traceback (a collective that lost its peer or
timed out: one line, which of ours; an exercise's stub: one sentence for every rank that reached
it, with the exercise, the function, its file:line and the check to run); a rank still running when every
other rank's collective has timed out is named first, as the one they waited for (watched: the rank
the first timed-out collective waited for, from every rank's record then), and once a rank
has returned the others must within timeout_s. Under torchrun the elastic agent does the stopping
on its node; a rank whose peer is gone fails its next collective, at once if the peer's connection
closed and after the timeout if it went silent, and says so, naming the peer first where its
process is seen to have ended (on this host, or by a peer on its host, through the side channel),
else, after a timeout, the rank it waited for, from every rank's record there (watch.lagged_peer:
the local launcher's timeout report); a rank dies with its own agent, as it would with its node.

Which mode (launch_mode): `mode=` of launch, else the environment variable MEGATRON_SCRATCH_LAUNCH,
"env" (join the group that RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT describe, whoever set them:
a Kubernetes operator, your own script) or "local" (fork the ranks here, whatever else the environment
holds); unset, it is "env" under torchrun (which exports TORCHELASTIC_RUN_ID with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT) and "local" when neither RANK nor WORLD_SIZE is set. Anything
else, such as a CI job that exports RANK and WORLD_SIZE for its own reasons, is refused in one sentence
before any process or group exists: it would otherwise run one rank of a group that never forms, or
one rank where n were asked for.
"""
import ctypes
import json
import operator
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, get_context

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


class RankFailure(RuntimeError):
    """Raised in the launching process when a rank raised, died or missed the deadline."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT), said in one line: where the run was ("interrupted at step 12 of 200").
    Raised by whatever knows where it is (05's progress bar, sampling); the launcher passes the
    first rank's on, and run_main prints it instead of a traceback."""


class Terminated(Interrupted):
    """SIGTERM to the launching process (a scheduler's kill, a `kill PID`): stopped as Ctrl-C stops a
    run, the ranks saying where they were, and said in one line; the exit code is 143 (128 + 15)."""


# Faults that name their own cause in a sentence: a rank that raises one reports the sentence and
# where, not a traceback (bad input; a run whose steps are all non-finite; a save that refuses, or
# that did not finish within its own timeout).
SENTENCES = (ValueError, FloatingPointError, TimeoutError)

# An exercise's stub (exercises/ex0N_*.py, and the numbered files of the students' copy) raises
# NotImplementedError with a hint that starts with its exercise ("01.2 ColumnParallelLinear.forward:
# ... then run: python3 -m exercises check 01.2"; exercises/autograder.py's STUB). A rank that reaches
# one says which stub, and where, in a sentence; the ranks that reach the same one are said once.
STUB_HINT = re.compile(r"(\d\d\.\d) ")
STUB_SAID = re.compile(r"reached the stub of exercise \d\d\.\d, .*?, which is not written yet: NotImplementedError: ")


def launch(worker, nprocs, *args, timeout_s=60.0, deadline_s=None, watch=None, mode=None):
    """Run worker(env, *args) on every rank and return the ranks' results, in rank order.

    mode: "env", "local" or None (MEGATRON_SCRATCH_LAUNCH, else torchrun's environment decides: the
    module's docstring; RANK/WORLD_SIZE set without torchrun and without a mode is a ValueError).
    In mode "env" (under torchrun) this process is one rank: it joins the launcher's group
    (NCCL on its LOCAL_RANK GPU if CUDA is available, else gloo) and returns [its own result]; the
    launcher's WORLD_SIZE, not nprocs, sets the number of ranks. Otherwise nprocs CPU ranks are
    fork-started here with gloo and one thread each. timeout_s bounds every collective; deadline_s,
    if given, bounds the whole run. If a rank raises or dies, the others are stopped and RankFailure
    carries the rank's traceback. nprocs below 1, or a malformed launcher variable, is a ValueError
    raised before any process or group exists. watch (local ranks): a Watch, whose watchdog here
    reads the ranks' records from the side channel, to name a dead rank's step and diagnose a hang.
    """
    try:
        count = operator.index(nprocs)  # an int, not a float or a string that looks like one
    except TypeError:
        count = None
    if count is None or isinstance(nprocs, bool) or count < 1:
        raise ValueError(f"launch: nprocs={nprocs!r} must be a whole number of ranks, at least 1")
    if _nested:
        raise ValueError(f"launch({getattr(worker, '__name__', worker)!r}, {count}) was called inside a rank that "
                         f"launch() (or torchrun) started: launches do not nest; a worker makes process groups "
                         f"of its own ranks with torch.distributed.new_group instead")
    ranks = launcher_ranks(mode)
    if ranks is not None:
        return [_run_launched_rank(worker, args, *ranks, timeout_s)]
    return _launch_local(worker, count, args, timeout_s, deadline_s, watch)


# ----------------------------------------------------------------------------------------------
# Under torchrun: this process is one rank of the launcher's group.

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE")  # a launcher's: this process is one rank of its group
MODE_VARIABLE, MODES = "MEGATRON_SCRATCH_LAUNCH", ("env", "local")
# torchrun (torch.distributed.run, and torch.distributed.launch, which is it) exports this to every rank it
# starts, with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and TORCHELASTIC_RESTART_COUNT (torch
# 2.11 to 2.13: torch/distributed/elastic/agent/server/local_elastic_agent.py): a launcher we recognise.
RECOGNISED = "TORCHELASTIC_RUN_ID"


def launch_mode(mode=None):
    """The mode, "env" or "local": mode if given, else MEGATRON_SCRATCH_LAUNCH, else torchrun's environment (env) or
    none of RANK and WORLD_SIZE (local). A ValueError, in one sentence naming the variables and the choice,
    for a mode that is not one of the two, and for RANK or WORLD_SIZE set by no launcher we recognise."""
    source = "launch(mode=...)" if mode is not None else MODE_VARIABLE
    chosen = mode if mode is not None else os.environ.get(MODE_VARIABLE, "").strip() or None
    if chosen is not None:
        if chosen not in MODES:
            raise ValueError(f"{source}={chosen!r} must be 'env' (this process is one rank of the group that RANK, "
                             f"WORLD_SIZE, MASTER_ADDR and MASTER_PORT describe) or 'local' (start the ranks here)")
        return chosen
    present = [name for name in LAUNCHER_VARIABLES if name in os.environ]
    if not present:
        return "local"
    if RECOGNISED in os.environ:
        return "env"
    shown = " and ".join(f"{name}={os.environ[name]!r}" for name in present)
    raise ValueError(f"{shown} {'are' if len(present) > 1 else 'is'} set, but not by a launcher this recognises "
                     f"(torchrun sets {RECOGNISED} too), so it cannot tell whether this process is one rank of a "
                     f"group or should start the ranks itself: set {MODE_VARIABLE}=env to join that group as rank "
                     f"RANK of WORLD_SIZE (at MASTER_ADDR:MASTER_PORT), or {MODE_VARIABLE}=local (or unset "
                     f"{' and '.join(LAUNCHER_VARIABLES)}) to start the ranks here")


def launcher_ranks(mode=None):
    """(rank, world_size, local_rank) from the launcher's environment, or None when the ranks are started
    here (launch_mode(mode) is "local"; a refused environment is its ValueError). A variable that is not a
    whole number in range is a ValueError naming it."""
    if launch_mode(mode) == "local":
        return None
    present = [name for name in LAUNCHER_VARIABLES if name in os.environ]
    if len(present) < 2:
        if not present:
            raise ValueError(f"{MODE_VARIABLE}=env (or mode='env') joins the group that RANK, WORLD_SIZE, "
                             f"MASTER_ADDR and MASTER_PORT describe, and RANK and WORLD_SIZE are not set: set them, "
                             f"or {MODE_VARIABLE}=local to start the ranks here")
        missing = next(name for name in LAUNCHER_VARIABLES if name not in present)
        raise ValueError(f"{present[0]} is set but {missing} is not: a launcher such as torchrun sets "
                         f"both; unset {present[0]} to start local ranks instead")
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if rank >= world:
        raise ValueError(f"RANK={rank} must be below WORLD_SIZE={world}")
    local = _env_int("LOCAL_RANK", 0, default=0)
    _check_master()
    return rank, world, local


def _check_master():
    """MASTER_PORT and MASTER_ADDR, where set: where rank 0 hosts the rendezvous (torch reads them
    at init_process_group). A port that is not one, or an address that does not resolve, would
    fail there with a traceback or a wait; say which variable, now."""
    port = os.environ.get("MASTER_PORT")
    if port is not None:
        value = _env_int("MASTER_PORT", 1)
        if value > 65535:
            raise ValueError(f"the environment variable MASTER_PORT={value} must be a TCP port, 1 to 65535")
    addr = os.environ.get("MASTER_ADDR")
    if addr is not None:
        try:
            socket.getaddrinfo(addr.strip(), None)
            if not addr.strip():
                raise socket.gaierror("empty")
        except (socket.gaierror, UnicodeError) as e:
            raise ValueError(f"the environment variable MASTER_ADDR={addr!r} does not resolve to an address "
                             f"({e.strerror if isinstance(e, OSError) and e.strerror else e}): it must name rank 0's "
                             f"host (torchrun sets it; --rdzv-endpoint / --master-addr)") from None


def _env_int(name, minimum, default=None):
    text = os.environ.get(name)
    if text is None and default is not None:
        return default
    try:
        value = int(text.strip())
    except (AttributeError, ValueError):
        raise ValueError(f"the environment variable {name}={text!r} must be a whole number "
                         f"(torchrun sets it for every rank it starts)") from None
    if value < minimum:
        raise ValueError(f"the environment variable {name}={value} must be at least {minimum}")
    return value


def _run_launched_rank(worker, args, rank, world, local_rank, timeout_s):
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent is our parent: die with it
        # torchrun starts each rank in a session of its own, so a signal to the agent's process
        # group (a kill of the agent) would otherwise leave this rank training on, headless.
        _die_with_parent()
    global _nested
    env = _join_launcher_group(rank, world, local_rank, timeout_s)
    side = _announce(rank)
    try:
        try:
            _nested = True
            try:
                result = worker(env, *args)
            finally:
                _nested = False
            # No rank tears its groups down while a peer may still be in a collective with it:
            # NCCL runs collectives asynchronously, so a rank's last ones may still be in flight
            # when its worker returns, and destroying the group would abort them under its peers.
            if env.device.type == "cuda":
                torch.cuda.synchronize(env.device)  # this rank's collectives, every group's, done
                dist.barrier(device_ids=[local_rank])  # NCCL's barrier needs its device named
            else:
                dist.barrier()
        except Exception as e:
            if _peer_lost(e):
                raise _lost_peer(e, side, rank, world, timeout_s) from e
            said = _stub_said(e)
            if said:  # an exercise's stub: this rank's sentence (torchrun's agent stops the others)
                raise RankFailure(f"rank {rank} of {world} {said}") from None
            raise
    finally:
        dist.destroy_process_group()
    return result


# Where each rank's process is, on the side channel, so that a rank whose collective lost a peer can
# name the peer that is gone: one key per host, "rank:pid:start time;" appended by each of its ranks.
HOST_KEY, VICTIMS_KEY, GONE_KEY = "launch/host/{}", "launch/victims", "launch/gone"


def _announce(rank):
    """Say on the side channel where this rank's process is; returns the side channel (or None)."""
    try:
        side = side_channel()
        side.append(HOST_KEY.format(socket.gethostname()), f"{rank}:{os.getpid()}:{_process(os.getpid())[2]};")
        return side
    except Exception:  # no side channel: a lost peer is then said without its name
        return None


def _process(pid):
    """(state, exit status or None, start time) of a process from /proc; state "gone" when there is
    no such process, None for all three without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # fields[0] is stat's field 3, the state
    except FileNotFoundError:
        return "gone", None, None
    except OSError:
        return None, None, None
    code = int(fields[49]) if fields[0] in "ZX" and len(fields) > 49 else None  # field 52, exit_code
    return fields[0], code, fields[19]  # field 22, starttime: a pid used again is another process


def _gone_peer(side, rank, wait_s=2.0):
    """The first peer found gone, as "rank R <what became of it>": a rank on this host whose process
    ended (or stopped), else one a peer on another host found so, within wait_s; None if none."""
    deadline = time.monotonic() + wait_s
    side.append(VICTIMS_KEY, f"{rank};")  # not a cause: its peers that look at its process skip it
    while True:
        if side.check([GONE_KEY]):
            return side.get(GONE_KEY).decode()
        victims = set(side.get(VICTIMS_KEY).decode().split(";"))
        key = HOST_KEY.format(socket.gethostname())
        found = []
        for entry in side.get(key).decode().split(";") if side.check([key]) else []:
            r, pid, started = entry.split(":") if entry.count(":") == 2 else (None, None, None)
            if r is None or r in victims or int(r) == rank:
                continue
            state, code, now = _process(int(pid))
            if state is None:  # no /proc here
                return None
            how = _ended(None, None) if state == "gone" or now != started else _ended(state, code) \
                if state in "ZX" else "is stopped (SIGSTOP, or a debugger holds it)" if state in "tT" else None
            if how:
                found.append(f"rank {r} {how}")
        # A rank killed by SIGTERM is torchrun's agent stopping the job after the death that caused it
        # (a rank it reached before that rank's collective failed): named only when no other is found.
        cause = next((f for f in found if "SIGTERM" not in f), None)
        last = time.monotonic() >= deadline
        if cause or (found and last):
            side.compare_set(GONE_KEY, "", cause or found[0])  # the first finder's answer is everyone's
            return side.get(GONE_KEY).decode()
        if last:
            return None
        time.sleep(0.05)


def _ended(state, code):
    if code is None:
        return "died (its process is gone)"
    return f"died (killed by {signal.Signals(code & 0x7F).name})" if code & 0x7F else f"died (exit code {code >> 8})"


def _lost_peer(error, side, rank, world, timeout_s):
    """The RankFailure of a rank whose collective lost a peer: the peer that is gone named first, with
    its last step, when it can be found (its process ended or stopped: seen from its host). A
    collective that timed out with no peer found gone: the rank it waited for, directly or in turn,
    named first from every rank's record on the side channel, as the local launcher's timeout report
    does (watch.lagged_peer), and said on the side channel for the ranks that then lose this one.
    torchrun's agent stops the surviving ranks meanwhile (SIGTERM, a tenth of a second after a
    death): the sentence is printed here, with SIGTERM held off while the peer is looked for."""
    from plumbing import watch as watching  # not at the top: watch imports nothing of ours but health
    caught = []
    try:
        previous = signal.signal(signal.SIGTERM, lambda *a: caught.append(1))
    except ValueError:  # not the main thread: looked for all the same
        previous = None
    try:
        timed_out = re.search(r"timed out|timeout", str(error), re.IGNORECASE) is not None
        dog = watching.first_look(side, world) if timed_out else None  # every record now, and again below
        try:
            gone = _gone_peer(side, rank) if side is not None else None
        except Exception:  # the side channel went away with the job: said without the peer's name
            gone = None
        culprit, said = watching.lagged_peer(dog, rank, timeout_s) if dog is not None and (
            not gone or " lagged " in gone) else (None, None)  # another timed-out rank's claim: this one's own report
        if said:
            if culprit is not None:  # the ranks whose collectives lose this one name the lagging rank
                try:
                    side.compare_set(GONE_KEY, "", f"rank {culprit} lagged (the timeout report above)")
                except Exception:
                    pass
            failure = RankFailure(f"{said}\n{_where(error)}")
            print(f"\nerror: {printable(failure)}", file=sys.stderr, flush=True)  # before the agent's SIGTERM
            failure.said = True
            return failure
        step = None
        if gone:
            from plumbing.watch import KEY  # the peer's last record, when the run is watched
            one = gone.split()[1] if gone.startswith("rank ") else None  # "rank 3 died ...", not "ranks [...]"
            try:
                key = KEY.format(one)
                step = json.loads(side.get(key)).get("step") if one and side.check([key]) else None
            except Exception:
                step = None
        if not gone:
            cause = (f"a collective failed because a peer rank is gone (its process or node died, or it failed) or "
                     f"did not answer within the {timeout_s:g} s timeout; the first rank to fail, in the launcher's "
                     f"log, has the cause.")
        elif " is stopped " in gone:
            cause = f"a collective failed because a peer rank did not answer within the {timeout_s:g} s timeout."
        elif " lagged " in gone:
            cause = "a collective failed because a peer rank is gone: it stopped when its wait for the lagging rank " \
                    "timed out."
        else:
            cause = "a collective failed because a peer rank is gone."
        failure = RankFailure((f"{gone}{'' if step is None else f' at step {step}'}; " if gone else "")
                              + f"rank {rank} of {world} stopped{' as its consequence' if gone else ''}: {cause}\n"
                              + _where(error))
        print(f"\nerror: {printable(failure)}", file=sys.stderr, flush=True)  # before the agent's SIGTERM ends it
        failure.said = True
        return failure
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if caught:  # the agent asked this rank to stop: now it does
            os.kill(os.getpid(), signal.SIGTERM)


def _join_launcher_group(rank, world, local_rank, timeout_s):
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(f"LOCAL_RANK={local_rank} but this node has {count} GPU(s): start at most "
                             f"{count} ranks per node (torchrun --nproc-per-node)")
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
        # device_id binds the group to this GPU: NCCL connects at once (a wrong GPU or a missing
        # peer shows here, not at the first collective), new groups split from it, and a barrier
        # need not guess the device.
        bind = dict(device_id=device)
    else:
        device, backend, bind = torch.device("cpu"), "gloo", {}
    # env:// reads MASTER_ADDR and MASTER_PORT from the launcher. Rank 0 hosts the rendezvous there
    # (or torchrun's agent does), and every other rank waits for it: looked for here first, so that
    # a missing rank 0 is said in a sentence (after 5 s, and at the timeout), not retried in silence.
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    hosted_elsewhere = rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if hosted_elsewhere and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        _wait_for_rendezvous(os.environ["MASTER_ADDR"].strip(), int(os.environ["MASTER_PORT"]), rank, world, timeout_s)
    try:
        # Under torchrun's agent store (its default), this attempt's keys under a prefix of their own
        # (_attempt_store); else env://, rank 0 hosting a fresh store.
        store = _attempt_store(timeout_s) if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                **(dict(store=store) if store is not None else {}), **bind)
    except (RuntimeError, ValueError) as e:  # torch's DistStoreError / DistNetworkError are RuntimeErrors
        lines = str(e).strip().splitlines()
        raise RankFailure(f"rank {rank} of {world} could not join the process group at {where} (MASTER_ADDR:"
                          f"MASTER_PORT) within {timeout_s:g} s: {lines[0] if lines else type(e).__name__}. Rank 0 "
                          f"(or torchrun's agent) hosts it there: is it running, with the same MASTER_ADDR, "
                          f"MASTER_PORT and WORLD_SIZE?") from None
    return RankEnv(rank, world, local_rank, device)


def _attempt_store(timeout_s=30.0):
    """A client of torchrun's agent store (MASTER_ADDR:MASTER_PORT), its keys under this attempt's
    own prefix. torchrun keeps one store for the whole job: after a restart (--max-restarts) it
    still holds the previous attempt's keys, among them every rank's gloo address, and a new rank
    that read a dead peer's address before the peer wrote its new one failed to connect
    ("Connection refused"; a plain torch script fails the same way). The prefix is torchrun's
    restart count (TORCHELASTIC_RESTART_COUNT)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"].strip(), int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(f"megatron-scratch/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _wait_for_rendezvous(addr, port, rank, world, timeout_s, say_after_s=5.0):
    """Return once something listens at addr:port, the rendezvous rank 0 (or torchrun's agent)
    hosts; say after say_after_s that this rank waits, and give up at timeout_s, naming the address."""
    start = time.monotonic()
    said = False
    while True:
        left = timeout_s - (time.monotonic() - start)
        try:
            with socket.create_connection((addr, port), timeout=max(0.05, min(1.0, left))):
                return
        except OSError as e:
            why = e.strerror or str(e)
        if left <= 0:
            raise RankFailure(f"rank {rank} of {world} found no rendezvous at {addr}:{port} (MASTER_ADDR:MASTER_PORT) "
                              f"within {timeout_s:g} s (--timeout-s): {why}. Rank 0, or torchrun's agent, hosts it "
                              f"there: was rank 0 started, with the same MASTER_ADDR and MASTER_PORT?")
        if not said and time.monotonic() - start >= say_after_s:
            print(f"rank {rank} of {world}: waiting for rank 0's rendezvous at {addr}:{port} (MASTER_ADDR:"
                  f"MASTER_PORT); giving up after {timeout_s:g} s (--timeout-s)", file=sys.stderr, flush=True)
            said = True
        time.sleep(min(0.1, max(left, 0)))


# What a collective raises when a peer is gone or silent: gloo raises RuntimeError, saying so in
# its message; NCCL and the c10d store raise DistError (their own timeouts included).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting",
             "timed out", "Broken pipe")


def _peer_lost(error):
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(text in str(error) for text in PEER_LOST))


def _stub_said(error):
    """For an exercise stub's NotImplementedError (its hint starts with the exercise, STUB_HINT): "reached
    the stub of exercise 01.2, ColumnParallelLinear.forward (01_tensor_parallel.py:161), which is not
    written yet: NotImplementedError: <the hint>", the place the student's file (relative to the working
    directory when inside it); None for any other."""
    message = " ".join(str(error).split())
    key = STUB_HINT.match(message)
    if not isinstance(error, NotImplementedError) or not key or error.__traceback__ is None:
        return None
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    code, path = tb.tb_frame.f_code, os.path.abspath(tb.tb_frame.f_code.co_filename)
    here = os.getcwd() + os.sep
    shown = path[len(here):] if path.startswith(here) else path
    return (f"reached the stub of exercise {key.group(1)}, {getattr(code, 'co_qualname', code.co_name)} "
            f"({shown}:{tb.tb_lineno}), which is not written yet: NotImplementedError: {message}")


def _where(error):
    """The error's first line and the innermost call outside torch that raised it: which collective
    of ours failed, without the whole traceback."""
    torch_dir, wrappers = os.path.dirname(torch.__file__), os.path.join(os.path.dirname(__file__), "watch.py")
    ours = [f for f in traceback.extract_tb(error.__traceback__)  # the watch's wrappers are not where: their caller is
            if not f.filename.startswith(torch_dir) and os.path.abspath(f.filename) != os.path.abspath(wrappers)]
    at = f" (at {os.path.basename(ours[-1].filename)}:{ours[-1].lineno}, in {ours[-1].name})" if ours else ""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}{at}: {lines[0] if lines else ''}"


def _die_with_parent(parent=None):
    """Linux: be killed (SIGKILL) when the process that started this one exits, as a rank dies with
    its node; elsewhere, nothing. If parent (its pid) is given and already gone, stop here: the
    signal would never come. (torchrun's agent's pid is not known to its ranks; a rank orphaned in
    the moment before this call is left to its collective timeout.)"""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        raise RankFailure(f"the process that started this rank (pid {parent}) is gone")


# ----------------------------------------------------------------------------------------------
# Without a launcher: fork nprocs CPU ranks here.


_warmed = False


def _warm_torch():
    """Import, once, what torch imports lazily at a process's first backward and first meta-device
    draw (sympy, its compiler's modules): done here, before the fork, every rank inherits it
    instead of spending a second or more of a shared core on it."""
    global _warmed
    if not _warmed:
        layer = torch.nn.Linear(2, 2)
        layer(torch.zeros(1, 2)).sum().backward()
        torch.empty(2, device="meta").normal_()
        _warmed = True


@dataclass
class Watch:
    """What the local launcher's watchdog needs: hang_s (0: no hang report) and where_is(rank), the
    rank's coordinates in words (05: "tp 1, dp 0, pp 1")."""
    hang_s: float
    where_is: object


def side_channel(timeout_s=30.0):
    """A new client of the launcher's key-value store, which no training process group uses (the
    watch's heartbeats go there): the local launcher's TCPStore, or under torchrun the one at
    MASTER_ADDR:MASTER_PORT (with torchrun's agent store, under this attempt's prefix: it outlives
    restarts). None when neither is known."""
    if _side is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ:
        return _attempt_store(timeout_s)  # this attempt's keys only: the store outlives restarts
    host, port = _side or (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


_side = None  # (host, port) of the local launcher's store, in a local rank
_nested = False  # this process runs a rank's worker: a launch() here is refused


def loopback_store(nprocs, timeout_s):
    """The local launcher's rendezvous store, listening on 127.0.0.1 only. TCPStore's own server
    binds the wildcard address whatever host it is given (every interface: a laptop's run would
    offer its unauthenticated key-value store to the network), so the socket is made and bound here
    and handed over (master_listen_fd, which the store then owns and closes). The port is the OS's
    choice: no free-port race. Any local process can still reach it: nothing is ever read from it as
    a path or a command (plumbing/watch.py)."""
    last = None
    for libuv in (True, False):  # libuv's server takes a listening fd from torch 2.4; the old one always did
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(max(128, 2 * nprocs))
            port = listener.getsockname()[1]
            return dist.TCPStore("127.0.0.1", port, nprocs, is_master=True, wait_for_workers=False,
                                 timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.detach(),
                                 use_libuv=libuv)
        except (RuntimeError, TypeError, ValueError) as e:
            last = e
        finally:
            listener.close()  # detached: a no-op; else the socket that could not be handed over
    raise RankFailure(f"the local launcher could not start its store on 127.0.0.1: {last}")


def loopback_interface():
    """The name of the loopback interface (Linux's lo, macOS's lo0), or None: the local ranks' gloo
    groups listen there (GLOO_SOCKET_IFNAME), not on the address the host name resolves to."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((n for n in names if n in ("lo", "lo0")), None)


def _launch_local(worker, nprocs, args, timeout_s, deadline_s, watch=None):
    _warm_torch()
    ctx = get_context("fork")  # fork: no re-import, closures work, start-up in milliseconds
    procs, pipes = [], []
    for rank in range(nprocs):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=_local_rank_main, name=f"rank{rank}", daemon=True,
                        args=(rank, nprocs, theirs, worker, args, timeout_s, os.getpid()))
        p.start()
        theirs.close()  # only the child holds its end, so ours reads EOF if the child dies
        procs.append(p)
        pipes.append(ours)
    # The rendezvous store is made after the forks (its server thread must not be forked) on a
    # port the OS picks, so there is no free-port race; the children learn the port by pipe.
    store = loopback_store(nprocs, timeout_s)
    for pipe in pipes:
        pipe.send(store.port)
    from plumbing import watch as watching  # not at the top: watch imports nothing of ours but health
    dog = watching.Watchdog(store, nprocs, watch.hang_s) if watch else None
    results, failures, interrupted, deaths, terminated, timed_out = {}, {}, {}, set(), False, {}
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    try:
        try:
            _collect(pipes, procs, results, failures, interrupted, deadline, deadline_s, deaths=deaths, dog=dog,
                     watch=watch, timeout_s=timeout_s, timed_out=timed_out if dog else None)
        except KeyboardInterrupt as e:  # Ctrl-C here (the terminal sends it to the ranks too), a kill -INT, or
            _on_interrupt(pipes, procs, results, failures, interrupted)  # a SIGTERM (run_main's Terminated)
            terminated = isinstance(e, Terminated)
    finally:
        stopped = [r for r, p in enumerate(procs) if p.is_alive() and r not in {**results, **failures, **interrupted}]
        for p in procs:
            if p.is_alive():
                p.terminate()
                os.kill(p.pid, signal.SIGCONT)  # a stopped rank cannot act on SIGTERM until it runs
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    steps = [rec.get("step") for rec in (dog.last(r) for r in range(nprocs)) if rec] if dog and failures else []
    # The store's server thread ends with its last reference: before any later fork (a restart), which
    # must not copy a process with it running. The traceback of a raise here keeps this frame's names.
    dog = None
    if interrupted:  # the first rank that said where it was: they stop at the same step
        said = next((m for m in interrupted.values() if m), "interrupted")
        raise Terminated(f"terminated (SIGTERM): {said}") if terminated else Interrupted(said)
    if failures and timed_out and not deaths and all(isinstance(r, int) and _peer_lost_text(t)
                                                     for r, t in failures.items()):
        # Every failure a lost peer, the first a timeout: the rank it waited for, from the records then.
        (rank, records), = timed_out.items()
        said = watching.timeout_report(records, nprocs, rank, watch.where_is, timeout_s)
        if said:
            failures = {"the run": said + "\n", **{r: t for r, t in failures.items() if r != rank}}
    if failures:
        failure = RankFailure(_failure_report(failures, deaths, stopped))
        failure.step = max((s for s in steps if s is not None), default=None)  # the furthest any rank got
        raise failure
    return [results[r] for r in range(nprocs)]


def _death(rank, code, dog):
    """What a rank's death looks like from here: its exit code or signal, and its last step."""
    how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
    record = dog.last(rank) if dog else None
    step = f" at step {record['step']}" if record and record.get("step") is not None else ""
    return f"rank {rank} died ({how}){step}\n"


def _failure_report(failures, deaths, stopped):
    """The cause first, then its victims. The cause is the earliest death, else the earliest error
    that is not a lost peer, else, when every failure is a lost peer, the ranks that were still
    running (the ones the others' collectives waited for), else the earliest report; the ranks whose
    collective failed because a peer was gone follow on one line, as its consequences."""
    lost = {r for r, text in failures.items() if isinstance(r, int) and r not in deaths and _peer_lost_text(text)}
    order = list(failures)
    first = next((r for r in order if r in deaths), None)
    first = first if first is not None else next((r for r in order if r not in lost), None)
    who = lambda r: r if isinstance(r, str) else f"rank {r}"  # noqa: E731
    if first is None and stopped:  # a hang outside communication, seen only at the collective timeout
        lines = [f"{_ranks_word(stopped)} hung: {'it was' if len(stopped) == 1 else 'they were'} still running, "
                 f"in no collective that failed, when every other rank's collective had timed out waiting for a "
                 f"peer or lost one; stopped after the failure"]
        victims = sorted(lost)
        lines.append(f"ranks {victims} failed as its consequences (a collective lost its peer): "
                     f"{failures[victims[0]].strip().splitlines()[-1]}")
        return "\n".join(lines)
    stubs = {r: t for r, t in failures.items() if isinstance(r, int) and r not in deaths and STUB_SAID.match(t)}
    if stubs and all(r in stubs or r in lost for r in order):
        return _stub_report(stubs, sorted(r for r in lost if r not in stubs), stopped)
    first = order[0] if first is None else first
    # A death, or the hang report ("the run"), names itself in its first line: that line is the cause.
    # A sentence (bad input, a file changed under the run: "ValueError: --data x.bin: ...") on the first
    # line, where the cause is read; a traceback below it.
    text = failures[first]
    lines = [text.strip() if first in deaths or isinstance(first, str) else f"{who(first)} failed: {text.strip()}"
             if not text.startswith("Traceback") and len(text.strip().splitlines()) == 1 else
             f"{who(first)} failed:\n{text}"]
    lines += [f"{who(r)} also failed: {failures[r].strip().splitlines()[-1]}"
              for r in order if r != first and r not in lost]
    victims = sorted(r for r in lost if r != first)
    if victims:
        lines.append(f"ranks {victims} then failed as its consequences (a collective lost its peer): "
                     f"{failures[victims[0]].strip().splitlines()[-1]}")
    if stopped:
        lines.append(f"stopped ranks {stopped} after the failure")
    return "\n".join(lines)


def _stub_report(stubs, victims, stopped):
    """Ranks that reached exercise stubs (and no other fault): one sentence per stub, the ranks that
    reached it named once, and what became of the rest (stopped, or their collective lost its peer) in
    it, before the hint: the hint, which ends with the check to run, is the end of the line."""
    by_text = {}
    for r, text in stubs.items():
        by_text.setdefault(text.strip(), []).append(r)
    others = sorted(set(victims) | set(stopped))
    lines = []

    def listed(r):
        return f"rank {r[0]}" if len(r) == 1 else f"ranks {', '.join(map(str, r[:-1]))} and {r[-1]}"

    for n, (text, ranks) in enumerate(by_text.items()):
        head, hint = text.split(", which is not written yet: ", 1)
        rest = f" ({listed(others)} stopped)" if others and n == len(by_text) - 1 else ""
        lines.append(f"{listed(sorted(ranks))} {head}, which is not written yet{rest}: {hint}")
    return "\n".join(lines)


JOIN_S = 30.0  # the least time local ranks are given to arrive at the rendezvous (_local_rank_main)
LOST_GRACE_S = 2.0  # while every failure is a lost peer: the time the others get to report theirs


def _ranks_word(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _peer_lost_text(text):
    last = text.strip().splitlines()[-1] if text.strip() else ""
    if STUB_SAID.match(last):  # a stub's hint is its own cause, whatever words it holds
        return False
    return any(phrase in last for phrase in PEER_LOST) or "DistError" in last or "DistNetworkError" in last


def _collect(pipes, procs, results, failures, interrupted, deadline, deadline_s, grace_s=1.0, deaths=None,
             dog=None, watch=None, timeout_s=None, timed_out=None):
    """Read each rank's report ("ok", "error" or "interrupted") as it comes; after the first
    failure wait grace_s for the others' own (longer while every failure is a lost peer: a rank
    that never fails is then the one they waited for), then stop. With a watchdog (dog) and
    watch.hang_s, look at the ranks' records a few times a second, and stop with the hang report
    when it has one. timeout_s: once a rank has returned, the others must return within it, as
    their last collective would have (under torchrun the ranks' closing barrier has that timeout);
    a rank still running then, outside any collective, is stopped and named. deaths: the ranks
    that died are added to it; timed_out (with a watchdog), {rank: every rank's record} when the first
    failure is a rank's timed-out collective, read at once, while its peers still wait where they did."""
    nprocs, hang_s, returned_at = len(procs), dog and watch.hang_s, None
    while len(results) + len(failures) + len(interrupted) < nprocs:
        if failures or interrupted:  # give the other ranks a moment to report their own, then stop them
            only_lost = not interrupted and not (deaths or set()) & set(failures) and all(
                isinstance(r, int) and _peer_lost_text(text) for r, text in failures.items())
            wait_s = max(grace_s, LOST_GRACE_S) if only_lost else grace_s
        else:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            if hang_s:
                wait_s = 0.3 if wait_s is None else min(wait_s, 0.3)
            if results and timeout_s is not None:
                returned_at = returned_at or time.monotonic()
                left = max(0.0, returned_at + timeout_s - time.monotonic())
                if left == 0:
                    running = [r for r in range(nprocs) if r not in results]
                    first = min(results, key=lambda r: r)
                    failures["the run"] = (f"{_ranks_word(running)} did not return within {timeout_s:g} s (the "
                                           f"launch's timeout, which bounds every collective) of rank {first}'s "
                                           f"return: still running outside any collective (an endless loop, or a "
                                           f"wait on something else)\n")
                    break
                wait_s = left if wait_s is None else min(wait_s, left)
        waiting = [pipes[r] for r in range(nprocs) if r not in results and r not in failures and r not in interrupted]
        ready = connection.wait(waiting, timeout=wait_s)
        if not ready:
            diagnosis = dog.check() if hang_s and not failures and not interrupted else None
            if diagnosis:
                from plumbing import watch as watching
                failures["the run"] = watching.describe(diagnosis, watch.where_is, watch.hang_s, dog.dump_dir)
                break
            if failures or interrupted or (deadline is not None and time.monotonic() >= deadline):
                if not failures and not interrupted:
                    failures["the run"] = f"the run passed its deadline of {deadline_s} s\n"
                break
            continue
        for pipe in ready:
            rank = pipes.index(pipe)
            try:
                status, payload = pickle.loads(pipe.recv_bytes())
            except EOFError:
                procs[rank].join(5)
                status, payload = "error", _death(rank, procs[rank].exitcode, dog)
                if deaths is not None:
                    deaths.add(rank)
            if status == "error" and timed_out is not None and not failures and "timed out" in payload.lower() \
                    and _peer_lost_text(payload):
                timed_out[rank] = dog.records()
            {"ok": results, "interrupted": interrupted}.get(status, failures)[rank] = payload


def _on_interrupt(pipes, procs, results, failures, interrupted):
    """Ctrl-C in the launching process: pass it on to every rank still running (each ignores a
    second one), give them two seconds to say where they were, and stop. Further Ctrl-Cs are
    ignored meanwhile, so that the stopping itself is not interrupted."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for r, p in enumerate(procs):
            if p.is_alive() and r not in results:
                try:
                    os.kill(p.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        _collect(pipes, procs, results, failures, interrupted, time.monotonic() + 2.0, 2.0, grace_s=2.0)
        interrupted.setdefault("the run", "")
    finally:
        signal.signal(signal.SIGINT, previous)


def _local_rank_main(rank, world, pipe, worker, args, timeout_s, parent):
    torch.set_num_threads(1)  # one thread per rank: ranks share the cores, as GPUs would not
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's terminate() still ends a rank
    # One Ctrl-C interrupts a rank once: the terminal sends it to the whole group and the launching
    # process passes it on, and a second one must not interrupt the first one's reporting.
    signal.signal(signal.SIGINT, _interrupt_once)
    code = 0
    try:
        _die_with_parent(parent)  # rather than linger until a timeout when the launching process dies
        global _side, _nested
        _nested = True  # a launch() in this rank's worker is refused (launch): it would fork from a rank
        os.environ[MODE_VARIABLE] = "local"  # a local rank, whatever RANK or WORLD_SIZE it inherited (launch_mode)
        loopback = loopback_interface()
        if loopback:  # every gloo group of this rank, the training's and the save's, listens on loopback only
            os.environ["GLOO_SOCKET_IFNAME"] = loopback
        _side = ("127.0.0.1", pipe.recv())
        # Arriving is not a collective: under load, 8 forked ranks can take longer than a short
        # --timeout-s to reach the rendezvous, so every rank waits for the others here for at least
        # JOIN_S (a rank that dies first is seen by the launcher at once); the group is then made,
        # and keeps, timeout_s (gloo's point-to-point waits keep the timeout it was made with).
        store = dist.TCPStore(*_side, world, is_master=False, timeout=timedelta(seconds=max(timeout_s, JOIN_S)))
        store.set(f"launch/arrived/{rank}", "1")
        store.wait([f"launch/arrived/{r}" for r in range(world)])
        store.set_timeout(timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        # Every rank's connections made before any rank goes on: one that returned (or failed) at
        # once and exited would close its side while a slower peer still connects to it, and that
        # peer would fail with "connection closed by peer", not with what happened.
        store.set(f"launch/ready/{rank}", "1")
        store.wait([f"launch/ready/{r}" for r in range(world)])
        result = worker(RankEnv(rank, world, rank, torch.device("cpu")), *args)
        pipe.send_bytes(_pickled_result(rank, worker, result))
        # And every rank's sockets kept open until every rank has returned (or the launcher stops
        # this one), for the same reason: a rank that returned at once (bad input found after a
        # new_group) would close its side of a group a slower peer is still connecting.
        store.set(f"launch/done/{rank}", "1")
        try:
            store.wait([f"launch/done/{r}" for r in range(world)], timedelta(seconds=timeout_s))
        except Exception:  # a peer that never returns: the launcher names it and stops this rank too
            pass
    except SENTENCES as e:  # bad input found on a rank: its sentence and where, not a traceback
        code = 1
        frame = traceback.extract_tb(e.__traceback__)[-1]
        pipe.send_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e} (raised at "
                                               f"{os.path.basename(frame.filename)}:{frame.lineno})\n")))
    except KeyboardInterrupt as e:  # Ctrl-C: where this rank was, if it knew (Interrupted)
        code = 1
        pipe.send_bytes(pickle.dumps(("interrupted", str(e) if isinstance(e, Interrupted) else "")))
    except NotImplementedError as e:  # an exercise's stub: which one and where, not a traceback
        code = 1
        said = _stub_said(e)
        pipe.send_bytes(pickle.dumps(("error", f"{said}\n" if said else traceback.format_exc())))
    except Exception as e:
        code = 1  # a collective that lost its peer or timed out: which of ours, in one line (the cause is elsewhere)
        pipe.send_bytes(pickle.dumps(("error", f"{_where(e)}\n" if _peer_lost(e) else traceback.format_exc())))
    except BaseException:  # report everything else, including SystemExit
        code = 1
        pipe.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown in a forked child


def _pickled_result(rank, worker, result):
    """("ok", result) pickled for the launching process, or a ValueError naming what in the result
    cannot be pickled (a lambda, an open file, a process group): the first such part, by its place."""
    try:
        return pickle.dumps(("ok", result))
    except Exception as e:
        where, what = unpicklable(result)
        raise ValueError(f"rank {rank}: the result of {getattr(worker, '__name__', 'the worker')} cannot be sent "
                         f"back to the launching process: {where} is {what}, which pickle cannot copy "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); return plain values "
                         f"(numbers, strings, tensors, lists and dicts of them)") from None


def unpicklable(obj, where="the result", depth=0):
    """(its place, what it is) of the first part of obj that pickle cannot copy: looked for inside
    lists, tuples, sets and dicts (keys and values), depth-first; obj itself when none is found."""
    if depth < 20 and isinstance(obj, (list, tuple, set, frozenset, dict)):
        items = [(f"{where} key {k!r}", k) for k in obj] + [(f"{where}[{k!r}]", v) for k, v in obj.items()] \
            if isinstance(obj, dict) else [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
        for place, item in items:
            try:
                pickle.dumps(item)
            except Exception:
                return unpicklable(item, place, depth + 1)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    return where, f"a {type(obj).__module__}.{type(obj).__qualname__}" + (f" ({name})" if isinstance(name, str) else "")


def _terminate_once(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: what follows is the stopping itself
    raise Terminated("terminated (SIGTERM)")


def _interrupt_once(signum, frame):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def printable(text):
    """A message with its control characters escaped (plumbing/paths.py): what a file or the side
    channel put in it prints as its escape and never acts on the terminal."""
    from plumbing.paths import printable as escaped
    return escaped(text)


def run_main(main):
    """Call main() and turn its result into the exit code: 0 if it returned True, else 1; 130 (the
    shell's code for Ctrl-C) with one line saying where it stopped, not a traceback, on Ctrl-C; 143
    likewise on a SIGTERM to the launching process (not under torchrun, whose agent sends its own)."""
    try:
        started_here = launch_mode() == "local"
    except ValueError:  # refused, in a sentence, by main()'s launch
        started_here = False
    if started_here and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate_once)
    try:
        ok = main()
    except (RankFailure, *SENTENCES) as e:  # a rank stopped mid-bar leaves its progress line open
        from plumbing.paths import release_claims
        release_claims()  # an output this refused run made at its checks, and never wrote, goes
        if getattr(e, "said", False):  # a rank that lost its peer under torchrun: said at once, and
            sys.stdout.flush()  # the watch's threads may be inside the store's C++ client, which an
            sys.stderr.flush()  # interpreter's teardown then aborts ("terminate called"): no teardown
            os._exit(1)
        print(f"{chr(10) if isinstance(e, RankFailure) else ''}error: {printable(e)}", file=sys.stderr)
        sys.exit(1)
    except NotImplementedError as e:  # an exercise's stub, reached here, before (or between) the launches
        said = _stub_said(e)
        if said is None:
            raise
        from plumbing.paths import release_claims
        release_claims()
        print(f"error: the run {printable(said)}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:
        print(f"\n{printable(e) if isinstance(e, Interrupted) and str(e) else 'interrupted'}", file=sys.stderr)
        sys.exit(143 if isinstance(e, Terminated) else 130)
    sys.exit(0 if ok else 1)


def new_tp_group(env, tp, timeout_s=60.0):
    """Split the world into blocks of tp consecutive ranks (on a GPU node: inside its NVLink
    domain); return this rank's block as a group. env comes from launch()."""
    if tp < 1 or tp > env.world_size or env.world_size % tp:
        raise ValueError(f"tp={tp} must be between 1 and the world size {env.world_size} and divide it")
    groups = [dist.new_group(list(range(s, s + tp)), timeout=timedelta(seconds=timeout_s))
              for s in range(0, env.world_size, tp)]
    return groups[env.rank // tp]


def printer(env, quiet=False):
    """print on rank 0 (unless quiet), nothing elsewhere: a demo's report is written once."""
    return print if env.rank == 0 and not quiet else (lambda *a, **k: None)


def gather_rows(mine, group=None):
    """Every rank's 1-D tensor (lengths may differ), in rank order, on every rank: the lengths
    first, then the tensors padded to the longest. Plain tensor collectives, not
    all_gather_object: that pickles through numpy (which the CPU wheel of torch does not install)
    and under NCCL needs a device of its own."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=mine.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], device=mine.device), group=group)
    padded = torch.cat([mine, mine.new_zeros(max(int(n) for n in sizes) - mine.numel())])
    rows = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(rows, padded, group=group)
    return [row[: int(n)] for row, n in zip(rows, sizes)]


def gather_numbers(values, group=None, device="cpu"):
    """Every rank's list of numbers, as float64: exact for any count below 2**53, and for
    perf_counter() times to the nanosecond for days."""
    mine = torch.tensor([float(x) for x in values], dtype=torch.float64, device=device)
    return [row.tolist() for row in gather_rows(mine, group)]


def gather_json(obj, group=None, device="cpu"):
    """Every rank's JSON-able object, as UTF-8 bytes in a uint8 tensor (05's --trace gathers its
    timelines so)."""
    mine = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    return [json.loads(bytes(row.tolist())) for row in gather_rows(mine, group)]
