"""Bad numbers and bad runs never cost a run (issue 15): a non-finite step is skipped on every rank
and never saved, a microbatch with nothing to score adds nothing, each chunk draws its own dropout
masks, a run never deletes or shadows checkpoints it did not write, saves are durable and a full
disk says so, resharded resumes reseed every stream, and the hot path reads nothing back; Ctrl-C
stops every rank with one line naming the step, and a run's metrics are its own only when it
continues a checkpoint (issue 28).

Tolerances: a skipped step leaves the weights and AdamW's state exactly as they were, so the run
with an injected fault must equal (==) the clean run that stopped before it; parity with the serial
model is 1e-10 in float64, as in test_3d.py.
"""
import errno
import io
import json
import math
import os
import re
import runpy
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from conftest import PIPELINE_CFG, ROOT, TOL, TRAINER_BASE, TRAINER_CFG, load, run_script
from plumbing import checkpoint
from plumbing.launch import RankFailure

tensor_parallel, pipeline, gpt3d = load("01_tensor_parallel"), load("02_pipeline_1f1b"), load("05_3d_gpt")
data_parallel = load("04_data_parallel")
CFG, BASE = TRAINER_CFG, TRAINER_BASE
PP2 = replace(BASE, pp=2, steps=4)  # two ranks: stage 0 holds wte, stage 1 its tied copy
SMALL = ["--tp", "1", "--pp", "2", "--dp", "1", "--n-layer", "8", "--n-head", "2", "--n-embd", "16", "--block-size",
         "16", "--batch-size", "8", "--microbatches", "2", "--seq-len", "16", "--no-check"]  # PP2 on the command line;
# --no-check: 05's check of its lesson before training is tested by test_lesson_05 and the main job's tests


# ----------------------------------------------------------------------------------------------
# 1. Numbers


def _poison(env, tc, bad, at_calls, where="pre"):
    """Train tc with a `bad` value written into one gradient on stage 0 (where="pre") at the given
    calls of clip_gradients, i.e. at those steps; returns the run's figures and its weights."""
    real, calls = gpt3d.clip_gradients, [0]

    def clip(opt, chunks, groups, max_norm, zero1):
        calls[0] += 1
        if calls[0] in at_calls and chunks[0].pre_process:
            opt.pieces[-1].grad.view(-1)[0] = bad  # the last piece: wte, on the first stage
        return real(opt, chunks, groups, max_norm, zero1)

    gpt3d.clip_gradients = clip
    return gpt3d.train(env, CFG, tc, quiet=True)


def _clean(env, tc):
    return gpt3d.train(env, CFG, tc, quiet=True)


def _weights(root):
    manifest, full, state = checkpoint.read_checkpoint(checkpoint.latest_checkpoint(root))
    return manifest["step"], full, state


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_non_finite_gradient_skips_the_step_on_every_rank_and_is_never_saved(run_ranks, tmp_path, bad):
    poisoned, clean = str(tmp_path / "poisoned"), str(tmp_path / "clean")
    out = run_ranks(_poison, 2, replace(PP2, steps=3, save=poisoned, save_every=1, keep=1), bad, {3})[0]
    run_ranks(_clean, 2, replace(PP2, steps=2, save=clean))
    assert out["skipped"] == [2] and math.isnan(out["norms"][2]) or math.isinf(out["norms"][2])
    step, after_skip, state = _weights(poisoned)  # keep 1: the newest only, written after the skip
    _, before, state_before = _weights(clean)
    assert step == 3
    for name, t in after_skip.items():  # the skipped step changed nothing, and nothing is non-finite
        assert torch.isfinite(t).all() and torch.equal(t, before[name]), name
    for name, moments in state.items():
        assert all(torch.equal(v, state_before[name][k]) for k, v in moments.items()), name


def test_steps_skipped_in_a_row_stop_the_run_and_leave_the_last_good_checkpoint(run_ranks, tmp_path):
    root = str(tmp_path)
    tc = replace(PP2, steps=8, save=root, save_every=1, keep=1, max_skipped_steps=3)
    with pytest.raises(RankFailure, match=r"3 steps in a row \(2 to 4\) had a non-finite loss or gradient norm"):
        run_ranks(_poison, 2, tc, math.nan, {3, 4, 5})
    step, full, _ = _weights(root)
    assert step == 4 and all(torch.isfinite(t).all() for t in full.values())  # skipped steps are finite


def _nan_in_weights_after_step(env, root):
    real = gpt3d.train_step

    def step(run, *args):
        out = real(run, *args)
        if env.rank == 1 and run.opt.optimizer.state:  # a fault the skip cannot see: straight into a weight
            with torch.no_grad():
                next(run.chunks[0].parameters()).view(-1)[0] = math.nan
        return out

    gpt3d.train_step = step
    gpt3d.train(env, CFG, replace(PP2, save=root, save_every=1), quiet=True)


def test_a_checkpoint_holding_a_non_finite_value_is_never_written(run_ranks, tmp_path):
    with pytest.raises(RankFailure, match="not saving step 1: this rank holds non-finite values"):
        run_ranks(_nan_in_weights_after_step, 2, str(tmp_path))
    assert [d for d in os.listdir(tmp_path) if not d.endswith(".tmp")] == []


def _ignored_microbatch(env):
    pp = env.world_size
    full = tensor_parallel.init_state_dict(PIPELINE_CFG, 5, dtype=torch.float64, random_all=True)
    serial = tensor_parallel.GPT(PIPELINE_CFG, None, init=False, dtype=torch.float64)
    serial.load_full_state_dict(full)
    chunks = pipeline.build_chunks(PIPELINE_CFG, pp, env.rank, init=False, dtype=torch.float64)
    chunks[0].load_full_state_dict(full)
    idx = torch.randint(97, (8, 16), generator=torch.Generator().manual_seed(0))
    targets = idx.roll(-1, 1)
    targets[2:4] = -100  # microbatch 1 of 4 has nothing to score
    serial(idx, targets)[1].backward()
    schedule = pipeline.Schedule([pipeline.one_f_one_b(pp, 4, r) for r in range(pp)])
    res = pipeline.execute(schedule, chunks, dist.group.WORLD, pipeline.split_batch(idx, targets, 4),
                           pipeline.Wire((2, 16, 16)))
    pipeline.sync_tied_embeddings(chunks, dist.new_group([0, pp - 1]))
    ref = dict(serial.named_parameters())
    worst = max(tensor_parallel.max_rel_diff(p.grad, ref[n].grad) for n, p in chunks[0].named_parameters())
    return worst, None if res.loss is None else float(res.loss), float(serial(idx, targets)[1])


def test_a_microbatch_with_only_ignored_targets_adds_nothing_and_gradients_equal_serial(run_ranks):
    for worst, loss, ref in run_ranks(_ignored_microbatch, 2):
        assert worst <= TOL
        assert loss is None or abs(loss - ref) <= TOL * abs(ref)
    one = tensor_parallel.GPT(PIPELINE_CFG, None, dtype=torch.float64)
    idx = torch.zeros(1, 4, dtype=torch.long)
    loss = one(idx, torch.full((1, 4), -100))[1]
    loss.backward()
    assert loss.item() == 0 and all(p.grad.abs().max() == 0 for p in one.parameters())  # not 0/0


def _chunk_masks(env):
    group = tensor_parallel.new_tp_group(env, 2)
    cfg = replace(PIPELINE_CFG, dropout=0.5)
    chunks = pipeline.build_chunks(cfg, 1, 0, 2, group, sequence_parallel=True, seed=3, dtype=torch.float64)
    blocks = [next(iter(c.transformer.h.values())) for c in chunks]
    blocks[1].load_state_dict(blocks[0].state_dict())  # the same weights in a layer of each chunk
    x = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return torch.equal(blocks[0](x), blocks[1](x))


def test_each_virtual_chunk_draws_its_own_dropout_masks_in_tp_regions(run_ranks):
    assert run_ranks(_chunk_masks, 2) == [False, False]


# ----------------------------------------------------------------------------------------------
# 2. Paths and runs


def test_a_save_directory_holding_another_runs_later_steps_is_refused_and_kept(run_ranks, tmp_path):
    root = str(tmp_path)
    run_ranks(_clean, 2, replace(PP2, save=root, save_every=2))  # another run's steps 2 and 4
    before = sorted(os.listdir(root))
    for args in ([], ["--resume", os.path.join(root, "step_00000002")]):
        proc = run_script("05_3d_gpt.py", *SMALL, "--steps", "6", "--save", root, *args)
        assert proc.returncode == 1 and f"--save {root} already holds" in proc.stderr, proc.stderr[-2000:]
        assert "Resume from them with --resume" in proc.stderr and proc.seconds < 10
    assert sorted(os.listdir(root)) == before


def test_rotation_removes_only_the_runs_own_checkpoints(run_ranks, tmp_path):
    root = str(tmp_path)
    run_ranks(_clean, 2, replace(PP2, save=root, save_every=2))  # steps 2 and 4, another run's
    run_ranks(_clean, 2, replace(PP2, steps=8, resume=root, save=root, save_every=1, keep=1))
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000004", "step_00000008"]


def _save_with_full_disk(env, root):
    checkpoint._open = lambda path, mode: open("/dev/full", mode)  # this forked rank's module only
    gpt3d.train(env, CFG, replace(PP2, save=root, save_every=2), quiet=True)


def test_a_full_disk_says_so_in_a_sentence(run_ranks, tmp_path):
    with pytest.raises(RankFailure, match=r"no space left writing .*step_00000002.tmp/rank_0000[01].pt"):
        run_ranks(_save_with_full_disk, 2, str(tmp_path))


def _durable(env, root, metrics):
    synced, real_fsync, real_save = [], os.fsync, checkpoint.Saver.save

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def save(self, run, step, say=print):
        lines = [json.loads(x)["step"] for x in open(metrics)] if env.rank == 0 else [step - 1]
        assert lines[-1] == step - 1, f"the metrics line of step {step - 1} is not written before its checkpoint"
        real_save(self, run, step, say)

    os.fsync, checkpoint.Saver.save = fsync, save
    gpt3d.train(env, CFG, replace(PP2, steps=2, save=root, save_every=1, metrics=metrics), quiet=True)
    return synced


def test_shards_manifest_and_directory_are_fsynced_and_metrics_precede_the_checkpoint(run_ranks, tmp_path):
    root, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    synced = run_ranks(_durable, 2, root, metrics)
    for step in ("step_00000001", "step_00000002"):
        tmp = os.path.join(root, step + ".tmp")
        assert os.path.join(tmp, "rank_00000.pt") in synced[0] and os.path.join(tmp, "rank_00001.pt") in synced[1]
        assert os.path.join(tmp, "manifest.json") in synced[0] and tmp in synced[0]
    assert synced[0].count(root) == 2  # the directory, after each rename


def test_metrics_are_appended_only_when_a_checkpoint_was_resumed(run_ranks, tmp_path):
    metrics, ckpt = str(tmp_path / "m.jsonl"), str(tmp_path / "ckpt")
    run_ranks(_clean, 2, replace(PP2, steps=1, metrics=metrics, save=ckpt))
    run_ranks(_clean, 2, replace(PP2, steps=2, metrics=metrics, resume=ckpt))  # the run continued: its own file
    assert [json.loads(x)["step"] for x in open(metrics)] == [0, 1]
    # A --resume that finds nothing starts afresh: it would replace the earlier run's metrics, which
    # it did not write, so only with --overwrite.
    again = replace(PP2, steps=2, metrics=metrics, resume=str(tmp_path / "nothing_here"))
    with pytest.raises(RankFailure, match="--metrics .* already exists, and this run did not write it: give --overwrite"):
        run_ranks(_clean, 2, again)
    run_ranks(_clean, 2, replace(again, overwrite=True))
    assert [json.loads(x)["step"] for x in open(metrics)] == [0, 1]


def _resume_from(env, tc, root):
    run = gpt3d.build(env, replace(CFG, dropout=0.1), tc, gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, tc.tp, tc.dp, tc.pp)))
    fresh = run.chunks[0].rng.state.clone()
    checkpoint.load_checkpoint(run, checkpoint.latest_checkpoint(root), say=lambda text: None)
    seed = tc.seed + 7919 * 2 + 100 * dist.get_rank(run.groups.pp)
    expected = tensor_parallel.TPRandom(seed, dist.get_rank(run.groups.tp), "cpu").state
    return torch.equal(run.chunks[0].rng.state, fresh), torch.equal(run.chunks[0].rng.state, expected)


def test_a_resharded_resume_reseeds_the_tracked_streams_from_the_step(run_ranks, tmp_path):
    root, cfg_tc = str(tmp_path), replace(BASE, tp=2, steps=2, save=str(tmp_path))
    run_ranks(lambda env: gpt3d.train(env, replace(CFG, dropout=0.1), cfg_tc, quiet=True), 2)
    for unchanged, reseeded in run_ranks(_resume_from, 2, replace(BASE, tp=2, zero1=True), root):
        assert not unchanged and reseeded


def _train_after(env, tc, cfg):
    return gpt3d.train(env, cfg, tc, quiet=True)["losses"]


def test_a_checkpoint_written_on_a_gpu_resumes_on_a_cpu(run_ranks, tmp_path):
    root, cfg = str(tmp_path), replace(CFG, dropout=0.1)
    run_ranks(_train_after, 2, replace(BASE, tp=2, steps=2, save=root), cfg)
    step = os.path.join(root, "step_00000002")
    for r in range(2):  # what a CUDA run writes: a CUDA generator's 16-byte state
        file = os.path.join(step, f"rank_{r:05d}.pt")
        shard = torch.load(file, weights_only=True)
        shard["rng"].update(device="cuda", tracked=torch.zeros(16, dtype=torch.uint8))
        torch.save(shard, file)
    manifest = json.load(open(os.path.join(step, "manifest.json")))  # its checksums, as that run's save wrote them
    manifest["shards"] = {name: checkpoint.sha256_of(os.path.join(step, name)) for name in manifest["shards"]}
    with open(os.path.join(step, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    losses = run_ranks(_train_after, 2, replace(BASE, tp=2, steps=4, resume=root), cfg)[0]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


# ----------------------------------------------------------------------------------------------
# 4. The hot path and the GPU paths that a CPU can show


class ReadBacks(TorchFunctionMode):
    """Counts every read of a tensor's value into Python (a device sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _read_backs(env):
    chunks = pipeline.build_chunks(PIPELINE_CFG, 2, env.rank, init=True, check_inputs=False)
    idx = torch.randint(97, (4, 16), generator=torch.Generator().manual_seed(0))
    targets = idx.roll(-1, 1)
    valid = [int((t != -100).sum()) for t in targets.chunk(2)]  # on the host, as 05 does
    micro = pipeline.split_batch(idx, targets, 2)
    with ReadBacks() as counted:
        pipeline.execute(pipeline.Schedule([pipeline.one_f_one_b(2, 2, r) for r in range(2)]), chunks,
                         dist.group.WORLD, micro, pipeline.Wire((2, 16, 16)), valid=valid)
    return counted.seen


def test_the_executor_reads_nothing_back_from_the_device(run_ranks):
    assert run_ranks(_read_backs, 2) == [[], []]


def _bad_id_at_step_1(env):
    real = gpt3d.replica_batch

    def batch(tokens, step, tc, dp_rank, salt=0):
        idx, targets = real(tokens, step, tc, dp_rank, salt)
        if step == 1:
            idx = idx.clone()
            idx[0, 0] = 999  # >= vocab_size 256, seen by every rank of the replica
        return idx, targets

    gpt3d.replica_batch = batch
    gpt3d.train(env, CFG, replace(PP2, timeout_s=30), quiet=True)


def test_a_bad_token_id_stops_every_stage_at_once_not_at_the_timeout(run_ranks):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_bad_id_at_step_1, 2)
    text = str(failure.value)
    assert "token ids must lie in [0, vocab_size=256); got min=" in text
    assert "also failed: ValueError: token ids must lie" in text  # stage 1 too, by itself


def test_cuda_graphs_never_capture_one_chunk_of_several_as_the_whole_step():
    from plumbing.checks import acceleration, check_config
    tc = replace(BASE, virtual_stages=2, pp=1, microbatches=2, cuda_graphs=True)
    assert acceleration(tc, torch.device("cuda")) == (True, "stage")
    with pytest.raises(ValueError, match="--graph-scope step captures one model chunk"):
        check_config(CFG, replace(tc, graph_scope="step"), 1)


def test_kernels_are_built_before_the_first_collective(run_ranks):
    def body(env):
        order = []
        gpt3d.kernels.prebuild = lambda mode: order.append("build")
        real = gpt3d.new_groups
        gpt3d.new_groups = lambda *a: order.append("groups") or real(*a)
        gpt3d.train(env, CFG, replace(BASE, steps=1, fused_kernels=True, kernel_path="reference"), quiet=True)
        return order

    assert run_ranks(body, 1) == [["build", "groups"]]


def test_bucketed_ddp_makes_no_low_precision_gradient_copy(run_ranks):
    def body(env):
        out = []
        for dtype, grad_dtype in ((torch.bfloat16, torch.float32), (torch.float64, None)):
            model = tensor_parallel.GPT(PIPELINE_CFG, None, dtype=dtype)
            ddp = data_parallel.BucketedDDP(model.parameters(), dist.group.WORLD, 1000, grad_dtype=grad_dtype)
            model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
            ddp.finish()
            p = next(model.parameters())
            out.append(p.grad is None if dtype == torch.bfloat16 else
                       p.grad.untyped_storage().data_ptr() == ddp.grad_buffer.untyped_storage().data_ptr())
        return out

    assert run_ranks(body, 1) == [[True, True]]


def _p2p_groups(env):
    real, groups = dist.P2POp, []

    def op(fn, tensor, peer, group=None, *rest):
        groups.append(group)
        return real(fn, tensor, peer, group, *rest)

    dist.P2POp = op
    pp_group = dist.new_group([0, 1])
    chunks = pipeline.build_chunks(PIPELINE_CFG, 2, env.rank)
    idx = torch.randint(97, (4, 16), generator=torch.Generator().manual_seed(0))
    pipeline.execute(pipeline.Schedule([pipeline.one_f_one_b(2, 2, r) for r in range(2)]), chunks, pp_group,
                     pipeline.split_batch(idx, idx, 2), pipeline.Wire((2, 16, 16)))
    return bool(groups) and all(g is pp_group for g in groups)


def test_every_point_to_point_op_carries_its_pipeline_group(run_ranks):
    assert run_ranks(_p2p_groups, 2) == [True, True]


def test_a_bad_output_path_is_refused_by_every_rank_before_any_collective(run_ranks, tmp_path):
    tc = replace(PP2, metrics=str(tmp_path / "missing" / "m.jsonl"))
    with pytest.raises(RankFailure) as failure:
        run_ranks(_clean, 2, tc)
    text = str(failure.value)
    assert re.match(r"rank \d failed: ValueError: --metrics", text.splitlines()[0])  # the cause first, on the
    # report's first line (a sentence: issue 48), not "Connection reset"
    # Both ranks refuse it; or, when the first to refuse exits while the other is still connecting its
    # default group (gloo's handshake, before any of our code runs), the other is its consequence.
    assert "also failed: ValueError: --metrics" in text or "as its consequences" in text


def test_a_resume_with_another_seed_or_data_is_said(run_ranks, tmp_path):
    root = str(tmp_path)
    run_ranks(_clean, 2, replace(PP2, steps=2, save=root))
    proc = run_script("05_3d_gpt.py", *SMALL, "--steps", "3", "--resume", root, "--seed", "7", "--eval-every", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "note: the checkpoint was trained with --seed 1337; this run continues with 7" in proc.stdout


def test_an_exported_gpt2_config_is_complete_and_consistent(tmp_path):
    from plumbing import gpt2
    cfg = replace(CFG, dropout=0.1)
    gpt2.export_gpt2(cfg, tensor_parallel.init_state_dict(cfg, 0), str(tmp_path))
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["bos_token_id"] is None and hf["eos_token_id"] is None  # V = 256 holds no id 50256
    assert hf["resid_pdrop"] == hf["embd_pdrop"] == hf["attn_pdrop"] == 0.1
    assert all(hf[k] in v or (k == "n_inner" and hf[k] is None) for k, v in gpt2.OURS.items())
    assert gpt2.config_from_hf(hf, "config.json") == replace(cfg, dropout=0.0)  # and reads back


# ----------------------------------------------------------------------------------------------
# Faults from outside and the watch's own figures (issue 36, section 6), each case as a user meets
# it: a non-zero exit (or the run completing, where that is right), the culprit named first in one
# sentence, no traceback, nothing left running. (tests/test_watch.py has the cases under torchrun.)

WATCH_SMALL = ["--n-layer", "2", "--batch-size", "8", "--microbatches", "2", "--seq-len", "16", "--block-size", "16",
               "--eval-every", "0", "--no-check"]


def _first_error(text):
    return next((line for line in text.replace("\r", "\n").splitlines() if line.startswith("error: ")), "")


def test_an_unset_hang_s_is_never_below_a_second_and_off_when_the_timeout_leaves_no_room():
    from plumbing import watch
    hang = lambda **kw: watch.hang_seconds(replace(gpt3d.TrainConfig(), **kw))  # noqa: E731
    # --hang-s itself must be at least 1 s: below it a healthy run's ordinary waits look hung.
    assert hang(timeout_s=1.5) == 1 and hang(timeout_s=1.9) == 1 and hang(timeout_s=120) == 60
    assert hang(timeout_s=1) == 0  # 1 s, the least --timeout-s, leaves the report no room before it
    assert hang(timeout_s=1.5, hang_s=0) == 0 and hang(timeout_s=10, hang_s=3) == 3 and hang(watch=False) == 0


def test_a_slowed_rank_under_a_short_timeout_is_the_one_named_and_its_stack_is_written():
    # --timeout-s 1.5 made --hang-s 0.75 s, and the report once blamed rank 5, not the slowed rank 0,
    # and promised stack files that were not written. Now: the run completes (rank 0's 1.1 s stalls
    # are below the 1.5 s timeout, and at most just over the 1 s of --hang-s), or the report says 1 s,
    # names rank 0 first, and every stack it says was written is there (a stall in the last step ends
    # before any rank's heartbeat sees the request: then it says that none was).
    # On a loaded machine a third outcome: a collective times out before the hang report (late heartbeats
    # hold the watchdog back, and a rank starved of the CPU lags too); then the rank that collective
    # waited for is named first, in one sentence, and not the timed-out rank's traceback.
    proc = run_script("05_3d_gpt.py", *WATCH_SMALL, "--steps", "8", "--timeout-s", "1.5", "--rehearse-fault",
                      "slow:0:1100", timeout=60)
    assert proc.leftover == [] and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = _first_error(proc.stderr)
    if proc.returncode != 0 and " lagged: " in line:
        said = _TIMED_OUT.match(line)
        assert said and said[1] != said[2], proc.stderr[-3000:]
    elif proc.returncode != 0:
        assert line.startswith("error: hang: no rank made progress for 1 s. rank 0 (tp 0, dp 0, pp 0): rank 0 is not in "
                               "any collective"), proc.stderr[-3000:]
        said = re.search(r"(Every rank's Python stack|The Python stacks? of ranks? ([\d, ]+) \(the others wrote none "
                         r"in time\)): (\S+)/rank<N>\.txt$", line)
        assert said or line.endswith("No rank wrote its Python stack in time"), line
        for r in (range(8) if said and said[2] is None else map(int, said[2].split(", ")) if said else []):
            assert os.path.exists(os.path.join(said[3], f"rank{r}.txt")), line


# The report of a collective that timed out waiting for a rank that lagged (plumbing/watch.py's timeout_report):
# the rank waited for, its coordinates and where it was; then the rank whose wait timed out, and in what.
_TIMED_OUT = re.compile(r"error: rank (\d+) \(tp \d, dp \d, pp \d\) lagged: it is not in any collective \(at step \d+, "
                        r"[^)]*\), and rank (\d+)'s (\w+ on group \[[\d,]+\]|point-to-point exchange with "
                        r"ranks? [\d, \[\]]+)"
                        r" timed out after 1\.5 s \(the launch's timeout, which bounds every collective\), waiting for "
                        r"it( through ranks? [\d, \[\]]+)?$")


def test_a_rank_stalled_past_the_collective_timeout_with_no_hang_report_is_named_first_in_one_sentence():
    # --hang-s 0: no hang report, the records kept all the same. Rank 0 sleeps 5 s at its first step, past
    # the 1.5 s timeout of the collectives that wait for it: the first to time out is a victim's, and
    # the report names rank 0 first, from every rank's record at that moment, with no traceback.
    proc = run_script("05_3d_gpt.py", *WATCH_SMALL, "--steps", "4", "--timeout-s", "1.5", "--hang-s", "0",
                      "--rehearse-fault", "slow:0:5000", timeout=60)
    assert proc.returncode == 1 and proc.leftover == [] and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = _first_error(proc.stderr)
    said = _TIMED_OUT.match(line)
    assert said and said[1] == "0" and said[2] != "0", proc.stderr[-3000:]
    assert line.startswith("error: rank 0 (tp 0, dp 0, pp 0) lagged: it is not in any collective (at step 0, "
                           "training), and rank "), line
    assert "then failed as its consequences (a collective lost its peer)" in proc.stderr, proc.stderr[-3000:]


def test_the_timeout_report_follows_the_timed_out_ranks_wait_and_says_a_cycle_without_naming_an_end():
    from plumbing.watch import timeout_report
    at = lambda r: f"at {r}"  # noqa: E731
    # Rank 2 timed out in its all-reduce on [1,2] (its record's `failed`); rank 1 waits on rank 0 in an
    # exchange; rank 0 computes. The record of rank 2 itself no longer says it waits (it left the call).
    records = {0: dict(step=3, phase="training", groups={}, waiting_for=[], state="running"),
               1: dict(step=3, phase="training", groups={"1,2": [4, 4, None]}, waiting_for=[0], state="running"),
               2: dict(step=3, phase="training", groups={"1,2": [5, 4, None]}, waiting_for=[], state="running",
                       failed={"groups": {"1,2": [5, 4, "all_reduce"]}})}
    assert timeout_report(records, 3, 2, at, 1.5) == (
        "rank 0 (at 0) lagged: it is not in any collective (at step 3, training), and rank 2's all_reduce on group "
        "[1,2] timed out after 1.5 s (the launch's timeout, which bounds every collective), waiting for it through "
        "rank 1")
    records[0]["waiting_for"] = [2]  # rank 0 waits for rank 2 in turn: no end to name
    assert timeout_report(records, 3, 2, at, 1.5).endswith("waiting for rank 1 (at 1), which waited in turn for "
                                                           "ranks already waiting (a cycle of waits, or records out "
                                                           "of date)")
    assert timeout_report({r: {k: v for k, v in rec.items() if k != "failed"} for r, rec in records.items()},
                          3, 2, at, 1.5) is None  # not said what it waited in: the launcher's own report


def _returns_but_rank_1(env):
    while env.rank == 1:  # an endless loop, in no collective
        pass
    return env.rank


def test_the_librarys_launch_stops_a_rank_still_running_long_after_its_peers_returned():
    from plumbing.launch import launch
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        launch(_returns_but_rank_1, 2, timeout_s=5)  # no deadline_s: the timeout bounds the ranks' ends too
    assert time.monotonic() - t0 < 15
    text = str(failure.value)
    assert text.startswith("rank 1 did not return within 5 s (the launch's timeout, which bounds every collective) of "
                           "rank 0's return: still running outside any collective"), text
    assert "stopped ranks [1] after the failure" in text and "Traceback" not in text


def test_a_rehearsed_hang_without_the_watch_names_the_hung_rank_first_at_the_timeout():
    # --no-watch: no records, no hang report; the others' collectives time out, and the one rank still
    # running, in no collective that failed, is the one they waited for.
    proc = run_script("05_3d_gpt.py", *WATCH_SMALL, "--steps", "6", "--timeout-s", "2", "--no-watch",
                      "--rehearse-fault", "hang:3:1", timeout=60)
    assert proc.returncode == 1 and proc.leftover == [], proc.stderr[-3000:]
    assert _first_error(proc.stderr).startswith("error: rank 3 hung: it was still running, in no collective that "
                                                "failed, when every other rank's collective had timed out"), \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.seconds < 20, (proc.seconds, proc.stderr[-3000:])


# ----------------------------------------------------------------------------------------------
# 5. Ctrl-C, and what a run may write over (issue 28)


def _start(script, *args):
    """`python3 script args` in a forked process of its own group, with Python's own Ctrl-C
    handling (conftest.run_script resets SIGINT to the default, which kills without a word), for a
    test that signals it while it runs. Returns (pid, stdout file, stderr file)."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setpgid(0, 0)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
            os.chdir(ROOT)
            sys.argv = [str(ROOT / script), *args]
            try:
                runpy.run_path(str(ROOT / script), run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid, out, err


def _stopped_by(signalled, tmp_path):
    """Start 05 training without end, wait for its second step, signalled(pid), then wait for the exit:
    (exit status, seconds it took, processes left in its group, its last stderr line but the bar's, stderr)."""
    metrics = tmp_path / "m.jsonl"
    pid, out, err = _start("05_3d_gpt.py", *SMALL, "--steps", "100000", "--eval-every", "0", "--metrics", str(metrics),
                           "--save", str(tmp_path / "ckpt"))
    deadline = time.monotonic() + 60
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    signalled(pid)
    start, status = time.monotonic(), None
    while status is None and time.monotonic() < start + 10:
        done, code = os.waitpid(pid, os.WNOHANG)
        status = os.waitstatus_to_exitcode(code) if done else None
        time.sleep(0.05)
    seconds = time.monotonic() - start
    time.sleep(0.5)  # the ranks' exits, once the launcher's is seen
    alive = [p for p in os.listdir("/proc") if p.isdigit() and _group_of(int(p)) == pid]
    if status is None or alive:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0) if status is None else None
    err.seek(0)
    text = err.read().decode(errors="replace")
    lines = [x for x in text.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("train:")]
    return status, seconds, alive, lines[-1] if lines else "", text


@pytest.mark.parametrize("to", ["group", "launcher"], ids=["Ctrl-C in the terminal", "kill -INT to the launcher"])
def test_ctrl_c_stops_every_rank_with_one_line_saying_the_step(tmp_path, to):
    status, seconds, alive, last, text = _stopped_by(
        lambda pid: (os.killpg if to == "group" else os.kill)(pid, signal.SIGINT), tmp_path)  # a terminal: the group
    assert status == 130 and seconds < 5 and alive == [], (status, seconds, alive, text[-3000:])
    assert re.fullmatch(r"interrupted at step \d+ of 100000; resume from the newest checkpoint with --resume \S+",
                        last), text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


def test_sigterm_to_the_launcher_stops_every_rank_with_one_line_saying_so_and_the_step(tmp_path):
    # A scheduler's kill (or `kill PID`) of the launching process: stopped as Ctrl-C stops a run, and
    # said (issue 36, section 4), exit 143 = 128 + SIGTERM; the newest checkpoint stays resumable.
    status, seconds, alive, last, text = _stopped_by(lambda pid: os.kill(pid, signal.SIGTERM), tmp_path)
    assert status == 143 and seconds < 5 and alive == [], (status, seconds, alive, text[-3000:])
    assert re.fullmatch(r"terminated \(SIGTERM\): interrupted at step \d+ of 100000; resume from the newest "
                        r"checkpoint with --resume \S+", last), text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


def _group_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[2]) if fields[0] != "Z" else None
    except OSError:
        return None


# ----------------------------------------------------------------------------------------------
# 6. The third hostile pass (issue 36): faults from outside during a run, broken output streams,
# ranks that disagree (in one launcher here; two: tests/test_multinode.py). Each ends in one
# sentence naming the path, file or rank, with the last checkpoint intact, or the run completes
# where it can.

STREAM_STEPS = ["--steps", "3", "--eval-every", "0"]


def _wait(pid, seconds):
    """The exit code of a _start()ed run, waited for at most `seconds` (None: still running, killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(code)
        time.sleep(0.05)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _running(pid):
    """The forked run is alive (not yet a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _until(pid, ready, err, seconds=60):
    """Wait until ready() while the run lives; on a timeout or the run's end, stop it and fail."""
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline or not _running(pid):
            os.killpg(pid, signal.SIGKILL) if _running(pid) else None
            os.waitpid(pid, 0)
            pytest.fail(f"the run ended, or did not get there in {seconds} s:\n{_text(err)[-3000:]}")
        time.sleep(0.02)


def _text(f):
    f.seek(0)
    return f.read().decode(errors="replace")


def _left_in_group(pid):
    time.sleep(0.5)
    return [p for p in os.listdir("/proc") if p.isdigit() and _group_of(int(p)) == pid]


def _complete(step_dir):
    """A committed checkpoint that reads back whole (manifest, every shard, every tensor)."""
    manifest, full, _ = checkpoint.read_checkpoint(step_dir)
    return manifest["step"] == int(os.path.basename(step_dir).split("_")[1]) and all(
        torch.isfinite(t).all() for t in full.values())


STREAMS = {  # what the shell does with the run's output: (redirections, where stderr can be read)
    "stdout closed": (">&- 2>{err}", True),
    "stderr closed": ("2>&- >{out}", False),
    "stdout to a full disk": (">/dev/full 2>{err}", True),
    "stderr to a full disk": ("2>/dev/full >{out}", False),
    "stdout into head -c 100": ("2>{err} | head -c 100 >/dev/null; exit ${{PIPESTATUS[0]}}", True),
}


@pytest.mark.grid(keep=['stderr to a full disk'])
@pytest.mark.parametrize("how", list(STREAMS))
def test_a_closed_full_or_broken_output_stream_never_costs_the_run_or_its_checkpoints(tmp_path, how):
    redirect, readable = STREAMS[how]
    out, err, ckpt = tmp_path / "out", tmp_path / "err", tmp_path / "ckpt"
    command = " ".join([sys.executable, str(ROOT / "05_3d_gpt.py"), *SMALL, *STREAM_STEPS, "--save", str(ckpt)])
    shell = subprocess.Popen(["bash", "-c", f"{command} {redirect.format(out=out, err=err)}"], cwd=ROOT,
                             start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        code = shell.wait(timeout=80)
    finally:
        left = _left_in_group(shell.pid)
        os.killpg(shell.pid, signal.SIGKILL) if left or shell.poll() is None else None
    said = err.read_text(errors="replace") if readable else ""
    assert code == 0, said[-3000:]
    assert left == []
    assert _complete(str(ckpt / "step_00000003"))
    assert "Traceback" not in said and "Exception ignored" not in said, said[-3000:]
    if readable and how != "stdout closed":
        assert "note: stdout failed (" in said and "the run goes on, printing nothing more there" in said, said[-2000:]


class _FillsAfter:
    """A file whose disk fills after `room` bytes: every write beyond raises ENOSPC, as a full
    tmpfs does."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            self.f.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_metrics_file_whose_disk_fills_stops_the_run_in_one_sentence_and_keeps_the_checkpoints(tmp_path, monkeypatch):
    from plumbing import report
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    room = 2 * 200  # about two lines, whatever their exact length
    monkeypatch.setattr(report, "_open", lambda path, mode: _FillsAfter(open(path, mode), room))
    proc = run_script("05_3d_gpt.py", *SMALL, "--steps", "8", "--eval-every", "0", "--save", ckpt, "--save-every",
                      "1", "--metrics", metrics)
    assert proc.returncode == 1, proc.stderr[-2000:]
    said = re.search(rf"--metrics {re.escape(str(metrics))}: no space left on its disk, writing step (\d)'s line; "
                     rf"the run stops here, and the checkpoints it saved so far are intact", proc.stderr)
    assert said, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.seconds < 10 and proc.leftover == []
    step = int(said[1])  # its line was not written, so its checkpoint was not either; the one before is whole
    saved = sorted(os.listdir(ckpt))
    assert saved[-1] == f"step_{step:08d}" and _complete(str(ckpt / saved[-1])), saved


def test_a_disk_that_fills_in_the_middle_of_a_shard_is_the_no_space_sentence_and_commits_nothing(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    real = checkpoint._open
    monkeypatch.setattr(checkpoint, "_open", lambda path, mode: _FillsAfter(real(path, mode), 3000)
                        if "step_00000002.tmp" in path and path.endswith(".pt") else real(path, mode))
    proc = run_script("05_3d_gpt.py", *SMALL, "--steps", "4", "--eval-every", "0", "--save", ckpt, "--save-every", "1")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert re.search(rf"no space left writing {re.escape(str(ckpt))}/step_00000002.tmp/rank_0000[01].pt \([\d.,]+ MiB "
                     rf"free on its disk\); the previous checkpoint is intact", proc.stderr), proc.stderr[-2000:]
    assert "inline_container" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.seconds < 10 and proc.leftover == []
    assert sorted(os.listdir(ckpt)) == ["step_00000001"] and _complete(str(ckpt / "step_00000001"))


def _train_until_saved(tmp_path, *args):
    """A run saving every step, started; returns (pid, stdout, stderr, save dir) once step 2 is saved."""
    ckpt = tmp_path / "ckpt"
    pid, out, err = _start("05_3d_gpt.py", *SMALL, "--steps", "100000", "--eval-every", "0", "--save", str(ckpt),
                           "--save-every", "1", "--keep", "2", *args)
    _until(pid, lambda: any(n.startswith("step_") and not n.endswith(".tmp") and n >= "step_00000002"
                            for n in (os.listdir(ckpt) if ckpt.exists() else [])), err)
    return pid, out, err, ckpt


def test_a_save_directory_deleted_mid_run_is_said_as_gone_not_as_a_timeout(tmp_path):
    pid, out, err, ckpt = _train_until_saved(tmp_path)
    gone = tmp_path / "deleted"  # moved away in one step, then deleted: rmtree alone can race a save writing into it
    os.rename(ckpt, gone)  # while the run trains, and perhaps while it saves
    shutil.rmtree(gone, ignore_errors=True)
    attacked = time.monotonic()
    code, seconds, said = _wait(pid, 30), time.monotonic() - attacked, _text(err)
    left = _left_in_group(pid)
    assert code == 1 and seconds < 10 and left == [], (code, seconds, left, said[-3000:])
    assert re.search(rf"({re.escape(str(ckpt))}, where this run saves, is gone: deleted or moved while the run "
                     rf"trained|cannot (write|make) {re.escape(str(ckpt))}/step_\d+\S*: No such file or directory)",
                     said), said[-3000:]
    assert "timed out" not in said and "1800" not in said and "Traceback" not in said, said[-3000:]
    assert not ckpt.exists()  # not made again behind the user's back


def _immutable(path):
    """Make the directory path unwritable, even for root where chattr can: a function that undoes it,
    or None where neither works here."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        return lambda: os.chmod(path, 0o755)
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
        return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)
    return None


def test_a_save_directory_made_unwritable_mid_run_is_one_sentence_and_the_last_checkpoint_survives(tmp_path):
    pid, out, err, ckpt = _train_until_saved(tmp_path)
    undo = _immutable(ckpt)
    if undo is None:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.skip("neither chmod (as root) nor chattr can make a directory unwritable here")
    try:
        attacked = time.monotonic()
        code, seconds, said = _wait(pid, 30), time.monotonic() - attacked, _text(err)
        left = _left_in_group(pid)
    finally:
        undo()
    assert code == 1 and seconds < 10 and left == [], (code, seconds, left, said[-3000:])
    assert re.search(rf"cannot (make|write) {re.escape(str(ckpt))}/step_\d+(\.tmp)?\S*( from \S+)?:? \(?(Operation not "
                     rf"permitted|Permission denied)", said), said[-3000:]
    assert "Traceback" not in said and "timed out" not in said, said[-3000:]
    saved = sorted(n for n in os.listdir(ckpt) if not n.endswith(".tmp"))
    assert saved and _complete(str(ckpt / saved[-1])), saved


def test_a_bin_truncated_while_training_names_the_file_not_sigbus(tmp_path):
    corpus = tmp_path / "ids.bin"
    corpus.write_bytes(struct.pack("<40000H", *(i % 200 for i in range(40000))))
    metrics = tmp_path / "m.jsonl"
    pid, out, err = _start("05_3d_gpt.py", *SMALL, "--steps", "100000", "--eval-every", "0", "--data", str(corpus),
                           "--metrics", str(metrics))
    _until(pid, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, err)
    os.truncate(corpus, 100)
    attacked = time.monotonic()
    code, seconds, said = _wait(pid, 30), time.monotonic() - attacked, _text(err)
    assert code == 1 and seconds < 10 and _left_in_group(pid) == [], (code, seconds, said[-3000:])
    assert f"--data {corpus}: the file is 100 bytes now, shorter than the" in said, said[-3000:]
    assert "it was truncated while the run trained on it" in said and "SIGBUS" not in said, said[-3000:]
    assert "Traceback" not in said, said[-3000:]


def test_a_text_file_larger_than_the_memory_left_is_a_sentence_not_a_memory_error(tmp_path):
    import resource
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: 512 MiB of zero bytes (valid byte tokens) that take no disk
        f.truncate(512 << 20)
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the run, with 256 MiB of address space beyond what it has mapped now
        try:
            os.setpgid(0, 0)
            with open("/proc/self/status") as f:
                vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
            resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
            sys.argv = [str(ROOT / "05_3d_gpt.py"), *SMALL, "--data", str(big)]
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 2
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    t0 = time.monotonic()
    code, said = _wait(pid, 30), _text(err)
    assert code == 1 and time.monotonic() - t0 < 10, (code, said[-3000:])
    assert f"--data {big}: 512.0 MiB of text does not fit in this process's memory" in said, said[-3000:]
    assert "MemoryError" not in said and "Traceback" not in said, said[-3000:]


def test_a_window_of_one_token_trains_and_says_the_sum_probe_cannot_fit(tmp_path):
    proc = run_script("05_3d_gpt.py", "--block-size", "1", "--seq-len", "1", "--steps", "2", "--eval-every", "0",
                      "--no-check")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "done: 2 steps" in proc.stdout
    assert 'sums: not probed: a window of --seq-len 1 cannot hold "9 plus 9 is 18." (15 tokens)' in proc.stdout
    assert proc.seconds < 20 and proc.leftover == []


def _disagree(env, variant):
    """05's train on each rank, rank 1 started otherwise (variant), as under two launchers."""
    tc, cfg = replace(PP2, steps=2), CFG
    if env.rank == 1:
        tc = {"layers": tc, "seed": replace(tc, seed=7), "many": replace(tc, seed=7, lr=0.02, keep=3, eval_every=2,
                                                                          grad_clip=0.7)}[variant]
        cfg = replace(CFG, n_layer=4) if variant in ("layers", "many") else cfg
    return gpt3d.train(env, cfg, tc, quiet=True)["losses"]


@pytest.mark.parametrize("variant, said", [
    ("layers", "they differ in --n-layer (rank 0: 8; rank 1: 4); give every node the same command"),
    ("seed", "they differ in --seed (rank 0: 1337; rank 1: 7)"),
    ("many", "they differ in --n-layer (rank 0: 8; rank 1: 4), --lr (rank 0: 0.01; rank 1: 0.02), --grad-clip "
             "(rank 0: 0.5; rank 1: 0.7), and 3 more;")])
def test_ranks_started_with_different_configurations_are_refused_on_every_rank_before_training(run_ranks, variant, said):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_disagree, 2, variant)
    text = str(failure.value)
    assert text.count(said) == 2 and "nothing was trained or written" in text, text  # rank 0's and rank 1's


def _late(env, seconds):
    from plumbing import agreement
    if env.rank == 1:  # never arrives within the others' timeout (still starting, stuck, or gone)
        time.sleep(seconds)
        os._exit(0)
    agreement.check(env, CFG, PP2, None, 0)


def test_a_rank_that_never_reaches_the_agreement_is_named_by_the_others():
    from plumbing.launch import launch
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 0 of 2: rank 1 never reached the check that every rank runs the same "
                                          r"configuration \(within --timeout-s 30 s\)"):
        launch(_late, 2, 8, timeout_s=3, deadline_s=30)
    assert time.monotonic() - t0 < 15


def test_flags_spelled_otherwise_or_left_to_their_defaults_agree():
    from plumbing import agreement
    cwd = os.getcwd()
    os.chdir(ROOT)  # relative paths, resolved from the rank's working directory
    try:
        base = replace(PP2, data=str(ROOT / "README.md"), save="ckpt", timeout_s=30, dtype="auto", lr=0.003)
        same = replace(base, data="./README.md", save=str(ROOT / "ckpt") + "/", hang_s=15.0, dtype="float32",
                       fused_kernels=False, cuda_graphs=False, lr=3e-3)  # unset: half of --timeout-s; CPU's
        mine, theirs = agreement.items(CFG, base, None, 0), agreement.items(CFG, same, None, 0)
        other = agreement.items(CFG, replace(base, hang_s=20.0), None, 0)
    finally:
        os.chdir(cwd)
    assert agreement.digest(mine) == agreement.digest(theirs), {k: (v, theirs[k]) for k, v in mine.items()
                                                                 if v[0] != theirs[k][0]}
    assert agreement.digest(other) != agreement.digest(mine)
