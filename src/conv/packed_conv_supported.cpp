// packed_causal_conv1d_supported(): which arguments the packed kernel runs bit for bit, as
// conv::args_supported() (everything but the grid) and check_grid() of the default launch
// shape. Reads no device memory; pointers are only checked for null and alignment. Strides are
// in elements of each array's type (the conv states' is state_dtype).
#include <cstdint>
#include <string>
#include <utility>

#include "common/arg_checks.h"
#include "common/check.h"
#include "common/state_storage.h"
#include "conv/conv_params.h"
#include "kda/packed_conv.h"

namespace kda {

namespace conv {

bool args_supported(const PackedConvArgs& a, std::string* why) {
  using detail::aligned_to;
  using detail::fail;
  using detail::kInt32Max;
  using detail::kInt64Max;
  using detail::mul_add_or_overflow;
  using detail::str_cat;
  const int dtype_value = static_cast<int>(a.x_dtype);
  if (dtype_value < static_cast<int>(DType::BF16) || dtype_value > static_cast<int>(DType::FP32))
    return fail(why, str_cat("x_dtype has the invalid value ", dtype_value,
                             "; supported are bf16, fp16 and fp32"));

  // A conv-state line holds the last 3 conv inputs of each channel. fp32 holds every x_dtype
  // exactly; bf16 holds only bf16 inputs exactly (a bf16 line would round fp16 or fp32 inputs,
  // and the state would no longer be the stock path's).
  const int state_dtype_value = static_cast<int>(a.state_dtype);
  if (state_dtype_value < static_cast<int>(DType::BF16) ||
      state_dtype_value > static_cast<int>(DType::FP32))
    return fail(why, str_cat("state_dtype has the invalid value ", state_dtype_value,
                             "; supported are fp32, and bf16 with x_dtype bf16"));
  if (!is_state_pool_dtype(a.state_dtype))
    return fail(why, str_cat("state_dtype ", dtype_name(a.state_dtype),
                             " is not supported; conv states are fp32, or bf16 with x_dtype bf16"));
  if (a.state_dtype == DType::BF16 && a.x_dtype != DType::BF16)
    return fail(why, str_cat("state_dtype bf16 needs x_dtype bf16: a bf16 conv-state line would "
                             "round the ", dtype_name(a.x_dtype), " inputs it keeps"));

  if (!a.x) return fail(why, "x is null");
  if (!a.weight) return fail(why, "weight is null");
  if (!a.conv_states) return fail(why, "conv_states is null");
  if (!a.varlen.query_start_loc) return fail(why, "query_start_loc is null");
  if (!a.varlen.cache_indices) return fail(why, "cache_indices is null");
  if (!a.out) return fail(why, "out is null");

  const std::size_t elem = dtype_size(a.x_dtype);
  if (!aligned_to(a.x, elem))
    return fail(why, str_cat("x is not aligned to its ", elem, "-byte ", dtype_name(a.x_dtype),
                             " elements"));
  if (!aligned_to(a.out, elem))
    return fail(why, str_cat("out is not aligned to its ", elem, "-byte ",
                             dtype_name(a.x_dtype), " elements"));
  if (!aligned_to(a.weight, 4) || (a.bias && !aligned_to(a.bias, 4)) ||
      !aligned_to(a.varlen.query_start_loc, 4) || !aligned_to(a.varlen.cache_indices, 4))
    return fail(why, "weight, bias, query_start_loc and cache_indices must be aligned to their "
                     "4-byte elements");
  const std::size_t state_elem = dtype_size(a.state_dtype);
  if (!aligned_to(a.conv_states, state_elem))
    return fail(why, str_cat("conv_states is not aligned to its ", state_elem, "-byte ",
                             dtype_name(a.state_dtype), " elements (state_dtype)"));

  if (a.num_tokens < 0) return fail(why, str_cat("num_tokens ", a.num_tokens, " is negative"));
  if (a.num_tokens > kInt32Max)
    return fail(why, str_cat("num_tokens ", a.num_tokens,
                             " exceeds 2147483647 (query_start_loc is int32)"));
  if (a.varlen.num_seqs < 0) return fail(why, str_cat("num_seqs ", a.varlen.num_seqs, " is negative"));
  if (a.varlen.num_seqs >= kInt32Max)
    return fail(why, str_cat("num_seqs ", a.varlen.num_seqs, " must be below 2147483647"));
  if (a.part_dim <= 0) return fail(why, str_cat("part_dim ", a.part_dim, " must be positive"));
  if (a.part_dim % 64 != 0)
    return fail(why, str_cat("part_dim ", a.part_dim, " is not a multiple of 64"));
  if (a.dim <= 0) return fail(why, str_cat("dim ", a.dim, " must be positive"));
  if (a.dim % a.part_dim != 0)
    return fail(why, str_cat("dim ", a.dim, " is not a multiple of part_dim ", a.part_dim));
  if (a.x_row_stride < a.dim)
    return fail(why, str_cat("x_row_stride ", a.x_row_stride, " is smaller than dim ", a.dim));

  if (a.weight_stride_dim < 0 || a.weight_stride_tap < 0)
    return fail(why, str_cat("weight strides (", a.weight_stride_dim, ", ", a.weight_stride_tap,
                             ") must not be negative"));

  const int64_t weight_taps_extent = mul_add_or_overflow(3, a.weight_stride_tap, 1);
  if (weight_taps_extent < 0 ||
      mul_add_or_overflow(a.dim - 1, a.weight_stride_dim, weight_taps_extent) < 0)
    return fail(why, "weight's extent (dim, strides) overflows 64-bit addressing");

  if (a.varlen.cache_lines < 1)
    return fail(why, str_cat("cache_lines ", a.varlen.cache_lines, " must be at least 1"));
  if (a.state_len < 3)
    return fail(why, str_cat("state_len ", a.state_len,
                             " is below 3 (the width-4 conv keeps 3 history columns)"));
  if (a.state_stride_line < 0 || a.state_stride_dim < 0 || a.state_stride_tap < 0)
    return fail(why, str_cat("conv_states strides (", a.state_stride_line, ", ",
                             a.state_stride_dim, ", ", a.state_stride_tap,
                             ") must not be negative"));
  if (detail::strided_extent<3>({{{a.varlen.cache_lines, a.state_stride_line},
                                  {a.dim, a.state_stride_dim},
                                  {a.state_len, a.state_stride_tap}}}) < 0)
    return fail(why, str_cat("conv_states strides (", a.state_stride_line, ", ",
                             a.state_stride_dim, ", ", a.state_stride_tap,
                             ") make different (line, channel, tap) elements overlap or "
                             "overflow 64-bit addressing"));
  if (a.cache_indices_stride < 1)
    return fail(why, str_cat("cache_indices_stride ", a.cache_indices_stride,
                             " must be at least 1"));
  if (a.varlen.num_seqs > 0 && mul_add_or_overflow(a.varlen.num_seqs - 1, a.cache_indices_stride, 1) < 0)
    return fail(why, "cache_indices' extent (num_seqs, cache_indices_stride) overflows 64-bit "
                     "addressing");

  const int64_t plane_rows = a.num_tokens * a.part_dim;  // <= 2^31 * 2^31: no overflow
  if (a.out_plane_stride < 0)
    return fail(why, str_cat("out_plane_stride ", a.out_plane_stride, " is negative"));
  if (a.out_plane_stride != 0 && a.out_plane_stride < plane_rows)
    return fail(why, str_cat("out_plane_stride ", a.out_plane_stride,
                             " is smaller than num_tokens * part_dim = ", plane_rows));

  // Byte extents of x and out must be addressable, and the two must not overlap (the kernel
  // reads x through the read-only cache while it writes out).
  const int64_t parts = a.dim / a.part_dim;
  const int64_t plane_stride = a.out_plane_stride != 0 ? a.out_plane_stride : plane_rows;
  if (a.num_tokens > 0) {
    const int64_t x_elems = mul_add_or_overflow(a.num_tokens - 1, a.x_row_stride, a.dim);
    const int64_t out_elems = mul_add_or_overflow(parts - 1, plane_stride, plane_rows);
    const int64_t e = static_cast<int64_t>(elem);
    if (x_elems < 0 || x_elems > kInt64Max / e)
      return fail(why, "x's extent (num_tokens, x_row_stride) overflows 64-bit addressing");
    if (out_elems < 0 || out_elems > kInt64Max / e)
      return fail(why, "out's extent (planes, out_plane_stride) overflows 64-bit addressing");
    if (detail::byte_ranges_overlap(a.x, static_cast<std::size_t>(x_elems * e), a.out,
                                    static_cast<std::size_t>(out_elems * e)))
      return fail(why, "out overlaps x");
  }

  return true;
}

}  // namespace conv

bool packed_causal_conv1d_supported(const PackedConvArgs& a, std::string* why) {
  if (!conv::args_supported(a, why)) return false;
  if (a.num_tokens > 0 && a.varlen.num_seqs > 0) {
    std::string grid = conv::check_grid(conv::make_params(a));
    if (!grid.empty()) return detail::fail(why, std::move(grid));
  }
  if (why) why->clear();
  return true;
}

}  // namespace kda
