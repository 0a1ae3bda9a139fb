// The layer program's StepContext -> kernel-arguments adapters read the module's layout; host
// only, no device.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "kda/error.h"
#include "kda/prefill.h"
#include "recurrence/kda_recurrence_token.h"
#include "runtime/layer_program.h"

namespace {

// Distinct, suitably aligned addresses that are never dereferenced.
template <typename T>
T* fake(uintptr_t slot) {
  return reinterpret_cast<T*>(uintptr_t{1} << 20 | slot << 12);
}

}  // namespace

TEST_CASE("the StepContext adapters read the module's layout") {
  kda::Config config;
  config.model.hidden_size = 2304;
  config.model.num_heads = 4;
  config.model.norm_eps = 2e-5;
  config.model.gate_lower_bound = -5.0;
  config.pools.cache_lines = 9;
  config.pools.null_line = 0;
  kda::LayerWeights weights;
  weights.A_log = fake<const float>(20);
  weights.dt_bias = fake<const float>(21);
  weights.o_norm_weight = fake<const void>(22);
  kda::StepContext ctx;
  ctx.bucket_tokens = 512;
  ctx.max_seqs = 16;
  ctx.query_start_loc = fake<const int32_t>(1);
  ctx.cache_indices = fake<const int32_t>(2);
  ctx.has_initial_state = fake<const bool>(3);
  ctx.in_proj_out = fake<void>(4);
  ctx.q = fake<void>(5);
  ctx.k = fake<void>(6);
  ctx.v = fake<void>(7);
  ctx.recurrent_states = fake<float>(8);
  ctx.recurrent_state_dtype = kda::DType::BF16;
  ctx.conv_strides = kda::detail::conv_state_strides(config, 0);
  ctx.recurrent_strides = kda::detail::recurrent_state_strides(config, 0);
  ctx.weights = &weights;
  ctx.config = &config;
  const int64_t p = 512;

  kda::detail::StepInputs in;
  in.ctx = ctx;
  in.g1 = fake<void>(30);
  in.o = fake<void>(31);
  in.g2 = fake<void>(32);
  in.y = fake<void>(33);
  const kda::RecurrenceArgs r = kda::detail::recurrence_args_for_step(in);
  CHECK(r.num_heads == 4);
  CHECK(r.num_tokens == 512);
  CHECK(r.varlen.num_seqs == 16);
  CHECK(r.qkv_row_stride == p);
  CHECK(r.b == ctx.in_proj_out);
  CHECK(r.b_col_offset == 3 * p);
  CHECK(r.b_row_stride == config.model.in_proj_stride());
  CHECK(r.a_log == weights.A_log);
  CHECK(r.gate_lower_bound == -5.0);
  CHECK(r.varlen.cache_lines == 9);
  CHECK(r.state_stride_line == 4 * 128 * 128);
  CHECK(r.state_stride_v == 1);
  CHECK(r.states == ctx.recurrent_states);
  CHECK(r.state_dtype == kda::DType::BF16);  // the context's pool element type, passed on
  std::string why;
  CHECK(kda::kda_recurrence_token_supported(r, &why));
  CHECK(why.empty());

  const kda::GatedRmsNormArgs g = kda::detail::rmsnorm_args_for_step(in);
  CHECK(g.num_tokens == 512);
  CHECK(g.varlen.num_seqs == 16);
  CHECK(g.eps == 2e-5);
  CHECK(g.weight == weights.o_norm_weight);
  CHECK(kda::gated_rmsnorm_supported(g, &why));

  config.runtime.token_buckets = {256, 512};  // batch_token_capacity() 512: the planes' stride
  const kda::PackedConvArgs c = kda::detail::conv_args_for_step(in.ctx);
  CHECK(c.x == ctx.in_proj_out);
  CHECK(c.dim == 3 * p);
  CHECK(c.part_dim == p);
  CHECK(c.x_row_stride == config.model.in_proj_stride());
  CHECK(c.num_tokens == 512);
  CHECK(c.varlen.num_seqs == 16);
  CHECK(c.varlen.cache_lines == 9);
  CHECK(c.state_stride_line == 3 * p * 3);
  CHECK(c.state_dtype == kda::DType::FP32);
  CHECK(c.out == ctx.q);
  CHECK(c.out_plane_stride == 512 * p);
  CHECK(c.varlen.null_line == 0);

  in.ctx.weights = nullptr;
  CHECK_THROWS_AS(kda::detail::recurrence_args_for_step(in), kda::Error);
}

TEST_CASE("pool layouts and line strides give the state strides the kernels are handed") {
  kda::Config config;
  config.model.hidden_size = 2304;
  config.model.num_heads = 4;  // P = 512
  config.pools.cache_lines = 9;
  const int64_t p = 512;

  kda::ConvStateStrides c = kda::detail::conv_state_strides(config, 0);
  CHECK(c.line == 3 * p * 3);
  CHECK(c.dim == 3);
  CHECK(c.tap == 1);
  kda::RecurrentStateStrides r = kda::detail::recurrent_state_strides(config, 0);
  CHECK(r.line == 4 * 128 * 128);
  CHECK(r.head == 128 * 128);
  CHECK(r.k == 128);
  CHECK(r.v == 1);

  config.pools.conv_layout = kda::ConvStateLayout::TapDim;
  config.pools.recurrent_layout = kda::RecurrentLayout::HVK;
  c = kda::detail::conv_state_strides(config, 5000);
  CHECK(c.line == 5000);
  CHECK(c.dim == 1);
  CHECK(c.tap == 3 * p);
  r = kda::detail::recurrent_state_strides(config, 70000);
  CHECK(r.line == 70000);
  CHECK(r.head == 128 * 128);
  CHECK(r.k == 1);
  CHECK(r.v == 128);

  // The adapters hand them on unchanged.
  kda::LayerWeights weights;
  kda::detail::StepInputs in;
  in.ctx.weights = &weights;
  in.ctx.config = &config;
  in.ctx.conv_strides = c;
  in.ctx.recurrent_strides = r;
  const kda::PackedConvArgs ca = kda::detail::conv_args_for_step(in.ctx);
  CHECK(ca.state_stride_line == 5000);
  CHECK(ca.state_stride_dim == 1);
  CHECK(ca.state_stride_tap == 3 * p);
  const kda::RecurrenceArgs ra = kda::detail::recurrence_args_for_step(in);
  CHECK(ra.state_stride_line == 70000);
  CHECK(ra.state_stride_head == 128 * 128);
  CHECK(ra.state_stride_k == 1);
  CHECK(ra.state_stride_v == 128);
}

TEST_CASE("the checkpoint records reach the conv checkpoints and the recurrence, or nothing does") {
  kda::Config config;
  config.model.hidden_size = 1024;
  config.model.num_heads = 2;
  config.runtime.token_buckets = {128, 256};
  config.pools.cache_lines = 40;
  config.pools.null_line = 3;
  kda::LayerWeights weights;
  kda::StepContext ctx;
  ctx.bucket_tokens = 256;
  ctx.max_seqs = 8;
  ctx.query_start_loc = fake<const int32_t>(1);
  ctx.cache_indices = fake<const int32_t>(2);
  ctx.has_initial_state = fake<const bool>(3);
  ctx.in_proj_out = fake<void>(4);
  // The pools far from the in_proj output: the overlap checks compare extents.
  ctx.conv_states = reinterpret_cast<float*>(uintptr_t{1} << 40);
  ctx.recurrent_states = reinterpret_cast<float*>(uintptr_t{1} << 41);
  ctx.conv_state_dtype = kda::DType::BF16;
  ctx.conv_strides = kda::detail::conv_state_strides(config, 0);
  ctx.recurrent_strides = kda::detail::recurrent_state_strides(config, 0);
  ctx.weights = &weights;
  ctx.config = &config;
  kda::detail::StepInputs in;
  in.ctx = ctx;

  SUBCASE("checkpoints off: the conv checkpoints do nothing and the recurrence gets no table") {
    const kda::ConvCheckpointArgs c = kda::detail::conv_checkpoint_args_for_step(in);
    CHECK(c.max_entries == 0);
    CHECK(kda::conv_checkpoint_supported(c));
    const kda::RecurrenceArgs r = kda::detail::recurrence_args_for_step(in);
    CHECK(r.checkpoint_seqs == nullptr);
    CHECK(r.checkpoint_entries == nullptr);
    CHECK(r.max_checkpoints == 0);
  }
  SUBCASE("checkpoints on") {
    config.runtime.max_checkpoints = 12;
    in.checkpoint_seqs = fake<const kda::CheckpointSeq>(7);
    in.checkpoint_entries = fake<const kda::CheckpointEntry>(8);
    const kda::ConvCheckpointArgs c = kda::detail::conv_checkpoint_args_for_step(in);
    CHECK(c.x == ctx.in_proj_out);
    CHECK(c.x_row_stride == config.model.in_proj_stride());
    CHECK(c.dim == 3 * 256);
    CHECK(c.num_tokens == 256);
    CHECK(c.conv_states == ctx.conv_states);
    CHECK(c.state_dtype == kda::DType::BF16);
    CHECK(c.state_stride_line == ctx.conv_strides.line);
    CHECK(c.state_stride_dim == ctx.conv_strides.dim);
    CHECK(c.state_stride_tap == ctx.conv_strides.tap);
    CHECK(c.varlen.cache_lines == 40);
    CHECK(c.varlen.null_line == 3);
    CHECK(c.varlen.num_seqs == 8);
    CHECK(c.varlen.query_start_loc == ctx.query_start_loc);
    CHECK(c.varlen.cache_indices == ctx.cache_indices);
    CHECK(c.varlen.has_initial_state == ctx.has_initial_state);
    CHECK(c.entries == in.checkpoint_entries);
    CHECK(c.max_entries == 12);
    std::string why;
    CHECK_MESSAGE(kda::conv_checkpoint_supported(c, &why), why);
    const kda::RecurrenceArgs r = kda::detail::recurrence_args_for_step(in);
    CHECK(r.checkpoint_seqs == in.checkpoint_seqs);
    CHECK(r.checkpoint_entries == in.checkpoint_entries);
    CHECK(r.max_checkpoints == 12);
  }
}
