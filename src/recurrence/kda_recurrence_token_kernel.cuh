// The device code of kda_recurrence_token (kda_recurrence_token.h): per-token prep (L2 norms,
// q scale, decay, beta) fused into the token-by-token gated delta rule, one block per
// (sequence, head, value slice). Included by kda_recurrence_token.cu alone: the kernel and its
// helpers have internal linkage there.
//
// Layout: a block is one warp owning kColumns = 32 value columns of one head; thread j holds
// the state column S[:, v_j] (128 fp32) in registers. The block prepares kChunk tokens at a
// time into shared memory (one warp per token, 4 channels per lane): q, k, exp(g) as broadcast
// vectors and beta, k.q as scalars, so the serial loop needs no cross-thread reduction.
//
// The layer's token step (docs/layer.md)
//   S = diag(exp(g)) S;  u = v - S^T k;  S += beta k u^T;  o = S^T q
// runs as one pass over S per token: the rank-one update of token t is applied lazily, fused
// with the decay of token t + 1 (S = (S + w_t k_t) * exp(g_{t+1}), the same two roundings as
// applying it eagerly), and the read-out uses o = S'^T q + w (k.q) with S' the decayed state
// before the update and w = beta u. A second pass over S would make ptxas hoist its shared
// loads under the first pass's reduction and spill; one pass keeps ~170 registers. The update
// left pending at the end of a chunk is applied before the stage is refilled.
// State checkpoints (kda_recurrence.h) sit on multiples of 64 rows or the sequence's last row,
// both stage ends (stages start at the sequence's first row), where the pending update has
// just been applied: S there is exactly the state a run cut at that row ends with, and the
// block writes its columns of it to the checkpoint's line.
// Pool lines hold fp32 or bf16 elements (RecurrenceParams::state_dtype_is_bf16, a run-time
// flag): the state is widened once when loaded and rounded to nearest even at each store,
// through common/state_elements.h. A checkpoint line and the final line of a run cut there are the same
// registers rounded the same way, so they stay bitwise equal in either type. A run continued
// from a bf16 line starts from the rounded state, so it is not bitwise the uninterrupted run
// (an fp32 line stores the state exactly, and there it is).
// The four slices of a head repeat the prep; it is cheap next to 512 FMAs per token and column.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_math.cuh"
#include "common/state_elements.h"
#include "recurrence/kda_recurrence.h"

namespace kda {
namespace {

constexpr int kHeadDim = recurrence::kHeadDim;
using recurrence::RecurrenceParams;

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
  static_assert(kSlices == recurrence::kTokenSlices,
                "recurrence::args_supported() limits the heads for this grid");
};
using Traits = RecurrenceTraits;

// One chunk of prepared tokens. Rows are 16-byte aligned for float4 broadcast reads.
struct alignas(16) ChunkStage {
  float q[Traits::kChunk][kHeadDim];      // normalised and scaled
  float k[Traits::kChunk][kHeadDim];      // normalised
  float decay[Traits::kChunk][kHeadDim];  // exp(g)
  float v[Traits::kChunk][Traits::kColumns];
  float beta[Traits::kChunk];
  float kq[Traits::kChunk];  // k . q of the prepared vectors
};

using device_math::load4_bf16;
using device_math::load_bf16;
using device_math::sigmoid;
using device_math::softplus;
using device_math::warp_sum;

// Step 4 (docs/layer.md) for token `row` and this block's head, by one warp; results go to
// stage slot `slot`. Lane l owns channels [4l, 4l + 4).
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

// Reads this thread's state column S[:, v_j] from pool element `at` on (elements k_stride
// apart), widening bf16 elements. The flag is tested once, outside the unrolled loops: a test
// per element keeps more registers live and made ptxas spill.
__device__ __forceinline__ void load_column(float (&s)[kHeadDim], const void* pool, int64_t at,
                                            int64_t k_stride, bool bf16) {
  if (bf16) {
#pragma unroll
    for (int i = 0; i < kHeadDim; ++i) s[i] = load_state_elem(pool, at + i * k_stride, true);
  } else {
#pragma unroll
    for (int i = 0; i < kHeadDim; ++i) s[i] = load_state_elem(pool, at + i * k_stride, false);
  }
}

// Writes this thread's state column S[:, v_j] to pool element `at` on (elements k_stride
// apart), rounded to bf16 to nearest even when the pool holds bf16.
__device__ __forceinline__ void store_column(const float (&s)[kHeadDim], void* pool, int64_t at,
                                             int64_t k_stride, bool bf16) {
  if (bf16) {
#pragma unroll
    for (int i = 0; i < kHeadDim; ++i) store_state_elem(pool, at + i * k_stride, s[i], true);
  } else {
#pragma unroll
    for (int i = 0; i < kHeadDim; ++i) store_state_elem(pool, at + i * k_stride, s[i], false);
  }
}

// grid (num_seqs, H x kSlices), block kThreads. Every exit before the token loop is uniform
// over the block (it depends on blockIdx only), so the barriers below are reached by all.
template <bool kLowerBound>
__global__ void __launch_bounds__(Traits::kThreads)
    kda_recurrence_token_kernel(const RecurrenceParams p) {
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
  const int64_t column_offset = head * p.state_head + column * p.state_v;
  const int64_t state_at = line * p.state_line + column_offset;  // pool elements, either type
  float s[kHeadDim];
  if (p.has_initial_state != nullptr && p.has_initial_state[seq]) {
    load_column(s, p.states, state_at, p.state_k, p.state_dtype_is_bf16);
  } else {
#pragma unroll
    for (int i = 0; i < kHeadDim; ++i) s[i] = 0.0f;
  }

  // The sequence's checkpoints, read once: per stage the test is integer arithmetic on them.
  const CheckpointSeq checkpoints = recurrence::checkpoints_of(p, seq);

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
    // S is the state after the first `end` rows, no update pending. Checkpoints are looked
    // up where kda_chunked looks them up (multiples of 64 rows and the last row), so that
    // the two kernels write the same entries whatever the table holds.
    const int64_t end = t0 + n - bos;
    if (end % kKdaChunk == 0 || t0 + n == eos) {
      const int64_t ck = recurrence::checkpoint_line(p, checkpoint_at(checkpoints, end));
      if (ck >= 0)
        store_column(s, p.states, ck * p.state_line + column_offset, p.state_k, p.state_dtype_is_bf16);
    }
  }
  store_column(s, p.states, state_at, p.state_k, p.state_dtype_is_bf16);
}

}  // namespace
}  // namespace kda
