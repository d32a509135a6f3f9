"""LayerNorm over the last dim, y = (x - mean) * rstd * w + b, with fp32 statistics.

Megatron-LM fuses it (megatron/fused_kernels/layer_norm_cuda_kernel.cu, taken from Apex) for
the reason Narayanan et al. 2021, Section 4.2 gives for its elementwise fusions: unfused, the mean,
the variance, the normalisation and the affine map each make a trip through memory. The kernel
is kernels/layernorm.cu; this file holds the reference (the same formulas in PyTorch, forward and
backward), the binding, and one autograd Function that runs either.

Forward keeps mean and rstd = 1 / sqrt(var + eps) (var biased, as torch) per row, in fp32;
backward recomputes xhat = (x - mean) * rstd from them. With gy = g * w:
    dx = rstd * (gy - mean_c(gy) - xhat * mean_c(gy * xhat))
    dw = sum_rows(g * xhat),  db = sum_rows(g)
The kernel's dw and db arrive as per-block partial sums, (2, G, C) fp32, which torch adds up.
"""
import functools

import torch

from . import build

# Shared memory per block: the forward keeps a row of C fp32, the backward two (its dw and db sums),
# and each kernel has STATIC_SMEM_BYTES of its own (scratch[32] of fp32; ptxas -v reports it, and
# tests/test_kernel_layernorm.py checks it). Up to 48 KiB a launch needs nothing; beyond, the
# launcher opts in, up to what the device allows one block: 99 KiB on sm_86 and sm_89, 163 KiB on
# an A100, 227 KiB on an H100 or H200. So the longest row is the device's (max_columns): 29,040 on
# an H100, which takes the paper's largest hidden sizes, 20,480 and 25,600; 20,848 on an A100.
STATIC_SMEM_BYTES = 32 * 4
DEFAULT_SMEM_BYTES = 48 * 1024  # what any block may use: assumed if torch does not report the opt-in limit
BACKWARD_BLOCKS_PER_SM = 2


def max_columns(block_smem_bytes):
    """The longest row both kernels take when a block may use `block_smem_bytes` of shared memory:
    the backward's 2 C fp32 and its static bytes must fit (the forward needs less)."""
    return (block_smem_bytes - STATIC_SMEM_BYTES) // (2 * 4)


def block_smem_limit(device):
    """(shared memory one block may use on this GPU with the opt-in, in bytes; the GPU's name);
    a CPU device: the GPU mode "simt" emulates."""
    if isinstance(device, torch.device) and device.type == "cpu":
        props = build.device_properties(device)
        return props.shared_memory_per_block_optin, props.name
    return _cuda_block_smem_limit(device.index if isinstance(device, torch.device) else device)


@functools.lru_cache(maxsize=None)
def _cuda_block_smem_limit(device_index):
    props = torch.cuda.get_device_properties(device_index if device_index is not None else torch.cuda.current_device())
    return getattr(props, "shared_memory_per_block_optin", DEFAULT_SMEM_BYTES), props.name


# ----------------------------------------------------------------------------------------------
# Reference: the kernel's formulas, in PyTorch (any device; float64 stays float64, every other
# dtype is computed in fp32 as the kernel does)


def accumulation_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def reference_forward(x, w, b, eps):
    """(y, mean, rstd) for x (rows, C): y like x, mean and rstd (rows,) in the accumulation dtype."""
    xf = x.to(accumulation_dtype(x))
    mean = xf.mean(-1)
    centered = xf - mean[:, None]
    rstd = torch.rsqrt((centered * centered).mean(-1) + eps)  # two passes, as the kernel
    y = centered * rstd[:, None] * w.to(xf.dtype) + b.to(xf.dtype)
    return y.to(x.dtype), mean, rstd


def reference_backward(g, x, w, mean, rstd):
    """(dx, dw, db) for g, x (rows, C) and forward's mean, rstd (rows,)."""
    gf = g.to(mean.dtype)
    xhat = (x.to(mean.dtype) - mean[:, None]) * rstd[:, None]
    gy = gf * w.to(mean.dtype)
    dx = rstd[:, None] * (gy - gy.mean(-1, keepdim=True) - xhat * (gy * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (gf * xhat).sum(0).to(w.dtype), gf.sum(0).to(w.dtype)


# ----------------------------------------------------------------------------------------------
# Kernel: the binding, and calls that write into given outputs (so tests can poison them)

BINDING = r"""
extern "C" const char* layernorm_forward(int, const void*, const void*, const void*, void*, float*, float*,
                                         int64_t, int64_t, float, void*);
extern "C" const char* layernorm_backward(int, const void*, const void*, const void*, const float*,
                                          const float*, void*, float*, int64_t, int64_t, int64_t, void*);
void forward(torch::Tensor x, torch::Tensor w, torch::Tensor b, torch::Tensor y, torch::Tensor mean,
             torch::Tensor rstd, double eps, int64_t dtype, int64_t stream) {
  ON_DEVICE_OF(x);
  check(layernorm_forward(dtype, x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(),
                          mean.data_ptr<float>(), rstd.data_ptr<float>(), x.size(0), x.size(1), (float)eps,
                          as_stream(stream)), "layernorm_forward");
}
void backward(torch::Tensor g, torch::Tensor x, torch::Tensor w, torch::Tensor mean, torch::Tensor rstd,
              torch::Tensor dx, torch::Tensor partial, int64_t dtype, int64_t stream) {
  ON_DEVICE_OF(g);
  check(layernorm_backward(dtype, g.data_ptr(), x.data_ptr(), w.data_ptr(), mean.data_ptr<float>(),
                           rstd.data_ptr<float>(), dx.data_ptr(), partial.data_ptr<float>(), x.size(0),
                           x.size(1), partial.size(1), as_stream(stream)), "layernorm_backward");
}
"""
FUNCTIONS = ("forward", "backward")


def unsupported(x, w, b, target="cuda"):
    """Why the kernel cannot take these tensors, or None. The shape checks come first: they hold
    on any device, so they can be tested without a GPU; the row length's limit is the GPU's (for
    target "simt", the emulated one's)."""
    if x.dim() == 0 or x.numel() == 0:
        return "x has no rows to normalise"
    C = x.shape[-1]
    if w.shape != (C,) or b.shape != (C,):
        return f"w and b must have shape ({C},), got {tuple(w.shape)} and {tuple(b.shape)}"
    reason = build.unsupported(x, w, b, target=target)
    if reason:
        return reason
    limit, name = block_smem_limit(x.device if target == "simt" else
                                   (x.device.index if x.device.index is not None else torch.cuda.current_device()))
    if C > max_columns(limit):
        return (f"rows of {C} elements need {2 * 4 * C + STATIC_SMEM_BYTES:,} bytes of shared memory per block "
                f"(the backward's), more than this GPU ({name}) allows one block, {limit:,}: rows of up to "
                f"{max_columns(limit):,} elements")
    return None


def backward_blocks(rows, device):
    """G, the backward grid: about 2 blocks per SM, never more than there are rows."""
    sms = build.device_properties(device).multi_processor_count
    return max(1, min(rows, BACKWARD_BLOCKS_PER_SM * sms))


def kernel_forward(ext, x, w, b, eps, y, mean, rstd):
    """x, y: (rows, C); mean, rstd: (rows,) fp32."""
    ext.forward(x, w, b, y, mean, rstd, eps, build.code(x), build.stream(x))


def kernel_backward(ext, g, x, w, mean, rstd, dx, partial):
    """g, x, dx: (rows, C); partial: (2, G, C) fp32, each block's sums of g * xhat and of g."""
    ext.backward(g, x, w, mean, rstd, dx, partial, build.code(x), build.stream(x))


# ----------------------------------------------------------------------------------------------
# Autograd and dispatch


class LayerNorm(torch.autograd.Function):
    """(x - mean) * rstd * w + b over the last dim forward; (dx, dw, db) above backward.
    ext=None: reference."""

    @staticmethod
    def forward(ctx, x, w, b, eps, ext):
        C = x.shape[-1]
        x2, w, b = x.reshape(-1, C).contiguous(), w.contiguous(), b.contiguous()  # x2: (rows, C)
        if ext is None:
            y, mean, rstd = reference_forward(x2, w, b, eps)
        else:
            y = torch.empty_like(x2)
            mean = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
            rstd = torch.empty_like(mean)
            kernel_forward(ext, x2, w, b, eps, y, mean, rstd)
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.ext = ext
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x2, w, mean, rstd = ctx.saved_tensors
        g2 = grad.reshape(x2.shape).contiguous()
        if ctx.ext is None:
            dx, dw, db = reference_backward(g2, x2, w, mean, rstd)
        else:
            dx = torch.empty_like(x2)
            G = backward_blocks(x2.shape[0], x2.device)
            partial = torch.empty(2, G, x2.shape[1], dtype=torch.float32, device=x2.device)
            kernel_backward(ctx.ext, g2, x2, w, mean, rstd, dx, partial)
            # The last reduction, over G ~ 2 * SMs rows, is small next to the kernel's pass over
            # (rows, C); torch's column sum does it in fp32 (and deterministically), then one
            # rounding to w's dtype.
            dw, db = partial.sum(1).to(w.dtype)
        return dx.reshape(grad.shape), dw, db, None, None


def layer_norm(x, w, b, eps=1e-5, mode="auto"):
    """(x - mean) * rstd * w + b over the last dim, x (..., C), w and b (C,); mode as in
    kernels/build.py. The kernel wants w and b in x's dtype; otherwise "auto" runs the reference."""
    ext = build.use_kernel(mode, "layernorm", unsupported(x, w, b, build.target(mode)), BINDING, FUNCTIONS)
    return LayerNorm.apply(x, w, b, eps, ext)
