"""The stable reference API: a few functions whose signatures and results do not change without a
deliberate decision (tests/test_reference.py pins every signature with inspect.signature). Each is a
thin wrapper over the chapters; everything else in the repository is internal and may change.

    gpt_config(*, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.0, tp=1) -> GPTConfig
    init_weights(cfg, *, seed=0, dtype=torch.float64, random_all=True) -> full state dict
    serial_loss_and_grads(cfg, full, tokens, targets, *, ignore_index=-100) -> LossAndGrads
    tp_shard(full, cfg, tp, rank) -> {name: tensor}          one tp rank's shards, no process group
    tp_unshard(shards, cfg) -> full state dict               the inverse, from every rank's, in rank order
    tp_loss_and_grads(cfg, full, tokens, targets, *, tp=2, sequence_parallel=False, ignore_index=-100)
                                                             -> LossAndGrads, computed on tp gloo ranks

"full" is our full (serial) state dict: GPT2LMHeadModel's parameter names with nn.Linear's (out, in)
weights (megatron_scratch.convert.from_hf / to_hf convert), lm_head tied to transformer.wte.weight
and so not a key. Run everything in float64 to compare: two float64 computations of the same model
differ only in the order of their sums (~1e-15 relative), so megatron_scratch.testing's defaults
(rtol 1e-10, atol 1e-12) hold with room, and a real mistake is off by far more.
"""
import inspect
from dataclasses import dataclass

import torch

from megatron_scratch import tensor_parallel as _tp


@dataclass
class LossAndGrads:
    """loss: the mean cross-entropy over the counted targets (not ignore_index), a 0-dim tensor; logits:
    (B, T, vocab_size), the full vocabulary (no padding columns); grads: {name: gradient} of the loss,
    keyed and shaped as the full state dict (every parameter; lm_head's is inside wte's, tied)."""
    loss: torch.Tensor
    logits: torch.Tensor
    grads: dict


def gpt_config(*, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.0, tp=1):
    """01's GPTConfig, checked as 01's GPT checks it for tp ranks (each size a whole number of at least 1,
    n_head dividing n_embd, tp dividing n_head): a ValueError names the field, its value and the rule."""
    cfg = _tp.GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                        n_embd=n_embd, dropout=dropout)
    from plumbing.checks import check_model
    check_model(cfg, tp, "cpu")
    return cfg


def init_weights(cfg, *, seed=0, dtype=torch.float64, random_all=True):
    """The full state dict drawn from seed with GPT-2's initialisation (01's init_state_dict: N(0, 0.02),
    the residual projections scaled by 1/sqrt(2 n_layer)); random_all=True also draws the biases and
    LayerNorms at random (N(0, 0.01), LayerNorm weights around 1), so that none of their gradients is
    trivially tested by zeros. The same seed gives the same tensors under the same torch."""
    return _tp.init_state_dict(cfg, seed, dtype=dtype, random_all=random_all)


def _serial(cfg, full):
    first = next(iter(full.values()))
    model = _tp.GPT(cfg, None, init=False, dtype=first.dtype)
    return model.load_full_state_dict(full)


def serial_loss_and_grads(cfg, full, tokens, targets, *, ignore_index=-100):
    """The serial GPT-2 (01's GPT at tp=1) with the weights `full` (its dtype: give float64), on token
    ids tokens (B, T) and targets (B, T) (ignore_index marks a position not counted): LossAndGrads.
    tokens and targets out of range, or of other shapes, are refused by 01's checks, naming the value."""
    model = _serial(cfg, full)
    logits, loss = model(tokens, targets, ignore_index=ignore_index)
    loss.backward()
    return LossAndGrads(loss.detach(), logits.detach(), {n: p.grad.detach() for n, p in model.named_parameters()})


def _placeholders(cfg, tp):
    """{name: a meta tensor shaped as tp rank's shard, carrying 01's split marks} for every parameter."""
    from plumbing.checks import check_model
    check_model(cfg, tp, "cpu")
    out = {}
    for name, p in _tp.GPT(cfg, device="meta").named_parameters():
        if not hasattr(p, "tp_dim"):
            out[name] = p
            continue
        shape = list(p.shape)
        shape[p.tp_dim] = -(-p.tp_full // tp)  # the vocabulary's rows padded up to a multiple of tp, as 01 does
        t = torch.empty(shape, device="meta")
        t.tp_dim, t.tp_full, t.tp_fused = p.tp_dim, p.tp_full, p.tp_fused
        out[name] = t
    return out


def tp_shard(full, cfg, tp, rank):
    """tp rank `rank`'s part of every tensor of full, keyed as full: what 01's GPT(cfg, a tp group of tp)
    holds on that rank after load_full_state_dict(full) (its state_dict, lm_head aside). Column-parallel
    weights are split by rows (c_attn fused: [Q_i; K_i; V_i], megatron_scratch.convert.split_qkv),
    row-parallel by columns, the vocabulary by rows padded with zero rows to a multiple of tp; the
    rest is replicated (the same tensor). No process group is needed. A ValueError names tp or rank
    when tp does not divide n_head or rank is not in 0 .. tp-1, and a key full should not hold."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < (tp if isinstance(tp, int) else 1):
        raise ValueError(f"tp_shard: rank={rank!r} must be a whole number from 0 to tp - 1 = {tp - 1 if isinstance(tp, int) else '?'}")
    held = _placeholders(cfg, tp)
    if set(full) != set(held):
        raise ValueError(f"tp_shard: full does not hold cfg's parameters: missing {sorted(set(held) - set(full))[:3]}, "
                         f"unexpected {sorted(set(full) - set(held))[:3]}")
    out = {}
    for name, p in held.items():
        try:
            out[name] = _tp.split_full(full[name], p, tp, rank)
        except ValueError as e:
            raise ValueError(f"tp_shard: {name}: {e}") from None
        if out[name].shape != p.shape:  # a replicated tensor is not split, so its shape is checked here
            raise ValueError(f"tp_shard: {name}: a full tensor of shape {tuple(full[name].shape)} where cfg's GPT-2 "
                             f"has {tuple(p.shape)}")
    return out


def tp_unshard(shards, cfg):
    """The full state dict from every tp rank's tp_shard, in rank order (the padding rows dropped)."""
    tp = len(shards)
    return {name: _tp.join_shards([s[name] for s in shards], p) for name, p in _placeholders(cfg, tp).items()}


def _tp_rank(env, cfg, full, tokens, targets, tp, sp, ignore_index):
    model = _tp.GPT(cfg, _tp.new_tp_group(env, tp), sequence_parallel=sp, init=False,
                    dtype=next(iter(full.values())).dtype)
    model.load_full_state_dict(full)
    logits, loss = model(tokens, targets, ignore_index=ignore_index)
    loss.backward()
    return LossAndGrads(loss.detach(), model.full_logits(logits.detach()), model.full_grads())


def tp_loss_and_grads(cfg, full, tokens, targets, *, tp=2, sequence_parallel=False, ignore_index=-100):
    """serial_loss_and_grads's result computed by 01's tensor-parallel GPT on tp gloo CPU ranks forked for
    the call (megatron_scratch.testing.run_ranks), gathered to full shapes: rank 0's (every rank's
    equal). With sequence_parallel, T must divide by tp."""
    from megatron_scratch.testing import run_ranks
    return run_ranks(_tp_rank, tp, cfg, full, tokens, targets, tp, sequence_parallel, ignore_index)[0]


STABLE = ["gpt_config", "init_weights", "serial_loss_and_grads", "tp_shard", "tp_unshard", "tp_loss_and_grads"]


def signatures():
    """{name: str(inspect.signature)} of the stable functions: what tests/test_reference.py pins."""
    return {name: str(inspect.signature(globals()[name])) for name in STABLE}
