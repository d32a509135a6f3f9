"""04_data_parallel: replicas stay identical and train exactly like one model on the whole batch.

Tolerance: float64, max|a - b| / max|b| <= 1e-10. Data parallelism adds the replicas' gradients in
another order (a few ulps); AdamW then divides by sqrt of the second moment, which can grow such
ulp differences in parameters with tiny gradients to ~1e-13 over ten steps. A missing 1/dp, a
gradient reduced twice or a stale bucket is O(1).
"""
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, load

tp = load("01_tensor_parallel")
pipe = load("02_pipeline_1f1b")
ddp_mod = load("04_data_parallel")
TOL = 1e-10
CFG = tp.GPTConfig(vocab_size=53, block_size=16, n_layer=1, n_head=2, n_embd=16)


def _batches(steps, B, T=8, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(CFG.vocab_size, (2, B, T), generator=gen)) for _ in range(steps)]


def _args(**kw):
    return Namespace(**{**dict(lr=1e-2, bucket_numel=300, microbatches=1, steps=10), **kw})


def _modes(env, args, batches):
    group = ddp_mod.new_groups(env, ddp_mod.rank_grid(env.world_size, dp=env.world_size))["dp"]
    full = tp.init_state_dict(CFG, 3, dtype=torch.float64, random_all=True)
    ref_losses, ref_params = ddp_mod.serial_training(CFG, args, full, batches)
    out = {}
    for mode in ("naive", "bucketed", "zero1"):
        losses, params, timeline, state, digest = ddp_mod.train_replica(env, CFG, args, mode, group, full, batches)
        diffs = [tp.max_rel_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, ref_losses)]
        diffs += [tp.max_rel_diff(params[n], ref_params[n].detach()) for n in params]
        out[mode] = (max(diffs), digest, state, timeline)
    return out


@pytest.mark.parametrize("bucket_numel", [300, 1000], ids=["bucket-smaller-than-a-weight", "bucket-splits-params"])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_naive_bucketed_and_zero1_equal_serial_over_10_adamw_steps(run_ranks, dp, bucket_numel):
    results = run_ranks(_modes, dp, _args(bucket_numel=bucket_numel), _batches(10, 8))
    for mode in ("naive", "bucketed", "zero1"):
        assert all(r[mode][0] <= TOL for r in results), (mode, [r[mode][0] for r in results])
        assert len({r[mode][1] for r in results}) == 1  # every replica bit-identical


def test_accumulation_syncing_only_on_the_last_microbatch_equals_one_big_batch(run_ranks):
    results = run_ranks(_modes, 2, _args(microbatches=4, steps=3), _batches(3, 16))
    for r in results:
        for mode in ("naive", "bucketed", "zero1"):
            assert r[mode][0] <= TOL, mode
        start, end, events, n_buckets = r["bucketed"][3]
        # Reductions come from the last microbatch only: exactly one launch per bucket.
        assert sorted(i for kind, i, _ in events if kind == "launch") == list(range(n_buckets))


def test_with_overlap_a_bucket_is_launched_before_backward_has_produced_every_gradient(run_ranks):
    for r in run_ranks(_modes, 2, _args(bucket_numel=300, steps=1), _batches(1, 4)):
        for mode in ("bucketed", "zero1"):
            events = r[mode][3][2]
            order = [kind for kind, _, _ in events]
            last_ready = len(order) - 1 - order[::-1].index("ready")
            assert order.index("launch") < last_ready, order  # recorded order, not timing
            # Reverse parameter order: the buckets fill, and launch, in the order of the buffer.
            assert [i for kind, i, _ in events if kind == "launch"] == list(range(r[mode][3][3]))


def _zero_state(env):
    group = ddp_mod.new_groups(env, ddp_mod.rank_grid(env.world_size, dp=env.world_size))["dp"]
    # 18 (V + 247) parameters: with V=52 that is 5382, not a multiple of dp=4.
    cfg = tp.GPTConfig(vocab_size=52, block_size=16, n_layer=1, n_head=2, n_embd=18)
    model = tp.GPT(cfg, None, seed=1, dtype=torch.float64)
    ddp = ddp_mod.BucketedDDP(model.parameters(), group, 100, zero=True)
    opt = ddp_mod.DistributedAdamW(ddp, lr=1e-3)
    idx, targets = _batches(1, 4)[0]
    model(idx, targets)[1].backward()
    ddp.finish()
    opt.step()
    owned = sum(m.numel() for _, _, m, _ in opt.pieces)
    return opt.state_bytes(), owned, sum(p.numel() for p in model.parameters()), len(ddp.grad_buffer)


def test_zero1_keeps_1_over_dp_of_the_adamw_state_and_pads_an_uneven_parameter_count(run_ranks):
    dp = 4
    results = run_ranks(_zero_state, dp)
    n_params, padded = results[0][2], results[0][3]
    assert n_params % dp != 0 and padded % dp == 0 and padded - n_params < dp * len(results)
    assert sum(owned for _, owned, _, _ in results) == n_params  # every parameter owned once
    for state, owned, _, _ in results:
        assert state == 2 * owned * 8  # two float64 moments for the owned elements only
        assert abs(state - 2 * 8 * n_params / dp) <= 2 * 8 * 100  # ~1/dp, up to a bucket's padding


# ----------------------------------------------------------------------------------------------
# dp x pp: the reduction runs after the pipeline flush, on each stage's dp group.


def _dp_pp(env, dp, pp, zero, steps):
    cfg = tp.GPTConfig(**{**CFG.__dict__, "n_layer": 2})
    groups = ddp_mod.new_groups(env, ddp_mod.rank_grid(env.world_size, dp=dp, pp=pp))
    dp_rank, pp_rank = dist.get_rank(groups["dp"]), dist.get_rank(groups["pp"])
    full = tp.init_state_dict(cfg, 3, dtype=torch.float64, random_all=True)
    serial = tp.GPT(cfg, None, init=False, dtype=torch.float64)
    serial.load_full_state_dict(full)
    ref_opt = torch.optim.AdamW(serial.parameters(), lr=1e-2, weight_decay=0.1)
    chunks = pipe.build_chunks(cfg, pp, pp_rank, init=False, dtype=torch.float64)
    chunks[0].load_full_state_dict(full)
    params = [p for c in chunks for p in c.parameters()]
    ddp = ddp_mod.BucketedDDP(params, groups["dp"], 50, zero=zero)
    opt = ddp_mod.DistributedAdamW(ddp, lr=1e-2, weight_decay=0.1) if zero else \
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    worst, m = 0.0, 2
    for idx, targets in _batches(steps, 8):
        serial(idx, targets)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = ddp_mod.shard_batch(idx, targets, dp, dp_rank)
        ddp.sync = False  # the pipeline runs every microbatch first; then the flush, then the reduction
        schedule = pipe.one_f_one_b(pp, m, pp_rank)
        pipe.execute(schedule, chunks, groups["pp"], pipe.split_batch(*mine, m), (2, 8, cfg.n_embd))
        pipe.sync_tied_embeddings(chunks, groups["embed"], grad_of=ddp.main_grad)
        ddp.finish()
        opt.step()
        ddp.zero_grad()
        ref = dict(serial.named_parameters())
        worst = max([worst] + [tp.max_rel_diff(p.detach(), ref[n].detach()) for n, p in chunks[0].named_parameters()])
    return worst


@pytest.mark.parametrize("zero", [False, True], ids=["dp", "zero1"])
def test_dp2_x_pp2_equals_serial(run_ranks, zero):
    assert all(w <= TOL for w in run_ranks(_dp_pp, 4, 2, 2, zero, 3))


def test_the_rank_grid_follows_megatrons_order_tp_fastest_then_dp_then_pp():
    g = ddp_mod.rank_grid(16, tp=2, dp=2, pp=4)
    assert g["tp"][:2] == [[0, 1], [2, 3]]  # adjacent ranks: one node
    assert g["dp"][:2] == [[0, 2], [1, 3]]
    assert g["pp"][0] == [0, 4, 8, 12] and g["embed"][0] == [0, 12]
    for kind in ("tp", "dp", "pp"):  # every rank in exactly one group of each kind
        assert sorted(r for grp in g[kind] for r in grp) == list(range(16))


# ----------------------------------------------------------------------------------------------
# Bad input, before any collective.


def test_a_world_that_does_not_match_dp_is_refused():
    with pytest.raises(ValueError, match="world size 4 does not match tp=1 x dp=2 x pp=1"):
        ddp_mod.rank_grid(4, dp=2)


def _bucket_zero(env):
    try:
        ddp_mod.BucketedDDP(tp.GPT(CFG, None).parameters(), dist.group.WORLD, 0)
    except ValueError as e:
        return str(e)


def test_a_bucket_size_of_zero_is_refused(run_ranks):
    assert all("bucket_numel=0" in e for e in run_ranks(_bucket_zero, 2))


def test_the_demo_refuses_a_batch_not_divisible_by_dp_times_m_and_passes_otherwise():
    proc = subprocess.run([sys.executable, "04_data_parallel.py", "--batch-size", "12", "--microbatches", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "batch of 12 sequences is not divisible by dp x m = 4 x 2" in proc.stderr
    proc = subprocess.run([sys.executable, "04_data_parallel.py", "--dp", "2", "--steps", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("PASS") == 4 and "(0.500, 1/dp = 0.500)" in proc.stdout
