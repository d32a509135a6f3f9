"""Bias + GeLU (tanh approximation): y -> gelu(y + b), the MLP's first elementwise op.

Megatron fuses it (Narayanan et al. 2021, Section 4.2: "we fuse ... bias + GeLU"): unfused, y + b
makes a trip to memory and back before the GeLU reads it. The kernel is kernels/bias_gelu.cu;
this file holds the reference (the same formulas in PyTorch, forward and backward), the binding,
and one autograd Function that runs either. Backward recomputes y + b rather than storing it.
"""
import math

import torch

from . import build

K0, K1 = math.sqrt(2 / math.pi), 0.044715


# ----------------------------------------------------------------------------------------------
# Reference: the kernel's formulas, in PyTorch (any device, any float dtype)


def reference_forward(y, b):
    z = y + b
    return 0.5 * z * (1 + torch.tanh(K0 * (z + K1 * z**3)))


def reference_backward(grad, y, b):
    """(dy, db): d gelu(z) / dz = 0.5 (1 + t) + 0.5 z (1 - t^2) K0 (1 + 3 K1 z^2), t = tanh(u)."""
    z = y + b
    t = torch.tanh(K0 * (z + K1 * z**3))
    dy = grad * (0.5 * (1 + t) + 0.5 * z * (1 - t * t) * K0 * (1 + 3 * K1 * z * z))
    return dy, dy.reshape(-1, b.numel()).sum(0)


# ----------------------------------------------------------------------------------------------
# Kernel: the binding, and calls that write into given outputs (so tests can poison them)

BINDING = r"""
extern "C" const char* bias_gelu_forward(int, const void*, const void*, void*, int64_t, int64_t, int, void*);
extern "C" const char* bias_gelu_backward(int, const void*, const void*, const void*, void*, int64_t, int64_t,
                                          int, void*);
void forward(torch::Tensor y, torch::Tensor b, torch::Tensor out, int64_t dtype, int64_t aligned, int64_t stream) {
  ON_DEVICE_OF(y);
  check(bias_gelu_forward(dtype, y.data_ptr(), b.data_ptr(), out.data_ptr(), y.numel(), b.numel(), aligned,
                          as_stream(stream)), "bias_gelu_forward");
}
void backward(torch::Tensor grad, torch::Tensor y, torch::Tensor b, torch::Tensor dy, int64_t dtype,
              int64_t aligned, int64_t stream) {
  ON_DEVICE_OF(grad);
  check(bias_gelu_backward(dtype, grad.data_ptr(), y.data_ptr(), b.data_ptr(), dy.data_ptr(), y.numel(),
                           b.numel(), aligned, as_stream(stream)), "bias_gelu_backward");
}
"""
FUNCTIONS = ("forward", "backward")


def unsupported(y, b, target="cuda"):
    return build.unsupported(y, b, target=target) or (None if y.shape[-1] == b.numel() else
                                       f"the bias has {b.numel()} elements, the rows {y.shape[-1]}")


def kernel_forward(ext, y, b, out):
    ext.forward(y, b, out, build.code(y), build.aligned(y, b, out), build.stream(y))


def kernel_backward(ext, grad, y, b, dy):
    ext.backward(grad, y, b, dy, build.code(y), build.aligned(grad, y, b, dy), build.stream(y))


# ----------------------------------------------------------------------------------------------
# Autograd and dispatch


class BiasGelu(torch.autograd.Function):
    """gelu(y + b) forward; (grad * gelu'(y + b), its column sum) backward. ext=None: reference."""

    @staticmethod
    def forward(ctx, y, b, ext):
        y, b = y.contiguous(), b.contiguous()
        ctx.save_for_backward(y, b)
        ctx.ext = ext
        if ext is None:
            return reference_forward(y, b)
        out = torch.empty_like(y)
        kernel_forward(ext, y, b, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        y, b = ctx.saved_tensors
        if ctx.ext is None:
            dy, db = reference_backward(grad, y, b)
        else:
            dy = torch.empty_like(y)
            kernel_backward(ctx.ext, grad.contiguous(), y, b, dy)
            db = dy.reshape(-1, b.numel()).sum(0)  # the bias gradient: a column sum, left to torch
        return dy, db, None


def bias_gelu(y, b, mode="auto"):
    """gelu_tanh(y + b) for y (..., n) and b (n,); mode as in kernels/build.py."""
    ext = build.use_kernel(mode, "bias_gelu", unsupported(y, b, build.target(mode)), BINDING, FUNCTIONS)
    return BiasGelu.apply(y, b, ext)
