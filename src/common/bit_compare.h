// Bitwise comparison of byte ranges, for bit-exactness checks (self_check, tests, benches).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kda::detail {

// Number of bits in which the `bytes` bytes at a and b differ.
inline int64_t diff_bits(const void* a, const void* b, std::size_t bytes) {
  const auto* pa = static_cast<const unsigned char*>(a);
  const auto* pb = static_cast<const unsigned char*>(b);
  int64_t bits = 0;
  for (std::size_t i = 0; i < bytes; ++i) bits += __builtin_popcount(static_cast<unsigned>(pa[i] ^ pb[i]));
  return bits;
}

}  // namespace kda::detail
