// The packed conv's plan (conv/packed_conv.h): which arguments the kernel runs bit for bit
// (args_supported: everything but the grid; packed_causal_conv1d_supported adds check_grid()
// of the default launch shape), the launch shape (vector width, chunk length, warps and chunk
// programs per CTA) and the params. Plain C++, no CUDA; reads no device memory: pointers are
// only checked for null and alignment. Strides are in elements of each array's type (the conv
// states' is state_dtype).
#include "conv/packed_conv.h"

#include <cstdint>
#include <string>
#include <utility>

#include "common/arg_checks.h"
#include "common/check.h"
#include "common/state_elements.h"
#include "common/varlen_map.h"
#include "kda/packed_conv.h"

namespace kda::conv {

namespace {

int log2_exact(int64_t v) {
  int s = 0;
  while ((int64_t{1} << s) < v) ++s;
  return s;
}

int64_t resolved_plane_stride(const PackedConvArgs& args) {
  return args.out_plane_stride != 0 ? args.out_plane_stride : args.num_tokens * args.part_dim;
}

// Whether every lane's vector of `vec` channels is aligned for its access width.
bool vec_fits(const PackedConvArgs& args, int vec) {
  const int64_t elem = static_cast<int64_t>(dtype_size(args.x_dtype));
  const int64_t access = vec * elem < 16 ? vec * elem : 16;
  if (args.part_dim % (32 * vec) != 0) return false;
  const auto access_bytes = static_cast<std::size_t>(access);
  return detail::aligned_to(args.x, access_bytes) && (args.x_row_stride * elem) % access == 0 &&
         detail::aligned_to(args.out, access_bytes) && (resolved_plane_stride(args) * elem) % access == 0 &&
         (args.part_dim * elem) % access == 0;
}

}  // namespace

int default_vec(const PackedConvArgs& args) {
  for (int vec : {4, 2}) {
    if (vec_fits(args, vec)) return vec;
  }
  return 1;
}

int default_chunks_per_cta(int64_t num_tokens) {
  return num_tokens >= 4096 ? 2 : 1;
}

int default_warps_per_cta(int64_t num_tokens, int64_t cols_per_plane) {
  int warps = num_tokens >= 4096 ? 4 : 2;
  while (warps > 1 && cols_per_plane % warps != 0) warps /= 2;
  return warps;
}

std::string check_tuning_values(const PackedConvArgs& args, const ConvTuning& tuning) {
  if (tuning.vec != 0) {
    if (tuning.vec != 8 && tuning.vec != 4 && tuning.vec != 2 && tuning.vec != 1)
      return detail::str_cat("vec ", tuning.vec, " is not one of 8, 4, 2, 1 (or 0 for the default)");
    if (!vec_fits(args, tuning.vec))
      return detail::str_cat("vec ", tuning.vec, " does not fit: 32 * vec must divide part_dim ",
                             args.part_dim,
                             " and x, out and their row/plane strides must be aligned to the "
                             "vector width");
  }
  if (tuning.chunk_len != 0) {
    const int c = tuning.chunk_len;
    if (c != 8 && c != 16 && c != 32 && c != 64 && c != 128 && c != 256)
      return detail::str_cat("chunk_len ", c,
                             " is not one of 8, 16, 32, 64, 128, 256 (or 0 for the default)");
  }
  if (tuning.warps_per_cta != 0) {
    const int w = tuning.warps_per_cta;
    if (w != 1 && w != 2 && w != 4 && w != 8)
      return detail::str_cat("warps_per_cta ", w, " is not one of 1, 2, 4, 8 (or 0 for the default)");
  }
  if (tuning.chunks_per_cta != 0) {
    const int k = tuning.chunks_per_cta;
    if (k != 1 && k != 2 && k != 4 && k != 8 && k != 16)
      return detail::str_cat("chunks_per_cta ", k, " is not one of 1, 2, 4, 8, 16 (or 0 for the default)");
  }
  const int vec = tuning.vec != 0 ? tuning.vec : default_vec(args);
  const int warps = tuning.warps_per_cta != 0
                        ? tuning.warps_per_cta
                        : default_warps_per_cta(args.num_tokens, args.part_dim / (32 * vec));
  if (warps * staging_bytes_per_warp(32 * vec) > kMaxStagingBytes)
    return detail::str_cat("warps_per_cta ", warps, " with vec ", vec, " needs ",
                           warps * staging_bytes_per_warp(32 * vec),
                           " bytes of shared memory, more than ", kMaxStagingBytes);
  return {};
}

std::string check_tuning(const PackedConvArgs& args, const ConvTuning& tuning) {
  std::string why = check_tuning_values(args, tuning);
  if (why.empty() && args.num_tokens > 0 && args.varlen.num_seqs > 0)
    why = check_grid(make_params(args, tuning));
  return why;
}

std::string check_grid(const PackedConvParams& p) {
  if (p.cta_programs > kMaxGridX)
    return detail::str_cat("the launch needs ", p.cta_programs, " CTAs per column group ((num_tokens / ",
                           1 << p.chunk_shift, " + num_seqs) / ", p.chunks_per_cta, "), more than the ",
                           kMaxGridX, " a grid's x extent can hold");
  if (p.planes > kMaxGridYZ)
    return detail::str_cat("dim / part_dim = ", p.planes, " planes, more than the ", kMaxGridYZ,
                           " a grid's z extent can hold");
  if (p.col_groups_per_plane > kMaxGridYZ)
    return detail::str_cat("part_dim ", p.part_dim, " needs ", p.col_groups_per_plane,
                           " column groups per plane, more than the ", kMaxGridYZ,
                           " a grid's y extent can hold");
  return {};
}

PackedConvParams make_params(const PackedConvArgs& args, const ConvTuning& tuning) {
  PackedConvParams p;
  p.x = args.x;
  p.out = args.out;
  p.weight = args.weight;
  p.bias = args.bias;
  p.conv_states = args.conv_states;
  varlen::copy_varlen_fields(p, args.varlen);
  p.num_tokens = args.num_tokens;
  p.dim = args.dim;
  p.part_dim = args.part_dim;
  p.x_row_stride = args.x_row_stride;
  p.weight_stride_dim = args.weight_stride_dim;
  p.weight_stride_tap = args.weight_stride_tap;
  p.state_stride_line = args.state_stride_line;
  p.state_stride_dim = args.state_stride_dim;
  p.state_stride_tap = args.state_stride_tap;
  p.cache_indices_stride = args.cache_indices_stride;
  p.out_plane_stride = resolved_plane_stride(args);
  p.has_null_line = args.varlen.null_line.has_value();
  p.null_line = args.varlen.null_line.value_or(0);
  p.silu = args.silu;
  p.x_dtype = args.x_dtype;
  p.state_dtype_is_bf16 = args.state_dtype == DType::BF16;

  p.vec = tuning.vec != 0 ? tuning.vec : default_vec(args);
  p.tile = 32 * p.vec;
  p.num_col_blocks = args.dim / p.tile;
  const int chunk = tuning.chunk_len != 0 ? tuning.chunk_len : kDefaultChunkLen;
  p.chunk_shift = log2_exact(chunk);
  p.search_steps = varlen::search_steps(args.varlen.num_seqs);
  p.search_stride = varlen::search_stride(p.search_steps);
  p.planes = args.dim / args.part_dim;
  p.cols_per_plane = args.part_dim / p.tile;
  p.programs_per_col_block = varlen::slot_count(args.num_tokens, args.varlen.num_seqs, p.chunk_shift);
  p.num_programs = p.programs_per_col_block * p.num_col_blocks;
  p.warps_per_cta = tuning.warps_per_cta != 0 ? tuning.warps_per_cta
                                             : default_warps_per_cta(args.num_tokens, p.cols_per_plane);
  p.col_groups_per_plane = (p.cols_per_plane + p.warps_per_cta - 1) / p.warps_per_cta;
  p.chunks_per_cta = tuning.chunks_per_cta != 0 ? tuning.chunks_per_cta
                                               : default_chunks_per_cta(args.num_tokens);
  p.cta_programs = (p.programs_per_col_block + p.chunks_per_cta - 1) / p.chunks_per_cta;
  p.num_ctas = p.cta_programs * p.col_groups_per_plane * p.planes;
  return p;
}

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

}  // namespace kda::conv

namespace kda {

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
