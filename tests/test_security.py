"""The fourth hostile pass (issue 48): security, checksums, --resume that finds nothing, concurrency and
the library's own misuse. Each attack has a row here (or in tests/test_bad_input.py's FOURTH table,
which shares that file's checkpoint) that failed before and passes now.

Security first: the local launcher's store and every gloo group listen on loopback only, and nothing
a process outside the job writes into the store (it is reachable by every local process) makes a
rank write a file anywhere. Most rows are in-process: a refusal costs milliseconds, not a run.
"""
import hashlib
import os
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT
from plumbing import launch as launching
from plumbing import watch
from plumbing.launch import RankFailure, Watch, launch

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


# ----------------------------------------------------------------------------------------------
# 1. The local launcher: nothing listens beyond loopback; no path is taken from the store


def _socket_inodes(pid):
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _job_pids():
    """This rank's launching process and every process it started (the ranks)."""
    parent = os.getppid()
    pids = {parent}
    for task in os.listdir(f"/proc/{parent}/task"):
        try:
            with open(f"/proc/{parent}/task/{task}/children") as f:
                pids |= {int(p) for p in f.read().split()}
        except OSError:
            pass
    return pids


LOOPBACK = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def listening(pids):
    """[(address hex, port, inode)] of every TCP socket in LISTEN state that one of pids holds."""
    mine = set().union(*(_socket_inodes(p) for p in pids))
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in mine:
                    address, port = local.split(":")
                    out.append((address, int(port, 16), inode))
    return out


def _listening_while_running(env):
    group = dist.new_group(backend="gloo")  # a group made later, as the Saver's is
    dist.barrier(group)
    side = launching.side_channel()  # the watch's client
    side.set("probe", "1")
    found = listening(_job_pids()) if env.rank == 0 else None
    dist.barrier(group)
    return found


@LINUX
def test_a_local_runs_store_and_groups_listen_on_loopback_only():
    found = launch(_listening_while_running, 2, timeout_s=20, deadline_s=60)[0]
    assert len(found) >= 3, found  # the store, and each rank's gloo listener at least
    assert [f for f in found if f[0] not in LOOPBACK] == [], found


def _outsider_sets_every_key(env, victim, link):
    """Every rank runs its heartbeat; rank 0, as a process outside the job would, sets every key the
    job reads: the stacks' request (as the old path), records, stacks, the side channel's peers."""
    recorder = watch.Recorder(env.rank)
    beat = watch.Heartbeat(launching.side_channel(), recorder)
    beat.start()
    dist.barrier()
    if env.rank == 0:
        outsider = dist.TCPStore("127.0.0.1", launching._side[1], is_master=False, wait_for_workers=False)
        for key, value in [(watch.DUMP_KEY, victim), (watch.DUMP_KEY, link), (watch.KEY.format(0), "not json"),
                           (watch.KEY.format(1), '{"beat": "x"}'), (watch.STACK_KEY.format(0), "forged"),
                           (launching.HOST_KEY.format(socket.gethostname()), "0:1:x;garbage;"),
                           (launching.GONE_KEY, "\x1b[2J"), (launching.VICTIMS_KEY, "0;1;"),
                           (f"save/{victim}/2/0", "done")]:
            outsider.set(key, value)
            if key == watch.DUMP_KEY:  # each request seen by every heartbeat before the next
                time.sleep(3 * watch.BEAT_S)
    time.sleep(3 * watch.BEAT_S)
    dist.barrier()
    beat.stopped.set()
    beat.join()
    return True


@LINUX
def test_no_key_an_outside_process_sets_makes_a_rank_write_outside_the_runs_own_directories(tmp_path):
    victim, planted = tmp_path / "victim", tmp_path / "planted"
    victim.mkdir()
    planted.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (planted / "rank0.txt").symlink_to(target)
    (planted / "rank1.txt").symlink_to(target)
    before = sorted(os.listdir(tempfile_dir())), _tree(tmp_path)
    assert launch(_outsider_sets_every_key, 2, str(victim), str(planted), timeout_s=20, deadline_s=60,
                  watch=Watch(30.0, str)) == [True, True]
    assert _tree(tmp_path) == before[1]  # nothing written into either directory, nothing through a link
    assert target.read_text() == "keep me"
    made = set(os.listdir(tempfile_dir())) - set(before[0])
    assert not [m for m in made if m.startswith("hang-")], made


def tempfile_dir():
    import tempfile
    return tempfile.gettempdir()


def _tree(root):
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            out[path] = ("-> " + os.readlink(path)) if os.path.islink(path) else \
                hashlib.sha256(open(path, "rb").read()).hexdigest() if os.path.isfile(path) else "dir"
    return out


def test_the_hang_reports_stacks_go_into_a_new_private_directory_never_a_planted_one(tmp_path):
    """The watchdog writes the stacks the ranks sent, into a directory mkdtemp makes (mode 0700), each
    file created anew: a directory or a link planted under the old predictable name is never used."""
    class Store(dict):
        def set(self, k, v):
            self[k] = v.encode() if isinstance(v, str) else v

        def get(self, k):
            return self[k]

        def check(self, keys):
            return all(k in self for k in keys)

    store = Store()
    for r in range(2):
        store.set(watch.STACK_KEY.format(r), f"stack of rank {r}")
    planted = tmp_path / f"hang-{os.getpid()}-{int(time.time())}"
    planted.mkdir()
    (planted / "rank0.txt").symlink_to(tmp_path / "victim")
    dog = watch.Watchdog(store, 2, 1.0, parent=str(tmp_path))
    assert dog._write_stacks() == [0, 1]
    assert os.path.dirname(dog.dump_dir) == str(tmp_path) and dog.dump_dir != str(planted)
    assert os.stat(dog.dump_dir).st_mode & 0o777 == 0o700
    assert open(os.path.join(dog.dump_dir, "rank1.txt")).read() == "stack of rank 1"
    assert not (tmp_path / "victim").exists()
    with pytest.raises(FileExistsError):  # a file made anew, never one (or a link) that was there
        watch.write_new(os.path.join(dog.dump_dir, "rank1.txt"), b"again")


# ----------------------------------------------------------------------------------------------
# 6. The library: launch() says what it cannot do


def _returns_a_lambda(env):
    return {"loss": 1.0, "callback": lambda: None}


def _nests(env):
    return launch(_returns_a_lambda, 1)


def test_an_unpicklable_result_is_named_by_its_place_not_a_pasted_traceback():
    with pytest.raises(RankFailure) as e:
        launch(_returns_a_lambda, 1, timeout_s=20, deadline_s=60)
    text = str(e.value)
    assert "the result of _returns_a_lambda cannot be sent back to the launching process: the result['callback'] " \
           "is a builtins.function" in text and "Traceback" not in text, text


def test_a_nested_launch_is_refused_by_name():
    with pytest.raises(RankFailure) as e:
        launch(_nests, 1, timeout_s=20, deadline_s=60)
    assert "launch('_returns_a_lambda', 1) was called inside a rank that launch() (or torchrun) started: launches " \
           "do not nest" in str(e.value) and "Traceback" not in str(e.value), str(e.value)
