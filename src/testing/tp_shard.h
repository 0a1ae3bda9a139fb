// Tensor-parallel sharding of one KDA layer's host tensors (plain C++, no CUDA): what rank r of
// `size` ranks holds of the full model's weights and state pools. Heads are split across ranks
// (P = H_rank x 128 per rank); o_proj is row-parallel (each rank holds the columns of its heads,
// and the ranks' layer outputs are summed). bf16 tensors are uint16_t bit patterns.
#pragma once

#include <cstdint>
#include <vector>

#include "kda/config.h"

namespace kda::detail {

// The full layer's host tensors, shapes as in kda::LayerWeights with H = the model's heads.
struct HostLayerTensors {
  std::vector<uint16_t> in_proj;      // (3P + H + 2r, D): rows q | k | v | b | f_a | g_a
  std::vector<float> conv_weight;     // (3P, 4)
  std::vector<uint16_t> f_b, g_b;     // (P, r)
  std::vector<float> A_log;           // (H)
  std::vector<float> dt_bias;         // (P)
  std::vector<uint16_t> o_norm_weight;  // (128), shared by all heads
  std::vector<uint16_t> o_proj;       // (D, P)
};

// The model one rank runs: `full` with num_heads / size heads. Throws kda::Error when the heads
// do not divide, size is outside [1, 64] or rank outside [0, size).
ModelConfig rank_model(const ModelConfig& full, int64_t size, int64_t rank);

// Rank `rank`'s tensors: its heads' rows of q, k, v, b, conv weights, f_b, g_b, A_log, dt_bias,
// its heads' columns of o_proj; f_a, g_a and the norm weight replicated. Throws kda::Error on
// a size mismatch with `full`.
HostLayerTensors shard_layer(const ModelConfig& full, const HostLayerTensors& weights, int64_t size,
                             int64_t rank);

// Pools, contiguous: conv (lines, 3P, 3) -> the rank's q, k, v channels; recurrent
// (lines, H, 128, 128) -> the rank's heads.
std::vector<float> shard_conv_pool(const ModelConfig& full, const std::vector<float>& pool,
                                   int64_t lines, int64_t size, int64_t rank);
std::vector<float> shard_recurrent_pool(const ModelConfig& full, const std::vector<float>& pool,
                                        int64_t lines, int64_t size, int64_t rank);

}  // namespace kda::detail
