"""Building the CUDA kernels, and choosing between a kernel and its PyTorch reference.

Each family kernels/<name>.py pairs kernels/<name>.cu (plain CUDA C++: kernels and launchers that
take raw pointers and a stream) with a thin torch binding, a few lines of C++ kept in the .py.
They are compiled together by torch.utils.cpp_extension the first time the kernel is used on a
CUDA tensor, and cached by torch (under TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions by
default) under a name that holds the GPU's compute capability and a hash of the sources, the flags
and the architectures built for: an edit rebuilds, and nodes of two GPU generations sharing the
directory each keep their own build. The ranks of a node build one at a time (a file lock beside
the build: the first builds, the others then load it); a lock file left by a build that was killed
is refused, naming the file to delete, rather than waited on forever (wait_for_build_lock). Once
loaded, an empty kernel is launched (probe): a build that left out this GPU's architecture fails
there, at start, with "no kernel image is available", and mode "auto" falls back to the reference.

Dispatch, per call: mode "auto" runs the kernel for CUDA tensors of a supported dtype (fp32,
fp16, bf16) and shape and the reference otherwise; "cuda" runs the kernel or raises, saying why
it cannot; "reference" always runs the reference; "simt" runs the same kernels' source on CPU
tensors through the emulator of kernels/simt (for tests: "auto" never picks it), with the launch
configuration the wrappers compute for the emulated device. `calls` counts which path each family took.
"""
import collections
import contextlib
import fcntl
import hashlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

KERNELS_DIR = Path(__file__).resolve().parent
MODES = ("auto", "cuda", "reference", "simt")
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # common.cuh's enum DType
ARCHS = ("80", "90")  # A100 and H100/H200: what the compile check targets
# What the build passes nvcc besides torch's own flags (cpp_extension.COMMON_NVCC_FLAGS, the arch
# flags, -fPIC); nvcc_check passes all of them too. The C++ standard is named: torch's default for
# nvcc has changed between versions.
CUDA_CFLAGS = ("-O3", "-std=c++20")

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
// common.cuh's empty kernel, launched once after loading (build.probe).
extern "C" const char* kernels_probe(void* stream);
void probe(int64_t stream) { check(kernels_probe(as_stream(stream)), "kernels_probe"); }
"""

calls = collections.defaultdict(collections.Counter)  # family -> {"cuda": n, "reference": n, "simt": n}
_extensions, _failed = {}, {}


def extension(family, binding, functions):
    """The compiled module for kernels/<family>.cu and its binding: built on first use, cached,
    and probed (one empty kernel launched) before it is handed out."""
    if family not in _extensions:
        from torch.utils import cpp_extension

        root = cuda_toolkit()
        if root and root != cpp_extension.CUDA_HOME:  # torch's guess has no CUDA headers: nvcc would fail
            print(f"kernels: CUDA toolkit {root} (torch guessed {cpp_extension.CUDA_HOME})", flush=True)
            cpp_extension.CUDA_HOME = root
        name = extension_name(family, binding)
        directory = build_directory(name)
        os.makedirs(directory, exist_ok=True)
        with one_build_at_a_time(family, directory):
            wait_for_build_lock(family, directory)
            print(f"kernels: building {family}.cu (first use; cached afterwards)", flush=True)
            # The .cu needs no torch header (common.cuh: plain CUDA C++), so none is put before it
            # where torch allows: it is then compiled exactly as nvcc_check compiles it, and sooner.
            headers = {"no_implicit_headers": True} if "no_implicit_headers" in _LOAD_INLINE_ARGS else {}
            ext = cpp_extension.load_inline(
                name=name, cpp_sources=[PRELUDE + binding], cuda_sources=[(KERNELS_DIR / f"{family}.cu").read_text()],
                functions=[*functions, "probe"], extra_include_paths=[str(KERNELS_DIR)],
                extra_cuda_cflags=list(CUDA_CFLAGS), build_directory=directory, verbose=False, **headers)
        probe(family, ext)
        _extensions[family] = ext
    return _extensions[family]


def _load_inline_args():
    from torch.utils import cpp_extension

    return set(inspect.signature(cpp_extension.load_inline).parameters)


_LOAD_INLINE_ARGS = _load_inline_args()


def extension_name(family, binding):
    """The extension's name: the family, this GPU's compute capability, and a hash of the sources,
    the flags and the architectures built for. So an edit rebuilds; and two generations of GPU
    sharing one build directory (nodes of a mixed cluster) each build and keep their own, rather
    than rebuilding under each other or loading a build made for the other."""
    sources = [(KERNELS_DIR / f"{family}.cu").read_text(), (KERNELS_DIR / "common.cuh").read_text(), PRELUDE, binding]
    digest = hashlib.sha1("\0".join([*sources, *CUDA_CFLAGS, arch_list()]).encode()).hexdigest()
    return f"megatron_ref_{family}_{capability()}_{digest[:12]}"


def capability():
    """This GPU's compute capability, as 'sm90' ('nogpu' without one)."""
    if not torch.cuda.is_available():
        return "nogpu"
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


def arch_list():
    """What torch's build targets: TORCH_CUDA_ARCH_LIST as given, else (torch's default) the compute
    capabilities of the GPUs in view."""
    given = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if given and given != "native":
        return f"TORCH_CUDA_ARCH_LIST={given!r}"
    in_view = sorted({torch.cuda.get_device_capability(d) for d in range(torch.cuda.device_count())}) \
        if torch.cuda.is_available() else []
    return "the GPUs in view: " + (";".join(f"{a}.{b}" for a, b in in_view) or "none")


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


class CannotRun(RuntimeError):
    """An extension built and loaded whose kernels cannot run on this GPU (probe)."""


def probe(family, ext):
    """Launch the extension's empty kernel once on the current device and wait for it. A build for
    other architectures than this GPU's (TORCH_CUDA_ARCH_LIST without it) compiles and loads, and
    then every launch fails with "no kernel image is available for execution on the device": here,
    at start, rather than inside the first training step. Not during a graph capture (the first use
    of a family is normally before any: kernels.prebuild)."""
    if not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return
    stream = torch.cuda.current_stream()
    try:
        ext.probe(stream.cuda_stream)
        stream.synchronize()
    except RuntimeError as e:
        major, minor = torch.cuda.get_device_capability()
        raise CannotRun(
            f"kernels: {family}.cu was built, but its kernels cannot run on this GPU ({torch.cuda.get_device_name()}, "
            f"compute capability {major}.{minor}): {str(e).strip().splitlines()[0]}. The build targeted {arch_list()}: "
            f"set TORCH_CUDA_ARCH_LIST to include {major}.{minor} (or unset it, to build for the GPUs in view) "
            f"and run again") from None


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


# ----------------------------------------------------------------------------------------------
# One build at a time. The ranks of a node start together, and each would call load_inline on the
# same cold directory at once: torch writes the sources there before taking its lock, so one rank
# may rewrite a file another's compiler is reading. So each process first takes a lock of its own,
# <build directory>.lock, beside the directory (inside it, it would count as a live build's change):
# the first builds, the others then find the build done and only load it. It is an flock: the
# kernel releases it when its holder exits, killed or not, so it is never left stale. The wait is
# bounded: by STALE_LOCK_S without any change in the build directory (a build that hangs), and by
# BUILD_WAIT_S in all.

BUILD_WAIT_S = 3600.0


class BuildWaitTimeout(ValueError):
    """Another process has held the build's lock too long; the sentence names the lock file."""


@contextlib.contextmanager
def one_build_at_a_time(family, directory):
    path, said, t0 = directory.rstrip(os.sep) + ".lock", False, time.monotonic()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:  # a read-only cache, say: build as before, unserialised
        print(f"kernels: cannot open {path} ({e.strerror}); building {family}.cu without waiting for the "
              f"other ranks of this node", flush=True)
        yield
        return
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError as e:  # a filesystem without flock (some parallel ones): as above
                print(f"kernels: cannot lock {path} ({e.strerror}); building {family}.cu without waiting for "
                      f"the other ranks of this node", flush=True)
                break
            waited, idle = time.monotonic() - t0, _last_change(directory)
            if idle > STALE_LOCK_S or waited > BUILD_WAIT_S:
                why = (f"nothing in {directory} has changed for {idle:.0f} s (kernels.build.STALE_LOCK_S = "
                       f"{STALE_LOCK_S:g} s)" if idle > STALE_LOCK_S else
                       f"that is longer than kernels.build.BUILD_WAIT_S = {BUILD_WAIT_S:g} s")
                raise BuildWaitTimeout(
                    f"kernels: waited {waited:.0f} s for another process's build of {family}.cu, which holds the "
                    f"lock {path}, and {why}: that build seems stuck. Stop it (`fuser -v {path}` names it) and "
                    f"run again")
            if not said:
                print(f"kernels: waiting for another process's build of {family}.cu (it holds {path}); "
                      f"then loading it", flush=True)
                said = True
            time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # releases the lock


def target(mode):
    """Where mode's kernels run: "simt" (the emulator, on CPU tensors) or "cuda"."""
    return "simt" if mode == "simt" else "cuda"


def unsupported(*tensors, target="cuda"):
    """Why the kernels cannot take these tensors, or None if they can; target "simt": the
    emulator's, which takes CPU tensors."""
    if target == "cuda" and not torch.cuda.is_available():
        return "no CUDA device is available"
    t0 = tensors[0]
    for t in tensors:
        if target == "cuda" and not t.is_cuda:
            return f"a tensor is on {t.device}, not on a CUDA device"
        if target == "simt" and t.device.type != "cpu":
            return f"a tensor is on {t.device}: mode 'simt' runs the kernels on CPU tensors"
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
        what = "CUDA kernel" if mode == "cuda" else "kernel, emulated on the CPU,"
        raise ValueError(f"{family}: the {what} was forced (mode {mode!r}) but {reason}")
    if mode == "simt":
        from . import simt

        calls[family]["simt"] += 1
        return simt.extension(family, binding, functions)
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
    except (StaleBuildLock, BuildWaitTimeout):  # not a machine without a toolkit: said in every mode
        raise
    except CannotRun as e:  # built for other GPUs: the sentence says which, and what to set
        if mode == "cuda":
            raise
        _failed[family] = str(e)
        warnings.warn(f"{e}; using the PyTorch reference")
        return None
    except Exception as e:
        if mode == "cuda":
            raise
        _failed[family] = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        warnings.warn(f"kernels: building {family}.cu failed ({_failed[family]}); using the PyTorch reference")
        return None


def code(t):
    return DTYPE_CODES[t.dtype]


def stream(t):
    """The current stream of t's device, as the launchers take it (0 for the emulator's CPU tensors)."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def device_properties(device):
    """torch.cuda.get_device_properties for a CUDA device; for a CPU one (mode "simt"), the
    emulated GPU's, so that the wrappers compute the launch they would compute there."""
    device = torch.device(device) if isinstance(device, str) else device
    if isinstance(device, torch.device) and device.type == "cpu":
        from . import simt

        return simt.properties()
    return torch.cuda.get_device_properties(device)


def aligned(*tensors):
    """1 if every tensor starts on a 16-byte boundary (the kernels then move 16-byte packs)."""
    return int(all(t.data_ptr() % 16 == 0 for t in tensors))


def report():
    """Which path each family took so far, e.g. {'bias_gelu': 'cuda', 'layer_norm': 'reference'}."""
    return {f: "+".join(k for k in ("cuda", "simt", "reference") if c[k]) for f, c in sorted(calls.items())}


# ----------------------------------------------------------------------------------------------
# Compile checks that need no GPU: nvcc on every .cu; the C++ compiler on every binding.


def cu_files():
    return sorted(KERNELS_DIR.glob("*.cu"))


def nvcc_check(cu, archs=ARCHS, extra=()):
    """Compile one .cu for each arch with nvcc alone, with the flags the real build gives it (torch's
    own, cpp_extension.COMMON_NVCC_FLAGS, which forbid half and bfloat16's operators and implicit
    conversions, and CUDA_CFLAGS), every warning an error; returns (ok, compiler output)."""
    from torch.utils import cpp_extension

    nvcc = shutil.which("nvcc")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    cmd = [nvcc, *cpp_extension.COMMON_NVCC_FLAGS, *CUDA_CFLAGS, "--compiler-options", "-fPIC", "--Werror",
           "all-warnings", "-I", str(KERNELS_DIR), *gencode, *extra, "-c", str(cu), "-o", os.devnull]
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


def binding_source(bindings):
    """The one translation unit of the binding check: PRELUDE, then each family's binding in a namespace
    of its own, each under a #line naming the .py and the line it is written on, so that g++'s errors
    say kernels/<family>.py:<line>, the line to edit."""
    parts = [_line_directive(KERNELS_DIR / "build.py", PRELUDE, "PRELUDE"), PRELUDE]
    for family, binding in sorted(bindings.items()):
        parts += [f"namespace {family} {{\n", _line_directive(KERNELS_DIR / f"{family}.py", binding, "BINDING"),
                  binding, f"\n}}  // namespace {family}\n"]
    return "".join(parts)


def _line_directive(path, text, what):
    """#line for `text` written verbatim in `path` (a raw string there): the line it starts on; else
    (built at run time) line 1 of a name that says so."""
    try:
        written = path.read_text()
    except OSError:
        written = ""
    at = written.find(text) if text else -1
    if at < 0:
        return f'#line 1 "kernels/{path.name} ({what}, as built at run time)"\n'
    return f'#line {written.count(chr(10), 0, at) + 1} "kernels/{path.name}"\n'


# The check's pass is cached, as a build is (by torch's cpp_extension and ninja): g++ is
# deterministic, so the same translation unit, command line and compiler over the same headers
# passes again. The key holds the source, the command, the compiler's identity and the environment
# g++ reads; the record lists every file g++ read (its -MD dependency list) with a hash of its
# content, checked at each use: a changed header (another torch, an edited stand-in) compiles again.
# A failure is never cached. A precompiled header of torch/extension.h was measured and not taken:
# 800 MB, twice the parse's CPU time to build (40 s against 19 s) and 5-6 s to load at each use.
_COMPILER_ENV = ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH", "GCC_EXEC_PREFIX", "COMPILER_PATH")


def binding_check(bindings):
    """Syntax-check the bindings {family: source} against this torch's headers, in one translation
    unit (each family in its own namespace, errors naming kernels/<family>.py's line); returns (ok,
    compiler output). A pass over unchanged inputs is not compiled again (above)."""
    root = Path(build_directory("megatron_ref_binding_check"))
    try:
        _write_stand_in(root)
    except OSError as e:  # a read-only cache, say: check in a folder of its own, recording nothing kept
        print(f"kernels: cannot write the binding check's files under {root} ({e.strerror}); checking in a "
              f"temporary folder", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            _write_stand_in(Path(tmp))
            return _binding_check(bindings, Path(tmp))
    return _binding_check(bindings, root)


def _write_stand_in(root):
    """A CPU build of torch ships c10/cuda's headers without the one its CMake generates (a single
    build macro): stand one in, root/stand_in, found only when torch lacks it (last on the path)."""
    _write_if_changed(root / "stand_in" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h",
                      "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")


def _binding_check(bindings, root):
    from torch.utils import cpp_extension
    import sysconfig

    src, stand_in = binding_source(bindings), root / "stand_in"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    cuda_home = cuda_toolkit()
    if cuda_home:  # c10/cuda's headers include the CUDA runtime's
        includes.append(f"-I{os.path.join(cuda_home, 'include')}")
    includes.append(f"-I{stand_in}")
    cxx = os.environ.get("CXX", "c++")
    command = [cxx, "-std=c++20", "-fsyntax-only", "-w", *includes]
    key = hashlib.sha1("\0".join([src, *command, *_compiler_identity(cxx),
                                   *(f"{v}={os.environ.get(v, '')}" for v in _COMPILER_ENV)]).encode()).hexdigest()
    record = root / f"passed_{key[:16]}.txt"
    if _still_passes(record):
        return True, f"passed before over the same inputs ({record}); not compiled again"
    os.makedirs(root, exist_ok=True)
    tag = f"{os.getpid()}_{key[:16]}"
    source, deps = root / f"bindings_{tag}.cpp", root / f"bindings_{tag}.d"
    source.write_text(src)
    try:
        out = subprocess.run([*command, "-MD", "-MF", str(deps), str(source)], capture_output=True, text=True)
        if out.returncode == 0:
            _record_pass(record, deps, source)
    finally:
        for f in (source, deps):
            f.unlink(missing_ok=True)
    return out.returncode == 0, out.stdout + out.stderr


def _write_if_changed(path, text):
    if not path.exists() or path.read_text() != text:
        os.makedirs(path.parent, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(text)
        os.replace(partial, path)  # a concurrent g++ reads the old file or the new one, never half of one


def _compiler_identity(cxx):
    """What names this compiler: its --version, and the path, size and time of its driver and of the
    C++ front end it runs (cc1plus), so that a reinstalled compiler compiles again."""
    identity = []
    for args in (["--version"], ["-print-prog-name=cc1plus"]):
        try:
            identity.append(subprocess.run([cxx, *args], capture_output=True, text=True).stdout.strip())
        except OSError:
            identity.append("")
    for program in (shutil.which(cxx), shutil.which(identity[1]) if identity[1] else None):
        if program:
            st = os.stat(program)
            identity.append(f"{os.path.realpath(program)} {st.st_size} {st.st_mtime_ns}")
    return identity


def _dependencies(deps):
    """The files of a g++ -MD list ("target: a.h b.h \\" lines; a space in a name escaped)."""
    text = deps.read_text().replace("\\\n", " ")
    text = text.split(":", 1)[1] if ":" in text else ""
    return [name.replace("\\ ", " ") for name in re.split(r"(?<!\\)\s+", text) if name]


def _digest(path):
    with open(path, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()


def _record_pass(record, deps, source):
    """Write the record of a pass: every file g++ read but the source (in the key; removed after)."""
    read = [os.path.abspath(p) for p in dict.fromkeys(_dependencies(deps))]
    lines = [f"{_digest(p)} {p}" for p in read if p != os.path.abspath(source)]
    partial = record.with_name(f"{record.name}.{os.getpid()}.tmp")
    partial.write_text("\n".join(lines) + "\n")
    os.replace(partial, record)


def _still_passes(record):
    """The record exists and every file it lists still has the content it had when g++ passed."""
    try:
        lines = record.read_text().splitlines()
        return bool(lines) and all(_digest(p) == d for d, p in (line.split(" ", 1) for line in lines))
    except (OSError, ValueError):
        return False
