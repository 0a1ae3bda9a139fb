// The gated RMSNorm's device code (gated_rmsnorm.h): y = x * rsqrt(mean(x^2) + eps) * weight *
// sigmoid(g2) per (token, head) 128-vector x of o, fp32 math, bf16 out. One warp per vector, 4
// channels per lane; the grid covers the capacity (num_tokens x H vectors) and warps past the
// batch's last row exit. Included by gated_rmsnorm.cu alone (internal linkage).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_math.cuh"
#include "norm/gated_rmsnorm.h"

namespace kda {
namespace {

using device_math::load4_bf16;
using device_math::sigmoid;
using device_math::store4_bf16;
using device_math::warp_sum;

constexpr int kHeadDim = norm::kHeadDim;
using Traits = norm::RmsNormTraits;
using norm::RmsNormParams;

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
}  // namespace kda
