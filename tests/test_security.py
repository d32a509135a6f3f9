"""The fourth hostile pass (issue 48): security, checksums, --resume that finds nothing, concurrency and
the library's own misuse. Each attack has a row here (or in tests/test_bad_input.py's FOURTH table,
which shares that file's checkpoint) that failed before and passes now.

Security first: the local launcher's store and every gloo group listen on loopback only, and nothing
a process outside the job writes into the store (it is reachable by every local process) makes a
rank write a file anywhere. Most rows are in-process: a refusal costs milliseconds, not a run.
"""
import dataclasses
import hashlib
import math
import os
import re
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, load
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


def _ring_on_rows(env, rows):
    cp = load("08_context_parallel")
    q = torch.zeros(1, 1, rows, 4)
    try:
        cp.ring_forward(q, q, q, cp.megatron(1), dist.group.WORLD)
    except ValueError as e:
        return str(e)


def test_08_refuses_a_sequence_its_split_does_not_divide_by_name():
    cp = load("08_context_parallel")
    with pytest.raises(ValueError, match=r"positions: T=15 tokens do not split into the megatron split's 4 equal "
                                         r"blocks \(cp=2\); T must be a multiple of 4"):
        cp.positions(cp.megatron(2), 0, 15)
    with pytest.raises(ValueError, match="positions: T=16 tokens do not split into the contiguous split's 3 equal"):
        cp.positions(cp.contiguous(3), 0, 16)
    q = torch.zeros(1, 2, 5, 4)  # 5 rows a rank, cp=2: T=10 over megatron(2)'s 4 blocks
    with pytest.raises(ValueError, match="ulysses_core: T=10 tokens do not split into the megatron split's 4"):
        cp.ulysses_core(cp.megatron(2), None, q, q, q, 0.0)
    with pytest.raises(ValueError, match="ulysses_core: q, k and v hold 5, 4 and 5 rows"):
        cp.ulysses_core(cp.megatron(2), None, q, q[:, :, :4], q, 0.0)
    said = launch(_ring_on_rows, 1, 7, timeout_s=20, deadline_s=60)[0]
    assert said == "ring_forward: rank 0's 7 rows do not split into its 2 blocks of the megatron split; T must be a " \
                   "multiple of 2", said
    assert cp.positions(cp.megatron(2), 1, 16).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # what divides is as before


def test_09_route_refuses_nan_logits_naming_the_weight_or_the_tokens():
    moe = load("09_expert_parallel")
    x, w = torch.randn(6, 8), torch.randn(4, 8)
    with pytest.raises(FloatingPointError, match=r"route: the router's logits hold NaN or inf \(from the tokens x"):
        moe.route(torch.where(torch.arange(8) == 3, torch.nan, x), w, 2)
    with pytest.raises(FloatingPointError, match=r"route: the router's logits hold NaN or inf \(from the router's weight"):
        moe.route(x, torch.where(torch.arange(8) == 0, torch.nan, w), 2)
    probs, weights, chosen = moe.route(x, w, 2)  # finite: routed as before
    assert torch.allclose(weights.sum(-1), torch.ones(6)) and chosen.shape == (6, 2)


def test_max_rel_diff_counts_equal_entries_as_no_difference_infinities_included_and_nan_as_one():
    from plumbing.shards import max_rel_diff
    a = torch.tensor([1.0, float("inf"), -float("inf"), 2.0])
    assert max_rel_diff(a, a.clone()) == 0.0
    assert max_rel_diff(torch.empty(0, 3), torch.empty(0, 3)) == 0.0
    assert math.isnan(max_rel_diff(torch.tensor([1.0, math.nan]), torch.tensor([1.0, math.nan])))
    assert math.isnan(max_rel_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, math.nan])))
    assert max_rel_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("inf")])) == math.inf
    assert max_rel_diff(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 2.0])) == 0.5  # as before


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo this ran",))


def test_a_pickle_payload_is_refused_naming_the_object_without_torchs_advice_to_load_it_anyway(tmp_path):
    from plumbing import checkpoint, gpt2
    pt, shard = tmp_path / "model.pt", tmp_path / "rank_00000.pt"
    for file in (pt, shard):
        torch.save({"w": torch.zeros(2), "x": _Payload()}, file)
    for call in (lambda: gpt2.import_gpt2(str(pt)), lambda: checkpoint._load_shard(str(shard))):
        with pytest.raises(ValueError) as e:
            call()
        text = str(e.value)
        assert "it holds Python objects besides tensors (posix.system), which a file of weights never holds, so " \
               "it is not loaded" in text, text
        assert "weights_only" not in text and "arbitrary code" not in text, text


def test_saving_or_exporting_into_the_repositorys_own_source_is_refused(tmp_path):
    from dataclasses import replace
    from plumbing import checks, gpt2
    gpt3d = load("05_3d_gpt")
    for folder in (str(ROOT), str(ROOT / "plumbing"), os.path.relpath(ROOT / "tests")):
        with pytest.raises(ValueError, match=f"--save {re.escape(folder)}: it is a directory of this repository's "
                                             f"source \\(it holds .*\\.py"):
            checks.check_paths(replace(gpt3d.TrainConfig(), save=folder))
        with pytest.raises(ValueError, match=f"--export-hf {re.escape(folder)}: it is a directory of this repository"):
            gpt2.export_checkpoint(_a_checkpoint(tmp_path), hf_dir=folder)
    assert not [n for n in os.listdir(ROOT) if n.startswith(".write_test")]


def _a_checkpoint(tmp_path):
    """A directory that passes for a checkpoint up to the export's output checks: a manifest of no extension."""
    import json
    folder = tmp_path / "step_00000000"
    folder.mkdir(exist_ok=True)
    cfg = load("01_tensor_parallel").GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=1, n_embd=4)
    json.dump(dict(step=0, model=dataclasses.asdict(cfg), world=1, layout=dict(tp=1, pp=1, dp=1, v=1),
                   train=dict(batch_size=1, seq_len=8)), open(folder / "manifest.json", "w"))
    return str(folder)


# ----------------------------------------------------------------------------------------------
# 7. The third pass's leftovers: the model's sizes, a GPU where there is none, data truncated mid-run


@pytest.mark.parametrize("field,value", [("block_size", -1), ("n_layer", 0), ("n_embd", -16), ("vocab_size", 2.5)])
def test_a_gpt_config_size_below_one_is_refused_naming_the_field(field, value):
    tensor_parallel = load("01_tensor_parallel")
    cfg = tensor_parallel.GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=1, n_embd=4)
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field}={value!r} must be a whole number, at least 1"):
        tensor_parallel.init_state_dict(dataclasses.replace(cfg, **{field: value}), 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="says there is no GPU: needs a machine without one")
def test_a_cuda_device_without_a_gpu_is_a_sentence_saying_so():
    tensor_parallel = load("01_tensor_parallel")
    cfg = tensor_parallel.GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=1, n_embd=4)
    with pytest.raises(ValueError, match=r"device='cuda': this machine has no GPU that torch can use"):
        tensor_parallel.GPT(cfg, device="cuda")


def test_a_data_file_truncated_mid_run_is_named_on_the_reports_first_line(tmp_path):
    from plumbing import data
    file = tmp_path / "d.bin"
    file.write_bytes(bytes(2 * 1000))
    tokens = data.TokenFile(str(file), 1000)
    os.truncate(file, 100)
    with pytest.raises(ValueError) as e:
        tokens[900:950]
    failures = {7: f"ValueError: {e.value} (raised at data.py:184)\n",
                0: "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234\n"}
    first = launching._failure_report(failures, set(), []).splitlines()[0]
    assert first.startswith(f"rank 7 failed: ValueError: --data {file}: the file is 100 bytes now, shorter than"), first


# ----------------------------------------------------------------------------------------------
# 5. Concurrency: an output claimed at check time; a checkpoint read under a shared lock


def _in_another_process(call):
    """call() in a forked process (another run): what it raised, as text, or "" if nothing."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        from plumbing import paths
        paths._claimed.clear()  # another run knows nothing of this one's claims (their locks stay, inherited)
        try:
            call()
            said = ""
        except Exception as e:
            said = f"{type(e).__name__}: {e}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    os.waitpid(pid, 0)
    return said


def test_two_runs_on_one_new_metrics_file_one_is_refused_at_its_checks_and_no_line_is_lost(tmp_path):
    from dataclasses import replace
    from plumbing import checks, paths
    gpt3d = load("05_3d_gpt")
    metrics = str(tmp_path / "m.jsonl")
    tc = replace(gpt3d.TrainConfig(), metrics=metrics)
    try:
        checks.check_outputs(tc)
        checks.check_paths(tc)  # the first run: its file made now, and locked
        assert os.path.exists(metrics)
        said = _in_another_process(lambda: (checks.check_outputs(tc), checks.check_paths(tc)))
        assert "--metrics " + metrics + " already exists" in said or "another run" in said, said
        forced = _in_another_process(lambda: checks.check_paths(replace(tc, overwrite=True)))
        assert f"--metrics {metrics}: another run (pid {os.getpid()}) is writing it" in forced, forced
        with paths.create_new(paths.fresh(metrics), "w") as f:  # what report.py opens: the claimed file itself
            f.write('{"step": 0}\n')
        assert open(metrics).read() == '{"step": 0}\n'
    finally:
        paths.release_claims()
    assert os.path.exists(metrics)  # written: kept
    tc2 = replace(tc, metrics=str(tmp_path / "refused.jsonl"))
    checks.check_paths(tc2)
    paths.release_claims()  # a refused run's untouched claim leaves nothing behind
    assert not os.path.exists(tc2.metrics)


def test_a_rotation_keeps_a_checkpoint_another_process_reads_and_removes_it_once_free(tmp_path):
    from types import SimpleNamespace
    from plumbing import checkpoint
    steps = []
    for n in (2, 4):
        step = tmp_path / f"step_{n:08d}"
        step.mkdir()
        (step / "manifest.json").write_text("{}")
        steps.append(str(step))
    read, go = os.pipe()
    done = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reader: --resume step_2 (or an export of it)
        checkpoint.hold(steps[0])
        os.write(done[1], b"held")
        os.read(read, 1)
        os._exit(0)
    os.read(done[0], 4)
    said, saver = [], SimpleNamespace(written=list(steps), keep=1)
    checkpoint.Saver._rotate(saver, said.append)
    assert os.path.isdir(steps[0]) and saver.written == steps, said
    assert said == [f"note: keeping {steps[0]} for now: another process is reading it (--resume, an export); a later "
                    f"save removes it"]
    os.write(go, b"x")
    os.waitpid(pid, 0)
    checkpoint.Saver._rotate(saver, said.append)  # the reader is gone: the next save removes it
    assert not os.path.exists(steps[0]) and saver.written == steps[1:]
    with pytest.raises(ValueError, match=f"--resume {re.escape(steps[0])}: the checkpoint was removed after this run "
                                         f"chose it"):
        checkpoint.hold(steps[0])
