"""05's build(..., full=): the sharded trainer takes its weights from a full (serial) state dict of your
own, split by the rule a checkpoint loaded in another layout is split by (each chunk's
load_full_state_dict); a dict that does not fit the model is refused by key and shape before any
collective.

Tolerance. The weights: 0 (bitwise): splitting a tensor over tp and gathering it back only copies. The
loss: float64, max|a - b| / max|b| <= 1e-12 against the serial model's on the same weights and batch;
tp and pp only change where each sum is taken and in which order (0.0 measured here), while a build that
ignored full= (the seed's own weights) gives a loss 2.6e-3 away (measured), and fails the weights' check.
"""
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from conftest import TRAINER_BASE, load
from plumbing.reference import unequal_counts
from plumbing.shards import max_rel_diff

tensor_parallel = load("01_tensor_parallel")
gpt3d = load("05_3d_gpt")
CFG = tensor_parallel.GPTConfig(vocab_size=97, block_size=16, n_layer=4, n_head=4, n_embd=16)
TC = replace(TRAINER_BASE, tp=2, pp=2, dp=1, batch_size=4, microbatches=2, seq_len=16, grad_clip=float("inf"))
SEED = 7  # not TC.seed: the weights of full= are not the ones build would draw by itself


def _batch():
    gen = torch.Generator().manual_seed(3)
    idx, targets = torch.randint(CFG.vocab_size, (2, TC.batch_size, TC.seq_len), generator=gen)
    unequal_counts(targets, TC.microbatches)  # microbatch 0 counts no target, the last one fewer
    return idx, targets


def _full():
    return tensor_parallel.init_state_dict(CFG, SEED, dtype=torch.float64, random_all=True)


def _serial_loss():
    serial = tensor_parallel.GPT(CFG, None, init=False, dtype=torch.float64).load_full_state_dict(_full())
    return serial(*_batch())[1].detach()


def _built_from_full(env):
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, TC.tp, TC.dp, TC.pp))
    full = _full()
    run = gpt3d.build(env, CFG, TC, groups, full=full)
    weights = {n: w for c in run.chunks for n, w in c.full_state_dict().items()}  # gathered over tp
    same = all(torch.equal(w, full[n]) for n, w in weights.items())
    loss = gpt3d.train_step(run, *_batch(), lr=0.0)[0]  # the loss of the weights it was built with
    return sorted(weights), same, loss


def test_build_from_a_full_state_dict_gives_the_serial_models_weights_and_loss_at_tp2_pp2(run_ranks):
    ref, full = _serial_loss(), _full()
    assert float(_batch()[1].ne(-100).sum()) < TC.batch_size * TC.seq_len  # some targets masked
    results = run_ranks(_built_from_full, 4)
    held = sorted({n for names, _, _ in results for n in names})
    assert held == sorted(full)  # every key is on some rank
    for names, same, loss in results:
        assert same, names  # each rank's shards are exactly full's, gathered back
        assert max_rel_diff(torch.tensor(loss, dtype=torch.float64), ref) <= 1e-12, (loss, float(ref))
    default = tensor_parallel.init_state_dict(CFG, TC.seed, dtype=torch.float64, random_all=True)
    assert not torch.equal(default["transformer.wte.weight"], full["transformer.wte.weight"])  # full= mattered


def _refusals(env):
    """build(full=...) with a dict that does not fit, on each of 2 pipeline stages, every collective
    recorded. The key at fault is layer 1's, which only stage 0 holds: a rank that checked only its own
    chunk's keys would go on alone, and wait in the caller's next collective for the one that refused."""
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, 1, 1, 2))
    tc, good = replace(TC, tp=1, pp=2), _full()
    key = "transformer.h.1.attn.c_attn.weight"
    bad = {"wrong shape": {**good, key: good[key][:, :-1]},
           "missing": {n: t for n, t in good.items() if n != key},
           "extra": {**good, "transformer.h.9.mlp.c_fc.weight": good[key]}}
    called, real = [], {}
    for name in ("all_reduce", "broadcast", "all_gather", "barrier", "new_group", "send", "recv",
                 "batch_isend_irecv", "reduce_scatter_tensor", "all_gather_into_tensor"):
        real[name] = getattr(dist, name)
        setattr(dist, name, lambda *a, _n=name, **k: called.append(_n) or real[_n](*a, **k))
    out = {}
    try:
        for case, full in bad.items():
            del called[:]
            with pytest.raises(ValueError) as e:
                gpt3d.build(env, CFG, tc, groups, full=full)
            out[case] = (str(e.value), list(called))
        del called[:]
        run = gpt3d.build(env, CFG, tc, groups, full=good)
        gpt3d.train_step(run, *_batch(), lr=0.0)  # the recorder sees the collectives a step makes
        out["good"] = ("", list(called))
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return out


def test_a_full_state_dict_that_does_not_fit_is_refused_by_key_and_shape_before_any_collective(run_ranks):
    key = "transformer.h.1.attn.c_attn.weight"
    shape = tuple(_full()[key].shape)
    for out in run_ranks(_refusals, 2):  # every rank refuses alike: none is left waiting in a collective
        for case in ("wrong shape", "missing", "extra"):
            message, called = out[case]
            assert called == [], (case, called)
            assert message.startswith("build(full=...) does not fit the model"), message
        assert f"{key}: {(shape[0], shape[1] - 1)} instead of {shape}" in out["wrong shape"][0]
        assert f"{key}: missing instead of {shape}" in out["missing"][0]
        assert "unexpected ['transformer.h.9.mlp.c_fc.weight']" in out["extra"][0]
        assert "all_reduce" in out["good"][1], "the recorder missed a step's collectives: it would prove nothing"
