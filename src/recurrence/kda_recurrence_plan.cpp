// The plan the two recurrence kernels share (kda_recurrence.h): the argument checks of the op
// (recurrence::args_supported, which kda_recurrence_token_supported is whole) and the params
// both kernels read. Plain C++, no CUDA.
#include "recurrence/kda_recurrence.h"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/arg_checks.h"
#include "common/check.h"
#include "common/state_elements.h"
#include "common/varlen_map.h"
#include "recurrence/kda_recurrence_token.h"

namespace kda {
namespace {

// `bf16` advanced by `elements` 2-byte elements (the type is incomplete on the host).
const __nv_bfloat16* bf16_offset(const void* bf16, int64_t elements) {
  return static_cast<const __nv_bfloat16*>(
      static_cast<const void*>(static_cast<const unsigned char*>(bf16) + 2 * elements));
}

}  // namespace

namespace recurrence {

bool args_supported(const RecurrenceArgs& a, std::string* why) {
  using detail::aligned_to;
  using detail::fail;
  using detail::in_range;
  using detail::kInt32Max;
  using detail::str_cat;
  if (a.head_dim != kHeadDim)
    return fail(why, str_cat("head_dim ", a.head_dim, " is not supported; only 128 is"));
  if (!in_range(a.num_heads, 1, kMaxHeads))
    return fail(why, str_cat("num_heads ", a.num_heads, " is outside [1, ", kMaxHeads,
                             "] (the grid has ", kTokenSlices,
                             " blocks per head in y)"));
  if (!in_range(a.num_tokens, 0, kInt32Max))
    return fail(why, str_cat("num_tokens ", a.num_tokens, " is outside [0, 2^31 - 1]"));
  if (!in_range(a.varlen.num_seqs, 0, kInt32Max))
    return fail(why, str_cat("num_seqs ", a.varlen.num_seqs, " is outside [0, 2^31 - 1]"));
  if (!in_range(a.varlen.cache_lines, 0, kInt32Max + 1))
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
  if (!in_range(a.max_checkpoints, 0, kInt32Max))
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

RecurrenceParams make_recurrence_params(const RecurrenceArgs& a) {
  RecurrenceParams p{};
  varlen::copy_varlen_fields(p, a.varlen);
  p.null_line = a.varlen.null_line.value_or(-1);  // no null line: -1, skipped as out of range
  p.num_tokens = a.num_tokens;
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
  p.state_dtype_is_bf16 = a.state_dtype == DType::BF16;
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
  p.workspace = nullptr;
  p.seg_chunk_shift = kNoSegments;  // kda_chunked's make_chunked_params sets the segments
  p.seg_slots = 0;
  p.seg_states = nullptr;
  p.seg_trans = nullptr;
  return p;
}

}  // namespace recurrence

bool kda_recurrence_token_supported(const RecurrenceArgs& a, std::string* why) {
  return recurrence::args_supported(a, why);
}

}  // namespace kda
