// The faults a server meets, end to end on the GPU: a user step that throws while a graph is
// recorded and in eager runs, a failed begin_forward, a second run of a layer, a device
// allocation that fails at construction, bad batches between good ones, overlapping external
// pools, pools freed and replaced between forwards, another device current on the calling
// thread. After each: the error names the cause, the module is as before or refuses to run, a
// later good forward gives the bits of a clean module, and no device memory leaks.
// KDA_TEST_QUICK=1 runs fewer construct/destroy cycles (for compute-sanitizer).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kda/config.h"
#include "kda/error.h"
#include "kda/prefill.h"
#include "support/external_pools.h"
#include "support/gpu_buffers.h"
#include "support/host_batch.h"
#include "support/module_fixture.h"
#include "support/test_data.h"

namespace {

using namespace kda::test;

__global__ void count_run(unsigned* counter) { atomicAdd(counter, 1u); }

bool capturing(kda::Stream stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  KDA_TEST_CUDA(cudaStreamIsCapturing(stream, &status));
  return status == cudaStreamCaptureStatusActive;
}

// A user step that throws once: at its `throw_at`-th recording into a graph (1-based; 0: never)
// or at its `throw_at_eager`-th eager run. It enqueues nothing.
struct FaultyStep {
  struct Counts {
    int recordings = 0, eager_runs = 0;
    bool thrown = false;
  };
  std::shared_ptr<Counts> counts = std::make_shared<Counts>();
  int throw_at = 0, throw_at_eager = 0;
  void operator()(const kda::StepContext&, kda::Stream stream) const {
    int& n = capturing(stream) ? counts->recordings : counts->eager_runs;
    ++n;
    const int at = capturing(stream) ? throw_at : throw_at_eager;
    if (!counts->thrown && n == at) {
      counts->thrown = true;
      throw std::runtime_error(capturing(stream) ? "refused while recording" : "refused in an eager run");
    }
  }
};

// A user step that counts on the device every (layer, window) it runs in, graph replays too.
kda::Step counting_step(unsigned* counter) {
  return [counter](const kda::StepContext&, kda::Stream stream) { count_run<<<1, 1, 0, stream>>>(counter); };
}

unsigned read_counter(const DeviceBuffer& counter, cudaStream_t s) {
  KDA_TEST_CUDA(cudaStreamSynchronize(s));
  return counter.download_as<unsigned>()[0];
}

// Rows 0..599 in three 256-row windows of tiny_config(): sequences 0, 1 in window 0, 2 across
// windows 0 and 1, 3 in window 1, 4 across windows 1 and 2, 5 in window 2.
HostBatch three_window_batch(int32_t first_line, bool initial) {
  std::vector<int32_t> lines;
  for (int32_t i = 0; i < 6; ++i) lines.push_back(first_line + i);
  return make_batch({120, 100, 60, 150, 106, 64}, lines, std::vector<bool>(6, initial));
}

std::vector<unsigned char> line_of(const std::vector<unsigned char>& pool, int32_t line, std::size_t line_bytes) {
  return {pool.begin() + line * line_bytes, pool.begin() + (line + 1) * line_bytes};
}

}  // namespace

TEST_CASE("a step-list change after a failed eager capture drops the old graphs, and the new step runs") {
  Stream stream;
  const cudaStream_t s = stream.get();
  kda::Config cfg = tiny_config();
  cfg.runtime.capture = kda::CaptureMode::Eager;
  auto m = make_module(cfg, 21);
  auto clean = make_module(cfg, 21);
  FaultyStep faulty;
  faulty.throw_at = 2;  // the second recording: (bucket 64, layer 0), after (16, 0) was recorded
  m->add_step(faulty);
  const HostBatch b = make_batch({40, 9, 130}, {1, 2, 3}, {false, false, false});
  for (PrefillModule* x : {m.get(), clean.get()}) fill_hidden(*x, b.tokens(), 3, s);

  CHECK_THROWS_WITH_AS(m->begin_forward(b.view(), s), doctest::Contains("user step 0 threw: refused while recording"),
                       kda::Error);
  CHECK(m->stats(s).graphs.size() == 1);
  CHECK_THROWS_WITH_AS(m->run_layer(0, s), doctest::Contains("no batch is staged: the last begin_forward failed"),
                       kda::Error);

  // No batch has been staged yet, so the step list may still change; the change drops the
  // graph recorded without the new step.
  DeviceBuffer counter(sizeof(unsigned));
  m->add_step(counting_step(counter.as<unsigned>()));
  CHECK(m->stats(s).graphs.empty());
  CHECK_NOTHROW(m->set_partial_output(true));
  CHECK_NOTHROW(m->set_partial_output(false));

  m->begin_forward(b.view(), s);  // records every window-0 graph, with both user steps
  CHECK(m->stats(s).graphs.size() == cfg.runtime.token_buckets.size() * 2);
  KDA_TEST_CUDA(cudaMemsetAsync(counter.get(), 0, sizeof(unsigned), s));
  m->run_layer(0, s);
  m->run_layer(1, s);
  CHECK(read_counter(counter, s) == 2);  // one window per layer, run by the replays
  clean->run(b.view(), s);
  CHECK(module_diff_bits(*m, *clean, b.tokens(), s) == 0);
  CHECK_THROWS_WITH_AS(m->add_step(counting_step(counter.as<unsigned>())), doctest::Contains("before the first forward"),
                       kda::Error);
}

TEST_CASE("run_layer on another stream than the batch's begin_forward throws and writes nothing") {
  Stream stream, other;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = tiny_config();
  auto m = make_module(cfg, 33);
  auto clean = make_module(cfg, 33);
  const HostBatch b = make_batch({70, 200, 5}, {4, 5, 6}, {false, true, false});
  for (PrefillModule* x : {m.get(), clean.get()}) fill_hidden(*x, b.tokens(), 8, s);
  m->begin_forward(b.view(), s);
  for (int l = 0; l < 2; ++l)
    CHECK_THROWS_WITH_AS(m->run_layer(l, other.get()),
                         doctest::Contains("but this batch's begin_forward staged its metadata on stream"), kda::Error);
  for (int l = 0; l < 2; ++l) m->run_layer(l, s);  // the batch still runs, once, on its stream
  clean->run(b.view(), s);
  CHECK(module_diff_bits(*m, *clean, b.tokens(), s) == 0);
}

TEST_CASE("after a failed begin_forward, or a second run of a layer, run_layer throws and writes nothing") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = tiny_config();
  auto m = make_module(cfg, 31);
  auto clean = make_module(cfg, 31);
  const HostBatch first = make_batch({70, 200, 5}, {4, 5, 6}, {false, false, false});
  const HostBatch second = make_batch({33, 190}, {4, 6}, {true, true});
  for (PrefillModule* x : {m.get(), clean.get()}) {
    fill_hidden(*x, first.tokens(), 5, s);
    x->run(first.view(), s);
    fill_hidden(*x, second.tokens(), 6, s);
  }
  // A second run of a layer would advance lines 4 and 6 twice.
  m->begin_forward(second.view(), s);
  m->run_layer(0, s);
  CHECK_THROWS_WITH_AS(m->run_layer(0, s), doctest::Contains("layer 0 has already run this batch"), kda::Error);
  m->run_layer(1, s);
  CHECK_THROWS_WITH_AS(m->run_layer(1, s), doctest::Contains("layer 1 has already run this batch"), kda::Error);
  clean->run(second.view(), s);
  CHECK(module_diff_bits(*m, *clean, second.tokens(), s) == 0);

  // A bad batch between good ones: refused, the good batch before it is no longer staged.
  const HostBatch bad = make_batch({10, 10}, {7, 7}, {false, false});
  m->begin_forward(second.view(), s);
  CHECK_THROWS_WITH_AS(m->begin_forward(bad.view(), s), doctest::Contains("two sequences may not share a cache line"),
                       kda::Error);
  for (int l = 0; l < 2; ++l)
    CHECK_THROWS_WITH_AS(m->run_layer(l, s), doctest::Contains("the last begin_forward failed (kda::PrefillModule::begin_forward"),
                         kda::Error);
  CHECK(module_diff_bits(*m, *clean, second.tokens(), s) == 0);
  const HostBatch third = make_batch({12, 250}, {8, 9}, {false, false});
  for (PrefillModule* x : {m.get(), clean.get()}) {
    fill_hidden(*x, third.tokens(), 7, s);
    x->run(third.view(), s);
  }
  CHECK(module_diff_bits(*m, *clean, third.tokens(), s) == 0);
}

TEST_CASE("a lazy capture that fails half way marks the batch failed and names the layers and windows written") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = tiny_config();  // largest bucket 256: three windows for 600 rows
  auto m = make_module(cfg, 41);
  auto clean = make_module(cfg, 41);
  FaultyStep faulty;
  // Recordings in order: layer 0 windows 0, 1, 2, then layer 1 window 0 (the fourth).
  faulty.throw_at = 4;
  m->add_step(faulty);
  const HostBatch b = three_window_batch(1, false);
  for (PrefillModule* x : {m.get(), clean.get()}) fill_hidden(*x, b.tokens(), 8, s);
  const Dims d = dims(cfg);
  const std::size_t conv_line = static_cast<std::size_t>(3 * d.P * 3) * 4, rec_line = static_cast<std::size_t>(d.H * 128 * 128) * 4;
  const auto conv1_before = conv_pool(*m, 1, s), rec1_before = rec_pool(*m, 1, s);

  m->begin_forward(b.view(), s);
  m->run_layer(0, s);
  const std::string why = error_message([&] { m->run_layer(1, s); });
  CHECK(why.find("layer 1 window 0 failed: ") != std::string::npos);
  CHECK(why.find("user step 0 threw: refused while recording") != std::string::npos);
  CHECK(why.find("written: layer 0: windows 0-2 (rows 0-599, all of the batch); layer 1: window 0 (rows 0-255)") !=
        std::string::npos);
  CHECK(why.find("may be partly written") == std::string::npos);  // window 0 ran before its capture failed
  for (int l = 0; l < 2; ++l)
    CHECK_THROWS_WITH_AS(m->run_layer(l, s), doctest::Contains("this batch can no longer run: run_layer(1) failed in window 0"),
                         kda::Error);

  // What the error says is what the pools hold: layer 0 in full, layer 1 for the sequences of
  // window 0 only (a sequence across windows 0 and 1 holds its state at row 255, compared with
  // neither), nothing of layer 1 for sequences after it.
  clean->run(b.view(), s);
  const auto conv1 = conv_pool(*m, 1, s), rec1 = rec_pool(*m, 1, s);
  const auto conv1_clean = conv_pool(*clean, 1, s), rec1_clean = rec_pool(*clean, 1, s);
  CHECK(diff_bits(conv_pool(*m, 0, s).data(), conv_pool(*clean, 0, s).data(), conv1.size()) == 0);
  CHECK(diff_bits(rec_pool(*m, 0, s).data(), rec_pool(*clean, 0, s).data(), rec1.size()) == 0);
  for (int32_t line : {1, 2}) {  // sequences 0 and 1: all their rows are in window 0
    CAPTURE(line);
    CHECK(line_of(conv1, line, conv_line) == line_of(conv1_clean, line, conv_line));
    CHECK(line_of(rec1, line, rec_line) == line_of(rec1_clean, line, rec_line));
  }
  for (int32_t line : {4, 5, 6}) {  // sequences 3, 4, 5 start after window 0
    CAPTURE(line);
    CHECK(line_of(conv1, line, conv_line) == line_of(conv1_before, line, conv_line));
    CHECK(line_of(rec1, line, rec_line) == line_of(rec1_before, line, rec_line));
  }

  // The server drops those lines and goes on with other ones: the next batch gives the clean
  // module's bits (its graphs are recorded now that the step no longer throws).
  const HostBatch next = three_window_batch(10, false);
  for (PrefillModule* x : {m.get(), clean.get()}) {
    fill_hidden(*x, next.tokens(), 9, s);
    x->run(next.view(), s);
  }
  CHECK(batch_diff_bits(*m, *clean, next, s) == 0);
  CHECK(faulty.counts->thrown);
}

TEST_CASE("a step that throws in an eager run fails the batch, naming the window that may be partly written") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = tiny_config();
  auto m = make_module(cfg, 43, /*eager=*/true);
  auto clean = make_module(cfg, 43, /*eager=*/true);
  FaultyStep faulty;
  faulty.throw_at_eager = 5;  // layer 1 window 1
  m->add_step(faulty);
  const HostBatch b = three_window_batch(1, false);
  for (PrefillModule* x : {m.get(), clean.get()}) fill_hidden(*x, b.tokens(), 10, s);
  m->begin_forward(b.view(), s);
  m->run_layer(0, s);
  const std::string why = error_message([&] { m->run_layer(1, s); });
  CHECK(why.find("user step 0 threw: refused in an eager run") != std::string::npos);
  CHECK(why.find("written: layer 0: windows 0-2 (rows 0-599, all of the batch); layer 1: window 0 (rows 0-255); "
                 "layer 1 window 1 may be partly written") != std::string::npos);
  CHECK_THROWS_WITH_AS(m->run_layer(1, s), doctest::Contains("this batch can no longer run"), kda::Error);
  const HostBatch next = three_window_batch(10, false);
  for (PrefillModule* x : {m.get(), clean.get()}) {
    fill_hidden(*x, next.tokens(), 11, s);
    x->run(next.view(), s);
  }
  CHECK(batch_diff_bits(*m, *clean, next, s) == 0);
}

TEST_CASE("a step that throws in profile_steps fails the batch as in run_layer") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = tiny_config();
  auto m = make_module(cfg, 45);
  FaultyStep faulty;
  faulty.throw_at_eager = 2;  // layer 0 window 1 (profile_steps runs the steps eagerly)
  m->add_step(faulty);
  const HostBatch b = three_window_batch(1, false);
  fill_hidden(*m, b.tokens(), 12, s);
  const std::string why = error_message([&] { m->profile_steps(b.view(), 0, s); });
  CHECK(why.find("layer 0 window 1 failed: ") != std::string::npos);
  CHECK(why.find("user step 0 threw: refused in an eager run") != std::string::npos);
  CHECK(why.find("written: layer 0: window 0 (rows 0-255); layer 0 window 1 may be partly written") !=
        std::string::npos);
  for (int layer : {0, 1})
    CHECK_THROWS_WITH_AS(m->run_layer(layer, s),
                         doctest::Contains("this batch can no longer run: profile_steps(0) failed in window 1"),
                         kda::Error);
  const HostBatch next = three_window_batch(10, false);
  fill_hidden(*m, next.tokens(), 13, s);
  CHECK_NOTHROW(m->run(next.view(), s));
  CHECK(faulty.counts->thrown);
}

TEST_CASE("external pools that share bytes with each other, another layer's pools or module buffers are refused") {
  Stream stream;
  const cudaStream_t s = stream.get();
  kda::Config cfg = tiny_config();
  cfg.pools.external = true;
  PrefillModule m(cfg);
  m.init_random_weights(51);
  const int64_t lines = cfg.pools.cache_lines;
  const std::size_t conv_bytes = static_cast<std::size_t>(lines * cfg.conv_line_elems()) * 4;
  const std::size_t rec_bytes = static_cast<std::size_t>(lines * cfg.recurrent_line_elems()) * 4;
  DeviceBuffer arena(2 * (conv_bytes + rec_bytes));
  char* base = arena.as<char>();
  auto pools_at = [&](void* conv, void* rec) {
    kda::StatePools p;
    p.conv = conv;
    p.recurrent = rec;
    p.lines = lines;
    return p;
  };
  // The conv pool reaching into the recurrent pool.
  CHECK_THROWS_WITH_AS(m.set_layer_pools(0, pools_at(base, base + conv_bytes - 64)),
                       doctest::Contains("layer 0 pools.conv ["), kda::Error);
  CHECK_THROWS_WITH_AS(m.set_layer_pools(0, pools_at(base, base + conv_bytes - 64)),
                       doctest::Contains("overlaps layer 0 pools.recurrent ["), kda::Error);
  CHECK(m.state_pools(0).conv == nullptr);
  // Layer 0 well placed; layer 1's conv pool inside layer 0's recurrent pool.
  m.set_layer_pools(0, pools_at(base, base + conv_bytes));
  char* after0 = base + conv_bytes + rec_bytes;
  CHECK_THROWS_WITH_AS(m.set_layer_pools(1, pools_at(base + conv_bytes + 4096, after0)),
                       doctest::Contains("layer 1 pools.conv [") , kda::Error);
  CHECK_THROWS_WITH_AS(m.set_layer_pools(1, pools_at(base + conv_bytes + 4096, after0)),
                       doctest::Contains("overlaps layer 0 pools.recurrent"), kda::Error);
  // Pools on the module's own buffers.
  CHECK_THROWS_WITH_AS(m.set_layer_pools(1, pools_at(m.hidden_states(), after0)),
                       doctest::Contains("overlaps the module's hidden_states()"), kda::Error);
  CHECK_THROWS_WITH_AS(m.set_layer_pools(1, pools_at(after0, const_cast<void*>(m.conv_planes()))),
                       doctest::Contains("layer 1 pools.recurrent ["), kda::Error);
  CHECK(m.state_pools(1).conv == nullptr);
  CHECK(m.state_pools(0).conv == base);
  // Replacing layer 0's pools by ones in the same memory is no overlap with themselves.
  CHECK_NOTHROW(m.set_layer_pools(0, pools_at(base, base + conv_bytes)));

  // Interleaved pools: each line's conv part and recurrent part side by side, as a server's
  // paged cache may hold them. No byte is shared, so they are accepted and run as any pools.
  const int64_t page = cfg.conv_line_elems() + cfg.recurrent_line_elems();
  DeviceBuffer pages(static_cast<std::size_t>(lines * page) * 4);
  KDA_TEST_CUDA(cudaMemset(pages.get(), 0, pages.bytes()));
  kda::StatePools inter = pools_at(pages.get(), pages.as<float>() + cfg.conv_line_elems());
  inter.conv_line_stride = page;
  inter.recurrent_line_stride = page;
  CHECK_NOTHROW(m.set_layer_pools(1, inter));
  const HostBatch b = make_batch({50, 300}, {1, 2}, {false, false});
  fill_hidden(m, b.tokens(), 12, s);
  const kda::SelfCheckReport r = m.self_check(b.view(), s);
  MESSAGE(r.detail);
  CHECK(r.ok);
}

TEST_CASE("pools swapped for new memory between forwards: replays write only the new pools") {
  Stream stream;
  const cudaStream_t s = stream.get();
  kda::Config ext = tiny_config();
  ext.pools.external = true;
  PrefillModule m(ext);
  m.init_random_weights(61);
  auto clean = make_module(tiny_config(), 61);
  std::vector<std::unique_ptr<ExternalPools>> old_pools, new_pools;
  for (int l = 0; l < 2; ++l) {
    old_pools.push_back(std::make_unique<ExternalPools>(ext, 8, 16));
    m.set_layer_pools(l, old_pools[l]->view);
  }
  const HostBatch a = make_batch({90, 200, 17}, {3, 4, 5}, {false, false, false});
  const HostBatch b = make_batch({60, 140}, {3, 5}, {true, true});
  for (const HostBatch* batch : {&a, &a}) {  // the second forward replays the graphs
    for (PrefillModule* x : {&m, clean.get()}) {
      fill_hidden(*x, batch->tokens(), 13, s);
      x->run(batch->view(), s);
    }
  }
  // The server moves every line into new memory (other gaps) and frees the old pools.
  KDA_TEST_CUDA(cudaStreamSynchronize(s));
  for (int l = 0; l < 2; ++l) {
    new_pools.push_back(std::make_unique<ExternalPools>(ext, 24, 0));
    int64_t gaps = 0;
    const auto conv = old_pools[l]->packed_conv(&gaps), rec = old_pools[l]->packed_recurrent(&gaps);
    CHECK(gaps == 0);
    const auto& nv = new_pools[l]->view;
    KDA_TEST_CUDA(cudaMemcpy2D(nv.conv, nv.conv_line_stride * 4, conv.data(), ext.conv_line_elems() * 4,
                               ext.conv_line_elems() * 4, ext.pools.cache_lines, cudaMemcpyHostToDevice));
    KDA_TEST_CUDA(cudaMemcpy2D(nv.recurrent, nv.recurrent_line_stride * 4, rec.data(), ext.recurrent_line_elems() * 4,
                               ext.recurrent_line_elems() * 4, ext.pools.cache_lines, cudaMemcpyHostToDevice));
    m.set_layer_pools(l, nv);
  }
  // The old pools stay allocated here, poisoned, to show that nothing writes them any more.
  std::vector<std::vector<unsigned char>> old_bytes;
  for (auto& p : old_pools) {
    p->conv.fill_bytes(0x5A);
    p->rec.fill_bytes(0x5A);
    old_bytes.push_back(p->conv.download_as<unsigned char>());
    old_bytes.push_back(p->rec.download_as<unsigned char>());
  }
  for (PrefillModule* x : {&m, clean.get()}) {
    fill_hidden(*x, b.tokens(), 14, s);
    x->run(b.view(), s);
    fill_hidden(*x, b.tokens(), 15, s);
    x->run(b.view(), s);
  }
  KDA_TEST_CUDA(cudaStreamSynchronize(s));
  for (int l = 0; l < 2; ++l) {
    CAPTURE(l);
    CHECK(old_pools[l]->conv.download_as<unsigned char>() == old_bytes[2 * l]);
    CHECK(old_pools[l]->rec.download_as<unsigned char>() == old_bytes[2 * l + 1]);
    int64_t gaps = 0;
    const auto conv = new_pools[l]->packed_conv(&gaps), rec = new_pools[l]->packed_recurrent(&gaps);
    CHECK(gaps == 0);
    CHECK(diff_bits(conv.data(), conv_pool(*clean, l, s).data(), conv.size()) == 0);
    CHECK(diff_bits(rec.data(), rec_pool(*clean, l, s).data(), rec.size()) == 0);
  }
  // The pools in use freed and replaced outright: the graphs re-record on the new pointers.
  for (int l = 0; l < 2; ++l) {
    new_pools[l].reset();
    new_pools[l] = std::make_unique<ExternalPools>(ext, 0, 0);
    m.set_layer_pools(l, new_pools[l]->view);
  }
  const HostBatch fresh = make_batch({30, 30}, {7, 8}, {false, false});
  fill_hidden(m, fresh.tokens(), 16, s);
  const kda::SelfCheckReport r = m.self_check(fresh.view(), s);
  CHECK(r.ok);
}

TEST_CASE("a failed allocation at construction names the buffer, leaks nothing, and later modules work") {
  Stream stream;
  const cudaStream_t s = stream.get();
  std::size_t free_mem = 0, total = 0;
  KDA_TEST_CUDA(cudaMemGetInfo(&free_mem, &total));
  kda::Config huge = tiny_config();
  // Recurrent lines of 2 heads are 128 KiB: more lines than the device holds.
  huge.pools.cache_lines = static_cast<int64_t>(total / (128 * 1024)) + 1024;
  // One clean construct/destroy first: kernel modules load lazily and stay.
  auto cycle = [&](uint64_t seed) {
    auto m = make_module(tiny_config(), seed);
    const HostBatch b = make_batch({20, 100}, {1, 2}, {false, true});
    fill_hidden(*m, b.tokens(), seed, s);
    m->run(b.view(), s);
    m->run(b.view(), s);
    KDA_TEST_CUDA(cudaStreamSynchronize(s));
  };
  cycle(1);
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  {
    // The constructor takes at least what kda::module_memory's table says (cudaMalloc rounds up).
    int device = 0, sms = 0;
    KDA_TEST_CUDA(cudaGetDevice(&device));
    KDA_TEST_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    std::size_t table = 0, before = 0, after = 0;
    for (const kda::ModuleAllocation& a : kda::module_memory(tiny_config(), sms))
      if (!a.pinned_host) table += a.bytes * static_cast<std::size_t>(a.count);
    KDA_TEST_CUDA(cudaMemGetInfo(&before, &total));
    {
      const kda::PrefillModule m(tiny_config());
      KDA_TEST_CUDA(cudaMemGetInfo(&after, &total));
    }
    MESSAGE("module_memory's device total ", table, " B; construction took ", before - after, " B");
    CHECK(before - after >= table);
  }
  std::size_t free_before = 0;
  KDA_TEST_CUDA(cudaMemGetInfo(&free_before, &total));
  CHECK_THROWS_WITH_AS(kda::PrefillModule{huge}, doctest::Contains("for recurrent-state pool failed: cudaErrorMemoryAllocation"),
                       kda::Error);
  KDA_TEST_CUDA(cudaGetLastError());  // the failure left no error behind
  const int cycles = quick_mode() ? 10 : 100;
  for (int i = 0; i < cycles; ++i) {
    if (i % 10 == 5) CHECK_THROWS_AS(kda::PrefillModule{huge}, kda::Error);
    cycle(2 + i);
  }
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  std::size_t free_after = 0;
  KDA_TEST_CUDA(cudaMemGetInfo(&free_after, &total));
  MESSAGE("free device memory before ", free_before, " B, after ", cycles, " construct/run/destroy cycles and ",
          cycles / 10, " failed constructions ", free_after, " B");
  CHECK(free_after == free_before);

  // A module made after all that gives a clean module's bits.
  auto a = make_module(tiny_config(), 77), b = make_module(tiny_config(), 77);
  const HostBatch batch = three_window_batch(3, false);
  for (PrefillModule* x : {a.get(), b.get()}) {
    fill_hidden(*x, batch.tokens(), 17, s);
    x->run(batch.view(), s);
  }
  CHECK(module_diff_bits(*a, *b, batch.tokens(), s) == 0);
}

TEST_CASE("a module works on its own device whatever device is current, and refuses another device's stream") {
  int devices = 0;
  KDA_TEST_CUDA(cudaGetDeviceCount(&devices));
  if (devices < 2) {
    MESSAGE("one CUDA device: the two-device case needs a second one (the guard's bookkeeping is tested on the CPU)");
    return;
  }
  KDA_TEST_CUDA(cudaSetDevice(0));
  cudaStream_t s0 = nullptr, s1 = nullptr;
  KDA_TEST_CUDA(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  auto m = make_module(tiny_config(), 81);
  auto clean = make_module(tiny_config(), 81);
  const HostBatch b = three_window_batch(1, false);
  fill_hidden(*m, b.tokens(), 18, s0);
  fill_hidden(*clean, b.tokens(), 18, s0);
  clean->run(b.view(), s0);
  KDA_TEST_CUDA(cudaSetDevice(1));
  KDA_TEST_CUDA(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  m->run(b.view(), s0);  // every call on device 0, the caller's device 1 given back
  int current = -1;
  KDA_TEST_CUDA(cudaGetDevice(&current));
  CHECK(current == 1);
  CHECK_THROWS_WITH_AS(m->begin_forward(b.view(), s1),
                       doctest::Contains("the stream belongs to CUDA device 1, the module to device 0"), kda::Error);
  KDA_TEST_CUDA(cudaGetDevice(&current));
  CHECK(current == 1);
  KDA_TEST_CUDA(cudaSetDevice(0));
  CHECK(module_diff_bits(*m, *clean, b.tokens(), s0) == 0);
  KDA_TEST_CUDA(cudaSetDevice(1));
  m.reset();  // destroyed on device 0 while device 1 is current
  KDA_TEST_CUDA(cudaGetDevice(&current));
  CHECK(current == 1);
  KDA_TEST_CUDA(cudaStreamDestroy(s1));
  KDA_TEST_CUDA(cudaSetDevice(0));
  clean.reset();
  KDA_TEST_CUDA(cudaStreamDestroy(s0));
}
