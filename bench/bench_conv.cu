// Benchmark of the packed Q|K|V conv against the stock-path baseline and a device copy of
// the same bytes, at the KDA seed scale (bench_util.h's seed_model(): part_dim 1536 x 3, in_proj
// row stride 4928).
//
//   bench_conv [--quick] [--case TOKENSxSEQS] [--out FILE] [--help]
//
// Prints a markdown table (and writes it to FILE with --out). Exits 0 after --help, 2 without a
// usable GPU, 1 on a bad argument, on an error or when the packed and stock outputs differ on the
// benchmarked data, else 0 (a missed target is reported in the table, not in the exit code).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.h"
#include "conv/stock_conv.h"
#include "kda/config.h"
#include "kda/error.h"
#include "kda/packed_conv.h"
#include "runtime/random_weights.h"

namespace {

using kda::bench::DeviceMem;
using kda::bench::fixed;

const kda::ModelConfig kModel = kda::bench::seed_model();
constexpr int64_t kParts = 3;
const int64_t kPartDim = kModel.part_dim();
const int64_t kDim = kPartDim * kParts;
const int64_t kRowStride = kModel.in_proj_stride();  // the in_proj output row: Q|K|V|b|f_a|g_a, padded
constexpr int64_t kStateLen = 3;
constexpr uint64_t kSeed = 20240601;
constexpr uint64_t kTensorId = uint64_t{1} << 42;  // fills of this benchmark: ids from here

struct Case {
  int64_t tokens, seqs;
  double stock_spec_us;  // the real stock path on one H200 (stock-conv.md), for orientation
};

// Target for packed / copy, or 0 where none is set.
double copy_ratio_target(const Case& c) {
  if (c.tokens == 16384 && c.seqs == 256) return 1.15;
  if (c.tokens >= 8192) return 1.10;
  if (c.tokens == 2048) return 1.30;
  return 0.0;
}

// Target for stock / packed, or 0 where none is set.
double stock_ratio_target(const Case& c) { return c.tokens == 16384 ? 6.5 : 0.0; }

// One input/output/state set; the benchmark rotates over several so that the data of one
// launch is no longer in L2 when its set comes round again.
struct BufferSet {
  DeviceMem x, out, states;
  BufferSet(int64_t tokens, int64_t lines)
      : x(static_cast<std::size_t>(tokens * kRowStride) * 2),
        out(static_cast<std::size_t>(tokens * kDim) * 2),
        states(static_cast<std::size_t>(lines * kDim * kStateLen) * 4) {}
};

struct Row {
  Case c;
  int sets = 0;
  double packed_us = 0, stock_us = 0, copy_us = 0;
  uint64_t out_diff_bits = 0, state_diff_bits = 0;
};

Row run_case(const Case& c, const cudaDeviceProp& prop, bool quick, cudaStream_t stream) {
  Row row;
  row.c = c;
  const int64_t lines = c.seqs + 1;  // line 0 is the null line, sequence s uses line s + 1
  const std::size_t set_bytes = static_cast<std::size_t>(c.tokens) * (kRowStride + kDim) * 2 +
                                static_cast<std::size_t>(lines * kDim * kStateLen) * 4;
  const std::size_t l2 = std::max<std::size_t>(static_cast<std::size_t>(prop.l2CacheSize), 60u << 20);
  row.sets = static_cast<int>(std::min<std::size_t>(std::max<std::size_t>((4 * l2 + set_bytes - 1) / set_bytes, 2), 64));

  std::vector<BufferSet> sets;
  sets.reserve(static_cast<std::size_t>(row.sets));
  for (int i = 0; i < row.sets; ++i) sets.emplace_back(c.tokens, lines);
  DeviceMem weight(static_cast<std::size_t>(kDim * 4) * 4);
  DeviceMem pristine_states(sets[0].states.bytes());
  kda::detail::fill_uniform(weight.get(), kda::DType::FP32, kDim * 4, kSeed, kTensorId, {-1.0f, 1.0f, false, 0.0f},
                            stream);
  kda::detail::fill_uniform(pristine_states.get(), kda::DType::FP32, lines * kDim * kStateLen, kSeed, kTensorId + 1,
                            {-3.0f, 3.0f, false, 0.0f}, stream);
  for (int i = 0; i < row.sets; ++i) {
    BufferSet& s = sets[static_cast<std::size_t>(i)];
    kda::detail::fill_uniform_bf16(s.x.get(), c.tokens * kRowStride, kSeed, kTensorId + 2 + static_cast<uint64_t>(i),
                                   -3.0f, 3.0f, stream);
    BENCH_CUDA(cudaMemcpyAsync(s.states.get(), pristine_states.get(), pristine_states.bytes(), cudaMemcpyDeviceToDevice,
                               stream));
  }

  // Equal-length sequences, every one with an initial state.
  const int64_t len = c.tokens / c.seqs;
  std::vector<int32_t> qsl(static_cast<std::size_t>(c.seqs + 1)), cache(static_cast<std::size_t>(c.seqs));
  for (int64_t s = 0; s <= c.seqs; ++s) qsl[static_cast<std::size_t>(s)] = static_cast<int32_t>(s * len);
  for (int64_t s = 0; s < c.seqs; ++s) cache[static_cast<std::size_t>(s)] = static_cast<int32_t>(s + 1);
  std::vector<unsigned char> init(static_cast<std::size_t>(c.seqs), 1);
  DeviceMem d_qsl(qsl.size() * 4), d_cache(cache.size() * 4), d_init(init.size());
  BENCH_CUDA(cudaMemcpy(d_qsl.get(), qsl.data(), d_qsl.bytes(), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(d_cache.get(), cache.data(), d_cache.bytes(), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(d_init.get(), init.data(), d_init.bytes(), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaStreamSynchronize(stream));  // the host vectors above are copied synchronously, the fills are not

  auto args_for = [&](const BufferSet& in, BufferSet& out) {
    kda::PackedConvArgs a;
    a.x = in.x.get();
    a.x_dtype = kda::DType::BF16;
    a.num_tokens = c.tokens;
    a.dim = kDim;
    a.x_row_stride = kRowStride;
    a.weight = weight.as<float>();
    a.bias = nullptr;
    a.conv_states = out.states.as<float>();
    a.varlen.cache_lines = lines;
    a.state_len = kStateLen;
    // vLLM keeps the pool as (lines, 3, dim) and hands the conv its (lines, dim, 3) transpose.
    a.state_stride_line = kDim * kStateLen;
    a.state_stride_dim = 1;
    a.state_stride_tap = kDim;
    a.varlen.query_start_loc = d_qsl.as<int32_t>();
    a.varlen.num_seqs = c.seqs;
    a.varlen.cache_indices = d_cache.as<int32_t>();
    a.varlen.has_initial_state = d_init.as<bool>();
    a.part_dim = kPartDim;
    a.silu = true;
    a.varlen.null_line = 0;
    a.out = out.out.get();
    return a;
  };
  std::vector<kda::PackedConvArgs> args;
  for (BufferSet& s : sets) args.push_back(args_for(s, s));
  const std::size_t ws_bytes = kda::baseline::stock_causal_conv1d_workspace_bytes(args[0]);
  DeviceMem workspace(ws_bytes);

  // Bitwise sanity check on set 0's input: packed into set 0, stock into set 1.
  {
    for (int i : {0, 1}) {
      BufferSet& s = sets[static_cast<std::size_t>(i)];
      BENCH_CUDA(cudaMemsetAsync(s.out.get(), 0xFF, s.out.bytes(), stream));
      BENCH_CUDA(cudaMemcpyAsync(s.states.get(), pristine_states.get(), pristine_states.bytes(),
                                 cudaMemcpyDeviceToDevice, stream));
    }
    kda::packed_causal_conv1d(args[0], stream);
    kda::baseline::stock_causal_conv1d(args_for(sets[0], sets[1]), workspace.get(), ws_bytes, stream);
    row.out_diff_bits = kda::bench::diff_bits(sets[0].out.get(), sets[1].out.get(), sets[0].out.bytes(), stream);
    row.state_diff_bits =
        kda::bench::diff_bits(sets[0].states.get(), sets[1].states.get(), sets[0].states.bytes(), stream);
  }

  const int warmup = quick ? 3 : 20;
  const int iters = quick ? 15 : (c.tokens >= 65536 ? 60 : 200);
  const auto median_us = [&](auto&& launch) {
    return kda::bench::time_each(stream, warmup, iters, [&](int i) { launch(i % row.sets); }).median_us;
  };
  row.packed_us = median_us([&](int i) { kda::packed_causal_conv1d(args[static_cast<std::size_t>(i)], stream); });
  row.stock_us = median_us([&](int i) {
    kda::baseline::stock_causal_conv1d(args[static_cast<std::size_t>(i)], workspace.get(), ws_bytes, stream);
  });
  const std::size_t copy_bytes = static_cast<std::size_t>(c.tokens * kDim) * 2;
  row.copy_us = median_us([&](int i) {
    BufferSet& s = sets[static_cast<std::size_t>(i)];
    BENCH_CUDA(cudaMemcpyAsync(s.out.get(), s.x.get(), copy_bytes, cudaMemcpyDeviceToDevice, stream));
  });
  return row;
}

std::string verdict(double value, double target, bool at_most) {
  if (target == 0.0) return "-";
  return (at_most ? value <= target : value >= target) ? "pass" : "MISS";
}

std::string table(const std::vector<Row>& rows, const cudaDeviceProp& prop, bool quick) {
  std::ostringstream os;
  os << "## bench_conv: packed Q|K|V conv vs the stock path on " << prop.name << (quick ? " (--quick)" : "") << "\n\n"
     << "part_dim " << kPartDim << " x " << kParts << " parts, x bf16 with row stride " << kRowStride
     << ", fp32 weights and conv state ((lines, dim, 3) view of a (lines, 3, dim) pool), no bias, SiLU; "
     << "sequences of equal length, all with an initial state. Times are medians over launches timed with CUDA "
     << "events after warm-up, rotating over `sets` buffer sets (> 4x L2 in total). `copy` is a device-to-device "
     << "cudaMemcpyAsync of tokens x 3 x part_dim x 2 bytes, what the packed kernel reads and writes; GB/s "
     << "counts read + write. `stock` is this project's stock-path baseline (per plane: cast to fp32, fp32 conv "
     << "+ state update, cast back); `vLLM stock` is the real stock path measured on an H200 (stock-conv.md). "
     << "`diff bits`: packed vs stock on the benchmarked data (outputs + states), must be 0.\n\n";
  os << kda::bench::md_head({"tokens x seqs", "sets", "packed us", "copy us", "packed/copy", "target", "met",
                              "stock us", "vLLM stock us", "stock/packed", "target", "met", "packed GB/s",
                              "copy GB/s", "diff bits"},
                             "lrrrrrlrrrrlrrr");
  for (const Row& r : rows) {
    const double bytes = 2.0 * static_cast<double>(r.c.tokens * kDim) * 2.0;  // read + write
    const double copy_ratio = r.packed_us / r.copy_us, stock_ratio = r.stock_us / r.packed_us;
    const double ct = copy_ratio_target(r.c), st = stock_ratio_target(r.c);
    os << kda::bench::md_row({std::to_string(r.c.tokens) + " x " + std::to_string(r.c.seqs), std::to_string(r.sets),
                              fixed(r.packed_us, 1), fixed(r.copy_us, 1), fixed(copy_ratio, 3),
                              ct ? "<= " + fixed(ct, 2) : "-", verdict(copy_ratio, ct, true), fixed(r.stock_us, 1),
                              fixed(r.c.stock_spec_us, 0), fixed(stock_ratio, 2), st ? ">= " + fixed(st, 1) : "-",
                              verdict(stock_ratio, st, false), fixed(bytes / (r.packed_us * 1e3), 0),
                              fixed(bytes / (r.copy_us * 1e3), 0),
                              std::to_string(r.out_diff_bits + r.state_diff_bits)});
  }
  return os.str();
}

constexpr const char* kArgs = "[--quick] [--case TOKENSxSEQS] [--out FILE] [--help]";

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string out_path;
  long long only_tokens = 0, only_seqs = 0;  // --case: run only this shape (for a profiler)
  for (int i = 1; i < argc; ++i) {
    if (kda::bench::is_help(argv[i])) {
      kda::bench::usage_exit(argv[0], kArgs);
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--case") == 0 && i + 1 < argc) {
      ++i;
      if (std::sscanf(argv[i], "%lldx%lld", &only_tokens, &only_seqs) != 2 || only_tokens < 1 || only_seqs < 1)
        kda::bench::usage_exit(argv[0], kArgs, argv[i]);
    } else if (std::strcmp(argv[i], "--out") == 0 && i + 1 < argc) {
      out_path = argv[++i];
    } else {
      kda::bench::usage_exit(argv[0], kArgs, argv[i]);
    }
  }
  const cudaDeviceProp prop = kda::bench::require_gpu("bench_conv");
  try {
    cudaStream_t stream = nullptr;
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::vector<Case> cases = {
        {2048, 1, 78}, {4096, 64, 147}, {8192, 1, 286}, {16384, 1, 558}, {16384, 256, 564}, {65536, 4, 2151},
    };
    if (only_tokens > 0) {
      Case c{};
      c.tokens = only_tokens;
      c.seqs = only_seqs;
      for (const Case& k : cases)
        if (k.tokens == only_tokens && k.seqs == only_seqs) c = k;  // keep the spec's stock time if listed
      cases = {c};
    }
    std::vector<Row> rows;
    bool bits_ok = true;
    for (const Case& c : cases) {
      rows.push_back(run_case(c, prop, quick, stream));
      bits_ok = bits_ok && rows.back().out_diff_bits == 0 && rows.back().state_diff_bits == 0;
      std::fprintf(stderr, "bench_conv: %lld x %lld done\n", static_cast<long long>(c.tokens),
                   static_cast<long long>(c.seqs));
    }
    BENCH_CUDA(cudaStreamDestroy(stream));
    kda::bench::emit(table(rows, prop, quick), out_path);
    if (!bits_ok) {
      std::printf("\nbench_conv: the packed and stock outputs differ on the benchmarked data (see diff bits).\n");
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_conv: %s\n", e.what());
    return 1;
  }
}
