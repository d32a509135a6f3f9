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
import io
import json
import math
import os
import re
import runpy
import signal
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
         "16", "--batch-size", "8", "--microbatches", "2", "--seq-len", "16"]  # PP2 on the command line


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
    assert text.splitlines()[1].startswith("ValueError: --metrics")  # the cause first, not "Connection reset"
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
               "--eval-every", "0"]


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
    proc = run_script("05_3d_gpt.py", *WATCH_SMALL, "--steps", "8", "--timeout-s", "1.5", "--rehearse-fault",
                      "slow:0:1100", timeout=60)
    assert proc.leftover == [] and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if proc.returncode != 0:
        line = _first_error(proc.stderr)
        assert line.startswith("error: hang: no rank made progress for 1 s. rank 0 (tp 0, dp 0, pp 0): rank 0 is not in "
                               "any collective"), proc.stderr[-3000:]
        said = re.search(r"(Every rank's Python stack|The Python stacks? of ranks? ([\d, ]+) \(the others wrote none "
                         r"in time\)): (\S+)/rank<N>\.txt$", line)
        assert said or line.endswith("No rank wrote its Python stack in time"), line
        for r in (range(8) if said and said[2] is None else map(int, said[2].split(", ")) if said else []):
            assert os.path.exists(os.path.join(said[3], f"rank{r}.txt")), line


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


@pytest.mark.parametrize("to", ["group", "launcher"], ids=["Ctrl-C in the terminal", "kill -INT to the launcher"])
def test_ctrl_c_stops_every_rank_with_one_line_saying_the_step(tmp_path, to):
    metrics = tmp_path / "m.jsonl"
    pid, out, err = _start("05_3d_gpt.py", *SMALL, "--steps", "100000", "--eval-every", "0", "--metrics", str(metrics),
                           "--save", str(tmp_path / "ckpt"))
    deadline = time.monotonic() + 60
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    (os.killpg if to == "group" else os.kill)(pid, signal.SIGINT)  # a terminal signals the whole group
    signalled, status = time.monotonic(), None
    while status is None and time.monotonic() < signalled + 10:
        done, code = os.waitpid(pid, os.WNOHANG)
        status = os.waitstatus_to_exitcode(code) if done else None
        time.sleep(0.05)
    seconds = time.monotonic() - signalled
    time.sleep(0.5)  # the ranks' exits, once the launcher's is seen
    alive = [p for p in os.listdir("/proc") if p.isdigit() and _group_of(int(p)) == pid]
    if status is None or alive:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0) if status is None else None
    err.seek(0)
    text = err.read().decode(errors="replace")
    lines = [x for x in text.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("train:")]
    assert status == 130 and seconds < 5 and alive == [], (status, seconds, alive, text[-3000:])
    assert re.fullmatch(r"interrupted at step \d+ of 100000; resume from the newest checkpoint with --resume \S+",
                        lines[-1]), text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


def _group_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[2]) if fields[0] != "Z" else None
    except OSError:
        return None
