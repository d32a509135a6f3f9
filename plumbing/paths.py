"""The files a run reads and writes, checked against each other before anything is written, with
nothing heavier than the standard library (scripts/prepare_data.py and plot_metrics.py use it too).

    describe(path)                   what is at path when it is not a regular file ("a FIFO", "a
                                     directory", ...), or None
    regular_file(path, name)         refuse an input that is not a regular file, naming it: a FIFO
                                     or a device would block or never end
    check_outputs(writes, reads, ...) every output resolved (symlinks followed) and refused if it is
                                     one of the run's inputs, another output, lies inside a
                                     checkpoint, is not a regular file, or would replace a file
                                     this run did not write without --overwrite
    lock_save_dir(root)              one run at a time saves into a directory (an flock on it,
                                     released when the run's processes exit)
    create_new(path, mode)           open a new file exclusively, never through a link (O_EXCL,
                                     O_NOFOLLOW): how every output is opened
    fresh(path)                      the name of a new file: what was at path (a file allowed to
                                     be replaced, or a link) removed, so that writing never goes
                                     through a link or a second name (a hard link) into another file
    looks_like_metrics(path), looks_like_trace(path)   a file an earlier part of this run wrote

The rule (issue 28): a run never replaces a file it did not create unless the user says so
(--overwrite), and never writes over what it reads, whatever the flag.
"""
import errno
import json
import os
import re
import stat

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (a named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def describe(path):
    """None for a regular file or nothing at all; else what is there, in words (links followed)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((words for test, words in _KINDS if test(mode)), None)


def regular_file(path, name):
    """Refuse an input that exists but is not a regular file: reading a FIFO waits for a writer,
    a device never ends. name: what the user called it ("--data", "the sidecar of --data x.bin")."""
    what = describe(path)
    if what:
        raise ValueError(f"{name} {path}: it is {what}, not a regular file; give a file")


def _same(a, b):
    """One file: the same path once links are followed, or (both existing) the same inode."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _inside(path, folder):
    real, top = os.path.realpath(path), os.path.realpath(folder)
    return real != top and os.path.commonpath([real, top]) == top


def is_checkpoint(folder):
    """A directory 05's Saver wrote (or is writing): its manifest and rank 0's shard."""
    return os.path.isfile(os.path.join(folder, "manifest.json")) or \
        os.path.isfile(os.path.join(folder, "rank_00000.pt"))


def enclosing_checkpoint(path):
    """The checkpoint directory path lies in (links followed), or None."""
    folder = os.path.dirname(os.path.realpath(path))
    while True:
        if is_checkpoint(folder):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def check_outputs(writes, reads=(), protected=(), overwrite=False, own=(), writer=True):
    """Refuse, before anything is written, every output that would destroy something.

    writes: [(flag, path)] the files this run writes; reads: [(flag, path)] the files it reads;
    protected: [(flag, folder, pattern)]: no output may lie in folder (pattern None) or in an entry
    of it whose name matches pattern (a --save directory's step_N); own: the flags whose existing
    file is this run's own (a resumed run's metrics). Every path is resolved, links followed.
    writer: this process writes the outputs; only it asks whether a file is already there (another
    rank may see one that the writer has just made), and any file there, empty or not, needs
    --overwrite."""
    outputs = [(flag, path) for flag, path in writes if path]
    for i, (flag, path) in enumerate(outputs):
        real = os.path.realpath(path)
        via = f" (a link to {real})" if real != os.path.abspath(path) else ""
        for other, other_path in outputs[:i]:
            if _same(path, other_path):
                raise ValueError(f"{other} {other_path} and {flag} {path} are the same file{via}: "
                                 f"give each its own path")
        for source, source_path in reads:
            if source_path and _same(path, source_path):
                raise ValueError(f"{flag} {path}{via} would overwrite {source} {source_path}, which this "
                                 f"run reads: give {flag} another path")
        for source, folder, pattern in protected:
            top = os.path.realpath(folder)
            if not _inside(real, top):
                continue
            first = os.path.relpath(real, top).split(os.sep)[0]
            if pattern is None:
                raise ValueError(f"{flag} {path}{via} lies inside {source} {folder}, which this run reads: "
                                 f"a run never writes into a checkpoint; give {flag} another path")
            if re.fullmatch(pattern, first):
                raise ValueError(f"{flag} {path}{via} lies where {source} {folder} writes its checkpoints "
                                 f"({first}): give {flag} another path")
        checkpoint = enclosing_checkpoint(path)
        if checkpoint:
            raise ValueError(f"{flag} {path}{via} lies inside the checkpoint {checkpoint}: a run never "
                             f"writes into a checkpoint; give {flag} another path")
        what = describe(real)
        if what:
            raise ValueError(f"{flag} {path}{via}: it is {what}; give a file name")
        if writer and flag not in own and not overwrite and os.path.lexists(path):
            raise ValueError(f"{flag} {path}{via} already exists, and this run did not write it: give "
                             f"--overwrite to replace it, or another path")


def fresh(path):
    """path, with whatever was there removed (check_outputs allowed replacing it): the file written
    next is a new one, so a link at path is replaced rather than followed, and a file with a second
    name (a hard link) elsewhere keeps its contents there."""
    if os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)
    return path


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def create_new(path, mode="wb"):
    """Open a new file at path for writing ("w" or "wb"): created here (O_CREAT | O_EXCL, which
    never opens a file or a link that is there) and never through a link (O_NOFOLLOW). Mode "a" or
    "ab" appends to the file at path (a run's own earlier metrics), refusing a link there all the
    same. Every file a run writes is opened so, or written so and renamed over its name."""
    append = mode.startswith("a")
    flags = os.O_WRONLY | _NOFOLLOW | (os.O_APPEND | os.O_CREAT if append else os.O_CREAT | os.O_EXCL)
    fd = os.open(path, flags, 0o644)
    try:
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def looks_like_metrics(path, lines=1):
    """Empty, or its first line is a JSON record with a step: 05's --metrics wrote it."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16).decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    try:
        return all(isinstance(r := json.loads(line), dict) and "step" in r for line in head[:lines] if line.strip())
    except ValueError:
        return False


def looks_like_trace(path):
    """A Chrome trace as plumbing/trace.py writes it (a JSON object opening with its events)."""
    try:
        with open(path, "rb") as f:
            return f.read(16) == b'{"traceEvents": '
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------
# One run at a time in a --save directory


_held = {}  # realpath of a --save directory -> its locked fd; forked ranks inherit it with the lock


def lock_save_dir(root, name="--save"):
    """Hold an flock on the directory root itself for the rest of this process and its forked
    children, or refuse naming the process that holds it: two runs saving into one directory would
    write over each other's steps. Nothing is written there; the lock goes with the processes that
    hold it, so a killed run leaves none behind; where the filesystem has no locks, nothing is
    checked."""
    import fcntl
    key = os.path.realpath(root)
    if key in _held:
        return
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise ValueError(f"{name} {root}: cannot open it ({e.strerror or e})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            holder = _lock_holder(key)
            raise ValueError(f"{name} {root}: another run{f' (pid {holder})' if holder else ''} is saving there; two "
                             f"runs in one directory would write over each other's checkpoints. Wait for it to end, "
                             f"or give {name} another directory") from None
        return  # no locks on this filesystem (ENOLCK, EOPNOTSUPP, NFS's EBADF): nothing to check with
    _held[key] = fd


def _lock_holder(path):
    """The pid holding an flock on path, from /proc/locks (Linux), or None."""
    try:
        inode = os.stat(path).st_ino
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
                    return int(fields[4])
    except (OSError, ValueError):
        pass
    return None
