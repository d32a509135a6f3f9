"""Building the CUDA kernels, and choosing between a kernel and its PyTorch reference.

Each family kernels/<name>.py pairs kernels/<name>.cu (plain CUDA C++: kernels and launchers that
take raw pointers and a stream) with a thin torch binding, a few lines of C++ kept in the .py.
They are compiled together by torch.utils.cpp_extension the first time the kernel is used on a
CUDA tensor, and cached by torch (under TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by
default) under a name that hashes the sources, so an edit rebuilds and nothing else does.

Dispatch, per call: mode "auto" runs the kernel for CUDA tensors of a supported dtype (fp32,
fp16, bf16) and shape and the reference otherwise; "cuda" runs the kernel or raises, saying why
it cannot; "reference" always runs the reference. `calls` counts which path each family took.
"""
import collections
import hashlib
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

KERNELS_DIR = Path(__file__).resolve().parent
MODES = ("auto", "cuda", "reference")
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # common.cuh's enum DType
ARCHS = ("80", "90")  # A100 and H100/H200: what the compile check targets

# Every binding starts with this: torch, a device guard, and the one way a launcher's error becomes
# a Python error. The stream each binding is given is the current one of its tensors' device.
PRELUDE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
// Each binding launches on its tensors' device, whatever device is current in the caller.
#define ON_DEVICE_OF(t) const c10::cuda::CUDAGuard device_guard((t).device())
static void check(const char* error, const char* launcher) {
  TORCH_CHECK(error == nullptr, launcher, ": ", error ? error : "");
}
static void* as_stream(int64_t stream) { return reinterpret_cast<void*>(stream); }
"""

calls = collections.defaultdict(collections.Counter)  # family -> {"cuda": n, "reference": n}
_extensions, _failed = {}, {}


def extension(family, binding, functions):
    """The compiled module for kernels/<family>.cu and its binding: built on first use, cached."""
    if family not in _extensions:
        from torch.utils import cpp_extension

        root = cuda_toolkit()
        if root and root != cpp_extension.CUDA_HOME:  # torch's guess has no CUDA headers: nvcc would fail
            print(f"kernels: CUDA toolkit {root} (torch guessed {cpp_extension.CUDA_HOME})", flush=True)
            cpp_extension.CUDA_HOME = root
        cu = (KERNELS_DIR / f"{family}.cu").read_text()
        digest = hashlib.sha1((cu + (KERNELS_DIR / "common.cuh").read_text() + binding).encode()).hexdigest()
        print(f"kernels: building {family}.cu (first use; cached afterwards)", flush=True)
        _extensions[family] = cpp_extension.load_inline(
            name=f"megatron_ref_{family}_{digest[:12]}", cpp_sources=[PRELUDE + binding],
            cuda_sources=[cu], functions=list(functions), extra_include_paths=[str(KERNELS_DIR)],
            extra_cuda_cflags=["-O3"], verbose=False)
    return _extensions[family]


def unsupported(*tensors):
    """Why the kernels cannot take these tensors, or None if they can."""
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    t0 = tensors[0]
    for t in tensors:
        if not t.is_cuda:
            return f"a tensor is on {t.device}, not on a CUDA device"
        if t.dtype not in DTYPE_CODES:
            return f"dtype {t.dtype} is not one of fp32, fp16, bf16"
        if t.dtype != t0.dtype or t.device != t0.device:
            return f"mixed dtypes or devices ({t0.dtype} on {t0.device}, {t.dtype} on {t.device})"
    return None


def use_kernel(mode, family, reason, binding, functions):
    """The extension to run, or None for the reference. reason: unsupported()'s answer, or a
    family-specific one (a shape the kernel does not cover)."""
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {MODES}, got {mode!r}")
    if mode == "reference" or (mode == "auto" and reason):
        calls[family]["reference"] += 1
        return None
    if reason:
        raise ValueError(f"{family}: the CUDA kernel was forced (mode 'cuda') but {reason}")
    ext = built(mode, family, binding, functions)
    calls[family]["cuda" if ext else "reference"] += 1
    return ext


def built(mode, family, binding, functions):
    """The extension, built now if it is not yet; in mode "auto" a failed build (no CUDA toolkit,
    a compiler error) is said once and gives None (the reference) from then on."""
    if family in _failed and mode != "cuda":
        return None
    try:
        return extension(family, binding, functions)
    except Exception as e:
        if mode == "cuda":
            raise
        _failed[family] = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        warnings.warn(f"kernels: building {family}.cu failed ({_failed[family]}); using the PyTorch reference")
        return None


def code(t):
    return DTYPE_CODES[t.dtype]


def stream(t):
    return torch.cuda.current_stream(t.device).cuda_stream


def aligned(*tensors):
    """1 if every tensor starts on a 16-byte boundary (the kernels then move 16-byte packs)."""
    return int(all(t.data_ptr() % 16 == 0 for t in tensors))


def report():
    """Which path each family took so far, e.g. {'bias_gelu': 'cuda', 'layer_norm': 'reference'}."""
    return {f: "+".join(k for k in ("cuda", "reference") if c[k]) for f, c in sorted(calls.items())}


# ----------------------------------------------------------------------------------------------
# Compile checks that need no GPU: nvcc on every .cu; the C++ compiler on every binding.


def cu_files():
    return sorted(KERNELS_DIR.glob("*.cu"))


def nvcc_check(cu, archs=ARCHS, extra=()):
    """Compile one .cu for each arch with nvcc alone (no torch); returns (ok, compiler output)."""
    nvcc = shutil.which("nvcc")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    cmd = [nvcc, "-std=c++17", "-O3", "--Werror", "all-warnings", "-I", str(KERNELS_DIR), *gencode, *extra,
           "-c", str(cu), "-o", os.devnull]
    out = subprocess.run(cmd, capture_output=True, text=True)
    return out.returncode == 0, out.stdout + out.stderr


def static_smem(cu, archs=ARCHS):
    """Each kernel's static shared memory in bytes, as ptxas reports it (nvcc -Xptxas -v) for
    every arch: {kernel name: the largest over its dtype instantiations and the archs}."""
    ok, out = nvcc_check(cu, archs, extra=("-Xptxas", "-v"))
    if not ok:
        raise ValueError(f"nvcc failed on {cu}:\n{out[-3000:]}")
    sizes, kernel = {}, None
    for line in out.splitlines():
        entry = re.search(r"Compiling entry function '_Z(\d+)(\w+)'", line)
        if entry:  # an Itanium-mangled name: its length, then the name, then the template arguments
            kernel = entry[2][:int(entry[1])]
        if kernel and re.search(r"ptxas info\s*: Used ", line):  # "... 128 bytes smem" only if any
            smem = re.search(r"(\d+) bytes smem", line)
            sizes[kernel] = max(sizes.get(kernel, 0), int(smem[1]) if smem else 0)
            kernel = None
    return sizes


def cuda_toolkit():
    """The CUDA toolkit's root (the one whose include/ has cuda_runtime.h), or None: torch's
    CUDA_HOME if it is one, else found from nvcc. torch's CPU builds do not look for it, and its
    CUDA builds guess it from nvcc's path, wrong for a wrapper script such as /usr/local/bin/nvcc."""
    from torch.utils import cpp_extension

    nvcc = shutil.which("nvcc")
    roots = [cpp_extension.CUDA_HOME]
    if nvcc and subprocess.run([nvcc, "--version"], capture_output=True).returncode == 0:
        roots += [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    return next((r for r in roots if r and os.path.exists(os.path.join(r, "include", "cuda_runtime.h"))), None)


def binding_check(bindings):
    """Syntax-check the bindings {family: source} against this torch's headers, in one
    translation unit (each family in its own namespace); returns (ok, compiler output)."""
    from torch.utils import cpp_extension
    import sysconfig
    import tempfile

    src = PRELUDE + "".join(f"namespace {f} {{\n{b}\n}}\n" for f, b in sorted(bindings.items()))
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "bindings.cpp")
        with open(source, "w") as f:
            f.write(src)
        # A CPU build of torch ships c10/cuda's headers without the one its CMake generates (a
        # single build macro): stand one in, found only when torch lacks it.
        stand_in = os.path.join(tmp, "stand_in", "c10", "cuda", "impl")
        os.makedirs(stand_in)
        with open(os.path.join(stand_in, "cuda_cmake_macros.h"), "w") as f:
            f.write("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
        cuda_home = cuda_toolkit()
        if cuda_home:  # c10/cuda's headers include the CUDA runtime's
            includes.append(f"-I{os.path.join(cuda_home, 'include')}")
        includes.append(f"-I{os.path.join(tmp, 'stand_in')}")
        cxx = os.environ.get("CXX", "c++")
        out = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", "-w", *includes, source],
                             capture_output=True, text=True)
    return out.returncode == 0, out.stdout + out.stderr
