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
#include "runtime/state_pools.h"

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
  const LayerWeights old = weights[layer];
  weights[layer] = w;
  try {
    check_steps_can_run(layer, "these weights", fn);
  } catch (...) {
    weights[layer] = old;
    throw;
  }
  // Graphs record the pointers: the same ones keep them, also after drop_weights_in (storage
  // refilled in place). A layer never given weights holds null pointers, which always differ.
  if (std::memcmp(&old, &w, sizeof(LayerWeights)) != 0) bump_version(layer);
  // runtime.capture: eager skipped this layer while it had no weights: record its graphs at the
  // next begin_forward (capture_eager_graphs skips the ones it finds current).
  if (!has_weights[layer]) eager_graphs_current = false;
  has_weights[layer] = true;
}

void PrefillModule::Impl::check_steps_can_run(int layer, const char* what, const char* fn) const {
  // Every step's can_implement for every bucket of window 0 (later windows differ only in the
  // output rows and staging slot, which the module owns). A layer without pools yet is checked
  // with its weights when its pools come, and the other way round.
  if (!has_pools[layer] || weights[layer].in_proj == nullptr) return;
  for (int64_t bucket : config.runtime.token_buckets) {
    const detail::LayerProgram::Unsupported u = program.why_unsupported(inputs(layer, 0, bucket));
    if (u.step) KDA_FAIL(fn, "layer ", layer, ": ", u.step, " cannot run ", what, " (bucket ", bucket, "): ", u.why);
  }
}

void PrefillModule::Impl::bump_version(int layer) {
  layer_version[layer] = next_version++;
  eager_graphs_current = false;
}

void PrefillModule::Impl::set_pools(int layer, const StatePools& p, const char* fn) {
  check_layer(layer, fn);
  KDA_CHECK(config.pools.external, fn, "pools.external is false: the module owns its pools, which cannot be replaced");
  KDA_CHECK(p.conv != nullptr && p.recurrent != nullptr, fn, "layer ", layer, ": ", p.conv ? "" : "pools.conv",
            p.conv || p.recurrent ? "" : " and ", p.recurrent ? "" : "pools.recurrent", p.conv || p.recurrent ? " is" : " are", " null; both pools must be set");
  struct Named {
    const void* ptr;
    DType dtype;
    const char* name;
  };
  for (const Named& n : {Named{p.conv, config.pools.conv_dtype, "conv"},
                         Named{p.recurrent, config.pools.recurrent_dtype, "recurrent"}})
    KDA_CHECK(reinterpret_cast<uintptr_t>(n.ptr) % dtype_size(n.dtype) == 0, fn, "layer ", layer, ": pools.", n.name,
              " must be aligned to its ", dtype_size(n.dtype), "-byte ", dtype_name(n.dtype), " elements, got ",
              n.ptr);
  KDA_CHECK(p.lines >= config.pools.cache_lines, fn, "layer ", layer, ": pools.lines ", p.lines,
            " is below pools.cache_lines ", config.pools.cache_lines);
  StatePools resolved = p;
  resolved.conv_line_stride = p.conv_line_stride ? p.conv_line_stride : config.conv_line_elems();
  resolved.recurrent_line_stride = p.recurrent_line_stride ? p.recurrent_line_stride : config.recurrent_line_elems();
  KDA_CHECK(resolved.conv_line_stride >= config.conv_line_elems(), fn, "layer ", layer, ": conv_line_stride ",
            p.conv_line_stride, " is below a line's ", config.conv_line_elems(), " elements (3P x 3)");
  KDA_CHECK(resolved.recurrent_line_stride >= config.recurrent_line_elems(), fn, "layer ", layer,
            ": recurrent_line_stride ", p.recurrent_line_stride, " is below a line's ", config.recurrent_line_elems(),
            " elements (H x 128 x 128)");
  check_pools_overlap_nothing(layer, resolved, fn);
  const StatePools old = pools[layer];
  const bool had = has_pools[layer] != 0;
  pools[layer] = resolved;
  has_pools[layer] = 1;
  try {
    check_steps_can_run(layer, "these pools", fn);
  } catch (...) {
    pools[layer] = old;
    has_pools[layer] = had;
    throw;
  }
  if (!had || old.conv != resolved.conv || old.recurrent != resolved.recurrent ||
      old.conv_line_stride != resolved.conv_line_stride || old.recurrent_line_stride != resolved.recurrent_line_stride)
    bump_version(layer);
}

void PrefillModule::Impl::check_pools_overlap_nothing(int layer, const StatePools& p, const char* fn) const {
  // The lines this layer's pools would have the module write, against each other, against
  // every other layer's pools and against every buffer the module owns.
  const std::vector<detail::LineSpan> mine = detail::pool_line_spans(config, layer, p);
  std::vector<detail::LineSpan> others;
  for (int l = 0; l < num_layers; ++l)
    if (l != layer && has_pools[l])
      for (detail::LineSpan& s : detail::pool_line_spans(config, l, pools[l])) others.push_back(std::move(s));
  for (const detail::LayerProgram::NamedBuffer& b : program.buffers())
    others.push_back(detail::LineSpan::contiguous(detail::str_cat("the module's ", b.name), b.buffer->get(),
                                                  b.buffer->bytes()));
  others.push_back(detail::LineSpan::contiguous("the module's metadata staging", staging_dev.get(), staging_dev.bytes()));
  others.push_back(
      detail::LineSpan::contiguous("the module's random weights", random_storage.get(), random_storage.bytes()));
  for (std::size_t l = 0; l < uploaded_weights.size(); ++l)
    others.push_back(detail::LineSpan::contiguous(detail::str_cat("the module's uploaded weights of layer ", l),
                                                  uploaded_weights[l].get(), uploaded_weights[l].bytes()));
  const std::string own = detail::overlap_message(mine[0], mine[1]);
  KDA_CHECK(own.empty(), fn, own, ": a pool's lines must not share bytes with any other pool or module buffer");
  for (const detail::LineSpan& m : mine)
    for (const detail::LineSpan& o : others) {
      const std::string msg = detail::overlap_message(m, o);
      KDA_CHECK(msg.empty(), fn, msg, ": a pool's lines must not share bytes with any other pool or module buffer");
    }
}

void PrefillModule::set_layer_pools(int layer, const StatePools& pools) {
  constexpr const char* fn = "kda::PrefillModule::set_layer_pools";
  const detail::DeviceGuard on_device(impl_->device, fn);
  impl_->set_pools(layer, pools, fn);
}

void PrefillModule::set_layer_weights(int layer, const LayerWeights& weights) {
  constexpr const char* fn = "kda::PrefillModule::set_layer_weights";
  const detail::DeviceGuard on_device(impl_->device, fn);
  impl_->set_weights(layer, weights, fn);
}

void PrefillModule::init_random_weights(uint64_t seed) {
  constexpr const char* fn = "kda::PrefillModule::init_random_weights";
  Impl& m = *impl_;
  const detail::DeviceGuard on_device(m.device, fn);
  const std::size_t per_layer = detail::random_layer_weights_bytes(m.config.model);
  if (!m.random_storage.get())
    m.random_storage = detail::DeviceBuffer(per_layer * m.num_layers, "random weights");
  // A forward still in flight may read the current weights; refill only when it is done.
  KDA_CUDA_CHECK(fn, cudaDeviceSynchronize());
  m.drop_weights_in(m.random_storage.get(), m.random_storage.bytes());
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
  const detail::DeviceGuard on_device(m.device, fn);
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
  m.drop_weights_in(m.uploaded_weights[layer].get(), m.uploaded_weights[layer].bytes());
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

void PrefillModule::Impl::drop_weights_in(const void* begin, std::size_t bytes) {
  if (!begin) return;
  const auto* lo = static_cast<const char*>(begin);
  const auto inside = [&](const void* p) {
    return static_cast<const char*>(p) >= lo && static_cast<const char*>(p) < lo + bytes;
  };
  for (int l = 0; l < num_layers; ++l) {
    const LayerWeights& w = weights[l];
    // Any of the eight: a layer may mix these weights with the caller's (set_layer_weights).
    for (const void* p : {static_cast<const void*>(w.in_proj), static_cast<const void*>(w.conv_weight), w.f_b,
                          w.g_b, static_cast<const void*>(w.A_log), static_cast<const void*>(w.dt_bias),
                          w.o_norm_weight, w.o_proj})
      if (has_weights[l] && inside(p)) has_weights[l] = 0;
  }
}

const LayerWeights& PrefillModule::layer_weights(int layer) const {
  impl_->check_layer(layer, "kda::PrefillModule::layer_weights");
  return impl_->weights[layer];
}

}  // namespace kda
