// Element access of state pools whose lines hold fp32 or bf16 values (pools.conv_dtype,
// pools.recurrent_dtype). The kernels keep every state in fp32 while they work; only the pool
// line is stored in the chosen type:
//   - a load widens exactly (bf16 is the top half of an fp32);
//   - a bf16 store rounds to nearest, ties to even, as __float2bfloat16_rn does (every NaN
//     becomes 0x7FFF, overflow gives infinity): 8 significant bits, so a relative error of at
//     most 2^-8 (half a unit in the 8th bit).
// The choice is a run-time flag, not a template parameter: pool lines are read once and written
// once per sequence (and per checkpoint), so the branch costs nothing measurable and no kernel
// is instantiated twice. Host and device (the CPU emulations include it).
#pragma once

#include <cstdint>
#include <cstring>

#include "common/host_device.h"
#include "kda/types.h"

namespace kda {

// The element types a pool line may have: the one definition the config, the conv, the conv
// checkpoints and the recurrences check against.
inline bool is_state_pool_dtype(DType d) { return d == DType::FP32 || d == DType::BF16; }

KDA_HOST_DEVICE inline float state_bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

KDA_HOST_DEVICE inline uint16_t state_float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;  // NaN
  // Adding 0x7FFF plus the lowest kept bit rounds ties to the even result; a carry out of the
  // mantissa bumps the exponent (and the largest finite values to infinity).
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Element i (in elements of the pool's type) of a pool at `base`.
KDA_HOST_DEVICE inline float load_state_elem(const void* base, int64_t i, bool bf16) {
  if (bf16) return state_bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

KDA_HOST_DEVICE inline void store_state_elem(void* base, int64_t i, float v, bool bf16) {
  if (bf16)
    static_cast<uint16_t*>(base)[i] = state_float_to_bf16(v);
  else
    static_cast<float*>(base)[i] = v;
}

// `base` advanced by i elements of the pool's type.
KDA_HOST_DEVICE inline void* state_elem_ptr(void* base, int64_t i, bool bf16) {
  return static_cast<unsigned char*>(base) + i * (bf16 ? 2 : 4);
}
KDA_HOST_DEVICE inline const void* state_elem_ptr(const void* base, int64_t i, bool bf16) {
  return static_cast<const unsigned char*>(base) + i * (bf16 ? 2 : 4);
}

}  // namespace kda
