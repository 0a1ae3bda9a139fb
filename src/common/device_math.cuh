// Device-side math shared by the kernels of src/recurrence and src/norm: bf16 widening and
// vector loads / stores (round to nearest even), a deterministic warp sum, and the IEEE fp32
// forms of the layer's scalar functions (sigmoid, softplus; docs/layer.md). Include from .cu
// files only.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace kda::device_math {

// bf16 is the top half of an fp32, so widening is a shift.
__device__ __forceinline__ float bf16_low_to_float(uint32_t word) {
  return __uint_as_float(word << 16);
}
__device__ __forceinline__ float bf16_high_to_float(uint32_t word) {
  return __uint_as_float(word & 0xFFFF0000u);
}

// 4 consecutive bf16 from an 8-byte aligned address; element 0 is the low half of word 0.
__device__ __forceinline__ void load4_bf16(const __nv_bfloat16* src, float (&out)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(src);
  out[0] = bf16_low_to_float(raw.x);
  out[1] = bf16_high_to_float(raw.x);
  out[2] = bf16_low_to_float(raw.y);
  out[3] = bf16_high_to_float(raw.y);
}

// Rounds 4 values to bf16 (nearest even) and stores them to an 8-byte aligned address.
__device__ __forceinline__ void store4_bf16(__nv_bfloat16* dst, const float (&in)[4]) {
  auto bits = [](float x) {
    return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(x)));
  };
  uint2 raw;
  raw.x = bits(in[0]) | (bits(in[1]) << 16);
  raw.y = bits(in[2]) | (bits(in[3]) << 16);
  *reinterpret_cast<uint2*>(dst) = raw;
}

__device__ __forceinline__ float load_bf16(const __nv_bfloat16* src) { return __bfloat162float(*src); }

// Butterfly sum over the warp. Every lane ends with the same value (each step adds the same
// two operands on both partners, only swapped), so the result is deterministic and uniform.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, mask);
  return x;
}

// IEEE expf / log1pf / division (the build never uses --use_fast_math).
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

}  // namespace kda::device_math
