// The stock conv's per-element arithmetic, defined once for the packed kernel, the stock-path
// baseline and the CPU reference (see /work/shared/spec/stock-conv.md for why each step is
// what it is). Compiles under nvcc and under a plain C++ compiler.
//
// Bit-exact on the device: conv4_tap_fma, silu_stock (device), the *_rn stores.
// Not bit-exact: silu_host_approx (std::exp2 and IEEE division instead of ex2.approx.f32 and
// div.full.f32); the CPU reference uses it for tolerance checks only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef KDA_HOST_DEVICE
#if defined(__CUDACC__)
#define KDA_HOST_DEVICE __host__ __device__
#else
#define KDA_HOST_DEVICE
#endif
#endif

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace kda::conv {

// log2(e) as Triton's exp lowering multiplies by it: the fp32 value 0x3FB8AA3B.
constexpr float kLog2e = 1.44269502f;

// One output of the width-4 conv: acc0 is bias[c] or +0.0f; h3 is the oldest input
// (token i-3), h0 the current one (token i); w0..w3 are the taps oldest first. Four fmas in
// that order, each rounded once. The first tap is an fma too: fma(h, w, +0) keeps +0 where a
// plain multiply would give -0.
KDA_HOST_DEVICE inline float conv4_tap_fma(float h3, float h2, float h1, float h0, float w0,
                                           float w1, float w2, float w3, float acc0) {
  float acc = fmaf(h3, w0, acc0);
  acc = fmaf(h2, w1, acc);
  acc = fmaf(h1, w2, acc);
  acc = fmaf(h0, w3, acc);
  return acc;
}

#if defined(__CUDACC__)
// SiLU exactly as Triton lowers acc / (1 + exp(-acc)) for fp32. The _rn intrinsics are
// never contracted into an fma; ex2.approx.f32 and div.full.f32 are what Triton emits and
// have no C++ spelling, hence the inline PTX.
__device__ __forceinline__ float silu_stock(float acc) {
  const float n = __fsub_rn(0.0f, acc);  // a subtraction, not a negation
  const float t = __fmul_rn(n, kLog2e);
  float e;
  asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(t));
  const float d = __fadd_rn(e, 1.0f);
  float y;
  asm("div.full.f32 %0, %1, %2;" : "=f"(y) : "f"(acc), "f"(d));
  return y;
}

// Stores of an fp32 result into the output dtype, rounding to nearest even.
template <typename T>
__device__ __forceinline__ T store_rn(float v);
template <>
__device__ __forceinline__ float store_rn<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 store_rn<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half store_rn<__half>(float v) { return __float2half_rn(v); }

// Input conversions to fp32; exact for every input dtype.
__device__ __forceinline__ float load_f32(float v) { return v; }
__device__ __forceinline__ float load_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float load_f32(__half v) { return __half2float(v); }
#endif

// Host approximation of silu_stock: same steps, std::exp2 for ex2.approx.f32 and IEEE
// division for div.full.f32. Both differ from the device by a few ulp at most (far less than
// one bf16 ulp except near rounding boundaries), so compare with a tolerance, never bitwise.
inline float silu_host_approx(float acc) {
  const float n = 0.0f - acc;
  const float t = n * kLog2e;
  const float e = std::exp2(t);
  const float d = e + 1.0f;
  return acc / d;
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Host fp32 -> bf16 bits, round to nearest even, as __float2bfloat16_rn: every NaN becomes
// the canonical 0x7FFF.
inline uint16_t float_to_bf16_bits_rn(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7FFFu + lsb) >> 16);
}

inline float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// Host fp32 -> fp16 bits, round to nearest even, as __float2half_rn: overflow gives +-inf,
// every NaN becomes the canonical 0x7FFF.
inline uint16_t float_to_fp16_bits_rn(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7FFFu;
  const uint32_t exp = a >> 23;
  if (exp >= 113) {  // |f| >= 2^-14: a normal half unless it overflows
    uint32_t h = (a >> 13) - (112u << 10);
    const uint32_t rem = a & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    if (h >= 0x7C00u) h = 0x7C00u;
    return static_cast<uint16_t>(sign | h);
  }
  // Half subnormal or zero, in units of 2^-24: value = m * 2^(exp - 150) = m >> (126 - exp).
  // A carry out of the subnormal range yields the smallest normal's encoding, as it should.
  const uint32_t shift = 126 - exp;
  if (exp == 0 || shift > 24) return static_cast<uint16_t>(sign);
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t h = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  // Subnormal or zero: man * 2^-24 is exact in fp32.
  const float mag = static_cast<float>(man) * bits_float(0x33800000u);  // 2^-24
  return sign ? -mag : mag;
}

}  // namespace kda::conv
