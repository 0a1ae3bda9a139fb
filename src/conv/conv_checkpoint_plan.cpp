// The conv-state checkpoint op's plan (conv_checkpoint.h): conv_checkpoint_supported(), which
// arguments the kernel runs, and make_checkpoint_params(). Plain C++, no CUDA; reads no device
// memory: pointers are only checked for null, alignment and overlap.
#include <cstdint>
#include <string>

#include "common/arg_checks.h"
#include "common/check.h"
#include "common/state_elements.h"
#include "common/varlen_map.h"
#include "conv/conv_checkpoint.h"

namespace kda {

namespace {

// CUDA's grid limits: entries on x, column blocks on y.
constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridY = 65535;

}  // namespace

bool conv_checkpoint_supported(const ConvCheckpointArgs& a, std::string* why) {
  using detail::aligned_to;
  using detail::fail;
  using detail::kInt32Max;
  using detail::kInt64Max;
  using detail::mul_add_or_overflow;
  using detail::str_cat;
  if (a.max_entries < 0) return fail(why, str_cat("max_entries ", a.max_entries, " is negative"));
  if (a.max_entries > kMaxGridX)
    return fail(why, str_cat("max_entries ", a.max_entries, " exceeds the ", kMaxGridX,
                             " CTAs a grid's x extent can hold (one per entry)"));
  if (a.dim <= 0) return fail(why, str_cat("dim ", a.dim, " must be positive"));
  const int64_t col_blocks =
      (a.dim + kConvCheckpointChannelsPerCta - 1) / kConvCheckpointChannelsPerCta;
  if (col_blocks > kMaxGridY)
    return fail(why, str_cat("dim ", a.dim, " needs ", col_blocks, " column blocks of ",
                             kConvCheckpointChannelsPerCta, " channels, more than the ", kMaxGridY,
                             " a grid's y extent can hold"));
  if (a.num_tokens < 0) return fail(why, str_cat("num_tokens ", a.num_tokens, " is negative"));
  if (a.num_tokens > kInt32Max)
    return fail(why, str_cat("num_tokens ", a.num_tokens,
                             " exceeds 2147483647 (query_start_loc is int32)"));
  if (a.varlen.num_seqs < 0) return fail(why, str_cat("num_seqs ", a.varlen.num_seqs, " is negative"));
  if (a.varlen.num_seqs >= kInt32Max)
    return fail(why, str_cat("num_seqs ", a.varlen.num_seqs, " must be below 2147483647"));
  if (a.x_row_stride < a.dim)
    return fail(why, str_cat("x_row_stride ", a.x_row_stride, " is smaller than dim ", a.dim));
  if (a.num_tokens > 0) {
    const int64_t x_elems = mul_add_or_overflow(a.num_tokens - 1, a.x_row_stride, a.dim);
    if (x_elems < 0 || x_elems > kInt64Max / 2)
      return fail(why, "x's extent (num_tokens, x_row_stride) overflows 64-bit addressing");
  }
  if (a.varlen.cache_lines < 1)
    return fail(why, str_cat("cache_lines ", a.varlen.cache_lines, " must be at least 1"));
  // The pool holds bf16 inputs (and copies of its own taps): fp32 and bf16 both hold them exactly.
  const int state_dtype_value = static_cast<int>(a.state_dtype);
  if (state_dtype_value < static_cast<int>(DType::BF16) ||
      state_dtype_value > static_cast<int>(DType::FP32))
    return fail(why, str_cat("state_dtype has the invalid value ", state_dtype_value,
                             "; supported are fp32 and bf16"));
  if (!is_state_pool_dtype(a.state_dtype))
    return fail(why, str_cat("state_dtype ", dtype_name(a.state_dtype),
                             " is not supported; conv states are fp32 or bf16"));
  const int64_t state_elem = static_cast<int64_t>(dtype_size(a.state_dtype));
  if (a.state_stride_line < 0 || a.state_stride_dim < 0 || a.state_stride_tap < 0)
    return fail(why, str_cat("conv_states strides (", a.state_stride_line, ", ", a.state_stride_dim,
                             ", ", a.state_stride_tap, ") must not be negative"));
  const int64_t state_elems = detail::strided_extent<3>(
      {{{a.varlen.cache_lines, a.state_stride_line}, {a.dim, a.state_stride_dim}, {3, a.state_stride_tap}}});
  if (state_elems < 0 || state_elems > kInt64Max / state_elem)
    return fail(why, str_cat("conv_states strides (", a.state_stride_line, ", ", a.state_stride_dim,
                             ", ", a.state_stride_tap,
                             ") make different (line, channel, tap) elements overlap or overflow "
                             "64-bit addressing"));

  if (a.max_entries == 0) {  // nothing is read or written: no pointer is needed
    if (why) why->clear();
    return true;
  }
  if (!a.x) return fail(why, "x is null");
  if (!a.conv_states) return fail(why, "conv_states is null");
  if (!a.varlen.query_start_loc) return fail(why, "query_start_loc is null");
  if (!a.varlen.cache_indices) return fail(why, "cache_indices is null");
  if (!a.entries) return fail(why, "entries is null");
  if (!aligned_to(a.x, 2)) return fail(why, "x is not aligned to its 2-byte bf16 elements");
  if (!aligned_to(a.conv_states, static_cast<std::size_t>(state_elem)))
    return fail(why, str_cat("conv_states is not aligned to its ", state_elem, "-byte ",
                             dtype_name(a.state_dtype), " elements (state_dtype)"));
  if (!aligned_to(a.varlen.query_start_loc, 4) || !aligned_to(a.varlen.cache_indices, 4))
    return fail(why, "query_start_loc and cache_indices must be aligned to their 4-byte elements");
  if (!aligned_to(a.entries, alignof(CheckpointEntry)))
    return fail(why, str_cat("entries is not aligned to its ", alignof(CheckpointEntry),
                             "-byte CheckpointEntry records"));

  // The kernel writes conv_states while it reads x: the two must not overlap.
  if (a.num_tokens > 0) {
    const auto x_bytes = static_cast<std::size_t>(((a.num_tokens - 1) * a.x_row_stride + a.dim) * 2);
    const auto state_bytes = static_cast<std::size_t>(state_elems * state_elem);
    if (detail::byte_ranges_overlap(a.x, x_bytes, a.conv_states, state_bytes))
      return fail(why, "conv_states overlaps x");
  }

  if (why) why->clear();
  return true;
}

namespace conv {

ConvCheckpointParams make_checkpoint_params(const ConvCheckpointArgs& a) {
  ConvCheckpointParams p;
  p.x = a.x;
  p.x_row_stride = a.x_row_stride;
  p.num_tokens = a.num_tokens;
  p.dim = a.dim;
  p.conv_states = a.conv_states;
  p.state_dtype = a.state_dtype;
  p.state_stride_line = a.state_stride_line;
  p.state_stride_dim = a.state_stride_dim;
  p.state_stride_tap = a.state_stride_tap;
  varlen::copy_varlen_fields(p, a.varlen);
  p.null_line = a.varlen.null_line.value_or(-1);
  p.entries = a.entries;
  p.max_entries = a.max_entries;
  return p;
}

}  // namespace conv

}  // namespace kda
