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
    pipeline_loss_and_grads(cfg, full, tokens, targets, *, pp=2, microbatches=4, schedule="1f1b",
                            virtual_stages=1) -> PipelineStep      02's and 03's schedules on pp ranks
    reference_training(cfg, full, batches, *, mode="bucketed", dp=2, microbatches=1, lr=1e-3,
                       betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, bucket_numel=20000) -> Training
                                                             04: serial, naive, bucketed or ZeRO-1 AdamW steps
    gpt3d_training(cfg, full, batches, *, tp=1, pp=1, dp=1, microbatches=None, virtual_stages=1,
                   sequence_parallel=False, zero1=False, lr=3e-3, weight_decay=0.1, grad_clip=None,
                   loss_normalization="token") -> Training3D 05's machine (build, train_step) on your weights
    cp_loss_and_grads(cfg, full, tokens, targets, *, cp=2, split="megatron") -> LossAndGrads   08's ring
    moe_weights(cfg, *, num_experts, seed=0, dtype=torch.float64) -> an MoE layer's weights
    moe_layer(cfg, weights, x, *, num_experts, top_k, ep=1, grad_output=None) -> MoEOutput     09's layer

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


@dataclass
class PipelineStep:
    """loss: the batch's mean loss over its counted targets (0-dim, from the last stage); grads: every
    gradient, full names and shapes (wte's the sum of its two copies'); lists: every rank's actions
    (02's Action: kind, microbatch, chunk), what ran: megatron_scratch.convert.to_torch_order takes them."""
    loss: torch.Tensor
    grads: dict
    lists: list


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _pipeline_schedule(schedule, pp, m, v):
    from megatron_scratch import interleaved, pipeline
    if schedule == "interleaved":
        return interleaved.InterleavedSchedule([interleaved.interleaved(pp, m, r, v) for r in range(pp)])
    return pipeline.Schedule([pipeline.SCHEDULES[schedule](pp, m, r) for r in range(pp)])


def _pipeline_rank(env, cfg, full, tokens, targets, schedule, m, v):
    import torch.distributed as dist
    from megatron_scratch import pipeline
    pp = env.world_size
    embed = dist.new_group([0, pp - 1]) if pp > 1 else None
    sched = _pipeline_schedule(schedule, pp, m, v)
    chunks, result = pipeline.pipeline_step(cfg, sched, dist.group.WORLD, embed, full,
                                            list(zip(tokens.chunk(m), targets.chunk(m))))
    grads = {n: p.grad.detach().clone() for c in chunks for n, p in c.named_parameters()}
    return None if result.loss is None else result.loss.detach(), grads


def pipeline_loss_and_grads(cfg, full, tokens, targets, *, pp=2, microbatches=4, schedule="1f1b", virtual_stages=1):
    """serial_loss_and_grads's loss and gradients (targets -100 not counted: each counted target of the
    batch weighs the same, whichever microbatch holds it) computed by 02's pipeline executor on pp gloo
    ranks: the batch cut into `microbatches`, run by schedule "gpipe", "1f1b" (02's) or "interleaved"
    (03's, virtual_stages chunks per rank), on 01's GPT cut into chunks (02's build_chunks) from `full`,
    the tied embedding's two copies summed: PipelineStep. n_layer must divide by pp x virtual_stages, B
    by microbatches."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline_loss_and_grads: schedule={schedule!r} must be one of {', '.join(PIPELINE_SCHEDULES)}")
    for name, n in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"pipeline_loss_and_grads: {name}={n!r} must be a whole number of at least 1")
    v = virtual_stages if schedule == "interleaved" else 1
    if v != virtual_stages:
        raise ValueError(f"pipeline_loss_and_grads: virtual_stages={virtual_stages} needs schedule='interleaved'")
    if cfg.n_layer % (pp * v) or tokens.dim() != 2 or tokens.shape != targets.shape or tokens.shape[0] % microbatches:
        raise ValueError(f"pipeline_loss_and_grads: n_layer={cfg.n_layer} must divide by pp x virtual_stages = {pp} x {v}, "
                         f"and tokens {tuple(tokens.shape)}, targets {tuple(targets.shape)} be one (B, T), B divisible "
                         f"by microbatches={microbatches}")
    from megatron_scratch.testing import run_ranks
    ranks = run_ranks(_pipeline_rank, pp, cfg, full, tokens, targets, schedule, microbatches, v)
    grads = {}
    for _, g in ranks:
        grads.update(g)  # wte on the first and the last stage: the same sum
    return PipelineStep(next(loss for loss, _ in ranks[::-1] if loss is not None), {n: grads[n] for n in full},
                        _pipeline_schedule(schedule, pp, microbatches, v).lists)


# ----------------------------------------------------------------------------------------------
# 04, 05, 08, 09: training with data parallelism, the 3D trainer, a context-parallel step, an MoE layer.

MODES = ("serial", "naive", "bucketed", "zero1")


@dataclass
class Training:
    """losses: every step's loss of the global batch (the mean over its counted targets, float);
    weights: the full state dict after the last step (float64, keyed and shaped as `full`)."""
    losses: list
    weights: dict


def _check_batches(batches, dp, microbatches):
    batches = list(batches)
    if not batches:
        raise ValueError("batches: at least one (tokens, targets) global batch is needed")
    for i, (tokens, targets) in enumerate(batches):
        if tokens.shape != targets.shape or tokens.dim() != 2 or tokens.shape[0] % (dp * microbatches):
            raise ValueError(f"batches[{i}]: tokens {tuple(tokens.shape)} and targets {tuple(targets.shape)} must be the "
                             f"same (B, T), B divisible by dp x microbatches = {dp} x {microbatches}")
    return batches


def _04_rank(env, cfg, full, batches, mode, args, adamw):
    import torch.distributed as dist
    from megatron_scratch import data_parallel as dpm
    losses, weights = dpm.train_replica(env, cfg, args, mode, dist.group.WORLD, full, batches, **adamw)[:2]
    return Training(losses, weights)


def reference_training(cfg, full, batches, *, mode="bucketed", dp=2, microbatches=1, lr=1e-3, betas=(0.9, 0.999),
                       eps=1e-8, weight_decay=0.01, bucket_numel=20000):
    """04's data-parallel training from the full weights, in float64: one AdamW step (torch's AdamW, or
    ZeRO-1's FlatAdamW, with lr, betas, eps and weight_decay, on every parameter as torch.optim.AdamW(model.
    parameters()) decays them) per global batch of `batches` [(tokens, targets) (B, T)]: Training.
    mode "serial": 04's serial_training, the serial model on the whole batch (in this process); "naive"
    (04's lesson: every gradient all-reduced after backward), "bucketed" (04's BucketedDDP: buckets of
    bucket_numel reduced during the last microbatch's backward) or "zero1" (BucketedDDP's reduce-scatter
    and FlatAdamW's shards): 04's train_replica on dp gloo ranks, each on its B / dp rows in
    `microbatches` accumulation steps, every counted target (not -100) of the global batch weighing the
    same (docs/LOSS.md). All four compute the same function: what an FSDP or DDP run is compared with."""
    if mode not in MODES:
        raise ValueError(f"reference_training: mode={mode!r} must be one of {', '.join(MODES)}")
    for name, v in (("dp", dp), ("microbatches", microbatches), ("bucket_numel", bucket_numel)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"reference_training: {name}={v!r} must be a whole number of at least 1")
    batches = _check_batches(batches, 1 if mode == "serial" else dp, 1 if mode == "serial" else microbatches)
    from types import SimpleNamespace
    from megatron_scratch import data_parallel as dpm
    args = SimpleNamespace(lr=lr, microbatches=microbatches, bucket_numel=bucket_numel)  # the 04 demo's flags read
    adamw = dict(betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    if mode == "serial":
        losses, weights = dpm.serial_training(cfg, args, full, batches, **adamw)
        return Training(losses, {n: p.detach() for n, p in weights.items()})
    from megatron_scratch.testing import run_ranks
    return run_ranks(_04_rank, dp, cfg, full, batches, mode, args, adamw)[0]


@dataclass
class Training3D:
    """losses, grad_norms: every step's loss of the global batch and global gradient norm (before
    clipping); grads: every gradient of step 0's loss, before clipping and the first update, full shapes
    (wte's the sum of both its uses), with zero1 too (each rank's shards gathered over dp); weights:
    the full state dict after the last step."""
    losses: list
    grad_norms: list
    grads: dict
    weights: dict


def _3d_rank(env, cfg, full, batches, layout):
    import math
    import torch.distributed as dist
    from megatron_scratch import data_parallel as dpm, gpt3d
    layout = dict(layout, grad_clip=math.inf if layout["grad_clip"] is None else layout["grad_clip"])
    tc = gpt3d.TrainConfig(**layout, batch_size=batches[0][0].shape[0], seq_len=batches[0][0].shape[1],
                           dtype="float64", warmup_steps=0, min_lr=layout["lr"], steps=len(batches),
                           fused_kernels=False, cuda_graphs=False, eval_every=0)
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, tc.tp, tc.dp, tc.pp), tc.timeout_s)
    run = gpt3d.build(env, cfg, tc, groups)
    for c in run.chunks:
        c.load_full_state_dict(full)  # as 05's prove_machine does: these weights, not build's own draw
    grads, ddp, finish = {}, run.ddp, run.ddp.finish

    def read_grads():  # step 0's gradients, as finish() leaves them: every replica's mean, not yet clipped
        finish()
        if ddp.zero:  # ZeRO-1: this rank holds its shard of each bucket's mean; every rank's, gathered
            buffer = ddp.grad_buffer.clone()
            for i, (lo, hi) in enumerate(ddp.buckets):
                _tp.all_gather_single(buffer[lo:hi], ddp.grad_buffer[slice(*ddp.shard_range(i))].clone(),
                                      ddp.bucket_groups[i])
            for p in ddp.params:
                p.grad = buffer[ddp.offsets[p]:ddp.offsets[p] + p.numel()].view_as(p)
        grads.update({n: g.clone() for c in run.chunks for n, g in c.full_grads().items()})
        if ddp.zero:
            for p in ddp.params:
                p.grad = None  # as finish() leaves them under ZeRO-1: FlatAdamW reads the buffer
        ddp.finish = finish

    losses, norms, dp_rank = [], [], dist.get_rank(groups.dp)
    for step, (idx, targets) in enumerate(batches):
        ddp.finish = read_grads if step == 0 else finish
        loss, norm, _ = gpt3d.train_step(run, *dpm.shard_batch(idx, targets, tc.dp, dp_rank), tc.lr)
        losses.append(float(loss))
        norms.append(float(norm))
    run.opt.wait_gather()
    weights = {n: w.clone() for c in run.chunks for n, w in c.full_state_dict().items()}
    keep = dp_rank == 0 and dist.get_rank(groups.tp) == 0
    return losses, norms, grads if keep else {}, weights if keep else {}


def gpt3d_training(cfg, full, batches, *, tp=1, pp=1, dp=1, microbatches=None, virtual_stages=1,
                   sequence_parallel=False, zero1=False, lr=3e-3, weight_decay=0.1, grad_clip=None,
                   loss_normalization="token"):
    """05's trainer's machine (build and train_step: 02's executor, 1F1B or interleaved 1F1B over pp,
    01's layers over tp inside, 04's buckets or ZeRO-1 over dp, every speed flag on) on tp x pp x dp
    gloo ranks, from the full weights `full` (float64), one step per global batch of `batches`
    [(tokens, targets) (B, T)] at a constant lr: Training3D. microbatches: m per replica (default
    B / dp: one sequence each). 05's AdamW: betas (0.9, 0.95), eps 1e-8, weight_decay on the 2-D
    weights only; grad_clip None: no clipping. loss_normalization "token": each counted target of the
    global batch alike (the serial model's mean); "microbatch": Megatron's mean of means. 05's
    refusals (sizes that do not divide, a world too large for the machine) are its ValueErrors."""
    batches = list(batches)
    if not batches:
        raise ValueError("gpt3d_training: at least one (tokens, targets) global batch is needed")
    m = batches[0][0].shape[0] // dp if microbatches is None else microbatches
    batches = _check_batches(batches, dp, m)
    layout = dict(tp=tp, pp=pp, dp=dp, microbatches=m, virtual_stages=virtual_stages,
                  sequence_parallel=sequence_parallel, zero1=zero1, lr=lr, weight_decay=weight_decay,
                  grad_clip=grad_clip, loss_normalization=loss_normalization)
    from plumbing.checks import check_model
    check_model(cfg, tp, "cpu")
    if cfg.n_layer % (pp * virtual_stages):
        raise ValueError(f"gpt3d_training: n_layer={cfg.n_layer} must be divisible by pp x virtual_stages = "
                         f"{pp} x {virtual_stages}")
    from megatron_scratch.testing import run_ranks
    ranks = run_ranks(_3d_rank, tp * pp * dp, cfg, full, batches, layout)
    grads, weights = {}, {}
    for _, _, g, w in ranks:
        grads.update(g)  # the tied wte's two copies hold the same sum, and the same weights
        weights.update(w)
    return Training3D(ranks[0][0], ranks[0][1], {n: grads[n] for n in full}, {n: weights[n] for n in full})


def _cp_rank(env, cfg, full, tokens, targets, split):
    import torch.distributed as dist
    from megatron_scratch import context_parallel as cpm
    group, sched = dist.group.WORLD, cpm.SPLITS[split](env.world_size)
    model = cpm.context_parallel(_tp.GPT(cfg, None, init=False, dtype=next(iter(full.values())).dtype), sched, group)
    model.load_full_state_dict(full)
    logits, loss = cpm.step(model, tokens, targets, group, group)  # gradients: summed over the ring
    return LossAndGrads(loss.detach(), cpm.gather_sequence(logits.detach(), sched, group),
                        {n: p.grad.detach().clone() for n, p in model.named_parameters()})


def cp_loss_and_grads(cfg, full, tokens, targets, *, cp=2, split="megatron"):
    """serial_loss_and_grads's result (targets -100 not counted) computed by 08's context parallelism on
    cp gloo ranks: each holds T / cp of every sequence (split "contiguous", "megatron": 2 cp blocks, rank
    i's i and 2 cp - 1 - i, or "lightseq"), attention runs 08's ring, the loss's shares are summed over
    the ring; rank 0's result, the logits gathered to (B, T, V). T must divide by cp (2 cp: megatron)."""
    from megatron_scratch import context_parallel as cpm
    if split not in cpm.SPLITS:
        raise ValueError(f"cp_loss_and_grads: split={split!r} must be one of {', '.join(cpm.SPLITS)}")
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp_loss_and_grads: cp={cp!r} must be a whole number of at least 1")
    blocks = 2 * cp if split == "megatron" else cp
    if tokens.dim() != 2 or tokens.shape != targets.shape or tokens.shape[1] % blocks:
        raise ValueError(f"cp_loss_and_grads: tokens {tuple(tokens.shape)} and targets {tuple(targets.shape)} must be "
                         f"the same (B, T), T divisible by {blocks} (the {split} split's blocks at cp={cp})")
    from megatron_scratch.testing import run_ranks
    return run_ranks(_cp_rank, cp, cfg, full, tokens, targets, split)[0]


@dataclass
class MoEOutput:
    """y: the layer's output (B, T, C); x_grad: the gradient of (y * grad_output).sum() with respect to
    x; grads: with respect to every weight, keyed as moe_weights's (router.weight, experts.<e>.c_fc.weight,
    ...); aux: the load-balancing loss E sum_i f_i P_i over every token (ep = 1; at ep > 1 the mean of
    the ranks', each over its own rows)."""
    y: torch.Tensor
    x_grad: torch.Tensor
    grads: dict
    aux: torch.Tensor


def moe_weights(cfg, *, num_experts, seed=0, dtype=torch.float64):
    """An MoE layer's weights for n_embd = cfg.n_embd, drawn from seed: router.weight (E, C) N(0, 0.02),
    and each expert e's GPT-2 MLP, experts.<e>.c_fc.weight (4C, C), .c_fc.bias (4C,), .c_proj.weight
    (C, 4C), .c_proj.bias (C,), nn.Linear's (out, in), N(0, 0.02) (the biases N(0, 0.01))."""
    gen, C = torch.Generator().manual_seed(seed), cfg.n_embd
    draw = lambda *shape, s=0.02: torch.randn(*shape, generator=gen, dtype=dtype) * s  # noqa: E731
    out = {"router.weight": draw(num_experts, C)}
    for e in range(num_experts):
        out.update({f"experts.{e}.c_fc.weight": draw(4 * C, C), f"experts.{e}.c_fc.bias": draw(4 * C, s=0.01),
                    f"experts.{e}.c_proj.weight": draw(C, 4 * C), f"experts.{e}.c_proj.bias": draw(C, s=0.01)})
    return out


def _moe_layer(cfg, weights, num_experts, top_k, group):
    from types import SimpleNamespace
    from megatron_scratch import expert_parallel as epm
    moe = epm.MoEConfig(num_experts=num_experts, top_k=top_k, aux_loss_coeff=0.0)
    layer = epm.MoELayer(cfg, moe, SimpleNamespace(ep=group) if group is not None else None,
                         dtype=weights["router.weight"].dtype)
    mine = dict(layer.named_parameters())
    with torch.no_grad():
        for n, p in mine.items():
            p.copy_(weights[n])
    return layer


def _moe_run(layer, x, grad_output):
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    (y * grad_output).sum().backward()
    return y.detach(), x.grad, {n: p.grad.detach().clone() for n, p in layer.named_parameters()}, layer.aux.detach()


def _moe_rank(env, cfg, weights, num_experts, top_k, x, grad_output):
    import torch.distributed as dist
    layer = _moe_layer(cfg, weights, num_experts, top_k, dist.group.WORLD)
    rows = lambda t: t.chunk(env.world_size)[env.rank]  # noqa: E731: this rank's rows of the batch
    y, xg, grads, aux = _moe_run(layer, rows(x), rows(grad_output))
    router = grads.pop("router.weight")
    dist.all_reduce(router)  # a dense weight: every rank's tokens' share summed
    gather = lambda t: torch.cat(_gather(t, env.world_size))  # noqa: E731
    dist.all_reduce(aux)
    return gather(y), gather(xg), dict(grads, **{"router.weight": router}), aux / env.world_size


def _gather(t, n):
    import torch.distributed as dist
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous())
    return parts


def moe_layer(cfg, weights, x, *, num_experts, top_k, ep=1, grad_output=None):
    """09's MoE layer (MoELayer: a router, softmax over E, the top k renormalised to sum to 1 (Mixtral's),
    dispatch by all-to-all, each expert a GPT-2 MLP, combine; dropless, no auxiliary-loss term in y) with
    `weights` (moe_weights's keys) on x (B, T, C), backward from grad_output (default: a fixed
    cos(0.7 j) probe of y's shape): MoEOutput. ep = 1: the serial layer, here; ep > 1: on ep gloo ranks,
    rank r holding experts r E/ep .. (r+1) E/ep - 1 and rows r B/ep .. of the batch (B divisible by ep)."""
    from megatron_scratch.testing import run_ranks
    for name, v in (("num_experts", num_experts), ("top_k", top_k), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"moe_layer: {name}={v!r} must be a whole number of at least 1")
    if top_k > num_experts or num_experts % ep or x.dim() != 3 or x.shape[0] % ep or x.shape[2] != cfg.n_embd:
        raise ValueError(f"moe_layer: top_k={top_k} must be at most num_experts={num_experts}, ep={ep} must divide "
                         f"it and x's B; x {tuple(x.shape)} must be (B, T, n_embd={cfg.n_embd})")
    if grad_output is None:
        grad_output = torch.cos(0.7 * torch.arange(x.numel(), dtype=x.dtype)).reshape(x.shape)
    if ep == 1:
        return MoEOutput(*_moe_run(_moe_layer(cfg, weights, num_experts, top_k, None), x, grad_output))
    ranks = run_ranks(_moe_rank, ep, cfg, weights, num_experts, top_k, x, grad_output)
    grads = {}
    for _, _, g, _ in ranks:
        grads.update(g)  # each rank's experts, and the router (the same sum on every rank)
    return MoEOutput(ranks[0][0], ranks[0][1], {n: grads[n] for n in weights}, ranks[0][3])


STABLE = ["gpt_config", "init_weights", "serial_loss_and_grads", "tp_shard", "tp_unshard", "tp_loss_and_grads",
          "pipeline_loss_and_grads", "reference_training", "gpt3d_training", "cp_loss_and_grads", "moe_weights", "moe_layer"]


def signatures():
    """{name: str(inspect.signature)} of the stable functions: what tests/test_reference.py pins."""
    return {name: str(inspect.signature(globals()[name])) for name in STABLE}
