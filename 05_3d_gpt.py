"""05 - The 3D-parallel GPT trainer: PTD-P (Narayanan et al. 2021, Sections 3 and 4).

What this file adds on top of 01-04: their composition into one trainer. Tensor parallelism (01,
optionally with sequence parallelism) runs inside each pipeline stage; the stages run 1F1B (02) or
interleaved 1F1B (03); data parallelism or ZeRO-1 (04) runs across pipeline replicas. New here:
  - the scatter/gather optimisation (Section 4.1): between stages each tp rank sends only 1/tp of
    the boundary tensor and the receiving stage all-gathers it over tp;
  - the global gradient norm for clipping across tp, pp and dp, every element counted once;
  - training: AdamW with weight-decay groups, LR warmup then cosine decay, clipping, activation
    recomputation, a held-out eval loss, a built-in corpus or --data, a progress bar, metrics;
  - the planner (--plan): what a model costs on a cluster (eqs. 2-4), allocating nothing;
  - checkpoints: sharded, atomic, bit-identical on resume, loadable under any other layout
    (--save, --resume), and GPT-2 weights in and out (--init-from, --export-hf);
  - operator fusion and CUDA graphs (Section 4.2; kernels/), on by default on a GPU: the fused
    kernels (--fused-kernels, --kernel-path auto|cuda|reference) and graphs of each stage's
    forward and backward, or of the whole step at tp = pp = dp = 1 (--cuda-graphs).

Run it (it is the project's main job):
    python 05_3d_gpt.py                                   # tp=2 x pp=2 x dp=2: 8 CPU ranks
    python 05_3d_gpt.py --print-layout --tp 8 --pp 4 --dp 4
    python 05_3d_gpt.py --plan 1T --gpus 3072             # the paper's 1T model on 3072 A100s
    python 05_3d_gpt.py --steps 20 --save ckpt && python 05_3d_gpt.py --steps 40 --resume ckpt --tp 1 --pp 4
    python 05_3d_gpt.py --resume ckpt --sample "alice has 3 apples." --top-k 40
    torchrun --standalone --nproc_per_node 8 05_3d_gpt.py --tp 8 --pp 1 --dp 1 --dtype bfloat16
    torchrun --standalone --nproc_per_node 1 05_3d_gpt.py --tp 1 --pp 1 --dp 1   # kernels + a whole-step graph
docs/RUNBOOK.md has multi-node torchrun and SLURM recipes.

The run prints a start-up summary (model, data, layout, device, training, files, memory, FLOPs per
iteration by eq. 3, the bubble), a progress bar with loss and tokens/s (and MFU on GPU), a line per
save, a periodic eval loss, and at the end a chart of the loss and, on the built-in corpus, how
many single-digit sums greedy decoding gets right. --metrics FILE writes one JSON line per step;
--trace FILE one step's timeline on every rank as a Chrome trace.
"""
import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import math
import os
import re
import time
from collections import namedtuple
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import kernels  # a package beside the numbered files
from kernels import graphs as cuda_graphs
from plumbing import cli
from plumbing import sample as sampling
from plumbing.charts import ascii_chart
from plumbing.data import global_batch, held_out, load_tokens, replica_batch, split_tokens, tokenizer_of
from plumbing.data import sum_probe as corpus_sum_probe
from plumbing.launch import gather_numbers, printer, run_main
from plumbing.sample import tokenizer_kind
from plumbing.trace import StepTrace

tp = importlib.import_module("01_tensor_parallel")
pipe = importlib.import_module("02_pipeline_1f1b")
inter = importlib.import_module("03_interleaved")
ddp_mod = importlib.import_module("04_data_parallel")


@dataclass
class TrainConfig:
    tp: int = 2  # tensor-parallel size (ranks inside a stage)
    pp: int = 2  # pipeline stages
    dp: int = 2  # data-parallel replicas
    virtual_stages: int = 1  # v: model chunks per pipeline rank (interleaved 1F1B when > 1)
    batch_size: int = 32  # global batch B, in sequences
    microbatches: int = 4  # m per replica; micro-batch size b = B / (dp m)
    seq_len: int = 64  # T, tokens per sequence
    steps: int = 200  # optimizer steps, counted from 0 (a resumed run stops at the same total)
    lr: float = 3e-3  # peak learning rate, reached after the warmup
    min_lr: float = 3e-4  # learning rate at the last step, after the cosine decay
    warmup_steps: int = 20  # linear warmup from lr/(warmup+1) to lr
    weight_decay: float = 0.1  # AdamW decay of the 2-D weights (not biases or LayerNorms)
    grad_clip: float = 1.0  # clip the global gradient norm to this
    zero1: bool = False  # ZeRO-1 distributed optimizer instead of plain data parallelism
    sequence_parallel: bool = False  # shard LayerNorm and dropout activations along T (Korthikanti)
    scatter_gather: bool = True  # each tp rank sends 1/tp of a stage's output (Section 4.1); tp > 1 without sp
    recompute: bool = False  # full activation recomputation, per layer
    dtype: Literal["auto", "float32", "float64", "bfloat16"] = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    bucket_numel: int = 2_000_000  # gradient bucket, in elements
    eval_every: int = 50  # steps between eval losses on the held-out split (0: never)
    eval_batches: int = 2  # held-out batches per eval loss
    data: str = ""  # a text file (its bytes), or a uint16 .bin (scripts/prepare_data.py); none: the built-in corpus
    trace: str = ""  # write one step's per-rank timeline here (Chrome trace JSON)
    metrics: str = ""  # write one JSON line per step to this file (scripts/plot_metrics.py plots it)
    seed: int = 1337  # weights, data order, dropout and sampling
    timeout_s: float = 120.0  # every collective's timeout
    save: str = ""  # write checkpoints under this directory
    save_every: int = 0  # steps between checkpoints (0: only at the end); needs --save
    keep: int = 2  # checkpoints kept, the newest
    resume: str = ""  # continue from the newest complete checkpoint here (any layout)
    init_from: str = ""  # start from GPT-2 weights: a Hugging Face GPT-2 directory, or a .pt state dict
    fused_kernels: bool | None = None  # kernels/ fused ops; unset: on on GPU, off on CPU
    kernel_path: Literal["auto", "cuda", "reference"] = "auto"  # fused kernels: CUDA where they apply, forced, or the PyTorch references
    flash_attention: bool = True  # with fused kernels: SDPA attention, or (off) matmul + fused causal softmax
    cuda_graphs: bool | None = None  # unset: on on GPU where the layout allows (tp = 1, no recompute)
    graph_scope: Literal["auto", "stage", "step"] = "auto"  # auto: the whole step at tp = pp = dp = 1, else per stage


MODEL_DEFAULTS = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)


# ----------------------------------------------------------------------------------------------
# Checks: everything that can be wrong with the config, before any process group exists.


def check_config(cfg, tc, world):
    for name in ("tp", "pp", "dp", "virtual_stages", "batch_size", "microbatches", "seq_len",
                 "steps", "bucket_numel", "eval_batches"):
        if getattr(tc, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(tc, name)}")
    if not (tc.lr > 0 and tc.min_lr >= 0 and tc.grad_clip > 0 and tc.weight_decay >= 0):
        raise ValueError(f"need lr > 0, min_lr >= 0, grad_clip > 0, weight_decay >= 0; got "
                         f"{tc.lr}, {tc.min_lr}, {tc.grad_clip}, {tc.weight_decay}")
    ddp_mod.rank_grid(world, tc.tp, tc.dp, tc.pp)  # world == tp * dp * pp
    pipe.split_layers(cfg.n_layer, tc.pp * tc.virtual_stages)
    if tc.batch_size % (tc.dp * tc.microbatches):
        raise ValueError(f"the global batch of {tc.batch_size} sequences is not divisible by "
                         f"dp x m = {tc.dp} x {tc.microbatches}")
    inter.check_interleaving(tc.pp, tc.microbatches, tc.virtual_stages)
    if cfg.n_embd % cfg.n_head or cfg.n_head % tc.tp:
        raise ValueError(f"need n_embd={cfg.n_embd} divisible by n_head={cfg.n_head}, and n_head "
                         f"divisible by tp={tc.tp}")
    if tc.seq_len > cfg.block_size:
        raise ValueError(f"seq_len={tc.seq_len} exceeds block_size={cfg.block_size}")
    if tc.sequence_parallel and tc.seq_len % tc.tp:
        raise ValueError(f"sequence parallelism needs seq_len={tc.seq_len} divisible by tp={tc.tp}")
    if tc.save_every < 0 or tc.keep < 1 or (tc.save_every and not tc.save):
        raise ValueError(f"need --save-every >= 0 (with --save) and --keep >= 1; got "
                         f"save_every={tc.save_every}, keep={tc.keep}, save={tc.save!r}")
    if tc.dtype not in ("auto", "float32", "float64", "bfloat16"):
        raise ValueError(f"--dtype must be auto, float32, float64 or bfloat16, got {tc.dtype!r}")
    if tc.kernel_path not in kernels.build.MODES:
        raise ValueError(f"--kernel-path must be one of {kernels.build.MODES}, got {tc.kernel_path!r}")
    if tc.graph_scope not in ("auto", "stage", "step"):
        raise ValueError(f"--graph-scope must be auto, stage or step, got {tc.graph_scope!r}")
    if tc.graph_scope == "step" and tc.tp * tc.pp * tc.dp > 1:
        raise ValueError(f"--graph-scope step captures one rank's whole step: it needs tp = pp = dp = 1, "
                         f"got tp={tc.tp}, pp={tc.pp}, dp={tc.dp}")
    if tc.cuda_graphs and (tc.tp > 1 or tc.recompute):
        raise ValueError(f"--cuda-graphs captures whole stages, which here needs tp=1 (a stage with tp > 1 "
                         f"holds all-reduces) and no --recompute; got tp={tc.tp}, recompute={tc.recompute}")


def check_device(tc, device):
    """What the device decides: CUDA graphs and forced kernels need a GPU (checked on every rank
    before the first collective)."""
    if tc.cuda_graphs and device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a GPU: CUDA graphs record GPU kernel launches, and this "
                         f"run is on {device.type}. Drop the flag, or run under torchrun on GPUs.")
    if tc.fused_kernels is not False and tc.kernel_path == "cuda" and device.type != "cuda":
        raise ValueError(f"--kernel-path cuda forces the CUDA kernels, and this run is on {device.type}; "
                         f"use --kernel-path reference (same math, PyTorch) or auto")


def acceleration(tc, device):
    """(fused kernels on?, CUDA graphs: None, "stage" or "step"), unset flags resolved: both on on
    a GPU, graphs where the layout allows them; the whole step is one graph at tp = pp = dp = 1."""
    gpu = device.type == "cuda"
    fused = gpu if tc.fused_kernels is None else tc.fused_kernels
    graphs = (gpu and tc.tp == 1 and not tc.recompute) if tc.cuda_graphs is None else tc.cuda_graphs
    if not graphs:
        return fused, None
    if tc.graph_scope != "auto":
        return fused, tc.graph_scope
    return fused, "step" if tc.tp == tc.pp == tc.dp == 1 else "stage"


def print_layout(tc):
    """The rank grid for tp x pp x dp, without starting anything (--print-layout)."""
    world = tc.tp * tc.pp * tc.dp
    grid = ddp_mod.rank_grid(world, tc.tp, tc.dp, tc.pp)
    coord = {}
    for kind in ("tp", "dp", "pp"):
        for g in grid[kind]:
            for i, r in enumerate(g):
                coord.setdefault(r, {})[kind] = i
    print(f"world={world}: tp={tc.tp} x dp={tc.dp} x pp={tc.pp}, Megatron's order (tp fastest, "
          f"then dp, then pp)")
    print("rank  tp dp pp")
    for r in range(world):
        print(f"{r:4d} {coord[r]['tp']:3d} {coord[r]['dp']:2d} {coord[r]['pp']:2d}")
    for kind in ("tp", "dp", "pp", "embed"):
        print(f"{kind} groups: {grid[kind]}")


# ----------------------------------------------------------------------------------------------
# Scatter/gather (Section 4.1). Without sequence parallelism both tp ranks of a stage hold the
# same boundary tensor, so sending it whole from each would move tp copies of it between nodes.


class ScatterGather(pipe.Wire):
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
        tp.all_gather_single(out, buf, group=self.tp_group)
        return out.view(self.full)


# ----------------------------------------------------------------------------------------------
# Activation recomputation: keep only each layer's input, rerun its forward during backward.


def recompute_layers(chunk):
    """Wrap every block of a chunk so that its forward is recomputed in backward. Dropout inside
    tp regions draws from the chunk's tracked stream, so that stream is replayed too (the default
    stream is restored by checkpoint itself)."""
    for block in chunk.transformer.h.values():
        block.forward = functools.partial(_recomputed, block.forward, chunk.rng)


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
    tied_copy = chunk.post_process and not chunk.pre_process and p is chunk.transformer.wte.weight
    return not tied_copy and (hasattr(p, "tp_dim") or dist.get_rank(tp_group) == 0)


def clip_gradients(opt, chunks, groups, max_norm, zero1):
    """Compute the global norm of every gradient, scale them by max_norm / norm if it is larger
    (as torch.nn.utils.clip_grad_norm_), and return the norm before clipping."""
    owner = {id(p): c for c in chunks for p in c.parameters()}
    dtype = torch.float64 if opt.pieces[0][3].dtype == torch.float64 else torch.float32
    sq = torch.zeros((), dtype=dtype, device=opt.pieces[0][3].device)
    for p, _, _, grad in opt.pieces:
        if counts_in_norm(p, owner[id(p)], groups["tp"]):
            sq += grad.to(dtype).pow(2).sum()
    kinds = ["tp", "pp"] + (["dp"] if zero1 else [])  # replicas hold the same full gradients
    for kind in kinds:
        dist.all_reduce(sq, group=groups[kind])
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for _, _, _, grad in opt.pieces:
        grad.mul_(coef.to(grad.dtype))
    return float(norm)


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
# The planner (--plan): what a model costs on a cluster, from closed forms only, allocating nothing.
# Parameters (eq. 2), FLOPs (eq. 3) and training time (eq. 4) are Narayanan et al. 2021's;
# activation memory is Korthikanti et al. 2022's Table 2 and Section 4.2.3. l layers, h hidden,
# a heads, V vocabulary, s sequence, B global batch, b micro-batch, t/p/d = tp/pp/dp, n GPUs.
# Mixed precision as in Megatron: bf16 weights, fp32 gradients and Adam state. GB = 1e9 bytes.

PAPER_VOCAB, PAPER_SEQ = 51200, 2048  # every row of Table 1
# tflops: the achieved teraFLOP/s per GPU, counted with eq. 3 (recomputation included).
PaperRow = namedtuple("PaperRow", "billions n_head n_embd n_layer tp pp n_gpus batch tflops")
ModelSpec = namedtuple("ModelSpec", "n_layer n_embd n_head vocab_size seq_len",
                       defaults=(PAPER_VOCAB, PAPER_SEQ))

# Narayanan et al. 2021, Table 1 (weak scaling on A100s).
PAPER_CONFIGS = {f"{r[0]}B": PaperRow(*r) for r in [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]}


@dataclass(frozen=True)
class Layout:
    """One way to run the model: the three sizes, the batch cut and the memory-saving options."""
    tp: int
    pp: int
    dp: int
    batch: int  # B, global, in sequences
    b: int = 1  # micro-batch size
    v: int = 1  # virtual stages per pipeline rank
    recompute: bool = True  # full activation recomputation, as in the paper's runs
    sequence_parallel: bool = False  # shard LayerNorm and dropout activations along T (Korthikanti)
    zero1: bool = False
    scatter_gather: bool = True  # Narayanan Section 4.1: pp messages split over the tp ranks

    @property
    def m(self):  # at least 1, so that a refused layout can still be described
        return max(1, self.batch // (self.b * self.dp))


@dataclass(frozen=True)
class Cluster:
    """The machine the throughput model assumes: Narayanan's A100 cluster (Section 5)."""
    peak_tflops: float = 312.0  # A100 bf16 dense tensor cores
    # Of peak, reached by the layers' GEMMs before bubble and communication: chosen so that the
    # paper's 1T layout comes out near its measured 163 TFLOP/s (small models land above theirs).
    efficiency: float = 0.6
    nvlink_gbs: float = 300.0  # per GPU per direction, inside a node (carries tp)
    ib_gbs: float = 25.0  # per GPU per direction, across nodes (carries pp and dp)
    gpu_mem_gb: float = 80.0  # 80e9 B: an "80 GB" A100 has 85.9e9, the rest is left as headroom
    gpus_per_node: int = 8


def model_spec(name_or_spec):
    """A ModelSpec from a ModelSpec, a GPTConfig (seq_len = block_size) or a Table 1 name."""
    c = name_or_spec
    if isinstance(c, ModelSpec):
        return c
    if hasattr(c, "block_size"):
        return ModelSpec(c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.block_size)
    row = paper_row(name_or_spec)
    return ModelSpec(row.n_layer, row.n_embd, row.n_head)


def paper_row(name):
    """The Table 1 row within 2% of name ("145.6B", "1T", "1008B"), or ValueError."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([bBtT])\s*", str(name))
    if match:
        billions = float(match[1]) * (1000 if match[2] in "tT" else 1)
        row = min(PAPER_CONFIGS.values(), key=lambda r: abs(r.billions - billions))
        if abs(row.billions - billions) <= 0.02 * row.billions:  # so "1T" finds 1008.0B
            return row
    raise ValueError(f"unknown model {name!r}: give one of {', '.join(PAPER_CONFIGS)} or 1T")


def params_eq2(m):
    """Narayanan eq. 2: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))."""
    l, h = m.n_layer, m.n_embd
    return 12 * l * h * h * (1 + 13 / (12 * h) + (m.vocab_size + m.seq_len) / (12 * l * h))


def params_exact(m):
    """Exactly 01's GPT-2 (V unpadded): eq. 2 expanded, plus the final LayerNorm's 2h."""
    l, h = m.n_layer, m.n_embd
    return 12 * l * h * h + 13 * l * h + (m.vocab_size + m.seq_len) * h + 2 * h


def flops_per_iteration(m, batch, recompute=True):
    """Narayanan eq. 3: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full recomputation."""
    l, h, s, V = m.n_layer, m.n_embd, m.seq_len, m.vocab_size
    # A layer's forward is 24 B s h^2 (1 + s/(6h)); backward is twice that and recomputation one
    # more forward (4x, 3x without); the logit layer (2 B s h V) is never recomputed: always 3x.
    # So without recomputation the last term is V/(12 l h), not the paper's V/(16 l h).
    k = 4 if recompute else 3
    return 24 * k * batch * s * l * h * h * (1 + s / (6 * h) + 6 * V / (24 * k * l * h))


def training_days(tokens, params, n_gpus, tflops, recompute=True):
    """Narayanan eq. 4: 8 T P / (n X) seconds (6 T P / (n X) without recomputation), in days."""
    return (8 if recompute else 6) * tokens * params / (n_gpus * tflops * 1e12) / 86400


def bubble_fraction(pp, m, v=1):
    """Narayanan Section 2.2: the pipeline bubble (pp-1)/(v m) of the ideal compute time."""
    return (pp - 1) / (v * m)


def params_per_gpu(m, L):
    """The fullest GPU's parameters: the first stage's l/pp layers plus the embeddings, over tp."""
    h = m.n_embd
    # The replicated LayerNorms and row-parallel biases (a few h per layer) are counted as split.
    # The last stage holds the tied output copy (V h) instead of the position table (s h) and ln_f.
    embed = (m.vocab_size + m.seq_len) * h + (2 * h if L.pp == 1 else 0)
    return (m.n_layer / L.pp * (12 * h * h + 13 * h) + embed) / L.tp


def activation_bytes_per_layer(m, L):
    """Korthikanti Table 2: one layer's stored activations for one microbatch on one tp rank."""
    s, b, h, a, t = m.seq_len, L.b, m.n_embd, m.n_head, L.tp
    if L.recompute:  # only the layer's bf16 input, replicated over tp unless sequence-parallel
        return 2 * s * b * h / (t if L.sequence_parallel else 1)
    if L.sequence_parallel:
        return s * b * h * (34 / t + 5 * a * s / (h * t))
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))  # LayerNorms, dropout masks replicated


def layers_in_flight(m, L):
    """Layers' worth of activations the first stage holds at its peak (Korthikanti 4.2.3)."""
    # 1F1B: pp microbatches of l/pp layers = l. Megatron's interleaved schedule warms up
    # (v+1) pp - 1 chunks of l/(pp v) layers = l (1 + (pp-1)/(pp v)). Fewer if m is small.
    chunks = min(L.m * L.v, L.pp if L.v == 1 else (L.v + 1) * L.pp - 1)
    return chunks * m.n_layer / (L.pp * L.v)


def memory_per_gpu(m, L):
    """Bytes on the fullest GPU: bf16 weights, fp32 gradients, fp32 Adam state, activations."""
    n = params_per_gpu(m, L)
    # Embedding and output-layer activations are left out (Korthikanti 4.3: small for pp > 1).
    mem = dict(params=n, weights=2 * n, gradients=4 * n,
               optimizer=12 * n / (L.dp if L.zero1 else 1),  # fp32 master + 2 Adam moments
               activations=activation_bytes_per_layer(m, L) * layers_in_flight(m, L))
    mem["total"] = mem["weights"] + mem["gradients"] + mem["optimizer"] + mem["activations"]
    return mem


def comm_bytes_per_gpu(m, L):
    """Bytes one GPU sends per iteration for tp all-reduce, pp point-to-point and dp reduction."""
    t, d, act = L.tp, L.dp, 2 * L.b * m.seq_len * m.n_embd  # one microbatch's bf16 hidden state
    # 2 forward + 2 backward all-reduces per layer per microbatch, +2 when the forward is rerun; a
    # ring moves 2 (t-1)/t of the data per GPU, as do sequence parallelism's all-gather and
    # reduce-scatter that replace each all-reduce (Korthikanti 4.2.2).
    tp = (6 if L.recompute else 4) * L.m * m.n_layer / L.pp * act * 2 * (t - 1) / t
    # An activation forward and a gradient backward per microbatch, at each of a rank's v chunks.
    split = t if (L.scatter_gather or L.sequence_parallel) else 1
    pp = 0.0 if L.pp == 1 else 2 * L.m * L.v * act / split
    n = params_per_gpu(m, L)
    # fp32 gradients are all-reduced; ZeRO-1 reduce-scatters them and all-gathers the updated bf16
    # weights (as Megatron's distributed optimizer does), so it sends 6 (d-1)/d B/param, not 8.
    dp = (d - 1) / d * n * (4 + 2 if L.zero1 else 2 * 4)
    return dict(tp=tp, pp=pp, dp=dp)


def estimate_iteration(m, L, n_gpus, c=Cluster()):
    """Seconds per iteration, by part, and TFLOP/s per GPU under THROUGHPUT_MODEL."""
    flops, comm = flops_per_iteration(m, L.batch, L.recompute), comm_bytes_per_gpu(m, L)
    t = dict(compute=flops / (n_gpus * c.peak_tflops * 1e12 * c.efficiency))
    t["bubble"] = t["compute"] * bubble_fraction(L.pp, L.m, L.v)
    t["tp"] = comm["tp"] / (c.nvlink_gbs * 1e9)  # on the critical path: nothing to hide it behind
    t["pp"] = comm["pp"] / (c.ib_gbs * 1e9)
    # Gradients are final only after the last microbatch's backward, so the dp reduction can hide
    # behind that one backward (3/4 of a microbatch's work with recomputation, 2/3 without).
    hidden = t["compute"] / L.m * (0.75 if L.recompute else 2 / 3)
    t["dp"] = max(0.0, comm["dp"] / (c.ib_gbs * 1e9) - hidden)
    t["total"] = sum(t.values())
    t["tflops"] = flops / (n_gpus * t["total"]) / 1e12
    return t


THROUGHPUT_MODEL = ("time = F/(n peak eff) (1 + bubble) + tp bytes/NVLink + pp bytes/IB"
                    " + dp bytes/IB less the last microbatch's backward")


def layout_problems(m, L, n_gpus, c=Cluster()):
    """Why layout L cannot run model m on n_gpus: a list of reasons, empty if it can."""
    checks = [(L.tp * L.pp * L.dp == n_gpus, f"tp*pp*dp != {n_gpus} GPUs"),
              (L.tp <= c.gpus_per_node, f"tp={L.tp} spans nodes ({c.gpus_per_node} GPUs each)"),
              (m.n_head % L.tp == 0, f"{m.n_head} heads not divisible by tp={L.tp}"),
              (m.n_layer % (L.pp * L.v) == 0, f"{m.n_layer} layers not divisible by pp*v"),
              (L.batch % (L.dp * L.b) == 0, f"B={L.batch} not divisible by dp*b={L.dp * L.b}"),
              (L.v == 1 or (L.pp > 1 and L.m % L.pp == 0), "interleaving needs pp > 1, pp | m"),
              (not L.sequence_parallel or m.seq_len % L.tp == 0, "sequence parallelism: tp | s")]
    bad = [why for ok, why in checks if not ok]
    total = memory_per_gpu(m, L)["total"] if not bad else 0
    if total > c.gpu_mem_gb * 1e9:
        bad.append(f"needs {total / 1e9:.1f} GB of {c.gpu_mem_gb:g} GB")
    return bad


def rank_layouts(m, n_gpus, batch, c=Cluster(), **options):
    """Every runnable (tp, pp, dp) for n_gpus, best estimated throughput first: [(Layout, est)]."""
    divisors = [k for k in range(1, n_gpus + 1) if n_gpus % k == 0]
    layouts = [Layout(tp, pp, n_gpus // (tp * pp), batch, **options)
               for tp in divisors for pp in divisors if (n_gpus // tp) % pp == 0]
    ranked = [(L, estimate_iteration(m, L, n_gpus, c)) for L in layouts
              if not layout_problems(m, L, n_gpus, c)]
    return sorted(ranked, key=lambda r: -r[1]["tflops"])


def _si(x, unit):
    """1.23e19 FLOP -> '12.3 EFLOP'."""
    prefix, scale = next((p, k) for p, k in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9),
                                             ("M", 1e6), ("", 1)) if x >= k or k == 1)
    return f"{x / scale:.3g} {prefix}{unit}"


def plan_report(name_or_spec, n_gpus, layout=None, batch=None, tokens=300e9, tflops=None,
                c=Cluster(), top=5, **options):
    """The text --plan prints. layout: (tp, pp, dp), or None for the best-ranked; options: Layout's
    b, v, recompute, sequence_parallel, zero1, scatter_gather; batch defaults to Table 1's."""
    m = model_spec(name_or_spec)
    row = paper_row(name_or_spec) if isinstance(name_or_spec, str) else None
    batch = batch or (row and row.batch)
    if not batch:
        raise ValueError("the global batch size B is needed for a model not in Table 1")
    ranked = rank_layouts(m, n_gpus, batch, c, **options)
    if layout is None and not ranked:
        return f"no layout of {n_gpus} GPUs can run {m} with B={batch}"
    L = Layout(*layout, batch, **options) if layout else ranked[0][0]
    P, mem, comm = params_eq2(m), memory_per_gpu(m, L), comm_bytes_per_gpu(m, L)
    est, problems = estimate_iteration(m, L, n_gpus, c), layout_problems(m, L, n_gpus, c)
    gb = lambda x: f"{x / 1e9:9.1f} GB"  # noqa: E731
    out = [f"model: {f'{row.billions}B of Table 1, ' if row else ''}l={m.n_layer} h={m.n_embd} "
           f"a={m.n_head} V={m.vocab_size} s={m.seq_len}; {n_gpus} GPUs of {c.gpu_mem_gb:g} GB, "
           f"{c.gpus_per_node} per node",
           f"parameters: {P / 1e9:,.1f} B (eq. 2); 01's GPT-2 has exactly {params_exact(m):,}",
           f"layout ({'given' if layout else 'best-ranked'}): tp={L.tp} pp={L.pp} dp={L.dp} "
           f"v={L.v} b={L.b} B={batch} -> m={L.m} microbatches per pipeline",
           f"  recompute={L.recompute} sequence_parallel={L.sequence_parallel} zero1={L.zero1} "
           f"scatter_gather={L.scatter_gather}"]
    out += [f"  CANNOT RUN: {'; '.join(problems)}"] if problems else []
    out += ["memory on the fullest GPU (the first stage):",
            f"  parameters  {mem['params'] / 1e9:9.2f} B    l/pp layers + embeddings, / tp",
            f"  weights     {gb(mem['weights'])}   bf16, 2 B/param",
            f"  gradients   {gb(mem['gradients'])}   fp32, 4 B/param",
            f"  optimizer   {gb(mem['optimizer'])}   fp32 master + 2 Adam moments, 12 B/param"
            + (" / dp (ZeRO-1)" if L.zero1 else ""),
            f"  activations {gb(mem['activations'])}   Korthikanti Table 2: "
            f"{activation_bytes_per_layer(m, L) / 1e6:,.1f} MB/layer"
            f" x {layers_in_flight(m, L):g} held",
            f"  total       {gb(mem['total'])}   of {c.gpu_mem_gb:g} GB",
            f"FLOPs per iteration (eq. 3): "
            f"{_si(flops_per_iteration(m, batch, L.recompute), 'FLOP')}",
            f"pipeline bubble (pp-1)/(v m) = {L.pp - 1}/{L.v * L.m} = "
            f"{bubble_fraction(L.pp, L.m, L.v):.1%}",
            "communication sent per GPU per iteration:",
            f"  tp all-reduce {gb(comm['tp'])}   "
            f"{6 if L.recompute else 4} per layer and microbatch",
            f"  pp p2p        {gb(comm['pp'])}   act + grad per microbatch per chunk"
            + (" / tp" if L.scatter_gather or L.sequence_parallel else ""),
            f"  dp gradients  {gb(comm['dp'])}   " + ("reduce-scatter fp32 + all-gather bf16"
                                                    if L.zero1 else "all-reduce fp32"),
            f"estimated iteration: {est['total']:.2f} s = compute {est['compute']:.2f} + bubble "
            f"{est['bubble']:.2f} + tp {est['tp']:.2f} + pp {est['pp']:.2f} + exposed dp "
            f"{est['dp']:.2f} -> {est['tflops']:.0f} TFLOP/s per GPU"]
    rates = [("estimated", est["tflops"]), ("Table 1's", row and row.tflops), ("given", tflops)]
    out.append(f"training time for {tokens / 1e9:g}B tokens (eq. 4): " + ", ".join(
        f"{training_days(tokens, P, n_gpus, x, L.recompute):.1f} days at {how} {x:.0f} TFLOP/s"
        for how, x in rates if x))
    out += [f"best {min(top, len(ranked))} of {len(ranked)} runnable layouts (tp <= "
            f"{c.gpus_per_node}, fitting in memory), by estimated throughput:",
            f"  {THROUGHPUT_MODEL};",
            f"  eff={c.efficiency:g} of {c.peak_tflops:g} TFLOP/s, NVLink {c.nvlink_gbs:g} GB/s "
            f"and InfiniBand {c.ib_gbs:g} GB/s per GPU",
            "     tp    pp    dp      m  bubble       memory   iteration  TFLOP/s"]
    out += [f"  {r.tp:5d} {r.pp:5d} {r.dp:5d} {r.m:6d} {bubble_fraction(r.pp, r.m, r.v):7.1%} "
            f"{gb(memory_per_gpu(m, r)['total'])} {e['total']:9.2f} s {e['tflops']:8.0f}"
            for r, e in ranked[:top]]
    return "\n".join(out)


def add_plan_args(parser):
    """--plan NAME|custom, --gpus N and --plan-* options; model flags the parser has (05's
    --n-layer etc. from GPTConfig) are reused for `custom`, not added twice."""
    g = parser.add_argument_group("planner: --plan prints estimates and exits, allocating nothing")
    g.add_argument("--plan", metavar="NAME", help=f"a model of Table 1 ({', '.join(PAPER_CONFIGS)}, "
                   f"or 1T), or custom (the model flags)")
    g.add_argument("--gpus", type=int, default=None, help="n GPUs (default: Table 1's for the model)")
    for flag in ("--n-layer", "--n-embd", "--n-head", "--vocab-size", "--seq-len"):
        if flag not in parser._option_string_actions:
            g.add_argument(flag, type=int, default=None, help="model size for --plan custom")
    g.add_argument("--plan-layout", metavar="TP,PP,DP", help="estimate this layout (default: the best-ranked)")
    g.add_argument("--plan-batch", type=int, help="global batch B in sequences (default: Table 1's)")
    g.add_argument("--plan-micro-batch", type=int, default=1, help="micro-batch size b")
    g.add_argument("--plan-v", type=int, default=1, help="virtual stages per pipeline rank")
    for name, what in (("recompute", "full activation recomputation"),
                       ("sequence-parallel", "sequence parallelism"),
                       ("zero1", "the ZeRO-1 distributed optimizer"),
                       ("scatter-gather", "scatter/gather of pipeline messages over tp")):
        g.add_argument(f"--plan-{name}", default=name in ("recompute", "scatter-gather"),
                       action=argparse.BooleanOptionalAction, help=f"assume {what}")
    g.add_argument("--plan-tokens", type=float, default=300e9, help="training tokens T for eq. 4")
    g.add_argument("--plan-tflops", type=float, help="also give the training time at this many "
                   "TFLOP/s per GPU")
    g.add_argument("--plan-gpu-mem", type=float, default=80.0, help="GB of memory per GPU")


def plan_from_args(args):
    """plan_report for the options of add_plan_args (custom: seq_len, else block_size)."""
    spec = args.plan
    if spec == "custom":
        spec = ModelSpec(args.n_layer, args.n_embd, args.n_head, args.vocab_size,
                         getattr(args, "seq_len", None) or args.block_size)
    n = args.gpus or (paper_row(spec).n_gpus if isinstance(spec, str) else None)
    if not n:
        raise ValueError("--plan custom needs --gpus")
    layout = tuple(int(k) for k in args.plan_layout.split(",")) if args.plan_layout else None
    return plan_report(spec, n, layout, args.plan_batch, args.plan_tokens, args.plan_tflops,
                       Cluster(gpu_mem_gb=args.plan_gpu_mem), b=args.plan_micro_batch,
                       v=args.plan_v, recompute=args.plan_recompute, zero1=args.plan_zero1,
                       sequence_parallel=args.plan_sequence_parallel,
                       scatter_gather=args.plan_scatter_gather)


# ----------------------------------------------------------------------------------------------
# Checkpoints: every rank writes its own shard, then one rename makes the step visible. Loading
# rebuilds each full tensor from the shards (01's join_shards) and splits it again for the
# current layout (01's split_full), so a checkpoint loads under any (tp, pp, dp, v, ZeRO-1).

CKPT = re.compile(r"step_(\d+)$")
KEPT_FIELDS = ("batch_size", "seq_len")  # a resumed run must cut the data exactly as before


def save_checkpoint(run, step, root, keep, say=print):
    """Write step `step` (the number of steps done) under root/step_<step>; keep the newest `keep`.
    Rank 0 says where, how many bytes and how long it took."""
    t0 = time.perf_counter()
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    owner = {id(p): (c, n) for c, chunk in enumerate(run.chunks) for n, p in chunk.named_parameters()}
    # Replicas hold the same weights and, without ZeRO-1, the same optimizer state: one copy does.
    first_replica = dist.get_rank(run.groups["dp"]) == 0
    pieces = []
    for p, piece, master, _ in run.opt.pieces if run.tc.zero1 or first_replica else []:
        c, name = owner[id(p)]
        start = piece.storage_offset() - run.ddp.offsets[p]
        state = {k: v.cpu() for k, v in run.opt.optimizer.state.get(master, {}).items()}
        if master is not piece:
            state["master"] = master.detach().cpu()
        pieces.append((c, name, start, start + piece.numel(), state))
    shard = dict(
        coords={k: dist.get_rank(run.groups[k]) for k in ("tp", "dp", "pp")},
        chunks=[{n: p.detach().cpu() for n, p in c.named_parameters()} for c in run.chunks] if first_replica else [],
        pieces=pieces,
        rng=dict(cpu=torch.get_rng_state(), tracked=[c.rng.state.cpu() for c in run.chunks],
                 cuda=torch.cuda.get_rng_state(run.env.device) if run.env.device.type == "cuda" else None))
    torch.save(shard, os.path.join(tmp, f"rank_{run.env.rank:05d}.pt"))
    dist.barrier()  # every shard is on disk before the step becomes visible
    if run.env.rank == 0:
        tc = run.tc
        manifest = dict(step=step, model=dataclasses.asdict(run.cfg), world=run.env.world_size,
                        layout=dict(tp=tc.tp, pp=tc.pp, dp=tc.dp, v=tc.virtual_stages, zero1=tc.zero1),
                        train={k: getattr(tc, k) for k in KEPT_FIELDS}, dtype=str(run.dtype),
                        tokenizer=tokenizer_of(tc.data))
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, final)  # atomic: a crash before this line leaves the previous step intact
        size = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))
        say(f"saved step {step} to {final}: {size / 1e6:,.2f} MB in {time.perf_counter() - t0:.2f} s")
        for old in sorted(d for d in os.listdir(root) if CKPT.match(d))[:-keep]:
            for name in os.listdir(os.path.join(root, old)):
                os.remove(os.path.join(root, old, name))
            os.rmdir(os.path.join(root, old))
    dist.barrier()


def latest_checkpoint(root, say=print):
    """The newest complete checkpoint under root (a step_N directory, or root itself), or None.
    Interrupted saves (.tmp) are skipped with a message."""
    if os.path.exists(os.path.join(root, "manifest.json")):
        return root
    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root)):
        if name.endswith(".tmp"):
            say(f"ignoring {os.path.join(root, name)}: an interrupted save, never completed")
    steps = sorted(d for d in os.listdir(root) if CKPT.match(d))
    complete = [d for d in steps if os.path.exists(os.path.join(root, d, "manifest.json"))]
    for d in set(steps) - set(complete):
        say(f"ignoring {os.path.join(root, d)}: it has no manifest.json")
    return os.path.join(root, complete[-1]) if complete else None


def read_checkpoint(path, cfg=None, tc=None):
    """(manifest, full parameters, full optimizer state per parameter name) from any layout. With
    cfg and tc, refuses a checkpoint of another model or another batch, naming what differs."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a checkpoint: no readable manifest.json ({e})") from None
    if cfg is not None:
        diff = [f"{k}={v} (this run {getattr(cfg, k)})" for k, v in manifest["model"].items()
                if getattr(cfg, k) != v]
        diff += [f"{k}={v} (this run {getattr(tc, k)})" for k, v in manifest["train"].items()
                 if getattr(tc, k) != v]
        if diff:
            raise ValueError(f"the checkpoint {path} was written with " + ", ".join(diff))
    lay = manifest["layout"]
    meta = dict(tp.GPT(tp.GPTConfig(**manifest["model"]), device="meta").named_parameters())
    params, states = {}, {}  # name -> {tp rank: shard}; name -> {tp rank: {key: flat shard}}
    for r in range(manifest["world"]):
        file = os.path.join(path, f"rank_{r:05d}.pt")
        try:
            shard = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated zip, a missing file, garbage: all the same to us
            raise ValueError(f"checkpoint shard {file} is missing, truncated or corrupt: {e}") from None
        t = shard["coords"]["tp"]
        for chunk in shard["chunks"]:
            for name, value in chunk.items():
                params.setdefault(name, {})[t] = value
        for c, name, start, end, state in shard["pieces"]:
            # Shaped like the parameter's shard on this tp rank, which replica 0 (a lower rank,
            # read earlier) wrote even when this file is a ZeRO-1 replica's without weights.
            local = params[name][t]
            flat = states.setdefault(name, {}).setdefault(t, {})
            for key, value in state.items():
                if value.dim() == 0:  # the step counter
                    flat[key] = value
                    continue
                flat.setdefault(key, torch.zeros(local.numel(), dtype=value.dtype))[start:end] = value
    full = {n: tp.join_shards([shards[t] for t in range(lay["tp"])], meta[n]) for n, shards in params.items()}
    full_state = {}
    for name, by_rank in states.items():
        shape = params[name][0].shape
        keys = by_rank[0].keys()
        full_state[name] = {k: by_rank[0][k] if by_rank[0][k].dim() == 0 else tp.join_shards(
            [by_rank[t][k].view(shape) for t in range(lay["tp"])], meta[name]) for k in keys}
    return manifest, full, full_state


def load_checkpoint(run, path, say=print):
    """Load path into this run, whatever layout wrote it; returns the number of steps done."""
    manifest, full, full_state = read_checkpoint(path, run.cfg, run.tc)
    for c in run.chunks:
        c.load_full_state_dict(full)
    tp_n, tp_r = dist.get_world_size(run.groups["tp"]), dist.get_rank(run.groups["tp"])
    owner = {id(p): n for chunk in run.chunks for n, p in chunk.named_parameters()}
    for p, piece, master, _ in run.opt.pieces:
        state = full_state.get(owner[id(p)])
        if not state:
            continue  # saved before the first optimizer step
        start = piece.storage_offset() - run.ddp.offsets[p]
        mine = {k: v if v.dim() == 0 else tp.split_full(v, p, tp_n, tp_r).reshape(-1)[start:start + piece.numel()]
                for k, v in state.items()}
        if "master" in mine:
            master.data.copy_(mine.pop("master"))
        elif master is not piece:  # bf16 now, not before: the master starts from the weights
            master.data.copy_(piece.float())
        dev = master.device
        run.opt.optimizer.state[master] = {k: v.to(dev if v.dim() else "cpu").clone() for k, v in mine.items()}
    lay, here = manifest["layout"], dict(tp=run.tc.tp, pp=run.tc.pp, dp=run.tc.dp, v=run.tc.virtual_stages,
                                          zero1=run.tc.zero1)
    if lay == here and manifest["world"] == run.env.world_size:
        shard = torch.load(os.path.join(path, f"rank_{run.env.rank:05d}.pt"), map_location="cpu", weights_only=True)
        torch.set_rng_state(shard["rng"]["cpu"])
        for c, state in zip(run.chunks, shard["rng"]["tracked"]):
            c.rng.state = state.to(c.rng.state.device)
        if shard["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(shard["rng"]["cuda"], run.env.device)
    else:  # another layout: random streams cannot be mapped, so they restart from (seed, step)
        pp_rank = dist.get_rank(run.groups["pp"])
        torch.manual_seed(run.tc.seed + 100 * pp_rank + 7919 * manifest["step"])
        say(f"resharded {path} from {lay} to {here}; dropout streams reseeded from the step")
    return manifest["step"]


# GPT-2 interchange: Hugging Face's GPT2LMHeadModel layout stores the four projection matrices as
# Conv1D weights, (in, out), the transpose of nn.Linear's; it also carries causal-mask buffers.

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def import_gpt2(path):
    """(GPTConfig, full state dict, tokenizer) from a local GPT-2 directory (config.json with
    model.safetensors or pytorch_model.bin) or from a plain serial state dict file (.pt) of our own
    names. The tokenizer ("bytes", "gpt2", "ids") is known only for a .pt that records it."""
    if os.path.isfile(path):
        full = torch.load(path, map_location="cpu", weights_only=True)
        cfg = tp.GPTConfig(**full.pop("_config")) if "_config" in full else None
        return cfg, full, full.pop("_tokenizer", None)
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} has no readable config.json: {e}") from None
    cfg = tp.GPTConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                       n_head=hf["n_head"], n_embd=hf["n_embd"], dropout=0.0)
    st, pt = os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin")
    if os.path.exists(st):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ValueError(f"{st} needs the safetensors package (pip install safetensors)") from None
        raw = load_file(st)
    elif os.path.exists(pt):
        raw = torch.load(pt, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path} holds no weights: neither model.safetensors nor pytorch_model.bin")
    full = {}
    for key, value in raw.items():
        name = key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue  # causal-mask buffers, and the output layer tied to wte
        full[name] = value.t().contiguous() if name.endswith(CONV1D) else value
    want = {n: p.shape for n, p in tp.GPT(cfg, device="meta").named_parameters()}
    bad = [f"{n}: {tuple(full[n].shape) if n in full else 'missing'} instead of {tuple(s)}"
           for n, s in want.items() if n not in full or full[n].shape != s]
    if bad:
        raise ValueError(f"{path} does not fit its config.json: " + "; ".join(bad[:5]))
    return cfg, full, None


def export_gpt2(cfg, full, out):
    """Write a full state dict in GPT2LMHeadModel's layout, with its config.json."""
    os.makedirs(out, exist_ok=True)  # our names are GPT2LMHeadModel's; only Conv1D is transposed
    hf = {k: (v.t() if k.endswith(CONV1D) else v).contiguous() for k, v in full.items()}
    hf["lm_head.weight"] = full["transformer.wte.weight"].clone()
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size,
                       n_positions=cfg.block_size, n_ctx=cfg.block_size, n_embd=cfg.n_embd,
                       n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu_new",
                       layer_norm_epsilon=1e-5, tie_word_embeddings=True), f, indent=1)
    try:
        from safetensors.torch import save_file
        save_file(hf, os.path.join(out, "model.safetensors"))
    except ImportError:
        torch.save(hf, os.path.join(out, "pytorch_model.bin"))


# ----------------------------------------------------------------------------------------------
# The trainer


Run = namedtuple("Run", "env cfg tc groups chunks ddp opt schedule act_shape wire dtype ops graphs")


def resolve_dtype(tc, device):
    if tc.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, tc.dtype)


def build(env, cfg, tc, groups):
    """This rank's chunks (TP inside, loaded from the full weights), its DDP and optimizer."""
    pp_rank = dist.get_rank(groups["pp"])
    dtype = resolve_dtype(tc, env.device)
    torch.manual_seed(tc.seed + 100 * pp_rank)  # dropout: alike across tp and dp, not across stages
    # Megatron's CPU initialisation: the full model from the seed (or imported GPT-2 weights),
    # then this rank's part of it.
    full = import_gpt2(tc.init_from)[1] if tc.init_from else tp.init_state_dict(cfg, tc.seed, dtype=dtype)
    fused, graph_mode = acceleration(tc, env.device)
    ops = kernels.FusedOps(tc.kernel_path, tc.flash_attention) if fused else tp.TORCH_OPS
    chunks = pipe.build_chunks(cfg, tc.pp, pp_rank, tc.virtual_stages, groups["tp"],
                               sequence_parallel=tc.sequence_parallel, seed=tc.seed + 100 * pp_rank,
                               init=False, dtype=dtype, device=env.device, ops=ops)
    for c in chunks:
        c.load_full_state_dict(full)
        if tc.recompute:
            recompute_layers(c)
    params = [p for c in chunks for p in c.parameters()]
    # Gradients are reduced in fp32 when the weights are bf16; the optimizer keeps fp32 masters.
    grad_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    ddp = ddp_mod.BucketedDDP(params, groups["dp"], tc.bucket_numel, zero=tc.zero1, grad_dtype=grad_dtype)
    opt = ddp_mod.DistributedAdamW(ddp, lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay,
                                   no_decay=no_decay(params))
    schedule = inter.interleaved(tc.pp, tc.microbatches, pp_rank, tc.virtual_stages)
    b = tc.batch_size // (tc.dp * tc.microbatches)
    act_shape = (b, tc.seq_len // (tc.tp if tc.sequence_parallel else 1), cfg.n_embd)
    sg = tc.scatter_gather and tc.tp > 1 and not tc.sequence_parallel  # with sp it is split already
    wire = ScatterGather(act_shape, groups["tp"]) if sg else None
    # Graphs are captured at the first step, when real batches give the shapes: {"mode", "graph"}.
    graphs = dict(mode=graph_mode, graph=None)
    return Run(env, cfg, tc, groups, chunks, ddp, opt, schedule, act_shape, wire, dtype, ops, graphs)


def shared_loss(loss, run):
    """The batch's mean loss on every rank: from the last stage along the pipeline, then the mean
    over the replicas (each saw an equal share of the tokens)."""
    t = torch.zeros((), dtype=torch.float64, device=run.env.device)
    if loss is not None and dist.get_rank(run.groups["tp"]) == 0:
        t += loss.double()  # one rank per replica contributes: one all-reduce over everyone
    dist.all_reduce(t)
    return float(t) / run.tc.dp


def train_step(run, idx, targets, lr, trace=None):
    """One iteration: the pipeline over this replica's microbatches, tied-embedding sync, the data-
    parallel reduction after the flush, clipping, AdamW. Returns (loss, grad norm, StepResult).
    trace, a plumbing.trace.StepTrace, records the step's timeline."""
    tc, groups = run.tc, run.groups
    span = trace.span if trace else (lambda name, category: contextlib.nullcontext())
    timing = dict(t0=trace.t0, clock=trace.clock) if trace else {}
    micro = pipe.split_batch(idx.to(run.env.device), targets.to(run.env.device), tc.microbatches)
    run.ddp.sync = False  # reduce after the pipeline flush, not during its backwards
    with tp.trace_comm(trace.clock) if trace else contextlib.nullcontext() as collectives:
        if run.graphs["mode"] == "step":
            step = run.graphs["graph"] = run.graphs["graph"] or cuda_graphs.StepGraph(run.chunks[0], micro, run.ddp)
            with span("forward + backward (one CUDA graph)", "compute"):
                res = pipe.StepResult(step.replay(micro), [], 0, 0, 0)
        else:
            call = None
            if run.graphs["mode"] == "stage":
                run.graphs["graph"] = run.graphs["graph"] or stage_graphs(run, micro)
                call = run.graphs["graph"].call
            # A graph's output is a static buffer it rewrites at the next replay: never deallocated.
            res = pipe.execute(run.schedule, run.chunks, groups["pp"], micro, run.act_shape, wire=run.wire,
                               call=call, deallocate=call is None, **timing)
    if trace:
        trace.add_pipeline(res, collectives)
    with span("tied-embedding all-reduce", "collective"):
        pipe.sync_tied_embeddings(run.chunks, groups["embed"], grad_of=run.ddp.main_grad)
    with span("data-parallel gradient reduction", "collective"):
        run.ddp.finish()
    with span("global gradient norm and clipping", "collective"):
        norm = clip_gradients(run.opt, run.chunks, groups, tc.grad_clip, tc.zero1)
    with span("AdamW" + (" and ZeRO-1 all-gather" if tc.zero1 else ""), "optimizer"):
        for g in run.opt.optimizer.param_groups:
            g["lr"] = lr
        run.opt.step()
        run.ddp.zero_grad()
    with span("loss all-reduce", "collective"):
        loss = shared_loss(res.loss, run)
    return loss, norm, res


def stage_graphs(run, micro):
    """Capture this rank's chunks, one copy per microbatch slot, from the first step's shapes."""
    pp_rank, pp, v = dist.get_rank(run.groups["pp"]), run.tc.pp, len(run.chunks)
    samples = {}
    for c in range(v):
        first = c == 0 and pp_rank == 0
        x = micro[0][0] if first else torch.randn(run.act_shape, dtype=run.dtype, device=run.env.device,
                                                   requires_grad=True)
        samples[c] = (x, micro[0][1])
    return cuda_graphs.StageGraphs(run.chunks, run.schedule, v - 1 if pp_rank == pp - 1 else None, samples)


def forward_only(run, idx, targets, call=None):
    """This replica's batch through the pipeline, forward only (eval mode, no gradients)."""
    forwards = [pipe.Action("F", a.mb, a.chunk) for a in run.schedule if a.kind == "F"]
    micro = pipe.split_batch(idx.to(run.env.device), targets.to(run.env.device), run.tc.microbatches)
    for c in run.chunks:
        c.eval()
    try:
        with torch.no_grad():
            return pipe.execute(forwards, run.chunks, run.groups["pp"], micro, run.act_shape, wire=run.wire,
                                call=call)
    finally:
        for c in run.chunks:
            c.train()


def evaluate(run, tokens):
    """The mean loss over eval_batches held-out batches, forward only."""
    dp_rank = dist.get_rank(run.groups["dp"])
    losses = [shared_loss(forward_only(run, *replica_batch(tokens, i, run.tc, dp_rank, salt=1)).loss, run)
              for i in range(run.tc.eval_batches)]
    return sum(losses) / len(losses)


def sum_probe(run):
    """How many of the 100 single-digit sums greedy decoding gets right, split into the sums the
    built-in corpus states and the held-out ones it never does: (right, of) for each. The last
    stage reads its logits through the executor's call hook; the counts are summed over the world."""
    tc, dp_rank = run.tc, dist.get_rank(run.groups["dp"])
    counts = torch.zeros(4, dtype=torch.float64, device=run.env.device)  # seen right/of, held right/of
    rows_per_mb = tc.batch_size // (tc.dp * tc.microbatches)
    for idx, targets, pairs in corpus_sum_probe(tc.seq_len, tc.batch_size):
        mine = pairs[dp_rank * (tc.batch_size // tc.dp):(dp_rank + 1) * (tc.batch_size // tc.dp)]

        def call(c, mb, x, tgt):
            out = run.chunks[c](x, tgt)
            if tgt is None:
                return out
            logits = run.chunks[c].full_logits(out[0])  # (b, T, V): every tp rank holds all of it
            scored = tgt != -100
            right = ((logits.argmax(-1) == tgt) | ~scored).all(-1)  # (b,): every scored token right
            if dist.get_rank(run.groups["tp"]) == 0:
                for ok, pair in zip(right.tolist(), mine[mb * rows_per_mb:(mb + 1) * rows_per_mb]):
                    if pair is not None:
                        k = 2 if held_out(*pair) else 0
                        counts[k] += ok
                        counts[k + 1] += 1
            return out

        forward_only(run, *ddp_mod.shard_batch(idx, targets, tc.dp, dp_rank), call=call)
    dist.all_reduce(counts)
    return [int(x) for x in counts.tolist()]


PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}


def train(env, cfg, tc, quiet=False):
    """Train on this rank; returns the per-step losses and gradient norms and the final figures."""
    check_config(cfg, tc, env.world_size)  # everything is refused before the first collective
    check_device(tc, env.device)
    train_tokens, eval_tokens = split_tokens(load_tokens(tc.data, cfg.vocab_size, tc.seq_len), tc.seq_len)
    groups = ddp_mod.new_groups(env, ddp_mod.rank_grid(env.world_size, tc.tp, tc.dp, tc.pp), tc.timeout_s)
    run = build(env, cfg, tc, groups)
    dp_rank = dist.get_rank(groups["dp"])
    say = printer(env, quiet)
    note = (lambda text: tqdm.write(text)) if env.rank == 0 and not quiet else (lambda text: None)
    spec = ModelSpec(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, tc.seq_len)
    flops = flops_per_iteration(spec, tc.batch_size, tc.recompute)
    summary(run, spec, flops, len(train_tokens), len(eval_tokens), say)
    name = env.device.type == "cuda" and torch.cuda.get_device_name(env.device)
    peak = next((f for k, f in PEAK_BF16_FLOPS.items() if name and k in name), None)
    start = 0
    path = latest_checkpoint(tc.resume, say) if tc.resume else None
    if path:
        start = load_checkpoint(run, path, say)
        say(f"resumed from {path}: {start} steps done")
    elif tc.resume:
        say(f"no complete checkpoint in {tc.resume}: starting from step 0")
    metrics = open(tc.metrics, "a" if tc.resume else "w") if tc.metrics and env.rank == 0 else None
    traced = min(start + 1, tc.steps - 1)  # not the first step: it allocates, compiles, captures
    losses, norms, evals = [], [], []
    t_start, tokens_per_step = time.perf_counter(), tc.batch_size * tc.seq_len
    bar = tqdm(range(start, tc.steps), initial=start, total=tc.steps, disable=env.rank != 0 or quiet,
               desc="train", dynamic_ncols=True)
    for step in bar:
        trace = StepTrace(env.device) if tc.trace and step == traced else None
        if trace:
            dist.barrier()  # every rank's clock starts together
            trace.start()
        t0 = time.perf_counter()
        lr = lr_at(step, tc)
        loss, norm, res = train_step(run, *replica_batch(train_tokens, step, tc, dp_rank), lr, trace)
        if not math.isfinite(loss):  # the same value on every rank: they all stop here together
            raise FloatingPointError(f"the loss is {loss} at step {step}; stopping instead of training on")
        dt = time.perf_counter() - t0
        if trace:  # one track per rank, named by its place in the grid (tp fastest, then dp, pp)
            names = [f"rank {r}: tp {r % tc.tp}, dp {r // tc.tp % tc.dp}, pp {r // (tc.tp * tc.dp)}"
                     for r in range(env.world_size)] if env.rank == 0 else None
            trace.write(tc.trace, f"step {step}", names)
            note(f"trace of step {step}, one track per rank: {tc.trace} (open it in chrome://tracing "
                 f"or ui.perfetto.dev)")
        losses.append(loss)
        norms.append(norm)
        record = dict(step=step, loss=loss, lr=lr, grad_norm=norm, tokens_per_s=tokens_per_step / dt, time_s=dt)
        shown = dict(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
        if peak and run.dtype == torch.bfloat16:
            shown["mfu"] = f"{flops / dt / (env.world_size * peak):.1%}"
        if tc.eval_every and ((step + 1) % tc.eval_every == 0 or step == tc.steps - 1):
            record["eval_loss"] = evaluate(run, eval_tokens)
            evals.append((step, record["eval_loss"]))
            shown["eval"] = f"{record['eval_loss']:.3f}"
        bar.set_postfix(shown)
        if step == start and run.ops is not tp.TORCH_OPS:  # what the dispatcher actually chose
            note(f"kernel paths: {kernels.build.report()}")
        if tc.save and ((tc.save_every and (step + 1) % tc.save_every == 0) or step + 1 == tc.steps):
            save_checkpoint(run, step + 1, tc.save, tc.keep, note)
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
    wall = time.perf_counter() - t_start
    if metrics:
        metrics.close()
    if not losses:
        say(f"nothing to do: {start} of {tc.steps} steps were already done")
        return dict(losses=[], norms=[], evals=[], start=start)
    out = dict(losses=losses, norms=norms, evals=evals, start=start,
               bytes_per_message=res.bytes_sent / max(res.messages, 1),
               peak_activation_bytes=res.peak_activation_bytes)
    if not tc.data and cfg.vocab_size >= 128:  # the built-in corpus: what did the model learn?
        out["sums"] = sum_probe(run)
    report(run, out, wall, say)
    return out


def report(run, out, wall, say):
    """The end of training: throughput, the loss chart, the message size, the sum probe."""
    tc, cfg, losses, evals = run.tc, run.cfg, out["losses"], out["evals"]
    tokens = len(losses) * tc.batch_size * tc.seq_len
    say(f"\ndone: {len(losses)} steps in {wall:.1f} s ({tokens / wall:,.0f} tokens/s); loss "
        f"{losses[0]:.3f} -> {losses[-1]:.3f}" + (f"; eval loss {evals[-1][1]:.3f}" if evals else ""))
    series = {"train loss": ("*", list(enumerate(losses, out["start"])))}
    if evals:
        series["eval loss"] = ("o", evals)
    say(ascii_chart(series))
    per_msg, elt = out["bytes_per_message"], torch.empty((), dtype=run.dtype).element_size()
    b = tc.batch_size // (tc.dp * tc.microbatches)
    say(f"p2p per message (rank 0): {per_msg:,.0f} bytes = {per_msg / elt:,.0f} elements; b*T*C = "
        f"{b * tc.seq_len * cfg.n_embd:,} elements, /tp = {b * tc.seq_len * cfg.n_embd // tc.tp:,} "
        f"({'scatter/gather on' if run.wire else 'scatter/gather off'}"
        f"{', sequence parallel' if tc.sequence_parallel else ''})")
    say(f"peak stored activation bytes on rank 0 (last step): {out['peak_activation_bytes']:,}")
    if "sums" in out:
        seen, of_seen, held, of_held = out["sums"]
        say(f"sums, greedy \"x plus y is\" for x, y < 10: {seen}/{of_seen} right of those in the "
            f"corpus, {held}/{of_held} of the held-out ones it never states")


def summary(run, spec, flops, n_train, n_eval, say):
    """The start-up summary (rank 0): a few grouped lines, not the config's repr."""
    cfg, tc, env = run.cfg, run.tc, run.env
    local = sum(p.numel() for c in run.chunks for p in c.parameters())
    per_rank = [int(x[0]) for x in gather_numbers([local], device=env.device)]
    elt = torch.empty((), dtype=run.dtype).element_size()
    grad_elt = run.ddp.grad_buffer.element_size()
    owned = sum(m.numel() for _, _, m, _ in run.opt.pieces)
    masters = sum(m.numel() for _, piece, m, _ in run.opt.pieces if m is not piece)
    L = Layout(tc.tp, tc.pp, tc.dp, tc.batch_size, b=run.act_shape[0], v=tc.virtual_stages,
               recompute=tc.recompute, sequence_parallel=tc.sequence_parallel)
    # Korthikanti's activation bytes assume 2-byte (bf16) activations: rescale to ours.
    act = activation_bytes_per_layer(spec, L) * layers_in_flight(spec, L) * elt / 2
    sim = pipe.simulate([inter.interleaved(tc.pp, tc.microbatches, s, tc.virtual_stages)
                         for s in range(tc.pp)], tc.pp)
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    graphs = {None: "off", "stage": "per stage and microbatch", "step": "whole step"}[run.graphs["mode"]]
    data = tc.data or "the built-in corpus"
    say(f"model     GPT-2: {cfg.n_layer} layers, {cfg.n_head} heads, C={cfg.n_embd}, V={cfg.vocab_size}, "
        f"block {cfg.block_size}, dropout {cfg.dropout:g}; {params_exact(spec):,} parameters"
        + (f" (from {tc.init_from})" if tc.init_from else ""))
    say(f"data      {data}: {n_train:,} tokens to train on, {n_eval:,} held out; "
        f"{tokenizer_of(tc.data)} tokens")
    say(f"layout    world {env.world_size} = tp {tc.tp} x pp {tc.pp} x dp {tc.dp}; "
        f"{'interleaved 1F1B, v=' + str(tc.virtual_stages) if tc.virtual_stages > 1 else '1F1B'}, "
        f"m={tc.microbatches} microbatches of b={run.act_shape[0]}; "
        f"{'ZeRO-1' if tc.zero1 else 'data parallel'}; scatter/gather {on(run.wire)}, "
        f"sequence parallel {on(tc.sequence_parallel)}, recompute {on(tc.recompute)}")
    say(f"device    {run.dtype} on {env.device.type} ({dist.get_backend()}); kernels: {run.ops.name}; "
        f"CUDA graphs: {graphs}")
    say(f"training  {tc.steps} steps of B={tc.batch_size} x T={tc.seq_len} = "
        f"{tc.batch_size * tc.seq_len:,} tokens; AdamW lr {tc.lr:g} -> {tc.min_lr:g} (warmup "
        f"{tc.warmup_steps}, cosine), weight decay {tc.weight_decay:g}, clip {tc.grad_clip:g}, "
        f"seed {tc.seed}; eval every {tc.eval_every or 'never'}")
    say(f"files     checkpoints: {tc.save or 'none'}"
        + (f" (every {tc.save_every} steps, keep {tc.keep})" if tc.save else "")
        + f"; resume: {tc.resume or 'no'}; metrics: {tc.metrics or 'none'}; trace: {tc.trace or 'none'}")
    opt_bytes = 2 * owned * max(elt, 4) + masters * 4  # two AdamW moments, plus fp32 masters
    say(f"memory    rank 0, estimated: weights {local * elt / 2**20:.2f} MiB, gradients "
        f"{local * grad_elt / 2**20:.2f} MiB, optimizer {opt_bytes / 2**20:.2f} MiB, activations "
        f"{act / 2**20:.2f} MiB (Korthikanti Table 2); parameters per rank {per_rank}")
    say(f"compute   FLOPs per iteration (eq. 3): {flops:.3e}; pipeline bubble (pp-1)/(v m) = "
        f"{sim.bubble} (simulated, t_b = 2 t_f)")


def serial_train(cfg, tc):
    """The reference: the same data, schedule and optimizer on one serial GPT-2 in tc.dtype."""
    dtype = getattr(torch, tc.dtype)
    train_tokens, _ = split_tokens(load_tokens(tc.data, cfg.vocab_size, tc.seq_len), tc.seq_len)
    model = tp.GPT(cfg, None, seed=tc.seed, dtype=dtype)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                             {"params": no_decay(params), "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    losses, norms = [], []
    for step in range(tc.steps):
        idx, targets = global_batch(train_tokens, step, tc)
        loss = model(idx, targets)[1]
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, norms=norms)


# ----------------------------------------------------------------------------------------------
# Main


def sample_main(cfg, tc, sc):
    """--sample: load the weights of --resume (any layout) or --init-from into the serial GPT-2 and
    print a continuation of the prompt. Nothing is launched: one process samples."""
    if tc.resume:
        path = latest_checkpoint(tc.resume)
        if not path:
            raise ValueError(f"--resume {tc.resume!r} holds no complete checkpoint to sample from")
        manifest, full, _ = read_checkpoint(path)
        cfg = tp.GPTConfig(**manifest["model"])
        kind = manifest.get("tokenizer") or tokenizer_kind(cfg.vocab_size)
        print(f"sampling from step {manifest['step']} of {path}")
    elif tc.init_from:
        imported, full, kind = import_gpt2(tc.init_from)
        cfg = imported or cfg  # a .pt without a recorded config: the model flags describe it
        kind = kind or tokenizer_kind(cfg.vocab_size)
        print(f"sampling from {tc.init_from}")
    else:
        raise ValueError("--sample needs weights: --resume DIR (a checkpoint) or --init-from PATH "
                         "(an exported .pt or a GPT-2 directory)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tp.GPT(cfg, None, init=False, device=device)
    model.load_full_state_dict({k: v.float() for k, v in full.items()})
    sampling.run(model, sc, kind, tc.seed)
    return True


def parser():
    """Every flag of the trainer: its config dataclasses, the actions, and the planner's."""
    p = cli.make_parser(__doc__)
    actions = p.add_argument_group("actions instead of training (each prints and exits)")
    actions.add_argument("--print-layout", action="store_true", help="print the rank grid and exit")
    actions.add_argument("--export-hf", metavar="DIR", help="write --resume's newest checkpoint as a "
                         "Hugging Face GPT-2 directory and exit")
    actions.add_argument("--export-state-dict", metavar="FILE", help="write --resume's newest checkpoint "
                         "as a plain serial state dict (.pt) and exit")
    cli.add_dataclass_args(p, TrainConfig, "training")
    cli.add_dataclass_args(p, tp.GPTConfig, "model", **MODEL_DEFAULTS)
    cli.add_dataclass_args(p, sampling.SampleConfig, "sampling (with --resume or --init-from)")
    add_plan_args(p)
    return p


def main():
    args = parser().parse_args()
    if args.plan:
        print(plan_from_args(args))
        return True
    tc, cfg = cli.from_args(TrainConfig, args), cli.from_args(tp.GPTConfig, args)
    if args.print_layout:
        print_layout(tc)
        return True
    if args.sample is not None:
        return sample_main(cfg, tc, cli.from_args(sampling.SampleConfig, args))
    if args.export_hf or args.export_state_dict:  # offline: the shards are read, nothing started
        path = latest_checkpoint(tc.resume) if tc.resume else None
        if not path:
            raise ValueError(f"exporting needs --resume DIR with a complete checkpoint; got {tc.resume!r}")
        manifest, full, _ = read_checkpoint(path)
        cfg = tp.GPTConfig(**manifest["model"])
        if args.export_hf:
            export_gpt2(cfg, full, args.export_hf)
        else:
            torch.save({**full, "_config": dataclasses.asdict(cfg), "_tokenizer": manifest.get("tokenizer")},
                       args.export_state_dict)
        print(f"exported step {manifest['step']} of {path} to {args.export_hf or args.export_state_dict}")
        return True
    if tc.init_from:  # the imported weights decide the model's shape
        imported, _, _ = import_gpt2(tc.init_from)
        if imported:
            cfg = dataclasses.replace(imported, dropout=cfg.dropout)
            print(f"model from {tc.init_from}: {cfg}")
    world = int(os.environ.get("WORLD_SIZE", tc.tp * tc.pp * tc.dp))
    check_config(cfg, tc, world)  # also checked on every rank; here it fails before any fork
    under_torchrun = "RANK" in os.environ and torch.cuda.is_available()  # as tp.launch decides
    check_device(tc, torch.device("cuda" if under_torchrun else "cpu"))
    load_tokens(tc.data, cfg.vocab_size, tc.seq_len)
    return bool(tp.launch(train, tc.tp * tc.pp * tc.dp, cfg, tc, timeout_s=tc.timeout_s))


if __name__ == "__main__":
    run_main(main)
