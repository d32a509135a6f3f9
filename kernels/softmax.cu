// Scaled causal softmax, forward and backward, fused (Narayanan et al. 2021, Section 4.2; Megatron's
// scaled_upper_triang_masked_softmax): the attention path when flash attention is off.
// Compile check:  nvcc -std=c++17 -O3 -arch=sm_90 -I kernels -c kernels/softmax.cu -o /dev/null
// The torch build and the dispatch live in kernels/softmax.py.
//
// Unfused, scale * x, the masked fill and the softmax are three trips through memory for a (T, T)
// tensor per head; fused, each score is read once and each probability written once. Query i sees
// keys 0..i only, so the kernel never reads the masked half of the row: it writes zeros there.
#include "common.cuh"

// Forward caches the row in shared memory as fp32, backward both y and g: at 4096 columns 32 KB,
// within the 48 KB a block gets without opting in. kernels/softmax.py's MAX_T is the same number.
constexpr int MAX_T = 4096;

// x, y: (rows, cols), rows = (batch...) * cols, one block per row; row r is query i = r % cols.
// y[j] = exp(scale x[j] - m) / sum_{j' <= i} exp(scale x[j'] - m) for j <= i, m the row's max; else 0.
template <typename T>
__global__ void softmax_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int cols, float scale) {
  extern __shared__ float row[];  // (cols,): scale * x, then the exponentials
  __shared__ float scratch[32];
  const int64_t offset = (int64_t)blockIdx.x * cols;
  const int visible = (int)(blockIdx.x % cols) + 1;
  // Each thread revisits only its own columns j = threadIdx.x + k * blockDim.x, so row[] needs no
  // barrier between the passes; the reductions carry their own.
  float m = -INFINITY;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) {
    row[j] = scale * to_float(x[offset + j]);
    m = fmaxf(m, row[j]);
  }
  m = block_max(m, scratch);
  float sum = 0.f;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) {
    row[j] = expf(row[j] - m);  // <= 1: the max is subtracted, so no score can overflow
    sum += row[j];
  }
  const float inv = 1.f / block_sum(sum, scratch);  // >= 1 term equals 1 (the max), so sum >= 1
  for (int j = threadIdx.x; j < cols; j += blockDim.x)
    y[offset + j] = from_float<T>(j < visible ? row[j] * inv : 0.f);
}

// dx[j] = scale * y[j] * (g[j] - sum_j' g[j'] y[j']): the softmax Jacobian applied to g, then the
// scale's chain rule. Masked columns have y = 0, hence dx = 0; they are written, never read.
template <typename T>
__global__ void softmax_backward_kernel(const T* __restrict__ g, const T* __restrict__ y, T* __restrict__ dx,
                                        int cols, float scale) {
  extern __shared__ float cache[];  // (2, cols): y, then g
  __shared__ float scratch[32];
  float *yc = cache, *gc = cache + cols;
  const int64_t offset = (int64_t)blockIdx.x * cols;
  const int visible = (int)(blockIdx.x % cols) + 1;
  float dot = 0.f;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) {
    yc[j] = to_float(y[offset + j]);
    gc[j] = to_float(g[offset + j]);
    dot += yc[j] * gc[j];
  }
  dot = block_sum(dot, scratch);
  for (int j = threadIdx.x; j < cols; j += blockDim.x)
    dx[offset + j] = from_float<T>(j < visible ? scale * yc[j] * (gc[j] - dot) : 0.f);
}

// About four columns per thread, in whole warps (block_sum/block_max need them), 128..1024 threads.
static int threads_for(int cols) {
  const int t = (cols + 127) / 128 * 32;
  return t < 128 ? 128 : (t > 1024 ? 1024 : t);
}

static const char* check_shape(int64_t rows, int64_t cols) {
  if (cols > MAX_T) return "T is above the kernel's limit of 4096 (the row must fit in shared memory)";
  if (rows > 0x7fffffff) return "more than 2^31 - 1 rows (one block each)";
  return nullptr;
}

template <typename T>
static void launch_forward(const void* x, void* y, int64_t rows, int cols, float scale, cudaStream_t stream) {
  softmax_forward_kernel<T><<<(unsigned)rows, threads_for(cols), cols * sizeof(float), stream>>>(
      (const T*)x, (T*)y, cols, scale);
}

template <typename T>
static void launch_backward(const void* g, const void* y, void* dx, int64_t rows, int cols, float scale,
                            cudaStream_t stream) {
  softmax_backward_kernel<T><<<(unsigned)rows, threads_for(cols), 2 * cols * sizeof(float), stream>>>(
      (const T*)g, (const T*)y, (T*)dx, cols, scale);
}

// x, y: (rows, cols) contiguous, rows a multiple of cols (the query index is row % cols).
extern "C" const char* softmax_forward(int dtype, const void* x, void* y, int64_t rows, int64_t cols,
                                       float scale, void* stream) {
  if (const char* error = check_shape(rows, cols)) return error;
  if (rows == 0) return nullptr;  // a grid of zero blocks is a launch error, and there is no work
  DISPATCH_DTYPE(dtype, T, launch_forward<T>(x, y, rows, (int)cols, scale, (cudaStream_t)stream));
  return launch_status();
}

// g, y, dx: (rows, cols) contiguous; y is the forward's output.
extern "C" const char* softmax_backward(int dtype, const void* g, const void* y, void* dx, int64_t rows,
                                        int64_t cols, float scale, void* stream) {
  if (const char* error = check_shape(rows, cols)) return error;
  if (rows == 0) return nullptr;
  DISPATCH_DTYPE(dtype, T, launch_backward<T>(g, y, dx, rows, (int)cols, scale, (cudaStream_t)stream));
  return launch_status();
}
