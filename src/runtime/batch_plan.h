// Host-side planning of one forward: batch validation, bucket choice, window split and the
// staged metadata of each window. Plain C++ (no CUDA) so CI tests all of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kda/config.h"
#include "kda/prefill.h"

namespace kda::detail {

// Throws kda::Error naming the first problem (which array, which index, which value, what was
// expected): null arrays, num_seqs outside [0, max_seqs], query_start_loc[0] != 0, a decrease,
// more tokens than runtime.batch_token_capacity(), a cache index outside [0, cache_lines), a
// real (non-null) cache line named twice. Reads only the batch.
void validate_batch(const BatchView& batch, const Config& config);

// Smallest bucket >= tokens (tokens >= 1). Throws when tokens exceed the largest bucket.
int64_t choose_bucket(const std::vector<int64_t>& buckets, int64_t tokens);

// A window is a run of at most largest-bucket consecutive batch rows. Window w starts at row
// w * largest_bucket, so its graph's buffer pointers are fixed per window index.
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
// allocates) for a batch that passed validate_batch. An empty batch gives no window.
void plan_windows(const BatchView& batch, const Config& config, std::vector<WindowPlan>& windows);

// Byte layout of one window's staging slot, identical in pinned host and device memory:
// query_start_loc (max_seqs + 1) int32, cache_indices (max_seqs) int32,
// has_initial_state (max_seqs) bool, each array 16-byte aligned.
struct StagingLayout {
  std::size_t qsl_offset = 0;
  std::size_t cache_offset = 0;
  std::size_t flags_offset = 0;
  std::size_t slot_bytes = 0;  // multiple of 16
  static StagingLayout for_max_seqs(int64_t max_seqs);
};

// Writes window `w`'s metadata into its slot: query_start_loc relative to the window start;
// a sequence continuing from an earlier window gets has_initial_state = true (the earlier window
// wrote its state); entries past the window's sequences repeat the last query_start_loc, name
// pools.null_line and have has_initial_state = false.
void fill_window_staging(const BatchView& batch, const WindowPlan& window, const Config& config,
                         const StagingLayout& layout, void* slot);

}  // namespace kda::detail
