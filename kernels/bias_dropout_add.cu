// Bias + dropout + residual add, forward and backward, fused (Narayanan et al. 2021, Section 4.2;
// Megatron's bias_dropout_add_fused_train). Compile check:
//   nvcc -std=c++17 -O3 -arch=sm_90 -I kernels -c kernels/bias_dropout_add.cu -o /dev/null
// The torch build and the dispatch live in kernels/bias_dropout_add.py.
//
// Unfused, y + b, the dropout mask, the dropped tensor and the sum are four trips to memory; fused,
// y, b and the residual are read once and the output written once. The mask is never stored: keep(i)
// is a hash of (seed, i), so backward regenerates it bit for bit, and the PyTorch reference computes
// the same hash on int64 tensors. The seed is read through a device pointer, not passed by value, so
// a CUDA graph replays this kernel with whatever seed the graph's own randint drew this time.
#include "common.cuh"

// A 32-bit integer finaliser (two multiply-xorshift rounds); every output bit depends on every
// input bit, so consecutive indices give unrelated bits.
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  x ^= x >> 15;
  return x;
}

// Element i survives iff the top 24 bits of its hash reach threshold = ceil(p * 2^24): probability
// 1 - threshold / 2^24 ~ 1 - p, and the comparison is exact in integers, so reference and kernel agree.
__device__ __forceinline__ bool keep(uint32_t i, uint32_t key, uint32_t threshold) {
  return (mix32(mix32(i ^ key) + key) >> 8) >= threshold;
}

// y, residual, out: n elements as n / N packs of N; b: (cols,), cols % N == 0, so a pack never crosses
// a row and its bias is one pack of b. Forward: out = residual + keep * (y + b) * scale. Backward
// passes grad as y and nullptr for b and residual: out = keep * grad * scale. n < 2^32, so the flat
// index fits the hash's 32 bits.
template <typename T, int N>
__global__ void bias_dropout_add_kernel(const T* __restrict__ y, const T* __restrict__ b,
                                        const T* __restrict__ residual, const int64_t* __restrict__ seed,
                                        T* __restrict__ out, int64_t n_packs, int64_t cols,
                                        uint32_t threshold, float scale) {
  using P = Pack<T, N>;
  const uint32_t key = mix32((uint32_t)*seed);  // the seed mod 2^32
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_packs; i += stride) {
    const P yv = reinterpret_cast<const P*>(y)[i];
    P bv, rv, o;
    if (b) bv = reinterpret_cast<const P*>(b)[(i * N) % cols / N];
    if (residual) rv = reinterpret_cast<const P*>(residual)[i];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float z = to_float(yv.v[k]) + (b ? to_float(bv.v[k]) : 0.f);
      // a dropped element adds exactly 0, even where z is inf or nan
      const float dropped = keep((uint32_t)(i * N + k), key, threshold) ? z * scale : 0.f;
      o.v[k] = from_float<T>(residual ? to_float(rv.v[k]) + dropped : dropped);
    }
    reinterpret_cast<P*>(out)[i] = o;
  }
}

template <typename T>
static void launch(const void* y, const void* b, const void* residual, const int64_t* seed, void* out,
                   int64_t n, int64_t cols, uint32_t threshold, float scale, bool aligned,
                   cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);  // 16-byte packs when every row starts on a 16-byte boundary
  const int threads = 256;
  if (aligned && cols % V == 0) {
    bias_dropout_add_kernel<T, V><<<grid_for(n / V, threads), threads, 0, stream>>>(
        (const T*)y, (const T*)b, (const T*)residual, seed, (T*)out, n / V, cols, threshold, scale);
  } else {
    bias_dropout_add_kernel<T, 1><<<grid_for(n, threads), threads, 0, stream>>>(
        (const T*)y, (const T*)b, (const T*)residual, seed, (T*)out, n, cols, threshold, scale);
  }
}

// n = rows * cols elements; seed: one int64 on the device; aligned: all pointers are 16-byte aligned.
extern "C" const char* bias_dropout_add_forward(int dtype, const void* y, const void* b, const void* residual,
                                                const int64_t* seed, void* out, int64_t n, int64_t cols,
                                                uint32_t threshold, float scale, int aligned, void* stream) {
  DISPATCH_DTYPE(dtype, T, launch<T>(y, b, residual, seed, out, n, cols, threshold, scale, aligned,
                                     (cudaStream_t)stream));
  return launch_status();
}

// dy = keep * grad * scale over n elements, seen as one row of n with no bias (packs when n % V == 0).
extern "C" const char* bias_dropout_add_backward(int dtype, const void* grad, const int64_t* seed, void* dy,
                                                 int64_t n, uint32_t threshold, float scale, int aligned,
                                                 void* stream) {
  DISPATCH_DTYPE(dtype, T, launch<T>(grad, nullptr, nullptr, seed, dy, n, n, threshold, scale, aligned,
                                     (cudaStream_t)stream));
  return launch_status();
}
