// kda-prefill: the module's configuration (model shape, graph buckets, pools), read from YAML.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kda/error.h"
#include "kda/types.h"

namespace kda {

// Shapes of one KDA layer on this tensor-parallel rank (docs/config.md lists the YAML keys).
struct ModelConfig {
  int64_t hidden_size = 0;                  // D                                    (model.hidden_size)
  int64_t num_heads = 0;                    // H on this rank                       (model.num_heads)
  int64_t head_dim = 128;                   // K = V; only 128 is supported         (model.head_dim)
  int64_t gate_rank = 128;                  // r of f_a/f_b and g_a/g_b             (model.gate_rank)
  int64_t conv_width = 4;                   // short-conv taps; only 4 is supported (model.conv_width)
  double norm_eps = 1e-5;                   // gated RMSNorm epsilon                (model.norm_eps)
  std::optional<double> gate_lower_bound;   // K3-style decay variant when set      (model.gate_lower_bound)

  int64_t part_dim() const { return num_heads * head_dim; }                    // P
  int64_t in_proj_cols() const { return 3 * part_dim() + num_heads + 2 * gate_rank; }  // W_in
  // Row stride of the in_proj output: W_in rounded up to 64 elements (128-byte rows).
  int64_t in_proj_stride() const { return (in_proj_cols() + 63) / 64 * 64; }
};

enum class CaptureMode {
  Eager,  // record every (bucket, layer) window-0 graph at the first begin_forward
  Lazy,   // capture a graph the first time a batch needs it
};

enum class LayerSteps {
  Full,        // the whole KDA layer: in_proj, conv, gates, recurrence, gated RMSNorm, o_proj
  InProjConv,  // in_proj GEMM and packed conv only (plus user steps): the conv planes are the output
};

enum class Recurrence {
  Chunked,       // 64-token chunks in the WY/UT form on tensor cores (kda_chunked): the fast path
  TokenByToken,  // the spec's loop, one token at a time (kda_recurrence_token): the reference path
};

struct RuntimeConfig {
  std::vector<int64_t> token_buckets;   // graph keys, strictly increasing      (runtime.token_buckets)
  int64_t max_seqs = 256;               // sequences per batch                  (runtime.max_seqs)
  int64_t max_batch_tokens = 0;         // 0 = largest bucket; larger allows split
                                        // batches (windows of the largest bucket) (runtime.max_batch_tokens)
  CaptureMode capture = CaptureMode::Lazy;  //                                  (runtime.capture: eager|lazy)
  bool use_graphs = true;               // false: run every step eagerly        (runtime.graphs)
  LayerSteps layer_steps = LayerSteps::Full;  //                       (runtime.layer_steps: full|conv)
  Recurrence recurrence = Recurrence::Chunked;  //                   (runtime.recurrence: chunked|token)
  int64_t num_layers = 1;               // KDA layers held by one module        (runtime.num_layers)
  int64_t gemm_workspace_bytes = 32ll << 20;  // cuBLASLt workspace            (runtime.gemm_workspace_mib)
  // State checkpoints one batch may name in all (BatchView::checkpoint_lines); 0 turns them off.
  // Each window stages this many entries and the conv checkpoint step's grid has this many blocks.
  int64_t max_checkpoints = 0;          //                                      (runtime.max_checkpoints)
  // The chunked recurrence may cut a long sequence into segments walked in parallel when few
  // heads leave SMs idle (docs/design.md, "Segments"). The rounding then depends on the cut, so
  // a run continued from a checkpoint is within tolerance of the uninterrupted run, not
  // bitwise; false keeps every sequence whole.   (runtime.sequence_parallel)
  bool sequence_parallel = true;

  int64_t largest_bucket() const { return token_buckets.empty() ? 0 : token_buckets.back(); }
  int64_t batch_token_capacity() const {
    return max_batch_tokens > 0 ? max_batch_tokens : largest_bucket();
  }
};

// How one line of a recurrent-state pool orders a sequence's state: per head, K x V
// with v fastest, or V x K with k fastest (the transposed form some decode kernels read).
enum class RecurrentLayout {
  HKV,  // (H, K, V)                                                    (pools.recurrent_layout: hkv)
  HVK,  // (H, V, K)                                                    (pools.recurrent_layout: hvk)
};

// How one line of a conv-state pool orders the last 3 inputs of the 3P conv channels.
enum class ConvStateLayout {
  DimTap,  // (3P, 3): a channel's 3 taps together, oldest first        (pools.conv_layout: dim_tap)
  TapDim,  // (3, 3P): one tap of every channel together                (pools.conv_layout: tap_dim)
};

struct PoolConfig {
  // Lines in each layer's conv-state and recurrent-state pool. A sequence's cache index names
  // the same line in both pools. Line `null_line` is the pad line: sequences on it are skipped.
  int64_t cache_lines = 0;              //                                       (pools.cache_lines)
  int32_t null_line = 0;                //                                       (pools.null_line)
  // false: the module allocates every layer's pools (zeroed). true: the server hands each
  // layer's pools to PrefillModule::set_layer_pools before the layer's first forward.
  bool external = false;                //                                       (pools.external)
  RecurrentLayout recurrent_layout = RecurrentLayout::HKV;  //            (pools.recurrent_layout)
  ConvStateLayout conv_layout = ConvStateLayout::DimTap;    //                 (pools.conv_layout)
  // Element type of the pool lines: FP32 or BF16 (pools.recurrent_dtype / pools.conv_dtype:
  // fp32|bf16). The kernels compute in fp32 either way. A bf16 conv state is exact (it holds
  // bf16 conv inputs); a bf16 recurrent state is rounded to nearest even each time a line is
  // written (8 significant bits), docs/layer.md "State pools".
  DType recurrent_dtype = DType::FP32;  //                                   (pools.recurrent_dtype)
  DType conv_dtype = DType::FP32;       //                                        (pools.conv_dtype)
};

// Tensor parallelism: this module runs rank `rank` of `size` ranks; model.num_heads is the heads
// on this rank (the full model has num_heads x size). The ranks' layer outputs must be summed
// (o_proj is row-parallel): by the module's NCCL all-reduce (PrefillModule::set_communicator) or
// by the caller (set_partial_output). src/testing/tp_shard.h (test-only) cuts a full layer's weights and pools.
struct TensorParallelConfig {
  int64_t size = 1;  //                                                       (tensor_parallel.size)
  int64_t rank = 0;  //                                                       (tensor_parallel.rank)
};

struct Config {
  ModelConfig model;
  RuntimeConfig runtime;
  PoolConfig pools;
  TensorParallelConfig tensor_parallel;  // optional section; default one rank
  std::string name;  // for display only; empty when absent (top-level `name:`)

  // Elements of one line of each pool, and of one layer's pools as the module allocates them
  // (lines packed: cache_lines x line elements), in the pools' element types
  // (pools.conv_dtype, pools.recurrent_dtype; dtype_size gives their bytes).
  int64_t conv_line_elems() const { return 3 * model.part_dim() * 3; }
  int64_t recurrent_line_elems() const { return model.num_heads * model.head_dim * model.head_dim; }
  int64_t conv_pool_elems() const { return pools.cache_lines * conv_line_elems(); }
  int64_t recurrent_pool_elems() const { return pools.cache_lines * recurrent_line_elems(); }
};

// Reads and validates a YAML file. Throws kda::Error naming file, line and key path, e.g.
//   "configs/x.yaml:14: runtime.token_buckets[2]: 4096 after 8192, buckets must increase".
// Unknown keys, duplicate keys and wrongly typed values are errors; absent keys take the
// defaults above (model.hidden_size, model.num_heads, runtime.token_buckets and
// pools.cache_lines have none and are required).
Config load_config(const std::string& path);

// Same, from YAML text; `source` names it in messages.
Config parse_config(const std::string& yaml_text, const std::string& source = "<string>");

// Checks a Config however it was built. Throws kda::Error naming the key path
// ("runtime.token_buckets[2]: ..."); load_config and parse_config validate too, and their
// errors also name the file and line.
void validate_config(const Config& config);

}  // namespace kda
