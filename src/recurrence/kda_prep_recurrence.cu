// kda_prep_recurrence: per-token prep (L2 norms, q scale, decay, beta) fused into the
// token-by-token gated delta rule, one block per (sequence, head, value slice).
//
// Layout: a block is one warp owning kColumns = 32 value columns of one head; thread j holds
// the state column S[:, v_j] (128 fp32) in registers. The block prepares kChunk tokens at a
// time into shared memory (one warp per token, 4 channels per lane): q, k, exp(g) as broadcast
// vectors and beta, k.q as scalars, so the serial loop needs no cross-thread reduction.
//
// The spec's token step
//   S = diag(exp(g)) S;  u = v - S^T k;  S += beta k u^T;  o = S^T q
// runs as one pass over S per token: the rank-one update of token t is applied lazily, fused
// with the decay of token t + 1 (S = (S + w_t k_t) * exp(g_{t+1}), the same two roundings as
// applying it eagerly), and the read-out uses o = S'^T q + w (k.q) with S' the decayed state
// before the update and w = beta u. A second pass over S would make ptxas hoist its shared
// loads under the first pass's reduction and spill; one pass keeps ~170 registers. The update
// left pending at the end of a chunk is applied before the stage is refilled.
// The four slices of a head repeat the prep; it is cheap next to 512 FMAs per token and column.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "common/check.h"
#include "common/cuda_check.h"
#include "common/device_math.cuh"
#include "recurrence/kda_recurrence.h"

namespace kda {
namespace {

constexpr const char* kFunction = "kda::kda_prep_recurrence";
constexpr int kHeadDim = 128;

struct RecurrenceTraits {
  static constexpr int kThreads = 32;                    // one warp per block
  static constexpr int kColumns = kThreads;              // value columns per block, one per thread
  static constexpr int kSlices = kHeadDim / kColumns;    // blocks per (sequence, head)
  static constexpr int kChunk = 16;                      // tokens prepared per shared-memory stage
  static constexpr int kPartials = 4;                    // independent accumulators per dot product
  static constexpr int kLaneChannels = kHeadDim / 32;    // channels per lane in the prep
  static_assert(kHeadDim % kColumns == 0, "value slices must tile the head");
  static_assert(kLaneChannels == 4, "the prep loads 4 bf16 (8 bytes) per lane");
  static_assert(kPartials % 4 == 0, "a float4 step must land on 4 distinct accumulators");
  static constexpr int kMaxHeads = 65535 / kSlices;      // gridDim.y = H x kSlices
};
using Traits = RecurrenceTraits;

// Kernel-facing copy of PrepRecurrenceArgs: typed pointers, b already offset to its columns.
struct RecurrenceParams {
  const int32_t* query_start_loc;
  const int32_t* cache_indices;
  const bool* has_initial_state;
  int32_t null_line;
  int64_t cache_lines;
  int64_t num_tokens;
  const __nv_bfloat16* q;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  int64_t qkv_stride;
  const __nv_bfloat16* g1;
  int64_t g1_stride;
  const __nv_bfloat16* b;
  int64_t b_stride;
  const float* a_log;
  const float* dt_bias;
  float lower_bound;
  float* states;
  int64_t state_line, state_head, state_k, state_v;
  __nv_bfloat16* o;
  int64_t o_stride;
};

// One chunk of prepared tokens. Rows are 16-byte aligned for float4 broadcast reads.
struct alignas(16) ChunkStage {
  float q[Traits::kChunk][kHeadDim];      // normalised and scaled
  float k[Traits::kChunk][kHeadDim];      // normalised
  float decay[Traits::kChunk][kHeadDim];  // exp(g)
  float v[Traits::kChunk][Traits::kColumns];
  float beta[Traits::kChunk];
  float kq[Traits::kChunk];  // k . q of the prepared vectors
};

using layer_device::load4_bf16;
using layer_device::load_bf16;
using layer_device::sigmoid;
using layer_device::softplus;
using layer_device::warp_sum;

// Spec step 4 for token `row` and this block's head, by one warp; results go to stage slot
// `slot`. Lane l owns channels [4l, 4l + 4).
template <bool kLowerBound>
__device__ __forceinline__ void prep_token(const RecurrenceParams& p, int64_t row, int head,
                                           float a_exp, int lane, ChunkStage& stage, int slot) {
  const int channel = Traits::kLaneChannels * lane;
  const int64_t col = static_cast<int64_t>(head) * kHeadDim + channel;
  float q[4], k[4], g1[4];
  load4_bf16(p.q + row * p.qkv_stride + col, q);
  load4_bf16(p.k + row * p.qkv_stride + col, k);
  load4_bf16(p.g1 + row * p.g1_stride + col, g1);
  float qq = 0.0f, kk = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    qq = fmaf(q[j], q[j], qq);
    kk = fmaf(k[j], k[j], kk);
  }
  const float q_norm = sqrtf(warp_sum(qq) + 1e-6f);
  const float k_norm = sqrtf(warp_sum(kk) + 1e-6f);
  constexpr float kQScale = 0.088388347648318440f;  // 128^-0.5
  float decay[4];
  float kq = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    q[j] = q[j] / q_norm * kQScale;
    k[j] = k[j] / k_norm;
    kq = fmaf(k[j], q[j], kq);
    const float x = g1[j] + p.dt_bias[col + j];
    const float g = kLowerBound ? p.lower_bound * sigmoid(a_exp * x) : -a_exp * softplus(x);
    decay[j] = expf(g);
  }
  *reinterpret_cast<float4*>(&stage.q[slot][channel]) = make_float4(q[0], q[1], q[2], q[3]);
  *reinterpret_cast<float4*>(&stage.k[slot][channel]) = make_float4(k[0], k[1], k[2], k[3]);
  *reinterpret_cast<float4*>(&stage.decay[slot][channel]) =
      make_float4(decay[0], decay[1], decay[2], decay[3]);
  kq = warp_sum(kq);
  if (lane == 0) {
    stage.beta[slot] = sigmoid(load_bf16(p.b + row * p.b_stride + head));
    stage.kq[slot] = kq;
  }
}

__device__ __forceinline__ float sum_partials(const float (&a)[Traits::kPartials]) {
  static_assert(Traits::kPartials == 4, "the fixed summation tree is written for 4 partials");
  return (a[0] + a[1]) + (a[2] + a[3]);
}

// One token for this thread's value column: applies the pending update w_prev * k_prev, decays,
// and returns S^T k and S^T q of the decayed state (in *sk, *sq).
__device__ __forceinline__ void token_pass(float (&s)[kHeadDim], const float* k_prev,
                                           float w_prev, const float* decay, const float* k,
                                           const float* q, float* sk, float* sq) {
  float ak[Traits::kPartials], aq[Traits::kPartials];
#pragma unroll
  for (int j = 0; j < Traits::kPartials; ++j) ak[j] = aq[j] = 0.0f;
#pragma unroll
  for (int i = 0; i < kHeadDim; i += 4) {
    const float4 kp = *reinterpret_cast<const float4*>(k_prev + i);
    const float4 d = *reinterpret_cast<const float4*>(decay + i);
    const float4 kv = *reinterpret_cast<const float4*>(k + i);
    const float4 qv = *reinterpret_cast<const float4*>(q + i);
    const int a = i % Traits::kPartials;
    s[i + 0] = fmaf(kp.x, w_prev, s[i + 0]) * d.x;
    s[i + 1] = fmaf(kp.y, w_prev, s[i + 1]) * d.y;
    s[i + 2] = fmaf(kp.z, w_prev, s[i + 2]) * d.z;
    s[i + 3] = fmaf(kp.w, w_prev, s[i + 3]) * d.w;
    ak[a + 0] = fmaf(s[i + 0], kv.x, ak[a + 0]);
    ak[a + 1] = fmaf(s[i + 1], kv.y, ak[a + 1]);
    ak[a + 2] = fmaf(s[i + 2], kv.z, ak[a + 2]);
    ak[a + 3] = fmaf(s[i + 3], kv.w, ak[a + 3]);
    aq[a + 0] = fmaf(s[i + 0], qv.x, aq[a + 0]);
    aq[a + 1] = fmaf(s[i + 1], qv.y, aq[a + 1]);
    aq[a + 2] = fmaf(s[i + 2], qv.z, aq[a + 2]);
    aq[a + 3] = fmaf(s[i + 3], qv.w, aq[a + 3]);
  }
  *sk = sum_partials(ak);
  *sq = sum_partials(aq);
}

// S += w k: the update a chunk's last token left pending.
__device__ __forceinline__ void apply_update(float (&s)[kHeadDim], const float* k, float w) {
#pragma unroll
  for (int i = 0; i < kHeadDim; i += 4) {
    const float4 kv = *reinterpret_cast<const float4*>(k + i);
    s[i + 0] = fmaf(kv.x, w, s[i + 0]);
    s[i + 1] = fmaf(kv.y, w, s[i + 1]);
    s[i + 2] = fmaf(kv.z, w, s[i + 2]);
    s[i + 3] = fmaf(kv.w, w, s[i + 3]);
  }
}

// grid (max_seqs, H x kSlices), block kThreads. Every exit before the token loop is uniform
// over the block (it depends on blockIdx only), so the barriers below are reached by all.
template <bool kLowerBound>
__global__ void __launch_bounds__(Traits::kThreads)
    kda_prep_recurrence_kernel(const RecurrenceParams p) {
  const int seq = blockIdx.x;
  const int head = blockIdx.y / Traits::kSlices;
  const int slice = blockIdx.y % Traits::kSlices;
  const int64_t bos = max(static_cast<int64_t>(p.query_start_loc[seq]), int64_t{0});
  const int64_t eos = min(static_cast<int64_t>(p.query_start_loc[seq + 1]), p.num_tokens);
  if (bos >= eos) return;
  const int32_t line = p.cache_indices[seq];
  if (line == p.null_line || line < 0 || line >= p.cache_lines) return;

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int column = slice * Traits::kColumns + tid;  // value index inside the head
  float* state = p.states + line * p.state_line + head * p.state_head + column * p.state_v;
  float s[kHeadDim];
  if (p.has_initial_state != nullptr && p.has_initial_state[seq]) {
#pragma unroll
    for (int i = 0; i < kHeadDim; ++i) s[i] = state[i * p.state_k];
  } else {
#pragma unroll
    for (int i = 0; i < kHeadDim; ++i) s[i] = 0.0f;
  }

  __shared__ ChunkStage stage;
  const float a_exp = expf(p.a_log[head]);
  const int64_t v_col = static_cast<int64_t>(head) * kHeadDim + column;
  constexpr int kWarps = Traits::kThreads / 32;
  for (int64_t t0 = bos; t0 < eos; t0 += Traits::kChunk) {
    const int n = static_cast<int>(min(static_cast<int64_t>(Traits::kChunk), eos - t0));
    __syncthreads();  // the previous chunk's token loop is done reading the stage
    for (int i = warp; i < n; i += kWarps) prep_token<kLowerBound>(p, t0 + i, head, a_exp, lane, stage, i);
    for (int i = 0; i < n; ++i) stage.v[i][tid] = load_bf16(p.v + (t0 + i) * p.qkv_stride + v_col);
    __syncthreads();
    // No update is pending at a chunk start: with w = 0 the first fmaf leaves S as it is.
    const float* k_prev = stage.k[0];
    float w = 0.0f;
#pragma unroll 1
    for (int i = 0; i < n; ++i) {
      float sk, sq;
      token_pass(s, k_prev, w, stage.decay[i], stage.k[i], stage.q[i], &sk, &sq);
      w = stage.beta[i] * (stage.v[i][tid] - sk);  // beta u
      const float o = fmaf(w, stage.kq[i], sq);   // (S' + w k)^T q
      p.o[(t0 + i) * p.o_stride + v_col] = __float2bfloat16_rn(o);
      k_prev = stage.k[i];
    }
    apply_update(s, k_prev, w);
  }
#pragma unroll
  for (int i = 0; i < kHeadDim; ++i) state[i * p.state_k] = s[i];
}

bool aligned_to(const void* ptr, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0;
}

bool fail(std::string* why, std::string reason) {
  if (why) *why = std::move(reason);
  return false;
}

// Whether (size, stride) dimensions map distinct indices to distinct elements: sorted by
// stride, each stride must step past everything the smaller ones span.
bool strides_disjoint(std::array<std::pair<int64_t, int64_t>, 4> dims) {
  std::sort(dims.begin(), dims.end(),
            [](const auto& a, const auto& b) { return a.second < b.second; });
  int64_t extent = 1;
  for (const auto& [size, stride] : dims) {
    if (size <= 1) continue;
    if (stride < extent) return false;
    if (stride > (std::numeric_limits<int64_t>::max() - extent) / (size - 1)) return false;
    extent += stride * (size - 1);
  }
  return true;
}

}  // namespace

bool kda_prep_recurrence_supported(const PrepRecurrenceArgs& a, std::string* why) {
  using detail::str_cat;
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (a.head_dim != kHeadDim)
    return fail(why, str_cat("head_dim ", a.head_dim, " is not supported; only 128 is"));
  if (a.num_heads < 1 || a.num_heads > Traits::kMaxHeads)
    return fail(why, str_cat("num_heads ", a.num_heads, " is outside [1, ", Traits::kMaxHeads,
                             "] (the grid has ", Traits::kSlices, " blocks per head in y)"));
  if (a.num_tokens < 0 || a.num_tokens > kInt32Max)
    return fail(why, str_cat("num_tokens ", a.num_tokens, " is outside [0, 2^31 - 1]"));
  if (a.max_seqs < 0 || a.max_seqs > kInt32Max)
    return fail(why, str_cat("max_seqs ", a.max_seqs, " is outside [0, 2^31 - 1]"));
  if (a.cache_lines < 0 || a.cache_lines > kInt32Max + 1)
    return fail(why, str_cat("cache_lines ", a.cache_lines, " is outside [0, 2^31]"));
  if (!a.query_start_loc || !a.cache_indices)
    return fail(why, "query_start_loc and cache_indices must be set");
  if (!a.q || !a.k || !a.v || !a.g1 || !a.b)
    return fail(why, "q, k, v, g1 and b must be set");
  if (!a.a_log || !a.dt_bias) return fail(why, "a_log and dt_bias must be set");
  if (!a.states) return fail(why, "states (the recurrent-state pool) must be set");
  if (!a.o) return fail(why, "o must be set");

  const int64_t part_dim = a.num_heads * kHeadDim;
  if (a.qkv_row_stride < part_dim || a.qkv_row_stride % 4 != 0)
    return fail(why, str_cat("qkv_row_stride ", a.qkv_row_stride, " must be >= P = ", part_dim,
                             " and a multiple of 4 (the prep reads 4 bf16 at a time)"));
  if (a.g1_row_stride < part_dim || a.g1_row_stride % 4 != 0)
    return fail(why, str_cat("g1_row_stride ", a.g1_row_stride, " must be >= P = ", part_dim,
                             " and a multiple of 4"));
  if (!aligned_to(a.q, 8) || !aligned_to(a.k, 8) || !aligned_to(a.g1, 8))
    return fail(why, "q, k and g1 must be 8-byte aligned (the prep reads 4 bf16 at a time)");
  if (!aligned_to(a.v, 2) || !aligned_to(a.b, 2) || !aligned_to(a.o, 2))
    return fail(why, "v, b and o must be aligned to their 2-byte bf16 elements");
  if (!aligned_to(a.a_log, 4) || !aligned_to(a.dt_bias, 4) || !aligned_to(a.states, 4))
    return fail(why, "a_log, dt_bias and states must be aligned to their 4-byte elements");
  if (a.b_col_offset < 0 || a.b_row_stride < a.b_col_offset + a.num_heads)
    return fail(why, str_cat("the b columns [", a.b_col_offset, ", ",
                             a.b_col_offset + a.num_heads, ") do not fit in b_row_stride ",
                             a.b_row_stride));
  if (a.o_row_stride < part_dim)
    return fail(why, str_cat("o_row_stride ", a.o_row_stride, " is below P = ", part_dim));
  if (a.gate_lower_bound &&
      (!std::isfinite(*a.gate_lower_bound) || !(*a.gate_lower_bound < 0.0)))
    return fail(why, str_cat("gate_lower_bound ", *a.gate_lower_bound,
                             " must be finite and negative"));
  if (a.state_stride_line <= 0 || a.state_stride_head <= 0 || a.state_stride_k <= 0 ||
      a.state_stride_v <= 0)
    return fail(why, "the state strides (line, head, k, v) must be positive");
  if (!strides_disjoint({{{a.cache_lines, a.state_stride_line},
                          {a.num_heads, a.state_stride_head},
                          {kHeadDim, a.state_stride_k},
                          {kHeadDim, a.state_stride_v}}}))
    return fail(why, str_cat("the state strides (line ", a.state_stride_line, ", head ",
                             a.state_stride_head, ", k ", a.state_stride_k, ", v ",
                             a.state_stride_v, ") make state elements overlap"));
  return true;
}

void kda_prep_recurrence(const PrepRecurrenceArgs& a, Stream stream) {
  std::string why;
  if (!kda_prep_recurrence_supported(a, &why)) KDA_FAIL(kFunction, why);
  if (a.max_seqs == 0 || a.num_tokens == 0) return;

  RecurrenceParams p{};
  p.query_start_loc = a.query_start_loc;
  p.cache_indices = a.cache_indices;
  p.has_initial_state = a.has_initial_state;
  p.null_line = a.null_line;
  p.cache_lines = a.cache_lines;
  p.num_tokens = a.num_tokens;
  p.q = static_cast<const __nv_bfloat16*>(a.q);
  p.k = static_cast<const __nv_bfloat16*>(a.k);
  p.v = static_cast<const __nv_bfloat16*>(a.v);
  p.qkv_stride = a.qkv_row_stride;
  p.g1 = static_cast<const __nv_bfloat16*>(a.g1);
  p.g1_stride = a.g1_row_stride;
  p.b = static_cast<const __nv_bfloat16*>(a.b) + a.b_col_offset;
  p.b_stride = a.b_row_stride;
  p.a_log = a.a_log;
  p.dt_bias = a.dt_bias;
  p.lower_bound = a.gate_lower_bound ? static_cast<float>(*a.gate_lower_bound) : 0.0f;
  p.states = a.states;
  p.state_line = a.state_stride_line;
  p.state_head = a.state_stride_head;
  p.state_k = a.state_stride_k;
  p.state_v = a.state_stride_v;
  p.o = static_cast<__nv_bfloat16*>(a.o);
  p.o_stride = a.o_row_stride;

  const dim3 grid(static_cast<unsigned>(a.max_seqs),
                  static_cast<unsigned>(a.num_heads * Traits::kSlices));
  const dim3 block(Traits::kThreads);
  switch (a.head_dim) {
    case kHeadDim:
      if (a.gate_lower_bound)
        kda_prep_recurrence_kernel<true><<<grid, block, 0, stream>>>(p);
      else
        kda_prep_recurrence_kernel<false><<<grid, block, 0, stream>>>(p);
      break;
    default:
      KDA_FAIL(kFunction, "head_dim ", a.head_dim, " is not supported; only 128 is");
  }
  KDA_CUDA_CHECK(kFunction, cudaGetLastError());
}

}  // namespace kda
