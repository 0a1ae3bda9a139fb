// kda::module_memory on the CPU: the table of what the constructor allocates, against formulas
// of the config written out here, and against docs/design.md's table of the module's objects.
#include <doctest/doctest.h>

#include <cstdint>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kda/config.h"
#include "kda/error.h"
#include "kda/prefill.h"
#include "recurrence/kda_chunked.h"
#include "support/test_errors.h"

namespace {

kda::Config serving() {
  kda::Config c;
  c.model.hidden_size = 2304;
  c.model.num_heads = 2;  // few heads: long sequences are cut on 132 SMs
  c.runtime.token_buckets = {1024, 16384};
  c.runtime.max_batch_tokens = 40000;  // 3 windows
  c.runtime.max_seqs = 64;
  c.runtime.max_checkpoints = 16;
  c.runtime.num_layers = 3;
  c.pools.cache_lines = 65;
  return c;
}

const kda::ModuleAllocation* find(const std::vector<kda::ModuleAllocation>& t, const std::string& name) {
  for (const auto& a : t)
    if (a.name == name) return &a;
  return nullptr;
}

std::size_t bytes_of(const std::vector<kda::ModuleAllocation>& t, const std::string& name) {
  const kda::ModuleAllocation* a = find(t, name);
  return a ? a->bytes : 0;
}

// The first column of the table under "## The objects" in docs/design.md.
std::set<std::string> design_rows() {
  std::ifstream f(kda::test::source_path("docs/design.md"));
  REQUIRE(f.good());
  std::set<std::string> rows;
  std::string line;
  bool in_table = false;
  while (std::getline(f, line)) {
    if (line.rfind("| allocation | shape |", 0) == 0) {
      in_table = true;
      continue;
    }
    if (!in_table) continue;
    if (line.rfind("| ---", 0) == 0) continue;
    if (line.rfind("|", 0) != 0) break;
    const std::size_t end = line.find('|', 1);
    std::string name = line.substr(1, end - 1);
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
    rows.insert(name);
  }
  return rows;
}

}  // namespace

TEST_CASE("module_memory sizes every allocation from the config") {
  const kda::Config c = serving();
  const auto t = kda::module_memory(c, 132);
  const int64_t D = 2304, P = 256, B = 16384, windows = 3, capacity = 40000;
  CHECK(bytes_of(t, "hidden states") == static_cast<std::size_t>(windows * B * D * 2));
  CHECK(bytes_of(t, "layer output") == static_cast<std::size_t>(windows * B * D * 2));
  CHECK(bytes_of(t, "in_proj output") == static_cast<std::size_t>(B * c.model.in_proj_stride() * 2));
  CHECK(bytes_of(t, "conv planes") == static_cast<std::size_t>((2 * capacity + windows * B) * P * 2));
  for (const char* s : {"g1 scratch", "g2 scratch", "recurrence output scratch", "gated RMSNorm output scratch"})
    CHECK(bytes_of(t, s) == static_cast<std::size_t>(B * P * 2));
  CHECK(bytes_of(t, "cuBLASLt workspace") == static_cast<std::size_t>(c.runtime.gemm_workspace_bytes));
  // Records for (B / 64 + max_seqs) chunk slots x H, and (cut at 2 heads) the segment states.
  const std::size_t records = static_cast<std::size_t>((B / 64 + 64) * 2) * 90624;
  CHECK(bytes_of(t, "chunked recurrence workspace") > records);
  kda::Config whole = c;
  whole.runtime.sequence_parallel = false;
  CHECK(bytes_of(kda::module_memory(whole, 132), "chunked recurrence workspace") == records);
  CHECK(bytes_of(kda::module_memory(c, 0), "chunked recurrence workspace") == records);  // no SMs: no cut
  const kda::ModuleAllocation* conv = find(t, "conv-state pool");
  const kda::ModuleAllocation* rec = find(t, "recurrent-state pool");
  REQUIRE(conv);
  REQUIRE(rec);
  CHECK(conv->bytes == static_cast<std::size_t>(65 * 3 * P * 3) * 4);
  CHECK(rec->bytes == static_cast<std::size_t>(65 * 2 * 128 * 128) * 4);
  CHECK(conv->count == 3);
  CHECK(rec->count == 3);
  const kda::ModuleAllocation* host = find(t, "host metadata staging");
  REQUIRE(host);
  CHECK(host->pinned_host);
  CHECK(host->count == 4);
  CHECK(host->bytes == bytes_of(t, "metadata staging"));
  CHECK(bytes_of(t, "metadata staging") % (3 * 16) == 0);
  for (const auto& a : t) {
    CAPTURE(a.name);
    CHECK(a.bytes > 0);
    CHECK_FALSE(a.size.empty());
  }
}

TEST_CASE("module_memory leaves out what a config does not allocate") {
  kda::Config c = serving();
  c.pools.external = true;
  c.runtime.layer_steps = kda::LayerSteps::InProjConv;
  const auto t = kda::module_memory(c, 132);
  for (const char* s : {"conv-state pool", "recurrent-state pool", "g1 scratch", "g2 scratch",
                        "recurrence output scratch", "gated RMSNorm output scratch", "chunked recurrence workspace"})
    CHECK(find(t, s) == nullptr);
  c.runtime.layer_steps = kda::LayerSteps::Full;
  c.runtime.recurrence = kda::Recurrence::TokenByToken;
  const auto token = kda::module_memory(c, 132);
  CHECK(find(token, "chunked recurrence workspace") == nullptr);
  CHECK(find(token, "recurrence output scratch") != nullptr);
}

TEST_CASE("docs/design.md's table of objects names exactly module_memory's allocations") {
  std::set<std::string> names;
  for (const auto& a : kda::module_memory(serving(), 132)) names.insert(a.name);
  const std::set<std::string> documented = design_rows();
  for (const std::string& n : names) CHECK_MESSAGE(documented.count(n), "not in docs/design.md: ", n);
  for (const std::string& n : documented) CHECK_MESSAGE(names.count(n), "in docs/design.md only: ", n);
}

TEST_CASE("module_memory refuses an invalid config and a negative SM count") {
  kda::Config c = serving();
  CHECK_THROWS_AS(kda::module_memory(c, -1), kda::Error);
  c.runtime.token_buckets = {};
  CHECK_THROWS_AS(kda::module_memory(c, 132), kda::Error);
}
