#include "runtime/random_weights.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>

#include "common/check.h"
#include "common/cuda_check.h"

namespace kda::detail {

namespace {

constexpr const char* kFillFn = "kda::detail::fill_uniform";
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

__host__ __device__ inline uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Per-tensor key: different (seed, tensor_id) pairs start unrelated splitmix64 sequences.
uint64_t tensor_key(uint64_t seed, uint64_t tensor_id) {
  return splitmix64_mix(splitmix64_mix(seed + kGolden) ^ (tensor_id * 0xD1B54A32D192ED03ull + 1));
}

struct FillParams {
  void* dst;
  int64_t count;
  uint64_t key;
  float lo, span, offset;
  bool log_of_value;
};

template <typename T>
__device__ inline void store(T* p, float v);
template <>
__device__ inline void store<float>(float* p, float v) { *p = v; }
template <>
__device__ inline void store<__nv_bfloat16>(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

template <typename T>
__global__ void fill_uniform_kernel(FillParams p) {
  T* dst = static_cast<T*>(p.dst);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.count; i += stride) {
    // splitmix64's i-th output for this tensor's key: counter-based, order-free.
    const uint64_t h = splitmix64_mix(p.key + static_cast<uint64_t>(i + 1) * kGolden);
    const float u = static_cast<float>(h >> 40) * 0x1.0p-24f;  // [0, 1), exact
    float v = __fmaf_rn(p.span, u, p.lo);
    if (p.log_of_value) v = logf(v);
    store<T>(dst + i, __fadd_rn(p.offset, v));
  }
}

std::size_t align256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

struct LayerTensorSizes {
  int64_t in_proj, conv_weight, f_b, g_b, A_log, dt_bias, o_norm, o_proj;  // elements
};

LayerTensorSizes layer_sizes(const ModelConfig& m) {
  const int64_t P = m.part_dim(), D = m.hidden_size, r = m.gate_rank;
  return {m.in_proj_stride() * D, 3 * P * m.conv_width, P * r, P * r, m.num_heads, P, m.head_dim, D * P};
}

}  // namespace

void fill_uniform(void* dst, DType dtype, int64_t count, uint64_t seed, uint64_t tensor_id,
                  const UniformSpec& spec, Stream stream) {
  KDA_CHECK(count >= 0, kFillFn, "count ", count, " must be >= 0");
  KDA_CHECK(dst != nullptr || count == 0, kFillFn, "dst is null for ", count, " elements");
  KDA_CHECK(spec.lo <= spec.hi, kFillFn, "lo ", spec.lo, " > hi ", spec.hi);
  KDA_CHECK(!spec.log_of_value || spec.lo > 0.0f, kFillFn, "log_of_value needs lo > 0, got ", spec.lo);
  if (count == 0) return;
  FillParams p{dst, count, tensor_key(seed, tensor_id), spec.lo, spec.hi - spec.lo, spec.offset,
               spec.log_of_value};
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((count + kThreads - 1) / kThreads, 8192));
  switch (dtype) {
    case DType::BF16:
      fill_uniform_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(p);
      break;
    case DType::FP32:
      fill_uniform_kernel<float><<<blocks, kThreads, 0, stream>>>(p);
      break;
    default:
      KDA_FAIL(kFillFn, "dtype ", dtype_name(dtype), " is not supported: use bf16 or fp32");
  }
  KDA_CUDA_CHECK(kFillFn, cudaGetLastError());
}

void fill_uniform_bf16(void* dst, int64_t count, uint64_t seed, uint64_t tensor_id, float lo,
                       float hi, Stream stream) {
  UniformSpec spec;
  spec.lo = lo;
  spec.hi = hi;
  fill_uniform(dst, DType::BF16, count, seed, tensor_id, spec, stream);
}

std::size_t random_layer_weights_bytes(const ModelConfig& model) {
  const LayerTensorSizes s = layer_sizes(model);
  return align256(s.in_proj * 2) + align256(s.conv_weight * 4) + align256(s.f_b * 2) +
         align256(s.g_b * 2) + align256(s.A_log * 4) + align256(s.dt_bias * 4) +
         align256(s.o_norm * 2) + align256(s.o_proj * 2);
}

LayerWeights init_random_layer_weights(const ModelConfig& model, int layer, uint64_t seed,
                                       void* storage, Stream stream) {
  constexpr const char* fn = "kda::detail::init_random_layer_weights";
  KDA_CHECK(storage != nullptr, fn, "storage is null");
  KDA_CHECK(reinterpret_cast<uintptr_t>(storage) % 256 == 0, fn, "storage must be 256-byte aligned");
  KDA_CHECK(layer >= 0 && layer < (1 << 24), fn, "layer ", layer, " out of range");
  const LayerTensorSizes s = layer_sizes(model);
  char* next = static_cast<char*>(storage);
  auto carve = [&next](int64_t elements, std::size_t elem_bytes) {
    void* p = next;
    next += align256(static_cast<std::size_t>(elements) * elem_bytes);
    return p;
  };
  const uint64_t id0 = static_cast<uint64_t>(layer) << 8;
  auto fill = [&](void* dst, DType dtype, int64_t count, uint64_t index, float lo, float hi,
                  bool log_of_value = false, float offset = 0.0f) {
    UniformSpec spec;
    spec.lo = lo;
    spec.hi = hi;
    spec.log_of_value = log_of_value;
    spec.offset = offset;
    fill_uniform(dst, dtype, count, seed, id0 | index, spec, stream);
  };
  const float s_d = static_cast<float>(1.0 / std::sqrt(static_cast<double>(model.hidden_size)));
  const float s_r = static_cast<float>(1.0 / std::sqrt(static_cast<double>(model.gate_rank)));
  const float s_p = static_cast<float>(1.0 / std::sqrt(static_cast<double>(model.part_dim())));

  LayerWeights w;
  // in_proj is padded to in_proj_stride rows of zeros (see LayerWeights::in_proj_rows).
  void* in_proj = carve(s.in_proj, 2);
  const int64_t in_proj_used = model.in_proj_cols() * model.hidden_size;
  fill(in_proj, DType::BF16, in_proj_used, 0, -s_d, s_d);
  KDA_CUDA_CHECK("kda::detail::init_random_layer_weights",
                 cudaMemsetAsync(static_cast<char*>(in_proj) + in_proj_used * 2, 0,
                                 static_cast<std::size_t>(s.in_proj - in_proj_used) * 2, stream));
  float* conv_weight = static_cast<float*>(carve(s.conv_weight, 4));
  fill(conv_weight, DType::FP32, s.conv_weight, 1, -0.5f, 0.5f);
  void* f_b = carve(s.f_b, 2);
  fill(f_b, DType::BF16, s.f_b, 2, -s_r, s_r);
  void* g_b = carve(s.g_b, 2);
  fill(g_b, DType::BF16, s.g_b, 3, -s_r, s_r);
  float* A_log = static_cast<float*>(carve(s.A_log, 4));
  fill(A_log, DType::FP32, s.A_log, 4, 1.0f, 16.0f, /*log_of_value=*/true);
  float* dt_bias = static_cast<float*>(carve(s.dt_bias, 4));
  fill(dt_bias, DType::FP32, s.dt_bias, 5, -1.0f, 1.0f);
  void* o_norm = carve(s.o_norm, 2);
  fill(o_norm, DType::BF16, s.o_norm, 6, -0.1f, 0.1f, false, /*offset=*/1.0f);
  void* o_proj = carve(s.o_proj, 2);
  fill(o_proj, DType::BF16, s.o_proj, 7, -s_p, s_p);

  w.in_proj = in_proj;
  w.in_proj_rows = model.in_proj_stride();
  w.conv_weight = conv_weight;
  w.f_b = f_b;
  w.g_b = g_b;
  w.A_log = A_log;
  w.dt_bias = dt_bias;
  w.o_norm_weight = o_norm;
  w.o_proj = o_proj;
  return w;
}

}  // namespace kda::detail
