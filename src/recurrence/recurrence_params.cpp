// The host side shared by the two recurrence kernels: kda_prep_recurrence_supported() (the
// argument checks of the op) and make_recurrence_params(). Plain C++, no CUDA.
#include "recurrence/recurrence_params.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "common/arg_checks.h"
#include "common/check.h"
#include "common/state_storage.h"
#include "common/varlen_map.h"
#include "recurrence/kda_recurrence.h"

namespace kda {
namespace {

// `bf16` advanced by `elements` 2-byte elements (the type is incomplete on the host).
const __nv_bfloat16* bf16_offset(const void* bf16, int64_t elements) {
  return static_cast<const __nv_bfloat16*>(
      static_cast<const void*>(static_cast<const unsigned char*>(bf16) + 2 * elements));
}

}  // namespace

bool kda_prep_recurrence_supported(const PrepRecurrenceArgs& a, std::string* why) {
  using detail::aligned_to;
  using detail::fail;
  using detail::kInt32Max;
  using detail::str_cat;
  using recurrence::kHeadDim;
  using recurrence::kMaxHeads;
  if (a.head_dim != kHeadDim)
    return fail(why, str_cat("head_dim ", a.head_dim, " is not supported; only 128 is"));
  if (a.num_heads < 1 || a.num_heads > kMaxHeads)
    return fail(why, str_cat("num_heads ", a.num_heads, " is outside [1, ", kMaxHeads,
                             "] (the grid has ", recurrence::kTokenSlices,
                             " blocks per head in y)"));
  if (a.num_tokens < 0 || a.num_tokens > kInt32Max)
    return fail(why, str_cat("num_tokens ", a.num_tokens, " is outside [0, 2^31 - 1]"));
  if (a.varlen.num_seqs < 0 || a.varlen.num_seqs > kInt32Max)
    return fail(why, str_cat("num_seqs ", a.varlen.num_seqs, " is outside [0, 2^31 - 1]"));
  if (a.varlen.cache_lines < 0 || a.varlen.cache_lines > kInt32Max + 1)
    return fail(why, str_cat("cache_lines ", a.varlen.cache_lines, " is outside [0, 2^31]"));
  if (!a.varlen.query_start_loc || !a.varlen.cache_indices)
    return fail(why, "query_start_loc and cache_indices must be set");
  if (!a.q || !a.k || !a.v || !a.g1 || !a.b)
    return fail(why, "q, k, v, g1 and b must be set");
  if (!a.a_log || !a.dt_bias) return fail(why, "a_log and dt_bias must be set");
  if (!a.states) return fail(why, "states (the recurrent-state pool) must be set");
  if (!a.o) return fail(why, "o must be set");

  const int64_t part_dim = a.num_heads * kHeadDim;
  if (a.qkv_row_stride < part_dim || a.qkv_row_stride % 4 != 0)
    return fail(why, str_cat("qkv_row_stride ", a.qkv_row_stride, " must be >= P = ", part_dim,
                             " and a multiple of 4 (the prep reads 4 bf16 at a time)"));
  if (a.g1_row_stride < part_dim || a.g1_row_stride % 4 != 0)
    return fail(why, str_cat("g1_row_stride ", a.g1_row_stride, " must be >= P = ", part_dim,
                             " and a multiple of 4"));
  if (!aligned_to(a.q, 8) || !aligned_to(a.k, 8) || !aligned_to(a.g1, 8))
    return fail(why, "q, k and g1 must be 8-byte aligned (the prep reads 4 bf16 at a time)");
  if (!aligned_to(a.v, 2) || !aligned_to(a.b, 2) || !aligned_to(a.o, 2))
    return fail(why, "v, b and o must be aligned to their 2-byte bf16 elements");
  if (!aligned_to(a.a_log, 4) || !aligned_to(a.dt_bias, 4))
    return fail(why, "a_log and dt_bias must be aligned to their 4-byte fp32 elements");
  if (!is_state_pool_dtype(a.state_dtype))
    return fail(why, str_cat("state_dtype ", dtype_name(a.state_dtype), " (value ",
                             static_cast<int>(a.state_dtype),
                             ") is not supported; recurrent-state pools hold fp32 or bf16"));
  const std::size_t state_bytes = dtype_size(a.state_dtype);
  if (!aligned_to(a.states, state_bytes))
    return fail(why, str_cat("states must be aligned to its ", state_bytes,
                             "-byte elements (state_dtype ", dtype_name(a.state_dtype), ")"));
  if (a.b_col_offset < 0 || a.b_row_stride < a.b_col_offset + a.num_heads)
    return fail(why, str_cat("the b columns [", a.b_col_offset, ", ",
                             a.b_col_offset + a.num_heads, ") do not fit in b_row_stride ",
                             a.b_row_stride));
  if (a.o_row_stride < part_dim)
    return fail(why, str_cat("o_row_stride ", a.o_row_stride, " is below P = ", part_dim));
  if (a.gate_lower_bound &&
      (!std::isfinite(*a.gate_lower_bound) || !(*a.gate_lower_bound < 0.0)))
    return fail(why, str_cat("gate_lower_bound ", *a.gate_lower_bound,
                             " must be finite and negative"));
  if (a.state_stride_line <= 0 || a.state_stride_head <= 0 || a.state_stride_k <= 0 ||
      a.state_stride_v <= 0)
    return fail(why, "the state strides (line, head, k, v) must be positive");
  if (detail::strided_extent<4>({{{a.varlen.cache_lines, a.state_stride_line},
                                  {a.num_heads, a.state_stride_head},
                                  {kHeadDim, a.state_stride_k},
                                  {kHeadDim, a.state_stride_v}}}) < 0)
    return fail(why, str_cat("the state strides (line ", a.state_stride_line, ", head ",
                             a.state_stride_head, ", k ", a.state_stride_k, ", v ",
                             a.state_stride_v, ") make state elements overlap"));
  if ((a.checkpoint_seqs == nullptr) != (a.checkpoint_entries == nullptr))
    return fail(why, "checkpoint_seqs and checkpoint_entries must be set together (or both "
                     "null: no checkpoints)");
  if (a.max_checkpoints < 0 || a.max_checkpoints > kInt32Max)
    return fail(why, str_cat("max_checkpoints ", a.max_checkpoints,
                             " is outside [0, 2^31 - 1]"));
  if (a.checkpoint_seqs != nullptr) {
    if (a.max_checkpoints == 0)
      return fail(why, "max_checkpoints is 0 but checkpoint tables are set (an empty entry "
                       "table: pass null tables for no checkpoints)");
    if (!aligned_to(a.checkpoint_seqs, alignof(CheckpointSeq)) ||
        !aligned_to(a.checkpoint_entries, alignof(CheckpointEntry)))
      return fail(why, "checkpoint_seqs and checkpoint_entries must be 16-byte aligned "
                       "(16-byte records)");
  }
  return true;
}

namespace recurrence {

ChunkedLayout chunked_layout(const PrepRecurrenceArgs& a, int seg_chunk_shift) {
  ChunkedLayout l;
  l.seg_chunk_shift = seg_chunk_shift;
  if (a.num_tokens <= 0 || a.varlen.num_seqs <= 0 || a.num_heads <= 0) return l;
  const auto heads = static_cast<std::size_t>(a.num_heads);
  l.slots = varlen::slot_count(a.num_tokens, a.varlen.num_seqs, kChunkShift);
  l.record_bytes = static_cast<std::size_t>(l.slots) * heads * kRecordBytes;
  if (seg_chunk_shift >= kNoSegments) {
    l.seg_slots = a.varlen.num_seqs;
  } else {
    l.seg_slots = varlen::slot_count(a.num_tokens, a.varlen.num_seqs, kChunkShift + seg_chunk_shift);
    l.seg_bytes = static_cast<std::size_t>(l.seg_slots) * heads * kHeadDim * kHeadDim * 4;
  }
  return l;
}

// The model (docs/design.md, "Segments"): phase 2 runs one block per SM, and a walk block
// takes a time t per chunk whatever its role, so a pass of b blocks over segments of L chunks
// takes ceil(b / S) L t on S SMs. One sequence of N chunks, B = 4 H blocks per segment and
// role, n = ceil(N / L) segments: pass 1 runs B (2 n - 3) blocks (segment 0's walk, and the
// summary and the transition of segments 1 .. n - 2), pass 3 B (n - 1), and the scan n - 2
// steps of about kScanStep chunk times each.
int auto_segment_shift(int64_t num_tokens, int64_t num_heads, int sm_count) {
  constexpr int64_t kScanStep = 2;
  if (sm_count <= 0) return kNoSegments;
  const int64_t n_chunks = (num_tokens + kKdaChunk - 1) / kKdaChunk;
  const int64_t b = 4 * std::max<int64_t>(num_heads, 1), sms = std::max(sm_count, 1);
  const auto waves = [&](int64_t blocks) { return (blocks + sms - 1) / sms; };
  const int64_t uncut = waves(b) * n_chunks;
  int64_t best_cost = uncut;
  int best = kNoSegments;
  for (int k = kMinAutoSegmentShift; k < 30 && (int64_t{1} << k) < n_chunks; ++k) {
    const int64_t len = int64_t{1} << k, n = (n_chunks + len - 1) / len;
    const int64_t cost =
        waves(b * (2 * n - 3)) * len + waves(b * (n - 1)) * len + kScanStep * (n - 2);
    if (cost < best_cost) best_cost = cost, best = k;
  }
  return 5 * best_cost <= 4 * uncut ? best : kNoSegments;
}

int segment_shift_of(const PrepRecurrenceArgs& a, int sm_count) {
  int shift = kNoSegments;
  if (a.segment_tokens < 0) {
    shift = auto_segment_shift(a.num_tokens, a.num_heads, sm_count);
  } else if (a.segment_tokens > 0) {
    shift = 0;
    while ((kKdaChunk << shift) < a.segment_tokens) ++shift;
  }
  // Segments as long as the longest possible sequence cut nothing.
  const int64_t n_chunks = (a.num_tokens + kKdaChunk - 1) / kKdaChunk;
  return shift < kNoSegments && (int64_t{1} << shift) < n_chunks ? shift : kNoSegments;
}

RecurrenceParams make_recurrence_params(const PrepRecurrenceArgs& a, void* workspace,
                                        int seg_chunk_shift) {
  RecurrenceParams p{};
  p.query_start_loc = a.varlen.query_start_loc;
  p.cache_indices = a.varlen.cache_indices;
  p.has_initial_state = a.varlen.has_initial_state;
  p.null_line = a.varlen.null_line.value_or(-1);  // no null line: -1, skipped as out of range
  p.cache_lines = a.varlen.cache_lines;
  p.num_tokens = a.num_tokens;
  p.num_seqs = a.varlen.num_seqs;
  p.num_heads = static_cast<int>(a.num_heads);
  p.q = static_cast<const __nv_bfloat16*>(a.q);
  p.k = static_cast<const __nv_bfloat16*>(a.k);
  p.v = static_cast<const __nv_bfloat16*>(a.v);
  p.qkv_stride = a.qkv_row_stride;
  p.g1 = static_cast<const __nv_bfloat16*>(a.g1);
  p.g1_stride = a.g1_row_stride;
  p.b = bf16_offset(a.b, a.b_col_offset);
  p.b_stride = a.b_row_stride;
  p.a_log = a.a_log;
  p.dt_bias = a.dt_bias;
  p.lower_bound = a.gate_lower_bound ? static_cast<float>(*a.gate_lower_bound) : 0.0f;
  p.states = a.states;
  p.state_bf16 = a.state_dtype == DType::BF16;
  p.state_line = a.state_stride_line;
  p.state_head = a.state_stride_head;
  p.state_k = a.state_stride_k;
  p.state_v = a.state_stride_v;
  p.o = static_cast<__nv_bfloat16*>(a.o);
  p.o_stride = a.o_row_stride;
  p.checkpoint_seqs = a.checkpoint_seqs;
  p.checkpoint_entries = a.checkpoint_entries;
  p.max_checkpoints = a.max_checkpoints;
  p.slots = varlen::slot_count(a.num_tokens, a.varlen.num_seqs, kChunkShift);
  p.search_steps = varlen::search_steps(a.varlen.num_seqs);
  p.search_stride = varlen::search_stride(p.search_steps);
  p.workspace = static_cast<unsigned char*>(workspace);
  const ChunkedLayout layout = chunked_layout(a, seg_chunk_shift);
  p.seg_chunk_shift = seg_chunk_shift;
  p.seg_slots = layout.seg_slots;
  p.seg_states = nullptr;
  p.seg_trans = nullptr;
  if (workspace != nullptr && layout.seg_bytes > 0) {
    p.seg_states = reinterpret_cast<float*>(p.workspace + layout.record_bytes);
    p.seg_trans = reinterpret_cast<float*>(p.workspace + layout.record_bytes + layout.seg_bytes);
  }
  return p;
}

}  // namespace recurrence
}  // namespace kda
