// Module benchmark: per config and token bucket, graph replay vs eager launches of the same steps
// (GPU time from events, wall time per forward) and host time per run(). One batch per bucket:
// equal sequences (4, or --seqs) filling the bucket, continuing from their states
// (has_initial_state); then the per-step GPU time of one whole layer (profile_steps) at
// layer-scale shapes.
//
//   bench_module [--config FILE]... [--iters N] [--seqs N] [--steps-only] [--out FILE] [--help]
//
// --seqs N: equal sequences per batch (default 4; at most the bucket and runtime.max_seqs).
// --steps-only: the per-step table alone. Prints markdown tables (and writes them to FILE with
// --out). Exits 0 after --help, 2 without a usable GPU, 1 on an error or a bad option, else 0.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_util.h"
#include "kda/config.h"
#include "kda/error.h"
#include "kda/prefill.h"
#include "common/half_host.h"
#include "gpu_spin.h"

namespace {

struct Row {
  std::string config, steps;
  int64_t bucket = 0, tokens = 0, seqs = 0, layers = 0;
  double graph_gpu_us = 0, eager_gpu_us = 0, graph_wall_us = 0, eager_wall_us = 0;
  double host_run_us = 0;  // host time of one run() call (all layers), graph mode, median
  double host_begin_us = 0, host_first_layer_us = 0, host_last_layer_us = 0;  // its parts
  double host_busy_us = 0;  // run() behind a busy GPU
};

// Random bf16 hidden states for the largest bucket's rows, made on the host.
void upload_random_hidden(kda::PrefillModule& m, uint64_t seed) {
  const kda::Config& cfg = m.config();
  std::vector<uint16_t> h(static_cast<size_t>(cfg.runtime.largest_bucket() * cfg.model.hidden_size));
  uint64_t x = seed | 1;
  for (auto& v : h) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    v = kda::host::float_to_bf16(static_cast<float>((x >> 40) & 0xFFFFFF) / 8388608.0f - 1.0f);
  }
  BENCH_CUDA(cudaMemcpy(m.hidden_states(), h.data(), h.size() * 2, cudaMemcpyHostToDevice));
}

// n sequences of (nearly) equal length filling `tokens` rows, on lines 1.., continuing from
// their states.
struct EqualBatch {
  std::vector<int32_t> qsl{0}, lines;
  std::vector<uint8_t> flags;
  EqualBatch(int64_t tokens, int64_t n, const kda::Config& cfg) {
    for (int64_t i = 0; i < n; ++i) {
      qsl.push_back(static_cast<int32_t>(tokens * (i + 1) / n));
      // Lines 1, 2, ... with the null line skipped, so every sequence has its own.
      const int64_t line = i + 1 >= cfg.pools.null_line && cfg.pools.null_line >= 1 ? i + 2 : i + 1;
      lines.push_back(static_cast<int32_t>(line));
      flags.push_back(1);
    }
  }
  kda::BatchView view() const {
    return {qsl.data(), lines.data(), reinterpret_cast<const bool*>(flags.data()),
            static_cast<int64_t>(lines.size())};
  }
};

struct Measured {
  double gpu_us, wall_us, host_us;
  double host_begin_us, host_first_layer_us, host_last_layer_us;  // parts of host_us
  double host_busy_us;  // host time of run() behind a GPU spin kernel (stream not drained)
};

Measured measure(kda::PrefillModule& m, const kda::BatchView& b, int iters, cudaStream_t s) {
  for (int i = 0; i < 3; ++i) m.run(b, s);  // warm-up (and lazy capture)
  BENCH_CUDA(cudaStreamSynchronize(s));
  // Host time of run() with the stream drained first, as a server that waits for each forward
  // sees it: validation, planning, staging and the launches, without queue back-pressure.
  // run() is begin_forward + run_layer per layer; the parts are timed separately so that a
  // cost that grows with the bucket can be placed.
  using Clock = std::chrono::steady_clock;
  const auto us = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::micro>(b - a).count();
  };
  const int layers = m.config().runtime.num_layers;
  // Medians over at least 30 drained-stream runs: single runs see OS jitter of tens of us.
  const int host_iters = std::max(iters, 30);
  std::vector<double> host, begin, first, last;
  for (int i = 0; i < host_iters; ++i) {
    BENCH_CUDA(cudaStreamSynchronize(s));
    const auto h0 = Clock::now();
    m.begin_forward(b, s);
    const auto h1 = Clock::now();
    begin.push_back(us(h0, h1));
    auto prev = h1;
    for (int l = 0; l < layers; ++l) {
      m.run_layer(l, s);
      const auto now = Clock::now();
      if (l == 0) first.push_back(us(prev, now));
      if (l == layers - 1) last.push_back(us(prev, now));
      prev = now;
    }
    host.push_back(us(h0, prev));
  }
  // The same with the GPU busy and the host thread warm: behind a spin kernel, three run()
  // calls back to back (the module's host staging ring lets the host run that far ahead without
  // blocking), each timed; what a server that launches the next forwards while the GPU works
  // pays. The drained numbers above include whatever a host thread pays right after waking from
  // a long synchronize.
  std::vector<double> busy;
  for (int i = 0; i < (host_iters + 2) / 3; ++i) {
    BENCH_CUDA(cudaStreamSynchronize(s));
    kda::bench::gpu_spin(s, 2000.0);
    for (int k = 0; k < 3; ++k) {
      const auto h0 = Clock::now();
      m.run(b, s);
      busy.push_back(us(h0, Clock::now()));
    }
  }
  BENCH_CUDA(cudaStreamSynchronize(s));
  // GPU and wall time of back-to-back forwards.
  const auto w0 = Clock::now();
  const double gpu_us = kda::bench::time_back_to_back_us(s, 0, iters, [&](int) { m.run(b, s); });
  const double wall_us = us(w0, Clock::now()) / iters;
  using kda::bench::median_of;
  return {gpu_us, wall_us, median_of(host), median_of(begin), median_of(first), median_of(last), median_of(busy)};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> configs;
  std::string out_path;
  int iters = 50;
  int64_t batch_seqs = 4;
  bool steps_only = false;
  constexpr const char* kArgs =
      "[--config FILE]... [--iters N] [--seqs N] [--steps-only] [--out FILE] [--help]";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (kda::bench::is_help(argv[i])) kda::bench::usage_exit(argv[0], kArgs);
    else if (a == "--steps-only") steps_only = true;
    else if (a == "--config" && i + 1 < argc) configs.push_back(argv[++i]);
    else if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--iters" && i + 1 < argc) iters = std::max(1, std::atoi(argv[++i]));
    else if (a == "--seqs" && i + 1 < argc) batch_seqs = std::max(1, std::atoi(argv[++i]));
    else kda::bench::usage_exit(argv[0], kArgs, argv[i]);
  }
  // tiny.yaml: a layer small enough that launches, not GPU work, bound the eager path, which
  // is where replaying a graph pays.
  if (configs.empty())
    configs = {"configs/default.yaml", "configs/kimi-linear-48b-tp1.yaml", "configs/tiny.yaml"};

  const cudaDeviceProp prop = kda::bench::require_gpu("bench_module");

  std::vector<Row> rows;
  try {
    cudaStream_t s;
    BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (const auto& path : steps_only ? std::vector<std::string>{} : configs)
    for (kda::LayerSteps steps : {kda::LayerSteps::InProjConv, kda::LayerSteps::Full}) {
      kda::Config cfg = kda::load_config(path);
      cfg.runtime.layer_steps = steps;
      const char* steps_name = steps == kda::LayerSteps::Full ? "full" : "conv";
      // The whole layer (token-by-token recurrence) runs ms per forward: fewer repetitions.
      const int n = steps == kda::LayerSteps::Full ? std::max(1, iters / 5) : iters;
      kda::PrefillModule m(cfg);
      m.init_random_weights(7);
      upload_random_hidden(m, 99);
      for (int64_t bucket : cfg.runtime.token_buckets) {
        const int64_t seqs = std::min<int64_t>({batch_seqs, bucket, cfg.runtime.max_seqs});
        const EqualBatch eb(bucket, seqs, cfg);
        const kda::BatchView b = eb.view();

        Row r;
        r.config = path;
        r.steps = steps_name;
        r.bucket = bucket;
        r.tokens = bucket;
        r.seqs = seqs;
        r.layers = cfg.runtime.num_layers;
        // Graph, eager, graph again: the graph's GPU and wall times are the means of its two
        // measurements, so that a drift over the run (clocks, state values growing from
        // forward to forward) does not favour whichever mode is measured first.
        m.set_eager(false);
        Measured g = measure(m, b, n, s);
        m.set_eager(true);
        Measured e = measure(m, b, n, s);
        m.set_eager(false);
        const Measured g2 = measure(m, b, n, s);
        g.gpu_us = 0.5 * (g.gpu_us + g2.gpu_us);
        g.wall_us = 0.5 * (g.wall_us + g2.wall_us);
        r.graph_gpu_us = g.gpu_us;
        r.graph_wall_us = g.wall_us;
        r.host_run_us = g.host_us;
        r.host_begin_us = g.host_begin_us;
        r.host_first_layer_us = g.host_first_layer_us;
        r.host_last_layer_us = g.host_last_layer_us;
        r.host_busy_us = g.host_busy_us;
        r.eager_gpu_us = e.gpu_us;
        r.eager_wall_us = e.wall_us;
        rows.push_back(r);
        std::fprintf(stderr, "  %s %s bucket %lld: graph %.1f us, eager %.1f us GPU\n", path.c_str(),
                     steps_name, (long long)bucket, g.gpu_us, e.gpu_us);
      }
    }
    cudaStreamDestroy(s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_module: %s\n", e.what());
    return 1;
  }

  // Per-step GPU time of one layer (eager, events between steps), whole-layer config.
  std::string steps_table =
      "| config | tokens x seqs | step | GPU us |\n| --- | --- | --- | ---: |\n";
  try {
    cudaStream_t s;
    BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (const auto& path : configs) {
      kda::Config cfg = kda::load_config(path);
      cfg.runtime.layer_steps = kda::LayerSteps::Full;
      if (cfg.runtime.largest_bucket() < 2048) continue;  // tiny.yaml: no layer-scale cases
      kda::PrefillModule m(cfg);
      m.init_random_weights(7);
      upload_random_hidden(m, 5);
      const int64_t cases[][2] = {{2048, 4}, {16384, 1}, {16384, 16}};
      for (const auto& c : cases) {
        const int64_t T = std::min(c[0], cfg.runtime.largest_bucket()), n = c[1];
        const EqualBatch eb(T, n, cfg);
        const kda::BatchView b = eb.view();
        m.profile_steps(b, 0, s);  // warm-up: module loads
        const auto t = m.profile_steps(b, 0, s);
        double total = 0;
        char line[256];
        for (const auto& st : t) {
          total += st.gpu_us;
          double extra = 0;
          if (st.name == "in_proj GEMM")
            extra = 2.0 * T * cfg.model.in_proj_cols() * cfg.model.hidden_size / (st.gpu_us * 1e6);
          std::snprintf(line, sizeof line, "| %s | %lld x %lld | %s | %.1f%s |\n", path.c_str(), (long long)T,
                        (long long)n, st.name.c_str(), st.gpu_us,
                        extra > 0 ? (" (" + std::to_string(static_cast<int>(extra)) + " TFLOP/s)").c_str() : "");
          steps_table += line;
        }
        std::snprintf(line, sizeof line, "| %s | %lld x %lld | **layer** | %.1f |\n", path.c_str(), (long long)T,
                      (long long)n, total);
        steps_table += line;
      }
    }
    cudaStreamDestroy(s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_module: %s\n", e.what());
    return 1;
  }

  std::string table = std::string("## bench_module: graph replay vs eager launches on ") + prop.name + "\n\n" +
      "| config | steps | tokens | seqs | layers | graph GPU us | eager GPU us | graph wall us | eager wall us "
      "| eager/graph wall | host us per run() | host us per layer | begin_forward us | first layer us "
      "| last layer us | host us per layer, GPU busy |\n"
      "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
  char line[512];
  for (const auto& r : rows) {
    std::snprintf(line, sizeof line,
                  "| %s | %s | %lld | %lld | %lld | %.1f | %.1f | %.1f | %.1f | %.2f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n",
                  r.config.c_str(), r.steps.c_str(), (long long)r.tokens, (long long)r.seqs, (long long)r.layers,
                  r.graph_gpu_us, r.eager_gpu_us, r.graph_wall_us, r.eager_wall_us,
                  r.eager_wall_us / r.graph_wall_us, r.host_run_us, r.host_run_us / r.layers, r.host_begin_us,
                  r.host_first_layer_us, r.host_last_layer_us, r.host_busy_us / r.layers);
    table += line;
  }
  table += "\nHost times are medians of >= 30 run() calls: drained (the stream synchronised before each "
           "call; begin_forward / first / last layer are its parts) and GPU busy (three calls back to back "
           "behind a 2 ms spin kernel).\n"
           "targets: host run() < 15 us per layer; at 2048 tokens graph wall >= 1.3x faster than eager\n\n";
  table += steps_table;
  try {
    kda::bench::emit(table, out_path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_module: %s\n", e.what());
    return 1;
  }
  return 0;
}
