// Phase 1 of the chunked KDA recurrence, the prep (kda_chunked_kernel.cuh has the overview and
// the kernels). Include through kda_chunked_kernel.cuh.
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
#pragma once

#include "recurrence/kda_chunked_kernel_common.cuh"

namespace kda::chunked {

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
    kv[e] = kv[e] * kr * f[e];  // (k / ||k||) 2^(..), in this order
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
  const int64_t seq = locate_sequence(ops, p, slot, lane, kChunkShift);
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

}  // namespace kda::chunked
