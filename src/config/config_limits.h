// The limits validate_config holds a Config to, in one place: the config's validation and the
// tools that propose config values (runtime/bucket_ladder) read them from here, so a limit
// cannot differ between them. docs/config.md states each with its key.
#pragma once

#include <cstdint>

namespace kda::limits {

constexpr int64_t kMaxHiddenSize = int64_t{1} << 17;     // model.hidden_size
constexpr int64_t kMaxHeads = 1024;                      // model.num_heads
constexpr int64_t kMaxGateRank = 1024;                   // model.gate_rank
constexpr int64_t kMaxBuckets = 64;                      // runtime.token_buckets entries
constexpr int64_t kMaxBucketTokens = int64_t{1} << 20;   // one runtime.token_buckets entry
constexpr int64_t kMaxSeqs = int64_t{1} << 20;           // runtime.max_seqs
constexpr int64_t kMaxBatchTokens = int64_t{1} << 24;    // runtime.max_batch_tokens
constexpr int64_t kMaxLayers = 1024;                     // runtime.num_layers
constexpr int64_t kMaxCheckpoints = int64_t{1} << 16;    // runtime.max_checkpoints (staged per window)
constexpr int64_t kMaxWorkspaceBytes = int64_t{1} << 30; // runtime.gemm_workspace_mib, in bytes
// pools.cache_lines: cache indices are int32 and a pool holds cache_lines x (H, 128, 128)
// elements; the cap keeps both far from overflow.
constexpr int64_t kMaxCacheLines = int64_t{1} << 24;

}  // namespace kda::limits
