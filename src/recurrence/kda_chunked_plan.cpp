// kda_chunked's plan (kda_chunked.h): its checks on top of the shared ones, the workspace
// layout, the segment choice (the cost model of docs/design.md, "Segments") and the params of
// its launches. Plain C++, no CUDA: the device's SM count comes in as a number.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/arg_checks.h"
#include "common/check.h"
#include "common/varlen_map.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_recurrence.h"

namespace kda {
namespace recurrence {
namespace {

int64_t chunk_slots(const RecurrenceArgs& a) {
  return varlen::slot_count(a.num_tokens, a.varlen.num_seqs, kChunkShift);
}

// Chunks of the longest sequence num_tokens rows can hold.
int64_t chunks_of(int64_t num_tokens) { return (num_tokens + kKdaChunk - 1) / kKdaChunk; }

}  // namespace

// The model (docs/design.md, "Segments"): phase 2 runs one block per SM, and a walk block
// takes a time t per chunk whatever its role, so a pass of b blocks over segments of L chunks
// takes ceil(b / S) L t on S SMs. One sequence of N chunks, B = kStateSlices H blocks per segment and
// role, n = ceil(N / L) segments: pass 1 runs B (2 n - 3) blocks (segment 0's walk, and the
// summary and the transition of segments 1 .. n - 2), pass 3 B (n - 1), and the scan n - 2
// steps of about kScanStep chunk times each. L runs over the powers of two from
// kMinAutoSegmentTokens while shorter than the sequence.
int64_t auto_segment_tokens(int64_t num_tokens, int64_t num_heads, int sm_count) {
  constexpr int64_t kScanStep = 2;
  if (sm_count <= 0) return 0;
  const int64_t n_chunks = chunks_of(num_tokens);
  const int64_t b = kStateSlices * std::max<int64_t>(num_heads, 1), sms = std::max(sm_count, 1);
  const auto waves = [&](int64_t blocks) { return (blocks + sms - 1) / sms; };
  const int64_t uncut = waves(b) * n_chunks;
  int64_t best_cost = uncut;
  int64_t best = 0;  // tokens; 0: whole sequences
  for (int64_t len = kMinAutoSegmentTokens / kKdaChunk; len < (int64_t{1} << 30) && len < n_chunks;
       len *= 2) {
    const int64_t n = (n_chunks + len - 1) / len;
    const int64_t cost =
        waves(b * (2 * n - 3)) * len + waves(b * (n - 1)) * len + kScanStep * (n - 2);
    if (cost < best_cost) best_cost = cost, best = len * kKdaChunk;
  }
  return 5 * best_cost <= 4 * uncut ? best : 0;
}

int64_t segment_tokens_of(const RecurrenceArgs& a, int sm_count) {
  int64_t tokens = 0;
  if (a.segment_tokens < 0) {
    tokens = auto_segment_tokens(a.num_tokens, a.num_heads, sm_count);
  } else if (a.segment_tokens > 0) {
    // Segments as long as the longest possible sequence cut nothing. Tested before rounding up
    // to a power of two, so the doubling stops below 2 num_tokens (an unchecked length near
    // 2^63 would overflow it: the workspace query takes lengths supported() has not seen).
    if (a.segment_tokens >= chunks_of(a.num_tokens) * kKdaChunk) return 0;
    tokens = kKdaChunk;
    while (tokens < a.segment_tokens) tokens *= 2;
  }
  return tokens > 0 && tokens / kKdaChunk < chunks_of(a.num_tokens) ? tokens : 0;
}

int segment_chunk_shift(int64_t segment_tokens) {
  if (segment_tokens <= 0) return kNoSegments;
  int shift = 0;
  while ((kKdaChunk << shift) < segment_tokens) ++shift;
  return shift;
}

ChunkedLayout chunked_layout(const RecurrenceArgs& a, int64_t segment_tokens) {
  ChunkedLayout l;
  l.seg_chunk_shift = segment_chunk_shift(segment_tokens);
  if (a.num_tokens <= 0 || a.varlen.num_seqs <= 0 || a.num_heads <= 0) return l;
  const auto heads = static_cast<std::size_t>(a.num_heads);
  l.slots = chunk_slots(a);
  l.record_bytes = static_cast<std::size_t>(l.slots) * heads * kRecordBytes;
  if (l.seg_chunk_shift >= kNoSegments) {
    l.seg_slots = a.varlen.num_seqs;
  } else {
    l.seg_slots = varlen::slot_count(a.num_tokens, a.varlen.num_seqs, kChunkShift + l.seg_chunk_shift);
    l.seg_bytes = static_cast<std::size_t>(l.seg_slots) * heads * kHeadDim * kHeadDim * 4;
  }
  return l;
}

std::size_t chunked_workspace_bytes(const RecurrenceArgs& a, int sm_count) {
  if (a.num_tokens <= 0 || a.varlen.num_seqs <= 0 || a.num_heads <= 0) return 0;
  return chunked_layout(a, segment_tokens_of(a, sm_count)).total();
}

RecurrenceParams make_chunked_params(const RecurrenceArgs& a, void* workspace,
                                     int64_t segment_tokens) {
  RecurrenceParams p = make_recurrence_params(a);
  p.workspace = static_cast<unsigned char*>(workspace);
  const ChunkedLayout layout = chunked_layout(a, segment_tokens);
  p.seg_chunk_shift = layout.seg_chunk_shift;
  p.seg_slots = layout.seg_slots;
  if (workspace != nullptr && layout.seg_bytes > 0) {
    p.seg_states = reinterpret_cast<float*>(p.workspace + layout.record_bytes);
    p.seg_trans = reinterpret_cast<float*>(p.workspace + layout.record_bytes + layout.seg_bytes);
  }
  return p;
}

}  // namespace recurrence

bool kda_chunked_supported(const RecurrenceArgs& a, std::string* why) {
  using detail::fail;
  using detail::str_cat;
  // The shared checks bound num_heads by 16383, below the 65535 of both grids' y extent.
  static_assert(recurrence::kMaxHeads <= 65535, "gridDim.y = H");
  if (!recurrence::args_supported(a, why)) return false;
  // gridDim.x: phase 1 runs one block per chunk slot; phase 2 kStateSlices per sequence and up
  // to 2 kStateSlices per segment window, and num_seqs + windows <= chunk slots + 1.
  const int64_t slots = recurrence::chunk_slots(a);
  constexpr int64_t kWalkBlocks = 2 * recurrence::kStateSlices;
  if (slots + 1 > detail::kInt32Max / kWalkBlocks)
    return fail(why, str_cat("num_tokens / 64 + num_seqs = ", slots, " chunk slots exceed (2^31 - 1) / ",
                             kWalkBlocks, " (gridDim.x of phase 2: ", kWalkBlocks,
                             " walk blocks per slot)"));
  const int64_t st = a.segment_tokens;
  if (st != kKdaAutoSegments && st != 0 && (st < kKdaChunk || (st & (st - 1)) != 0))
    return fail(why, str_cat("segment_tokens ", st, " is not ", kKdaAutoSegments,
                             " (the op's choice), 0 (no cut) or a power of two >= 64"));
  return true;
}

}  // namespace kda
