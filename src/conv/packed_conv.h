// The packed conv inside the library: its public Args, supported() and launch are
// kda/packed_conv.h's; this header adds the forced tunings, the kernel-facing params and the
// plan functions (packed_conv_plan.cpp: the checks, the launch shape), the launch with a
// tuning (packed_conv.cu) and the staging layout the device code (packed_conv_kernel.cuh)
// shares. Plain C++ (no CUDA headers): the launcher, benchmarks and CPU tests share it.
#pragma once

#include <cstdint>
#include <string>

#include "kda/packed_conv.h"

namespace kda::conv {

// Choices a benchmark may force; 0 means the launcher's default.
struct ConvTuning {
  int vec = 0;            // channels per lane: 8, 4, 2 or 1 (tile = 32 * vec channels)
  int chunk_len = 0;      // tokens per program: 8, 16, 32, 64, 128 or 256
  int warps_per_cta = 0;  // 1, 2, 4 or 8; each warp is one column block
  int chunks_per_cta = 0; // 1, 2, 4, 8 or 16 consecutive chunk programs per CTA
};

// Everything the kernel reads, from PackedConvArgs plus the launch shape. Element strides.
struct PackedConvParams {
  const void* x = nullptr;
  void* out = nullptr;
  const float* weight = nullptr;
  const float* bias = nullptr;  // nullptr: acc starts at +0.0f
  void* conv_states = nullptr;  // elements of the pool's type: fp32, or bf16 with state_dtype_is_bf16
  const int32_t* query_start_loc = nullptr;
  const int32_t* cache_indices = nullptr;
  const bool* has_initial_state = nullptr;  // nullptr: no sequence has an initial state

  int64_t num_tokens = 0;  // capacity; rows past query_start_loc[num_seqs] are not written
  int64_t num_seqs = 0;    // capacity
  int64_t dim = 0;
  int64_t part_dim = 0;
  int64_t x_row_stride = 0;
  int64_t weight_stride_dim = 0, weight_stride_tap = 0;
  int64_t cache_lines = 0;
  int64_t state_stride_line = 0, state_stride_dim = 0, state_stride_tap = 0;
  int64_t cache_indices_stride = 0;
  int64_t out_plane_stride = 0;  // resolved: never 0
  int32_t null_line = 0;
  bool has_null_line = false;
  bool silu = true;
  DType x_dtype = DType::BF16;
  // The pool stores bf16 (state_dtype BF16, only with bf16 x): a line then holds the same bf16
  // inputs an fp32 line would hold widened. A run-time flag, not a template parameter: the state
  // moves once per sequence (packed_conv_kernel.cuh), so no kernel is instantiated twice for it.
  bool state_dtype_is_bf16 = false;

  // Launch shape.
  int vec = 0;          // channels per lane
  int tile = 0;         // channels per program = 32 * vec; divides part_dim
  int chunk_shift = 0;  // tokens per program = 1 << chunk_shift
  int search_steps = 0;
  int64_t search_stride = 0;
  int64_t num_col_blocks = 0;          // dim / tile
  int64_t planes = 0;                  // dim / part_dim
  int64_t cols_per_plane = 0;          // part_dim / tile column blocks per plane
  int64_t programs_per_col_block = 0;  // (num_tokens >> chunk_shift) + num_seqs
  int64_t num_programs = 0;            // programs_per_col_block * num_col_blocks
  int warps_per_cta = 0;
  // The grid is (cta_programs, col_groups_per_plane, planes): CTA (x, y, z) runs chunk
  // programs x * chunks_per_cta + j (j < chunks_per_cta, < programs_per_col_block) one after
  // another, on column blocks y * warps_per_cta + w (w < warps_per_cta, < cols_per_plane) of
  // plane z. Every warp searches its first chunk itself (no barrier: a warp that waited for
  // another's search would start its row loads later) and derives the next ones without a
  // search up to a sequence boundary (carrying its history there); no program index is ever
  // divided. Chunk programs vary fastest, so the CTAs in flight read a band of columns over
  // many rows rather than a whole row's column groups next to each other (docs/perf.md).
  int chunks_per_cta = 1;
  int64_t cta_programs = 0;          // ceil(programs_per_col_block / chunks_per_cta)
  int64_t col_groups_per_plane = 0;  // ceil(cols_per_plane / warps_per_cta)
  int64_t num_ctas = 0;              // the product of the grid's three extents
};

// CUDA's grid limits: a launch beyond them is refused by check_grid (in supported(),
// check_tuning() and the launcher, each on the params it builds).
constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxGridX = 2147483647;

// Empty when the launch shape of p fits CUDA's grid limits, otherwise why not.
std::string check_grid(const PackedConvParams& p);

// The default vector width (channels per lane): the widest of 4, 2, 1 such that 32 * vec
// divides part_dim and the x pointer, the x row stride in bytes, the out pointer and the out
// plane stride in bytes are multiples of min(16, vec * element size). vec 4 (128-channel
// tiles, 8-byte bf16 accesses) rather than 8: it fits in 128 registers, so twice as many
// warps fit an SM as with vec 8, with the same bytes in flight per warp (docs/perf.md). vec 8
// is available through ConvTuning. Narrower vectors give the same bits.
int default_vec(const PackedConvArgs& args);

// Consecutive chunk programs per CTA when not forced: 2 from 4096 tokens of capacity, else 1.
// A warp that runs the next chunk of its sequence carries the last 3 rows instead of reading
// them again and skips the search, the taps and the cache line; below 4096 tokens halving the
// CTAs costs more than that saves (docs/perf.md). Like the chunk length it depends on
// capacities only, so a captured grid stays valid.
int default_chunks_per_cta(int64_t num_tokens);

// Tokens per program when not forced: one length for every shape (docs/perf.md: a program's
// fixed cost, the radix search and the first loads, is latency that more programs in flight
// hide better than longer streams do). Never derived from the pointer alignment that picks
// the vector width, so a captured grid stays valid.
constexpr int kDefaultChunkLen = 16;

// Warps per CTA when not forced: 2 below 4096 tokens of capacity (where a CTA runs one chunk
// program), else 4; halved while it does not divide a plane's cols_per_plane column blocks (so
// no warp of the grid idles). With one program per CTA the smaller CTAs schedule better
// (docs/perf.md). Capacities only: graph-safe.
int default_warps_per_cta(int64_t num_tokens, int64_t cols_per_plane);
constexpr int kMaxWarpsPerCta = 8;

// Each warp stages its tile's 4 taps and 3 state columns in shared memory, rows padded by 8
// floats. A launch stays within the 48 KiB of dynamic shared memory available without opt-in.
constexpr int staging_pitch(int tile) { return tile + 8; }
constexpr int staging_floats_per_warp(int tile) { return 7 * staging_pitch(tile); }
constexpr int64_t staging_bytes_per_warp(int tile) { return staging_floats_per_warp(tile) * 4; }
constexpr int64_t kMaxStagingBytes = 48 * 1024;

// The checks of packed_causal_conv1d_supported() that need no launch shape: true when the
// kernel runs `args` bit for bit whatever the grid; otherwise false with the reason in *why.
// Reads no device memory. supported() adds check_grid() of the default shape.
bool args_supported(const PackedConvArgs& args, std::string* why);

// Empty when the forced values of `tuning` are kernel instances that fit `args` (vector
// alignment, shared memory), otherwise why not (a sentence naming the allowed values). The
// grid is not checked: that is check_grid()'s, on the params of the launch.
std::string check_tuning_values(const PackedConvArgs& args, const ConvTuning& tuning);

// check_tuning_values(), then (for a non-empty batch) check_grid() of the params `tuning`
// gives: empty when `tuning` can run `args`.
std::string check_tuning(const PackedConvArgs& args, const ConvTuning& tuning);

// Params for args that passed args_supported() and a tuning that passed
// check_tuning_values(); zero fields of tuning take the defaults. The grid is check_grid()'s.
PackedConvParams make_params(const PackedConvArgs& args, const ConvTuning& tuning = {});

// Enqueues the kernel with a forced tuning (for benchmarks and tests of every instance):
// args_supported(), check_tuning_values(), then the params built once, check_grid() on them and
// the launch. Throws kda::Error ("kda::conv::launch_packed_conv") when a check fails; enqueues
// nothing then. packed_causal_conv1d(args, s) is launch_packed_conv(args, {}, s).
void launch_packed_conv(const PackedConvArgs& args, const ConvTuning& tuning, Stream stream);

}  // namespace kda::conv
