// PrefillModule::Impl: buffers, staging, the layer step list, keyed graphs and replay.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/cuda_check.h"
#include "conv/stock_conv.h"
#include "graph_cache.h"
#include "kda/prefill.h"
#include "recurrence/kda_chunked.h"
#include "norm/gated_rmsnorm.h"
#include "recurrence/kda_recurrence.h"
#include "runtime/step_args.h"
#include "runtime/batch_plan.h"
#include "runtime/gemm_plan.h"
#include "runtime/random_weights.h"
#include "runtime/tp_comm.h"

namespace kda {

using detail::str_cat;

namespace {

using Clock = std::chrono::steady_clock;

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// Device memory owned by the module; zero bytes holds no allocation.
class DeviceAlloc {
 public:
  DeviceAlloc() = default;
  DeviceAlloc(std::size_t bytes, const char* what) : bytes_(bytes) {
    if (bytes_ == 0) return;
    const cudaError_t err = cudaMalloc(&ptr_, bytes_);
    if (err != cudaSuccess) {
      cudaGetLastError();
      KDA_FAIL("kda::PrefillModule", "cudaMalloc of ", bytes_, " bytes for ", what, " failed: ",
               cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
    }
  }
  ~DeviceAlloc() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceAlloc(DeviceAlloc&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceAlloc& operator=(DeviceAlloc&& o) noexcept {
    if (this != &o) {
      if (ptr_) cudaFree(ptr_);
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  char* get() const { return static_cast<char*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// Pinned host memory (async copies from it are truly asynchronous).
class PinnedAlloc {
 public:
  PinnedAlloc() = default;
  PinnedAlloc(std::size_t bytes, const char* what) {
    if (bytes == 0) return;
    const cudaError_t err = cudaMallocHost(&ptr_, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      KDA_FAIL("kda::PrefillModule", "cudaMallocHost of ", bytes, " bytes for ", what,
               " failed: ", cudaGetErrorName(err));
    }
    std::memset(ptr_, 0, bytes);
  }
  ~PinnedAlloc() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  PinnedAlloc(PinnedAlloc&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)) {}
  PinnedAlloc& operator=(PinnedAlloc&& o) noexcept {
    if (this != &o) {
      if (ptr_) cudaFreeHost(ptr_);
      ptr_ = std::exchange(o.ptr_, nullptr);
    }
    return *this;
  }
  char* get() const { return static_cast<char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
};

class Event {
 public:
  Event() { KDA_CUDA_CHECK("kda::PrefillModule", cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~Event() {
    if (event_) cudaEventDestroy(event_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Largest power of two <= 256 dividing `bytes` (the alignment of every window's row block).
uint32_t pow2_alignment(std::size_t bytes) {
  uint32_t a = 256;
  while (a > 1 && bytes % a != 0) a /= 2;
  return a;
}

int64_t popcount_diff(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b) {
  int64_t bits = 0;
  const std::size_t n = std::min(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) bits += __builtin_popcount(static_cast<unsigned>(a[i] ^ b[i]));
  return bits;
}

}  // namespace

struct PrefillModule::Impl {
  // How run_window executes a (layer, window): as configured, forced eager, or forced graph
  // replay (capturing a missing graph without the warm-up run, for self_check).
  enum class Mode { Auto, Eager, Replay };

  explicit Impl(const Config& cfg);
  ~Impl();

  // Shapes, fixed at construction.
  Config config;
  int device = 0;  // the CUDA device everything is allocated on
  int num_layers = 0;
  int64_t D = 0, P = 0, H = 0, in_cols = 0, in_stride = 0;
  int64_t f_a_col = 0, g_a_col = 0;  // first columns of f_a and g_a in the in_proj output
  int64_t B = 0;             // largest bucket: rows per window
  int64_t capacity = 0;      // runtime.batch_token_capacity()
  int64_t windows_max = 0;   // staging slots
  int64_t padded_rows = 0;   // windows_max * B >= capacity: every window's bucket rows exist
  int64_t cache_lines = 0;
  std::size_t conv_pool_bytes = 0, rec_pool_bytes = 0;
  detail::StagingLayout staging;

  // Device buffers.
  DeviceAlloc hidden, output, in_proj_out, planes, staging_dev, gemm_workspace, random_storage;
  std::vector<DeviceAlloc> uploaded_weights;  // per layer, for upload_layer_weights
  // Downstream-step scratch (runtime.layer_steps: full), largest-bucket rows, row stride P,
  // shared by layers and windows like in_proj_out: g1 = f_a f_b^T, g2 = g_a g_b^T, the
  // recurrence output o and the gated-RMSNorm output y.
  DeviceAlloc g1_buf, g2_buf, o_buf, y_buf;
  DeviceAlloc chunked_workspace;  // kda_chunked's per-chunk records (runtime.recurrence: chunked)
  std::vector<DeviceAlloc> conv_pools, rec_pools;
  // Host staging, a ring of kHostStagingSlots: staging_done[h] is recorded after the copy out of
  // slot h, so refilling slot h waits only for the copy kHostStagingSlots forwards back, and the
  // host may run that many forwards ahead of the GPU without blocking in begin_forward.
  static constexpr int kHostStagingSlots = 4;
  PinnedAlloc staging_host[kHostStagingSlots];
  Event staging_done[kHostStagingSlots];
  int staging_next = 0;
  PinnedAlloc padding_slot;  // one slot of an all-padding batch: every sequence empty

  detail::LtHandle lt;
  // in_proj over the unpadded width W_in, and over in_proj_stride for weights padded to it
  // (LayerWeights::in_proj_rows); the same plan when the two widths agree.
  std::unique_ptr<detail::GemmPlan> in_proj_gemm, in_proj_gemm_padded, g1_gemm, g2_gemm, o_proj_gemm;
  bool full_layer() const { return config.runtime.layer_steps == LayerSteps::Full; }
  bool chunked() const { return full_layer() && config.runtime.recurrence == Recurrence::Chunked; }
  detail::GraphCache graphs;
  detail::BatchValidator validator;

  std::vector<LayerWeights> weights;
  std::vector<bool> has_weights;
  // Graphs record weight pointers: a layer's version changes when its pointers change, which
  // makes its graphs stale (re-recorded on next use).
  std::vector<uint64_t> weights_version;
  uint64_t next_version = 1;

  std::vector<Step> builtin_steps, user_steps;
  std::vector<const char*> builtin_names;  // one per built-in step, for profile_steps
  // Tensor parallelism: the server's communicator (not owned) and the partial-output switch.
  // Both are fixed from the first forward on, so every recorded graph and eager run has the
  // same step list.
  ncclComm_t comm = nullptr;
  bool partial_output = false;
  Step all_reduce_step;  // in place on ctx.out rows [0, bucket_tokens)
  bool all_reduce_active() const { return full_layer() && comm != nullptr && !partial_output; }
  std::vector<detail::WindowPlan> windows, next_windows;
  bool batch_staged = false;
  bool forward_started = false;
  bool eager = false;
  bool kernels_warm = false;  // the eager-capture warm-up has run
  bool eager_graphs_current = false;  // every window-0 graph of every layer with weights is recorded

  int64_t forwards = 0, layer_calls = 0, eager_runs = 0;
  double begin_us_total = 0, layer_us_total = 0;

  bool graphs_active() const { return config.runtime.use_graphs && !eager; }
  void check_layer(int layer, const char* fn) const;
  void check_tp_ready(const char* fn) const;
  // Calls f(name, step) for every step in recorded order: built-ins, the all-reduce when active,
  // then user steps.
  template <typename F>
  void for_each_step(F&& f) const;
  void check_layer_ready(int layer, const char* fn) const;

  StepContext make_context(int layer, int window, int64_t bucket, const char* slot) const;
  PackedConvArgs conv_args(const StepContext& ctx) const;
  void build_builtin_steps();
  void run_steps(const StepContext& ctx, cudaStream_t stream) const;
  void run_window(int layer, int window, Mode mode, cudaStream_t stream);
  void capture_eager_graphs(cudaStream_t stream);
  void stage(const BatchView& batch, cudaStream_t stream);
  void set_weights(int layer, const LayerWeights& w, const char* fn);
};

PrefillModule::Impl::Impl(const Config& cfg) : config(cfg), validator(cfg) {
  constexpr const char* fn = "kda::PrefillModule::PrefillModule";
  const ModelConfig& m = config.model;
  KDA_CHECK(m.head_dim == 128, fn, "model.head_dim ", m.head_dim, " is not supported: only 128 is");
  KDA_CHECK(m.conv_width == 4, fn, "model.conv_width ", m.conv_width, " is not supported: only 4 is");
  num_layers = static_cast<int>(config.runtime.num_layers);
  D = m.hidden_size;
  P = m.part_dim();
  H = m.num_heads;
  in_cols = m.in_proj_cols();
  in_stride = m.in_proj_stride();
  f_a_col = 3 * P + H;
  g_a_col = f_a_col + m.gate_rank;
  B = config.runtime.largest_bucket();
  capacity = config.runtime.batch_token_capacity();
  windows_max = detail::max_windows(config);
  padded_rows = windows_max * B;
  cache_lines = config.pools.cache_lines;
  staging = detail::StagingLayout::for_max_seqs(config.runtime.max_seqs);
  conv_pool_bytes = static_cast<std::size_t>(config.conv_pool_elems()) * sizeof(float);
  rec_pool_bytes = static_cast<std::size_t>(config.recurrent_pool_elems()) * sizeof(float);

  KDA_CUDA_CHECK(fn, cudaGetDevice(&device));

  hidden = DeviceAlloc(static_cast<std::size_t>(padded_rows * D) * 2, "hidden states");
  output = DeviceAlloc(static_cast<std::size_t>(padded_rows * D) * 2, "layer output");
  in_proj_out = DeviceAlloc(static_cast<std::size_t>(B * in_stride) * 2, "in_proj output");
  // Planes (3, capacity, P) plus the tail that the last window's bucket rows of plane 2 reach.
  planes = DeviceAlloc(static_cast<std::size_t>((2 * capacity + padded_rows) * P) * 2, "conv planes");
  staging_dev = DeviceAlloc(static_cast<std::size_t>(windows_max) * staging.slot_bytes, "metadata staging");
  if (full_layer()) {
    const std::size_t scratch = static_cast<std::size_t>(B * P) * 2;
    g1_buf = DeviceAlloc(scratch, "g1 (f_a f_b^T)");
    g2_buf = DeviceAlloc(scratch, "g2 (g_a g_b^T)");
    o_buf = DeviceAlloc(scratch, "recurrence output o");
    y_buf = DeviceAlloc(scratch, "gated RMSNorm output y");
  }
  gemm_workspace = DeviceAlloc(static_cast<std::size_t>(config.runtime.gemm_workspace_bytes), "cuBLASLt workspace");
  for (int l = 0; l < num_layers; ++l) {
    conv_pools.emplace_back(conv_pool_bytes, "conv-state pool");
    rec_pools.emplace_back(rec_pool_bytes, "recurrent-state pool");
  }
  for (auto& h : staging_host) h = PinnedAlloc(static_cast<std::size_t>(windows_max) * staging.slot_bytes, "host staging");
  padding_slot = PinnedAlloc(staging.slot_bytes, "padding slot");
  {
    // query_start_loc all 0 (PinnedAlloc zeroes), every line null, no initial state.
    auto* ci = reinterpret_cast<int32_t*>(padding_slot.get() + staging.cache_offset);
    for (int64_t s = 0; s < config.runtime.max_seqs; ++s) ci[s] = config.pools.null_line;
  }

  // Zeroed so that pools start empty and no buffer ever holds uninitialised bits (the in_proj
  // output's pad columns [in_cols, in_stride) are never written by the GEMM).
  for (const DeviceAlloc* a : {&hidden, &output, &in_proj_out, &planes, &staging_dev, &g1_buf,
                               &g2_buf, &o_buf, &y_buf})
    if (a->bytes()) KDA_CUDA_CHECK(fn, cudaMemset(a->get(), 0, a->bytes()));
  for (int l = 0; l < num_layers; ++l) {
    KDA_CUDA_CHECK(fn, cudaMemset(conv_pools[l].get(), 0, conv_pool_bytes));
    KDA_CUDA_CHECK(fn, cudaMemset(rec_pools[l].get(), 0, rec_pool_bytes));
  }
  KDA_CUDA_CHECK(fn, cudaDeviceSynchronize());

  detail::GemmShape in_shape;
  in_shape.n = in_cols;
  in_shape.k = D;
  in_shape.lda = D;
  in_shape.ldw = D;
  in_shape.ldc = in_stride;
  // Window w reads hidden rows from w * B; caller-owned weights need only 16-byte alignment.
  in_shape.align_a = windows_max > 1 ? pow2_alignment(static_cast<std::size_t>(B * D) * 2) : 256;
  in_shape.align_w = 16;
  in_shape.align_c = 256;
  const auto workspace_bytes = static_cast<std::size_t>(config.runtime.gemm_workspace_bytes);
  in_proj_gemm = std::make_unique<detail::GemmPlan>(lt.get(), in_shape, config.runtime.token_buckets,
                                                    workspace_bytes);
  if (in_stride != in_cols) {
    // Zero-padded weights let the GEMM's N be a multiple of 16: measured on the H200 at 16384
    // tokens, seed scale, N = 4876: 277 TFLOP/s, N = 4880: 722 (GemmPlan's choice), N = 4928:
    // <= 687 (docs/perf-notes.md). Rows past N (up to in_proj_stride) are not read.
    const int64_t n16 = (in_cols + 15) / 16 * 16;
    in_shape.n = n16 != in_cols ? n16 : in_stride;
    in_proj_gemm_padded = std::make_unique<detail::GemmPlan>(lt.get(), in_shape, config.runtime.token_buckets,
                                                             workspace_bytes);
  }
  if (full_layer()) {
    // g1 / g2 read the f_a / g_a columns of the in_proj output in place: their alignment is the
    // column offset's (rows are 128-byte multiples apart, in_proj_stride being a multiple of 64).
    const int64_t r = m.gate_rank;
    detail::GemmShape gate;
    gate.n = P;
    gate.k = r;
    gate.lda = in_stride;
    gate.ldw = r;
    gate.ldc = P;
    gate.align_w = 16;
    gate.align_c = 256;
    gate.align_a = pow2_alignment(static_cast<std::size_t>(f_a_col) * 2);
    g1_gemm = std::make_unique<detail::GemmPlan>(lt.get(), gate, config.runtime.token_buckets, workspace_bytes);
    gate.align_a = pow2_alignment(static_cast<std::size_t>(g_a_col) * 2);
    g2_gemm = std::make_unique<detail::GemmPlan>(lt.get(), gate, config.runtime.token_buckets, workspace_bytes);
    // o_proj writes the window's rows of the output buffer.
    detail::GemmShape out_shape;
    out_shape.n = D;
    out_shape.k = P;
    out_shape.lda = P;
    out_shape.ldw = P;
    out_shape.ldc = D;
    out_shape.align_a = 256;
    out_shape.align_w = 16;
    out_shape.align_c = windows_max > 1 ? pow2_alignment(static_cast<std::size_t>(B * D) * 2) : 256;
    o_proj_gemm = std::make_unique<detail::GemmPlan>(lt.get(), out_shape, config.runtime.token_buckets,
                                                     workspace_bytes);
  }

  weights.assign(num_layers, LayerWeights{});
  has_weights.assign(num_layers, false);
  weights_version.assign(num_layers, 0);
  windows.reserve(windows_max);
  next_windows.reserve(windows_max);
  if (chunked()) {
    // Sized for the largest bucket and max_seqs: the capacities every window's launch uses.
    PrepRecurrenceArgs a;
    a.num_heads = H;
    a.head_dim = m.head_dim;
    a.num_tokens = B;
    a.max_seqs = config.runtime.max_seqs;
    chunked_workspace = DeviceAlloc(kda_chunked_workspace_bytes(a), "chunked recurrence workspace");
  }
  build_builtin_steps();
}

PrefillModule::Impl::~Impl() {
  // Work enqueued on the caller's stream may still read these buffers; the module does not
  // know that stream, so wait for the device before freeing.
  cudaDeviceSynchronize();
}

void PrefillModule::Impl::check_layer(int layer, const char* fn) const {
  KDA_CHECK(layer >= 0 && layer < num_layers, fn, "layer ", layer, " is out of range: the module holds ",
            num_layers, " layer", num_layers == 1 ? "" : "s", " (runtime.num_layers), valid are 0..",
            num_layers - 1);
}

void PrefillModule::Impl::check_tp_ready(const char* fn) const {
  const TensorParallelConfig& tp = config.tensor_parallel;
  KDA_CHECK(tp.size == 1 || !full_layer() || comm != nullptr || partial_output, fn, "tensor_parallel.size is ",
            tp.size, " (rank ", tp.rank, ") with runtime.layer_steps: full, so the ranks' partial o_proj outputs ",
            "must be summed: call set_communicator with the tensor-parallel group's NCCL communicator, or ",
            "set_partial_output(true) to sum them yourself, before the first forward");
}

template <typename F>
void PrefillModule::Impl::for_each_step(F&& f) const {
  for (std::size_t i = 0; i < builtin_steps.size(); ++i) f(std::string(builtin_names[i]), builtin_steps[i]);
  if (all_reduce_active()) f(std::string("all-reduce"), all_reduce_step);
  for (std::size_t i = 0; i < user_steps.size(); ++i) f("user step " + std::to_string(i), user_steps[i]);
}

void PrefillModule::Impl::check_layer_ready(int layer, const char* fn) const {
  check_layer(layer, fn);
  KDA_CHECK(has_weights[layer], fn, "layer ", layer,
            " has no weights: call set_layer_weights or init_random_weights");
}

StepContext PrefillModule::Impl::make_context(int layer, int window, int64_t bucket,
                                              const char* slot) const {
  StepContext ctx;
  ctx.layer = layer;
  ctx.bucket_tokens = bucket;
  ctx.max_seqs = config.runtime.max_seqs;
  ctx.query_start_loc = reinterpret_cast<const int32_t*>(slot + staging.qsl_offset);
  ctx.cache_indices = reinterpret_cast<const int32_t*>(slot + staging.cache_offset);
  ctx.has_initial_state = reinterpret_cast<const bool*>(slot + staging.flags_offset);
  const int64_t row0 = window * B;
  ctx.hidden = hidden.get() + row0 * D * 2;
  ctx.in_proj_out = in_proj_out.get();
  ctx.q = planes.get() + (0 * capacity + row0) * P * 2;
  ctx.k = planes.get() + (1 * capacity + row0) * P * 2;
  ctx.v = planes.get() + (2 * capacity + row0) * P * 2;
  ctx.out = output.get() + row0 * D * 2;
  ctx.conv_states = reinterpret_cast<float*>(conv_pools[layer].get());
  ctx.recurrent_states = reinterpret_cast<float*>(rec_pools[layer].get());
  ctx.weights = &weights[layer];
  ctx.config = &config;
  return ctx;
}

PackedConvArgs PrefillModule::Impl::conv_args(const StepContext& ctx) const {
  PackedConvArgs a;
  a.x = ctx.in_proj_out;  // the Q|K|V columns are the first 3P of each row
  a.x_dtype = DType::BF16;
  a.num_tokens = ctx.bucket_tokens;
  a.dim = 3 * P;
  a.x_row_stride = in_stride;
  a.weight = ctx.weights->conv_weight;
  a.weight_stride_dim = 4;
  a.weight_stride_tap = 1;
  a.bias = nullptr;
  a.conv_states = ctx.conv_states;
  a.num_cache_lines = cache_lines;
  a.state_len = 3;
  a.state_stride_line = 3 * P * 3;
  a.state_stride_dim = 3;
  a.state_stride_tap = 1;
  a.query_start_loc = ctx.query_start_loc;
  a.num_seqs = ctx.max_seqs;
  a.cache_indices = ctx.cache_indices;
  a.cache_indices_stride = 1;
  a.has_initial_state = ctx.has_initial_state;
  a.part_dim = P;
  a.silu = true;
  a.null_block_id = config.pools.null_line;
  a.out = ctx.q;  // planes q, k, v follow each other at capacity * P
  a.out_plane_stride = capacity * P;
  return a;
}

// The layer's built-in steps in order. The downstream KDA steps (g1/g2 GEMMs, prep +
// recurrence, gated RMSNorm, o_proj into ctx.out) are appended here; user steps run after all.
void PrefillModule::Impl::build_builtin_steps() {
  // (1) in_proj: hidden rows [w*B, w*B + bucket) -> in_proj output rows [0, bucket).
  builtin_names.push_back("in_proj GEMM");
  builtin_steps.push_back([this](const StepContext& ctx, Stream stream) {
    const detail::GemmPlan& plan =
        ctx.weights->in_proj_rows == in_stride && in_proj_gemm_padded ? *in_proj_gemm_padded : *in_proj_gemm;
    plan.run(ctx.bucket_tokens, ctx.hidden, ctx.weights->in_proj, ctx.in_proj_out, gemm_workspace.get(),
             gemm_workspace.bytes(), stream);
  });
  // (2) packed conv of the Q|K|V columns into the window's plane rows, updating the conv pool.
  builtin_names.push_back("packed conv");
  builtin_steps.push_back([this](const StepContext& ctx, Stream stream) {
    packed_causal_conv1d(conv_args(ctx), stream);
  });
  if (!full_layer()) return;
  // (3) the gate projections g1 = f_a f_b^T and g2 = g_a g_b^T, reading the in_proj output.
  builtin_names.push_back("gate GEMMs (g1, g2)");
  builtin_steps.push_back([this](const StepContext& ctx, Stream stream) {
    const char* x = static_cast<const char*>(ctx.in_proj_out);
    g1_gemm->run(ctx.bucket_tokens, x + f_a_col * 2, ctx.weights->f_b, g1_buf.get(), gemm_workspace.get(),
                 gemm_workspace.bytes(), stream);
    g2_gemm->run(ctx.bucket_tokens, x + g_a_col * 2, ctx.weights->g_b, g2_buf.get(), gemm_workspace.get(),
                 gemm_workspace.bytes(), stream);
  });
  // (4)+(5) L2 norms, decay, beta and the gated delta rule over each sequence, with the
  // recurrent pool line read and written back.
  builtin_names.push_back("prep + recurrence");
  builtin_steps.push_back([this](const StepContext& ctx, Stream stream) {
    const PrepRecurrenceArgs args = prep_recurrence_args_for_step(ctx, g1_buf.get(), P, o_buf.get(), P);
    if (chunked())
      kda_chunked(args, chunked_workspace.get(), chunked_workspace.bytes(), stream);
    else
      kda_prep_recurrence(args, stream);
  });
  // (6) gated RMSNorm per head.
  builtin_names.push_back("gated RMSNorm");
  builtin_steps.push_back([this](const StepContext& ctx, Stream stream) {
    gated_rmsnorm(gated_rmsnorm_args_for_step(ctx, o_buf.get(), P, g2_buf.get(), P, y_buf.get(), P), stream);
  });
  // (7) o_proj into the window's rows of the output buffer.
  builtin_names.push_back("o_proj GEMM");
  builtin_steps.push_back([this](const StepContext& ctx, Stream stream) {
    o_proj_gemm->run(ctx.bucket_tokens, y_buf.get(), ctx.weights->o_proj, ctx.out, gemm_workspace.get(),
                     gemm_workspace.bytes(), stream);
  });
  // (8) with a communicator: the sum of the ranks' outputs, in place over the bucket's rows
  // (every rank runs the same batch, so the same bucket and element count). Rows past the batch
  // and rows of skipped sequences are summed too; they hold unspecified values either way.
  all_reduce_step = [this](const StepContext& ctx, Stream stream) {
    detail::all_reduce_sum_bf16(ctx.out, ctx.bucket_tokens * D, comm, stream, "kda::PrefillModule (all-reduce step)");
  };
}

void PrefillModule::Impl::run_steps(const StepContext& ctx, cudaStream_t stream) const {
  for_each_step([&](const std::string&, const Step& s) { s(ctx, stream); });
}

void PrefillModule::Impl::run_window(int layer, int window, Mode mode, cudaStream_t stream) {
  const detail::WindowPlan& win = windows[window];
  const StepContext ctx =
      make_context(layer, window, win.bucket, staging_dev.get() + window * staging.slot_bytes);
  const bool replay = mode == Mode::Replay || (mode == Mode::Auto && graphs_active());
  if (!replay) {
    run_steps(ctx, stream);
    ++eager_runs;
    return;
  }
  const detail::GraphKey key{win.bucket, layer, window};
  const uint64_t version = weights_version[layer];
  detail::GraphCache::Entry* graph = graphs.find(key, version);
  if (!graph) {
    auto record = [this, &ctx](cudaStream_t s) { run_steps(ctx, s); };
    if (mode == Mode::Auto && !graphs.contains_any(key)) {
      // First use of the key: this eager run is the batch's work and loads every kernel and
      // cuBLASLt module before the capture, which then only records.
      run_steps(ctx, stream);
      ++eager_runs;
      graphs.capture(key, version, record);
      return;
    }
    graph = graphs.capture(key, version, record);
  }
  graphs.launch(graph, stream);
}

// runtime.capture: eager. Records the (bucket, layer, window 0) graph of every layer that has
// weights, after one eager run per (bucket, layer) over an all-padding batch (it writes only
// scratch rows and touches no pool line) so that every module is loaded before capturing.
void PrefillModule::Impl::capture_eager_graphs(cudaStream_t stream) {
  const char* slot0 = staging_dev.get();
  bool need_warmup = !kernels_warm;
  for (int l = 0; l < num_layers; ++l) {
    if (!has_weights[l]) continue;
    for (int64_t bucket : config.runtime.token_buckets) {
      const detail::GraphKey key{bucket, l, 0};
      if (graphs.find(key, weights_version[l])) continue;
      const StepContext ctx = make_context(l, 0, bucket, slot0);
      if (need_warmup) {
        KDA_CUDA_CHECK("kda::PrefillModule::begin_forward",
                       cudaMemcpyAsync(staging_dev.get(), padding_slot.get(), staging.slot_bytes,
                                       cudaMemcpyHostToDevice, stream));
        for (int wl = 0; wl < num_layers; ++wl) {
          if (!has_weights[wl]) continue;
          for (int64_t b : config.runtime.token_buckets) {
            run_steps(make_context(wl, 0, b, slot0), stream);
            ++eager_runs;
          }
        }
        KDA_CUDA_CHECK("kda::PrefillModule::begin_forward", cudaStreamSynchronize(stream));
        need_warmup = false;
        kernels_warm = true;
      }
      graphs.capture(key, weights_version[l], [this, &ctx](cudaStream_t s) { run_steps(ctx, s); });
    }
  }
}

void PrefillModule::Impl::stage(const BatchView& batch, cudaStream_t stream) {
  constexpr const char* fn = "kda::PrefillModule::begin_forward";
  check_tp_ready(fn);
  validator.validate(batch);  // throws, changing nothing, on bad input
  detail::plan_windows(batch, config, next_windows);
  if (graphs_active() && config.runtime.capture == CaptureMode::Eager && !eager_graphs_current) {
    capture_eager_graphs(stream);
    eager_graphs_current = true;
  }

  const int h = staging_next;
  char* host = staging_host[h].get();
  // The copy out of this slot kHostStagingSlots forwards ago must be done before it is overwritten.
  KDA_CUDA_CHECK(fn, cudaEventSynchronize(staging_done[h].get()));
  for (std::size_t w = 0; w < next_windows.size(); ++w)
    detail::fill_window_staging(batch, next_windows[w], config, staging, host + w * staging.slot_bytes);
  if (!next_windows.empty()) {
    KDA_CUDA_CHECK(fn, cudaMemcpyAsync(staging_dev.get(), host, next_windows.size() * staging.slot_bytes,
                                       cudaMemcpyHostToDevice, stream));
    KDA_CUDA_CHECK(fn, cudaEventRecord(staging_done[h].get(), stream));
    staging_next = (h + 1) % kHostStagingSlots;
  }
  windows.swap(next_windows);
  batch_staged = true;
  forward_started = true;
}

void PrefillModule::Impl::set_weights(int layer, const LayerWeights& w, const char* fn) {
  check_layer(layer, fn);
  const std::pair<const void*, const char*> required[] = {
      {w.in_proj, "in_proj"}, {w.conv_weight, "conv_weight"}, {w.f_b, "f_b"},
      {w.g_b, "g_b"},         {w.A_log, "A_log"},             {w.dt_bias, "dt_bias"},
      {w.o_norm_weight, "o_norm_weight"}, {w.o_proj, "o_proj"}};
  for (const auto& [ptr, name] : required)
    KDA_CHECK(ptr != nullptr, fn, "layer ", layer, ": weights.", name, " is null");
  KDA_CHECK(w.in_proj_rows == 0 || w.in_proj_rows == in_cols || w.in_proj_rows == in_stride, fn,
            "layer ", layer, ": weights.in_proj_rows is ", w.in_proj_rows, ", expected 0 or ", in_cols,
            " (in_proj_cols) or ", in_stride, " (in_proj_stride, zero-padded rows)");
  for (const auto& [ptr, name] : {std::pair<const void*, const char*>{w.in_proj, "in_proj"},
                                  {w.f_b, "f_b"}, {w.g_b, "g_b"}, {w.o_proj, "o_proj"}})
    KDA_CHECK(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, fn, "layer ", layer, ": weights.", name,
              " must be 16-byte aligned (cuBLASLt operand), got ", ptr);
  // The conv's can_implement for every bucket of window 0 (later windows differ only in
  // the output rows and staging slot, which the module owns).
  LayerWeights old = weights[layer];
  weights[layer] = w;
  for (int64_t bucket : config.runtime.token_buckets) {
    std::string why;
    const StepContext ctx = make_context(layer, 0, bucket, staging_dev.get());
    const char* step = nullptr;
    if (!packed_causal_conv1d_supported(conv_args(ctx), &why)) {
      step = "the packed conv";
    } else if (full_layer()) {
      const PrepRecurrenceArgs rec = prep_recurrence_args_for_step(ctx, g1_buf.get(), P, o_buf.get(), P);
      if (chunked() ? !kda_chunked_supported(rec, &why) : !kda_prep_recurrence_supported(rec, &why))
        step = "the recurrence";
      else if (!gated_rmsnorm_supported(gated_rmsnorm_args_for_step(ctx, o_buf.get(), P, g2_buf.get(), P,
                                                                    y_buf.get(), P), &why))
        step = "the gated RMSNorm";
    }
    if (step) {
      weights[layer] = old;
      KDA_FAIL(fn, "layer ", layer, ": ", step, " cannot run these weights (bucket ", bucket, "): ", why);
    }
  }
  const bool moved = !has_weights[layer] || std::memcmp(&old, &w, sizeof(LayerWeights)) != 0;
  if (moved) {
    weights_version[layer] = next_version++;
    eager_graphs_current = false;
  }
  has_weights[layer] = true;
}

// The config is validated before anything is created on the device.
PrefillModule::PrefillModule(const Config& config)
    : impl_((validate_config(config), std::make_unique<Impl>(config))) {}
PrefillModule::~PrefillModule() = default;

const Config& PrefillModule::config() const { return impl_->config; }
void* PrefillModule::hidden_states() { return impl_->hidden.get(); }
const void* PrefillModule::output() const { return impl_->output.get(); }
const void* PrefillModule::conv_planes() const { return impl_->planes.get(); }
const void* PrefillModule::in_proj_output() const { return impl_->in_proj_out.get(); }

float* PrefillModule::conv_state_pool(int layer) {
  impl_->check_layer(layer, "kda::PrefillModule::conv_state_pool");
  return reinterpret_cast<float*>(impl_->conv_pools[layer].get());
}

float* PrefillModule::recurrent_state_pool(int layer) {
  impl_->check_layer(layer, "kda::PrefillModule::recurrent_state_pool");
  return reinterpret_cast<float*>(impl_->rec_pools[layer].get());
}

void PrefillModule::set_layer_weights(int layer, const LayerWeights& weights) {
  impl_->set_weights(layer, weights, "kda::PrefillModule::set_layer_weights");
}

void PrefillModule::init_random_weights(uint64_t seed) {
  constexpr const char* fn = "kda::PrefillModule::init_random_weights";
  Impl& m = *impl_;
  const std::size_t per_layer = detail::random_layer_weights_bytes(m.config.model);
  if (!m.random_storage.get())
    m.random_storage = DeviceAlloc(per_layer * m.num_layers, "random weights");
  // A forward still in flight may read the current weights; refill only when it is done.
  KDA_CUDA_CHECK(fn, cudaDeviceSynchronize());
  std::vector<LayerWeights> w(m.num_layers);
  for (int l = 0; l < m.num_layers; ++l)
    w[l] = detail::init_random_layer_weights(m.config.model, l, seed, m.random_storage.get() + l * per_layer,
                                             nullptr);
  KDA_CUDA_CHECK(fn, cudaStreamSynchronize(nullptr));
  for (int l = 0; l < m.num_layers; ++l) m.set_weights(l, w[l], fn);
}

void PrefillModule::upload_layer_weights(int layer, const LayerWeights& h) {
  constexpr const char* fn = "kda::PrefillModule::upload_layer_weights";
  Impl& m = *impl_;
  m.check_layer(layer, fn);
  const ModelConfig& mc = m.config.model;
  const int64_t rows = h.in_proj_rows ? h.in_proj_rows : m.in_cols;
  KDA_CHECK(rows == m.in_cols || rows == m.in_stride, fn, "layer ", layer, ": in_proj_rows is ", h.in_proj_rows,
            ", expected 0, ", m.in_cols, " or ", m.in_stride);
  struct Tensor {
    const void* host;
    const char* name;
    std::size_t bytes;
  };
  const int64_t r = mc.gate_rank;
  const Tensor tensors[] = {
      {h.in_proj, "in_proj", static_cast<std::size_t>(rows * m.D) * 2},
      {h.conv_weight, "conv_weight", static_cast<std::size_t>(3 * m.P * 4) * 4},
      {h.f_b, "f_b", static_cast<std::size_t>(m.P * r) * 2},
      {h.g_b, "g_b", static_cast<std::size_t>(m.P * r) * 2},
      {h.A_log, "A_log", static_cast<std::size_t>(m.H) * 4},
      {h.dt_bias, "dt_bias", static_cast<std::size_t>(m.P) * 4},
      {h.o_norm_weight, "o_norm_weight", static_cast<std::size_t>(mc.head_dim) * 2},
      {h.o_proj, "o_proj", static_cast<std::size_t>(m.D * m.P) * 2},
  };
  // in_proj is stored padded to in_proj_stride rows of zeros whatever the host gave, so that the
  // GEMM takes its fast width (LayerWeights::in_proj_rows).
  const std::size_t in_proj_padded = static_cast<std::size_t>(m.in_stride * m.D) * 2;
  std::size_t total = (in_proj_padded + 255) / 256 * 256;
  for (const Tensor& t : tensors) {
    KDA_CHECK(t.host != nullptr, fn, "layer ", layer, ": host_weights.", t.name, " is null");
    if (&t != &tensors[0]) total += (t.bytes + 255) / 256 * 256;
  }
  if (m.uploaded_weights.empty()) m.uploaded_weights.resize(m.num_layers);
  // A forward in flight may still read the storage being replaced or overwritten.
  KDA_CUDA_CHECK(fn, cudaDeviceSynchronize());
  if (m.uploaded_weights[layer].bytes() < total) m.uploaded_weights[layer] = DeviceAlloc(total, "uploaded weights");
  char* dst = m.uploaded_weights[layer].get();
  const void* dev[8];
  for (int i = 0; i < 8; ++i) {
    KDA_CUDA_CHECK(fn, cudaMemcpy(dst, tensors[i].host, tensors[i].bytes, cudaMemcpyHostToDevice));
    const std::size_t stored = i == 0 ? in_proj_padded : tensors[i].bytes;
    if (stored > tensors[i].bytes)
      KDA_CUDA_CHECK(fn, cudaMemset(dst + tensors[i].bytes, 0, stored - tensors[i].bytes));
    dev[i] = dst;
    dst += (stored + 255) / 256 * 256;
  }
  // The padding cudaMemset is asynchronous, and a pageable cudaMemcpy may return before its DMA
  // is done; both run on the legacy stream, which a caller's non-blocking stream does not wait
  // for. Wait here so that the weights are in place when this returns, as documented.
  KDA_CUDA_CHECK(fn, cudaDeviceSynchronize());
  LayerWeights w;
  w.in_proj = dev[0];
  w.in_proj_rows = m.in_stride;
  w.conv_weight = static_cast<const float*>(dev[1]);
  w.f_b = dev[2];
  w.g_b = dev[3];
  w.A_log = static_cast<const float*>(dev[4]);
  w.dt_bias = static_cast<const float*>(dev[5]);
  w.o_norm_weight = dev[6];
  w.o_proj = dev[7];
  m.set_weights(layer, w, fn);
}

std::vector<StepTiming> PrefillModule::profile_steps(const BatchView& batch, int layer, Stream stream) {
  constexpr const char* fn = "kda::PrefillModule::profile_steps";
  Impl& m = *impl_;
  m.check_layer_ready(layer, fn);
  begin_forward(batch, stream);
  std::vector<StepTiming> out;
  std::vector<const Step*> steps;
  m.for_each_step([&](const std::string& name, const Step& step) {
    out.push_back(StepTiming{name, 0.0});
    steps.push_back(&step);
  });
  const std::size_t n = steps.size();
  std::vector<cudaEvent_t> events(n + 1);
  for (auto& e : events) KDA_CUDA_CHECK(fn, cudaEventCreate(&e));
  try {
    for (int w = 0; w < static_cast<int>(m.windows.size()); ++w) {
      const StepContext ctx = m.make_context(layer, w, m.windows[w].bucket,
                                             m.staging_dev.get() + w * m.staging.slot_bytes);
      KDA_CUDA_CHECK(fn, cudaEventRecord(events[0], stream));
      for (std::size_t i = 0; i < n; ++i) {
        (*steps[i])(ctx, stream);
        KDA_CUDA_CHECK(fn, cudaEventRecord(events[i + 1], stream));
      }
      KDA_CUDA_CHECK(fn, cudaEventSynchronize(events[n]));
      for (std::size_t i = 0; i < n; ++i) {
        float ms = 0;
        KDA_CUDA_CHECK(fn, cudaEventElapsedTime(&ms, events[i], events[i + 1]));
        out[i].gpu_us += ms * 1e3;
      }
    }
  } catch (...) {
    for (auto e : events) cudaEventDestroy(e);
    throw;
  }
  for (auto e : events) cudaEventDestroy(e);
  ++m.eager_runs;
  return out;
}

const LayerWeights& PrefillModule::layer_weights(int layer) const {
  impl_->check_layer(layer, "kda::PrefillModule::layer_weights");
  return impl_->weights[layer];
}

void PrefillModule::add_step(Step step) {
  constexpr const char* fn = "kda::PrefillModule::add_step";
  KDA_CHECK(static_cast<bool>(step), fn, "the step is empty");
  KDA_CHECK(!impl_->forward_started, fn,
            "steps must be added before the first forward: graphs record the step list");
  impl_->user_steps.push_back(std::move(step));
}

void PrefillModule::set_communicator(ncclComm_t comm) {
  constexpr const char* fn = "kda::PrefillModule::set_communicator";
  Impl& m = *impl_;
  KDA_CHECK(m.full_layer(), fn, "runtime.layer_steps is conv: the module writes no layer output, so there is ",
            "nothing to all-reduce");
  KDA_CHECK(!m.forward_started, fn,
            "the communicator must be set before the first forward: graphs record the all-reduce");
  // Throws without NCCL, for a null communicator and when NCCL cannot query it.
  const detail::CommunicatorShape shape = detail::communicator_shape(comm, fn);
  detail::check_communicator_matches(m.config.tensor_parallel, shape, m.device, fn);
  m.comm = comm;
  // NCCL's captured nodes cannot be updated in place (see GraphCache::set_exec_update).
  m.graphs.set_exec_update(false);
}

void PrefillModule::set_partial_output(bool partial) {
  constexpr const char* fn = "kda::PrefillModule::set_partial_output";
  KDA_CHECK(!impl_->forward_started, fn,
            "the partial-output switch must be set before the first forward: graphs record the step list");
  impl_->partial_output = partial;
}

void PrefillModule::begin_forward(const BatchView& batch, Stream stream) {
  const auto t0 = Clock::now();
  impl_->stage(batch, stream);
  ++impl_->forwards;
  impl_->begin_us_total += us_since(t0);
}

void PrefillModule::run_layer(int layer, Stream stream) {
  constexpr const char* fn = "kda::PrefillModule::run_layer";
  const auto t0 = Clock::now();
  Impl& m = *impl_;
  m.check_layer_ready(layer, fn);
  KDA_CHECK(m.batch_staged, fn, "no batch: call begin_forward before run_layer");
  for (int w = 0; w < static_cast<int>(m.windows.size()); ++w) m.run_window(layer, w, Impl::Mode::Auto, stream);
  ++m.layer_calls;
  m.layer_us_total += us_since(t0);
}

void PrefillModule::run(const BatchView& batch, Stream stream) {
  // Every layer must be runnable before anything is staged, so a failure changes nothing.
  for (int l = 0; l < impl_->num_layers; ++l) impl_->check_layer_ready(l, "kda::PrefillModule::run");
  begin_forward(batch, stream);
  for (int l = 0; l < impl_->num_layers; ++l) run_layer(l, stream);
}

void PrefillModule::set_eager(bool eager) { impl_->eager = eager; }

ModuleStats PrefillModule::stats(Stream stream) const {
  KDA_CUDA_CHECK("kda::PrefillModule::stats", cudaStreamSynchronize(stream));
  const Impl& m = *impl_;
  ModuleStats s;
  s.graphs = impl_->graphs.stats();
  s.forwards = m.forwards;
  s.mean_host_us_begin = m.forwards ? m.begin_us_total / m.forwards : 0.0;
  s.mean_host_us_layer = m.layer_calls ? m.layer_us_total / m.layer_calls : 0.0;
  s.eager_layer_runs = m.eager_runs;
  return s;
}

SelfCheckReport PrefillModule::self_check(const BatchView& batch, Stream stream) {
  constexpr const char* fn = "kda::PrefillModule::self_check";
  Impl& m = *impl_;
  for (int l = 0; l < m.num_layers; ++l) m.check_layer_ready(l, fn);
  begin_forward(batch, stream);  // validates first: a bad batch throws here, changing nothing

  const int64_t T = batch.num_tokens();
  const std::size_t plane_bytes = static_cast<std::size_t>(T * m.P) * 2;  // real rows of one plane
  const std::size_t cap_plane_bytes = static_cast<std::size_t>(m.capacity * m.P) * 2;
  const int nwin = static_cast<int>(m.windows.size());
  auto copy = [&](void* dst, const void* src, std::size_t bytes) {
    if (bytes) KDA_CUDA_CHECK(fn, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  };
  auto download = [&](const void* src, std::size_t bytes) {
    std::vector<unsigned char> h(bytes);
    if (bytes) KDA_CUDA_CHECK(fn, cudaMemcpyAsync(h.data(), src, bytes, cudaMemcpyDeviceToHost, stream));
    KDA_CUDA_CHECK(fn, cudaStreamSynchronize(stream));
    return h;
  };
  // Real rows [0, T) of the three planes, packed.
  auto copy_planes = [&](char* dst) {
    for (int i = 0; i < 3; ++i) copy(dst + i * plane_bytes, m.planes.get() + i * cap_plane_bytes, plane_bytes);
  };

  // Starting pools, the eager pass's planes (per layer) and pools.
  std::vector<DeviceAlloc> snap_conv, snap_rec, eager_conv, eager_rec, stock_conv;
  DeviceAlloc eager_planes(3 * plane_bytes * m.num_layers, "self_check eager planes");
  // The layer output's real rows, per layer (runtime.layer_steps: full).
  const std::size_t out_bytes = m.full_layer() ? static_cast<std::size_t>(T * m.D) * 2 : 0;
  DeviceAlloc eager_out(out_bytes * m.num_layers, "self_check eager outputs");
  for (int l = 0; l < m.num_layers; ++l) {
    snap_conv.emplace_back(m.conv_pool_bytes, "self_check pool snapshot");
    snap_rec.emplace_back(m.rec_pool_bytes, "self_check pool snapshot");
    eager_conv.emplace_back(m.conv_pool_bytes, "self_check eager pools");
    eager_rec.emplace_back(m.rec_pool_bytes, "self_check eager pools");
    stock_conv.emplace_back(m.conv_pool_bytes, "self_check stock conv pool");
    copy(snap_conv[l].get(), m.conv_pools[l].get(), m.conv_pool_bytes);
    copy(snap_rec[l].get(), m.rec_pools[l].get(), m.rec_pool_bytes);
    copy(stock_conv[l].get(), m.conv_pools[l].get(), m.conv_pool_bytes);
  }
  // The stock baseline writes planes laid out like the module's: (3, padded_rows, P).
  const int64_t stock_plane_elems = m.padded_rows * m.P;
  DeviceAlloc stock_planes(static_cast<std::size_t>(3 * stock_plane_elems) * 2, "self_check stock planes");
  std::size_t stock_ws_bytes = 0;
  for (int w = 0; w < nwin; ++w) {
    PackedConvArgs a = m.conv_args(m.make_context(0, w, m.windows[w].bucket, m.staging_dev.get()));
    stock_ws_bytes = std::max(stock_ws_bytes, baseline::stock_causal_conv1d_workspace_bytes(a));
  }
  DeviceAlloc stock_ws(stock_ws_bytes, "self_check stock workspace");

  // Eager pass.
  for (int l = 0; l < m.num_layers; ++l) {
    for (int w = 0; w < nwin; ++w) m.run_window(l, w, Impl::Mode::Eager, stream);
    copy_planes(eager_planes.get() + 3 * plane_bytes * l);
    copy(eager_out.get() + out_bytes * l, m.output.get(), out_bytes);
  }
  for (int l = 0; l < m.num_layers; ++l) {
    copy(eager_conv[l].get(), m.conv_pools[l].get(), m.conv_pool_bytes);
    copy(eager_rec[l].get(), m.rec_pools[l].get(), m.rec_pool_bytes);
    copy(m.conv_pools[l].get(), snap_conv[l].get(), m.conv_pool_bytes);
    copy(m.rec_pools[l].get(), snap_rec[l].get(), m.rec_pool_bytes);
  }

  SelfCheckReport report;
  auto add = [&report](const std::string& what, int64_t bits, int64_t& total) {
    total += bits;
    report.detail += str_cat(what, ": ", bits, " differing bits\n");
  };
  if (!m.config.runtime.use_graphs) report.detail += "runtime.graphs is false: graphs recorded for this check only\n";

  // Graph pass; after each window the stock baseline convolves the same in_proj output from
  // its own copy of the starting conv pool, with the window's staged metadata. Rows the conv
  // does not write (skipped sequences) start equal: the stock planes take the module's.
  for (int l = 0; l < m.num_layers; ++l) {
    for (int i = 0; i < 3; ++i)
      copy(stock_planes.get() + i * stock_plane_elems * 2, m.planes.get() + i * cap_plane_bytes, plane_bytes);
    for (int w = 0; w < nwin; ++w) {
      m.run_window(l, w, Impl::Mode::Replay, stream);
      const char* slot = m.staging_dev.get() + w * m.staging.slot_bytes;
      PackedConvArgs a = m.conv_args(m.make_context(l, w, m.windows[w].bucket, slot));
      a.conv_states = reinterpret_cast<float*>(stock_conv[l].get());
      a.out = stock_planes.get() + w * m.B * m.P * 2;
      a.out_plane_stride = stock_plane_elems;
      baseline::stock_causal_conv1d(a, stock_ws.get(), stock_ws.bytes(), stream);
    }
    const auto eager_h = download(eager_planes.get() + 3 * plane_bytes * l, 3 * plane_bytes);
    std::vector<unsigned char> graph_h(3 * plane_bytes), stock_h(3 * plane_bytes);
    for (int i = 0; i < 3; ++i) {
      auto g = download(m.planes.get() + i * cap_plane_bytes, plane_bytes);
      auto s = download(stock_planes.get() + i * stock_plane_elems * 2, plane_bytes);
      std::copy(g.begin(), g.end(), graph_h.begin() + i * plane_bytes);
      std::copy(s.begin(), s.end(), stock_h.begin() + i * plane_bytes);
    }
    add(str_cat("layer ", l, " planes (", T, " rows), graph vs eager"), popcount_diff(graph_h, eager_h),
        report.graph_vs_eager_diff_bits);
    add(str_cat("layer ", l, " planes (", T, " rows), packed conv vs stock"), popcount_diff(graph_h, stock_h),
        report.conv_vs_stock_diff_bits);
    if (out_bytes) {
      // Output rows of skipped sequences are unspecified (BatchView): o_proj reads recurrence
      // rows nobody wrote for them, which hold whatever the last forward left. They are not
      // compared.
      auto graph_out = download(m.output.get(), out_bytes);
      auto eager_out_h = download(eager_out.get() + out_bytes * l, out_bytes);
      const std::size_t row_bytes = static_cast<std::size_t>(m.D) * 2;
      int64_t skipped_rows = 0;
      for (int64_t q = 0; q < batch.num_seqs; ++q) {
        if (batch.cache_indices[q] != m.config.pools.null_line) continue;
        const int64_t r0 = batch.query_start_loc[q], r1 = batch.query_start_loc[q + 1];
        skipped_rows += r1 - r0;
        std::fill(graph_out.begin() + r0 * row_bytes, graph_out.begin() + r1 * row_bytes, 0);
        std::fill(eager_out_h.begin() + r0 * row_bytes, eager_out_h.begin() + r1 * row_bytes, 0);
      }
      add(str_cat("layer ", l, " output (", T - skipped_rows, " rows of sequences that ran), graph vs eager"),
          popcount_diff(graph_out, eager_out_h), report.graph_vs_eager_diff_bits);
    }
  }
  for (int l = 0; l < m.num_layers; ++l) {
    const auto conv_g = download(m.conv_pools[l].get(), m.conv_pool_bytes);
    add(str_cat("layer ", l, " conv pool, graph vs eager"),
        popcount_diff(conv_g, download(eager_conv[l].get(), m.conv_pool_bytes)), report.graph_vs_eager_diff_bits);
    add(str_cat("layer ", l, " conv pool, packed conv vs stock"),
        popcount_diff(conv_g, download(stock_conv[l].get(), m.conv_pool_bytes)), report.conv_vs_stock_diff_bits);
    add(str_cat("layer ", l, " recurrent pool, graph vs eager"),
        popcount_diff(download(m.rec_pools[l].get(), m.rec_pool_bytes), download(eager_rec[l].get(), m.rec_pool_bytes)),
        report.graph_vs_eager_diff_bits);
  }
  report.ok = report.graph_vs_eager_diff_bits == 0 && report.conv_vs_stock_diff_bits == 0;
  return report;
}

}  // namespace kda
