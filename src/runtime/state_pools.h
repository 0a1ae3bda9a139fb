// State-pool geometry in one place: the element strides of each layout, the layouts' names,
// the bytes a pool's lines occupy, and whether two such sets of bytes meet (the external-pool
// checks). Plain C++ (tested on the CPU). A line's element counts are the Config's
// (conv_line_elems, recurrent_line_elems); docs/design.md, "How to add a pool layout", says
// what a new layout touches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kda/config.h"
#include "kda/prefill.h"

namespace kda::detail {

// The element strides of a pool line of the config's layout (pools.conv_layout,
// pools.recurrent_layout), lines `line_stride` elements apart (0: packed lines).
ConvStateStrides conv_state_strides(const Config& config, int64_t line_stride);
RecurrentStateStrides recurrent_state_strides(const Config& config, int64_t line_stride);

// The layouts as the config spells them (pools.conv_layout: dim_tap | tap_dim,
// pools.recurrent_layout: hkv | hvk) and as shapes of a line ("(3P, 3)", "(H, K, V)").
const char* layout_name(ConvStateLayout layout);
const char* layout_name(RecurrentLayout layout);
const char* line_shape(ConvStateLayout layout);
const char* line_shape(RecurrentLayout layout);

// Bytes from a pool's first element to the end of line cache_lines - 1, for line strides
// resolved (never 0).
std::size_t conv_pool_span_bytes(const Config& config, int64_t line_stride);
std::size_t recurrent_pool_span_bytes(const Config& config, int64_t line_stride);

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

// The lines the module writes in layer `layer`'s pools `p` (line strides resolved): conv,
// then recurrent, named "layer L pools.conv" / "pools.recurrent".
std::vector<LineSpan> pool_line_spans(const Config& config, int layer, const StatePools& p);

}  // namespace kda::detail
