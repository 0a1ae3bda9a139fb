// Example prefill driver: builds a PrefillModule from a YAML config, runs a batch of sequences
// through every layer as CUDA-graph replays, and prints per-bucket capture cost, replay time and
// throughput. --check compares graph replay with eager launches bitwise and the packed conv with
// the stock-path baseline.
//
// --tp N runs the config's model (all its heads) as N tensor-parallel ranks on GPUs 0..N-1, one
// host thread per rank, the ranks' outputs summed by the modules' NCCL all-reduce, and checks
// them against a TP = 1 run of the same weights on GPU 0 (see run_tp).
//
//   prefill_driver --config configs/default.yaml --lengths 512,37,2000 --check
//   prefill_driver --random 16 --layers 4 --iters 50
//   prefill_driver --config configs/kimi-linear-48b-tp1.yaml --tp 2
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

#include "kda/config.h"
#include "kda/error.h"
#include "kda/prefill.h"
#include "testing/host_layer_tensors.h"  // the full model's weights to and from the host
#include "testing/tp_shard.h"  // the driver cuts the full model's host weights and pools per rank

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
  int tp = 0;  // --tp N: ranks; 0 runs the config as one module
};

[[noreturn]] void usage(const char* argv0, const std::string& problem) {
  if (!problem.empty()) std::fprintf(stderr, "%s: %s\n\n", argv0, problem.c_str());
  std::fprintf(stderr,
               "usage: %s [--config FILE] [--lengths L1,L2,...| --random N] [--layers N]\n"
               "          [--iters N] [--seed S] [--check] [--no-eager] [--tp N]\n"
               "  --config FILE   YAML config (default configs/default.yaml)\n"
               "  --lengths ...   sequence lengths in tokens (default 512,37,2000,1500)\n"
               "  --random N      N sequences of random length filling about half the capacity\n"
               "  --layers N      layers to run (overrides runtime.num_layers)\n"
               "  --iters N       timed forwards (default 20)\n"
               "  --check         graph vs eager bitwise, packed conv vs stock baseline\n"
               "  --no-eager      skip the eager-launch timing\n"
               "  --tp N          run the config's model as N tensor-parallel ranks on GPUs 0..N-1\n"
               "                  (NCCL all-reduce) and compare with a TP = 1 run on GPU 0; the\n"
               "                  config is the whole model (tensor_parallel.size 1)\n",
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
    else if (a == "--tp") o.tp = static_cast<int>(int_value(1, 64));
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

std::vector<int32_t> batch_lengths(const Options& opt, const kda::Config& cfg) {
  std::vector<int32_t> lengths = opt.lengths;
  if (lengths.empty() && opt.random_seqs == 0) lengths = {512, 37, 2000, 1500};
  if (opt.random_seqs) {
    std::mt19937_64 rng(opt.seed);
    int64_t budget = cfg.runtime.batch_token_capacity() / 2;
    int32_t max_len = static_cast<int32_t>(std::max<int64_t>(1, 2 * budget / opt.random_seqs));
    std::uniform_int_distribution<int32_t> len(1, max_len);
    for (int i = 0; i < opt.random_seqs; ++i) lengths.push_back(len(rng));
  }
  return lengths;
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
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(e));
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

// Relative Frobenius error of bf16 `got` against bf16 `want`.
double rel_error_bf16(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
  auto f = [](uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return static_cast<double>(x);
  };
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = f(got[i]) - f(want[i]);
    num += d * d;
    den += f(want[i]) * f(want[i]);
  }
  return std::isfinite(num) ? std::sqrt(num / (den > 0 ? den : 1)) : INFINITY;
}

int64_t diff_bits(const void* a, const void* b, size_t bytes) {
  auto* pa = static_cast<const unsigned char*>(a);
  auto* pb = static_cast<const unsigned char*>(b);
  int64_t bits = 0;
  for (size_t i = 0; i < bytes; ++i) bits += __builtin_popcount(static_cast<unsigned>(pa[i] ^ pb[i]));
  return bits;
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
int run_tp(const Options& opt) {
  const int N = opt.tp;
  // NVLink SHARP (NVLS) multicast stays off (NCCL_NVLS_ENABLE=0), as the lent multi-GPU
  // machines require. NCCL reads its environment at its first call, so this comes before any
  // NCCL call; a value the caller set is kept.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);

  const kda::Config full = driver_config(opt);
  if (full.tensor_parallel.size != 1) {
    std::fprintf(stderr,
                 "prefill_driver: --tp takes the config of the whole model (tensor_parallel.size 1, "
                 "model.num_heads = all heads) and cuts it into ranks itself; %s has tensor_parallel.size %lld\n",
                 opt.config.c_str(), (long long)full.tensor_parallel.size);
    return 1;
  }
  if (full.runtime.layer_steps != kda::LayerSteps::Full) {
    std::fprintf(stderr, "prefill_driver: --tp needs runtime.layer_steps: full (the all-reduce sums the layer output)\n");
    return 1;
  }
  std::vector<kda::Config> rank_cfg(N, full);
  for (int r = 0; r < N; ++r) {
    rank_cfg[r].model = kda::detail::rank_model(full.model, N, r);  // throws when the heads do not divide
    rank_cfg[r].tensor_parallel.size = N;
    rank_cfg[r].tensor_parallel.rank = r;
    kda::validate_config(rank_cfg[r]);
  }
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
int run_tp(const Options&) {
  std::fprintf(stderr,
               "prefill_driver: --tp needs NCCL, and this build has none (meson found no usable nccl.h and "
               "libnccl; its summary says so): install NCCL >= 2.10 and rebuild\n");
  return 2;
}
#endif

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
  if (opt.tp > devices) {
    std::fprintf(stderr,
                 "prefill_driver: --tp %d runs one rank per GPU on GPUs 0..%d, but only %d CUDA device%s usable "
                 "here; use --tp %d or fewer\n",
                 opt.tp, opt.tp - 1, devices, devices == 1 ? " is" : "s are", devices);
    return 2;
  }

  try {
    if (opt.tp) return run_tp(opt);
    const kda::Config cfg = driver_config(opt);
    const std::vector<int32_t> lengths = batch_lengths(opt, cfg);

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
