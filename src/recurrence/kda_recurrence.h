// The KDA recurrence (docs/layer.md steps 4 and 5): the per-token prep fused into the gated
// delta rule. Two kernels compute the same op from the same arguments: kda_prep_recurrence
// (token by token, the reference path) and kda_chunked (kda_chunked.h, the fast path).
// CUDA-free: host code includes this header, the kernels live in the .cu files beside it.
//
// All pointers are device pointers, all strides are in elements, bf16 tensors are row-major
// with column stride 1. Row counts are capacities (a bucket's rows) and the grids depend only
// on them, on num_seqs and on the head count, never on the batch: a launch can be captured in
// a CUDA graph once and replayed with new query_start_loc / cache_indices / has_initial_state.
// Each launcher checks its arguments with the matching *_supported() (which reads no device
// memory), builds the kernels' params once (recurrence_params.h, shared by both) and throws
// kda::Error, enqueueing nothing, when the arguments are unusable.
// Both kernels also write state checkpoints (common/state_checkpoints.h, for prefix caching):
// a sequence's state after chosen numbers of its rows (multiples of 64 or all of them) into
// further pool lines, bitwise the final line that the same kernel leaves when the sequence is
// cut there (in a bf16 pool too: the same fp32 state rounded the same way). A run continued
// from a checkpoint line of a bf16 pool starts from the rounded state, so unlike one from an
// fp32 line it is not bitwise the uninterrupted run.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/state_checkpoints.h"
#include "kda/types.h"
#include "kda/varlen.h"

namespace kda {

// Steps 4 and 5 (docs/layer.md) per (sequence, head): L2-normalise q and k (eps 1e-6), q *= 128^-0.5,
// g = -exp(A_log[h]) * softplus(g1 + dt_bias) (or the lower-bound variant), beta = sigmoid(b),
// then the gated delta rule token by token in fp32 from the pool line (zeros when the sequence
// has no initial state) and the final state written back to that line.
//
// Sequence s owns rows [query_start_loc[s], query_start_loc[s+1]) (clamped to
// [0, num_tokens)). A sequence that is empty, or whose cache index is varlen.null_line or
// outside [0, varlen.cache_lines), writes no o row and reads or writes no pool line. o rows that belong to no
// processed sequence are never written. Two processed sequences naming the same line is
// undefined behaviour (the batch validator rejects it).
struct PrepRecurrenceArgs {
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

  // Recurrent-state pool (varlen.cache_lines, H, K, V), read and written in place; any strides that
  // do not make two elements overlap (e.g. (line, head, v, k) order). Elements are FP32 or BF16
  // (state_dtype): the kernels carry the state in fp32 and round a bf16 line once per store
  // (common/state_storage.h); strides count elements of that type.
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

  // kda_chunked only (kda_prep_recurrence ignores it): sequence parallelism, the length of the
  // segments a sequence is cut into (kda_chunked.h). kKdaAutoSegments (-1): the op's choice
  // from the capacities and the device's SM count; 0: never cut; otherwise a power of two
  // >= 64 (tokens).
  int64_t segment_tokens = -1;
};

// True when both kernels can run `args` (the argument checks they share; kda_chunked_supported
// adds the chunked grid's limits); otherwise false with the reason in *why. Reads no device
// memory.
bool kda_prep_recurrence_supported(const PrepRecurrenceArgs& args, std::string* why = nullptr);
void kda_prep_recurrence(const PrepRecurrenceArgs& args, Stream stream);

}  // namespace kda
