// State-pool geometry the module checks external pools with: the bytes a pool's lines occupy
// and whether two such sets of bytes meet. Plain C++ (tested on the CPU).
#pragma once

#include <cstdint>
#include <string>

namespace kda::detail {

// The bytes a pool's lines [0, lines) occupy: runs of `line_bytes` bytes, `stride_bytes` apart,
// from `base`. A contiguous buffer is one line. What lies between lines is not part of the span
// (an external pool's gaps are the server's, and may hold another pool's lines).
struct LineSpan {
  std::string name;  // e.g. "layer 1 pools.recurrent"
  uintptr_t base = 0;
  uint64_t stride_bytes = 0;  // >= line_bytes when lines > 1
  uint64_t line_bytes = 0;
  int64_t lines = 0;

  static LineSpan contiguous(std::string name, const void* base, uint64_t bytes);
  // One past the last byte of the last line (base when empty).
  uintptr_t end() const;
  bool empty() const { return lines <= 0 || line_bytes == 0; }
  // "[0x7f0000000000, 0x7f0000120000): 513 lines of 4608 B, 9216 B apart" (or "... : 1024 B").
  std::string describe() const;
};

// True when a byte lies in a line of both spans; *first gets the lowest such byte. Walks only
// the lines inside the spans' common address range: O(lines there).
bool spans_overlap(const LineSpan& a, const LineSpan& b, uintptr_t* first = nullptr);

// "layer 1 pools.conv [..): ... overlaps layer 0 pools.recurrent [..): ... (first common byte 0x..)",
// or empty when they do not overlap.
std::string overlap_message(const LineSpan& a, const LineSpan& b);

}  // namespace kda::detail
