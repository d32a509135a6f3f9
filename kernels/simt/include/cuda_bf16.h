// The emulator's __nv_bfloat16: the top 16 bits of an fp32, rounded to nearest even (as torch's
// CPU conversion and CUDA's __float2bfloat16_rn). No operators, as under torch's flags.
#pragma once
#include <cstdint>
#include <cstring>
#include "../simt.h"
struct __nv_bfloat16 {
  unsigned short __x;
};
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = (uint32_t)b.__x << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {(unsigned short)((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return {(unsigned short)(u >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float x) { return __float2bfloat16_rn(x); }
