"""kernels/: fused CUDA kernels written by hand (no Triton, no torch.compile), and CUDA graphs.

Narayanan et al. 2021, Section 4.2: Megatron fuses the memory-bound elementwise chains of a
transformer layer into single kernels (bias + GeLU, bias + dropout + residual add, scale + mask +
softmax) and credits fusion with 11-19% of its throughput. One family per pair of files:
    bias_gelu         gelu_tanh(y + b)
    bias_dropout_add  residual + dropout(y + b), the mask a hash of (seed, index): replayed, never stored
    softmax           softmax(scale * x) under the causal mask, the attention path without flash
    layernorm         LayerNorm with fp32 statistics
Each <family>.cu is plain CUDA C++ (nvcc alone compiles it); <family>.py holds the PyTorch
reference of the same formulas, the thin torch binding and the autograd Function. build.py
compiles at first use and dispatches; graphs.py captures CUDA graphs.

fuse() plugs them into a GPT of 01 (its one seam: 01's layers are written with plain PyTorch ops):
    model = kernels.fuse(GPT(cfg, group), kernels.FusedOps("auto"))
"""
import concurrent.futures
import contextlib
import functools
import importlib
import math

import torch
import torch.nn.functional as F
from einops import rearrange

from . import build

FAMILY_NAMES = ("bias_gelu", "bias_dropout_add", "softmax", "layernorm")


def families():
    return [importlib.import_module(f"{__name__}.{name}") for name in FAMILY_NAMES]


def prebuild(mode="auto"):
    """Compile every family now, rather than at its first use inside the first forward: a cold
    build takes minutes, and meanwhile the other pipeline stages would sit in posted receives
    under the collective timeout. The four build at once, each in a thread of its own (each
    compile is a process of torch's ninja: the threads only wait), on this thread's device.
    Nothing to do for mode "reference" or without CUDA; mode "simt" builds the emulator's, one
    after another (g++ processes on the CPU the run itself needs). Returns the families built."""
    if mode == "simt":
        from . import simt

        for family in families():
            simt.extension(family.__name__.split(".")[-1], family.BINDING, family.FUNCTIONS)
        return list(FAMILY_NAMES)
    if mode == "reference" or not torch.cuda.is_available():
        return []
    device = torch.cuda.current_device()

    def one(name, family):
        torch.cuda.set_device(device)  # a new thread starts on device 0; the probe runs on this one
        return build.built(mode, name, family.BINDING, family.FUNCTIONS)

    with concurrent.futures.ThreadPoolExecutor(len(FAMILY_NAMES)) as pool:
        built = list(pool.map(one, FAMILY_NAMES, families()))
    return [name for name, ext in zip(FAMILY_NAMES, built) if ext]


class FusedOps:
    """Every elementwise piece of a block fused. mode: "auto" (kernels on CUDA tensors, the
    references elsewhere), "cuda" (kernels or an error), "reference" (the references: same math,
    PyTorch), "simt" (the kernels' CUDA source run on CPU tensors by kernels/simt, for tests).
    flash=True keeps attention in PyTorch's scaled_dot_product_attention; flash=False
    computes it as matmul -> fused scaled causal softmax -> dropout -> matmul, as Megatron does
    without flash attention."""

    def __init__(self, mode="auto", flash=True):
        if mode not in build.MODES:
            raise ValueError(f"kernel mode must be one of {build.MODES}, got {mode!r}")
        self.mode, self.flash = mode, flash
        self.bias_gelu_mod, self.bda_mod, self.softmax_mod, self.ln_mod = families()
        self.name = f"fused ({mode}{', flash attention' if flash else ', fused softmax attention'})"

    def layer_norm(self, x, w, b, eps):
        return self.ln_mod.layer_norm(x, w, b, eps, mode=self.mode)

    def bias_gelu(self, y, b):
        return self.bias_gelu_mod.bias_gelu(y, b, mode=self.mode)

    def bias_dropout_add(self, y, b, residual, p):
        return self.bda_mod.bias_dropout_add(y, b, residual, p, mode=self.mode)

    def attention(self, q, k, v, p):  # causal; q, k, v: (B, nh, T, hs)
        if self.flash:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        scores = q @ k.transpose(-2, -1)  # (B, nh, T, T), unscaled: the kernel scales
        probs = self.softmax_mod.scaled_masked_softmax(scores, 1 / math.sqrt(q.shape[-1]), mode=self.mode)
        return F.dropout(probs, p, p > 0) @ v  # (B, nh, T, hs)


# ----------------------------------------------------------------------------------------------
# The seam: Megatron's fused transformer layer, the same function as 01's Block with each
# elementwise chain one kernel. The bias of c_fc moves into the GeLU kernel, and each row-parallel
# layer's bias into the bias-dropout-add kernel, so those linears run without theirs.


def fuse(model, ops, overlap_input_grad=True):
    """Swap the forwards of model's 01 layers (LayerNorm, the attention core, Block) for ops' fused
    ones; overlap_input_grad: c_fc, computed here, overlaps as 01's optimize() does. Returns model."""
    tp = importlib.import_module("01_tensor_parallel")
    for m in model.modules():
        if isinstance(m, tp.LayerNorm):
            m.forward = functools.partial(_layer_norm, tp, m, ops)
        elif isinstance(m, tp.ParallelAttention):
            m.core = ops.attention
        elif isinstance(m, tp.Block):
            m.forward = functools.partial(_block, tp, m, ops, overlap_input_grad)
    return model


def _layer_norm(tp, ln, ops, x):
    return ops.layer_norm(x, tp.sp_param(ln.weight, ln.group, ln.sp), tp.sp_param(ln.bias, ln.group, ln.sp), 1e-5)


def _block(tp, block, ops, overlap, x):
    a, mlp, p = block.attn, block.mlp, block.p if block.training else 0.0
    q, k, v = rearrange(a.c_attn(block.ln_1(x)), "B T (three nh hs) -> three B nh T hs", three=3, hs=a.hs)
    pa = a.p if a.training else 0.0
    with a.rng.fork() if pa else contextlib.nullcontext():
        y = a.core(q, k, v, pa)  # (B, nh/tp, T, hs)
    x = _residual(block, ops, *_row(tp, a.c_proj, rearrange(y, "B nh T hs -> B T (nh hs)")), x, p)
    fc = mlp.c_fc  # its GEMM without the bias: the GeLU kernel adds it
    if overlap and tp.tp_size(fc.group) > 1:
        h = tp.OverlappedColumnLinear.apply(block.ln_2(x), fc.weight, None, fc.group, fc.sp)
    else:
        h = F.linear(tp.enter_tp(block.ln_2(x), fc.group, fc.sp), fc.weight)
    return _residual(block, ops, *_row(tp, mlp.c_proj, ops.bias_gelu(h, fc.bias)), x, p)


def _row(tp, linear, x):
    """A RowParallelLinear's output without its bias, and the bias (f on it with sp)."""
    return tp.exit_tp(F.linear(x, linear.weight), linear.group, linear.sp), tp.sp_param(linear.bias, linear.group, linear.sp)


def _residual(block, ops, y, bias, x, p):
    with block.rng.fork() if p and block.sp else contextlib.nullcontext():  # sp: the split stream
        return ops.bias_dropout_add(y, bias, x, p)
