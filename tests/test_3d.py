"""05_3d_gpt: every layout trains exactly like the serial model, with each overlap on and off, and
bad input stops cleanly.

Tolerance: float64, max|a - b| / max|b| <= 1e-10 on the loss and the gradient-norm trajectories
over 10 AdamW steps with warmup, cosine decay and active clipping. Layouts only reorder additions
(a few ulps); AdamW and the clipping coefficient propagate them, staying far below 1e-10 here. A
norm that counts replicated weights tp times or the tied embedding twice is off by O(1), and so is
a bucket reduced while the tied embedding's sum still writes into it (measured with the tied
embedding's buckets not held back: 0.43, and 0.34 with ZeRO-1).
"""
import functools
import math
import re
import struct
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from conftest import TOL, TRAINER_BASE, TRAINER_CFG, load, run_script
from plumbing import checks, data
from plumbing.gpt2 import export_checkpoint
from plumbing.reference import serial_train

tensor_parallel = load("01_tensor_parallel")
pipeline = load("02_pipeline_1f1b")
data_parallel = load("04_data_parallel")
gpt3d = load("05_3d_gpt")
CFG, BASE = TRAINER_CFG, TRAINER_BASE


def layout(tp_, pp, dp, v=1, **kw):
    m = 4 if v > 1 and pp == 4 else 2  # interleaving needs m divisible by pp
    return replace(BASE, tp=tp_, pp=pp, dp=dp, virtual_stages=v, microbatches=m, **kw)


@pytest.fixture(scope="module")
def serial():
    return serial_train(CFG, BASE)


def _train_all(env, tcs):
    return [gpt3d.train(env, CFG, tc, quiet=True) for tc in tcs]


LAUNCHES = {  # grouped by world size: one launch runs several trainings in turn
    "world 1": [layout(1, 1, 1)],
    "world 2": [layout(2, 1, 1), layout(1, 2, 1), layout(1, 1, 2), layout(1, 1, 2, 2, zero1=True),
                # The fused kernels' reference path (same formulas as the CUDA kernels, in PyTorch),
                # with attention as matmul + the fused scaled causal softmax instead of SDPA.
                layout(2, 1, 1, fused_kernels=True, kernel_path="reference", flash_attention=False)],
    "world 4": [layout(2, 2, 1, 2), layout(2, 2, 1, 2, scatter_gather=False), layout(1, 4, 1, 2),
                layout(1, 2, 2, 2), layout(1, 2, 2, 2, zero1=True),
                layout(2, 2, 1, 2, sequence_parallel=True, recompute="selective")],
    "world 8": [layout(2, 2, 2), layout(2, 2, 2, zero1=True)],  # scatter/gather off: world 4's
    "world 8, sp and recompute": [layout(2, 2, 2, sequence_parallel=True), layout(2, 2, 2, recompute="full")],
}
OFF = dict(overlap_grad_reduce=False, overlap_param_gather=False,  # the reduction after the flush, as before,
           overlap_input_grad=False, background_sends=False)  # and 01's, 02's switches


def reduces(tc):
    """Off, a layout runs only where the DP switches act: dp > 1 (the buckets, ZeRO-1's gather), and not
    the variants of tp's traffic and of recomputation, which meet the reduction as the plain layout does.
    The world-8 layouts have tp = pp = 2 too: there 01's and 02's switches are off as well."""
    same_tp = (tc.scatter_gather, tc.sequence_parallel, tc.recompute) == (BASE.scatter_gather, BASE.sequence_parallel,
                                                                         BASE.recompute)
    return tc.dp > 1 and same_tp


GRID = [(name, "on") for name in LAUNCHES] + [(name, "off") for name, tcs in LAUNCHES.items() if any(map(reduces, tcs))]


@pytest.mark.grid(keep=['world 8-overlap on', 'world 4-overlap off', 'world 2-overlap off', 'world 1-overlap on'])
@pytest.mark.parametrize("name, overlap", GRID, ids=[f"{name}-overlap {o}" for name, o in GRID])
def test_every_layout_trains_like_the_serial_model_loss_and_grad_norm(run_ranks, serial, name, overlap):
    tcs = [tc if overlap == "on" else replace(tc, **OFF) for tc in LAUNCHES[name] if overlap == "on" or reduces(tc)]
    world = tcs[0].tp * tcs[0].pp * tcs[0].dp
    assert max(serial["norms"]) > BASE.grad_clip  # clipping is active, so the norm matters
    for tc, out in zip(tcs, run_ranks(_train_all, world, tcs)[0]):
        what = f"tp={tc.tp} pp={tc.pp} dp={tc.dp} v={tc.virtual_stages} zero1={tc.zero1} " \
               f"sp={tc.sequence_parallel} recompute={tc.recompute} sg={tc.scatter_gather} fused={tc.fused_kernels} " \
               f"overlap={tc.overlap_grad_reduce, tc.overlap_param_gather, tc.overlap_input_grad, tc.background_sends}"
        for key in ("losses", "norms"):
            got, want = torch.tensor(out[key]), torch.tensor(serial[key])
            assert tensor_parallel.max_rel_diff(got, want) <= TOL, (what, key, got - want)
        # The p2p message between stages: b*T*C float64 elements, 1/tp of it with scatter/gather.
        if tc.pp > 1:
            b = tc.batch_size // (tc.dp * tc.microbatches)
            split = tc.tp if (tc.scatter_gather or tc.sequence_parallel) else 1
            assert out["bytes_per_message"] == b * tc.seq_len * CFG.n_embd * 8 / split, what


def _dropout_recompute(env, fused):
    cfg = replace(CFG, dropout=0.2, n_layer=2)
    # With the fused kernels the attention is matmul + softmax + torch's dropout (flash off): the
    # selective region then holds a dropout of its own, drawn from the tracked stream.
    tcs = [replace(BASE, tp=2, steps=3, recompute=r, fused_kernels=fused, kernel_path="reference",
                   flash_attention=not fused, sequence_parallel=fused) for r in ("none", "full", "selective")]
    return [gpt3d.train(env, cfg, tc, quiet=True)["losses"] for tc in tcs]


@pytest.mark.parametrize("fused", [False, True], ids=["pytorch ops", "fused bias-dropout-add (hashed masks, sp)"])
def test_recomputation_full_or_selective_replays_the_dropout_masks_inside_and_outside_tp_regions(run_ranks, fused):
    plain, *recomputed = run_ranks(_dropout_recompute, 2, fused)[0]
    assert plain[0] != plain[1]  # the steps differ: training happened
    for losses in recomputed:
        assert tensor_parallel.max_rel_diff(torch.tensor(losses), torch.tensor(plain)) <= TOL


# ----------------------------------------------------------------------------------------------
# Selective recomputation: what one layer stores for backward, against Korthikanti's Table 2.


def _stored_bytes_per_layer(env, mode, T):
    tp = env.world_size
    cfg = tensor_parallel.GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=4, n_embd=32, dropout=0.1)
    model = tensor_parallel.GPT(cfg, dist.new_group(list(range(tp))), sequence_parallel=True, dtype=torch.float64)
    gpt3d.recompute_layers(model, mode)
    x = torch.randn(2, T // tp, cfg.n_embd, dtype=torch.float64, requires_grad=True)  # (b, s/t, h)
    meter = pipeline.ActivationMeter([model], {})  # what autograd saves, parameters left out
    with meter.forward("layer 0"):
        y = model.transformer.h["0"](x)
    y.sum().backward()  # the recomputation runs (its masks replay: the test above)
    return sum(meter.saved["layer 0"].values())


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_one_layer_stores_korthikantis_activation_bytes_up_to_three_named_differences(run_ranks, mode):
    """Korthikanti et al. 2022 Table 2 with t-way tensor and sequence parallelism, in bytes of 16-bit
    activations and 1-byte dropout masks: 34sbh/t + 5as^2b/t per layer without recomputation,
    34sbh/t with selective recomputation, 2sbh/t (the layer's input) with full. Ours, in the same
    units (float64 here: every byte count x 8/2), adds
      4sbh (1 - 1/t): the inputs of the two column-parallel GEMMs are kept all-gathered (s, not s/t;
                      Megatron keeps the shard and all-gathers it again in backward);
      2sbh/t:         the dropout masks after attention and after the MLP cost as much as
                      activations (torch's CPU dropout keeps its scaled mask in the activation
                      dtype; Korthikanti counts 1 byte each, as a fused GPU dropout keeps);
      8sb/t:          the two LayerNorms' mean and 1/std, one number each per token (small:
                      Korthikanti leaves them out);
    and, without recomputation, 6as^2b/t for the attention core instead of 5as^2b/t: the softmax,
    its dropout mask (again as large as an activation) and the dropout's output, as torch's CPU
    attention keeps them when it drops out (its math path; it also copies q, k and v, which then
    replace the QKV output: the same bytes). Exact equality: a tensor stored more or less, or kept
    twice, changes the count."""
    t, s, b, h, a, elt = 2, 16, 2, 32, 4, 8
    ours = 34 * s * b * h / t + 4 * s * b * h * (1 - 1 / t) + 2 * s * b * h / t + 8 * s * b / t
    want = {"none": ours + 6 * a * s * s * b / t, "selective": ours, "full": 2 * s * b * h / t}[mode]
    assert run_ranks(_stored_bytes_per_layer, t, mode, s)[0] == want * elt / 2


def test_each_replica_reads_a_disjoint_slice_and_together_they_read_the_global_batch():
    tokens = torch.arange(5000) % 256
    tc = replace(BASE, dp=4, batch_size=16)
    idx, targets = data.global_batch(tokens, 7, tc)
    parts = [data.replica_batch(tokens, 7, tc, r) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), idx)
    assert torch.equal(torch.cat([p[1] for p in parts]), targets)
    assert torch.equal(targets[:, :-1], idx[:, 1:])  # next-token targets


@pytest.mark.parametrize("world,tp_,pp,dp", [(8, 2, 2, 2), (16, 2, 4, 2), (12, 3, 2, 2), (6, 1, 3, 2)])
def test_the_grid_puts_every_rank_in_one_group_of_each_kind(world, tp_, pp, dp):
    grid = gpt3d.rank_grid(world, tp_, dp, pp)
    for kind, size in (("tp", tp_), ("dp", dp), ("pp", pp)):
        assert all(len(g) == size for g in grid[kind])
        assert sorted(r for g in grid[kind] for r in g) == list(range(world))
    assert grid["tp"][0] == list(range(tp_))  # adjacent ranks
    assert grid["pp"][0] == [k * tp_ * dp for k in range(pp)]
    assert all(e == [g[0], g[-1]] for e, g in zip(grid["embed"], grid["pp"]))


# ----------------------------------------------------------------------------------------------
# 04 composed with 02 on the rank grid: dp x pp, the reduction after the pipeline flush.

DP_CFG = tensor_parallel.GPTConfig(vocab_size=53, block_size=16, n_layer=1, n_head=2, n_embd=16)


def _dp_batches(steps, B, T=8, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(DP_CFG.vocab_size, (2, B, T), generator=gen)) for _ in range(steps)]


def _dp_pp(env, dp, pp, zero, steps):
    cfg = tensor_parallel.GPTConfig(**{**DP_CFG.__dict__, "n_layer": 2})
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, dp=dp, pp=pp))
    dp_rank, pp_rank = dist.get_rank(groups.dp), dist.get_rank(groups.pp)
    full = tensor_parallel.init_state_dict(cfg, 3, dtype=torch.float64, random_all=True)
    serial = tensor_parallel.GPT(cfg, None, init=False, dtype=torch.float64)
    serial.load_full_state_dict(full)
    ref_opt = torch.optim.AdamW(serial.parameters(), lr=1e-2, weight_decay=0.1)
    chunks = pipeline.build_chunks(cfg, pp, pp_rank, init=False, dtype=torch.float64)
    chunks[0].load_full_state_dict(full)
    params = [p for c in chunks for p in c.parameters()]
    ddp = data_parallel.BucketedDDP(params, groups.dp, 50, zero=zero)
    opt = data_parallel.FlatAdamW(ddp, lr=1e-2, weight_decay=0.1) if zero else \
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    worst, m = 0.0, 2
    for idx, targets in _dp_batches(steps, 8):
        serial(idx, targets)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = data_parallel.shard_batch(idx, targets, dp, dp_rank)
        ddp.sync = False  # the pipeline runs every microbatch first; then the flush, then the reduction
        schedule = pipeline.Schedule([pipeline.one_f_one_b(pp, m, r) for r in range(pp)])
        pipeline.execute(schedule, chunks, groups.pp, pipeline.split_batch(*mine, m), pipeline.Wire((2, 8, cfg.n_embd)))
        pipeline.sync_tied_embeddings(chunks, groups.embed, grad_of=ddp.main_grad)
        ddp.finish()
        opt.step()
        ddp.zero_grad()
        ref = dict(serial.named_parameters())
        worst = max([worst] + [tensor_parallel.max_rel_diff(p.detach(), ref[n].detach()) for n, p in chunks[0].named_parameters()])
    return worst


@pytest.mark.parametrize("zero", [False, True], ids=["dp", "zero1"])
def test_dp2_x_pp2_equals_serial(run_ranks, zero):
    assert all(w <= TOL for w in run_ranks(_dp_pp, 4, 2, 2, zero, 3))


# ----------------------------------------------------------------------------------------------
# 05's overlaps happen when they should (the parity tests above say they are right): each bucket's
# reduction during the last backward of the chunks it holds, the tied embedding's after the flush;
# ZeRO-1's gathers still in flight as the next step's first block starts.


def _step_timeline(env, tc):
    """One train_step; its actions and the DDP's events on one clock, and which chunks each bucket
    holds parameters of."""
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, tc.tp, tc.dp, tc.pp))
    run = gpt3d.build(env, CFG, tc, groups)
    tokens = data.split_tokens(data.load_tokens("", CFG.vocab_size, tc.seq_len), tc.seq_len)[0]
    seen, execute, finish = {}, gpt3d.pipeline.Executor.run, run.ddp.finish

    def timed_execute(self, *args, **kwargs):  # t0=0: the actions' times are perf_counter's, as the events'
        self.record.t0 = 0.0
        res = execute(self, *args, **kwargs)
        seen["actions"], seen["flushed"] = res.events, time.perf_counter()
        return res

    def kept_finish():
        finish()
        seen["events"] = list(run.ddp.events)  # train_step's zero_grad clears them

    gpt3d.pipeline.Executor.run, run.ddp.finish = timed_execute, kept_finish  # this forked rank's copies
    gpt3d.train_step(run, *data.replica_batch(tokens, 0, tc, dist.get_rank(groups.dp)), 1e-3)
    chunks_of = [{c for c, chunk in enumerate(run.chunks) for p in chunk.parameters() if i in run.ddp.buckets_of[p]}
                 for i in range(len(run.ddp.buckets))]
    return seen, chunks_of, run.ddp.held


@pytest.mark.parametrize("v,zero1", [(1, False), (2, True)], ids=["1F1B, DP", "interleaved, ZeRO-1"])
def test_each_bucket_reduces_during_its_chunks_last_backward_and_the_tied_embedding_after_the_flush(
        run_ranks, v, zero1):
    for seen, chunks_of, held in run_ranks(_step_timeline, 4, layout(1, 2, 2, v, zero1=zero1)):
        last = {a.chunk: start for start, _, a in seen["actions"] if a.kind == "B"}  # the last one wins
        launched = {i: t for kind, i, t in seen["events"] if kind == "launch"}
        assert sorted(launched) == list(range(len(chunks_of)))  # every bucket, once
        assert held and len(held) < len(chunks_of)  # every rank holds a copy of wte, and more
        for i, t in launched.items():
            if i in held:  # after the pipeline, once sync_tied_embeddings has added the other copy
                assert t > seen["flushed"], i
            else:  # not before its last gradient can come, and before the pipeline has ended
                assert max(last[c] for c in chunks_of[i]) <= t < seen["flushed"], i


def _gathers_in_flight(env, tc):
    """Two train_steps; at each forward of the first block of chunk 0, the buckets whose ZeRO-1
    gather is still in flight once that block has waited for its own."""
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, tc.tp, tc.dp, tc.pp))
    run = gpt3d.build(env, CFG, tc, groups)
    tokens = data.split_tokens(data.load_tokens("", CFG.vocab_size, tc.seq_len), tc.seq_len)[0]
    block = next(iter(run.chunks[0].transformer.h.values()))
    in_flight, after_step = [], []
    block.register_forward_pre_hook(lambda *_: in_flight.append(set(run.opt.gathers)))  # after build's
    for step in range(2):
        gpt3d.train_step(run, *data.replica_batch(tokens, step, tc, dist.get_rank(groups.dp)), 1e-3)
        after_step.append(len(run.opt.gathers))
    mine = {i for p in block.parameters() for i in run.ddp.buckets_of[p]}
    return in_flight, after_step, mine, len(run.ddp.buckets)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no overlap"])
def test_zero1_gathers_run_on_into_the_next_forward_each_block_waiting_for_its_own(run_ranks, overlap):
    tc = layout(1, 2, 2, zero1=True, overlap_param_gather=overlap)
    for in_flight, after_step, mine, n in run_ranks(_gathers_in_flight, 4, tc):
        assert after_step == ([n, n] if overlap else [0, 0])  # step() returns before any gather is waited for
        first, second = in_flight[:tc.microbatches], in_flight[tc.microbatches:]
        assert first == [set()] * tc.microbatches  # nothing gathered before the first step
        assert not second[0] & mine  # the block has its own weights ...
        assert bool(second[0]) == overlap  # ... while the later layers' gathers are not yet waited for
        assert second[1:] == [set()] * (tc.microbatches - 1)  # by the next microbatch all are in


def test_the_rank_grid_follows_megatrons_order_tp_fastest_then_dp_then_pp():
    g = gpt3d.rank_grid(16, tp=2, dp=2, pp=4)
    assert g["tp"][:2] == [[0, 1], [2, 3]]  # adjacent ranks: one node
    assert g["dp"][:2] == [[0, 2], [1, 3]]
    assert g["pp"][0] == [0, 4, 8, 12] and g["embed"][0] == [0, 12]
    for kind in ("tp", "dp", "pp"):  # every rank in exactly one group of each kind
        assert sorted(r for grp in g[kind] for r in grp) == list(range(16))


def test_a_world_that_does_not_match_dp_is_refused():
    with pytest.raises(ValueError, match="world size 4 does not match tp=1 x dp=2 x pp=1"):
        gpt3d.rank_grid(4, dp=2)


# ----------------------------------------------------------------------------------------------
# The command line: the main job, --print-layout, --plan, and bad input.


def run(*args, env=None, timeout=120):
    return run_script("05_3d_gpt.py", *args, timeout=timeout, env=env)


def test_the_main_job_trains_8_ranks_shows_progress_and_summaries(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = run("--steps", "20", "--eval-every", "10", "--metrics", str(metrics))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 8 = tp 2 x pp 2 x dp 2" in proc.stdout and "FLOPs per iteration (eq. 3)" in proc.stdout
    assert "train: 100%" in proc.stderr  # the progress bar
    # On a CPU, unasked, 05 first checks its lesson and its machine at this layout (--check's default)
    assert re.search(r"check: the lesson against serial .*: \S+ PASS \(tolerance 1e-10\)", proc.stdout), proc.stdout
    assert re.search(r"check: the machine .* against the lesson .*: \S+ PASS \(tolerance 1e-12\)", proc.stdout)
    lines = [__import__("json").loads(x) for x in metrics.read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(20))
    assert lines[-1]["loss"] < lines[0]["loss"] - 1.0  # it learns the built-in corpus
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "time_s"} <= set(lines[0])


def test_no_check_trains_at_once_and_a_later_chapters_train_refuses_check():
    """--no-check skips the lesson's check (a training run's own choice; on GPUs it is off unless --check);
    06-09's --train never run 05's check, so --check there is refused by name, before anything starts."""
    proc = run("--n-layer", "2", "--batch-size", "8", "--microbatches", "2", "--seq-len", "16", "--block-size", "16",
               "--eval-every", "0", "--steps", "1", "--no-check")
    assert proc.returncode == 0 and "check:" not in proc.stdout and "done: 1 steps" in proc.stdout, proc.stderr[-2000:]
    refused = run_script("06_zero_bubble.py", "--train", "--check")
    assert refused.returncode != 0 and "--check checks 05's lesson step" in refused.stderr, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr


def _switches(env, tc):
    """Build 05's run and take one train_step: where each of 01's and 02's switches ended up."""
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, tc.tp, tc.dp, tc.pp))
    run, seen, execute = gpt3d.build(env, CFG, tc, groups), {}, gpt3d.pipeline.Executor.run
    gpt3d.pipeline.Executor.run = lambda self, *a, **kw: (seen.update(exchange=self.exchange), execute(self, *a, **kw))[1]
    tokens = data.split_tokens(data.load_tokens("", CFG.vocab_size, tc.seq_len), tc.seq_len)[0]
    gpt3d.train_step(run, *data.replica_batch(tokens, 0, tc, 0), 1e-3)
    linears = [isinstance(m.forward, functools.partial) and m.forward.func is tensor_parallel.overlapped_forward
               for c in run.chunks for m in c.modules() if isinstance(m, tensor_parallel.ColumnParallelLinear)]
    return linears, isinstance(seen["exchange"], gpt3d.pipeline.BackgroundSends)


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_05s_flags_reach_01s_and_02s_overlap_switches(run_ranks, on):
    tc = replace(BASE, tp=2, overlap_input_grad=on, background_sends=on)
    linears, sends = run_ranks(_switches, 2, tc)[0]
    assert len(linears) > 4 and set(linears) == {on} and sends is on


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after the flush"])
def test_the_trace_shows_each_bucket_reduction_beside_the_backward_it_hides_behind(tmp_path, overlap):
    trace = tmp_path / "t.json"
    proc = run("--tp", "1", "--pp", "2", "--dp", "2", "--n-layer", "2", "--batch-size", "8", "--microbatches", "2",
               "--seq-len", "16", "--block-size", "16", "--eval-every", "0", "--steps", "3", "--bucket-numel", "3000",
               "--trace", str(trace), *([] if overlap else ["--no-overlap-grad-reduce"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    spans = [e for e in __import__("json").loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    for rank in range(4):
        mine = [e for e in spans if e["tid"] == rank]
        buckets = [e["ts"] for e in mine if e["cat"] == "dp collective"]
        backward_end = max(e["ts"] + e["dur"] for e in mine if e["cat"] == "compute" and e["name"].startswith("B"))
        finish = next(e["ts"] for e in mine if e["name"] == "data-parallel gradient reduction")
        assert len(buckets) > 1
        # On: a chunk's buckets are launched while its last backward runs, before the pipeline has
        # drained; off: every one inside finish(), after the last backward.
        assert (min(buckets) < backward_end) == overlap and all(t >= finish for t in buckets) != overlap


def test_print_layout_and_plan_start_nothing():
    proc = run("--print-layout", "--tp", "8", "--pp", "4", "--dp", "2", timeout=30)
    assert proc.returncode == 0 and "pp groups: [[0, 16, 32, 48]" in proc.stdout
    proc = run("--plan", "1T", "--gpus", "3072", "--plan-tokens", "450e9", timeout=30)
    assert proc.returncode == 0 and "tp=8 pp=64 dp=6" in proc.stdout and "days" in proc.stdout


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


BAD = {
    "world != tp pp dp": (["--tp", "2", "--pp", "2", "--dp", "2"], {"WORLD_SIZE": "4", "RANK": "0", "MEGATRON_SCRATCH_LAUNCH": "env"},
                          "world size 4 does not match tp=2 x dp=2 x pp=2"),
    "n_layer not divisible by pp v": (["--n-layer", "6", "--pp", "2", "--virtual-stages", "2"], {},
                                      "n_layer=6 is not divisible by 4 pipeline stages"),
    "batch not divisible by dp m": (["--batch-size", "12"], {}, "batch of 12 sequences is not divisible by dp x m = 2 x 4"),
    "missing data file": (["--data", "/nonexistent/x.txt"], {}, "cannot read the data file"),
    "unreadable data file (a directory)": (["--data", "/"], {}, "--data /: it is a directory"),
    "empty data file": (["--data", "EMPTY"], {}, "is empty"),
    "bin shorter than a sequence": (["--data", "SHORT"], {}, "fewer than one sequence of seq_len + 1 = 65"),
    "token ids >= vocab_size": (["--data", "BIG"], {}, "token id 1000 >= vocab_size=256"),
    "a bad value": (["--tp", "0"], {}, "--tp must be at least 1, got 0"),
    "CUDA graphs on a CPU run": (["--cuda-graphs", "--tp", "1"], {}, "--cuda-graphs needs a GPU"),
    "CUDA graphs with tp > 1": (["--cuda-graphs"], {}, "needs tp=1 (a stage with tp > 1 holds all-reduces)"),
    "the whole-step graph with world > 1": (["--graph-scope", "step"], {}, "it needs tp = pp = dp = 1, got tp=2"),
    "CUDA kernels forced on a CPU run": (["--fused-kernels", "--kernel-path", "cuda"], {},
                                         "--kernel-path cuda forces the CUDA kernels, and this run is on cpu"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_stops_with_a_clear_message_and_no_hang(case, tmp_path):
    args, env, message = BAD[case]
    files = {"EMPTY": _write(tmp_path, "e.txt", b""),
             "SHORT": _write(tmp_path, "s.bin", struct.pack("<10H", *range(10))),  # uint16 ids
             "BIG": _write(tmp_path, "b.bin", struct.pack("<200H", *[1000] * 200))}
    proc = run(*[files.get(a, a) for a in args], env=env, timeout=60)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr[-2000:]


def test_an_unknown_flag_is_refused():
    proc = run("--no-such-flag", timeout=30)
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-flag" in proc.stderr


def test_recompute_takes_a_mode_and_the_old_boolean_is_refused_by_name():
    proc = run("--recompute", timeout=30)  # it was a switch; now none, selective or full
    assert proc.returncode == 2 and "--recompute: expected one argument" in proc.stderr
    with pytest.raises(ValueError, match="--recompute must be one of 'none', 'selective', 'full', got True"):
        checks.check_fields(replace(BASE, recompute=True))


def _nan_at_step_3(env):
    real, calls = gpt3d.pipeline.Executor.run, [0]

    def poisoned(self, *args, **kwargs):
        res = real(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == 4 and res.loss is not None:
            res.loss = res.loss * float("nan")
        return res

    gpt3d.pipeline.Executor.run = poisoned  # this forked rank's copy of the module only
    return gpt3d.train(env, CFG, replace(BASE, pp=2, microbatches=2), quiet=True)


def test_a_nan_loss_skips_that_step_on_every_rank_and_the_run_goes_on(run_ranks):
    for out in run_ranks(_nan_at_step_3, 2):
        assert out["skipped"] == [3] and len(out["losses"]) == BASE.steps
        assert all(math.isfinite(x) for i, x in enumerate(out["losses"]) if i != 3)


def test_the_forward_only_eval_lists_cannot_deadlock():
    pipeline, interleaved = load("02_pipeline_1f1b"), load("03_interleaved")
    for pp in range(1, 9):
        for v in range(1, 5):
            for m in range(pp, 33, pp):
                lists = [[pipeline.Action("F", a.mb, a.chunk) for a in interleaved.interleaved(pp, m, s, v) if a.kind == "F"]
                         for s in range(pp)]
                pipeline.check_plans(pipeline.Schedule(lists))


# ----------------------------------------------------------------------------------------------
# The vocabulary, padded as Megatron pads it: V_pad a multiple of 128 tp, so that the output layer's
# GEMM has aligned sizes. The padding is never a token: its logits are masked out of the loss (and
# so get no gradient), and checkpoints, exports and samples hold the V real rows only.


def _poisoned_padding(env, cfg, tc):
    """05's training with the padded vocabulary rows set to 1e4 after build: were a padded logit
    counted anywhere, the loss would move far from serial's."""
    real, rows = gpt3d.build, []

    def build(env, cfg, tc, groups, *schedule):
        run = real(env, cfg, tc, groups, *schedule)
        for c in run.chunks:
            if "wte" in c.transformer:
                wte = c.transformer.wte
                rows.append(wte.weight.shape[0])
                with torch.no_grad():
                    wte.weight[torch.arange(wte.start, wte.start + wte.per_rank) >= cfg.vocab_size] = 1e4
        return run

    gpt3d.build = build  # this forked rank's only
    return rows, gpt3d.train(env, cfg, tc, quiet=True)


def test_the_vocabulary_is_padded_to_a_multiple_of_128_tp_and_the_padding_is_never_a_token(run_ranks, tmp_path):
    cfg = replace(CFG, vocab_size=300)  # bytes, and 44 ids no data holds; padded to 512 at tp = 2
    tc = replace(BASE, tp=2, steps=4, save=str(tmp_path / "ckpt"))
    (rows, out), _ = run_ranks(_poisoned_padding, 2, cfg, tc)
    assert rows == [512 // 2]  # this rank's half of V_pad = 512
    ref = serial_train(cfg, tc)  # the serial model, unpadded
    for key in ("losses", "norms"):
        assert tensor_parallel.max_rel_diff(torch.tensor(out[key]), torch.tensor(ref[key])) <= TOL, key
    exported = tmp_path / "model.pt"
    export_checkpoint(str(tmp_path / "ckpt"), None, str(exported))
    wte = torch.load(exported)["transformer.wte.weight"]
    assert wte.shape == (300, CFG.n_embd) and bool(wte.abs().max() < 1e3)  # the real rows only
    assert tensor_parallel.padded_vocab_size(50257, 1, gpt3d.VOCAB_DIVISIBLE_BY) == 50304  # GPT-2's, as Megatron's
