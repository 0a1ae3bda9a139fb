// The stock-path baseline's device code (stock_conv.h): the four per-part kernels of the
// stock path, plain on purpose (one element per thread, grid-strided rows). Included by
// stock_conv.cu alone (internal linkage).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/state_elements.h"
#include "conv/conv_math.h"
#include "conv/stock_conv.h"

namespace kda::baseline {
namespace {

// The cache line of sequence s, or -1 when the sequence is skipped (null block or a line
// outside [0, cache_lines)).
__device__ int64_t line_of_sequence(const StockPartParams& p, int64_t s) {
  const int32_t line = p.cache_indices[s * p.cache_indices_stride];
  if (p.has_null_line && line == p.null_line) return -1;
  if (line < 0 || line >= p.cache_lines) return -1;
  return line;
}

// A flag byte other than 0 counts as true, as in the packed kernel.
__device__ bool has_initial_state(const StockPartParams& p, int64_t s) {
  return p.has_initial_state != nullptr &&
         reinterpret_cast<const unsigned char*>(p.has_initial_state)[s] != 0;
}

// The sequence s with qsl[s] <= t < qsl[s + 1] (binary search for the first qsl entry > t),
// or -1 when token t belongs to no sequence. The found s always has qsl[s] <= t, so with
// qsl[s] >= 0 every row it implies lies in [0, t].
__device__ int64_t sequence_of_token(const StockPartParams& p, int64_t t) {
  int64_t lo = 0, hi = p.num_seqs + 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (p.query_start_loc[mid] > t)
      hi = mid;
    else
      lo = mid + 1;
  }
  const int64_t s = lo - 1;
  if (s < 0 || s >= p.num_seqs || p.query_start_loc[s] < 0) return -1;
  return s;
}

template <typename T>
__global__ void cast_slice_to_fp32_kernel(StockPartParams p) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= p.part_dim) return;
  const T* x = static_cast<const T*>(p.x);
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x)
    p.x32[t * p.part_dim + c] = conv::load_f32(x[t * p.x_row_stride + c]);
}

// One thread per output element; rows of no sequence or of a skipped one are not written.
__global__ void conv_fp32_kernel(StockPartParams p) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= p.part_dim) return;
  const float* w = p.weight + c * p.weight_stride_dim;
  const float w0 = w[0], w1 = w[p.weight_stride_tap], w2 = w[2 * p.weight_stride_tap],
              w3 = w[3 * p.weight_stride_tap];
  const float acc0 = p.bias ? p.bias[c] : 0.0f;
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const int64_t s = sequence_of_token(p, t);
    if (s < 0) continue;
    const int64_t line = line_of_sequence(p, s);
    if (line < 0) continue;
    const int64_t begin = p.query_start_loc[s];
    const bool init = has_initial_state(p, s);
    const int64_t st = line * p.state_stride_line + c * p.state_stride_dim;
    // h[k] is local token (t - begin) - 3 + k; before the sequence it is state tap 3 + j.
    float h[4];
    for (int k = 0; k < 4; ++k) {
      const int64_t j = t - begin - 3 + k;
      h[k] = j >= 0 ? p.x32[(begin + j) * p.part_dim + c]
                    : (init ? load_state_elem(p.states, st + (3 + j) * p.state_stride_tap,
                                              p.state_dtype_is_bf16)
                            : 0.0f);
    }
    float acc = conv::conv4_tap_fma(h[0], h[1], h[2], h[3], w0, w1, w2, w3, acc0);
    if (p.silu) acc = conv::silu_stock(acc);
    p.y32[t * p.part_dim + c] = acc;
  }
}

// One thread per (sequence, channel). Runs after conv_fp32_kernel on the same stream, so
// every read of the old state has happened.
__global__ void update_state_kernel(StockPartParams p) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= p.part_dim) return;
  for (int64_t s = blockIdx.x; s < p.num_seqs; s += gridDim.x) {
    const int64_t begin = p.query_start_loc[s], end = p.query_start_loc[s + 1];
    if (end <= begin || begin < 0 || end > p.num_tokens) continue;
    const int64_t line = line_of_sequence(p, s);
    if (line < 0) continue;
    const int64_t len = end - begin;
    const bool init = has_initial_state(p, s);
    const int64_t st = line * p.state_stride_line + c * p.state_stride_dim;
    // New tap k is local token len - 3 + k; before the sequence it is old tap k + len. Every
    // value is a widened bf16 input or tap, so a bf16 line's rounding store changes no value.
    float next[3];
    for (int k = 0; k < 3; ++k) {
      const int64_t j = len - 3 + k;
      next[k] = j >= 0 ? p.x32[(begin + j) * p.part_dim + c]
                       : (init ? load_state_elem(p.states, st + (k + len) * p.state_stride_tap,
                                                 p.state_dtype_is_bf16)
                               : 0.0f);
    }
    for (int k = 0; k < 3; ++k)
      store_state_elem(p.states, st + k * p.state_stride_tap, next[k], p.state_dtype_is_bf16);
  }
}

// Casts back exactly the rows conv_fp32_kernel wrote (same predicate).
template <typename T>
__global__ void cast_back_kernel(StockPartParams p) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= p.part_dim) return;
  T* out = static_cast<T*>(p.out);
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const int64_t s = sequence_of_token(p, t);
    if (s < 0 || line_of_sequence(p, s) < 0) continue;
    out[t * p.part_dim + c] = conv::store_rn<T>(p.y32[t * p.part_dim + c]);
  }
}

}  // namespace
}  // namespace kda::baseline
