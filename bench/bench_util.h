// What the bench/ programs share: the CUDA error check, device buffers, GPU timing with CUDA
// events, the GPU-presence check, the seed-scale layer shape and markdown output.
// Host C++ against the CUDA runtime API, so .cpp and .cu benchmarks include it alike.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/bit_compare.h"
#include "common/cuda_check.h"
#include "common/device_memory.h"
#include "kda/config.h"

namespace kda::bench {

// Throws kda::Error naming the failed call and CUDA's reason: the library's check.
#define BENCH_CUDA(expr) KDA_CUDA_CHECK("kda::bench", expr)

// Exit status of a benchmark that found no usable GPU (nothing was measured).
constexpr int kExitNoGpu = 2;

// True for --help and -h.
inline bool is_help(const char* arg) { return std::string(arg) == "--help" || std::string(arg) == "-h"; }

// Ends a benchmark's argument parsing with "usage: <argv0> <args>": for --help (`bad` null) on
// stdout with exit status 0, for a bad argument on stderr after naming it, exit status 1.
[[noreturn]] inline void usage_exit(const char* argv0, const char* args, const char* bad = nullptr) {
  if (bad) std::fprintf(stderr, "%s: bad argument \"%s\"\n", argv0, bad);
  std::fprintf(bad ? stderr : stdout, "usage: %s %s\n", argv0, args);
  std::exit(bad ? 1 : 0);
}

// The properties of device 0. Without a usable CUDA device: says so on stderr, naming
// `program`, and exits with kExitNoGpu.
inline cudaDeviceProp require_gpu(const char* program) {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  cudaDeviceProp prop{};
  if (err != cudaSuccess || devices == 0 || cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    std::fprintf(stderr, "%s: no CUDA device is usable (%s); this benchmark needs a GPU, nothing was measured.\n",
                 program, err != cudaSuccess ? cudaGetErrorString(err) : "no device");
    std::exit(kExitNoGpu);
  }
  return prop;
}

// Device memory: the library's RAII buffer (throws kda::Error when cudaMalloc fails).
using DeviceMem = kda::detail::DeviceBuffer;

// The median (of an even count, the upper of the two middle values); 0 for none.
inline double median_of(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timing {
  double median_us = 0, min_us = 0;
};

// GPU time of single launches: launch(i) for i in [0, warmup) untimed, then for i in
// [warmup, warmup + reps) each between its own pair of events on `stream`; launch(i) must
// enqueue its work on `stream`. One synchronisation at the end, so the launches queue back to
// back as in a real stream. reps >= 1.
template <typename Launch>
Timing time_each(cudaStream_t stream, int warmup, int reps, Launch&& launch) {
  for (int i = 0; i < warmup; ++i) launch(i);
  std::deque<kda::detail::Event> ev;  // Event does not move: a deque builds them in place
  for (int i = 0; i < 2 * reps; ++i) ev.emplace_back(kda::detail::Event::Timing::On);
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA(cudaEventRecord(ev[2 * i].get(), stream));
    launch(warmup + i);
    BENCH_CUDA(cudaEventRecord(ev[2 * i + 1].get(), stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> us(static_cast<std::size_t>(reps));
  for (int i = 0; i < reps; ++i) us[static_cast<std::size_t>(i)] = 1000.0 * ev[2 * i + 1].elapsed_ms_since(ev[2 * i]);
  Timing t;
  t.min_us = *std::min_element(us.begin(), us.end());
  t.median_us = median_of(std::move(us));
  return t;
}

// Mean GPU time per launch of a stream of launches: launch(i) for i in [0, warmup) untimed,
// then i in [warmup, warmup + reps) back to back between one pair of events on `stream` (no
// event between launches, so none of them waits for an event's completion). reps >= 1.
template <typename Launch>
double time_back_to_back_us(cudaStream_t stream, int warmup, int reps, Launch&& launch) {
  for (int i = 0; i < warmup; ++i) launch(i);
  const kda::detail::Event start(kda::detail::Event::Timing::On), stop(kda::detail::Event::Timing::On);
  BENCH_CUDA(cudaEventRecord(start.get(), stream));
  for (int i = 0; i < reps; ++i) launch(warmup + i);
  BENCH_CUDA(cudaEventRecord(stop.get(), stream));
  BENCH_CUDA(cudaEventSynchronize(stop.get()));
  return 1000.0 * stop.elapsed_ms_since(start) / reps;
}

// Bits in which `bytes` bytes of device memory at a and b differ (common/bit_compare.h's count,
// on host copies): 0 when the two are bitwise equal. Synchronises `stream`.
inline uint64_t diff_bits(const void* a, const void* b, std::size_t bytes, cudaStream_t stream) {
  std::vector<unsigned char> ha(bytes), hb(bytes);
  BENCH_CUDA(cudaMemcpyAsync(ha.data(), a, bytes, cudaMemcpyDeviceToHost, stream));
  BENCH_CUDA(cudaMemcpyAsync(hb.data(), b, bytes, cudaMemcpyDeviceToHost, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  return static_cast<uint64_t>(kda::detail::diff_bits(ha.data(), hb.data(), bytes));
}

// The layer of configs/default.yaml, the benchmarks' seed scale: D 7168, H 12, K = V 128,
// r 128, so part_dim P 1536, W_in = 3P + H + 2r = 4876 and the in_proj row stride 4928.
inline kda::ModelConfig seed_model() {
  kda::ModelConfig m;
  m.hidden_size = 7168;
  m.num_heads = 12;
  m.head_dim = 128;
  m.gate_rank = 128;
  return m;
}

// Markdown output.

// v with `digits` decimals.
inline std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// "| a | b |\n".
inline std::string md_row(const std::vector<std::string>& cells) {
  std::string s = "|";
  for (const std::string& c : cells) s += " " + c + " |";
  return s + "\n";
}

// A table's header row and its separator row; column i is right-aligned ("---:") when align[i]
// is 'r', else left ("---").
inline std::string md_head(const std::vector<std::string>& names, const std::string& align) {
  std::vector<std::string> seps;
  for (std::size_t i = 0; i < names.size(); ++i) seps.push_back(i < align.size() && align[i] == 'r' ? "---:" : "---");
  return md_row(names) + md_row(seps);
}

// Writes text to the file at path; throws std::runtime_error when it cannot.
inline void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  if (!f) throw std::runtime_error("cannot write " + path);
}

// Prints text on stdout and, when path is not empty, writes it to that file (write_text).
inline void emit(const std::string& text, const std::string& path) {
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
  if (!path.empty()) write_text(path, text);
}

}  // namespace kda::bench
