"""Bias + dropout + residual add: residual + dropout(y + b), where each block's branches end.

Megatron fuses it into one kernel (Narayanan et al. 2021, Section 4.2, bias + dropout + add):
unfused, y + b, the mask, the dropped tensor and the sum each make a trip to memory. The kernel is
kernels/bias_dropout_add.cu; this file holds the reference (the same formulas in PyTorch, forward
and backward), the binding, and one autograd Function that runs either.

The mask is a pure function of (seed, flat element index): a counter-based hash, so nothing is
stored for backward (it regenerates the mask), and the reference draws exactly the kernel's mask.
The seed is a one-element int64 tensor on the device, drawn from the current default generator
(so 01's TPRandom.fork() decides it, and a CUDA graph's capture redraws it on each replay); the
kernel reads it through a pointer for the same reason.
"""
import math

import torch

from . import build

MASK32 = 0xFFFFFFFF
MAX_NUMEL = 2**32  # the hash takes a 32-bit element index


# ----------------------------------------------------------------------------------------------
# Reference: the kernel's formulas, in PyTorch (any device, any float dtype). The hash runs on
# int64 tensors holding uint32 values: both multipliers are < 2^31, so no product overflows.


def mix32(x):
    """The kernel's 32-bit finaliser: x ^= x >> 16; x *= 0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97;
    x ^= x >> 15, all mod 2^32. x: int64 tensor of values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


def random_bits(seed, shape):
    """bits(i) = mix32(mix32(i ^ k) + k), k = mix32(seed mod 2^32), for every flat index i of shape."""
    numel = math.prod(shape)
    if numel >= MAX_NUMEL:
        raise ValueError(f"dropout masks hash a 32-bit element index: {numel} elements, at most 2**32 - 1")
    key = mix32(seed.reshape(1) & MASK32)
    i = torch.arange(numel, device=seed.device, dtype=torch.int64).reshape(shape)
    return mix32((mix32(i ^ key) + key) & MASK32)


def dropout_constants(p):
    """(threshold, scale): element i is kept iff bits(i) >> 8 >= threshold = ceil(p 2^24), which
    happens with probability 1 - p up to 2^-24; kept elements are scaled by 1 / (1 - p)."""
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    return math.ceil(p * 2**24), (1 / (1 - p) if p < 1 else 0.0)


def keep_mask(seed, shape, p):
    threshold, _ = dropout_constants(p)
    return (random_bits(seed, shape) >> 8) >= threshold


def reference_forward(y, b, residual, seed, p):
    z = y + b
    if p == 0:  # eval: no mask to hash
        return residual + z
    _, scale = dropout_constants(p)
    return residual + torch.where(keep_mask(seed, y.shape, p), z * scale, 0)  # dropped: exactly 0


def reference_backward(grad, seed, p, n):
    """(dy, db) for b of n elements; d residual is grad itself."""
    if p == 0:
        dy = grad
    else:
        _, scale = dropout_constants(p)
        dy = torch.where(keep_mask(seed, grad.shape, p), grad * scale, 0)
    return dy, dy.reshape(-1, n).sum(0)


# ----------------------------------------------------------------------------------------------
# Kernel: the binding, and calls that write into given outputs (so tests can poison them)

BINDING = r"""
extern "C" const char* bias_dropout_add_forward(int, const void*, const void*, const void*,
                                                const int64_t*, void*, int64_t, int64_t, uint32_t, float, int,
                                                void*);
extern "C" const char* bias_dropout_add_backward(int, const void*, const int64_t*, void*, int64_t, uint32_t,
                                                 float, int, void*);
void forward(torch::Tensor y, torch::Tensor b, torch::Tensor residual, torch::Tensor seed, torch::Tensor out,
             int64_t threshold, double scale, int64_t dtype, int64_t aligned, int64_t stream) {
  ON_DEVICE_OF(y);
  check(bias_dropout_add_forward(dtype, y.data_ptr(), b.data_ptr(), residual.data_ptr(),
                                 seed.data_ptr<int64_t>(), out.data_ptr(), y.numel(), b.numel(),
                                 (uint32_t)threshold, (float)scale, aligned, as_stream(stream)),
        "bias_dropout_add_forward");
}
void backward(torch::Tensor grad, torch::Tensor seed, torch::Tensor dy, int64_t threshold, double scale,
              int64_t dtype, int64_t aligned, int64_t stream) {
  ON_DEVICE_OF(grad);
  check(bias_dropout_add_backward(dtype, grad.data_ptr(), seed.data_ptr<int64_t>(), dy.data_ptr(),
                                  grad.numel(), (uint32_t)threshold, (float)scale, aligned,
                                  as_stream(stream)), "bias_dropout_add_backward");
}
"""
FUNCTIONS = ("forward", "backward")


def unsupported(y, b, residual, target="cuda"):
    if y.numel() >= MAX_NUMEL:
        return f"the dropout hash takes a 32-bit element index: {y.numel()} elements, at most 2**32 - 1"
    return build.unsupported(y, b, residual, target=target)


def kernel_forward(ext, y, b, residual, seed, p, out):
    threshold, scale = dropout_constants(p)
    ext.forward(y, b, residual, seed, out, threshold, scale, build.code(y),
                build.aligned(y, b, residual, out), build.stream(y))


def kernel_backward(ext, grad, seed, p, dy):
    threshold, scale = dropout_constants(p)
    ext.backward(grad, seed, dy, threshold, scale, build.code(grad), build.aligned(grad, dy),
                 build.stream(grad))


# ----------------------------------------------------------------------------------------------
# Autograd and dispatch


class BiasDropoutAdd(torch.autograd.Function):
    """residual + keep * (y + b) / (1 - p) forward; (keep * grad / (1 - p), its column sum, grad)
    backward, keep regenerated from the saved seed. ext=None: reference."""

    @staticmethod
    def forward(ctx, y, b, residual, seed, p, ext):
        y, b, residual = y.contiguous(), b.contiguous(), residual.contiguous()
        ctx.save_for_backward(seed)
        ctx.p, ctx.n, ctx.ext = p, b.numel(), ext
        if ext is None:
            return reference_forward(y, b, residual, seed, p)
        out = torch.empty_like(y)
        kernel_forward(ext, y, b, residual, seed, p, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (seed,) = ctx.saved_tensors
        if ctx.ext is None:
            dy, db = reference_backward(grad, seed, ctx.p, ctx.n)
        else:
            dy = torch.empty_like(grad, memory_format=torch.contiguous_format)
            kernel_backward(ctx.ext, grad.contiguous(), seed, ctx.p, dy)
            db = dy.reshape(-1, ctx.n).sum(0)  # the bias gradient: a column sum, left to torch
        return dy, db, grad, None, None, None


def bias_dropout_add(y, b, residual, p, mode="auto", seed=None):
    """residual + dropout(y + b, p) for y, residual (..., n) and b (n,); p = 0 is eval (no mask).
    seed: an int or a one-element int64 tensor on y's device; None draws one from the default
    generator (not for p = 0, which leaves the generator untouched, as F.dropout does in eval)."""
    dropout_constants(p)  # refuses p outside [0, 1]
    if residual.shape != y.shape or b.shape != y.shape[-1:]:
        raise ValueError(f"expected y and residual (..., n) and b (n,), got {tuple(y.shape)}, "
                         f"{tuple(residual.shape)} and {tuple(b.shape)}")
    if seed is None:
        seed = (torch.randint(0, 2**31 - 1, (1,), device=y.device, dtype=torch.int64) if p > 0 else
                torch.zeros(1, device=y.device, dtype=torch.int64))
    elif isinstance(seed, int):
        # mod 2^32 (all the hash reads) fits any int in int64; a fill, so it can be graph-captured
        seed = torch.full((1,), seed % 2**32, device=y.device, dtype=torch.int64)
    elif seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != y.device:
        raise ValueError(f"seed must be an int or a one-element int64 tensor on {y.device}, "
                         f"got {seed.dtype} {tuple(seed.shape)} on {seed.device}")
    reason = unsupported(y, b, residual, build.target(mode))
    ext = build.use_kernel(mode, "bias_dropout_add", reason, BINDING, FUNCTIONS)
    return BiasDropoutAdd.apply(y, b, residual, seed, p, ext)
