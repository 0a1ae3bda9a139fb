// Host-side per-batch work of the module, on the CPU: validation, window planning and staging
// of a forward (what begin_forward does before its one copy), with and without state
// checkpoints, and the bucket-ladder search over a large histogram. Medians of repeated calls.
//   bench_host [--quick] [--out FILE]
// Prints a Markdown table (and writes it to FILE with --out). Needs no GPU. Exits 1 on a bad
// argument, 0 otherwise.
#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "kda/config.h"
#include "kda/prefill.h"
#include "runtime/batch_plan.h"
#include "runtime/bucket_ladder.h"

namespace {

using Clock = std::chrono::steady_clock;
using kda::detail::BatchValidator;
using kda::detail::StagingLayout;
using kda::detail::WindowPlan;

kda::Config serving_config(int64_t cache_lines, int64_t max_checkpoints) {
  kda::Config c;
  c.model.hidden_size = 256;
  c.model.num_heads = 2;
  c.runtime.token_buckets = {512, 1024, 2048, 4096, 8192, 16384};
  c.runtime.max_batch_tokens = 65536;
  c.runtime.max_seqs = 256;
  c.runtime.max_checkpoints = max_checkpoints;
  c.pools.cache_lines = cache_lines;
  return c;
}

// A batch's host arrays; view() points into them.
struct Batch {
  std::vector<int32_t> qsl{0}, cache, interval, ckpt_start{0}, ckpt_lines;
  std::vector<unsigned char> flags;
  void add(int32_t length, int32_t line, bool initial, int32_t every = 0, const std::vector<int32_t>& lines = {}) {
    qsl.push_back(qsl.back() + length);
    cache.push_back(line);
    flags.push_back(initial ? 1 : 0);
    interval.push_back(every);
    ckpt_lines.insert(ckpt_lines.end(), lines.begin(), lines.end());
    ckpt_start.push_back(static_cast<int32_t>(ckpt_lines.size()));
  }
  kda::BatchView view(bool checkpoints) const {
    kda::BatchView v;
    v.query_start_loc = qsl.data();
    v.cache_indices = cache.data();
    v.has_initial_state = reinterpret_cast<const bool*>(flags.data());
    v.num_seqs = static_cast<int64_t>(cache.size());
    if (checkpoints) {
      v.checkpoint_interval = interval.data();
      v.checkpoint_start_loc = ckpt_start.data();
      v.checkpoint_lines = ckpt_lines.data();
    }
    return v;
  }
};

// Median microseconds of `iterations` calls of f, in 9 rounds.
double median_us(int iterations, const std::function<void()>& f) {
  f();  // warm caches
  std::vector<double> rounds;
  for (int r = 0; r < 9; ++r) {
    const auto t0 = Clock::now();
    for (int i = 0; i < iterations; ++i) f();
    rounds.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iterations);
  }
  std::sort(rounds.begin(), rounds.end());
  return rounds[rounds.size() / 2];
}

// validate + plan + fill every window's slot, as begin_forward does before its copy.
double stage_us(const kda::Config& config, const kda::BatchView& batch, int iterations, std::size_t* windows_out) {
  const StagingLayout layout = StagingLayout::for_config(config);
  BatchValidator validator(config);
  std::vector<WindowPlan> windows;
  windows.reserve(static_cast<std::size_t>(kda::detail::max_windows(config)));
  std::vector<unsigned char> staging(static_cast<std::size_t>(kda::detail::max_windows(config)) * layout.slot_bytes);
  const double us = median_us(iterations, [&] {
    validator.validate(batch);
    kda::detail::plan_windows(batch, config, windows);
    for (std::size_t w = 0; w < windows.size(); ++w)
      kda::detail::fill_window_staging(batch, windows[w], config, layout, staging.data() + w * layout.slot_bytes);
  });
  *windows_out = windows.size();
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  const char* out_path = nullptr;
  constexpr const char* kArgs = "[--quick] [--out FILE]";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--out" && i + 1 < argc) {
      out_path = argv[++i];
    } else if (kda::bench::is_help(argv[i])) {
      kda::bench::usage_exit(argv[0], kArgs);
    } else {
      kda::bench::usage_exit(argv[0], kArgs, argv[i]);
    }
  }
  const int scale = quick ? 10 : 1;
  std::string table = "| host work | case | median |\n|---|---|---|\n";
  auto row = [&table](const std::string& what, const std::string& which, double value, const char* unit) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.2f %s", value, unit);
    table += "| " + what + " | " + which + " | " + buf + " |\n";
  };

  // 256 sequences on lines drawn from the whole pool (the duplicate table is hit at random),
  // half continuing from their line.
  std::mt19937 rng(7);
  std::vector<int32_t> lines(512);
  for (int i = 0; i < 512; ++i) lines[static_cast<std::size_t>(i)] = i + 1;
  std::shuffle(lines.begin(), lines.end(), rng);
  const kda::Config plain = serving_config(513, 0);
  for (int32_t len : {64, 256}) {
    Batch b;
    for (int s = 0; s < 256; ++s) b.add(len, lines[static_cast<std::size_t>(s)], s % 2 == 0);
    std::size_t windows = 0;
    const double us = stage_us(plain, b.view(false), 20000 / scale / (len / 64), &windows);
    row("begin_forward: validate + plan + stage", "256 sequences, " + std::to_string(b.qsl.back()) + " tokens, " +
                                                      std::to_string(windows) + " window(s)", us, "us");
  }
  {
    // 64 sequences of 1024 rows, each with 4 checkpoints every 256 rows.
    const kda::Config ckpt = serving_config(1024, 256);
    Batch b;
    for (int s = 0; s < 64; ++s) {
      std::vector<int32_t> at;
      for (int j = 0; j < 4; ++j) at.push_back(512 + 4 * s + j);
      b.add(1024, s + 1, false, 256, at);
    }
    std::size_t windows = 0;
    const double us = stage_us(ckpt, b.view(true), 5000 / scale, &windows);
    row("begin_forward: validate + plan + stage", "64 sequences, 65536 tokens, 256 checkpoints, " +
                                                      std::to_string(windows) + " windows", us, "us");
  }
  {
    // The bucket-ladder tool over 100000 distinct batch sizes.
    kda::detail::TokenHistogram h;
    for (int64_t size = 1; size <= 100000; ++size)
      h.counts.emplace_back(size * 10, std::uniform_int_distribution<int64_t>(1, 1000)(rng));
    kda::detail::LadderLimits limits;
    const auto t0 = Clock::now();
    const auto ladder = kda::detail::propose_buckets(h, 64, limits);
    const auto t1 = Clock::now();
    limits.min_largest = 65536;
    const auto windowed = kda::detail::propose_buckets(h, 64, limits);
    const auto t2 = Clock::now();
    row("bucket_ladder: propose_buckets", "100000 sizes, " + std::to_string(ladder.size()) + " graphs, one top",
        std::chrono::duration<double, std::milli>(t1 - t0).count(), "ms");
    row("bucket_ladder: propose_buckets", "100000 sizes, " + std::to_string(windowed.size()) + " graphs, 32 tops",
        std::chrono::duration<double, std::milli>(t2 - t1).count(), "ms");
  }
  std::fputs(table.c_str(), stdout);
  if (out_path) {
    if (FILE* f = std::fopen(out_path, "w")) {
      std::fputs(table.c_str(), f);
      std::fclose(f);
    } else {
      std::fprintf(stderr, "bench_host: cannot write %s: %s\n", out_path, std::strerror(errno));
      return 1;
    }
  }
  return 0;
}
