// GPU tests of the prefill module runtime: graph replays against eager runs, padding rows,
// untouched pool lines, split batches, bucket independence, memory stability, bad input,
// weights, user steps, self_check and the stock-path baseline.
// KDA_TEST_QUICK=1 runs a reduced set (for compute-sanitizer).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/half_host.h"
#include "conv/stock_conv.h"
#include "kda/config.h"
#include "kda/error.h"
#include "kda/prefill.h"
#include "recurrence/kda_chunked.h"
#include "runtime/gemm_plan.h"
#include "runtime/random_weights.h"
#include "support/gpu_buffers.h"
#include "support/external_pools.h"
#include "support/module_fixture.h"
#include "support/host_batch.h"
#include "support/test_data.h"

namespace {

using kda::PrefillModule;
using kda::test::DeviceBuffer;
using kda::test::diff_bits;
using kda::test::HostBatch;
using kda::test::make_batch;
using kda::test::Stream;
using namespace kda::test;  // the module fixture: configs, batches, modules, comparisons


// Two modules with the same weights, one replaying graphs and one eager, fed the same batches.
void check_replays_match_eager(const kda::Config& cfg, cudaStream_t stream, int quick_batches) {
  const int batches = kda::test::quick_mode() ? quick_batches : 100;
  const int layers = static_cast<int>(cfg.runtime.num_layers);
  const Dims d = dims(cfg);
  auto g = make_module(cfg, 11);
  auto e = make_module(cfg, 11, /*eager=*/true);
  std::mt19937_64 rng(1234);
  uint64_t hidden_seed = 100;

  // Every batch compares everything both modules wrote: planes, output rows [0, T) (same
  // history on both sides, so skipped sequences' rows too), every pool line; and that padding
  // rows and lines the batch does not name kept their bytes.
  auto run_both = [&](const HostBatch& b) {
    const int64_t T = b.tokens();
    CAPTURE(T);
    CAPTURE(b.num_seqs());
    for (PrefillModule* m : {g.get(), e.get()}) {
      fill_hidden(*m, T, hidden_seed, stream);
      poison_planes(*m, stream);
    }
    ++hidden_seed;
    std::vector<std::vector<unsigned char>> conv_before, rec_before;
    for (int l = 0; l < layers; ++l) {
      conv_before.push_back(conv_pool(*g, l, stream));
      rec_before.push_back(rec_pool(*g, l, stream));
    }
    g->run(b.view(), stream);
    e->run(b.view(), stream);

    CHECK(module_diff_bits(*g, *e, T, stream) == 0);
    for (const PrefillModule* m : {g.get(), e.get()}) {
      const PaddingReport r = padding_report(planes_of(*m, stream), b, cfg);
      CHECK(r.nonfinite_real == 0);
      CHECK(r.unpoisoned_pad == 0);
    }
    const std::set<int32_t> named = named_lines(b, cfg);
    for (int l = 0; l < layers; ++l) {
      CAPTURE(l);
      CHECK(changed_unnamed_lines(conv_before[l], conv_pool(*g, l, stream), static_cast<std::size_t>(3 * d.P * 3) * 4,
                                  named) == 0);
      CHECK(changed_unnamed_lines(rec_before[l], rec_pool(*g, l, stream), static_cast<std::size_t>(d.H * 128 * 128) * 4,
                                  named) == 0);
    }
  };

  int64_t previous = 0;
  for (int64_t bucket : cfg.runtime.token_buckets) {
    CAPTURE(bucket);
    // The bucket's first batch records its graphs, after the warm-up eager run.
    run_both(random_batch(rng, bucket, cfg));
    const kda::ModuleStats first = g->stats(stream);
    const int64_t replays_before = replays_of_bucket(first, bucket);
    for (int i = 0; i < batches; ++i) {
      CAPTURE(i);
      const int64_t T = std::uniform_int_distribution<int64_t>(previous + 1, bucket)(rng);
      run_both(random_batch(rng, T, cfg));
    }
    const kda::ModuleStats after = g->stats(stream);
    CHECK(after.graphs.size() == first.graphs.size());
    CHECK(after.eager_layer_runs == first.eager_layer_runs);
    CHECK(replays_of_bucket(after, bucket) == replays_before + int64_t{batches} * layers);
    previous = bucket;
  }
}

}  // namespace

TEST_CASE("graph replays equal eager runs bitwise in every bucket, without re-capture") {
  SUBCASE("tiny config on the legacy default stream") { check_replays_match_eager(tiny_config(), nullptr, 8); }
  SUBCASE("hidden 2304, 4 heads, buckets 512 and 2048") {
    Stream s;
    check_replays_match_eager(big_config(), s.get(), 3);
  }
}

TEST_CASE("a split batch equals the unsplit run on a module whose largest bucket holds it") {
  Stream stream;
  const cudaStream_t s = stream.get();
  // The token-by-token recurrence makes the whole layer independent of window cuts, so all of
  // it must match bitwise; the chunked one is checked within tolerance in the next test.
  kda::Config split_cfg = tiny_config();  // windows of 256 rows, up to 1024 tokens
  split_cfg.runtime.recurrence = kda::Recurrence::TokenByToken;
  kda::Config whole_cfg = split_cfg;
  whole_cfg.runtime.token_buckets = {1024};
  whole_cfg.runtime.max_batch_tokens = 0;
  {
    // Diagnostics: the two modules pick their GEMM algorithm at different largest buckets.
    kda::detail::LtHandle lt;
    kda::detail::GemmShape shape;
    shape.n = split_cfg.model.in_proj_cols();
    shape.k = shape.lda = shape.ldw = split_cfg.model.hidden_size;
    shape.ldc = split_cfg.model.in_proj_stride();
    shape.align_w = 16;
    kda::detail::GemmPlan a(lt.get(), shape, split_cfg.runtime.token_buckets, 32u << 20);
    kda::detail::GemmPlan b(lt.get(), shape, whole_cfg.runtime.token_buckets, 32u << 20);
    MESSAGE("in_proj algorithm, buckets 16/64/256: ", std::string(a.algo_description()));
    MESSAGE("in_proj algorithm, bucket 1024: ", std::string(b.algo_description()));
  }
  auto split = make_module(split_cfg, 21);
  auto whole = make_module(whole_cfg, 21);

  std::vector<HostBatch> batches;
  // Sequences crossing the 256 and 512 boundaries, short ones right after a boundary (state
  // shift with initial state), a zero-length sequence exactly at a boundary, and a skipped
  // sequence spanning one.
  batches.push_back(make_batch({300, 1, 2, 250, 0, 200}, {1, 2, 3, 4, 5, 6},
                               {false, false, false, false, false, false}));
  batches.push_back(make_batch({255, 1, 2, 0, 300, 1, 200, 241}, {1, 2, 3, 7, 0, 4, 6, 8},
                               {true, true, true, false, false, true, true, false}));
  std::mt19937_64 rng(77);
  for (int i = 0; i < (kda::test::quick_mode() ? 3 : 20); ++i)
    batches.push_back(random_batch(rng, std::uniform_int_distribution<int64_t>(257, 1024)(rng), split_cfg));

  uint64_t hidden_seed = 500;
  for (std::size_t i = 0; i < batches.size(); ++i) {
    CAPTURE(i);
    const HostBatch& b = batches[i];
    for (PrefillModule* m : {split.get(), whole.get()}) fill_hidden(*m, b.tokens(), hidden_seed, s);
    ++hidden_seed;
    split->run(b.view(), s);
    whole->run(b.view(), s);
    CHECK(module_diff_bits(*split, *whole, b.tokens(), s, /*with_recurrent=*/true, &b) == 0);
  }
  int max_window = 0;
  for (const auto& g : split->stats(s).graphs) max_window = std::max(max_window, g.window);
  CHECK(max_window >= 2);  // the batches really were split
}

// Relative Frobenius norm of a - b over bf16 (or fp32) elements; skips nothing.
template <typename Load>
double rel_frobenius(std::size_t n, Load load_a, Load load_b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double a = load_a(i), b = load_b(i);
    num += (a - b) * (a - b);
    den += b * b;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

TEST_CASE("with the chunked recurrence a split batch equals the unsplit run within tolerance") {
  Stream stream;
  const cudaStream_t s = stream.get();
  kda::Config split_cfg = tiny_config();
  split_cfg.runtime.recurrence = kda::Recurrence::Chunked;
  kda::Config whole_cfg = split_cfg;
  whole_cfg.runtime.token_buckets = {1024};
  whole_cfg.runtime.max_batch_tokens = 0;
  auto split = make_module(split_cfg, 23);
  auto whole = make_module(whole_cfg, 23);
  const HostBatch b = make_batch({300, 1, 2, 250, 0, 200, 190}, {1, 2, 3, 4, 5, 6, 7},
                                 {false, false, false, false, false, false, false});
  const HostBatch c = make_batch({255, 1, 2, 300, 400}, {1, 2, 3, 4, 8}, {true, true, true, true, false});
  uint64_t seed = 700;
  for (const HostBatch* batch : {&b, &c}) {
    for (PrefillModule* m : {split.get(), whole.get()}) fill_hidden(*m, batch->tokens(), seed, s);
    ++seed;
    split->run(batch->view(), s);
    whole->run(batch->view(), s);
    // Conv planes and conv states do not depend on the recurrence: still bitwise.
    const Dims d = dims(split_cfg);
    CHECK(plane_rows_diff(planes_of(*split, s), planes_of(*whole, s), d, batch->tokens()) == 0);
    const int64_t D = split_cfg.model.hidden_size, T = batch->tokens();
    std::vector<uint16_t> oa(T * D), ob(T * D);
    KDA_TEST_CUDA(cudaMemcpy(oa.data(), split->output(), oa.size() * 2, cudaMemcpyDeviceToHost));
    KDA_TEST_CUDA(cudaMemcpy(ob.data(), whole->output(), ob.size() * 2, cudaMemcpyDeviceToHost));
    auto bf = [](const std::vector<uint16_t>& v) {
      return [&v](std::size_t i) { return static_cast<double>(kda::host::bf16_to_float(v[i])); };
    };
    const double out_err = rel_frobenius(oa.size(), bf(oa), bf(ob));
    double state_err = 0;
    for (int l = 0; l < static_cast<int>(split_cfg.runtime.num_layers); ++l) {
      const auto ra = rec_pool(*split, l, s), rb = rec_pool(*whole, l, s);
      auto f32 = [](const std::vector<unsigned char>& v) {
        return [&v](std::size_t i) {
          float x;
          std::memcpy(&x, v.data() + 4 * i, 4);
          return static_cast<double>(x);
        };
      };
      state_err = std::max(state_err, rel_frobenius(ra.size() / 4, f32(ra), f32(rb)));
    }
    MESSAGE("chunked, split vs unsplit: output ", out_err, ", recurrent states ", state_err);
    CHECK(out_err <= 1e-2);
    CHECK(state_err <= 5e-3);
  }
}

TEST_CASE("the same batch gives the same planes in every bucket that holds it") {
  Stream stream;
  const cudaStream_t s = stream.get();
  // Same largest bucket, so the same GEMM algorithm; the batch lands in buckets 16, 64, 256.
  std::vector<std::unique_ptr<PrefillModule>> modules;
  for (const std::vector<int64_t>& buckets : {std::vector<int64_t>{16, 64, 256}, std::vector<int64_t>{64, 256},
                                              std::vector<int64_t>{256}}) {
    kda::Config c = tiny_config();
    c.runtime.token_buckets = buckets;
    c.runtime.max_batch_tokens = 0;
    modules.push_back(make_module(c, 31));
  }
  std::mt19937_64 rng(5);
  uint64_t hidden_seed = 900;
  for (int i = 0; i < (kda::test::quick_mode() ? 3 : 12); ++i) {
    CAPTURE(i);
    const int64_t T = std::uniform_int_distribution<int64_t>(1, i % 2 ? 64 : 16)(rng);
    const HostBatch b = random_batch(rng, T, modules[0]->config());
    for (auto& m : modules) {
      fill_hidden(*m, T, hidden_seed, s);
      m->run(b.view(), s);
    }
    ++hidden_seed;
    CHECK(module_diff_bits(*modules[0], *modules[1], T, s, false, &b) == 0);
    CHECK(module_diff_bits(*modules[0], *modules[2], T, s, false, &b) == 0);
  }
  const auto has_bucket = [&](PrefillModule& m, int64_t bucket) {
    for (const auto& g : m.stats(s).graphs)
      if (g.bucket_tokens == bucket) return true;
    return false;
  };
  CHECK(has_bucket(*modules[0], 16));
  CHECK(has_bucket(*modules[1], 64));
  CHECK(has_bucket(*modules[2], 256));
}

// Two heads and a 16384-token largest bucket: the chunked recurrence cuts long sequences into
// segments walked in parallel and joined by a scan (docs/design.md, "Segments"), with the
// segment length of the largest bucket in every bucket.
kda::Config cut_config(std::vector<int64_t> buckets) {
  kda::Config c = tiny_config();
  c.runtime.token_buckets = std::move(buckets);
  c.runtime.max_batch_tokens = 16384;
  return c;
}

TEST_CASE("sequences cut into segments: replays equal eager runs, self_check is clean, every bucket gives the same bits") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const int64_t segment = kda::kda_chunked_auto_segment_tokens(16384, 2);
  MESSAGE("segment length at 2 heads, largest bucket 16384: ", segment, " tokens");
  REQUIRE(segment > 0);
  REQUIRE(segment < 4000);  // every batch below has sequences of several segments
  auto g = make_module(cut_config({1024, 8192, 16384}), 7);
  auto e = make_module(cut_config({1024, 8192, 16384}), 7, /*eager=*/true);
  auto top = make_module(cut_config({16384}), 7);  // every batch in the 16384 bucket
  const HostBatch batches[] = {
      make_batch({9000, 17, 3000, 64, 4000}, {1, 2, 3, 4, 5}, {false, false, false, false, false}),  // bucket 16384
      make_batch({5000, 2000, 100, 900}, {1, 3, 6, 7}, {true, true, false, false}),                  // bucket 8192
      make_batch({700, 200}, {5, 8}, {true, false}),                                                 // bucket 1024
  };
  uint64_t seed = 40;
  for (const HostBatch& b : batches) {
    const int64_t T = b.tokens();
    CAPTURE(T);
    for (PrefillModule* m : {g.get(), e.get(), top.get()}) fill_hidden(*m, T, seed, s);
    ++seed;
    for (int rep = 0; rep < 2; ++rep) {  // the first run records the graphs, the second replays
      CAPTURE(rep);
      g->begin_forward(b.view(), s);
      for (int l = 0; l < 2; ++l) g->run_layer(l, s);
      if (rep == 0) continue;
      e->run(b.view(), s);
      e->run(b.view(), s);
      top->run(b.view(), s);
      top->run(b.view(), s);
      CHECK(module_diff_bits(*g, *e, T, s) == 0);
      CHECK(module_diff_bits(*g, *top, T, s, true, &b) == 0);
    }
  }
  const HostBatch last = make_batch({6000, 300}, {1, 9}, {true, false});
  fill_hidden(*g, last.tokens(), seed, s);
  const kda::SelfCheckReport r = g->self_check(last.view(), s);
  MESSAGE(r.detail);
  CHECK(r.ok);
}

TEST_CASE("free device memory is unchanged after many runs, and replays keep host time small") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = tiny_config();
  auto m = make_module(cfg, 41);
  std::mt19937_64 rng(9);
  // Record every (bucket, layer, window) graph first: window w < last always has bucket 256.
  for (int64_t w = 0; w < 4; ++w)
    for (int64_t bucket : cfg.runtime.token_buckets) {
      const HostBatch b = random_batch(rng, w * 256 + bucket, cfg);
      fill_hidden(*m, b.tokens(), 1, s);
      m->run(b.view(), s);
    }
  const std::size_t graphs = m->stats(s).graphs.size();
  CHECK(graphs == std::size_t{3 * 4 * 2});
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  std::size_t free_before = 0, free_after = 0, total = 0;
  KDA_TEST_CUDA(cudaMemGetInfo(&free_before, &total));

  const int runs = kda::test::quick_mode() ? 40 : 1000;
  for (int i = 0; i < runs; ++i) {
    const int64_t T = std::uniform_int_distribution<int64_t>(0, 1024)(rng);
    if (T == 0) {
      m->run(kda::BatchView{}, s);  // an empty batch is a valid no-op
      continue;
    }
    const HostBatch b = random_batch(rng, T, cfg);
    if (i % 50 == 0) fill_hidden(*m, T, 2 + i, s);
    m->run(b.view(), s);
  }
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  KDA_TEST_CUDA(cudaMemGetInfo(&free_after, &total));
  CHECK(free_after == free_before);

  // Host time of run_layer on single-window batches, graphs already recorded.
  std::vector<double> us;
  const HostBatch b = random_batch(rng, 200, cfg);
  for (int i = 0; i < (kda::test::quick_mode() ? 20 : 400); ++i) {
    m->begin_forward(b.view(), s);
    const auto t0 = std::chrono::steady_clock::now();
    m->run_layer(0, s);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    m->run_layer(1, s);
  }
  std::sort(us.begin(), us.end());
  const double median = us[us.size() / 2];
  const kda::ModuleStats st = m->stats(s);
  MESSAGE("run_layer host time, one window: median ", median, " us; module means: begin_forward ",
          st.mean_host_us_begin, " us, run_layer ", st.mean_host_us_layer, " us");
  if (!kda::test::quick_mode()) CHECK(median < 15.0);
  CHECK(st.graphs.size() == graphs);
  for (const auto& g : st.graphs) {
    CAPTURE(g.bucket_tokens);
    CAPTURE(g.layer);
    CAPTURE(g.window);
    CHECK(g.capture_us > 0);
    CHECK(g.instantiate_us > 0);
    CHECK(g.graph_nodes >= 2);  // the GEMM and the conv at least
    if (g.replays > 0) CHECK(g.mean_replay_us > 0);
  }
}

TEST_CASE("bad batches throw, naming the problem, and change neither pools nor staging") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = tiny_config();
  auto m = make_module(cfg, 51);
  auto ref = make_module(cfg, 51);
  std::mt19937_64 rng(3);
  const HostBatch prime = random_batch(rng, 700, cfg);
  const HostBatch good = make_batch({100, 300, 0, 20}, {3, 4, 5, 0}, {true, false, false, false});
  for (PrefillModule* x : {m.get(), ref.get()}) {
    fill_hidden(*x, prime.tokens(), 7, s);
    x->run(prime.view(), s);
    fill_hidden(*x, good.tokens(), 8, s);
  }
  m->begin_forward(good.view(), s);
  std::vector<std::vector<unsigned char>> pools;
  for (int l = 0; l < 2; ++l) {
    pools.push_back(conv_pool(*m, l, s));
    pools.push_back(rec_pool(*m, l, s));
  }

  struct Bad {
    HostBatch batch;
    const char* message;
  };
  std::vector<Bad> bad;
  auto add = [&bad](HostBatch b, const char* msg) { bad.push_back({std::move(b), msg}); };
  {
    HostBatch b = make_batch({1}, {1}, {false});
    b.num_seqs_override = -1;
    add(std::move(b), "num_seqs -1 must not be negative");
  }
  add(make_batch(std::vector<int32_t>(17, 1), [] { std::vector<int32_t> v; for (int i = 1; i <= 17; ++i) v.push_back(i); return v; }(),
                 std::vector<bool>(17, false)),
      "exceeds runtime.max_seqs 16");
  {
    HostBatch b = make_batch({4, 4}, {1, 2}, {false, false});
    b.qsl[0] = 1;
    add(std::move(b), "query_start_loc[0] must be 0");
  }
  {
    HostBatch b = make_batch({4, 4}, {1, 2}, {false, false});
    b.qsl[1] = 9;
    add(std::move(b), "must not decrease");
  }
  add(make_batch({1000, 25}, {1, 2}, {false, false}), "more than runtime.batch_token_capacity() 1024");
  add(make_batch({4, 4}, {1, 33}, {false, false}), "cache_indices[1] = 33 is outside the pool");
  add(make_batch({4, 4}, {-1, 2}, {false, false}), "cache_indices[0] = -1 is outside the pool");
  add(make_batch({4, 4, 4}, {5, 0, 5}, {false, false, false}), "two sequences may not share a cache line");
  for (const Bad& b : bad) {
    CAPTURE(b.message);
    CHECK_THROWS_WITH_AS(m->begin_forward(b.batch.view(), s), doctest::Contains(b.message), kda::Error);
    CHECK_THROWS_WITH_AS(m->run(b.batch.view(), s), doctest::Contains(b.message), kda::Error);
  }
  {
    kda::BatchView v = good.view();
    v.query_start_loc = nullptr;
    CHECK_THROWS_WITH_AS(m->begin_forward(v, s), doctest::Contains("query_start_loc is null"), kda::Error);
    v = good.view();
    v.cache_indices = nullptr;
    CHECK_THROWS_WITH_AS(m->begin_forward(v, s), doctest::Contains("cache_indices is null"), kda::Error);
    v = good.view();
    v.has_initial_state = nullptr;
    CHECK_THROWS_WITH_AS(m->begin_forward(v, s), doctest::Contains("has_initial_state is null"), kda::Error);
  }
  CHECK_THROWS_WITH_AS(m->run_layer(2, s), doctest::Contains("layer 2 is out of range"), kda::Error);
  CHECK_THROWS_WITH_AS(m->run_layer(-1, s), doctest::Contains("layer -1 is out of range"), kda::Error);

  for (int l = 0; l < 2; ++l) {
    CAPTURE(l);
    const auto c = conv_pool(*m, l, s), r = rec_pool(*m, l, s);
    CHECK(diff_bits(c.data(), pools[2 * l].data(), c.size()) == 0);
    CHECK(diff_bits(r.data(), pools[2 * l + 1].data(), r.size()) == 0);
  }
  // A failed begin_forward dropped `good`: run_layer refuses, naming the failure, and writes
  // nothing; staging `good` again runs it as a plain run does.
  CHECK_THROWS_WITH_AS(m->run_layer(0, s), doctest::Contains("no batch is staged: the last begin_forward failed"),
                       kda::Error);
  for (int l = 0; l < 2; ++l) {
    CHECK(diff_bits(conv_pool(*m, l, s).data(), pools[2 * l].data(), pools[2 * l].size()) == 0);
    CHECK(diff_bits(rec_pool(*m, l, s).data(), pools[2 * l + 1].data(), pools[2 * l + 1].size()) == 0);
  }
  m->begin_forward(good.view(), s);
  m->run_layer(0, s);
  m->run_layer(1, s);
  ref->run(good.view(), s);
  CHECK(module_diff_bits(*m, *ref, good.tokens(), s) == 0);
}

TEST_CASE("layers need weights, and bad weights are refused without changing the old ones") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = tiny_config();
  auto donor = make_module(cfg, 61);
  PrefillModule m(cfg);
  const HostBatch b = make_batch({10, 5}, {1, 2}, {false, false});

  CHECK_THROWS_WITH_AS(m.run(b.view(), s),
                       doctest::Contains("layer 0 has no weights: call set_layer_weights, upload_layer_weights or init_random_weights"),
                       kda::Error);
  m.set_layer_weights(0, donor->layer_weights(0));
  CHECK_THROWS_WITH_AS(m.run_layer(0, s), doctest::Contains("call begin_forward"), kda::Error);
  m.begin_forward(b.view(), s);
  CHECK_NOTHROW(m.run_layer(0, s));
  CHECK_THROWS_WITH_AS(m.run_layer(1, s),
                       doctest::Contains("layer 1 has no weights: call set_layer_weights, upload_layer_weights or init_random_weights"),
                       kda::Error);
  CHECK_THROWS_WITH_AS(m.run(b.view(), s), doctest::Contains("layer 1 has no weights"), kda::Error);

  kda::LayerWeights w = donor->layer_weights(1);
  w.f_b = nullptr;
  CHECK_THROWS_WITH_AS(m.set_layer_weights(1, w), doctest::Contains("weights.f_b is null"), kda::Error);
  w = donor->layer_weights(1);
  w.in_proj = static_cast<const char*>(w.in_proj) + 2;
  CHECK_THROWS_WITH_AS(m.set_layer_weights(1, w), doctest::Contains("16-byte aligned"), kda::Error);
  CHECK_THROWS_WITH_AS(m.set_layer_weights(2, donor->layer_weights(1)), doctest::Contains("layer 2 is out of range"),
                       kda::Error);
  CHECK(m.layer_weights(1).in_proj == nullptr);
  CHECK(m.layer_weights(0).in_proj == donor->layer_weights(0).in_proj);
  CHECK_THROWS_AS(m.layer_weights(7), kda::Error);
  CHECK_THROWS_AS(m.conv_state_pool(2), kda::Error);
}

TEST_CASE("weights uploaded from host arrays give the same bits as the same weights on the device") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = tiny_config();
  auto dev = make_module(cfg, 61);
  auto up = std::make_unique<PrefillModule>(cfg);
  const kda::ModelConfig& mc = cfg.model;
  const int64_t P = mc.part_dim(), D = mc.hidden_size, r = mc.gate_rank;
  for (int l = 0; l < static_cast<int>(cfg.runtime.num_layers); ++l) {
    const kda::LayerWeights& w = dev->layer_weights(l);
    const int64_t rows = w.in_proj_rows ? w.in_proj_rows : mc.in_proj_cols();
    auto host = [&](const void* p, std::size_t bytes) { return download(p, bytes, s); };
    const auto in_proj = host(w.in_proj, rows * D * 2), conv = host(w.conv_weight, 3 * P * 4 * 4),
               f_b = host(w.f_b, P * r * 2), g_b = host(w.g_b, P * r * 2), a_log = host(w.A_log, mc.num_heads * 4),
               dt = host(w.dt_bias, P * 4), norm = host(w.o_norm_weight, mc.head_dim * 2), o = host(w.o_proj, D * P * 2);
    kda::LayerWeights h;
    h.in_proj = in_proj.data();
    h.in_proj_rows = rows;
    h.conv_weight = reinterpret_cast<const float*>(conv.data());
    h.f_b = f_b.data();
    h.g_b = g_b.data();
    h.A_log = reinterpret_cast<const float*>(a_log.data());
    h.dt_bias = reinterpret_cast<const float*>(dt.data());
    h.o_norm_weight = norm.data();
    h.o_proj = o.data();
    kda::LayerWeights missing = h;
    missing.f_b = nullptr;
    CHECK_THROWS_WITH_AS(up->upload_layer_weights(l, missing), doctest::Contains("host_weights.f_b is null"),
                         kda::Error);
    up->upload_layer_weights(l, h);
  }
  const HostBatch b = make_batch({40, 1, 100}, {1, 2, 3}, {false, false, false});
  for (PrefillModule* m : {dev.get(), up.get()}) fill_hidden(*m, b.tokens(), 5, s);
  dev->run(b.view(), s);
  up->run(b.view(), s);
  CHECK(module_diff_bits(*dev, *up, b.tokens(), s) == 0);
}

TEST_CASE("profile_steps times every step and leaves the pools as a run of the layer does") {
  Stream stream;
  const cudaStream_t s = stream.get();
  kda::Config cfg = tiny_config();
  cfg.runtime.num_layers = 1;
  auto profiled = make_module(cfg, 91);
  auto plain = make_module(cfg, 91);
  const HostBatch b = make_batch({300, 5, 0, 60}, {1, 2, 3, 4}, {false, false, false, false});
  for (PrefillModule* m : {profiled.get(), plain.get()}) fill_hidden(*m, b.tokens(), 9, s);
  const auto t = profiled->profile_steps(b.view(), 0, s);
  plain->run(b.view(), s);
  REQUIRE(t.size() == 6);
  const char* names[] = {"in_proj GEMM", "packed conv", "gate GEMMs (g1, g2)", "prep + recurrence",
                         "gated RMSNorm", "o_proj GEMM"};
  for (std::size_t i = 0; i < t.size(); ++i) {
    CHECK(t[i].name == names[i]);
    CHECK(t[i].gpu_us > 0);
  }
  CHECK(module_diff_bits(*profiled, *plain, b.tokens(), s) == 0);
  CHECK_THROWS_WITH_AS(profiled->profile_steps(b.view(), 1, s), doctest::Contains("layer 1 is out of range"),
                       kda::Error);
}

TEST_CASE("random weights are deterministic per seed and follow their distributions") {
  const kda::Config cfg = tiny_config();
  auto a = make_module(cfg, 71), b = make_module(cfg, 71), c = make_module(cfg, 72);
  const kda::ModelConfig& mc = cfg.model;
  const std::size_t in_bytes = static_cast<std::size_t>(mc.in_proj_cols() * mc.hidden_size) * 2;
  for (int l = 0; l < 2; ++l) {
    CAPTURE(l);
    const auto wa = download(a->layer_weights(l).in_proj, in_bytes, nullptr);
    const auto wb = download(b->layer_weights(l).in_proj, in_bytes, nullptr);
    const auto wc = download(c->layer_weights(l).in_proj, in_bytes, nullptr);
    CHECK(diff_bits(wa.data(), wb.data(), in_bytes) == 0);
    CHECK(diff_bits(wa.data(), wc.data(), in_bytes) > 0);
    float lo = 1e9f, hi = -1e9f;
    for (std::size_t i = 0; i < in_bytes; i += 2) {
      uint16_t v;
      std::memcpy(&v, wa.data() + i, 2);
      const float f = kda::host::bf16_to_float(v);
      lo = std::min(lo, f);
      hi = std::max(hi, f);
    }
    CHECK(lo >= -1.0f / 16);
    CHECK(hi <= 1.0f / 16);
    CHECK(hi - lo > 1.9f / 16);
    std::vector<float> a_log(mc.num_heads);
    KDA_TEST_CUDA(cudaMemcpy(a_log.data(), a->layer_weights(l).A_log, a_log.size() * 4, cudaMemcpyDeviceToHost));
    for (float v : a_log) CHECK((v >= 0.0f && v <= std::log(16.0f)));
    std::vector<uint16_t> norm(128);
    KDA_TEST_CUDA(cudaMemcpy(norm.data(), a->layer_weights(l).o_norm_weight, 256, cudaMemcpyDeviceToHost));
    for (uint16_t v : norm) CHECK(std::fabs(kda::host::bf16_to_float(v) - 1.0f) <= 0.1f + 1.0f / 128);  // bf16 spacing near 1 is 2^-7
  }
  const auto l0 = download(a->layer_weights(0).in_proj, in_bytes, nullptr);
  const auto l1 = download(a->layer_weights(1).in_proj, in_bytes, nullptr);
  CHECK(diff_bits(l0.data(), l1.data(), in_bytes) > 0);  // layers are independent streams
}

TEST_CASE("the in_proj GEMM computes hidden @ in_proj^T into rows of the padded output") {
  Stream stream;
  const cudaStream_t s = stream.get();
  kda::Config cfg = tiny_config();
  cfg.runtime.num_layers = 1;
  auto m = make_module(cfg, 81);
  const kda::ModelConfig& mc = cfg.model;
  const int64_t T = 13, D = mc.hidden_size, N = mc.in_proj_cols(), S = mc.in_proj_stride();
  fill_hidden(*m, T, 3, s);
  m->run(make_batch({T}, {1}, {false}).view(), s);
  const auto x = download(m->hidden_states(), static_cast<std::size_t>(T * D) * 2, s);
  const auto w = download(m->layer_weights(0).in_proj, static_cast<std::size_t>(N * D) * 2, s);
  const auto y = download(m->in_proj_output(), static_cast<std::size_t>(16 * S) * 2, s);
  auto at = [](const std::vector<unsigned char>& v, int64_t i) {
    uint16_t h;
    std::memcpy(&h, v.data() + 2 * i, 2);
    return kda::host::bf16_to_float(h);
  };
  int64_t bad = 0, pad_written = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t n = 0; n < N; ++n) {
      double ref = 0;
      for (int64_t k = 0; k < D; ++k) ref += static_cast<double>(at(x, t * D + k)) * at(w, n * D + k);
      bad += std::fabs(at(y, t * S + n) - ref) > 1e-2 + 1e-2 * std::fabs(ref);
    }
    for (int64_t n = N; n < S; ++n) pad_written += at(y, t * S + n) != 0.0f;
  }
  CHECK(bad == 0);
  CHECK(pad_written == 0);  // columns past W_in are never written (zeroed at construction)

  kda::detail::LtHandle lt;
  kda::detail::GemmShape shape;
  shape.n = N;
  shape.k = shape.lda = shape.ldw = D;
  shape.ldc = S;
  kda::detail::GemmPlan plan(lt.get(), shape, {16, 64}, 1u << 20);
  CHECK(plan.supports_m(64));
  CHECK_FALSE(plan.supports_m(32));
  DeviceBuffer ws(1u << 20);
  CHECK_THROWS_WITH_AS(plan.run(32, m->hidden_states(), w.data(), ws.get(), ws.get(), ws.bytes(), s),
                       doctest::Contains("M = 32 is not a planned bucket (planned: 16, 64)"), kda::Error);
  CHECK_THROWS_WITH_AS(plan.run(16, static_cast<char*>(m->hidden_states()) + 2, m->layer_weights(0).in_proj,
                                ws.get(), ws.get(), ws.bytes(), s),
                       doctest::Contains("aligned"), kda::Error);
  CHECK_THROWS_AS(kda::detail::GemmPlan(lt.get(), shape, {64, 16}, 0), kda::Error);
}

TEST_CASE("eager capture records every window-0 graph at the first forward") {
  Stream stream;
  const cudaStream_t s = stream.get();
  kda::Config cfg = tiny_config();
  cfg.runtime.capture = kda::CaptureMode::Eager;
  auto g = make_module(cfg, 91);
  auto e = make_module(tiny_config(), 91, /*eager=*/true);
  CHECK(g->stats(s).graphs.empty());
  const HostBatch b = make_batch({7, 0, 5}, {2, 3, 4}, {false, false, false});
  for (PrefillModule* m : {g.get(), e.get()}) fill_hidden(*m, b.tokens(), 4, s);
  g->begin_forward(b.view(), s);
  kda::ModuleStats st = g->stats(s);
  CHECK(st.graphs.size() == std::size_t{3 * 2});
  for (const auto& x : st.graphs) {
    CHECK(x.window == 0);
    CHECK(x.replays == 0);
  }
  CHECK(st.eager_layer_runs == 3 * 2);  // the all-padding warm-up
  g->run_layer(0, s);
  g->run_layer(1, s);
  e->run(b.view(), s);
  CHECK(module_diff_bits(*g, *e, b.tokens(), s) == 0);
  st = g->stats(s);
  CHECK(st.graphs.size() == std::size_t{3 * 2});
  CHECK(st.eager_layer_runs == 3 * 2);
  CHECK(replays_of_bucket(st, 16) == 2);
}

TEST_CASE("new weight values need no re-recording, new weight pointers re-record the graphs") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = tiny_config();
  auto g = make_module(cfg, 1);
  auto e = make_module(cfg, 1, /*eager=*/true);
  auto donor = make_module(cfg, 3);
  std::mt19937_64 rng(13);
  auto run_both = [&](uint64_t hidden_seed) {
    const HostBatch b = random_batch(rng, 12, cfg);
    for (PrefillModule* m : {g.get(), e.get()}) {
      fill_hidden(*m, b.tokens(), hidden_seed, s);
      m->run(b.view(), s);
    }
    return module_diff_bits(*g, *e, b.tokens(), s);
  };
  CHECK(run_both(1) == 0);
  const std::size_t graphs = g->stats(s).graphs.size();
  const void* in_proj = g->layer_weights(0).in_proj;
  g->init_random_weights(2);  // same storage, new values
  e->init_random_weights(2);
  CHECK(g->layer_weights(0).in_proj == in_proj);
  CHECK(run_both(2) == 0);
  for (int l = 0; l < 2; ++l) {
    g->set_layer_weights(l, donor->layer_weights(l));
    e->set_layer_weights(l, donor->layer_weights(l));
  }
  CHECK(run_both(3) == 0);
  CHECK(g->stats(s).graphs.size() == graphs);  // re-recorded in place
}

TEST_CASE("user steps see the window's buffers and run inside the graphs") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = tiny_config();
  auto m = make_module(cfg, 101);
  std::vector<kda::StepContext> seen;
  m->add_step([&seen](const kda::StepContext& ctx, kda::Stream st) {
    seen.push_back(ctx);
    const int64_t bytes = ctx.bucket_tokens * ctx.config->model.hidden_size * 2;
    KDA_TEST_CUDA(cudaMemsetAsync(ctx.out, 0x3C, static_cast<std::size_t>(bytes), st));
  });
  const Dims d = dims(cfg);
  const HostBatch b = make_batch({300, 200, 30}, {1, 2, 3}, {false, false, false});  // windows 256, 256, 18
  const std::size_t out_bytes = static_cast<std::size_t>(b.tokens() * d.D) * 2;
  auto check_output = [&] {
    const auto out = download(m->output(), out_bytes, s);
    int64_t wrong = 0;
    for (unsigned char c : out) wrong += c != 0x3C;
    CHECK(wrong == 0);
  };
  m->run(b.view(), s);
  check_output();
  const std::size_t calls = seen.size();
  CHECK(calls == std::size_t{2 * 3 * 2});  // per (layer, window): the warm-up run and the capture
  const char* hidden = static_cast<const char*>(m->hidden_states());
  const char* planes = static_cast<const char*>(m->conv_planes());
  const char* output = static_cast<const char*>(m->output());
  for (const kda::StepContext& ctx : seen) {
    const int64_t row0 = (static_cast<const char*>(ctx.hidden) - hidden) / (d.D * 2);
    CAPTURE(row0);
    CAPTURE(ctx.layer);
    CHECK((row0 == 0 || row0 == 256 || row0 == 512));
    CHECK(ctx.bucket_tokens == (row0 == 512 ? 64 : 256));
    CHECK(ctx.max_seqs == 16);
    CHECK(static_cast<const char*>(ctx.q) == planes + row0 * d.P * 2);
    CHECK(static_cast<const char*>(ctx.k) == planes + (d.cap + row0) * d.P * 2);
    CHECK(static_cast<const char*>(ctx.v) == planes + (2 * d.cap + row0) * d.P * 2);
    CHECK(static_cast<const char*>(ctx.out) == output + row0 * d.D * 2);
    CHECK(ctx.in_proj_out == m->in_proj_output());
    CHECK(ctx.conv_states == m->conv_state_pool(ctx.layer));
    CHECK(ctx.recurrent_states == m->recurrent_state_pool(ctx.layer));
    CHECK(ctx.conv_strides.line == m->conv_state_strides(ctx.layer).line);
    CHECK(ctx.conv_strides.dim == 3);
    CHECK(ctx.conv_strides.tap == 1);
    CHECK(ctx.recurrent_strides.line == m->recurrent_state_strides(ctx.layer).line);
    CHECK(ctx.recurrent_strides.k == 128);
    CHECK(ctx.recurrent_strides.v == 1);
    CHECK(ctx.weights == &m->layer_weights(ctx.layer));
    CHECK(ctx.config == &m->config());
  }
  KDA_TEST_CUDA(cudaMemsetAsync(const_cast<void*>(m->output()), 0, out_bytes, s));
  m->run(b.view(), s);
  check_output();                 // the graphs did the memset
  CHECK(seen.size() == calls);    // replays do not call the step
  CHECK_THROWS_WITH_AS(m->add_step([](const kda::StepContext&, kda::Stream) {}),
                       doctest::Contains("before the first forward"), kda::Error);
  PrefillModule fresh(cfg);
  CHECK_THROWS_WITH_AS(fresh.add_step(kda::Step{}), doctest::Contains("the step is empty"), kda::Error);
}

TEST_CASE("self_check reports no differing bits and leaves the pools as one run does") {
  Stream stream;
  const cudaStream_t s = stream.get();
  auto check = [&](const kda::Config& cfg, const std::vector<int64_t>& sizes) {
    auto g = make_module(cfg, 111);
    auto ref = make_module(cfg, 111);
    std::mt19937_64 rng(17);
    const HostBatch prime = random_batch(rng, sizes.front(), cfg);
    for (PrefillModule* m : {g.get(), ref.get()}) {
      fill_hidden(*m, prime.tokens(), 1, s);
      m->run(prime.view(), s);
    }
    uint64_t hidden_seed = 2;
    for (int64_t T : sizes) {
      CAPTURE(T);
      const HostBatch b = random_batch(rng, T, cfg);
      for (PrefillModule* m : {g.get(), ref.get()}) fill_hidden(*m, T, hidden_seed, s);
      ++hidden_seed;
      const kda::SelfCheckReport r = g->self_check(b.view(), s);
      ref->run(b.view(), s);
      MESSAGE(r.detail);
      CHECK(r.ok);
      CHECK(r.graph_vs_eager_diff_bits == 0);
      CHECK(r.conv_vs_stock_diff_bits == 0);
      CHECK(!r.detail.empty());
      CHECK(module_diff_bits(*g, *ref, T, s) == 0);
    }
  };
  SUBCASE("tiny config, one and several windows") { check(tiny_config(), {200, 16, 700, 1024}); }
  SUBCASE("hidden 2304, 4 heads") { check(big_config(), kda::test::quick_mode() ? std::vector<int64_t>{2048} : std::vector<int64_t>{2048, 300}); }
  SUBCASE("configs/tiny.yaml") {
    // meson test sets KDA_SOURCE_ROOT; run by hand from the source root, "." does.
    const char* root = std::getenv("KDA_SOURCE_ROOT");
    const kda::Config cfg = kda::load_config(std::string(root ? root : ".") + "/configs/tiny.yaml");
    check(cfg, {100, 600});
  }
}

TEST_CASE("the conv planes equal the stock baseline run on the module's in_proj output") {
  Stream stream;
  const cudaStream_t s = stream.get();
  auto check = [&](kda::Config cfg) {
    cfg.runtime.num_layers = 1;  // the in_proj output then holds the layer that is compared
    cfg.runtime.max_batch_tokens = 0;
    auto m = make_module(cfg, 121);
    const Dims d = dims(cfg);
    std::mt19937_64 rng(23);
    const int64_t B = cfg.runtime.largest_bucket();
    const HostBatch prime = random_batch(rng, B, cfg);
    fill_hidden(*m, prime.tokens(), 1, s);
    m->run(prime.view(), s);
    for (int i = 0; i < (kda::test::quick_mode() ? 2 : 6); ++i) {
      CAPTURE(i);
      const int64_t T = std::uniform_int_distribution<int64_t>(1, B)(rng);
      const HostBatch b = random_batch(rng, T, cfg);
      const std::size_t pool_bytes = d.conv_pool_bytes(cfg.pools.cache_lines);
      DeviceBuffer states(pool_bytes);
      KDA_TEST_CUDA(cudaMemcpyAsync(states.get(), m->conv_state_pool(0), pool_bytes, cudaMemcpyDeviceToDevice, s));
      fill_hidden(*m, T, 10 + i, s);
      m->run(b.view(), s);

      DeviceBuffer qsl = kda::test::to_device(b.qsl);
      DeviceBuffer cache = kda::test::to_device(b.lines);
      DeviceBuffer flags(static_cast<std::size_t>(b.num_seqs()));
      flags.upload(b.flags.get(), static_cast<std::size_t>(b.num_seqs()));
      DeviceBuffer out(static_cast<std::size_t>(3 * T * d.P) * 2);
      out.fill_bytes(0xFF);
      kda::PackedConvArgs a;
      a.x = m->in_proj_output();
      a.num_tokens = T;
      a.dim = 3 * d.P;
      a.x_row_stride = cfg.model.in_proj_stride();
      a.weight = m->layer_weights(0).conv_weight;
      a.conv_states = states.as<float>();
      a.varlen.cache_lines = cfg.pools.cache_lines;
      a.state_stride_line = 3 * d.P * 3;
      a.state_stride_dim = 3;
      a.state_stride_tap = 1;
      a.varlen.query_start_loc = qsl.as<int32_t>();
      a.varlen.num_seqs = b.num_seqs();
      a.varlen.cache_indices = cache.as<int32_t>();
      a.varlen.has_initial_state = flags.as<bool>();
      a.part_dim = d.P;
      a.varlen.null_line = cfg.pools.null_line;
      a.out = out.get();
      DeviceBuffer ws(kda::baseline::stock_causal_conv1d_workspace_bytes(a));
      kda::baseline::stock_causal_conv1d(a, ws.get(), ws.bytes(), s);

      const auto stock = download(out.get(), out.bytes(), s);
      const auto mine = planes_of(*m, s);
      const std::vector<bool> written = written_rows(b, cfg);
      int64_t bits = 0, rows = 0;
      for (int p = 0; p < 3; ++p)
        for (int64_t r = 0; r < T; ++r) {
          if (!written[r]) continue;
          ++rows;
          bits += diff_bits(stock.data() + (p * T + r) * d.P * 2, mine.data() + p * d.plane_bytes() + r * d.P * 2,
                            static_cast<std::size_t>(d.P) * 2);
        }
      CHECK(bits == 0);
      const auto stock_states = download(states.get(), pool_bytes, s);
      const auto module_states = conv_pool(*m, 0, s);
      CHECK(diff_bits(stock_states.data(), module_states.data(), pool_bytes) == 0);
      MESSAGE("compared ", rows, " plane rows of ", T);
    }
  };
  SUBCASE("tiny config") { check(tiny_config()); }
  SUBCASE("hidden 2304, 4 heads") { check(big_config()); }
}

TEST_CASE("external pools give the bits of module-owned pools, keep their graphs, and bad ones are refused") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config owned_cfg = tiny_config();
  kda::Config cfg = owned_cfg;
  cfg.pools.external = true;
  const int64_t lines = cfg.pools.cache_lines;
  const int layers = static_cast<int>(cfg.runtime.num_layers);

  auto owned = make_module(owned_cfg, 71);
  PrefillModule m(cfg);
  m.init_random_weights(71);
  const HostBatch small = make_batch({10, 5}, {1, 2}, {false, false});
  CHECK_THROWS_WITH_AS(m.run(small.view(), s),
                       doctest::Contains("layer 0 has no state pools: pools.external is true, so call set_layer_pools"),
                       kda::Error);
  CHECK(m.conv_state_pool(0) == nullptr);

  std::vector<std::unique_ptr<kda::test::ExternalPools>> pools;
  for (int l = 0; l < layers; ++l) pools.push_back(std::make_unique<kda::test::ExternalPools>(cfg, 24 + 8 * l, 24 + 8 * l));

  // Refusals name the problem and keep the layer without pools.
  CHECK_THROWS_WITH_AS(owned->set_layer_pools(0, pools[0]->view), doctest::Contains("pools.external is false"),
                       kda::Error);
  kda::StatePools bad = pools[0]->view;
  bad.conv = nullptr;
  CHECK_THROWS_WITH_AS(m.set_layer_pools(0, bad), doctest::Contains("layer 0: pools.conv is null; both pools must be set"),
                       kda::Error);
  bad = pools[0]->view;
  bad.recurrent = nullptr;
  CHECK_THROWS_WITH_AS(m.set_layer_pools(0, bad),
                       doctest::Contains("layer 0: pools.recurrent is null; both pools must be set"), kda::Error);
  bad.conv = nullptr;
  CHECK_THROWS_WITH_AS(m.set_layer_pools(0, bad),
                       doctest::Contains("layer 0: pools.conv and pools.recurrent are null; both pools must be set"),
                       kda::Error);
  bad = pools[0]->view;
  bad.lines = lines - 1;
  CHECK_THROWS_WITH_AS(m.set_layer_pools(0, bad), doctest::Contains("is below pools.cache_lines"), kda::Error);
  bad = pools[0]->view;
  bad.conv_line_stride = cfg.conv_line_elems() - 1;
  CHECK_THROWS_WITH_AS(m.set_layer_pools(0, bad), doctest::Contains("conv_line_stride"), kda::Error);
  bad = pools[0]->view;
  bad.recurrent_line_stride = cfg.recurrent_line_elems() - 3;
  CHECK_THROWS_WITH_AS(m.set_layer_pools(0, bad), doctest::Contains("recurrent_line_stride"), kda::Error);
  bad = pools[0]->view;
  bad.recurrent = reinterpret_cast<char*>(bad.recurrent) + 2;
  CHECK_THROWS_WITH_AS(m.set_layer_pools(0, bad), doctest::Contains("aligned to its 4-byte fp32 elements"), kda::Error);
  CHECK_THROWS_WITH_AS(m.set_layer_pools(layers, pools[0]->view), doctest::Contains("out of range"), kda::Error);
  CHECK(m.state_pools(0).conv == nullptr);
  CHECK_THROWS_AS(m.run(small.view(), s), kda::Error);

  for (int l = 0; l < layers; ++l) m.set_layer_pools(l, pools[l]->view);
  CHECK(m.conv_state_pool(1) == pools[1]->view.conv);
  CHECK(m.state_pools(1).recurrent_line_stride == pools[1]->view.recurrent_line_stride);
  CHECK(m.conv_state_strides(0).line == pools[0]->view.conv_line_stride);

  // Batches through lazily recorded graphs (the second of a bucket is a replay), one of several
  // windows, the same pools handed again in the middle (no re-recording): every bit equals the
  // module that owns its pools, and no gap byte is written.
  std::mt19937_64 rng(23);
  uint64_t seed = 5;
  std::map<std::tuple<int64_t, int, int>, double> captured;  // capture_us per graph at the reset
  for (int64_t T : {40, 200, 40, 700, 200}) {
    CAPTURE(T);
    const HostBatch b = random_batch(rng, T, cfg);
    for (PrefillModule* x : {owned.get(), &m}) {
      fill_hidden(*x, T, seed, s);
      x->run(b.view(), s);
    }
    ++seed;
    const Dims d = dims(cfg);
    CHECK(plane_rows_diff(planes_of(*owned, s), planes_of(m, s), d, T) == 0);
    const std::size_t out_bytes = static_cast<std::size_t>(T * d.D) * 2;
    const auto oa = download(owned->output(), out_bytes, s), ob = download(m.output(), out_bytes, s);
    int64_t out_bits = 0;
    for (int64_t q = 0; q < b.num_seqs(); ++q) {
      if (b.lines[q] == cfg.pools.null_line) continue;
      const std::size_t r0 = b.qsl[q] * d.D * 2, r1 = b.qsl[q + 1] * d.D * 2;
      out_bits += diff_bits(oa.data() + r0, ob.data() + r0, r1 - r0);
    }
    CHECK(out_bits == 0);
    for (int l = 0; l < layers; ++l) {
      int64_t gap_written = 0;
      const auto conv = pools[l]->packed_conv(&gap_written);
      const auto rec = pools[l]->packed_recurrent(&gap_written);
      const auto conv_owned = conv_pool(*owned, l, s), rec_owned = rec_pool(*owned, l, s);
      CHECK(diff_bits(conv.data(), conv_owned.data(), conv.size()) == 0);
      CHECK(diff_bits(rec.data(), rec_owned.data(), rec.size()) == 0);
      CHECK(gap_written == 0);
    }
    if (T == 200 && captured.empty()) {
      for (const kda::BucketStats& g : m.stats(s).graphs) captured[{g.bucket_tokens, g.layer, g.window}] = g.capture_us;
      for (int l = 0; l < layers; ++l) m.set_layer_pools(l, pools[l]->view);  // same pointers: graphs stay
    }
  }
  int64_t replays = 0, kept = 0;
  for (const kda::BucketStats& g : m.stats(s).graphs) {
    replays += g.replays;
    const auto it = captured.find({g.bucket_tokens, g.layer, g.window});
    if (it != captured.end()) kept += it->second == g.capture_us;  // not recorded again
  }
  CHECK(replays > 0);
  CHECK(kept == static_cast<int64_t>(captured.size()));

  // self_check copies and restores the external pools too.
  const HostBatch last = random_batch(rng, 300, cfg);
  fill_hidden(m, 300, 99, s);
  const kda::SelfCheckReport r = m.self_check(last.view(), s);
  MESSAGE(r.detail);
  CHECK(r.ok);
}

TEST_CASE("eager capture records the graphs of the layers that have weights and pools") {
  Stream stream;
  const cudaStream_t s = stream.get();
  kda::Config cfg = tiny_config();
  cfg.runtime.capture = kda::CaptureMode::Eager;
  cfg.pools.external = true;
  PrefillModule m(cfg);
  m.init_random_weights(93);
  kda::test::ExternalPools p0(cfg, 0, 0), p1(cfg, 16, 16);
  m.set_layer_pools(0, p0.view);
  const HostBatch b = make_batch({7, 5}, {2, 3}, {false, false});
  fill_hidden(m, b.tokens(), 4, s);
  m.begin_forward(b.view(), s);  // layer 1 has no pools yet: only layer 0's graphs
  kda::ModuleStats st = m.stats(s);
  CHECK(st.graphs.size() == std::size_t{3});
  for (const auto& x : st.graphs) CHECK(x.layer == 0);
  CHECK_NOTHROW(m.run_layer(0, s));
  CHECK_THROWS_WITH_AS(m.run_layer(1, s), doctest::Contains("layer 1 has no state pools"), kda::Error);
  m.set_layer_pools(1, p1.view);
  m.begin_forward(b.view(), s);
  st = m.stats(s);
  CHECK(st.graphs.size() == std::size_t{3 * 2});
  CHECK_NOTHROW(m.run_layer(0, s));
  CHECK_NOTHROW(m.run_layer(1, s));
  KDA_TEST_CUDA(cudaStreamSynchronize(s));
}
