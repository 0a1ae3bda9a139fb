// Sweep of the packed conv's launch shapes: kda::conv::launch_packed_conv with a forced
// ConvTuning (vec, chunk_len, warps_per_cta, chunks_per_cta) against the default launch and a
// device copy of the same bytes, at the seed scale (bench_util.h's seed_model(): part_dim
// 1536 x 3, in_proj row stride 4928, bf16, fp32 (lines, dim, 3) state, SiLU, no bias). It is
// the measurement behind the defaults of src/conv/packed_conv.h.
//
//   bench_conv_tunings [--quick] [--out FILE] [--help]
//
// For each batch shape it prints the copy time, the default launch, the best tuning and every
// tuning (mean GPU time per launch over back-to-back launches, buffer sets rotated so that L2
// holds none of them); with --out the whole report also goes to FILE. Every tuning's output
// and final state are compared bitwise with the default launch's from the same input and
// initial state. Exits 0 after --help, 2 without a usable GPU, 1 on a bad argument, when any
// tuning differs in a bit or on an error, else 0.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.h"
#include "conv/packed_conv.h"
#include "kda/config.h"
#include "kda/error.h"
#include "kda/packed_conv.h"
#include "runtime/random_weights.h"

namespace {

using kda::bench::DeviceMem;

const kda::ModelConfig kModel = kda::bench::seed_model();
const int64_t kPartDim = kModel.part_dim();
const int64_t kDim = 3 * kPartDim;
const int64_t kRowStride = kModel.in_proj_stride();
constexpr int64_t kStateLen = 3;
constexpr int64_t kRotateBytes = 256ll << 20;  // > 5 x the H200's 50 MB L2
constexpr uint64_t kSeed = 20240601;
constexpr uint64_t kTensorId = uint64_t{3} << 41;  // fills of this benchmark: ids from here

struct Shape {
  int64_t tokens, seqs;
};

// One set of device buffers for a shape, and the conv's arguments on it.
struct BufferSet {
  DeviceMem x, out, state, copy_dst;
  kda::PackedConvArgs args;
  BufferSet(int64_t tokens, int64_t lines)
      : x(static_cast<std::size_t>(tokens * kRowStride) * 2),
        out(static_cast<std::size_t>(tokens * kDim) * 2),
        state(static_cast<std::size_t>(lines * kDim * kStateLen) * 4),
        copy_dst(out.bytes()) {}
};

// A shape's buffers: the sets the timing rotates over (all with the same input), the initial
// state, and the default launch's output and final state on set 0.
struct Batch {
  int64_t tokens = 0, seqs = 0, lines = 0;
  DeviceMem weight, qsl, cache, flags, state0, ref_out, ref_state;
  std::vector<BufferSet> sets;

  explicit Batch(const Shape& shape)
      : tokens(shape.tokens),
        seqs(shape.seqs),
        lines(shape.seqs + 1),  // line 0 is the null line, sequence s uses line s + 1
        weight(static_cast<std::size_t>(kDim * 4) * 4),
        qsl(static_cast<std::size_t>(shape.seqs + 1) * 4),
        cache(static_cast<std::size_t>(shape.seqs) * 4),
        flags(static_cast<std::size_t>(shape.seqs)),
        state0(static_cast<std::size_t>(lines * kDim * kStateLen) * 4),
        ref_out(static_cast<std::size_t>(tokens * kDim) * 2),
        ref_state(state0.bytes()) {}
};

void make_batch(Batch& b) {
  // Equal-length sequences; every other one has an initial state.
  std::vector<int32_t> qsl(static_cast<std::size_t>(b.seqs + 1)), cache(static_cast<std::size_t>(b.seqs));
  std::vector<uint8_t> flags(static_cast<std::size_t>(b.seqs));
  for (int64_t s = 0; s <= b.seqs; ++s) qsl[static_cast<std::size_t>(s)] = static_cast<int32_t>(s * b.tokens / b.seqs);
  for (int64_t s = 0; s < b.seqs; ++s) {
    cache[static_cast<std::size_t>(s)] = static_cast<int32_t>(s + 1);
    flags[static_cast<std::size_t>(s)] = s % 2;
  }
  BENCH_CUDA(cudaMemcpy(b.qsl.get(), qsl.data(), b.qsl.bytes(), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(b.cache.get(), cache.data(), b.cache.bytes(), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(b.flags.get(), flags.data(), b.flags.bytes(), cudaMemcpyHostToDevice));
  kda::detail::fill_uniform(b.weight.get(), kda::DType::FP32, kDim * 4, kSeed, kTensorId, {-1.0f, 1.0f, false, 0.0f},
                            nullptr);
  kda::detail::fill_uniform(b.state0.get(), kda::DType::FP32, b.lines * kDim * kStateLen, kSeed, kTensorId + 1,
                            {-3.0f, 3.0f, false, 0.0f}, nullptr);

  const int64_t set_bytes = b.tokens * (kRowStride + kDim) * 2;
  const int64_t num_sets = std::max<int64_t>(1, (kRotateBytes + set_bytes - 1) / set_bytes);
  b.sets.reserve(static_cast<std::size_t>(num_sets));
  for (int64_t i = 0; i < num_sets; ++i) {
    b.sets.emplace_back(b.tokens, b.lines);
    BufferSet& s = b.sets.back();
    kda::detail::fill_uniform_bf16(s.x.get(), b.tokens * kRowStride, kSeed, kTensorId + 2, -3.0f, 3.0f, nullptr);
    BENCH_CUDA(cudaMemcpyAsync(s.state.get(), b.state0.get(), b.state0.bytes(), cudaMemcpyDeviceToDevice, nullptr));
    kda::PackedConvArgs& a = s.args;
    a.x = s.x.get();
    a.x_dtype = kda::DType::BF16;
    a.num_tokens = b.tokens;
    a.dim = kDim;
    a.x_row_stride = kRowStride;
    a.weight = b.weight.as<float>();
    a.conv_states = s.state.as<float>();
    a.varlen.cache_lines = b.lines;
    a.state_len = kStateLen;
    a.state_stride_line = kDim * kStateLen;
    a.state_stride_dim = kStateLen;
    a.state_stride_tap = 1;
    a.varlen.query_start_loc = b.qsl.as<int32_t>();
    a.varlen.num_seqs = b.seqs;
    a.varlen.cache_indices = b.cache.as<int32_t>();
    a.varlen.has_initial_state = b.flags.as<bool>();
    a.part_dim = kPartDim;
    a.silu = true;
    a.varlen.null_line = 0;
    a.out = s.out.get();
  }
  BENCH_CUDA(cudaDeviceSynchronize());
}

// Mean microseconds per launch(set) over `reps` back-to-back launches on the legacy stream,
// rotating over the sets, after one untimed launch per set.
template <typename Launch>
double time_us(Batch& b, int reps, Launch&& launch) {
  const int n = static_cast<int>(b.sets.size());
  return kda::bench::time_back_to_back_us(nullptr, n, reps,
                                          [&](int i) { launch(b.sets[static_cast<std::size_t>(i % n)]); });
}

// Runs tuning t on set 0 from the initial state, over an output filled with 0xFF bytes (so a
// row left unwritten cannot match).
void run_from_initial_state(Batch& b, const kda::conv::ConvTuning& t) {
  BufferSet& s = b.sets[0];
  BENCH_CUDA(cudaMemcpyAsync(s.state.get(), b.state0.get(), b.state0.bytes(), cudaMemcpyDeviceToDevice, nullptr));
  BENCH_CUDA(cudaMemsetAsync(s.out.get(), 0xFF, s.out.bytes(), nullptr));
  kda::conv::launch_packed_conv(s.args, t, nullptr);
  BENCH_CUDA(cudaDeviceSynchronize());
}

// Bits of set 0's output and final state after tuning t that differ from the default launch's.
uint64_t diff_bits_from_default(Batch& b, const kda::conv::ConvTuning& t) {
  run_from_initial_state(b, t);
  const BufferSet& s = b.sets[0];
  return kda::bench::diff_bits(s.out.get(), b.ref_out.get(), s.out.bytes(), nullptr) +
         kda::bench::diff_bits(s.state.get(), b.ref_state.get(), s.state.bytes(), nullptr);
}

// The sweep, around the default (vec 4, 16-token chunks): chunk programs per CTA x warps per
// CTA, the two knobs the defaults pick by capacity (default_chunks_per_cta,
// default_warps_per_cta); the chunk length at vec 4 (kDefaultChunkLen); then the vector width:
// vec 8 with 8-token chunks (its row queue's length) and vec 2. Tunings that check_tuning
// refuses for a shape are left out of its rows.
std::vector<kda::conv::ConvTuning> sweep() {
  std::vector<kda::conv::ConvTuning> tunings;
  for (int per_cta : {1, 2, 4, 8, 16})
    for (int warps : {1, 2, 4, 8}) tunings.push_back({4, 16, warps, per_cta});
  for (int chunk : {8, 32, 64, 128}) tunings.push_back({4, chunk, 4, 1});
  for (int per_cta : {2, 4, 8}) tunings.push_back({8, 8, 4, per_cta});
  for (int per_cta : {1, 2, 4}) tunings.push_back({2, 16, 4, per_cta});
  return tunings;
}

constexpr const char* kArgs = "[--quick] [--out FILE] [--help]";

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string out_path;
  for (int i = 1; i < argc; ++i) {
    if (kda::bench::is_help(argv[i])) {
      kda::bench::usage_exit(argv[0], kArgs);
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) {
      out_path = argv[++i];
    } else {
      kda::bench::usage_exit(argv[0], kArgs, argv[i]);
    }
  }
  const cudaDeviceProp prop = kda::bench::require_gpu("bench_conv_tunings");
  try {
    const std::vector<Shape> shapes = quick ? std::vector<Shape>{{2048, 1}, {16384, 256}}
                                            : std::vector<Shape>{{2048, 1},   {4096, 64},   {8192, 1},
                                                                 {16384, 1},  {16384, 256}, {65536, 4}};
    const int reps = quick ? 20 : 100;
    const std::vector<kda::conv::ConvTuning> tunings = sweep();
    // The summary rows go to stdout as each shape is done, every tuning's line to stderr as it
    // is measured, in case a run is cut short; the report collects both for --out.
    std::string report = "## bench_conv_tunings: packed conv launch shapes on " + std::string(prop.name) +
                         (quick ? " (--quick)" : "") + "\n\n";
    report += kda::bench::md_head({"tokens x seqs", "copy us", "default (vec/chunk/warps/per_cta) us", "x copy",
                                   "best us", "x copy", "best tuning"},
                                  "");
    std::fputs(report.c_str(), stdout);
    std::string details;
    bool mismatch = false;
    for (const Shape& shape : shapes) {
      Batch b(shape);
      make_batch(b);
      const double copy = time_us(b, reps, [&](BufferSet& s) {
        BENCH_CUDA(cudaMemcpy2DAsync(s.copy_dst.get(), kDim * 2, s.x.get(), kRowStride * 2, kDim * 2,
                                     static_cast<std::size_t>(b.tokens), cudaMemcpyDeviceToDevice, nullptr));
      });
      const kda::conv::PackedConvParams def = kda::conv::make_params(b.sets[0].args);
      const double def_us = time_us(b, reps, [&](BufferSet& s) { kda::packed_causal_conv1d(s.args, nullptr); });
      run_from_initial_state(b, {});
      BENCH_CUDA(cudaMemcpy(b.ref_out.get(), b.sets[0].out.get(), b.ref_out.bytes(), cudaMemcpyDeviceToDevice));
      BENCH_CUDA(cudaMemcpy(b.ref_state.get(), b.sets[0].state.get(), b.ref_state.bytes(), cudaMemcpyDeviceToDevice));
      double best = 1e30;
      kda::conv::ConvTuning best_t{};
      char line[256];
      for (const kda::conv::ConvTuning& t : tunings) {
        if (!kda::conv::check_tuning(b.sets[0].args, t).empty()) continue;
        const double us = time_us(b, reps, [&](BufferSet& s) { kda::conv::launch_packed_conv(s.args, t, nullptr); });
        const uint64_t bits = diff_bits_from_default(b, t);
        mismatch = mismatch || bits != 0;
        if (us < best) {
          best = us;
          best_t = t;
        }
        std::snprintf(line, sizeof line, "  %lld x %lld  vec %d chunk %3d warps %d per_cta %2d: %8.2f us (%.3f x copy)",
                      static_cast<long long>(shape.tokens), static_cast<long long>(shape.seqs), t.vec, t.chunk_len,
                      t.warps_per_cta, t.chunks_per_cta, us, us / copy);
        std::string entry = line;
        if (bits != 0) entry += "  DIFFERS FROM THE DEFAULT LAUNCH IN " + std::to_string(bits) + " BITS";
        entry += "\n";
        details += entry;
        std::fputs(entry.c_str(), stderr);
      }
      std::snprintf(line, sizeof line, "%.1f (%d/%d/%d/%d)", def_us, def.vec, 1 << def.chunk_shift, def.warps_per_cta,
                    def.chunks_per_cta);
      const std::string def_cell = line;
      std::snprintf(line, sizeof line, "vec %d chunk %d warps %d per_cta %d", best_t.vec, best_t.chunk_len,
                    best_t.warps_per_cta, best_t.chunks_per_cta);
      const std::string row = kda::bench::md_row(
          {std::to_string(shape.tokens) + " x " + std::to_string(shape.seqs), kda::bench::fixed(copy, 1), def_cell,
           kda::bench::fixed(def_us / copy, 3), kda::bench::fixed(best, 1), kda::bench::fixed(best / copy, 3), line});
      report += row;
      std::fputs(row.c_str(), stdout);
      std::fflush(stdout);
    }
    std::string tail = "\n`copy`: a 2D device copy of the tokens x 3 x part_dim bf16 values the conv reads (rows " +
                       std::to_string(kRowStride) + " apart) into dense rows; times are means over " +
                       std::to_string(reps) + " back-to-back launches.\n\nAll tunings:\n" + details;
    if (mismatch) tail += "\nFAILED: some tuning's output or state differs from the default launch\n";
    report += tail;
    std::fputs(tail.c_str(), stdout);
    if (!out_path.empty()) kda::bench::write_text(out_path, report);
    return mismatch ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_conv_tunings: %s\n", e.what());
    return 1;
  }
}
