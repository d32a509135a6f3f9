// LayerNorm over the last dim, forward and backward, fp32 statistics and accumulation. It mirrors
// Megatron-LM's own fused LayerNorm (megatron/fused_kernels/layer_norm_cuda_kernel.cu, from Apex):
// the same fusion of a memory-bound chain as Narayanan et al. 2021, Section 4.2, for an op that
// section's list of kernels leaves out.
// Compile check:  nvcc -std=c++17 -O3 -arch=sm_90 -I kernels -c kernels/layernorm.cu -o /dev/null
// The torch build and the dispatch live in kernels/layernorm.py.
//
// Unfused, the mean, the variance, the normalisation and the affine map are separate passes over
// memory. Here a block reads its row once, keeps it in shared memory as fp32, and writes y once.
// Backward recomputes xhat from x and the saved (mean, rstd) instead of storing it.
#include "common.cuh"

// A block's shared memory, static and dynamic together, up to which a launch needs no opt-in;
// more than that is a per-kernel attribute.
static const int DEFAULT_SMEM_BYTES = 48 * 1024;

// x, y: (rows, C); w, b: (C,); mean, rstd: (rows,) fp32. A block handles one row at a time
// (grid-stride over rows). Its threads read the row into shared memory, and each thread only ever
// touches its own columns c = threadIdx.x + k * blockDim.x there, so the cache needs no barrier:
// the two block sums (mean, then variance about it) supply all the synchronisation.
// Two passes over the cache rather than sum(x^2) - mean^2: no cancellation when |mean| >> std.
template <typename T>
__global__ void layernorm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                         const T* __restrict__ b, T* __restrict__ y,
                                         float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                         int64_t rows, int C, float eps) {
  extern __shared__ float row[];  // (C,): this block's current row of x, in fp32
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * C;
    T* yr = y + r * C;
    float sum = 0.f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      row[c] = to_float(xr[c]);
      sum += row[c];
    }
    const float mean = block_sum(sum, scratch) / C;
    float squares = 0.f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float d = row[c] - mean;
      squares += d * d;
    }
    const float rstd = rsqrtf(block_sum(squares, scratch) / C + eps);  // biased variance, as torch
    for (int c = threadIdx.x; c < C; c += blockDim.x)
      yr[c] = from_float<T>((row[c] - mean) * rstd * to_float(w[c]) + to_float(b[c]));
    if (threadIdx.x == 0) {
      mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
  }
}

// g, x, dx: (rows, C); w: (C,); mean, rstd: (rows,) fp32; partial: (2, gridDim.x, C) fp32.
// With xhat = (x - mean) rstd and gy = g w, per row:
//     dx = rstd (gy - mean_c(gy) - xhat mean_c(gy xhat))
// and over rows dw = sum g xhat, db = sum g. Each block takes rows blockIdx.x, + gridDim.x, ...
// and each thread owns the columns c = threadIdx.x + k * blockDim.x: it alone adds into their
// dw/db sums in shared memory, so there are no atomics, no barriers on those sums, and the
// result does not depend on timing. The block's sums land in partial[0 or 1][blockIdx.x]; the
// caller adds the gridDim.x rows of partial. x and g are read twice per row: the second read is
// of a row this block has just read, so it comes from cache rather than from DRAM.
template <typename T>
__global__ void layernorm_backward_kernel(const T* __restrict__ g, const T* __restrict__ x,
                                          const T* __restrict__ w, const float* __restrict__ mean,
                                          const float* __restrict__ rstd, T* __restrict__ dx,
                                          float* __restrict__ partial, int64_t rows, int C) {
  extern __shared__ float sums[];  // (2, C): this block's sum over its rows of g xhat, then of g
  __shared__ float scratch[32];
  float* dw_sum = sums;
  float* db_sum = sums + C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) dw_sum[c] = db_sum[c] = 0.f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* gr = g + r * C;
    const T* xr = x + r * C;
    const float mu = mean[r], rs = rstd[r];
    float sum_gy = 0.f, sum_gy_xhat = 0.f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float gc = to_float(gr[c]), xhat = (to_float(xr[c]) - mu) * rs, gy = gc * to_float(w[c]);
      sum_gy += gy;
      sum_gy_xhat += gy * xhat;
      dw_sum[c] += gc * xhat;
      db_sum[c] += gc;
    }
    const float mean_gy = block_sum(sum_gy, scratch) / C;
    const float mean_gy_xhat = block_sum(sum_gy_xhat, scratch) / C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float xhat = (to_float(xr[c]) - mu) * rs, gy = to_float(gr[c]) * to_float(w[c]);
      dx[r * C + c] = from_float<T>(rs * (gy - mean_gy - xhat * mean_gy_xhat));
    }
  }
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    partial[(int64_t)blockIdx.x * C + c] = dw_sum[c];
    partial[((int64_t)gridDim.x + blockIdx.x) * C + c] = db_sum[c];
  }
}

// The most dynamic shared memory a block of a kernel with `static_bytes` of its own may have on
// the current device with the opt-in (163 KiB on A100, 227 KiB on H100, in all), asked once per device.
static int max_dynamic_bytes(size_t static_bytes) {
  static int optin_of[64] = {0};
  int device = 0, optin = 0;
  cudaGetDevice(&device);
  if (device < 64) optin = optin_of[device];
  if (optin == 0) {
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (device < 64) optin_of[device] = optin;
  }
  return optin - (int)static_bytes;
}

// Launch `kernel` with `bytes` of dynamic shared memory, raising its limit first when the block's
// whole shared memory needs more than the default (above the device's opt-in the launch fails and
// says so). The whole is dynamic plus static: each kernel's scratch[32] is 128 B of its own (ptxas
// -v says so), and without the opt-in a launch whose total passes 48 KiB fails with "invalid
// argument" (forward at C = 12257..12288, backward at 6129..6144, before this counted it).
// cudaFuncGetAttributes reads the static size from the compiled kernel itself. The limit is raised
// to the device's maximum, the same value for every launch, and never lowered: set to this
// launch's bytes, two host threads launching the kernel at once could lower it between the other's
// setting and its launch, which would then fail (kernels/simt's tests show it).
template <typename Kernel, typename... Args>
static const char* launch(Kernel kernel, int blocks, int threads, int bytes, cudaStream_t stream,
                          Args... args) {
  cudaFuncAttributes attributes;
  const char* error = call_status(cudaFuncGetAttributes(&attributes, kernel));
  if (error) return error;
  const size_t static_bytes = attributes.sharedSizeBytes;
  if (bytes + static_bytes > DEFAULT_SMEM_BYTES) {
    error = call_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             max_dynamic_bytes(static_bytes)));
    if (error) return error;
  }
  kernel<<<blocks, threads, bytes, stream>>>(args...);
  return launch_status();
}

// Forward: 256 threads a block, as many blocks as grid_for gives (up to 8 per SM), each looping
// over rows; a row of C fp32 in shared memory.
extern "C" const char* layernorm_forward(int dtype, const void* x, const void* w, const void* b, void* y,
                                         float* mean, float* rstd, int64_t rows, int64_t C, float eps,
                                         void* stream) {
  const int threads = 256;
  const char* error = nullptr;
  DISPATCH_DTYPE(dtype, T,
      error = launch(layernorm_forward_kernel<T>, grid_for(rows, 1), threads, (int)(C * sizeof(float)),
                    (cudaStream_t)stream, (const T*)x, (const T*)w, (const T*)b, (T*)y, mean, rstd, rows,
                    (int)C, eps));
  return error;
}

// Backward: `blocks` blocks (the caller's partial has that many rows) of 512 threads. With only
// about 2 blocks per SM, 512 threads keep enough loads in flight; 2 C fp32 of shared memory each.
extern "C" const char* layernorm_backward(int dtype, const void* g, const void* x, const void* w,
                                          const float* mean, const float* rstd, void* dx, float* partial,
                                          int64_t rows, int64_t C, int64_t blocks, void* stream) {
  const int threads = 512;
  const char* error = nullptr;
  DISPATCH_DTYPE(dtype, T,
      error = launch(layernorm_backward_kernel<T>, (int)blocks, threads, (int)(2 * C * sizeof(float)),
                    (cudaStream_t)stream, (const T*)g, (const T*)x, (const T*)w, mean, rstd, (T*)dx,
                    partial, rows, (int)C));
  return error;
}
