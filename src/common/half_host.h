// Host-side bf16 / fp16 <-> float conversions, plain C++ (no CUDA headers), for CPU references
// and tests. Conversions from float round to nearest, ties to even, like __float2bfloat16_rn
// and __float2half_rn; every NaN becomes the canonical 0x7FFF, as the device conversions
// give; overflow gives infinity.
#pragma once

#include <cstdint>
#include <cstring>

namespace kda::host {

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

// bf16 is the top half of an fp32, so widening is exact.
inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  // Adding 0x7FFF plus the lowest kept bit rounds ties towards the even result; a carry out
  // of the mantissa correctly bumps the exponent (and the largest finite values to infinity).
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7FFFu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (man << 13));  // inf / NaN
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  if (man == 0) return bits_float(sign);  // +-0
  // Subnormal: man x 2^-24 is exact in fp32.
  float v = static_cast<float>(man) * bits_float(0x33800000u);  // 2^-24
  return sign ? -v : v;
}

inline uint16_t float_to_fp16(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return 0x7FFFu;
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: inf
  int32_t exp = static_cast<int32_t>(abs >> 23) - 127;  // unbiased fp32 exponent
  uint32_t man = (abs & 0x7FFFFFu) | 0x800000u;         // 24-bit significand with the hidden 1
  if (abs < 0x38800000u) {                              // below 2^-14: fp16 subnormal or zero
    if (abs < 0x33000000u) return sign;                 // below 2^-25: rounds to zero (2^-25 is a tie to 0)
    // The value is man x 2^(exp-23), i.e. man x 2^(exp+1) units of 2^-24 (the fp16 subnormal
    // step), so -(exp + 1) low bits of the significand are dropped (14..24 of them).
    int shift = -exp - 1;
    uint32_t kept = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (kept & 1u))) ++kept;  // a carry into 0x400 is the smallest normal
    return static_cast<uint16_t>(sign | kept);
  }
  // Normal: drop 13 mantissa bits with round-to-nearest-even; a carry bumps the exponent.
  uint32_t h = (static_cast<uint32_t>(exp + 15) << 10) | ((man >> 13) & 0x3FFu);
  uint32_t rem = abs & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline float bf16_round(float f) { return bf16_to_float(float_to_bf16(f)); }
inline float fp16_round(float f) { return fp16_to_float(float_to_fp16(f)); }

}  // namespace kda::host
