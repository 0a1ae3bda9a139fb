// The packed conv's device code: the per-warp program body, written once for the GPU and for a
// CPU emulation (tests/conv/test_packed_conv_emu.cpp runs it with one std::thread per lane),
// and at the end of this file its device Ops and the kernel.
// Everything that differs between the two goes through an Ops object:
//
//   template <int kBytes> RowOf<kBytes> load_x(const char* p)   x row bytes, read-only path
//   template <int kBytes> void store_out(char* p, const RowOf<kBytes>& r)
//   float load_ro(const float* p)          Float4 load4_ro(const float* p)   read-only path
//   Float4 load4(const float* p)           void store4(float* p, Float4 v)   shared or global
//   int32_t load_i32_ro(const int32_t* p)  bool load_flag(const bool* p)     (byte != 0)
//   float from_bits(uint32_t b)            uint32_t to_bits(float v)
//   float fp16_to_f32(uint16_t h)          uint16_t f32_to_bf16_rn(float)   uint16_t f32_to_fp16_rn(float)
//   uint32_t pack2_bf16_rn(float lo, float hi)   uint32_t pack2_fp16_rn(float lo, float hi)
//   float silu(float acc)                  (device: silu_stock_fast; CPU: silu_host_approx)
//   uint32_t ballot(bool pred)             int32_t shfl(int32_t v, int src_lane)   void syncwarp()
//   float* stage()                         this warp's staging area (staging_floats_per_warp)
//
// A program is a chunk slot (a (sequence, token chunk) of the varlen map, common/varlen_map.h)
// times a tile of 32 * vec channels inside one output plane; one warp runs chunks_per_cta consecutive programs
// of one tile (packed_conv_programs), searching with locate_chunk only at sequence boundaries.
// Each lane owns vec adjacent channels: it keeps their taps, bias and 3 history rows in
// registers across its programs and streams each chunk's rows through a register queue of
// kQueueRows loads in flight. The conv state (and taps of a non-dense weight layout) move
// through the warp's staging area in memory order; a pool of bf16 elements moves by the scalar
// walk, widened and narrowed exactly (common/state_elements.h). The arithmetic is conv_math.h's.
#pragma once

#include <cstdint>

#include "conv/packed_conv.h"
#include "common/state_elements.h"
#include "common/varlen_map.h"
#include "conv/conv_math.h"
#include "kda/packed_conv.h"

#if defined(__CUDACC__)
#define KDA_INLINE __forceinline__
#else
#define KDA_INLINE inline
#endif
// Unroll hints for the device compiler only (the host compiler would warn about them).
#if defined(__CUDA_ARCH__)
#define KDA_UNROLL _Pragma("unroll")
#define KDA_UNROLL_8 _Pragma("unroll 8")
#else
#define KDA_UNROLL
#define KDA_UNROLL_8
#endif

namespace kda::conv {

constexpr int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

constexpr int dtype_bytes(DType t) { return t == DType::FP32 ? 4 : 2; }

// Compile-time facts of one instance: element type and channels per lane.
template <DType kDType, int kVecChannels>
struct PackedConvTraits {
  static constexpr DType kElem = kDType;
  static constexpr int kElemBytes = dtype_bytes(kDType);
  static constexpr int kVec = kVecChannels;                   // channels per lane
  static constexpr int kTile = 32 * kVec;                     // channels per program
  static constexpr int kRowBytes = kVec * kElemBytes;         // bytes a lane moves per token
  static constexpr int kWords = kRowBytes >= 4 ? kRowBytes / 4 : 1;
  // About 128 bytes of loads in flight per lane, 4 to 16 rows: 16 rows of 4 bf16 channels,
  // 8 rows of 8 bf16 or 4 fp32 channels, 4 rows of 8 fp32 channels.
  static constexpr int kQueueRows = clamp_int(128 / kRowBytes, 4, 16);

  static_assert(kVec == 1 || kVec == 2 || kVec == 4 || kVec == 8, "vec is 1, 2, 4 or 8");
  // part_dim % 64 == 0 and the launcher checks part_dim % kTile == 0 for the larger tiles.
  static_assert(kTile == 32 || kTile == 64 || kTile == 128 || kTile == 256, "tile");
  static_assert(kRowBytes >= 2 && kRowBytes <= 32, "one to two 16-byte accesses per row");
};

// The raw bits of one lane's kVec elements of one row. Element i sits in word i / 2
// (16-bit types, low half first: little endian) or word i (fp32).
template <int kWords>
struct RowBits {
  uint32_t w[kWords];
};

// The RowBits holding kBytes bytes (a 2-byte row uses the low half of one word).
template <int kBytes>
using RowOf = RowBits<(kBytes >= 4 ? kBytes / 4 : 1)>;

struct alignas(16) Float4 {
  float x, y, z, w;
};

// Element i of a row, widened to fp32 (exact for every dtype).
template <class Traits, class Ops, int kWords>
KDA_HOST_DEVICE KDA_INLINE float element_f32(const Ops& ops, const RowBits<kWords>& r, int i) {
  if constexpr (Traits::kElem == DType::FP32) {
    return ops.from_bits(r.w[i]);
  } else {
    const uint32_t word = r.w[i / 2];
    const uint32_t bits = (i % 2) ? (word >> 16) : (word & 0xFFFFu);
    if constexpr (Traits::kElem == DType::BF16) {
      return ops.from_bits(bits << 16);  // bf16 is the top half of an fp32
    } else {
      return ops.fp16_to_f32(static_cast<uint16_t>(bits));
    }
  }
}

// v rounded to nearest even in the element type, placed as element i of a row. Elements are
// set in order 0, 1, ..., so an even element starts its word.
template <class Traits, class Ops, int kWords>
KDA_HOST_DEVICE KDA_INLINE void set_element(const Ops& ops, RowBits<kWords>& r, int i, float v) {
  if constexpr (Traits::kElem == DType::FP32) {
    r.w[i] = ops.to_bits(v);
  } else {
    const uint32_t bits = Traits::kElem == DType::BF16 ? ops.f32_to_bf16_rn(v)
                                                       : ops.f32_to_fp16_rn(v);
    if (i % 2 == 0) {
      r.w[i / 2] = bits;
    } else {
      r.w[i / 2] |= bits << 16;
    }
  }
}

template <class Traits, class Ops, int kWords>
KDA_HOST_DEVICE KDA_INLINE void row_to_f32(const Ops& ops, const RowBits<kWords>& r,
                                           float (&dst)[Traits::kVec]) {
  KDA_UNROLL
  for (int v = 0; v < Traits::kVec; ++v) dst[v] = element_f32<Traits>(ops, r, v);
}

// A tile's per-channel parameters, kRows values (taps) for each of kTile channels, move between
// global memory (element strides stride_channel, stride_row) and a warp's staging area laid
// out [row][channel], rows kPitch floats apart. The warp walks the global elements in memory
// order, consecutive lanes on consecutive addresses (coalesced), instead of each lane fetching
// its own channels (one cache line per lane per access); each lane then moves its own kVec
// channels between the staging area and registers.
//
// Two dense layouts move as 16-byte vectors: the tile as one block, channel-major
// (stride_row 1, stride_channel kRows: (dim, 4) weights, a (lines, dim, 3) state), and rows of
// contiguous channels (stride_channel 1, stride_row a multiple of 4: the transposed layouts).
// Any other strides take the scalar walk with the smaller stride innermost.
template <int kTile, int kVec, int kRows>
struct TileStaging {
  // 8 floats of padding per row: in the channel-major walks the lanes of one shared access hit
  // (nearly) distinct banks; rows stay 16-byte aligned for vector accesses.
  static constexpr int kPitch = kTile + 8;
  static constexpr int kScalarPerLane = kRows * kTile / 32;
  static constexpr int kVectorsPerLane = kRows * kTile / 128;  // Float4 per lane in a vector walk
  static constexpr bool kVectorWalks = kVectorsPerLane * 128 == kRows * kTile;
  static_assert(kRows <= 4, "at most 4 rows");
  static_assert(kRows * kTile % 32 == 0, "whole warps of elements");
  static_assert(kPitch == staging_pitch(kTile), "the staging layout of packed_conv.h");
  static_assert(kVec == 1 || kVec == 2 || kVec % 4 == 0, "lane vectors of 1, 2 or 4k floats");

  enum class Walk { kBlock, kContiguousRows, kScalar };

  KDA_HOST_DEVICE static KDA_INLINE Walk walk(const float* base, int64_t stride_channel,
                                              int64_t stride_row) {
    if constexpr (kVectorWalks) {
      const bool aligned = (reinterpret_cast<uintptr_t>(base) & 15u) == 0;
      if (aligned && stride_row == 1 && stride_channel == kRows) return Walk::kBlock;
      if (aligned && stride_channel == 1 && stride_row % 4 == 0) return Walk::kContiguousRows;
    }
    return Walk::kScalar;
  }

  // Scalar walk: element e = lane + 32 m, the smaller stride innermost.
  KDA_HOST_DEVICE static KDA_INLINE void scalar_index(int e, bool rows_inner, int& channel,
                                                      int& row) {
    channel = rows_inner ? e / kRows : e % kTile;
    row = rows_inner ? e % kRows : e / kTile;
  }

  // kReadOnly: through the read-only cache (the weights). Otherwise plain loads (the state
  // line, which the same warp writes afterwards).
  template <bool kReadOnly, class Ops>
  KDA_HOST_DEVICE static KDA_INLINE void gather(const Ops& ops, float* stage, const float* base,
                                                int64_t stride_channel, int64_t stride_row,
                                                int lane) {
    const Walk w = walk(base, stride_channel, stride_row);
    if constexpr (kVectorWalks) {
      if (w == Walk::kBlock) {
        KDA_UNROLL
        for (int m = 0; m < kVectorsPerLane; ++m) {
          const int e = 4 * (lane + 32 * m);  // channel-major element index of the block
          const Float4 q = kReadOnly ? ops.load4_ro(base + e) : ops.load4(base + e);
          const float vals[4] = {q.x, q.y, q.z, q.w};
          KDA_UNROLL
          for (int k = 0; k < 4; ++k) stage[((e + k) % kRows) * kPitch + (e + k) / kRows] = vals[k];
        }
        return;
      }
      if (w == Walk::kContiguousRows) {
        KDA_UNROLL
        for (int m = 0; m < kVectorsPerLane; ++m) {
          const int e = 4 * (lane + 32 * m);  // row-major element index
          const int r = e / kTile, c = e % kTile;
          const float* src = base + r * stride_row + c;
          ops.store4(stage + r * kPitch + c, kReadOnly ? ops.load4_ro(src) : ops.load4(src));
        }
        return;
      }
    }
    const bool rows_inner = stride_row < stride_channel;
    KDA_UNROLL_8
    for (int m = 0; m < kScalarPerLane; ++m) {
      int c, r;
      scalar_index(lane + 32 * m, rows_inner, c, r);
      const float* src = base + c * stride_channel + r * stride_row;
      stage[r * kPitch + c] = kReadOnly ? ops.load_ro(src) : *src;
    }
  }

  template <class Ops>
  KDA_HOST_DEVICE static KDA_INLINE void scatter(const Ops& ops, float* base,
                                                 int64_t stride_channel, int64_t stride_row,
                                                 const float* stage, int lane) {
    const Walk w = walk(base, stride_channel, stride_row);
    if constexpr (kVectorWalks) {
      if (w == Walk::kBlock) {
        KDA_UNROLL
        for (int m = 0; m < kVectorsPerLane; ++m) {
          const int e = 4 * (lane + 32 * m);
          float vals[4];
          KDA_UNROLL
          for (int k = 0; k < 4; ++k) vals[k] = stage[((e + k) % kRows) * kPitch + (e + k) / kRows];
          ops.store4(base + e, Float4{vals[0], vals[1], vals[2], vals[3]});
        }
        return;
      }
      if (w == Walk::kContiguousRows) {
        KDA_UNROLL
        for (int m = 0; m < kVectorsPerLane; ++m) {
          const int e = 4 * (lane + 32 * m);
          const int r = e / kTile, c = e % kTile;
          ops.store4(base + r * stride_row + c, ops.load4(stage + r * kPitch + c));
        }
        return;
      }
    }
    const bool rows_inner = stride_row < stride_channel;
    KDA_UNROLL_8
    for (int m = 0; m < kScalarPerLane; ++m) {
      int c, r;
      scalar_index(lane + 32 * m, rows_inner, c, r);
      base[c * stride_channel + r * stride_row] = stage[r * kPitch + c];
    }
  }

  // The same walks for a pool of bf16 elements (PackedConvParams::state_dtype_is_bf16, the conv
  // state only): the scalar walk in memory order (consecutive lanes on consecutive 2-byte elements in
  // both the (dim, taps) and the (taps, dim) layout), each element widened exactly on the way in
  // and rounded to nearest even on the way out. The staged values are bf16 inputs or widened
  // bf16 taps, so the rounding changes no value (a NaN becomes the canonical 0x7FFF) and a bf16
  // line holds the bits of the fp32 line rounded to bf16. Plain loads and stores: the same warp
  // writes the line it read. A line moves once per sequence, so the scalar walk costs nothing
  // that shows (vectorising it would add kernel code for no measurable gain).
  KDA_HOST_DEVICE static KDA_INLINE void gather_bf16(float* stage, const uint16_t* base,
                                                     int64_t stride_channel, int64_t stride_row,
                                                     int lane) {
    const bool rows_inner = stride_row < stride_channel;
    KDA_UNROLL_8
    for (int m = 0; m < kScalarPerLane; ++m) {
      int c, r;
      scalar_index(lane + 32 * m, rows_inner, c, r);
      stage[r * kPitch + c] = state_bf16_to_float(base[c * stride_channel + r * stride_row]);
    }
  }

  KDA_HOST_DEVICE static KDA_INLINE void scatter_bf16(uint16_t* base, int64_t stride_channel,
                                                      int64_t stride_row, const float* stage,
                                                      int lane) {
    const bool rows_inner = stride_row < stride_channel;
    KDA_UNROLL_8
    for (int m = 0; m < kScalarPerLane; ++m) {
      int c, r;
      scalar_index(lane + 32 * m, rows_inner, c, r);
      base[c * stride_channel + r * stride_row] = state_float_to_bf16(stage[r * kPitch + c]);
    }
  }

  // The lane's kVec channels of one staged row.
  template <class Ops>
  KDA_HOST_DEVICE static KDA_INLINE void read_lane(const Ops& ops, const float* stage, int row,
                                                   int lane, float (&dst)[kVec]) {
    const float* src = stage + row * kPitch + lane * kVec;
    if constexpr (kVec % 4 == 0) {
      KDA_UNROLL
      for (int v = 0; v < kVec; v += 4) {
        const Float4 q = ops.load4(src + v);
        dst[v] = q.x; dst[v + 1] = q.y; dst[v + 2] = q.z; dst[v + 3] = q.w;
      }
    } else {
      KDA_UNROLL
      for (int v = 0; v < kVec; ++v) dst[v] = src[v];
    }
  }

  template <class Ops>
  KDA_HOST_DEVICE static KDA_INLINE void write_lane(const Ops& ops, float* stage, int row,
                                                    int lane, const float (&src)[kVec]) {
    float* dst = stage + row * kPitch + lane * kVec;
    if constexpr (kVec % 4 == 0) {
      KDA_UNROLL
      for (int v = 0; v < kVec; v += 4) {
        ops.store4(dst + v, Float4{src[v], src[v + 1], src[v + 2], src[v + 3]});
      }
    } else {
      KDA_UNROLL
      for (int v = 0; v < kVec; ++v) dst[v] = src[v];
    }
  }
};

// The (sequence, token chunk) of chunk program `chunk_program`, found by the 32 lanes of one
// warp (common/varlen_map.h's radix search). It is the same for every column block, so the kernel
// runs it once per CTA and shares it.
template <class Ops>
KDA_HOST_DEVICE KDA_INLINE varlen::SlotChunk locate_chunk(const PackedConvParams& p, int64_t chunk_program,
                                                     int lane, Ops& ops) {
  return varlen::locate_slot_warp(
      p.num_seqs, p.chunk_shift, p.search_steps, p.search_stride, chunk_program, lane,
      [&](int64_t i) { return ops.load_i32_ro(p.query_start_loc + i); },
      [&](bool pred) { return ops.ballot(pred); },
      [&](int32_t v, int src) { return ops.shfl(v, src); });
}

// Two results rounded to nearest even in the element type and packed into one 32-bit word, low
// half first (16-bit types only). The device packs with one cvt of two floats.
template <class Traits, class Ops>
KDA_HOST_DEVICE KDA_INLINE uint32_t pack2_rn(const Ops& ops, float lo, float hi) {
  static_assert(Traits::kElemBytes == 2, "16-bit types");
  if constexpr (Traits::kElem == DType::BF16) {
    return ops.pack2_bf16_rn(lo, hi);
  } else {
    return ops.pack2_fp16_rn(lo, hi);
  }
}

// One row of results in the element type.
template <class Traits, class Ops, int kWords>
KDA_HOST_DEVICE KDA_INLINE void pack_row(const Ops& ops, const float (&v)[Traits::kVec],
                                         RowBits<kWords>& r) {
  if constexpr (Traits::kElem == DType::FP32 || Traits::kVec == 1) {
    KDA_UNROLL
    for (int i = 0; i < Traits::kVec; ++i) set_element<Traits>(ops, r, i, v[i]);
  } else {
    KDA_UNROLL
    for (int i = 0; i < Traits::kVec; i += 2) r.w[i / 2] = pack2_rn<Traits>(ops, v[i], v[i + 1]);
  }
}

// A lane's taps and bias for its kVec channels: one column block's, so a warp loads them once
// for all the chunk programs it runs.
template <int kVec>
struct LaneTaps {
  float w0[kVec], w1[kVec], w2[kVec], w3[kVec], acc0[kVec];
};

// A lane's last 3 input rows in fp32: h1 = token t-1 (the most recent), h2 = t-2, h3 = t-3.
template <int kVec>
struct LaneHistory {
  float h1[kVec], h2[kVec], h3[kVec];
};

// Taps and bias of the tile that starts at channel tile_begin; the lane's channels start at c0.
// Dense weights load per lane; any other layout moves through the warp's staging area in memory
// order.
template <class Traits, bool kHasBias, class Ops>
KDA_HOST_DEVICE KDA_INLINE void load_lane_taps(const PackedConvParams& p, int64_t tile_begin, int64_t c0,
                                               int lane, Ops& ops, LaneTaps<Traits::kVec>& t) {
  using Taps = TileStaging<Traits::kTile, Traits::kVec, 4>;
  // The dense (dim, 4) layout, 16-byte aligned: channel c's 4 taps are one vector and the lane's
  // kVec vectors are contiguous (the warp reads one contiguous block), so each lane loads its
  // own, with no staging and no syncwarp between the row loads and the cache-line load (the
  // staged walk is slower: docs/perf.md). Warp-uniform condition.
  if (p.weight_stride_dim == 4 && p.weight_stride_tap == 1 &&
      (reinterpret_cast<uintptr_t>(p.weight) & 15u) == 0) {
    KDA_UNROLL
    for (int v = 0; v < Traits::kVec; ++v) {
      const Float4 q = ops.load4_ro(p.weight + (c0 + v) * 4);
      t.w0[v] = q.x;
      t.w1[v] = q.y;
      t.w2[v] = q.z;
      t.w3[v] = q.w;
    }
  } else {
    float* const stage_taps = ops.stage();
    Taps::template gather<true>(ops, stage_taps, p.weight + tile_begin * p.weight_stride_dim,
                                p.weight_stride_dim, p.weight_stride_tap, lane);
    ops.syncwarp();
    Taps::read_lane(ops, stage_taps, 0, lane, t.w0);
    Taps::read_lane(ops, stage_taps, 1, lane, t.w1);
    Taps::read_lane(ops, stage_taps, 2, lane, t.w2);
    Taps::read_lane(ops, stage_taps, 3, lane, t.w3);
  }
  // Without a bias acc0 is the constant +0.0f, which costs no registers.
  KDA_UNROLL
  for (int v = 0; v < Traits::kVec; ++v) t.acc0[v] = kHasBias ? ops.load_ro(p.bias + c0 + v) : 0.0f;
}

// One chunk program of the packed conv, run by the 32 lanes of a warp: chunk `pc` (from
// locate_chunk or next_chunk_in_sequence) of the tile of column block `plane_col_block` of
// plane `plane`, with the lane's taps `taps`. Every branch below depends on the program only,
// so the warp never diverges.
//
// Taps: loaded by the warp's first chunk that runs (taps_loaded false), after its x loads are
// issued, so that their round trip overlaps the rows' instead of delaying them.
//
// History: with `carried` the caller asserts that `hist` holds this warp's last 3 rows before
// pc.begin (it ran chunk pc.chunk - 1 of the same sequence just before), so the 3 seed rows are
// not read again. Returns true when the chunk ran, and then `hist` holds its last 3 rows.
template <class Traits, bool kSilu, bool kHasBias, class Ops>
KDA_HOST_DEVICE KDA_INLINE bool packed_conv_chunk(const PackedConvParams& p, const varlen::SlotChunk& pc,
                                                  int64_t plane, int64_t plane_col_block, int lane,
                                                  LaneTaps<Traits::kVec>& taps, bool& taps_loaded,
                                                  LaneHistory<Traits::kVec>& hist, bool carried,
                                                  Ops& ops) {
  constexpr int kVec = Traits::kVec;
  constexpr int kQueue = Traits::kQueueRows;
  constexpr int kBytes = Traits::kRowBytes;
  constexpr int kTile = Traits::kTile;
  constexpr int64_t kElemBytes = Traits::kElemBytes;
  using Row = RowBits<Traits::kWords>;
  using State = TileStaging<kTile, kVec, 3>;

  if (pc.seq < 0 || pc.begin >= pc.end) return false;
  // Malformed query_start_loc (negative, decreasing, past num_tokens) skips the sequence, so
  // no access leaves x or out. For a well-formed one these never trigger.
  if (pc.seq_begin < 0 || pc.seq_end > p.num_tokens || pc.begin < pc.seq_begin) return false;
  carried = carried && pc.chunk != 0;

  // The tile lies inside one plane because kTile divides part_dim.
  const int64_t plane_col = plane_col_block * kTile + lane * kVec;  // this lane's first channel
  const int64_t tile_begin = plane * p.part_dim + plane_col_block * kTile;
  const int64_t c0 = tile_begin + lane * kVec;

  const char* x_lane = static_cast<const char*>(p.x) + c0 * kElemBytes;
  const int64_t x_row_bytes = p.x_row_stride * kElemBytes;
  char* out_lane =
      static_cast<char*>(p.out) + (plane * p.out_plane_stride + plane_col) * kElemBytes;
  const int64_t out_row_bytes = p.part_dim * kElemBytes;

  // Rows of this chunk: at most 256, so 32-bit row counters suffice.
  const int rows = static_cast<int>(pc.end - pc.begin);
  const int64_t len = pc.seq_end - pc.seq_begin;  // >= rows >= 1

  // Start-up. Every x load depends only on the varlen map, so all of them are issued first:
  // the rows that seed the history (chunk 0: the sequence's last 3 rows, for the new state;
  // later chunks, unless carried: the 3 rows before the chunk, inside the sequence because
  // chunks are >= 8 tokens) and the first kQueue rows of the main loop. The cache line and the
  // old state load while those are in flight (a program's fixed latency is what limits short
  // programs: docs/perf.md). A skipped sequence's x loads are dropped unused.
  Row seed1{}, seed2{}, seed3{};
  if (!carried) {
    const int64_t seed_end = pc.chunk == 0 ? pc.seq_end : pc.begin;
    seed1 = ops.template load_x<kBytes>(x_lane + (seed_end - 1) * x_row_bytes);
    if (pc.chunk != 0 || len >= 2) seed2 = ops.template load_x<kBytes>(x_lane + (seed_end - 2) * x_row_bytes);
    if (pc.chunk != 0 || len >= 3) seed3 = ops.template load_x<kBytes>(x_lane + (seed_end - 3) * x_row_bytes);
  }

  // Row r of the chunk is consumed from queue slot r % kQueue, which then loads row
  // r + kQueue; load_ptr always points at row r + kQueue.
  Row queue[kQueue];
  const char* load_ptr = x_lane + pc.begin * x_row_bytes;
  KDA_UNROLL
  for (int i = 0; i < kQueue; ++i) {
    if (i < rows) queue[i] = ops.template load_x<kBytes>(load_ptr);
    load_ptr += x_row_bytes;
  }

  if (!taps_loaded) {
    load_lane_taps<Traits, kHasBias>(p, tile_begin, c0, lane, ops, taps);
    taps_loaded = true;
  }

  // A carried chunk belongs to the sequence whose previous chunk ran, so its line was valid.
  if (!carried) {
    const int64_t line = ops.load_i32_ro(p.cache_indices + pc.seq * p.cache_indices_stride);
    if (p.has_null_line && line == p.null_line) return false;
    if (line < 0 || line >= p.cache_lines) return false;

    if (pc.chunk == 0) {
      // Chunk 0 starts from the state (column 2 is the most recent, column 0 the oldest) or
      // from zeros. The state's 3 columns move through rows 4..6 of the staging area.
      // A bf16 pool (p.state_dtype_is_bf16, warp-uniform) takes the bf16 walks; the values
      // staged are the same either way.
      float* const stage_state = ops.stage() + 4 * staging_pitch(kTile);
      const int64_t state_tile_offset =
          line * p.state_stride_line + tile_begin * p.state_stride_dim;
      const bool has_initial_state =
          p.has_initial_state != nullptr && ops.load_flag(p.has_initial_state + pc.seq);
      if (has_initial_state) {
        if (p.state_dtype_is_bf16) {
          State::gather_bf16(stage_state,
                             static_cast<const uint16_t*>(p.conv_states) + state_tile_offset,
                             p.state_stride_dim, p.state_stride_tap, lane);
        } else {
          State::template gather<false>(
              ops, stage_state, static_cast<const float*>(p.conv_states) + state_tile_offset,
              p.state_stride_dim, p.state_stride_tap, lane);
        }
        ops.syncwarp();
        State::read_lane(ops, stage_state, 0, lane, hist.h3);
        State::read_lane(ops, stage_state, 1, lane, hist.h2);
        State::read_lane(ops, stage_state, 2, lane, hist.h1);
      } else {
        KDA_UNROLL
        for (int v = 0; v < kVec; ++v) hist.h1[v] = hist.h2[v] = hist.h3[v] = 0.0f;
      }
      // The new state is the last 3 entries of (old history, the sequence's tokens): the last
      // 3 tokens when len >= 3; for 1 or 2 tokens the old history shifted left with the tokens
      // appended. It is written now, so nothing of it stays live through the main loop. Every
      // read of the old state happened above, and only chunk 0 of a sequence touches its line.
      float n1[kVec], n2[kVec], n3[kVec];
      row_to_f32<Traits>(ops, seed1, n1);
      if (len >= 2) {
        row_to_f32<Traits>(ops, seed2, n2);
      } else {
        KDA_UNROLL
        for (int v = 0; v < kVec; ++v) n2[v] = hist.h1[v];
      }
      if (len >= 3) {
        row_to_f32<Traits>(ops, seed3, n3);
      } else {
        KDA_UNROLL
        for (int v = 0; v < kVec; ++v) n3[v] = len == 2 ? hist.h1[v] : hist.h2[v];
      }
      ops.syncwarp();  // every lane has read the old state before it is overwritten
      State::write_lane(ops, stage_state, 0, lane, n3);
      State::write_lane(ops, stage_state, 1, lane, n2);
      State::write_lane(ops, stage_state, 2, lane, n1);
      ops.syncwarp();
      if (p.state_dtype_is_bf16) {
        State::scatter_bf16(static_cast<uint16_t*>(p.conv_states) + state_tile_offset,
                            p.state_stride_dim, p.state_stride_tap, stage_state, lane);
      } else {
        State::scatter(ops, static_cast<float*>(p.conv_states) + state_tile_offset,
                       p.state_stride_dim, p.state_stride_tap, stage_state, lane);
      }
      ops.syncwarp();  // the staging rows are free again for the warp's next chunk
    } else {
      row_to_f32<Traits>(ops, seed1, hist.h1);
      row_to_f32<Traits>(ops, seed2, hist.h2);
      row_to_f32<Traits>(ops, seed3, hist.h3);
    }
  }

  char* store_ptr = out_lane + pc.begin * out_row_bytes;
  // One row: the lane's kVec outputs from the row and the 3 history rows, then the history
  // shifts (register renaming once the loops are unrolled).
  const auto convolve_row = [&](const Row& cur, char* dst) {
    float y[kVec];
    KDA_UNROLL
    for (int v = 0; v < kVec; ++v) {
      const float x0 = element_f32<Traits>(ops, cur, v);
      float acc = conv4_tap_fma(hist.h3[v], hist.h2[v], hist.h1[v], x0, taps.w0[v], taps.w1[v],
                                taps.w2[v], taps.w3[v], taps.acc0[v]);
      if constexpr (kSilu) acc = ops.silu(acc);
      y[v] = acc;
      hist.h3[v] = hist.h2[v];
      hist.h2[v] = hist.h1[v];
      hist.h1[v] = x0;
    }
    Row out;
    pack_row<Traits>(ops, y, out);
    ops.template store_out<kBytes>(dst, out);
  };
  if (rows == kQueue) {
    // A full chunk of the default length: every row is in the queue already, and the loop has
    // no per-row guards (the common case).
    KDA_UNROLL
    for (int i = 0; i < kQueue; ++i) convolve_row(queue[i], store_ptr + i * out_row_bytes);
    return true;
  }
  for (int r0 = 0; r0 < rows; r0 += kQueue) {
    KDA_UNROLL
    for (int i = 0; i < kQueue; ++i) {
      const int r = r0 + i;
      if (r < rows) {
        const Row cur = queue[i];
        if (r + kQueue < rows) queue[i] = ops.template load_x<kBytes>(load_ptr);
        load_ptr += x_row_bytes;
        convolve_row(cur, store_ptr);
        store_ptr += out_row_bytes;
      }
    }
  }
  return true;
}

// How many chunk programs CTA x runs: chunks_per_cta, fewer in the grid's last CTA.
KDA_HOST_DEVICE KDA_INLINE int cta_program_count(const PackedConvParams& p, int64_t cta) {
  const int64_t left = p.programs_per_col_block - cta * p.chunks_per_cta;
  return left < p.chunks_per_cta ? static_cast<int>(left) : p.chunks_per_cta;
}

// The chunk programs first_program .. first_program + count - 1 of one column block, run one
// after another by one warp (the kernel's CTA x runs programs x * chunks_per_cta + j). `first`
// is the first one's chunk (the warp searched it). A program that continues the previous one's
// sequence is derived from it (next_chunk_in_sequence) and carries its history; at a sequence
// boundary the warp searches. The taps load once, with the first chunk.
template <class Traits, bool kSilu, bool kHasBias, class Ops>
KDA_HOST_DEVICE KDA_INLINE void packed_conv_programs(const PackedConvParams& p, const varlen::SlotChunk& first,
                                                     int64_t first_program, int count, int64_t plane,
                                                     int64_t plane_col_block, int lane, Ops& ops) {
  LaneTaps<Traits::kVec> taps;
  bool taps_loaded = false;
  LaneHistory<Traits::kVec> hist;
  varlen::SlotChunk pc = first;
  bool carried = false;
  for (int j = 0; j < count; ++j) {
    if (j > 0) {
      varlen::SlotChunk next;
      // A derived chunk is the previous one's successor (chunk + 1) in the same sequence.
      const bool same = varlen::next_chunk_in_sequence(pc, p.num_seqs, p.chunk_shift, first_program + j, next);
      carried = carried && same;
      pc = same ? next : locate_chunk(p, first_program + j, lane, ops);
    }
    carried = packed_conv_chunk<Traits, kSilu, kHasBias>(p, pc, plane, plane_col_block, lane, taps,
                                                         taps_loaded, hist, carried, ops);
  }
}

}  // namespace kda::conv

// The program body on the GPU: the device side of Ops and the kernel. Compiled in
// packed_conv.cu alone (internal linkage); the CPU emulation includes the body without it
// (a host compiler, or KDA_EMULATED_BODIES_ONLY).
#if defined(__CUDACC__) && !defined(KDA_EMULATED_BODIES_ONLY)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace kda::conv {
namespace {

constexpr int kMaxThreadsPerCta = kMaxWarpsPerCta * 32;

// The device side of packed_conv_kernel.cuh's Ops. x, the taps, the bias, query_start_loc,
// cache_indices and has_initial_state are read through the read-only cache: nothing writes
// them during the kernel (supported() rejects an out that overlaps x). The conv state is read
// with plain loads because the same warp writes it.
//
// Results are stored streaming (st.global.cs, evict first from L1 and L2): the kernel never
// reads them again, and L2 keeps more of the row stream (the seed rows that neighbouring
// programs re-read; docs/perf.md).
struct DeviceOps {
  float* stage_area;

  template <int kBytes>
  __device__ __forceinline__ RowOf<kBytes> load_x(const char* ptr) const {
    RowOf<kBytes> r;
    if constexpr (kBytes == 32) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(ptr));
      const uint4 b = __ldg(reinterpret_cast<const uint4*>(ptr) + 1);
      r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
      r.w[4] = b.x; r.w[5] = b.y; r.w[6] = b.z; r.w[7] = b.w;
    } else if constexpr (kBytes == 16) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(ptr));
      r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
    } else if constexpr (kBytes == 8) {
      const uint2 a = __ldg(reinterpret_cast<const uint2*>(ptr));
      r.w[0] = a.x; r.w[1] = a.y;
    } else if constexpr (kBytes == 4) {
      r.w[0] = __ldg(reinterpret_cast<const unsigned int*>(ptr));
    } else {
      static_assert(kBytes == 2, "row bytes");
      r.w[0] = __ldg(reinterpret_cast<const unsigned short*>(ptr));
    }
    return r;
  }

  template <class T>
  __device__ __forceinline__ static void store(T* ptr, T v) { __stcs(ptr, v); }

  template <int kBytes>
  __device__ __forceinline__ void store_out(char* ptr, const RowOf<kBytes>& r) const {
    if constexpr (kBytes == 32) {
      store(reinterpret_cast<uint4*>(ptr), make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]));
      store(reinterpret_cast<uint4*>(ptr) + 1, make_uint4(r.w[4], r.w[5], r.w[6], r.w[7]));
    } else if constexpr (kBytes == 16) {
      store(reinterpret_cast<uint4*>(ptr), make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]));
    } else if constexpr (kBytes == 8) {
      store(reinterpret_cast<uint2*>(ptr), make_uint2(r.w[0], r.w[1]));
    } else if constexpr (kBytes == 4) {
      store(reinterpret_cast<unsigned int*>(ptr), r.w[0]);
    } else {
      static_assert(kBytes == 2, "row bytes");
      store(reinterpret_cast<unsigned short*>(ptr), static_cast<unsigned short>(r.w[0]));
    }
  }

  __device__ __forceinline__ float load_ro(const float* ptr) const { return __ldg(ptr); }
  __device__ __forceinline__ Float4 load4_ro(const float* ptr) const {
    const float4 v = __ldg(reinterpret_cast<const float4*>(ptr));
    return Float4{v.x, v.y, v.z, v.w};
  }
  __device__ __forceinline__ Float4 load4(const float* ptr) const {
    const float4 v = *reinterpret_cast<const float4*>(ptr);
    return Float4{v.x, v.y, v.z, v.w};
  }
  __device__ __forceinline__ void store4(float* ptr, Float4 v) const {
    *reinterpret_cast<float4*>(ptr) = make_float4(v.x, v.y, v.z, v.w);
  }
  __device__ __forceinline__ int32_t load_i32_ro(const int32_t* ptr) const { return __ldg(ptr); }
  __device__ __forceinline__ bool load_flag(const bool* ptr) const {
    return *reinterpret_cast<const unsigned char*>(ptr) != 0;
  }

  __device__ __forceinline__ float from_bits(uint32_t b) const { return __uint_as_float(b); }
  __device__ __forceinline__ uint32_t to_bits(float v) const { return __float_as_uint(v); }
  __device__ __forceinline__ float fp16_to_f32(uint16_t h) const {
    return load_f32(__ushort_as_half(h));
  }
  __device__ __forceinline__ uint16_t f32_to_bf16_rn(float v) const {
    return __bfloat16_as_ushort(store_rn<__nv_bfloat16>(v));
  }
  __device__ __forceinline__ uint16_t f32_to_fp16_rn(float v) const {
    return __half_as_ushort(store_rn<__half>(v));
  }
  // One cvt for two results; the same bits as two single conversions.
  __device__ __forceinline__ uint32_t pack2_bf16_rn(float lo, float hi) const {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ __forceinline__ uint32_t pack2_fp16_rn(float lo, float hi) const {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ __forceinline__ float silu(float acc) const { return silu_stock_fast(acc); }

  __device__ __forceinline__ uint32_t ballot(bool pred) const {
    return __ballot_sync(0xFFFFFFFFu, pred);
  }
  __device__ __forceinline__ int32_t shfl(int32_t v, int src) const {
    return __shfl_sync(0xFFFFFFFFu, v, src);
  }
  __device__ __forceinline__ void syncwarp() const { __syncwarp(); }
  __device__ __forceinline__ float* stage() const { return stage_area; }
};

// CTA (x, y, z): chunk programs x * chunks_per_cta + j, column blocks y * warps + warp of plane z
// (packed_conv.h). Each warp finds its first program's chunk itself (the radix search's
// dependent loads; its CTA's other warps load the same words, which L1 serves) and walks the
// CTA's programs (packed_conv_programs). No barrier: the warps of a CTA never wait for each
// other, so each issues its row loads as soon as its own search answers.
//
// Registers: instances of up to 4 channels per lane are held to 128 per thread (2 CTAs of the
// largest block, 256 threads, per SM: 16 warps, so 4 CTAs of 4 warps or 8 of 2). The bias instances,
// which keep 4 more values live through the chunk loop, would take 165-171 and fit 2 CTAs.
template <typename Traits, bool kSilu, bool kHasBias>
__global__ void __launch_bounds__(kMaxThreadsPerCta, Traits::kVec <= 4 ? 2 : 1)
packed_conv_kernel(const PackedConvParams p) {
  extern __shared__ float4 staging_storage[];
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t plane_col_block = static_cast<int64_t>(blockIdx.y) * (blockDim.x / 32) + warp;
  if (plane_col_block >= p.cols_per_plane) return;  // the last group of a forced warps_per_cta
  DeviceOps ops{reinterpret_cast<float*>(staging_storage) +
                warp * staging_floats_per_warp(Traits::kTile)};
  const int64_t first_program = static_cast<int64_t>(blockIdx.x) * p.chunks_per_cta;
  const varlen::SlotChunk first = locate_chunk(p, first_program, lane, ops);
  packed_conv_programs<Traits, kSilu, kHasBias>(p, first, first_program, cta_program_count(p, blockIdx.x),
                                                blockIdx.z, plane_col_block, lane, ops);
}

}  // namespace
}  // namespace kda::conv

#endif  // __CUDACC__ && !KDA_EMULATED_BODIES_ONLY
