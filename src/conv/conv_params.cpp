#include "conv/conv_params.h"

#include <cstdint>

#include "common/arg_checks.h"
#include "common/check.h"
#include "common/varlen_map.h"

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
  p.query_start_loc = args.varlen.query_start_loc;
  p.cache_indices = args.varlen.cache_indices;
  p.has_initial_state = args.varlen.has_initial_state;
  p.num_tokens = args.num_tokens;
  p.num_seqs = args.varlen.num_seqs;
  p.dim = args.dim;
  p.part_dim = args.part_dim;
  p.x_row_stride = args.x_row_stride;
  p.weight_stride_dim = args.weight_stride_dim;
  p.weight_stride_tap = args.weight_stride_tap;
  p.cache_lines = args.varlen.cache_lines;
  p.state_stride_line = args.state_stride_line;
  p.state_stride_dim = args.state_stride_dim;
  p.state_stride_tap = args.state_stride_tap;
  p.cache_indices_stride = args.cache_indices_stride;
  p.out_plane_stride = resolved_plane_stride(args);
  p.has_null_line = args.varlen.null_line.has_value();
  p.null_line = args.varlen.null_line.value_or(0);
  p.silu = args.silu;
  p.x_dtype = args.x_dtype;
  p.state_bf16 = args.state_dtype == DType::BF16;

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

}  // namespace kda::conv
