// Phase 2 of the chunked KDA recurrence, the walks over the chunk records and the scan that
// joins segments (kda_chunked_kernel.cuh has the overview and the kernels). Include through
// kda_chunked_kernel.cuh.
//
// Phase 2 (state_block): one block of 8 warps per (sequence, head,
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
#pragma once

#include "recurrence/kda_chunked_kernel_common.cuh"

namespace kda::chunked {

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

// Element r of key tile nt of a state warp's S^T fragment (an m16n8 accumulator, g = lane / 4,
// t = lane % 4): value row state_row(v0, g, r), key channel state_key(nt, t, r).
__host__ __device__ __forceinline__ int state_row(int v0, int g, int r) {
  return v0 + g + 8 * (r >> 1);
}
__host__ __device__ __forceinline__ int state_key(int nt, int t, int r) {
  return 8 * nt + 2 * t + (r & 1);
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
      const int v = state_row(v0, g, r), c = state_key(nt, t, r);
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
      const int v = state_row(v0, g, r), c = state_key(nt, t, r);
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
      const int v = state_row(v0, g, r), c = state_key(nt, t, r);
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
      const int v = state_row(v0, g, r), c = state_key(nt, t, r);
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
        st[nt][r] = state_row(v0, g, r) == state_key(nt, t, r) ? 1.0f : 0.0f;
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
  seq = locate_row(ops, p, row, lane);
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
    // A decreasing query_start_loc may also give two sequences overlapping slots, whose E and P
    // then share workspace matrices: in bounds, and that batch's results are wrong anyway.
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
// cores, the sum over j in ascending order. ScanTraits::kThreads threads; smem: P_m (64 KB) and the
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
