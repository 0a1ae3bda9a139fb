// Example prefill driver: builds a PrefillModule from a YAML config, runs a batch of sequences
// through every layer as CUDA-graph replays, and prints per-bucket capture cost, replay time and
// throughput. --check compares graph replay with eager launches bitwise and the packed conv with
// the stock-path baseline.
//
//   prefill_driver --config configs/default.yaml --lengths 512,37,2000 --check
//   prefill_driver --random 16 --layers 4 --iters 50
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <vector>

#include "kda/config.h"
#include "kda/error.h"
#include "kda/prefill.h"

namespace {

struct Options {
  std::string config = "configs/default.yaml";
  std::vector<int32_t> lengths;
  int random_seqs = 0;
  int layers = 0;  // 0: the config's runtime.num_layers
  int iters = 20;
  uint64_t seed = 1234;
  bool check = false;
  bool compare_eager = true;
};

[[noreturn]] void usage(const char* argv0, const std::string& problem) {
  if (!problem.empty()) std::fprintf(stderr, "%s: %s\n\n", argv0, problem.c_str());
  std::fprintf(stderr,
               "usage: %s [--config FILE] [--lengths L1,L2,...| --random N] [--layers N]\n"
               "          [--iters N] [--seed S] [--check] [--no-eager]\n"
               "  --config FILE   YAML config (default configs/default.yaml)\n"
               "  --lengths ...   sequence lengths in tokens (default 512,37,2000,1500)\n"
               "  --random N      N sequences of random length filling about half the capacity\n"
               "  --layers N      layers to run (overrides runtime.num_layers)\n"
               "  --iters N       timed forwards (default 20)\n"
               "  --check         graph vs eager bitwise, packed conv vs stock baseline\n"
               "  --no-eager      skip the eager-launch timing\n",
               argv0);
  std::exit(2);
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
    else if (a == "--help" || a == "-h") usage(argv[0], "");
    else usage(argv[0], "unknown argument \"" + a + "\"");
  }
  if (!o.lengths.empty() && o.random_seqs) usage(argv[0], "give --lengths or --random, not both");
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

// Uniform(-1, 1) bf16 bits (round to nearest even), from a xorshift generator: hidden states
// for the batch rows, made on the host so the driver needs nothing but the public API.
std::vector<uint16_t> random_bf16(size_t count, uint64_t seed) {
  std::vector<uint16_t> out(count);
  uint64_t x = seed | 1;
  for (auto& v : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    float f = static_cast<float>(static_cast<int64_t>(x >> 40) - (1 << 23)) / float(1 << 23);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
  return out;
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
  double host_us_per_run = 0;  // run() alone, on a drained stream (no queue back-pressure)
};

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
  for (int i = 0; i < iters; ++i) {
    cuda_or_die(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    auto h0 = std::chrono::steady_clock::now();
    m.run(batch.view(), s);
    t.host_us_per_run += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count();
  }
  cuda_or_die(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  t.host_us_per_run /= iters;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt = parse_args(argc, argv);

  int devices = 0;
  cudaError_t dev_err = cudaGetDeviceCount(&devices);
  if (dev_err != cudaSuccess || devices == 0) {
    std::fprintf(stderr,
                 "prefill_driver: no CUDA device is usable here (%s). This program runs the KDA "
                 "prefill on an NVIDIA Hopper GPU (sm_90); the CPU test suite runs without one: "
                 "bash scripts/run_tests.sh\n",
                 dev_err != cudaSuccess ? cudaGetErrorString(dev_err) : "no device");
    return 2;
  }

  try {
    kda::Config cfg = kda::load_config(opt.config);
    if (opt.layers) {
      cfg.runtime.num_layers = opt.layers;
      kda::validate_config(cfg);
    }
    std::vector<int32_t> lengths = opt.lengths;
    if (lengths.empty() && opt.random_seqs == 0) lengths = {512, 37, 2000, 1500};
    if (opt.random_seqs) {
      std::mt19937_64 rng(opt.seed);
      int64_t budget = cfg.runtime.batch_token_capacity() / 2;
      int32_t max_len = static_cast<int32_t>(std::max<int64_t>(1, 2 * budget / opt.random_seqs));
      std::uniform_int_distribution<int32_t> len(1, max_len);
      for (int i = 0; i < opt.random_seqs; ++i) lengths.push_back(len(rng));
    }

    const auto& m = cfg.model;
    std::printf("config %s: hidden %lld, %lld heads (P = %lld), in_proj width %lld, %lld layers\n",
                opt.config.c_str(), (long long)m.hidden_size, (long long)m.num_heads,
                (long long)m.part_dim(), (long long)m.in_proj_cols(),
                (long long)cfg.runtime.num_layers);

    cudaStream_t stream;
    cuda_or_die(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    kda::PrefillModule module(cfg);
    module.init_random_weights(opt.seed);
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
    std::printf("host time per run() on a drained stream: %.1f us (%.1f us per layer)\n",
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
