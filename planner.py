"""The planner: what a model costs on a cluster, from closed forms and a replayed schedule, allocating
nothing.

    python3 05_3d_gpt.py --plan 1T --gpus 3072           # Table 1's 1T model on 3072 A100s
    python3 05_3d_gpt.py --plan custom --n-layer 24 --n-embd 2048 --n-head 16 --gpus 64 --plan-batch 512

It is the arithmetic of the papers, each formula a function below, in the papers' own symbols:
l layers, h hidden size, a heads, V vocabulary, s sequence, B global batch, b micro-batch,
t, p, d the tensor-, pipeline- and data-parallel sizes, n GPUs, T training tokens, X FLOP/s per GPU.

    parameters        P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))            Narayanan eq. 2
    FLOPs/iteration   F = 96 B s l h^2 (1 + s/(6 h) + V/(16 l h))                Narayanan eq. 3
                      (with full recomputation: forward, backward, forward again)
    training time     8 T P / (n X)   (6 T P / (n X) without recomputation)     Narayanan eq. 4
    bubble            (p - 1) / (v m), m = B / (b d) microbatches per pipeline  Narayanan 2.2
    activations       s b h (10 + 24/t + 5 a s/(h t)) bytes per layer           Korthikanti Table 2
                      s b h (34/t + 5 a s/(h t)) with sequence parallelism
                      s b h (10 + 24/t), s b h 34/t with selective recomputation
                      2 s b h (/ t with sequence parallelism) with full recomputation
    memory per GPU    2 + 4 + 12 bytes per parameter (bf16 weights, fp32 gradients, fp32 master
                      and two Adam moments; the optimizer's 12 / d under ZeRO-1), plus activations
                      for the layers in flight (Korthikanti 4.2.3)

The throughput estimate (estimate_iteration) times what one GPU does, kernel by kernel, with one
set of constants (Cluster, each with its source; none fitted to Table 1, none per model):

    GEMMs             roofline: max(math, bytes / HBM), the math in waves of one 256x128 output
                      tile per SM (tile and wave quantization): small h/t and b s waste more of it
    memory-bound      LayerNorm, bias-GeLU, bias-dropout-add, softmax, dropout: their bytes / HBM
    tp all-reduce     2 (t-1)/t of b s h bf16 over NVLink, 4 per layer, 6 with full recomputation
    pp p2p            b s h / t per GPU over InfiniBand, then an all-gather over NVLink (4.1)
    bubble            02's simulate() replaying the schedule's own action lists with these times
    dp all-reduce     fp32 gradients after the last backward, not overlapped (Megatron 2021)
    optimizer         Adam's bytes per parameter / HBM
    recomputation     full: the whole forward again in backward; selective: the attention core

Vocabulary parallelism (07; Yeung et al. 2024): vocab_stages gives each pipeline stage's time,
parameters and peak memory with the output layer and the embedding on the last and first stage, or
spread over every rank with 07's S and T passes, replayed by 02's simulate() on 07's own lists;
`--plan table5` sets them beside the paper's Table 5 (8 GPUs, seq 2048, V from 32k to 256k).

It lands within 10% of every row of Table 1 (tests/test_planner.py), and says why the paper's
small models are its least efficient (Section 5.1: "larger matrix multiplications"): for 1.7B the
memory-bound kernels, mostly softmax and dropout over the s^2 attention scores, take 28% of the
time against 10% for 1T, and its projection GEMMs run at 214 TFLOP/s against 1T's 255 (ragged
tiles and waves at small h); for 18.4B, tp = 8 at h/t = 768 spends 17% in all-reduces against 6%.
Mixed precision as in Megatron; GB = 1e9 bytes.
"""
import argparse
import functools
import importlib
import math
import re
from collections import namedtuple
from dataclasses import dataclass

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
RECOMPUTE = ("full", "selective", "none", "lightseq")  # Korthikanti 5: full layers, the attention core, nothing;
# LightSeq 3.3 (08): full layers but the attention core, whose output is kept


@dataclass(frozen=True)
class Layout:
    """One way to run the model: the three sizes, the batch cut and the memory-saving options."""
    tp: int
    pp: int
    dp: int
    batch: int  # B, global, in sequences
    b: int = 1  # micro-batch size (Table 1 does not give it: 1 is assumed for every row)
    v: int = 1  # virtual stages per pipeline rank
    recompute: bool | str = True  # True or "full" (the paper's runs), "selective", False or "none"
    sequence_parallel: bool = False  # shard LayerNorm and dropout activations along T (Korthikanti)
    zero1: bool = False
    scatter_gather: bool = True  # Narayanan Section 4.1: pp messages split over the tp ranks

    @property
    def m(self):  # at least 1, so that a refused layout can still be described
        return max(1, self.batch // (self.b * self.dp))

    @property
    def recompute_mode(self):
        return recompute_mode(self.recompute)


def recompute_mode(recompute):
    """'full', 'selective', 'none' or 'lightseq' from a bool (05's --recompute) or one of those names."""
    mode = {True: "full", False: "none"}.get(recompute, recompute)
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: expected one of {', '.join(RECOMPUTE)}")
    return mode


@dataclass(frozen=True)
class Cluster:
    """The machine: Narayanan's Selene (Section 5), DGX A100 nodes of 8 A100-SXM4-80GB. These are
    every constant of the throughput model, each from a datasheet or a published measurement; none
    is fitted to Table 1, and every model and layout uses the same ones."""
    peak_tflops: float = 312.0  # A100 dense bf16 Tensor Core peak (A100 datasheet; Section 5)
    # The most a bf16 matmul reaches on an A100 SXM over all shapes, 86% of peak: the "maximum
    # achievable matmul FLOPS" measured in S. Bekman's Machine Learning Engineering book
    # (github.com/stas00/ml-engineering, compute/accelerator: 267.9 TFLOP/s).
    gemm_tflops: float = 267.9
    sms: int = 108  # streaming multiprocessors (A100 datasheet): one output tile each per wave
    # cuBLAS's largest output tile, either way round (NVIDIA, "Matrix Multiplication Background
    # User's Guide", 2.3; 3.1-3.2 describe tile and wave quantization on the A100's 108 SMs).
    tile: tuple = (256, 128)
    # What a streaming kernel reaches of the 2039 GB/s of HBM2e (datasheet): 1.80 TB/s, 88%,
    # measured (NVIDIA developer forum, "Trouble to Reach Peak Bandwidth of A100", 2025).
    hbm_gbs: float = 1800.0
    # All-reduce bus bandwidth among the 8 GPUs of a node (NVSwitch): about 200 GB/s measured by
    # nccl-tests on 8 A100-SXM4-80GB (NVIDIA/nccl-tests issue 149); each GPU's links carry 300 GB/s
    # per direction ("600 GB/s" in Section 5).
    nvlink_gbs: float = 200.0
    ib_gbs: float = 25.0  # per GPU across nodes: eight 200 Gb/s HDR InfiniBand cards a node (Section 5)
    gpu_mem_gb: float = 80.0  # 80e9 B: an "80 GB" A100 has 85.9e9, the rest is left as headroom
    gpus_per_node: int = 8


# ----------------------------------------------------------------------------------------------
# The papers' closed forms


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
    """Narayanan eq. 3: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full recomputation; the FLOPs
    run, so fewer with selective recomputation or none."""
    l, h, s, V = m.n_layer, m.n_embd, m.seq_len, m.vocab_size
    # A layer's forward is 24 B s h^2 (1 + s/(6h)); backward is twice that and recomputation one
    # more forward (4x, 3x without); the logit layer (2 B s h V) is never recomputed: always 3x.
    # So without recomputation the last term is V/(12 l h), not the paper's V/(16 l h).
    # Selective recomputation (Korthikanti 5) reruns only the attention core: QK^T and the
    # attention over V, 4 B s^2 h of the forward's 24 B s h^2 s/(6h).
    # LightSeq's checkpointing (08) reruns all of the forward but the core: full's FLOPs less 4 B s^2 h.
    mode = recompute_mode(recompute)
    k = 4 if mode in ("full", "lightseq") else 3
    core = {"selective": 1, "lightseq": -1}.get(mode, 0) * 4 * batch * s * s * h * l
    return 24 * k * batch * s * l * h * h * (1 + s / (6 * h) + 6 * V / (24 * k * l * h)) + core


def training_days(tokens, params, n_gpus, tflops, recompute=True):
    """Narayanan eq. 4: 8 T P / (n X) seconds (6 T P / (n X) without recomputation), in days."""
    k = 8 if recompute_mode(recompute) in ("full", "lightseq") else 6
    return k * tokens * params / (n_gpus * tflops * 1e12) / 86400


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
    mode = L.recompute_mode
    if mode == "full":  # only the layer's bf16 input, replicated over tp unless sequence-parallel
        return 2 * s * b * h / (t if L.sequence_parallel else 1)
    if mode == "lightseq":  # the input, and the attention's output (split over heads) and fp32 log-sum-exp
        return 2 * s * b * h / (t if L.sequence_parallel else 1) + 2 * s * b * h / t + 4 * s * b * a / t
    core = 0 if mode == "selective" else 5 * a * s / (h * t)  # the s^2 terms, rerun if selective
    if L.sequence_parallel:
        return s * b * h * (34 / t + core)
    return s * b * h * (10 + 24 / t + core)  # LayerNorms, dropout masks replicated


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


def hidden_bytes(m, L):
    """One microbatch's bf16 hidden state, b s h: what an all-reduce or a pipeline message carries."""
    return 2 * L.b * m.seq_len * m.n_embd


def comm_bytes_per_gpu(m, L):
    """Bytes one GPU sends per iteration for tp all-reduce, pp point-to-point and dp reduction."""
    t, d, act = L.tp, L.dp, hidden_bytes(m, L)
    # 2 forward + 2 backward all-reduces per layer per microbatch, +2 when the forward is rerun; a
    # ring moves 2 (t-1)/t of the data per GPU, as do sequence parallelism's all-gather and
    # reduce-scatter that replace each all-reduce (Korthikanti 4.2.2).
    per_layer = 6 if L.recompute_mode in ("full", "lightseq") else 4
    tp_bytes = per_layer * L.m * m.n_layer / L.pp * act * 2 * (t - 1) / t
    # An activation forward and a gradient backward per microbatch, at each of a rank's v chunks.
    pp_bytes = 0.0 if L.pp == 1 else 2 * L.m * L.v * act / _p2p_split(L)
    n = params_per_gpu(m, L)
    # fp32 gradients are all-reduced; ZeRO-1 reduce-scatters them and all-gathers the updated bf16
    # weights (as Megatron's distributed optimizer does), so it sends 6 (d-1)/d B/param, not 8.
    dp_bytes = (d - 1) / d * n * (4 + 2 if L.zero1 else 2 * 4)
    return dict(tp=tp_bytes, pp=pp_bytes, dp=dp_bytes)


def _p2p_split(L):
    """Section 4.1: with scatter/gather (or sequence parallelism) each tp rank sends 1/t."""
    return L.tp if (L.scatter_gather or L.sequence_parallel) else 1


# ----------------------------------------------------------------------------------------------
# The throughput model: one GPU's kernels, timed with Cluster's constants, then the schedule


def gemm_seconds(M, N, K, batch=1, c=Cluster()):
    """One bf16 GEMM (M x K) @ (K x N), `batch` of them in one strided-batched call: the slower of
    its math and its memory traffic (a roofline). The math runs in waves, one output tile per SM at
    a time; a partial tile or a partial last wave costs a whole one (tile and wave quantization),
    which is what makes small h/t and b s slower per FLOP."""
    def math_seconds(tm, tn):
        tiles = batch * math.ceil(M / tm) * math.ceil(N / tn)
        return math.ceil(tiles / c.sms) * 2 * tm * tn * K / (c.gemm_tflops * 1e12 / c.sms)
    compute = min(math_seconds(*c.tile), math_seconds(*c.tile[::-1]))
    memory = 2 * batch * (M * K + K * N + M * N) / (c.hbm_gbs * 1e9)
    return max(compute, memory)


def layer_gemms(m, L):
    """A layer's forward GEMMs on one tp rank for one microbatch, as (M, N, K, batch). The
    projections are split over t (Shoeybi 3); QK^T and the attention over V run per head."""
    b, s, h, t = L.b, m.seq_len, m.n_embd, L.tp
    hs, heads = h // m.n_head, b * m.n_head // t  # head size; (b, a/t) attention matrices
    return dict(qkv=(b * s, 3 * h // t, h, 1), scores=(s, s, hs, heads), context=(s, hs, s, heads),
                proj=(b * s, h, h // t, 1), fc1=(b * s, 4 * h // t, h, 1), fc2=(b * s, h, 4 * h // t, 1))


def memory_bound_bytes(m, L):
    """Bytes one layer's memory-bound kernels move for one microbatch on one tp rank:
    (the attention core's forward, the rest of the forward, the backward). Megatron's fused
    kernels (Narayanan 4.2) each read and write bf16 tensors once, dropout masks one byte:

        kernel                   forward  backward   per element of
        LayerNorm (x2)              4        6        b s h, on every tp rank (/ t with sp)
        bias-dropout-add (x2)       7       11        b s h, on every tp rank (/ t with sp)
        bias-GeLU                   4        6        b s 4h/t
        scale-mask-softmax          4        6        b a/t s^2 attention scores
        attention dropout           5        5        b a/t s^2
    plus the fp32 gradient accumulation after each microbatch's backward (Megatron 2021's main_grad:
    read the bf16 gradient and the fp32 sum, write the sum: 10 bytes per parameter)."""
    b, s, h, t = L.b, m.seq_len, m.n_embd, L.tp
    tokens, scores = b * s, b * m.n_head / t * s * s
    replicated = tokens * h / (t if L.sequence_parallel else 1)
    core = 9 * scores
    rest = 2 * 4 * replicated + 2 * 7 * replicated + 4 * tokens * 4 * h / t
    backward = 11 * scores + 2 * 6 * replicated + 2 * 11 * replicated + 6 * tokens * 4 * h / t
    return core, rest, backward + 10 * (12 * h * h + 13 * h) / t


def ring_gbs(size, stride, c=Cluster()):
    """GB/s each GPU sends at in a ring among `size` GPUs `stride` ranks apart (NCCL's bus bandwidth).
    Inside a node: NVLink's. Across nodes, each of the group's GPUs in a node drives its own
    InfiniBand card (NCCL runs one ring per card), so k members per node send at k x 25 GB/s."""
    per_node = max(1, c.gpus_per_node // stride)
    return c.nvlink_gbs if size <= per_node else min(c.nvlink_gbs, per_node * c.ib_gbs)


def tp_allreduce_seconds(m, L, c=Cluster()):
    """One all-reduce of b s h bf16 over the tp group: a ring sends 2 (t-1)/t of it per GPU."""
    return 2 * (L.tp - 1) / L.tp * hidden_bytes(m, L) / (ring_gbs(L.tp, 1, c) * 1e9)


def microbatch_seconds(m, L, c=Cluster()):
    """One microbatch through one pipeline rank's l/p layers, forward and backward (the backward
    with its recomputation), each as dict(gemm, memory, tp) in seconds. The slowest rank counts:
    the last, which adds the logit layer and the loss (never recomputed); the first adds only an
    embedding all-reduce. Megatron runs tp all-reduces on the compute stream: they are exposed."""
    hbm = c.hbm_gbs * 1e9
    g = {k: gemm_seconds(*x, c=c) for k, x in layer_gemms(m, L).items()}
    g_bwd = sum(gemm_seconds(M, K, N, B, c) + gemm_seconds(K, N, M, B, c)  # dX and dW
                for M, N, K, B in layer_gemms(m, L).values())
    core, rest, mem_bwd = memory_bound_bytes(m, L)
    ar = tp_allreduce_seconds(m, L, c)
    mode = L.recompute_mode
    redo_gemm = {"full": sum(g.values()), "selective": g["scores"] + g["context"], "none": 0,
                 "lightseq": sum(g.values()) - g["scores"] - g["context"]}[mode]
    redo_mem = {"full": core + rest, "selective": core, "none": 0, "lightseq": rest}[mode]
    layers = m.n_layer / L.pp
    fwd = dict(gemm=layers * sum(g.values()), memory=layers * (core + rest) / hbm, tp=layers * 2 * ar)
    bwd = dict(gemm=layers * (g_bwd + redo_gemm), memory=layers * (mem_bwd + redo_mem) / hbm,
               tp=layers * (2 + (2 if mode in ("full", "lightseq") else 0)) * ar)
    # The logit layer, split over V (column-parallel): one GEMM forward, two backward, its input's
    # gradient all-reduced; the fp32 vocab-parallel cross entropy moves ~38 B per logit forward
    # (cast, max, subtract, exp, sum, divide) and ~22 backward.
    bs, h, v_t = L.b * m.seq_len, m.n_embd, math.ceil(m.vocab_size / L.tp)
    logits = bs * v_t
    fwd["gemm"] += gemm_seconds(bs, v_t, h, c=c)
    bwd["gemm"] += gemm_seconds(bs, h, v_t, c=c) + gemm_seconds(h, v_t, bs, c=c)
    fwd["memory"] += 38 * logits / hbm
    bwd["memory"] += (22 * logits + 10 * v_t * h) / hbm  # + its weight's fp32 accumulation
    bwd["tp"] += ar
    if L.pp == 1:
        fwd["tp"] += ar  # the vocab-parallel embedding's all-reduce, on the same rank
    return fwd, bwd


def p2p_seconds(m, L, c=Cluster()):
    """One pipeline message (an activation or its gradient) between neighbouring stages. With
    scatter/gather each tp rank sends 1/t over its own InfiniBand card and the receiving tp group
    all-gathers the pieces over NVLink (Section 4.1). Stages are t d ranks apart (Megatron's rank
    order: tp, then dp, then pp), so the pipeline crosses nodes once t d p > GPUs per node. The
    replay delays the receiver by this much; Megatron's 2021 sends also held the sender until
    delivery, one message per action (about 2% of an action for 1T), which is left out."""
    if L.pp == 1:
        return 0.0
    nbytes, split = hidden_bytes(m, L), _p2p_split(L)
    link = c.ib_gbs if L.tp * L.dp * L.pp > c.gpus_per_node else c.nvlink_gbs
    seconds = nbytes / split / (link * 1e9)
    if split > 1 and not L.sequence_parallel:  # sp keeps the pieces: the next stage wants them split
        seconds += (split - 1) / split * nbytes / (c.nvlink_gbs * 1e9)
    return seconds


@functools.lru_cache(maxsize=64)
def _schedule(pp, m, v):
    """02's Schedule of every rank's action list: 02's 1F1B, or 03's interleaved 1F1B for v > 1."""
    pipeline = importlib.import_module("02_pipeline_1f1b")
    if v == 1:
        return pipeline.Schedule([pipeline.one_f_one_b(pp, m, r) for r in range(pp)])
    interleaved = importlib.import_module("03_interleaved").interleaved
    return pipeline.Schedule([interleaved(pp, m, r, v) for r in range(pp)])


@functools.lru_cache(maxsize=1024)
def pipeline_seconds(pp, m, v, t_f, t_b, t_comm):
    """The pipeline's step time: 02's simulate() replays the schedule's own action lists with
    forward t_f, backward t_b (per chunk) and t_comm on every message between ranks, so the bubble
    and the messages on the critical path come out of the schedule rather than a formula.
    1F1B repeats itself every pp microbatches once the pipeline is full, so two replays of at most
    3 pp microbatches (m1 = m mod pp, counted from pp, and m1 + pp) give any m: replaying all 512 of
    1T's would take seconds (tests/test_planner.py checks the shortcut against full replays, slow
    messages included). The interleaved schedule settles into no such short period when messages
    are slow, so for v > 1 all m are replayed."""
    simulate = importlib.import_module("02_pipeline_1f1b").simulate
    step = lambda k: simulate(_schedule(pp, k, v), t_f, t_b, t_comm).step_time  # noqa: E731
    m1 = pp + (m - pp) % pp
    if v > 1 or m <= m1 + pp:
        return step(m)
    first, second = step(m1), step(m1 + pp)
    return second + (m - m1 - pp) / pp * (second - first)


def estimate_iteration(m, L, n_gpus, c=Cluster()):
    """Seconds per iteration by part, and TFLOP/s per GPU (eq. 3's FLOPs over n GPUs and the time).
    gemm, memory and tp: the slowest pipeline rank's work summed over its m microbatches; bubble: its
    idle time in 02's replay (warm-up, drain, waiting on messages); dp: the exposed gradient
    all-reduce; optimizer: the Adam step."""
    fwd, bwd = microbatch_seconds(m, L, c)
    t_f, t_b = sum(fwd.values()) / L.v, sum(bwd.values()) / L.v  # per chunk, logits shared out
    step = pipeline_seconds(L.pp, L.m, L.v, t_f, t_b, p2p_seconds(m, L, c))
    t = {k: L.m * (fwd[k] + bwd[k]) for k in ("gemm", "memory", "tp")}
    t["bubble"] = step - sum(t.values())
    # Megatron's 2021 local DDP all-reduces the fp32 gradients only after the last backward, so
    # none of it hides; pp > 1 adds the tied embedding's all-reduce between first and last stage.
    t["dp"] = comm_bytes_per_gpu(m, L)["dp"] / (ring_gbs(L.dp, L.tp, c) * 1e9)
    if L.pp > 1:
        t["dp"] += 4 * m.vocab_size * m.n_embd / L.tp / (c.ib_gbs * 1e9)
    # Adam over fp32 state, per parameter: the gradient norm reads 4 B, the update reads gradient,
    # master and two moments (16) and writes three (12), the bf16 copy 6, zeroing the gradients 4.
    n = params_per_gpu(m, L)
    t["optimizer"] = n * (8 + 34 / (L.dp if L.zero1 else 1)) / (c.hbm_gbs * 1e9)
    t["total"] = step + t["dp"] + t["optimizer"]
    t["tflops"] = flops_per_iteration(m, L.batch, L.recompute) / (n_gpus * t["total"]) / 1e12
    return t


def model_constants(c=Cluster()):
    """The throughput model's constants and their sources, as --plan prints them."""
    return ["throughput model constants (Cluster; one set for every model and layout, none fitted "
            "to Table 1):",
            f"  peak        {c.peak_tflops:g} TFLOP/s bf16 per A100 (datasheet, Section 5); "
            f"TFLOP/s counted with eq. 3",
            f"  GEMMs       at most {c.gemm_tflops:g} TFLOP/s (the best bf16 matmul measured on an "
            f"A100 SXM, Bekman's ML Engineering),",
            f"              in waves of one {c.tile[0]}x{c.tile[1]} tile per SM over {c.sms} SMs "
            f"(datasheet; NVIDIA's matmul guide), or bytes / HBM",
            f"  HBM         {c.hbm_gbs:g} GB/s (88% of the datasheet's 2039, measured) for "
            f"the memory-bound kernels",
            f"  NVLink      {c.nvlink_gbs:g} GB/s all-reduce bus bandwidth in a node (nccl-tests, "
            f"8 A100-SXM4-80GB)",
            f"  InfiniBand  {c.ib_gbs:g} GB/s per GPU across nodes ({c.gpus_per_node} x 200 Gb/s "
            f"HDR per node, Section 5)",
            "  software    Megatron as in 2021: fused kernels (4.2); tp all-reduces and fp32 "
            "gradient accumulation per microbatch;",
            "              dp all-reduce after the last backward, not overlapped; the bubble from "
            "02's simulate() on the schedule"]


# ----------------------------------------------------------------------------------------------
# Vocabulary parallelism (07; Yeung et al. 2024): the output layer and the embedding per stage, on
# the first and last stage (Megatron's) or spread over every pipeline rank, and the paper's Table 5


# Yeung et al. 2024, Table 5, "8GPU, Seq Length 2048": 1F1B over pp = 8 A100s, the ~4B model of their
# Table 1 (32 layers, h 3072, 24 heads, b = 1, m = 128). MFU % and peak memory GB for V = 32k to 256k
# (read here as 2^15 to 2^18).
TABLE5_MODEL, TABLE5_VOCABS = ModelSpec(32, 3072, 24, 32768, 2048), (32768, 65536, 131072, 262144)
TABLE5 = {0: ("baseline", [46.16, 40.48, 33.11, 25.23], [14.86, 16.32, 19.25, 25.64]),
          2: ("Vocab-1", [50.42, 50.28, 49.93, 50.12], [15.63, 16.02, 16.84, 18.59]),
          1: ("Vocab-2", [50.23, 50.18, 49.82, 49.69], [14.83, 15.23, 16.04, 17.78])}


def output_layer_seconds(m, L, slices=1, c=Cluster()):
    """The output layer and its cross entropy for one microbatch on one rank holding V/(t slices) of
    the vocabulary: (forward, backward) as microbatch_seconds counts them (one GEMM forward, two
    backward, the fp32 loss's bytes), and the GEMM X's gradient costs."""
    bs, h, v = L.b * m.seq_len, m.n_embd, math.ceil(m.vocab_size / (L.tp * slices))
    hbm, grad_x = c.hbm_gbs * 1e9, gemm_seconds(bs, h, v, c=c)
    return (gemm_seconds(bs, v, h, c=c) + 38 * bs * v / hbm,
            grad_x + gemm_seconds(h, v, bs, c=c) + (22 * bs * v + 10 * v * h) / hbm, grad_x)


@functools.lru_cache(maxsize=64)
def _vocab_lists(pp, m, barriers, schedule="1f1b"):
    return importlib.import_module("07_vocab_parallel").vocab_schedule(schedule, pp, m, barriers)


def vocab_stages(m, L, barriers=0, c=Cluster(), schedule="1f1b"):
    """Per pipeline rank, 1F1B: a microbatch's forward and backward seconds (with 07's S and T), its
    parameters, its peak bytes (weights, fp32 gradients and Adam, activations in flight, the fp32
    logits kept for the loss), and the step, replayed by 02's simulate(). barriers 0: the vocabulary
    layers on the first and last stage; 2 or 1: spread over the pp ranks (Algorithm 1 or 2).
    schedule "v-half" (barriers 1 or 2): 06's V-Half instead, two chunks of l / (2 pp) layers a rank,
    a chunk's backward split into I and W of half its time each, its activations 06's peak_memory
    (what W keeps: half a chunk's, as 06's simulate assumes)."""
    pp, h, V, l = L.pp, m.n_embd, m.vocab_size, m.n_layer / L.pp
    if schedule != "1f1b" and not barriers:
        raise ValueError(f"schedule {schedule}: planned with vocabulary parallelism only (barriers 1 or 2)")
    fwd, bwd = microbatch_seconds(m, L, c)  # the last stage's, output layer included
    out_f, out_b, grad_x = output_layer_seconds(m, L, 1, c)
    ar = tp_allreduce_seconds(m, L, c)  # the output layer's input gradient over tp
    t_f, t_b = sum(fwd.values()) - out_f, sum(bwd.values()) - out_b - ar  # the layers alone
    last = [r == pp - 1 for r in range(pp)]
    layers = l * (12 * h * h + 13 * h)
    if barriers:
        pipe = _vocab_lists(pp, L.m, barriers, schedule)
        s_f, s_b, s_x = output_layer_seconds(m, L, pp, c)  # one rank's slice; Algorithm 2 moves X's GEMM to S
        times = {"S": s_f + (s_x if barriers == 1 else 0), "T": s_b - (s_x if barriers == 1 else 0) + ar / pp,
                 "I": t_b / 4, "W": t_b / 4}  # V-Half's: a chunk is half a stage
        sim = pipeline_sim(pipe, [t_f / pipe.v] * pp, [t_b / pipe.v] * pp, p2p_seconds(m, L, c), times)
        last = [r == pipe.where[pipe.S - 1][0] for r in range(pp)]  # V-Half's last stage is rank 0's
        params = [layers + V * h / pp + (m.seq_len * h if r == 0 else 0) + 2 * h * x for r, x in enumerate(last)]
        logits = [L.b * m.seq_len * V / pp * importlib.import_module("07_vocab_parallel").logits_held(acts)
                  for acts in pipe.lists]  # from S to T
    else:
        sim = pipeline_sim(_schedule(pp, L.m, 1), [t_f + out_f * x for x in last],
                           [t_b + (out_b + ar) * x for x in last],
                           p2p_seconds(m, L, c))
        params = [layers + (V + m.seq_len) * h * (r == 0) + (V * h + 2 * h) * x for r, x in enumerate(last)]
        logits = [L.b * m.seq_len * V * x for x in last]  # the softmax, for the one microbatch in flight
    params = [p / L.tp for p in params]
    held = [importlib.import_module("06_zero_bubble").peak_memory(acts, 0.5) / 2 for acts in pipe.lists] \
        if schedule == "v-half" else sim.peak_in_flight  # in stages' worth (two chunks) of a microbatch
    activations = [activation_bytes_per_layer(m, L) * l * n for n in held]
    memory = [18 * p + a + 4 * x / L.tp for p, a, x in zip(params, activations, logits)]  # Megatron's 2+4+12 B
    # The Adam step of the fullest rank, and (without) the tied embedding's all-reduce between stages.
    tail = max(params) * 42 / (c.hbm_gbs * 1e9) + (0 if barriers else 4 * V * h / L.tp / (c.ib_gbs * 1e9))
    total = sim.step_time + tail
    mfu = flops_per_iteration(m, L.batch, "none") / (L.tp * pp * L.dp * total * c.peak_tflops * 1e12)
    return dict(forward=[f for f in ([t_f] * pp if barriers else [t_f + out_f * x for x in last])],
                compute=[busy / L.m for busy in (sim.step_time - i for i in sim.idle)], params=params,
                memory=memory, step=total, mfu=mfu, peak=max(memory))


def v_half_report(c=Cluster()):
    """--plan v-half: Table 5's setting (pp = 8, V = 32k to 256k) with 06's V-Half and vocabulary
    parallelism beside 1F1B's: MFU, peak memory, and max/min over ranks of busy time and memory
    (the paper's "perfect balance": 1.00 in both)."""
    m, L = TABLE5_MODEL, Layout(1, 8, 1, 128, recompute="selective")
    out = [f"Yeung et al. 2024, Table 5's setting: l={m.n_layer} h={m.n_embd} a={m.n_head} s={m.seq_len}, pp=8, b=1, "
           f"m=128, as --plan table5; V-Half (06's) and 1F1B, each with vocabulary parallelism", "the paper's own "
           "V-Half figures are not given here: they are in none of this repository's docs and were not found (not "
           "invented)", "V        schedule          MFU %   peak GB   busy max/min   memory max/min"]
    spread = lambda xs: max(xs) / min(xs)  # noqa: E731
    for V in TABLE5_VOCABS:
        for name, b in (("1f1b", 2), ("1f1b", 1), ("v-half", 2), ("v-half", 1)):
            e = vocab_stages(m._replace(vocab_size=V), L, b, c, name)
            out.append(f"{V // 1024:4d}k   {name + ' Vocab-' + str(3 - b):16s} {100 * e['mfu']:6.1f}   "
                       f"{e['peak'] / 1e9:7.2f}   {spread(e['compute']):12.2f}   {spread(e['memory']):14.2f}")
    return "\n".join(out)


def pipeline_sim(schedule, t_f, t_b, t_comm, times=None):
    """02's simulate() of a Schedule (per-rank times), for the vocabulary estimates."""
    return importlib.import_module("02_pipeline_1f1b").simulate(schedule, t_f, t_b, t_comm, times)


def vocab_report(c=Cluster()):
    """--plan table5: Table 5's setting estimated without and with vocabulary parallelism (each
    stage at V = 256k, then MFU and peak memory for every V) beside the paper's figures, and how
    the trends compare."""
    m, L = TABLE5_MODEL, Layout(1, 8, 1, 128, recompute="selective")  # FlashAttention: no s^2 stored
    out = [f"Yeung et al. 2024, Table 5: l={m.n_layer} h={m.n_embd} a={m.n_head} s={m.seq_len}, 1F1B over pp=8, "
           f"b=1, m=128, the attention core recomputed (as FlashAttention does); {c.peak_tflops:g} TFLOP/s bf16 "
           f"peak (A100); MFU counts the model's FLOPs (eq. 3 without recomputation)"]
    big = m._replace(vocab_size=TABLE5_VOCABS[-1])
    est = {b: vocab_stages(big, L, b, c) for b in (0, 2)}
    out.append(f"each stage at V = {big.vocab_size:,}: without | with vocabulary parallelism (Algorithm 1)")
    out.append("  stage   busy ms per microbatch    parameters (M)    peak memory (GB)")
    for r in range(L.pp):
        out.append(f"  {r:5d}   {est[0]['compute'][r] * 1e3:7.2f} | {est[2]['compute'][r] * 1e3:7.2f}"
                   f"      {est[0]['params'][r] / 1e6:6.0f} | {est[2]['params'][r] / 1e6:5.0f}"
                   f"      {est[0]['memory'][r] / 1e9:6.2f} | {est[2]['memory'][r] / 1e9:5.2f}")
    out.append("V          " + "".join(f"{'MFU % ' + name:>24s}{'peak GB':>16s}" for name, _, _ in TABLE5.values()))
    rows = {}
    for i, V in enumerate(TABLE5_VOCABS):
        spec = m._replace(vocab_size=V)
        rows[V] = {b: vocab_stages(spec, L, b, c) for b in TABLE5}
        out.append(f"{V // 1024:4d}k   " + "".join(
            f"{100 * rows[V][b]['mfu']:9.1f} (paper {mfu[i]:5.2f}){rows[V][b]['peak'] / 1e9:7.2f} ({mem[i]:5.2f})"
            for b, (_, mfu, mem) in TABLE5.items()))
    first, last = rows[TABLE5_VOCABS[0]], rows[TABLE5_VOCABS[-1]]
    out.append(f"trend, 32k -> 256k: without, MFU {100 * first[0]['mfu']:.1f} -> {100 * last[0]['mfu']:.1f} % "
               f"(x{last[0]['mfu'] / first[0]['mfu']:.2f}; the paper x{TABLE5[0][1][-1] / TABLE5[0][1][0]:.2f}); with, "
               f"{100 * first[2]['mfu']:.1f} -> {100 * last[2]['mfu']:.1f} % (x{last[2]['mfu'] / first[2]['mfu']:.2f}; the "
               f"paper x{TABLE5[2][1][-1] / TABLE5[2][1][0]:.2f}); peak memory without x"
               f"{last[0]['peak'] / first[0]['peak']:.2f} (paper x{TABLE5[0][2][-1] / TABLE5[0][2][0]:.2f}), with x"
               f"{last[2]['peak'] / first[2]['peak']:.2f} (paper x{TABLE5[2][2][-1] / TABLE5[2][2][0]:.2f})")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Mixture of experts (09; Liu et al. 2025, "MoE Parallel Folding"): every moe_every-th layer's MLP
# (layer i, i % moe_every == 0) is E experts and a router, each token sent to k of them; the experts
# fold onto attention's tp x dp ranks of a stage as etp x ep x edp.
#
#     parameters        P + n ((E - 1)(8 h^2 + 5 h) + E h) in all; a token uses P + n ((k - 1)(8 h^2 + 5 h) + E h)
#     FLOPs per token   3 (l (8 h^2 + 4 s h) + (l - n) 16 h^2 + n (16 k h^2 + 2 E h) + 2 h V), forward and backward
#     all-to-all        4 N k (ep - 1)/ep h bytes per element a rank sends per MoE layer and microbatch
#     memory per rank   dense weights / tp and experts / (ep etp), 2 + 4 + 12 bytes each (the 12 / dp, / edp
#                       for experts, with ZeRO-1), plus activations: an MoE layer's MLP part k times a dense one's
# with n the MoE layers, P the dense model's parameters (params_exact), N the tokens a rank routes.

MoESpec = namedtuple("MoESpec", "num_experts top_k moe_every", defaults=(2, 1))


def moe_layers(l, every):
    """The MoE layers' indices among l: i % every == 0 (09's with_experts, Megatron's --moe-layer-freq)."""
    return range(0, l, every)


def moe_params(m, e):
    """(total, active) parameters of 01's GPT-2 with experts (09's model exactly): each MoE layer's MLP,
    8 h^2 + 5 h, is E of them plus a router of E h; a token runs k of them and the router."""
    h, n, mlp = m.n_embd, len(moe_layers(m.n_layer, e.moe_every)), 8 * m.n_embd ** 2 + 5 * m.n_embd
    dense = params_exact(m)
    router = e.num_experts * h
    return dense + n * ((e.num_experts - 1) * mlp + router), dense + n * ((e.top_k - 1) * mlp + router)


def moe_flops_per_token(m, e):
    """Forward and backward FLOPs per token, 3 x the forward's 2 per weight a token meets in a GEMM
    (attention's 4 h^2 weights, each expert's 8 h^2, the router's E h, the output layer's h V) plus the
    attention scores' 4 s h per layer (QK^T and AV, the causal half not subtracted, as eq. 3)."""
    h, l, s, V = m.n_embd, m.n_layer, m.seq_len, m.vocab_size
    n = len(moe_layers(l, e.moe_every))
    return 3 * (l * (8 * h * h + 4 * s * h) + (l - n) * 16 * h * h + n * (16 * e.top_k * h * h + 2 * e.num_experts * h)
                + 2 * h * V)


def moe_alltoall_bytes(tokens, k, ep, h, elt=2):
    """Bytes one rank sends in one MoE layer's all-to-alls for one microbatch, forward and backward, at
    uniform routing: of its tokens x k rows of h elements, (ep - 1)/ep leave it, in each of four all-to-
    alls (dispatch and combine, and the reverse of each in the backward)."""
    return 4 * tokens * k * (ep - 1) / ep * h * elt


def moe_memory_per_rank(m, e, L, ep=1, etp=1, zero1=False):
    """Bytes on the fullest rank (the first stage) under the fold: dense weights over tp, experts over
    ep x etp, 2 + 4 + 12 bytes per parameter (bf16 weights, fp32 gradients, fp32 master and Adam moments;
    with ZeRO-1 the 12 over dp, over edp = tp dp / (ep etp) for experts), and Korthikanti's activations
    with each MoE layer's MLP part (19 s b h of 34) k times over, plus its 4 k s b h of sorted and sent
    copies, its tokens spread over ep x etp as evenly as the router sends them."""
    h, E, k = m.n_embd, e.num_experts, e.top_k
    first = [i for i in moe_layers(m.n_layer, e.moe_every) if i < m.n_layer // L.pp]  # the first stage's
    mlp = 8 * h * h + 5 * h
    dense = params_per_gpu(m, L) - len(first) * (mlp / L.tp - E * h)  # the MLPs out, the routers in
    experts = len(first) * E // ep * mlp / etp
    edp = L.tp * L.dp // (ep * etp)
    weights = dense * (6 + 12 / (L.dp if zero1 else 1)) + experts * (6 + 12 / (edp if zero1 else 1))
    per_layer = activation_bytes_per_layer(m, L)
    moe_extra = (19 * (k - 1) + 4 * k) * m.seq_len * L.b * h / L.tp  # bytes, as Table 2 counts them
    acts = (per_layer * m.n_layer // L.pp + moe_extra * len(first)) * layers_in_flight(m, L) / (m.n_layer // L.pp)
    return weights + acts


# ----------------------------------------------------------------------------------------------
# Layouts


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


# ----------------------------------------------------------------------------------------------
# Input checks (bad input never costs a run): every --plan flag, in one place, before anything


MODEL_FLAGS = (("--n-layer", "n_layer"), ("--n-embd", "n_embd"), ("--n-head", "n_head"),
               ("--vocab-size", "vocab_size"), ("--seq-len", "seq_len"))
PlanInput = namedtuple("PlanInput", "spec n_gpus layout batch options")


def check_plan_args(args, c=Cluster()):
    """The --plan flags (and the model flags `custom` reads) checked for type, range and their
    relations; ValueError naming the flag, its value and the constraint. Returns a PlanInput."""
    def need(ok, flag, value, constraint):
        if not ok:
            raise ValueError(f"{flag}={value}: {constraint}")

    def count(flag, value):  # a positive int (bool is an int to Python, not to us)
        need(isinstance(value, int) and not isinstance(value, bool) and value >= 1, flag, value,
             "must be a whole number of at least 1")
        return value

    def amount(flag, value):  # a positive, finite float
        need(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, flag, value,
             "must be a finite number above 0")
        return value

    row = None
    if args.plan == "custom":
        sizes = {attr: count(flag, getattr(args, attr, None)) for flag, attr in MODEL_FLAGS}
        need(sizes["n_embd"] % sizes["n_head"] == 0, "--n-embd", sizes["n_embd"],
             f"must be divisible by --n-head={sizes['n_head']} (head size C / nh)")
        spec = ModelSpec(**sizes)
    else:
        try:
            row = paper_row(args.plan)
        except ValueError:
            raise ValueError(f"--plan={args.plan}: give a model of Table 1 "
                             f"({', '.join(PAPER_CONFIGS)}, or 1T) or custom") from None
        spec = model_spec(args.plan)
    n_gpus = args.gpus if args.gpus is not None or not row else row.n_gpus
    need(n_gpus is not None, "--gpus", n_gpus, "the number of GPUs is needed for a model not in Table 1")
    count("--gpus", n_gpus)
    batch = args.plan_batch if args.plan_batch is not None or not row else row.batch
    need(batch is not None, "--plan-batch", batch, "the global batch B is needed for a model not in Table 1")
    count("--plan-batch", batch)
    b, v = count("--plan-micro-batch", args.plan_micro_batch), count("--plan-v", args.plan_v)
    need(batch % b == 0, "--plan-micro-batch", b, f"must divide --plan-batch={batch}")
    need(spec.n_layer % v == 0, "--plan-v", v, f"must divide the model's {spec.n_layer} layers")
    amount("--plan-tokens", args.plan_tokens)
    amount("--plan-gpu-mem", args.plan_gpu_mem)
    if args.plan_tflops is not None:
        amount("--plan-tflops", args.plan_tflops)
        need(args.plan_tflops <= c.peak_tflops, "--plan-tflops", args.plan_tflops,
             f"cannot exceed the GPU's peak of {c.peak_tflops:g} TFLOP/s")
    options = dict(b=b, v=v, recompute=args.plan_recompute, zero1=args.plan_zero1,
                   sequence_parallel=args.plan_sequence_parallel, scatter_gather=args.plan_scatter_gather)
    layout = None
    if args.plan_layout is not None:
        given = args.plan_layout
        parts = given.split(",")
        need(len(parts) == 3 and all(p.strip().isdigit() and int(p) >= 1 for p in parts), "--plan-layout",
             given, "expected three whole numbers of at least 1, TP,PP,DP")
        layout = tp, pp, dp = tuple(int(p) for p in parts)
        need(tp * pp * dp == n_gpus, "--plan-layout", given,
             f"tp*pp*dp = {tp * pp * dp} GPUs, but --gpus={n_gpus}")
        need(spec.n_head % tp == 0, "--plan-layout", given, f"tp={tp} must divide the {spec.n_head} heads")
        need(spec.n_layer % (pp * v) == 0, "--plan-layout", given,
             f"pp*v = {pp * v} (with --plan-v={v}) must divide the {spec.n_layer} layers")
        need(batch % (dp * b) == 0, "--plan-layout", given,
             f"dp*b = {dp * b} (with --plan-micro-batch={b}) must divide --plan-batch={batch}")
        m = batch // (dp * b)
        need(v == 1 or (pp > 1 and m % pp == 0), "--plan-v", v,
             f"interleaving needs pp > 1 and pp | m: pp={pp}, m={m} microbatches")
        need(not args.plan_sequence_parallel or spec.seq_len % tp == 0, "--plan-sequence-parallel",
             True, f"tp={tp} must divide the sequence length {spec.seq_len}")
    return PlanInput(spec if row is None else args.plan, n_gpus, layout, batch, options)


# ----------------------------------------------------------------------------------------------
# Context parallelism (08; Li et al. 2023, "LightSeq"; Megatron's cp): the sequence split over P GPUs.
# Per GPU, layer and microbatch of b sequences, bf16, h_kv = h kv_heads / a the keys' and values' width
# (GPT-2: every head has its own, h_kv = h; grouped-query attention has fewer):
#
#     tp + sp (Megatron, t = P)   8 (P-1)/P 2 b s h              2 all-gathers, 2 reduce-scatters each way
#     ring (cp = P)               6 (P-1)/P 2 b s h_kv           every other rank's keys and values in
#                                                                forward, again in backward with their
#                                                                gradients sent home
#     Ulysses (cp = P)            4 (P-1)/P^2 2 b s (h + h_kv)   q, k, v in and o out, all-to-all each way
#
# Memory: every cp rank holds the whole model (ZeRO-1 shards its optimizer over dp x cp) and s/P of
# the tokens' activations, Korthikanti's without the s^2 terms (ring attention keeps only the
# blocks' log-sum-exp): 34 s b h / P bytes per layer, plus the fp32 logits of s/P tokens.

GPT2_SMALL = ModelSpec(12, 768, 12, 50257, 1024)


def cp_comm_bytes_per_layer(m, P, b=1, kv_heads=None):
    """Bytes one GPU sends per layer and microbatch, forward and backward, at P GPUs along the
    sequence: {"tp_sp", "ring", "ulysses"} (the formulas above)."""
    h, s = m.n_embd, m.seq_len
    h_kv = h * (kv_heads or m.n_head) / m.n_head
    return dict(tp_sp=8 * (P - 1) / P * 2 * b * s * h, ring=6 * (P - 1) / P * 2 * b * s * h_kv,
                ulysses=4 * (P - 1) / P ** 2 * 2 * b * s * (h + h_kv))


def cp_memory_per_gpu(m, P, b=1, tp=1, zero1=False):
    """Bytes on one GPU of cp = P (or, with tp = P and cp = 1, Megatron's tp + sp): 2 + 4 + 12 bytes
    per parameter of its tp shard (ZeRO-1: 12 / P), the layers' activations of s / (cp tp) tokens
    with no s^2 term, and the fp32 logits of its tokens."""
    cp = P if tp == 1 else 1
    n = params_exact(m) / tp
    tokens = m.seq_len * b / (cp * tp)
    acts = m.n_layer * tokens * m.n_embd * 34
    return 2 * n + 4 * n + 12 * n / (cp if zero1 else 1) + acts + 4 * tokens * m.vocab_size


def cp_step_seconds(m, P, b=1, balance=1.0, kv_heads=None, c=Cluster()):
    """One microbatch's forward and backward on one of P GPUs of cp: the projections' FLOPs (eq. 3's
    24 b s h^2 per layer, three times) over P at the GEMM rate; the attention's (4 b s^2 h, three times)
    over P times the split's balance factor (the busiest rank's work over the mean: 2 - 1/P contiguous,
    1 for Megatron's split), overlapped with the ring's messages over NVLink: the longer of the two."""
    l, h, s = m.n_layer, m.n_embd, m.seq_len
    rate = c.gemm_tflops * 1e12
    proj = 3 * 24 * b * s * h * h / P / rate
    attn = 3 * 4 * b * s * s * h / P * balance / rate
    ring = cp_comm_bytes_per_layer(m, P, b, kv_heads)["ring"] / (c.nvlink_gbs * 1e9)
    return l * (proj + max(attn, ring))


def cp_longest_sequence(m, P, budget, tp=False, b=1, zero1=False):
    """The longest s, a multiple of 2 P (Megatron's split), whose memory per GPU fits `budget` bytes: at
    cp = P, or with tp = P (Megatron's tp + sp: None where P does not divide the heads)."""
    if tp and m.n_head % P:
        return None
    fits = lambda s: cp_memory_per_gpu(m._replace(seq_len=s), P, b, P if tp else 1, zero1) <= budget  # noqa: E731
    lo, hi, step = 0, 2 * P, 2 * P
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def context_report(c=Cluster(), m=GPT2_SMALL, s=32768):
    """--plan context: 08's figures for GPT-2 small (12 heads, each with its own keys and values)."""
    m = m._replace(seq_len=s)
    out = [f"context parallelism (08) for GPT-2 small: l={m.n_layer} h={m.n_embd} a={m.n_head} V={m.vocab_size}, "
           f"b=1, bf16 (the position table grown to s rows); {c.gpu_mem_gb:g} GB GPUs, NVLink {c.nvlink_gbs:g} GB/s",
           f"\nmemory per GPU and the step's estimate at s={s:,} (Megatron's split: balance 1; contiguous: 2 - 1/P):",
           "      P   weights+grads+Adam  activations+logits   step (balanced)   step (contiguous)"]
    for P in (1, 2, 4, 8):
        n = params_exact(m)
        act = cp_memory_per_gpu(m, P) - 18 * n
        out.append(f"  cp={P}  {18 * n / 1e9:12.2f} GB {act / 1e9:16.2f} GB {cp_step_seconds(m, P) * 1e3:14.1f} ms "
                   f"{cp_step_seconds(m, P, balance=2 - 1 / P) * 1e3:16.1f} ms")
    full, light = (flops_per_iteration(m, 1, mode) for mode in ("full", "lightseq"))
    out.append(f"  --recompute lightseq against full: {(full - light) / 1e12:.1f} TFLOP a sequence fewer, the attention's "
               f"forward not rerun (4 b s^2 h l): {(full - light) / full:.0%} of full's FLOPs, and the ring's forward "
               f"messages not sent again")
    out.append(f"\nbytes one GPU sends per layer, forward and backward, at s={s:,}, P=8 (formulas in planner.py):")
    for kv, what in ((m.n_head, f"GPT-2: {m.n_head} KV heads"), (1, "one KV head (multi-query)")):
        x = cp_comm_bytes_per_layer(m, 8, kv_heads=kv)
        out.append(f"  {what:28s} tp+sp {x['tp_sp'] / 1e6:8.1f} MB   ring {x['ring'] / 1e6:8.1f} MB   Ulysses "
                   f"{x['ulysses'] / 1e6:8.1f} MB   tp+sp / ring = {x['tp_sp'] / x['ring']:.2f}")
    budget = c.gpu_mem_gb * 1e9
    out.append(f"\nthe longest sequence whose memory fits {c.gpu_mem_gb:g} GB per GPU:")
    base = cp_longest_sequence(m, 1, budget)
    for P in (1, 2, 4, 8):
        cp_s, tp_s = cp_longest_sequence(m, P, budget), cp_longest_sequence(m, P, budget, tp=True)
        out.append(f"  P={P}: cp {cp_s:>10,} ({cp_s / base:.2f}x)   tp+sp "
                   + (f"{tp_s:>10,} ({tp_s / base:.2f}x)" if tp_s else f"{'cannot':>10s} ({m.n_head} heads over tp={P})"))
    out += ["\nLightSeq's claims (Li et al. 2023): up to 4.7x less communication than Megatron-LM on popular LLMs, "
            "and 2-8x longer sequences on models with fewer heads.",
            "  - longer: activations fall as 1/P either way; tp + sp is bounded by the heads (tp must divide them: "
            "no tp=8 with 12 heads) and by one node, cp by neither;",
            "  - less communication: the ring sends keys and values only, so its advantage is a / kv_heads times "
            "larger with grouped or multi-query attention (Llama-2 70B: 8 KV heads of 64);",
            "    our GPT-2 has as many KV heads as heads, so here the ring sends 3/4 of tp + sp's bytes, not 1/4.7: the "
            "4.7x needs fewer KV heads than heads."]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# The report and the command line


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
    busy = est["gemm"] + est["memory"] + est["tp"]
    out = [f"model: {f'{row.billions}B of Table 1, ' if row else ''}l={m.n_layer} h={m.n_embd} "
           f"a={m.n_head} V={m.vocab_size} s={m.seq_len}; {n_gpus} GPUs of {c.gpu_mem_gb:g} GB, "
           f"{c.gpus_per_node} per node",
           f"parameters: {P / 1e9:,.1f} B (eq. 2); 01's GPT-2 has exactly {params_exact(m):,}",
           f"layout ({'given' if layout else 'best-ranked'}): tp={L.tp} pp={L.pp} dp={L.dp} "
           f"v={L.v} b={L.b} B={batch} -> m={L.m} microbatches per pipeline",
           f"  recompute={L.recompute_mode} sequence_parallel={L.sequence_parallel} zero1={L.zero1} "
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
            f"{bubble_fraction(L.pp, L.m, L.v):.1%}; 02's replay with the model's times and "
            f"messages: {est['bubble'] / busy:.1%}",
            "communication sent per GPU per iteration:",
            f"  tp all-reduce {gb(comm['tp'])}   "
            f"{6 if L.recompute_mode == 'full' else 4} per layer and microbatch",
            f"  pp p2p        {gb(comm['pp'])}   act + grad per microbatch per chunk"
            + (" / tp" if _p2p_split(L) > 1 else ""),
            f"  dp gradients  {gb(comm['dp'])}   " + ("reduce-scatter fp32 + all-gather bf16"
                                                    if L.zero1 else "all-reduce fp32"),
            f"estimated iteration: {est['total']:.3g} s = GEMMs {est['gemm']:.3g} + memory-bound "
            f"{est['memory']:.3g} + tp {est['tp']:.3g} + bubble {est['bubble']:.3g} + dp "
            f"{est['dp']:.3g} + optimizer {est['optimizer']:.3g} -> {est['tflops']:.0f} TFLOP/s per GPU"]
    rates = [("estimated", est["tflops"]), ("Table 1's", row and row.tflops), ("given", tflops)]
    out.append(f"training time for {tokens / 1e9:g}B tokens (eq. 4): " + ", ".join(
        f"{training_days(tokens, P, n_gpus, x, L.recompute):.1f} days at {how} {x:.0f} TFLOP/s"
        for how, x in rates if x))
    out += model_constants(c)
    out += [f"best {min(top, len(ranked))} of {len(ranked)} runnable layouts (tp <= "
            f"{c.gpus_per_node}, fitting in memory), by estimated throughput:",
            "     tp    pp    dp      m  bubble       memory   iteration  TFLOP/s"]
    out += [f"  {r.tp:5d} {r.pp:5d} {r.dp:5d} {r.m:6d} {bubble_fraction(r.pp, r.m, r.v):7.1%} "
            f"{gb(memory_per_gpu(m, r)['total'])} {e['total']:9.3g} s {e['tflops']:8.0f}"
            for r, e in ranked[:top]]
    return "\n".join(out)


def add_plan_args(parser):
    """--plan NAME|custom, --gpus N and --plan-* options; model flags the parser has (05's
    --n-layer etc. from GPTConfig) are reused for `custom`, not added twice."""
    g = parser.add_argument_group("planner: --plan prints estimates and exits, allocating nothing")
    g.add_argument("--plan", metavar="NAME", help=f"a model of Table 1 ({', '.join(PAPER_CONFIGS)}, "
                   f"or 1T), or custom (the model flags), or table5 (07's vocabulary parallelism against "
                   f"Yeung et al.'s Table 5), or v-half (its setting with 06's V-Half), or context (08's context parallelism for GPT-2 small)")
    g.add_argument("--gpus", type=int, default=None, help="n GPUs (default: Table 1's for the model)")
    for flag, _ in MODEL_FLAGS:
        if flag not in parser._option_string_actions:
            g.add_argument(flag, type=int, default=None, help="model size for --plan custom")
    g.add_argument("--plan-layout", metavar="TP,PP,DP",
                   help="estimate this layout (default: the best-ranked)")
    g.add_argument("--plan-batch", type=int, help="global batch B in sequences (default: Table 1's)")
    g.add_argument("--plan-micro-batch", type=int, default=1, help="micro-batch size b")
    g.add_argument("--plan-v", type=int, default=1, help="virtual stages per pipeline rank")
    g.add_argument("--plan-recompute", choices=RECOMPUTE, default="full",
                   help="activation recomputation: whole layers (the paper's runs), the attention "
                   "core (Korthikanti), or none")
    for name, what in (("sequence-parallel", "sequence parallelism"),
                       ("zero1", "the ZeRO-1 distributed optimizer"),
                       ("scatter-gather", "scatter/gather of pipeline messages over tp")):
        g.add_argument(f"--plan-{name}", default=name == "scatter-gather",
                       action=argparse.BooleanOptionalAction, help=f"assume {what}")
    g.add_argument("--plan-tokens", type=float, default=300e9, help="training tokens T for eq. 4")
    g.add_argument("--plan-tflops", type=float, help="also give the training time at this many "
                   "TFLOP/s per GPU")
    g.add_argument("--plan-gpu-mem", type=float, default=80.0, help="GB of memory per GPU")


def plan_from_args(args):
    """plan_report for the options of add_plan_args, after check_plan_args has refused bad ones;
    --plan table5: vocab_report."""
    if args.plan == "table5":
        return vocab_report(Cluster(gpu_mem_gb=args.plan_gpu_mem))
    if args.plan == "v-half":
        return v_half_report(Cluster(gpu_mem_gb=args.plan_gpu_mem))
    if args.plan == "context":
        return context_report(Cluster(gpu_mem_gb=args.plan_gpu_mem))
    spec, n_gpus, layout, batch, options = check_plan_args(args)
    return plan_report(spec, n_gpus, layout, batch, args.plan_tokens, args.plan_tflops,
                       Cluster(gpu_mem_gb=args.plan_gpu_mem), **options)


# The GPUs whose dense bf16 peak an MFU figure divides by (the trainer shows MFU on these).
PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}
