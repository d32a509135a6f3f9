// The emulator's __half: the bits of an IEEE binary16, converted with round-to-nearest-even. No
// operators, as under torch's -D__CUDA_NO_HALF_OPERATORS__: a kernel converts to float first.
#pragma once
#include <cstring>
#include "../simt.h"
struct __half {
  unsigned short __x;
};
inline float __half2float(__half h) {
  _Float16 f;
  memcpy(&f, &h, 2);
  return (float)f;
}
inline __half __float2half_rn(float x) {
  const _Float16 f = (_Float16)x;
  __half h;
  memcpy(&h, &f, 2);
  return h;
}
inline __half __float2half(float x) { return __float2half_rn(x); }
