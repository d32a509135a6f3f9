"""kernels/simt: the CUDA kernels of kernels/*.cu executed on a CPU, from their unchanged source.

Kernel mode "simt" (beside "auto", "cuda" and "reference"; "auto" never picks it): each family's
.cu is compiled by g++ against simt.h, which runs every CUDA thread of a block as a fiber on the
calling CPU thread (__syncthreads a block barrier, __shfl_*_sync a masked warp exchange, shared
memory a fresh NaN-poisoned buffer per block), with stand-ins for cuda_runtime.h, cuda_fp16.h and
cuda_bf16.h (include/). rewrite.py changes only what g++ cannot parse (launches and __shared__
declarations), on the same lines. nvcc stays the compile check of record (kernels/build.py).

The binding is the family's own C++ BINDING, compiled with a CPU prelude in which torch::Tensor is
a pointer, a dtype and sizes; ctypes calls it (Extension), with the methods the torch build has.
A build is cached on disk beside the CUDA ones (TORCH_EXTENSIONS_DIR, else torch's default root)
under a hash of every source and flag, and in the process: a kernel is compiled once.

The emulated device (an H100 by default; an A100) sets the launch checks and what the wrappers
ask of it: its SM count (settable, so that grid-stride loops loop) and its opt-in shared memory.

    with simt.emulating(device="A100", sms=4, order="random", seed=3):
        layernorm.layer_norm(x, w, b, mode="simt")
"""
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from . import rewrite as rewriter

HERE = Path(__file__).resolve().parent
KERNELS_DIR = HERE.parent
CXX_FLAGS = ("-std=c++20", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas",
             "-Wno-unused-function", "-Wno-unused-variable")
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-O1", "-g")


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    sms: int  # streaming multiprocessors (cudaDevAttrMultiProcessorCount)
    optin_bytes: int  # shared memory one block may use with the opt-in (CUDA's technical specifications)


DEVICES = {"H100": Device("H100", 132, 227 * 1024), "A100": Device("A100", 108, 163 * 1024)}
ORDERS = {"forward": 0, "reverse": 1, "random": 2}


@dataclasses.dataclass
class Settings:
    device: str = "H100"
    sms: int | None = None  # None: the device's
    order: str = "forward"  # the order a block's threads take turns in: forward, reverse, random
    seed: int = 0  # for order "random"


settings = Settings()


@contextlib.contextmanager
def emulating(**changes):
    """Run the block under other settings (device, sms, order, seed), restored afterwards."""
    global settings
    for key, value in changes.items():
        if key not in Settings.__dataclass_fields__:
            raise ValueError(f"simt.emulating: no setting {key!r}; the settings are {list(Settings.__dataclass_fields__)}")
    new = dataclasses.replace(settings, **changes)
    if new.device not in DEVICES:
        raise ValueError(f"simt: device {new.device!r} is not emulated; the devices are {list(DEVICES)}")
    if new.order not in ORDERS:
        raise ValueError(f"simt: thread order {new.order!r} is not one of {list(ORDERS)}")
    if new.sms is not None and not 1 <= new.sms <= 1024:
        raise ValueError(f"simt: sms={new.sms}: an SM count from 1 to 1024")
    old, settings = settings, new
    try:
        yield settings
    finally:
        settings = old


def device():
    return DEVICES[settings.device]


def properties():
    """The emulated device as torch.cuda.get_device_properties describes a GPU (the fields the
    wrappers read)."""
    d = device()
    return types.SimpleNamespace(name=f"NVIDIA {d.name} (simt, emulated)", multi_processor_count=settings.sms or d.sms,
                                 shared_memory_per_block_optin=d.optin_bytes)


# ----------------------------------------------------------------------------------------------
# The binding's CPU prelude: what build.PRELUDE gives a binding, with torch::Tensor a record.

PRELUDE = r"""
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
namespace torch {
// What a binding asks of a tensor: its data, its sizes; data_ptr<T>() checks the dtype as torch does.
struct Tensor {
  void* data_;
  int64_t dtype_;  // 0 fp32, 1 fp16, 2 bf16, 3 int64, 4 fp64, 5 another
  int64_t dim_;
  int64_t sizes_[8];
  void* data_ptr() const { return data_; }
  template <typename T> T* data_ptr() const {
    const int64_t want = std::is_same<T, float>::value ? 0 : std::is_same<T, int64_t>::value ? 3
                         : std::is_same<T, double>::value ? 4 : -1;
    if (want >= 0 && want != dtype_) throw std::runtime_error("expected a tensor of dtype code " + std::to_string(want) +
                                                              ", got " + std::to_string(dtype_));
    return static_cast<T*>(data_);
  }
  int64_t dim() const { return dim_; }
  int64_t size(int64_t d) const {
    if (d < -dim_ || d >= dim_) throw std::runtime_error("dimension " + std::to_string(d) + " out of range");
    return sizes_[d < 0 ? d + dim_ : d];
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t i = 0; i < dim_; ++i) n *= sizes_[i];
    return n;
  }
  int device() const { return 0; }
};
}  // namespace torch
template <typename... A> static std::string simt_concat(const A&... a) {
  std::ostringstream s;
  (s << ... << a);
  return s.str();
}
#define TORCH_CHECK(cond, ...) \
  if (!(cond)) throw std::runtime_error(simt_concat(__VA_ARGS__))
#define ON_DEVICE_OF(t) (void)(t)
static void check(const char* error, const char* launcher) {
  TORCH_CHECK(error == nullptr, launcher, ": ", error ? error : "");
}
static void* as_stream(int64_t stream) { return reinterpret_cast<void*>(stream); }
extern "C" const char* kernels_probe(void* stream);
void probe(int64_t stream) { check(kernels_probe(as_stream(stream)), "kernels_probe"); }
"""

ARG_TYPES = {"torch::Tensor": "tensor", "double": ctypes.c_double, "int64_t": ctypes.c_int64}
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int64: 3, torch.float64: 4}


def signatures(binding, functions):
    """{function: [(C++ type, name), ...]} for each function of the binding (and probe)."""
    out = {}
    for name in (*functions, "probe"):
        text = binding if name != "probe" else PRELUDE
        m = re.search(rf"\bvoid\s+{name}\s*\(([^)]*)\)\s*\{{", text)
        if not m:
            raise ValueError(f"simt: the binding defines no `void {name}(...)`")
        params = []
        for p in filter(None, (s.strip() for s in m[1].split(","))):
            type_, arg = p.rsplit(None, 1)
            if type_ not in ARG_TYPES:
                raise ValueError(f"simt: {name}'s parameter {p!r}: the CPU binding takes {list(ARG_TYPES)}")
            params.append((type_, arg))
        out[name] = params
    return out


def source(family, binding, functions):
    """The one translation unit: the rewritten .cu, then the binding with its prelude and an
    extern "C" wrapper per function that turns a C++ exception into the message it returns."""
    wrappers = []
    for name, params in signatures(binding, functions).items():
        decl = ", ".join(f"const torch::Tensor* a{i}" if t == "torch::Tensor" else f"{t} a{i}"
                         for i, (t, _) in enumerate(params))
        call = ", ".join(f"*a{i}" if t == "torch::Tensor" else f"a{i}" for i, (t, _) in enumerate(params))
        wrappers.append(f'extern "C" const char* simt_call_{name}({decl}) {{\n'
                        f"  try {{ {name}({call}); return nullptr; }}\n"
                        f"  catch (const std::exception& e) {{ static thread_local std::string m; m = e.what(); "
                        f"return m.c_str(); }}\n}}\n")
    return (f'#include "{family}.cu"\n#line 1 "kernels/simt/__init__.py (PRELUDE)"\n{PRELUDE}\n'
            f'#line 1 "kernels/{family}.py (BINDING)"\n{binding}\n#line 1 "kernels/simt (wrappers)"\n' + "".join(wrappers))


@functools.lru_cache(maxsize=None)
def compiler():
    cxx = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise RuntimeError(f"simt: no C++ compiler: {cxx!r} ({e.strerror}); set CXX") from None
    return cxx, version


def _inputs(family, cu):
    """Every file a build depends on, {name: text}."""
    files = {f"{family}.cu": Path(cu), "common.cuh": KERNELS_DIR / "common.cuh",
             "simt.h": HERE / "simt.h", "rewrite.py": HERE / "rewrite.py"}
    files.update({f"include/{p.name}": p for p in sorted((HERE / "include").glob("*.h"))})
    return {name: path.read_text() for name, path in files.items()}


_extensions = {}


def extension(family, binding, functions, flags=(), cu=None):
    """The family's kernels compiled for the emulator, loaded (cached on disk and in the process).
    cu: another .cu than kernels/<family>.cu (the emulator's own tests plant bugs in theirs);
    flags: g++'s, added to CXX_FLAGS (SANITIZE_FLAGS: load the result under LD_PRELOAD of libasan)."""
    from .. import build

    cu = Path(cu) if cu else KERNELS_DIR / f"{family}.cu"
    key = (family, binding, tuple(flags), str(cu))
    if key in _extensions:
        return _extensions[key]
    cxx, version = compiler()
    tu = source(family, binding, functions)
    inputs = _inputs(family, cu)
    command = [cxx, *CXX_FLAGS, *flags]
    digest = hashlib.sha1("\0".join([*inputs.values(), tu, *command, version, str(cu)]).encode()).hexdigest()
    directory = build.build_directory(f"megatron_ref_simt_{family}_{digest[:12]}")
    library = os.path.join(directory, f"{family}_simt.so")
    os.makedirs(directory, exist_ok=True)
    with build.one_build_at_a_time(family, directory):
        if not os.path.exists(library):
            t0 = time.monotonic()
            print(f"kernels: building {family}.cu for the CPU emulator (simt; cached afterwards)", flush=True)
            for name, original in ((f"{family}.cu", cu), ("common.cuh", KERNELS_DIR / "common.cuh")):
                Path(directory, name).write_text(rewriter.rewrite(inputs[name], str(original)))
            Path(directory, "unit.cpp").write_text(tu)
            partial = f"{library}.{os.getpid()}.tmp"
            out = subprocess.run([*command, f"-I{HERE / 'include'}", f"-I{KERNELS_DIR}", os.path.join(directory, "unit.cpp"),
                                  "-o", partial], capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"simt: g++ failed on {family}.cu:\n{(out.stdout + out.stderr)[-6000:]}")
            os.replace(partial, library)
            print(f"kernels: built {family}.cu for simt in {time.monotonic() - t0:.1f} s", flush=True)
    _extensions[key] = Extension(family, library, signatures(binding, functions))
    return _extensions[key]


class Extension:
    """The methods of the family's torch extension (forward, backward, probe), calling the
    compiled binding through ctypes on CPU tensors. A launcher's error is a RuntimeError, as
    TORCH_CHECK's is through torch."""

    def __init__(self, family, library, signatures):
        self.family, self.library = family, library
        self.lib = ctypes.CDLL(library)
        self.lib.simt_configure.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_int,
                                            ctypes.c_ulonglong]
        self.lib.simt_set_attribute_hook.argtypes = [ctypes.c_void_p]
        for name, params in signatures.items():
            fn = getattr(self.lib, f"simt_call_{name}")
            fn.restype = ctypes.c_char_p
            fn.argtypes = [ctypes.POINTER(TensorRecord) if t == "torch::Tensor" else ARG_TYPES[t] for t, _ in params]
            setattr(self, name, functools.partial(self._call, name, fn, params))

    def configure(self):
        d, s = device(), settings
        self.lib.simt_configure(d.name.encode(), s.sms or d.sms, d.optin_bytes, ORDERS[s.order], s.seed)

    def _call(self, name, fn, params, *args):
        if len(args) != len(params):
            raise TypeError(f"{self.family}.{name} takes {len(params)} arguments ({', '.join(p for _, p in params)}), "
                            f"got {len(args)}")
        converted = []
        for (type_, pname), a in zip(params, args):
            if type_ == "torch::Tensor":
                if not isinstance(a, torch.Tensor):
                    raise TypeError(f"{self.family}.{name}: {pname} must be a tensor, got {type(a).__name__}")
                if a.device.type != "cpu":
                    raise ValueError(f"{self.family}.{name}: {pname} is on {a.device}; mode 'simt' runs the kernels "
                                     f"on CPU tensors")
                if a.dim() > 8:
                    raise ValueError(f"{self.family}.{name}: {pname} has {a.dim()} dimensions, at most 8")
                converted.append(ctypes.byref(TensorRecord(a.data_ptr(), DTYPES.get(a.dtype, 5), a.dim(),
                                                           (ctypes.c_int64 * 8)(*a.shape))))
            else:
                converted.append(a)
        self.configure()
        error = fn(*converted)
        if error is not None:
            raise RuntimeError(error.decode(errors="replace"))


class TensorRecord(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int64), ("dim", ctypes.c_int64),
                ("sizes", ctypes.c_int64 * 8)]
