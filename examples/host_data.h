// Host-side data helpers of the example driver: seeded random bf16 hidden states and the
// comparisons the driver prints (differing bits, common/bit_compare.h; relative Frobenius
// error). Plain C++, no CUDA.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/bit_compare.h"

namespace driver {

// Uniform(-1, 1) bf16 bits (round to nearest even), from a xorshift generator: hidden states
// for the batch rows, made on the host so the driver needs nothing but the public API.
inline std::vector<uint16_t> random_bf16(size_t count, uint64_t seed) {
  std::vector<uint16_t> out(count);
  uint64_t x = seed | 1;
  for (auto& v : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    float f = static_cast<float>(static_cast<int64_t>(x >> 40) - (1 << 23)) / float(1 << 23);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
  return out;
}

inline double bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return static_cast<double>(x);
}

// Relative Frobenius error of bf16 `got` against bf16 `want` (same length); infinity when
// `got` holds a NaN or an infinity.
inline double rel_error_bf16(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = bf16_value(got[i]) - bf16_value(want[i]);
    num += d * d;
    den += bf16_value(want[i]) * bf16_value(want[i]);
  }
  return std::isfinite(num) ? std::sqrt(num / (den > 0 ? den : 1)) : INFINITY;
}

using kda::detail::diff_bits;  // differing bits of two equally long host byte ranges

}  // namespace driver
