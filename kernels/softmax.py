"""Scaled causal softmax: scores (..., T, T) -> softmax(scale * scores) with key j > query i masked.

Attention without flash computes probs = softmax(mask(q k^T / sqrt(hs))) as a (B, nh, T, T) tensor.
Megatron fuses the scale, the causal mask and the softmax into one kernel (Narayanan et al. 2021,
Section 4.2: "scale, mask, and softmax"; its scaled_upper_triang_masked_softmax): unfused, the
scaled and the masked scores each make a trip to memory and back. The kernel is kernels/softmax.cu;
this file holds the reference (the same formulas in PyTorch, forward and backward), the binding,
and one autograd Function that runs either. Backward needs only the output y, which is saved:
dx = scale * y * (g - sum_j g_j y_j), zero where masked since y is.
"""
import math

import torch

from . import build

MAX_T = 4096  # softmax.cu's MAX_T: backward caches two fp32 rows of T in a block's 48 KB of shared memory


# ----------------------------------------------------------------------------------------------
# Reference: the kernel's formulas, in PyTorch (any device, any float dtype; fp32 math at least)


def causal_mask(T, device):
    """(T, T), True where key j comes after query i: the entries softmax must not see."""
    return torch.ones(T, T, dtype=torch.bool, device=device).triu(1)


def _at_least_fp32(t):  # the kernel computes in fp32 whatever it loads, so the reference does too
    return t.to(torch.promote_types(t.dtype, torch.float32))


def reference_forward(x, scale):
    z = (scale * _at_least_fp32(x)).masked_fill(causal_mask(x.shape[-1], x.device), -math.inf)
    e = (z - z.amax(-1, keepdim=True)).exp()  # the diagonal is never masked: the max is finite
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)


def reference_backward(grad, y, scale):
    """dx = scale * y * (g - sum_j g_j y_j): the softmax Jacobian applied to g, times the scale."""
    g, y32 = _at_least_fp32(grad), _at_least_fp32(y)
    return (scale * y32 * (g - (g * y32).sum(-1, keepdim=True))).to(y.dtype)


# ----------------------------------------------------------------------------------------------
# Kernel: the binding, and calls that write into given outputs (so tests can poison them)

BINDING = r"""
extern "C" const char* softmax_forward(int, const void*, void*, int64_t, int64_t, float, void*);
extern "C" const char* softmax_backward(int, const void*, const void*, void*, int64_t, int64_t, float, void*);
void forward(torch::Tensor x, torch::Tensor y, double scale, int64_t dtype, int64_t stream) {
  ON_DEVICE_OF(x);
  const int64_t T = x.size(-1);
  check(softmax_forward(dtype, x.data_ptr(), y.data_ptr(), x.numel() / T, T, (float)scale, as_stream(stream)),
        "softmax_forward");
}
void backward(torch::Tensor grad, torch::Tensor y, torch::Tensor dx, double scale, int64_t dtype,
              int64_t stream) {
  ON_DEVICE_OF(grad);
  const int64_t T = y.size(-1);
  check(softmax_backward(dtype, grad.data_ptr(), y.data_ptr(), dx.data_ptr(), y.numel() / T, T, (float)scale,
                         as_stream(stream)), "softmax_backward");
}
"""
FUNCTIONS = ("forward", "backward")


def unsupported(x, target="cuda"):
    """Why the kernel cannot take x, or None. Shape first, so the reason names it on any device."""
    T, rows = x.shape[-1], x.numel() // max(x.shape[-1], 1)
    if T > MAX_T:
        return f"T={T} is above the kernel's limit of {MAX_T} (a row must fit in shared memory)"
    if rows >= 2**31:
        return f"{rows} rows exceed the 2^31 - 1 blocks of one launch"
    return build.unsupported(x, target=target)


def kernel_forward(ext, x, scale, out):
    ext.forward(x, out, scale, build.code(x), build.stream(x))


def kernel_backward(ext, grad, y, scale, dx):
    ext.backward(grad, y, dx, scale, build.code(y), build.stream(y))


# ----------------------------------------------------------------------------------------------
# Autograd and dispatch


class ScaledMaskedSoftmax(torch.autograd.Function):
    """Causal softmax(scale * x) forward, scale * y * (g - sum g y) backward. ext=None: the reference."""

    @staticmethod
    def forward(ctx, x, scale, ext):
        x = x.contiguous()
        if ext is None:
            y = reference_forward(x, scale)
        else:
            y = torch.empty_like(x)
            kernel_forward(ext, x, scale, y)
        ctx.save_for_backward(y)
        ctx.scale, ctx.ext = scale, ext
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        if ctx.ext is None:
            return reference_backward(grad, y, ctx.scale), None, None
        dx = torch.empty_like(y)
        kernel_backward(ctx.ext, grad.contiguous(), y, ctx.scale, dx)
        return dx, None, None


def scaled_masked_softmax(x, scale, mode="auto"):
    """Causal softmax(scale * x) over the last dim of attention scores x (..., T, T); mode as in
    kernels/build.py. Row i of each (T, T) block is query i; keys j > i get probability 0."""
    if x.dim() < 2 or x.shape[-1] != x.shape[-2] or x.shape[-1] == 0:
        raise ValueError(f"attention scores must be (..., T, T) with T >= 1, got shape {tuple(x.shape)}")
    ext = build.use_kernel(mode, "softmax", unsupported(x, build.target(mode)), BINDING, FUNCTIONS)
    return ScaledMaskedSoftmax.apply(x, float(scale), ext)
