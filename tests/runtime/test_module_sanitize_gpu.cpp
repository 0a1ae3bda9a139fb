// One module forward of every kind for compute-sanitizer (scripts/gpu_suite.sh runs it under
// memcheck, racecheck and synccheck): graphs on and off, two layers, state checkpoints,
// external pools with gaps, and a sequence the chunked recurrence cuts into segments. Without a
// tool it checks that graph replay equals eager launches (self_check).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "kda/config.h"
#include "kda/prefill.h"
#include "recurrence/kda_chunked.h"
#include "support/external_pools.h"
#include "support/gpu_buffers.h"
#include "support/host_batch.h"
#include "support/module_fixture.h"

using namespace kda::test;

TEST_CASE("a forward with checkpoints, external pools and a cut sequence, graphs on and off") {
  Stream stream;
  const cudaStream_t s = stream.get();
  // Two heads and a largest bucket of 4096 rows: long sequences are cut into segments.
  const int64_t segment = kda::kda_chunked_auto_segment_tokens(4096, 2);
  MESSAGE("segment length at 2 heads, largest bucket 4096: ", segment, " tokens");
  REQUIRE(segment > 0);
  REQUIRE(segment < 3000);
  for (bool graphs : {true, false}) {
    CAPTURE(graphs);
    kda::Config c = tiny_config();
    c.runtime.token_buckets = {256, 4096};
    c.runtime.max_batch_tokens = 8192;
    c.runtime.max_checkpoints = 8;
    c.runtime.use_graphs = graphs;
    c.pools.external = true;
    kda::PrefillModule m(c);
    std::vector<std::unique_ptr<ExternalPools>> pools;
    for (int l = 0; l < 2; ++l) {
      pools.push_back(std::make_unique<ExternalPools>(c, 8, 16));
      m.set_layer_pools(l, pools[l]->view);
    }
    m.init_random_weights(3);
    // A 3000-row sequence (cut) with checkpoints every 1024 rows, a short one, one with a
    // checkpoint every 512 rows; then the long one continues in a batch of two windows.
    HostBatch first = make_batch({3000, 40, 900}, {1, 2, 3}, {false, false, false});
    first.set_checkpoints(0, 1024, {10, 11});
    first.set_checkpoints(2, 512, {12});
    const HostBatch second = make_batch({4096, 700, 30}, {1, 4, 3}, {true, false, true});
    fill_hidden(m, first.tokens(), 1, s);
    m.run(first.view(), s);
    fill_hidden(m, second.tokens(), 2, s);
    m.run(second.view(), s);
    m.run(second.view(), s);  // replays (graphs on)
    const kda::SelfCheckReport r = m.self_check(second.view(), s);
    MESSAGE(r.detail);
    CHECK(r.ok);
    KDA_TEST_CUDA(cudaStreamSynchronize(s));
    for (const auto& p : pools) CHECK(p->gap_bytes_written() == 0);
  }
}
