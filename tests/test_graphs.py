"""kernels/graphs.py and the accelerated trainer: CUDA graph slots are data, replays go through the
executor like eager calls, and (on a GPU) graphs and fused kernels train like the plain path.

Tolerances. CPU, float64: the stand-in capture runs the same modules, so 1e-12 only allows for
nothing but reordering (a slot or hook mix-up is O(1)). GPU, fp32 training for 6 steps: a graph
replays the very kernels eager ran, so 1e-6 relative on the loss (in practice equal); the fused
kernels' fp32 results differ from PyTorch's by ~1e-6 per op (other summation orders, tanhf/expf),
which AdamW carries through 6 steps to ~1e-5, so 1e-4 relative on the loss trajectory.
"""
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
# The replay path through the executor, with capture replaced by the plain module (CPU).


def _stage_graphs_match_eager(env, sched_name):
    pp, rank = env.world_size, env.rank
    torch.manual_seed(0)
    micro = pipeline.split_batch(torch.randint(97, (8, 16)), torch.randint(97, (8, 16)), 4)
    full = tensor_parallel.init_state_dict(CFG, 3, dtype=torch.float64, random_all=True)
    results = []
    for graphed in (False, True):
        chunks = pipeline.build_chunks(CFG, pp, rank, 1, None, init=False, dtype=torch.float64)
        for c in chunks:
            c.load_full_state_dict(full)
        actions = pipeline.SCHEDULES[sched_name](pp, 4, rank)
        call = None
        if graphed:  # the stand-in "capture" returns the wrapper itself: replays are plain calls
            real, torch.cuda.make_graphed_callables = torch.cuda.make_graphed_callables, lambda mod, args: mod
            try:
                x = micro[0][0] if rank == 0 else torch.randn(2, 16, 16, dtype=torch.float64, requires_grad=True)
                sg = graphs.StageGraphs(chunks, actions, 0 if rank == pp - 1 else None, {0: (x, micro[0][1])})
            finally:
                torch.cuda.make_graphed_callables = real
            call = sg.call
            assert sg.captured == graphs.slots(actions)[1][0]
        res = pipeline.execute(actions, chunks, dist.group.WORLD, micro, (2, 16, 16), call=call, deallocate=not graphed)
        results.append((None if res.loss is None else float(res.loss),
                        {n: p.grad.clone() for n, p in chunks[0].named_parameters()}))
    return results


@pytest.mark.parametrize("sched_name", ["1f1b", "gpipe"])
def test_replays_through_the_executor_give_the_eager_loss_and_gradients(run_ranks, sched_name):
    for (loss_e, grads_e), (loss_g, grads_g) in run_ranks(_stage_graphs_match_eager, 2, sched_name):
        assert loss_e == loss_g
        for n in grads_e:
            assert tensor_parallel.max_rel_diff(grads_g[n], grads_e[n]) <= 1e-12, n


# ----------------------------------------------------------------------------------------------
# GPU: the trainer with graphs / kernels against the plain path (torchrun, one GPU).


def _torchrun(tmp_path, name, *args):
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(ROOT / "05_3d_gpt.py"), "--tp", "1", "--pp", "1", "--dp", "1", "--steps", "6",
           "--dtype", "float32", "--eval-every", "0", "--metrics", str(metrics), *args]
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
