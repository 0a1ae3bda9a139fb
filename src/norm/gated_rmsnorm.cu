// gated_rmsnorm: y = x * rsqrt(mean(x^2) + eps) * weight * sigmoid(g2) per (token, head)
// 128-vector x of o, fp32 math, bf16 out. One warp per vector, 4 channels per lane; the grid
// covers the capacity (num_tokens x H vectors) and warps past the batch's last row exit.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "common/arg_checks.h"
#include "common/check.h"
#include "common/cuda_check.h"
#include "common/device_math.cuh"
#include "norm/gated_rmsnorm.h"

namespace kda {
namespace {

using device_math::load4_bf16;
using device_math::sigmoid;
using device_math::store4_bf16;
using device_math::warp_sum;

constexpr const char* kFunction = "kda::gated_rmsnorm";
constexpr int kHeadDim = 128;

struct RmsNormTraits {
  static constexpr int kWarps = 8;  // vectors per block
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kLaneChannels = kHeadDim / 32;
  static_assert(kLaneChannels == 4, "lanes move 4 bf16 (8 bytes) at a time");
};
using Traits = RmsNormTraits;

struct RmsNormParams {
  int64_t num_heads;
  int64_t num_tokens;
  const int32_t* query_start_loc;  // nullptr: all num_tokens rows
  int64_t num_seqs;
  const __nv_bfloat16* o;
  int64_t o_stride;
  const __nv_bfloat16* g2;
  int64_t g2_stride;
  const __nv_bfloat16* weight;
  float eps;
  __nv_bfloat16* y;
  int64_t y_stride;
};

__global__ void __launch_bounds__(Traits::kThreads) gated_rmsnorm_kernel(const RmsNormParams p) {
  int64_t rows = p.num_tokens;
  if (p.query_start_loc != nullptr)
    rows = min(rows, max(static_cast<int64_t>(p.query_start_loc[p.num_seqs]), int64_t{0}));
  const int64_t vector = static_cast<int64_t>(blockIdx.x) * Traits::kWarps + threadIdx.x / 32;
  const int64_t row = vector / p.num_heads;
  const int64_t head = vector % p.num_heads;
  if (row >= rows) return;  // uniform over the warp: the shuffles below see all 32 lanes

  const int channel = Traits::kLaneChannels * (threadIdx.x % 32);
  const int64_t col = head * kHeadDim + channel;
  float x[4], g2[4], w[4];
  load4_bf16(p.o + row * p.o_stride + col, x);
  load4_bf16(p.g2 + row * p.g2_stride + col, g2);
  load4_bf16(p.weight + channel, w);
  float sum_sq = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) sum_sq = fmaf(x[j], x[j], sum_sq);
  const float inv_rms = 1.0f / sqrtf(warp_sum(sum_sq) * (1.0f / kHeadDim) + p.eps);
  float y[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) y[j] = x[j] * inv_rms * w[j] * sigmoid(g2[j]);
  store4_bf16(p.y + row * p.y_stride + col, y);
}

}  // namespace

bool gated_rmsnorm_supported(const GatedRmsNormArgs& a, std::string* why) {
  using detail::aligned_to;
  using detail::fail;
  using detail::kInt32Max;
  using detail::str_cat;
  if (a.head_dim != kHeadDim)
    return fail(why, str_cat("head_dim ", a.head_dim, " is not supported; only 128 is"));
  if (a.num_heads < 1 || a.num_heads > 65535)
    return fail(why, str_cat("num_heads ", a.num_heads, " is outside [1, 65535]"));
  if (a.num_tokens < 0 || a.num_tokens > kInt32Max)
    return fail(why, str_cat("num_tokens ", a.num_tokens, " is outside [0, 2^31 - 1]"));
  if ((a.num_tokens * a.num_heads + Traits::kWarps - 1) / Traits::kWarps > kInt32Max)
    return fail(why, str_cat("num_tokens x num_heads = ", a.num_tokens * a.num_heads,
                             " vectors need more than 2^31 - 1 blocks"));
  if (a.varlen.query_start_loc && (a.varlen.num_seqs < 0 || a.varlen.num_seqs > kInt32Max))
    return fail(why, str_cat("num_seqs ", a.varlen.num_seqs, " is outside [0, 2^31 - 1]"));
  if (!a.o || !a.g2 || !a.weight || !a.y) return fail(why, "o, g2, weight and y must be set");
  if (!aligned_to(a.o, 8) || !aligned_to(a.g2, 8) || !aligned_to(a.weight, 8) ||
      !aligned_to(a.y, 8))
    return fail(why, "o, g2, weight and y must be 8-byte aligned (lanes move 4 bf16 at a time)");
  if (a.varlen.query_start_loc && !aligned_to(a.varlen.query_start_loc, 4))
    return fail(why, "query_start_loc must be aligned to its 4-byte elements");
  const int64_t part_dim = a.num_heads * kHeadDim;
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

void gated_rmsnorm(const GatedRmsNormArgs& a, Stream stream) {
  std::string why;
  if (!gated_rmsnorm_supported(a, &why)) KDA_FAIL(kFunction, why);
  if (a.num_tokens == 0) return;

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

  const int64_t vectors = a.num_tokens * a.num_heads;
  const dim3 grid(static_cast<unsigned>((vectors + Traits::kWarps - 1) / Traits::kWarps));
  switch (a.head_dim) {
    case kHeadDim:
      gated_rmsnorm_kernel<<<grid, Traits::kThreads, 0, stream>>>(p);
      break;
    default:
      KDA_FAIL(kFunction, "head_dim ", a.head_dim, " is not supported; only 128 is");
  }
  KDA_CUDA_CHECK(kFunction, cudaGetLastError());
}

}  // namespace kda
