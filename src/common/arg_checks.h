// The argument checks every op's supported() shares: pointer alignment, overflow-free extents,
// strided arrays whose indices never alias, byte ranges that overlap, and the int32 range that
// the kernels' varlen metadata and grids are bound by. Plain C++, no CUDA: the plan files and
// the CPU tests include it. Each op words its own refusal (detail::fail); these only decide.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>

namespace kda::detail {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// Whether `p` is a multiple of `bytes` (an element's size, or a vector access's width).
inline bool aligned_to(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// a * b + c for non-negative operands, or -1 when it exceeds int64 (or c is already -1).
inline int64_t mul_add_or_overflow(int64_t a, int64_t b, int64_t c) {
  if (c < 0) return -1;
  if (a != 0 && b > (kInt64Max - c) / a) return -1;
  return a * b + c;
}

// One dimension of a strided array: (size, element stride).
using StridedDim = std::pair<int64_t, int64_t>;

// The elements an array of N dimensions spans (1 + sum of stride * (size - 1)) when it maps
// distinct indices to distinct elements, otherwise -1; -1 also when the extent overflows int64.
// Sorted by stride, each stride must step past everything the smaller ones span; a dimension
// of size 0 or 1 takes no stride. Strides are not negative (each op refuses those first).
template <std::size_t N>
int64_t strided_extent(std::array<StridedDim, N> dims) {
  std::sort(dims.begin(), dims.end(),
            [](const StridedDim& a, const StridedDim& b) { return a.second < b.second; });
  int64_t extent = 1;  // elements spanned by the dimensions sorted so far
  for (const auto& [size, stride] : dims) {
    if (size <= 1) continue;
    if (stride < extent) return -1;
    extent = mul_add_or_overflow(stride, size - 1, extent);
    if (extent < 0) return -1;
  }
  return extent;
}

// Whether the byte ranges [a, a + a_bytes) and [b, b + b_bytes) share a byte (a kernel that
// reads one through the read-only path while it writes the other needs them apart).
inline bool byte_ranges_overlap(const void* a, std::size_t a_bytes, const void* b,
                                std::size_t b_bytes) {
  const auto a_begin = reinterpret_cast<std::uintptr_t>(a);
  const auto b_begin = reinterpret_cast<std::uintptr_t>(b);
  return a_begin < b_begin + b_bytes && b_begin < a_begin + a_bytes;
}

// Whether lo <= v <= hi.
constexpr bool in_range(int64_t v, int64_t lo, int64_t hi) { return lo <= v && v <= hi; }

}  // namespace kda::detail
