"""05 - The 3D-parallel GPT trainer: PTD-P (Narayanan et al. 2021, Sections 3 and 4).

What this file adds on top of 01-04: their composition into one trainer. Tensor parallelism (01) runs
inside each pipeline stage, the stages run 1F1B (02) or interleaved 1F1B (03), and data parallelism or
ZeRO-1 (04) runs across pipeline replicas.
  - The lesson, read first: the rank grid (Megatron's order: tp fastest, then dp, then pp; Section 3),
    its process groups, and ptd_p_step, ONE training step as plain code from the earlier lessons.
  - The machine, read second, which the main job runs and 06-09 extend: scatter/gather (Section 4.1),
    the global gradient norm, build, train_step and train, the loop. After it: recomputation
    (Korthikanti et al. 2022, Section 5), the flags, and fused kernels and CUDA graphs where the device
    allows (Section 4.2).
The demo, before the main job trains: the lesson's step at the run's layout against the serial model
in float64 (1e-10), then the machine's against the lesson (1e-12); exit 1 on a mismatch.

Run it (it is the project's main job):
    python 05_3d_gpt.py                                   # tp=2 x pp=2 x dp=2: 8 CPU ranks
    python 05_3d_gpt.py --print-layout --tp 8 --pp 4 --dp 4
    python 05_3d_gpt.py --plan 1T --gpus 3072             # the paper's 1T model on 3072 A100s
    python 05_3d_gpt.py --steps 20 --save ckpt && python 05_3d_gpt.py --steps 40 --resume ckpt --tp 1 --pp 4
    python 05_3d_gpt.py --resume ckpt --sample "alice has 3 apples." --top-k 40
    torchrun --standalone --nproc_per_node 8 05_3d_gpt.py --tp 8 --pp 1 --dp 1 --dtype bfloat16
    torchrun --standalone --nproc_per_node 1 05_3d_gpt.py --tp 1 --pp 1 --dp 1   # kernels + a whole-step graph
docs/RUNBOOK.md has multi-node torchrun and SLURM recipes; docs/GUIDE.md explains what a run prints.
"""
import contextlib
import functools
import importlib
import math
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import kernels  # a package beside the numbered files
from kernels import graphs as cuda_graphs
from plumbing import command, report
from plumbing.checkpoint import resume
from plumbing.checks import acceleration
from plumbing.data import check_tokens, replica_batch
from plumbing.demos import verdict
from plumbing.evaluation import evaluate, forward_only  # the held-out loss, forward only
from plumbing.flags import GROUPS, MODEL_DEFAULTS, TrainConfig, resolve_dtype  # the flags: argument handling
from plumbing.gpt2 import check_full, import_gpt2
from plumbing.launch import printer, run_main
from plumbing.operations import Operations, before_training
from plumbing.reference import unequal_counts
from plumbing.shards import max_rel_diff

tensor_parallel = importlib.import_module("01_tensor_parallel")
pipeline = importlib.import_module("02_pipeline_1f1b")
interleaved = importlib.import_module("03_interleaved")
data_parallel = importlib.import_module("04_data_parallel")


# ----------------------------------------------------------------------------------------------
# The lesson (Section 3) as plain code. tp fastest, then dp, then pp: a tp group is adjacent ranks (one
# node: its all-reduces stay on NVLink) and only pipeline and data-parallel traffic crosses nodes.


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


class Groups(SimpleNamespace):
    """This rank's process group of each kind in the grid (tp, dp, pp; embed, None on a rank that
    holds no copy of the tied embedding), passed explicitly to whatever communicates."""


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


def ptd_p_step(stage, opt, idx, targets, groups, m):
    """One PTD-P step on this rank: its replica's rows of the global batch (idx, targets (B, T)), cut into m
    microbatches, through 1F1B over its pipeline (02's lesson: stage is 02's stage_model, 01's layers over
    groups.tp inside); the tied embedding's two copies summed; the gradients averaged over the replicas
    (04's lesson); an AdamW step (opt). Returns the global batch's loss on the last stage, else None."""
    dp = dist.get_world_size(groups.dp)
    idx, targets = data_parallel.shard_batch(idx, targets, dp, dist.get_rank(groups.dp))  # this replica's rows
    microbatches = list(zip(idx.chunk(m), targets.chunk(m)))
    # The loss contract (docs/LOSS.md), 04's: every counted target of the GLOBAL batch weighs 1/n, n counted
    # over the replicas (one all-reduce); microbatch i's mean loss weighs valid_i dp / n.
    weights = data_parallel.replica_loss_weights(microbatches, groups.dp)
    opt.zero_grad()
    loss = pipeline.one_f_one_b_step(stage, microbatches, groups.pp, weights)  # and the tied-embedding sum
    data_parallel.allreduce_gradients(list(stage.parameters()), groups.dp)  # the mean over the dp replicas
    opt.step()
    if loss is not None:  # each replica's loss is dp times its share of the global batch's
        dist.all_reduce(loss, group=groups.dp)
        loss = loss / dp
    return loss


# ----------------------------------------------------------------------------------------------
# Demo: the lesson against the serial model, then the machine below (build, train_step) against the lesson.

CHECK_M, CHECK_LR = 3, 1e-3  # the check's microbatches per replica and learning rate


def adamw(params, lr=CHECK_LR):
    """The check's AdamW, the trainer's: betas (0.9, 0.95), weight decay 0.1 on the 2-D weights only."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def demo(env, tc, say):
    """The lesson's one step at tc's layout against the serial model's on a small model: loss, every gradient
    and every weight after AdamW within 1e-10 (the layout only reorders sums: a few ulps; a wrong weighting is
    off by ~1e-1); then prove_machine. Collective; every rank returns whether both passed."""
    tp, pp, dp, m, dt, dev = tc.tp, tc.pp, tc.dp, CHECK_M, torch.float64, env.device
    cfg = tensor_parallel.GPTConfig(vocab_size=97, block_size=8, n_layer=2 * pp, n_head=2 * tp, n_embd=8 * tp)
    groups = new_groups(env, rank_grid(env.world_size, tp, dp, pp), tc.timeout_s)
    gen = torch.Generator().manual_seed(tc.seed)
    idx, targets = torch.randint(cfg.vocab_size, (2, dp * m * 2, 8), generator=gen)
    unequal_counts(targets, dp * m)  # replica 0's first microbatch counts none, the last replica's last fewer
    idx, targets = idx.to(dev), targets.to(dev)
    counts = [[int((t != -100).sum()) for t in r.chunk(m)] for r in targets.chunk(dp)]
    full = tensor_parallel.init_state_dict(cfg, tc.seed, dtype=dt, random_all=True)
    serial = tensor_parallel.ParallelGPT(cfg, None, dtype=dt, device=dev)
    stage = pipeline.stage_model(cfg, groups.pp, group=groups.tp, dtype=dt, device=dev)
    for model in (serial, stage):
        model.load_full_state_dict(full)
    ref_loss = serial(idx, targets)[1]  # serial: the whole global batch at once
    ref_loss.backward()
    adamw(serial.parameters()).step()
    loss = ptd_p_step(stage, adamw(stage.parameters()), idx, targets, groups, m)
    lesson = loss, stage.full_grads(), stage.full_state_dict()  # gathered over tp to serial shapes
    diffs = [max_rel_diff(g, serial.get_parameter(n).grad) for n, g in lesson[1].items()]
    diffs += [max_rel_diff(w, serial.get_parameter(n).detach()) for n, w in lesson[2].items()]
    worst = torch.tensor(max(diffs + ([max_rel_diff(loss, ref_loss.detach())] if loss is not None else [])),
                         dtype=dt, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank's
    say(f"check: the lesson's PTD-P step (ptd_p_step) at tp={tp} x pp={pp} x dp={dp}, m={m}, float64, against "
        f"serial; targets counted per replica and microbatch: {counts}")
    say(f"check: the lesson against serial (loss, every gradient, every weight after AdamW): {verdict(float(worst), 1e-10)}")
    same = prove_machine(env, cfg, tc, groups, (idx, targets, full), lesson)
    say(f"check: the machine (build, train_step) against the lesson on the same weights and batch: {verdict(same, 1e-12)}")
    return bool(worst <= 1e-10) and same <= 1e-12


# ----------------------------------------------------------------------------------------------
# Read second: the machine, which the trainer runs and 06-09 extend. Scatter/gather (Section 4.1): without
# sequence parallelism a stage's tp ranks hold the same boundary tensor; sent whole, it crosses tp times.


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
# Read second: the global gradient norm: each element of the model counted exactly once, whatever the layout.


def counts_in_norm(p, chunk, tp_group):
    """Split parameters count on every tp rank (each holds its own slice); replicated ones (LayerNorms,
    row-parallel biases, wpe) on tp rank 0 only, of tp or of a later file's .split_group (07's); the
    tied output layer's copy on the last stage not at all (it is the first stage's embedding again)."""
    tied_copy = hasattr(chunk, "lm_head") and not chunk.pre_process and p is chunk.lm_head.weight
    return not tied_copy and (hasattr(p, "tp_dim") or tensor_parallel.tp_rank(getattr(p, "split_group", tp_group)) == 0)


def clip_gradients(opt, chunks, groups, max_norm, zero1):
    """The global norm of every gradient, returned; the gradients scaled by max_norm / norm if it is larger
    (as torch.nn.utils.clip_grad_norm_)."""
    owner = {id(p): c for c in chunks for p in c.parameters()}
    grad0 = opt.pieces[0].grad
    dtype = torch.float64 if grad0.dtype == torch.float64 else torch.float32
    sq = torch.zeros((), dtype=dtype, device=grad0.device)
    for piece in opt.pieces:  # this rank's elements: all of them, or with ZeRO-1 its 1/dp
        replicas = getattr(piece.param, "replica_group", groups.dp)  # holding the same gradient: dp (09's experts: edp)
        if counts_in_norm(piece.param, owner[id(piece.param)], groups.tp) and (zero1 or dist.get_rank(replicas) == 0):
            sq += piece.grad.to(dtype).pow(2).sum()
    dist.all_reduce(sq)  # every element was counted on exactly one rank
    norm = float(sq.sqrt())
    if math.isfinite(norm):  # inf: the step is skipped (train_step), and inf * 0 would be NaN
        coef = min(max_norm / (norm + 1e-6), 1.0)
        for piece in opt.pieces:
            piece.grad.mul_(coef)
    return norm


# ----------------------------------------------------------------------------------------------
# Read second: one rank's part of the trainer: 01's layers inside 02/03's chunks, 04's DDP and AdamW


def build(env, cfg, tc, groups, pipe=None, full=None):
    """This rank's chunks (TP inside, loaded from the full weights), its DDP and optimizer. pipe: the
    PipelineSchedule (None: interleaved_schedule(tc)); full: a full (serial) state dict of your own to
    take the weights from, refused by key and shape before any collective (None: the seed's, or --init-from's)."""
    if full is not None:
        check_full(cfg, full, "build(full=...)")  # alike on every rank: all refuse it, none waits
    pipe, pp_rank = pipe or interleaved_schedule(tc), dist.get_rank(groups.pp)
    dtype = resolve_dtype(tc, env.device)
    torch.manual_seed(tc.seed + 100 * pp_rank)  # dropout: alike across tp and dp, not across stages
    # Megatron's CPU initialisation: the full model, then this rank's part of it (each chunk's
    # load_full_state_dict, as a checkpoint loaded in another layout is split).
    if full is None:
        full = import_gpt2(tc.init_from)[1] if tc.init_from else tensor_parallel.init_state_dict(cfg, tc.seed, dtype=dtype)
    chunks = pipeline.build_chunks(cfg, tc.pp, pp_rank, pipe.v, groups.tp, pipe.placement,
                                   sequence_parallel=tc.sequence_parallel, seed=tc.seed + 100 * pp_rank,
                                   init=False, dtype=dtype, device=env.device, vocab_divisible_by=VOCAB_DIVISIBLE_BY,
                                   check_inputs=False)  # train_step checks each batch on the host
    fused, graph_mode = acceleration(tc, env.device)
    ops = kernels.FusedOps(tc.kernel_path, tc.flash_attention) if fused else None
    for c in chunks:
        c.load_full_state_dict(full)
        tensor_parallel.optimize(c, tc.overlap_input_grad)
        if ops:
            kernels.fuse(c, ops, tc.overlap_input_grad)
        recompute_layers(c, tc.recompute)
    pipe.prepare(chunks, groups, full)  # what the schedule does to the chunks (06, 07), last
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
    if overlap_gather:
        opt.wait_in_forward(chunks)  # each of their modules waits for its own weights' gathers
    b = tc.batch_size // (tc.dp * tc.microbatches)
    act_shape = (b, tc.seq_len // (tc.tp if tc.sequence_parallel else 1), cfg.n_embd)
    sg = tc.scatter_gather and tc.tp > 1 and not tc.sequence_parallel  # with sp it is split already
    wire = ScatterGather(act_shape, groups.tp) if sg else None
    step = cuda_graphs.Graphed(graph_mode, forward_backward, pipeline.StepResult) if graph_mode else forward_backward
    return Run(env, cfg, tc, groups, chunks, pipe.lists[pp_rank], pipe, act_shape, wire, ddp, opt, dtype, ops, step)


# ----------------------------------------------------------------------------------------------
# Read second: the lesson's step on the machine (buckets, clipping, the schedule as data); prove_machine


def train_step(run, idx, targets, lr):
    """One iteration of PTD-P: the pipeline over this replica's microbatches (each chunk's last backward
    reducing its buckets), the tied embedding's sync, the rest of the data-parallel reduction, clipping,
    AdamW. A non-finite loss or norm (the same on every rank: both are all-reduced) skips the update
    everywhere, as Megatron does; so does a batch with no counted target (StepResult None). Returns
    (loss, gradient norm, 02's StepResult)."""
    tc, groups = run.tc, run.groups
    # Checked and counted on the host, on every rank: a bad id stops every stage at once (not the
    # first stage alone, the others left waiting), and the executor reads nothing back.
    check_tokens(idx, run.cfg, tc.tp if tc.sequence_parallel else 1)
    valid = [int((t != -100).sum()) for t in targets.chunk(tc.microbatches)]
    norm, n = normalization(run, valid)
    if n == 0:  # no counted target in the whole batch: nothing to learn, no update (docs/LOSS.md)
        return 0.0, 0.0, None
    micro = pipeline.split_batch(idx.to(run.env.device), targets.to(run.env.device), tc.microbatches)
    res = run.forward_backward(run, micro, valid, norm)
    pipeline.sync_tied_embeddings(run.chunks, groups.embed, grad_of=run.ddp.main_grad)  # beside the buckets
    run.ddp.finish()
    norm = clip_gradients(run.opt, run.chunks, groups, tc.grad_clip, tc.zero1)
    loss = shared_loss(res.loss, run)
    if finite_step(loss, norm):
        for g in run.opt.optimizer.param_groups:
            g["lr"] = lr
        run.opt.step()
    run.ddp.zero_grad()
    return loss, norm, res


def forward_backward(run, micro, valid, norm=None, chunks=None, plain=False):
    """This replica's microbatches through 02's executor on this rank's list, scatter/gather on the wire, 02's
    BackgroundSends (background_sends). chunks, plain (kernels/graphs.py): these chunks, nothing in flight or freed."""
    exchange = pipeline.BackgroundSends() if run.tc.background_sends and not plain else None
    wire = run.wire or pipeline.Wire(run.act_shape)
    return run.pipe.executor(chunks or run.chunks, run.groups.pp, wire, exchange, not plain).run(micro, valid, norm)


def normalization(run, valid):
    """The loss contract (docs/LOSS.md): ([(num, den)]: microbatch i's summed loss counts num / den, the
    global batch's count n). token: each counted target weighs 1/n (one all-reduce over dp, x cp);
    microbatch (Megatron's default): each microbatch's mean, averaged. num = G: the buckets' mean."""
    tc, G = run.tc, run.ddp.dp  # G = dp, or dp x cp (08): each replica's count is held by G / dp ranks
    n = torch.tensor(sum(valid), device=run.env.device)
    dist.all_reduce(n, group=run.groups.dp)
    n = int(n) // (G // tc.dp)
    if tc.loss_normalization == "microbatch":
        return [(G, tc.dp * tc.microbatches * v) for v in valid], n
    return [(G, n)] * len(valid), n


def prove_machine(env, cfg, tc, groups, batch, lesson):
    """The machine as the main job runs it (build, then train_step: the executor, buckets, every speed
    flag on; clipping off) on the lesson's weights, batch and groups: the largest relative difference over
    every rank of its loss, gradients and weights after the step from the lesson's (0.0 today)."""
    (idx, targets, full), (loss, grads, weights) = batch, lesson
    mtc = TrainConfig(tp=tc.tp, pp=tc.pp, dp=tc.dp, batch_size=idx.shape[0], microbatches=CHECK_M,
                      seq_len=idx.shape[1], dtype="float64", lr=CHECK_LR, weight_decay=0.1, grad_clip=math.inf,
                      bucket_numel=500, fused_kernels=False, cuda_graphs=False, eval_every=0, timeout_s=tc.timeout_s)
    run = build(env, cfg, mtc, groups)
    for c in run.chunks:  # full: the lesson's weights, of this stage's keys at least (the tests pass each step's)
        c.load_full_state_dict(full)
    got, zero_grad = {}, run.ddp.zero_grad

    def read_grads():  # train_step's last call: the gradients are read just before they are cleared
        got.update({n: g.clone() for c in run.chunks for n, g in c.full_grads().items()})
        zero_grad()

    run.ddp.zero_grad = read_grads
    m_loss = train_step(run, *data_parallel.shard_batch(idx, targets, tc.dp, dist.get_rank(groups.dp)), CHECK_LR)[0]
    run.ddp.zero_grad = zero_grad
    diffs = [max_rel_diff(g, grads[n]) for n, g in got.items()]
    diffs += [max_rel_diff(w, weights[n]) for c in run.chunks for n, w in c.full_state_dict().items()]
    if loss is not None:
        diffs.append(max_rel_diff(torch.tensor(m_loss, dtype=loss.dtype, device=loss.device), loss))
    worst = torch.tensor(max(diffs), dtype=torch.float64, device=env.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


# ----------------------------------------------------------------------------------------------
# Read second: training: the loop


def train(env, cfg, tc, quiet=False, schedule_of=None, check=None):
    """Train on this rank, as nanoGPT's loop: a batch, a step, a log line, an eval, a save (the watch, faults,
    skipped steps, the trace, saves: plumbing's Operations). schedule_of(tc): the PipelineSchedule (06's, 07's);
    check (05's demo) runs before anything trains, False stopping the run. Returns losses, norms, evals, figures."""
    say = printer(env, quiet)  # the refusals, every rank's agreement, then check: before anything is built
    train_tokens, eval_tokens, path, start = before_training(env, cfg, tc, say, check)
    pipe = (schedule_of or interleaved_schedule)(tc)
    run = build(env, cfg, tc, new_groups(env, pipe.grid(env.world_size, tc.tp, tc.dp), tc.timeout_s), pipe)
    flops = report.summary(run, len(train_tokens), len(eval_tokens), say)  # FLOPs per iteration: eq. 3
    resume(run, path, say)  # --resume: the newest complete checkpoint, in any layout
    progress = report.Progress(env, tc, flops, start, run.dtype, quiet, append=path is not None)
    ops, dp_rank, t_start = Operations(run, progress, start), pipe.replica(run.groups), time.perf_counter()
    losses, norms, evals, res = [], [], [], None
    for step in progress:
        lr = lr_at(step, tc)
        with ops.step(step):  # the watch's record, a rehearsed fault, the traced step
            loss, norm, got = train_step(run, *replica_batch(train_tokens, step, tc, dp_rank), lr)
        if got is None:  # every target of the batch masked: said, and not counted as a skipped step
            progress.note(f"step {step}: no target of the global batch is counted (--loss-mask): nothing updated")
        res = got or res
        record = ops.record(dict(step=step, loss=loss, lr=lr, grad_norm=norm))  # too many skipped stop it
        losses.append(loss)
        norms.append(norm)
        if tc.eval_every and ((step + 1) % tc.eval_every == 0 or step == tc.steps - 1):
            ops.phase("eval")
            record["eval_loss"] = evaluate(run, eval_tokens)
            evals.append((step, record["eval_loss"]))
        ops.end(step, record)  # the log line, then a checkpoint or a snapshot when one is due
    busy = ops.finish(say)
    run.opt.wait_gather()  # the last step's: the report and the caller read the weights
    out = dict(losses=losses, norms=norms, evals=evals, start=start, skipped=ops.skipped, busy_ms=busy)
    if res:  # the last step's pipeline figures
        out.update(bytes_per_message=res.bytes_sent / max(res.messages, 1), peak_activation_bytes=res.peak_activation_bytes)
    report.report(run, out, time.perf_counter() - t_start, say, forward_only)
    return out


# ----------------------------------------------------------------------------------------------
# After the concept: activation recomputation (Korthikanti Section 5; --recompute), rerun in backward


def recompute_layers(chunk, mode):
    """mode "full": every block's forward recomputed in backward from its input, the chunk's tracked dropout
    stream replayed too (checkpoint restores only the default one). "selective": only the attention core
    (QK^T, softmax, its dropout, the product with V), whose 5as^2b/t bytes per layer grow with s^2, from q,
    k and v; its dropout's stream is forked in around the checkpoint, which restores it. "none": nothing."""
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
# After the concept: what build() and train() read: Run, PipelineSchedule (a later file's seam), helpers


@dataclass
class Run:
    """What one rank trains with, made once by build()."""
    env: object  # plumbing.launch.RankEnv: rank, world size, device
    cfg: object  # 01's GPTConfig
    tc: object  # TrainConfig
    groups: Groups
    chunks: list  # this rank's model chunks, chunk c being virtual stage pipe.stage(pp_rank, c)
    schedule: list  # this rank's actions: 1F1B, or interleaved 1F1B when v > 1 (pipe.lists[pp_rank])
    pipe: object  # the PipelineSchedule it runs
    act_shape: tuple  # a stage's output: (b, T, C), T/tp with sequence parallelism
    wire: object  # ScatterGather, or None: boundary tensors travel whole
    ddp: object  # 04's BucketedDDP (PipelineDDP) over the chunks' parameters
    opt: object  # 04's FlatAdamW (or OverlappedGather)
    dtype: torch.dtype
    ops: object  # kernels.FusedOps, or None: 01's layers as written
    forward_backward: object  # forward_backward below, or kernels.graphs' CUDA-graph replay of it


@dataclass
class PipelineSchedule(interleaved.InterleavedSchedule):
    """What the trainer runs: 02's Schedule (03's, whose steady pairs run as one), named for the summary. A
    later chapter's schedule is a subclass passed to train() as schedule_of(tc), and may override grid (the
    groups it needs), prepare (what it does to the chunks), replica and forward_only (the eval's lists)."""
    name: str = "1F1B"  # for the summary: "1F1B", "interleaved 1F1B, v=2", ...
    bubble: str = "(pp-1)/(v m)"  # the formula of the summary's simulated bubble (t_f = 1, t_b = 2)
    times: dict = field(default_factory=dict)  # the summary's times of kinds other than F and B

    def grid(self, world, tp, dp):
        """rank_grid for this schedule. With the last stage on the first stage's rank, both copies of
        the tied embedding are on one rank, summed there (02's sync_tied_embeddings): no group."""
        grid = rank_grid(world, tp, dp, self.pp)
        grid["embed"] = grid["embed"] if self.where[self.S - 1][0] else []
        return grid

    def prepare(self, chunks, groups=None, full=None):
        """Called by build() once this rank's chunks hold their weights and optimizations."""

    def replica(self, groups):  # which share of the global batch this rank trains on
        return dist.get_rank(groups.dp)

    def forward_only(self):
        """The eval's schedule: every rank's forwards, in order."""
        return replace(self, lists=[[pipeline.Action(a.kind, a.mb, a.chunk) for a in acts
                                     if self.kinds[a.kind].flow == "act"] for acts in self.lists])


def interleaved_schedule(tc):
    """1F1B (02), or interleaved 1F1B (03) when v > 1."""
    v = tc.virtual_stages
    return PipelineSchedule([interleaved.interleaved(tc.pp, tc.microbatches, r, v) for r in range(tc.pp)],
                            name="interleaved 1F1B, v=" + str(v) if v > 1 else "1F1B")


def lr_at(step, tc):
    """Linear warmup, then cosine decay to min_lr at the last step."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / (tc.warmup_steps + 1)
    ratio = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
    return tc.min_lr + 0.5 * (1 + math.cos(math.pi * min(ratio, 1.0))) * (tc.lr - tc.min_lr)


def no_decay(params):
    """Biases and LayerNorm weights (the 1-D parameters) take no weight decay."""
    return [p for p in params if p.dim() < 2]


def shared_loss(loss, run):
    """The batch's loss on every rank: each last-stage rank's share (its losses times num / den), one tp rank
    each, summed over everyone, over G: the buckets average over G, so each share was G times its part."""
    t = torch.zeros((), dtype=torch.float64, device=run.env.device)
    if loss is not None and dist.get_rank(run.groups.tp) == 0:
        t += loss.double()  # one rank per replica contributes: one all-reduce over everyone
    dist.all_reduce(t)
    return float(t) / run.ddp.dp


def finite_step(loss, norm):
    """Whether a step updates the weights: its loss and gradient norm are both finite."""
    return math.isfinite(loss) and math.isfinite(norm)


VOCAB_DIVISIBLE_BY = 128  # Megatron's: V_pad a multiple of it times tp, the output GEMM aligned (50257 -> 50304 at tp 1)


# ----------------------------------------------------------------------------------------------
# After the concept: the flags (TrainConfig: plumbing/flags.py) and the command line (plumbing/command.py)


def parser():
    """Every flag of the trainer: its config groups, the actions, sampling, the planner's (plumbing/command.py)."""
    return command.parser(__doc__, GROUPS, MODEL_DEFAULTS)


def main(parser=parser, config=TrainConfig, schedule_of=None):
    """The trainer's command line (plumbing/command.py), which 06-09 run with their flags and schedules;
    05's own run checks the lesson and the machine first (demo), a later chapter's --train trains at once."""
    own = schedule_of is None and config is TrainConfig
    return command.main(parser(), config, train, schedule_of or interleaved_schedule, rank_grid, demo if own else None)


if __name__ == "__main__":
    run_main(main)
