"""kernels/simt, the CUDA kernels executed on a CPU: what it checks, shown on kernels with planted
bugs (tests/simt/planted.cu, one bug each), each caught by the check named; what a GPU checks at
launch, as an H100 or an A100 checks it; the thread order; the opt-in race layernorm.cu had; and
under --full-grid, every launcher built with AddressSanitizer and UBSan.

Each fault is one sentence that names the .cu file and line (the rewriter's #line), so the test
asserts the line of the planted bug, found by its `// BUG:` comment.
"""
import ctypes
import os
import subprocess
import sys
import threading

import pytest
import torch

from conftest import ROOT, randn, rel
from kernels import layernorm, simt

PLANTED = ROOT / "tests" / "simt" / "planted.cu"
BINDING = r"""
extern "C" const char* planted(int, const float*, float*, int, void*);
void run(int64_t which, torch::Tensor in, torch::Tensor out, int64_t n) {
  check(planted(which, in.data_ptr<float>(), out.data_ptr<float>(), n, nullptr), "planted");
}
"""
CASES = {"partial warp": 1, "divergent barrier": 2, "over default smem": 3, "unwritten": 4, "missing barrier": 5,
         "past the buffer": 6, "deadlock": 7, "mismatched masks": 8, "own bytes": 9, "threads": 10, "grid y": 11}


def bug_line(bug):
    """planted.cu's file:line of the line marked `// BUG: bug`."""
    lines = PLANTED.read_text().splitlines()
    return f"{PLANTED}:{next(i + 1 for i, text in enumerate(lines) if text.endswith('// BUG: ' + bug))}"


@pytest.fixture(scope="module")
def planted():
    ext = simt.extension("planted", BINDING, ("run",), cu=PLANTED)

    def run(case, n=32, inputs=None):
        x = inputs if inputs is not None else torch.arange(1024, dtype=torch.float32) + 1
        out = torch.full((1024,), float("nan"))
        ext.run(CASES[case], x, out, n)
        return out

    return run


# ----------------------------------------------------------------------------------------------
# Checks a GPU does not make: each planted bug, and the sentence that catches it


def test_a_full_mask_shuffle_in_a_block_of_100_threads_is_caught(planted):
    with pytest.raises(RuntimeError, match=rf"__shfl_xor_sync at .*common.cuh:\d+ with mask 0xffffffff in a partial "
                                           rf"warp: warp 3 of a block \(0, 0, 0\) of 100 threads has lanes 0..3 only"):
        planted("partial warp")


def test_a_divergent_syncthreads_is_caught_naming_the_threads_that_exited(planted):
    with pytest.raises(RuntimeError, match=rf"__syncthreads at {bug_line('divergent barrier')} in block \(0, 0, 0\) "
                                           rf"of 128 threads: thread(s)? .*exited without reaching it"):
        planted("divergent barrier")


def test_48_kib_of_dynamic_shared_memory_plus_128_static_bytes_without_the_opt_in_is_refused(planted):
    with pytest.raises(RuntimeError, match=r"planted: invalid argument \(simt, emulating an H100\): a launch with "
                                           r"49152 bytes of dynamic shared memory and 128 static: the kernel allows "
                                           r"49024 dynamic bytes \(48 KiB minus its static bytes"):
        planted("over default smem")


def test_a_read_of_shared_memory_no_thread_wrote_is_nan(planted):
    out = planted("unwritten")
    assert torch.isnan(out[31]) and not torch.isnan(out[:31]).any()  # the poison shows where it was read


@pytest.mark.parametrize("order", ["reverse", "random"])
def test_a_missing_barrier_shows_under_another_thread_order(planted, order):
    x = torch.arange(1024, dtype=torch.float32) + 1
    expected = 2 * torch.cat([x[:1], x[:1023]])
    assert torch.equal(planted("missing barrier", 1024, x), expected)  # forward: each reads a finished write
    with simt.emulating(order=order, seed=1):
        assert not torch.equal(planted("missing barrier", 1024, x), expected)


def test_a_deadlock_is_caught_saying_what_each_thread_waits_for(planted):
    with pytest.raises(RuntimeError, match=rf"deadlock in block \(0, 0, 0\) of 32 threads: no thread can go on: "
                                           rf"threads 0 in __shfl_xor_sync at {bug_line('deadlock')} \(mask "
                                           rf"0x00000003\); threads 1..31 in __syncthreads at"):
        planted("deadlock")


def test_mismatched_masks_are_caught(planted):
    with pytest.raises(RuntimeError, match=rf"mismatched masks in warp 0 of a block \(0, 0, 0\) of 32 threads: lane 0 "
                                           rf"waits in __shfl_xor_sync at {bug_line('mismatched masks')} with mask "
                                           rf"0x00000003, lane 1 .* with mask 0xffffffff"):
        planted("mismatched masks")


def test_after_a_fault_the_next_launch_runs(planted):
    with pytest.raises(RuntimeError, match="deadlock"):
        planted("deadlock")
    assert torch.equal(planted("threads", 32)[:32], torch.full((32,), 32.0))


# ----------------------------------------------------------------------------------------------
# The launch checks a GPU makes, against the emulated device


def test_a_block_of_1025_threads_and_a_grid_of_65536_rows_are_refused(planted):
    with pytest.raises(RuntimeError, match=r"invalid configuration argument .*a block of 1025 threads"):
        planted("threads", 1025)
    with pytest.raises(RuntimeError, match=r"invalid configuration argument .*a grid of \(1, 65536, 1\) blocks"):
        planted("grid y", 65536)
    assert torch.equal(planted("threads", 1024), torch.full((1024,), 32.0))


@pytest.mark.parametrize("device", ["H100", "A100"])
def test_the_longest_layernorm_row_runs_and_one_more_is_refused_as_the_device_refuses_it(device):
    """The backward's 8 C + 128 bytes against the opt-in: 29040 on an H100, 20848 on an A100."""
    ext = simt.extension("layernorm", layernorm.BINDING, layernorm.FUNCTIONS)
    with simt.emulating(device=device, sms=1):
        longest = layernorm.max_columns(simt.device().optin_bytes)
        for C in (longest, longest + 1):
            x, g = randn(1, C, seed=0, dtype=torch.float32), randn(1, C, seed=1, dtype=torch.float32)
            w, mean, rstd = torch.ones(C), torch.empty(1), torch.empty(1)
            layernorm.kernel_forward(ext, x, w, w, 1e-5, torch.empty_like(x), mean, rstd)
            partial = torch.empty(2, 1, C)
            if C == longest:
                layernorm.kernel_backward(ext, g, x, w, mean, rstd, torch.empty_like(x), partial)
                assert rel(partial[1, 0], g[0]) == 0  # db = g for one row
            else:
                with pytest.raises(RuntimeError, match=rf"layernorm_backward: invalid argument \(simt, emulating an "
                                                       rf"{device}\): a launch with {8 * C} bytes"):
                    layernorm.kernel_backward(ext, g, x, w, mean, rstd, torch.empty_like(x), partial)


def test_the_sm_count_is_the_emulated_devices_and_settable():
    assert simt.properties().multi_processor_count == 132
    with simt.emulating(sms=3, device="A100"):
        assert simt.properties().multi_processor_count == 3
        assert layernorm.backward_blocks(100, torch.device("cpu")) == 6
    with pytest.raises(ValueError, match="device 'V100' is not emulated"):
        with simt.emulating(device="V100"):
            pass


# ----------------------------------------------------------------------------------------------
# The thread order: the kernels' outputs do not depend on it


def test_layernorm_is_bit_identical_whatever_order_the_threads_take_turns_in():
    ext = simt.extension("layernorm", layernorm.BINDING, layernorm.FUNCTIONS)
    x, g = randn(37, 300, seed=0, dtype=torch.float32) * 3 + 2, randn(37, 300, seed=1, dtype=torch.float32)
    w = randn(300, seed=2, dtype=torch.float32)
    results = []
    for order, seed in [("forward", 0), ("reverse", 0), ("random", 1), ("random", 2)]:
        with simt.emulating(order=order, seed=seed, sms=2):
            y, dx, mean, rstd, partial = (torch.empty_like(x), torch.empty_like(x), torch.empty(37), torch.empty(37),
                                          torch.empty(2, layernorm.backward_blocks(37, x.device), 300))
            layernorm.kernel_forward(ext, x, w, w, 1e-5, y, mean, rstd)
            layernorm.kernel_backward(ext, g, x, w, mean, rstd, dx, partial)
            results.append([y, dx, mean, rstd, partial])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


# ----------------------------------------------------------------------------------------------
# The opt-in race (issue 46, item 5): two host threads launch one kernel above 48 KiB at once


def race(ext, first, second):
    """Host thread A runs first() up to its cudaFuncSetAttribute; host thread B then runs second()
    whole; then A goes on. Returns (A's error or None, B's)."""
    a_set, b_done, errors = threading.Event(), threading.Event(), {}
    a_thread = []

    @ctypes.CFUNCTYPE(None, ctypes.c_longlong)
    def hook(value):
        if threading.current_thread() is a_thread[0] and not a_set.is_set():
            a_set.set()
            b_done.wait(10)

    def run(name, fn, before=None, after=None):
        if before:
            before.wait(10)
        try:
            fn()
        except RuntimeError as e:
            errors[name] = str(e)
        finally:
            if after:
                after.set()

    ext.lib.simt_reset_attributes()
    ext.lib.simt_set_attribute_hook(hook)
    try:
        a_thread.append(threading.Thread(target=run, args=("A", first)))
        b = threading.Thread(target=run, args=("B", second, a_set, b_done))
        a_thread[0].start()
        b.start()
        a_thread[0].join(20)
        b.join(20)
    finally:
        ext.lib.simt_set_attribute_hook(None)
        ext.lib.simt_reset_attributes()
    return errors.get("A"), errors.get("B")


def test_setting_the_opt_in_to_each_launchs_own_bytes_fails_one_of_two_host_threads():
    """The emulator shows the race the old launcher had (planted.cu keeps it): B lowers the limit
    between A's setting and A's launch."""
    ext = simt.extension("planted", BINDING, ("run",), cu=PLANTED)
    x, out = torch.zeros(1024), torch.zeros(1024)
    a, b = race(ext, lambda: ext.run(9, x, out, 100_000), lambda: ext.run(9, x, out, 60_000))
    assert b is None
    assert a and "invalid argument" in a and "a launch with 100000 bytes" in a and "as last set" in a, a


def test_layernorms_launcher_raises_the_opt_in_to_the_devices_maximum_so_both_threads_launch():
    ext = simt.extension("layernorm", layernorm.BINDING, layernorm.FUNCTIONS)

    def forward(C):
        x = randn(2, C, seed=0, dtype=torch.float32)
        return lambda: layernorm.kernel_forward(ext, x, torch.ones(C), torch.zeros(C), 1e-5, torch.empty_like(x),
                                                torch.empty(2), torch.empty(2))

    with simt.emulating(sms=1):
        assert race(ext, forward(25_000), forward(13_000)) == (None, None)


# ----------------------------------------------------------------------------------------------
# Sanitizers: every launcher of every family, and the planted read past the shared buffer


SANITIZED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from kernels import simt, bias_gelu, bias_dropout_add as bda, softmax, layernorm
flags = simt.SANITIZE_FLAGS
case = sys.argv[2]
def ext(family):
    return simt.extension(family.__name__.split(".")[-1], family.BINDING, family.FUNCTIONS, flags)
with simt.emulating(sms=2):
    if case == "planted":
        e = simt.extension("planted", sys.argv[3], ("run",), flags, cu=sys.argv[4])
        e.run(6, torch.ones(64), torch.zeros(64), 64)
        print("no report")
    for dtype in (torch.float32, torch.bfloat16, torch.float16) if case == "families" else ():
        for rows, C in [(3, 7), (5, 96), (2, 6200)]:
            x, g = torch.randn(rows, C).to(dtype), torch.randn(rows, C).to(dtype)
            w, b = torch.randn(C).to(dtype), torch.randn(C).to(dtype)
            out, seed = torch.empty_like(x), torch.tensor([5])
            bias_gelu.kernel_forward(ext(bias_gelu), x, b, out)
            bias_gelu.kernel_backward(ext(bias_gelu), g, x, b, out)
            bda.kernel_forward(ext(bda), x, b, g, seed, 0.3, out)
            bda.kernel_backward(ext(bda), g, seed, 0.3, out)
            mean, rstd = torch.empty(rows), torch.empty(rows)
            layernorm.kernel_forward(ext(layernorm), x, w, b, 1e-5, out, mean, rstd)
            layernorm.kernel_backward(ext(layernorm), g, x, w, mean, rstd, out,
                                      torch.empty(2, layernorm.backward_blocks(rows, x.device), C))
            s = torch.randn(2, min(C, 300), min(C, 300)).to(dtype)
            softmax.kernel_forward(ext(softmax), s, 0.5, torch.empty_like(s))
            softmax.kernel_backward(ext(softmax), s, s, 0.5, torch.empty_like(s))
        print("clean", dtype)
"""


@pytest.mark.grid(keep=[])
@pytest.mark.parametrize("case", ["families", "planted"])
def test_under_address_and_undefined_behaviour_sanitizers(case, tmp_path):
    """The launchers built with -fsanitize=address,undefined and run in a Python that preloads ASan:
    the four families' every launcher is clean; the planted read one float past the dynamic shared
    buffer is reported, naming planted.cu's line. Slow (a sanitized build of each): --full-grid."""
    libasan = subprocess.run([os.environ.get("CXX", "g++"), "-print-file-name=libasan.so"], capture_output=True,
                             text=True).stdout.strip()
    if not os.path.isabs(libasan):
        pytest.skip("g++ has no libasan")
    env = {**os.environ, "LD_PRELOAD": libasan, "ASAN_OPTIONS": "detect_leaks=0:handle_segv=0",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path))}
    script = tmp_path / "sanitized.py"
    script.write_text(SANITIZED)
    proc = subprocess.run([sys.executable, str(script), str(ROOT), case, BINDING, str(PLANTED)], env=env,
                          capture_output=True, text=True, timeout=85)
    if case == "families":
        assert proc.returncode == 0 and "clean torch.float16" in proc.stdout, proc.stderr[-4000:]
        assert "runtime error" not in proc.stderr, proc.stderr[-4000:]
    else:
        assert proc.returncode != 0 and "no report" not in proc.stdout, proc.stdout[-2000:]
        assert "heap-buffer-overflow" in proc.stderr and bug_line("past the buffer") in proc.stderr, proc.stderr[-4000:]


# ----------------------------------------------------------------------------------------------
# The trainer's own path: 05 with --kernel-path simt trains as with the references


def test_05_with_the_kernels_emulated_trains_like_the_reference_path_in_float32(run_ranks):
    """Every fused op of a block (LayerNorm, bias + GeLU, bias + dropout + add, the causal softmax with
    flash attention off) through the CUDA source, 4 steps of 05 in float32 against the same run on the
    references. 1e-4: fp32 kernels (1e-5 each, GPU_TOL) through a few layers and AdamW steps."""
    from dataclasses import replace

    from conftest import TRAINER_BASE, TRAINER_CFG, gpt3d, tensor_parallel

    cfg = replace(TRAINER_CFG, n_layer=2, dropout=0.1)
    base = replace(TRAINER_BASE, steps=3, batch_size=4, dtype="float32", fused_kernels=True, flash_attention=False)

    def body(env):
        from kernels import build

        build.calls.clear()
        out = {path: gpt3d.train(env, cfg, replace(base, kernel_path=path), quiet=True) for path in ("reference", "simt")}
        return out, build.report()

    (out, report), = run_ranks(body, 1)
    assert set(report.values()) == {"simt+reference"}, report  # every family ran both ways
    for key in ("losses", "norms"):
        got, want = torch.tensor(out["simt"][key]), torch.tensor(out["reference"][key])
        assert tensor_parallel.max_rel_diff(got, want) <= 1e-4, (key, got - want)


# ----------------------------------------------------------------------------------------------
# On a GPU: each kernel's GPU output against its CPU execution, on the same inputs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_kernels_gpu_output_equals_its_cpu_execution(dtype):
    """The emulated H100 is given the GPU's SM count, so both launch the same grid. fp32 1e-5 and bf16
    one rounding (1e-2) apart: the GPU's fused multiply-adds, expf and rsqrtf are not g++'s; the
    dropout masks are integer hashes and must agree exactly."""
    from conftest import GPU_TOL, kernel_extension
    from kernels import bias_dropout_add as bda, bias_gelu, softmax

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x, g = randn(300, 1000, seed=0, dtype=dtype), randn(300, 1000, seed=1, dtype=dtype)
    w, b = randn(1000, seed=2, dtype=dtype), randn(1000, seed=3, dtype=dtype)
    s = randn(2, 3, 100, 100, seed=4, dtype=dtype)
    seed = torch.tensor([77])

    def run(mode, device):
        put = lambda t: t.to(device)  # noqa: E731
        xs, gs, ws, bs, ss = map(put, (x, g, w, b, s))
        outs = [torch.empty_like(xs) for _ in range(6)]
        bias_gelu.kernel_forward(kernel_extension(mode, bias_gelu), xs, bs, outs[0])
        bda.kernel_forward(kernel_extension(mode, bda), xs, bs, gs, put(seed), 0.3, outs[1])
        mean, rstd = torch.empty(300, device=device), torch.empty(300, device=device)
        layernorm.kernel_forward(kernel_extension(mode, layernorm), xs, ws, bs, 1e-5, outs[2], mean, rstd)
        partial = torch.empty(2, layernorm.backward_blocks(300, xs.device), 1000, device=device)
        layernorm.kernel_backward(kernel_extension(mode, layernorm), gs, xs, ws, mean, rstd, outs[3], partial)
        probs = torch.empty_like(ss)
        softmax.kernel_forward(kernel_extension(mode, softmax), ss, 0.125, probs)
        return [o.cpu() for o in (*outs[:4], mean, rstd, partial, probs)]

    gpu = run("cuda", "cuda")
    with simt.emulating(sms=sms):
        cpu = run("simt", "cpu")
    assert torch.equal(gpu[1] == 0, cpu[1] == 0)  # the same dropout mask
    for a, c in zip(gpu, cpu):
        assert rel(a, c) <= GPU_TOL[dtype if a.dtype == dtype else torch.float32]
