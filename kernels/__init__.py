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

FusedOps plugs the families into the GPT of 01 (which takes any object with Ops' methods):
    model = GPT(cfg, group, ops=kernels.FusedOps("auto"))
"""
import importlib
import math

import torch
import torch.nn.functional as F

from . import build

FAMILY_NAMES = ("bias_gelu", "bias_dropout_add", "softmax", "layernorm")


def families():
    return [importlib.import_module(f"{__name__}.{name}") for name in FAMILY_NAMES]


def prebuild(mode="auto"):
    """Compile every family now, rather than at its first use inside the first forward: a cold
    build takes minutes, and meanwhile the other pipeline stages would sit in posted receives
    under the collective timeout. Nothing to do for mode "reference" or without CUDA. Returns the
    families built."""
    if mode == "reference" or not torch.cuda.is_available():
        return []
    return [name for name, family in zip(FAMILY_NAMES, families())
            if build.built(mode, name, family.BINDING, family.FUNCTIONS)]


class FusedOps:
    """01's Ops with every elementwise piece fused. mode: "auto" (kernels on CUDA tensors, the
    references elsewhere), "cuda" (kernels or an error), "reference" (the references: same math,
    PyTorch). flash=True keeps attention in PyTorch's scaled_dot_product_attention; flash=False
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
