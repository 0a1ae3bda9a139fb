#include "conv/stock_conv.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/check.h"
#include "common/cuda_check.h"
#include "common/state_storage.h"
#include "conv/silu_recipe.h"

namespace kda::baseline {
namespace {

constexpr const char* kFn = "kda::baseline::stock_causal_conv1d";
constexpr const char* kWorkspaceFn = "kda::baseline::stock_causal_conv1d_workspace_bytes";
constexpr std::size_t kWorkspaceAlign = 256;
constexpr int64_t kMaxGridRows = 1 << 20;  // grid.x cap; kernels stride over further rows

// One part's (plane's) view of PackedConvArgs: every pointer already offset to the part's
// first channel, channel indices below run over [0, part_dim). CUDA-free.
struct StockPartParams {
  const void* x = nullptr;  // (num_tokens, part_dim) slice, row stride x_row_stride
  int64_t x_row_stride = 0;
  int64_t num_tokens = 0, part_dim = 0;
  const float* weight = nullptr;  // (part_dim, 4)
  int64_t weight_stride_dim = 0, weight_stride_tap = 0;
  const float* bias = nullptr;  // (part_dim) or nullptr
  void* states = nullptr;       // (cache_lines, part_dim, >= 3), fp32 or bf16 elements
  bool states_bf16 = false;     // state_dtype BF16: taps widen on load, round back on store
  int64_t cache_lines = 0;
  int64_t state_stride_line = 0, state_stride_dim = 0, state_stride_tap = 0;
  const int32_t* query_start_loc = nullptr;  // (num_seqs + 1)
  int64_t num_seqs = 0;
  const int32_t* cache_indices = nullptr;
  int64_t cache_indices_stride = 0;
  const bool* has_initial_state = nullptr;  // nullptr: no sequence has an initial state
  bool has_null_line = false;
  int32_t null_line = 0;
  bool silu = true;
  float* x32 = nullptr;  // dense (num_tokens, part_dim) FP32 copy of the slice
  float* y32 = nullptr;  // dense (num_tokens, part_dim) FP32 conv output
  void* out = nullptr;   // the part's plane, dense (num_tokens, part_dim), x dtype
};

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
                                              p.states_bf16)
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
                                                 p.states_bf16)
                               : 0.0f);
    }
    for (int k = 0; k < 3; ++k)
      store_state_elem(p.states, st + k * p.state_stride_tap, next[k], p.states_bf16);
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

std::size_t align_up(std::size_t n) { return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

std::size_t part_fp32_bytes(const PackedConvArgs& a) {
  return align_up(static_cast<std::size_t>(a.num_tokens) * static_cast<std::size_t>(a.part_dim) *
                  sizeof(float));
}

void check_supported(const PackedConvArgs& a, const char* fn) {
  std::string why;
  if (!packed_causal_conv1d_supported(a, &why))
    KDA_FAIL(fn, "arguments rejected by packed_causal_conv1d_supported: ", why);
}

// part_dim is a multiple of 64 (supported()), so a block covers whole 64-channel groups.
unsigned threads_for(int64_t part_dim) {
  if (part_dim % 256 == 0) return 256;
  if (part_dim % 128 == 0) return 128;
  return 64;
}

template <typename T>
void run_parts(const PackedConvArgs& a, void* workspace, Stream stream) {
  const int64_t parts = a.dim / a.part_dim;
  const int64_t plane_stride = a.out_plane_stride ? a.out_plane_stride : a.num_tokens * a.part_dim;
  const unsigned threads = threads_for(a.part_dim);
  const unsigned col_blocks = static_cast<unsigned>((a.part_dim + threads - 1) / threads);
  const dim3 token_grid(static_cast<unsigned>(std::min(a.num_tokens, kMaxGridRows)), col_blocks);
  const dim3 seq_grid(static_cast<unsigned>(std::min(a.varlen.num_seqs, kMaxGridRows)), col_blocks);
  cudaStream_t s = stream;
  for (int64_t part = 0; part < parts; ++part) {
    const int64_t ch0 = part * a.part_dim;
    StockPartParams p;
    p.x = static_cast<const T*>(a.x) + ch0;
    p.x_row_stride = a.x_row_stride;
    p.num_tokens = a.num_tokens;
    p.part_dim = a.part_dim;
    p.weight = a.weight + ch0 * a.weight_stride_dim;
    p.weight_stride_dim = a.weight_stride_dim;
    p.weight_stride_tap = a.weight_stride_tap;
    p.bias = a.bias ? a.bias + ch0 : nullptr;
    p.states_bf16 = a.state_dtype == DType::BF16;
    p.states = state_elem_ptr(a.conv_states, ch0 * a.state_stride_dim, p.states_bf16);
    p.cache_lines = a.varlen.cache_lines;
    p.state_stride_line = a.state_stride_line;
    p.state_stride_dim = a.state_stride_dim;
    p.state_stride_tap = a.state_stride_tap;
    p.query_start_loc = a.varlen.query_start_loc;
    p.num_seqs = a.varlen.num_seqs;
    p.cache_indices = a.varlen.cache_indices;
    p.cache_indices_stride = a.cache_indices_stride;
    p.has_initial_state = a.varlen.has_initial_state;
    p.has_null_line = a.varlen.null_line.has_value();
    p.null_line = a.varlen.null_line.value_or(0);
    p.silu = a.silu;
    p.x32 = static_cast<float*>(workspace);
    p.y32 = reinterpret_cast<float*>(static_cast<char*>(workspace) + part_fp32_bytes(a));
    p.out = static_cast<T*>(a.out) + part * plane_stride;

    cast_slice_to_fp32_kernel<T><<<token_grid, threads, 0, s>>>(p);
    KDA_CUDA_CHECK(kFn, cudaGetLastError());
    conv_fp32_kernel<<<token_grid, threads, 0, s>>>(p);
    KDA_CUDA_CHECK(kFn, cudaGetLastError());
    update_state_kernel<<<seq_grid, threads, 0, s>>>(p);
    KDA_CUDA_CHECK(kFn, cudaGetLastError());
    cast_back_kernel<T><<<token_grid, threads, 0, s>>>(p);
    KDA_CUDA_CHECK(kFn, cudaGetLastError());
  }
}

}  // namespace

std::size_t stock_causal_conv1d_workspace_bytes(const PackedConvArgs& args) {
  check_supported(args, kWorkspaceFn);
  return 2 * part_fp32_bytes(args);
}

void stock_causal_conv1d(const PackedConvArgs& args, void* workspace, std::size_t workspace_bytes,
                         Stream stream) {
  check_supported(args, kFn);
  const std::size_t need = 2 * part_fp32_bytes(args);
  KDA_CHECK(workspace_bytes >= need, kFn, "workspace_bytes ", workspace_bytes, " is below the ",
            need, " bytes stock_causal_conv1d_workspace_bytes() asks for");
  KDA_CHECK(need == 0 || workspace != nullptr, kFn, "workspace is null");
  KDA_CHECK(reinterpret_cast<std::uintptr_t>(workspace) % kWorkspaceAlign == 0, kFn,
            "workspace is not ", kWorkspaceAlign, "-byte aligned");
  if (args.num_tokens == 0 || args.varlen.num_seqs == 0) return;
  switch (args.x_dtype) {
    case DType::BF16: run_parts<__nv_bfloat16>(args, workspace, stream); return;
    case DType::FP16: run_parts<__half>(args, workspace, stream); return;
    case DType::FP32: run_parts<float>(args, workspace, stream); return;
    default:
      KDA_FAIL(kFn, "x_dtype ", static_cast<int>(args.x_dtype), " is not one of bf16, fp16, fp32");
  }
}

}  // namespace kda::baseline
