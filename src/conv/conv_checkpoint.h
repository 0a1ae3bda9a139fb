// kda-prefill: conv-state checkpoints. For prefix caching, copies the conv state that a
// sequence has after its first `end` rows of the window (the last 3 conv inputs before that
// offset, docs/stock-conv.md "State update") into another pool line, the checkpoint's.
//
// The module runs it before the packed conv of the same window: it reads the bf16 in_proj
// output columns in place, and, for a checkpoint end below 3, the old taps of the sequence's
// own line, which the packed conv then rewrites. The values are copies (bf16 inputs, or old taps
// of the same pool) stored in the pool's type, fp32 or bf16 (state_dtype): both hold them
// exactly. So a checkpoint line is bitwise the state that the packed conv leaves on a line of
// the same pool after running the sequence cut at `end` rows.
//
// The entries (common/state_checkpoints.h) are read from device memory: one captured launch
// replays with new entries. CUDA-free: conv_checkpoint_plan.cpp is the plan (checks, params),
// conv_checkpoint_kernel.cuh the device code, conv_checkpoint.cu the launch.
#pragma once

#include <cstdint>
#include <string>

#include "common/state_checkpoints.h"
#include "kda/error.h"
#include "kda/types.h"
#include "kda/varlen.h"

namespace kda {

// All strides are in elements. All pointers are device pointers.
struct ConvCheckpointArgs {
  const void* x = nullptr;     // bf16 (num_tokens, dim), column stride 1: the packed conv's x
  int64_t x_row_stride = 0;    // >= dim
  int64_t num_tokens = 0;      // capacity (rows of x)
  int64_t dim = 0;             // channels (3P for the Q|K|V columns)
  void* conv_states = nullptr;   // (varlen.cache_lines, dim, taps), only taps 0..2 read or written
  DType state_dtype = DType::FP32;  // FP32 or BF16 (bf16 inputs: a bf16 line stores them exactly)
  int64_t state_stride_line = 0, state_stride_dim = 0, state_stride_tap = 0;
  // The window's sequences: cache_indices with element stride 1, cache_lines >= 1; sequences on
  // null_line are skipped and no checkpoint is written to it.
  VarlenArgs varlen;
  const CheckpointEntry* entries = nullptr;  // (max_entries), 16-byte aligned; unused: line -1
  int64_t max_entries = 0;                   // capacity; 0: the op does nothing
};

// Semantics (values in fp32, stored in the pool's type), for entry i < max_entries with
// entries[i].line >= 0: with s = entries[i].seq, bos = varlen.query_start_loc[s],
// line_s = varlen.cache_indices[s], for channel c < dim and tap j in 0..2,
// r = end - 3 + j:
//   conv_states[line, c, j] = r >= 0 ? float(x[bos + r, c])
//                                    : has_initial_state[s] ? conv_states[line_s, c, 3 + r] : 0.0f
// The host guarantees well-formed entries (common/state_checkpoints.h); malformed device data
// never makes the kernel touch memory outside the arrays these arguments describe: an entry is
// skipped (writes nothing) when its line is outside [0, cache_lines), the null line or its
// sequence's own line, its seq is outside [0, num_seqs), its sequence's line is the null line or
// outside [0, cache_lines), its sequence's rows are not within [0, num_tokens), or end is
// below 1 or above the sequence's rows. Two entries on one line, or an entry on the line of
// another sequence of the batch, is undefined (validate on the host) but stays in bounds.
//
// The grid is (max_entries, ceil(dim / kConvCheckpointChannelsPerCta)): capacities only, never
// the contents of the entries, so a launch can be captured in a CUDA graph.

// True when the arguments are well formed (state_dtype FP32 or BF16, conv_states aligned to its
// elements, and the grid fits CUDA's limits); otherwise false,
// with the reason in *why when why is non-null (cleared on success). Pointers are needed only
// when max_entries > 0. Reads no device memory.
bool conv_checkpoint_supported(const ConvCheckpointArgs& args, std::string* why = nullptr);

// Enqueues the checkpoint copies on `stream`. Throws kda::Error ("kda::conv_checkpoint"; enqueues
// nothing) when conv_checkpoint_supported() is false; max_entries == 0 enqueues nothing. Makes
// no host synchronisation and allocates nothing, so it may be captured into a CUDA graph.
void conv_checkpoint(const ConvCheckpointArgs& args, Stream stream);

// Channels per CTA (one per thread, the 3 taps each).
constexpr int kConvCheckpointChannelsPerCta = 256;

namespace conv {

// ConvCheckpointArgs as the kernel (and the CPU tests, through conv_checkpoint_kernel.cuh) read
// them: the varlen fields flat, the null line as a value (-1 when varlen.null_line is empty:
// a line below 0 is skipped anyway).
struct ConvCheckpointParams {
  const void* x = nullptr;
  int64_t x_row_stride = 0;
  int64_t num_tokens = 0;
  int64_t dim = 0;
  void* conv_states = nullptr;
  DType state_dtype = DType::FP32;
  int64_t cache_lines = 0;
  int64_t state_stride_line = 0, state_stride_dim = 0, state_stride_tap = 0;
  const int32_t* query_start_loc = nullptr;
  int64_t num_seqs = 0;
  const int32_t* cache_indices = nullptr;
  const bool* has_initial_state = nullptr;
  int32_t null_line = 0;
  const CheckpointEntry* entries = nullptr;
  int64_t max_entries = 0;
};

// The params of args (which passed conv_checkpoint_supported()). Reads no device memory.
ConvCheckpointParams make_checkpoint_params(const ConvCheckpointArgs& args);

}  // namespace conv

}  // namespace kda
