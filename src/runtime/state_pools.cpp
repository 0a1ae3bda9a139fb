#include "runtime/state_pools.h"

#include <algorithm>
#include <sstream>
#include <utility>

namespace kda::detail {

namespace {
std::string hex(uintptr_t p) {
  std::ostringstream os;
  os << "0x" << std::hex << p;
  return os.str();
}

// The first line of `s` that ends after address `at`.
int64_t first_line_ending_after(const LineSpan& s, uintptr_t at) {
  if (at < s.base || s.lines <= 1) return 0;
  const uint64_t off = at - s.base;
  int64_t i = static_cast<int64_t>(off / s.stride_bytes);
  if (off - static_cast<uint64_t>(i) * s.stride_bytes >= s.line_bytes) ++i;  // `at` lies in the gap after line i
  return i;
}
}  // namespace

ConvStateStrides conv_state_strides(const Config& config, int64_t line_stride) {
  ConvStateStrides s;
  s.line = line_stride > 0 ? line_stride : config.conv_line_elems();
  const bool dim_tap = config.pools.conv_layout == ConvStateLayout::DimTap;
  s.dim = dim_tap ? 3 : 1;
  s.tap = dim_tap ? 1 : 3 * config.model.part_dim();
  return s;
}

RecurrentStateStrides recurrent_state_strides(const Config& config, int64_t line_stride) {
  const int64_t hd = config.model.head_dim;
  RecurrentStateStrides s;
  s.line = line_stride > 0 ? line_stride : config.recurrent_line_elems();
  s.head = hd * hd;
  const bool hkv = config.pools.recurrent_layout == RecurrentLayout::HKV;
  s.k = hkv ? hd : 1;
  s.v = hkv ? 1 : hd;
  return s;
}

const char* layout_name(ConvStateLayout layout) { return layout == ConvStateLayout::DimTap ? "dim_tap" : "tap_dim"; }
const char* layout_name(RecurrentLayout layout) { return layout == RecurrentLayout::HKV ? "hkv" : "hvk"; }
const char* line_shape(ConvStateLayout layout) { return layout == ConvStateLayout::DimTap ? "(3P, 3)" : "(3, 3P)"; }
const char* line_shape(RecurrentLayout layout) { return layout == RecurrentLayout::HKV ? "(H, K, V)" : "(H, V, K)"; }

std::size_t conv_pool_span_bytes(const Config& config, int64_t line_stride) {
  return static_cast<std::size_t>((config.pools.cache_lines - 1) * line_stride + config.conv_line_elems()) *
         dtype_size(config.pools.conv_dtype);
}

std::size_t recurrent_pool_span_bytes(const Config& config, int64_t line_stride) {
  return static_cast<std::size_t>((config.pools.cache_lines - 1) * line_stride + config.recurrent_line_elems()) *
         dtype_size(config.pools.recurrent_dtype);
}

LineSpan LineSpan::contiguous(std::string name, const void* base, uint64_t bytes) {
  LineSpan s;
  s.name = std::move(name);
  s.base = reinterpret_cast<uintptr_t>(base);
  s.stride_bytes = bytes;
  s.line_bytes = bytes;
  s.lines = bytes ? 1 : 0;
  return s;
}

uintptr_t LineSpan::end() const {
  return empty() ? base : base + static_cast<uint64_t>(lines - 1) * stride_bytes + line_bytes;
}

std::string LineSpan::describe() const {
  std::ostringstream os;
  os << "[" << hex(base) << ", " << hex(end()) << "): ";
  if (lines == 1) os << line_bytes << " B";
  else os << lines << " lines of " << line_bytes << " B, " << stride_bytes << " B apart";
  return os.str();
}

bool spans_overlap(const LineSpan& a, const LineSpan& b, uintptr_t* first) {
  if (a.empty() || b.empty()) return false;
  const uintptr_t lo = std::max(a.base, b.base), hi = std::min(a.end(), b.end());
  if (lo >= hi) return false;
  // Sweep both line sequences in address order from the common range's start: advance the
  // line that ends first, until two lines meet or one sequence leaves the range.
  int64_t i = first_line_ending_after(a, lo), j = first_line_ending_after(b, lo);
  while (i < a.lines && j < b.lines) {
    const uintptr_t as = a.base + static_cast<uint64_t>(i) * a.stride_bytes, ae = as + a.line_bytes;
    const uintptr_t bs = b.base + static_cast<uint64_t>(j) * b.stride_bytes, be = bs + b.line_bytes;
    if (as >= hi || bs >= hi) return false;
    if (std::max(as, bs) < std::min(ae, be)) {
      if (first) *first = std::max(as, bs);
      return true;
    }
    if (ae <= be) ++i;
    else ++j;
  }
  return false;
}

std::string overlap_message(const LineSpan& a, const LineSpan& b) {
  uintptr_t at = 0;
  if (!spans_overlap(a, b, &at)) return {};
  return a.name + " " + a.describe() + " overlaps " + b.name + " " + b.describe() + " (first common byte " + hex(at) +
         ")";
}

std::vector<LineSpan> pool_line_spans(const Config& config, int layer, const StatePools& p) {
  auto span = [&](const char* which, const void* base, int64_t stride, int64_t line_elems, DType dtype) {
    LineSpan s;
    s.name = "layer " + std::to_string(layer) + " pools." + which;
    s.base = reinterpret_cast<uintptr_t>(base);
    s.stride_bytes = static_cast<uint64_t>(stride) * dtype_size(dtype);
    s.line_bytes = static_cast<uint64_t>(line_elems) * dtype_size(dtype);
    s.lines = config.pools.cache_lines;
    return s;
  };
  return {span("conv", p.conv, p.conv_line_stride, config.conv_line_elems(), config.pools.conv_dtype),
          span("recurrent", p.recurrent, p.recurrent_line_stride, config.recurrent_line_elems(),
               config.pools.recurrent_dtype)};
}

}  // namespace kda::detail
