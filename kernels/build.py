"""Building the CUDA kernels, and choosing between a kernel and its PyTorch reference.

Each family kernels/<name>.py pairs kernels/<name>.cu (plain CUDA C++: kernels and launchers that
take raw pointers and a stream) with a thin torch binding, a few lines of C++ kept in the .py.
They are compiled together by torch.utils.cpp_extension the first time the kernel is used on a
CUDA tensor, and cached by torch (under TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by
default) under a name that hashes the sources, so an edit rebuilds and nothing else does. A lock
file left there by a build that was killed is refused, naming the file to delete, rather than
waited on forever (wait_for_build_lock).

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
import sys
import time
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
        name = extension_name(family, binding)
        directory = build_directory(name)
        wait_for_build_lock(family, directory)
        os.makedirs(directory, exist_ok=True)
        print(f"kernels: building {family}.cu (first use; cached afterwards)", flush=True)
        _extensions[family] = cpp_extension.load_inline(
            name=name, cpp_sources=[PRELUDE + binding], cuda_sources=[(KERNELS_DIR / f"{family}.cu").read_text()],
            functions=list(functions), extra_include_paths=[str(KERNELS_DIR)], extra_cuda_cflags=["-O3"],
            build_directory=directory, verbose=False)
    return _extensions[family]


def extension_name(family, binding):
    """The extension's name: the family and a hash of its sources, so an edit rebuilds."""
    cu = (KERNELS_DIR / f"{family}.cu").read_text()
    digest = hashlib.sha1((cu + (KERNELS_DIR / "common.cuh").read_text() + binding).encode()).hexdigest()
    return f"megatron_ref_{family}_{digest[:12]}"


def build_directory(name):
    """Where torch's cpp_extension builds `name`, and keeps its lock: TORCH_EXTENSIONS_DIR/name, else
    torch's default root, one folder per Python and CUDA version (as cpp_extension lays it out).
    Passed to load_inline, so the lock looked at below is the one torch takes."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(cpp_extension.get_default_build_root(), f"{python}_{accelerator}")
    return os.path.join(root, name)


# ----------------------------------------------------------------------------------------------
# The build lock. torch's cpp_extension builds under a lock file, <build directory>/lock: the first
# process to create it builds, the others wait until it is gone. A build killed part-way (a job
# cancelled during the minutes of a cold build) leaves the file behind, and every later run then
# waits in torch forever, silently: no collective is pending yet, so no timeout fires. So the lock
# is looked at before torch is called: a live build changes the files beside it (ninja's log, the
# objects) every minute or so; a lock with nothing changed beside it for STALE_LOCK_S is refused,
# naming the file to delete. (The lock holds no pid, and the build may run on another node that
# shares the directory, so its age is the only sign.)

STALE_LOCK_S = 600.0  # about 10 times the longest single compile step seen (49-55 s a family, 2 cores)
LOCK_POLL_S = 1.0


class StaleBuildLock(ValueError):
    """A build lock left by a killed build. Raised in every mode: the fix is to delete one file."""


def _last_change(directory):
    """Seconds since anything in the build directory (the lock included) last changed."""
    times = [os.stat(directory).st_mtime] + [e.stat().st_mtime for e in os.scandir(directory)]
    return time.time() - max(times)


def wait_for_build_lock(family, directory):
    """Return once no build of `family` holds its lock in `directory` (at once, normally); wait,
    and say so, while another process builds; raise StaleBuildLock if the lock is stale."""
    lock, said = os.path.join(directory, "lock"), False
    while True:
        try:
            if not os.path.exists(lock):
                return
            idle = _last_change(directory)
        except FileNotFoundError:  # the build finished (or the directory was removed) meanwhile
            continue
        if idle > STALE_LOCK_S:
            raise StaleBuildLock(
                f"kernels: the build lock {lock} is stale: nothing in {directory} has changed for {idle:.0f} s "
                f"(a live build of {family}.cu changes it every minute or so; the limit is "
                f"kernels.build.STALE_LOCK_S = {STALE_LOCK_S:g} s). A build that was killed left it, and torch "
                f"would wait on it forever. If no process is building {family}.cu (on this node, or on any "
                f"node sharing {directory}), delete the lock and run again: rm {lock}")
        if not said:
            print(f"kernels: waiting for another process's build of {family}.cu (its lock {lock}; last change "
                  f"{idle:.0f} s ago; refused as stale after {STALE_LOCK_S:g} s without one)", flush=True)
            said = True
        time.sleep(LOCK_POLL_S)


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
    except StaleBuildLock:  # not a machine without a toolkit: a file to delete, said in every mode
        raise
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
