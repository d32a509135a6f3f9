// Kernels with planted bugs, one bug each: tests/test_simt.py runs each through kernels/simt and
// names the check that must catch it. Never compiled by nvcc (kernels/*.cu are the compile check).
#include "common.cuh"

// A block of 100 threads in a full-mask shuffle: its last warp has lanes 0..3 only.
__global__ void partial_warp(float* out) {
  out[threadIdx.x] = warp_sum(1.f);  // BUG: partial warp
}

// A divergent __syncthreads: half the block never reaches it.
__global__ void divergent_barrier(float* out) {
  if (threadIdx.x < 64) __syncthreads();  // BUG: divergent barrier
  out[threadIdx.x] = 1.f;
}

// 48 KiB of dynamic shared memory and 128 B of static, without the opt-in.
__global__ void over_default_smem(float* out) {
  extern __shared__ float row[];
  __shared__ float scratch[32];
  row[threadIdx.x] = scratch[threadIdx.x] = 1.f;
  out[threadIdx.x] = row[threadIdx.x] + scratch[threadIdx.x];
}

// A read of shared memory no thread wrote: 32 threads fill s[0..31], thread 31 reads s[32].
__global__ void unwritten_smem(const float* in, float* out) {
  __shared__ float s[64];
  s[threadIdx.x] = in[threadIdx.x];
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x] + s[threadIdx.x + 1];  // BUG: unwritten
}

// A missing barrier: each thread reads its neighbour's write without waiting for it.
__global__ void missing_barrier(const float* in, float* out) {
  __shared__ float s[1024];
  s[threadIdx.x] = 2.f * in[threadIdx.x];
  out[threadIdx.x] = s[threadIdx.x == 0 ? 0 : threadIdx.x - 1];  // BUG: no __syncthreads before
}

// One float read past the dynamic shared buffer of n floats.
__global__ void past_the_buffer(const float* in, float* out) {
  extern __shared__ float row[];  // (blockDim.x,)
  row[threadIdx.x] = in[threadIdx.x];
  __syncthreads();
  out[threadIdx.x] = row[threadIdx.x + 1];  // BUG: past the buffer
}

// A deadlock: lane 0 waits in a shuffle for lane 1, which waits in __syncthreads for lane 0.
__global__ void deadlock(float* out) {
  float v = 1.f;
  if (threadIdx.x == 0) v = __shfl_xor_sync(0x3u, v, 1);  // BUG: deadlock
  else __syncthreads();
  out[threadIdx.x] = v;
}

// Mismatched masks: lane 0 names lanes 0 and 1, the other lanes the whole warp.
__global__ void mismatched_masks(float* out) {
  const unsigned mask = threadIdx.x == 0 ? 0x3u : 0xffffffffu;
  out[threadIdx.x] = __shfl_xor_sync(mask, 1.f, 1);  // BUG: mismatched masks
}

__global__ void big_smem(float* out) {
  extern __shared__ float row[];
  row[threadIdx.x] = 1.f;
  out[threadIdx.x] = row[threadIdx.x];
}

// The launch layernorm.cu had before issue 46: the limit set to this launch's bytes, which a
// second host thread's smaller launch can lower between this one's setting and its launch.
template <typename Kernel>
static const char* launch_setting_its_own_bytes(Kernel kernel, int bytes, float* out) {
  cudaFuncAttributes attributes;
  if (const char* error = call_status(cudaFuncGetAttributes(&attributes, kernel))) return error;
  if (bytes + attributes.sharedSizeBytes > 48 * 1024) {
    const char* error = call_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    if (error) return error;
  }
  kernel<<<1, 32, bytes>>>(out);
  return launch_status();
}

extern "C" const char* planted(int which, const float* in, float* out, int n, void* stream) {
  const cudaStream_t s = (cudaStream_t)stream;
  switch (which) {
    case 1: partial_warp<<<1, 100, 0, s>>>(out); break;
    case 2: divergent_barrier<<<1, 128, 0, s>>>(out); break;
    case 3: over_default_smem<<<1, 32, 48 * 1024, s>>>(out); break;
    case 4: unwritten_smem<<<1, 32, 0, s>>>(in, out); break;
    case 5: missing_barrier<<<1, n, 0, s>>>(in, out); break;
    case 6: past_the_buffer<<<1, n, n * sizeof(float), s>>>(in, out); break;
    case 7: deadlock<<<1, 32, 0, s>>>(out); break;
    case 8: mismatched_masks<<<1, 32, 0, s>>>(out); break;
    case 9: return launch_setting_its_own_bytes(big_smem, n, out);  // n: the bytes
    case 10: partial_warp<<<1, n, 0, s>>>(out); break;              // n: the threads (whole warps)
    case 11: partial_warp<<<dim3(1, n), 32, 0, s>>>(out); break;    // n: the grid's y
    default: return "no such case";
  }
  return launch_status();
}
