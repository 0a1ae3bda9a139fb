#include "testing/conv_reference.h"

#include <cmath>
#include <cstdint>

#include "common/check.h"
#include "common/half_host.h"
#include "common/state_elements.h"
#include "conv/conv_math.h"

namespace kda::reference {
namespace {

constexpr const char* kFn = "kda::reference::causal_conv1d";

float load_input(const PackedConvArgs& a, int64_t token, int64_t channel) {
  const int64_t i = token * a.x_row_stride + channel;
  switch (a.x_dtype) {
    case DType::BF16: return host::bf16_to_float(static_cast<const uint16_t*>(a.x)[i]);
    case DType::FP16: return host::fp16_to_float(static_cast<const uint16_t*>(a.x)[i]);
    case DType::FP32: return static_cast<const float*>(a.x)[i];
    default: KDA_FAIL(kFn, "x_dtype ", static_cast<int>(a.x_dtype), " is not one of bf16, fp16, fp32");
  }
}

void store_output(const PackedConvArgs& a, int64_t plane_stride, int64_t token, int64_t channel,
                  float v) {
  const int64_t part = channel / a.part_dim;
  const int64_t i = part * plane_stride + token * a.part_dim + channel % a.part_dim;
  switch (a.x_dtype) {
    case DType::BF16: static_cast<uint16_t*>(a.out)[i] = host::float_to_bf16(v); return;
    case DType::FP16: static_cast<uint16_t*>(a.out)[i] = host::float_to_fp16(v); return;
    case DType::FP32: static_cast<float*>(a.out)[i] = v; return;
    default: KDA_FAIL(kFn, "x_dtype ", static_cast<int>(a.x_dtype), " is not one of bf16, fp16, fp32");
  }
}

void validate(const PackedConvArgs& a) {
  KDA_CHECK(a.x_dtype == DType::BF16 || a.x_dtype == DType::FP16 || a.x_dtype == DType::FP32,
            kFn, "x_dtype ", static_cast<int>(a.x_dtype), " is not one of bf16, fp16, fp32");
  KDA_CHECK(a.state_dtype == DType::FP32 || a.state_dtype == DType::BF16, kFn, "state_dtype ",
            static_cast<int>(a.state_dtype), " is not one of fp32, bf16");
  KDA_CHECK(a.state_dtype == DType::FP32 || a.x_dtype == DType::BF16, kFn,
            "state_dtype bf16 needs x_dtype bf16 (a bf16 line would round ", dtype_name(a.x_dtype),
            " inputs)");
  KDA_CHECK(a.num_tokens >= 0, kFn, "num_tokens is ", a.num_tokens, ", expected >= 0");
  KDA_CHECK(a.varlen.num_seqs >= 0, kFn, "num_seqs is ", a.varlen.num_seqs, ", expected >= 0");
  KDA_CHECK(a.part_dim > 0, kFn, "part_dim is ", a.part_dim, ", expected > 0");
  KDA_CHECK(a.dim > 0 && a.dim % a.part_dim == 0, kFn, "dim ", a.dim,
            " is not a positive multiple of part_dim ", a.part_dim);
  KDA_CHECK(a.x_row_stride >= a.dim, kFn, "x_row_stride ", a.x_row_stride, " is below dim ", a.dim);
  KDA_CHECK(a.state_len >= 3, kFn, "state_len is ", a.state_len, ", expected >= 3");
  KDA_CHECK(a.varlen.cache_lines >= 0, kFn, "cache_lines is ", a.varlen.cache_lines, ", expected >= 0");
  KDA_CHECK(a.out_plane_stride == 0 || a.out_plane_stride >= a.num_tokens * a.part_dim, kFn,
            "out_plane_stride ", a.out_plane_stride, " is below num_tokens * part_dim = ",
            a.num_tokens * a.part_dim);
  KDA_CHECK(a.varlen.query_start_loc != nullptr, kFn, "query_start_loc is null");
  if (a.varlen.num_seqs == 0) return;
  KDA_CHECK(a.varlen.query_start_loc[0] >= 0, kFn, "query_start_loc[0] is ", a.varlen.query_start_loc[0],
            ", expected >= 0");
  for (int64_t s = 0; s < a.varlen.num_seqs; ++s)
    KDA_CHECK(a.varlen.query_start_loc[s + 1] >= a.varlen.query_start_loc[s], kFn, "query_start_loc decreases at ",
              s + 1, ": ", a.varlen.query_start_loc[s], " then ", a.varlen.query_start_loc[s + 1]);
  KDA_CHECK(a.varlen.query_start_loc[a.varlen.num_seqs] <= a.num_tokens, kFn, "query_start_loc[", a.varlen.num_seqs,
            "] = ", a.varlen.query_start_loc[a.varlen.num_seqs], " exceeds num_tokens ", a.num_tokens);
  // With no token rows every sequence is empty: nothing is read or written, as on the GPU.
  if (a.num_tokens == 0) return;
  KDA_CHECK(a.x && a.weight && a.conv_states && a.varlen.cache_indices && a.out, kFn,
            "x, weight, conv_states, cache_indices and out must be non-null");
}

bool skipped(const PackedConvArgs& a, int32_t line) {
  if (a.varlen.null_line && line == *a.varlen.null_line) return true;
  return line < 0 || line >= a.varlen.cache_lines;
}

float conv_one(const PackedConvArgs& a, ConvMath math, int64_t channel, const float h[4]) {
  const float* w = a.weight + channel * a.weight_stride_dim;
  const float bias = a.bias ? a.bias[channel] : 0.0f;
  if (math == ConvMath::kStockFp32) {
    float acc = bias;
    for (int k = 0; k < 4; ++k) acc = std::fma(h[k], w[k * a.weight_stride_tap], acc);
    return a.silu ? conv::silu_host_approx(acc) : acc;
  }
  double acc = bias;
  for (int k = 0; k < 4; ++k)
    acc += static_cast<double>(h[k]) * static_cast<double>(w[k * a.weight_stride_tap]);
  if (a.silu) acc = acc / (1.0 + std::exp(-acc));
  return static_cast<float>(acc);
}

}  // namespace

void causal_conv1d(const PackedConvArgs& a, ConvMath math) {
  validate(a);
  if (a.num_tokens == 0) return;
  const int64_t plane_stride = a.out_plane_stride ? a.out_plane_stride : a.num_tokens * a.part_dim;
  for (int64_t s = 0; s < a.varlen.num_seqs; ++s) {
    const int64_t begin = a.varlen.query_start_loc[s];
    const int64_t len = a.varlen.query_start_loc[s + 1] - begin;
    const int32_t line = a.varlen.cache_indices[s * a.cache_indices_stride];
    if (len == 0 || skipped(a, line)) continue;
    const bool init = a.varlen.has_initial_state && a.varlen.has_initial_state[s];
    const bool bf16_state = a.state_dtype == DType::BF16;
    const int64_t state_line = line * a.state_stride_line;  // in elements of the pool's type
    // ext(c, k) is channel c of local token k - 3: three history values, then the inputs.
    auto ext = [&](int64_t c, int64_t k) -> float {
      if (k >= 3) return load_input(a, begin + k - 3, c);
      return init ? load_state_elem(a.conv_states,
                                    state_line + c * a.state_stride_dim + k * a.state_stride_tap,
                                    bf16_state)
                  : 0.0f;
    };
    // Tokens outer, channels inner: x is read row by row.
    for (int64_t i = 0; i < len; ++i)
      for (int64_t c = 0; c < a.dim; ++c) {
        const float h[4] = {ext(c, i), ext(c, i + 1), ext(c, i + 2), ext(c, i + 3)};
        store_output(a, plane_stride, begin + i, c, conv_one(a, math, c, h));
      }
    // New tap k is local token len - 3 + k, i.e. ext(c, len + k); all three are read before
    // any is written, and the outputs above read the old state before this.
    for (int64_t c = 0; c < a.dim; ++c) {
      const float next[3] = {ext(c, len), ext(c, len + 1), ext(c, len + 2)};
      for (int k = 0; k < 3; ++k)
        store_state_elem(a.conv_states,
                         state_line + c * a.state_stride_dim + k * a.state_stride_tap, next[k],
                         bf16_state);
    }
  }
}

}  // namespace kda::reference
