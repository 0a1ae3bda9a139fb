// The stock conv's per-element arithmetic, defined once for the packed kernel, the stock-path
// baseline and the CPU reference (docs/stock-conv.md says why each step is what it
// is). Compiles under nvcc and under a plain C++ compiler.
//
// Bit-exact on the device: conv4_tap_fma, silu_stock (device), store_rn, load_f32.
// Not bit-exact: silu_host_approx (std::exp2 and IEEE division instead of ex2.approx and
// div.full.f32); the CPU reference uses it for tolerance checks only. Host-side bf16/fp16
// rounding lives in common/half_host.h.
#pragma once

#include <cmath>

#include "common/host_device.h"

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
// never contracted into an fma; ex2.approx and div.full.f32 are what Triton emits and have no
// C++ spelling, hence the inline PTX. The .ftz form of ex2 gives the same final bits
// (stock-conv.md; e only ever meets d = e + 1, where a subnormal e or 2^t for a subnormal t
// rounds away) and saves the denormal fix-ups around MUFU.EX2. div.full stays non-ftz: a
// subnormal acc has a subnormal quotient, which bf16 and fp16 outputs can represent.
__device__ __forceinline__ float silu_stock(float acc) {
  const float n = __fsub_rn(0.0f, acc);  // a subtraction, not a negation
  const float t = __fmul_rn(n, kLog2e);
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(t));
  const float d = __fadd_rn(e, 1.0f);
  float y;
  asm("div.full.f32 %0, %1, %2;" : "=f"(y) : "f"(acc), "f"(d));
  return y;
}

// silu_stock with the same bits for every fp32 input, in fewer instructions; the packed kernel
// uses it, the stock-path baseline keeps the literal recipe, and test_packed_conv_gpu compares
// the two over all 2^32 inputs on the device.
//  - t = acc * -log2e instead of (0 - acc) * log2e: for acc not +-0 and not NaN, 0 - acc = -acc
//    exactly and round-to-nearest-even is symmetric; for acc = +-0 both t are +-0 and ex2 gives 1
//    (y = acc / 2 depends on acc alone); a NaN acc gives NaN either way (the GPU's fp32 NaN
//    results are the canonical NaN).
//  - div.full.f32 as ptxas expands it for sm_90 (nvcc 13.0): operands scaled by 1/4 when
//    |d| > 2^126, scaled by 2^24 when |d| < 2^-126, then a * rcp.approx(d). Here d = e + 1 with
//    e = 2^t >= 0, so d >= 1 or d is NaN, and the 2^-126 branch never runs (its test is false
//    for NaN too); what remains is spelled out.
__device__ __forceinline__ float silu_stock_fast(float acc) {
  const float t = __fmul_rn(acc, -kLog2e);
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(t));
  float d = __fadd_rn(e, 1.0f);
  float a = acc;
  if (fabsf(d) > 8.50705917302346158658e+37f) {  // 2^126
    d = __fmul_rn(d, 0.25f);
    a = __fmul_rn(a, 0.25f);
  }
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return __fmul_rn(r, a);
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

// Host approximation of silu_stock: same steps, std::exp2 for ex2.approx and IEEE
// division for div.full.f32. Both differ from the device by a few ulp at most (far less than
// one bf16 ulp except near rounding boundaries), so compare with a tolerance, never bitwise.
inline float silu_host_approx(float acc) {
  const float n = 0.0f - acc;
  const float t = n * kLog2e;
  const float e = std::exp2(t);
  const float d = e + 1.0f;
  return acc / d;
}

}  // namespace kda::conv
