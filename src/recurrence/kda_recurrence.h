// The KDA recurrence (docs/layer.md steps 4 and 5): the per-token prep fused into the gated
// delta rule. Two kernels compute the same op from the same RecurrenceArgs:
// kda_recurrence_token (kda_recurrence_token.h: token by token, the reference path) and
// kda_chunked (kda_chunked.h: 64-token chunks on tensor cores, the fast path). This header
// holds what they share: the arguments, their checks (recurrence::args_supported), the
// kernel-facing params and the checkpoint lookups. CUDA-free: host code, the plan files and the
// CPU emulation tests include it; kda_recurrence_plan.cpp defines its functions.
//
// All pointers are device pointers, all strides are in elements, bf16 tensors are row-major
// with column stride 1. Row counts are capacities (a bucket's rows) and the grids depend only
// on them, on varlen.num_seqs and on the head count, never on the batch: a launch can be
// captured in a CUDA graph once and replayed with new query_start_loc / cache_indices /
// has_initial_state. Each launcher checks its arguments with its op's *_supported() (which
// reads no device memory), builds the kernels' params once and throws kda::Error, enqueueing
// nothing, when the arguments are unusable.
// Both kernels also write state checkpoints (common/state_checkpoints.h, for prefix caching):
// a sequence's state after chosen numbers of its rows (multiples of 64 or all of them) into
// further pool lines, bitwise the final line that the same kernel leaves when the sequence is
// cut there (in a bf16 pool too: the same fp32 state rounded the same way). A run continued
// from a checkpoint line of a bf16 pool starts from the rounded state, so unlike one from an
// fp32 line it is not bitwise the uninterrupted run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "common/host_device.h"
#include "common/state_checkpoints.h"
#include "kda/types.h"
#include "kda/varlen.h"

// cuda_bf16.h's bf16 type, declared here as that header declares it: host code only stores
// and passes on pointers to it; the kernels include cuda_bf16.h and do the arithmetic.
struct __nv_bfloat16;

namespace kda {

// Chunk length of the chunked recurrence (tokens); chunks start at each sequence's first
// token. Both kernels look state checkpoints up at these chunk ends.
constexpr int64_t kKdaChunk = 64;
static_assert(kCheckpointChunk == kKdaChunk,
              "checkpoint offsets must fall on the chunked recurrence's chunk ends");

// Steps 4 and 5 (docs/layer.md) per (sequence, head): L2-normalise q and k (eps 1e-6), q *= 128^-0.5,
// g = -exp(A_log[h]) * softplus(g1 + dt_bias) (or the lower-bound variant), beta = sigmoid(b),
// then the gated delta rule token by token in fp32 from the pool line (zeros when the sequence
// has no initial state) and the final state written back to that line.
//
// Sequence s owns rows [query_start_loc[s], query_start_loc[s+1]) (clamped to
// [0, num_tokens)). A sequence that is empty, or whose cache index is varlen.null_line or
// outside [0, varlen.cache_lines), writes no o row and reads or writes no pool line. o rows
// that belong to no processed sequence are never written. Two processed sequences naming the
// same line is undefined behaviour (the batch validator rejects it).
struct RecurrenceArgs {
  int64_t num_heads = 0;   // H; P = H x head_dim
  int64_t head_dim = 128;  // K = V; only 128 is supported
  int64_t num_tokens = 0;  // rows of q, k, v, g1, b and o

  // The batch (cache_indices with element stride 1) and the recurrent-state pool's lines. The
  // token kernel's grid has varlen.num_seqs x H x 4 blocks.
  VarlenArgs varlen;

  // q, k, v: (num_tokens, P) bf16 conv planes sharing one row stride.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t qkv_row_stride = 0;  // >= P, a multiple of 4
  const void* g1 = nullptr;    // (num_tokens, P) bf16, f_a @ f_b^T
  int64_t g1_row_stride = 0;   // >= P, a multiple of 4
  // The beta logit of (token t, head h) is b[t * b_row_stride + b_col_offset + h], bf16: the
  // b columns of the in_proj output read in place.
  const void* b = nullptr;
  int64_t b_row_stride = 0;
  int64_t b_col_offset = 0;
  const float* a_log = nullptr;    // (H) fp32
  const float* dt_bias = nullptr;  // (P) fp32
  std::optional<double> gate_lower_bound;  // finite and < 0 when set (K3-style decay)

  // Recurrent-state pool (varlen.cache_lines, H, K, V), read and written in place; any strides
  // that do not make two elements overlap (e.g. (line, head, v, k) order). Elements are FP32
  // or BF16 (state_dtype): the kernels carry the state in fp32 and round a bf16 line once per
  // store (common/state_elements.h); strides count elements of that type.
  void* states = nullptr;
  DType state_dtype = DType::FP32;
  int64_t state_stride_line = 0, state_stride_head = 0, state_stride_k = 0, state_stride_v = 0;

  void* o = nullptr;         // (num_tokens, H, V) bf16, rounded to nearest even
  int64_t o_row_stride = 0;  // >= P

  // State checkpoints (common/state_checkpoints.h); both null: none. checkpoint_seqs has
  // varlen.num_seqs entries, checkpoint_entries max_checkpoints. Sequence s's state after
  // checkpoint_entries[i].end of its rows (i from checkpoint_seqs[s]) is also written to
  // recurrent-pool line checkpoint_entries[i].line. Both tables are device memory, 16-byte
  // aligned, and keep that header's invariants (ends on chunk ends or the sequence's last row,
  // lines that no sequence of the batch names); an entry index outside the table, or a line
  // that is the null line or outside [0, cache_lines), is not written.
  const CheckpointSeq* checkpoint_seqs = nullptr;
  const CheckpointEntry* checkpoint_entries = nullptr;
  int64_t max_checkpoints = 0;

  // kda_chunked only (kda_recurrence_token ignores it): sequence parallelism, the length in
  // tokens of the segments a sequence is cut into from its first row (kda_chunked.h).
  // kKdaAutoSegments (-1): the op's choice from the capacities and the device's SM count
  // (kda_chunked_auto_segment_tokens); 0: never cut; otherwise a power of two >= 64. Tokens
  // from the caller to kda_chunked_plan.cpp; only the kernel params hold it as a shift.
  int64_t segment_tokens = -1;
};

}  // namespace kda

namespace kda::recurrence {

constexpr int kHeadDim = 128;    // K = V, the one head size the kernels have
constexpr int kChunkShift = 6;   // kda_chunked's chunk: 64 tokens
static_assert((int64_t{1} << kChunkShift) == kKdaChunk, "the chunk length and its shift");
// kda_recurrence_token's grid has kTokenSlices blocks per head in y (<= 65535); both kernels
// accept the same head counts, so that a caller may run either on the same arguments.
constexpr int kTokenSlices = 4;
constexpr int64_t kMaxHeads = 65535 / kTokenSlices;

// RecurrenceArgs as the kernels read them: typed pointers (the state pool's element type as a
// flag, state_dtype_is_bf16), b offset to its columns, the gate's lower bound as fp32, and the
// varlen map's launch facts of the chunked kernel. Element strides throughout.
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

  // The state pool and the output. Pool elements are fp32, or bf16 when state_dtype_is_bf16
  // (RecurrenceArgs::state_dtype == DType::BF16; common/state_elements.h: loads widen exactly,
  // stores round to nearest even); the strides count elements of that type. The kernels carry
  // the state in fp32 either way and touch the pool only to load a sequence's line once and to
  // store it at checkpoints and at the end, so the element type is this run-time flag, not a
  // template parameter.
  void* states;
  bool state_dtype_is_bf16;
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
  unsigned char* workspace;  // nullptr for kda_recurrence_token

  // kda_chunked's sequence parallelism (kda_chunked_kernel_state.cuh, block_walk): a sequence's
  // chunks are cut into segments of 2^seg_chunk_shift chunks from its first row; segment slots
  // follow the varlen map with 2^(6 + seg_chunk_shift)-token chunks. kNoSegments: one segment
  // per sequence, and slot = sequence. seg_states / seg_trans: seg_slots x H fp32 128 x 128
  // matrices in the workspace (after the records), null when not segmented.
  int seg_chunk_shift;
  int64_t seg_slots;
  float* seg_states;
  float* seg_trans;
};

// seg_chunk_shift of an op that does not cut sequences (2^40 chunks: more than any batch).
constexpr int kNoSegments = 40;

// The checks both kernels make: true when `args` are well formed for them (the token grid's
// head limit included); otherwise false with the reason in *why. Reads no device memory. Each
// op's supported() starts with it (kda_recurrence_token_supported, kda_chunked_supported).
bool args_supported(const RecurrenceArgs& args, std::string* why);

// The params both kernels read, for `args` that passed args_supported(): no workspace, whole
// sequences (kda_chunked's make_chunked_params adds its workspace and segments). Reads no
// device memory.
RecurrenceParams make_recurrence_params(const RecurrenceArgs& args);

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

}  // namespace kda::recurrence
