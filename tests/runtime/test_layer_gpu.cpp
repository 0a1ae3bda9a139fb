// The whole KDA layer through the module (hidden states in, layer output out) against the
// float64 layer reference (src/testing/layer_reference.h) fed the module's own weights, hidden
// states and starting pools: output and final recurrent states within the tolerances,
// for both recurrences, both gate variants, varlen batches with and without initial states.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/half_host.h"
#include "kda/config.h"
#include "kda/prefill.h"
#include "recurrence/kda_chunked.h"
#include "testing/layer_reference.h"
#include "runtime/random_weights.h"
#include "support/gpu_buffers.h"
#include "support/external_pools.h"
#include "support/host_batch.h"
#include "support/test_data.h"

namespace {

using kda::PrefillModule;


template <typename T>
std::vector<T> download(const void* p, int64_t count) {
  std::vector<T> v(static_cast<std::size_t>(count));
  KDA_TEST_CUDA(cudaMemcpy(v.data(), p, v.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

std::vector<float> bf16_to_floats(const std::vector<uint16_t>& bits) {
  std::vector<float> f(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) f[i] = kda::host::bf16_to_float(bits[i]);
  return f;
}

using Batch = kda::test::HostBatch;

Batch make_batch(const std::vector<int32_t>& lengths, bool initial) {
  Batch b;
  b.flags = std::make_unique<bool[]>(lengths.size());
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    b.qsl.push_back(b.qsl.back() + lengths[s]);
    // Line 0 is the null line; every fifth sequence sits on it (skipped).
    b.lines.push_back(s % 5 == 3 ? 0 : static_cast<int32_t>(s + 1));
    b.flags[s] = initial && s % 2 == 0;
  }
  return b;
}

// `count` pool elements of type `dtype` (fp32 or bf16) at `p`, widened to fp32 (exact).
std::vector<float> download_pool(const void* p, int64_t count, kda::DType dtype) {
  if (dtype == kda::DType::FP32) return download<float>(p, count);
  return bf16_to_floats(download<uint16_t>(p, count));
}

// Layer 0's pools in the canonical layouts, whatever the module's layouts, line strides and
// element types: conv (lines, 3P, 3), recurrent (lines, H, K, V), fp32.
std::vector<float> canonical_conv_pool(const PrefillModule& m) {
  const kda::Config& c = m.config();
  const kda::ConvStateStrides st = m.conv_state_strides(0);
  const int64_t lines = c.pools.cache_lines, dim = 3 * c.model.part_dim();
  const auto raw =
      download_pool(m.state_pools(0).conv, (lines - 1) * st.line + c.conv_line_elems(), c.pools.conv_dtype);
  std::vector<float> out(static_cast<std::size_t>(lines * dim * 3));
  for (int64_t l = 0; l < lines; ++l)
    for (int64_t ch = 0; ch < dim; ++ch)
      for (int64_t j = 0; j < 3; ++j) out[(l * dim + ch) * 3 + j] = raw[l * st.line + ch * st.dim + j * st.tap];
  return out;
}

std::vector<float> canonical_recurrent_pool(const PrefillModule& m) {
  const kda::Config& c = m.config();
  const kda::RecurrentStateStrides st = m.recurrent_state_strides(0);
  const int64_t lines = c.pools.cache_lines, H = c.model.num_heads;
  const auto raw = download_pool(m.state_pools(0).recurrent, (lines - 1) * st.line + c.recurrent_line_elems(),
                                 c.pools.recurrent_dtype);
  std::vector<float> out(static_cast<std::size_t>(lines * H * 128 * 128));
  for (int64_t l = 0; l < lines; ++l)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t k = 0; k < 128; ++k)
        for (int64_t v = 0; v < 128; ++v)
          out[((l * H + h) * 128 + k) * 128 + v] = raw[l * st.line + h * st.head + k * st.k + v * st.v];
  return out;
}

double rel_err(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

void check_layer(kda::Config cfg, const std::vector<int32_t>& lengths) {
  cfg.runtime.num_layers = 1;
  const kda::ModelConfig& mc = cfg.model;
  const int64_t D = mc.hidden_size, P = mc.part_dim(), H = mc.num_heads, r = mc.gate_rank;
  PrefillModule m(cfg);
  std::unique_ptr<kda::test::ExternalPools> external;
  if (cfg.pools.external) {
    external = std::make_unique<kda::test::ExternalPools>(cfg, 37, 64);
    m.set_layer_pools(0, external->view);
  }
  m.init_random_weights(1234);
  cudaStream_t s = nullptr;

  // A first forward on the same lines leaves non-zero states to start from.
  const Batch warm = make_batch(lengths, false);
  kda::detail::fill_uniform_bf16(m.hidden_states(), warm.qsl.back() * D, 11, 1, -1.0f, 1.0f, s);
  m.run(warm.view(), s);
  const Batch b = make_batch(lengths, true);
  const int64_t T = b.qsl.back();
  kda::detail::fill_uniform_bf16(m.hidden_states(), T * D, 12, 1, -1.0f, 1.0f, s);
  KDA_TEST_CUDA(cudaDeviceSynchronize());

  const int64_t lines = cfg.pools.cache_lines;
  std::vector<float> conv0 = canonical_conv_pool(m);
  std::vector<float> rec0 = canonical_recurrent_pool(m);
  const kda::LayerWeights& w = m.layer_weights(0);
  const auto in_proj = bf16_to_floats(download<uint16_t>(w.in_proj, mc.in_proj_cols() * D));
  const auto conv_w = download<float>(w.conv_weight, 3 * P * 4);
  const auto f_b = bf16_to_floats(download<uint16_t>(w.f_b, P * r));
  const auto g_b = bf16_to_floats(download<uint16_t>(w.g_b, P * r));
  const auto a_log = download<float>(w.A_log, H);
  const auto dt_bias = download<float>(w.dt_bias, P);
  const auto norm = bf16_to_floats(download<uint16_t>(w.o_norm_weight, 128));
  const auto o_proj = bf16_to_floats(download<uint16_t>(w.o_proj, D * P));
  const auto hidden_bits = download<uint16_t>(m.hidden_states(), T * D);

  m.run(b.view(), s);
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  const auto out_bits = download<uint16_t>(m.output(), T * D);
  const auto rec_gpu = canonical_recurrent_pool(m);
  const auto conv_gpu = canonical_conv_pool(m);

  kda::ref::HostLayerWeights hw;
  hw.in_proj = in_proj.data();
  hw.conv_weight = conv_w.data();
  hw.f_b = f_b.data();
  hw.g_b = g_b.data();
  hw.a_log = a_log.data();
  hw.dt_bias = dt_bias.data();
  hw.o_norm_weight = norm.data();
  hw.o_proj = o_proj.data();
  kda::ref::HostBatch hb;
  hb.query_start_loc = b.qsl.data();
  hb.cache_indices = b.lines.data();
  hb.has_initial_state = b.flags.get();
  hb.num_seqs = static_cast<int64_t>(b.lines.size());
  hb.null_line = cfg.pools.null_line;
  hb.cache_lines = lines;
  const kda::ref::Matrix hidden = kda::ref::matrix_from_bf16(hidden_bits.data(), T, D, D);
  const kda::ref::LayerTrace ref = kda::ref::layer_forward(
      mc, hw, hidden, hb, conv0.data(), kda::ref::StatePool::contiguous(rec0.data(), H));

  // Output rows of sequences that ran; final states of the lines they name.
  std::vector<double> got, want, sgot, swant;
  for (std::size_t q = 0; q < b.lines.size(); ++q) {
    if (!hb.names_line(static_cast<int64_t>(q))) continue;
    for (int64_t t = b.qsl[q]; t < b.qsl[q + 1]; ++t)
      for (int64_t c = 0; c < D; ++c) {
        got.push_back(kda::host::bf16_to_float(out_bits[t * D + c]));
        want.push_back(ref.out.at(t, c));
      }
    const int64_t line = b.lines[q];
    if (b.qsl[q + 1] == b.qsl[q]) continue;
    for (int64_t i = 0; i < H * 128 * 128; ++i) {
      sgot.push_back(rec_gpu[line * H * 128 * 128 + i]);
      swant.push_back(rec0[line * H * 128 * 128 + i]);
    }
  }
  // The conv pool's lines of the sequences that ran: the last three inputs, read back in the
  // layout the config asked for (the reference updated conv0 in the canonical one).
  std::vector<double> cgot, cwant;
  for (std::size_t q = 0; q < b.lines.size(); ++q) {
    if (!hb.names_line(static_cast<int64_t>(q)) || b.qsl[q + 1] == b.qsl[q]) continue;
    for (int64_t i = 0; i < 3 * P * 3; ++i) {
      cgot.push_back(conv_gpu[b.lines[q] * 3 * P * 3 + i]);
      cwant.push_back(conv0[b.lines[q] * 3 * P * 3 + i]);
    }
  }
  const double out_err = rel_err(got, want), state_err = rel_err(sgot, swant), conv_err = rel_err(cgot, cwant);
  const std::string what = std::string(cfg.runtime.recurrence == kda::Recurrence::Chunked ? "chunked" : "token-by-token") +
                           (mc.gate_lower_bound ? ", lower-bound gate" : ", softplus gate") +
                           (cfg.pools.recurrent_layout == kda::RecurrentLayout::HVK ? ", (H, V, K) states" : "") +
                           (cfg.pools.conv_layout == kda::ConvStateLayout::TapDim ? ", (3, 3P) conv states" : "") +
                           (cfg.pools.external ? ", external pools" : "") +
                           (cfg.pools.recurrent_dtype == kda::DType::BF16 ? ", bf16 recurrent pool" : "") +
                           (cfg.pools.conv_dtype == kda::DType::BF16 ? ", bf16 conv pool" : "");
  MESSAGE("hidden ", D, ", ", H, " heads, ", T, " tokens, ", what, ": output error ", out_err,
          ", final-state error ", state_err, ", conv-state error ", conv_err);
  CHECK(out_err <= 1e-2);
  CHECK(state_err <= 5e-3);
  CHECK(conv_err <= 1e-2);
  if (external) CHECK(external->gap_bytes_written() == 0);
}

kda::Config tiny() {
  kda::Config c;
  c.model.hidden_size = 256;
  c.model.num_heads = 2;
  c.runtime.token_buckets = {64, 1024, 2048};
  c.runtime.max_seqs = 16;
  c.pools.cache_lines = 17;
  return c;
}

kda::Config seed_scale() {
  kda::Config c;
  c.model.hidden_size = 7168;
  c.model.num_heads = 12;
  c.runtime.token_buckets = {512, 2048};
  c.runtime.max_seqs = 16;
  c.pools.cache_lines = 17;
  return c;
}

}  // namespace

TEST_CASE("the module's layer output and final states match the float64 layer reference") {
  const std::vector<int32_t> lengths = {1, 15, 16, 17, 63, 64, 65, 1000};
  for (kda::Recurrence rec : {kda::Recurrence::Chunked, kda::Recurrence::TokenByToken}) {
    SUBCASE("tiny, softplus gate") {
      kda::Config c = tiny();
      c.runtime.recurrence = rec;
      check_layer(c, lengths);
    }
    SUBCASE("tiny, lower-bound gate") {
      kda::Config c = tiny();
      c.runtime.recurrence = rec;
      c.model.gate_lower_bound = -5.0;
      check_layer(c, lengths);
    }
    SUBCASE("seed scale (hidden 7168, 12 heads)") {
      kda::Config c = seed_scale();
      c.runtime.recurrence = rec;
      check_layer(c, kda::test::quick_mode() ? std::vector<int32_t>{1, 17, 64, 65} : std::vector<int32_t>{1, 17, 64, 65, 300, 15});
    }
  }
}

TEST_CASE("sequences the chunked recurrence cuts into segments meet the float64 layer reference") {
  // Two heads and a 16384-token largest bucket: long sequences are cut (docs/design.md,
  // "Segments"); a wrong segment start or scan shows in the states of the long sequences.
  kda::Config c = tiny();
  c.runtime.token_buckets = {1024, 16384};
  c.runtime.max_batch_tokens = 16384;
  const int64_t segment = kda::kda_chunked_auto_segment_tokens(16384, c.model.num_heads);
  MESSAGE("segment length: ", segment, " tokens");
  REQUIRE(segment > 0);
  REQUIRE(segment < 3000);
  check_layer(c, {9000, 17, 3000, 64, 4000});
}

TEST_CASE("other pool layouts and external pools meet the float64 layer reference") {
  const std::vector<int32_t> lengths = {1, 15, 16, 17, 63, 64, 65, 300};
  for (kda::Recurrence rec : {kda::Recurrence::Chunked, kda::Recurrence::TokenByToken}) {
    SUBCASE("(H, V, K) recurrent states, (3, 3P) conv states") {
      kda::Config c = tiny();
      c.runtime.recurrence = rec;
      c.pools.recurrent_layout = kda::RecurrentLayout::HVK;
      c.pools.conv_layout = kda::ConvStateLayout::TapDim;
      check_layer(c, lengths);
    }
    SUBCASE("external pools with gaps between lines, default layouts") {
      kda::Config c = tiny();
      c.runtime.recurrence = rec;
      c.pools.external = true;
      check_layer(c, lengths);
    }
    SUBCASE("external pools with gaps between lines, the other layouts") {
      kda::Config c = tiny();
      c.runtime.recurrence = rec;
      c.pools.external = true;
      c.pools.recurrent_layout = kda::RecurrentLayout::HVK;
      c.pools.conv_layout = kda::ConvStateLayout::TapDim;
      check_layer(c, lengths);
    }
  }
}

TEST_CASE("bf16 state pools meet the float64 layer reference in both layouts") {
  // The reference starts from the bf16 lines widened and keeps its states in double; the GPU's
  // final recurrent lines are rounded to bf16 once, which adds at most 2^-8 relative per
  // element, inside the 5e-3 bound. The conv lines hold bf16 inputs and must be exact.
  const std::vector<int32_t> lengths = {1, 15, 16, 17, 63, 64, 65, 300};
  for (kda::Recurrence rec : {kda::Recurrence::Chunked, kda::Recurrence::TokenByToken}) {
    SUBCASE("module-owned bf16 pools, default layouts") {
      kda::Config c = tiny();
      c.runtime.recurrence = rec;
      c.pools.recurrent_dtype = kda::DType::BF16;
      c.pools.conv_dtype = kda::DType::BF16;
      check_layer(c, lengths);
    }
    SUBCASE("module-owned bf16 pools, (H, V, K) and (3, 3P)") {
      kda::Config c = tiny();
      c.runtime.recurrence = rec;
      c.pools.recurrent_dtype = kda::DType::BF16;
      c.pools.conv_dtype = kda::DType::BF16;
      c.pools.recurrent_layout = kda::RecurrentLayout::HVK;
      c.pools.conv_layout = kda::ConvStateLayout::TapDim;
      check_layer(c, lengths);
    }
    SUBCASE("external bf16 pools with gaps, the other layouts, one pool bf16") {
      kda::Config c = tiny();
      c.runtime.recurrence = rec;
      c.pools.external = true;
      c.pools.recurrent_dtype = kda::DType::BF16;
      c.pools.recurrent_layout = kda::RecurrentLayout::HVK;
      c.pools.conv_layout = kda::ConvStateLayout::TapDim;
      check_layer(c, lengths);
    }
  }
}
