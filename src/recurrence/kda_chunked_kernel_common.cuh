// What the two phases' block bodies of the chunked KDA recurrence share (kda_chunked_kernel.cuh
// has the overview): the sizes, the layout of the chunk record that phase 1 writes and phase 2
// reads, the element conversions and the sequence span. Include through kda_chunked_kernel.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/state_checkpoints.h"
#include "common/state_elements.h"
#include "common/varlen_map.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_recurrence.h"

// The bodies call Ops members that are __device__ (DeviceOps) or __host__ (the CPU emulation)
// only; each instantiation is used on that side alone, so nvcc's cross-side call check is
// turned off for them.
#define KDA_OPS_BODY _Pragma("nv_exec_check_disable")
// `#pragma unroll` in the device passes only: the host compilers (nvcc's host pass, the CPU
// emulation) do not know it and would warn.
#if defined(__CUDA_ARCH__)
#define KDA_UNROLL _Pragma("unroll")
#define KDA_UNROLL_8 _Pragma("unroll 8")
#define KDA_UNROLL_1 _Pragma("unroll 1")
#else
#define KDA_UNROLL
#define KDA_UNROLL_8
#define KDA_UNROLL_1
#endif

namespace kda::chunked {

using recurrence::RecurrenceParams;

constexpr int kHeadDim = recurrence::kHeadDim;  // K = V
constexpr int kChunk = 64;
constexpr int kChunkShift = recurrence::kChunkShift;
constexpr int kSub = 16;  // diagonal sub-block of A and M'
constexpr int kSubBlocks = kChunk / kSub;
static_assert(kChunk == 1 << kChunkShift, "chunk length and shift disagree");
static_assert(kChunk % kSub == 0 && kSub == 16, "the off-diagonal products are m16 tiles");

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kQScale = 0.088388347648318440f;  // 128^-0.5
// Per-token log decays below this are raised to it. exp(-128) is 0 for every purpose here
// (kda_recurrence_token's expf underflows already at -104) and the floor keeps the cumulative
// sums of a chunk finite, so differences of them never become inf - inf.
constexpr float kMinLogDecay = -128.0f;

// One (chunk slot, head) record in the workspace. All offsets are multiples of 16 bytes.
struct Record {
  static constexpr int kW = 0;                                 // bf16 [i][c]   64 x 128
  static constexpr int kQt = kW + kChunk * kHeadDim * 2;       // bf16 [i][c]   64 x 128
  static constexpr int kKb = kQt + kChunk * kHeadDim * 2;      // fp16 [j][c]   64 x 128
  static constexpr int kMp = kKb + kChunk * kHeadDim * 2;      // bf16 [i][j]   64 x 64
  static constexpr int kUvT = kMp + kChunk * kChunk * 2;       // fp32 [v][i]  128 x 64
  static constexpr int kGamma = kUvT + kHeadDim * kChunk * 4;  // fp32 [c]     128
  static constexpr int kBytes = kGamma + kHeadDim * 4;
  static_assert(kBytes == 90624 && kBytes % 16 == 0, "record layout changed");
  // W, Qt and Kb' are three consecutive 64 x 128 tiles of 16-bit elements (phase 2 copies
  // them as one 192-row block).
  static_assert(kKb == kQt + kChunk * kHeadDim * 2 && kQt == kW + kChunk * kHeadDim * 2,
                "W, Qt, Kb' adjacent");
};

// The layer's sigmoid, as device_math::sigmoid (IEEE expf), for beta (one per token and
// head); the per-element gates use the short forms below.
__host__ __device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// The hardware's approximate 2^x, log2 x and 1 / x (MUFU.EX2 / LG2 / RCP; ex2 relative error
// < 2^-22, lg2 absolute error < 2^-22.6 on [0.5, 2], rcp < 1 ulp; .ftz: subnormal inputs and
// results are zero). The host side (the CPU emulation) stands in with libm and the same
// flushing. IEEE exp2f is the same EX2 plus a rescaling for subnormal results, expf and
// log1pf are ~10 and ~25 instructions: phase 1 evaluates tens of thousands of these per block,
// so the short forms keep its instruction count down.
__host__ __device__ __forceinline__ float flush_subnormal(float x) {
  return std::fabs(x) < FLT_MIN ? 0.0f * x : x;
}
__host__ __device__ __forceinline__ float ex2_approx(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
#else
  return flush_subnormal(exp2f(flush_subnormal(x)));
#endif
}
__host__ __device__ __forceinline__ float lg2_approx(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
#else
  return log2f(flush_subnormal(x));
#endif
}
__host__ __device__ __forceinline__ float rcp_approx(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
#else
  return flush_subnormal(1.0f / flush_subnormal(x));
#endif
}

// 2^x for the x <= 0 of phase 1 (differences of the non-increasing G, and G itself): results
// in [0, 1]; those below 2^-126 (flushed to zero) weigh nothing in any sum they enter.
__host__ __device__ __forceinline__ float exp2_nonpos(float x) { return ex2_approx(x); }

// softplus and sigmoid of the per-channel decay, in a few hardware instructions, to ~2e-6
// relative (the gates enter only through 2^(G_i - G_j), so an error e in one gate moves a
// factor by e |g| ln 2 relative; the IEEE forms, as in device_math, cost ~35 instructions
// per element).
// softplus(x) = max(x, 0) + log1p(y), y = e^-|x| in (0, 1]: log1p(y) by its series for
// y <= 1/16 (truncated after y^5: relative error < y^5 / 6 < 2e-7), else ln 2 log2(1 + y),
// where log2(1 + y) >= 0.087 keeps lg2's absolute error under 2e-6 relative. For x > 20 the
// result rounds to x, as the layer's threshold gives (docs/layer.md).
__host__ __device__ __forceinline__ float softplus_fast(float x) {
  constexpr float kLn2 = 0.69314718055994531f;
  const float y = ex2_approx(-std::fabs(x) * kLog2e);
  const float series =
      y * fmaf(y, fmaf(y, fmaf(y, fmaf(y, 0.2f, -0.25f), 1.0f / 3.0f), -0.5f), 1.0f);
  const float viaLog = kLn2 * lg2_approx(1.0f + y);
  return fmaxf(x, 0.0f) + (y <= 0.0625f ? series : viaLog);
}
// 1 / (1 + e^-x): e^-x may overflow to inf, whose reciprocal is the correct limit 0.
__host__ __device__ __forceinline__ float sigmoid_fast(float x) {
  return rcp_approx(1.0f + ex2_approx(-x * kLog2e));
}

__host__ __device__ __forceinline__ float bf16_low(uint32_t word) {
  uint32_t bits = word << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
__host__ __device__ __forceinline__ float bf16_high(uint32_t word) {
  uint32_t bits = word & 0xFFFF0000u;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// Reads / writes a T where the memory holds other types (bf16 rows as 8-byte words and so
// on): a plain access on the device, memcpy on the host, where the strict-aliasing rules of
// the CPU emulation's compiler apply.
template <typename T>
__host__ __device__ __forceinline__ T ld_as(const void* p) {
#if defined(__CUDA_ARCH__)
  return *static_cast<const T*>(p);
#else
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
#endif
}
template <typename T>
__host__ __device__ __forceinline__ void st_as(void* p, const T& v) {
#if defined(__CUDA_ARCH__)
  *static_cast<T*>(p) = v;
#else
  memcpy(p, &v, sizeof(T));
#endif
}

// A 16-byte shared-memory load that stays one ld.shared.v4.f32 on the device. For loads at
// compile-time addresses (fully unrolled loops such as phase 1's inversion of the diagonal
// blocks) nvcc splits a plain float4 load into scalar ld.shared.f32, four instructions instead
// of one; volatile keeps it ordered with the barriers around it. It has no "memory" clobber,
// so the compiler may move ordinary accesses across it: use it only for shared data that no
// thread writes between the barrier before the read and the next one (A's diagonal blocks,
// complete at "A is complete" and not written in step 5).
__host__ __device__ __forceinline__ float4 lds_f4(const float* p) {
#if defined(__CUDA_ARCH__)
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
  return v;
#else
  return ld_as<float4>(p);
#endif
}

__host__ __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo, the low half
  uint32_t word;
  memcpy(&word, &v, 4);
  return word;
}
__host__ __device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);  // .x = lo, the low half
  uint32_t word;
  memcpy(&word, &v, 4);
  return word;
}

// Rounds to tf32 (10 explicit mantissa bits, to nearest, ties away from zero: cvt.rna) and
// returns the fp32 bit pattern, low 13 bits zero, as the tf32 mma operand.
__host__ __device__ __forceinline__ uint32_t tf32_bits(float x) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
#else
  uint32_t bits;
  memcpy(&bits, &x, 4);
  return (bits + 0x1000u) & 0xFFFFE000u;
#endif
}
__host__ __device__ __forceinline__ float tf32_round(float x) {
  const uint32_t bits = tf32_bits(x);
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// The rows a sequence owns, clamped to [0, num_tokens) as kda_recurrence_token does, and
// whether it is processed at all (non-empty, naming a real pool line).
struct SeqSpan {
  int64_t bos = 0, eos = 0;
  int32_t line = 0;
  bool active = false;
};

__host__ __device__ __forceinline__ SeqSpan sequence_span(const RecurrenceParams& p, int64_t seq) {
  SeqSpan s;
  s.bos = std::max(static_cast<int64_t>(p.query_start_loc[seq]), int64_t{0});
  s.eos = std::min(static_cast<int64_t>(p.query_start_loc[seq + 1]), p.num_tokens);
  s.line = p.cache_indices[seq];
  s.active = s.bos < s.eos && s.line != p.null_line && s.line >= 0 && s.line < p.cache_lines;
  return s;
}

// The radix searches over query_start_loc (common/varlen_map.h's find_sequence), run by the 32
// lanes of one warp: every lane calls them with the same target, and each level is one load per
// lane and one ballot (WarpLevelCount: lane j loads candidate j's query_start_loc and tests pred
// on it, which must hold for a prefix of the sequences). locate_sequence: the sequence of chunk
// slot `slot` of the varlen map with 2^shift-token chunks. locate_row: the last sequence with
// query_start_loc[seq] <= row. -1 when none.
template <class Ops, class Pred>
struct WarpLevelCount {
  Ops& ops;
  const RecurrenceParams& p;
  int lane;
  Pred pred;
  KDA_OPS_BODY
  __host__ __device__ __forceinline__ int operator()(int64_t base, int64_t stride) const {
    const int64_t cand = base + lane * stride;
    const bool hit = cand < p.num_seqs && pred(cand, ops.load_i32_ro(p.query_start_loc + cand));
    return varlen::popcount32(ops.ballot(hit));
  }
};
template <class Ops, class Pred>
__host__ __device__ __forceinline__ int64_t warp_search(Ops& ops, const RecurrenceParams& p,
                                                        int lane, Pred pred) {
  return varlen::find_sequence(p.search_steps, p.search_stride,
                               WarpLevelCount<Ops, Pred>{ops, p, lane, pred});
}
template <class Ops>
__host__ __device__ __forceinline__ int64_t locate_sequence(Ops& ops, const RecurrenceParams& p,
                                                            int64_t slot, int lane, int shift) {
  return warp_search(ops, p, lane, [=](int64_t cand, int32_t qsl) {
    return varlen::first_slot(qsl, cand, shift) <= slot;
  });
}
template <class Ops>
__host__ __device__ __forceinline__ int64_t locate_row(Ops& ops, const RecurrenceParams& p,
                                                       int64_t row, int lane) {
  return warp_search(ops, p, lane, [=](int64_t, int32_t qsl) { return qsl <= row; });
}

__host__ __device__ __forceinline__ unsigned char* record_of(const RecurrenceParams& p,
                                                             int64_t slot, int head) {
  return p.workspace + (slot * p.num_heads + head) * static_cast<int64_t>(Record::kBytes);
}

}  // namespace kda::chunked
