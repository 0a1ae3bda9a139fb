// Bitwise comparison of byte ranges, for bit-exactness checks (self_check, tests, benches, the
// example driver): the one count of differing bits that every bitwise claim is measured with.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kda::detail {

// Number of bits in which the `bytes` bytes at a and b differ (host memory).
inline int64_t diff_bits(const void* a, const void* b, std::size_t bytes) {
  const auto* pa = static_cast<const unsigned char*>(a);
  const auto* pb = static_cast<const unsigned char*>(b);
  int64_t bits = 0;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {  // 8 bytes at a time; the tail byte by byte
    uint64_t wa, wb;
    std::memcpy(&wa, pa + i, 8);
    std::memcpy(&wb, pb + i, 8);
    bits += __builtin_popcountll(wa ^ wb);
  }
  for (; i < bytes; ++i) bits += __builtin_popcount(static_cast<unsigned>(pa[i] ^ pb[i]));
  return bits;
}

}  // namespace kda::detail
