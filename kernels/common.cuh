// Shared by every kernels/*.cu: dtype conversions, warp and block reductions, dtype dispatch.
// Plain CUDA C++ with no torch headers, so `nvcc -c` alone compiles each .cu (tests do, for sm_80
// and sm_90). Launchers take raw pointers and a stream, and return nullptr or an error string.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

// The dtype codes, as kernels/build.py's DTYPE_CODES numbers them.
enum DType { F32 = 0, F16 = 1, BF16 = 2 };

// Every kernel loads T, computes in fp32 and stores T.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N consecutive elements moved as one 16-byte load or store when N * sizeof(T) == 16.
template <typename T, int N> struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Block-wide reductions; every thread gets the result. blockDim.x must be a multiple of 32.
// `scratch` holds 32 floats of shared memory; the first barrier lets a previous call finish
// reading it before it is overwritten. Each warp reduces, then every warp reduces the warps'
// results (`identity` fills the lanes beyond the number of warps).
template <float (*warp_reduce)(float)>
__device__ __forceinline__ float block_reduce(float v, float* scratch, float identity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_reduce(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : identity;
  return warp_reduce(v);
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  return block_reduce<warp_sum>(v, scratch, 0.f);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  return block_reduce<warp_max>(v, scratch, -INFINITY);
}

// Enough blocks to fill the device for a grid-stride loop over `work` items of `threads` each.
// The SM count is asked once per device, not at every launch.
static inline int grid_for(int64_t work, int threads) {
  static int sms_of[64] = {0};
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  if (device < 64) sms = sms_of[device];
  if (sms == 0) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (device < 64) sms_of[device] = sms;
  }
  const int64_t wanted = (work + threads - 1) / threads, cap = (int64_t)sms * 8;
  return (int)(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
}

// What a launcher returns: nullptr if the launch went in, else CUDA's message for the error. It
// takes the error (cudaGetLastError), and the binding raises it: reported once, by the launcher
// whose launch failed. Peeking would leave it pending, so that the next launch check, torch's own
// after an unrelated kernel or the next launcher's here, would report it again as its own failure.
static inline const char* launch_status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// What a launcher returns for a runtime call of its own (an attribute query or setting): nullptr if
// it succeeded, else CUDA's message. The runtime records a failed call's error as the last error
// too, so it is taken here: left pending, the next launch check would report it as its own.
static inline const char* call_status(cudaError_t err) {
  if (err == cudaSuccess) return nullptr;
  cudaGetLastError();
  return cudaGetErrorString(err);
}

// One empty kernel, launched once after an extension is loaded (kernels/build.py's probe): built
// without this GPU's architecture, it fails to launch with "no kernel image is available for
// execution on the device", at start rather than inside a training step. Each .cu is one
// extension and includes this header once, so the definition is made once per extension.
static __global__ void probe_kernel() {}
extern "C" const char* kernels_probe(void* stream) {
  probe_kernel<<<1, 32, 0, (cudaStream_t)stream>>>();
  return launch_status();
}

// Run `body` with T bound to the element type of dtype code `code`.
#define DISPATCH_DTYPE(code, T, ...)                 \
  switch (code) {                                    \
    case F32: { using T = float; __VA_ARGS__; break; }          \
    case F16: { using T = __half; __VA_ARGS__; break; }         \
    case BF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
    default: return "unsupported dtype code";        \
  }
