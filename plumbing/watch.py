"""Watching a run as MegaScale does (Jiang et al. 2024, Sections 4 and 5): what each rank is doing,
kept where a hang cannot block it, so that when a rank is slow, stuck or dead the report names it
first. The ideas (who waits for whom; what makes a straggler) are pure functions in health.py.

    Recorder      this rank's record (plumbing/health.py's format): its step and phase, per process
                  group the collectives it entered and left and the one it is in, the peers of the
                  point-to-point exchange it waits in, and its busy time (the step minus its waits).
                  It wraps torch.distributed's collectives while the run lasts; nothing in the
                  numbered files calls it. On NCCL, whose collectives return before they complete,
                  it watches them on the GPU (CUDA events around each), not on the host.
    Heartbeat     a thread writing the record to the side channel (a key-value store apart from
                  every training process group: the launcher's TCPStore, its own client) every BEAT_S,
                  and this rank's Python stacks to a file when the watchdog asks
    Watchdog      reads every record; when no rank has made progress for hang_s while some rank
                  waits, diagnoses the hang (health.diagnose) and has every rank dump its stacks.
                  The local launcher runs one; under torchrun rank 0 does, and the last rank stands
                  in for it when rank 0 itself is silent
    Timeouts      a collective that timed out names the rank it waited for, directly or in turn, first
                  (timeout_report): the local launcher reads every record at once; under torchrun the
                  timed-out rank reads them itself, twice (lagged_peer), and tells its victims
    Faults        --rehearse-fault KIND:RANK:ARG, to see all this at work: slow:R:MS sleeps MS every
                  step, hang:R:STEP stops entering collectives, kill:R:STEP and stop:R:STEP send
                  SIGKILL and SIGSTOP to the rank itself
"""
import dataclasses
import faulthandler
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from plumbing import health

BEAT_S = 0.25  # how often a rank's record reaches the side channel
SILENT_S = 2.0  # a rank whose heartbeat has not changed for this long is silent (stopped, or stuck in C)
STALE_S = 4 * BEAT_S  # a record not rewritten for longer is not trusted for a diagnosis (until it is silent)
KEY = "watch/rank/{}"  # the side channel's keys: each rank's record, the watchdog's request for the
DUMP_KEY = "watch/dump"  # stacks (a number: no path is ever read from the store, which any local
STACK_KEY = "watch/stack/{}"  # process can reach), and each rank's stacks, as text
_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single",
                "reduce_scatter_single", "all_gather", "broadcast", "barrier", "monitored_barrier")
installed = None  # this process's Recorder while it is installed


# ----------------------------------------------------------------------------------------------
# This rank's record


class Recorder:
    """This rank's record, kept up to date by wrappers around torch.distributed's collectives.

    With gloo a collective returns when it has completed: the host waits inside the call, and the
    wrapper times the wait. NCCL (and any backend in ASYNC_BACKENDS) returns at once, having queued
    the collective on the device; the host waits later, wherever it first reads a result (the
    gradient norm's float(), the loss's), outside any wrapped call. There the wrapper puts a marker
    into the device's stream before and after each collective (a CUDA event): while the device has
    reached the first and not the second, this rank waits in that collective, and the time between
    the two is its wait. The heartbeat thread reads the markers, so the record says so while the
    host is blocked anywhere."""

    def __init__(self, rank, where_is=str):
        self.rank, self.where_is, self.lock = rank, where_is, threading.Lock()
        self.step, self.phase, self.groups, self.waiting_for, self.progress = None, "start", {}, [], 0
        self.blocked_s, self.step_start, self.busy_ms = 0.0, None, []  # busy_ms: one entry per step
        self.names, self.originals, self.marker_of = {}, {}, {}
        self.queued = []  # asynchronous backends: [_Queued], in the order the device runs them
        self.failed = None  # what this rank waited in when a collective or exchange raised (_fail)

    def install(self):
        global installed
        installed = self  # this process's recorder: the launcher asks it what a failed rank waited in
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                self.originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self.originals[name]))
        self.originals["batch_isend_irecv"] = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._wrap_p2p(dist.batch_isend_irecv)
        return self

    def uninstall(self):
        global installed
        for name, fn in self.originals.items():
            setattr(dist, name, fn)
        self.originals = {}
        if installed is self:
            installed = None

    def record(self):
        with self.lock:
            self._poll()
            groups = {g: list(v) for g, v in self.groups.items()}
            waiting_for = list(self.waiting_for)
            head = self.queued[0] if self.queued else None
            if head and head.before.done():  # the device has reached it: this rank waits in it
                if head.peers is None:
                    groups[head.group][2] = head.op
                else:
                    waiting_for = list(head.peers)
            return dict(step=self.step, phase=self.phase, groups=groups, waiting_for=waiting_for, state="running",
                        progress=self.progress, **({"failed": self.failed} if self.failed else {}))

    def set_phase(self, phase, step=None):
        with self.lock:
            self.phase, self.progress = phase, self.progress + 1
            if step is not None:
                self.step = step

    def begin_step(self, step):
        self.set_phase("training", step)
        with self.lock:
            self.step_start, self.blocked_s = time.perf_counter(), 0.0
        self.on_step()  # the heartbeat writes the record now: a rank dying in this step is seen in it

    def on_step(self):
        pass

    def end_step(self):
        with self.lock:
            self._poll()
            if self.step_start is not None:
                self.busy_ms.append(1e3 * (time.perf_counter() - self.step_start - self.blocked_s))
                self.step_start = None

    def _group(self, group):
        name = self.names.get(group)
        if name is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            name = self.names[group] = ",".join(map(str, ranks))
        return name

    def _markers(self, group):
        """The marker factory of the group's backend when its collectives return before they complete
        (ASYNC_BACKENDS), else None."""
        if group not in self.marker_of:
            try:
                backend = str(dist.get_backend(group)).lower()
            except Exception:  # not a group torch knows: treated as blocking
                backend = ""
            self.marker_of[group] = ASYNC_BACKENDS.get(backend)
        return self.marker_of[group]

    def _enter(self, group, op):
        with self.lock:
            entry = self.groups.setdefault(self._group(group), [0, 0, None])
            entry[0] += 1
            self.progress += 1
            return entry

    def _block(self, entry, op):  # waiting in a collective: the entry's next one to complete
        with self.lock:
            entry[2] = op
        return time.perf_counter()

    def _leave(self, entry, started):
        with self.lock:
            entry[1], entry[2], self.progress = entry[1] + 1, None, self.progress + 1
            self.blocked_s += time.perf_counter() - started

    def _fail(self, entry=None, group=None, peers=None):
        """A collective or exchange that raised (its timeout, a lost peer): what this rank waited in then,
        kept in its record as `failed` ({"groups": {group: entry}} or {"waiting_for": peers}, the record's
        own fields as they were), and written at once, before the error reaches the launcher, which reads
        from it whom a timed-out rank waited for (timeout_report)."""
        with self.lock:
            self.failed = {"groups": {group: list(entry)}} if entry is not None else {"waiting_for": list(peers)}
        self.on_step()

    def note_failure(self):
        """An error reached the launcher (a timeout, a lost peer) and no wrapped call kept `failed`: on an
        asynchronous backend the host meets the error outside them, where it reads a result (NCCL's
        timeout or abort). What the device waited in then, the queue's head (begun, not ended), is kept
        as `failed`, in the same form as _fail's, and written at once; nothing when the device waited in
        nothing. Returns `failed`."""
        with self.lock:
            self._poll()
            head = self.queued[0] if self.queued else None
            if self.failed is not None or head is None or not head.before.done():
                return self.failed
            if head.peers is None:
                entry = self.groups.get(head.group) or [0, 0, None]
                self.failed = {"groups": {head.group: [entry[0], entry[1], head.op]}}
            else:
                self.failed = {"waiting_for": list(head.peers)}
        self.on_step()
        return self.failed

    def _queue(self, markers, call, group=None, op=None, peers=None):
        """Run call() (which queues a collective, or the stream's wait for one, and returns at once)
        between two markers, kept until the device has passed the second. A factory gives no marker
        where none can be put (a CUDA graph being captured: its collectives run at replay, unwatched)."""
        before = markers()
        if before is None:
            try:
                return call()
            finally:
                with self.lock:
                    if peers is None:
                        self.groups[group][1] += 1
                    self.progress += 1
        try:
            return call()
        except Exception:  # raised while queueing (an aborted communicator): what it was queueing
            self._fail(self.groups.get(group, [0, 0, None])[:2] + [op] if peers is None else None, group, peers)
            raise
        finally:
            with self.lock:
                self.queued.append(_Queued(before, markers(), group, op, peers))

    def _poll(self):  # under the lock: what the device has completed, in its order
        while self.queued and self.queued[0].after.done():
            q = self.queued.pop(0)
            if q.peers is None:
                self.groups[q.group][1] += 1
            self.progress += 1
            self.blocked_s += q.before.seconds_to(q.after)

    def _wrap(self, name, fn):
        def collective(*args, **kwargs):
            group = kwargs.get("group")
            entry = self._enter(group, name)
            markers = self._markers(group)
            if markers is not None:  # queued on the device: watched there
                where = self._group(group)
                if kwargs.get("async_op"):  # queued now; the stream waits for it at wait()
                    def wait(work, *a):
                        return self._queue(markers, lambda: work.wait(*a), where, name)
                    return _Work(fn(*args, **kwargs), wait=wait)
                return self._queue(markers, lambda: fn(*args, **kwargs), where, name)
            where = self._group(group)
            if kwargs.get("async_op"):
                return _Work(fn(*args, **kwargs), lambda: self._block(entry, name), lambda t: self._leave(entry, t),
                             fail=lambda: self._fail(entry, where))
            started = self._block(entry, name)
            try:
                return fn(*args, **kwargs)
            except Exception:
                self._fail(entry, where)
                raise
            finally:
                self._leave(entry, started)
        return collective

    def _wrap_p2p(self, fn):
        def batch(ops):
            works, peers = fn(ops), [op.peer for op in ops]
            markers = self._markers(getattr(ops[0], "group", None)) if ops else None
            if markers is not None:
                return [_Work(w, wait=lambda w, *a, p=p: self._queue(markers, lambda: w.wait(*a), peers=[p]))
                        for w, p in zip(works, peers)]
            return [_Work(w, lambda p=p: self._wait_on(p), self._waited, fail=lambda p=p: self._fail(peers=[p]))
                    for w, p in zip(works, peers)]
        return batch

    def _wait_on(self, peer):
        with self.lock:
            self.waiting_for = [peer]
        return time.perf_counter()

    def _waited(self, started):
        with self.lock:
            self.waiting_for, self.progress = [], self.progress + 1
            self.blocked_s += time.perf_counter() - started


@dataclasses.dataclass
class _Queued:
    """A collective (group, op), or a wait for point-to-point peers, between two device markers."""
    before: object
    after: object
    group: str | None
    op: str | None
    peers: list | None


class _CudaMarker:
    """A point in the current CUDA stream's work: done once the device has passed it."""

    def __init__(self):
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def done(self):
        return self.event.query()

    def seconds_to(self, later):
        return self.event.elapsed_time(later.event) / 1e3


def _cuda_marker():
    return None if torch.cuda.is_current_stream_capturing() else _CudaMarker()


# Backends whose collectives return before they complete, and how to mark a point in the device's
# work: a factory of objects with done() and seconds_to(later marker). A backend added here is
# watched on the device (tests/test_watch.py adds a CPU one whose collectives return at once).
ASYNC_BACKENDS = {"nccl": _cuda_marker}


class _Work:
    """An async collective's or a point-to-point op's work, whose wait() is recorded: between
    before() and after(started) (a blocking backend; fail() first if it raises), or by
    wait(work, *args) itself."""

    def __init__(self, work, before=None, after=None, wait=None, fail=None):
        self.work, self.before, self.after, self.waiting, self.fail = work, before, after, wait, fail

    def wait(self, *args):
        if self.waiting is not None:
            return self.waiting(self.work, *args)
        started = self.before()
        try:
            return self.work.wait(*args)
        except Exception:
            if self.fail is not None:
                self.fail()
            raise
        finally:
            self.after(started)

    def __getattr__(self, name):
        return getattr(self.work, name)


# ----------------------------------------------------------------------------------------------
# The side channel: each rank's heartbeat, and the watchdog that reads them


class Heartbeat(threading.Thread):
    """Writes the recorder's record to the store every BEAT_S (with a beat count, so that a rank that
    stops answering shows), and dumps this rank's Python stacks into the file the watchdog names."""

    def __init__(self, store, recorder):
        super().__init__(daemon=True, name="heartbeat")
        self.store, self.recorder, self.beat, self.stopped = store, recorder, 0, threading.Event()
        self.lock = threading.Lock()  # one store client, two callers: this thread and the step's start
        recorder.on_step = self.write

    def write(self):
        with self.lock:
            self.beat += 1
            try:
                self.store.set(KEY.format(self.recorder.rank), json.dumps({**self.recorder.record(), "beat": self.beat}))
            except Exception:  # the store went away with the job; training is not the watch's to stop
                self.stopped.set()

    def run(self):
        asked = None
        while not self.stopped.wait(BEAT_S):
            self.write()
            try:
                with self.lock:
                    request = self.store.get(DUMP_KEY) if self.store.check([DUMP_KEY]) else asked
                if request != asked:  # its value is a request's number, never a place: read for nothing else
                    asked = request
                    stacks = own_stacks()
                    with self.lock:
                        self.store.set(STACK_KEY.format(self.recorder.rank), stacks)
            except Exception:  # the store went away with the job: nothing left to watch
                return


def own_stacks():
    """This process's Python stacks, as text: faulthandler writes them to a file of its own, which
    no other process can name (an unlinked temporary file), and they are read back from it."""
    with tempfile.TemporaryFile() as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()


def write_new(path, data):
    """Write data to a new file at path: created here (O_EXCL, so never a file or a link that was
    there), readable by its owner only, and never through a link (O_NOFOLLOW)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class Watchdog:
    """Reads every rank's record from the store (call check() every few tenths of a second). When
    no rank has made progress for hang_s while some rank waits in communication, it diagnoses the
    hang (health.diagnose), asks every rank for its stacks, writes them into a directory of its own
    (dump_dir: made then by tempfile.mkdtemp under parent, the temporary directory unless given:
    private, and a name no other process can have planted) and returns the report; else None. A
    rank whose heartbeat stopped for SILENT_S is silent. The ranks send their stacks as text through
    the store: they never take a path from it, since any process on the host can set its keys."""

    def __init__(self, store, world, hang_s, parent=None):
        self.store, self.world, self.hang_s, self.parent = store, world, hang_s, parent
        self.dump_dir, self.asked = None, 0
        self.seen = {}  # rank -> (beat, progress, when the beat last changed, when progress did)

    def records(self):
        now, out = time.monotonic(), {}
        for r in range(self.world):
            key = KEY.format(r)
            if not self.store.check([key]):
                continue
            rec = _record(self.store.get(key))
            if rec is None:  # not a heartbeat's record (the store is open to every local process): not trusted
                continue
            beat, progress, beat_at, progress_at = self.seen.get(r, (None, None, now, now))
            if rec["beat"] != beat:
                beat_at = now
            if rec["progress"] != progress:
                progress_at = now
            self.seen[r] = (rec["beat"], rec["progress"], beat_at, progress_at)
            rec["quiet_s"] = now - progress_at
            if now - beat_at > SILENT_S:
                rec["state"] = "silent"
            out[r] = rec
        return out

    def last(self, rank):
        """The rank's last record, or None."""
        key = KEY.format(rank)
        return _record(self.store.get(key)) if self.store.check([key]) else None

    def check(self, acting=None):
        """The diagnosis of a hang, its stacks written; else None. acting(records): whether to report
        one (a deputy reports only when the watchdog it stands in for is silent)."""
        records = self.records()
        if len(self.seen) < self.world or any(rec.get("phase", "").startswith("save") for rec in records.values()):
            return None  # some rank has not started yet, or a save is under way (it has its own timeout)
        now = time.monotonic()
        if min(now - progress_at for _, _, _, progress_at in self.seen.values()) < self.hang_s:
            return None
        if any(STALE_S < now - beat_at <= SILENT_S for _, _, beat_at, _ in self.seen.values()):
            return None  # a record not rewritten lately (its heartbeat starved of the CPU) may be old news:
            # wait for it, or for the rank to turn silent
        diagnosis = health.diagnose(records, self.world)
        if diagnosis.kind == "none" or (acting is not None and not acting(records)):
            return None  # every rank computing for long: slow, not stuck
        self.asked += 1
        self.store.set(DUMP_KEY, str(self.asked))
        deadline = time.monotonic() + 3 * BEAT_S + 1.0
        alive = [r for r, rec in records.items() if rec.get("state") == "running"]
        while time.monotonic() < deadline and not self.store.check([STACK_KEY.format(r) for r in alive]):
            time.sleep(0.05)
        written = self._write_stacks()
        diagnosis.stacks = None if len(written) == self.world else written  # None: every rank's
        return diagnosis

    def _write_stacks(self):
        """The stacks the ranks sent, each written as rank<N>.txt into this watchdog's own new
        directory; returns the ranks written."""
        written = [r for r in range(self.world) if self.store.check([STACK_KEY.format(r)])]
        if written:
            parent = self.parent or tempfile.gettempdir()
            os.makedirs(parent, exist_ok=True)
            self.dump_dir = tempfile.mkdtemp(prefix="hang-", dir=parent)
            for r in written:
                write_new(os.path.join(self.dump_dir, f"rank{r}.txt"), self.store.get(STACK_KEY.format(r)))
        return written


def _record(raw):
    """A heartbeat's record from the store's bytes, or None when it is not one (the fields health
    reads, of their types)."""
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    ok = isinstance(rec, dict) and isinstance(rec.get("beat"), int) and isinstance(rec.get("progress"), int) \
        and isinstance(rec.get("groups", {}), dict) and isinstance(rec.get("waiting_for", []), list) \
        and (rec.get("step") is None or isinstance(rec.get("step"), int))
    return rec if ok else None


def describe(diagnosis, grid_of, hang_s, dump_dir):
    """The hang report's sentence: the culprit's coordinates first, then what the others wait in."""
    who = ", ".join(f"rank {r} ({grid_of(r)})" for r in diagnosis.culprits)
    written = diagnosis.stacks  # None: every rank's
    stacks = "Every rank's Python stack" if written is None else \
        f"The Python stack{'' if len(written) == 1 else 's'} of {'rank' if len(written) == 1 else 'ranks'} " \
        f"{', '.join(map(str, written))} (the others wrote none in time)" if written else None
    return (f"hang: no rank made progress for {hang_s:g} s. {who}: {diagnosis.why}"
            + (f", at step {diagnosis.step}" if diagnosis.step is not None and diagnosis.kind != "cycle" else "")
            + (f". {stacks}: {dump_dir}/rank<N>.txt" if stacks else ". No rank wrote its Python stack in time"))


def timeout_report(records, world, rank, where_is, timeout_s):
    """The sentence for a rank whose collective or exchange timed out, from every rank's record at that
    moment (the timed-out rank's `failed`, what it waited in): the rank it waited for, directly or in
    turn, first (the one at the end of who waits for whom: not in any collective, dead or silent; of
    several, dead or silent first, then the quietest), then the wait that timed out; None when the
    records do not say what it waited in. A rank slowed or stalled for longer than the timeout, which
    the hang report did not catch first (--hang-s off, or a loaded machine's late heartbeats), is
    named so, not as its victim's failure. Another rank whose wait failed too (its `failed`) is taken
    to wait there still, though it may have ended since: a victim, never the end."""
    return _timeout_finding(records, world, rank, where_is, timeout_s)[1]


def _timeout_finding(records, world, rank, where_is, timeout_s):
    """(the rank timeout_report names first, or None where it names none; its sentence, or None)."""
    failed = (records.get(rank) or {}).get("failed")
    if not _failed_ok(failed):
        return None, None
    records = {r: dict(records.get(r) or {"state": "silent"}) for r in range(world)}
    for r, rec in records.items():  # each rank whose wait failed, as it was then: in that wait
        theirs = rec.get("failed")
        if _failed_ok(theirs):
            rec["groups"] = {**(rec.get("groups") or {}), **(theirs.get("groups") or {})}
            rec["waiting_for"], rec["state"] = list(theirs.get("waiting_for") or []), "running"
    group, op = next(((g, e[2]) for g, e in (failed.get("groups") or {}).items()), ("", ""))
    edges = health.waits_for(records)
    waited = sorted(edges.get(rank) or [])
    if not waited:
        return None, None
    what = f"{op} on group [{group}]" if op else "point-to-point exchange with " + _ranks_text(waited)
    timed_out = f"rank {rank}'s {what} timed out after {timeout_s:g} s (the launch's timeout, which bounds " \
                f"every collective)"

    def worst(qs):  # dead or silent first, then the one quiet longest, then the lowest
        return min(qs, key=lambda q: (records[q].get("state", "running").startswith("running"),
                                      -records[q].get("quiet_s", 0.0), q))

    path, r = [rank], worst(waited)
    while edges.get(r) and r not in path:
        path.append(r)
        r = worst(edges[r])
    if r in path:  # back to a rank already passed: a cycle, or records out of date; no end to name
        return None, f"{timed_out}, waiting for {_ranks_text(waited)} ({', '.join(where_is(q) for q in waited)}), " \
                     f"which waited in turn for ranks already waiting (a cycle of waits, or records out of date)"
    how = health.state_of(records[r])[1]
    through = f" through {_ranks_text(path[1:])}" if len(path) > 1 else ""
    return r, f"rank {r} ({where_is(r)}) lagged: it {how}, and {timed_out}, waiting for it{through}"


def _failed_ok(failed):
    """Whether a record's `failed` is as _fail writes it (the store is open to every local process)."""
    if not isinstance(failed, dict):
        return False
    groups, peers = failed.get("groups") or {}, failed.get("waiting_for") or []
    return isinstance(groups, dict) and isinstance(peers, list) and all(isinstance(q, int) for q in peers) and all(
        isinstance(g, str) and all(q.isdigit() for q in g.split(",")) and isinstance(e, list) and len(e) == 3
        and all(isinstance(n, int) for n in e[:2]) for g, e in groups.items())


def first_look(store, world):
    """Under torchrun, for a rank whose collective timed out: a Watchdog that has read every rank's
    record once, the first of the two reads lagged_peer compares (None without a side channel or
    when it cannot be read)."""
    if store is None:
        return None
    try:
        dog = Watchdog(store, world, 0)
        dog.records()
        dog.first_at = time.monotonic()
        return dog
    except Exception:  # the side channel went away with the job
        return None


def lagged_peer(dog, rank, timeout_s):
    """Under torchrun, what the local launcher's timeout report says (timeout_report) of this rank's
    timed-out collective: (the rank named first, its sentence), from every rank's record read a second
    time more than SILENT_S after dog's first read (first_look), so that a rank whose heartbeat stopped
    meanwhile is silent, and from this rank's own `failed` (the installed recorder's, kept on an
    asynchronous backend by note_failure). (None, None) when there are no records, they do not say
    what this rank waited in, or they cannot be read: the caller's own sentence then."""
    if dog is None:
        return None, None
    try:
        mine = installed if installed is not None and installed.rank == rank else None
        failed = mine.note_failure() if mine is not None else None
        left = dog.first_at + SILENT_S + BEAT_S - time.monotonic()
        if left > 0:
            time.sleep(left)
        records = dog.records()
        if failed and rank in records and not records[rank].get("failed"):
            records[rank]["failed"] = failed  # its heartbeat had not written it yet
        where_is = mine.where_is if mine is not None else str
        return _timeout_finding(records, dog.world, rank, where_is, timeout_s)
    except Exception:  # the side channel went away with the job, or a record not as written
        return None, None


def _ranks_text(qs):
    return f"rank {qs[0]}" if len(qs) == 1 else f"ranks {qs}"


def start(env, store, recorder, hang_s, launched):
    """This rank's heartbeat, when there is a side channel (store), and under torchrun (launched) the
    watchdog threads, which report a hang and end the job themselves (the local launcher runs its
    own): rank 0's, and its deputy on the last rank, which reports only when rank 0 itself is silent
    (stopped, or stuck in C code). Returns what stop() needs."""
    if store is None:
        return None
    threads = [Heartbeat(store, recorder)]
    if launched and hang_s and env.rank in (0, env.world_size - 1):
        threads.append(_WatchdogThread(env.world_size, hang_s, recorder.where_is, deputy=env.rank != 0))
    for t in threads:
        t.start()
    return threads


def stop(threads, recorder):
    recorder.uninstall()
    for t in threads or []:
        t.stopped.set()
    for t in threads or []:
        t.join(2 * BEAT_S)


class _WatchdogThread(threading.Thread):
    def __init__(self, world, hang_s, where_is, deputy=False):
        from plumbing.launch import side_channel  # its own client: one per thread
        super().__init__(daemon=True, name="watchdog")
        # The stacks go where the local launcher's go: a new temporary directory, not the working one
        # (often a checkout).
        self.dog = Watchdog(side_channel(), world, hang_s)
        self.where_is, self.stopped, self.deputy = where_is, threading.Event(), deputy

    def run(self):
        acting = (lambda records: (records.get(0) or {}).get("state") == "silent") if self.deputy else None
        while not self.stopped.wait(0.5):
            try:
                diagnosis = self.dog.check(acting)
            except Exception:
                return
            if diagnosis:
                from plumbing.paths import printable  # the records' phases came through the store
                print(f"\nerror: {printable(describe(diagnosis, self.where_is, self.dog.hang_s, self.dog.dump_dir))}",
                      file=sys.stderr, flush=True)
                _claim(self.dog.store, diagnosis)
                _end_stopped(self.dog.store, diagnosis.culprits)
                os._exit(1)  # torchrun's agent then stops every other rank


def _claim(store, diagnosis):
    """Say on the side channel that the hang's culprit is the cause: the ranks whose collective loses
    this rank when it ends the job name the culprit first, not this rank."""
    from plumbing.launch import GONE_KEY
    culprits = diagnosis.culprits
    who = f"rank {culprits[0]}" if len(culprits) == 1 else f"ranks {culprits}"
    try:
        store.compare_set(GONE_KEY, "", f"{who} hung (the hang report above)")
    except Exception:
        pass


def _end_stopped(store, ranks):
    """End the stopped ranks among these on this host (SIGTERM, then SIGCONT so that it is acted on),
    as the local launcher does: torchrun's agent sends its SIGTERM too, but a stopped process acts on
    it only when continued, and the agent waits 30 s before its SIGKILL."""
    from plumbing.launch import HOST_KEY, _process
    try:
        key = HOST_KEY.format(socket.gethostname())
        entries = [e.split(":") for e in store.get(key).decode().split(";") if e.count(":") == 2] \
            if store.check([key]) else []
        for r, pid, started in entries:
            state, _, now = _process(int(pid))
            if int(r) in ranks and now == started and state in ("T", "t"):
                os.kill(int(pid), signal.SIGTERM)
                os.kill(int(pid), signal.SIGCONT)
    except Exception:  # the job ends all the same, its agent's SIGKILL the later
        pass


# ----------------------------------------------------------------------------------------------
# 05's use of all this: its flags, the straggler report, restarts


def hang_seconds(tc):
    """--hang-s, or when unset half of --timeout-s: the report comes well before the timeout. Never
    below 1 s, the least --hang-s itself may be (below it a healthy run's ordinary waits look hung):
    1 s for a --timeout-s below 2 s, and off for --timeout-s 1, which it cannot come before."""
    if not tc.watch:
        return 0
    if tc.hang_s is not None:
        return tc.hang_s
    return max(tc.timeout_s / 2, MIN_HANG_S) if tc.timeout_s > MIN_HANG_S else 0


MIN_HANG_S = 1.0


def coords(rank, tc):
    """A rank's coordinates in words, from its place in the rank grid: the layout's sizes in order,
    the first fastest (05's: tp, then dp, then pp; plumbing.checks.layout_sizes)."""
    from plumbing.checks import layout_sizes
    out = []
    for name, n in layout_sizes(tc):
        out.append(f"{name} {rank % n}")
        rank //= n
    return ", ".join(out)


def launcher_watch(tc):
    """What the local launcher watches a 05 run with."""
    from plumbing.launch import Watch
    return Watch(hang_seconds(tc), lambda r: coords(r, tc))


def gather_busy(env, recorder, last):
    """Every rank's median busy ms over its last `last` steps, in rank order (a collective: every rank)."""
    from plumbing.launch import gather_numbers
    return [row[0] for row in gather_numbers([median_busy(recorder, last)], device=env.device)]


def report_stragglers(env, tc, recorder, last, say, final=False, busy=None):
    """Every rank's median busy ms over its last `last` steps (gathered here unless given as busy),
    and on rank 0 the stragglers among them named (health.stragglers); final: and the heat map of
    the whole run. Returns the list."""
    busy = gather_busy(env, recorder, last) if busy is None else busy
    if env.rank == 0:
        stage_of = {r: r // (env.world_size // tc.pp) for r in range(env.world_size)}  # pp is the slowest size
        for r in health.stragglers(dict(enumerate(busy)), stage_of):
            others = [b for q, b in enumerate(busy) if stage_of[q] == stage_of[r] and q != r]
            say(f"straggler: rank {r} ({coords(r, tc)}) is busy {busy[r]:.1f} ms a step, against "
                f"{statistics.median(others):.1f} ms for the other ranks of its stage (median of the last {last} steps)")
        if final:
            say(health.heat_map(dict(enumerate(busy)), tc.tp, env.world_size // (tc.tp * tc.pp), tc.pp))
    return busy


def with_restarts(launch_run, tc, grid):
    """launch_run(tc), and when a rank dies or hangs (a RankFailure) and --restarts allows: the
    launcher has stopped the rest; check every rank and group again (--self-check), then resume from
    the newest of --snapshot-dir and --save, saying how many finished steps were lost. MegaScale,
    Section 4.1, in the small. Faults rehearsed with --rehearse-fault happen in the first attempt only.
    grid: the layout's groups, for the self-check."""
    from plumbing import selfcheck
    from plumbing.checkpoint import newest_checkpoint, read_manifest
    from plumbing.launch import RankFailure, launcher_ranks
    ranks = launcher_ranks()
    if tc.restarts and ranks:
        raise ValueError(f"--restarts {tc.restarts} restarts the ranks this script starts itself; under torchrun "
                         f"(this is rank {ranks[0]} of {ranks[1]}) torchrun starts them: give torchrun --max-restarts "
                         f"{tc.restarts} instead (a restarted rank resumes from the newest of --snapshot-dir and "
                         f"--save), or drop --restarts")
    for attempt in range(tc.restarts + 1):
        try:
            return bool(launch_run(tc))
        except RankFailure as failure:
            if attempt == tc.restarts or launcher_ranks():
                raise
            newest = newest_checkpoint(tc.snapshot_dir, tc.save)
            done, reached = read_manifest(newest)["step"] if newest else 0, getattr(failure, "step", None)
            lost = "the steps since then are lost" if reached is None else "no finished step is lost" \
                if reached <= done else f"{reached - done} finished step(s) lost: steps {done} to {reached - 1} run again"
            lines = str(failure).splitlines() or [""]
            headline = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]  # "rank 2 failed:" says no cause
            from plumbing.paths import printable
            headline = printable(headline)
            print(f"\n{headline}\nrestart {attempt + 1} of {tc.restarts}: resuming from {newest or 'the start'} at "
                  f"step {done}; {lost}", file=sys.stderr, flush=True)
            # Its outputs are this run's own now (overwrite), and the faults were the first attempt's,
            tc = dataclasses.replace(tc, resume=newest or "", rehearse_fault=[], overwrite=True)  # self-check's too:
            selfcheck.run(tc, grid, "not restarting: ")  # it would act a rehearsed hang or slow rank out again


# ----------------------------------------------------------------------------------------------
# Rehearsing faults


FAULT_KINDS = {"slow": "MS", "hang": "STEP", "kill": "STEP", "stop": "STEP"}


def parse_faults(specs, world=None, steps=None):
    """[(kind, rank, arg)] from --rehearse-fault values KIND:RANK:ARG; a ValueError naming the flag,
    the value and the rule otherwise. world: ranks must be below it; steps: a fault's STEP too (a
    step the run never reaches rehearses nothing)."""
    out = []
    for spec in specs or []:
        parts = str(spec).split(":")
        ok = len(parts) == 3 and parts[0] in FAULT_KINDS and all(p.strip().isdigit() for p in parts[1:])
        if not ok:
            raise ValueError(f"--rehearse-fault {spec!r} must be KIND:RANK:ARG with KIND one of "
                             f"{', '.join(f'{k} (ARG: {a})' for k, a in FAULT_KINDS.items())}, RANK and ARG "
                             f"whole numbers, e.g. kill:5:3")
        kind, rank, arg = parts[0], int(parts[1]), int(parts[2])
        if world is not None and rank >= world:
            raise ValueError(f"--rehearse-fault {spec!r}: rank {rank} is not below the world size {world}")
        if steps is not None and FAULT_KINDS[kind] == "STEP" and arg >= steps:
            raise ValueError(f"--rehearse-fault {spec!r}: step {arg} is not below --steps {steps} (steps count "
                             f"from 0), so the fault would never happen")
        out.append((kind, rank, arg))
    return out


def rehearse(faults, rank, step, recorder=None):
    """Act out this rank's faults at the start of `step`."""
    for kind, r, arg in faults:
        if r != rank:
            continue
        if kind == "slow":
            time.sleep(arg / 1e3)
        elif step == arg and kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif step == arg and kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif step == arg and kind == "hang":
            if recorder:
                recorder.set_phase(f"rehearsed hang at step {step}")
            while True:  # alive, answering, and entering no collective: the line its stack shows
                time.sleep(0.1)


def median_busy(recorder, last):
    """This rank's median busy ms over its last `last` steps (0 with none)."""
    window = recorder.busy_ms[-last:]
    return statistics.median(window) if window else 0.0
