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
    shown(text), printable(message)  text from a file, printed with its control characters escaped
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


REPOSITORY = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # this package's checkout


def refuse_source_directory(path, flag):
    """Refuse a directory (links followed) inside this repository that holds its Python source: a
    checkpoint or an export there would lie among the code (and a later --keep rotation, a clean-up,
    or a `git clean` would act beside it). A subdirectory of its own (ckpt/) is fine."""
    real = os.path.realpath(path)
    if not os.path.isdir(real) or not (real == REPOSITORY or _inside(real, REPOSITORY)):
        return
    source = sorted(n for n in os.listdir(real) if n.endswith(".py") and os.path.isfile(os.path.join(real, n)))
    if source:
        raise ValueError(f"{flag} {path}: it is a directory of this repository's source (it holds "
                         f"{', '.join(source[:3])}{', ...' if len(source) > 3 else ''}); give a directory of its own, "
                         f"such as {os.path.join(path, 'ckpt')}")


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
        if writer and flag not in own and not overwrite and os.path.lexists(path) and not _claimed_file(path):
            raise ValueError(f"{flag} {path}{via} already exists, and this run did not write it: give "
                             f"--overwrite to replace it, or another path")


def fresh(path):
    """path, with whatever was there removed (check_outputs allowed replacing it): the file written
    next is a new one, so a link at path is replaced rather than followed, and a file with a second
    name (a hard link) elsewhere keeps its contents there. A file this run made when it claimed the
    path (claim) is its own already, and stays."""
    made = _claimed_file(path)
    if made and _claimed[made[1]][3]:
        return path
    if os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)
    return path


def shown(value):
    """A string that came from a file (a manifest's field, a name in a config), as a message prints it:
    as it is when every character is printable, else quoted with its control characters escaped
    (repr), so that a file cannot move the cursor, clear the screen or retitle the terminal."""
    text = str(value)
    return text if text.isprintable() else repr(text)


def printable(text):
    """A whole message with every control character but newline and tab escaped (C0, DEL and C1:
    an escape sequence from a file, or from the side channel, prints as its escape, never acts)."""
    return "".join(c if c in "\n\t" or c.isprintable() or not _control(c) else repr(c)[1:-1] for c in str(text))


def _control(c):
    code = ord(c)
    return code < 0x20 or 0x7F <= code <= 0x9F


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


_claimed = {}  # realpath of an output -> (its fd, flocked, inode, made here): claimed at check time


def claim(path, name):
    """Claim the output at path for this run when its checks pass, so that a second run started at the
    same moment cannot pass them too (issue 48: two runs on one new --metrics lost one's lines): a
    file that is not there is made now (O_EXCL: of two runs, one makes it and the other is refused);
    one that is (this run's own, or --overwrite) is locked. Either way an exclusive flock on it, held
    by this process and its forked ranks, refuses a second run naming its pid. create_new then opens
    the claimed file itself; release_claims removes one made here that a refused run never wrote."""
    import fcntl
    key = os.path.realpath(path)
    if key in _claimed:
        return
    made = not os.path.lexists(path)
    try:
        fd = os.open(path, os.O_WRONLY | _NOFOLLOW | (os.O_CREAT | os.O_EXCL if made else 0), 0o644)
    except FileExistsError:
        raise ValueError(f"{name} {path} already exists: another run made it just now, and this run did not "
                         f"write it; give another path") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            holder = _lock_holder(key)
            raise ValueError(f"{name} {path}: another run{f' (pid {holder})' if holder else ''} is writing it; two "
                             f"runs would interleave or lose each other's lines: give another path") from None
        locked = False  # no locks on this filesystem: the O_EXCL above is the only guard
    else:
        locked = True
    _claimed[key] = (fd, locked, os.fstat(fd).st_ino, made)


def release_claims():
    """A refused run's claimed outputs: each that it made and never wrote (empty, still the same
    file) removed, every lock let go. run_main calls it on a refusal."""
    for key, (fd, _, inode, made) in list(_claimed.items()):
        try:
            st = os.stat(key, follow_symlinks=False)
            if made and st.st_ino == inode and st.st_size == 0:
                os.unlink(key)
        except OSError:
            pass
        try:
            os.close(fd)
        except OSError:
            pass
        del _claimed[key]


def _claimed_file(path):
    """(fd, entry key) of the claim on path when it still names the claimed file, else None."""
    key = os.path.realpath(path)
    entry = _claimed.get(key)
    if entry is None:
        return None
    try:
        same = os.stat(path, follow_symlinks=False).st_ino == entry[2]
    except OSError:
        same = False
    return (entry[0], key) if same else None


def create_new(path, mode="wb"):
    """Open a new file at path for writing ("w" or "wb"): created here (O_CREAT | O_EXCL, which
    never opens a file or a link that is there) and never through a link (O_NOFOLLOW). Mode "a" or
    "ab" appends to the file at path (a run's own earlier metrics), refusing a link there all the
    same. Every file a run writes is opened so, or written so and renamed over its name."""
    append = mode.startswith("a")
    claimed = _claimed_file(path)
    if claimed:  # this run's claim (claim): the file it made, or locked, at check time
        fd = os.dup(claimed[0])
        if not append:
            os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_END)
        return open(path, mode, opener=lambda name, _: fd)
    flags = os.O_WRONLY | _NOFOLLOW | (os.O_APPEND | os.O_CREAT if append else os.O_CREAT | os.O_EXCL)
    f = open(path, mode, opener=lambda name, _: os.open(name, flags, 0o644))  # a file named by its path
    key = os.path.realpath(path)
    if key in _claimed:  # the claim was on the file this one replaced (--overwrite): it moves to the new one
        import fcntl
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
        old_fd = _claimed[key][0]
        _claimed[key] = (os.dup(f.fileno()), True, os.fstat(f.fileno()).st_ino, False)
        os.close(old_fd)
    return f


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
