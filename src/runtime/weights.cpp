// PrefillModule weights: caller-owned device pointers, uploads into module storage, seeded
// random weights. Every path ends in Impl::set_weights, which checks that every step can run
// the weights before the layer takes them.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/cuda_check.h"
#include "runtime/module_impl.h"
#include "runtime/random_weights.h"

namespace kda {

void PrefillModule::Impl::set_weights(int layer, const LayerWeights& w, const char* fn) {
  check_layer(layer, fn);
  const std::pair<const void*, const char*> required[] = {
      {w.in_proj, "in_proj"}, {w.conv_weight, "conv_weight"}, {w.f_b, "f_b"},
      {w.g_b, "g_b"},         {w.A_log, "A_log"},             {w.dt_bias, "dt_bias"},
      {w.o_norm_weight, "o_norm_weight"}, {w.o_proj, "o_proj"}};
  for (const auto& [ptr, name] : required)
    KDA_CHECK(ptr != nullptr, fn, "layer ", layer, ": weights.", name, " is null");
  KDA_CHECK(w.in_proj_rows == 0 || w.in_proj_rows == program.in_cols || w.in_proj_rows == program.in_stride, fn,
            "layer ", layer, ": weights.in_proj_rows is ", w.in_proj_rows, ", expected 0 or ", program.in_cols,
            " (in_proj_cols) or ", program.in_stride, " (in_proj_stride, zero-padded rows)");
  for (const auto& [ptr, name] : {std::pair<const void*, const char*>{w.in_proj, "in_proj"},
                                  {w.f_b, "f_b"}, {w.g_b, "g_b"}, {w.o_proj, "o_proj"}})
    KDA_CHECK(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, fn, "layer ", layer, ": weights.", name,
              " must be 16-byte aligned (cuBLASLt operand), got ", ptr);
  // Every step's can_implement for every bucket of window 0 (later windows differ only in
  // the output rows and staging slot, which the module owns).
  LayerWeights old = weights[layer];
  weights[layer] = w;
  for (int64_t bucket : config.runtime.token_buckets) {
    const detail::LayerProgram::Unsupported u = program.why_unsupported(inputs(layer, 0, bucket));
    if (u.step) {
      weights[layer] = old;
      KDA_FAIL(fn, "layer ", layer, ": ", u.step, " cannot run these weights (bucket ", bucket, "): ", u.why);
    }
  }
  const bool moved = !has_weights[layer] || std::memcmp(&old, &w, sizeof(LayerWeights)) != 0;
  if (moved) {
    weights_version[layer] = next_version++;
    eager_graphs_current = false;
  }
  has_weights[layer] = true;
}

void PrefillModule::set_layer_weights(int layer, const LayerWeights& weights) {
  impl_->set_weights(layer, weights, "kda::PrefillModule::set_layer_weights");
}

void PrefillModule::init_random_weights(uint64_t seed) {
  constexpr const char* fn = "kda::PrefillModule::init_random_weights";
  Impl& m = *impl_;
  const std::size_t per_layer = detail::random_layer_weights_bytes(m.config.model);
  if (!m.random_storage.get())
    m.random_storage = detail::DeviceBuffer(per_layer * m.num_layers, "random weights");
  // A forward still in flight may read the current weights; refill only when it is done.
  KDA_CUDA_CHECK(fn, cudaDeviceSynchronize());
  std::vector<LayerWeights> w(m.num_layers);
  for (int l = 0; l < m.num_layers; ++l)
    w[l] = detail::init_random_layer_weights(m.config.model, l, seed, m.random_storage.as<char>() + l * per_layer,
                                             nullptr);
  KDA_CUDA_CHECK(fn, cudaStreamSynchronize(nullptr));
  for (int l = 0; l < m.num_layers; ++l) m.set_weights(l, w[l], fn);
}

void PrefillModule::upload_layer_weights(int layer, const LayerWeights& h) {
  constexpr const char* fn = "kda::PrefillModule::upload_layer_weights";
  Impl& m = *impl_;
  m.check_layer(layer, fn);
  const ModelConfig& mc = m.config.model;
  const int64_t rows = h.in_proj_rows ? h.in_proj_rows : m.program.in_cols;
  KDA_CHECK(rows == m.program.in_cols || rows == m.program.in_stride, fn, "layer ", layer, ": in_proj_rows is ", h.in_proj_rows,
            ", expected 0, ", m.program.in_cols, " or ", m.program.in_stride);
  struct Tensor {
    const void* host;
    const char* name;
    std::size_t bytes;
  };
  const int64_t r = mc.gate_rank;
  const Tensor tensors[] = {
      {h.in_proj, "in_proj", static_cast<std::size_t>(rows * m.program.D) * 2},
      {h.conv_weight, "conv_weight", static_cast<std::size_t>(3 * m.program.P * 4) * 4},
      {h.f_b, "f_b", static_cast<std::size_t>(m.program.P * r) * 2},
      {h.g_b, "g_b", static_cast<std::size_t>(m.program.P * r) * 2},
      {h.A_log, "A_log", static_cast<std::size_t>(m.program.H) * 4},
      {h.dt_bias, "dt_bias", static_cast<std::size_t>(m.program.P) * 4},
      {h.o_norm_weight, "o_norm_weight", static_cast<std::size_t>(mc.head_dim) * 2},
      {h.o_proj, "o_proj", static_cast<std::size_t>(m.program.D * m.program.P) * 2},
  };
  // in_proj is stored padded to in_proj_stride rows of zeros whatever the host gave, so that the
  // GEMM takes its fast width (LayerWeights::in_proj_rows).
  const std::size_t in_proj_padded = static_cast<std::size_t>(m.program.in_stride * m.program.D) * 2;
  std::size_t total = (in_proj_padded + 255) / 256 * 256;
  for (const Tensor& t : tensors) {
    KDA_CHECK(t.host != nullptr, fn, "layer ", layer, ": host_weights.", t.name, " is null");
    if (&t != &tensors[0]) total += (t.bytes + 255) / 256 * 256;
  }
  if (m.uploaded_weights.empty()) m.uploaded_weights.resize(m.num_layers);
  // A forward in flight may still read the storage being replaced or overwritten.
  KDA_CUDA_CHECK(fn, cudaDeviceSynchronize());
  if (m.uploaded_weights[layer].bytes() < total) m.uploaded_weights[layer] = detail::DeviceBuffer(total, "uploaded weights");
  char* dst = m.uploaded_weights[layer].as<char>();
  const void* dev[8];
  for (int i = 0; i < 8; ++i) {
    KDA_CUDA_CHECK(fn, cudaMemcpy(dst, tensors[i].host, tensors[i].bytes, cudaMemcpyHostToDevice));
    const std::size_t stored = i == 0 ? in_proj_padded : tensors[i].bytes;
    if (stored > tensors[i].bytes)
      KDA_CUDA_CHECK(fn, cudaMemset(dst + tensors[i].bytes, 0, stored - tensors[i].bytes));
    dev[i] = dst;
    dst += (stored + 255) / 256 * 256;
  }
  // The padding cudaMemset is asynchronous, and a pageable cudaMemcpy may return before its DMA
  // is done; both run on the legacy stream, which a caller's non-blocking stream does not wait
  // for. Wait here so that the weights are in place when this returns, as documented.
  KDA_CUDA_CHECK(fn, cudaDeviceSynchronize());
  LayerWeights w;
  w.in_proj = dev[0];
  w.in_proj_rows = m.program.in_stride;
  w.conv_weight = static_cast<const float*>(dev[1]);
  w.f_b = dev[2];
  w.g_b = dev[3];
  w.A_log = static_cast<const float*>(dev[4]);
  w.dt_bias = static_cast<const float*>(dev[5]);
  w.o_norm_weight = dev[6];
  w.o_proj = dev[7];
  m.set_weights(layer, w, fn);
}

const LayerWeights& PrefillModule::layer_weights(int layer) const {
  impl_->check_layer(layer, "kda::PrefillModule::layer_weights");
  return impl_->weights[layer];
}

}  // namespace kda
