// The gated RMSNorm's plan (gated_rmsnorm.h): gated_rmsnorm_supported() and the params. Plain
// C++, no CUDA; reads no device memory.
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "common/arg_checks.h"
#include "common/check.h"
#include "norm/gated_rmsnorm.h"

namespace kda {

bool gated_rmsnorm_supported(const GatedRmsNormArgs& a, std::string* why) {
  using detail::aligned_to;
  using detail::fail;
  using detail::in_range;
  using detail::kInt32Max;
  using detail::str_cat;
  constexpr int kWarps = norm::RmsNormTraits::kWarps;
  if (a.head_dim != norm::kHeadDim)
    return fail(why, str_cat("head_dim ", a.head_dim, " is not supported; only 128 is"));
  if (!in_range(a.num_heads, 1, 65535))
    return fail(why, str_cat("num_heads ", a.num_heads, " is outside [1, 65535]"));
  if (!in_range(a.num_tokens, 0, kInt32Max))
    return fail(why, str_cat("num_tokens ", a.num_tokens, " is outside [0, 2^31 - 1]"));
  if ((a.num_tokens * a.num_heads + kWarps - 1) / kWarps > kInt32Max)
    return fail(why, str_cat("num_tokens x num_heads = ", a.num_tokens * a.num_heads,
                             " vectors need more than 2^31 - 1 blocks"));
  if (a.varlen.query_start_loc && !in_range(a.varlen.num_seqs, 0, kInt32Max))
    return fail(why, str_cat("num_seqs ", a.varlen.num_seqs, " is outside [0, 2^31 - 1]"));
  if (!a.o || !a.g2 || !a.weight || !a.y) return fail(why, "o, g2, weight and y must be set");
  if (!aligned_to(a.o, 8) || !aligned_to(a.g2, 8) || !aligned_to(a.weight, 8) ||
      !aligned_to(a.y, 8))
    return fail(why, "o, g2, weight and y must be 8-byte aligned (lanes move 4 bf16 at a time)");
  if (a.varlen.query_start_loc && !aligned_to(a.varlen.query_start_loc, 4))
    return fail(why, "query_start_loc must be aligned to its 4-byte elements");
  const int64_t part_dim = a.num_heads * norm::kHeadDim;
  const std::pair<const char*, int64_t> strides[] = {
      {"o_row_stride", a.o_row_stride}, {"g2_row_stride", a.g2_row_stride},
      {"y_row_stride", a.y_row_stride}};
  for (const auto& [name, stride] : strides)
    if (stride < part_dim || stride % 4 != 0)
      return fail(why, str_cat(name, " ", stride, " must be >= P = ", part_dim,
                               " and a multiple of 4"));
  if (!(a.eps > 0.0) || !std::isfinite(a.eps))
    return fail(why, str_cat("eps ", a.eps, " must be positive and finite"));
  return true;
}

namespace norm {

RmsNormParams make_params(const GatedRmsNormArgs& a) {
  RmsNormParams p{};
  p.num_heads = a.num_heads;
  p.num_tokens = a.num_tokens;
  p.query_start_loc = a.varlen.query_start_loc;
  p.num_seqs = a.varlen.num_seqs;
  p.o = static_cast<const __nv_bfloat16*>(a.o);
  p.o_stride = a.o_row_stride;
  p.g2 = static_cast<const __nv_bfloat16*>(a.g2);
  p.g2_stride = a.g2_row_stride;
  p.weight = static_cast<const __nv_bfloat16*>(a.weight);
  p.eps = static_cast<float>(a.eps);
  p.y = static_cast<__nv_bfloat16*>(a.y);
  p.y_stride = a.y_row_stride;
  return p;
}

}  // namespace norm

}  // namespace kda
