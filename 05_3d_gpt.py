"""05 - The 3D-parallel GPT trainer: PTD-P (Narayanan et al. 2021, Sections 3 and 4).

What this file adds on top of 01-04: their composition into one trainer. Tensor parallelism (01,
optionally with sequence parallelism) runs inside each pipeline stage; the stages run 1F1B (02) or
interleaved 1F1B (03); data parallelism or ZeRO-1 (04) runs across pipeline replicas, each stage
reducing over its own dp group during each model chunk's last backward. New here, in this order:
  - the rank grid: Megatron's order, tp fastest, then dp, then pp (Section 3);
  - the scatter/gather optimisation (Section 4.1): between stages each tp rank sends only 1/tp of
    the boundary tensor and the receiving stage all-gathers it over tp;
  - activation recomputation, of whole layers or of the attention core (Korthikanti et al. 2022, §5);
  - the global gradient norm for clipping across tp, pp and dp, every element counted once;
  - the training step and loop: AdamW with weight-decay groups, warmup then cosine decay, a held-out
    eval loss.
The trainer turns on every optimization the chapters add after their concepts (the "speed" flags,
each on by default: 01's overlapped linear and merged loss reductions, 02's background sends, 04's
pipeline buckets and overlapped ZeRO-1 gather), and, where the device allows, fused kernels and CUDA
graphs (Section 4.2), each behind one seam of kernels/ (kernels.fuse, kernels.graphs.Graphed).
What a run needs but does not teach is plumbing/: data, checkpoints (sharded, atomic, loadable in
any layout), GPT-2 weights, sampling, the summary and the progress bar; the planner (--plan, the
papers' cost formulas) is planner.py.

Run it (it is the project's main job):
    python 05_3d_gpt.py                                   # tp=2 x pp=2 x dp=2: 8 CPU ranks
    python 05_3d_gpt.py --print-layout --tp 8 --pp 4 --dp 4
    python 05_3d_gpt.py --plan 1T --gpus 3072             # the paper's 1T model on 3072 A100s
    python 05_3d_gpt.py --steps 20 --save ckpt && python 05_3d_gpt.py --steps 40 --resume ckpt --tp 1 --pp 4
    python 05_3d_gpt.py --resume ckpt --sample "alice has 3 apples." --top-k 40
    torchrun --standalone --nproc_per_node 8 05_3d_gpt.py --tp 8 --pp 1 --dp 1 --dtype bfloat16
    torchrun --standalone --nproc_per_node 1 05_3d_gpt.py --tp 1 --pp 1 --dp 1   # kernels + a whole-step graph
docs/RUNBOOK.md has multi-node torchrun and SLURM recipes. The run prints a start-up summary (model,
data, layout, memory, FLOPs per iteration by eq. 3, the bubble), a progress bar, a line per save,
and a chart of the loss; --metrics FILE writes a JSON line per step, --trace FILE a Chrome trace.
"""
import contextlib
import dataclasses
import functools
import importlib
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import kernels  # a package beside the numbered files
import planner
from kernels import graphs as cuda_graphs
from plumbing import agreement, cli, report, sample, selfcheck, watch
from plumbing.checkpoint import Saver, load_checkpoint, newest_checkpoint
from plumbing.checks import acceleration, check_action, check_fields, check_model_flags, check_plan_flags, preflight
from plumbing.data import check_tokens, replica_batch
from plumbing.gpt2 import export_checkpoint, import_gpt2
from plumbing.launch import launcher_ranks, printer, run_main, side_channel
from plumbing.trace import StepTrace, trace_comm

tensor_parallel = importlib.import_module("01_tensor_parallel")
pipeline = importlib.import_module("02_pipeline_1f1b")
interleaved = importlib.import_module("03_interleaved")
data_parallel = importlib.import_module("04_data_parallel")


# ----------------------------------------------------------------------------------------------
# The rank grid (Section 3): tp fastest, then dp, then pp, so a tp group is adjacent ranks (one
# node: its all-reduces stay on NVLink) and only pipeline and data-parallel traffic crosses nodes.
# Pure: it can be checked without any process.


def rank_grid(world, tp=1, dp=1, pp=1):
    """Every group of each kind as lists of global ranks: {"tp", "dp", "pp", "embed"}."""
    if tp * dp * pp != world:
        raise ValueError(f"the world size {world} does not match tp={tp} x dp={dp} x pp={pp}")
    rank = lambda t, d, p: (p * dp + d) * tp + t  # noqa: E731
    grid = {
        "tp": [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }
    # The tied embedding lives on the first and the last stage of every pipeline.
    grid["embed"] = [[g[0], g[-1]] for g in grid["pp"]] if pp > 1 else []
    return grid


@dataclass
class Groups:
    """This rank's process group of each kind, passed explicitly to whatever communicates."""
    tp: object
    dp: object
    pp: object
    embed: object  # None on a rank that holds no copy of the tied embedding (or at pp = 1)
    vocab: object = None  # 07: the vocabulary group, this replica's pp x tp ranks (else None)
    vocab_p2p: object = None  # 07: its own pp group, for the last stage's output sent to every rank


def new_groups(env, grid, timeout_s=60.0):
    """Create every group of the grid (a collective call: all ranks, same order) and return this
    rank's group of each kind."""
    mine = dict(embed=None)
    for kind, groups in grid.items():
        for ranks in groups:
            group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
            if env.rank in ranks:
                mine[kind] = group
    return Groups(**mine)


# ----------------------------------------------------------------------------------------------
# Scatter/gather (Section 4.1). Without sequence parallelism both tp ranks of a stage hold the
# same boundary tensor, so sending it whole from each would move tp copies of it between nodes.


class ScatterGather(pipeline.Wire):
    """Each tp rank sends its 1/tp slice of the (flattened) boundary tensor; the receiver
    all-gathers the slices over its tp group (fast, inside the node) to rebuild it."""

    def __init__(self, shape, tp_group):
        n, self.tp_group, self.full = math.prod(shape), tp_group, shape
        self.tp, self.rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        if n % self.tp:
            raise ValueError(f"scatter/gather needs b*T*C={n} divisible by tp={self.tp}")
        super().__init__((n // self.tp,))

    def pack(self, t):
        return t.reshape(-1).chunk(self.tp)[self.rank].contiguous()

    def unpack(self, buf):
        out = buf.new_empty(buf.numel() * self.tp)
        tensor_parallel.all_gather_single(out, buf, group=self.tp_group)
        return out.view(self.full)


# ----------------------------------------------------------------------------------------------
# Activation recomputation (Korthikanti Section 5): keep each layer's input, or the attention core's
# q, k and v, and rerun the rest during backward.


def recompute_layers(chunk, mode):
    """mode "full": wrap every block so that its forward is recomputed in backward. Dropout inside tp
    regions draws from the chunk's tracked stream, so that stream is replayed too (checkpoint itself
    restores the default one). "selective": recompute only the attention core (QK^T, softmax, its
    dropout, the product with V), whose 5as^2b/t bytes per layer grow with s^2; its dropout's stream
    is forked in around the checkpoint, which restores the generator it saw. "none": nothing."""
    for block in chunk.transformer.h.values():
        if mode == "full":
            block.forward = functools.partial(_recomputed, block.forward, chunk.rng)
        elif mode == "selective":  # q, k and v are kept; the (B, nh, T, T) tensors are not
            block.attn.core = functools.partial(checkpoint, block.attn.core, use_reentrant=False)


def _recomputed(forward, rng, x):
    state = rng.state.clone()

    @contextlib.contextmanager
    def replay():
        saved, rng.state = rng.state, state.clone()
        try:
            yield
        finally:
            rng.state = saved

    return checkpoint(forward, x, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: (contextlib.nullcontext(), replay()))


# ----------------------------------------------------------------------------------------------
# The global gradient norm: each element of the model counted exactly once, whatever the layout.


def counts_in_norm(p, chunk, tp_group):
    """Split parameters count on every tp rank (each holds a different slice); replicated ones
    (LayerNorms, row-parallel biases, wpe) only on tp rank 0; the tied output layer's copy on the
    last stage not at all (it is the first stage's embedding again)."""
    tied_copy = hasattr(chunk, "lm_head") and not chunk.pre_process and p is chunk.lm_head.weight  # 07: none
    return not tied_copy and (hasattr(p, "tp_dim") or dist.get_rank(tp_group) == 0)


def clip_gradients(opt, chunks, groups, max_norm, zero1):
    """Compute the global norm of every gradient, scale them by max_norm / norm if it is larger
    (as torch.nn.utils.clip_grad_norm_), and return the norm before clipping."""
    owner = {id(p): c for c in chunks for p in c.parameters()}
    grad0 = opt.pieces[0].grad
    dtype = torch.float64 if grad0.dtype == torch.float64 else torch.float32
    sq = torch.zeros((), dtype=dtype, device=grad0.device)
    for piece in opt.pieces:  # this rank's elements: all of them, or with ZeRO-1 its 1/dp
        if counts_in_norm(piece.param, owner[id(piece.param)], groups.tp):
            sq += piece.grad.to(dtype).pow(2).sum()
    for group in [groups.tp, groups.pp] + ([groups.dp] if zero1 else []):  # replicas: same gradients
        dist.all_reduce(sq, group=group)
    norm = float(sq.sqrt())
    if math.isfinite(norm):  # inf: the step is skipped (train_step), and inf * 0 would be NaN
        coef = min(max_norm / (norm + 1e-6), 1.0)
        for piece in opt.pieces:
            piece.grad.mul_(coef)
    return norm


def lr_at(step, tc):
    """Linear warmup, then cosine decay to min_lr at the last step."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / (tc.warmup_steps + 1)
    ratio = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.min_lr + 0.5 * (1 + math.cos(math.pi * min(ratio, 1.0))) * (tc.lr - tc.min_lr)


def no_decay(params):
    """Biases and LayerNorm weights (the 1-D parameters) take no weight decay."""
    return [p for p in params if p.dim() < 2]


# ----------------------------------------------------------------------------------------------
# Building one rank's part of the trainer


@dataclass
class Run:
    """What one rank trains with, made once by build()."""
    env: object  # plumbing.launch.RankEnv: rank, world size, device
    cfg: object  # 01's GPTConfig
    tc: object  # TrainConfig
    groups: Groups
    chunks: list  # this rank's model chunks, chunk c being virtual stage c pp + pp_rank (pipe.placement)
    schedule: list  # this rank's actions: 1F1B, or interleaved 1F1B when v > 1 (pipe.lists[pp_rank])
    pipe: object  # the PipelineSchedule it runs: every rank's list, the placement of the chunks
    split: object  # 06's backward split of the chunks, for lists with I and W; else None
    act_shape: tuple  # a stage's output: (b, T, C), T/tp with sequence parallelism
    wire: object  # ScatterGather, or None: boundary tensors travel whole
    ddp: object  # 04's BucketedDDP (PipelineDDP) over the chunks' parameters
    opt: object  # 04's FlatAdamW (or OverlappedGather)
    dtype: torch.dtype
    ops: object  # kernels.FusedOps, or None: 01's layers as written
    forward_backward: object  # forward_backward below, or kernels.graphs' CUDA-graph replay of it
    vocab: object = None  # 07's vocabulary passes over the chunks, or None


@dataclass
class PipelineSchedule:
    """What the pipeline runs. 05's is 03's interleaved 1F1B (interleaved_schedule); 06 passes its
    zero-bubble schedules to train() as schedule_of(tc), the one seam for them, named here, and 07
    its schedules with the vocabulary passes (vocab, grad_from)."""
    name: str  # for the summary: "1F1B", "interleaved 1F1B, v=2", ...
    lists: list  # every pipeline rank's actions
    placement: object = pipeline.looped  # where each chunk's stage is (02)
    lockstep: bool = False  # receives posted in lockstep with their senders (02's rank_plan)
    split: object = None  # (chunks) -> the backward split that runs I and W actions (06)
    bubble: str = "(pp-1)/(v m)"  # the formula of the summary's simulated bubble (t_b = 2 t_f)
    # 07: (cfg, chunks, groups, pipe) -> the vocabulary passes (the output and input layers spread
    # over every rank; it moves the token embedding's rows into the chunks), and the kind of pass
    # whose all-reduce brings the last stage its output's gradient (02's waits_for).
    vocab: object = None
    grad_from: str | None = None

    @property
    def last(self):
        """The pipeline rank holding the last stage (and the tied output layer)."""
        pp = len(self.lists)
        v = pipeline.n_chunks([a for acts in self.lists for a in acts])
        return pipeline.stage_map(pp, v, self.placement)[pp * v - 1][0]

    def grid(self, world, tp, dp):
        """rank_grid for this schedule: with the last stage beside the first (06's V), the tied
        embedding's copies are on one rank, summed there (02's sync_tied_embeddings): no group.
        07's vocabulary groups: each replica's pp x tp ranks, and a second group per pipeline; the
        embedding is then tied on each rank, no group either."""
        grid = rank_grid(world, tp, dp, len(self.lists))
        grid["embed"] = grid["embed"] if self.last and not self.vocab else []
        if self.vocab:
            grid["vocab"] = [sorted(r for g in grid["pp"] for r in g if r // tp % dp == d) for d in range(dp)]
            grid["vocab_p2p"] = [list(g) for g in grid["pp"]]
        return grid


def interleaved_schedule(tc):
    """1F1B (02), or interleaved 1F1B (03) when v > 1."""
    v = tc.virtual_stages
    return PipelineSchedule("interleaved 1F1B, v=" + str(v) if v > 1 else "1F1B",
                            [interleaved.interleaved(tc.pp, tc.microbatches, r, v) for r in range(tc.pp)])


def resolve_dtype(tc, device):
    if tc.dtype == "auto":  # bf16 on a GPU (fp32 gradients and masters); fp32 on a CPU
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, tc.dtype)


def build(env, cfg, tc, groups, pipe=None):
    """This rank's chunks (TP inside, loaded from the full weights), its DDP and optimizer. pipe: the
    PipelineSchedule (None: interleaved_schedule(tc))."""
    pipe, pp_rank = pipe or interleaved_schedule(tc), dist.get_rank(groups.pp)
    dtype = resolve_dtype(tc, env.device)
    torch.manual_seed(tc.seed + 100 * pp_rank)  # dropout: alike across tp and dp, not across stages
    # Megatron's CPU initialisation: the full model from the seed (or imported GPT-2 weights),
    # then this rank's part of it.
    full = import_gpt2(tc.init_from)[1] if tc.init_from else tensor_parallel.init_state_dict(cfg, tc.seed, dtype=dtype)
    chunks = pipeline.build_chunks(cfg, tc.pp, pp_rank, pipeline.n_chunks(pipe.lists[pp_rank]), groups.tp,
                                   pipe.placement, sequence_parallel=tc.sequence_parallel, seed=tc.seed + 100 * pp_rank,
                                   init=False, dtype=dtype, device=env.device,
                                   # Megatron's padding: V_pad a multiple of 128 tp, so the output
                                   # layer's GEMM has aligned sizes (50257 -> 50304 at tp = 1)
                                   vocab_divisible_by=VOCAB_DIVISIBLE_BY,
                                   check_inputs=False)  # train_step checks each batch on the host
    vocab = pipe.vocab(cfg, chunks, groups, pipe) if pipe.vocab else None  # 07: before the weights load
    fused, graph_mode = acceleration(tc, env.device)
    ops = kernels.FusedOps(tc.kernel_path, tc.flash_attention) if fused else None
    for c in chunks:
        c.load_full_state_dict(full)
        tensor_parallel.optimize(c, tc.overlap_input_grad, tc.merge_loss_reductions)
        if ops:
            kernels.fuse(c, ops, tc.overlap_input_grad)
        recompute_layers(c, tc.recompute)
    split = pipe.split(chunks) if pipe.split else None  # last: it takes over the linears' forwards
    params = [p for c in chunks for p in c.parameters()]
    # Gradients are reduced in fp32 when the weights are bf16; the optimizer keeps fp32 masters. A
    # gradient is final at the last of its chunk's m backwards, when its bucket's reduction can start,
    # except the tied embedding's buckets: they wait for train_step to add the other stage's copy in.
    grad_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    wte = [c.transformer.wte.weight for c in chunks if "wte" in c.transformer]
    ddp = data_parallel.PipelineDDP(params, groups.dp, tc.bucket_numel, tc.microbatches, hold=wte, zero=tc.zero1,
                                    grad_dtype=grad_dtype, overlap=tc.overlap_grad_reduce)
    overlap_gather = tc.zero1 and tc.overlap_param_gather and graph_mode is None  # a graph's replay runs no hooks
    opt = (data_parallel.OverlappedGather if overlap_gather else data_parallel.FlatAdamW)(
        ddp, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay, no_decay=no_decay(params))
    if overlap_gather:  # each block waits for its own weights; the chunk, first, for the rest
        for c in chunks:
            opt.wait_before_forward(c, [p for n, p in c.named_parameters() if not n.startswith("transformer.h.")])
            if vocab and "wte" in c.transformer:  # 07 looks tokens up outside the chunk's forward
                opt.wait_before_forward(c.transformer.wte, [c.transformer.wte.weight])
            for block in c.transformer.h.values():
                opt.wait_before_forward(block, list(block.parameters()))
    b = tc.batch_size // (tc.dp * tc.microbatches)
    act_shape = (b, tc.seq_len // (tc.tp if tc.sequence_parallel else 1), cfg.n_embd)
    sg = tc.scatter_gather and tc.tp > 1 and not tc.sequence_parallel  # with sp it is split already
    wire = ScatterGather(act_shape, groups.tp) if sg else None
    step = cuda_graphs.Graphed(graph_mode, forward_backward, pipeline.StepResult) if graph_mode else forward_backward
    return Run(env, cfg, tc, groups, chunks, pipe.lists[pp_rank], pipe, split, act_shape, wire, ddp, opt, dtype, ops,
               step, vocab)


# ----------------------------------------------------------------------------------------------
# One step, and the forward-only passes of the eval


def shared_loss(loss, run):
    """The batch's mean loss on every rank: from the last stage along the pipeline, then the mean
    over the replicas (each saw an equal share of the tokens)."""
    t = torch.zeros((), dtype=torch.float64, device=run.env.device)
    if loss is not None and dist.get_rank(run.groups.tp) == 0:
        t += loss.double()  # one rank per replica contributes: one all-reduce over everyone
    dist.all_reduce(t)
    return float(t) / run.tc.dp


def finite_step(loss, norm):
    """Whether a step updates the weights: its loss and gradient norm are both finite."""
    return math.isfinite(loss) and math.isfinite(norm)


def train_step(run, idx, targets, lr, trace=None):
    """One iteration: the pipeline over this replica's microbatches (each chunk's last backward
    reducing its buckets), tied-embedding sync, the rest of the data-parallel reduction, clipping,
    AdamW. Returns (loss, grad norm, StepResult).
    A non-finite loss or norm (the same on every rank: both are all-reduced) skips the update on
    every rank, as Megatron does; finite_step(loss, norm) says whether it ran. trace, a
    plumbing.trace.StepTrace, records the step's timeline."""
    tc, groups = run.tc, run.groups
    span = trace.span if trace else (lambda name, category: contextlib.nullcontext())
    # Checked and counted here, on the host, on every rank: a bad id stops every stage at once (not
    # the first stage alone, the others left waiting), and the executor reads nothing back.
    check_tokens(idx, run.cfg, tc.tp if tc.sequence_parallel else 1)
    valid = [int((t != -100).sum()) for t in targets.chunk(tc.microbatches)]
    micro = pipeline.split_batch(idx.to(run.env.device), targets.to(run.env.device), tc.microbatches)
    run.ddp.clock = trace.clock if trace else time.perf_counter  # the buckets' events on the trace's clock
    with trace_comm(*run.chunks, clock=trace.clock, groups=[groups.tp]) if trace else contextlib.nullcontext() \
            as collectives:  # the tp group's collectives, named by the layers that ran them
        res = run.forward_backward(run, micro, valid, trace)
    with span("tied-embedding all-reduce", "collective"):  # beside the buckets still in flight
        pipeline.sync_tied_embeddings(run.chunks, groups.embed, grad_of=run.ddp.main_grad)
    with span("data-parallel gradient reduction", "collective"):
        run.ddp.finish()
    if trace:
        trace.add_pipeline(res, collectives, run.ddp.events)
    with span("global gradient norm and clipping", "collective"):
        norm = clip_gradients(run.opt, run.chunks, groups, tc.grad_clip, tc.zero1)
    with span("loss all-reduce", "collective"):
        loss = shared_loss(res.loss, run)
    if finite_step(loss, norm):
        with span("AdamW" + (" and ZeRO-1 all-gather" if tc.zero1 else ""), "optimizer"):
            for g in run.opt.optimizer.param_groups:
                g["lr"] = lr
            run.opt.step()
    run.ddp.zero_grad()
    return loss, norm, res


def forward_backward(run, micro, valid, trace=None, chunks=None, plain=False):
    """This replica's microbatches through the pipeline: 02's executor runs this rank's list, with
    scatter/gather on the wire and (background_sends) 02's BackgroundSends. trace: the executor's
    events go on its timeline. chunks, plain (kernels/graphs.py): run these chunks instead, with
    nothing left in flight and no output freed (a graph owns them)."""
    exchange = pipeline.BackgroundSends() if run.tc.background_sends and not plain else None
    timing = dict(t0=trace.t0, clock=trace.clock) if trace else {}
    return pipeline.execute(run.schedule, chunks or run.chunks, run.groups.pp, micro, run.act_shape, wire=run.wire,
                            valid=valid, exchange=exchange, deallocate=not plain, placement=run.pipe.placement,
                            schedule=run.pipe.lists if run.pipe.lockstep else None, split=run.split, vocab=run.vocab,
                            **timing)


def forward_only(run, idx, targets, chunks=None):
    """This replica's batch through the pipeline, forward only (eval mode, no gradients); chunks:
    stand-ins for run.chunks that wrap them (the end report's probe reads the logits so). The
    forwards, and 07's S passes (its loss)."""
    forwards = [[pipeline.Action(a.kind, a.mb, a.chunk) for a in acts if a.kind in "FS"] for acts in run.pipe.lists]
    valid = [int((t != -100).sum()) for t in targets.chunk(run.tc.microbatches)]  # on the host
    micro = pipeline.split_batch(idx.to(run.env.device), targets.to(run.env.device), run.tc.microbatches)
    for c in run.chunks:
        c.eval()
    try:
        with torch.no_grad():
            return pipeline.execute(forwards[dist.get_rank(run.groups.pp)], chunks or run.chunks, run.groups.pp, micro,
                                    run.act_shape, wire=run.wire, valid=valid, placement=run.pipe.placement,
                                    schedule=forwards if run.pipe.lockstep else None, vocab=run.vocab)
    finally:
        for c in run.chunks:
            c.train()


def evaluate(run, tokens):
    """The mean loss over eval_batches held-out batches, forward only."""
    dp_rank = dist.get_rank(run.groups.dp)
    losses = [shared_loss(forward_only(run, *replica_batch(tokens, i, run.tc, dp_rank, salt=1)).loss, run)
              for i in range(run.tc.eval_batches)]
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------------------------
# The trainer's flags: one flat config (tc.tp, tc.lr, ...) made of groups, which --help prints apart


@dataclass
class Layout:
    tp: int = 2  # tensor-parallel size (ranks inside a stage)
    pp: int = 2  # pipeline stages
    dp: int = 2  # data-parallel replicas
    virtual_stages: int = 1  # v: model chunks per pipeline rank (interleaved 1F1B when > 1)
    batch_size: int = 32  # global batch B, in sequences
    microbatches: int = 4  # m per replica; micro-batch size b = B / (dp m)
    seq_len: int = 64  # T, tokens per sequence
    sequence_parallel: bool = False  # shard LayerNorm and dropout activations along T (Korthikanti)
    zero1: bool = False  # ZeRO-1 distributed optimizer instead of plain data parallelism
    recompute: Literal["none", "selective", "full"] = "none"  # rerun in backward: the attention core, or whole layers


@dataclass
class Optimization:
    steps: int = 200  # optimizer steps, counted from 0 (a resumed run stops at the same total)
    lr: float = 3e-3  # peak learning rate, reached after the warmup
    min_lr: float = 3e-4  # learning rate at the last step, after the cosine decay
    warmup_steps: int = 20  # linear warmup from lr/(warmup+1) to lr
    weight_decay: float = 0.1  # AdamW decay of the 2-D weights (not biases or LayerNorms)
    grad_clip: float = 1.0  # clip the global gradient norm to this
    dtype: Literal["auto", "float32", "float64", "bfloat16"] = "auto"  # auto: float32 on CPU, bfloat16 on GPU


@dataclass
class Speed:  # the optimizations each chapter adds after its concept: each on by default here
    overlap_input_grad: bool = True  # 01: a column-parallel input gradient's all-reduce runs beside the dW GEMM
    merge_loss_reductions: bool = True  # 01: the cross-entropy's target-logit and sum-of-exp all-reduces as one
    background_sends: bool = True  # 02: a boundary waits for its receives only; its sends complete meanwhile
    overlap_grad_reduce: bool = True  # 04: reduce each gradient bucket during the chunk's last backward, not after the flush
    overlap_param_gather: bool = True  # 04, ZeRO-1: all-gather the updated weights during the next forward, not before it
    scatter_gather: bool = True  # 05: each tp rank sends 1/tp of a stage's output (Section 4.1); tp > 1 without sp
    bucket_numel: int = 2_000_000  # 04: gradient bucket, in elements
    fused_kernels: bool | None = None  # kernels/ fused ops; unset: on on GPU, off on CPU
    kernel_path: Literal["auto", "cuda", "reference"] = "auto"  # fused kernels: CUDA where they apply, forced, or the PyTorch references
    flash_attention: bool = True  # with fused kernels: SDPA attention, or (off) matmul + fused causal softmax
    cuda_graphs: bool | None = None  # unset: on on GPU where the layout allows (tp = 1, no recompute)
    graph_scope: Literal["auto", "stage", "step"] = "auto"  # auto: the whole step at tp = pp = dp = 1, else per stage


@dataclass
class Loop:
    eval_every: int = 50  # steps between eval losses on the held-out split (0: never)
    eval_batches: int = 2  # held-out batches per eval loss
    seed: int = 1337  # weights, data order, dropout and sampling
    timeout_s: float = 120.0  # every collective's timeout, in seconds (at most 3600)
    max_skipped_steps: int = 5  # stop after this many steps in a row skipped for a non-finite loss or gradient norm
    hang_s: float | None = None  # no rank progressing this long while one waits: name the rank it waits for, stop (0: off; unset: half of --timeout-s)
    straggler_every: int = 0  # compare every rank's busy time with its stage's every N steps (0: only at the end)
    rehearse_fault: list[str] = dataclasses.field(default_factory=list)  # KIND:RANK:ARG: slow:R:MS, hang:R:STEP, kill:R:STEP, stop:R:STEP
    watch: bool = True  # each rank's record on the side channel: the hang report, the straggler report (off: neither)


@dataclass
class Files:
    data: str = ""  # a text file (its bytes), or a uint16 .bin (scripts/prepare_data.py); none: the built-in corpus
    save: str = ""  # write checkpoints under this directory
    save_every: int = 0  # steps between checkpoints (0: only at the end); needs --save
    keep: int = 2  # checkpoints kept, the newest
    save_timeout_s: float = 1800.0  # a save's own timeout: every rank's shard written and fsynced, and the rotation
    async_save: bool = False  # save in two stages: a snapshot in host memory (the only pause), then written in the background
    snapshot_every: int = 0  # steps between snapshots to --snapshot-dir, for --restarts (0: none)
    snapshot_dir: str = ""  # where snapshots go: node-local and fast, e.g. /dev/shm/snapshots
    restarts: int = 0  # when a rank dies or hangs, restart this many times from the newest snapshot or checkpoint
    resume: str = ""  # continue from the newest complete checkpoint here (any layout)
    data_changed_ok: bool = False  # with --resume: go on although --data is not the checkpoint's data (said, not refused)
    init_from: str = ""  # start from GPT-2 weights: a Hugging Face GPT-2 directory, or a .pt state dict
    metrics: str = ""  # write one JSON line per step to this file (scripts/plot_metrics.py plots it)
    trace: str = ""  # write one step's per-rank timeline here (Chrome trace JSON)
    overwrite: bool = False  # let --metrics, --trace and the exports replace files this run did not write


@dataclass
class TrainConfig(Files, Loop, Speed, Optimization, Layout):
    """Every flag of the trainer, one flat record (tc.tp, tc.lr, ...); --help prints it in these groups."""


GROUPS = [(Layout, "layout"), (Optimization, "optimization"), (Speed, "speed: the chapters' optimizations"),
          (Loop, "the training loop"), (Files, "files")]


VOCAB_DIVISIBLE_BY = 128  # Megatron's --make-vocab-size-divisible-by: V_pad is a multiple of it times tp
MODEL_DEFAULTS = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)


# ----------------------------------------------------------------------------------------------
# Training


def train(env, cfg, tc, quiet=False, schedule_of=interleaved_schedule):
    """Train on this rank; returns the per-step losses and gradient norms and the final figures.
    schedule_of(tc): the PipelineSchedule to run (06 passes its own)."""
    say = printer(env, quiet)  # everything that can be refused is, before the first collective:
    train_tokens, eval_tokens, path, start = preflight(cfg, tc, env.world_size, env.device, say, ranks_here=1,
                                                       writer=env.rank == 0)
    agreement.check(env, cfg, tc, path, start)  # every rank the same flags, data and checkpoint, or none trains
    if acceleration(tc, env.device)[0]:
        kernels.prebuild(tc.kernel_path)  # minutes when cold: before any collective can time out
    pipe = schedule_of(tc)
    groups = new_groups(env, pipe.grid(env.world_size, tc.tp, tc.dp), tc.timeout_s)
    run = build(env, cfg, tc, groups, pipe)
    spec = planner.ModelSpec(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, tc.seq_len)
    flops = planner.flops_per_iteration(spec, tc.batch_size, tc.recompute)
    report.summary(run, spec, flops, len(train_tokens), len(eval_tokens), say)
    if path:
        load_checkpoint(run, path, say)
        say(f"resumed from {path}: {start} steps done")
    elif tc.resume:
        say(f"no complete checkpoint in {tc.resume}: starting from step 0")
    progress = report.Progress(env, tc, flops, start, run.dtype, quiet, append=path is not None)
    saver = Saver(tc.save, tc.keep, tc.save_timeout_s, tc.async_save) if tc.save else None
    snapshots = Saver(tc.snapshot_dir, 2, tc.save_timeout_s, tc.async_save) if tc.snapshot_every else None
    recorder = watch.Recorder(env.rank, lambda r: watch.coords(r, tc))
    faults = watch.parse_faults(tc.rehearse_fault, env.world_size)
    beats = watch.start(env, side_channel(), recorder.install(), watch.hang_seconds(tc), launcher_ranks()) \
        if tc.watch else None
    traced = min(start + 1, tc.steps - 1)  # not the first step: it allocates, compiles, captures
    losses, norms, evals, skipped, in_a_row, t_start, busy = [], [], [], [], 0, time.perf_counter(), None
    for step in progress:
        trace = StepTrace(env.device).start() if tc.trace and step == traced else None
        recorder.begin_step(step)
        watch.rehearse(faults, env.rank, step, recorder)
        t0, lr = time.perf_counter(), lr_at(step, tc)
        loss, norm, res = train_step(run, *replica_batch(train_tokens, step, tc, dist.get_rank(groups.dp)), lr, trace)
        recorder.end_step()
        record = dict(step=step, loss=loss, lr=lr, grad_norm=norm, time_s=time.perf_counter() - t0)
        in_a_row = 0 if finite_step(loss, norm) else in_a_row + 1  # the same on every rank
        if in_a_row:  # the update was skipped everywhere; so many in a row stop every rank together
            skipped.append(step)
            record["skipped"] = True
            progress.note(f"step {step} skipped: loss {loss}, gradient norm {norm} ({in_a_row} in a row)")
            if in_a_row >= tc.max_skipped_steps:
                raise FloatingPointError(f"{in_a_row} steps in a row ({step - in_a_row + 1} to {step}) had a "
                                         f"non-finite loss or gradient norm; stopping (--max-skipped-steps "
                                         f"{tc.max_skipped_steps}). Saved checkpoints hold only finite values.")
        if trace:  # one track per rank, named by its place in the grid (tp fastest, then dp, pp)
            trace.write(tc.trace, f"step {step}", [f"rank {r}: tp {r % tc.tp}, dp {r // tc.tp % tc.dp}, pp "
                                                   f"{r // (tc.tp * tc.dp)}" for r in range(env.world_size)])
            progress.note(f"trace of step {step}, one track per rank: {tc.trace} (open it in "
                          f"chrome://tracing or ui.perfetto.dev)")
        losses.append(loss)
        norms.append(norm)
        if tc.eval_every and ((step + 1) % tc.eval_every == 0 or step == tc.steps - 1):
            recorder.set_phase("eval")
            record["eval_loss"] = evaluate(run, eval_tokens)
            evals.append((step, record["eval_loss"]))
        if tc.watch and tc.straggler_every and (step + 1 - start) % tc.straggler_every == 0:
            record["busy_ms"] = watch.report_stragglers(env, tc, recorder, tc.straggler_every, progress.note)
        if tc.watch and step == tc.steps - 1:  # the whole run's, per rank: the end report's, and this line's
            busy = record["busy_ms_run"] = watch.gather_busy(env, recorder, len(recorder.busy_ms))
        if step == start and run.ops:  # what the dispatcher chose
            progress.note(f"kernel paths: {kernels.build.report()}")
        saving = saver and ((tc.save_every and (step + 1) % tc.save_every == 0) or step + 1 == tc.steps)
        progress.log(record, durable=saving)  # on disk before the checkpoint: a crash between loses no line
        if saving:
            run.opt.wait_gather()  # ZeRO-1's gathers may still be in flight; the checkpoint reads every weight
            recorder.set_phase("save")  # it waits under its own timeout, not the watchdog's
            saver.save(run, step + 1, progress.note)
        if snapshots and (step + 1) % tc.snapshot_every == 0 and step + 1 < tc.steps:
            run.opt.wait_gather()
            recorder.set_phase("save snapshot")
            snapshots.save(run, step + 1, lambda text: None)  # quietly: one a step, perhaps
    for s in (saver, snapshots):
        if s:
            recorder.set_phase("save")
            s.wait()  # the run's end waits for a save still being written
    progress.close()
    if busy:
        watch.report_stragglers(env, tc, recorder, len(recorder.busy_ms), say, final=True, busy=busy)
    watch.stop(beats, recorder)
    run.opt.wait_gather()  # the last step's: the report and the caller read the weights
    if not losses:
        say(f"nothing to do: {start} of {tc.steps} steps were already done")
        return dict(losses=[], norms=[], evals=[], start=start)
    out = dict(losses=losses, norms=norms, evals=evals, start=start, skipped=skipped, busy_ms=busy,
               bytes_per_message=res.bytes_sent / max(res.messages, 1),
               peak_activation_bytes=res.peak_activation_bytes)
    if not tc.data and cfg.vocab_size >= 128 and not run.vocab:  # the built-in corpus: what did it learn?
        out["sums"] = report.sum_probe(run, forward_only)
    report.report(run, out, time.perf_counter() - t_start, say)
    return out


# ----------------------------------------------------------------------------------------------
# Main


def parser():
    """Every flag of the trainer: its config dataclasses, the actions, and the planner's."""
    p = cli.make_parser(__doc__)
    actions = p.add_argument_group("actions instead of training (each prints and exits)")
    actions.add_argument("--print-layout", action="store_true", help="print the rank grid and exit")
    actions.add_argument("--self-check", action="store_true", help="try every rank (a timed matmul), every tp "
                         "and dp group (an all-reduce) and every pair of neighbouring stages (a ping-pong), "
                         "each under a short timeout; print a table, name what is out of line, and exit")
    actions.add_argument("--export-hf", metavar="DIR", help="write --resume's newest checkpoint as a "
                         "Hugging Face GPT-2 directory and exit")
    actions.add_argument("--export-state-dict", metavar="FILE", help="write --resume's newest checkpoint "
                         "as a plain serial state dict (.pt) and exit")
    cli.add_dataclass_args(p, tensor_parallel.GPTConfig, "model", **MODEL_DEFAULTS)
    for group, title in GROUPS:
        cli.add_dataclass_args(p, group, title)
    cli.add_dataclass_args(p, sample.SampleConfig, "sampling (with --resume or --init-from)")
    planner.add_plan_args(p)
    return p


def main(parser=parser, config=TrainConfig, schedule_of=interleaved_schedule):
    """The trainer's command line; 06 runs it with its own flags (config, parser) and schedules."""
    p = parser()
    args = p.parse_args()
    if args.plan:  # the planner checks its own flags, and refuses any other
        check_plan_flags(cli.given(p), [name for _, name in planner.MODEL_FLAGS])
        print(planner.plan_from_args(args))
        return True
    tc, cfg, sc = (cli.from_args(c, args) for c in (config, tensor_parallel.GPTConfig, sample.SampleConfig))
    check_fields(tc, cfg, sc)  # every flag's type and range, whatever the action
    given = cli.given(p)  # the flags on the command line: no action may ignore one
    action = check_action(args, given)
    if action == "print_layout":
        report.print_layout(tc, lambda world, tp, dp, pp: schedule_of(tc).grid(world, tp, dp))
    elif action == "self_check":
        selfcheck.run(tc, rank_grid(tc.tp * tc.pp * tc.dp, tc.tp, tc.dp, tc.pp))
    elif action == "sample":
        sample.from_weights(cfg, tc, sc, given)
    elif action == "export":
        export_checkpoint(tc.resume, args.export_hf, args.export_state_dict, tc.overwrite)
    else:
        if tc.init_from:  # the imported weights decide the model's shape
            imported = import_gpt2(tc.init_from, cfg)[0]
            if imported:
                check_model_flags(given, cfg, imported, tc.init_from)
                cfg = dataclasses.replace(imported, dropout=cfg.dropout)
                print(f"model from {tc.init_from}: {cfg}")
        ranks = launcher_ranks()  # (rank, world, local rank) under torchrun, else None
        if ranks and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:  # torchrun --max-restarts
            tc = dataclasses.replace(tc, resume=newest_checkpoint(tc.snapshot_dir, tc.save) or tc.resume,
                                     rehearse_fault=[])
        world = ranks[1] if ranks else tc.tp * tc.pp * tc.dp
        device = torch.device("cuda" if ranks and torch.cuda.is_available() else "cpu")  # as launch decides
        preflight(cfg, tc, world, device, ranks_here=1 if ranks else world,  # again on every rank
                  writer=not ranks or ranks[0] == 0)
        # Under a fault, --restarts N starts again from the newest snapshot (plumbing/watch.py).
        return watch.with_restarts(lambda tc: tensor_parallel.launch(train, tc.tp * tc.pp * tc.dp, cfg, tc, False,
                                                                     schedule_of, timeout_s=tc.timeout_s,
                                                                     watch=watch.launcher_watch(tc)),
                                   tc, rank_grid(tc.tp * tc.pp * tc.dp, tc.tp, tc.dp, tc.pp))
    return True


if __name__ == "__main__":
    run_main(main)
