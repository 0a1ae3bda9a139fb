// The kernel-facing parameters of the KDA recurrence, one struct for both kernels of
// kda_recurrence.h (kda_prep_recurrence, token by token, and kda_chunked), built once per
// launch by make_recurrence_params() from PrepRecurrenceArgs that passed
// kda_prep_recurrence_supported() (the argument checks both kernels share).
// CUDA-free: host code and the CPU emulation tests include it; recurrence_params.cpp defines
// the functions.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/host_device.h"
#include "common/state_checkpoints.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_recurrence.h"

// cuda_bf16.h's bf16 type, declared here as that header declares it: host code only stores
// and passes on pointers to it; the kernels include cuda_bf16.h and do the arithmetic.
struct __nv_bfloat16;

static_assert(kda::kCheckpointChunk == kda::kKdaChunk,
              "checkpoint offsets must fall on the chunked recurrence's chunk ends");

namespace kda::recurrence {

constexpr int kHeadDim = 128;    // K = V, the one head size the kernels have
constexpr int kChunkShift = 6;   // kda_chunked's chunk: 64 tokens
static_assert((int64_t{1} << kChunkShift) == kKdaChunk, "kda_chunked.h's chunk length");
// kda_prep_recurrence's grid has kTokenSlices blocks per head in y (<= 65535); both kernels
// accept the same head counts, so that a caller may run either on the same arguments.
constexpr int kTokenSlices = 4;
constexpr int64_t kMaxHeads = 65535 / kTokenSlices;

// PrepRecurrenceArgs as the kernels read them: typed pointers (the state pool's element type
// as a flag), b offset to its columns, the gate's lower bound as fp32, and the varlen map's
// launch facts of the chunked kernel. Element strides throughout.
struct RecurrenceParams {
  // Batch metadata (capacities: the grids depend on them only).
  const int32_t* query_start_loc;
  const int32_t* cache_indices;
  const bool* has_initial_state;  // nullptr: no sequence has an initial state
  int32_t null_line;
  int64_t cache_lines;
  int64_t num_tokens;
  int64_t num_seqs;
  int num_heads;

  // Inputs.
  const __nv_bfloat16* q;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  int64_t qkv_stride;
  const __nv_bfloat16* g1;
  int64_t g1_stride;
  const __nv_bfloat16* b;  // already offset to the b columns: head h is b[t * b_stride + h]
  int64_t b_stride;
  const float* a_log;
  const float* dt_bias;
  float lower_bound;  // the bounded gate's bound; read only by the kernels instantiated for it

  // The state pool and the output. Pool elements are fp32, or bf16 when state_bf16
  // (common/state_storage.h: loads widen exactly, stores round to nearest even); the strides
  // count elements of that type. The kernels carry the state in fp32 either way and touch the
  // pool only to load a sequence's line once and to store it at checkpoints and at the end,
  // so the element type is this run-time flag, not a template parameter.
  void* states;
  bool state_bf16;
  int64_t state_line, state_head, state_k, state_v;
  __nv_bfloat16* o;
  int64_t o_stride;

  // State checkpoints (common/state_checkpoints.h): both null, or num_seqs and max_checkpoints
  // entries.
  const CheckpointSeq* checkpoint_seqs;
  const CheckpointEntry* checkpoint_entries;
  int64_t max_checkpoints;

  // kda_chunked only: chunk slots (common/varlen_map.h, 64-token chunks), the radix search
  // over query_start_loc, and the workspace of per-(slot, head) records.
  int64_t slots;  // (num_tokens >> 6) + num_seqs
  int search_steps;
  int64_t search_stride;
  unsigned char* workspace;  // nullptr for kda_prep_recurrence

  // kda_chunked's sequence parallelism (kda_chunked_body.cuh, "Segments"): a sequence's chunks
  // are cut into segments of 2^seg_chunk_shift chunks from its first row; segment slots follow
  // the varlen map with 2^(6 + seg_chunk_shift)-token chunks. kNoSegments: one segment per
  // sequence, and slot = sequence. seg_states / seg_trans: seg_slots x H fp32 128 x 128
  // matrices in the workspace (after the records), null when not segmented.
  int seg_chunk_shift;
  int64_t seg_slots;
  float* seg_states;
  float* seg_trans;
};

// seg_chunk_shift of an op that does not cut sequences (2^40 chunks: more than any batch).
constexpr int kNoSegments = 40;
// The smallest segment auto_segment_shift picks: 16 chunks (1024 tokens).
constexpr int kMinAutoSegmentShift = 4;
// Bytes of one (chunk slot, head) record of kda_chunked (chunked::Record::kBytes).
constexpr std::size_t kRecordBytes = 90624;

// kda_chunked's workspace for `args`, cut into segments of 2^seg_chunk_shift chunks
// (kNoSegments: not cut): the records, then the segment-end states E and transitions P.
struct ChunkedLayout {
  int seg_chunk_shift = kNoSegments;
  int64_t slots = 0, seg_slots = 0;
  std::size_t record_bytes = 0;  // slots x H x Record bytes
  std::size_t seg_bytes = 0;     // each of E and P: seg_slots x H x 64 KB (0 when not cut)
  std::size_t total() const { return record_bytes + 2 * seg_bytes; }
};
ChunkedLayout chunked_layout(const PrepRecurrenceArgs& args, int seg_chunk_shift);

// The segment length (as seg_chunk_shift) kda_chunked picks for args.segment_tokens ==
// kKdaAutoSegments on a device of `sm_count` SMs: the one with the smallest modelled phase-2
// time for a single sequence of num_tokens, or kNoSegments when no cut saves a fifth of the
// uncut walk (docs/design.md, "Segments", has the model). Host arithmetic only.
int auto_segment_shift(int64_t num_tokens, int64_t num_heads, int sm_count);

// seg_chunk_shift for args on a device of sm_count SMs: args.segment_tokens if set, else
// auto_segment_shift. args passed kda_chunked_supported.
int segment_shift_of(const PrepRecurrenceArgs& args, int sm_count);

// Sequence `seq`'s checkpoints (none when the op has no checkpoint tables): read once per
// block, before its token loop, so that the test at each chunk end is integer arithmetic.
KDA_HOST_DEVICE inline CheckpointSeq checkpoints_of(const RecurrenceParams& p, int64_t seq) {
  return p.checkpoint_seqs != nullptr ? p.checkpoint_seqs[seq] : CheckpointSeq{};
}

// The pool line that checkpoint `i` (checkpoint_at's result) writes, or -1: none (i < 0), or
// an entry the kernels do not write (outside the table, naming the null line or no pool line).
// The host's invariants make the second case impossible; the test keeps a malformed table
// from writing outside the pool.
KDA_HOST_DEVICE inline int64_t checkpoint_line(const RecurrenceParams& p, int32_t i) {
  if (i < 0 || i >= p.max_checkpoints) return -1;
  const int32_t line = p.checkpoint_entries[i].line;
  return line == p.null_line || line < 0 || line >= p.cache_lines ? -1 : line;
}

// The params of `args` (which passed kda_prep_recurrence_supported()); `workspace` is
// kda_chunked's, nullptr for kda_prep_recurrence. Reads no device memory.
RecurrenceParams make_recurrence_params(const PrepRecurrenceArgs& args,
                                        void* workspace = nullptr,
                                        int seg_chunk_shift = kNoSegments);

}  // namespace kda::recurrence
