"""kernels/: every fused kernel's reference equals the unfused PyTorch it replaces; the dispatcher
picks the right path; every .cu compiles with nvcc for sm_80 and sm_90; every binding compiles
against torch's headers. GPU tests (kernel against reference) run only where CUDA is.

Tolerances. CPU, float64: the reference and the unfused composition evaluate the same formula in
a different order, so they differ by a few ulps (~1e-16 relative); 1e-12 leaves room for the
tanh/exp chains and catches any wrong term (O(1e-3) or more). GPU: the issue's bounds, 1e-5 in
fp32 and 1e-2 in bf16, as max|kernel - ref| / max|ref| against the reference in float64 on the
same (rounded) inputs: fp32 keeps ~7 digits through a few transcendental ops, bf16 ~3 digits.
"""
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import GPU_TOL, check_against_unfused, load, needs_cuda, needs_nvcc, randn, rel
from kernels import bias_gelu, build

tensor_parallel = load("01_tensor_parallel")
# ----------------------------------------------------------------------------------------------
# Building: no GPU needed.


@needs_nvcc
@pytest.mark.parametrize("cu", build.cu_files(), ids=lambda p: p.name)
def test_every_cu_file_compiles_with_nvcc_alone_for_sm80_and_sm90(cu):
    ok, out = build.nvcc_check(cu)
    assert ok, out


@needs_nvcc
def test_every_binding_compiles_against_this_torchs_headers(tmp_path, monkeypatch):
    import kernels
    from torch.utils import cpp_extension

    # Whatever torch guessed for the toolkit: here a root without the CUDA headers, as torch 2.11's
    # CUDA wheel guesses behind a wrapper script /usr/local/bin/nvcc (see the next test).
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))

    bindings = {m.__name__.split(".")[-1]: m.BINDING for m in kernels.families()}
    assert len(bindings) == len(build.cu_files())  # one binding per .cu: none forgotten
    ok, out = build.binding_check(bindings)
    assert ok, out[-4000:]


@needs_nvcc
@pytest.mark.parametrize("torchs_guess", ["none", "no headers"])
def test_the_toolkit_is_found_whatever_torch_guessed(torchs_guess, tmp_path, monkeypatch):
    # A CPU build of torch has no CUDA_HOME; a CUDA build guesses it from nvcc's path, which for a
    # wrapper script (/usr/local/bin/nvcc) is /usr/local, with no cuda_runtime.h: torch 2.11's
    # CUDA wheel failed the binding check above on this machine that way.
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None if torchs_guess == "none" else str(tmp_path))
    root = build.cuda_toolkit()
    assert root is not None and (Path(root) / "include" / "cuda_runtime.h").exists(), root
    # ... and the real build (cpp_extension.load_inline, which runs CUDA_HOME's nvcc) is pointed at it
    seen = []
    monkeypatch.setattr(cpp_extension, "load_inline", lambda **kw: seen.append(cpp_extension.CUDA_HOME))
    monkeypatch.setattr(build, "_extensions", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))  # not the user's cache
    build.extension("bias_gelu", bias_gelu.BINDING, bias_gelu.FUNCTIONS)
    assert seen == [root]


# The build lock: torch's load_inline is stubbed (no compiler runs); the lock file is put where
# torch's own cpp_extension would take it, found by torch's function, not ours.


def torchs_lock(tmp_path, monkeypatch):
    """(torch's lock file for bias_gelu's build under a fresh TORCH_EXTENSIONS_DIR, the stub's record
    of load_inline's calls: whether the lock existed then, and the build directory it was given)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_extensions", {})
    monkeypatch.setattr(build, "_failed", {})
    directory = cpp_extension._get_build_directory(build.extension_name("bias_gelu", bias_gelu.BINDING), False)
    lock = Path(directory) / "lock"
    calls = []
    monkeypatch.setattr(cpp_extension, "load_inline",
                        lambda **kw: calls.append((lock.exists(), kw.get("build_directory"))))
    return lock, calls


def test_a_build_lock_left_by_a_killed_build_is_refused_naming_the_file_to_delete(tmp_path, monkeypatch):
    lock, calls = torchs_lock(tmp_path, monkeypatch)
    lock.touch()
    old = time.time() - build.STALE_LOCK_S - 60  # the killed build's last change, long ago
    os.utime(lock, (old, old))
    os.utime(lock.parent, (old, old))
    for mode in ("cuda", "auto"):  # "auto" does not fall back in silence: the file is the fix
        with pytest.raises(build.StaleBuildLock, match=f"nothing in .* has changed for .*rm {lock}$"):
            build.built(mode, "bias_gelu", bias_gelu.BINDING, bias_gelu.FUNCTIONS)
    assert calls == []  # torch's load_inline, which would wait forever, was never reached


def test_a_live_build_lock_is_waited_for_then_the_build_runs(tmp_path, monkeypatch, capsys):
    lock, calls = torchs_lock(tmp_path, monkeypatch)
    monkeypatch.setattr(build, "LOCK_POLL_S", 0.05)
    lock.touch()  # another process's build, just started
    threading.Timer(0.3, lock.unlink).start()  # ... which finishes
    build.extension("bias_gelu", bias_gelu.BINDING, bias_gelu.FUNCTIONS)
    assert calls == [(False, str(lock.parent))]  # torch's load_inline after the lock went, in its directory
    assert f"waiting for another process's build of bias_gelu.cu (its lock {lock}" in capsys.readouterr().out


def test_a_build_lock_with_no_progress_while_waited_for_becomes_stale(tmp_path, monkeypatch):
    lock, calls = torchs_lock(tmp_path, monkeypatch)
    monkeypatch.setattr(build, "LOCK_POLL_S", 0.05)
    monkeypatch.setattr(build, "STALE_LOCK_S", 0.5)
    lock.touch()  # fresh, but its build was killed a moment later: nothing changes after it
    with pytest.raises(build.StaleBuildLock, match=f"rm {lock}$"):
        build.extension("bias_gelu", bias_gelu.BINDING, bias_gelu.FUNCTIONS)
    assert calls == []


def test_every_launcher_takes_its_launch_error_rather_than_peeking_at_it():
    """cudaPeekAtLastError leaves the error pending: the next launch check (torch's after an
    unrelated kernel, or the next launcher's) would report it again as its own. A source check:
    a CPU cannot launch anything (the next test is its GPU twin)."""
    files = [*build.cu_files(), build.KERNELS_DIR / "common.cuh"]
    code = {f.name: re.sub(r"//[^\n]*", "", f.read_text()) for f in files}  # comments may name it
    assert not [name for name, text in code.items() if "cudaPeekAtLastError" in text]
    status = re.search(r"launch_status\(\) \{(.*?)\n\}", code["common.cuh"], re.S)
    assert status and "cudaGetLastError()" in status[1], "common.cuh's launch_status() must take the error"
    for name, text in code.items():
        if "<<<" in text:  # it launches: its launchers must say how the launch went
            assert "return launch_status();" in text, name


@needs_cuda
def test_a_failed_launch_is_reported_once_by_its_launcher_and_not_by_the_next_cuda_op():
    from kernels import layernorm

    ext = build.extension("layernorm", layernorm.BINDING, layernorm.FUNCTIONS)
    x = randn(4, 64, seed=0, dtype=torch.float32, device="cuda")
    w, stats = torch.ones(64, device="cuda"), torch.ones(4, device="cuda")
    empty_grid = torch.empty(2, 0, 64, device="cuda")  # (2, G, C) with G = 0: a grid of no blocks
    with pytest.raises(RuntimeError, match="layernorm_backward: invalid configuration"):
        layernorm.kernel_backward(ext, x, x, w, stats, stats, torch.empty_like(x), empty_grid)
    # The error was taken: torch's own launch check after its next kernel finds none pending.
    assert torch.equal(x * 2, x + x)
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------
# Dispatch


def test_auto_falls_back_to_the_reference_off_cuda_and_counts_it():
    build.calls.clear()
    y, b = randn(4, 6, seed=0), randn(6, seed=1)
    out = bias_gelu.bias_gelu(y, b)  # CPU tensors: the reference, never a build
    assert torch.equal(out, bias_gelu.reference_forward(y, b))
    assert build.report() == {"bias_gelu": "reference"}


def test_forcing_the_kernel_on_unsupported_input_names_the_reason():
    with pytest.raises(ValueError, match="forced.*(no CUDA|not on a CUDA device)"):
        bias_gelu.bias_gelu(randn(4, 6, seed=0), randn(6, seed=1), mode="cuda")
    with pytest.raises(ValueError, match="mode must be one of"):
        bias_gelu.bias_gelu(randn(4, 6, seed=0), randn(6, seed=1), mode="fast")


# ----------------------------------------------------------------------------------------------
# bias + GeLU


@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 1), (2, 1000)])
def test_bias_gelu_reference_equals_unfused_add_then_gelu(shape):
    y, b = randn(*shape, seed=0) * 3, randn(shape[-1], seed=1)
    check_against_unfused(lambda y, b: bias_gelu.bias_gelu(y, b, mode="reference"),
                           lambda y, b: F.gelu(y + b, approximate="tanh"), [y, b])


def test_bias_gelu_hand_written_backward_passes_gradcheck():
    y, b = randn(3, 4, seed=2).requires_grad_(), randn(4, seed=3).requires_grad_()
    assert torch.autograd.gradcheck(lambda y, b: bias_gelu.BiasGelu.apply(y, b, None), (y, b))


SHAPES = [(8, 1024), (3, 1000), (777, 4097), (1, 7), (2, 5, 96)]  # non-multiples of 256 and of 8


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu_kernel_matches_the_float64_reference(shape, dtype):
    ext = build.extension("bias_gelu", bias_gelu.BINDING, bias_gelu.FUNCTIONS)
    y, b, g = (randn(*s, seed=i, dtype=dtype, device="cuda") for i, s in enumerate([shape, shape[-1:], shape]))
    out, dy = torch.full_like(y, float("nan")), torch.full_like(y, float("nan"))  # poisoned
    bias_gelu.kernel_forward(ext, y, b, out)
    bias_gelu.kernel_backward(ext, g, y, b, dy)
    ref_out = bias_gelu.reference_forward(y.double(), b.double())
    ref_dy, _ = bias_gelu.reference_backward(g.double(), y.double(), b.double())
    assert rel(out, ref_out) <= GPU_TOL[dtype]
    assert rel(dy, ref_dy) <= GPU_TOL[dtype]


@needs_cuda
def test_bias_gelu_graph_replay_equals_eager():
    y, b = randn(64, 1000, seed=0, device="cuda", dtype=torch.float32), randn(1000, seed=1, device="cuda", dtype=torch.float32)
    bias_gelu.bias_gelu(y, b, mode="cuda")  # build and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = bias_gelu.bias_gelu(y, b, mode="cuda")
    y.copy_(randn(64, 1000, seed=5, device="cuda", dtype=torch.float32))
    graph.replay()
    assert torch.equal(static_out, bias_gelu.bias_gelu(y, b, mode="cuda"))


# ----------------------------------------------------------------------------------------------
# The benchmark script runs (on a CPU it times the references at small shapes and says so).


def test_the_kernel_benchmark_runs_and_says_when_gpu_figures_are_not_measured():
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py")], capture_output=True,
                          text=True, timeout=80, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if not torch.cuda.is_available():
        assert "no CUDA device: GPU figures not measured" in proc.stdout
