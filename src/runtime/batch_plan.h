// Host-side planning of one forward: batch validation, bucket choice, window split and the
// staged metadata of each window. Plain C++ (no CUDA) so CI tests all of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kda/config.h"
#include "kda/prefill.h"

namespace kda::detail {

// Throws kda::Error (function "kda::PrefillModule::begin_forward") naming the first problem
// (which array, which index, which value, what was expected), checked in this order: num_seqs
// outside [0, max_seqs], null arrays, query_start_loc[0] != 0, a decrease, more tokens than
// runtime.batch_token_capacity(), a cache index outside [0, cache_lines), a real (non-null)
// cache line named twice; then the checkpoints (BatchView::checkpoint_*, in the order the
// header lists their refusals, per sequence). The null line may repeat. With num_seqs == 0 no
// array is read (they may be null). Reads only the batch. Allocates a duplicate table per call:
// the module uses BatchValidator instead.
void validate_batch(const BatchView& batch, const Config& config);

// validate_batch without per-call allocation: duplicate cache lines are found with a
// generation-stamped table of cache_lines entries, so a call costs O(num_seqs) and never
// clears the table (except once every 2^32 calls, when the stamp wraps). Same checks, order
// and messages as validate_batch. Holds a copy of the limits it needs, not the Config.
class BatchValidator {
 public:
  explicit BatchValidator(const Config& config);
  void validate(const BatchView& batch);

 private:
  struct Stamp {
    uint32_t generation = 0;  // == generation_: the line was named in the current call
    int32_t seq = 0;          // the batch index that named it, or for a checkpoint line the
                              // index into checkpoint_lines
    bool checkpoint = false;  // named by checkpoint_lines, not cache_indices
  };
  void check_checkpoints(const BatchView& batch);

  int64_t max_seqs_ = 0;
  int64_t token_capacity_ = 0;
  int64_t cache_lines_ = 0;
  int32_t null_line_ = 0;
  int64_t max_checkpoints_ = 0;
  int64_t window_rows_ = 0;  // the largest bucket
  uint32_t generation_ = 0;
  std::vector<Stamp> stamps_;  // one per cache line
};

// Smallest bucket >= tokens (tokens >= 1). Throws when tokens exceed the largest bucket, when
// tokens < 1 and when there is no bucket. `buckets` is strictly increasing (validate_config).
int64_t choose_bucket(const std::vector<int64_t>& buckets, int64_t tokens);

// A window is a run of at most largest-bucket consecutive batch rows. Window w starts at row
// w * largest_bucket, so its graph's buffer pointers are fixed per window index.
// A window's sequences are consecutive batch indices: every sequence with rows in the window
// (one that spans a boundary is in both windows), plus the zero-length sequences whose start
// lies in [token_offset, token_offset + num_tokens). So a zero-length sequence exactly at a
// boundary belongs to the window that starts there, and one at the very end of the batch
// (start == T) to the last window.
struct WindowPlan {
  int64_t token_offset = 0;  // first batch row
  int64_t num_tokens = 0;    // real rows, >= 1
  int64_t bucket = 0;        // graph key: smallest bucket >= num_tokens
  int64_t first_seq = 0;     // batch index of the first sequence overlapping the window
  int64_t num_seqs = 0;      // sequences overlapping the window (zero-length ones inside it too)
};

// Number of window slots the module reserves: ceil(batch_token_capacity / largest bucket).
int64_t max_windows(const Config& config);

// Fills `windows` (cleared first; its capacity is reused, so a reserved vector never
// allocates) for a batch that passed validate_batch. A batch without tokens gives no window
// (its zero-length sequences change no state). Runs in O(num_seqs + windows).
void plan_windows(const BatchView& batch, const Config& config, std::vector<WindowPlan>& windows);

// Byte layout of one window's staging slot, identical in pinned host and device memory:
// query_start_loc (max_seqs + 1) int32, cache_indices (max_seqs) int32,
// has_initial_state (max_seqs) bool, and with max_checkpoints > 0 the checkpoint records
// (common/state_checkpoints.h): CheckpointSeq (max_seqs) and CheckpointEntry (max_checkpoints),
// each array 16-byte aligned. Throws for max_seqs < 0 or max_checkpoints < 0.
struct StagingLayout {
  std::size_t qsl_offset = 0;
  std::size_t cache_offset = 0;
  std::size_t flags_offset = 0;
  std::size_t checkpoint_seq_offset = 0;    // == checkpoint_entry_offset when max_checkpoints is 0
  std::size_t checkpoint_entry_offset = 0;  // == slot_bytes when max_checkpoints is 0
  std::size_t slot_bytes = 0;               // multiple of 16
  bool has_checkpoints = false;             // max_checkpoints > 0
  static StagingLayout for_max_seqs(int64_t max_seqs, int64_t max_checkpoints = 0);
  static StagingLayout for_config(const Config& config);
};

// Writes window `w`'s metadata into its slot: query_start_loc relative to the window start;
// a sequence continuing from an earlier window gets has_initial_state = true (the earlier window
// wrote its state); entries past the window's sequences repeat the last query_start_loc, name
// pools.null_line and have has_initial_state = false. A sequence on the null line always gets
// has_initial_state = false. The checkpoints whose offset lies in the window's rows of their
// sequence (offset c of a sequence with L0 rows before the window and L1 up to its end:
// L0 < c <= L1) are staged window-local (end = c - L0), in batch order; unused entries have
// line -1. Every byte of the slot is written (alignment gaps are zero), so equal batches stage
// equal bytes. `slot` is 16-byte aligned and layout.slot_bytes long; `layout` is
// StagingLayout::for_config(config).
void fill_window_staging(const BatchView& batch, const WindowPlan& window, const Config& config,
                         const StagingLayout& layout, void* slot);

// An all-padding slot: every sequence empty on pools.null_line, no initial state, no checkpoint.
// The module's eager-capture warm-up runs it (it writes only scratch rows and no pool line).
void fill_padding_staging(const Config& config, const StagingLayout& layout, void* slot);

}  // namespace kda::detail
