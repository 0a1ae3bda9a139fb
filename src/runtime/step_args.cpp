// The StepContext adapters of kda_steps.h: plain C++, so that the kernels' .cu files do not
// depend on the module's public headers.
#include "common/check.h"
#include "kda/config.h"
#include "kda/prefill.h"
#include "norm/gated_rmsnorm.h"
#include "recurrence/kda_recurrence.h"
#include "runtime/step_args.h"

namespace kda {

PrepRecurrenceArgs prep_recurrence_args_for_step(const StepContext& ctx, const void* g1,
                                                 int64_t g1_row_stride, void* o,
                                                 int64_t o_row_stride) {
  KDA_CHECK(ctx.config && ctx.weights, "kda::prep_recurrence_args_for_step",
            "the step context has no config or no weights");
  const ModelConfig& m = ctx.config->model;
  PrepRecurrenceArgs a;
  a.num_heads = m.num_heads;
  a.head_dim = m.head_dim;
  a.num_tokens = ctx.bucket_tokens;
  a.max_seqs = ctx.max_seqs;
  a.query_start_loc = ctx.query_start_loc;
  a.cache_indices = ctx.cache_indices;
  a.has_initial_state = ctx.has_initial_state;
  a.null_line = ctx.config->pools.null_line;
  a.q = ctx.q;
  a.k = ctx.k;
  a.v = ctx.v;
  a.qkv_row_stride = m.part_dim();
  a.g1 = g1;
  a.g1_row_stride = g1_row_stride;
  a.b = ctx.in_proj_out;
  a.b_row_stride = m.in_proj_stride();
  a.b_col_offset = 3 * m.part_dim();
  a.a_log = ctx.weights->A_log;
  a.dt_bias = ctx.weights->dt_bias;
  a.gate_lower_bound = m.gate_lower_bound;
  a.states = ctx.recurrent_states;
  a.cache_lines = ctx.config->pools.cache_lines;
  a.state_stride_v = 1;
  a.state_stride_k = m.head_dim;
  a.state_stride_head = m.head_dim * m.head_dim;
  a.state_stride_line = m.num_heads * m.head_dim * m.head_dim;
  a.o = o;
  a.o_row_stride = o_row_stride;
  return a;
}

GatedRmsNormArgs gated_rmsnorm_args_for_step(const StepContext& ctx, const void* o,
                                             int64_t o_row_stride, const void* g2,
                                             int64_t g2_row_stride, void* y,
                                             int64_t y_row_stride) {
  KDA_CHECK(ctx.config && ctx.weights, "kda::gated_rmsnorm_args_for_step",
            "the step context has no config or no weights");
  const ModelConfig& m = ctx.config->model;
  GatedRmsNormArgs a;
  a.num_heads = m.num_heads;
  a.head_dim = m.head_dim;
  a.num_tokens = ctx.bucket_tokens;
  a.query_start_loc = ctx.query_start_loc;
  a.num_seqs = ctx.max_seqs;
  a.o = o;
  a.o_row_stride = o_row_stride;
  a.g2 = g2;
  a.g2_row_stride = g2_row_stride;
  a.weight = ctx.weights->o_norm_weight;
  a.eps = m.norm_eps;
  a.y = y;
  a.y_row_stride = y_row_stride;
  return a;
}

}  // namespace kda
