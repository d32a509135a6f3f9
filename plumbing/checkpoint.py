"""Checkpoints: sharded, atomic, durable, bit-identical on resume, and loadable in any other layout.

    Saver(root, keep, timeout_s, asynchronous)
                                            save(run, step): every rank writes and fsyncs its own
                                            shard, then rank 0 the manifest, and one rename makes
                                            step_N visible; keeps the newest `keep` of its own saves.
                                            Its own group and timeout (a collective to construct).
                                            A rank that cannot write (a full disk, a directory made
                                            read-only, deleted or replaced) stops every rank, each
                                            with a sentence, and nothing is committed.
                                            asynchronous: a snapshot in host memory, then the same
                                            protocol in a background writer; wait() for it
    latest_checkpoint(root)                 the newest complete step under root (or root itself)
    resumable(root)                         that, or a refusal naming --resume when there is none
    hold(path)                              a shared lock on a checkpoint being read: --keep leaves it
    verify_checkpoint(root)                 --verify: every check a load makes, without a model
    read_manifest(path, cfg, tc)            the manifest, checked field by field (types, ranges,
                                            known names), and refused if it is of another model or
                                            batch, or of other data (--data-changed-ok: said)
    check_shards(path, manifest)            every shard a whole archive; with tensors=True, every
                                            tensor finite, of a float dtype and of the shape its
                                            layout gives it, as loads check too
    check_save_dir(root, start)             refuse a --save directory that holds later steps, or a
                                            step_N.tmp that is not an interrupted save of ours
    read_checkpoint(path)                   (manifest, full weights, full optimizer state), whatever
                                            layout wrote it: every tensor joined from its shards
    load_checkpoint(run, path)              into a running trainer: same layout, the shards as they
                                            are (random streams too); another, split anew

Every shard is hashed as it is written (sha256); the manifest records each shard's digest, the step
and the run's id, and each shard the same step and id. Every load checks them before it unpickles a
shard (a flipped bit, an edit, a shard of another step or run, a link are refused by file name),
and the optimizer's step counts and the random streams' sizes after. A crash during a save leaves
the previous checkpoint intact (the partial step_N.tmp is skipped on resume). A run never deletes
or shadows a checkpoint it did not write, and never writes one that holds a non-finite value. The data position and the LR schedule follow from the step, so they need
no state of their own. `run` is 05's Run: its chunks, its ZeRO-aware optimizer pieces (04), groups.
"""
import dataclasses
import errno
import hashlib
import importlib
import json
import math
import os
import re
import shutil
import stat
import threading
import time
import zipfile
from datetime import timedelta

import torch
import torch.distributed as dist

from plumbing import checks, paths
from plumbing.data import identity as data_identity
from plumbing.launch import side_channel
from plumbing.shards import split_of
from plumbing.tokenizer import TOKENIZERS, tokenizer_of

tensor_parallel = importlib.import_module("01_tensor_parallel")

# A model that extends 01's GPT-2 (09's, with experts) registers here how to build it from its manifest's
# "extension" record ({"name", "file", "model": its fields beyond GPTConfig's}): EXTENSIONS[name](a meta
# GPT, the record) returns that GPT with the rest put in. Its run's flags say what they add through
# tc.extension() (also "layout": the sizes of its own groups, kept in the manifest's layout). A checkpoint
# whose extension is not registered here (05 reading 09's) is refused, naming the file that reads it.
EXTENSIONS = {}


def extension_of(tc):
    """tc.extension() (a later chapter's record of what its model adds), or None: 01's GPT-2."""
    return tc.extension() if hasattr(tc, "extension") else None


def model_parameters(manifest, device="meta"):
    """{name: parameter} of the whole serial model a manifest describes, on the meta device."""
    model = tensor_parallel.GPT(tensor_parallel.GPTConfig(**manifest["model"]), device=device)
    ext = manifest.get("extension")
    if ext:
        if ext["name"] not in EXTENSIONS:
            raise ValueError(f"the checkpoint holds a GPT-2 with {paths.shown(ext['name'])} ({_fields(ext['model'])}), "
                             f"which this command does not build: resume, sample or export it with the chapter "
                             f"that trains it (its manifest names the file {paths.shown(ext['file'])})")
        model = EXTENSIONS[ext["name"]](model, ext)
    return dict(model.named_parameters())


def only_gpt2(path, what):
    """Refuse, naming it, a checkpoint whose model extends GPT-2 (its manifest's extension), for `what`
    only 01's GPT-2 can take (an export to GPT-2's formats, sampling with 01's serial model)."""
    ext = read_manifest(path).get("extension")
    if ext:
        raise ValueError(f"{what}: the checkpoint {path} holds a GPT-2 with {paths.shown(ext['name'])} "
                         f"({_fields(ext['model'])}), and 01's GPT-2 has no {paths.shown(ext['name'])}; the chapter "
                         f"that trains it resumes it (its manifest names the file {paths.shown(ext['file'])})")


def _fields(model):
    """An extension's fields (k=v, ...), as a message prints them: names from a file, escaped."""
    return ", ".join(f"{paths.shown(k)}={paths.shown(v)}" for k, v in model.items())


CKPT = re.compile(r"step_(\d+)$")
INTERRUPTED = re.compile(r"step_(\d+)\.tmp$")
SAVED_FILES = re.compile(r"rank_\d{5}\.pt|manifest\.json")  # all a save writes into step_N
KEPT_FIELDS = ("batch_size", "seq_len")  # a resumed run must cut the data exactly as before
NOTED_FIELDS = ("seed", "data")  # may change on resume (new data, a new order), but it is said
_open = paths.create_new  # exclusive, never through a link; tests put a full disk here


# ----------------------------------------------------------------------------------------------
# Writing


class _Hashed:
    """A file being written, and the sha256 of every byte written to it, in the order written: the
    shard's checksum costs no second read. The bytes are kept (the shard is in host memory already)
    and hashed while the file's fsync waits on the disk (digest()): hashlib and fsync both release
    the GIL, so on a save whose pause is the disk's the checksum adds next to nothing."""

    def __init__(self, f):
        self.f, self.sha, self.kept = f, hashlib.sha256(), []

    def write(self, data):
        self.kept.append(bytes(data))
        return self.f.write(data)

    def digest_during(self, wait):
        """The sha256 (hex) of every byte written, computed while wait() runs in another thread."""
        failed = []

        def run():
            try:
                wait()
            except BaseException as e:  # raised here, in the writer, as the fsync's own error
                failed.append(e)
        waiter = threading.Thread(target=run, name="fsync")
        waiter.start()
        for chunk in self.kept:
            self.sha.update(chunk)
        self.kept = []
        waiter.join()
        if failed:
            raise failed[0]
        return self.sha.hexdigest()

    def flush(self):
        self.f.flush()

    def __getattr__(self, name):  # the file's own (its name, its descriptor)
        return getattr(self.f, name)


def _write(path, write):
    """Write a new file durably (write(f), flush, fsync) and return the sha256 of its bytes (hex);
    a full disk or any other OS error becomes a plain sentence naming the file, also when
    torch.save reports it as its own RuntimeError (a disk that fills in the middle of a shard:
    inline_container's "unexpected pos"). The file is created here, never opened through a link."""
    try:
        with _open(path, "wb") as f:
            hashed = _Hashed(f)
            write(hashed)
            f.flush()
            digest = hashed.digest_during(lambda: os.fsync(f.fileno()))
        return digest
    except (OSError, RuntimeError) as e:
        cause = _os_error(e)
        if cause is None:  # torch failed for a reason of its own: its first line, not its traceback
            raise ValueError(f"cannot write {path}: torch.save failed: {str(e).strip().splitlines()[0]}") from None
        raise ValueError(_write_failed(path, cause)) from None


def _os_error(error):
    """The OSError behind an error (itself, or what it was raised from or during), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _write_failed(path, error):
    """A failed write of a checkpoint's file, in a sentence naming it."""
    folder = os.path.dirname(path)
    if error.errno == errno.ENOSPC:
        free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
        return (f"no space left writing {path} ({free / 2**20:,.1f} MiB free on its disk); the previous checkpoint "
                f"is intact")
    return f"cannot write {path}: {error.strerror or error}; the previous checkpoint is intact"


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finite(run):
    """Names of this rank's parameters or optimizer state holding inf or NaN (none, normally). One
    read-back per device when all is finite; the names are looked for only when it is not.

    The tensors are on more than one device on a GPU: AdamW keeps its `step` counters on the CPU
    (unless fused or capturable) beside the GPU's parameters and moments, and torch.stack refuses
    tensors of two devices. So each device's flags are stacked and reduced on that device."""
    params = [(n, p) for c in run.chunks for n, p in c.named_parameters()]
    state = [t for st in run.opt.optimizer.state.values() for t in st.values()
             if torch.is_tensor(t) and t.is_floating_point()]
    flags = {}  # device -> every tensor's "all finite" there, not yet read back
    for t in [p for _, p in params] + state:
        flags.setdefault(t.device, []).append(torch.isfinite(t).all())
    if all(bool(torch.stack(f).all()) for f in flags.values()):
        return []
    bad = [n for n, p in params if not torch.isfinite(p).all()]
    return bad + (["the optimizer state"] if not all(torch.isfinite(t).all() for t in state) else [])


SAVE_TIMEOUT_S = 1800.0  # a save's own collectives: every rank's shard written and fsynced, then the rotation


class Saver:
    """Checkpoints of one run under root, keeping the newest `keep` of those this run wrote.

    A save waits for every rank's torch.save and fsync, and then for rank 0's manifest, rename and
    rotation: for multi-GB shards on a busy parallel filesystem, minutes, far past the training
    collectives' timeout (--timeout-s). So a save synchronises in a group of its own, made here, with
    its own timeout, timeout_s; it is gloo, whatever the training backend, for torch's monitored
    barrier, whose rank 0 names the ranks that had not arrived. Constructing a Saver is a
    collective: every rank makes one, at the same point."""

    def __init__(self, root, keep, timeout_s=SAVE_TIMEOUT_S, asynchronous=False):
        self.root, self.keep, self.written, self.timeout_s = root, keep, [], timeout_s
        # Its own timeout bounds what ranks other than 0 wait for rank 0 (the barrier's own bounds
        # rank 0's wait for them): a little longer, so that rank 0, which knows who is missing,
        # reports first.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s + 30))
        # asynchronous (--async-save): stage 2 in a background writer, its completion counted on the
        # side channel (no training group: the training goes on meanwhile).
        self.store = side_channel() if asynchronous else None
        self.writer, self.in_flight, self.failed = None, None, None
        os.makedirs(root, exist_ok=True)  # (05's preflight made it already)
        self.identity = _inode(root)  # a directory deleted or replaced mid-run is not saved into
        # This run's id, rank 0's draw, in every shard and manifest it saves: a shard of another run (or
        # another step, which each shard records too) in a checkpoint is refused at load.
        drawn = torch.tensor(list(os.urandom(8)), dtype=torch.uint8)
        dist.broadcast(drawn, src=dist.get_global_rank(self.group, 0), group=self.group)
        self.run_id = bytes(drawn.tolist()).hex()

    def _barrier(self, step, after):
        """Return once every rank has done `after`; raise, naming who had not, after timeout_s."""
        try:
            dist.monitored_barrier(self.group, timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)
        except RuntimeError as e:
            text, rank = str(e).strip().splitlines()[0], dist.get_rank()
            late = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
            if not late and "timed out" not in text.lower():  # not a timeout: a rank failed or died meanwhile
                who = "rank 0" if rank else "another rank"
                raise RuntimeError(f"saving step {step} under {self.root} stopped: {who} failed or died during the "
                                   f"save (its own error says why; the previous checkpoint is intact). torch: "
                                   f"{text}") from e
            if late:  # rank 0: torch names every rank that did not arrive in time
                who = f"rank(s) {late[1].strip()} had not finished {after}"
            elif rank:
                who = (f"rank {rank} had finished {after}, but rank 0 did not answer: rank 0 waits for every "
                       f"rank, and its own error names those that had not finished; if it names none, rank 0 "
                       f"itself was the slow one")
            else:
                who = f"not every rank had finished {after}"
            raise TimeoutError(f"saving step {step} under {self.root} timed out after {self.timeout_s:g} s (the "
                               f"save's own timeout, Saver's timeout_s; --timeout-s does not bound a save): "
                               f"{who}. torch: {text}") from e

    def _settle(self, run, step, after, error, tmp):
        """Every rank at the barrier (it names the late ones), then every rank told which failed
        `after` (error: this rank's sentence, or None): a failure stops every rank together, each
        with a sentence, instead of leaving the others waiting out the save's timeout. A failed
        save's step_N.tmp is removed (rank 0): only the previous checkpoint remains."""
        self._barrier(step, after)
        failed = torch.zeros(run.env.world_size)
        failed[run.env.rank] = error is not None
        dist.all_reduce(failed, group=self.group)
        culprits = [r for r, f in enumerate(failed.tolist()) if f]
        if not culprits:
            return
        if run.env.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise ValueError(f"not saving step {step}: rank(s) {culprits} failed {after} (their own errors say why); "
                         f"the previous checkpoint is intact")

    def _gather_digests(self, run, digest):
        """Every rank's shard's sha256 (hex), in rank order, on every rank (the save's gloo group)."""
        mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(run.env.world_size)]
        dist.all_gather(every, mine, group=self.group)
        return [bytes(d.tolist()).hex() for d in every]

    def _gone(self, step):
        """Why root cannot take step `step` (deleted, or replaced, since this run began), or None."""
        now = _inode(self.root)
        if now == self.identity:
            return None
        what = "is gone" if now is None else "is another directory now"
        had = f" (with this run's {', '.join(os.path.basename(w) for w in self.written)})" if self.written else ""
        return (f"not saving step {step}: {self.root}, where this run saves, {what}: deleted or moved while the run "
                f"trained{had}; a run never writes into a directory it did not check and lock; the run stops here")

    def _rotate(self, say):
        """Remove this run's own saves beyond the newest `keep` (only those: never another run's). One
        already gone is fine; one that cannot be removed stays, and is said; one that another process
        reads (its shared lock, hold()) stays until a later save finds it free."""
        busy = []
        for old in self.written[:-self.keep]:
            try:
                with _exclusive(old) as free:
                    if not free:
                        say(f"note: keeping {old} for now: another process is reading it (--resume, an export); "
                            f"a later save removes it")
                        busy.append(old)
                        continue
                    shutil.rmtree(old)
            except FileNotFoundError:
                pass
            except OSError as e:
                say(f"note: could not remove {old}, an older checkpoint of this run ({e.strerror or e}); it stays")
        self.written = busy + self.written[-self.keep:]

    def _commit(self, step, tmp, final, manifest):
        """Rank 0: the manifest, then the one rename that makes the step visible."""
        _write(os.path.join(tmp, "manifest.json"), lambda f: f.write(manifest))
        try:
            _fsync_dir(tmp)
            os.replace(tmp, final)  # atomic: a crash before this line leaves the previous step intact
            _fsync_dir(self.root)
        except OSError as e:
            raise ValueError(self._gone(step) or f"cannot make {final} from {tmp}: {e.strerror or e}; the "
                             f"previous checkpoint is intact") from None

    def save(self, run, step, say=print):
        """Write step `step` (the number of steps done) under root/step_<step>. Rank 0 says where,
        how many bytes and how long it took. Every rank agrees first that every value is finite and
        that root is still the directory the run began with, and after writing that every rank
        wrote: a failure anywhere stops every rank, with a sentence each, and commits nothing.
        Asynchronous: returns after stage 1 (the snapshot); stage 2 writes in the background."""
        self.wait()  # at most one save in flight
        t0 = time.perf_counter()
        final = os.path.join(self.root, f"step_{step:08d}")
        tmp = final + ".tmp"
        if os.path.lexists(final):  # every rank looks: they all stop here, none waits for the others
            raise ValueError(f"not saving step {step}: {final} already exists, written by another run saving into "
                             f"{self.root}; this run's checkpoints are left as they were")
        if run.env.rank == 0 and os.path.lexists(tmp):  # not a checkpoint: it never got its manifest
            _check_interrupted(tmp, f"not saving step {step}")
            say(f"removing {tmp}: an interrupted save of this step, never completed")
            shutil.rmtree(tmp)
        bad, gone = _finite(run), self._gone(step)
        flags = torch.tensor([float(bool(bad)), float(gone is not None)])  # on the CPU: the save's group is gloo
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)  # also: nobody writes before the removal above
        if flags[0].item():
            where = f"this rank holds non-finite values in {', '.join(bad[:3])}" if bad else "another rank does"
            raise FloatingPointError(f"not saving step {step}: {where}; the last checkpoint is left as it was")
        if flags[1].item():
            raise ValueError(gone or f"not saving step {step}: {self.root}, where this run saves, is gone or another "
                                     f"directory now, as another rank found; the run stops here")
        error = None
        try:
            os.mkdir(tmp)  # not makedirs: root is not made again behind the user's back
        except FileExistsError:
            pass  # another rank made it
        except OSError as e:  # root removed between the check above and here: said as gone, as above
            error = ValueError(self._gone(step) or f"not saving step {step}: cannot make {tmp} ({e.strerror or e}); "
                               f"the previous checkpoint is intact")
        shard = dict(_shard(run, snapshot=self.store is not None), step=step, run=self.run_id)
        if self.store is not None:
            self._settle(run, step, f"making {tmp}", error, tmp)  # before the writers: each fails alone there
            manifest = _manifest(run, step, self.run_id) if run.env.rank == 0 else None
            self.in_flight = step
            self.writer = threading.Thread(target=self._stage_2, daemon=True, name="checkpoint writer",
                                           args=(run.env.rank, run.env.world_size, step, tmp, final, shard, manifest, say, t0))
            self.writer.start()
            if run.env.rank == 0:
                say(f"saving step {step} to {final} in the background; training paused "
                    f"{time.perf_counter() - t0:.3f} s for the snapshot")
            return
        digest = None
        try:
            if error is None:
                digest = _write(os.path.join(tmp, f"rank_{run.env.rank:05d}.pt"), lambda f: torch.save(shard, f))
        except ValueError as e:
            error = e
        self._settle(run, step, f"writing its shard to {tmp}", error, tmp)  # every shard on disk, or none is used
        digests = self._gather_digests(run, digest)  # through the save's barrier: into the manifest
        error = None
        if run.env.rank == 0:
            try:
                manifest = _manifest(run, step, self.run_id, digests)
                self._commit(step, tmp, final, json.dumps(manifest, indent=1).encode())
            except ValueError as e:
                error = e
            else:
                size = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))
                say(f"saved step {step} to {final}: {size / 1e6:,.2f} MB in {time.perf_counter() - t0:.2f} s")
                self.written.append(final)
                self._rotate(say)  # only this run's own saves are ever removed
        last = f"the save (rank 0 last: the manifest, the rename to {final}, the rotation)"
        self._settle(run, step, last, error, tmp)

    # The asynchronous save, two stages as MegaScale's (Jiang et al. 2024, Section 4.4). Stage 1, in
    # save(): the finiteness agreement, then a snapshot of this rank's part in host memory (a copy
    # of every tensor), the only pause of training. Stage 2, here, in a thread per rank while
    # training goes on: the shard written and fsynced into step_N.tmp, then "done" on the side
    # channel (or "failed"); rank 0 waits until every rank said so, then writes the manifest and
    # renames. Why a crash cannot leave a partial or a wrong checkpoint: the rename is the only act
    # that makes a step visible, and rank 0 does it only after every shard is on disk (fsynced) and
    # the manifest too; a step_N.tmp is never resumed from, and is cleared by the next save of that
    # step. The snapshot was taken after the step's optimizer update and copies every tensor, so
    # the training that goes on cannot change what is written. Rotation removes only this run's
    # own committed saves, after the new one is visible, as the blocking save does.

    def _stage_2(self, rank, world, step, tmp, final, shard, manifest, say, t0):
        key = f"save/{self.root}/{step}/{{}}"
        try:
            try:
                digest = _write(os.path.join(tmp, f"rank_{rank:05d}.pt"), lambda f: torch.save(shard, f))
            except ValueError:
                self.store.set(key.format(rank), "failed")  # rank 0 need not wait out the timeout for it
                raise
            self.store.set(key.format(rank), f"done {digest}")  # a forged one is refused at load, by name
            if rank != 0:
                return
            deadline, missing = time.monotonic() + self.timeout_s, list(range(world))
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not self.store.check([key.format(r)])]
                time.sleep(0.02 if missing else 0)
            failed = [r for r in range(world) if r not in missing and self.store.get(key.format(r)) == b"failed"]
            if missing or failed:
                newest = self.written[-1] if self.written else "none"
                why = (f"rank(s) {failed} could not write their shards to {tmp} (their own errors say why)" if failed
                       else f"rank(s) {missing} had not written their shards to {tmp} within {self.timeout_s:g} s "
                            f"(--save-timeout-s)")
                say(f"abandoned step {step}: {why}; the newest checkpoint stays {newest}")
                return
            said = [self.store.get(key.format(r)).decode(errors="replace").split() for r in range(world)]
            manifest = _with_digests(manifest, [d[1] if len(d) == 2 and d[0] == "done" else "" for d in said])
            self._commit(step, tmp, final, json.dumps(manifest, indent=1).encode())
            size = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))
            say(f"saved step {step} to {final}: {size / 1e6:,.2f} MB, durable {time.perf_counter() - t0:.2f} s "
                f"after the snapshot began")
            self.written.append(final)
            self._rotate(say)
        except Exception as e:  # said when the next save or the run's end waits for it
            self.failed = e

    def wait(self):
        """The save in flight, finished: the next save and the run's end wait here (for its timeout
        at most; a writer that never finishes then ends the run, naming this rank and the step)."""
        if self.writer is not None:
            self.writer.join(self.timeout_s)
            if self.writer.is_alive():
                raise TimeoutError(f"rank {dist.get_rank()}: the background write of step {self.in_flight} under "
                                   f"{self.root} did not finish within {self.timeout_s:g} s (--save-timeout-s); "
                                   f"the previous checkpoint stays the newest")
            self.writer = None
        if self.failed is not None:
            failed, self.failed = self.failed, None
            raise failed


class _exclusive:
    """with _exclusive(folder) as free: an exclusive flock on the directory, taken without waiting;
    free is False when a reader holds its shared lock (hold()). No locks on the filesystem: free."""

    def __init__(self, folder):
        self.fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)  # FileNotFoundError: already gone

    def __enter__(self):
        import fcntl
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            return e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN)
        return True

    def __exit__(self, *exc):
        os.close(self.fd)


_reading = {}  # realpath of a checkpoint this process reads -> its directory's fd, flocked shared


def hold(path, flag="--resume"):
    """Take a shared flock on the checkpoint directory path for the rest of this process (and its
    forked ranks), so that another run's --keep rotation does not remove it while it is read; refuse,
    naming it, a checkpoint removed between being chosen and being locked. Returns path."""
    import fcntl
    key = os.path.realpath(path)
    if key in _reading:
        return path
    gone = (f"{flag} {path}: the checkpoint was removed after this run chose it (another run's --keep rotating "
            f"its saves); run again to take the newest there")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise ValueError(gone) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a rotation holds its lock only while it removes the directory
    except OSError:
        pass  # no locks on this filesystem
    if not os.path.exists(os.path.join(path, "manifest.json")):
        os.close(fd)
        raise ValueError(gone)
    _reading[key] = fd
    return path


def _inode(path):
    """(device, inode) of the directory at path, or None if there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _shard(run, snapshot=False):
    """This rank's part: its weights (one replica's), its optimizer pieces, its random streams.
    snapshot: every tensor a copy in host memory, so that training may go on changing the live ones."""
    cpu = (lambda t: t.detach().to("cpu", copy=True)) if snapshot else (lambda t: t.detach().cpu())
    owner = {id(p): (c, n) for c, chunk in enumerate(run.chunks) for n, p in chunk.named_parameters()}
    # Replicas hold the same weights and, without ZeRO-1, the same optimizer state: one copy does, the
    # first replica's of each parameter (over dp, or over its own .replica_group: 09's experts).
    writes = lambda p: dist.get_rank(getattr(p, "replica_group", run.groups.dp)) == 0  # noqa: E731
    pieces = []
    for piece in [piece for piece in run.opt.pieces if run.tc.zero1 or writes(piece.param)]:
        c, name = owner[id(piece.param)]
        start = piece.weights.storage_offset() - run.ddp.offsets[piece.param]
        state = {k: cpu(v) for k, v in run.opt.optimizer.state.get(piece.master, {}).items()}
        if piece.master is not piece.weights:
            state["master"] = cpu(piece.master)
        pieces.append((c, name, start, start + piece.weights.numel(), state))
    device, chunks = run.env.device, [{n: cpu(p) for n, p in c.named_parameters() if writes(p)} for c in run.chunks]
    return dict(
        coords={k: dist.get_rank(getattr(run.groups, k)) for k in ("tp", "dp", "pp")},
        chunks=chunks if any(chunks) else [],
        # a tensor split over another group than tp (07's vocabulary shard): (its shards, this one's index)
        splits={n: split_of(p, None) for c in run.chunks for n, p in c.named_parameters() if hasattr(p, "split_group")},
        pieces=pieces,
        rng=dict(device=device.type, cpu=torch.get_rng_state(), tracked=cpu(run.chunks[0].rng.state),
                 cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None))


def _layout(run):
    """The layout a checkpoint records; 07's vocabulary parallelism places the embedding otherwise; a
    later chapter's own sizes (checks.layout_sizes: 08's cp) are recorded where they are not 1."""
    tc = run.tc
    more = {k: n for k, n in checks.layout_sizes(tc) if k not in ("tp", "pp", "dp") and n != 1}  # 08's cp
    return dict(tp=tc.tp, pp=tc.pp, dp=tc.dp, v=tc.virtual_stages, zero1=tc.zero1, **more,
                **({"vocab_parallel": True} if getattr(run, "vocab", None) else {}),
                **(extension_of(tc) or {}).get("layout", {}))  # 09's ep and etp


def _with_digests(manifest, digests):
    """The manifest with each shard's sha256 (digests: in rank order)."""
    return dict(manifest, shards={f"rank_{r:05d}.pt": d for r, d in enumerate(digests)})


def _manifest(run, step, run_id=None, digests=None):
    tc = run.tc
    # outputs: the files this run writes, so that a resume knows them as its own (checks.check_outputs)
    outputs = {name: os.path.realpath(getattr(tc, name)) if getattr(tc, name, "") else "" for name in OUTPUTS}
    ext = extension_of(tc)
    return dict(step=step, model=dataclasses.asdict(run.cfg), world=run.env.world_size, layout=_layout(run),
                **({"extension": {k: ext[k] for k in ("name", "file", "model")}} if ext else {}),
                train={k: getattr(tc, k) for k in KEPT_FIELDS}, noted={k: getattr(tc, k) for k in NOTED_FIELDS},
                dtype=str(run.dtype), tokenizer=tokenizer_of(tc.data), outputs=outputs,
                data=data_identity(tc.data),  # as it was loaded: a resume on other data is refused (read_manifest)
                loss_mask=_mask_identity(tc),  # and on another mask, or with one where there was none (or none)
                **({"run_id": run_id} if run_id else {}),
                **({"shards": {f"rank_{r:05d}.pt": d for r, d in enumerate(digests)}} if digests else {}))


def _mask_identity(tc):
    """--loss-mask's identity (plumbing/data.identity), or None for a run without a mask."""
    mask = getattr(tc, "loss_mask", "")
    return data_identity(mask) if mask else None


OUTPUTS = ("metrics", "trace")  # the manifest's outputs: what the run that wrote it wrote besides checkpoints


def outputs_of(path):
    """{"metrics": path, "trace": path} the run that wrote the checkpoint at path wrote ("": none),
    or None for a manifest from before they were kept."""
    return read_manifest(path).get("outputs")


# ----------------------------------------------------------------------------------------------
# Finding and checking


def latest_checkpoint(root, say=None, flag=None):
    """The newest complete checkpoint under root (a step_N directory, or root itself), or None.
    Interrupted saves (.tmp) are skipped, and said so when say is given. flag (the user's --resume):
    a root that is a regular file, an interrupted save itself, or a step_N without its manifest is
    refused, naming flag; without flag (library calls) it is simply not a checkpoint."""
    say = say or (lambda text: None)
    if flag:
        name = os.path.basename(os.path.normpath(root))
        what = paths.describe(root)
        if os.path.exists(root) and what != "a directory":
            raise ValueError(f"{flag} {root}: it is {what or 'a file'}, not a checkpoint directory (step_N) or a "
                             f"directory of them")
        if INTERRUPTED.match(name) and os.path.isdir(root):
            raise ValueError(f"{flag} {root}: it is an interrupted save, never completed (a save writes step_N.tmp "
                             f"and renames it step_N once every shard and the manifest are on disk); resume from "
                             f"{os.path.dirname(os.path.normpath(root)) or '.'}, whose newest complete step is taken")
        if CKPT.match(name) and os.path.isdir(root) and not os.path.exists(os.path.join(root, "manifest.json")):
            raise ValueError(f"{flag} {root}: this checkpoint has no manifest.json (a save writes it last, so the "
                             f"save never completed or the file was removed); resume from "
                             f"{os.path.dirname(os.path.normpath(root)) or '.'} to take its newest complete step")
    if os.path.exists(os.path.join(root, "manifest.json")):
        return root
    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root)):
        if name.endswith(".tmp"):
            say(f"ignoring {os.path.join(root, name)}: an interrupted save, never completed")
    steps = sorted(d for d in os.listdir(root) if CKPT.match(d))
    complete = [d for d in steps if os.path.exists(os.path.join(root, d, "manifest.json"))]
    for d in sorted(set(steps) - set(complete)):
        say(f"ignoring {os.path.join(root, d)}: it has no manifest.json")
    return os.path.join(root, complete[-1]) if complete else None


def resumable(root, flag="--resume", lenient=None):
    """The newest complete checkpoint that --resume root names, or a ValueError naming the flag: a path
    that does not exist, or that holds no complete checkpoint, is refused (a mistyped --resume would
    otherwise start over from step 0 and say it resumed). lenient: the flag that allows "none yet"
    (--resume-if-present, for a restart wrapper): then None for a directory with none, said by resume()."""
    if lenient is None and not os.path.exists(root):
        parent = os.path.dirname(os.path.normpath(root)) or "."
        near = sorted(d for d in os.listdir(parent) if CKPT.match(d))[-3:] if os.path.isdir(parent) else []
        raise ValueError(f"{flag} {root}: no such file or directory"
                         + (f" ({parent} holds {', '.join(near)})" if near else "")
                         + "; to start from step 0 when no checkpoint is there yet, give --resume-if-present instead")
    path = latest_checkpoint(root, flag=flag)
    if path is None and lenient is None:
        what = "a GPT-2 directory (config.json): start from it with --init-from" if os.path.isfile(
            os.path.join(root, "config.json")) else "no complete checkpoint (a step_N directory with its manifest.json)"
        raise ValueError(f"{flag} {root}: it holds {what}; to start from step 0 when no checkpoint is there yet, "
                         f"give --resume-if-present instead")
    return path


def verify_checkpoint(root, say=print):
    """--verify: the newest complete checkpoint under root checked as every load checks it, without
    a model: each shard a file of its own (no link), its bytes as the save wrote them (sha256, as its
    manifest records), of the manifest's step and run, every tensor finite and of the shape its layout
    holds, the optimizer's step counts and the random streams as a save writes them."""
    path = resumable(root, "--verify")
    manifest = read_manifest(path)
    check_shards(path, manifest, tensors=True)
    sums = "each as its save wrote it (sha256)" if manifest.get("shards") else \
        "their bytes unchecked: the manifest was written before checksums were kept"
    say(f"verified {path}: step {manifest['step']}, {manifest['world']} shards, {sums}"
        + (f", of run {manifest['run_id']}" if manifest.get("run_id") else "")
        + "; every tensor finite and shaped as its layout holds")
    return True


def newest_checkpoint(*roots):
    """The newest complete checkpoint under any of roots (05's --snapshot-dir and --save), or None."""
    found = [p for p in (latest_checkpoint(d) for d in roots if d) if p]
    return max(found, key=lambda p: read_manifest(p)["step"], default=None)


def check_save_dir(root, start, resuming_from=None, name="--save"):
    """A run that starts after `start` steps must not write into a directory holding later steps:
    it would shadow them, and rotating its own saves would never reach them. Say what to do.
    name: the flag that gave root (--save, --snapshot-dir)."""
    if not os.path.isdir(root):
        return
    later = sorted(d for d in os.listdir(root) if CKPT.match(d) and int(CKPT.match(d)[1]) > start)
    if later:
        where = f"resuming from {resuming_from} ({start} steps)" if resuming_from else "starting from step 0"
        raise ValueError(f"{name} {root} already holds {', '.join(later[-3:])}, written by another run, and this "
                         f"run is {where}: it would write over or beside them. Resume from them with "
                         f"--resume {root}, or save to another directory.")
    for d in sorted(os.listdir(root)):  # the interrupted saves of steps this run will save: removed then
        if INTERRUPTED.match(d) and int(INTERRUPTED.match(d)[1]) > start:
            _check_interrupted(os.path.join(root, d), f"{name} {root}")


def _check_interrupted(tmp, who):
    """A step_N.tmp that a save may remove (and write again) must be what a save leaves: a real
    directory of shards and a manifest. Anything else is not ours to delete, and would break the save."""
    if os.path.islink(tmp) or not os.path.isdir(tmp):
        what = "a link" if os.path.islink(tmp) else paths.describe(tmp) or "a file"
        raise ValueError(f"{who}: {tmp} is {what}, not an interrupted save of this trainer (a directory), and a save "
                         f"of that step would have to remove it; remove it yourself, or save to another directory")
    foreign = sorted(e for e in os.listdir(tmp) if not SAVED_FILES.fullmatch(e))
    if foreign:
        raise ValueError(f"{who}: {tmp} holds {', '.join(foreign[:3])}, which no save writes, and a save of that "
                         f"step would remove it; move them away, or save to another directory")


DTYPES = ("torch.float32", "torch.float64", "torch.bfloat16")  # what 05 trains in (--dtype)


def _whole(v, lo):
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


FOLDED = ("ep", "etp")  # 09's sizes in a manifest's layout: the experts' grid over the same ranks as attention's


def _manifest_problems(m):
    """Each field of a manifest that is missing or wrong, as 'field (what it must be; got ...)'."""
    got = lambda k, d=m: repr(d[k]) if k in d else "nothing"  # noqa: E731
    wrong = [f"{k} (a whole number, at least {lo}; got {got(k)})" for k, lo in (("step", 0), ("world", 1))
             if not _whole(m.get(k), lo)]
    wrong += [f"{k} (an object; got {got(k)})" for k in ("model", "layout", "train") if not isinstance(m.get(k), dict)]
    if wrong:
        return wrong
    lay = m["layout"]
    # Every number but v is a size of the grid (tp, pp, dp, and a later chapter's: 08's cp), or of a grid
    # folded onto the same ranks (09's experts' ep and etp: FOLDED), which is no factor of the world.
    sizes = [k for k, n in lay.items() if k != "v" and not isinstance(n, bool)] if isinstance(lay, dict) else []
    grid = [k for k in sizes if k not in FOLDED]
    if not all(_whole(lay.get(k), 1) for k in ("tp", "pp", "dp", "v", *sizes)) \
            or not isinstance(lay.get("zero1", False), bool):
        wrong.append(f"layout {lay} (tp, pp, dp and v whole numbers of at least 1, zero1 true or false"
                     + (f"; {', '.join(k for k in sizes if k not in ('tp', 'pp', 'dp'))} too" if len(sizes) > 3 else "")
                     + ")")
    elif math.prod(lay[k] for k in grid) != m["world"]:
        wrong.append(f"layout {lay} ({' x '.join(grid)} must equal world={m['world']})")
    fields = {f.name for f in dataclasses.fields(tensor_parallel.GPTConfig)}
    if set(m["model"]) != fields:
        wrong.append(f"model {sorted(m['model'])} (want {sorted(fields)})")
    else:
        wrong += [f"model.{k} (must be {problem}; got {v!r})" for k, v in m["model"].items()
                  if (problem := checks.value_problem(tensor_parallel.GPTConfig, k, v))]
    wrong += [f"train.{k} (a whole number, at least 1; got {got(k, m['train'])})" for k in KEPT_FIELDS
              if not _whole(m["train"].get(k), 1)]
    wrong += [f"train.{k} (not a field a checkpoint keeps)" for k in m["train"] if k not in KEPT_FIELDS]
    noted = m.get("noted", {})
    if not isinstance(noted, dict) or not _whole(noted.get("seed", 0), 0) or not isinstance(noted.get("data", ""), str):
        wrong.append(f"noted {noted!r} (an object: seed a whole number, data a path)")
    if "dtype" in m and m["dtype"] not in DTYPES:
        wrong.append(f"dtype (one of {', '.join(DTYPES)}; got {m['dtype']!r})")
    ext = m.get("extension")
    if "extension" in m and not (isinstance(ext, dict) and set(ext) == {"name", "file", "model"}
                                 and all(isinstance(ext[k], str) for k in ("name", "file"))
                                 and isinstance(ext["model"], dict) and all(_whole(v, 1) for v in ext["model"].values())):
        wrong.append(f"extension {ext!r} (an object: name and file, text; model, whole numbers of at least 1)")
    out = m.get("outputs", {})
    if not isinstance(out, dict) or set(out) - set(OUTPUTS) or not all(isinstance(v, str) for v in out.values()):
        wrong.append(f"outputs {out!r} (an object: {' and '.join(OUTPUTS)}, each a path or \"\")")
    data = m.get("data")  # absent from a manifest written before it was kept: nothing to compare
    if "data" in m and not (isinstance(data, dict) and set(data) == {"bytes", "head_tail_sha256"}
                            and _whole(data["bytes"], 0) and isinstance(data["head_tail_sha256"], str)
                            and re.fullmatch(r"[0-9a-f]{64}", data["head_tail_sha256"])):
        wrong.append(f"data {data!r} (an object: bytes, a whole number, and head_tail_sha256, 64 hex digits)")
    shards = m.get("shards")  # absent from a manifest written before checksums were kept
    if "shards" in m and not (isinstance(shards, dict) and set(shards) == {f"rank_{r:05d}.pt" for r in range(m["world"])}
                              and all(isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for v in shards.values())):
        wrong.append(f"shards {_short(shards)} (an object: each rank's rank_NNNNN.pt and its sha256, 64 hex digits)")
    if "run_id" in m and not (isinstance(m["run_id"], str) and re.fullmatch(r"[0-9a-f]{16}", m["run_id"])):
        wrong.append(f"run_id {_short(m['run_id'])} (16 hex digits)")
    if "tokenizer" in m and m["tokenizer"] not in TOKENIZERS:
        wrong.append(f"tokenizer (one of {', '.join(TOKENIZERS)}; got {m['tokenizer']!r})")
    wrong += _mask_problems(m)
    return wrong


def _is_identity(v):
    return (isinstance(v, dict) and set(v) == {"bytes", "head_tail_sha256"} and _whole(v["bytes"], 0)
            and isinstance(v["head_tail_sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", v["head_tail_sha256"]))


def _mask_problems(m):
    """The manifest's loss_mask: absent (written before it was kept), null (no mask), or an identity."""
    mask = m.get("loss_mask")
    if mask is not None and not _is_identity(mask):
        return [f"loss_mask {mask!r} (null, or an object: bytes, a whole number, and head_tail_sha256, 64 hex digits)"]
    return []


def _short(value, limit=120):
    """repr(value), cut at limit characters: a field of a file, said without its control characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def read_manifest(path, cfg=None, tc=None, say=None):
    """The manifest of the checkpoint at path, checked field by field: its types, ranges and names
    (a step that is negative or true, a size given as text, an unknown dtype or tokenizer are each
    refused, naming the file and the field). With cfg and tc, refuses a checkpoint of another model
    or batch, naming what differs, and says when the seed or the data differ (a run may change them
    on purpose)."""
    file = os.path.join(path, "manifest.json")
    try:
        paths.regular_file(file, "the checkpoint's manifest")
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a checkpoint: no readable manifest.json ({e})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{file} is malformed: it holds a JSON {type(manifest).__name__}, not an object of fields")
    wrong = _manifest_problems(manifest)
    if wrong:
        raise ValueError(f"{file} is malformed: missing or wrong " + ", ".join(map(str, wrong)))
    named = CKPT.fullmatch(os.path.basename(os.path.normpath(path)))
    if named and int(named[1]) != manifest["step"]:  # a save names its directory after its step
        raise ValueError(f"{file} is malformed: its step {manifest['step']} is not the {int(named[1])} of its "
                         f"directory's name")
    if cfg is not None:
        diff = [f"{k}={v} (this run {getattr(cfg, k)})" for k, v in manifest["model"].items()
                if getattr(cfg, k) != v]
        diff += [f"{k}={v} (this run {getattr(tc, k)})" for k, v in manifest["train"].items()
                 if getattr(tc, k, v) != v]
        ours, theirs = extension_of(tc), manifest.get("extension")
        if (ours or {}).get("model") != (theirs or {}).get("model") or (ours or {}).get("name") != (theirs or {}).get("name"):
            what = lambda e: f"a GPT-2 with {paths.shown(e['name'])} ({_fields(e['model'])})" \
                if e else "01's GPT-2"  # noqa: E731
            diff.append(f"{what(theirs)} (this run {what(ours)})")
        if diff:
            raise ValueError(f"the checkpoint {path} was written with " + ", ".join(diff))
        for k, v in manifest.get("noted", {}).items():
            if say and getattr(tc, k, v) != v:
                say(f"note: the checkpoint was trained with --{k} {v!r}; this run continues with {getattr(tc, k)!r}")
        _check_same_data(path, manifest, tc, say)
        _check_same_mask(path, manifest, tc, say)
    return manifest


def _check_same_mask(path, manifest, tc, say):
    """Refuse to resume with another --loss-mask than the checkpoint's (by identity), with one where
    it had none or none where it had one, unless --data-changed-ok (the mask is part of the data),
    which says it. A manifest from before masks were kept is not compared."""
    if "loss_mask" not in manifest or not hasattr(tc, "data"):
        return
    then, now = manifest["loss_mask"], _mask_identity(tc)
    if now == then:
        return
    mask = getattr(tc, "loss_mask", "")
    if then is None:
        how = f"--loss-mask {mask}: the checkpoint {path} was trained without a loss mask (every target counted)"
    elif now is None:
        how = (f"no --loss-mask: the checkpoint {path} was trained with one ({then['bytes']:,} bytes, head and tail "
               f"{then['head_tail_sha256'][:12]}), and this run would count every target")
    else:
        what = (f"{then['bytes']:,} bytes then, {now['bytes']:,} now" if now["bytes"] != then["bytes"] else
                f"the same {now['bytes']:,} bytes, other contents at its head or tail")
        how = f"--loss-mask {mask} is not the mask the checkpoint {path} was trained with ({what})"
    if getattr(tc, "data_changed_ok", False):
        if say:
            say(f"note: {how}; continuing (--data-changed-ok): other targets are counted from here on")
        return
    fix = "drop --loss-mask" if then is None else "give --loss-mask the mask it was trained with"
    raise ValueError(f"{how}: a resumed run would count other targets than the run it continues; {fix}, or give "
                     f"--data-changed-ok to continue all the same")


def _check_same_data(path, manifest, tc, say):
    """Refuse to resume on data other than the checkpoint's (its identity: size, head and tail,
    plumbing/data.identity), appended to or replaced since, unless --data-changed-ok, which says it."""
    then = manifest.get("data")
    if then is None or not hasattr(tc, "data"):  # a manifest from before it was kept; a caller without data
        return
    now = data_identity(tc.data)
    if now == then:
        return
    how = (f"{then['bytes']:,} bytes then, {now['bytes']:,} now" if now["bytes"] != then["bytes"] else
           f"the same {now['bytes']:,} bytes, other contents at its head or tail")
    trained = manifest.get("noted", {}).get("data")
    was = f"{paths.shown(trained) if trained else 'the built-in corpus'}" if trained is not None else "its data"
    where = f"--data {tc.data or '(the built-in corpus)'}"
    if getattr(tc, "data_changed_ok", False):
        if say:
            say(f"note: {where} is not the data the checkpoint {path} was trained on ({how}); continuing on it "
                f"(--data-changed-ok): other batches, and another held-out split")
        return
    raise ValueError(f"{where} is not the data the checkpoint {path} was trained on ({was}: {how}): a resumed run "
                     f"would draw other batches and hold out another split; give --data-changed-ok to continue on it "
                     f"all the same, or give --data the data it was trained on")


def check_shards(path, manifest, tensors=False):
    """Every shard the manifest promises is there and is a whole archive (its end record, written
    last, is intact): checked before any process starts. tensors: also read every tensor (memory-
    mapped) and refuse a shard whose contents lie, as every load does (_check_shard)."""
    meta = None
    for r in range(manifest["world"]):
        file = os.path.join(path, f"rank_{r:05d}.pt")
        what = paths.describe(file)
        if what or not zipfile.is_zipfile(file):
            raise ValueError(f"checkpoint shard {file} is missing, truncated or corrupt: "
                             f"{'it is ' + what if what else 'not a complete archive'}")
        _verify_bytes(file, {} if not tensors else manifest)  # a link, always; the checksum with the tensors
        if tensors and file not in _checked:  # a launcher's check is its forked ranks' too
            meta = meta or model_parameters(manifest)
            _check_shapes(file, _load_shard(file, mmap=True, manifest=manifest), manifest["layout"]["tp"], meta)
            _checked.add(file)


VOCABULARY = "transformer.wte.weight"  # the one split tensor whose shards may hold padding rows


def _check_shapes(file, shard, tp, meta):
    """Every weight of a shard shaped as its layout splits it: the full model's shape (meta: its
    parameters on the meta device), a split dimension 1/count of it (count: tp, or the shard's own
    group for 07's vocabulary shard), the vocabulary's rounded up by its padding. Refused naming the
    shard and the tensor: a shard a few rows short would otherwise be zero-padded, or fail at copy."""
    splits = shard.get("splits", {})
    for chunk in shard["chunks"]:
        for name, t in chunk.items():
            if name not in meta:
                raise ValueError(f"checkpoint shard {file} holds {name}, which the model of its manifest does not have")
            p, want = meta[name], list(meta[name].shape)
            if hasattr(p, "tp_dim"):
                count = splits.get(name, (tp, 0))[0] if isinstance(splits, dict) else tp
                want[p.tp_dim] = t.shape[p.tp_dim] if t.dim() == p.dim() else -1
                rows = want[p.tp_dim] * count
                if rows != p.tp_full and not (name == VOCABULARY and rows >= p.tp_full):
                    want[p.tp_dim] = f"{p.tp_full}/{count}"
            if list(t.shape) != want:
                raise ValueError(f"checkpoint shard {file}: the weight {name} is {tuple(t.shape)}, where its layout "
                                 f"holds ({', '.join(map(str, want))}); the shard does not fit its manifest, so it "
                                 f"cannot be resumed, sampled or exported")


_checked = set()  # the shards this process (or the one that forked it) has read through once


# ----------------------------------------------------------------------------------------------
# Reading


def sha256_of(file, block=1 << 22):
    """The sha256 (hex) of a file's bytes."""
    sha = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(block):
            sha.update(chunk)
    return sha.hexdigest()


_verified = {}  # (file, inode, size, mtime): its checksum checked, in this process or the one that forked it


def _verify_bytes(file, manifest):
    """Refuse a shard that is a link, or whose bytes are not those the save wrote (the manifest's
    sha256 of it): a flipped bit, an edit, a shard copied in from another step or run. Before the
    shard is unpickled. A manifest from before checksums were kept has none to compare."""
    if os.path.islink(file):
        raise ValueError(f"checkpoint shard {file} is a link (to {_short(os.readlink(file))}): a save writes every "
                         f"shard as a file of its own, and a link could bring in another checkpoint's shard; copy "
                         f"the file in its place, or resume the checkpoint it belongs to")
    want = (manifest.get("shards") or {}).get(os.path.basename(file))
    if not want:
        return
    st = os.stat(file)
    key = (os.path.realpath(file), st.st_ino, st.st_size, st.st_mtime_ns)
    if _verified.get(key) == want:
        return
    got = sha256_of(file)
    if got != want:
        raise ValueError(f"checkpoint shard {file} is not the file its save wrote: its sha256 is {got[:16]}..., "
                         f"where {os.path.join(os.path.dirname(file), 'manifest.json')} records {want[:16]}... "
                         f"(a changed byte on disk, an edit, or a shard copied from another checkpoint); it cannot "
                         f"be resumed, sampled or exported: resume an earlier step")
    _verified[key] = want


def _load_shard(file, mmap=False, manifest=None):
    """A shard, checked: its bytes (_verify_bytes), its form, its step and run (those of its
    manifest), its numbers (_check_shard). manifest: its checkpoint's, read here unless given."""
    if manifest is None:
        try:
            manifest = read_manifest(os.path.dirname(file))
        except ValueError:
            manifest = {}
    what = paths.describe(file)
    if what or not os.path.isfile(file) or not zipfile.is_zipfile(file):  # said as such, not as a checksum
        raise ValueError(f"checkpoint shard {file} is missing, truncated or corrupt: " + (
            f"it is {what}" if what else "no such file" if not os.path.isfile(file) else "not a complete archive"))
    _verify_bytes(file, manifest)
    try:
        paths.regular_file(file, "checkpoint shard")
        shard = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # a truncated zip, a missing file, garbage: all the same to us
        raise ValueError(f"checkpoint shard {file} is missing, truncated or corrupt: {load_error(e)}") from None
    if not (isinstance(shard, dict) and isinstance(shard.get("coords"), dict) and isinstance(shard.get("chunks"), list)
            and isinstance(shard.get("pieces"), list) and isinstance(shard.get("rng"), dict)):
        raise ValueError(f"checkpoint shard {file} is malformed: not a shard this trainer writes")
    for field, own in (("step", "step"), ("run", "run_id")):
        if own in manifest and field in shard and shard[field] != manifest[own]:
            raise ValueError(f"checkpoint shard {file} is of {field} {_short(shard[field])}, and its manifest of "
                             f"{own.replace('_', ' ')} {manifest[own]!r}: a shard of another save was put in this "
                             f"checkpoint; it cannot be resumed, sampled or exported")
    _check_shard(file, shard, manifest.get("step"))
    return shard


def load_error(error):
    """What torch.load's error says, without its advice to load the file with weights_only=False
    (which would run whatever code the file holds): for a pickle of Python objects, the object."""
    text = str(error).strip()
    if "weights_only" not in text:
        return text.splitlines()[0] if text else type(error).__name__
    named = re.search(r"(?:GLOBAL|global|Unsupported class) ([\w.]+)", text)
    return (f"it holds Python objects besides tensors ({named[1] if named else 'an object weights_only loading refuses'}), "
            f"which a file of weights never holds, so it is not loaded")


# The largest magnitude every training dtype holds (bfloat16's, just below float32's): a float64
# number beyond it is finite in a file and inf once a run casts it.
LARGEST = torch.finfo(torch.bfloat16).max


def unusable(t):
    """What makes the floating-point tensor t unusable as weights or optimizer state, as a phrase:
    NaN or inf values, or values inf once cast to a training dtype; "" if nothing."""
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        return f"holds {bad} non-finite value{'s' if bad > 1 else ''} (NaN or inf) of {t.numel()}"
    big = int((t.abs() > LARGEST).sum())
    if big:
        return (f"holds {big} value{'s' if big > 1 else ''} larger than {LARGEST:.4g} in magnitude, which "
                f"become{'' if big > 1 else 's'} inf in float32 or bfloat16")
    return ""


def _rng_problem(rng):
    """What is wrong with a shard's random streams (the sizes torch's generators take), or None."""
    size = torch.get_rng_state().numel()
    tracked = rng.get("tracked")
    streams = [("cpu", rng.get("cpu"))] + [("tracked", t) for t in (tracked if isinstance(tracked, list) else [tracked])]
    for name, t in streams:
        if not (torch.is_tensor(t) and t.dtype == torch.uint8 and t.dim() == 1):
            return f"its {name} random stream is {type(t).__name__ if not torch.is_tensor(t) else t.dtype}, not a byte tensor"
        if (name == "cpu" or rng.get("device", "cpu") == "cpu") and t.numel() != size:
            return f"its {name} random stream holds {t.numel()} bytes, where a CPU generator's state is {size}"
    cuda = rng.get("cuda")
    if cuda is not None and not (torch.is_tensor(cuda) and cuda.dtype == torch.uint8 and cuda.dim() == 1):
        return "its cuda random stream is not a byte tensor"
    return None


def _check_shard(file, shard, step=None):
    """Refuse a shard whose numbers cannot be trained on: every weight and every piece of AdamW's
    state a floating-point tensor of finite values, the second moments (exp_avg_sq) not negative,
    the step count at least 0. Found here, at load, not as every step skipped or a save refused
    after the run."""
    def refuse(what, why):
        raise ValueError(f"checkpoint shard {file}: {what} {why}; a checkpoint holds only finite floating-point "
                         f"numbers, so this one cannot be resumed, sampled or exported (resume an earlier step)")

    def numbers(what, t):
        if not torch.is_tensor(t) or not (t.is_floating_point() or what.startswith("AdamW's step")):
            refuse(what, f"is {type(t).__name__ if not torch.is_tensor(t) else t.dtype}, not a floating-point tensor")
        why = unusable(t) if t.is_floating_point() else ""
        if why:
            refuse(what, why)

    for c, chunk in enumerate(shard["chunks"]):
        if not isinstance(chunk, dict):
            raise ValueError(f"checkpoint shard {file} is malformed: chunk {c} is not a dict of weights")
        for name, t in chunk.items():
            numbers(f"the weight {name}", t)
    for piece in shard["pieces"]:
        if not (isinstance(piece, (list, tuple)) and len(piece) == 5 and isinstance(piece[1], str)
                and isinstance(piece[4], dict) and all(isinstance(x, int) for x in piece[2:4]) and piece[3] >= piece[2]):
            raise ValueError(f"checkpoint shard {file} is malformed: an optimizer piece is not (chunk, name, start, "
                             f"end, state)")
        name, start, end, state = piece[1:]
        for key, t in state.items():
            numbers(f"AdamW's {key} of {name}", t)
            if key != "step" and t.numel() != end - start:
                raise ValueError(f"checkpoint shard {file} is malformed: AdamW's {key} of {name} has {t.numel()} "
                                 f"values for the {end - start} elements {start} to {end} it is the state of")
            if key in ("exp_avg_sq", "step") and bool((t < 0).any()):
                refuse(f"AdamW's {key} of {name}", "is negative (a sum of squares, or a count, cannot be)")
            if key == "step" and step is not None and (t.numel() != 1 or float(t) != int(float(t)) or float(t) > step):
                raise ValueError(f"checkpoint shard {file}: AdamW's step count of {name} is {t.flatten()[:1].tolist()}, "
                                 f"in a checkpoint of step {step}: a count of the optimizer's steps is a whole number "
                                 f"no larger than the steps done, so a resume would not continue this run; resume "
                                 f"an earlier step")
    why = _rng_problem(shard["rng"])
    if why:
        raise ValueError(f"checkpoint shard {file} is malformed: {why}; it cannot be resumed")


def read_checkpoint(path, cfg=None, tc=None):
    """(manifest, full parameters, full optimizer state per parameter name) from any layout. With
    cfg and tc, refuses a checkpoint of another model or another batch, naming what differs."""
    manifest = read_manifest(path, cfg, tc)
    lay = manifest["layout"]
    meta = model_parameters(manifest)
    params, states = {}, {}  # name -> {shard index: shard}; name -> {shard index: {key: flat shard}}
    count = {}  # name -> how many shards it has: tp, or (07's vocabulary shard) its own group's size
    for r in range(manifest["world"]):
        file = os.path.join(path, f"rank_{r:05d}.pt")
        shard = _load_shard(file, manifest=manifest)
        try:
            splits = shard.get("splits", {})
            for chunk in shard["chunks"]:
                for name, value in chunk.items():
                    count[name], t = splits.get(name, (lay["tp"], shard["coords"]["tp"]))
                    params.setdefault(name, {})[t] = value
            for c, name, start, end, state in shard["pieces"]:
                # Shaped like the parameter's shard on this tp rank, which replica 0 (a lower rank,
                # read earlier) wrote even when this file is a ZeRO-1 replica's without weights.
                t = splits.get(name, (lay["tp"], shard["coords"]["tp"]))[1]
                local = params[name][t]
                flat = states.setdefault(name, {}).setdefault(t, {})
                for key, value in state.items():
                    if value.dim() == 0:  # the step counter
                        flat[key] = value
                        continue
                    flat.setdefault(key, torch.zeros(local.numel(), dtype=value.dtype))[start:end] = value
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as e:
            raise ValueError(f"checkpoint shard {file} is malformed: {type(e).__name__} {e}") from None
    missing = sorted(set(meta) - set(params))
    if missing or any(set(shards) != set(range(count[n])) for n, shards in params.items()):
        raise ValueError(f"the checkpoint {path} is incomplete: its shards lack {missing[:3] or 'some tp ranks'}")
    try:
        full = {n: tensor_parallel.join_shards([shards[t] for t in range(count[n])], meta[n])
                for n, shards in params.items()}
        full_state = {}
        for name, by_rank in states.items():
            shape = params[name][0].shape
            keys = by_rank[0].keys()
            full_state[name] = {k: by_rank[0][k] if by_rank[0][k].dim() == 0 else tensor_parallel.join_shards(
                [by_rank[t][k].view(shape) for t in range(count[name])], meta[name]) for k in keys}
    except (KeyError, RuntimeError, ValueError) as e:
        raise ValueError(f"the checkpoint {path} does not fit its manifest: {type(e).__name__} {e}") from None
    bad = [n for n, t in full.items() if t.shape != meta[n].shape]
    if bad:
        raise ValueError(f"the checkpoint {path} does not fit its manifest: {bad[0]} is {tuple(full[bad[0]].shape)}, "
                         f"not {tuple(meta[bad[0]].shape)}")
    return manifest, full, full_state


def resume(run, path, say=print):
    """05's --resume: load `path` (preflight's newest complete checkpoint) if there is one, and say so."""
    if path:
        say(f"resumed from {path}: {load_checkpoint(run, path, say)} steps done")
    elif run.tc.resume:
        say(f"no complete checkpoint in {run.tc.resume}: starting from step 0")


def load_checkpoint(run, path, say=print):
    """Load path into this run, whatever layout wrote it; returns the number of steps done. In the
    layout that wrote it, each rank reads only its own shard (and, for the weights a replica does
    not write, its replica 0's): 2 files at most, not every rank's."""
    here = _layout(run)
    manifest = read_manifest(path, run.cfg, run.tc)
    own = _load_own_shards(run, path) if manifest["layout"] == here and manifest["world"] == run.env.world_size else None
    if own is None:
        own = _load_resharded(run, path, manifest, here)
    device = run.env.device
    if own and own["rng"].get("device", "cpu") == device.type:  # the same streams, continued
        torch.set_rng_state(own["rng"]["cpu"])
        tracked = own["rng"]["tracked"]
        run.chunks[0].rng.state = (tracked[0] if isinstance(tracked, list) else tracked).to(run.chunks[0].rng.state.device)
        if own["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(own["rng"]["cuda"], device)
    else:  # another layout or device: the streams cannot be mapped, so both restart from (seed, step)
        lay = manifest["layout"]
        pp_rank, seed = dist.get_rank(run.groups.pp), run.tc.seed + 7919 * manifest["step"]
        torch.manual_seed(seed + 100 * pp_rank)
        run.chunks[0].rng.state = tensor_parallel.TPRandom(seed + 100 * pp_rank, dist.get_rank(run.groups.tp), device).state
        why = f"from {lay} to {here}" if own is None else f"from {own['rng'].get('device')} to {device.type}"
        say(f"resharded {path} {why}; dropout streams, default and tracked, reseeded from the step")
    return manifest["step"]


def _set_piece(piece, state):
    """One optimizer piece's saved state (its AdamW moments, its fp32 master) into this run."""
    state = dict(state)
    if "master" in state:
        piece.master.data.copy_(state.pop("master"))
    elif piece.master is not piece.weights:  # bf16 now, not before: the master starts from the weights
        piece.master.data.copy_(piece.weights.float())
    dev, dtype = piece.master.device, piece.master.dtype  # the moments follow this run's dtype
    return {k: v.to(dev, dtype).clone() if v.dim() else v.clone() for k, v in state.items()}


def _load_own_shards(run, path):
    """Same layout: each weight from the shard of its first replica (which wrote it for every replica: over
    dp, or over the parameter's own .replica_group), the optimizer pieces from the shard that holds them (its
    own with ZeRO-1, else that first replica's), the random streams from its own. Returns its own shard, or
    None if the pieces do not match (another --bucket-numel cuts the buffer otherwise): then every shard is
    read and split anew."""
    tp, pp, rank = dist.get_rank(run.groups.tp), dist.get_rank(run.groups.pp), run.env.rank
    files = {}

    def shard(r):  # rank r's file, read once
        if r not in files:
            files[r] = _load_shard(os.path.join(path, f"rank_{r:05d}.pt"))
        return files[r]

    first = lambda p: dist.get_global_rank(getattr(p, "replica_group", run.groups.dp), 0)  # noqa: E731
    own, base = shard(rank), shard(dist.get_global_rank(run.groups.dp, 0))  # base: replica 0 of this (tp, pp) place
    if base.get("coords") != dict(tp=tp, dp=0, pp=pp) or len(base["chunks"]) != len(run.chunks):
        return None
    owner = {id(p): n for chunk in run.chunks for n, p in chunk.named_parameters()}
    source = [rank if run.tc.zero1 else first(piece.param) for piece in run.opt.pieces]  # the file of each piece
    saved = {r: {(name, start, end): state for _, name, start, end, state in shard(r)["pieces"]} for r in set(source)}
    keys = [(owner[id(piece.param)], piece.weights.storage_offset() - run.ddp.offsets[piece.param]) for piece in run.opt.pieces]
    keys = [(n, start, start + piece.weights.numel()) for (n, start), piece in zip(keys, run.opt.pieces)]
    if any(k not in saved[r] for k, r in zip(keys, source)) and any(saved.values()):
        return None
    with torch.no_grad():
        for c, chunk in enumerate(run.chunks):
            for n, p in chunk.named_parameters():
                held = shard(first(p))["chunks"]
                weight = held[c].get(n) if len(held) == len(run.chunks) else None
                if weight is None or weight.shape != p.shape:
                    held = tuple(weight.shape) if weight is not None else "nothing"
                    raise ValueError(f"checkpoint {path}: the shard of rank {first(p)} holds {n} as {held}, not "
                                     f"{tuple(p.shape)}: it does not fit its manifest")
                p.copy_(weight)
    for key, r, piece in zip(keys, source, run.opt.pieces):
        if saved[r].get(key):
            run.opt.optimizer.state[piece.master] = _set_piece(piece, saved[r][key])
    return own


def _load_resharded(run, path, manifest, here):
    """Another layout: every shard read, each tensor joined to its full shape, then split for this
    run. Returns this rank's own shard when the layout is the same after all, else None."""
    manifest, full, full_state = read_checkpoint(path, run.cfg, run.tc)
    for c in run.chunks:
        c.load_full_state_dict(full)
    owner = {id(p): n for chunk in run.chunks for n, p in chunk.named_parameters()}
    for piece in run.opt.pieces:
        state = full_state.get(owner[id(piece.param)])
        if not state:
            continue  # saved before the first optimizer step
        start, n = piece.weights.storage_offset() - run.ddp.offsets[piece.param], piece.weights.numel()
        split = split_of(piece.param, run.groups.tp)  # tp, or 07's vocabulary group
        mine = {k: v if v.dim() == 0 else tensor_parallel.split_full(v, piece.param, *split).reshape(-1)[start:start + n]
                for k, v in state.items()}
        run.opt.optimizer.state[piece.master] = _set_piece(piece, mine)
    same = manifest["layout"] == here and manifest["world"] == run.env.world_size
    return _load_shard(os.path.join(path, f"rank_{run.env.rank:05d}.pt")) if same else None
