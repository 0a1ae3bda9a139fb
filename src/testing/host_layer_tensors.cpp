#include "testing/host_layer_tensors.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "common/cuda_check.h"

namespace kda::detail {

namespace {

template <typename T>
std::vector<T> download(const void* src, int64_t count) {
  std::vector<T> v(static_cast<std::size_t>(count));
  KDA_CUDA_CHECK("kda::detail::download_layer_tensors",
                 cudaMemcpy(v.data(), src, v.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

}  // namespace

LayerWeights host_weights_view(const HostLayerTensors& t) {
  LayerWeights w;
  w.in_proj = t.in_proj.data();
  w.in_proj_rows = 0;
  w.conv_weight = t.conv_weight.data();
  w.f_b = t.f_b.data();
  w.g_b = t.g_b.data();
  w.A_log = t.A_log.data();
  w.dt_bias = t.dt_bias.data();
  w.o_norm_weight = t.o_norm_weight.data();
  w.o_proj = t.o_proj.data();
  return w;
}

HostLayerTensors download_layer_tensors(const PrefillModule& module, int layer) {
  const ModelConfig& mc = module.config().model;
  const int64_t D = mc.hidden_size, P = mc.part_dim(), r = mc.gate_rank;
  const LayerWeights& w = module.layer_weights(layer);
  HostLayerTensors t;
  t.in_proj = download<uint16_t>(w.in_proj, mc.in_proj_cols() * D);  // rows past W_in are padding
  t.conv_weight = download<float>(w.conv_weight, 3 * P * 4);
  t.f_b = download<uint16_t>(w.f_b, P * r);
  t.g_b = download<uint16_t>(w.g_b, P * r);
  t.A_log = download<float>(w.A_log, mc.num_heads);
  t.dt_bias = download<float>(w.dt_bias, P);
  t.o_norm_weight = download<uint16_t>(w.o_norm_weight, mc.head_dim);
  t.o_proj = download<uint16_t>(w.o_proj, D * P);
  return t;
}

}  // namespace kda::detail
