// The device form of a window's state checkpoints (BatchView::checkpoint_*), shared by the
// module's staging (src/runtime/batch_plan.cpp, which writes it), the conv-state checkpoint op
// (src/conv/conv_checkpoint*) and both recurrences (src/recurrence), which read it.
//
// A checkpoint is a copy of one sequence's states, as they stand after its first `end` rows of
// the window, into another pool line. Offsets are window-local: `end` counts the sequence's rows
// inside the window (tokens before the window are already in the sequence's line). The host
// guarantees (validate_batch) for every staged checkpoint:
//  - 1 <= end <= the sequence's rows in the window, and end is a multiple of the recurrence's
//    64-token chunk or equals those rows (the chunks of a sequence start at its first row of the
//    window, so every checkpoint falls on a chunk end);
//  - its line is in [0, cache_lines), is not the null line, and is named by no other checkpoint
//    and by no sequence of the batch (so no kernel reads a line that another writes);
//  - its sequence is not skipped (not on the null line, not empty).
// CUDA-free.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace kda {

// Checkpoint offsets are multiples of the chunked recurrence's chunk (kKdaChunk in
// recurrence/kda_chunked.h, which static_asserts the two agree).
constexpr int64_t kCheckpointChunk = 64;

// Per window-local sequence index (max_seqs entries per window): its checkpoints in this window
// are entries [base, base + count) of the window's CheckpointEntry table, in order, at ends
// first, first + interval, ... (interval a positive multiple of 64 when count > 1).
// count == 0: none (the other fields are 0).
struct alignas(16) CheckpointSeq {
  int32_t first = 0;
  int32_t interval = 0;
  int32_t count = 0;
  int32_t base = 0;
};

// One checkpoint (runtime.max_checkpoints entries per window; unused entries have line -1).
struct alignas(16) CheckpointEntry {
  int32_t line = -1;  // the pool line that receives the states
  int32_t seq = 0;    // window-local sequence index
  int32_t end = 0;    // the sequence's rows of the window that the states have taken in
  int32_t pad = 0;    // 0
};

static_assert(sizeof(CheckpointSeq) == 16 && sizeof(CheckpointEntry) == 16,
              "staged as 16-byte records");

// The checkpoint, if any, that a sequence with checkpoints `cs` owes after its first `end` rows
// of the window: its index into the entry table, or -1. Chunk-end form, for kernels that visit
// each multiple of 64 (and the sequence's last row) once.
KDA_HOST_DEVICE inline int32_t checkpoint_at(const CheckpointSeq& cs, int64_t end) {
  if (cs.count <= 0 || end < cs.first) return -1;
  const int64_t past = end - cs.first;
  if (cs.interval <= 0) return past == 0 ? cs.base : -1;
  if (past % cs.interval != 0) return -1;
  const int64_t j = past / cs.interval;
  return j < cs.count ? static_cast<int32_t>(cs.base + j) : -1;
}

}  // namespace kda
