#include "runtime/module_memory.h"

#include <string>

#include "common/check.h"
#include "recurrence/kda_chunked.h"
#include "runtime/batch_plan.h"
#include "runtime/layer_program.h"

namespace kda::detail {

namespace {
std::size_t bf16_rows(int64_t rows, int64_t cols) { return static_cast<std::size_t>(rows * cols) * 2; }
std::string n(int64_t v) { return std::to_string(v); }
}  // namespace

MemoryPlan plan_memory(const Config& config, int sm_count) {
  const ModelConfig& m = config.model;
  const RuntimeConfig& rt = config.runtime;
  const int64_t D = m.hidden_size, P = m.part_dim(), B = rt.largest_bucket(), capacity = rt.batch_token_capacity();
  MemoryPlan p;
  p.windows = max_windows(config);
  p.padded_rows = p.windows * B;
  p.hidden = p.output = bf16_rows(p.padded_rows, D);
  p.in_proj_out = bf16_rows(B, m.in_proj_stride());
  p.planes = bf16_rows(2 * capacity + p.padded_rows, P);
  const unsigned scratch = LayerProgram::scratch_needed(config);
  p.g1 = scratch & kScratchG1 ? bf16_rows(B, P) : 0;
  p.g2 = scratch & kScratchG2 ? bf16_rows(B, P) : 0;
  p.o = scratch & kScratchO ? bf16_rows(B, P) : 0;
  p.y = scratch & kScratchY ? bf16_rows(B, P) : 0;
  p.gemm_workspace = static_cast<std::size_t>(rt.gemm_workspace_bytes);
  if (scratch & kScratchChunkedWorkspace) {
    p.segment_tokens = rt.sequence_parallel ? recurrence::auto_segment_tokens(B, m.num_heads, sm_count) : 0;
    // Sized for the largest bucket and max_seqs: the capacities every window's launch uses.
    RecurrenceArgs a;
    a.num_heads = m.num_heads;
    a.head_dim = m.head_dim;
    a.num_tokens = B;
    a.varlen.num_seqs = rt.max_seqs;
    a.segment_tokens = p.segment_tokens;
    p.chunked_workspace = recurrence::chunked_workspace_bytes(a, sm_count);
  }
  p.staging_slot = StagingLayout::for_config(config).slot_bytes;
  p.staging_device = static_cast<std::size_t>(p.windows) * p.staging_slot;
  p.host_staging_copies = kHostStagingCopies;
  p.staging_host = p.staging_device;
  p.padding_slot = p.staging_slot;
  if (!config.pools.external) {
    p.conv_pool = static_cast<std::size_t>(config.conv_pool_elems()) * dtype_size(config.pools.conv_dtype);
    p.recurrent_pool = static_cast<std::size_t>(config.recurrent_pool_elems()) * dtype_size(config.pools.recurrent_dtype);
  }
  return p;
}

std::vector<ModuleAllocation> MemoryPlan::table(const Config& config) const {
  const ModelConfig& m = config.model;
  const RuntimeConfig& rt = config.runtime;
  const int64_t B = rt.largest_bucket(), P = m.part_dim();
  const std::string rows = "padded rows " + n(padded_rows) + " (" + n(windows) + " window" +
                           (windows == 1 ? "" : "s") + " x largest bucket " + n(B) + ") x D " + n(m.hidden_size) +
                           ", bf16";
  const std::string scratch = "largest bucket " + n(B) + " x P " + n(P) + ", bf16";
  std::vector<ModuleAllocation> t;
  auto add = [&t](const char* name, std::string size, std::size_t bytes, int64_t count = 1, bool host = false) {
    if (bytes) t.push_back({name, std::move(size), bytes, count, host});
  };
  // The layer program's buffers, in LayerProgram's order.
  add("hidden states", rows, hidden);
  add("layer output", rows, output);
  add("in_proj output", "largest bucket " + n(B) + " x in_proj_stride " + n(m.in_proj_stride()) + ", bf16", in_proj_out);
  add("conv planes", "(2 x capacity " + n(rt.batch_token_capacity()) + " + padded rows " + n(padded_rows) + ") x P " +
                         n(P) + ", bf16",
      planes);
  add("g1 scratch", scratch, g1);
  add("g2 scratch", scratch, g2);
  add("recurrence output scratch", scratch, o);
  add("gated RMSNorm output scratch", scratch, y);
  add("cuBLASLt workspace", "runtime.gemm_workspace_mib", gemm_workspace);
  add("chunked recurrence workspace",
      "(largest bucket " + n(B) + " / 64 + max_seqs " + n(rt.max_seqs) + ") x H " + n(m.num_heads) +
          " records of 90624 B" +
          (segment_tokens ? ", and the segment states of " + n(segment_tokens) + "-token segments" : ""),
      chunked_workspace);
  // The module's.
  const char* cd = dtype_name(config.pools.conv_dtype);
  const char* rd = dtype_name(config.pools.recurrent_dtype);
  add("conv-state pool", "cache_lines " + n(config.pools.cache_lines) + " x 3P " + n(3 * P) + " x 3 taps, " + cd,
      conv_pool, rt.num_layers);
  add("recurrent-state pool",
      "cache_lines " + n(config.pools.cache_lines) + " x H " + n(m.num_heads) + " x 128 x 128, " + rd, recurrent_pool,
      rt.num_layers);
  add("metadata staging", n(windows) + " window slots of " + n(static_cast<int64_t>(staging_slot)) + " B",
      staging_device);
  add("host metadata staging", n(windows) + " window slots of " + n(static_cast<int64_t>(staging_slot)) + " B",
      staging_host, host_staging_copies, true);
  add("host padding slot", "one slot of " + n(static_cast<int64_t>(staging_slot)) + " B", padding_slot, 1, true);
  return t;
}

}  // namespace kda::detail

namespace kda {

std::vector<ModuleAllocation> module_memory(const Config& config, int sm_count) {
  validate_config(config);
  KDA_CHECK(sm_count >= 0, "kda::module_memory", "sm_count ", sm_count, " must not be negative");
  return detail::plan_memory(config, sm_count).table(config);
}

}  // namespace kda
