// StepContext -> kernel arguments for the module's built-in steps.
#pragma once

#include <cstdint>

#include "kda/prefill.h"
#include "norm/gated_rmsnorm.h"
#include "recurrence/kda_recurrence.h"

namespace kda {

// Arguments for a module step: shapes, metadata, planes (row stride P), the b columns of
// ctx.in_proj_out (offset 3P, row stride in_proj_stride()), weights, the layer's recurrent
// pool (contiguous (line, head, k, v)) and the pool facts from ctx.config. g1/o (resp. o, g2,
// y) live in buffers the caller owns, ctx.bucket_tokens rows with the given row strides.
PrepRecurrenceArgs prep_recurrence_args_for_step(const StepContext& ctx, const void* g1,
                                                 int64_t g1_row_stride, void* o,
                                                 int64_t o_row_stride);
GatedRmsNormArgs gated_rmsnorm_args_for_step(const StepContext& ctx, const void* o,
                                             int64_t o_row_stride, const void* g2,
                                             int64_t g2_row_stride, void* y,
                                             int64_t y_row_stride);

}  // namespace kda
