// Bias + GeLU (tanh approximation), forward and backward, fused (Narayanan et al. 2021, Section 4.2).
// Compile check:  nvcc -std=c++17 -O3 -arch=sm_90 -I kernels -c kernels/bias_gelu.cu -o /dev/null
// The torch build and the dispatch live in kernels/bias_gelu.py.
//
// Unfused, y + b is written to memory and read back by the GeLU; fused, each element is read once
// and written once. Backward recomputes z = y + b instead of storing it.
#include "common.cuh"

__device__ __forceinline__ float gelu_tanh(float z) {
  const float k0 = 0.7978845608028654f, k1 = 0.044715f;  // sqrt(2/pi)
  return 0.5f * z * (1.f + tanhf(k0 * (z + k1 * z * z * z)));
}

// d/dz of 0.5 z (1 + tanh(u)), u = k0 (z + k1 z^3):  0.5 (1 + t) + 0.5 z (1 - t^2) k0 (1 + 3 k1 z^2)
__device__ __forceinline__ float gelu_tanh_grad(float z) {
  const float k0 = 0.7978845608028654f, k1 = 0.044715f;
  const float t = tanhf(k0 * (z + k1 * z * z * z));
  return 0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * k0 * (1.f + 3.f * k1 * z * z);
}

// y, out: (rows, cols) as n / N packs of N elements; b: (cols,). cols % N == 0, so a pack never
// crosses a row and its bias is one pack of b too. grad == nullptr: forward, out = gelu(y + b);
// else backward, out = grad * gelu'(y + b).
template <typename T, int N>
__global__ void bias_gelu_kernel(const T* __restrict__ y, const T* __restrict__ b, const T* __restrict__ grad,
                                 T* __restrict__ out, int64_t n_packs, int64_t cols) {
  using P = Pack<T, N>;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_packs; i += stride) {
    const P yv = reinterpret_cast<const P*>(y)[i];
    const P bv = reinterpret_cast<const P*>(b)[(i * N) % cols / N];
    P gv, o;
    if (grad) gv = reinterpret_cast<const P*>(grad)[i];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float z = to_float(yv.v[k]) + to_float(bv.v[k]);
      o.v[k] = from_float<T>(grad ? to_float(gv.v[k]) * gelu_tanh_grad(z) : gelu_tanh(z));
    }
    reinterpret_cast<P*>(out)[i] = o;
  }
}

template <typename T>
static void launch(const void* y, const void* b, const void* grad, void* out, int64_t n, int64_t cols,
                   bool aligned, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);  // 16-byte packs when every row starts on a 16-byte boundary
  const int threads = 256;
  if (aligned && cols % V == 0) {
    bias_gelu_kernel<T, V><<<grid_for(n / V, threads), threads, 0, stream>>>(
        (const T*)y, (const T*)b, (const T*)grad, (T*)out, n / V, cols);
  } else {
    bias_gelu_kernel<T, 1><<<grid_for(n, threads), threads, 0, stream>>>(
        (const T*)y, (const T*)b, (const T*)grad, (T*)out, n, cols);
  }
}

// n = rows * cols elements; aligned: all pointers are 16-byte aligned.
extern "C" const char* bias_gelu_forward(int dtype, const void* y, const void* b, void* out, int64_t n,
                                         int64_t cols, int aligned, void* stream) {
  DISPATCH_DTYPE(dtype, T, launch<T>(y, b, nullptr, out, n, cols, aligned, (cudaStream_t)stream));
  return launch_status();
}

extern "C" const char* bias_gelu_backward(int dtype, const void* grad, const void* y, const void* b, void* dy,
                                          int64_t n, int64_t cols, int aligned, void* stream) {
  DISPATCH_DTYPE(dtype, T, launch<T>(y, b, grad, dy, n, cols, aligned, (cudaStream_t)stream));
  return launch_status();
}
