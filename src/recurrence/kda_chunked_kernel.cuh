// The device code of the chunked KDA recurrence (kda_chunked.h): the block bodies, written
// once for the GPU and for a CPU emulation of one CUDA block
// (tests/recurrence/test_kda_chunked_emu.cu), and at the end of this file their binding to the
// hardware (DeviceOps) and the kernels.
// Include from .cu files only (nvcc); the emulation defines KDA_EMULATED_BODIES_ONLY to take
// the bodies without the binding and the kernels.
//
// Math, per sequence, head and chunk of tokens i = 0..C-1 starting from state S0 (K x V), with
// Gam_i = sum_{j<=i} g_j per key channel (cumulative inside the chunk, so <= 0 and
// non-increasing; kept in log2 units, G = Gam * log2(e)):
//   A_ij  = beta_j sum_c k_ic k_jc 2^(G_ic - G_jc)            (j < i, strictly lower)
//   M'_ij = beta_j sum_c q_ic k_jc 2^(G_ic - G_jc)            (j <= i)
//   (I + A) [W | Uv] = [k_i * 2^G_i | v_i]                    (unit lower-triangular solve)
//   Qt_i = q_i * 2^G_i,  Kb'_j = beta_j k_j * 2^(G_C-1 - G_j),  gamma = 2^G_C-1
//   U = Uv - W S0,  O = Qt S0 + M' U,  S_C = diag(gamma) S0 + Kb'^T U.
// Only exponentials of non-positive numbers appear, so nothing overflows however strong the
// decay. The pairwise factors of A and M' are formed directly only inside the 8 x 8
// diagonal triangles; below them the factor is split at the reference token r = 16I - 1
// (the last token before row block I; inside a 16 x 16 diagonal sub-block b, at its middle
// token r = 16b + 7): 2^(G_i - G_j) = 2^(G_i - G_r) * 2^(G_r - G_j), both factors <= 1
// because j <= r < i, so each such block is a plain bf16 product on tensor cores of rows
// scaled once. tests/recurrence/test_kda_chunked_math.cpp checks this
// algebra against the token-by-token recurrence in float64.
//
// Phase 1 (prep_block): one block of 256 threads per (chunk slot, head), all in parallel.
// Chunk slots follow the varlen map (common/varlen_map.h): sequence s owns
// slots f(s) + n, f(s) = floor(qsl[s] / 64) + s, for its chunks n. It writes one Record per
// (slot, head) to the workspace. Steps: 1 inputs, norms, decay, beta; 2 cumulative decay;
// 3a Qt, Kb', gamma; 3b the diagonal 16 x 16 sub-blocks of A and M'; 4 the blocks below them;
// 5 the solve on tensor cores, in transposed form as phase 2: each warp holds 32 columns of
// X = [W | Uv] as X^T in tf32 m16n8k8 accumulators (W in warps 0..3, Uv in 4..7) and forms
// X_I^T = (R_I^T - sum_{J<I} X_J^T A_IJ^T) (L_II^-1)^T per 16-token block I, the A operands
// being its own accumulators (phase 2's k permutation), the B operands 8-byte pairs of A and
// of the four diagonal blocks' inverses L_II^-1 - I (fp32, on CUDA cores, once per block).
// Phase 2 (state_block, at the end of this file): one block of 8 warps per (sequence, head,
// value slice of 64 columns), walking the sequence's chunks in order with the chunk records
// double-buffered in shared memory (cp.async). Per 16 value rows a state warp holds the
// transposed state S^T (16 value rows x 128 key channels, fp32) in mma accumulator registers
// and computes U and the state update; an output warp computes O and writes o from the state
// warp's bf16 S0^T and U^T fragments, published through shared memory. In transposed form
// every A operand (S^T and U^T) comes from registers (an m16n8 accumulator pair is an m16k16 A
// fragment) and every B operand is a record tile in shared memory. U and O are bf16 products
// (B tiles read with ldmatrix); the state update, whose operands set the precision of the
// carried state, is an fp16 product with each row of U^T scaled by a power of two into fp16's
// range (update_state_f16; Kb' is stored in fp16, B tiles read with ldmatrix .trans), which
// keeps the final state's error an order of magnitude below that of bf16 operands.
// At a chunk end where the sequence has a state checkpoint (common/state_checkpoints.h) the
// state warps also store the carried state to the checkpoint's line.
// Segments (sequence parallelism, docs/design.md): a block may walk one segment of a
// sequence's chunks in one of three roles (block_walk, WalkRole), and scan_block joins the
// segments; with segments off, pass 1 alone is the walk described above.
// Pool lines hold fp32 or bf16 elements (RecurrenceParams::state_dtype_is_bf16, a run-time flag):
// load_state widens, store_state rounds to nearest even (common/state_elements.h); the carried
// state stays fp32 in registers. A checkpoint line is bitwise the final line of a run cut at its
// offset in either type: the same registers, rounded the same way. A run continued from a bf16
// line starts from the rounded state and so is not bitwise the uninterrupted run (from an fp32
// line, which holds the state exactly, it is).
//
// The bodies run per thread and reach other threads only through `Ops` (barriers, named
// barriers (sync and arrive), shuffles, the radix search, ldmatrix (.trans), mma in bf16,
// fp16 and tf32, cp.async); DeviceOps (end of this file) maps them to the hardware
// instructions. Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16" and "for
// mma.m16n8k8"), with g = lane / 4 and t = lane % 4:
//   A (16 x 16, row-major), 4 regs of 2 bf16: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..),
//     a3 (g+8, 2t+8..)
//   B (16 x 8, k x n), 2 regs: b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C/D (16 x 8, fp32), 4 regs: c0, c1 (g, 2t, 2t+1), c2, c3 (g+8, 2t, 2t+1)
// The lower-index element of a pair sits in the low 16 bits. ldmatrix x4: lanes 8m..8m+7
// give the row addresses of 8 x 8 matrix m; r[m] receives (row g, columns 2t, 2t+1) of it,
// with .trans (rows 2t, 2t+1; column g). fp16 fragments are laid out as the bf16 ones.
// mma.sync m16n8k8 tf32 (one fp32 word per element):
//   A (16 x 8): a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)
//   B (8 x 8, k x n): b0 (k t, n g), b1 (k t+4, n g);  C/D as above.
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

__host__ __device__ __forceinline__ unsigned char* record_of(const RecurrenceParams& p,
                                                             int64_t slot, int head) {
  return p.workspace + (slot * p.num_heads + head) * static_cast<int64_t>(Record::kBytes);
}

// ---------------------------------------------------------------------------------------------
// Phase 1.

struct PrepTraits {
  static constexpr int kThreads = 256;
  static constexpr int kPitchBf16 = kHeadDim + 8;  // 272-byte rows: ldmatrix rows hit distinct banks
  static constexpr int kPitchG = kHeadDim + 4;     // 16-byte aligned fp32 rows
  static constexpr int kChunks8 = kHeadDim / 8;    // 8-channel chunks of a row (16 bf16 / 32 fp32 bytes)
  static constexpr int kHalf = kSub / 2;           // the diagonal sub-blocks split at their middle token
  // tmp holds either the quadrant operands of step 3b (per sub-block KE | QE | KF, 8 rows each)
  // or step 4's KE | QE | KF of one row block.
  static constexpr int kQuadRows = 3 * kHalf;
  static constexpr int kTmpRows = std::max(2 * kSub + kChunk - kSub, kSubBlocks * kQuadRows);
  // Direct pairs (i >= j) of the 8 x 8 diagonal triangles, 8 lanes (16 channels each) per pair.
  static constexpr int kTriPairs = kHalf * (kHalf + 1) / 2;            // 36
  static_assert(kHalf == 8, "triangle_row knows the 8 x 8 triangle");
  static constexpr int kDiagItems = 2 * kSubBlocks * kTriPairs * 8;    // 2304
  // Step 5 (the solve on tensor cores). A's rows are padded to 72 floats: the 8-byte B pairs
  // of a half-warp (rows g = 0..3, columns 2t) then start 8 banks apart, conflict-free; the
  // diagonal blocks' N = L^-1 - I (16 x 16 fp32 each) use 24-float rows for the same reason.
  static constexpr int kPitchA = kChunk + 8;
  static constexpr int kPitchN = kSub + 8;
  static constexpr int kSolveCols = 32;                 // columns of X (rows of X^T) per warp
  static constexpr int kInvThreads = kSubBlocks * kSub; // one column of one diagonal block each
  static constexpr int kVPieces = kChunk * kHeadDim * 2 / 8;  // 8-byte pieces of the v tile
  static_assert(kThreads == 4 * kChunk, "the load step gives each token row 4 threads");
  static_assert(kThreads / 32 * kSolveCols == 2 * kHeadDim,
                "the solve gives each warp 32 of the 2 x 128 columns, W first, then Uv");
  static_assert((kPitchA % 32 == 8 || kPitchA % 32 == 24) &&
                    (kPitchN % 32 == 8 || kPitchN % 32 == 24),
                "the solve's 8-byte B pairs are conflict-free with these row pitches");
  static_assert(2 * kInvThreads == kThreads / 2,
                "step 5a: the Uv warps round A (2 warps) and invert its diagonal blocks (2 warps)");
  static_assert(kVPieces % kThreads == 0 && kHeadDim * 2 / 8 == 32,
                "the v tile: one 256-byte row per warp instruction, whole passes");
  static_assert(kThreads / 32 >= kSubBlocks - 1, "one warp per off-diagonal block of a row block");
  static_assert(kThreads / 32 >= kSubBlocks, "one warp per diagonal quadrant");
  static_assert(kDiagItems % kThreads == 0, "diagonal items must give every thread the same count");
  static_assert(kSub * kChunks8 == kThreads, "step 4's KE / QE rows: one 8-channel chunk per thread");
};

// Column of channel c in a G row. Groups of 4 channels are kept together; the two groups of
// an 8-channel chunk swap places when bit 2 of the chunk index is set (c ^ 4 when bit 5 of c
// is set). Then 8 lanes reading the first (or the second) group of 8 consecutive chunks with
// 16-byte loads hit 32 distinct banks, and so do 32 lanes reading 32 consecutive channels one
// word each; unswizzled, the chunk reads would be 2-way bank conflicts (32-byte lane stride).
__host__ __device__ __forceinline__ constexpr int g_col(int c) { return c ^ ((c >> 3) & 4); }

struct alignas(16) PrepSmem {
  __nv_bfloat16 q[kChunk][PrepTraits::kPitchBf16];  // raw (un-normalised) bf16 inputs
  __nv_bfloat16 k[kChunk][PrepTraits::kPitchBf16];
  float G[kChunk][PrepTraits::kPitchG];             // log2 decay (cumulative after step 2), at g_col(c)
  // beta_j-weighted, strictly lower; step 5a rounds the blocks below the diagonal to tf32.
  float A[kChunk][PrepTraits::kPitchA];
  // Scaled bf16 mma operands (steps 3b, 4); in step 5 rows [0, 64) stage W and the rows from
  // 64 on hold the diagonal blocks' N (kSubBlocks x 16 x kPitchN floats).
  __nv_bfloat16 tmp[PrepTraits::kTmpRows][PrepTraits::kPitchBf16];
  float rq[kChunk];  // q scale: 128^-0.5 / ||q||
  float rk[kChunk];  // 1 / ||k||
  float beta[kChunk];
};
static_assert(sizeof(PrepSmem) <= 113 * 1024, "two prep blocks must fit on an SM");
static_assert(offsetof(PrepSmem, A) % 16 == 0 && PrepTraits::kPitchA % 4 == 0,
              "the inversion reads A's rows with 16-byte loads");
static_assert(offsetof(PrepSmem, tmp) % 16 == 0 &&
                  (kChunk * PrepTraits::kPitchBf16 * 2 +
                   kSubBlocks * kSub * PrepTraits::kPitchN * 4) <= sizeof(PrepSmem::tmp),
              "step 5's W stage and N fit in tmp");

// Channels [8 ch, 8 ch + 8) of a bf16 row (one 16-byte load) and of a G row (two), as floats.
__host__ __device__ __forceinline__ void load_bf16x8(const __nv_bfloat16* row, int ch,
                                                     float (&v)[8]) {
  const uint4 w = ld_as<uint4>(row + 8 * ch);
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
KDA_UNROLL
  for (int e = 0; e < 4; ++e) {
    v[2 * e] = bf16_low(words[e]);
    v[2 * e + 1] = bf16_high(words[e]);
  }
}
__host__ __device__ __forceinline__ void load_g8(const float* grow, int ch, float (&v)[8]) {
  const float4 lo = ld_as<float4>(grow + g_col(8 * ch));
  const float4 hi = ld_as<float4>(grow + g_col(8 * ch + 4));
  v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
  v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}
__host__ __device__ __forceinline__ uint4 pack_bf16x8(const float (&v)[8]) {
  return make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]), pack_bf16(v[4], v[5]),
                    pack_bf16(v[6], v[7]));
}
__host__ __device__ __forceinline__ uint4 pack_f16x8(const float (&v)[8]) {
  return make_uint4(pack_f16(v[0], v[1]), pack_f16(v[2], v[3]), pack_f16(v[4], v[5]),
                    pack_f16(v[6], v[7]));
}

// The row il of entry l (< 36) of the 8 x 8 lower triangle stored row by row (l = il (il + 1)
// / 2 + jl, jl <= il): the number of the triangular numbers 1, 3, ..., 28 that are <= l.
// Branch-free, a few integer instructions (a search loop here cost up to 8 iterations per item).
__host__ __device__ __forceinline__ int triangle_row(int l) {
  constexpr uint64_t kTriangular = (1ull << 1) | (1ull << 3) | (1ull << 6) | (1ull << 10) |
                                   (1ull << 15) | (1ull << 21) | (1ull << 28);
  const uint64_t upto = kTriangular & ((2ull << l) - 1);
#if defined(__CUDA_ARCH__)
  return __popcll(upto);
#else
  return __builtin_popcountll(upto);
#endif
}

// The scaled bf16 operand rows of a split at reference token r, channels [8 ch, 8 ch + 8):
// for a row i > r, KE_i = k_i / ||k_i|| 2^(G_i - G_r) to ke and QE_i (q_i's scale) to qe; for
// a row j <= r, KF_j = k_j / ||k_j|| 2^(G_r - G_j) to ke (qe unused). Both exponents are <= 0.
__host__ __device__ __forceinline__ void scaled_rows(const PrepSmem& sm, int row, int r, int ch,
                                                     bool below, __nv_bfloat16* ke,
                                                     __nv_bfloat16* qe) {
  float gi[8], gr[8], kv[8];
  load_g8(sm.G[row], ch, gi);
  load_g8(sm.G[r], ch, gr);
  load_bf16x8(sm.k[row], ch, kv);
  const float kr = sm.rk[row];
  float f[8];
KDA_UNROLL
  for (int e = 0; e < 8; ++e) {
    f[e] = exp2_nonpos(below ? gi[e] - gr[e] : gr[e] - gi[e]);
    kv[e] = kv[e] * kr * f[e];  // (k / ||k||) 2^(..), as before the vectorisation
  }
  st_as<uint4>(ke + 8 * ch, pack_bf16x8(kv));
  if (below) {
    float qv[8];
    load_bf16x8(sm.q[row], ch, qv);
    const float qr = sm.rq[row];
KDA_UNROLL
    for (int e = 0; e < 8; ++e) qv[e] = qv[e] * qr * f[e];
    st_as<uint4>(qe + 8 * ch, pack_bf16x8(qv));
  }
}

// The off-diagonal block (row block I, column block J < I) of A and M' on tensor cores, by one
// warp: KE (rows of I scaled by 2^(G_i - G_r)), QE likewise and KF (rows j < 16I scaled by
// 2^(G_r - G_j)) are in sm.tmp.
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ void offdiag_block(Ops& ops, PrepSmem& sm,
                                                       __nv_bfloat16* mp, int I, int J,
                                                       int lane) {
  constexpr int P = PrepTraits::kPitchBf16;
  const int g = lane >> 2, t = lane & 3, m = lane >> 3, r8 = lane & 7;
  // A operand (KE / QE, rows i, columns c): matrix m covers rows 8 (m & 1).., columns
  // 8 (m >> 1).., so r[0..3] are a0..a3.
  const uint32_t a_base = ops.smem_addr(&sm.tmp[r8 + 8 * (m & 1)][8 * (m >> 1)]);
  // B operand (KF of column block J stored [n = j][k = c]): matrix m covers rows 8 (m >> 1)..,
  // columns 8 (m & 1).., so r[0], r[1] are b0, b1 of n-tile 0 and r[2], r[3] of n-tile 1.
  const uint32_t b_base =
      ops.smem_addr(&sm.tmp[2 * kSub + kSub * J + r8 + 8 * (m >> 1)][8 * (m & 1)]);
  constexpr uint32_t kQeOffset = kSub * P * 2;  // QE starts 16 rows below KE
  float acc_a[2][4] = {}, acc_m[2][4] = {};
KDA_UNROLL
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t ak[4], aq[4], b[4];
    ops.ldsm_x4(ak, a_base + kk * 32);
    ops.ldsm_x4(aq, a_base + kQeOffset + kk * 32);
    ops.ldsm_x4(b, b_base + kk * 32);
    ops.mma(acc_a[0], ak, b[0], b[1]);
    ops.mma(acc_a[1], ak, b[2], b[3]);
    ops.mma(acc_m[0], aq, b[0], b[1]);
    ops.mma(acc_m[1], aq, b[2], b[3]);
  }
KDA_UNROLL
  for (int nt = 0; nt < 2; ++nt) {
KDA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int i = kSub * I + g + 8 * h;
      const int j = kSub * J + 8 * nt + 2 * t;
      const float b0 = sm.beta[j], b1 = sm.beta[j + 1];
      sm.A[i][j] = acc_a[nt][2 * h] * b0;
      sm.A[i][j + 1] = acc_a[nt][2 * h + 1] * b1;
      st_as<uint32_t>(mp + i * kChunk + j,
                      pack_bf16(acc_m[nt][2 * h] * b0, acc_m[nt][2 * h + 1] * b1));
    }
  }
}

// The lower-left 8 x 8 quadrant of diagonal sub-block b (rows i = 16b + 8.., columns
// j = 16b..16b + 7, reference r = 16b + 7) of A and M' on tensor cores, by one warp: one m16n8
// accumulator of [KE; QE] (16 rows) against KF (8 rows), all in sm.tmp rows 24b...
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ void diag_quadrant(Ops& ops, PrepSmem& sm,
                                                       __nv_bfloat16* mp, int b, int lane) {
  constexpr int R = PrepTraits::kQuadRows, H = PrepTraits::kHalf;
  const int g = lane >> 2, t = lane & 3, m = lane >> 3, r8 = lane & 7;
  // A operand: rows 0..7 KE, 8..15 QE; matrix m covers rows 8 (m & 1).., columns 8 (m >> 1)..
  const uint32_t a_base = ops.smem_addr(&sm.tmp[R * b + r8 + 8 * (m & 1)][8 * (m >> 1)]);
  // B operand (KF stored [n = j][k = c]): matrix m covers columns 8 m.., so r[0], r[1] are b0,
  // b1 of k-step 2 kp and r[2], r[3] those of k-step 2 kp + 1.
  const uint32_t b_base = ops.smem_addr(&sm.tmp[R * b + 2 * H + r8][8 * m]);
  float acc[4] = {};
KDA_UNROLL
  for (int kp = 0; kp < kHeadDim / 32; ++kp) {
    uint32_t a0[4], a1[4], bf[4];
    ops.ldsm_x4(bf, b_base + kp * 64);
    ops.ldsm_x4(a0, a_base + kp * 64);
    ops.ldsm_x4(a1, a_base + kp * 64 + 32);
    ops.mma(acc, a0, bf[0], bf[1]);
    ops.mma(acc, a1, bf[2], bf[3]);
  }
  const int i = kSub * b + H + g, j = kSub * b + 2 * t;
  const float b0 = sm.beta[j], b1 = sm.beta[j + 1];
  sm.A[i][j] = acc[0] * b0;
  sm.A[i][j + 1] = acc[1] * b1;
  st_as<uint32_t>(mp + i * kChunk + j, pack_bf16(acc[2] * b0, acc[3] * b1));
}

// Step 5 of phase 1: the solve (I + A) X = R on tensor cores, in transposed form. With 16-token
// blocks I = 0..3, L_II = I + A_II (unit lower triangular) and N_I = L_II^-1 - I,
//   X_I^T = Y_I^T (L_II^-1)^T = Y_I^T + Y_I^T N_I^T,  Y_I^T = R_I^T - sum_{J<I} X_J^T A_IJ^T.
// A warp owning 32 columns of X (32 rows of X^T) keeps its X^T tile in m16n8 accumulators:
// x[mt][nt] holds rows c0 + 16 mt + (g, g + 8) and tokens 8 nt + (2t, 2t + 1) (c0, c1 row g;
// c2, c3 row g + 8). Every product is a tf32 m16n8k8 whose A operand is such an accumulator
// and whose B operand is a matrix M[i][j] of shared memory read as B(k = j, n = i).
using SolveTile = float[2][kChunk / 8][4];

// The m16k8 tf32 A fragment of sign * c for an accumulator tile c, the k index permuted as in
// state_block's state update: k = t stands for token 2t and k = t + 4 for token 2t + 1 of the
// n-tile, so a0 (g, k t) = c[0], a1 (g + 8, k t) = c[2], a2 (g, k t + 4) = c[1], a3 = c[3].
__host__ __device__ __forceinline__ void solve_a_frag(const float (&c)[4], float sign,
                                                      uint32_t (&a)[4]) {
  a[0] = tf32_bits(sign * c[0]);
  a[1] = tf32_bits(sign * c[2]);
  a[2] = tf32_bits(sign * c[1]);
  a[3] = tf32_bits(sign * c[3]);
}

// The B fragment (b0 (k t, n g), b1 (k t + 4, n g)) of an 8 x 8 block of M read as
// B(k = j, n = i): with the k permutation above, b0 = M[i0 + g][j0 + 2t] and b1 the next float,
// one 8-byte load from `pair` = &M[i0 + g][j0 + 2t]. M holds tf32 values already (A's blocks
// below the diagonal and N are rounded in step 5a), so the bits are the operands as they are.
__host__ __device__ __forceinline__ uint2 solve_b_frag(const float* pair) {
  return ld_as<uint2>(pair);
}

// A 64-token x 32-column bf16 tile of a [token][column] shared array (row pitch
// PrepTraits::kPitchBf16), columns [c0, c0 + 32), into the X^T accumulator layout: ldmatrix
// .trans matrix m of (mt, np) covers tokens 16 np + 8 (m >> 1).. and columns
// c0 + 16 mt + 8 (m & 1)..; r[m] = (token 2t, column g), (token 2t + 1, column g) of it are
// x[mt][2 np + (m >> 1)][2 (m & 1)] and [.. + 1].
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ void load_tile_t(Ops& ops,
                                                     const __nv_bfloat16 (*tile)[PrepTraits::kPitchBf16],
                                                     int c0, SolveTile& x, int lane) {
  constexpr uint32_t kRowBytes = PrepTraits::kPitchBf16 * 2;
  const int m = lane >> 3, r8 = lane & 7;
  const uint32_t base = ops.smem_addr(&tile[8 * (m >> 1) + r8][c0 + 8 * (m & 1)]);
KDA_UNROLL
  for (int mt = 0; mt < 2; ++mt) {
KDA_UNROLL
    for (int np = 0; np < kChunk / 16; ++np) {
      uint32_t r[4];
      ops.ldsm_x4_trans(r, base + mt * 32 + np * 16 * kRowBytes);
KDA_UNROLL
      for (int q = 0; q < 4; ++q) {
        float* c = x[mt][2 * np + (q >> 1)] + 2 * (q & 1);
        c[0] = bf16_low(r[q]);
        c[1] = bf16_high(r[q]);
      }
    }
  }
}

// The solve of one warp's X^T tile, from R^T in x to X^T in x, right-looking: once block J of
// X^T is final, its A fragments are formed once and its products go to every block below, so
// each accumulator still receives its terms in ascending token order, and the updates of
// different blocks are independent mma chains. A (strictly lower) is sm.A, N_I of the four
// diagonal blocks is nmat (rows 16 I + i, pitch PrepTraits::kPitchN), both tf32-rounded.
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ void solve_tile(Ops& ops, const PrepSmem& sm,
                                                    const float* nmat, SolveTile& x, int lane) {
  constexpr int PA = PrepTraits::kPitchA, PN = PrepTraits::kPitchN;
  const int g = lane >> 2, t = lane & 3;
  const float* a_lane = &sm.A[g][2 * t];
  const float* n_lane = nmat + g * PN + 2 * t;
KDA_UNROLL
  for (int J = 0; J < kSubBlocks; ++J) {
    // X_J^T = Y_J^T + Y_J^T N_J^T: the identity part stays exact fp32. B(k = j, n = i) =
    // N_J[i][j] is zero unless j < i, so the k-step of tokens 8..15 against the n-tile of
    // tokens 0..7 is skipped.
    float z[2][2][4];
KDA_UNROLL
    for (int mt = 0; mt < 2; ++mt)
KDA_UNROLL
      for (int ni = 0; ni < 2; ++ni)
KDA_UNROLL
        for (int e = 0; e < 4; ++e) z[mt][ni][e] = x[mt][2 * J + ni][e];
KDA_UNROLL
    for (int s = 0; s < 2; ++s) {
      uint32_t a[2][4];
KDA_UNROLL
      for (int mt = 0; mt < 2; ++mt) solve_a_frag(x[mt][2 * J + s], 1.0f, a[mt]);
KDA_UNROLL
      for (int ni = s; ni < 2; ++ni) {
        const uint2 b = solve_b_frag(n_lane + (kSub * J + 8 * ni) * PN + 8 * s);
KDA_UNROLL
        for (int mt = 0; mt < 2; ++mt) ops.mma_tf32(z[mt][ni], a[mt], b.x, b.y);
      }
    }
KDA_UNROLL
    for (int mt = 0; mt < 2; ++mt)
KDA_UNROLL
      for (int ni = 0; ni < 2; ++ni)
KDA_UNROLL
        for (int e = 0; e < 4; ++e) x[mt][2 * J + ni][e] = z[mt][ni][e];
    // Y_I^T -= X_J^T A_IJ^T for I > J: k-step kt is token n-tile kt of X_J^T (the -X_J
    // fragment is exact up to the tf32 rounding), n-tile 2I + ni takes
    // B(k = j, n = i) = A[16 I + 8 ni + i'][8 kt + j'].
KDA_UNROLL
    for (int s = 0; s < 2; ++s) {
      const int kt = 2 * J + s;
      if (J + 1 >= kSubBlocks) break;
      uint32_t a[2][4];
KDA_UNROLL
      for (int mt = 0; mt < 2; ++mt) solve_a_frag(x[mt][kt], -1.0f, a[mt]);
KDA_UNROLL
      for (int I = J + 1; I < kSubBlocks; ++I) {
KDA_UNROLL
        for (int ni = 0; ni < 2; ++ni) {
          const uint2 b = solve_b_frag(a_lane + (kSub * I + 8 * ni) * PA + 8 * kt);
KDA_UNROLL
          for (int mt = 0; mt < 2; ++mt) ops.mma_tf32(x[mt][2 * I + ni], a[mt], b.x, b.y);
        }
      }
    }
  }
}

// One (chunk slot, head) of phase 1, as thread `tid` of 256. Every exit is uniform over the
// block (it depends on the slot and on metadata all threads read alike), so all threads
// reach every barrier.
KDA_OPS_BODY
template <bool kLowerBound, class Ops>
__host__ __device__ __forceinline__ void prep_block(Ops& ops, const RecurrenceParams& p,
                                                    int64_t slot, int head, int tid) {
  using T = PrepTraits;
  const int lane = tid & 31, warp = tid >> 5;
  const int64_t seq = ops.locate_sequence(p, slot, lane, kChunkShift);
  if (seq < 0) return;
  const SeqSpan span = sequence_span(p, seq);
  if (!span.active) return;
  const int64_t chunk = slot - varlen::first_slot(p.query_start_loc[seq], seq, kChunkShift);
  const int64_t begin = span.bos + chunk * kChunk;
  if (begin >= span.eos) return;
  const int len = static_cast<int>(std::min(static_cast<int64_t>(kChunk), span.eos - begin));

  PrepSmem& sm = *reinterpret_cast<PrepSmem*>(ops.smem());
  unsigned char* rec = record_of(p, slot, head);
  __nv_bfloat16* rec_w = reinterpret_cast<__nv_bfloat16*>(rec + Record::kW);
  __nv_bfloat16* rec_qt = reinterpret_cast<__nv_bfloat16*>(rec + Record::kQt);
  __half* rec_kb = reinterpret_cast<__half*>(rec + Record::kKb);
  __nv_bfloat16* rec_mp = reinterpret_cast<__nv_bfloat16*>(rec + Record::kMp);
  float* rec_uvt = reinterpret_cast<float*>(rec + Record::kUvT);
  float* rec_gamma = reinterpret_cast<float*>(rec + Record::kGamma);

  // Step 1: raw q, k and the log2 decay of token row `row`, channels 4 part + 16 jj + (0..3)
  // (the 4 threads of a row read 32 contiguous bytes per load); rows past the chunk's end are
  // zeros (k = q = v = 0, g = 0, beta = 0), which makes every record entry of theirs zero and
  // leaves G flat, so gamma is the decay up to the last token.
  {
    const int row = tid >> 2, part = tid & 3, c0 = 4 * part;
    float ssq = 0.0f, ssk = 0.0f;
    if (row < len) {
      const int64_t tok = begin + row;
      const int64_t col = static_cast<int64_t>(head) * kHeadDim + c0;
      const __nv_bfloat16* qsrc = p.q + tok * p.qkv_stride + col;
      const __nv_bfloat16* ksrc = p.k + tok * p.qkv_stride + col;
      const __nv_bfloat16* gsrc = p.g1 + tok * p.g1_stride + col;
      const float a_exp = expf(p.a_log[head]);
KDA_UNROLL
      for (int j = 0; j < kHeadDim; j += 16) {
        // 8-byte loads: supported() guarantees 8-byte aligned bases and strides of 4 elements.
        const uint2 qw = ld_as<uint2>(qsrc + j);
        const uint2 kw = ld_as<uint2>(ksrc + j);
        const uint2 gw = ld_as<uint2>(gsrc + j);
        st_as<uint2>(&sm.q[row][c0 + j], qw);
        st_as<uint2>(&sm.k[row][c0 + j], kw);
        const float qv[4] = {bf16_low(qw.x), bf16_high(qw.x), bf16_low(qw.y), bf16_high(qw.y)};
        const float kv[4] = {bf16_low(kw.x), bf16_high(kw.x), bf16_low(kw.y), bf16_high(kw.y)};
        const float gv[4] = {bf16_low(gw.x), bf16_high(gw.x), bf16_low(gw.y), bf16_high(gw.y)};
        float gl[4];
KDA_UNROLL
        for (int e = 0; e < 4; ++e) {
          ssq = fmaf(qv[e], qv[e], ssq);
          ssk = fmaf(kv[e], kv[e], ssk);
          const float x = gv[e] + p.dt_bias[col + j + e];
          const float gate = kLowerBound ? p.lower_bound * sigmoid_fast(a_exp * x)
                                         : -a_exp * softplus_fast(x);
          gl[e] = fmaxf(gate, kMinLogDecay) * kLog2e;
        }
        st_as<float4>(&sm.G[row][g_col(c0 + j)], make_float4(gl[0], gl[1], gl[2], gl[3]));
      }
    } else {
KDA_UNROLL
      for (int j = 0; j < kHeadDim; j += 16) {
        st_as<uint2>(&sm.q[row][c0 + j], make_uint2(0u, 0u));
        st_as<uint2>(&sm.k[row][c0 + j], make_uint2(0u, 0u));
        st_as<float4>(&sm.G[row][g_col(c0 + j)], make_float4(0.f, 0.f, 0.f, 0.f));
      }
    }
    // The 4 threads of a row are adjacent lanes of one warp.
    ssq += ops.shfl_xor(ssq, 1);
    ssq += ops.shfl_xor(ssq, 2);
    ssk += ops.shfl_xor(ssk, 1);
    ssk += ops.shfl_xor(ssk, 2);
    if (part == 0) {
      const bool real = row < len;
      sm.rq[row] = real ? kQScale / sqrtf(ssq + 1e-6f) : 0.0f;
      sm.rk[row] = real ? 1.0f / sqrtf(ssk + 1e-6f) : 0.0f;
      sm.beta[row] =
          real ? sigmoid_f(__bfloat162float(p.b[(begin + row) * p.b_stride + head])) : 0.0f;
    }
    // M' is stored whole with zeros above the diagonal, which phase 2 relies on inside the
    // diagonal tiles. (A needs no fill: step 5 reads only its strictly lower entries.)
    for (int e = tid; e < kChunk * kChunk / 8; e += T::kThreads)
      st_as<uint4>(rec_mp + 8 * e, make_uint4(0u, 0u, 0u, 0u));
  }
  ops.sync();

  // Step 2: cumulative sums along the chunk, one channel per thread. fp32 addition of
  // non-positive terms never increases, so G stays non-increasing in i as rounded and every
  // difference G_i - G_j (j <= i) below is <= 0.
  if (tid < kHeadDim) {
    float run = 0.0f;
    const int gc = g_col(tid);
KDA_UNROLL
    for (int i = 0; i < kChunk; ++i) {
      run += sm.G[i][gc];
      sm.G[i][gc] = run;
    }
  }
  // Also orders step 1's zero fill of M' before the entries written below.
  ops.sync();

  // Step 3a: Qt (bf16) and Kb' (fp16: |Kb'| <= 1, where fp16 carries 3 more bits than bf16;
  // entries under 2^-14 lose bits and weigh nothing beside the others), and gamma. Item =
  // (token pair 2 tp, 2 tp + 1; 8-channel chunk), one 16-byte store per row and tile.
  for (int e = tid; e < kChunk / 2 * T::kChunks8; e += T::kThreads) {
    const int tp = e / T::kChunks8, ch = e % T::kChunks8;
    float gl[8];
    load_g8(sm.G[kChunk - 1], ch, gl);
KDA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * tp + h;
      float qv[8], kv[8], gv[8];
      load_bf16x8(sm.q[i], ch, qv);
      load_bf16x8(sm.k[i], ch, kv);
      load_g8(sm.G[i], ch, gv);
      const float qs = sm.rq[i], ks = sm.beta[i] * sm.rk[i];
KDA_UNROLL
      for (int c = 0; c < 8; ++c) {
        qv[c] = qv[c] * qs * exp2_nonpos(gv[c]);
        kv[c] = kv[c] * ks * exp2_nonpos(gl[c] - gv[c]);
      }
      st_as<uint4>(rec_qt + i * kHeadDim + 8 * ch, pack_bf16x8(qv));
      st_as<uint4>(rec_kb + i * kHeadDim + 8 * ch, pack_f16x8(kv));
    }
  }
  if (tid < kHeadDim) rec_gamma[tid] = exp2_nonpos(sm.G[kChunk - 1][g_col(tid)]);

  // Step 3b: the 16 x 16 diagonal sub-blocks of A and M', each split at its middle token as
  // well (reference r = 16b + 7): the lower-left 8 x 8 quadrant is one m16n8 product of
  // [KE; QE] against KF on tensor cores (as step 4 below), the two 8 x 8 triangles (i >= j) have
  // their pairwise factors formed directly, in fp32.
  // Quadrant operands: item = (sub-block b, row slot s, chunk); s < 8: KE / QE of row
  // 16b + 8 + s, s >= 8: KF of row 16b + s - 8 (a warp's 32 items share one kind).
  for (int e = tid; e < kSubBlocks * 2 * T::kHalf * T::kChunks8; e += T::kThreads) {
    const int ch = e % T::kChunks8, s = (e / T::kChunks8) % (2 * T::kHalf);
    const int b = e / (2 * T::kHalf * T::kChunks8);
    const int r = kSub * b + T::kHalf - 1;
    const bool below = s < T::kHalf;
    __nv_bfloat16(*quad)[T::kPitchBf16] = sm.tmp + T::kQuadRows * b;
    if (below)
      scaled_rows(sm, r + 1 + s, r, ch, true, quad[s], quad[T::kHalf + s]);
    else
      scaled_rows(sm, r + 1 - 2 * T::kHalf + s, r, ch, false, quad[T::kHalf + s], nullptr);
  }
  ops.sync();
  if (warp < kSubBlocks) diag_quadrant(ops, sm, rec_mp, warp, lane);
  // Triangles: item = (pair, channel group cg), 8 adjacent lanes per pair; lane cg takes the
  // chunks cg and cg + 8 (so the 8 lanes of a pair read 128 contiguous bytes per load), and
  // the 8 partial sums are added with three shuffles. 2304 items: 9 per thread, whole warps.
KDA_UNROLL_1
  for (int item = tid; item < T::kDiagItems; item += T::kThreads) {
    const int pair = item >> 3, cg = item & 7;
    const int tri = pair / T::kTriPairs, l = pair % T::kTriPairs;
    const int il = triangle_row(l);
    const int jl = l - il * (il + 1) / 2;
    const int i = T::kHalf * tri + il, j = T::kHalf * tri + jl;
    float a = 0.0f, m = 0.0f;
KDA_UNROLL
    for (int u = 0; u < 2; ++u) {
      const int ch = cg + 8 * u;
      float ki[8], qi[8], kj[8], gi[8], gj[8];
      load_bf16x8(sm.k[i], ch, ki);
      load_bf16x8(sm.q[i], ch, qi);
      load_bf16x8(sm.k[j], ch, kj);
      load_g8(sm.G[i], ch, gi);
      load_g8(sm.G[j], ch, gj);
KDA_UNROLL
      for (int c = 0; c < 8; ++c) {
        const float f = kj[c] * exp2_nonpos(gi[c] - gj[c]);
        a = fmaf(ki[c], f, a);
        m = fmaf(qi[c], f, m);
      }
    }
    a += ops.shfl_xor(a, 1);
    m += ops.shfl_xor(m, 1);
    a += ops.shfl_xor(a, 2);
    m += ops.shfl_xor(m, 2);
    a += ops.shfl_xor(a, 4);
    m += ops.shfl_xor(m, 4);
    if (cg == 0) {
      const float bj = sm.beta[j] * sm.rk[j];
      if (j < i) sm.A[i][j] = a * sm.rk[i] * bj;
      rec_mp[i * kChunk + j] = __float2bfloat16_rn(m * sm.rq[i] * bj);
    }
  }

  // Step 4: the off-diagonal blocks, one row block I at a time (reference r = 16I - 1):
  // tmp rows [0, 16) = KE, [16, 32) = QE, [32, 32 + 16I) = KF; one 8-channel chunk per item.
  for (int I = 1; I < kSubBlocks; ++I) {
    ops.sync();  // the previous products (and step 3b's quadrants) are done reading tmp
    const int r = kSub * I - 1;
    {
      const int il = tid / T::kChunks8, ch = tid % T::kChunks8;
      scaled_rows(sm, kSub * I + il, r, ch, true, sm.tmp[il], sm.tmp[kSub + il]);
    }
    for (int e = tid; e < kSub * I * T::kChunks8; e += T::kThreads) {
      const int j = e / T::kChunks8, ch = e % T::kChunks8;
      scaled_rows(sm, j, r, ch, false, sm.tmp[2 * kSub + j], nullptr);
    }
    ops.sync();
    if (warp < I) offdiag_block(ops, sm, rec_mp, I, warp, lane);
  }
  ops.sync();  // A is complete

  // Step 5: the solve (I + A) [W | Uv] = [k * 2^G | v] on tensor cores (solve_tile). Warps
  // 0..3 take 32 W columns each (channels 32 w..), warps 4..7 32 Uv columns each (values
  // 32 (w - 4)..). q and tmp are free from here on: v is staged in sm.q (rows past the chunk's
  // end zero), N of the diagonal blocks and then W in tmp.
  // 5a: the v tile's 8-byte pieces (one 256-byte row per warp instruction) are loaded first,
  // their latency hidden behind the W warps' right-hand sides and the inversion.
  constexpr int kVPasses = T::kVPieces / T::kThreads;
  float* nmat = reinterpret_cast<float*>(&sm.tmp[kChunk][0]);
  uint2 vp[kVPasses];
  {
    const __nv_bfloat16* vsrc = p.v + begin * p.qkv_stride + static_cast<int64_t>(head) * kHeadDim;
KDA_UNROLL
    for (int k = 0; k < kVPasses; ++k) {
      const int row = warp + 8 * k;
      vp[k] = row < len ? ld_as<uint2>(vsrc + row * p.qkv_stride + 4 * lane) : make_uint2(0u, 0u);
    }
  }
  SolveTile x;
  constexpr int kWWarps = kHeadDim / T::kSolveCols;  // warps 0..3: W, 4..7: Uv
  const bool w_warp = warp < kWWarps;
  const int c0 = T::kSolveCols * (w_warp ? warp : warp - kWWarps);
  if (w_warp) {
    // R^T of the W columns: k_i / ||k_i|| 2^G_i at element (column c, token i), in that order
    // of multiplication (as the CUDA-core solve did).
    load_tile_t(ops, sm.k, c0, x, lane);
    const int g = lane >> 2, t = lane & 3;
KDA_UNROLL
    for (int mt = 0; mt < 2; ++mt)
KDA_UNROLL
      for (int nt = 0; nt < kChunk / 8; ++nt)
KDA_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int i = 8 * nt + 2 * t + (e & 1), c = c0 + 16 * mt + g + 8 * (e >> 1);
          x[mt][nt][e] = x[mt][nt][e] * sm.rk[i] * exp2_nonpos(sm.G[i][g_col(c)]);
        }
  } else if (tid >= T::kThreads - T::kInvThreads) {
    // N_b = L_bb^-1 - I for diagonal block b, column cc, by forward substitution in fp32 on
    // L_bb y = e_cc: y_i = [i = cc] - sum_{j<i} A_ij y_j (y_j = 0 for j < cc). Only A's strictly
    // lower entries are read (the 16-byte loads' other lanes are ignored), and A is not written
    // in step 5 outside the blocks below the diagonal (lds_f4's condition).
    const int u = tid - (T::kThreads - T::kInvThreads), b = u / kSub, cc = u % kSub;
    const float* ab = &sm.A[kSub * b][kSub * b];
    float y[kSub];
KDA_UNROLL
    for (int i = 0; i < kSub; ++i) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
KDA_UNROLL
      for (int j0 = 0; j0 < i; j0 += 4) {
        const float4 a = lds_f4(ab + i * T::kPitchA + j0);
        acc[0] = fmaf(a.x, y[j0], acc[0]);
        if (j0 + 1 < i) acc[1] = fmaf(a.y, y[j0 + 1], acc[1]);
        if (j0 + 2 < i) acc[2] = fmaf(a.z, y[j0 + 2], acc[2]);
        if (j0 + 3 < i) acc[3] = fmaf(a.w, y[j0 + 3], acc[3]);
      }
      y[i] = (i == cc ? 1.0f : 0.0f) - ((acc[0] + acc[1]) + (acc[2] + acc[3]));
    }
KDA_UNROLL
    for (int i = 0; i < kSub; ++i)
      st_as<float>(nmat + (kSub * b + i) * T::kPitchN + cc, i == cc ? 0.0f : tf32_round(y[i]));
  } else {
    // The blocks of A below the diagonal (rows 16.., columns [0, 16 (row / 16))) rounded to
    // tf32 in place: the solve's B operands then need no conversion. Nobody reads them before
    // the barrier below; the inversion reads only the diagonal blocks, which stay fp32.
    constexpr int kQuads = (kChunk - kSub) / 4;  // 16-byte quads of a row's first 48 columns
    constexpr int kRoundThreads = T::kThreads / 2 - T::kInvThreads;  // warps 4, 5
    for (int e = tid - kWWarps * 32; e < (kChunk - kSub) * kQuads; e += kRoundThreads) {
      const int r = kSub + e / kQuads, qd = e % kQuads;
      if (4 * qd < kSub * (r / kSub)) {
        float4 v = ld_as<float4>(&sm.A[r][4 * qd]);
        v = make_float4(tf32_round(v.x), tf32_round(v.y), tf32_round(v.z), tf32_round(v.w));
        st_as<float4>(&sm.A[r][4 * qd], v);
      }
    }
  }
KDA_UNROLL
  for (int k = 0; k < kVPasses; ++k) st_as<uint2>(&sm.q[warp + 8 * k][4 * lane], vp[k]);
  ops.sync();  // v and N are in place

  // 5b: the Uv warps' right-hand sides, the solves, the outputs: UvT [v][i] fp32 straight from
  // the accumulators (8-byte stores of tokens 2t, 2t + 1), W as bf16 to tmp rows [0, 64).
  {
    const int g = lane >> 2, t = lane & 3;
    if (w_warp) {
      solve_tile(ops, sm, nmat, x, lane);
KDA_UNROLL
      for (int mt = 0; mt < 2; ++mt)
KDA_UNROLL
        for (int nt = 0; nt < kChunk / 8; ++nt)
KDA_UNROLL
          for (int e = 0; e < 4; ++e)
            sm.tmp[8 * nt + 2 * t + (e & 1)][c0 + 16 * mt + g + 8 * (e >> 1)] =
                __float2bfloat16_rn(x[mt][nt][e]);
    } else {
      load_tile_t(ops, sm.q, c0, x, lane);
      solve_tile(ops, sm, nmat, x, lane);
KDA_UNROLL
      for (int mt = 0; mt < 2; ++mt)
KDA_UNROLL
        for (int h = 0; h < 2; ++h) {
          float* dst = rec_uvt + (c0 + 16 * mt + g + 8 * h) * kChunk + 2 * t;
KDA_UNROLL
          for (int nt = 0; nt < kChunk / 8; ++nt)
            st_as<float2>(dst + 8 * nt, make_float2(x[mt][nt][2 * h], x[mt][nt][2 * h + 1]));
        }
    }
  }
  ops.sync();  // W is staged
  // W rows to the record, 16-byte pieces (16 per 256-byte row), coalesced.
  for (int e = tid; e < kChunk * T::kChunks8; e += T::kThreads) {
    const int row = e / T::kChunks8, ch = e % T::kChunks8;
    st_as<uint4>(rec_w + row * kHeadDim + 8 * ch, ld_as<uint4>(&sm.tmp[row][8 * ch]));
  }
}

// ---------------------------------------------------------------------------------------------
// Phase 2.
//
// Per value tile (16 value rows) of a block, two warps (vt and vt + 4, which share a warp
// scheduler: warp id mod 4), the same records and stages:
//   state warp (warps 0 .. 3 = value tile vt): S^T in registers; per chunk it packs
//     sf = bf16(S0^T) and publishes it, computes U^T = Uv^T - S0^T W^T, publishes
//     uf = bf16(U^T), and updates the state. Its chain per chunk is the recurrence's critical
//     path, so it carries nothing that the next chunk does not need.
//   output warp (warps 4 .. 7 = value tile vt - 4): per chunk, O^T = S0^T Qt^T from the
//     published sf, then O^T += U^T M'^T from the published uf, and the o rows; the output
//     warps also copy the records into the stages.
//
// Publishing goes through an exchange area after the two stages, per value tile 8 sf slots
// (k-steps kk) and 4 uf slots (k-steps kq), each the 4 fragment registers of every lane as one
// 16-byte word at [slot][lane] (conflict-free 128-bit accesses). Each publication is a producer
// / consumer pair on a named barrier of the tile's two warps (64 threads): the state warp
// arrives (bar.arrive: it never waits for the output warp inside a chunk), the output warp
// syncs (bar.sync), so the state warp's stores are visible to it past the barrier. sf uses
// barrier 1 + vt, uf barrier 5 + vt (sf_barrier, uf_barrier), ids spelled as constants
// (pair_barrier; ptxas reserves 9 barriers). They must be distinct: with one id the state
// warp's two arrivals of a chunk could complete a generation on their own.
// Reuse of the slots and of the barriers across chunks is ordered by the block barrier of
// enter_chunk: the state warp writes chunk n + 1's sf (and arrives again) only after chunk
// n + 1's block barrier, which the output warp reaches only after it has read chunk n's sf and
// uf (and completed both barriers' generations of chunk n).
// The two roles reach the same barriers at different instructions (the block barrier in two
// loops; arrive against sync on the pair barriers), each by a whole, converged warp: the
// pattern of the PTX ISA's producer / consumer example for bar.arrive (compute-sanitizer's
// synccheck on the GPU is the check the emulation cannot make).

struct StateTraits {
  // 16-row value tiles per block: 4 (64 value columns, 2 blocks per head) halves the L2 reads
  // of the tiles a head's blocks share against 2 (4 blocks per head) and puts 8 warps on an SM.
  static constexpr int kValueTiles = 4;
  static constexpr int kWarps = 2 * kValueTiles;             // a state and an output warp per tile
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowsPerWarp = 16;                    // value rows of S^T per tile (m16)
  static constexpr int kColumns = kValueTiles * kRowsPerWarp;  // value columns per block
  static constexpr int kSlices = kHeadDim / kColumns;        // blocks per (sequence, head)
  static constexpr int kKeyTiles = kHeadDim / 8;             // n-tiles of a warp's S^T
  // Shared-memory stage: record tiles with padded rows (272 B / 144 B / 288 B: the 8 rows of
  // every ldmatrix and the float2 reads of UvT fall in distinct banks).
  static constexpr int kPitchTile = (kHeadDim + 8) * 2;                   // bytes per W / Qt / Kb' row
  static constexpr int kPitchMp = (kChunk + 8) * 2;                       // bytes per M' row
  static constexpr int kPitchUv = (kChunk + 8) * 4;                       // bytes per UvT row
  static constexpr int kW = 0;
  static constexpr int kQt = kW + kChunk * kPitchTile;
  static constexpr int kKb = kQt + kChunk * kPitchTile;
  static constexpr int kMp = kKb + kChunk * kPitchTile;
  static constexpr int kUvT = kMp + kChunk * kPitchMp;
  static constexpr int kGamma = kUvT + kColumns * kPitchUv;
  static constexpr int kStageBytes = kGamma + kHeadDim * 4;
  // The exchange of sf and uf after the two stages.
  static constexpr int kSlotBytes = 32 * 16;           // a 16-byte word per lane
  static constexpr int kSfSlots = kHeadDim / 16;       // S0^T fragments: k-steps of 16 keys
  static constexpr int kUfSlots = kChunk / 16;         // U^T fragments: k-steps of 16 tokens
  static constexpr int kXchgTileBytes = (kSfSlots + kUfSlots) * kSlotBytes;
  static constexpr int kXchg = 2 * kStageBytes;
  static constexpr int kSmemBytes = kXchg + kValueTiles * kXchgTileBytes;
  static constexpr int kPairThreads = 64;  // named barriers of a tile's state and output warp
  static constexpr int kCopyThreads = 32 * kValueTiles;  // the output warps copy the records
  static_assert(kStageBytes % 16 == 0 && kXchg % 16 == 0 && kSmemBytes <= 227 * 1024,
                "stage and exchange layout");
  static_assert(kHeadDim % kColumns == 0, "value slices must tile the head");
  static_assert(kSlices == recurrence::kStateSlices,
                "kda_chunked_plan's cost model counts recurrence::kStateSlices blocks per head");
  // Barrier 0 is the block barrier; tile vt publishes sf on 1 + vt and uf on 1 + kValueTiles + vt.
  static_assert(1 + 2 * kValueTiles <= 16, "two named barriers per value tile");
};

// 2^k, k = clamp(14 - floor(log2 m), -100, 40), for m >= 0: m 2^k lies in [2^14, 2^15), under
// fp16's largest finite 65504, for every m in [2^-26, 2^114]; 2^k and 2^-k are normal floats,
// so scaling by them is exact. NaN / inf give 2^-100 (and stay NaN / inf).
__host__ __device__ __forceinline__ int fp16_scale_exponent(float m) {
  uint32_t bits;
  memcpy(&bits, &m, 4);
  const int biased = static_cast<int>((bits >> 23) & 0xFFu);
  return std::min(40, std::max(-100, 141 - biased));  // 14 - (biased - 127)
}
__host__ __device__ __forceinline__ float pow2f(int k) {
  const uint32_t bits = static_cast<uint32_t>(k + 127) << 23;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// A state warp's S^T = S0^T diag(gamma) + U^T Kb' (value rows v0 + g, v0 + g + 8; all 128 key
// channels), on fp16 tensor cores. The state update's operands set the carried state's
// accuracy (bf16 ones carry 8 significant bits into it); fp16 carries tf32's 11
// significant bits at twice tf32's mma rate and half its operand bytes, but only over
// [2^-14, 65504]. Kb' is within [-1, 1] (phase 1 stores it in fp16). U is not bounded, so each
// value row of U^T is scaled by a power of two 2^k_row (fp16_scale_exponent of the row's
// largest |U|) before rounding to fp16, and the row of the accumulator with it:
// acc = S0^T diag(gamma) 2^k, acc += (2^k U^T) Kb', S^T = acc 2^-k. Power-of-two scalings are
// exact, so the result is the product of the fp16-rounded operands summed in fp32, whatever
// the scale, as long as |S| 2^k stays finite: always for |S| < 2^87 (k <= 40); a state entry
// beyond 1.5e26 is outside any layer this serves (and fp32 itself would not carry such a state
// much further). ua[s] holds U^T at tokens 8 s + (2t, 2t + 1) as an m16n8 accumulator; an
// accumulator pair is an m16k16 A fragment. Kb' is [token][channel] in the stage at shared
// address kb_addr (pitch StateTraits::kPitchTile), read with ldmatrix .trans as [k][n] B tiles.
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ void update_state_f16(
    Ops& ops, float (&st)[StateTraits::kKeyTiles][4], const float (&ua)[kChunk / 8][4],
    const float* gamma, uint32_t kb_addr, int lane) {
  constexpr int kKeyTiles = StateTraits::kKeyTiles;
  static_assert(kKeyTiles % 2 == 0, "key tiles in pairs (one ldmatrix x4 each)");
  const int t = lane & 3, m = lane >> 3, r8 = lane & 7;
  // The largest |U| of rows g and g + 8, over the 4 lanes of a row (lanes 4g .. 4g + 3).
  float mlo = 0.0f, mhi = 0.0f;
KDA_UNROLL
  for (int s = 0; s < kChunk / 8; ++s) {
    mlo = fmaxf(mlo, fmaxf(fabsf(ua[s][0]), fabsf(ua[s][1])));
    mhi = fmaxf(mhi, fmaxf(fabsf(ua[s][2]), fabsf(ua[s][3])));
  }
  mlo = fmaxf(mlo, ops.shfl_xor(mlo, 1));
  mhi = fmaxf(mhi, ops.shfl_xor(mhi, 1));
  mlo = fmaxf(mlo, ops.shfl_xor(mlo, 2));
  mhi = fmaxf(mhi, ops.shfl_xor(mhi, 2));
  const int klo = fp16_scale_exponent(mlo), khi = fp16_scale_exponent(mhi);
  const float slo = pow2f(klo), shi = pow2f(khi);
  // 2^k U^T as fp16 A fragments: k-step kq covers tokens [16 kq, 16 kq + 16).
  uint32_t uh[kChunk / 16][4];
KDA_UNROLL
  for (int kq = 0; kq < kChunk / 16; ++kq) {
    uh[kq][0] = pack_f16(ua[2 * kq][0] * slo, ua[2 * kq][1] * slo);
    uh[kq][1] = pack_f16(ua[2 * kq][2] * shi, ua[2 * kq][3] * shi);
    uh[kq][2] = pack_f16(ua[2 * kq + 1][0] * slo, ua[2 * kq + 1][1] * slo);
    uh[kq][3] = pack_f16(ua[2 * kq + 1][2] * shi, ua[2 * kq + 1][3] * shi);
  }
  const float plo = pow2f(klo), phi = pow2f(khi);
KDA_UNROLL
  for (int nt = 0; nt < kKeyTiles; ++nt) {
    const float gm0 = gamma[8 * nt + 2 * t], gm1 = gamma[8 * nt + 2 * t + 1];
    st[nt][0] *= gm0 * plo;
    st[nt][1] *= gm1 * plo;
    st[nt][2] *= gm0 * phi;
    st[nt][3] *= gm1 * phi;
  }
  // ldmatrix .trans of [token][channel] 8 x 8 blocks: matrix m covers tokens 8 (m & 1).. and
  // channels 8 (m >> 1)..: r[0], r[1] are b0, b1 of key tile 2 np, r[2], r[3] those of 2 np + 1.
  const uint32_t off = (r8 + 8 * (m & 1)) * StateTraits::kPitchTile + (m >> 1) * 16;
KDA_UNROLL
  for (int kq = 0; kq < kChunk / 16; ++kq) {
KDA_UNROLL
    for (int np = 0; np < kKeyTiles / 2; ++np) {
      uint32_t b[4];
      ops.ldsm_x4_trans(b, kb_addr + off + kq * 16 * StateTraits::kPitchTile + np * 32);
      ops.mma_f16(st[2 * np], uh[kq], b[0], b[1]);
      ops.mma_f16(st[2 * np + 1], uh[kq], b[2], b[3]);
    }
  }
  const float rlo = pow2f(-klo), rhi = pow2f(-khi);
KDA_UNROLL
  for (int nt = 0; nt < kKeyTiles; ++nt) {
    st[nt][0] *= rlo;
    st[nt][1] *= rlo;
    st[nt][2] *= rhi;
    st[nt][3] *= rhi;
  }
}

// Copies kRows rows of kPieces 16-byte pieces (global row pitch kSrcPitch, shared row pitch
// kDstPitch, both in bytes) with kThreads threads. Thread tid always takes piece tid % kPieces
// of rows tid / kPieces + k kThreads / kPieces, so after one base address per side every
// offset is a compile-time constant (one cp.async per piece, no index math).
KDA_OPS_BODY
template <int kThreads, int kRows, int kPieces, int kSrcPitch, int kDstPitch, class Ops>
__host__ __device__ __forceinline__ void copy_rows(Ops& ops, uint32_t dst,
                                                   const unsigned char* src, int tid) {
  static_assert(kPieces <= kThreads && kThreads % kPieces == 0, "whole rows per pass");
  constexpr int kRowsPerPass = kThreads / kPieces;
  const int row = tid / kPieces, piece = tid % kPieces;
  dst += row * kDstPitch + piece * 16;
  src += row * kSrcPitch + piece * 16;
KDA_UNROLL
  for (int j = 0; j < kRows / kRowsPerPass; ++j)
    ops.cp16(dst + j * kRowsPerPass * kDstPitch, src + j * kRowsPerPass * kSrcPitch);
  if constexpr (kRows % kRowsPerPass != 0) {
    constexpr int kDone = kRows / kRowsPerPass * kRowsPerPass;
    if (row < kRows - kDone) ops.cp16(dst + kDone * kDstPitch, src + kDone * kSrcPitch);
  }
}

// What a walk reads of a chunk record (WalkRole): everything (Full); no Qt and M' (Summary: no
// o); no Qt, M' and Uv either (Transition).
enum class StageParts { All, State, Transition };

// Copies this block's part of chunk record `rec` into the stage at shared address `stage`:
// W, Qt, Kb', M', the block's kColumns rows of UvT and gamma (less for the summary walks, `parts`),
// by kThreads threads (thread index tid).
KDA_OPS_BODY
template <int kThreads, class Ops>
__host__ __device__ __forceinline__ void load_stage(Ops& ops, uint32_t stage,
                                                    const unsigned char* rec, int vbase,
                                                    StageParts parts, int tid) {
  using S = StateTraits;
  if (parts == StageParts::All) {
    // W, Qt and Kb' are consecutive 64-row tiles in the record and in the stage: 192 rows.
    copy_rows<kThreads, 3 * kChunk, kHeadDim * 2 / 16, kHeadDim * 2, S::kPitchTile>(
        ops, stage + S::kW, rec + Record::kW, tid);
    copy_rows<kThreads, kChunk, kChunk * 2 / 16, kChunk * 2, S::kPitchMp>(
        ops, stage + S::kMp, rec + Record::kMp, tid);
  } else {
    copy_rows<kThreads, kChunk, kHeadDim * 2 / 16, kHeadDim * 2, S::kPitchTile>(
        ops, stage + S::kW, rec + Record::kW, tid);
    copy_rows<kThreads, kChunk, kHeadDim * 2 / 16, kHeadDim * 2, S::kPitchTile>(
        ops, stage + S::kKb, rec + Record::kKb, tid);
  }
  if (parts != StageParts::Transition)
    copy_rows<kThreads, S::kColumns, kChunk * 4 / 16, kChunk * 4, S::kPitchUv>(
        ops, stage + S::kUvT, rec + Record::kUvT + vbase * kChunk * 4, tid);
  copy_rows<kThreads, 1, kHeadDim * 4 / 16, kHeadDim * 4, kHeadDim * 4>(
      ops, stage + S::kGamma, rec + Record::kGamma, tid);
}

// The chunk range of sequence `seq` in phase 2. False when the block has nothing to do: the
// sequence is skipped, or (only with malformed metadata, a decreasing query_start_loc) its
// chunk slots leave the slot range, and it is skipped rather than read out of bounds. Depends
// on the block's indices and metadata only, so every thread of the block gets the same answer.
struct StateWalk {
  SeqSpan span;
  int64_t first = 0, nchunks = 0;
};
__host__ __device__ __forceinline__ bool state_walk(const RecurrenceParams& p, int64_t seq,
                                                    StateWalk& w) {
  w.span = sequence_span(p, seq);
  if (!w.span.active) return false;
  w.first = varlen::first_slot(p.query_start_loc[seq], seq, kChunkShift);
  w.nchunks = (w.span.eos - w.span.bos + kChunk - 1) / kChunk;
  return w.first >= 0 && w.first + w.nchunks <= p.slots;
}

// The double-buffered record stages: stage n & 1 holds chunk n. start_stages issues chunk 0's
// copies; enter_chunk(n) waits for chunk n's (this thread's, then everyone's at the block
// barrier, past which everyone is also done with chunk n - 1), refills the other stage with
// chunk n + 1 and returns chunk n's stage. One block barrier per chunk: the refill of a stage
// is issued after the barrier that follows its last use.
struct StagePipe {
  const unsigned char* rec;  // the record of the newest chunk in flight
  int64_t rec_step;          // between the records of consecutive chunks of a head
  uint32_t base;             // shared address of stage 0
  const unsigned char* ptr;  // generic pointer to stage 0
  int vbase;                 // the block's first value column (its UvT rows)
  StageParts parts;
};
struct Stage {
  uint32_t addr;             // shared address (ldmatrix)
  const unsigned char* ptr;  // generic pointer (plain shared loads)
};

KDA_OPS_BODY
template <int kThreads, class Ops>
__host__ __device__ __forceinline__ StagePipe start_stages(Ops& ops, const RecurrenceParams& p,
                                                           int64_t slot, int head, int vbase,
                                                           StageParts parts,
                                                           int tid, bool copies) {
  StagePipe s{record_of(p, slot, head), static_cast<int64_t>(p.num_heads) * Record::kBytes,
              ops.smem_addr(ops.smem()), ops.smem(), vbase, parts};
  if (copies) {
    load_stage<kThreads>(ops, s.base, s.rec, vbase, parts, tid);
    ops.cp_commit();
  }
  return s;
}

KDA_OPS_BODY
template <int kThreads, class Ops>
__host__ __device__ __forceinline__ Stage enter_chunk(Ops& ops, StagePipe& s, int64_t n,
                                                      int64_t nchunks, int tid, bool copies) {
  using S = StateTraits;
  if (copies) ops.cp_wait_all();  // this thread's pieces of chunk n have landed
  // ... and every copier's; everyone is also done with chunk n - 1, whose stage is refilled
  // next. (Threads with copies == false issue no copies: kThreads of the others do them all.)
  ops.sync();
  if (copies && n + 1 < nchunks) {
    s.rec += s.rec_step;
    load_stage<kThreads>(ops, s.base + ((n + 1) & 1) * S::kStageBytes, s.rec, s.vbase, s.parts,
                         tid);
    ops.cp_commit();
  }
  return {s.base + static_cast<uint32_t>(n & 1) * S::kStageBytes,
          s.ptr + (n & 1) * S::kStageBytes};
}

// A state warp's S^T: st[nt] holds value rows v0 + (g, g + 8) and key channels
// 8 nt + (2t, 2t + 1), read from (or written to) the pool at element `at` on: the head of a
// line (state_head_at). Elements are fp32, or bf16 when p.state_dtype_is_bf16: a load widens
// exactly, a store rounds to nearest even. The flag is tested once per call and each branch passes it on
// as a constant, so each is a straight loop over one element type (the fp32 one the plain fp32
// loop); positions are element offsets, scaled inside the branch: a line pointer whose element
// size is chosen at run time made ptxas keep ~45 more registers live across the chunk loop.
__host__ __device__ __forceinline__ void load_state_elems(float (&st)[StateTraits::kKeyTiles][4],
                                                          const RecurrenceParams& p, int64_t at,
                                                          bool bf16, int v0, int g, int t) {
KDA_UNROLL
  for (int nt = 0; nt < StateTraits::kKeyTiles; ++nt) {
KDA_UNROLL
    for (int r = 0; r < 4; ++r) {
      const int v = v0 + g + 8 * (r >> 1), c = 8 * nt + 2 * t + (r & 1);
      st[nt][r] = load_state_elem(p.states, at + c * p.state_k + v * p.state_v, bf16);
    }
  }
}
__host__ __device__ __forceinline__ void load_state(float (&st)[StateTraits::kKeyTiles][4],
                                                    const RecurrenceParams& p, int64_t at,
                                                    bool from_state, int v0, int g, int t) {
  if (!from_state) {
KDA_UNROLL
    for (int nt = 0; nt < StateTraits::kKeyTiles; ++nt)
KDA_UNROLL
      for (int r = 0; r < 4; ++r) st[nt][r] = 0.0f;
  } else if (p.state_dtype_is_bf16) {
    load_state_elems(st, p, at, true, v0, g, t);
  } else {
    load_state_elems(st, p, at, false, v0, g, t);
  }
}
__host__ __device__ __forceinline__ void store_state_elems(
    const float (&st)[StateTraits::kKeyTiles][4], const RecurrenceParams& p, int64_t at,
    bool bf16, int v0, int g, int t) {
KDA_UNROLL
  for (int nt = 0; nt < StateTraits::kKeyTiles; ++nt) {
KDA_UNROLL
    for (int r = 0; r < 4; ++r) {
      const int v = v0 + g + 8 * (r >> 1), c = 8 * nt + 2 * t + (r & 1);
      store_state_elem(p.states, at + c * p.state_k + v * p.state_v, st[nt][r], bf16);
    }
  }
}
__host__ __device__ __forceinline__ void store_state(const float (&st)[StateTraits::kKeyTiles][4],
                                                     const RecurrenceParams& p, int64_t at,
                                                     int v0, int g, int t) {
  if (p.state_dtype_is_bf16) store_state_elems(st, p, at, true, v0, g, t);
  else store_state_elems(st, p, at, false, v0, g, t);
}
// The pool element where head `head` of line `line` starts (elements of the pool's type).
__host__ __device__ __forceinline__ int64_t state_head_at(const RecurrenceParams& p, int64_t line,
                                                          int head) {
  return line * p.state_line + head * p.state_head;
}

// S0^T as bf16 A fragments: k-step kk covers key channels [16 kk, 16 kk + 16).
__host__ __device__ __forceinline__ void pack_state_bf16(
    const float (&st)[StateTraits::kKeyTiles][4], uint32_t (&sf)[StateTraits::kSfSlots][4]) {
KDA_UNROLL
  for (int kk = 0; kk < StateTraits::kSfSlots; ++kk) {
    sf[kk][0] = pack_bf16(st[2 * kk][0], st[2 * kk][1]);
    sf[kk][1] = pack_bf16(st[2 * kk][2], st[2 * kk][3]);
    sf[kk][2] = pack_bf16(st[2 * kk + 1][0], st[2 * kk + 1][1]);
    sf[kk][3] = pack_bf16(st[2 * kk + 1][2], st[2 * kk + 1][3]);
  }
}

// ua = -Uv^T of the warp's value rows vrow + (g, g + 8) (block-relative) from the stage's UvT
// tile, as the accumulator tiles of U^T (n-tile nt = tokens [8 nt, 8 nt + 8)).
__host__ __device__ __forceinline__ void load_neg_uv(float (&ua)[kChunk / 8][4], const float* uvt,
                                                     int vrow, int g, int t) {
  constexpr int kUvFloats = StateTraits::kPitchUv / 4;
KDA_UNROLL
  for (int nt = 0; nt < kChunk / 8; ++nt) {
    const float* lo = uvt + (vrow + g) * kUvFloats + 8 * nt + 2 * t;
    const float* hi = lo + 8 * kUvFloats;
    ua[nt][0] = -lo[0];
    ua[nt][1] = -lo[1];
    ua[nt][2] = -hi[0];
    ua[nt][3] = -hi[1];
  }
}

// U^T (the accumulator ua, n-tile nt = tokens [8 nt, 8 nt + 8)) as bf16 A fragments: k-step kq
// covers tokens [16 kq, 16 kq + 16).
__host__ __device__ __forceinline__ void pack_u_bf16(const float (&ua)[kChunk / 8][4],
                                                     uint32_t (&uf)[kChunk / 16][4]) {
KDA_UNROLL
  for (int kq = 0; kq < kChunk / 16; ++kq) {
    uf[kq][0] = pack_bf16(ua[2 * kq][0], ua[2 * kq][1]);
    uf[kq][1] = pack_bf16(ua[2 * kq][2], ua[2 * kq][3]);
    uf[kq][2] = pack_bf16(ua[2 * kq + 1][0], ua[2 * kq + 1][1]);
    uf[kq][3] = pack_bf16(ua[2 * kq + 1][2], ua[2 * kq + 1][3]);
  }
}

// oa += U^T M'^T over the token blocks kq <= np only (M' is zero above its diagonal).
// off_mp: the lane's ldmatrix offset into M'.
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ void add_u_mp(Ops& ops, float (&oa)[kChunk / 8][4],
                                                  const uint32_t (&uf)[kChunk / 16][4],
                                                  uint32_t stage, uint32_t off_mp) {
  using S = StateTraits;
KDA_UNROLL
  for (int np = 0; np < kSubBlocks; ++np) {
KDA_UNROLL
    for (int kq = 0; kq <= np; ++kq) {
      uint32_t b[4];
      ops.ldsm_x4(b, stage + S::kMp + off_mp + np * 16 * S::kPitchMp + kq * 32);
      ops.mma(oa[2 * np], uf[kq], b[0], b[1]);
      ops.mma(oa[2 * np + 1], uf[kq], b[2], b[3]);
    }
  }
}

// o rows of chunk n: token 8 nt + 2t + (r & 1), value column v0 + g + 8 (r >> 1). Two row
// pointers (tokens 2t and 2t + 1 of the n-tile) step 8 rows per n-tile.
__host__ __device__ __forceinline__ void store_o_chunk(const RecurrenceParams& p,
                                                       const SeqSpan& span, int64_t n, int head,
                                                       int v0, int g, int t,
                                                       const float (&oa)[kChunk / 8][4]) {
  const int64_t t0 = span.bos + n * kChunk;
  const int rows = static_cast<int>(std::min(static_cast<int64_t>(kChunk), span.eos - t0));
  __nv_bfloat16* orow0 =
      p.o + (t0 + 2 * t) * p.o_stride + static_cast<int64_t>(head) * kHeadDim + v0 + g;
  __nv_bfloat16* orow1 = orow0 + p.o_stride;
  const int64_t step8 = 8 * p.o_stride;
KDA_UNROLL
  for (int nt = 0; nt < kChunk / 8; ++nt, orow0 += step8, orow1 += step8) {
    const int i = 8 * nt + 2 * t;
    if (i < rows) {
      orow0[0] = __float2bfloat16_rn(oa[nt][0]);
      orow0[8] = __float2bfloat16_rn(oa[nt][2]);
    }
    if (i + 1 < rows) {
      orow1[0] = __float2bfloat16_rn(oa[nt][1]);
      orow1[8] = __float2bfloat16_rn(oa[nt][3]);
    }
  }
}

// What a phase-2 block walks: chunks [c0, c1) of sequence seq (segment seg of nseg), in one
// of three roles (docs/design.md, "Segments"):
//   Full:       the recurrence proper from the segment's true initial state: o rows, state
//               checkpoints, and at the end the pool line (last segment) or, for segment 0 of
//               a segmented sequence, the segment-end state E in the workspace;
//   Summary:    the state from zero over the segment (no o), stored as E;
//   Transition: the state from the identity with Uv = 0, i.e. the segment's transition
//               matrix P (value column j of this walk is column j of P), stored as P.
enum class WalkRole { Full, Summary, Transition };
struct BlockWalk {
  StateWalk walk;  // the sequence's span, chunk slot of its chunk 0 and chunk count
  int64_t seq = 0, slot = 0, seg = 0, nseg = 1, c0 = 0, c1 = 0;
  WalkRole role = WalkRole::Full;
  int slice = 0;
};

// The segments of a sequence of `nchunks` chunks: one when the op does not segment.
__host__ __device__ __forceinline__ int64_t segment_count(const RecurrenceParams& p,
                                                          int64_t nchunks) {
  return nchunks <= 0 ? 0 : ((nchunks - 1) >> p.seg_chunk_shift) + 1;
}
__host__ __device__ __forceinline__ bool segmented(const RecurrenceParams& p) {
  return p.seg_chunk_shift < recurrence::kNoSegments;
}
// The workspace's fp32 128 x 128 matrix of segment slot `slot` and head `head` (E or P),
// stored [v][c]: element (key c, value v) at v * 128 + c.
__host__ __device__ __forceinline__ float* segment_matrix(float* base, const RecurrenceParams& p,
                                                          int64_t slot, int head) {
  return base + (slot * p.num_heads + head) * int64_t{kHeadDim * kHeadDim};
}

// A state warp's S^T from / to a workspace matrix ([v][c], fp32, exact).
__host__ __device__ __forceinline__ void load_state_ws(float (&st)[StateTraits::kKeyTiles][4],
                                                       const float* m, int v0, int g, int t) {
KDA_UNROLL
  for (int nt = 0; nt < StateTraits::kKeyTiles; ++nt) {
KDA_UNROLL
    for (int r = 0; r < 4; ++r) {
      const int v = v0 + g + 8 * (r >> 1), c = 8 * nt + 2 * t + (r & 1);
      st[nt][r] = m[v * kHeadDim + c];
    }
  }
}
__host__ __device__ __forceinline__ void store_state_ws(
    const float (&st)[StateTraits::kKeyTiles][4], float* m, int v0, int g, int t) {
KDA_UNROLL
  for (int nt = 0; nt < StateTraits::kKeyTiles; ++nt) {
KDA_UNROLL
    for (int r = 0; r < 4; ++r) {
      const int v = v0 + g + 8 * (r >> 1), c = 8 * nt + 2 * t + (r & 1);
      m[v * kHeadDim + c] = st[nt][r];
    }
  }
}

// The pair barriers of value tile vt ("Publishing" in the comment that opens phase 2):
// sf on 1 + vt, uf on 1 + kValueTiles + vt. pair_arrive / pair_sync issue the barrier with its
// id as a literal (one branch per id, warp-uniform): ptxas reserves only the ids a kernel
// names, where an id in a register makes it reserve all 16.
__host__ __device__ __forceinline__ constexpr int sf_barrier(int vt) { return 1 + vt; }
__host__ __device__ __forceinline__ constexpr int uf_barrier(int vt) {
  return 1 + StateTraits::kValueTiles + vt;
}
KDA_OPS_BODY
template <int kId = 1, class Ops>
__host__ __device__ __forceinline__ void pair_barrier(Ops& ops, int id, bool arrive) {
  if constexpr (kId <= 2 * StateTraits::kValueTiles) {
    if (id == kId) {
      if (arrive) ops.named_arrive(kId, StateTraits::kPairThreads);
      else ops.named_sync(kId, StateTraits::kPairThreads);
      return;
    }
    pair_barrier<kId + 1>(ops, id, arrive);
  }
}
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ void pair_arrive(Ops& ops, int id) {
  pair_barrier(ops, id, true);
}
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ void pair_sync(Ops& ops, int id) {
  pair_barrier(ops, id, false);
}

// The state warp of value tile vt: holds S^T (16 value rows x 128 keys); in the Full role it
// publishes sf and uf for the output warp. `xchg` is the lane's word of slot 0 of the tile's
// exchange.
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ void state_warp(Ops& ops, const RecurrenceParams& p,
                                                    const BlockWalk& bw, StagePipe& pipe,
                                                    int head, int vt, int v0,
                                                    unsigned char* xchg, int tid) {
  using S = StateTraits;
  constexpr int kKeyTiles = S::kKeyTiles;
  const int lane = tid & 31;
  const int g = lane >> 2, t = lane & 3, m = lane >> 3, r8 = lane & 7;
  const int vrow = vt * S::kRowsPerWarp;
  const bool full = bw.role == WalkRole::Full;
  float st[kKeyTiles][4];
  const int64_t state_at = state_head_at(p, bw.walk.span.line, head);
  if (bw.role == WalkRole::Transition) {
KDA_UNROLL
    for (int nt = 0; nt < kKeyTiles; ++nt)
KDA_UNROLL
      for (int r = 0; r < 4; ++r)
        st[nt][r] = (v0 + g + 8 * (r >> 1) == 8 * nt + 2 * t + (r & 1)) ? 1.0f : 0.0f;
  } else if (full && bw.seg > 0) {
    load_state_ws(st, segment_matrix(p.seg_states, p, bw.slot - 1, head), v0, g, t);
  } else {
    const bool from_state = full && p.has_initial_state != nullptr && p.has_initial_state[bw.seq];
    load_state(st, p, state_at, from_state, v0, g, t);
  }
  // The sequence's checkpoints, read once: per chunk the test is integer arithmetic on them.
  const CheckpointSeq checkpoints = full ? recurrence::checkpoints_of(p, bw.seq) : CheckpointSeq{};
  const int64_t rows = bw.walk.span.eos - bw.walk.span.bos;
  const int64_t count = bw.c1 - bw.c0;
  // Non-transposed B tiles stored [n][k]: matrix m covers rows 8 (m >> 1).. and columns
  // 8 (m & 1).., so r[0], r[1] are b0, b1 of n-tile 2np and r[2], r[3] those of n-tile 2np + 1.
  const uint32_t off_tile = (r8 + 8 * (m >> 1)) * S::kPitchTile + (m & 1) * 16;
  unsigned char* xchg_uf = xchg + S::kSfSlots * S::kSlotBytes;

KDA_UNROLL_1
  for (int64_t i = 0; i < count; ++i) {
    const Stage st_n = enter_chunk<S::kCopyThreads>(ops, pipe, i, count, 0, /*copies=*/false);
    const float* uvt = reinterpret_cast<const float*>(st_n.ptr + S::kUvT);

    // sf, published for O (the output warp may read it once barrier 1 + vt completes).
    uint32_t sf[S::kSfSlots][4];
    pack_state_bf16(st, sf);
    if (full) {
KDA_UNROLL
      for (int kk = 0; kk < S::kSfSlots; ++kk)
        st_as<uint4>(xchg + kk * S::kSlotBytes,
                     make_uint4(sf[kk][0], sf[kk][1], sf[kk][2], sf[kk][3]));
      pair_arrive(ops, sf_barrier(vt));
    }

    // ua = -U^T = S0^T W^T - Uv^T (Uv = 0 for the transition), then U^T.
    float ua[kChunk / 8][4];
    if (bw.role == WalkRole::Transition) {
KDA_UNROLL
      for (int nt = 0; nt < kChunk / 8; ++nt) ua[nt][0] = ua[nt][1] = ua[nt][2] = ua[nt][3] = 0.0f;
    } else {
      load_neg_uv(ua, uvt, vrow, g, t);
    }
KDA_UNROLL
    for (int kk = 0; kk < S::kSfSlots; ++kk) {
KDA_UNROLL
      for (int np = 0; np < kSubBlocks; ++np) {
        uint32_t b[4];
        ops.ldsm_x4(b, st_n.addr + S::kW + off_tile + np * 16 * S::kPitchTile + kk * 32);
        ops.mma(ua[2 * np], sf[kk], b[0], b[1]);
        ops.mma(ua[2 * np + 1], sf[kk], b[2], b[3]);
      }
    }
KDA_UNROLL
    for (int nt = 0; nt < kChunk / 8; ++nt)
KDA_UNROLL
      for (int r = 0; r < 4; ++r) ua[nt][r] = -ua[nt][r];

    // uf, published for O += U^T M'^T (uf_barrier(vt)).
    if (full) {
      uint32_t uf[kChunk / 16][4];
      pack_u_bf16(ua, uf);
KDA_UNROLL
      for (int kq = 0; kq < S::kUfSlots; ++kq)
        st_as<uint4>(xchg_uf + kq * S::kSlotBytes,
                     make_uint4(uf[kq][0], uf[kq][1], uf[kq][2], uf[kq][3]));
      pair_arrive(ops, uf_barrier(vt));
    }

    // S^T = S0^T diag(gamma) + U^T Kb'.
    update_state_f16(ops, st, ua, reinterpret_cast<const float*>(st_n.ptr + S::kGamma),
                     st_n.addr + S::kKb, lane);

    // st is now the state after the first `end` rows. A checkpoint there gets these very
    // registers, as the final store below does: a run cut at `end` with the same segment
    // length has the same chunks and the same segments up to here (both are relative to the
    // sequence's first row; checkpoint ends are chunk ends or its last row), so it stores
    // bitwise the same line (rounded alike when the pool is bf16).
    const int64_t end = std::min((bw.c0 + i + 1) * kChunk, rows);
    const int64_t ck = recurrence::checkpoint_line(p, checkpoint_at(checkpoints, end));
    if (ck >= 0) store_state(st, p, state_head_at(p, ck, head), v0, g, t);
  }

  // The end: the pool line after the last segment; E after segment 0 and after a summary; P
  // after a transition. Pass 3's other segments store nothing: their E is the scan's result,
  // the next segment's start, which pass 3 reads meanwhile.
  if (bw.role == WalkRole::Transition)
    store_state_ws(st, segment_matrix(p.seg_trans, p, bw.slot, head), v0, g, t);
  else if (full && bw.seg == bw.nseg - 1)
    store_state(st, p, state_at, v0, g, t);
  else if (!full || bw.seg == 0)
    store_state_ws(st, segment_matrix(p.seg_states, p, bw.slot, head), v0, g, t);
}

// The output warp of value tile vt: O^T from the published sf and uf, and the o rows (Full
// role); in the other roles it only copies the records.
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ void output_warp(Ops& ops, const RecurrenceParams& p,
                                                     const BlockWalk& bw, StagePipe& pipe,
                                                     int head, int vt, int v0,
                                                     const unsigned char* xchg, int tid) {
  using S = StateTraits;
  const int lane = tid & 31;
  const int g = lane >> 2, t = lane & 3, m = lane >> 3, r8 = lane & 7;
  // ldmatrix offsets as in state_warp.
  const uint32_t off_tile = (r8 + 8 * (m >> 1)) * S::kPitchTile + (m & 1) * 16;
  const uint32_t off_mp = (r8 + 8 * (m >> 1)) * S::kPitchMp + (m & 1) * 16;
  const unsigned char* xchg_uf = xchg + S::kSfSlots * S::kSlotBytes;
  const int64_t count = bw.c1 - bw.c0;
  if (bw.role != WalkRole::Full) {
KDA_UNROLL_1
    for (int64_t i = 0; i < count; ++i)
      enter_chunk<S::kCopyThreads>(ops, pipe, i, count, tid - S::kCopyThreads, /*copies=*/true);
    return;
  }

KDA_UNROLL_1
  for (int64_t i = 0; i < count; ++i) {
    const Stage st_n = enter_chunk<S::kCopyThreads>(ops, pipe, i, count, tid - S::kCopyThreads,
                                                    /*copies=*/true);

    // oa = O^T = S0^T Qt^T, per accumulator the k-steps kk in ascending order.
    float oa[kChunk / 8][4];
KDA_UNROLL
    for (int nt = 0; nt < kChunk / 8; ++nt) oa[nt][0] = oa[nt][1] = oa[nt][2] = oa[nt][3] = 0.0f;
    pair_sync(ops, sf_barrier(vt));
KDA_UNROLL
    for (int kk = 0; kk < S::kSfSlots; ++kk) {
      const uint4 w = ld_as<uint4>(xchg + kk * S::kSlotBytes);
      const uint32_t sf[4] = {w.x, w.y, w.z, w.w};
KDA_UNROLL
      for (int np = 0; np < kSubBlocks; ++np) {
        uint32_t b[4];
        ops.ldsm_x4(b, st_n.addr + S::kQt + off_tile + np * 16 * S::kPitchTile + kk * 32);
        ops.mma(oa[2 * np], sf, b[0], b[1]);
        ops.mma(oa[2 * np + 1], sf, b[2], b[3]);
      }
    }

    // oa += U^T M'^T, then the o rows.
    pair_sync(ops, uf_barrier(vt));
    uint32_t uf[kChunk / 16][4];
KDA_UNROLL
    for (int kq = 0; kq < S::kUfSlots; ++kq) {
      const uint4 w = ld_as<uint4>(xchg_uf + kq * S::kSlotBytes);
      uf[kq][0] = w.x;
      uf[kq][1] = w.y;
      uf[kq][2] = w.z;
      uf[kq][3] = w.w;
    }
    add_u_mp(ops, oa, uf, st_n.addr, off_mp);
    store_o_chunk(p, bw.walk.span, bw.c0 + i, head, v0, g, t, oa);
  }
}

// Segment windows: rows [r L, (r + 1) L) of the batch, L = the segment length. The segments
// after a sequence's first start at least L rows apart (a sequence's own L apart; a later
// sequence's second one L rows past its first row, which lies past every row of the sequences
// before it), so a window holds the start of at most one of them, that of the sequence holding
// row r L. The summary walks of pass 1, the scan and pass 3 run per window (value slice, role)
// rather than per segment slot: ceil(num_tokens / L) windows against num_tokens / L +
// num_seqs slots, so the sequences a batch leaves empty (a graph's max_seqs capacity) launch
// no blocks there.
__host__ __device__ __forceinline__ int64_t segment_windows(const RecurrenceParams& p) {
  const int shift = kChunkShift + p.seg_chunk_shift;
  return (p.num_tokens + (int64_t{1} << shift) - 1) >> shift;
}

// The segment after the first that starts in window r, as (seq, seg >= 1) with its walk;
// false when the window holds none. Every lane of the calling warp calls it (the radix search
// over query_start_loc). Only a segment's own window finds it: seg = ceil((r L - bos) / L)
// puts its first row in [r L, (r + 1) L), also for malformed metadata.
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ bool window_segment(Ops& ops, const RecurrenceParams& p,
                                                        int64_t r, int lane, int64_t& seq,
                                                        int64_t& seg, StateWalk& walk) {
  const int shift = kChunkShift + p.seg_chunk_shift;
  const int64_t row = r << shift;
  seq = ops.locate_row(p, row, lane);
  if (seq < 0 || seq >= p.num_seqs || !state_walk(p, seq, walk)) return false;
  if (row < walk.span.bos || row >= walk.span.eos) return false;
  seg = (row - walk.span.bos + (int64_t{1} << shift) - 1) >> shift;
  return seg >= 1 && seg < segment_count(p, walk.nchunks);
}

// The blocks along x of phase-2 pass `pass` (per head, gridDim.y): s = StateTraits::kSlices
// per sequence (segment 0, Full); when sequences are cut, pass 1 adds 2 s per segment window
// (Summary, Transition) and pass 3 has s per window (Full).
__host__ __device__ __forceinline__ int64_t state_grid_blocks(const RecurrenceParams& p, int pass) {
  constexpr int s = StateTraits::kSlices;
  if (!segmented(p)) return p.num_seqs * s;
  return pass == 1 ? p.num_seqs * s + segment_windows(p) * 2 * s : segment_windows(p) * s;
}

// Which walk block x (< state_grid_blocks) of phase-2 pass `pass` runs (false: none), with
// s = StateTraits::kSlices (2) and z the block's place among its neighbours of one sequence or
// window (docs/design.md, "Segments"):
//   pass 1, x < num_seqs s: sequence x / s, segment 0, Full on slice z = x % s;
//   pass 1, later x: window w = (x - num_seqs s) / 2 s, z = its remainder: the window's
//           segment, if not the sequence's last: Summary (z < s) or Transition (z >= s) on
//           slice z % s;
//   pass 3: window x / s, Full on slice z = x % s.
// A block's neighbours share its chunk records and run at the same time, so each record is
// read from DRAM once (a record is 90 KB; slices laid a wave or more apart read it once each).
// Depends on the block's indices and metadata only, so every warp of the block gets the same
// answer.
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ bool block_walk(Ops& ops, const RecurrenceParams& p, int pass,
                                                    int64_t x, int lane, BlockWalk& bw) {
  constexpr int s = StateTraits::kSlices;
  const bool first_segment = !segmented(p) || (pass == 1 && x < p.num_seqs * s);
  int z = 0;
  if (first_segment) {
    if (pass != 1) return false;
    bw.seq = x / s;
    z = static_cast<int>(x % s);
    bw.seg = 0;
    if (bw.seq >= p.num_seqs || !state_walk(p, bw.seq, bw.walk)) return false;
  } else {
    const int zs = pass == 1 ? 2 * s : s;
    const int64_t w = pass == 1 ? x - p.num_seqs * s : x;
    z = static_cast<int>(w % zs);
    if (!window_segment(ops, p, w / zs, lane, bw.seq, bw.seg, bw.walk)) return false;
  }
  bw.nseg = segment_count(p, bw.walk.nchunks);
  if (segmented(p)) {
    const int64_t first =
        varlen::first_slot(p.query_start_loc[bw.seq], bw.seq, kChunkShift + p.seg_chunk_shift);
    // Only malformed metadata leaves the segment slots (as state_walk checks the chunk slots).
    if (first < 0 || first + bw.nseg > p.seg_slots) return false;
    bw.slot = first + bw.seg;
  } else {
    bw.slot = bw.seq;
  }
  bw.slice = z % s;
  if (first_segment || pass == 3) {
    bw.role = WalkRole::Full;
  } else {
    if (bw.seg > bw.nseg - 2) return false;
    bw.role = z < s ? WalkRole::Summary : WalkRole::Transition;
  }
  bw.c0 = bw.seg << p.seg_chunk_shift;
  bw.c1 = std::min(bw.c0 + (int64_t{1} << p.seg_chunk_shift), bw.walk.nchunks);
  return true;
}

// One block of phase-2 pass `pass` (1 or 3), as thread `tid` of StateTraits::kThreads.
// Exits are uniform over the block; the two roles run their own chunk loops, which meet at the
// same number of block barriers (one per chunk, in enter_chunk).
KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ void state_block(Ops& ops, const RecurrenceParams& p, int pass,
                                                     int64_t x, int head, int tid) {
  using S = StateTraits;
  const int lane = tid & 31, warp = tid >> 5;
  BlockWalk bw;
  if (!block_walk(ops, p, pass, x, lane, bw)) return;
  const int vt = warp % S::kValueTiles;
  const int vbase = bw.slice * S::kColumns;
  const int v0 = vbase + vt * S::kRowsPerWarp;
  unsigned char* xchg = ops.smem() + S::kXchg + vt * S::kXchgTileBytes + lane * 16;
  // The output warps copy the records alone (kCopyThreads = their 128 threads, thread index
  // tid - kCopyThreads): the state warps' stream, the recurrence's critical path, then carries
  // no cp.async and no copy address arithmetic.
  const bool copier = warp >= S::kValueTiles;
  const StageParts parts = bw.role == WalkRole::Full      ? StageParts::All
                           : bw.role == WalkRole::Summary ? StageParts::State
                                                          : StageParts::Transition;
  StagePipe pipe = start_stages<S::kCopyThreads>(ops, p, bw.walk.first + bw.c0, head, vbase,
                                                 parts, tid - S::kCopyThreads, copier);
  if (!copier)
    state_warp(ops, p, bw, pipe, head, vt, v0, xchg, tid);
  else
    output_warp(ops, p, bw, pipe, head, vt, v0, xchg, tid);
}

// Phase 2's pass 2, the scan over segments: per (sequence, head, value slice; one block per
// segment window, the one where the sequence's second segment starts), in segment
// order m = 1 .. nseg - 2, E_m <- P_m E_(m-1) + E_m, which turns every E into the true state at
// its segment's end (E_0 is, from pass 1). In the [v][c] storage: E_m[v][:] += E_(m-1)[v][:] P_m^T
// as rows, i.e. E_m[v][c] += sum_j E_(m-1)[v][j] P_m[c][j] with P_m stored [j][c]. fp32 on CUDA
// cores, the sum over j in ascending order. kScanThreads threads; smem: P_m (64 KB) and the
// slice's 32 rows of E_(m-1) (16 KB).
struct ScanTraits {
  static constexpr int kThreads = 256;
  static constexpr int kRows = 32;                     // value rows of the slice
  static constexpr int kSlices = kHeadDim / kRows;     // blocks per (sequence, head)
  static constexpr int kSmemBytes = (kHeadDim * kHeadDim + kRows * kHeadDim) * 4;
  static_assert(kRows * kHeadDim == 16 * kThreads, "4 x 4 results per thread");
};

KDA_OPS_BODY
template <class Ops>
__host__ __device__ __forceinline__ void scan_block(Ops& ops, const RecurrenceParams& p,
                                                    int64_t window, int head, int slice, int tid) {
  using T = ScanTraits;
  // The sequence whose second segment starts in the window (segment_windows).
  StateWalk walk;
  int64_t seq = 0, seg = 0;
  if (!segmented(p) || !window_segment(ops, p, window, tid & 31, seq, seg, walk) || seg != 1)
    return;
  const int64_t nseg = segment_count(p, walk.nchunks);
  if (nseg < 3) return;
  const int seg_shift = kChunkShift + p.seg_chunk_shift;
  const int64_t first = varlen::first_slot(p.query_start_loc[seq], seq, seg_shift);
  if (first < 0 || first + nseg > p.seg_slots) return;
  float* sp = reinterpret_cast<float*>(ops.smem());  // P_m, [j][c]
  float* se = sp + kHeadDim * kHeadDim;                 // E_(m-1), the slice's rows [v][j]
  const int v_base = slice * T::kRows;
  const int r0 = (tid / 32) * 4, c0 = (tid % 32) * 4;  // rows r0.., columns c0.. of the slice
  for (int64_t m = 1; m <= nseg - 2; ++m) {
    const float* pm = segment_matrix(p.seg_trans, p, first + m, head);
    const float* eprev = segment_matrix(p.seg_states, p, first + m - 1, head) + v_base * kHeadDim;
    float* em = segment_matrix(p.seg_states, p, first + m, head) + v_base * kHeadDim;
    // The previous step's reads of sp / se are done, and its stores of E_m (now E_(m-1)) are
    // visible to the whole block (a block barrier orders global memory too).
    ops.sync();
    for (int e = tid; e < kHeadDim * kHeadDim / 4; e += T::kThreads)
      st_as<float4>(sp + 4 * e, ld_as<float4>(pm + 4 * e));
    for (int e = tid; e < T::kRows * kHeadDim / 4; e += T::kThreads)
      st_as<float4>(se + 4 * e, ld_as<float4>(eprev + 4 * e));
    ops.sync();
    float acc[4][4];
    for (int r = 0; r < 4; ++r) {
      const float4 e4 = ld_as<float4>(em + (r0 + r) * kHeadDim + c0);
      acc[r][0] = e4.x, acc[r][1] = e4.y, acc[r][2] = e4.z, acc[r][3] = e4.w;
    }
    for (int j = 0; j < kHeadDim; ++j) {
      const float4 pj = ld_as<float4>(sp + j * kHeadDim + c0);
      for (int r = 0; r < 4; ++r) {
        const float ev = se[(r0 + r) * kHeadDim + j];
        acc[r][0] = fmaf(ev, pj.x, acc[r][0]);
        acc[r][1] = fmaf(ev, pj.y, acc[r][1]);
        acc[r][2] = fmaf(ev, pj.z, acc[r][2]);
        acc[r][3] = fmaf(ev, pj.w, acc[r][3]);
      }
    }
    for (int r = 0; r < 4; ++r)
      st_as<float4>(em + (r0 + r) * kHeadDim + c0,
                    make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
  }
}

}  // namespace kda::chunked

#ifndef KDA_EMULATED_BODIES_ONLY

// The bodies on the GPU: the hardware mapping of their thread-level operations and the three
// kernels. Internal linkage: kda_chunked.cu is the one translation unit that launches them.
namespace kda {
namespace {

using chunked::PrepTraits;
using chunked::ScanTraits;
using chunked::StateTraits;
using recurrence::RecurrenceParams;

// The thread-level operations of the block bodies on the GPU.
struct DeviceOps {
  unsigned char* smem_ptr;

  __device__ __forceinline__ unsigned char* smem() const { return smem_ptr; }
  __device__ __forceinline__ uint32_t smem_addr(const void* p) const {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
  }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
  __device__ __forceinline__ float shfl_xor(float v, int mask) const {
    return __shfl_xor_sync(0xFFFFFFFFu, v, mask);
  }
  // The radix search of common/varlen_map.h, warp-cooperative: every lane of the warp calls it
  // with the same slot, lane j tests candidate j of each level and a ballot counts them.
  __device__ __forceinline__ int64_t locate_sequence(const RecurrenceParams& p, int64_t slot,
                                                     int lane, int shift) const {
    return varlen::find_sequence(p.search_steps, p.search_stride, [&](int64_t base, int64_t st) {
      const int64_t cand = base + lane * st;
      const bool le = cand < p.num_seqs &&
                      varlen::first_slot(__ldg(p.query_start_loc + cand), cand, shift) <= slot;
      return __popc(__ballot_sync(0xFFFFFFFFu, le));
    });
  }
  // The last sequence with query_start_loc[seq] <= row (-1 when none), by the same
  // warp-cooperative search with that predicate.
  __device__ __forceinline__ int64_t locate_row(const RecurrenceParams& p, int64_t row,
                                                int lane) const {
    return varlen::find_sequence(p.search_steps, p.search_stride, [&](int64_t base, int64_t st) {
      const int64_t cand = base + lane * st;
      const bool le = cand < p.num_seqs && __ldg(p.query_start_loc + cand) <= row;
      return __popc(__ballot_sync(0xFFFFFFFFu, le));
    });
  }
  __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) const {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }

  // The same with .trans: r[m] receives (row 2t, column g) and (row 2t + 1, column g) of
  // matrix m, low half first (the phase-1 solve reads row-major [token][column] tiles as
  // column-major fragments with it).
  __device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) const {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }

  // d += a b (m16n8k16, bf16 in, fp32 accumulate).
  __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                      uint32_t b1) const {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // d += a b (m16n8k16, fp16 in, fp32 accumulate).
  __device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) const {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // d += a b (m16n8k8, tf32 in, fp32 accumulate); tf32 operands as fp32 bit patterns.
  __device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                           uint32_t b1) const {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // 16 bytes global -> shared through L2 only (the records are read once per block).
  __device__ __forceinline__ void cp16(uint32_t dst, const void* src) const {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
  }
  __device__ __forceinline__ void cp_commit() const {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  // Every cp.async of this thread is complete (commits the open group first).
  __device__ __forceinline__ void cp_wait_all() const {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  }
};

// The barriers of a body whose warps reach them from role-dependent code (state_block:
// the state and the output warps call the block barrier, and the two ends of each named
// barrier, at different instructions). bar.sync / bar.arrive / __syncthreads are the .aligned
// forms, which require every participating thread to execute the same barrier instruction
// (compute-sanitizer's synccheck reports "divergent threads" otherwise); the non-aligned
// barrier.sync / barrier.arrive do not. Same semantics otherwise.
struct DivergentBarrierOps : DeviceOps {
  __device__ __forceinline__ void sync() const { asm volatile("barrier.sync 0;\n" ::: "memory"); }
  // Barrier `id` (1 .. 15; 0 is the block barrier) among `threads` threads, whole warps.
  __device__ __forceinline__ void named_sync(int id, int threads) const {
    asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  }
  // Arrives at barrier `id` without waiting (a producer): its earlier memory accesses are
  // performed for the threads that wait there once the barrier completes.
  __device__ __forceinline__ void named_arrive(int id, int threads) const {
    asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  }
};

template <bool kLowerBound>
__global__ void __launch_bounds__(PrepTraits::kThreads, 2)
    kda_chunk_prep_kernel(const RecurrenceParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DeviceOps ops{smem_raw};
  chunked::prep_block<kLowerBound>(ops, p, blockIdx.x, blockIdx.y, threadIdx.x);
}

// Phase 2's walks: pass 1 (every sequence's first segment, and the other segments' summaries
// and transitions) or pass 3 (the segments after the first, from their true initial states).
// Grid (state_grid_blocks, H).
__global__ void __launch_bounds__(StateTraits::kThreads, 1)
    kda_chunk_state_kernel(const RecurrenceParams p, int pass) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DivergentBarrierOps ops{{smem_raw}};
  chunked::state_block(ops, p, pass, blockIdx.x, blockIdx.y, threadIdx.x);
}

// Phase 2's pass 2: the scan over each sequence's segments. Grid (segment windows, H,
// ScanTraits::kSlices).
__global__ void __launch_bounds__(ScanTraits::kThreads)
    kda_chunk_scan_kernel(const RecurrenceParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DeviceOps ops{smem_raw};
  chunked::scan_block(ops, p, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
}

}  // namespace
}  // namespace kda

#endif  // KDA_EMULATED_BODIES_ONLY
