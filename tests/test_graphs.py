"""kernels/graphs.py and the accelerated trainer: CUDA graph slots are data, replays go through the
executor like eager calls, and (on a GPU) graphs and fused kernels train like the plain path.

Tolerances. CPU, float64: the stand-in capture runs the same modules, so 1e-12 only allows for
nothing but reordering (a slot or hook mix-up is O(1)). GPU, fp32 training for 6 steps: a graph
replays the very kernels eager ran, so 1e-6 relative on the loss (in practice equal); the fused
kernels' fp32 results differ from PyTorch's by ~1e-6 per op (other summation orders, tanhf/expf),
which AdamW carries through 6 steps to ~1e-5, so 1e-4 relative on the loss trajectory.
"""
import contextlib
import dataclasses
import io
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, load

tensor_parallel = load("01_tensor_parallel")
pipeline = load("02_pipeline_1f1b")
interleaved = load("03_interleaved")
from kernels import graphs  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CFG = tensor_parallel.GPTConfig(vocab_size=97, block_size=16, n_layer=4, n_head=2, n_embd=16)


# ----------------------------------------------------------------------------------------------
# Slots: pure data.


def _in_flight_never_share(actions, slot_of):
    live = {}
    for a in actions:
        key = (a.chunk, a.mb)
        if a.kind == "F":
            taken = {s for (c, _), s in live.items() if c == a.chunk}
            assert slot_of[key] not in taken, f"{key} reuses a slot still in flight"
            live[key] = slot_of[key]
        else:
            del live[key]


@pytest.mark.parametrize("pp,m", [(1, 1), (2, 4), (4, 8), (4, 3)])
def test_1f1b_needs_pp_minus_stage_graph_copies_and_gpipe_needs_m(pp, m):
    for r in range(pp):
        f1b, gp = pipeline.one_f_one_b(pp, m, r), pipeline.gpipe(pp, m, r)
        assert graphs.slots(f1b)[1] == {0: min(pp - r, m)}
        assert graphs.slots(gp)[1] == {0: m}
        _in_flight_never_share(f1b, graphs.slots(f1b)[0])


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4)])
def test_interleaved_slots_never_give_two_in_flight_microbatches_one_copy(pp, m, v):
    for r in range(pp):
        actions = interleaved.interleaved(pp, m, r, v)
        slot_of, counts = graphs.slots(actions)
        _in_flight_never_share(actions, slot_of)
        assert set(counts) == set(range(v)) and all(1 <= n <= m for n in counts.values())
        assert counts == {c: pipeline.peak_in_flight([a for a in actions if a.chunk == c]) for c in range(v)}


# ----------------------------------------------------------------------------------------------
# The replay path through the executor, on CPU, with a stand-in for torch.cuda.make_graphed_callables
# that keeps the semantics a wrong buffer plan would break: the sample tensors it is given ARE the
# graph's static inputs; each call copies its inputs into them and computes from them, and the
# backward reads what the forward saved, which still points into them. (torch's capture does the
# same: a replay's copy into the static input is no autograd operation, so nothing notices a later
# replay overwriting an input that an earlier microbatch's backward still needs; neither does this.)


def faithful_make_graphed_callables(module, sample_args):
    static, params = sample_args, tuple(module.parameters())

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs_and_params):
            inputs = inputs_and_params[:len(static)]
            for buffer, x in zip(static, inputs):
                buffer.data.copy_(x)  # into the static input: .data, so no version counter sees it
            with torch.enable_grad():
                leaves = [b.detach().requires_grad_(b.requires_grad) for b in static]  # b's storage
                out = module(*leaves)
            ctx.leaves, ctx.out = leaves, out
            return out.detach()

        @staticmethod
        def backward(ctx, grad):
            wrt = [x for x in ctx.leaves if x.requires_grad] + list(params)
            got = iter(torch.autograd.grad(ctx.out, wrt, grad, allow_unused=True))
            return tuple(next(got) if x.requires_grad else None for x in ctx.leaves) + tuple(got)

    return lambda *inputs: Replay.apply(*inputs, *params)


def _graph_step(env, v, m, sched_name, graphed):
    """One step of this rank's list through the executor, eager or through StageGraphs' chunks."""
    pp, rank = env.world_size, env.rank
    torch.manual_seed(0)
    micro = pipeline.split_batch(torch.randint(97, (2 * m, 16)), torch.randint(97, (2 * m, 16)), m)
    cfg = dataclasses.replace(CFG, n_layer=pp * v)  # a layer per chunk
    full = tensor_parallel.init_state_dict(cfg, 3, dtype=torch.float64, random_all=True)
    chunks = pipeline.build_chunks(cfg, pp, rank, v, None, init=False, dtype=torch.float64)
    for c in chunks:
        c.load_full_state_dict(full)
    schedule = interleaved.InterleavedSchedule([interleaved.interleaved(pp, m, r, v) if sched_name == "interleaved" else
                                  pipeline.SCHEDULES[sched_name](pp, m, r) for r in range(pp)])
    actions = schedule.lists[rank]
    run_chunks, captured = chunks, None
    if graphed:
        real, torch.cuda.make_graphed_callables = torch.cuda.make_graphed_callables, faithful_make_graphed_callables
        try:
            samples = {c: (micro[0][0] if c == 0 and rank == 0 else
                           torch.randn(2, 16, 16, dtype=torch.float64, requires_grad=True), micro[0][1]) for c in range(v)}
            sg = graphs.StageGraphs(chunks, actions, v - 1 if rank == pp - 1 else None, samples)
        finally:
            torch.cuda.make_graphed_callables = real
        run_chunks, captured = sg.chunks, sg.captured
        assert captured == sum(graphs.slots(actions)[1].values())
    res = pipeline.execute(schedule, run_chunks, dist.group.WORLD, micro, pipeline.Wire((2, 16, 16)),
                           deallocate=not graphed)
    shared = max(graphs.slots(actions)[1].values()) > 1  # some chunk has two microbatches in flight
    return (None if res.loss is None else float(res.loss),
            {n: p.grad.clone() for c in chunks for n, p in c.named_parameters()}, shared)


def _stage_graphs_match_eager(env, v, m, sched_name):
    return [_graph_step(env, v, m, sched_name, graphed) for graphed in (False, True)]


@pytest.mark.parametrize("pp,v,m,sched_name", [(2, 1, 4, "1f1b"), (2, 1, 4, "gpipe"), (3, 1, 4, "1f1b"),
                                               (1, 4, 4, "interleaved"), (2, 2, 4, "interleaved")])
def test_replays_through_the_executor_give_the_eager_loss_and_gradients_with_shared_slots(run_ranks, pp, v, m,
                                                                                            sched_name):
    # Stages whose chunks take an activation and hold two or more microbatches in flight (1F1B at
    # pp >= 3 on its middle stages, pp = 2 with v = 2, pp = 1 with v = 4) read their inputs back in
    # backward: with one static input shared by a chunk's slots, the later forward's input replaces the
    # earlier one's and ln_1's gradients, then every upstream gradient, come out wrong (O(1)).
    results = run_ranks(_stage_graphs_match_eager, pp, v, m, sched_name)
    assert any(shared for (_, _, shared), _ in results)
    for (loss_e, grads_e, _), (loss_g, grads_g, _) in results:
        assert loss_e == loss_g
        for n in grads_e:
            assert tensor_parallel.max_rel_diff(grads_g[n], grads_e[n]) <= 1e-12, n


def _train_graphed(env, graphed, steps=3):
    """05's trainer at pp = 2, v = 2 (a layout with shared slots), its stage graphs captured by the
    faithful stand-in (graphed) or not: the losses of `steps` steps."""
    gpt3d = load("05_3d_gpt")
    tc = gpt3d.TrainConfig(tp=1, pp=2, dp=1, virtual_stages=2, batch_size=8, microbatches=4, seq_len=16, steps=steps,
                           lr=1e-2, dtype="float64", eval_every=0, bucket_numel=500, timeout_s=30)
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, 1, 1, 2))
    run = gpt3d.build(env, CFG, tc, groups)
    if graphed:
        run.forward_backward = graphs.Graphed("stage", gpt3d.forward_backward, pipeline.StepResult)
    torch.cuda.make_graphed_callables = faithful_make_graphed_callables  # this forked rank only
    gen = torch.Generator().manual_seed(1)
    return [gpt3d.train_step(run, *torch.randint(97, (2, 8, 16), generator=gen), 1e-2)[0] for _ in range(steps)]


def test_a_layout_with_shared_slots_trains_to_the_same_losses_with_and_without_stage_graphs(run_ranks):
    eager, graphed = (run_ranks(_train_graphed, 2, g)[0] for g in (False, True))
    assert tensor_parallel.max_rel_diff(torch.tensor(graphed), torch.tensor(eager)) <= 1e-12, (eager, graphed)


# ----------------------------------------------------------------------------------------------
# A capture that fails. On a GPU, torch's embedding backward above 3,072 token ids per microbatch
# sorts them and synchronises inside, which capture refuses (pytorch issue 82886). The rank says so
# in one sentence and trains eagerly, undoing what the failed capture left: the step graph's warm-up
# ran the gradient hooks (with sync off), so the buffer holds gradients and the hooks' counts.

CAPTURE_ERROR = ("unique_by_key: failed to synchronize: cudaErrorStreamCaptureUnsupported: operation not "
                 "permitted when stream is capturing")


class StepCaptureFailsHalfway:
    """StepGraph as it fails on a GPU: a warm-up forward and backward ran (the hooks wrote the first
    microbatch's gradients into the flat buffer), then the capture raised."""

    def __init__(self, chunk, micro, ddp, **options):
        chunk(*micro[0])[1].backward()
        try:  # as torch raises it: the capture's own error, then capture_end's, with advice below each
            raise RuntimeError(f"{CAPTURE_ERROR}\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture\n"
                               "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.")


def capture_fails_on_token_ids(module, sample_args):
    """make_graphed_callables failing for the chunk that takes token ids (the embedding's), faithful
    for the others."""
    if not sample_args[0].is_floating_point():
        raise RuntimeError(CAPTURE_ERROR)
    return faithful_make_graphed_callables(module, sample_args)


def _train_capture_fails(env, mode, steps=3):
    """05's trainer, eager (mode None) or with graphs whose capture fails (mode "step": tp = pp = dp
    = 1; "stage": pp = 2, v = 2): the losses of `steps` steps, what the rank printed, and whether its
    buckets are reduced during backward again (the step graph turns that off: its hooks ran at capture)."""
    gpt3d = load("05_3d_gpt")
    pp = env.world_size
    tc = gpt3d.TrainConfig(tp=1, pp=pp, dp=1, virtual_stages=pp, batch_size=8, microbatches=4, seq_len=16,
                           steps=steps, lr=1e-2, dtype="float64", eval_every=0, bucket_numel=500, timeout_s=30)
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(pp, 1, 1, pp))
    run = gpt3d.build(env, CFG, tc, groups)
    if mode:
        run.forward_backward = graphs.Graphed(mode, gpt3d.forward_backward, pipeline.StepResult)
    graphs.StepGraph = StepCaptureFailsHalfway  # this forked rank only
    torch.cuda.make_graphed_callables = capture_fails_on_token_ids
    gen, out = torch.Generator().manual_seed(1), io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = [gpt3d.train_step(run, *torch.randint(97, (2, 8, 16), generator=gen), 1e-2)[0] for _ in range(steps)]
    return losses, out.getvalue(), run.ddp.sync


@pytest.mark.parametrize("mode,ranks", [("step", 1), ("stage", 2)])
def test_a_failed_capture_is_said_once_and_the_rank_trains_as_without_graphs(run_ranks, mode, ranks):
    eager = run_ranks(_train_capture_fails, ranks, None)
    failed = run_ranks(_train_capture_fails, ranks, mode)
    assert tensor_parallel.max_rel_diff(torch.tensor(failed[0][0]), torch.tensor(eager[0][0])) <= 1e-12
    what = "the whole step" if mode == "step" else "the stage's chunks"
    said = (f"CUDA graphs: capturing {what} failed on rank 0 ({CAPTURE_ERROR}); this rank trains without graphs "
            f"from this step on, as with --no-cuda-graphs\n")
    assert failed[0][1] == said  # rank 0 holds the embedding: once, at the first step
    assert all(printed == "" for _, printed, _ in failed[1:])  # stage 1's chunks take activations: captured
    assert all(sync for _, _, sync in failed)


# ----------------------------------------------------------------------------------------------
# GPU: the trainer with graphs / kernels against the plain path (torchrun, one GPU).


def _torchrun(tmp_path, name, *args):
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(ROOT / "05_3d_gpt.py"), "--tp", "1", "--pp", "1", "--dp", "1", "--steps", "6",
           "--dtype", "float32", "--eval-every", "0", "--no-check", "--metrics", str(metrics), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=80, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.tensor([json.loads(line)["loss"] for line in metrics.read_text().splitlines()]), proc.stdout


@needs_cuda
def test_whole_step_graph_trains_like_eager(tmp_path):
    eager, _ = _torchrun(tmp_path, "eager", "--no-cuda-graphs", "--no-fused-kernels")
    graphed, out = _torchrun(tmp_path, "graphed", "--cuda-graphs", "--no-fused-kernels")
    assert "CUDA graphs: whole step" in out
    assert tensor_parallel.max_rel_diff(graphed, eager) <= 1e-6


@needs_cuda
def test_stage_graphs_train_like_eager_with_microbatches(tmp_path):
    args = ("--microbatches", "4", "--no-fused-kernels")
    eager, _ = _torchrun(tmp_path, "eager", "--no-cuda-graphs", *args)
    # One GPU, so pp=1: --graph-scope stage takes the per-stage path the whole step would replace.
    graphed, out = _torchrun(tmp_path, "graphed", "--cuda-graphs", "--graph-scope", "stage", *args)
    assert "CUDA graphs: per stage and microbatch" in out
    assert tensor_parallel.max_rel_diff(graphed, eager) <= 1e-6


@needs_cuda
def test_the_kernel_path_trains_like_the_reference_path(tmp_path):
    ref, _ = _torchrun(tmp_path, "ref", "--fused-kernels", "--kernel-path", "reference", "--no-flash-attention",
                       "--no-cuda-graphs")
    fused, out = _torchrun(tmp_path, "fused", "--fused-kernels", "--kernel-path", "cuda", "--no-flash-attention",
                           "--no-cuda-graphs")
    assert "kernel paths" in out and "reference" not in out.split("kernel paths")[1].splitlines()[0]
    assert tensor_parallel.max_rel_diff(fused, ref) <= 1e-4
