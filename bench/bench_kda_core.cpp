// Benchmark of the KDA core (spec steps 4 and 5: prep + gated delta rule): the token-by-token
// kernel kda_recurrence_token against the chunked tensor-core op kda_chunked, and the chunked
// op's two phases alone (KdaChunkedPhases::PrepOnly, then StateOnly on the records the
// PrepOnly launches wrote), on the shapes of docs/perf.md's KDA core table.
//
//   bench_kda_core [--quick] [--case TEXT] [--reps N] [--out FILE] [--help]
//
// --case keeps the cases whose name contains TEXT (e.g. "H 4,").
//
// GPU time per launch from CUDA events, median of N (default 30, at least 20) launches after
// warm-up. Reports the tensor-core work the chunked kernels issue (mma.sync m16n8k16 count x
// 4096 flop) against the H200's measured bf16 dense ceiling (~790 TFLOP/s) and the compulsory
// DRAM bytes against its copy bandwidth (~4.3 TB/s). Prints a markdown table (and writes it to
// FILE with --out). Exits 0 after --help, 2 without a usable GPU, 1 on a bad argument or an
// error, else 0.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.h"
#include "kda/config.h"
#include "kda/error.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_recurrence.h"
#include "recurrence/kda_recurrence_token.h"
#include "runtime/random_weights.h"

namespace {

using kda::bench::DeviceMem;
using kda::bench::fixed;

constexpr int64_t kD = 128;
constexpr double kPeakTflops = 790.0;  // H200 bf16 dense, measured
constexpr double kPeakTBps = 4.3;      // H200 device copy, measured
// Tensor-core work of the chunked kernels per (chunk, head), in bf16 m16n8k16 equivalents (4096
// flop): phase 1 runs 6 off-diagonal 16 x 16 blocks x 32 mma; phase 2 8 value-row groups x
// (64 U + 64 + 20 O bf16 mma + 64 fp16 m16n8k16 for the state update).
constexpr double kMmaFlop = 2.0 * 16 * 8 * 16;
constexpr double kPrepMmaPerChunk = 6 * 32;
constexpr double kStateMmaPerChunk = 8 * 212;
constexpr int64_t kRecordBytes = 90624;  // workspace record per (chunk slot, head)

struct Case {
  std::string name;
  int64_t heads;
  std::vector<int32_t> lengths;
};

// Median GPU time (us) of `reps` launches of launch(), each between its own events on
// `stream`, after `warmup` untimed ones.
template <typename Launch>
double median_us(Launch&& launch, cudaStream_t stream, int warmup, int reps) {
  return kda::bench::time_each(stream, warmup, reps, [&](int) { launch(); }).median_us;
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
  kda::ModelConfig model;  // the in_proj row layout of a layer with these heads: b at column 3 * part
  model.num_heads = heads;
  model.head_dim = kD;
  const int64_t in_proj_stride = model.in_proj_stride();

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

  kda::RecurrenceArgs a;
  a.num_heads = heads;
  a.num_tokens = tokens;
  a.varlen.num_seqs = seqs;
  a.varlen.query_start_loc = d_qsl.as<int32_t>();
  a.varlen.cache_indices = d_lines.as<int32_t>();
  a.varlen.has_initial_state = d_init.as<bool>();
  a.varlen.null_line = 0;
  a.q = q.get();
  a.k = k.get();
  a.v = v.get();
  a.qkv_row_stride = part;
  a.g1 = g1.get();
  a.g1_row_stride = part;
  a.b = x.get();
  a.b_row_stride = in_proj_stride;
  a.b_col_offset = 3 * part;
  a.a_log = a_log.as<float>();
  a.dt_bias = dt_bias.as<float>();
  a.states = pool.get();
  a.state_dtype = kda::DType::FP32;  // state_bytes below counts 4-byte elements
  a.varlen.cache_lines = seqs + 1;
  a.state_stride_line = heads * kD * kD;
  a.state_stride_head = kD * kD;
  a.state_stride_k = kD;
  a.state_stride_v = 1;
  a.o = o.get();
  a.o_row_stride = part;
  kda::RecurrenceArgs whole = a;  // the same op with every sequence walked whole
  whole.segment_tokens = 0;
  const bool cut = kda::kda_chunked_workspace_bytes(a) > kda::kda_chunked_workspace_bytes(whole);
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
  const auto chunked = [&](kda::KdaChunkedPhases phases) {
    return [&, phases] { kda::kda_chunked(a, work.get(), work.bytes(), stream, phases); };
  };
  rows.push_back({cs.name, "kda_recurrence_token (token by token)",
                  median_us([&] { kda::kda_recurrence_token(a, stream); }, stream, warmup, reps), 0.0,
                  4 * plane_bytes + b_bytes + state_bytes + plane_bytes});
  rows.push_back({cs.name, "kda_chunked", median_us(chunked(kda::KdaChunkedPhases::Both), stream, warmup, reps),
                  prep_flop + state_flop, 4 * plane_bytes + b_bytes + 2 * record_bytes + state_bytes + plane_bytes});
  rows.push_back({cs.name, "  phase 1 (prep, records)",
                  median_us(chunked(kda::KdaChunkedPhases::PrepOnly), stream, warmup, reps), prep_flop,
                  4 * plane_bytes + b_bytes + record_bytes});
  // On the records of the phase-1 launches above.
  rows.push_back({cs.name, cut ? "  phase 2 (state, o), cut into segments" : "  phase 2 (state, o)",
                  median_us(chunked(kda::KdaChunkedPhases::StateOnly), stream, warmup, reps), state_flop,
                  record_bytes + state_bytes + plane_bytes});
  if (cut) {
    // Side by side: phase 2 with every sequence whole, on the same records.
    rows.push_back({cs.name, "  phase 2, sequences whole",
                    median_us([&] { kda::kda_chunked(whole, work.get(), work.bytes(), stream,
                                                     kda::KdaChunkedPhases::StateOnly); },
                              stream, warmup, reps),
                    state_flop, record_bytes + state_bytes + plane_bytes});
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int reps = 30;
  std::string out_path, only;
  constexpr const char* kArgs = "[--quick] [--case TEXT] [--reps N (>= 20)] [--out FILE] [--help]";
  for (int i = 1; i < argc; ++i) {
    if (kda::bench::is_help(argv[i])) {
      kda::bench::usage_exit(argv[0], kArgs);
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::max(20, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) {
      out_path = argv[++i];
    } else if (std::strcmp(argv[i], "--case") == 0 && i + 1 < argc) {
      only = argv[++i];
    } else {
      kda::bench::usage_exit(argv[0], kArgs, argv[i]);
    }
  }
  const cudaDeviceProp prop = kda::bench::require_gpu("bench_kda_core");
  std::vector<Case> cases;
  cases.push_back({"H 12, 1 x 16384", 12, {16384}});
  cases.push_back({"H 12, 16 x 1024", 12, std::vector<int32_t>(16, 1024)});
  cases.push_back({"H 32, 4 x 512", 32, std::vector<int32_t>(4, 512)});
  if (!quick) {
    cases.push_back({"H 12, 4 x 512", 12, std::vector<int32_t>(4, 512)});
    cases.push_back({"H 32, 1 x 16384", 32, {16384}});
    cases.push_back({"H 4, 1 x 65536", 4, {65536}});
    cases.push_back({"H 96, 1 x 8192", 96, {8192}});
    cases.push_back({"H 32, 16 x 1024", 32, std::vector<int32_t>(16, 1024)});
    for (int64_t heads : {16, 32}) {
      const std::string h = "H " + std::to_string(heads);
      cases.push_back({h + ", 8 x 2048", heads, std::vector<int32_t>(8, 2048)});
      cases.push_back({h + ", 64 x 256", heads, std::vector<int32_t>(64, 256)});
    }
  }
  if (!only.empty())
    cases.erase(std::remove_if(cases.begin(), cases.end(),
                               [&](const Case& c) { return c.name.find(only) == std::string::npos; }),
                cases.end());
  try {
    cudaStream_t stream = nullptr;
    BENCH_CUDA(cudaStreamCreate(&stream));
    std::ostringstream table;
    table << "KDA core (prep + gated delta rule) on " << prop.name << ", median of " << reps
          << " launches (CUDA events)\n\n"
          << kda::bench::md_head({"case", "kernel", "GPU us", "tensor TFLOP/s", "% of " + fixed(kPeakTflops, 0),
                                  "DRAM GB/s", "% of " + fixed(kPeakTBps, 1) + " TB/s", "vs token by token"},
                                 "llrrrrrr");
    for (const Case& cs : cases) {
      const std::vector<Row> rows = run_case(cs, stream, reps);
      const double simple_us = rows.front().us;
      for (const Row& r : rows) {
        const double tflops = r.tflop / (r.us * 1e-6) / 1e12;
        const double gbps = r.bytes / (r.us * 1e-6) / 1e9;
        table << kda::bench::md_row({r.case_name, r.kernel, fixed(r.us, 1), r.tflop > 0 ? fixed(tflops, 1) : "-",
                                     r.tflop > 0 ? fixed(100.0 * tflops / kPeakTflops, 1) : "-", fixed(gbps, 0),
                                     fixed(100.0 * gbps / (kPeakTBps * 1000.0), 1), fixed(simple_us / r.us, 2) + "x"});
      }
    }
    table << "\nTensor work is the flop of the issued mma.sync (bf16 m16n8k16 and, for the state "
             "update, fp16 m16n8k16): 0.79 Mflop in phase 1 and 6.9 Mflop in phase 2 per (64-token "
             "chunk, head); the bf16 ceiling is quoted. DRAM bytes are "
             "compulsory traffic: planes, b, states, o, and the 90624-byte chunk records written "
             "by phase 1 and read once by phase 2 (the value slices of a head re-read the shared "
             "tiles from L2).\n";
    kda::bench::emit(table.str(), out_path);
    cudaStreamDestroy(stream);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_kda_core: %s\n", e.what());
    return 1;
  }
  return 0;
}
