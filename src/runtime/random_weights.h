// Seeded, deterministic device initialisers: uniform fills for any bf16/fp32 buffer (hidden
// states in the driver and tests) and the module-owned random weights of a KDA layer.
//
// Element i of tensor `tensor_id` is a pure function of (seed, tensor_id, i): a splitmix64 hash
// turned into u in [0, 1) with 24 random bits, so the same seed gives the same bits on every
// run, launch shape and GPU, and tensors with different ids are independent streams.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kda/config.h"
#include "kda/packed_conv.h"  // kda::Stream, kda::DType
#include "kda/prefill.h"      // kda::LayerWeights

namespace kda::detail {

// value = offset + g(lo + (hi - lo) * u), g the identity, or the natural log when log_of_value.
struct UniformSpec {
  float lo = 0.0f;
  float hi = 1.0f;
  bool log_of_value = false;
  float offset = 0.0f;
};

// Enqueues a fill of `count` elements of `dtype` (BF16 or FP32; rounding to bf16 is
// round-to-nearest-even). Throws kda::Error for a null pointer with count > 0, count < 0,
// lo > hi, log_of_value with lo <= 0, or FP16.
void fill_uniform(void* dst, DType dtype, int64_t count, uint64_t seed, uint64_t tensor_id,
                  const UniformSpec& spec, Stream stream);

// The common case: bf16 values ~ U(lo, hi).
void fill_uniform_bf16(void* dst, int64_t count, uint64_t seed, uint64_t tensor_id, float lo,
                       float hi, Stream stream);

// Bytes of device storage for one layer's random weights (every tensor 256-byte aligned).
std::size_t random_layer_weights_bytes(const ModelConfig& model);

// Carves one layer's tensors out of `storage` (random_layer_weights_bytes(model) bytes,
// 256-byte aligned) and enqueues their fills; returns the pointers. Distributions:
//   in_proj ~ U(-1,1)/sqrt(D), conv_weight ~ U(-0.5,0.5), f_b, g_b ~ U(-1,1)/sqrt(r),
//   A_log = log(U(1,16)), dt_bias ~ U(-1,1), o_norm_weight ~ 1 + U(-0.1,0.1),
//   o_proj ~ U(-1,1)/sqrt(P).
// Tensor ids are (layer << 8) | index with index 0..7; other callers should use ids >= 2^40.
LayerWeights init_random_layer_weights(const ModelConfig& model, int layer, uint64_t seed,
                                       void* storage, Stream stream);

}  // namespace kda::detail
