"""05_3d_gpt checkpoints: resume is bit-identical, any layout loads any other, faults lose at most
the steps since the last save, and GPT-2 weights go in and out unchanged.

Tolerances: resuming in the same layout must be bit-identical (==), in float32 and float64, with
dropout on: nothing is recomputed differently. Resharding to another layout is held to the serial
trajectory within 1e-10 (float64), the parity tolerance of test_3d.py.
"""
import os
import signal
import time
from dataclasses import replace

import pytest
import torch

from conftest import TOL, TRAINER_BASE, TRAINER_CFG, load
from plumbing import checkpoint, gpt2
from plumbing.checkpoint import Saver
from plumbing.launch import RankFailure, launch
from plumbing.reference import serial_train

tensor_parallel = load("01_tensor_parallel")
gpt3d = load("05_3d_gpt")
CFG, BASE = TRAINER_CFG, TRAINER_BASE
STEPS = 6


def tc_for(tp_, pp, dp, v=1, **kw):
    return replace(BASE, **{**dict(tp=tp_, pp=pp, dp=dp, virtual_stages=v, steps=STEPS), **kw})


def _resume_same_layout(env, layout, root, dtypes):
    out = {}
    for dtype in dtypes:
        cfg = replace(CFG, dropout=0.1)
        save = os.path.join(root, dtype)
        whole = gpt3d.train(env, cfg, replace(layout, dtype=dtype, save=save, save_every=3), quiet=True)
        half = gpt3d.train(env, cfg, replace(layout, dtype=dtype, resume=os.path.join(save, "step_00000003")),
                           quiet=True)
        out[dtype] = whole["losses"][3:], half["losses"], half["start"]
    return out


# Both dtypes on the interleaved layout; on the 8-rank one float32 only (float64 adds nothing there
# that the other layout and test_3d's float64 grid do not show, and costs 4 s of the suite).
@pytest.mark.parametrize("layout,dtypes", [(tc_for(2, 2, 2), ["float32"]), (tc_for(1, 2, 1, 2), ["float64", "float32"])],
                         ids=["2-2-2-1", "1-2-1-2"])
def test_resume_in_the_same_layout_is_bit_identical_with_dropout(run_ranks, tmp_path, layout, dtypes):
    world = layout.tp * layout.pp * layout.dp
    for dtype, (whole, resumed, start) in run_ranks(_resume_same_layout, world, layout, str(tmp_path), dtypes)[0].items():
        assert start == 3 and resumed == whole, dtype  # exactly equal floats


def _reshard(env, before, after, root):
    gpt3d.train(env, CFG, replace(before, steps=STEPS, save=root, save_every=3), quiet=True)
    return gpt3d.train(env, CFG, replace(after, resume=os.path.join(root, "step_00000003")), quiet=True)


PAIRS = {
    "tp2-pp2-dp2 to tp1-pp4-dp2": (tc_for(2, 2, 2), tc_for(1, 4, 2)),
    "tp2-pp2-dp2 ZeRO-1 to v=2 without": (tc_for(2, 2, 2, zero1=True), tc_for(2, 2, 2, 2)),
    "tp1-pp2-v2 to dp2 ZeRO-1": (tc_for(1, 2, 1, 2), tc_for(1, 1, 2, zero1=True)),
}


# tp 2 -> 1 with pp 2 -> 4 reshards what the other two do not (tp's shards), and so is kept.
@pytest.mark.grid(keep=["tp2-pp2-dp2 to tp1-pp4-dp2", "tp1-pp2-v2 to dp2 ZeRO-1"])
@pytest.mark.parametrize("pair", PAIRS, ids=list(PAIRS))
def test_a_checkpoint_loads_in_another_layout_and_the_trajectory_continues(run_ranks, tmp_path, pair):
    before, after = PAIRS[pair]
    serial = serial_train(CFG, replace(BASE, steps=STEPS))["losses"]
    out = run_ranks(_reshard, before.tp * before.pp * before.dp, before, after, str(tmp_path))[0]
    assert out["start"] == 3
    assert tensor_parallel.max_rel_diff(torch.tensor(out["losses"]), torch.tensor(serial[3:])) <= TOL


def _gathers_in_flight_at_each_save(env, root):
    real, seen = Saver.save, []

    def save(saver, run, step, say=print):
        seen.append(len(run.opt.gathers))
        return real(saver, run, step, say)

    Saver.save = save  # this forked rank's class only
    gpt3d.train(env, CFG, tc_for(1, 2, 2, zero1=True, save=root, save_every=2), quiet=True)
    return seen


def test_a_zero1_checkpoint_is_written_only_once_every_gather_has_landed(run_ranks, tmp_path):
    # With overlap_param_gather the updated weights are still being gathered when a step returns;
    # a save then would write some of the previous step's. (Whether it did would depend on timing.)
    assert run_ranks(_gathers_in_flight_at_each_save, 4, str(tmp_path)) == [[0, 0, 0]] * 4


# ----------------------------------------------------------------------------------------------
# Faults


def _crash_in_second_save(env, root):
    real, calls = torch.save, [0]

    def dying_save(obj, f):  # the shard's open file
        calls[0] += 1
        if env.rank == 1 and calls[0] == 2:  # half a file, then the rank is gone
            f.write(b"PK\x03\x04 truncated")
            f.flush()
            os._exit(1)
        real(obj, f)

    torch.save = dying_save  # this forked rank's torch only
    gpt3d.train(env, CFG, tc_for(1, 2, 1, save=root, save_every=3), quiet=True)


def _resume(env, tc):
    return gpt3d.train(env, CFG, tc, quiet=True)


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_loadable(run_ranks, tmp_path, capsys):
    root = str(tmp_path)
    with pytest.raises(RankFailure, match="rank 1 died"):
        run_ranks(_crash_in_second_save, 2, root)
    assert sorted(os.listdir(root)) == ["step_00000003", "step_00000006.tmp"]
    messages = []
    assert checkpoint.latest_checkpoint(root, messages.append).endswith("step_00000003")
    assert "an interrupted save" in messages[0]
    out = run_ranks(_resume, 2, tc_for(1, 2, 1, resume=root))[0]
    serial = serial_train(CFG, replace(BASE, steps=STEPS))["losses"]
    assert out["start"] == 3 and tensor_parallel.max_rel_diff(torch.tensor(out["losses"]), torch.tensor(serial[3:])) <= TOL


def _killed_in_step_4(env, root):
    real = gpt3d.train_step

    def step(run, idx, targets, lr, *rest):
        if env.rank == 3 and len(os.listdir(root)) and lr == gpt3d.lr_at(4, run.tc):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(run, idx, targets, lr, *rest)

    gpt3d.train_step = step
    gpt3d.train(env, CFG, tc_for(2, 2, 1, save=root, save_every=3, timeout_s=20), quiet=True)


def test_a_rank_killed_mid_step_stops_everyone_and_resume_loses_only_unsaved_steps(run_ranks, tmp_path):
    root = str(tmp_path)
    with pytest.raises(RankFailure, match=r"rank 3 died \(killed by SIGKILL\)"):
        run_ranks(_killed_in_step_4, 4, root)
    out = run_ranks(_resume, 4, tc_for(2, 2, 1, resume=root))[0]
    serial = serial_train(CFG, replace(BASE, steps=STEPS))["losses"]
    assert out["start"] == 3 and tensor_parallel.max_rel_diff(torch.tensor(out["losses"]), torch.tensor(serial[3:])) <= TOL


# ----------------------------------------------------------------------------------------------
# Slow saves: a save runs in its own group, under its own timeout, not the training collectives'


def _slow_shard_on_rank_1(env, root, delay_s, save_timeout_s, collective_timeout_s):
    real_save = torch.save

    def slow_save(obj, f):  # rank 1's shard: multi-GB on a busy filesystem, say
        if env.rank == 1:
            time.sleep(delay_s)
        real_save(obj, f)

    torch.save = slow_save  # this forked rank's torch only
    tc = tc_for(1, 2, 1, steps=2, save=root, timeout_s=collective_timeout_s, save_timeout_s=save_timeout_s)
    return gpt3d.train(env, CFG, tc, quiet=True)["losses"]


def test_a_save_slower_than_its_timeout_fails_naming_the_rank_that_had_not_written_its_shard(run_ranks, tmp_path):
    with pytest.raises(RankFailure, match=r"rank 0 failed:(.|\n)*saving step 2 under .* timed out after 1 s "
                                          r"(.|\n)*: rank\(s\) 1 had not finished writing its shard to "
                                          r".*step_00000002.tmp\."):
        run_ranks(_slow_shard_on_rank_1, 2, str(tmp_path), 2.5, 1.0, 20.0)
    assert os.listdir(tmp_path) == ["step_00000002.tmp"]  # never made visible


def test_a_save_slower_than_the_collective_timeout_completes_under_its_own(tmp_path):
    # Every training collective, and the default group, time out after 1.5 s; rank 1's shard takes 3 s.
    losses = launch(_slow_shard_on_rank_1, 2, str(tmp_path), 3.0, 30.0, 1.5, timeout_s=1.5, deadline_s=60)
    assert len(losses[1]) == 2 and os.listdir(tmp_path) == ["step_00000002"]
    assert checkpoint.read_manifest(str(tmp_path / "step_00000002"))["step"] == 2


# ----------------------------------------------------------------------------------------------
# GPT-2 interchange


def test_gpt2_export_then_import_is_bit_identical(tmp_path):
    full = tensor_parallel.init_state_dict(CFG, 3, dtype=torch.float32, random_all=True)
    gpt2.export_gpt2(CFG, full, str(tmp_path))
    cfg, back, _ = gpt2.import_gpt2(str(tmp_path))
    assert cfg == replace(CFG, dropout=0.0) and back.keys() == full.keys()
    assert all(torch.equal(back[k], full[k]) for k in full)


def _logits(env, full, idx):
    group = tensor_parallel.new_tp_group(env, env.world_size)
    model = tensor_parallel.GPT(CFG, group, init=False, dtype=torch.float64)
    model.load_full_state_dict(full)
    return model.full_logits(model(idx)[0].detach())


def test_a_hugging_face_layout_state_dict_runs_the_same_in_any_layout(run_ranks, tmp_path):
    full = tensor_parallel.init_state_dict(CFG, 4, dtype=torch.float64, random_all=True)
    # What GPT2LMHeadModel.state_dict() holds: Conv1D weights (in, out), mask buffers, lm_head.
    hf = {k: (v.t() if k.endswith(gpt2.CONV1D) else v) for k, v in full.items()}
    hf["lm_head.weight"] = full["transformer.wte.weight"]
    hf.update({f"transformer.h.{i}.attn.bias": torch.ones(1, 1, 16, 16) for i in range(CFG.n_layer)})
    torch.save(hf, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text('{"vocab_size": 256, "n_positions": 16, "n_layer": 8, '
                                          '"n_head": 2, "n_embd": 16}')
    cfg, imported, _ = gpt2.import_gpt2(str(tmp_path))
    idx = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = run_ranks(_logits, 2, imported, idx)[0]
    ref = tensor_parallel.GPT(CFG, None, init=False, dtype=torch.float64)
    ref.load_full_state_dict(full)
    assert tensor_parallel.max_rel_diff(logits, ref(idx)[0].detach()) <= TOL


# ----------------------------------------------------------------------------------------------
# Bad input, each naming what differs


def _save_once(env, root, tc=None):
    gpt3d.train(env, CFG, tc or tc_for(1, 2, 1, steps=3, save=root), quiet=True)


@pytest.fixture
def saved(run_ranks, tmp_path):
    run_ranks(_save_once, 2, str(tmp_path))
    return os.path.join(str(tmp_path), "step_00000003")


def test_a_checkpoint_of_another_model_or_batch_is_refused_naming_the_difference(saved):
    with pytest.raises(ValueError, match=r"n_layer=8 \(this run 4\)"):
        checkpoint.read_checkpoint(saved, replace(CFG, n_layer=4), BASE)
    with pytest.raises(ValueError, match=r"batch_size=8 \(this run 16\)"):
        checkpoint.read_checkpoint(saved, CFG, replace(BASE, batch_size=16))


def test_a_truncated_shard_or_a_missing_manifest_is_refused(saved):
    shard = os.path.join(saved, "rank_00001.pt")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(ValueError, match="rank_00001.pt is missing, truncated or corrupt"):
        checkpoint.read_checkpoint(saved)
    os.remove(os.path.join(saved, "manifest.json"))
    with pytest.raises(ValueError, match="no readable manifest.json"):
        checkpoint.read_checkpoint(saved)
    messages = []
    assert checkpoint.latest_checkpoint(os.path.dirname(saved), messages.append) is None
    assert "has no manifest.json" in messages[0]


def test_a_gpt2_directory_without_weights_or_with_wrong_shapes_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 256, "n_positions": 16, "n_layer": 8, '
                                          '"n_head": 2, "n_embd": 16}')
    with pytest.raises(ValueError, match="holds no weights"):
        gpt2.import_gpt2(str(tmp_path))
    full = tensor_parallel.init_state_dict(replace(CFG, n_embd=32), 0)
    torch.save(full, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"does not fit its config.json: transformer.wte.weight: \(256, 32\) instead of \(256, 16\)"):
        gpt2.import_gpt2(str(tmp_path))


# ----------------------------------------------------------------------------------------------
# --async-save: a snapshot in host memory, then the same commit protocol in a background writer.


def _saved_tensors(step_dir):
    out = {}
    for name in sorted(os.listdir(step_dir)):
        if name.endswith(".pt"):
            shard = torch.load(os.path.join(step_dir, name), weights_only=True)
            out[name] = ([dict(c) for c in shard["chunks"]], [(c, n, a, b, dict(s)) for c, n, a, b, s in shard["pieces"]])
    return out


def _async_against_blocking(env, root):
    layout = tc_for(1, 2, 2, zero1=True)
    whole = gpt3d.train(env, CFG, replace(layout, save=os.path.join(root, "blocking"), save_every=3), quiet=True)
    gpt3d.train(env, CFG, replace(layout, save=os.path.join(root, "async"), save_every=3, async_save=True), quiet=True)
    reads, real = [], checkpoint._load_shard
    # Counted in this rank: the shards the resume loads (the start-up check of every tensor, memory-
    # mapped, is the launching process's, once; here, without one, rank 0's).
    checkpoint._load_shard = lambda file, mmap=False, **kw: (mmap or reads.append(file)) and None or real(file, mmap, **kw)
    half = gpt3d.train(env, CFG, replace(layout, resume=os.path.join(root, "async", "step_00000003")), quiet=True)
    return whole["losses"][3:], half["losses"], len(reads)


def test_an_async_save_writes_what_a_blocking_one_does_and_resumes_bit_identically_reading_its_own_shards(
        run_ranks, tmp_path):
    for whole, resumed, reads in run_ranks(_async_against_blocking, 4, str(tmp_path)):
        assert resumed == whole  # exactly equal floats
        assert reads <= 2  # its own shard, and its replica 0's for the weights: not all 4
    for step in ("step_00000003", "step_00000006"):
        a, b = (_saved_tensors(tmp_path / kind / step) for kind in ("blocking", "async"))
        assert a.keys() == b.keys() and len(a) == 4
        for name in a:
            for x, y in zip(a[name][0], b[name][0]):
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
            for (c, n, lo, hi, s), (c2, n2, lo2, hi2, s2) in zip(a[name][1], b[name][1]):
                assert (c, n, lo, hi) == (c2, n2, lo2, hi2) and all(torch.equal(s[k], s2[k]) for k in s)


def _blocked_writer(env, root, kill_at=None):
    """Rank 1's background write of step 2 waits until rank 0, at step 3, has seen step 2 still
    invisible and released it (kill_at: or rank 1 dies at that step, its write never done)."""
    release, real_save, real_step, seen = os.path.join(root, "release"), torch.save, gpt3d.train_step, {}
    blocked = "step_00000004" if kill_at else "step_00000002"

    def slow_save(obj, f):
        if env.rank == 1 and blocked in str(getattr(f, "name", "")):
            while not os.path.exists(release):  # killed: nobody releases it
                time.sleep(0.01)
        real_save(obj, f)

    def step(run, idx, targets, lr, *rest):
        if lr == gpt3d.lr_at(3, run.tc) and env.rank == 0 and kill_at is None:
            seen["visible at step 3"] = checkpoint.latest_checkpoint(root + "/ckpt")
            open(release, "w").close()
        if env.rank == 1 and kill_at is not None and lr == gpt3d.lr_at(kill_at, run.tc):
            os.kill(os.getpid(), signal.SIGKILL)  # its write of step 4 still waiting
        return real_step(run, idx, targets, lr, *rest)

    torch.save, gpt3d.train_step = slow_save, step  # this forked rank's only
    out = gpt3d.train(env, CFG, tc_for(1, 2, 1, save=root + "/ckpt", save_every=2, async_save=True), quiet=True)
    return out["losses"], seen


def test_with_one_writer_blocked_training_goes_on_and_the_step_stays_invisible_until_it_is_released(run_ranks, tmp_path):
    (losses, seen), _ = run_ranks(_blocked_writer, 2, str(tmp_path))
    assert seen["visible at step 3"] is None  # step 2 not yet: rank 1's shard was still being written
    assert len(losses) == STEPS  # training went on meanwhile, and to the end
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000004", "step_00000006"]  # keep=2 of 2, 4, 6


def _writer_never_finishes(env, root):
    """Rank 1's background write of step 2 never finishes; the save's own timeout is 1 s."""
    real_save = torch.save

    def stuck_save(obj, f):
        while env.rank == 1 and "step_00000002" in str(getattr(f, "name", "")):
            time.sleep(0.05)
        real_save(obj, f)

    torch.save = stuck_save  # this forked rank's only
    gpt3d.train(env, CFG, tc_for(1, 2, 1, save=root, save_every=2, async_save=True, save_timeout_s=1), quiet=True)


def test_a_writer_that_never_finishes_abandons_its_step_naming_the_rank_and_leaves_the_previous_newest(
        run_ranks, tmp_path):
    with pytest.raises(RankFailure, match=r"rank 1: the background write of step 2 under \S+ did not finish within "
                                          r"1 s \(--save-timeout-s\); the previous checkpoint stays the newest") as e:
        run_ranks(_writer_never_finishes, 2, str(tmp_path))
    assert "Traceback" not in str(e.value)  # a sentence, not a stack
    assert checkpoint.latest_checkpoint(str(tmp_path)) is None  # step 2 never became visible
    assert os.listdir(tmp_path) == ["step_00000002.tmp"]


def test_sigkill_during_an_async_write_leaves_the_previous_checkpoint_intact_and_resumable_bit_for_bit(
        run_ranks, tmp_path):
    with pytest.raises(RankFailure, match=r"rank 1 died \(killed by SIGKILL\)"):
        run_ranks(_blocked_writer, 2, str(tmp_path), 5)
    assert checkpoint.latest_checkpoint(str(tmp_path / "ckpt")).endswith("step_00000002")
    resumed = run_ranks(_resume, 2, tc_for(1, 2, 1, resume=str(tmp_path / "ckpt")))[0]
    whole = run_ranks(_resume, 2, tc_for(1, 2, 1))[0]
    assert resumed["start"] == 2 and resumed["losses"] == whole["losses"][2:]  # bit for bit
