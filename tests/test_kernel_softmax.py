"""kernels/softmax: the scaled causal softmax's reference equals masked_fill + torch.softmax, and the
whole non-flash attention path equals scaled_dot_product_attention; the dispatcher falls back above
the kernel's T limit; on a GPU the kernel matches the float64 reference and replays in a CUDA graph.

Tolerances. CPU, float64 (CPU_TOL = 1e-12): the reference and torch.softmax evaluate the same
formula in a different order (a few ulps, ~1e-16 relative); the attention path adds two matmuls of
short sums, still far below 1e-12, while a wrong mask or a missing scale is off by O(1e-2) or more.
GPU (GPU_TOL, max|kernel - ref| / max|ref| against the reference in float64 on the same rounded
inputs): fp32 1e-5, the kernel's fp32 exp and its sums over up to T = 2048 terms keep ~6 digits;
bf16 1e-2, the rounding of the stored result alone is 2^-9 ~ 2e-3 relative. The probabilities of
masked keys are compared exactly: the kernel writes 0 there, never a small number.
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import build, softmax
from conftest import CPU_TOL, GPU_TOL, KERNEL_MODES, kernel_device, kernel_extension, needs_cuda, randn, rel

F64 = torch.float64


def unfused(x, scale):
    """What the kernel replaces: scale, mask with -inf, softmax; three passes over (..., T, T)."""
    return torch.softmax((x * scale).masked_fill(softmax.causal_mask(x.shape[-1], x.device), -math.inf), -1)


# ----------------------------------------------------------------------------------------------
# Reference (CPU, float64)


@pytest.mark.parametrize("shape", [(1, 1), (7, 7), (2, 3, 5, 5), (2, 33, 33)])
def test_reference_equals_scale_mask_then_softmax_forward_and_gradient(shape):
    x, grad, scale = randn(*shape, seed=0) * 3, randn(*shape, seed=1), 0.37
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, out_b = softmax.scaled_masked_softmax(a, scale, mode="reference"), unfused(b, scale)
    out_a.backward(grad)
    out_b.backward(grad)
    assert rel(out_a, out_b) < CPU_TOL
    assert rel(a.grad, b.grad) < CPU_TOL


def test_keys_after_the_query_get_probability_exactly_zero_and_rows_sum_to_one():
    y = softmax.scaled_masked_softmax(randn(3, 6, 6, seed=2), 0.5, mode="reference")
    assert torch.equal(y.masked_select(softmax.causal_mask(6, y.device)), torch.zeros(3 * 15, dtype=F64))
    assert (y.tril() > 0).sum() == 3 * 21  # every visible key keeps some probability
    assert rel(y.sum(-1), torch.ones(3, 6, dtype=F64)) < CPU_TOL


def test_a_single_token_attends_only_to_itself_probability_one_gradient_zero():
    x = randn(2, 3, 1, 1, seed=3).requires_grad_()
    y = softmax.scaled_masked_softmax(x, 0.125, mode="reference")
    y.backward(randn(2, 3, 1, 1, seed=4))
    assert torch.equal(y, torch.ones_like(y))
    assert torch.equal(x.grad.abs(), torch.zeros_like(x))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_large_magnitude_scores_stay_finite(dtype):
    x = (randn(2, 16, 16, seed=5) * 1e4).to(dtype).requires_grad_()  # exp(1e4) overflows: the max goes first
    y = softmax.scaled_masked_softmax(x, 1.0, mode="reference")
    y.backward(randn(2, 16, 16, seed=6, dtype=dtype))
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert rel(y, unfused(x.detach().double(), 1.0)) < (1e-6 if dtype == torch.float32 else CPU_TOL)


def test_hand_written_backward_passes_gradcheck():
    x = randn(2, 5, 5, seed=7).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: softmax.ScaledMaskedSoftmax.apply(x, 0.7, None), (x,))


@pytest.mark.parametrize("B, nh, T, hs", [(2, 3, 9, 4), (1, 2, 2, 8), (1, 1, 17, 5)])
def test_non_flash_attention_equals_causal_scaled_dot_product_attention(B, nh, T, hs):
    """q k^T -> fused scaled causal softmax -> @ v, as FusedOps(flash=False) computes attention."""
    qkv = [randn(B, nh, T, hs, seed=s) for s in (10, 11, 12)]
    a = [t.clone().requires_grad_() for t in qkv]
    b = [t.clone().requires_grad_() for t in qkv]
    out_a = kernels.FusedOps(mode="reference", flash=False).attention(*a, 0.0)
    out_b = F.scaled_dot_product_attention(*b, is_causal=True)
    grad = randn(B, nh, T, hs, seed=13)
    out_a.backward(grad)
    out_b.backward(grad)
    assert rel(out_a, out_b) < CPU_TOL
    for ta, tb in zip(a, b):  # q, k, v
        assert rel(ta.grad, tb.grad) < CPU_TOL


# ----------------------------------------------------------------------------------------------
# Shapes and dispatch


@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 4), (6,), (2, 0, 0)])
def test_scores_not_square_in_the_last_two_dims_or_empty_are_refused_naming_the_shape(shape):
    with pytest.raises(ValueError, match=re.escape(f"(..., T, T) with T >= 1, got shape {shape}")):
        softmax.scaled_masked_softmax(randn(*shape, seed=0), 1.0, mode="reference")


def test_forcing_the_kernel_on_a_cpu_tensor_names_the_reason():
    with pytest.raises(ValueError, match="forced.*(no CUDA|not on a CUDA device)"):
        softmax.scaled_masked_softmax(randn(2, 4, 4, seed=0), 1.0, mode="cuda")


def test_rows_longer_than_the_kernel_limit_send_auto_to_the_reference():
    big = torch.zeros(1).expand(softmax.MAX_T + 1, softmax.MAX_T + 1)  # the shape, without the memory
    assert f"T={softmax.MAX_T + 1}" in softmax.unsupported(big)
    assert "T=" not in (softmax.unsupported(torch.zeros(1).expand(softmax.MAX_T, softmax.MAX_T)) or "")
    build.calls.clear()
    x = randn(3, 3, seed=1)
    assert torch.equal(softmax.scaled_masked_softmax(x, 0.5), softmax.reference_forward(x, 0.5))
    assert build.report() == {"softmax": "reference"}


# ----------------------------------------------------------------------------------------------
# Kernel: on a GPU (mode "cuda") and from the same source on the CPU (mode "simt")

GPU_SHAPES = [(1, 1), (2, 3, 1, 1), (3, 7, 7), (2, 4, 128, 128), (2, 1000, 1000), (1, 2, 1024, 1024),
              (1, 1, 2048, 2048)]  # T = 1, 7, and T not a multiple of the block's 32-thread warps


def _ext():
    return build.extension("softmax", softmax.BINDING, softmax.FUNCTIONS)


@pytest.mark.grid(keep=["cuda-*", "simt-(1, 1)-torch.float32", "simt-(3, 7, 7)-torch.bfloat16", "simt-(2, 4, 128, 128)-torch.float32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_kernel_matches_the_float64_reference_forward_and_backward(mode, shape, dtype):
    device = kernel_device(mode)
    ext, scale, mask = kernel_extension(mode, softmax), 1 / math.sqrt(64), softmax.causal_mask(shape[-1], device)
    x, g = (randn(*shape, seed=s, dtype=dtype, device=device) * 4 for s in (0, 1))
    y = softmax.reference_forward(x, scale)  # the backward's input, the same for kernel and reference
    out, dx = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))  # poisoned
    softmax.kernel_forward(ext, x, scale, out)
    softmax.kernel_backward(ext, g, y, scale, dx)
    assert rel(out, softmax.reference_forward(x.double(), scale)) <= GPU_TOL[dtype]
    assert rel(dx, softmax.reference_backward(g.double(), y.double(), scale)) <= GPU_TOL[dtype]
    assert not out.masked_select(mask).any() and not dx.masked_select(mask).any()  # exact zeros, no NaN


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_kernel_keeps_large_magnitude_scores_finite(mode):
    x = randn(2, 300, 300, seed=2, device=kernel_device(mode), dtype=torch.float32) * 1e4
    out = softmax.scaled_masked_softmax(x, 1.0, mode=mode)
    assert torch.isfinite(out).all()
    assert rel(out, softmax.reference_forward(x.double(), 1.0)) <= GPU_TOL[torch.float32]


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_kernel_attention_path_matches_sdpa_forward_and_gradients(mode):
    """The autograd wiring of the kernel path: FusedOps(mode='cuda', flash=False) against PyTorch."""
    T = 200 if mode == "cuda" else 70  # the emulator: fewer rows, the same code path
    qkv = [randn(2, 3, T, 64, seed=s, device=kernel_device(mode), dtype=torch.float32) for s in (3, 4, 5)]
    a = [t.clone().requires_grad_() for t in qkv]
    b = [t.double().requires_grad_() for t in qkv]
    out_a = kernels.FusedOps(mode=mode, flash=False).attention(*a, 0.0)
    out_b = F.scaled_dot_product_attention(*b, is_causal=True)
    grad = randn(2, 3, T, 64, seed=6, device=kernel_device(mode), dtype=torch.float32)
    out_a.backward(grad)
    out_b.backward(grad.double())
    # 1e-4, not 1e-5: the fp32 matmuls around the softmax (sums of 64 and 200 terms) add their rounding
    assert rel(out_a, out_b) <= 1e-4
    for ta, tb in zip(a, b):
        assert rel(ta.grad, tb.grad) <= 1e-4


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_rows_above_the_limit_run_the_reference_in_auto_and_raise_in_cuda_mode(mode):
    x = randn(softmax.MAX_T + 1, softmax.MAX_T + 1, seed=7, device=kernel_device(mode), dtype=torch.float32)
    build.calls.clear()
    softmax.scaled_masked_softmax(x, 1.0)
    assert build.report() == {"softmax": "reference"}
    with pytest.raises(ValueError, match=f"T={softmax.MAX_T + 1}"):
        softmax.scaled_masked_softmax(x, 1.0, mode=mode)


@needs_cuda
def test_graph_replay_equals_eager():
    x = randn(2, 4, 300, 300, seed=8, device="cuda", dtype=torch.float32)
    softmax.scaled_masked_softmax(x, 0.125, mode="cuda")  # build and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = softmax.scaled_masked_softmax(x, 0.125, mode="cuda")
    x.copy_(randn(2, 4, 300, 300, seed=9, device="cuda", dtype=torch.float32))
    graph.replay()
    assert torch.equal(static_out, softmax.scaled_masked_softmax(x, 0.125, mode="cuda"))
