// Example prefill driver: builds a PrefillModule from a YAML config, runs a batch of sequences
// through every layer as CUDA-graph replays, and prints per-bucket capture cost, replay time and
// throughput. --check compares graph replay with eager launches bitwise and the packed conv with
// the stock-path baseline.
//
// The config is loaded and validated before anything touches CUDA: a bad config exits 2 with
// kda::load_config's message (file:line: key: what is wrong) on any machine. --validate stops
// there and prints the resolved sizes and the device memory the module will allocate, so
// configs can be checked on a machine without a GPU. Without --config the driver reads
// configs/default.yaml of the current directory, else the copy installed beside it (share/).
//
// --tp N runs the config's model (all its heads) as N tensor-parallel ranks on GPUs 0..N-1, one
// host thread per rank, the ranks' outputs summed by the modules' NCCL all-reduce, and checks
// them against a TP = 1 run of the same weights on GPU 0 (see run_tp).
//
// --prefix-sharing runs the prefix-caching scenario of prefix_sharing.h instead of the batch:
// prompt A with state checkpoints, then prompt B, which shares A's first 75%, from A's checkpoint.
//
//   prefill_driver --config configs/default.yaml --lengths 512,37,2000 --check
//   prefill_driver --validate --config configs/kimi-linear-48b-tp1.yaml
//   prefill_driver --random 16 --layers 4 --iters 50
//   prefill_driver --config configs/kimi-linear-48b-tp1.yaml --tp 2
//   prefill_driver --prefix-sharing
//
// Exit codes: 0 success; 1 a run or check failed; 2 bad arguments, a bad config, no usable
// CUDA device, or fewer GPUs than --tp asks for.
#include <cuda_runtime_api.h>

#if KDA_HAVE_NCCL
#include <nccl.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda_check.h"
#include "common/device_memory.h"
#include "host_data.h"
#include "prefix_sharing.h"
#include "runtime/batch_plan.h"      // max_windows, for --validate
#include "runtime/random_weights.h"  // random_layer_weights_bytes, for --validate
#include "kda/config.h"
#include "kda/error.h"
#include "kda/prefill.h"
#include "testing/host_layer_tensors.h"  // the full model's weights to and from the host
#include "testing/tp_shard.h"  // the driver cuts the full model's host weights and pools per rank

namespace {

using driver::diff_bits;
using driver::random_bf16;
using driver::rel_error_bf16;

// The config without --config: configs/default.yaml of the current directory (a source tree),
// else the one installed with the driver (<prefix>/<datadir>/kda-prefill/configs/default.yaml,
// KDA_INSTALLED_CONFIG, set by examples/meson.build).
constexpr const char* kLocalConfig = "configs/default.yaml";
#ifdef KDA_INSTALLED_CONFIG
constexpr const char* kInstalledConfig = KDA_INSTALLED_CONFIG;
#else
constexpr const char* kInstalledConfig = kLocalConfig;
#endif

std::string default_config() {
  if (std::FILE* f = std::fopen(kLocalConfig, "rb")) {
    std::fclose(f);
    return kLocalConfig;
  }
  return kInstalledConfig;
}

struct Options {
  std::string config;  // --config, else default_config()
  std::vector<int32_t> lengths;
  int random_seqs = 0;
  int layers = 0;  // 0: the config's runtime.num_layers
  int iters = 20;
  uint64_t seed = 1234;
  bool check = false;
  bool compare_eager = true;
  bool validate = false;  // --validate: check the config, print the sizes, touch no CUDA
  int tp = 0;  // --tp N: ranks; 0 runs the config as one module
  bool prefix_sharing = false;  // --prefix-sharing: the checkpoint scenario instead of the batch
};

// --help prints this on stdout and exits 0; a bad argument prints the problem and this on
// stderr and exits 2. Every flag that parse_args accepts is in the usage line and explained.
[[noreturn]] void usage(const char* argv0, const std::string& problem, bool help = false) {
  std::FILE* out = help ? stdout : stderr;
  if (!problem.empty()) std::fprintf(out, "%s: %s\n\n", argv0, problem.c_str());
  std::fprintf(out,
               "usage: %s [--config FILE] [--validate] [--lengths L1,L2,...| --random N] [--layers N]\n"
               "          [--iters N] [--seed S] [--check] [--no-eager] [--tp N] [--prefix-sharing]\n"
               "          [--help]\n"
               "  --config FILE   YAML config; loaded and validated before any CUDA call: a bad\n"
               "                  config exits 2 naming file:line: key. Default: configs/default.yaml\n"
               "                  in the current directory, else the installed one,\n"
               "                  %s\n"
               "  --validate      only check the config (with --layers and --tp applied) and that the\n"
               "                  batch (or --prefix-sharing's scenario) fits it, print the resolved\n"
               "                  sizes and the device memory the module will allocate; needs no GPU;\n"
               "                  exits 0 when they are valid\n"
               "  --lengths ...   sequence lengths in tokens (default 512,37,2000,1500)\n"
               "  --random N      N sequences of random length filling about half the capacity\n"
               "  --layers N      layers to run (overrides runtime.num_layers)\n"
               "  --iters N       timed forwards (default 20)\n"
               "  --seed S        seed of the random weights, the random hidden states and the --random\n"
               "                  lengths (default 1234); the same seed gives the same run\n"
               "  --check         graph vs eager bitwise, packed conv vs stock baseline\n"
               "  --no-eager      skip the eager-launch timing\n"
               "  --tp N          run the config's model as N tensor-parallel ranks on GPUs 0..N-1\n"
               "                  (NCCL all-reduce) and compare with a TP = 1 run on GPU 0; the\n"
               "                  config is the whole model (tensor_parallel.size 1)\n"
               "  --prefix-sharing  prefill prompt A with state checkpoints, then prompt B sharing A's\n"
               "                  first 75%% from the checkpoint; print tokens saved, both times and the\n"
               "                  difference from a full prefill of B (needs runtime.layer_steps: full,\n"
               "                  runtime.max_checkpoints >= 7, pools.cache_lines >= 11)\n"
               "  --help, -h      print this and exit 0\n"
               "exit status: 0 ok; 1 a run or check failed; 2 bad arguments, bad config, no usable\n"
               "CUDA device (or fewer than --tp N)\n",
               argv0, kInstalledConfig);
  std::exit(help ? 0 : 2);
}

std::vector<int32_t> parse_lengths(const char* argv0, const std::string& text) {
  std::vector<int32_t> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    char* end = nullptr;
    long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 0 || v > (1l << 30))
      usage(argv0, "--lengths: \"" + item + "\" is not a non-negative integer");
    out.push_back(static_cast<int32_t>(v));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(argv[0], a + " needs a value");
      // "--config --validate" names no file: the next flag is not taken as the value (a file
      // whose name starts with "--" is reached as ./--name).
      if (std::strncmp(argv[i + 1], "--", 2) == 0) usage(argv[0], a + " needs a value, got the flag " + argv[i + 1]);
      return argv[++i];
    };
    auto int_value = [&](long lo, long hi) -> long {
      std::string v = value();
      char* end = nullptr;
      long x = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || x < lo || x > hi)
        usage(argv[0], a + ": expected an integer in [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + "], got \"" + v + "\"");
      return x;
    };
    if (a == "--config") o.config = value();
    else if (a == "--lengths") o.lengths = parse_lengths(argv[0], value());
    else if (a == "--random") o.random_seqs = static_cast<int>(int_value(1, 1 << 20));
    else if (a == "--layers") o.layers = static_cast<int>(int_value(1, 1024));
    else if (a == "--iters") o.iters = static_cast<int>(int_value(1, 100000));
    else if (a == "--seed") o.seed = static_cast<uint64_t>(int_value(0, 1l << 62));
    else if (a == "--check") o.check = true;
    else if (a == "--no-eager") o.compare_eager = false;
    else if (a == "--validate") o.validate = true;
    else if (a == "--prefix-sharing") o.prefix_sharing = true;
    else if (a == "--tp") o.tp = static_cast<int>(int_value(1, 64));
    else if (a == "--help" || a == "-h") usage(argv[0], "", /*help=*/true);
    else usage(argv[0], "unknown argument \"" + a + "\"");
  }
  if (!o.lengths.empty() && o.random_seqs) usage(argv[0], "give --lengths or --random, not both");
  if (o.prefix_sharing && o.tp) usage(argv[0], "give --prefix-sharing or --tp, not both");
  if (o.config.empty()) o.config = default_config();
  return o;
}

struct HostBatch {
  std::vector<int32_t> qsl, cache;
  std::vector<uint8_t> flags;  // bool storage without std::vector<bool>
  kda::BatchView view() const {
    kda::BatchView b;
    b.query_start_loc = qsl.data();
    b.cache_indices = cache.data();
    b.has_initial_state = reinterpret_cast<const bool*>(flags.data());
    b.num_seqs = static_cast<int64_t>(cache.size());
    return b;
  }
};

HostBatch make_batch(const std::vector<int32_t>& lengths, const kda::Config& cfg, bool initial) {
  HostBatch b;
  b.qsl.push_back(0);
  int32_t line = 0;
  for (int32_t len : lengths) {
    b.qsl.push_back(b.qsl.back() + len);
    if (++line == cfg.pools.null_line) ++line;  // never hand a real sequence the pad line
    b.cache.push_back(line);
    b.flags.push_back(initial ? 1 : 0);
  }
  return b;
}

double ms_between(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms;
}

void cuda_or_die(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "prefill_driver: %s failed: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Times `iters` forwards: GPU time between events around the loop, and host enqueue time.
struct Timing {
  double gpu_ms_per_forward = 0;
  double wall_ms_per_forward = 0;
  double host_us_per_run = 0;  // run() alone on a drained stream (no queue back-pressure): median
};

kda::Config driver_config(const Options& opt) {
  kda::Config cfg = kda::load_config(opt.config);
  if (opt.layers) {
    cfg.runtime.num_layers = opt.layers;
    kda::validate_config(cfg);
  }
  return cfg;
}

// --tp N: the rank configs cut from the whole model's config (tensor_parallel {N, r},
// model.num_heads / N heads each), validated. Throws std::invalid_argument when the config cannot
// be cut, kda::Error when a rank's config is invalid: both are config errors, found before any
// CUDA call.
std::vector<kda::Config> tp_rank_configs(const Options& opt, const kda::Config& full) {
  const int N = opt.tp;
  if (full.tensor_parallel.size != 1)
    throw std::invalid_argument(
        "--tp takes the config of the whole model (tensor_parallel.size 1, model.num_heads = all heads) and "
        "cuts it into ranks itself; " + opt.config + " has tensor_parallel.size " +
        std::to_string(full.tensor_parallel.size));
  if (full.runtime.layer_steps != kda::LayerSteps::Full)
    throw std::invalid_argument("--tp needs runtime.layer_steps: full (the all-reduce sums the layer output); " +
                                opt.config + " has layer_steps: conv");
  if (full.pools.external || full.pools.recurrent_layout != kda::RecurrentLayout::HKV ||
      full.pools.conv_layout != kda::ConvStateLayout::DimTap || full.pools.recurrent_dtype != kda::DType::FP32 ||
      full.pools.conv_dtype != kda::DType::FP32)
    throw std::invalid_argument("--tp cuts module-owned fp32 pools in the default layouts (src/testing/tp_shard.h); " +
                                opt.config +
                                " sets pools.external, pools.recurrent_layout, pools.conv_layout or a bf16 pools.*_dtype");
  if (full.model.num_heads % N != 0)
    throw std::invalid_argument("--tp " + std::to_string(N) + ": " + opt.config + " has model.num_heads " +
                                std::to_string(full.model.num_heads) + ", which does not divide into " +
                                std::to_string(N) + " ranks (every rank needs whole heads)");
  std::vector<kda::Config> rank_cfg(N, full);
  for (int r = 0; r < N; ++r) {
    rank_cfg[r].model = kda::detail::rank_model(full.model, N, r);
    rank_cfg[r].tensor_parallel.size = N;
    rank_cfg[r].tensor_parallel.rank = r;
    kda::validate_config(rank_cfg[r]);
  }
  return rank_cfg;
}

// ---- --validate: the resolved sizes and the module's device memory, without CUDA ----

std::string mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

// The SM count --validate sizes the module for (the chunked recurrence's segment workspace
// depends on it): the current device's, else 132 (an H100 or H200 SXM) when there is none.
int validate_sm_count(bool* assumed) {
  int device = 0, sms = 0;
  *assumed = cudaGetDevice(&device) != cudaSuccess ||
             cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0;
  if (*assumed) {
    (void)cudaGetLastError();
    sms = 132;
  }
  return sms;
}

// kda::module_memory's table: what PrefillModule's constructor allocates, as it allocates it.
void print_module_memory(const kda::Config& cfg, const char* indent) {
  bool assumed = false;
  const int sms = validate_sm_count(&assumed);
  const std::vector<kda::ModuleAllocation> table = kda::module_memory(cfg, sms);
  std::printf("%smemory the module allocates (PrefillModule's constructor; kda::module_memory for %d SMs%s):\n",
              indent, sms, assumed ? ", assumed: no CUDA device here" : "");
  int64_t device_total = 0, host_total = 0;
  for (const kda::ModuleAllocation& a : table) {
    const auto all = static_cast<int64_t>(a.bytes) * a.count;
    (a.pinned_host ? host_total : device_total) += all;
    const std::string times = a.count > 1 ? " x " + std::to_string(a.count) : "";
    std::printf("%s  %-30s %14lld bytes%-5s %10s  %s(%s)\n", indent, a.name.c_str(), (long long)a.bytes, times.c_str(),
                mib(all).c_str(), a.pinned_host ? "pinned host " : "", a.size.c_str());
  }
  std::printf("%s  device total %lld bytes (%s), pinned host %lld bytes (%s)\n", indent, (long long)device_total,
              mib(device_total).c_str(), (long long)host_total, mib(host_total).c_str());
  const auto random = static_cast<int64_t>(kda::detail::random_layer_weights_bytes(cfg.model));
  std::printf("%splus, not counted above: init_random_weights (this driver) %lld bytes per layer (%s for %lld "
              "layers); CUDA's, cuBLASLt's and the graphs' own memory\n",
              indent, (long long)random, mib(random * cfg.runtime.num_layers).c_str(), (long long)cfg.runtime.num_layers);
}

const char* steps_name(kda::LayerSteps s) { return s == kda::LayerSteps::Full ? "full" : "conv"; }
const char* recurrence_name(kda::Recurrence r) { return r == kda::Recurrence::Chunked ? "chunked" : "token"; }

// --validate: the config is valid (main loaded it); print what it resolves to.
void print_validated(const Options& opt, const kda::Config& cfg, const std::vector<kda::Config>& rank_cfg) {
  const kda::ModelConfig& m = cfg.model;
  const kda::RuntimeConfig& rt = cfg.runtime;
  std::printf("%s: valid%s%s%s\n", opt.config.c_str(), cfg.name.empty() ? "" : " (", cfg.name.c_str(),
              cfg.name.empty() ? "" : ")");
  std::printf("  model: hidden %lld, %lld heads x %lld (P = %lld), gate rank %lld, in_proj width %lld "
              "(row stride %lld), norm eps %g, decay %s\n",
              (long long)m.hidden_size, (long long)m.num_heads, (long long)m.head_dim, (long long)m.part_dim(),
              (long long)m.gate_rank, (long long)m.in_proj_cols(), (long long)m.in_proj_stride(), m.norm_eps,
              m.gate_lower_bound ? "lower-bounded sigmoid" : "softplus");
  std::string buckets;
  for (int64_t b : rt.token_buckets) buckets += (buckets.empty() ? "" : ", ") + std::to_string(b);
  const int64_t windows = kda::detail::max_windows(cfg);
  std::printf("  runtime: token buckets [%s], max_seqs %lld, batch token capacity %lld (%lld window%s of up to "
              "%lld tokens), %lld layer%s, layer_steps %s, recurrence %s, capture %s, graphs %s, cuBLASLt "
              "workspace %s\n",
              buckets.c_str(), (long long)rt.max_seqs, (long long)rt.batch_token_capacity(),
              (long long)windows, windows == 1 ? "" : "s", (long long)rt.largest_bucket(),
              (long long)rt.num_layers, rt.num_layers == 1 ? "" : "s", steps_name(rt.layer_steps),
              recurrence_name(rt.recurrence), rt.capture == kda::CaptureMode::Eager ? "eager" : "lazy",
              rt.use_graphs ? "on" : "off", mib(rt.gemm_workspace_bytes).c_str());
  const int64_t conv_line = cfg.conv_line_elems() * static_cast<int64_t>(kda::dtype_size(cfg.pools.conv_dtype));
  const int64_t rec_line =
      cfg.recurrent_line_elems() * static_cast<int64_t>(kda::dtype_size(cfg.pools.recurrent_dtype));
  std::printf("  pools: %lld cache lines (null line %d), %s; a line holds conv-state %lld bytes, %s %s, and "
              "recurrent-state %lld bytes, %s %s; per layer %s\n",
              (long long)cfg.pools.cache_lines, cfg.pools.null_line,
              cfg.pools.external ? "external (the server's memory, handed over with set_layer_pools)" : "module-owned",
              (long long)conv_line, cfg.pools.conv_layout == kda::ConvStateLayout::DimTap ? "(3P, 3)" : "(3, 3P)",
              kda::dtype_name(cfg.pools.conv_dtype), (long long)rec_line,
              cfg.pools.recurrent_layout == kda::RecurrentLayout::HKV ? "(H, K, V)" : "(H, V, K)",
              kda::dtype_name(cfg.pools.recurrent_dtype),
              mib(cfg.pools.cache_lines * (conv_line + rec_line)).c_str());
  std::printf("  tensor parallel: size %lld, rank %lld\n", (long long)cfg.tensor_parallel.size,
              (long long)cfg.tensor_parallel.rank);
  if (opt.prefix_sharing)
    std::printf("  --prefix-sharing: the config has what the scenario needs (layer_steps full, max_checkpoints %lld, "
                "%lld cache lines)\n",
                (long long)rt.max_checkpoints, (long long)cfg.pools.cache_lines);
  if (rank_cfg.empty()) {
    print_module_memory(cfg, "  ");
  } else {
    std::printf("  --tp %d: %lld heads per rank; each rank's module, on its own GPU:\n", opt.tp,
                (long long)rank_cfg[0].model.num_heads);
    print_module_memory(rank_cfg[0], "    ");
    std::printf("  and a TP = 1 module of the whole model on GPU 0 for the comparison:\n");
    print_module_memory(cfg, "    ");
  }
}

std::vector<int32_t> batch_lengths(const Options& opt, const kda::Config& cfg) {
  std::vector<int32_t> lengths = opt.lengths;
  if (lengths.empty() && opt.random_seqs == 0) {
    lengths = {512, 37, 2000, 1500};
    // A config with a smaller batch capacity (configs/tiny.yaml) gets the same shape scaled
    // down to about half its capacity.
    const int64_t capacity = cfg.runtime.batch_token_capacity(), total = 4049;
    if (total > capacity)
      for (int32_t& len : lengths) len = static_cast<int32_t>(std::max<int64_t>(1, len * capacity / (2 * total)));
  }
  if (opt.random_seqs) {
    std::mt19937_64 rng(opt.seed);
    int64_t budget = cfg.runtime.batch_token_capacity() / 2;
    int32_t max_len = static_cast<int32_t>(std::max<int64_t>(1, 2 * budget / opt.random_seqs));
    std::uniform_int_distribution<int32_t> len(1, max_len);
    for (int i = 0; i < opt.random_seqs; ++i) lengths.push_back(len(rng));
  }
  return lengths;
}

// The batch must fit the config: refused here, before any CUDA call, with the limit named
// (PrefillModule::begin_forward would refuse it too, but only after the hidden states were
// copied into a buffer too small for them).
void check_batch_fits(const std::vector<int32_t>& lengths, const kda::Config& cfg) {
  int64_t tokens = 0;
  for (int32_t len : lengths) tokens += len;
  const auto n = static_cast<int64_t>(lengths.size());
  if (tokens > cfg.runtime.batch_token_capacity())
    throw std::invalid_argument("the batch has " + std::to_string(tokens) + " tokens, more than the config's batch "
                                "token capacity " + std::to_string(cfg.runtime.batch_token_capacity()) +
                                " (runtime.max_batch_tokens, or the largest bucket); give shorter --lengths");
  if (n > cfg.runtime.max_seqs)
    throw std::invalid_argument("the batch has " + std::to_string(n) + " sequences, more than runtime.max_seqs " +
                                std::to_string(cfg.runtime.max_seqs));
  if (n > cfg.pools.cache_lines - 1)  // one line per sequence, never pools.null_line
    throw std::invalid_argument("the batch has " + std::to_string(n) + " sequences, but the pools have " +
                                std::to_string(cfg.pools.cache_lines) + " lines, one of them the null line "
                                "(pools.cache_lines)");
}

Timing time_forwards(kda::PrefillModule& m, const HostBatch& batch, int iters, cudaStream_t s) {
  cudaEvent_t start, stop;
  cuda_or_die(cudaEventCreate(&start), "cudaEventCreate");
  cuda_or_die(cudaEventCreate(&stop), "cudaEventCreate");
  cuda_or_die(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  auto t0 = std::chrono::steady_clock::now();
  cuda_or_die(cudaEventRecord(start, s), "cudaEventRecord");
  for (int i = 0; i < iters; ++i) m.run(batch.view(), s);
  cuda_or_die(cudaEventRecord(stop, s), "cudaEventRecord");
  cuda_or_die(cudaEventSynchronize(stop), "cudaEventSynchronize");
  auto t1 = std::chrono::steady_clock::now();
  Timing t;
  t.gpu_ms_per_forward = ms_between(start, stop) / iters;
  t.wall_ms_per_forward = std::chrono::duration<double, std::milli>(t1 - t0).count() / iters;
  // The median, not the mean: a single call that the OS delays by tens of us would otherwise
  // dominate a few dozen samples (bench_module measures the same way).
  std::vector<double> host(static_cast<std::size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    cuda_or_die(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    auto h0 = std::chrono::steady_clock::now();
    m.run(batch.view(), s);
    host[static_cast<std::size_t>(i)] =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count();
  }
  cuda_or_die(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  std::sort(host.begin(), host.end());
  t.host_us_per_run = iters > 0 ? host[static_cast<std::size_t>(iters / 2)] : 0.0;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return t;
}

// ---- --tp N: tensor-parallel ranks against a TP = 1 run (needs NCCL in the build) ----

#if KDA_HAVE_NCCL
void cuda_try(cudaError_t e, const char* what) {
  kda::detail::check_cuda(e, "prefill_driver --tp", what, __FILE__, __LINE__);
}

template <typename T>
std::vector<T> download_vec(const void* p, int64_t count) {
  std::vector<T> v(static_cast<size_t>(count));
  if (count) cuda_try(cudaMemcpy(v.data(), p, v.size() * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy (download)");
  return v;
}

// Waits for the device too: a pageable cudaMemcpy may return before its DMA is done, and the
// modules' non-blocking streams do not wait for the legacy stream it runs on.
template <typename T>
void upload_vec(void* dst, const std::vector<T>& v) {
  if (!v.empty()) cuda_try(cudaMemcpy(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy (upload)");
  cuda_try(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

// What one module (the TP = 1 one, or a rank) leaves after the compared forward, and its timings.
struct RunResult {
  std::vector<uint16_t> out;                  // output() rows [0, T), bf16
  std::vector<std::vector<float>> conv, rec;  // pools per layer
  double layer_ms = 0;                        // graph replay, GPU time per layer
  std::vector<kda::StepTiming> steps;         // profile_steps of layer 0
  std::string check;                          // self_check summary (--check)
  bool check_ok = true;
  std::string error;                          // what failed; empty when the rank ran
};

void collect(kda::PrefillModule& m, int64_t T, cudaStream_t s, RunResult& r) {
  const kda::Config& c = m.config();
  cuda_try(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  r.out = download_vec<uint16_t>(m.output(), T * c.model.hidden_size);
  for (int l = 0; l < static_cast<int>(c.runtime.num_layers); ++l) {
    r.conv.push_back(download_vec<float>(m.conv_state_pool(l), c.conv_pool_elems()));
    r.rec.push_back(download_vec<float>(m.recurrent_state_pool(l), c.recurrent_pool_elems()));
  }
}

// Timed forwards and the per-step profile, the same on every rank (they are collective there).
void time_and_profile(kda::PrefillModule& m, const HostBatch& batch, const Options& opt, cudaStream_t s,
                      RunResult& r) {
  r.layer_ms = time_forwards(m, batch, opt.iters, s).gpu_ms_per_forward / m.config().runtime.num_layers;
  r.steps = m.profile_steps(batch.view(), 0, s);
}

double step_sum_us(const std::vector<kda::StepTiming>& steps) {
  double us = 0;
  for (const auto& t : steps) us += t.gpu_us;
  return us;
}

double step_us(const std::vector<kda::StepTiming>& steps, const std::string& name) {
  for (const auto& t : steps)
    if (t.name == name) return t.gpu_us;
  return 0;
}

// The rank threads' meeting point between phases, which also tells every rank whether all of
// them got through the phase: a rank that failed must not leave the others waiting inside an
// NCCL collective that it will never join, so nobody starts the next phase unless all may.
// (A rank failing inside a collective phase can still leave the others waiting on the GPU.)
class PhaseBarrier {
 public:
  explicit PhaseBarrier(int n) : n_(n) {}
  bool all_ok(bool ok) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = generation_;
    phase_ok_ = phase_ok_ && ok;
    if (++arrived_ == n_) {
      result_ = phase_ok_;
      phase_ok_ = true;
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return result_;
    }
    cv_.wait(lock, [&] { return generation_ != gen; });
    return result_;  // stable: the next phase cannot finish before this rank arrives at it
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int n_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool phase_ok_ = true;
  bool result_ = true;
};

// Runs the config's model as `opt.tp` ranks, rank r on GPU r in its own host thread with its own
// module (tensor_parallel {N, r}, model.num_heads / N heads) and the communicator of GPU r, and
// compares with a TP = 1 module of the same full weights on GPU 0:
//   - every rank's output (the all-reduced sum) within 1e-2 relative Frobenius error of TP = 1
//     (the sum order differs), and all ranks' outputs equal bitwise;
//   - every rank's conv-state pools equal the matching channel slices of the TP = 1 pools
//     bitwise; recurrent pools against the head slices: differing bits and errors printed;
//   - layer time per rank (graph replay) against TP = 1, and the all-reduce's share of the
//     profile_steps time of layer 0.
// The full weights are the TP = 1 module's seeded random ones, read back and cut by
// runtime/tp_shard; every rank starts from its slices of the TP = 1 pools after a first batch.
int run_tp(const Options& opt, const kda::Config& full, const std::vector<kda::Config>& rank_cfg) {
  const int N = opt.tp;
  // NVLink SHARP (NVLS) multicast stays off (NCCL_NVLS_ENABLE=0): the multi-GPU machines this
  // was written for require it. NCCL reads its environment at its first call, so this comes
  // before any NCCL call; a value the caller set is kept.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);

  const std::vector<int32_t> lengths = batch_lengths(opt, full);
  const HostBatch first = make_batch(lengths, full, /*initial=*/false);
  const HostBatch next = make_batch(lengths, full, /*initial=*/true);
  const int64_t T = first.view().num_tokens(), D = full.model.hidden_size, lines = full.pools.cache_lines;
  const int layers = static_cast<int>(full.runtime.num_layers);
  const std::vector<uint16_t> hidden = random_bf16(static_cast<size_t>(T * D), opt.seed);
  std::printf("config %s: hidden %lld, %lld heads, %d layers; tensor parallel over %d GPU%s: %lld heads per rank "
              "(NCCL_NVLS_ENABLE=%s)\n",
              opt.config.c_str(), (long long)D, (long long)full.model.num_heads, layers, N, N == 1 ? "" : "s",
              (long long)rank_cfg[0].model.num_heads, std::getenv("NCCL_NVLS_ENABLE"));
  std::printf("batch: %zu sequences, %lld tokens\n", lengths.size(), (long long)T);

  // TP = 1 on GPU 0: the full weights, the starting pools (after `first`) and `next`'s results.
  std::vector<kda::detail::HostLayerTensors> weights;
  std::vector<std::vector<float>> conv0, rec0;
  RunResult ref;
  {
    cuda_try(cudaSetDevice(0), "cudaSetDevice(0)");
    cudaStream_t s;
    cuda_try(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    kda::PrefillModule m(full);
    m.init_random_weights(opt.seed);
    for (int l = 0; l < layers; ++l) weights.push_back(kda::detail::download_layer_tensors(m, l));
    upload_vec(m.hidden_states(), hidden);
    m.run(first.view(), s);
    cuda_try(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    for (int l = 0; l < layers; ++l) {
      conv0.push_back(download_vec<float>(m.conv_state_pool(l), full.conv_pool_elems()));
      rec0.push_back(download_vec<float>(m.recurrent_state_pool(l), full.recurrent_pool_elems()));
    }
    m.run(next.view(), s);
    collect(m, T, s, ref);
    time_and_profile(m, next, opt, s, ref);
    cudaStreamDestroy(s);
  }

  // One communicator per GPU, made together here; each rank's thread uses its own. They are
  // destroyed after the threads have joined, so after the modules (whose graphs hold NCCL
  // resources).
  std::vector<ncclComm_t> comms(N, nullptr);
  std::vector<int> devs(N);
  for (int r = 0; r < N; ++r) devs[r] = r;
  if (const ncclResult_t nr = ncclCommInitAll(comms.data(), N, devs.data()); nr != ncclSuccess) {
    std::fprintf(stderr, "prefill_driver: ncclCommInitAll over GPUs 0..%d failed: %s\n", N - 1, ncclGetErrorString(nr));
    return 1;
  }

  std::vector<RunResult> res(N);
  PhaseBarrier barrier(N);
  auto rank_main = [&](int r) {
    RunResult& o = res[r];
    cudaStream_t s = nullptr;
    std::unique_ptr<kda::PrefillModule> m;
    auto phase = [&](auto&& body) {
      bool ok = true;
      try {
        body();
      } catch (const std::exception& e) {
        o.error = e.what();
        ok = false;
      }
      return barrier.all_ok(ok);
    };
    const bool ran =
        phase([&] {
          cuda_try(cudaSetDevice(r), "cudaSetDevice");
          cuda_try(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
          m = std::make_unique<kda::PrefillModule>(rank_cfg[r]);
          m->set_communicator(comms[r]);
          for (int l = 0; l < layers; ++l) {
            m->upload_layer_weights(l, kda::detail::host_weights_view(kda::detail::shard_layer(full.model, weights[l], N, r)));
            upload_vec(m->conv_state_pool(l), kda::detail::shard_conv_pool(full.model, conv0[l], lines, N, r));
            upload_vec(m->recurrent_state_pool(l), kda::detail::shard_recurrent_pool(full.model, rec0[l], lines, N, r));
          }
          upload_vec(m->hidden_states(), hidden);
        }) &&
        // From here every call is collective: all ranks make the same ones in the same order.
        phase([&] {
          m->run(next.view(), s);
          collect(*m, T, s, o);
        }) &&
        phase([&] { time_and_profile(*m, next, opt, s, o); }) &&
        phase([&] {
          if (!opt.check) return;
          const kda::SelfCheckReport rep = m->self_check(next.view(), s);
          o.check_ok = rep.ok;
          o.check = std::to_string(rep.graph_vs_eager_diff_bits) + " graph-vs-eager, " +
                    std::to_string(rep.conv_vs_stock_diff_bits) + " conv-vs-stock differing bits";
        });
    (void)ran;
    m.reset();
    if (s) cudaStreamDestroy(s);
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < N; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();
  for (ncclComm_t c : comms) ncclCommDestroy(c);

  int rc = 0;
  for (int r = 0; r < N; ++r)
    if (!res[r].error.empty()) {
      std::fprintf(stderr, "prefill_driver: rank %d: %s\n", r, res[r].error.c_str());
      rc = 1;
    }
  if (rc) return rc;

  const double ref_us = step_sum_us(ref.steps);
  std::printf("\nTP 1 on GPU 0: %.3f ms per layer (graph replay), profile of layer 0: %.1f us\n", ref.layer_ms, ref_us);
  std::printf("\n| rank | layer ms | TP 1 / rank | all-reduce us | all-reduce share | output rel err vs TP 1 | "
              "output bits vs rank 0 | conv pool bits vs TP 1 slice | recurrent bits | recurrent rel err (max elem) |\n");
  std::printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (int r = 0; r < N; ++r) {
    const RunResult& o = res[r];
    const double out_err = rel_error_bf16(o.out, ref.out);
    const int64_t out_bits = diff_bits(o.out.data(), res[0].out.data(), o.out.size() * 2);
    int64_t conv_bits = 0, rec_bits = 0;
    double rec_num = 0, rec_den = 0, rec_max_diff = 0, rec_max_ref = 0;
    for (int l = 0; l < layers; ++l) {
      const auto conv_want = kda::detail::shard_conv_pool(full.model, ref.conv[l], lines, N, r);
      const auto rec_want = kda::detail::shard_recurrent_pool(full.model, ref.rec[l], lines, N, r);
      conv_bits += diff_bits(o.conv[l].data(), conv_want.data(), conv_want.size() * 4);
      rec_bits += diff_bits(o.rec[l].data(), rec_want.data(), rec_want.size() * 4);
      for (size_t i = 0; i < rec_want.size(); ++i) {
        const double d = static_cast<double>(o.rec[l][i]) - rec_want[i];
        rec_num += d * d;
        rec_den += static_cast<double>(rec_want[i]) * rec_want[i];
        rec_max_diff = std::max(rec_max_diff, std::fabs(d));
        rec_max_ref = std::max(rec_max_ref, std::fabs(static_cast<double>(rec_want[i])));
      }
    }
    const double rec_err = std::sqrt(rec_num / (rec_den > 0 ? rec_den : 1));
    const double all_reduce_us = step_us(o.steps, "all-reduce"), total_us = step_sum_us(o.steps);
    std::printf("| %d | %.3f | %.2fx | %.1f | %.1f%% | %.2e | %lld | %lld | %lld | %.2e (%.2e) |\n", r, o.layer_ms,
                ref.layer_ms / o.layer_ms, all_reduce_us, total_us > 0 ? 100.0 * all_reduce_us / total_us : 0.0,
                out_err, (long long)out_bits, (long long)conv_bits, (long long)rec_bits, rec_err,
                rec_max_diff / (rec_max_ref > 0 ? rec_max_ref : 1));
    if (!(out_err <= 1e-2) || out_bits != 0 || conv_bits != 0) rc = 1;
    if (opt.check) {
      std::printf("  rank %d self_check: %s: %s\n", r, o.check.c_str(), o.check_ok ? "OK" : "FAILED");
      if (!o.check_ok) rc = 1;
    }
  }
  std::printf("\nThe all-reduce time includes waiting for the slowest rank. Pass: output within 1e-2 of TP 1 on "
              "every rank, ranks equal bitwise, conv pools equal bitwise: %s\n",
              rc == 0 ? "OK" : "FAILED");
  return rc;
}
#else
int run_tp(const Options&, const kda::Config&, const std::vector<kda::Config>&) {
  std::fprintf(stderr,
               "prefill_driver: --tp needs NCCL, and this build has none (meson found no usable nccl.h and "
               "libnccl; its summary says so): install NCCL >= 2.10 and rebuild\n");
  return 2;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options opt = parse_args(argc, argv);

  // The config first: a missing file, a YAML error or a bad value is reported the same way on
  // every machine (kda::Error: "kda::load_config: FILE:LINE: key.path: what is wrong"), exit 2.
  kda::Config cfg;
  std::vector<kda::Config> rank_cfg;
  try {
    cfg = driver_config(opt);
    if (opt.tp) rank_cfg = tp_rank_configs(opt, cfg);
    if (opt.prefix_sharing) {
      if (const std::string unmet = prefix_sharing_unmet(cfg); !unmet.empty()) throw std::invalid_argument(unmet);
    } else {
      check_batch_fits(batch_lengths(opt, cfg), cfg);
    }
  } catch (const kda::Error& e) {
    std::fprintf(stderr, "prefill_driver: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "prefill_driver: %s\n", e.what());
    return 2;
  }
  if (opt.validate) {
    print_validated(opt, cfg, rank_cfg);
    return 0;
  }

  int devices = 0;
  cudaError_t dev_err = cudaGetDeviceCount(&devices);
  if (dev_err != cudaSuccess || devices == 0) {
    std::fprintf(stderr,
                 "prefill_driver: config %s is valid, but no CUDA device is usable here (%s). This program "
                 "runs the KDA prefill on an NVIDIA Hopper GPU (sm_90); without one, --validate checks a "
                 "config and the CPU test suite runs: bash scripts/run_tests.sh\n",
                 opt.config.c_str(), dev_err != cudaSuccess ? cudaGetErrorString(dev_err) : "no device");
    return 2;
  }
  if (opt.tp > devices) {
    std::fprintf(stderr,
                 "prefill_driver: --tp %d runs one rank per GPU on GPUs 0..%d, but only %d CUDA device%s usable "
                 "here; use --tp %d or fewer\n",
                 opt.tp, opt.tp - 1, devices, devices == 1 ? " is" : "s are", devices);
    return 2;
  }

  try {
    if (opt.tp) return run_tp(opt, cfg, rank_cfg);
    const std::vector<int32_t> lengths = batch_lengths(opt, cfg);

    const auto& m = cfg.model;
    std::printf("config %s: hidden %lld, %lld heads (P = %lld), in_proj width %lld, %lld layers\n",
                opt.config.c_str(), (long long)m.hidden_size, (long long)m.num_heads,
                (long long)m.part_dim(), (long long)m.in_proj_cols(),
                (long long)cfg.runtime.num_layers);

    cudaStream_t stream;
    cuda_or_die(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    // The device memory the constructor takes, against what --validate computes for this config
    // (cudaMalloc rounds up, and cuBLASLt's handle allocates a little of its own).
    size_t free_before = 0, free_after = 0, device_bytes = 0;
    cuda_or_die(cudaMemGetInfo(&free_before, &device_bytes), "cudaMemGetInfo");
    kda::PrefillModule module(cfg);
    cuda_or_die(cudaMemGetInfo(&free_after, &device_bytes), "cudaMemGetInfo");
    int64_t estimate = 0;
    bool assumed = false;
    for (const kda::ModuleAllocation& a : kda::module_memory(cfg, validate_sm_count(&assumed)))
      if (!a.pinned_host) estimate += static_cast<int64_t>(a.bytes) * a.count;
    std::printf("module construction took %s of device memory (kda::module_memory's table: %s)\n",
                mib(static_cast<int64_t>(free_before) - static_cast<int64_t>(free_after)).c_str(),
                mib(estimate).c_str());
    // pools.external: the driver plays the server and hands the module pools of its own (packed
    // lines, zeroed, as a module-owned pool starts).
    std::vector<kda::detail::DeviceBuffer> server_pools;
    if (cfg.pools.external) {
      for (int l = 0; l < static_cast<int>(cfg.runtime.num_layers); ++l) {
        const size_t conv_bytes = static_cast<size_t>(cfg.conv_pool_elems()) * kda::dtype_size(cfg.pools.conv_dtype);
        const size_t rec_bytes =
            static_cast<size_t>(cfg.recurrent_pool_elems()) * kda::dtype_size(cfg.pools.recurrent_dtype);
        server_pools.emplace_back(conv_bytes, "the driver's conv-state pool");
        server_pools.emplace_back(rec_bytes, "the driver's recurrent-state pool");
        kda::StatePools p;
        p.conv = server_pools[server_pools.size() - 2].get();
        p.recurrent = server_pools.back().get();
        p.lines = cfg.pools.cache_lines;
        cuda_or_die(cudaMemset(p.conv, 0, conv_bytes), "cudaMemset(pool)");
        cuda_or_die(cudaMemset(p.recurrent, 0, rec_bytes), "cudaMemset(pool)");
        module.set_layer_pools(l, p);
      }
      cuda_or_die(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      std::printf("pools.external: the driver handed the module %d layers' pools\n",
                  static_cast<int>(cfg.runtime.num_layers));
    }
    module.init_random_weights(opt.seed);
    if (opt.prefix_sharing) {
      const int rc = run_prefix_sharing(module, opt.seed, stream);
      cudaStreamDestroy(stream);
      return rc;
    }
    HostBatch first = make_batch(lengths, cfg, /*initial=*/false);
    HostBatch next = make_batch(lengths, cfg, /*initial=*/true);
    const int64_t tokens = first.view().num_tokens();
    std::vector<uint16_t> hidden = random_bf16(static_cast<size_t>(tokens * m.hidden_size), opt.seed);
    cuda_or_die(cudaMemcpy(module.hidden_states(), hidden.data(), hidden.size() * 2,
                           cudaMemcpyHostToDevice),
                "cudaMemcpy(hidden states)");
    std::printf("batch: %zu sequences, %lld tokens\n", lengths.size(), (long long)tokens);

    // The first forward captures the graphs it needs (lazy capture) after an eager warm-up.
    auto c0 = std::chrono::steady_clock::now();
    module.run(first.view(), stream);
    cuda_or_die(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    double first_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - c0).count();

    Timing graph = time_forwards(module, next, opt.iters, stream);
    Timing eager;
    if (opt.compare_eager) {
      module.set_eager(true);
      eager = time_forwards(module, next, opt.iters, stream);
      module.set_eager(false);
    }

    kda::ModuleStats st = module.stats(stream);
    std::printf("\n| bucket | layer | window | capture us | instantiate us | nodes | replays | replay us |\n");
    std::printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (const auto& g : st.graphs)
      std::printf("| %lld | %d | %d | %.1f | %.1f | %lld | %lld | %.1f |\n", (long long)g.bucket_tokens,
                  g.layer, g.window, g.capture_us, g.instantiate_us, (long long)g.graph_nodes,
                  (long long)g.replays, g.mean_replay_us);

    const int layers = static_cast<int>(cfg.runtime.num_layers);
    std::printf("\nfirst forward (warm-up + capture): %.2f ms\n", first_ms);
    std::printf("graph replay: %.3f ms GPU, %.3f ms wall per forward (%d layers): %.0f tokens/s\n",
                graph.gpu_ms_per_forward, graph.wall_ms_per_forward, layers,
                tokens / (graph.wall_ms_per_forward * 1e-3));
    if (opt.compare_eager)
      std::printf("eager launch: %.3f ms GPU, %.3f ms wall per forward: %.0f tokens/s (graph %.2fx)\n",
                  eager.gpu_ms_per_forward, eager.wall_ms_per_forward,
                  tokens / (eager.wall_ms_per_forward * 1e-3),
                  eager.wall_ms_per_forward / graph.wall_ms_per_forward);
    std::printf("host time per run() on a drained stream (median): %.1f us (%.1f us per layer)\n",
                graph.host_us_per_run, graph.host_us_per_run / layers);

    int rc = 0;
    if (opt.check) {
      kda::SelfCheckReport r = module.self_check(next.view(), stream);
      std::printf("\ncheck: graph vs eager %lld differing bits, packed conv vs stock baseline %lld "
                  "differing bits: %s\n%s",
                  (long long)r.graph_vs_eager_diff_bits, (long long)r.conv_vs_stock_diff_bits,
                  r.ok ? "OK" : "FAILED", r.detail.c_str());
      if (!r.ok) rc = 1;
    }
    cudaStreamDestroy(stream);
    return rc;
  } catch (const kda::Error& e) {
    std::fprintf(stderr, "prefill_driver: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "prefill_driver: unexpected error: %s\n", e.what());
    return 1;
  }
}
