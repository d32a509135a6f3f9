"""kernels/bias_dropout_add: residual + dropout(y + b), with a mask hashed from (seed, element index).

The reference equals the unfused composition it replaces, given the mask; the mask is the specified
hash (checked against plain Python integers), drops about p of the elements, changes with the seed,
replays with it, and backward regenerates exactly forward's. GPU tests (run only where CUDA is): the
kernel draws bit-identical masks to the reference, its values match, and CUDA graphs replay it.

Tolerances. CPU, float64: the reference scales by 1/(1-p) where the composition divides by 1-p, a
few ulps apart (~1e-16 relative); 1e-12 (CPU_TOL) catches any wrong term. Masks are compared
exactly: they are integer functions of the seed. GPU: 1e-5 in fp32, 1e-2 in bf16 (GPU_TOL), as
max|kernel - ref| / max|ref| against the float64 reference on the same rounded inputs: two adds and
a multiply in fp32, rounded once to the storage dtype (bf16: 2^-9). Kept fractions: within 5 standard
deviations of 1 - p, sqrt(p (1 - p) / N), which a correct hash misses with probability ~6e-7.
"""
import math

import pytest
import torch

from conftest import load
from kernels import bias_dropout_add as bda
from kernels import build
from conftest import CPU_TOL, GPU_TOL, KERNEL_MODES, check_against_unfused, kernel_device, kernel_extension, needs_cuda, randn, rel

tensor_parallel = load("01_tensor_parallel")
M32 = 0xFFFFFFFF


def seed_tensor(seed, device="cpu"):
    return torch.tensor([seed], dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------------------------
# The hash, in plain Python integers: the specification the reference and the kernel implement


def mix32_int(x):
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & M32
    return x ^ (x >> 15)


def bits_int(seed, i):
    k = mix32_int(seed % 2**32)
    return mix32_int((mix32_int(i ^ k) + k) & M32)


def test_mix32_on_int64_tensors_equals_the_uint32_arithmetic_at_its_edges():
    xs = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, M32]
    assert bda.mix32(torch.tensor(xs)).tolist() == [mix32_int(x) for x in xs]


@pytest.mark.parametrize("seed", [0, 1, 2**31 - 2, -5, 2**40 + 3])
def test_random_bits_are_the_specified_hash_of_seed_and_flat_index(seed):
    shape = (7, 300)  # the flat index runs across rows
    bits = bda.random_bits(seed_tensor(seed), shape).flatten()
    for i in [0, 1, 2, 299, 300, 301, 1234, 2099]:
        assert bits[i].item() == bits_int(seed, i)
    assert bits.min() >= 0 and bits.max() <= M32


def test_threshold_is_ceil_p_times_2_to_the_24_and_p_outside_0_1_is_refused():
    assert bda.dropout_constants(0) == (0, 1.0)
    assert bda.dropout_constants(0.1) == (math.ceil(0.1 * 2**24), 1 / 0.9)
    assert bda.dropout_constants(1) == (2**24, 0.0)  # bits >> 8 < 2^24: nothing survives
    y, b = randn(4, 6, seed=0), randn(6, seed=1)
    for p in [-0.1, 1.5, float("nan")]:
        with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
            bda.bias_dropout_add(y, b, y, p)


# ----------------------------------------------------------------------------------------------
# The reference against the unfused composition, float64 on CPU


SHAPES = [(3, 5, 7), (1, 1), (2, 1000), (4, 33)]


def _inputs(shape):
    return [randn(*shape, seed=0), randn(shape[-1], seed=1), randn(*shape, seed=2)]  # y, b, residual


@pytest.mark.parametrize("shape", SHAPES)
def test_with_p_0_the_reference_is_residual_plus_y_plus_b(shape):
    check_against_unfused(lambda y, b, r: bda.bias_dropout_add(y, b, r, 0.0, mode="reference"),
                           lambda y, b, r: r + (y + b), _inputs(shape))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_reference_is_residual_plus_masked_y_plus_b_over_1_minus_p(shape, p):
    seed = seed_tensor(1234)
    mask = bda.keep_mask(seed, shape, p).double()
    check_against_unfused(lambda y, b, r: bda.bias_dropout_add(y, b, r, p, mode="reference", seed=seed),
                           lambda y, b, r: r + (y + b) * mask / (1 - p), _inputs(shape))


def test_with_p_1_everything_is_dropped():
    y, b, r = (t.requires_grad_() for t in _inputs((5, 8)))
    out = bda.bias_dropout_add(y, b, r, 1.0, mode="reference")
    out.backward(randn(5, 8, seed=3))
    assert torch.equal(out, r) and torch.equal(r.grad, randn(5, 8, seed=3))
    assert not y.grad.any() and not b.grad.any()


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_the_hand_written_backward_passes_gradcheck(p):
    y, b, r = (t.requires_grad_() for t in _inputs((3, 4)))
    seed = seed_tensor(7)
    assert torch.autograd.gradcheck(lambda *t: bda.BiasDropoutAdd.apply(*t, seed, p, None), (y, b, r))


# ----------------------------------------------------------------------------------------------
# The mask: its statistics, its seed, its replay in backward


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_kept_fraction_is_within_5_sigma_of_1_minus_p(p):
    n = 100_000
    for seed in [1, 2**31 - 2]:
        kept = bda.keep_mask(seed_tensor(seed), (100, 1000), p).double().mean().item()
        assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)


def test_different_seeds_draw_different_masks_and_a_seed_replays_its_mask():
    masks = [bda.keep_mask(seed_tensor(s), (64, 100), 0.5) for s in [0, 1, 2, 2**31 - 2]]
    for i in range(len(masks)):
        for j in range(i):
            assert 0.4 < (masks[i] != masks[j]).double().mean() < 0.6  # independent: disagree half the time
    assert torch.equal(bda.keep_mask(seed_tensor(1), (64, 100), 0.5), masks[1])
    assert torch.equal(bda.keep_mask(seed_tensor(2**32 + 1), (64, 100), 0.5), masks[1])  # seed mod 2^32
    y, b, r = _inputs((64, 100))
    assert torch.equal(bda.bias_dropout_add(y, b, r, 0.5, seed=1), bda.bias_dropout_add(y, b, r, 0.5, seed=1))


def test_backward_drops_exactly_the_elements_forward_dropped():
    y, b, r = (t.requires_grad_() for t in _inputs((50, 40)))  # y + b has no zeros
    out = bda.bias_dropout_add(y, b, r, 0.4, mode="reference")
    grad = randn(50, 40, seed=3)
    out.backward(grad)
    dropped = out == r
    assert 0.3 < dropped.double().mean() < 0.5
    assert torch.equal(y.grad == 0, dropped)
    assert torch.equal(y.grad[~dropped], grad[~dropped] / 0.6)


def test_an_unseeded_call_draws_its_seed_from_the_default_generator_unless_p_is_0():
    y, b, r = _inputs((16, 32))
    torch.manual_seed(5)
    first, second = bda.bias_dropout_add(y, b, r, 0.5), bda.bias_dropout_add(y, b, r, 0.5)
    assert not torch.equal(first, second)
    torch.manual_seed(5)
    assert torch.equal(bda.bias_dropout_add(y, b, r, 0.5), first)
    state = torch.get_rng_state()
    bda.bias_dropout_add(y, b, r, 0.0)  # eval draws nothing, as F.dropout(training=False)
    assert torch.equal(torch.get_rng_state(), state)


def test_tp_random_fork_gives_each_tp_rank_its_own_mask_and_restores_the_default_generator():
    y, b, r = _inputs((16, 32))
    state = torch.get_rng_state()
    outs = []
    for rank in [0, 1]:
        with tensor_parallel.TPRandom(0, rank, "cpu").fork():
            outs.append(bda.bias_dropout_add(y, b, r, 0.5))
    assert not torch.equal(outs[0], outs[1])
    assert torch.equal(torch.get_rng_state(), state)


# ----------------------------------------------------------------------------------------------
# Arguments and dispatch


def test_malformed_arguments_are_refused():
    y, b, r = _inputs((4, 6))
    with pytest.raises(ValueError, match="expected y and residual"):
        bda.bias_dropout_add(y, randn(5, seed=0), r, 0.1)
    with pytest.raises(ValueError, match="expected y and residual"):
        bda.bias_dropout_add(y, b, r[:2], 0.1)
    with pytest.raises(ValueError, match="one-element int64 tensor"):
        bda.bias_dropout_add(y, b, r, 0.1, seed=torch.tensor([1.0]))


def test_forcing_the_kernel_off_cuda_names_the_reason():
    with pytest.raises(ValueError, match="forced.*(no CUDA|not on a CUDA device)"):
        bda.bias_dropout_add(*_inputs((4, 6)), 0.1, mode="cuda")


def test_2_to_the_32_elements_are_refused_the_hash_index_is_32_bit():
    y = torch.empty(()).expand(2**16, 2**16)  # 2^32 elements, no memory
    assert "2**32" in bda.unsupported(y, torch.empty(2**16), y)
    with pytest.raises(ValueError, match=r"2\*\*32"):
        bda.random_bits(seed_tensor(0), (2**16, 2**16))
    assert bda.unsupported(*[t.float() for t in _inputs((4, 6))]) is not None  # and CPU tensors: no kernel


# ----------------------------------------------------------------------------------------------
# The kernel: on a GPU (mode "cuda") and from the same source on the CPU (mode "simt")

GPU_SHAPES = [(8, 1024), (3, 1000), (777, 4097), (1, 7), (2, 5, 96)]  # non-multiples of 256 and of 8


def _cuda_input(shape, seed, dtype, offset, device="cuda"):
    """randn on the device, starting `offset` elements into its storage (offset 1: not 16-byte aligned)."""
    flat = torch.empty(math.prod(shape) + offset, dtype=dtype, device=device)
    t = flat[offset:].view(shape)
    return t.copy_(randn(*shape, seed=seed, dtype=dtype, device=device))


def _cuda_fp32(shapes, device="cuda"):
    return [randn(*s, seed=i, dtype=torch.float32, device=device) for i, s in enumerate(shapes)]


@pytest.mark.grid(keep=["cuda-*", "simt-shape0-torch.float32-0.3-0", "simt-shape1-torch.bfloat16-0.0-1", "simt-shape2-torch.bfloat16-0.3-1", "simt-shape3-torch.float32-0.3-1", "simt-shape4-torch.bfloat16-0.3-0"])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_the_kernel_draws_the_references_mask_and_matches_its_values(mode, shape, dtype, p, offset):
    device = kernel_device(mode)
    ext = kernel_extension(mode, bda)
    y, r, g = (_cuda_input(shape, i, dtype, offset, device) for i in range(3))
    b = _cuda_input(shape[-1:], 3, dtype, offset, device)
    seed = seed_tensor(987654321, device)
    out, dy = torch.full_like(y, float("nan")), torch.full_like(y, float("nan"))  # poisoned
    bda.kernel_forward(ext, y, b, r, seed, p, out)
    bda.kernel_backward(ext, g, seed, p, dy)
    assert torch.equal(dy != 0, bda.keep_mask(seed, shape, p))  # g has no zeros: dy == 0 iff dropped
    ref_out = bda.reference_forward(y.double(), b.double(), r.double(), seed, p)
    ref_dy, _ = bda.reference_backward(g.double(), seed, p, shape[-1])
    assert rel(out, ref_out) <= GPU_TOL[dtype]
    assert rel(dy, ref_dy) <= GPU_TOL[dtype]


@pytest.mark.parametrize("kernel", KERNEL_MODES)
def test_the_kernels_autograd_path_matches_the_references(kernel):
    device = kernel_device(kernel)
    ins = _cuda_fp32([(64, 96), (96,), (64, 96)], device)
    g, seed = randn(64, 96, seed=9, dtype=torch.float32, device=device), seed_tensor(11, device)
    results = []
    for mode in [kernel, "reference"]:
        y, b, r = (t.clone().requires_grad_() for t in ins)
        out = bda.bias_dropout_add(y, b, r, 0.2, mode=mode, seed=seed)
        out.backward(g)
        results.append([out, y.grad, b.grad, r.grad])
    for a, c in zip(*results):
        assert rel(a, c) <= GPU_TOL[torch.float32]


@needs_cuda
def test_graph_replay_with_a_seed_tensor_equals_eager_and_reads_the_new_seed():
    y, b, r = _cuda_fp32([(64, 1000), (1000,), (64, 1000)])
    seed = seed_tensor(5, "cuda")
    bda.bias_dropout_add(y, b, r, 0.3, mode="cuda", seed=seed)  # build and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = bda.bias_dropout_add(y, b, r, 0.3, mode="cuda", seed=seed)
    y.copy_(randn(64, 1000, seed=5, dtype=torch.float32, device="cuda"))
    seed.fill_(6)  # read through the pointer at replay, not baked into the graph
    graph.replay()
    assert torch.equal(static_out, bda.bias_dropout_add(y, b, r, 0.3, mode="cuda", seed=seed))


@needs_cuda
def test_a_captured_unseeded_call_draws_a_new_mask_on_every_replay():
    y, b, r = _cuda_fp32([(64, 1000), (1000,), (64, 1000)])
    bda.bias_dropout_add(y, b, r, 0.5, mode="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = bda.bias_dropout_add(y, b, r, 0.5, mode="cuda")
    kept = []
    for _ in range(3):
        graph.replay()
        kept.append(static_out != r)
        assert abs(kept[-1].double().mean().item() - 0.5) < 5 * math.sqrt(0.25 / y.numel())
    assert not torch.equal(kept[0], kept[1]) and not torch.equal(kept[1], kept[2])
