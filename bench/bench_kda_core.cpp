// Benchmark of the KDA core (spec steps 4 and 5: prep + gated delta rule): the token-by-token
// kernel kda_prep_recurrence against the chunked tensor-core kernel kda_chunked, and the
// chunked kernel's two phases alone, phase 2 once per state kernel (KdaStateKernel: KSplit,
// Unsplit, Original and Specialized, the default, a row each, on the same records), on the
// shapes of docs/perf-notes-kda-core.md.
//
//   bench_kda_core [--quick] [--reps N] [--out FILE]
//
// GPU time per launch from CUDA events, median of N (default 30, at least 20) launches after
// warm-up. Reports the tensor-core work the chunked kernel issues (mma.sync m16n8k16 count x
// 4096 flop) against the H200's measured bf16 dense ceiling (~790 TFLOP/s) and the compulsory
// DRAM bytes against its copy bandwidth (~4.3 TB/s). Prints a markdown table (and writes it to
// FILE with --out). Exits 2 without a usable GPU, 1 on an error, else 0.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kda/error.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_recurrence.h"
#include "runtime/random_weights.h"

namespace {

constexpr int64_t kD = 128;
constexpr double kPeakTflops = 790.0;  // H200 bf16 dense, measured
constexpr double kPeakTBps = 4.3;      // H200 device copy, measured
// Tensor-core work of the chunked kernel per (chunk, head), in bf16 m16n8k16 equivalents (4096
// flop): phase 1 runs 6 off-diagonal 16 x 16 blocks x 32 mma; phase 2 8 warps x (64 U + 64 + 20
// O bf16 mma + 64 fp16 m16n8k16 for the state update), the
// same for every state kernel (KSplit deals each 16 value rows' mma to two warps).
constexpr double kMmaFlop = 2.0 * 16 * 8 * 16;
constexpr double kPrepMmaPerChunk = 6 * 32;
constexpr double kStateMmaPerChunk = 8 * 212;
constexpr int64_t kRecordBytes = 90624;  // workspace record per (chunk slot, head)

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(e));
}
#define BENCH_CUDA(expr) cuda_ok((expr), #expr)

class DeviceMem {
 public:
  explicit DeviceMem(std::size_t bytes) : bytes_(bytes) {
    if (bytes_) BENCH_CUDA(cudaMalloc(&ptr_, bytes_));
  }
  ~DeviceMem() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  template <typename T = void>
  T* get() const { return static_cast<T*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

struct Case {
  std::string name;
  int64_t heads;
  std::vector<int32_t> lengths;
};

// Median GPU time (us) of `reps` launches of `launch`, each bracketed by its own events,
// after `warmup` untimed ones.
double median_us(const std::function<void(cudaStream_t)>& launch, cudaStream_t stream, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) launch(stream);
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(reps));
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA(cudaEventRecord(ev[2 * i], stream));
    launch(stream);
    BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> us(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us[static_cast<size_t>(i)] = 1000.0 * ms;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

struct Row {
  std::string case_name, kernel;
  double us = 0, tflop = 0, bytes = 0;
};

std::vector<Row> run_case(const Case& cs, cudaStream_t stream, int reps) {
  const int64_t heads = cs.heads, part = heads * kD;
  std::vector<int32_t> qsl{0};
  for (int32_t n : cs.lengths) qsl.push_back(qsl.back() + n);
  const int64_t tokens = qsl.back(), seqs = static_cast<int64_t>(cs.lengths.size());
  std::vector<int32_t> lines(static_cast<size_t>(seqs));
  for (int64_t s = 0; s < seqs; ++s) lines[static_cast<size_t>(s)] = static_cast<int32_t>(s + 1);
  std::vector<char> initial(static_cast<size_t>(seqs), 1);
  const int64_t in_proj_stride = (3 * part + heads + 256 + 63) / 64 * 64;

  DeviceMem q(tokens * part * 2), k(tokens * part * 2), v(tokens * part * 2), g1(tokens * part * 2);
  DeviceMem x(tokens * in_proj_stride * 2), a_log(heads * 4), dt_bias(part * 4), o(tokens * part * 2);
  DeviceMem pool((seqs + 1) * heads * kD * kD * 4), d_qsl(qsl.size() * 4), d_lines(lines.size() * 4),
      d_init(initial.size());
  using kda::detail::fill_uniform;
  using kda::detail::fill_uniform_bf16;
  const uint64_t seed = 20240601;
  const uint64_t id = uint64_t{1} << 41;
  fill_uniform_bf16(q.get(), tokens * part, seed, id + 0, -1.0f, 1.0f, stream);
  fill_uniform_bf16(k.get(), tokens * part, seed, id + 1, -1.0f, 1.0f, stream);
  fill_uniform_bf16(v.get(), tokens * part, seed, id + 2, -1.0f, 1.0f, stream);
  fill_uniform_bf16(g1.get(), tokens * part, seed, id + 3, -1.5f, 1.5f, stream);
  fill_uniform_bf16(x.get(), tokens * in_proj_stride, seed, id + 4, -3.0f, 3.0f, stream);
  fill_uniform(a_log.get(), kda::DType::FP32, heads, seed, id + 5, {-1.0f, 1.0f, false, 0.0f}, stream);
  fill_uniform(dt_bias.get(), kda::DType::FP32, part, seed, id + 6, {-4.0f, 0.0f, false, 0.0f}, stream);
  fill_uniform(pool.get(), kda::DType::FP32, (seqs + 1) * heads * kD * kD, seed, id + 7,
               {-0.3f, 0.3f, false, 0.0f}, stream);
  BENCH_CUDA(cudaMemcpy(d_qsl.get(), qsl.data(), qsl.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(d_lines.get(), lines.data(), lines.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(d_init.get(), initial.data(), initial.size(), cudaMemcpyHostToDevice));

  kda::PrepRecurrenceArgs a;
  a.num_heads = heads;
  a.num_tokens = tokens;
  a.max_seqs = seqs;
  a.query_start_loc = d_qsl.get<int32_t>();
  a.cache_indices = d_lines.get<int32_t>();
  a.has_initial_state = d_init.get<bool>();
  a.null_line = 0;
  a.q = q.get();
  a.k = k.get();
  a.v = v.get();
  a.qkv_row_stride = part;
  a.g1 = g1.get();
  a.g1_row_stride = part;
  a.b = x.get();
  a.b_row_stride = in_proj_stride;
  a.b_col_offset = 3 * part;
  a.a_log = a_log.get<float>();
  a.dt_bias = dt_bias.get<float>();
  a.states = pool.get<float>();
  a.cache_lines = seqs + 1;
  a.state_stride_line = heads * kD * kD;
  a.state_stride_head = kD * kD;
  a.state_stride_k = kD;
  a.state_stride_v = 1;
  a.o = o.get();
  a.o_row_stride = part;
  DeviceMem work(kda::kda_chunked_workspace_bytes(a));

  int64_t chunks = 0;
  for (int32_t n : cs.lengths) chunks += (n + kda::kKdaChunk - 1) / kda::kKdaChunk;
  const double chunk_heads = static_cast<double>(chunks * heads);
  const double plane_bytes = 2.0 * tokens * part;
  const double b_bytes = 2.0 * tokens * heads;
  const double state_bytes = 2.0 * seqs * heads * kD * kD * 4;  // read + write
  const double record_bytes = chunk_heads * kRecordBytes;
  const double prep_flop = chunk_heads * kPrepMmaPerChunk * kMmaFlop;
  const double state_flop = chunk_heads * kStateMmaPerChunk * kMmaFlop;

  std::vector<Row> rows;
  const int warmup = 3;
  rows.push_back({cs.name, "kda_prep_recurrence (token by token)",
                  median_us([&](cudaStream_t s) { kda::kda_prep_recurrence(a, s); }, stream, warmup, reps), 0.0,
                  4 * plane_bytes + b_bytes + state_bytes + plane_bytes});
  rows.push_back({cs.name, "kda_chunked (default: Specialized)",
                  median_us([&](cudaStream_t s) { kda::kda_chunked(a, work.get(), work.bytes(), s); }, stream,
                            warmup, reps),
                  prep_flop + state_flop, 4 * plane_bytes + b_bytes + 2 * record_bytes + state_bytes + plane_bytes});
  rows.push_back({cs.name, "  phase 1 (prep, records)",
                  median_us([&](cudaStream_t s) {
                    kda::kda_chunked(a, work.get(), work.bytes(), s, kda::KdaChunkedPhases::PrepOnly);
                  }, stream, warmup, reps),
                  prep_flop, 4 * plane_bytes + b_bytes + record_bytes});
  // Phase 2 per state kernel, on the records of the phase-1 launches above.
  const std::pair<kda::KdaStateKernel, const char*> state_kernels[] = {
      {kda::KdaStateKernel::KSplit, "  phase 2 (state, o): KSplit"},
      {kda::KdaStateKernel::Unsplit, "  phase 2 (state, o): Unsplit"},
      {kda::KdaStateKernel::Original, "  phase 2 (state, o): Original"},
      {kda::KdaStateKernel::Specialized, "  phase 2 (state, o): Specialized (default)"},
  };
  for (const auto& [kernel, label] : state_kernels)
    rows.push_back({cs.name, label,
                    median_us([&, kernel = kernel](cudaStream_t s) {
                      kda::kda_chunked(a, work.get(), work.bytes(), s, kda::KdaChunkedPhases::StateOnly, kernel);
                    }, stream, warmup, reps),
                    state_flop, record_bytes + state_bytes + plane_bytes});
  BENCH_CUDA(cudaStreamSynchronize(stream));
  return rows;
}

std::string fmt(double x, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int reps = 30;
  std::string out_path;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::max(20, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) {
      out_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--reps N (>= 20)] [--out FILE]\n", argv[0]);
      return 1;
    }
  }
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("No CUDA device is usable (%s), so there is nothing to benchmark.\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "no device");
    return 2;
  }
  std::vector<Case> cases;
  cases.push_back({"H 12, 1 x 16384", 12, {16384}});
  cases.push_back({"H 12, 16 x 1024", 12, std::vector<int32_t>(16, 1024)});
  cases.push_back({"H 32, 4 x 512", 32, std::vector<int32_t>(4, 512)});
  if (!quick) {
    cases.push_back({"H 12, 4 x 512", 12, std::vector<int32_t>(4, 512)});
    cases.push_back({"H 32, 1 x 16384", 32, {16384}});
  }
  try {
    cudaDeviceProp prop{};
    BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t stream = nullptr;
    BENCH_CUDA(cudaStreamCreate(&stream));
    std::ostringstream table;
    table << "KDA core (prep + gated delta rule) on " << prop.name << ", median of " << reps
          << " launches (CUDA events)\n\n"
          << "| case | kernel | GPU us | tensor TFLOP/s | % of " << kPeakTflops << " | DRAM GB/s | % of "
          << kPeakTBps << " TB/s | vs token by token |\n"
          << "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n";
    for (const Case& cs : cases) {
      const std::vector<Row> rows = run_case(cs, stream, reps);
      const double simple_us = rows.front().us;
      for (const Row& r : rows) {
        const double tflops = r.tflop / (r.us * 1e-6) / 1e12;
        const double gbps = r.bytes / (r.us * 1e-6) / 1e9;
        table << "| " << r.case_name << " | " << r.kernel << " | " << fmt(r.us, 1) << " | "
              << (r.tflop > 0 ? fmt(tflops, 1) : "-") << " | "
              << (r.tflop > 0 ? fmt(100.0 * tflops / kPeakTflops, 1) : "-") << " | " << fmt(gbps, 0) << " | "
              << fmt(100.0 * gbps / (kPeakTBps * 1000.0), 1) << " | " << fmt(simple_us / r.us, 2) << "x |\n";
      }
    }
    table << "\nTensor work is the flop of the issued mma.sync (bf16 m16n8k16 and, for the state "
             "update, fp16 m16n8k16): 0.79 Mflop in phase 1 and 6.9 Mflop in phase 2 per (64-token "
             "chunk, head); the bf16 ceiling is quoted. DRAM bytes are "
             "compulsory traffic: planes, b, states, o, and the 90624-byte chunk records written "
             "by phase 1 and read once by phase 2 (the 4 value slices of a head re-read the shared "
             "tiles from L2).\n";
    std::fputs(table.str().c_str(), stdout);
    if (!out_path.empty()) {
      std::ofstream f(out_path);
      if (!f) throw std::runtime_error("cannot write " + out_path);
      f << table.str();
    }
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_kda_core: %s\n", e.what());
    return 1;
  }
  return 0;
}
