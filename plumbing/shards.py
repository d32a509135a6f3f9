"""Full (serial) tensors and their tensor-parallel shards, both ways: what checkpoints, GPT-2
imports and the parity tests need, not what tensor parallelism is. 01 re-exports every name here
(tensor_parallel.split_full and so on), so callers import them from 01.

    split_full(t, p, tp, rank)                  this rank's shard, shaped like p, of the full tensor t
    join_shards(shards, p)                      the full tensor from every rank's shard, in rank order
    load_full_state_dict(module, full, group, whole=None)   master weight, then split: copy this
                                                rank's shards (whole: the model a part such as a
                                                pipeline chunk is cut from, whose other keys it skips)
    gather_full(module, group, grads=False)     every parameter (or gradient) gathered to full shape
    init_full(named_params, n_layer, seed)      GPT-2's initialisation, full tensors (01's init_state_dict)
    keep_part(model, layers, pre, post)         cut a built GPT to a pipeline's part, in place (01's GPT)
    max_rel_diff(a, b)                          the parity tests' measure: max |a - b| / max |b|, of two
                                                tensors of one shape (never broadcast)

A split parameter carries .tp_dim (the dim it is split along), .tp_full (its unpadded full size
there) and .tp_fused (how many separately split blocks it stacks, 3 for Q, K, V); 01 marks them.
A tensor without .tp_dim is replicated: its full tensor is itself. One split over another group
than its module's carries that group as .split_group (07's vocabulary shard, over pp x tp ranks).
"""
import math

import torch
import torch.distributed as dist
from einops import rearrange


def _size_rank(group):
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


def split_of(p, group):
    """(size, rank) of the group p is split over: its module's group, or its own .split_group."""
    return _size_rank(getattr(p, "split_group", group))


def split_full(t, p, tp, rank):
    """This tp rank's shard, shaped like p, of the full tensor t (p's split metadata decides)."""
    if not hasattr(p, "tp_dim"):
        return t
    if t.dim() != p.dim() or t.shape[p.tp_dim] != p.tp_full:  # only the padding beyond tp_full (the vocabulary's)
        raise ValueError(f"a full tensor of shape {tuple(t.shape)} where its parameter holds {p.tp_full} along dim "
                         f"{p.tp_dim}, split over tp={tp} into {tuple(p.shape)}")
    t = t.movedim(p.tp_dim, 0)
    pad = p.shape[p.tp_dim] * tp - t.shape[0]  # padded vocabulary rows start as zeros
    t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return rearrange(t, "(f tp c) ... -> tp (f c) ...", f=p.tp_fused, tp=tp)[rank].movedim(0, p.tp_dim)


def join_shards(shards, p):
    """The inverse of split_full: the full tensor from every tp rank's shard, in rank order."""
    if not hasattr(p, "tp_dim"):
        return shards[0]
    t = torch.cat([s.movedim(p.tp_dim, 0) for s in shards])
    t = rearrange(t, "(tp f c) ... -> (f tp c) ...", tp=len(shards), f=p.tp_fused)
    return t[: p.tp_full].movedim(0, p.tp_dim)


def load_full_state_dict(module, full, group, whole=None):
    """Master weight, then split: copy this rank's shard of every full (serial) tensor. full holds
    exactly module's parameters, or, with whole (a callable giving the model module is a part of,
    e.g. on the meta device), any of whole's: a pipeline chunk skips the other chunks' keys. A key
    neither has is refused, not dropped; so is a full tensor of another shape (only the vocabulary's
    padding rows are made, as zeros)."""
    params = dict(module.named_parameters())
    known = params if whole is None or set(full) <= set(params) else dict(whole().named_parameters())
    missing, unknown = sorted(set(params) - set(full)), sorted(set(full) - set(known))
    if missing or unknown:
        raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unknown}")
    with torch.no_grad():
        for name, p in params.items():
            try:
                t = split_full(full[name], p, *split_of(p, group))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            if t.shape != p.shape:
                raise ValueError(f"{name}: full shape {tuple(full[name].shape)} does not fit shard {tuple(p.shape)}")
            p.copy_(t)


def gather_full(module, group, grads=False):
    """The inverse of load_full_state_dict: all-gather every split tensor back to its full shape
    (a collective over the tp group: every rank calls it). New tensors, never the parameters."""
    out = {}
    for name, p in module.named_parameters():
        t = (p.grad if grads else p).detach()
        parts, n = [t], split_of(p, group)[0]
        if hasattr(p, "tp_dim") and n > 1:
            parts = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(parts, t.contiguous(), group=getattr(p, "split_group", group))
        out[name] = join_shards(parts, p).clone()
    return out


def init_full(named_params, n_layer, seed, dtype=torch.float32, random_all=False):
    """Full tensors for (name, parameter) pairs (of a meta-device GPT), drawn from a seed in their
    order: N(0, 0.02), c_proj N(0, 0.02/sqrt(2 n_layer)), zero biases, unit LayerNorms. random_all
    draws biases and LayerNorms at random too (for tests)."""
    gen, out = torch.Generator().manual_seed(seed), {}
    for name, p in named_params:
        t = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if name.endswith(".bias") or ".ln_" in name:
            t = t * 0.1 if random_all else torch.zeros_like(t)
            t = t + 1 if ".ln_" in name and name.endswith(".weight") else t
        else:
            t = t * (0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02)
        out[name] = t.to(dtype)
    return out


def max_rel_diff(a, b):
    """max |a - b| / max |b|: relative to the tensor's scale, so tiny entries do not blow it up. The
    shapes must be equal: broadcasting would compare a (4, 1) gradient with a (4,) one and say 0.
    Equal entries differ by 0, infinities included (the scale is then b's largest finite entry); two
    empty tensors by 0.0; a NaN in either is a difference (the result is NaN, below no tolerance)."""
    if a.shape != b.shape:
        raise ValueError(f"max_rel_diff: shapes {tuple(a.shape)} and {tuple(b.shape)} differ; compare tensors of "
                         f"one shape")
    if a.numel() == 0:  # nothing differs
        return 0.0
    if bool(a.isnan().any() | b.isnan().any()):  # a NaN is never equal to anything, itself included
        return math.nan
    diff = torch.where(a == b, (a - b).new_zeros(()), (a - b).abs())  # equal entries, inf included: 0
    finite = b.abs()[torch.isfinite(b)]
    scale = finite.max().clamp_min(1e-300) if finite.numel() else b.abs().new_ones(())
    return (diff.max() / scale).item()


def materialize(module, device):
    """Give every meta parameter of module uninitialised memory on device, in place: a parameter shared by
    two modules (a tied output layer) stays one, and each keeps its attributes (split metadata: .tp_dim)."""
    given = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_meta and id(p) not in given:
                given[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
                given[id(p)].__dict__.update(p.__dict__)
            m._parameters[name] = given.get(id(p), p)
    return module


def keep_part(model, layers, pre_process, post_process):
    """Cut a built ParallelGPT (01) to a pipeline's part, in place: the blocks `layers`, the embeddings with
    pre_process, ln_f and the output layer with post_process, wte with either (the output layer's tie)."""
    tr = model.transformer
    if any(str(i) not in tr.h for i in layers):
        raise ValueError(f"layers={list(layers)}: this model has blocks 0..{len(tr.h) - 1} (n_layer={len(tr.h)})")
    tr["h"] = torch.nn.ModuleDict({str(i): tr.h[str(i)] for i in layers})
    if not pre_process:
        del tr["wpe"]
    if not post_process:
        del tr["ln_f"], model.lm_head
    if not (pre_process or post_process):
        del tr["wte"]


class FullWeights:
    """A mixin for a module of 01's layers over its tp group (self.group): its full (serial) weights
    in and out. 01's ParallelGPT takes it (and so its subclass GPT), so that chunks and tests speak in full tensors."""

    def load_full_state_dict(self, full):
        """Load this module's part (its layers, its shards) of a full serial state dict: the whole
        model's keys, of which a pipeline chunk takes its own; a key no part of the model has is refused.
        Returns the module."""
        model = next(c for c in type(self).__mro__ if FullWeights in c.__bases__)  # 01's ParallelGPT: it is whole
        load_full_state_dict(self, full, self.group, whole=lambda: model(self.cfg, device="meta"))
        return self

    def full_state_dict(self):  # every parameter, gathered to its serial shape
        return gather_full(self, self.group)

    def full_grads(self):  # every gradient, likewise
        return gather_full(self, self.group, grads=True)

    def full_logits(self, logits):
        """This rank's vocabulary slice of the logits (B, T, V_pad/tp), gathered over the tp group
        (a collective) into (B, T, V): padded columns dropped."""
        n = _size_rank(self.group)[0]
        parts = [logits] if n == 1 else [torch.empty_like(logits) for _ in range(n)]
        if n > 1:
            dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, -1)[..., : self.cfg.vocab_size]
