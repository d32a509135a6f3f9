// SIMT on a CPU: every CUDA thread of a block runs as a fiber on the calling host thread, so the
// unchanged kernels of kernels/*.cu execute on CPU memory (kernels/simt/__init__.py builds them;
// rewrite.py changes only what g++ cannot parse). What it models, and how:
//   a block      its threads, one fiber each (a stack of its own), run one at a time in the chosen
//                order (forward, reverse, or shuffled from a seed) until each waits or exits;
//   __syncthreads   a block barrier: released when every live thread has reached it;
//   __shfl_*_sync   a warp exchange over the lanes of `mask`: released when all of them arrived;
//   shared memory  one buffer per block (static declarations first, then the dynamic bytes),
//                  every byte 0xFF (NaN as fp32, fp16 and bf16) when the block starts;
//   a launch     checked as an H100 or an A100 checks it (block and grid limits, 48 KiB of shared
//                memory without the opt-in, the device's opt-in maximum with it).
// It also makes checks a GPU does not make, each reported as one sentence: a deadlock, a barrier
// some threads exited without reaching, a full-mask shuffle in a partial warp, mismatched masks.
// It does not model: instruction-level interleaving inside a warp, the memory model (every write
// is seen at once), races between blocks (blocks run one after another), speed, registers.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__SANITIZE_ADDRESS__)
#define SIMT_ASAN 1
#include <sanitizer/common_interface_defs.h>
#endif
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

// ---------------------------------------------------------------------------------------------
// The CUDA vocabulary g++ does not know: qualifiers vanish, the built-in variables read the
// running fiber.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__
#define warpSize 32

struct uint3 { unsigned x, y, z; };
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef struct CUstream_st* cudaStream_t;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorLaunchFailure = 719,
};
typedef cudaError_t cudaError;

namespace simt {

// The emulated device and the run's choices, set from Python (simt_configure) before each call.
struct Settings {
  char device[32] = "H100";
  int sms = 132;                       // so grid_for's grid-stride loops loop when it is small
  long long optin_bytes = 227 * 1024;  // shared memory one block may use with the opt-in
  int order = 0;                       // 0 forward, 1 reverse, 2 shuffled from seed
  unsigned long long seed = 0;
};
// Each emulated configuration (device and SM count) is a device index of its own, so that what a
// launcher caches per device (common.cuh's SM counts) is never another configuration's.
struct Devices {
  Settings seen[64];
  int count = 0, current = 0;
};
inline Devices& devices() {
  static Devices d;
  return d;
}
inline Settings& settings() { return devices().seen[devices().current]; }
constexpr long long DEFAULT_BLOCK_SMEM = 48 * 1024;
constexpr int MAX_THREADS = 1024;

// The last error, per host thread as CUDA keeps it, with the sentence that explains it.
struct LastError {
  cudaError_t code = cudaSuccess;
  cudaError_t described = cudaSuccess;
  std::string sentence;
};
inline LastError& last_error() {
  static thread_local LastError e;
  return e;
}
inline const char* cuda_name(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    default: return "unspecified launch failure";
  }
}
inline cudaError_t fail(cudaError_t code, const std::string& why) {
  LastError& e = last_error();
  e.code = e.described = code;
  e.sentence = std::string(cuda_name(code)) + " (simt, emulating an " + settings().device + "): " + why;
  return code;
}
inline std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string format(const char* fmt, ...) {
  char buffer[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buffer, sizeof buffer, fmt, args);
  va_end(args);
  return buffer;
}

// ---------------------------------------------------------------------------------------------
// Fibers: a stack each and a context switch (callee-saved registers and the stack pointer).

struct Fiber;
extern "C" void simt_fiber_main(Fiber* f);

#if defined(__x86_64__)
// simt_switch(&save_sp, load_sp): push the callee-saved registers and the FP control words, save
// the stack pointer, load the other, pop its. A new fiber's stack is laid out so that the first
// switch to it "returns" into simt_trampoline with the fiber in r12.
extern "C" void simt_switch(void** save_sp, void* load_sp);
extern "C" void simt_trampoline();
asm(R"(
  .text
  .p2align 4
  .hidden simt_switch
  .globl simt_switch
  .type simt_switch, @function
simt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size simt_switch, .-simt_switch
  .p2align 4
  .hidden simt_trampoline
  .globl simt_trampoline
  .type simt_trampoline, @function
simt_trampoline:
  movq %r12, %rdi
  call simt_fiber_main
  ud2
  .size simt_trampoline, .-simt_trampoline
)");
#endif

#if defined(SIMT_ASAN)
constexpr size_t STACK_BYTES = 512 * 1024;
#else
constexpr size_t STACK_BYTES = 128 * 1024;
#endif

struct Stack {
  char* base = nullptr;  // lowest usable byte; a guard page below it
  size_t size = 0;
};

// Stacks are kept per host thread and reused by every block and launch.
inline Stack take_stack(size_t index) {
  static thread_local std::vector<Stack> pool;
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  while (pool.size() <= index) {
    char* m = (char*)mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) { fprintf(stderr, "simt: cannot map a fiber stack\n"); abort(); }
    mprotect(m, page, PROT_NONE);  // a stack overflow faults instead of writing over the next
    pool.push_back({m + page, STACK_BYTES});
  }
  return pool[index];
}

enum State { RUNNABLE, AT_BARRIER, AT_WARP, DONE };
const char* const STATE_NAMES[] = {"runnable", "__syncthreads", "a warp exchange", "exited"};

struct Block;
struct Fiber {
  void* sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t context;
#endif
  Block* block = nullptr;
  uint3 thread_idx{0, 0, 0};
  int linear = 0;
  State state = RUNNABLE;
  const char* file = "";
  int line = 0;
  const char* what = "";  // the intrinsic it waits in
  unsigned mask = 0;
  uint64_t value = 0, result = 0;
  int src = 0;
  Stack stack;
};

// Each static __shared__ declaration of a kernel, in the order the rewriter numbered them.
struct Layout {
  std::vector<size_t> offsets;
  size_t static_bytes = 0;
};

struct Launch {
  dim3 grid, block;
  size_t dynamic_bytes = 0;
  size_t dynamic_offset = 0;
  const Layout* layout = nullptr;
  std::function<void()> body;  // one thread's kernel call with the launch's arguments
};

// The lanes of a warp waiting in one exchange (lanes of disjoint masks may wait at once).
struct Group {
  unsigned mask = 0;
  int arrived = 0;
};
struct Warp {
  Group groups[32];
  int n_groups = 0;
  unsigned exited = 0;  // lanes that have returned from the kernel
};

struct Block {
  Launch* launch = nullptr;
  uint3 block_idx{0, 0, 0};
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int threads = 0, live = 0, at_barrier = 0;
  const char* barrier_file = "";
  int barrier_line = 0;
  char* smem = nullptr;
  void* scheduler_sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t scheduler_context;
#endif
#if defined(SIMT_ASAN)
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
#endif
  std::string error;
};

inline Fiber*& current_fiber() {
  static thread_local Fiber* f = nullptr;
  return f;
}
inline Fiber* fiber() { return current_fiber(); }

// From a fiber to the scheduler, and back.
inline void to_scheduler(Fiber* f) {
  Block* b = f->block;
#if defined(SIMT_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, b->scheduler_stack_bottom, b->scheduler_stack_size);
#endif
#if defined(__x86_64__)
  simt_switch(&f->sp, b->scheduler_sp);
#else
  swapcontext(&f->context, &b->scheduler_context);
#endif
#if defined(SIMT_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

inline void to_fiber(Block* b, Fiber* f) {
  current_fiber() = f;
#if defined(SIMT_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f->stack.base, f->stack.size);
#endif
#if defined(__x86_64__)
  simt_switch(&b->scheduler_sp, f->sp);
#else
  swapcontext(&b->scheduler_context, &f->context);
#endif
#if defined(SIMT_ASAN)
  __sanitizer_finish_switch_fiber(fake, &b->scheduler_stack_bottom, &b->scheduler_stack_size);
#endif
  current_fiber() = nullptr;
}

// A fault found inside a kernel: said once, and the block stops (its fibers are abandoned).
[[noreturn]] inline void fault(Fiber* f, const std::string& sentence) {
  Block* b = f->block;
  if (b->error.empty()) b->error = sentence;
  for (;;) to_scheduler(f);  // the scheduler never resumes it
}

#if !defined(__x86_64__)
inline void ucontext_entry(unsigned hi, unsigned lo) {
  simt_fiber_main((Fiber*)(((uintptr_t)hi << 32) | (uintptr_t)lo));
}
#endif

inline void start_fiber(Fiber* f) {
#if defined(__x86_64__)
  // The frame simt_switch pops: FP control words (8 bytes), r15, r14, r13, r12 (the fiber), rbx,
  // rbp, then the return address: 64 bytes below a 16-byte-aligned top.
  uintptr_t top = ((uintptr_t)(f->stack.base + f->stack.size)) & ~(uintptr_t)15;
  uint64_t* frame = (uint64_t*)(top - 64);
  uint32_t control[2] = {0x1F80u, 0x037Fu};
  memcpy(&frame[0], control, 8);
  frame[1] = frame[2] = frame[3] = 0;  // r15, r14, r13
  frame[4] = (uint64_t)(uintptr_t)f;   // r12
  frame[5] = frame[6] = 0;             // rbx, rbp
  frame[7] = (uint64_t)(uintptr_t)&simt_trampoline;
  f->sp = frame;
#else
  getcontext(&f->context);
  f->context.uc_stack.ss_sp = f->stack.base;
  f->context.uc_stack.ss_size = f->stack.size;
  f->context.uc_link = nullptr;
  const uintptr_t p = (uintptr_t)f;
  makecontext(&f->context, (void (*)())ucontext_entry, 2, (unsigned)(p >> 32), (unsigned)(p & 0xffffffffu));
#endif
}

// "threads 0..31, 64" for a sorted list of thread indices.
inline std::string ranges(const std::vector<int>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!s.empty()) s += ", ";
    s += j == i ? std::to_string(ids[i]) : std::to_string(ids[i]) + ".." + std::to_string(ids[j]);
    i = j + 1;
  }
  return s;
}

inline std::string block_name(const Block* b) {
  return format("block (%u, %u, %u) of %d threads", b->block_idx.x, b->block_idx.y, b->block_idx.z, b->threads);
}

// What every thread of a stuck block waits on, grouped by the place it waits.
inline std::string waits(const Block* b) {
  std::map<std::string, std::vector<int>> at;
  for (const Fiber& f : b->fibers) {
    if (f.state == DONE) continue;
    std::string where = f.state == AT_BARRIER ? format("__syncthreads at %s:%d", f.file, f.line)
                        : f.state == AT_WARP  ? format("%s at %s:%d (mask 0x%08x)", f.what, f.file, f.line, f.mask)
                                              : std::string("running");
    at[where].push_back(f.linear);
  }
  std::string s;
  for (auto& [where, ids] : at) s += (s.empty() ? "" : "; ") + std::string("threads ") + ranges(ids) + " in " + where;
  return s;
}

// ---------------------------------------------------------------------------------------------
// __syncthreads: the block barrier.

inline std::vector<int> exited(const Block* b) {
  std::vector<int> gone;
  for (const Fiber& g : b->fibers)
    if (g.state == DONE) gone.push_back(g.linear);
  return gone;
}

inline void syncthreads(const char* file, int line) {
  Fiber* f = fiber();
  Block* b = f->block;
  if (b->live < b->threads)
    fault(f, format("__syncthreads at %s:%d in %s: threads %s exited without reaching it, so it cannot "
                    "complete as written (on a GPU: undefined behaviour, __syncthreads in divergent code)",
                    file, line, block_name(b).c_str(), ranges(exited(b)).c_str()));
  f->state = AT_BARRIER;
  f->file = file;
  f->line = line;
  if (b->at_barrier == 0) {
    b->barrier_file = file;
    b->barrier_line = line;
  } else if (line != b->barrier_line || strcmp(file, b->barrier_file) != 0) {
    fault(f, format("divergent __syncthreads in %s: %s", block_name(b).c_str(), waits(b).c_str()));
  }
  if (++b->at_barrier == b->live) {  // every live thread is here: all go on
    for (Fiber& g : b->fibers)
      if (g.state == AT_BARRIER) g.state = RUNNABLE;
    b->at_barrier = 0;
    return;  // the last to arrive goes on at once
  }
  to_scheduler(f);
}

// ---------------------------------------------------------------------------------------------
// Warp exchanges: __shfl_*_sync and __syncwarp. A lane deposits its value and waits until every
// lane of `mask` has arrived; the last to arrive hands each lane the value of its source lane.

enum Shuffle { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, SYNCWARP };

inline uint64_t warp_exchange(const char* what, Shuffle kind, unsigned mask, uint64_t value, int operand, int width,
                              const char* file, int line) {
  Fiber* f = fiber();
  Block* b = f->block;
  const int lane = f->linear & 31, warp = f->linear >> 5;
  const int lanes = std::min(32, b->threads - warp * 32);  // the lanes this warp has
  const unsigned present = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1);
  Warp& w = b->warps[warp];
  Fiber* lane0 = &b->fibers[warp * 32];
  if (!(mask >> lane & 1))
    fault(f, format("%s at %s:%d: thread %d (lane %d of warp %d) is not in its own mask 0x%08x",
                    what, file, line, f->linear, lane, warp, mask));
  if (mask & ~present)
    fault(f, format("%s at %s:%d with mask 0x%08x in a partial warp: warp %d of a %s has lanes 0..%d only, so "
                    "the mask names lanes that do not exist (0x%08x) and would wait for them forever (on a GPU: "
                    "undefined behaviour)", what, file, line, mask, warp, block_name(b).c_str(), lanes - 1,
                    mask & ~present));
  if (kind != SYNCWARP && (width < 1 || width > 32 || (width & (width - 1))))
    fault(f, format("%s at %s:%d: width %d is not a power of 2 from 1 to 32", what, file, line, width));
  if (mask & w.exited)
    fault(f, format("%s at %s:%d with mask 0x%08x in warp %d of a %s: lane %d, named by the mask, has exited",
                    what, file, line, mask, warp, block_name(b).c_str(), __builtin_ctz(mask & w.exited)));
  Group* group = nullptr;
  for (int i = 0; i < w.n_groups; ++i) {
    Group& g = w.groups[i];
    if (g.mask == mask) group = &g;
    else if (g.mask & mask) {  // a lane named by both waits with the other mask
      int other = 0;
      while (!(lane0[other].state == AT_WARP && lane0[other].mask == g.mask)) ++other;
      const Fiber& o = lane0[other];
      fault(f, format("mismatched masks in warp %d of a %s: lane %d waits in %s at %s:%d with mask 0x%08x, lane %d "
                      "in %s at %s:%d with mask 0x%08x", warp, block_name(b).c_str(), o.linear & 31, o.what, o.file,
                      o.line, g.mask, lane, what, file, line, mask));
    }
  }
  if (!group) {
    group = &w.groups[w.n_groups++];
    group->mask = mask;
    group->arrived = 0;
  }
  f->state = AT_WARP;
  f->what = what;
  f->file = file;
  f->line = line;
  f->mask = mask;
  f->value = value;
  f->src = operand;
  if (++group->arrived < __builtin_popcount(mask)) {
    to_scheduler(f);
    return f->result;
  }
  // The last lane of the mask: hand every lane its source lane's value.
  for (int l = 0; l < lanes; ++l) {
    Fiber& g = lane0[l];
    if (!(mask >> l & 1)) continue;
    if (g.what != what && strcmp(g.what, what) != 0)
      fault(f, format("lanes of warp %d of a %s meet in different intrinsics: lane %d in %s at %s:%d, lane %d in "
                      "%s at %s:%d", warp, block_name(b).c_str(), l, g.what, g.file, g.line, lane, what, file, line));
    int src = l;
    const int segment = l & ~(width - 1);
    switch (kind) {
      case SHFL_IDX: src = segment + (g.src & (width - 1)); break;
      case SHFL_UP: src = (l - segment) >= g.src ? l - g.src : l; break;
      case SHFL_DOWN: src = (l - segment) + g.src < width ? l + g.src : l; break;
      case SHFL_XOR: src = l ^ g.src; if (src >= segment + width || src < segment) src = l; break;
      case SYNCWARP: break;
    }
    if (src >= lanes || !(mask >> src & 1))
      fault(f, format("%s at %s:%d in warp %d of a %s: lane %d reads lane %d, which is not in the mask 0x%08x "
                      "(on a GPU: an undefined value)", what, g.file, g.line, warp, block_name(b).c_str(), l, src,
                      mask));
    g.result = lane0[src].value;
  }
  for (int l = 0; l < lanes; ++l)
    if (mask >> l & 1) lane0[l].state = RUNNABLE;
  *group = w.groups[--w.n_groups];  // this group is done
  return f->result;
}

template <typename T>
inline T shuffle(const char* what, Shuffle kind, const char* file, int line, unsigned mask, T v, int operand,
                 int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffles move up to 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  bits = warp_exchange(what, kind, mask, bits, operand, width, file, line);
  T out;
  memcpy(&out, &bits, sizeof(T));
  return out;
}

inline void syncwarp(const char* file, int line, unsigned mask = 0xffffffffu) {
  warp_exchange("__syncwarp", SYNCWARP, mask, 0, 0, 32, file, line);
}

// ---------------------------------------------------------------------------------------------
// Shared memory: the rewriter turns `__shared__ T name[N];` into a reference to
// static_shared<T[N]>(k), k the declaration's number in its kernel, and `extern __shared__ T name[];`
// into a pointer to the dynamic bytes. Each kernel's body starts with kernel_entry<its declared
// types...>(): called once by the launch in query mode, it gives the static layout and returns.

inline Layout*& query_slot() {
  static thread_local Layout* q = nullptr;
  return q;
}

template <typename X>
using id = X;  // so that a declarator can name an array type: id<float[32]>& scratch

template <typename... Ts>
inline bool kernel_entry() {
  Layout* q = query_slot();
  if (!q) return false;
  const size_t sizes[] = {sizeof(Ts)..., 0}, aligns[] = {alignof(Ts)..., 1};
  size_t at = 0;
  q->offsets.clear();
  for (size_t i = 0; i < sizeof...(Ts); ++i) {
    at = (at + aligns[i] - 1) / aligns[i] * aligns[i];
    q->offsets.push_back(at);
    at += sizes[i];
  }
  q->static_bytes = at;
  return true;
}

template <typename X>
inline X& static_shared(int k) {
  Fiber* f = fiber();
  return *reinterpret_cast<X*>(f->block->smem + f->block->launch->layout->offsets[k]);
}

template <typename T>
inline T* dynamic_shared() {
  Fiber* f = fiber();
  return reinterpret_cast<T*>(f->block->smem + f->block->launch->dynamic_offset);
}

// ---------------------------------------------------------------------------------------------
// Kernels' attributes (static shared memory; the opt-in), per kernel, for the whole process as a
// CUDA context keeps them: every host thread sees the others' settings.

struct Attributes {
  Layout layout;
  long long max_dynamic = -1;  // cudaFuncAttributeMaxDynamicSharedMemorySize; -1: the default
};
inline std::mutex& attributes_lock() {
  static std::mutex m;
  return m;
}
inline std::map<void*, Attributes>& attributes_table() {
  static std::map<void*, Attributes> t;
  return t;
}

template <typename... P>
inline Attributes& attributes(void (*kernel)(P...)) {
  std::lock_guard<std::mutex> hold(attributes_lock());
  auto [it, fresh] = attributes_table().try_emplace((void*)kernel);
  if (fresh) {  // its static layout: one call in query mode, which returns at kernel_entry
    query_slot() = &it->second.layout;
    kernel(P{}...);
    query_slot() = nullptr;
  }
  return it->second;
}

inline long long max_dynamic(const Attributes& a) {
  return a.max_dynamic >= 0 ? a.max_dynamic : DEFAULT_BLOCK_SMEM - (long long)a.layout.static_bytes;
}

// Called after every cudaFuncSetAttribute (a test's hook: it can hold one host thread there).
inline void (*&attribute_hook())(long long) {
  static void (*hook)(long long) = nullptr;
  return hook;
}

// ---------------------------------------------------------------------------------------------
// Running a launch: the checks a GPU makes, then each block in turn.

inline uint64_t next_random(uint64_t& s) {
  s ^= s << 13;
  s ^= s >> 7;
  s ^= s << 17;
  return s;
}

inline void order(std::vector<int>& ids, uint64_t& rng) {
  const int mode = settings().order;
  if (mode == 1) std::reverse(ids.begin(), ids.end());
  if (mode == 2)
    for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[next_random(rng) % i]);
}

inline const char* run_block(Block& b) {
  const int n = b.threads;
  b.live = n;
  b.at_barrier = 0;
  for (Warp& w : b.warps) w = Warp{};
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.state = RUNNABLE;
    f.block = &b;
    f.mask = 0;
    f.thread_idx = {(unsigned)(i % b.launch->block.x), (unsigned)(i / b.launch->block.x % b.launch->block.y),
                    (unsigned)(i / (b.launch->block.x * b.launch->block.y))};
    start_fiber(&f);
  }
  uint64_t rng = settings().seed * 0x9E3779B97F4A7C15ull + (b.block_idx.x + 1) * 0xBF58476D1CE4E5B9ull + 1;
  std::vector<int> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = settings().order == 1 ? n - 1 - i : i;
  while (b.live > 0 && b.error.empty()) {
    if (settings().order == 2) order(ids, rng);  // shuffled afresh for every round of turns
    bool ran = false;
    for (int i : ids) {
      Fiber& f = b.fibers[i];
      if (f.state != RUNNABLE) continue;
      ran = true;
      to_fiber(&b, &f);
      if (!b.error.empty()) break;
    }
    if (!ran && b.live > 0 && b.error.empty())
      b.error = format("deadlock in %s: no thread can go on: %s", block_name(&b).c_str(), waits(&b).c_str());
  }
  return b.error.empty() ? nullptr : b.error.c_str();
}

extern "C" inline __attribute__((used, visibility("hidden"))) void simt_fiber_main(Fiber* f) {
#if defined(SIMT_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &f->block->scheduler_stack_bottom, &f->block->scheduler_stack_size);
#endif
  f->block->launch->body();
  // It exited: a barrier still waiting for it can now never complete.
  Block* b = f->block;
  f->state = DONE;
  b->live--;
  b->warps[f->linear >> 5].exited |= 1u << (f->linear & 31);
  if (b->at_barrier > 0)
    fault(f, format("__syncthreads at %s:%d in %s: thread %d exited without reaching it, so it cannot "
                    "complete as written (on a GPU: undefined behaviour, __syncthreads in divergent code)",
                    b->barrier_file, b->barrier_line, block_name(b).c_str(), f->linear));
  for (;;) to_scheduler(f);
}

template <typename... P>
inline cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t dynamic_bytes,
                          std::function<void()> body) {
  const Settings& s = settings();
  const long long threads = (long long)block.x * block.y * block.z;
  if (!block.x || !block.y || !block.z || !grid.x || !grid.y || !grid.z)
    return fail(cudaErrorInvalidConfiguration,
                format("a launch of grid (%u, %u, %u) and block (%u, %u, %u): every dimension must be at least 1",
                       grid.x, grid.y, grid.z, block.x, block.y, block.z));
  if (threads > MAX_THREADS || block.x > 1024 || block.y > 1024 || block.z > 64)
    return fail(cudaErrorInvalidConfiguration,
                format("a block of %lld threads (%u, %u, %u): at most %d threads a block, (1024, 1024, 64) "
                       "in each dimension", threads, block.x, block.y, block.z, MAX_THREADS));
  if (grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
    return fail(cudaErrorInvalidConfiguration,
                format("a grid of (%u, %u, %u) blocks: at most (2^31 - 1, 65535, 65535)", grid.x, grid.y, grid.z));
  Layout layout;
  long long allowed;
  {
    Attributes& a = attributes(kernel);
    std::lock_guard<std::mutex> hold(attributes_lock());
    layout = a.layout;
    allowed = max_dynamic(a);
  }
  if ((long long)dynamic_bytes > allowed)
    return fail(cudaErrorInvalidValue,
                format("a launch with %zu bytes of dynamic shared memory and %zu static: the kernel allows %lld "
                       "dynamic bytes (%s); with the opt-in up to %lld bytes in all",
                       dynamic_bytes, layout.static_bytes, allowed,
                       allowed == DEFAULT_BLOCK_SMEM - (long long)layout.static_bytes
                           ? "48 KiB minus its static bytes, as it has not opted in with cudaFuncSetAttribute"
                           : "cudaFuncAttributeMaxDynamicSharedMemorySize as last set",
                       s.optin_bytes));
  Launch run;
  run.grid = grid;
  run.block = block;
  run.dynamic_bytes = dynamic_bytes;
  run.dynamic_offset = (layout.static_bytes + 15) / 16 * 16;
  run.layout = &layout;
  run.body = std::move(body);
  const size_t smem_bytes = run.dynamic_offset + dynamic_bytes;
  // Exactly the bytes asked for, so that a sanitizer sees a read past the end.
  char* smem = (char*)malloc(smem_bytes ? smem_bytes : 1);
  Block b;
  b.launch = &run;
  b.threads = (int)threads;
  b.smem = smem;
  b.fibers.resize(threads);
  b.warps.resize((threads + 31) / 32);
  for (long long i = 0; i < threads; ++i) {
    b.fibers[i].linear = (int)i;
    b.fibers[i].stack = take_stack((size_t)i);
  }
  std::vector<int> blocks((size_t)grid.x * grid.y * grid.z);
  for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = (int)i;
  uint64_t rng = s.seed + 0x2545F4914F6CDD1Dull;
  order(blocks, rng);
  cudaError_t result = cudaSuccess;
  for (int id : blocks) {
    b.block_idx = {(unsigned)(id % grid.x), (unsigned)(id / grid.x % grid.y), (unsigned)(id / (grid.x * grid.y))};
    b.error.clear();
    memset(smem, 0xFF, smem_bytes);  // NaN in fp32, fp16 and bf16: a read of unwritten shared memory shows
    if (const char* error = run_block(b)) {
      result = fail(cudaErrorLaunchFailure, error);
      break;
    }
  }
  free(smem);
  return result;
}

// kernel<<<grid, block, bytes, stream>>>(args) is rewritten as
// kernel | simt::Config(grid, block, bytes, stream)(args): the config binds the arguments, and the
// kernel's own parameter types convert them, as a launch does.
template <typename... A>
struct Bound {
  dim3 grid, block;
  size_t bytes;
  std::tuple<A...> args;
};
struct Config {
  dim3 grid, block;
  size_t bytes;
  Config(dim3 g, dim3 b, size_t bytes_ = 0, cudaStream_t = nullptr) : grid(g), block(b), bytes(bytes_) {}
  template <typename... A>
  Bound<std::decay_t<A>...> operator()(A&&... a) const {
    return {grid, block, bytes, std::tuple<std::decay_t<A>...>(std::forward<A>(a)...)};
  }
};
template <typename... P, typename... A>
inline void operator|(void (*kernel)(P...), Bound<A...>&& bound) {
  static_assert(sizeof...(P) == sizeof...(A), "a launch gives its kernel as many arguments as it takes");
  std::tuple<std::decay_t<P>...> params = std::apply(
      [](auto&... a) { return std::tuple<std::decay_t<P>...>(static_cast<std::decay_t<P>>(a)...); }, bound.args);
  launch(kernel, bound.grid, bound.block, bound.bytes, [kernel, &params] { std::apply(kernel, params); });
}

}  // namespace simt

// ---------------------------------------------------------------------------------------------
// The intrinsics, with the place each is called from (the rewriter's #line keeps the .cu's).

#define __syncthreads() ::simt::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ::simt::syncwarp(__FILE__, __LINE__, ##__VA_ARGS__)
#define __shfl_sync(...) ::simt::shuffle("__shfl_sync", ::simt::SHFL_IDX, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) ::simt::shuffle("__shfl_up_sync", ::simt::SHFL_UP, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::simt::shuffle("__shfl_down_sync", ::simt::SHFL_DOWN, __FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) ::simt::shuffle("__shfl_xor_sync", ::simt::SHFL_XOR, __FILE__, __LINE__, __VA_ARGS__)
#define threadIdx (::simt::fiber()->thread_idx)
#define blockIdx (::simt::fiber()->block->block_idx)
#define blockDim (::simt::fiber()->block->launch->block)
#define gridDim (::simt::fiber()->block->launch->grid)

inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float x, float y) { return x / y; }

// ---------------------------------------------------------------------------------------------
// The runtime calls the kernels make.

enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct cudaFuncAttributes {
  size_t sharedSizeBytes, constSizeBytes, localSizeBytes;
  int maxThreadsPerBlock, numRegs, ptxVersion, binaryVersion, cacheModeCA, maxDynamicSharedSizeBytes;
};

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = simt::last_error().code;
  simt::last_error().code = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return simt::last_error().code; }
inline const char* cudaGetErrorString(cudaError_t e) {
  const simt::LastError& last = simt::last_error();
  return e == last.described && e != cudaSuccess ? last.sentence.c_str() : simt::cuda_name(e);
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = simt::devices().current;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= simt::devices().count)
    return simt::fail(cudaErrorInvalidValue, simt::format("device %d: the emulator has devices 0..%d", device,
                                                          simt::devices().count - 1));
  const simt::Settings& d = simt::devices().seen[device];
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = simt::MAX_THREADS; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)simt::DEFAULT_BLOCK_SMEM; break;
    case cudaDevAttrMultiProcessorCount: *value = d.sms; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)d.optin_bytes; break;
    default: return simt::fail(cudaErrorInvalidValue, simt::format("device attribute %d is not emulated", (int)attr));
  }
  return cudaSuccess;
}
template <typename... P>
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* out, void (*kernel)(P...)) {
  simt::Attributes& a = simt::attributes(kernel);
  std::lock_guard<std::mutex> hold(simt::attributes_lock());
  *out = cudaFuncAttributes{};
  out->sharedSizeBytes = a.layout.static_bytes;
  out->maxThreadsPerBlock = simt::MAX_THREADS;
  out->maxDynamicSharedSizeBytes = (int)simt::max_dynamic(a);
  return cudaSuccess;
}
template <typename... P>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
    return simt::fail(cudaErrorInvalidValue, simt::format("function attribute %d is not emulated", (int)attr));
  simt::Attributes& a = simt::attributes(kernel);
  {
    std::lock_guard<std::mutex> hold(simt::attributes_lock());
    const long long limit = simt::settings().optin_bytes - (long long)a.layout.static_bytes;
    if (value < 0 || value > limit)
      return simt::fail(cudaErrorInvalidValue,
                        simt::format("cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize, %d) for a "
                                     "kernel with %zu static bytes: an %s allows one block %lld bytes in all, so "
                                     "at most %lld dynamic", value, a.layout.static_bytes, simt::settings().device,
                                     simt::settings().optin_bytes, limit));
    a.max_dynamic = value;
  }
  if (simt::attribute_hook()) simt::attribute_hook()(value);
  return cudaSuccess;
}

// What Python calls (kernels/simt/__init__.py): the emulated device and thread order, the hook.
extern "C" inline __attribute__((used)) void simt_configure(const char* device, int sms, long long optin_bytes, int order,
                                      unsigned long long seed) {
  simt::Devices& all = simt::devices();
  int i = 0;
  while (i < all.count && !(strcmp(all.seen[i].device, device) == 0 && all.seen[i].sms == sms &&
                            all.seen[i].optin_bytes == optin_bytes))
    ++i;
  if (i == all.count) {
    if (all.count == 64) { fprintf(stderr, "simt: more than 64 emulated device configurations\n"); abort(); }
    snprintf(all.seen[i].device, sizeof all.seen[i].device, "%s", device);
    all.seen[i].sms = sms;
    all.seen[i].optin_bytes = optin_bytes;
    all.count++;
  }
  all.current = i;
  all.seen[i].order = order;  // the thread order and seed are the run's, not the device's
  all.seen[i].seed = seed;
}
extern "C" inline __attribute__((used)) void simt_set_attribute_hook(void (*hook)(long long)) { simt::attribute_hook() = hook; }
extern "C" inline __attribute__((used)) void simt_reset_attributes() {
  std::lock_guard<std::mutex> hold(simt::attributes_lock());
  for (auto& [k, a] : simt::attributes_table()) a.max_dynamic = -1;
}
