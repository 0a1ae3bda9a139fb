// validate_config: the ranges and relations a Config must satisfy, however it was built.
// No YAML here; the key paths in messages are the YAML keys (docs/config.md) because that is
// where a user fixes them.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "common/check.h"
#include "common/state_elements.h"
#include "config/config_limits.h"
#include "config/config_source.h"
#include "kda/config.h"

namespace kda {
namespace {

using detail::str_cat;

using namespace limits;  // config/config_limits.h
constexpr int64_t kMiB = int64_t{1} << 20;

class Validator {
 public:
  Validator(const Config& config, const detail::ConfigSource* where) : config_(config), where_(where) {}

  // "<source>:<line>: <path>: <what>", with as much of the location as the config knows.
  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    std::string where;
    if (where_ && !where_->file.empty()) {
      where = where_->file;
      if (auto it = where_->key_lines.find(path); it != where_->key_lines.end() && it->second > 0)
        where += str_cat(':', it->second);
      where += ": ";
    }
    KDA_FAIL_AT_INPUT("kda::validate_config", where, path, ": ", what);
  }

  void in_range(const std::string& path, int64_t value, int64_t lo, int64_t hi,
                const char* reason) const {
    if (value < lo || value > hi)
      fail(path, str_cat(value, " is outside [", lo, ", ", hi, "]; ", reason));
  }

  void model() const {
    const ModelConfig& m = config_.model;
    if (m.hidden_size <= 0)
      fail("model.hidden_size", str_cat("expected a positive size, got ", m.hidden_size));
    if (m.hidden_size % 8 != 0)
      fail("model.hidden_size", str_cat(m.hidden_size, " is not a multiple of 8; the GEMMs need ",
                                        "16-byte bf16 rows"));
    in_range("model.hidden_size", m.hidden_size, 8, kMaxHiddenSize,
             "larger sizes are not supported");
    if (m.num_heads <= 0)
      fail("model.num_heads", str_cat("expected a positive head count, got ", m.num_heads));
    in_range("model.num_heads", m.num_heads, 1, kMaxHeads, "larger head counts are not supported");
    if (m.head_dim != 128)
      fail("model.head_dim", str_cat(m.head_dim, " is not supported; only 128 is (the kernels' ",
                                     "tiles are built for K = V = 128)"));
    in_range("model.gate_rank", m.gate_rank, 1, kMaxGateRank, "the gate rank r of f_a/f_b, g_a/g_b");
    if (m.conv_width != 4)
      fail("model.conv_width", str_cat(m.conv_width, " is not supported; only 4 taps are (the ",
                                       "conv keeps 3 state columns)"));
    if (!(m.norm_eps > 0) || !std::isfinite(m.norm_eps))
      fail("model.norm_eps", str_cat("expected a positive finite epsilon, got ", m.norm_eps));
    if (m.gate_lower_bound) {
      const double bound = *m.gate_lower_bound;
      if (!std::isfinite(bound))
        fail("model.gate_lower_bound", str_cat("expected a finite number, got ", bound));
      if (!(bound < 0))
        fail("model.gate_lower_bound",
             str_cat(bound, " is not negative; the bound scales a log-space decay, which must be ",
                     "< 0 (leave the key out or null for the softplus decay)"));
    }
  }

  void runtime() const {
    const RuntimeConfig& r = config_.runtime;
    const auto& buckets = r.token_buckets;
    if (buckets.empty())
      fail("runtime.token_buckets", "no buckets; give at least one token count");
    if (static_cast<int64_t>(buckets.size()) > kMaxBuckets)
      fail("runtime.token_buckets", str_cat(buckets.size(), " buckets; at most ", kMaxBuckets,
                                            " are allowed (each bucket captures its own graphs)"));
    for (std::size_t i = 0; i < buckets.size(); ++i) {
      const std::string path = str_cat("runtime.token_buckets[", i, ']');
      if (buckets[i] < 1)
        fail(path, str_cat(buckets[i], " tokens; a bucket holds at least 1"));
      if (buckets[i] > kMaxBucketTokens)
        fail(path, str_cat(buckets[i], " tokens is more than the largest supported bucket, ",
                           kMaxBucketTokens));
      if (i > 0 && buckets[i] <= buckets[i - 1])
        fail(path, str_cat(buckets[i], " after ", buckets[i - 1], ", buckets must increase"));
    }
    in_range("runtime.max_seqs", r.max_seqs, 1, kMaxSeqs, "sequences per batch");
    const int64_t largest = r.largest_bucket();
    if (r.max_batch_tokens != 0 && r.max_batch_tokens < largest)
      fail("runtime.max_batch_tokens",
           str_cat(r.max_batch_tokens, " is less than the largest bucket, ", largest,
                   "; use 0 for the largest bucket, or more to split batches into windows"));
    if (r.max_batch_tokens > kMaxBatchTokens)
      fail("runtime.max_batch_tokens",
           str_cat(r.max_batch_tokens, " is more than the supported ", kMaxBatchTokens, " tokens"));
    in_range("runtime.num_layers", r.num_layers, 1, kMaxLayers, "KDA layers per module");
    in_range("runtime.max_checkpoints", r.max_checkpoints, 0, kMaxCheckpoints,
             "state checkpoints per batch (0: none)");
    if (r.gemm_workspace_bytes < 0 || r.gemm_workspace_bytes > kMaxWorkspaceBytes)
      fail("runtime.gemm_workspace_mib",
           str_cat(r.gemm_workspace_bytes, " bytes (", r.gemm_workspace_bytes / kMiB,
                   " MiB) is outside [0, 1024] MiB"));
  }

  void tensor_parallel() const {
    const TensorParallelConfig& tp = config_.tensor_parallel;
    in_range("tensor_parallel.size", tp.size, 1, 64, "ranks of one tensor-parallel group");
    if (tp.rank < 0 || tp.rank >= tp.size)
      fail("tensor_parallel.rank", str_cat(tp.rank, " is outside [0, ", tp.size, "); tensor_parallel.size is ", tp.size));
  }

  void pools() const {
    const PoolConfig& p = config_.pools;
    // Cache indices are int32 and the pools hold cache_lines x (H, 128, 128) fp32; the cap keeps
    // both far from overflow.
    if (p.cache_lines < 2)
      fail("pools.cache_lines", str_cat(p.cache_lines, " is too few; a pool needs at least 2 ",
                                        "lines (the null line and one real line)"));
    in_range("pools.cache_lines", p.cache_lines, 2, kMaxCacheLines, "lines per state pool");
    if (p.null_line < 0 || p.null_line >= p.cache_lines)
      fail("pools.null_line", str_cat(p.null_line, " is outside [0, ", p.cache_lines,
                                      "); it must name a line of the pool (pools.cache_lines is ",
                                      p.cache_lines, ")"));
    // A Config built in code may carry any DType.
    if (!is_state_pool_dtype(p.recurrent_dtype))
      fail("pools.recurrent_dtype", str_cat(dtype_name(p.recurrent_dtype), " is not a pool element type; expected fp32 or bf16"));
    if (!is_state_pool_dtype(p.conv_dtype))
      fail("pools.conv_dtype", str_cat(dtype_name(p.conv_dtype), " is not a pool element type; expected fp32 or bf16"));
  }

 private:
  const Config& config_;
  const detail::ConfigSource* where_;
};

}  // namespace

void detail::validate_config(const Config& config, const ConfigSource* where) {
  const Validator v(config, where);
  v.model();
  v.runtime();
  v.pools();
  v.tensor_parallel();
}

void validate_config(const Config& config) { detail::validate_config(config, nullptr); }

}  // namespace kda
