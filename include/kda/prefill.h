// kda-prefill: the KDA-layer prefill module a server links and drives.
//
// A PrefillModule owns everything a prefill forward needs, allocated once at construction from
// the Config: activation buffers, the in_proj output, the three conv planes, per-layer conv-state
// and recurrent-state pools (unless pools.external: then the server hands them over with
// set_layer_pools), batch-metadata staging (pinned host + device) and the cuBLASLt workspace. Per (token bucket, layer, window) it records the layer's steps (in_proj GEMM,
// packed conv, and with runtime.layer_steps: full the gate GEMMs, the gated delta-rule
// recurrence, the gated RMSNorm and o_proj into output(), then the tensor-parallel all-reduce
// when a communicator is set; then the steps added with add_step) into a CUDA graph, and
// replays it for every batch that fits the bucket with the new query_start_loc, cache lines
// and flags.
//
// Threading: a module is driven from one host thread at a time and its work is ordered on the
// stream given to begin_forward/run_layer; use one stream per module (the device-side metadata
// staging is single-buffered and relies on that order: run_layer refuses a stream other than its
// batch's begin_forward's, and a begin_forward on another stream than the last batch's is not
// ordered after that batch's work by the module: the caller must order it, e.g. with an event). No
// member function may be called concurrently with another on the same module, const ones (config,
// output, stats) included. Different modules are independent and may be driven from different
// threads on different streams at the same time. The caller may write hidden_states() and read
// output(), the planes and the pools from any stream once it has ordered that access after the
// module's work.
//
// After an error: every throw is a kda::Error, and the module is then either exactly as before the
// call or refuses to run until the caller acts. A refused argument, config, batch, pool or weight
// changes nothing. begin_forward drops the previous batch before it validates the new one: after it
// throws, no batch is staged and run_layer throws until a begin_forward succeeds. A batch runs at
// most once per layer: a second run_layer of a layer throws and writes nothing. A run_layer (or
// profile_steps, self_check) that fails once work is enqueued (a step that throws, a failed graph
// capture after the window ran eagerly, a CUDA error) marks the batch failed: its error says which
// layers and windows (batch rows) were written, those sequences' state lines have advanced (drop
// them or restore them), and every later run_layer of the batch throws until the next
// begin_forward. A change of the step list (add_step, set_communicator, set_partial_output, allowed
// until a begin_forward has staged a batch) drops every graph recorded before it, so a failed eager
// capture never leaves graphs of an older step list. Every member function works on the module's
// device (the one current at construction) whatever device is current on the calling thread, and
// gives the caller's device back; a stream of another device is refused, naming both.
//
// Graphs: the (bucket, layer, window) graph records the layer's weight pointers and the step
// list. runtime.capture: lazy records a graph the first time a batch needs it, after running
// that window eagerly (the batch's work, which also loads every kernel). runtime.capture: eager
// records the (bucket, layer, window 0) graphs of every layer that has weights and pools at the
// first begin_forward (set the weights, and with pools.external the pools, by then; graphs of
// later windows are recorded lazily).
// Setting weights with different pointers makes that layer's graphs stale: they are
// re-recorded on next use (cudaGraphExecUpdate first). runtime.graphs: false or set_eager(true)
// runs the same steps eagerly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kda/config.h"
#include "kda/error.h"
#include "kda/packed_conv.h"
#include "kda/types.h"

// NCCL's communicator handle, declared exactly as nccl.h declares it, so that this header needs
// no nccl.h (and compiles where NCCL is not installed).
struct ncclComm;
typedef struct ncclComm* ncclComm_t;

namespace kda {

// True when the library was built with NCCL (meson option nccl): only then can a module
// all-reduce the tensor-parallel ranks' outputs itself (PrefillModule::set_communicator).
bool nccl_available();

// One forward's batch metadata, in host memory; not retained after begin_forward returns.
// Sequence s owns rows [query_start_loc[s], query_start_loc[s+1]) of hidden_states().
// A skipped sequence (on pools.null_line) writes no conv-plane row and touches no pool line;
// its rows of output() hold unspecified values (o_proj runs over every bucket row).
struct BatchView {
  const int32_t* query_start_loc = nullptr;  // num_seqs + 1 entries, [0] == 0, non-decreasing
  const int32_t* cache_indices = nullptr;    // num_seqs entries: the pool line of each sequence;
                                             // pools.null_line marks a skipped sequence
  const bool* has_initial_state = nullptr;   // num_seqs entries: continue from the line's state
  int64_t num_seqs = 0;

  // State checkpoints for prefix caching (runtime.max_checkpoints > 0; all three null: none).
  // Sequence s fills the lines checkpoint_lines[checkpoint_start_loc[s] .. checkpoint_start_loc[s+1])
  // in order: its j-th line receives the conv state and the recurrent state as they stand after
  // (j + 1) x checkpoint_interval[s] of its rows in this batch (offsets count this batch's rows
  // of s, whatever state it started from). A later batch that names such a line as a sequence's
  // cache line with has_initial_state continues from that offset: docs/design.md says when the
  // result is bitwise that of the uninterrupted run. The checkpoints are written by the same
  // graphs as the rest of the forward (no host synchronisation, no allocation).
  // Refused by begin_forward, before anything is staged or written: an interval that is not a
  // positive multiple of 64 (the recurrence's chunk) on a sequence with lines, more lines than
  // offsets (count x interval > the sequence's rows), a line outside [0, cache_lines) or on
  // pools.null_line, a line named twice or also named in cache_indices, lines on a skipped
  // sequence, more than runtime.max_checkpoints lines, and a checkpoint that a window boundary
  // puts inside a 64-token chunk (a sequence split across windows at a row that is not a
  // multiple of 64 from its start: start such sequences at rows that are multiples of 64 and
  // use a largest bucket that is one).
  const int32_t* checkpoint_interval = nullptr;   // num_seqs entries: tokens; 0 with no lines
  const int32_t* checkpoint_start_loc = nullptr;  // num_seqs + 1 entries, [0] == 0, non-decreasing
  const int32_t* checkpoint_lines = nullptr;      // checkpoint_start_loc[num_seqs] entries

  int64_t num_tokens() const { return num_seqs > 0 ? query_start_loc[num_seqs] : 0; }
  int64_t num_checkpoints() const {
    return num_seqs > 0 && checkpoint_start_loc ? checkpoint_start_loc[num_seqs] : 0;
  }
};

// Device weights of one layer, row-major, shapes as in docs/layer.md (P = H x 128, D hidden,
// r gate rank). The module neither copies nor frees them: they must outlive its use of them.
struct LayerWeights {
  const void* in_proj = nullptr;        // (in_proj_rows, D) bf16: rows q|k|v|b|f_a|g_a
  // Rows of in_proj: in_proj_cols() (3P + H + 2r), also written 0 (the unpadded weight), or
  // in_proj_stride() when the weight is padded with rows that are never read back (zeros, say).
  // The padded width lets the in_proj GEMM run with N a multiple of 16, a much faster width
  // (docs/perf.md).
  int64_t in_proj_rows = 0;
  const float* conv_weight = nullptr;   // (3P, 4) fp32
  const void* f_b = nullptr;            // (P, r) bf16
  const void* g_b = nullptr;            // (P, r) bf16
  const float* A_log = nullptr;         // (H) fp32
  const float* dt_bias = nullptr;       // (P) fp32
  const void* o_norm_weight = nullptr;  // (128) bf16
  const void* o_proj = nullptr;         // (D, P) bf16
};

// Element strides of a layer's pools, as the config's layouts and the pools' line strides give
// them (pools.conv_layout, pools.recurrent_layout, StatePools).
struct ConvStateStrides {
  int64_t line = 0, dim = 0, tap = 0;  // channel c's tap j of line l: [l * line + c * dim + j * tap]
};
struct RecurrentStateStrides {
  // head h's element (key channel i, value channel j) of line l:
  // [l * line + h * head + i * k + j * v]
  int64_t line = 0, head = 0, k = 0, v = 0;
};

// One layer's state pools in device memory the server owns (pools.external: true), in the
// config's layouts and element types (pools.conv_dtype, pools.recurrent_dtype: fp32 or bf16).
// Lines [0, pools.cache_lines) are read and written; whatever lies between lines (a line stride
// above the line's elements) is never touched. Strides count elements of the pool's type.
struct StatePools {
  void* conv = nullptr;
  int64_t conv_line_stride = 0;       // elements between lines; 0: conv_line_elems() (packed)
  void* recurrent = nullptr;
  int64_t recurrent_line_stride = 0;  // elements between lines; 0: recurrent_line_elems()
  int64_t lines = 0;                  // lines the memory holds; >= pools.cache_lines
};

// What a step sees when it is recorded: device pointers for one (layer, window). All row
// counts are the bucket's; rows at or past query_start_loc[num_seqs] are padding.
struct StepContext {
  int layer = 0;
  int64_t bucket_tokens = 0;               // rows of every per-token buffer below
  int64_t max_seqs = 0;                    // entries of the metadata arrays (capacity)
  const int32_t* query_start_loc = nullptr;  // (max_seqs + 1), window-local, padded by repetition
  const int32_t* cache_indices = nullptr;    // (max_seqs), padded with pools.null_line
  const bool* has_initial_state = nullptr;   // (max_seqs)
  const void* hidden = nullptr;            // (bucket_tokens, D) bf16
  void* in_proj_out = nullptr;             // (bucket_tokens, in_proj_stride) bf16
  void* q = nullptr;                       // (bucket_tokens, P) bf16, conv output planes
  void* k = nullptr;
  void* v = nullptr;
  void* out = nullptr;                     // (bucket_tokens, D) bf16 layer output
  void* conv_states = nullptr;             // this layer's conv pool, conv_strides, conv_state_dtype
  void* recurrent_states = nullptr;        // this layer's recurrent pool, recurrent_strides, ..._dtype
  ConvStateStrides conv_strides;
  RecurrentStateStrides recurrent_strides;
  DType conv_state_dtype = DType::FP32;       // pools.conv_dtype: FP32 or BF16
  DType recurrent_state_dtype = DType::FP32;  // pools.recurrent_dtype: FP32 or BF16
  const LayerWeights* weights = nullptr;
  const Config* config = nullptr;
};

// A step enqueues work on the stream and nothing else: no host synchronisation, no allocation,
// no reads of host memory that changes per batch (it may be recorded into a graph once and
// replayed many times).
using Step = std::function<void(const StepContext& ctx, Stream stream)>;

struct BucketStats {
  int64_t bucket_tokens = 0;
  int layer = 0;
  int window = 0;
  double capture_us = 0;       // stream capture of the steps
  double instantiate_us = 0;   // cudaGraphInstantiate
  int64_t graph_nodes = 0;
  int64_t replays = 0;
  double mean_replay_us = 0;   // GPU time per replay (events on every 8th replay), 0 until measured
};

struct ModuleStats {
  std::vector<BucketStats> graphs;  // one entry per captured (bucket, layer, window)
  int64_t forwards = 0;             // begin_forward calls
  double mean_host_us_begin = 0;    // host time per begin_forward (validate, plan, stage)
  double mean_host_us_layer = 0;    // host time per run_layer (all windows)
  int64_t eager_layer_runs = 0;     // (layer, window) step lists launched eagerly, warm-ups included
};

struct StepTiming {
  std::string name;   // "in_proj GEMM", "packed conv", ..., "o_proj GEMM", "all-reduce", "user step 0"
  double gpu_us = 0;  // summed over the batch's windows
};

struct SelfCheckReport {
  bool ok = true;
  int64_t graph_vs_eager_diff_bits = 0;  // planes, conv pool and recurrent pool, all layers
  int64_t conv_vs_stock_diff_bits = 0;   // packed conv planes + states vs the stock-path baseline
  std::string detail;                    // one line per comparison
};

// One allocation PrefillModule's constructor makes.
struct ModuleAllocation {
  std::string name;          // what it holds, e.g. "conv planes", "recurrent-state pool"
  std::string size;          // how the config sizes it, e.g. "padded rows 2048 x D 7168, bf16"
  std::size_t bytes = 0;     // of one allocation
  int64_t count = 1;         // how many: runtime.num_layers for the per-layer pools
  bool pinned_host = false;  // pinned host memory (the metadata staging), not device memory
};

// Every allocation PrefillModule(config) makes, in the order it makes them: the plan the
// constructor allocates from. `sm_count`, the multiprocessors of the device the module will
// run on, sizes the chunked recurrence's segment workspace (runtime.sequence_parallel cuts
// long sequences only with few heads per SM); 0 sizes it for no cut. Memory that CUDA,
// cuBLASLt and the graphs take for themselves is not in it, nor what init_random_weights,
// upload_layer_weights and self_check allocate later. Needs no GPU; throws kda::Error for an
// invalid config (as validate_config does).
std::vector<ModuleAllocation> module_memory(const Config& config, int sm_count);

class PrefillModule {
 public:
  // Validates the config and allocates everything on the current CUDA device. Throws kda::Error.
  explicit PrefillModule(const Config& config);
  ~PrefillModule();
  PrefillModule(const PrefillModule&) = delete;
  PrefillModule& operator=(const PrefillModule&) = delete;

  const Config& config() const;

  // Module-owned device buffers (bf16, row stride D, runtime.batch_token_capacity() rows):
  // write the batch's hidden states into hidden_states() rows [0, T) before run_layer.
  void* hidden_states();
  const void* output() const;
  // The conv planes q, k, v, bf16 rows of P: plane i at conv_planes() + i*capacity*P, its rows
  // [0, capacity) the batch's (capacity = runtime.batch_token_capacity()). The buffer has
  // 2*capacity + windows*largest bucket rows (windows = ceil(capacity / largest bucket)): the
  // last window's bucket rows of plane 2 reach past capacity when capacity is not a multiple of
  // the largest bucket.
  const void* conv_planes() const;
  const void* in_proj_output() const;  // (largest bucket, in_proj_stride) bf16 scratch
  // This layer's pools: conv (cache_lines, 3P, 3) and recurrent (cache_lines, H, 128, 128) in
  // the default layouts, packed, when the module owns them; the server's memory with
  // pools.external (null until set_layer_pools). Elements are fp32 or bf16 as pools.conv_dtype
  // and pools.recurrent_dtype say. state_pools(layer) gives the strides too.
  void* conv_state_pool(int layer);
  void* recurrent_state_pool(int layer);
  StatePools state_pools(int layer) const;
  ConvStateStrides conv_state_strides(int layer) const;
  RecurrentStateStrides recurrent_state_strides(int layer) const;

  // pools.external: true. Hands the module this layer's pools (not copied, not freed: they must
  // outlive the module's use of them). Needed before the layer's first forward. Throws, and
  // keeps the old pools, when the config owns its pools, a pointer is null or not aligned to
  // its element type, a line stride is below the line's elements, lines < pools.cache_lines,
  // or a step cannot run them. Graphs record the pool pointers: other pointers than before
  // make the layer's graphs stale (re-recorded on next use), the same pointers keep them.
  void set_layer_pools(int layer, const StatePools& pools);

  // Weights: device pointers owned by the caller, or module-owned seeded random weights
  // (deterministic for a seed; for the driver, tests and benchmarks).
  // set_layer_weights needs all eight pointers non-null and in_proj 16-byte aligned, and checks
  // that the packed conv can run them; it throws and keeps the old weights otherwise.
  // init_random_weights waits for the device (no forward may still read the old weights),
  // fills every layer and waits again. It and upload_layer_weights refill module-owned storage:
  // until the new weights are in place, every layer whose weights lie in that storage has none,
  // so after a copy that fails part way those layers refuse to run (rather than run on a mix of
  // old and new values) until they are given weights again. Refilling the same storage keeps
  // the graphs (same pointers).
  void set_layer_weights(int layer, const LayerWeights& weights);
  // Copies host arrays of the same shapes (in_proj_rows as for set_layer_weights) into
  // module-owned device storage, in_proj padded with zero rows to in_proj_stride(), then uses
  // them as set_layer_weights does. Synchronous; the host arrays may be freed when it returns.
  // Throws kda::Error on a null array.
  void upload_layer_weights(int layer, const LayerWeights& host_weights);
  void init_random_weights(uint64_t seed);
  const LayerWeights& layer_weights(int layer) const;

  // Appends a step after the built-in ones. Only until a begin_forward has staged a batch
  // (graphs record the step list); throws afterwards. Drops every graph recorded so far. A step
  // that throws is reported as a kda::Error naming it ("user step 0 threw: ...").
  void add_step(Step step);

  // Tensor parallelism (config.tensor_parallel). A rank's module holds its own heads
  // (model.num_heads is per rank) and writes its partial o_proj sum into output(); o_proj is
  // row-parallel, so the ranks' outputs must be summed. There are two ways to get that sum, chosen
  // before the first forward:
  //  - set_communicator(comm): the module sums the outputs itself. ncclAllReduce (bf16, sum, in
  //    place on output() rows [0, bucket) of each window, on the module's stream) runs as the last
  //    built-in step, after o_proj and before the user steps. It is recorded into the same
  //    per-bucket graphs, and it also runs in eager runs, self_check and profile_steps (step name
  //    "all-reduce"). comm is the server's NCCL communicator of the tensor-parallel group: its
  //    size and rank must equal tensor_parallel.size and .rank, and its device must be the
  //    module's. The module does not own comm and never destroys it, but comm must outlive the
  //    module because recorded graphs hold NCCL resources. With size 1 the all-reduce is recorded
  //    too, and NCCL makes it an identity.
  //  - set_partial_output(true): no all-reduce, and output() holds this rank's partial sum. This
  //    is for servers that reduce the outputs themselves, and for tests. It takes precedence over
  //    a communicator; false (the default) undoes it.
  // With tensor_parallel.size > 1 and runtime.layer_steps: full, one of the two is required: the
  // first begin_forward (and so run, self_check and profile_steps) throws otherwise. With
  // layer_steps: conv there is no layer output to sum: set_communicator throws and
  // set_partial_output has no effect. Both throw after the first forward (graphs record the step
  // list), and when they throw nothing changes. set_communicator also throws when the library was
  // built without NCCL (nccl_available()).
  //
  // The all-reduce is an NCCL collective, and NCCL requires every rank to capture and launch the
  // matching graphs. So every rank's module must be driven the same way: the same config apart
  // from the rank, the same batches, and the same calls in the same order (run / run_layer,
  // set_eager, weight changes that re-record graphs, self_check, profile_steps). One host thread
  // or process per rank; NCCL may deadlock when one thread drives several ranks' graphs.
  void set_communicator(ncclComm_t comm);
  void set_partial_output(bool partial);

  // Validates the batch on the host (throws, writing nothing, on error), picks the bucket or
  // splits it into windows of the largest bucket, stages all metadata with one async copy.
  // The previous batch is dropped first: after a throw no batch is staged.
  // May block the host: the staging is a ring of 4 pinned buffers, and refilling one waits for
  // its copy 4 forwards back, so the host runs at most 4 forwards ahead of the GPU
  // (docs/design.md); with runtime.capture: eager it also records the graphs (see Graphs above).
  void begin_forward(const BatchView& batch, Stream stream);
  // Runs one layer over the batch of the last begin_forward: replays (capturing on first use) the
  // graph of each window's bucket, or launches the steps eagerly when graphs are off. Throws,
  // writing nothing, for a layer out of range or without weights or pools, when no batch is staged
  // (none yet, or the last begin_forward failed), when this layer has run the batch already, after
  // a failed run_layer of the batch, and for a stream other than the one the batch's begin_forward
  // was given. A failure once work is enqueued marks the batch failed and names the layers and
  // windows written (the paragraph "After an error" at the top).
  void run_layer(int layer, Stream stream);
  // begin_forward, then run_layer for every layer in order. Checks first that every layer has
  // weights, so a failure changes nothing.
  void run(const BatchView& batch, Stream stream);

  // Debug switch: run the same steps eagerly instead of replaying graphs.
  void set_eager(bool eager);

  // Runs the batch eagerly and as graphs from the same starting pools and compares planes and
  // pools bitwise; also compares the packed conv with the stock-path baseline. Leaves the pools
  // as one run of the batch leaves them. Synchronises the stream.
  // Debug path: allocates copies of all pools. The planes are compared on the batch's rows
  // [0, T) after each layer, the layer output (layer_steps: full) on the rows of the sequences
  // that ran (skipped sequences' output rows are unspecified). The baseline convolves, per window, the module's in_proj output of
  // that window with the window's staged metadata, from its own copy of the starting conv pool
  // (multi-window batches included). Graphs are recorded for the check even when graphs are
  // off. Every layer must have weights. A bad batch throws before anything runs.
  SelfCheckReport self_check(const BatchView& batch, Stream stream);

  // Profiling: stages the batch, runs one layer's steps eagerly with CUDA events between them
  // and returns each step's GPU time. Advances the pools like a run of that layer. Synchronises
  // the stream.
  std::vector<StepTiming> profile_steps(const BatchView& batch, int layer, Stream stream);

  // (self_check runs every layer of its batch and profile_steps the layer it times: run_layer
  // refuses those layers of that batch afterwards. A failure part way through either marks the
  // batch failed, as a run_layer that throws does, and its error says what may be written.)

  // Synchronises the stream to read replay timings.
  ModuleStats stats(Stream stream) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kda
