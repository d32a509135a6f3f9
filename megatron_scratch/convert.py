"""Converters between our formats and the ones an engineer's own system speaks, in memory (issue 42).

    from_hf(hf_state_dict, cfg) -> full      Hugging Face GPT-2 tensors -> our full (serial) state dict
    to_hf(full, cfg) -> hf_state_dict        the inverse (GPT2LMHeadModel's keys, lm_head tied)
    split_qkv(t, n_head, tp=1) -> q, k, v    the fused c_attn weight or bias of one tp rank (or the full)
    merge_qkv(q, k, v) -> t                  the inverse: [q; k; v] along dim 0
    qkv_shard(full, n_head, tp, rank)        tp rank's fused [Q_i; K_i; V_i] from the full [Q; K; V]
    qkv_unshard(shards, n_head)              the inverse, from every rank's shard in rank order
    to_torch_order(schedule, placement=None, reduce_grad=False) -> {rank: [_Action]}
    from_torch_order(order, placement=looped) -> [[Action]]   torch.distributed.pipelining's IR <-> ours

GPT-2 and Hugging Face. Our parameter names are GPT2LMHeadModel's. Its four projections (attn.c_attn,
attn.c_proj, mlp.c_fc, mlp.c_proj) are Conv1D, whose weight is (in, out), the transpose of our
nn.Linear's (out, in); lm_head.weight is tied to transformer.wte.weight; each block's attn.bias and
attn.masked_bias are causal-mask buffers, not weights: from_hf skips them and to_hf writes none (a
GPT2LMHeadModel makes its own; load with strict=False if your transformers version still lists them).
Both directions are plumbing/gpt2.py's mapping (full_from_hf, hf_from_full, which --init-from and
--export-hf use on disk), so every tensor is checked the same way: floating point, finite, exactly
cfg's parameters and shapes, and lm_head equal to wte.

The fused QKV layout. c_attn computes q, k and v in one matmul: the full weight is (3C, C), rows
[Q; K; V], each C = n_head * hs rows, head h at rows h*hs .. (h+1)*hs of its block. 01's
ColumnParallelLinear(fused=3) gives tp rank i the heads i*nh/tp .. (i+1)*nh/tp - 1 of each block,
stacked as its own [Q_i; K_i; V_i] (3C/tp rows), so that its output's thirds are its heads' q, k, v:

    full (3C rows)              tp = 2: rank 0 (3C/2 rows)     rank 1 (3C/2 rows)
    Q  [heads 0..nh-1]          Q_0 [heads 0..nh/2-1]          Q_1 [heads nh/2..nh-1]
    K  [heads 0..nh-1]    ->    K_0 [heads 0..nh/2-1]          K_1 [heads nh/2..nh-1]
    V  [heads 0..nh-1]          V_0 [heads 0..nh/2-1]          V_1 [heads nh/2..nh-1]

A rank's shard is not the full tensor's rows i*3C/tp .. (i+1)*3C/tp (that would give rank 0 all of Q
and part of K). Since the full tensor and every shard have the same [q; k; v] shape, split_qkv takes
either: the full one with tp=1, a rank's with the tp it was cut for (the check that n_head divides
into tp ranks and the rows into 3 * nh/tp heads names the value). The bias (3C,) is laid out alike.

Pipeline schedules. torch.distributed.pipelining describes a schedule as pipeline_order, {rank:
[_Action(stage_index, computation_type, microbatch_index) or None]}, and writes the same as CSV, one
row a rank, each action as str(_Action) ("2F0", "0B3"; _load_csv / _dump_csv read and write that);
ours (02's Schedule) is lists[rank] = [Action(kind, mb, chunk)]. They number things differently:
  - stages: torch's stage_index is the global (virtual) stage; ours is the rank's own chunk, placed at
    virtual stage placement(pp, chunk, rank): 02's and 03's looped placement chunk*pp + rank is
    torch's for ScheduleGPipe, Schedule1F1B (one stage a rank: stage_index == rank) and
    ScheduleInterleaved1F1B (rank r holds stages r, r + pp, ...); 06's ZB-V places chunk 1 of rank r
    at 2pp - 1 - r (v_shape), as ScheduleZBVZeroBubble does;
  - microbatches: both count 0 .. m-1 within the step;
  - kinds: our F, B, and 06's I and W are torch's FORWARD "F", FULL_BACKWARD "B", BACKWARD_INPUT "I"
    and BACKWARD_WEIGHT "W". torch's None (an idle slot of its timeline), REDUCE_GRAD (the gradient
    reduction after a stage's last backward) and the communication and FSDP actions (SEND_F, RECV_F,
    SEND_B, RECV_B, UNSHARD, RESHARD) have no Action of ours: our plan derives the messages from the
    lists, and a step reduces its gradients after its last action. from_torch_order skips them;
    to_torch_order writes none (reduce_grad=True adds REDUCE_GRAD where torch's own GPipe and 1F1B
    orders put it, by torch's _add_reduce_grad).
  - **torch's Schedule1F1B.pipeline_order is off by one on its last rank** (torch 2.13): that rank has
    no warm-up forward, and its counter, started at 0, is incremented before each steady forward, so
    its order reads F1 .. Fm where it runs F0 .. Fm-1 (its _step_microbatches, which executes the
    schedule, is right; only the IR is wrong). Every other rank's numbers, and all of GPipe's and
    ScheduleInterleaved1F1B's, are ours. Compare with torch's 1F1B order after shifting the last rank's
    forwards down by one (tests/test_convert.py shows the shift, and that nothing else differs);
    to_torch_order writes the numbers the schedule runs.
torch's runtime runs what to_torch_order writes: _PipelineScheduleRuntime's
_prepare_schedule_with_comms(order) adds the sends and receives, or write the order row by row with
csv.writer and give the file to its _load_csv; tests/test_convert.py runs GPipe, 1F1B and interleaved
1F1B both ways on gloo ranks and gets the serial gradients, and runs torch's own orders, read back by
from_torch_order, on 02's executor (pipeline_step) to the serial loss and gradients.
"""
import dataclasses

import torch

from megatron_scratch import pipeline as _pipeline

looped = _pipeline.looped
KINDS_TO_TORCH = {"F": "FORWARD", "B": "FULL_BACKWARD", "I": "BACKWARD_INPUT", "W": "BACKWARD_WEIGHT"}
SKIPPED = ("REDUCE_GRAD", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD")  # no Action of ours


# ----------------------------------------------------------------------------------------------
# Hugging Face GPT-2.

def _gpt2():
    from plumbing import gpt2  # imports 01, which megatron_scratch already put on the path
    return gpt2


def _check_dict(d, what):
    if not isinstance(d, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in d.items()):
        raise ValueError(f"{what} must be a dict of names to tensors, got {type(d).__name__}"
                         + (" with other keys or values" if isinstance(d, dict) else ""))


def from_hf(hf_state_dict, cfg):
    """Our full state dict from a Hugging Face GPT-2 state dict in memory (GPT2LMHeadModel's
    `state_dict()`, or GPT2Model's, whose keys lack "transformer."): new tensors for the transposed
    Conv1D weights, the others as given (not copied). The causal-mask buffers (attn.bias,
    attn.masked_bias) are skipped; lm_head.weight, if present, must equal wte (tied) and is dropped. A
    ValueError names the tensor when one is not floating point or finite, when lm_head is untied, or
    when the tensors are not exactly cfg's GPT-2 (a missing one, another shape, an extra layer)."""
    _check_dict(hf_state_dict, "from_hf: hf_state_dict")
    return _gpt2().full_from_hf(hf_state_dict, cfg, "the HF state dict", "the HF state dict",
                                config=f"cfg (n_layer={cfg.n_layer}, n_head={cfg.n_head}, n_embd={cfg.n_embd}, "
                                       f"vocab_size={cfg.vocab_size}, block_size={cfg.block_size})")


def to_hf(full, cfg):
    """GPT2LMHeadModel's state dict from our full state dict (checked to be exactly cfg's GPT-2, as
    from_hf checks its input): new contiguous tensors, the Conv1D weights transposed, lm_head.weight a
    copy of wte, no causal-mask buffers. from_hf(to_hf(full, cfg), cfg) equals full exactly."""
    _check_dict(full, "to_hf: full")
    gpt2 = _gpt2()
    for key, value in full.items():
        gpt2._check_weight("to_hf: full", key, value)
    bad, extra = gpt2._misfits(cfg, full)
    if bad or extra:
        raise ValueError(f"to_hf: full does not fit cfg (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}): "
                         + "; ".join(bad[:5] + [f"unexpected {k}" for k in extra[:3]]))
    return gpt2.hf_from_full(full)


# ----------------------------------------------------------------------------------------------
# The fused QKV layout.

def _int(name, value, least=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}={value!r} must be a whole number of at least {least}")


def _qkv_rows(t, n_head, tp, what):
    """Checks t's dim 0 holds [q; k; v] of n_head/tp heads each; returns (heads here, head size)."""
    _int("n_head", n_head)
    _int("tp", tp)
    if n_head % tp:
        raise ValueError(f"{what}: tp={tp} must divide n_head={n_head} (each rank holds whole heads)")
    if not torch.is_tensor(t) or t.dim() not in (1, 2):
        raise ValueError(f"{what}: expects c_attn's weight (3C/tp, C) or bias (3C/tp,), got "
                         f"{tuple(t.shape) if torch.is_tensor(t) else type(t).__name__}")
    heads = n_head // tp
    if t.shape[0] % (3 * heads):
        raise ValueError(f"{what}: dim 0 of size {t.shape[0]} must be 3 x {heads} heads (n_head={n_head} / tp={tp}) "
                         f"x the head size: {t.shape[0]} is not divisible by {3 * heads}")
    return heads, t.shape[0] // (3 * heads)


def split_qkv(t, n_head, tp=1, heads=False):
    """(q, k, v) of a fused c_attn weight (3C/tp, C) or bias (3C/tp,): of tp rank i's shard (its
    [Q_i; K_i; V_i], the heads i*nh/tp .. (i+1)*nh/tp - 1), or of the full tensor with tp=1. Each is a
    view of t, (C/tp, ...); with heads=True (nh/tp, hs, ...), head by head. A ValueError names n_head,
    tp and the size when tp does not divide n_head or dim 0 is not 3 x (nh/tp) x hs."""
    n, hs = _qkv_rows(t, n_head, tp, "split_qkv")
    q, k, v = t.chunk(3, dim=0)
    return tuple(x.unflatten(0, (n, hs)) for x in (q, k, v)) if heads else (q, k, v)


def merge_qkv(q, k, v, heads=False):
    """The inverse of split_qkv: the fused [q; k; v] (a new tensor). heads=True: each is (nh, hs, ...)."""
    parts = [x.flatten(0, 1) if heads else x for x in (q, k, v)]
    if len({(p.shape, p.dtype) for p in parts}) != 1:
        raise ValueError(f"merge_qkv: q, k and v must have one shape and dtype, got "
                         f"{[(tuple(p.shape), str(p.dtype)) for p in parts]}")
    return torch.cat(parts, dim=0)


def qkv_shard(full, n_head, tp, rank):
    """tp rank `rank`'s c_attn weight or bias, [Q_i; K_i; V_i], from the full [Q; K; V] (what 01's
    load_full_state_dict copies into that rank's ColumnParallelLinear)."""
    _int("rank", rank, least=0)
    _qkv_rows(full, n_head, 1, "qkv_shard")
    _qkv_rows(full, n_head, tp, "qkv_shard")
    if rank >= tp:
        raise ValueError(f"qkv_shard: rank={rank} must be below tp={tp}")
    return merge_qkv(*(x.chunk(tp, dim=0)[rank] for x in split_qkv(full, n_head, 1)))


def qkv_unshard(shards, n_head):
    """The full [Q; K; V] from every tp rank's [Q_i; K_i; V_i], in rank order."""
    tp = len(shards)
    parts = [split_qkv(s, n_head, tp) for s in shards]
    return merge_qkv(*(torch.cat([p[j] for p in parts], dim=0) for j in range(3)))


# ----------------------------------------------------------------------------------------------
# Pipeline schedules: 02's lists <-> torch.distributed.pipelining's pipeline_order.

def _schedules():
    from torch.distributed.pipelining import schedules
    return schedules


def to_torch_order(schedule, placement=None, reduce_grad=False):
    """torch's pipeline_order, {rank: [_Action(stage_index, computation_type, microbatch_index)]}, of our
    schedule: a 02 Schedule (03's, 06's: its lists and placement) or lists[rank] of Actions (placement:
    02's looped by default). No None: torch's runtime skips idle slots anyway. reduce_grad=True appends
    REDUCE_GRAD after each stage's last backward, as torch's own GPipe and 1F1B orders do. The result
    prints as torch's IR ("0F0", "1B2") and is what PipelineScheduleMulti's _load_csv reads back once
    written row by row (one rank a row)."""
    S = _schedules()
    lists = getattr(schedule, "lists", schedule)
    placement = placement or getattr(schedule, "placement", looped)
    if not isinstance(lists, (list, tuple)) or not all(isinstance(acts, (list, tuple)) for acts in lists):
        raise ValueError(f"to_torch_order: expects a 02 Schedule or a list of each rank's Actions, got "
                         f"{type(schedule).__name__}")
    for r, acts in enumerate(lists):
        for a in acts:
            if getattr(a, "kind", None) not in KINDS_TO_TORCH:
                raise ValueError(f"to_torch_order: rank {r}'s {a!r} is not an Action of kind "
                                 f"{', '.join(KINDS_TO_TORCH)} (torch has no other computation)")
    pp, m = len(lists), 1 + max((a.mb for acts in lists for a in acts), default=-1)
    order = {}
    for r, acts in enumerate(lists):
        row = []
        for a in acts:
            row.append(S._Action(placement(pp, a.chunk, r), getattr(S._ComputationType, KINDS_TO_TORCH[a.kind]), a.mb))
        order[r] = S._add_reduce_grad(row, m) if reduce_grad else row
    return order


def _mark_steady(acts):
    """03's steady pairs in a list read back from torch: from the F just before the first B (when a
    forward follows that B), each F directly followed by a B runs with it, no boundary between, as
    03's InterleavedSchedule needs at v > 1. (A list with no forward after its first B has no steady
    phase to mark: marking its F|B junction would deadlock.) Validated on every pp <= 8, v <= 4."""
    kinds = [a.kind for a in acts]
    out = list(acts)
    if "B" not in kinds or "F" not in kinds[kinds.index("B"):]:
        return out
    for i in range(max(kinds.index("B") - 1, 0), len(acts) - 1):
        if kinds[i] == "F" and kinds[i + 1] == "B":
            out[i], out[i + 1] = (dataclasses.replace(a, steady=True) for a in acts[i:i + 2])
    return out


def from_torch_order(order, placement=looped):
    """lists[rank] of our Actions from torch's pipeline_order ({rank: [_Action or None]}; a list in rank
    order works too; strings such as "1F0", as its CSV holds, are parsed with _Action.from_str). None,
    REDUCE_GRAD and the communication and FSDP actions are skipped (module docstring); stage_index k
    becomes the chunk c with placement(pp, c, rank) == k. F and B pairs are marked steady as 03's
    InterleavedSchedule runs them (_mark_steady); wrap the lists in it (F and B only; 06's
    ZeroBubbleSchedule for I and W) and 02's validate says whether they run. A ValueError names the
    rank and action placed elsewhere than on its rank, and any computation we do not have
    (OVERLAP_F_B)."""
    S = _schedules()
    rows = dict(enumerate(order)) if isinstance(order, (list, tuple)) else dict(order)
    pp = len(rows)
    if sorted(rows) != list(range(pp)):
        raise ValueError(f"from_torch_order: the ranks must be 0 .. {pp - 1}, got {sorted(rows)}")
    rows = {r: [S._Action.from_str(a) if isinstance(a, str) else a for a in acts] for r, acts in rows.items()}
    top = max((a.stage_index for acts in rows.values() for a in acts if a is not None), default=0)
    n_chunks = -(-(top + 1) // max(pp, 1))  # chunks a rank holds: pp x n_chunks stages cover the highest
    names = {v: k for k, v in KINDS_TO_TORCH.items()}
    lists = []
    for r in range(pp):
        chunk_of = {placement(pp, c, r): c for c in range(n_chunks)}
        acts = []
        for a in rows[r]:
            if a is None or a.computation_type.name in SKIPPED:
                continue
            kind = names.get(a.computation_type.name)
            if kind is None:
                raise ValueError(f"from_torch_order: rank {r}'s {a} is {a.computation_type.name}, which has no "
                                 f"Action of ours (only {', '.join(KINDS_TO_TORCH.values())}; split it first)")
            if a.stage_index not in chunk_of:
                raise ValueError(f"from_torch_order: rank {r}'s {a} runs stage {a.stage_index}, which placement "
                                 f"{getattr(placement, '__name__', placement)} puts on another rank (rank {r} "
                                 f"holds stages {sorted(chunk_of)} of pp={pp})")
            acts.append(_pipeline.Action(kind, a.microbatch_index, chunk_of[a.stage_index]))
        lists.append(_mark_steady(acts))
    return lists
