// The packed Q|K|V causal conv1d kernel and its launcher.
//
// One warp is one program: a (sequence, token chunk) from the program map (program_map.h)
// times a tile of 32 * vec channels inside one output plane. Each lane owns vec adjacent
// channels: it keeps their taps, bias and 3 history rows in registers and streams the
// chunk's rows through a register queue of kQueueRows loads in flight. Row accesses are
// vectors of vec elements (8 bytes for the default 4 bf16 channels), coalesced across the warp;
// taps and conv state move through a per-warp shared staging area in memory order.
// The arithmetic is silu_recipe.h's, so the bits are the stock path's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "common/check.h"
#include "common/cuda_check.h"
#include "conv/conv_params.h"
#include "conv/program_map.h"
#include "conv/silu_recipe.h"
#include "kda/packed_conv.h"

namespace kda::conv {

namespace {

constexpr int kMaxThreadsPerCta = kMaxWarpsPerCta * 32;

constexpr int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

template <typename T, int kVecChannels>
struct PackedConvTraits {
  using Elem = T;
  static constexpr int kVec = kVecChannels;                   // channels per lane
  static constexpr int kTile = 32 * kVec;                     // channels per program
  static constexpr int kRowBytes = kVec * int(sizeof(T));     // bytes a lane moves per token
  static constexpr int kWords = kRowBytes >= 4 ? kRowBytes / 4 : 1;
  // About 128 bytes of loads in flight per lane, 4 to 16 rows: 16 rows of 4 bf16 channels,
  // 8 rows of 8 bf16 or 4 fp32 channels, 4 rows of 8 fp32 channels.
  static constexpr int kQueueRows = clamp_int(128 / kRowBytes, 4, 16);

  static_assert(kVec == 1 || kVec == 2 || kVec == 4 || kVec == 8, "vec is 1, 2, 4 or 8");
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "bf16, fp16 or fp32 elements");
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

// x is never written by the kernel (supported() rejects an out that overlaps it), so rows
// are read through the read-only path.
template <int kBytes>
__device__ __forceinline__ RowOf<kBytes> load_row(const char* ptr) {
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

template <int kBytes>
__device__ __forceinline__ void store_row(char* ptr, const RowOf<kBytes>& r) {
  if constexpr (kBytes == 32) {
    reinterpret_cast<uint4*>(ptr)[0] = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
    reinterpret_cast<uint4*>(ptr)[1] = make_uint4(r.w[4], r.w[5], r.w[6], r.w[7]);
  } else if constexpr (kBytes == 16) {
    *reinterpret_cast<uint4*>(ptr) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
  } else if constexpr (kBytes == 8) {
    *reinterpret_cast<uint2*>(ptr) = make_uint2(r.w[0], r.w[1]);
  } else if constexpr (kBytes == 4) {
    *reinterpret_cast<unsigned int*>(ptr) = r.w[0];
  } else {
    static_assert(kBytes == 2, "row bytes");
    *reinterpret_cast<unsigned short*>(ptr) = static_cast<unsigned short>(r.w[0]);
  }
}

// Element i of a row, widened to fp32 (exact).
template <typename T, int kWords>
__device__ __forceinline__ float element_f32(const RowBits<kWords>& r, int i) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(r.w[i]);
  } else {
    const uint32_t word = r.w[i / 2];
    const auto bits = static_cast<unsigned short>((i % 2) ? (word >> 16) : (word & 0xFFFFu));
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return load_f32(__ushort_as_bfloat16(bits));
    } else {
      return load_f32(__ushort_as_half(bits));
    }
  }
}

// The bits of v rounded to nearest even in T, placed as element i of a row.
template <typename T, int kWords>
__device__ __forceinline__ void set_element(RowBits<kWords>& r, int i, float v) {
  if constexpr (sizeof(T) == 4) {
    r.w[i] = __float_as_uint(v);
  } else {
    uint32_t bits;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      bits = __bfloat16_as_ushort(store_rn<__nv_bfloat16>(v));
    } else {
      bits = __half_as_ushort(store_rn<__half>(v));
    }
    if (i % 2 == 0) {
      r.w[i / 2] = bits;
    } else {
      r.w[i / 2] |= bits << 16;
    }
  }
}

// A tile's per-channel parameters, kRows values (taps) for each of kTile channels, move between
// global memory (element strides stride_channel, stride_row) and a warp's shared staging area
// laid out [row][channel], rows kPitch floats apart. The warp walks the global elements in
// memory order, consecutive lanes on consecutive addresses (coalesced), instead of each lane
// fetching its own channels (one cache line per lane per access); each lane then moves its own
// kVec channels between the staging area and registers.
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
  static constexpr int kVectorsPerLane = kRows * kTile / 128;  // float4 per lane in a vector walk
  static constexpr bool kVectorWalks = kVectorsPerLane * 128 == kRows * kTile;
  static_assert(kRows <= 4, "at most 4 rows");
  static_assert(kRows * kTile % 32 == 0, "whole warps of elements");
  static_assert(kRows * kPitch <= staging_floats_per_warp(kTile), "fits the staging area");
  static_assert(kVec == 1 || kVec == 2 || kVec % 4 == 0, "lane vectors of 1, 2 or 4k floats");

  enum class Walk { kBlock, kContiguousRows, kScalar };

  __device__ static Walk walk(const float* base, int64_t stride_channel, int64_t stride_row) {
    if constexpr (kVectorWalks) {
      const bool aligned = (reinterpret_cast<uintptr_t>(base) & 15u) == 0;
      if (aligned && stride_row == 1 && stride_channel == kRows) return Walk::kBlock;
      if (aligned && stride_channel == 1 && stride_row % 4 == 0) return Walk::kContiguousRows;
    }
    return Walk::kScalar;
  }

  // Scalar walk: element e = lane + 32 m, the smaller stride innermost.
  __device__ static void scalar_index(int e, bool rows_inner, int& channel, int& row) {
    channel = rows_inner ? e / kRows : e % kTile;
    row = rows_inner ? e % kRows : e / kTile;
  }

  // kReadOnly: through the read-only cache (the weights). Otherwise plain loads (the state
  // line, which the same warp writes afterwards).
  template <bool kReadOnly>
  __device__ static void gather(float* stage, const float* base, int64_t stride_channel,
                                int64_t stride_row, int lane) {
    const Walk w = walk(base, stride_channel, stride_row);
    if constexpr (kVectorWalks) {
      if (w == Walk::kBlock) {
#pragma unroll
        for (int m = 0; m < kVectorsPerLane; ++m) {
          const int e = 4 * (lane + 32 * m);  // channel-major element index of the block
          const float4 q = load4<kReadOnly>(base + e);
          const float vals[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
          for (int k = 0; k < 4; ++k) stage[((e + k) % kRows) * kPitch + (e + k) / kRows] = vals[k];
        }
        return;
      }
      if (w == Walk::kContiguousRows) {
#pragma unroll
        for (int m = 0; m < kVectorsPerLane; ++m) {
          const int e = 4 * (lane + 32 * m);  // row-major element index
          const int r = e / kTile, c = e % kTile;
          *reinterpret_cast<float4*>(stage + r * kPitch + c) = load4<kReadOnly>(base + r * stride_row + c);
        }
        return;
      }
    }
    const bool rows_inner = stride_row < stride_channel;
#pragma unroll 8
    for (int m = 0; m < kScalarPerLane; ++m) {
      int c, r;
      scalar_index(lane + 32 * m, rows_inner, c, r);
      const float* src = base + c * stride_channel + r * stride_row;
      stage[r * kPitch + c] = kReadOnly ? __ldg(src) : *src;
    }
  }

  __device__ static void scatter(float* base, int64_t stride_channel, int64_t stride_row,
                                 const float* stage, int lane) {
    const Walk w = walk(base, stride_channel, stride_row);
    if constexpr (kVectorWalks) {
      if (w == Walk::kBlock) {
#pragma unroll
        for (int m = 0; m < kVectorsPerLane; ++m) {
          const int e = 4 * (lane + 32 * m);
          float vals[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) vals[k] = stage[((e + k) % kRows) * kPitch + (e + k) / kRows];
          *reinterpret_cast<float4*>(base + e) = make_float4(vals[0], vals[1], vals[2], vals[3]);
        }
        return;
      }
      if (w == Walk::kContiguousRows) {
#pragma unroll
        for (int m = 0; m < kVectorsPerLane; ++m) {
          const int e = 4 * (lane + 32 * m);
          const int r = e / kTile, c = e % kTile;
          *reinterpret_cast<float4*>(base + r * stride_row + c) =
              *reinterpret_cast<const float4*>(stage + r * kPitch + c);
        }
        return;
      }
    }
    const bool rows_inner = stride_row < stride_channel;
#pragma unroll 8
    for (int m = 0; m < kScalarPerLane; ++m) {
      int c, r;
      scalar_index(lane + 32 * m, rows_inner, c, r);
      base[c * stride_channel + r * stride_row] = stage[r * kPitch + c];
    }
  }

  template <bool kReadOnly>
  __device__ static float4 load4(const float* p) {
    if constexpr (kReadOnly) {
      return __ldg(reinterpret_cast<const float4*>(p));
    } else {
      return *reinterpret_cast<const float4*>(p);
    }
  }

  // The lane's kVec channels of one row.
  __device__ static void read_lane(const float* stage, int row, int lane, float (&dst)[kVec]) {
    const float* src = stage + row * kPitch + lane * kVec;
    if constexpr (kVec % 4 == 0) {
#pragma unroll
      for (int v = 0; v < kVec; v += 4) {
        const float4 q = *reinterpret_cast<const float4*>(src + v);
        dst[v] = q.x; dst[v + 1] = q.y; dst[v + 2] = q.z; dst[v + 3] = q.w;
      }
    } else if constexpr (kVec == 2) {
      const float2 q = *reinterpret_cast<const float2*>(src);
      dst[0] = q.x; dst[1] = q.y;
    } else {
      dst[0] = src[0];
    }
  }

  __device__ static void write_lane(float* stage, int row, int lane, const float (&src)[kVec]) {
    float* dst = stage + row * kPitch + lane * kVec;
    if constexpr (kVec % 4 == 0) {
#pragma unroll
      for (int v = 0; v < kVec; v += 4) {
        *reinterpret_cast<float4*>(dst + v) = make_float4(src[v], src[v + 1], src[v + 2], src[v + 3]);
      }
    } else if constexpr (kVec == 2) {
      *reinterpret_cast<float2*>(dst) = make_float2(src[0], src[1]);
    } else {
      dst[0] = src[0];
    }
  }
};

template <typename T, int kWords, int kVec>
__device__ __forceinline__ void row_to_f32(const RowBits<kWords>& r, float (&dst)[kVec]) {
#pragma unroll
  for (int v = 0; v < kVec; ++v) dst[v] = element_f32<T>(r, v);
}

template <typename Traits, bool kSilu, bool kHasBias>
__global__ void __launch_bounds__(kMaxThreadsPerCta)
packed_conv_kernel(const PackedConvParams p) {
  using T = typename Traits::Elem;
  constexpr int kVec = Traits::kVec;
  constexpr int kQueue = Traits::kQueueRows;
  constexpr int kBytes = Traits::kRowBytes;
  constexpr int kTile = Traits::kTile;
  using Row = RowBits<Traits::kWords>;
  using Taps = TileStaging<kTile, kVec, 4>;
  using State = TileStaging<kTile, kVec, 3>;

  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int64_t program = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + warp;
  if (program >= p.num_programs) return;  // warp-uniform, like every early return below
  const int64_t chunk_program = program / p.num_col_blocks;
  const int64_t col_block = program - chunk_program * p.num_col_blocks;

  const ProgramChunk pc = locate_program_warp(p.query_start_loc, p.num_seqs, p.chunk_shift,
                                              p.search_steps, p.search_stride, chunk_program, lane);
  if (pc.seq < 0 || pc.begin >= pc.end) return;
  // Malformed query_start_loc (negative, decreasing, past num_tokens) skips the sequence, so
  // no access leaves x or out. For a well-formed one these never trigger.
  if (pc.seq_begin < 0 || pc.seq_end > p.num_tokens || pc.begin < pc.seq_begin) return;
  const int64_t line = p.cache_indices[pc.seq * p.cache_indices_stride];
  if (p.has_null_block && line == p.null_block_id) return;
  if (line < 0 || line >= p.num_cache_lines) return;

  // The tile lies inside one plane because kTile divides part_dim.
  const int64_t tile_begin = col_block * kTile;
  const int64_t c0 = tile_begin + lane * kVec;  // this lane's first channel
  const int64_t plane = tile_begin / p.part_dim;
  const int64_t plane_col = c0 - plane * p.part_dim;

  const char* x_lane = static_cast<const char*>(p.x) + c0 * int64_t(sizeof(T));
  const int64_t x_row_bytes = p.x_row_stride * int64_t(sizeof(T));
  char* out_lane = static_cast<char*>(p.out) +
                   (plane * p.out_plane_stride + plane_col) * int64_t(sizeof(T));
  const int64_t out_row_bytes = p.part_dim * int64_t(sizeof(T));

  // Rows of this chunk: at most 256, so 32-bit row counters suffice.
  const int rows = static_cast<int>(pc.end - pc.begin);
  const int64_t len = pc.seq_end - pc.seq_begin;  // >= rows >= 1

  // Start-up, in an order that overlaps the latencies while keeping few registers live: the x
  // rows that seed the history (chunk 0: the sequence's last 3 rows, for the new state; later
  // chunks: the 3 rows before the chunk, inside the sequence because chunks are >= 8 tokens),
  // then the taps and the old state through the staging area, then the new state, and only
  // then the row queue of the main loop.
  Row seed1, seed2, seed3;
  const int64_t seed_end = pc.chunk == 0 ? pc.seq_end : pc.begin;
  seed1 = load_row<kBytes>(x_lane + (seed_end - 1) * x_row_bytes);
  if (pc.chunk != 0 || len >= 2) seed2 = load_row<kBytes>(x_lane + (seed_end - 2) * x_row_bytes);
  if (pc.chunk != 0 || len >= 3) seed3 = load_row<kBytes>(x_lane + (seed_end - 3) * x_row_bytes);

  // This warp's staging area: the 4 taps in rows 0..3, the state's 3 columns in rows 4..6.
  extern __shared__ float4 staging_storage[];
  float* const stage_taps =
      reinterpret_cast<float*>(staging_storage) + warp * staging_floats_per_warp(kTile);
  float* const stage_state = stage_taps + 4 * Taps::kPitch;

  Taps::template gather<true>(stage_taps, p.weight + tile_begin * p.weight_stride_dim,
                              p.weight_stride_dim, p.weight_stride_tap, lane);

  float* const state_tile =
      p.conv_states + line * p.state_stride_line + tile_begin * p.state_stride_dim;
  const bool has_initial_state =
      pc.chunk == 0 && p.has_initial_state != nullptr &&
      reinterpret_cast<const unsigned char*>(p.has_initial_state)[pc.seq] != 0;
  if (has_initial_state) {
    State::template gather<false>(stage_state, state_tile, p.state_stride_dim,
                                  p.state_stride_tap, lane);
  }
  __syncwarp();

  float w0[kVec], w1[kVec], w2[kVec], w3[kVec], acc0[kVec];
  Taps::read_lane(stage_taps, 0, lane, w0);
  Taps::read_lane(stage_taps, 1, lane, w1);
  Taps::read_lane(stage_taps, 2, lane, w2);
  Taps::read_lane(stage_taps, 3, lane, w3);
  // Without a bias acc0 is the constant +0.0f, which costs no registers.
#pragma unroll
  for (int v = 0; v < kVec; ++v) acc0[v] = kHasBias ? __ldg(p.bias + c0 + v) : 0.0f;

  // h1 = token t-1 (the most recent), h2 = t-2, h3 = t-3. Chunk 0 starts from the state
  // (column 2 is the most recent, column 0 the oldest) or from zeros.
  float h1[kVec], h2[kVec], h3[kVec];
  if (pc.chunk == 0) {
    if (has_initial_state) {
      State::read_lane(stage_state, 0, lane, h3);
      State::read_lane(stage_state, 1, lane, h2);
      State::read_lane(stage_state, 2, lane, h1);
    } else {
#pragma unroll
      for (int v = 0; v < kVec; ++v) h1[v] = h2[v] = h3[v] = 0.0f;
    }
    // The new state is the last 3 entries of (old history, the sequence's tokens): the last
    // 3 tokens when len >= 3; for 1 or 2 tokens the old history shifted left with the tokens
    // appended. It is written now, so nothing of it stays live through the main loop. Every
    // read of the old state happened above (the __syncwarp orders the staging area), and
    // only chunk 0 of a sequence touches its line.
    float n1[kVec], n2[kVec], n3[kVec];
    row_to_f32<T>(seed1, n1);
    if (len >= 2) {
      row_to_f32<T>(seed2, n2);
    } else {
#pragma unroll
      for (int v = 0; v < kVec; ++v) n2[v] = h1[v];
    }
    if (len >= 3) {
      row_to_f32<T>(seed3, n3);
    } else {
#pragma unroll
      for (int v = 0; v < kVec; ++v) n3[v] = len == 2 ? h1[v] : h2[v];
    }
    __syncwarp();  // every lane has read the old state before it is overwritten
    State::write_lane(stage_state, 0, lane, n3);
    State::write_lane(stage_state, 1, lane, n2);
    State::write_lane(stage_state, 2, lane, n1);
    __syncwarp();
    State::scatter(state_tile, p.state_stride_dim, p.state_stride_tap, stage_state, lane);
  } else {
    row_to_f32<T>(seed1, h1);
    row_to_f32<T>(seed2, h2);
    row_to_f32<T>(seed3, h3);
  }

  // Row r of the chunk is consumed from queue slot r % kQueue, which then loads row
  // r + kQueue; load_ptr always points at row r + kQueue.
  Row queue[kQueue];
  const char* load_ptr = x_lane + pc.begin * x_row_bytes;
#pragma unroll
  for (int i = 0; i < kQueue; ++i) {
    if (i < rows) queue[i] = load_row<kBytes>(load_ptr);
    load_ptr += x_row_bytes;
  }
  char* store_ptr = out_lane + pc.begin * out_row_bytes;
  for (int r0 = 0; r0 < rows; r0 += kQueue) {
#pragma unroll
    for (int i = 0; i < kQueue; ++i) {
      const int r = r0 + i;
      if (r < rows) {
        const Row cur = queue[i];
        if (r + kQueue < rows) queue[i] = load_row<kBytes>(load_ptr);
        load_ptr += x_row_bytes;
        Row y;
#pragma unroll
        for (int v = 0; v < kVec; ++v) {
          const float x0 = element_f32<T>(cur, v);
          float acc = conv4_tap_fma(h3[v], h2[v], h1[v], x0, w0[v], w1[v], w2[v], w3[v], acc0[v]);
          if constexpr (kSilu) acc = silu_stock(acc);
          set_element<T>(y, v, acc);
          h3[v] = h2[v];
          h2[v] = h1[v];
          h1[v] = x0;
        }
        store_row<kBytes>(store_ptr, y);
        store_ptr += out_row_bytes;
      }
    }
  }
}

template <typename T, int kVec>
void launch_instance(const PackedConvParams& p, cudaStream_t stream) {
  using Traits = PackedConvTraits<T, kVec>;
  const dim3 grid(static_cast<unsigned>(p.num_ctas));
  const dim3 block(static_cast<unsigned>(p.warps_per_cta * 32));
  const std::size_t staging_bytes =
      static_cast<std::size_t>(p.warps_per_cta) * staging_bytes_per_warp(Traits::kTile);
  const bool has_bias = p.bias != nullptr;
  if (p.silu && has_bias) {
    packed_conv_kernel<Traits, true, true><<<grid, block, staging_bytes, stream>>>(p);
  } else if (p.silu) {
    packed_conv_kernel<Traits, true, false><<<grid, block, staging_bytes, stream>>>(p);
  } else if (has_bias) {
    packed_conv_kernel<Traits, false, true><<<grid, block, staging_bytes, stream>>>(p);
  } else {
    packed_conv_kernel<Traits, false, false><<<grid, block, staging_bytes, stream>>>(p);
  }
}

template <typename T>
void launch_for_vec(const PackedConvParams& p, cudaStream_t stream, const char* function) {
  switch (p.vec) {
    case 8: return launch_instance<T, 8>(p, stream);
    case 4: return launch_instance<T, 4>(p, stream);
    case 2: return launch_instance<T, 2>(p, stream);
    case 1: return launch_instance<T, 1>(p, stream);
    default: KDA_FAIL(function, "vec ", p.vec, " has no kernel instance; supported are 8, 4, 2, 1");
  }
}

void run(const PackedConvArgs& args, const ConvTuning& tuning, Stream stream,
         const char* function) {
  std::string why;
  if (!packed_causal_conv1d_supported(args, &why)) KDA_FAIL(function, why);
  why = check_tuning(args, tuning);
  if (!why.empty()) KDA_FAIL(function, why);
  if (args.num_tokens == 0 || args.num_seqs == 0) return;
  const PackedConvParams p = make_params(args, tuning);
  KDA_CHECK(p.num_ctas <= std::numeric_limits<int32_t>::max(), function, "the launch needs ",
            p.num_ctas, " thread blocks, more than the 2147483647 a grid can hold");
  const auto s = static_cast<cudaStream_t>(stream);
  switch (p.x_dtype) {
    case DType::BF16: launch_for_vec<__nv_bfloat16>(p, s, function); break;
    case DType::FP16: launch_for_vec<__half>(p, s, function); break;
    case DType::FP32: launch_for_vec<float>(p, s, function); break;
    default:
      KDA_FAIL(function, "x_dtype ", static_cast<int>(p.x_dtype),
               " has no kernel instance; supported are bf16, fp16 and fp32");
  }
  KDA_CUDA_CHECK(function, cudaGetLastError());
}

}  // namespace

void launch_packed_conv(const PackedConvArgs& args, const ConvTuning& tuning, Stream stream) {
  run(args, tuning, stream, "kda::conv::launch_packed_conv");
}

}  // namespace kda::conv

namespace kda {

void packed_causal_conv1d(const PackedConvArgs& args, Stream stream) {
  conv::run(args, conv::ConvTuning{}, stream, "kda::packed_causal_conv1d");
}

}  // namespace kda
