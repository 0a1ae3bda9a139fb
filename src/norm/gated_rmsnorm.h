// The gated RMSNorm of a KDA layer (docs/layer.md step 6), per (token, head). CUDA-free: host code
// includes this header; gated_rmsnorm_plan.cpp is its plan (checks, params),
// gated_rmsnorm_kernel.cuh its device code, gated_rmsnorm.cu its launch. The grid depends only on
// num_tokens and num_heads (capacities), so a launch can be captured once and replayed with
// new query_start_loc. The launcher checks its arguments with gated_rmsnorm_supported() (which
// reads no device memory) and throws kda::Error, enqueueing nothing, when they are unusable.
#pragma once

#include <cstdint>
#include <string>

#include "kda/types.h"
#include "kda/varlen.h"

// cuda_bf16.h's bf16 type, declared as that header declares it: host code only passes pointers.
struct __nv_bfloat16;

namespace kda {

// Step 6 (docs/layer.md) per (token, head) 128-vector x of o:
// y = x * rsqrt(mean(x^2) + eps) * weight * sigmoid(g2), fp32 math, bf16 out (nearest even).
// Rows processed: [0, query_start_loc[num_seqs]) clamped to num_tokens (varlen's fields), read
// on the device (padded metadata repeats the last entry, so num_seqs may be the capacity), or
// all num_tokens rows when query_start_loc is null. Rows past that are never written. Rows of skipped
// sequences inside it are computed from whatever o holds there; rows are independent, so this
// is harmless (their output rows belong to no sequence).
struct GatedRmsNormArgs {
  int64_t num_heads = 0;   // H
  int64_t head_dim = 128;  // only 128 is supported
  int64_t num_tokens = 0;  // rows of o, g2 and y
  // The batch: only query_start_loc ((num_seqs + 1), or nullptr) and num_seqs are read.
  VarlenArgs varlen;
  const void* o = nullptr;      // (num_tokens, H, 128) bf16
  int64_t o_row_stride = 0;     // >= P, a multiple of 4
  const void* g2 = nullptr;     // (num_tokens, P) bf16, g_a @ g_b^T
  int64_t g2_row_stride = 0;    // >= P, a multiple of 4
  const void* weight = nullptr; // (128) bf16, shared by all heads
  double eps = 1e-5;            // positive, finite
  void* y = nullptr;            // (num_tokens, P) bf16
  int64_t y_row_stride = 0;     // >= P, a multiple of 4
};

bool gated_rmsnorm_supported(const GatedRmsNormArgs& args, std::string* why = nullptr);
void gated_rmsnorm(const GatedRmsNormArgs& args, Stream stream);

namespace norm {

constexpr int kHeadDim = 128;

// The launch shape: one warp per (token, head) vector, kWarps vectors per block.
struct RmsNormTraits {
  static constexpr int kWarps = 8;  // vectors per block
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kLaneChannels = kHeadDim / 32;
  static_assert(kLaneChannels == 4, "lanes move 4 bf16 (8 bytes) at a time");
};

// GatedRmsNormArgs as the kernel reads them: typed pointers, eps as fp32.
struct RmsNormParams {
  int64_t num_heads;
  int64_t num_tokens;
  const int32_t* query_start_loc;  // varlen.query_start_loc; nullptr: all num_tokens rows
  int64_t num_seqs;                // varlen.num_seqs
  const __nv_bfloat16* o;
  int64_t o_stride;
  const __nv_bfloat16* g2;
  int64_t g2_stride;
  const __nv_bfloat16* weight;
  float eps;
  __nv_bfloat16* y;
  int64_t y_stride;
};

// The params of args (which passed gated_rmsnorm_supported()). Reads no device memory.
RmsNormParams make_params(const GatedRmsNormArgs& args);

}  // namespace norm

}  // namespace kda
