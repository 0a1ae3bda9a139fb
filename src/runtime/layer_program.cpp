#include "runtime/layer_program.h"

#include <cuda_runtime_api.h>

#include "common/check.h"
#include "common/cuda_check.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_recurrence_token.h"

namespace kda::detail {

namespace {
constexpr const char* kCtorFn = "kda::PrefillModule::PrefillModule";

const ModelConfig& model_of(const StepContext& ctx, const char* fn) {
  KDA_CHECK(ctx.config && ctx.weights, fn, "the step context has no config or no weights");
  return ctx.config->model;
}

// The window's batch as every op reads it: the staged metadata at max_seqs entries and the
// pools' lines (both pools have pools.cache_lines lines and the same null line).
VarlenArgs varlen_of(const StepContext& ctx) {
  VarlenArgs v;
  v.query_start_loc = ctx.query_start_loc;
  v.num_seqs = ctx.max_seqs;
  v.cache_indices = ctx.cache_indices;
  v.has_initial_state = ctx.has_initial_state;
  v.null_line = ctx.config->pools.null_line;
  v.cache_lines = ctx.config->pools.cache_lines;
  return v;
}
}  // namespace

uint32_t pow2_alignment(std::size_t bytes) {
  uint32_t a = 256;
  while (a > 1 && bytes % a != 0) a /= 2;
  return a;
}

GemmShape weight_gemm_shape(int64_t n, int64_t k, int64_t lda, int64_t ldc, uint32_t align_a, uint32_t align_c) {
  GemmShape s;
  s.n = n;
  s.k = k;
  s.lda = lda;
  s.ldw = k;
  s.ldc = ldc;
  s.align_a = align_a;
  s.align_w = 16;
  s.align_c = align_c;
  return s;
}

PackedConvArgs conv_args_for_step(const StepContext& ctx) {
  const ModelConfig& m = model_of(ctx, "kda::detail::conv_args_for_step");
  const int64_t P = m.part_dim();
  PackedConvArgs a;
  a.x = ctx.in_proj_out;  // the Q|K|V columns are the first 3P of each row
  a.x_dtype = DType::BF16;
  a.num_tokens = ctx.bucket_tokens;
  a.dim = 3 * P;
  a.x_row_stride = m.in_proj_stride();
  a.weight = ctx.weights->conv_weight;
  a.weight_stride_dim = 4;
  a.weight_stride_tap = 1;
  a.bias = nullptr;
  a.conv_states = ctx.conv_states;
  a.state_dtype = ctx.conv_state_dtype;
  a.state_len = 3;
  a.state_stride_line = ctx.conv_strides.line;
  a.state_stride_dim = ctx.conv_strides.dim;
  a.state_stride_tap = ctx.conv_strides.tap;
  a.varlen = varlen_of(ctx);
  a.cache_indices_stride = 1;
  a.part_dim = P;
  a.silu = true;
  a.out = ctx.q;  // planes q, k, v follow each other at capacity * P
  a.out_plane_stride = ctx.config->runtime.batch_token_capacity() * P;
  return a;
}

ConvCheckpointArgs conv_checkpoint_args_for_step(const StepInputs& in) {
  const StepContext& ctx = in.ctx;
  const ModelConfig& m = model_of(ctx, "kda::detail::conv_checkpoint_args_for_step");
  ConvCheckpointArgs a;
  a.x = ctx.in_proj_out;
  a.x_row_stride = m.in_proj_stride();
  a.num_tokens = ctx.bucket_tokens;
  a.dim = 3 * m.part_dim();
  a.conv_states = ctx.conv_states;
  a.state_dtype = ctx.conv_state_dtype;
  a.state_stride_line = ctx.conv_strides.line;
  a.state_stride_dim = ctx.conv_strides.dim;
  a.state_stride_tap = ctx.conv_strides.tap;
  a.varlen = varlen_of(ctx);
  a.entries = in.checkpoint_entries;
  a.max_entries = in.checkpoint_entries ? ctx.config->runtime.max_checkpoints : 0;
  return a;
}

RecurrenceArgs recurrence_args_for_step(const StepInputs& in) {
  const StepContext& ctx = in.ctx;
  const ModelConfig& m = model_of(ctx, "kda::detail::recurrence_args_for_step");
  RecurrenceArgs a;
  a.num_heads = m.num_heads;
  a.head_dim = m.head_dim;
  a.num_tokens = ctx.bucket_tokens;
  a.varlen = varlen_of(ctx);
  a.q = ctx.q;
  a.k = ctx.k;
  a.v = ctx.v;
  a.qkv_row_stride = m.part_dim();
  a.g1 = in.g1;
  a.g1_row_stride = m.part_dim();
  a.b = ctx.in_proj_out;
  a.b_row_stride = m.in_proj_stride();
  a.b_col_offset = 3 * m.part_dim();
  a.a_log = ctx.weights->A_log;
  a.dt_bias = ctx.weights->dt_bias;
  a.gate_lower_bound = m.gate_lower_bound;
  a.states = ctx.recurrent_states;
  a.state_dtype = ctx.recurrent_state_dtype;
  a.state_stride_line = ctx.recurrent_strides.line;
  a.state_stride_head = ctx.recurrent_strides.head;
  a.state_stride_k = ctx.recurrent_strides.k;
  a.state_stride_v = ctx.recurrent_strides.v;
  a.o = in.o;
  a.o_row_stride = m.part_dim();
  a.segment_tokens = in.segment_tokens;
  if (in.checkpoint_seqs && in.checkpoint_entries) {
    a.checkpoint_seqs = in.checkpoint_seqs;
    a.checkpoint_entries = in.checkpoint_entries;
    a.max_checkpoints = ctx.config->runtime.max_checkpoints;
  }
  return a;
}

GatedRmsNormArgs rmsnorm_args_for_step(const StepInputs& in) {
  const StepContext& ctx = in.ctx;
  const ModelConfig& m = model_of(ctx, "kda::detail::rmsnorm_args_for_step");
  GatedRmsNormArgs a;
  a.num_heads = m.num_heads;
  a.head_dim = m.head_dim;
  a.num_tokens = ctx.bucket_tokens;
  a.varlen = varlen_of(ctx);
  a.o = in.o;
  a.o_row_stride = m.part_dim();
  a.g2 = in.g2;
  a.g2_row_stride = m.part_dim();
  a.weight = ctx.weights->o_norm_weight;
  a.eps = m.norm_eps;
  a.y = in.y;
  a.y_row_stride = m.part_dim();
  return a;
}

namespace {
bool always(const Config&) { return true; }
bool with_checkpoints(const Config& c) { return c.runtime.max_checkpoints > 0; }
bool layer_is_full(const Config& c) { return c.runtime.layer_steps == LayerSteps::Full; }
bool chunked_recurrence(const Config& c) { return layer_is_full(c) && c.runtime.recurrence == Recurrence::Chunked; }
}  // namespace

// The step table: one row per built-in step, in recorded order. A step is enabled by its
// config predicate, gets the scratch it names allocated (MemoryPlan), is checked by its
// supported() before the module takes weights or pools (why_unsupported) and run by run().
const LayerProgram::BuiltinStep LayerProgram::kBuiltinSteps[] = {
    {"in_proj GEMM", always, 0, nullptr, &LayerProgram::run_in_proj},
    {"conv checkpoints", with_checkpoints, 0, &LayerProgram::conv_checkpoints_supported,
     &LayerProgram::run_conv_checkpoints},
    {"packed conv", always, 0, &LayerProgram::conv_supported, &LayerProgram::run_conv},
    {"gate GEMMs (g1, g2)", layer_is_full, kScratchG1 | kScratchG2, nullptr, &LayerProgram::run_gates},
    {"prep + recurrence", layer_is_full, kScratchO, &LayerProgram::recurrence_supported, &LayerProgram::run_recurrence},
    {"gated RMSNorm", layer_is_full, kScratchY, &LayerProgram::rmsnorm_supported, &LayerProgram::run_rmsnorm},
    {"o_proj GEMM", layer_is_full, 0, nullptr, &LayerProgram::run_o_proj},
};

unsigned LayerProgram::scratch_needed(const Config& config) {
  unsigned s = chunked_recurrence(config) ? kScratchChunkedWorkspace : 0u;
  for (const BuiltinStep& step : kBuiltinSteps)
    if (step.enabled(config)) s |= step.scratch;
  return s;
}

LayerProgram::LayerProgram(const Config& config, const MemoryPlan& plan) : config_(config), plan_(plan) {
  const ModelConfig& m = config.model;
  KDA_CHECK(m.head_dim == 128, kCtorFn, "model.head_dim ", m.head_dim, " is not supported: only 128 is");
  KDA_CHECK(m.conv_width == 4, kCtorFn, "model.conv_width ", m.conv_width, " is not supported: only 4 is");
  D = m.hidden_size;
  P = m.part_dim();
  H = m.num_heads;
  in_cols = m.in_proj_cols();
  in_stride = m.in_proj_stride();
  f_a_col_ = 3 * P + H;
  g_a_col_ = f_a_col_ + m.gate_rank;
  B = config.runtime.largest_bucket();
  capacity = config.runtime.batch_token_capacity();
  windows_max = plan.windows;
  padded_rows = plan.padded_rows;

  hidden = DeviceBuffer(plan.hidden, "hidden states");
  output = DeviceBuffer(plan.output, "layer output");
  in_proj_out = DeviceBuffer(plan.in_proj_out, "in_proj output");
  planes = DeviceBuffer(plan.planes, "conv planes");
  g1_ = DeviceBuffer(plan.g1, "g1 (f_a f_b^T)");
  g2_ = DeviceBuffer(plan.g2, "g2 (g_a g_b^T)");
  o_ = DeviceBuffer(plan.o, "recurrence output o");
  y_ = DeviceBuffer(plan.y, "gated RMSNorm output y");
  const std::size_t workspace_bytes = plan.gemm_workspace;
  gemm_workspace_ = DeviceBuffer(workspace_bytes, "cuBLASLt workspace");
  chunked_workspace_ = DeviceBuffer(plan.chunked_workspace, "chunked recurrence workspace");
  // Zeroed so that no buffer ever holds uninitialised bits (the in_proj output's pad columns
  // [in_cols, in_stride) are never written by the GEMM).
  for (const DeviceBuffer* a : {&hidden, &output, &in_proj_out, &planes, &g1_, &g2_, &o_, &y_})
    if (a->bytes()) KDA_CUDA_CHECK(kCtorFn, cudaMemset(a->get(), 0, a->bytes()));

  // Window w reads hidden rows (and o_proj writes output rows) from w * B.
  const uint32_t window_rows_align = windows_max > 1 ? pow2_alignment(static_cast<std::size_t>(B * D) * 2) : 256;
  GemmShape in_shape = weight_gemm_shape(in_cols, D, D, in_stride, window_rows_align, 256);
  in_proj_gemm_ = std::make_unique<GemmPlan>(lt_.get(), in_shape, config.runtime.token_buckets, workspace_bytes);
  if (in_stride != in_cols) {
    // Zero-padded weights let the GEMM's N be a multiple of 16, a much faster width than W_in
    // (docs/perf.md). Rows past N (up to in_proj_stride) are not read.
    const int64_t n16 = (in_cols + 15) / 16 * 16;
    in_shape.n = n16 != in_cols ? n16 : in_stride;
    in_proj_gemm_padded_ =
        std::make_unique<GemmPlan>(lt_.get(), in_shape, config.runtime.token_buckets, workspace_bytes);
  }
  if (full_layer()) {
    // g1 / g2 read the f_a / g_a columns of the in_proj output in place: their alignment is the
    // column offset's (rows are 128-byte multiples apart, in_proj_stride being a multiple of 64).
    const int64_t r = m.gate_rank;
    g1_gemm_ = std::make_unique<GemmPlan>(
        lt_.get(), weight_gemm_shape(P, r, in_stride, P, pow2_alignment(static_cast<std::size_t>(f_a_col_) * 2), 256),
        config.runtime.token_buckets, workspace_bytes);
    g2_gemm_ = std::make_unique<GemmPlan>(
        lt_.get(), weight_gemm_shape(P, r, in_stride, P, pow2_alignment(static_cast<std::size_t>(g_a_col_) * 2), 256),
        config.runtime.token_buckets, workspace_bytes);
    o_proj_gemm_ = std::make_unique<GemmPlan>(lt_.get(), weight_gemm_shape(D, P, P, D, 256, window_rows_align),
                                              config.runtime.token_buckets, workspace_bytes);
  }

  for (const BuiltinStep& step : kBuiltinSteps)
    if (step.enabled(config)) steps_.push_back(&step);
}

std::vector<LayerProgram::NamedBuffer> LayerProgram::buffers() const {
  return {{"hidden_states()", &hidden},
          {"output()", &output},
          {"the in_proj output", &in_proj_out},
          {"the conv planes", &planes},
          {"the g1 scratch", &g1_},
          {"the g2 scratch", &g2_},
          {"the recurrence output scratch", &o_},
          {"the gated RMSNorm output scratch", &y_},
          {"the cuBLASLt workspace", &gemm_workspace_},
          {"the chunked recurrence workspace", &chunked_workspace_}};
}

StepInputs LayerProgram::inputs(int layer, int window, int64_t bucket, const char* slot, const StagingLayout& staging,
                                const LayerWeights* weights, void* conv_pool, const ConvStateStrides& conv_strides,
                                void* recurrent_pool, const RecurrentStateStrides& recurrent_strides) const {
  StepInputs in;
  StepContext& ctx = in.ctx;
  ctx.layer = layer;
  ctx.bucket_tokens = bucket;
  ctx.max_seqs = config_.runtime.max_seqs;
  ctx.query_start_loc = reinterpret_cast<const int32_t*>(slot + staging.qsl_offset);
  ctx.cache_indices = reinterpret_cast<const int32_t*>(slot + staging.cache_offset);
  ctx.has_initial_state = reinterpret_cast<const bool*>(slot + staging.flags_offset);
  if (staging.has_checkpoints) {
    in.checkpoint_seqs = reinterpret_cast<const CheckpointSeq*>(slot + staging.checkpoint_seq_offset);
    in.checkpoint_entries = reinterpret_cast<const CheckpointEntry*>(slot + staging.checkpoint_entry_offset);
  }
  in.segment_tokens = plan_.segment_tokens;
  const int64_t row0 = window * B;
  ctx.hidden = hidden.as<char>() + row0 * D * 2;
  ctx.in_proj_out = in_proj_out.get();
  ctx.q = planes.as<char>() + (0 * capacity + row0) * P * 2;
  ctx.k = planes.as<char>() + (1 * capacity + row0) * P * 2;
  ctx.v = planes.as<char>() + (2 * capacity + row0) * P * 2;
  ctx.out = output.as<char>() + row0 * D * 2;
  ctx.conv_states = conv_pool;
  ctx.conv_strides = conv_strides;
  ctx.recurrent_states = recurrent_pool;
  ctx.recurrent_strides = recurrent_strides;
  ctx.conv_state_dtype = config_.pools.conv_dtype;
  ctx.recurrent_state_dtype = config_.pools.recurrent_dtype;
  ctx.weights = weights;
  ctx.config = &config_;
  in.g1 = g1_.get();
  in.g2 = g2_.get();
  in.o = o_.get();
  in.y = y_.get();
  in.gemm_workspace = gemm_workspace_.get();
  in.gemm_workspace_bytes = gemm_workspace_.bytes();
  in.chunked_workspace = chunked_workspace_.get();
  in.chunked_workspace_bytes = chunked_workspace_.bytes();
  return in;
}

LayerProgram::Unsupported LayerProgram::why_unsupported(const StepInputs& in) const {
  Unsupported u;
  for (const BuiltinStep* step : steps_) {
    if (step->supported && !(this->*step->supported)(in, &u.why)) {
      u.step = step->name;
      break;
    }
  }
  return u;
}

bool LayerProgram::conv_checkpoints_supported(const StepInputs& in, std::string* why) const {
  return conv_checkpoint_supported(conv_checkpoint_args_for_step(in), why);
}

bool LayerProgram::conv_supported(const StepInputs& in, std::string* why) const {
  return packed_causal_conv1d_supported(conv_args_for_step(in.ctx), why);
}

bool LayerProgram::recurrence_supported(const StepInputs& in, std::string* why) const {
  const RecurrenceArgs a = recurrence_args_for_step(in);
  return chunked() ? kda_chunked_supported(a, why) : kda_recurrence_token_supported(a, why);
}

bool LayerProgram::rmsnorm_supported(const StepInputs& in, std::string* why) const {
  return gated_rmsnorm_supported(rmsnorm_args_for_step(in), why);
}

// (1) in_proj: hidden rows [w*B, w*B + bucket) -> in_proj output rows [0, bucket).
void LayerProgram::run_in_proj(const StepInputs& in, Stream stream) const {
  const StepContext& ctx = in.ctx;
  const GemmPlan& plan =
      ctx.weights->in_proj_rows == in_stride && in_proj_gemm_padded_ ? *in_proj_gemm_padded_ : *in_proj_gemm_;
  plan.run(ctx.bucket_tokens, ctx.hidden, ctx.weights->in_proj, ctx.in_proj_out, in.gemm_workspace,
           in.gemm_workspace_bytes, stream);
}

// (2a) the conv states at the window's checkpoints, copied from the in_proj output (and the
// sequences' conv lines, read before (2) rewrites them) into the checkpoint lines.
void LayerProgram::run_conv_checkpoints(const StepInputs& in, Stream stream) const {
  conv_checkpoint(conv_checkpoint_args_for_step(in), stream);
}

// (2) packed conv of the Q|K|V columns into the window's plane rows, updating the conv pool.
void LayerProgram::run_conv(const StepInputs& in, Stream stream) const {
  packed_causal_conv1d(conv_args_for_step(in.ctx), stream);
}

// (3) the gate projections g1 = f_a f_b^T and g2 = g_a g_b^T, reading the in_proj output.
void LayerProgram::run_gates(const StepInputs& in, Stream stream) const {
  const StepContext& ctx = in.ctx;
  const char* x = static_cast<const char*>(ctx.in_proj_out);
  g1_gemm_->run(ctx.bucket_tokens, x + f_a_col_ * 2, ctx.weights->f_b, in.g1, in.gemm_workspace,
                in.gemm_workspace_bytes, stream);
  g2_gemm_->run(ctx.bucket_tokens, x + g_a_col_ * 2, ctx.weights->g_b, in.g2, in.gemm_workspace,
                in.gemm_workspace_bytes, stream);
}

// (4)+(5) L2 norms, decay, beta and the gated delta rule over each sequence, with the recurrent
// pool line read and written back.
void LayerProgram::run_recurrence(const StepInputs& in, Stream stream) const {
  const RecurrenceArgs args = recurrence_args_for_step(in);
  if (chunked())
    kda_chunked(args, in.chunked_workspace, in.chunked_workspace_bytes, stream);
  else
    kda_recurrence_token(args, stream);
}

// (6) gated RMSNorm per head.
void LayerProgram::run_rmsnorm(const StepInputs& in, Stream stream) const {
  gated_rmsnorm(rmsnorm_args_for_step(in), stream);
}

// (7) o_proj into the window's rows of the output buffer.
void LayerProgram::run_o_proj(const StepInputs& in, Stream stream) const {
  const StepContext& ctx = in.ctx;
  o_proj_gemm_->run(ctx.bucket_tokens, in.y, ctx.weights->o_proj, ctx.out, in.gemm_workspace, in.gemm_workspace_bytes,
                    stream);
}

}  // namespace kda::detail
