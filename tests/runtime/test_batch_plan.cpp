#include "runtime/batch_plan.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kda/error.h"

using kda::BatchView;
using kda::Config;
using kda::detail::BatchValidator;
using kda::detail::StagingLayout;
using kda::detail::WindowPlan;

namespace {

Config make_config(std::vector<int64_t> buckets, int64_t max_batch_tokens, int64_t max_seqs,
                   int64_t cache_lines, int32_t null_line = 0) {
  Config config;
  config.model.hidden_size = 256;
  config.model.num_heads = 2;
  config.runtime.token_buckets = std::move(buckets);
  config.runtime.max_batch_tokens = max_batch_tokens;
  config.runtime.max_seqs = max_seqs;
  config.pools.cache_lines = cache_lines;
  config.pools.null_line = null_line;
  return config;
}

// The serving shape: 256 sequences, pools of 513 lines, batches up to 4 windows of 16384.
Config serving_config() {
  return make_config({512, 1024, 2048, 4096, 8192, 16384}, 65536, 256, 513);
}

// Owns a batch's arrays; view() points into them.
struct Batch {
  std::vector<int32_t> qsl{0};
  std::vector<int32_t> cache;
  std::vector<unsigned char> flags;  // bool storage that vector<bool> would not give
  int64_t num_seqs_override = -2;    // -2: use the real count

  void add(int32_t length, int32_t line, bool initial = false) {
    qsl.push_back(qsl.back() + length);
    cache.push_back(line);
    flags.push_back(initial ? 1 : 0);
  }
  int64_t num_seqs() const { return static_cast<int64_t>(cache.size()); }
  int32_t start(int64_t s) const { return qsl[static_cast<std::size_t>(s)]; }
  int32_t end(int64_t s) const { return qsl[static_cast<std::size_t>(s) + 1]; }
  BatchView view() const {
    BatchView v;
    v.query_start_loc = qsl.data();
    v.cache_indices = cache.data();
    v.has_initial_state = reinterpret_cast<const bool*>(flags.data());
    v.num_seqs = num_seqs_override == -2 ? num_seqs() : num_seqs_override;
    return v;
  }
};

// Sequences of the given lengths on lines 1, 2, 3, ... without initial state.
Batch batch_of_lengths(const std::vector<int32_t>& lengths) {
  Batch b;
  int32_t line = 1;
  for (int32_t len : lengths) b.add(len, line++);
  return b;
}

// One window slot as the module stages it, with typed views of its arrays.
struct Slot {
  const StagingLayout layout;
  const int64_t max_seqs;
  std::vector<unsigned char> bytes;
  explicit Slot(int64_t m) : layout(StagingLayout::for_max_seqs(m)), max_seqs(m),
                             bytes(layout.slot_bytes) {}
  int32_t qsl(int64_t i) const { return read<int32_t>(layout.qsl_offset, i); }
  int32_t cache(int64_t i) const { return read<int32_t>(layout.cache_offset, i); }
  bool flag(int64_t i) const { return bytes[layout.flags_offset + static_cast<std::size_t>(i)] != 0; }

 private:
  template <typename T>
  T read(std::size_t offset, int64_t i) const {
    T value;
    std::memcpy(&value, bytes.data() + offset + static_cast<std::size_t>(i) * sizeof(T), sizeof(T));
    return value;
  }
};

// What begin_forward does on the host: validate, plan, then fill one slot per window of one
// contiguous staging buffer (the one the module copies to the device in one go).
void stage_forward(BatchValidator& validator, const BatchView& batch, const Config& config,
                   const StagingLayout& layout, std::vector<WindowPlan>& windows,
                   std::vector<unsigned char>& staging) {
  validator.validate(batch);
  kda::detail::plan_windows(batch, config, windows);
  for (std::size_t w = 0; w < windows.size(); ++w) {
    kda::detail::fill_window_staging(batch, windows[w], config, layout,
                                     staging.data() + w * layout.slot_bytes);
  }
}

// Checks a batch with the free function and with a (reused) BatchValidator; both must agree.
void check_rejects(const Batch& batch, const Config& config, const std::string& message) {
  const BatchView view = batch.view();
  CHECK_THROWS_WITH_AS(kda::detail::validate_batch(view, config), doctest::Contains(message.c_str()),
                       kda::Error);
  BatchValidator validator(config);
  CHECK_THROWS_WITH_AS(validator.validate(view), doctest::Contains(message.c_str()), kda::Error);
}

// The window rule stated independently of plan_windows' single pass: membership per
// (sequence, window) pair.
std::vector<WindowPlan> naive_windows(const Batch& batch, const Config& config) {
  std::vector<WindowPlan> out;
  const int64_t total = batch.qsl.back();
  const int64_t width = config.runtime.largest_bucket();
  const int64_t count = (total + width - 1) / width;
  for (int64_t w = 0; w < count; ++w) {
    const int64_t begin = w * width;
    const int64_t end = std::min(begin + width, total);
    std::vector<int64_t> members;
    for (int64_t s = 0; s < batch.num_seqs(); ++s) {
      const int64_t a = batch.start(s), b = batch.end(s);
      const bool overlaps = a < end && b > begin;
      const bool empty_inside = a == b && a >= begin && (a < end || (w == count - 1 && a == total));
      if (overlaps || empty_inside) members.push_back(s);
    }
    WindowPlan plan;
    plan.token_offset = begin;
    plan.num_tokens = end - begin;
    plan.bucket = 0;
    for (int64_t bucket : config.runtime.token_buckets) {
      if (bucket >= plan.num_tokens) {
        plan.bucket = bucket;
        break;
      }
    }
    plan.first_seq = members.empty() ? -1 : members.front();
    plan.num_seqs = static_cast<int64_t>(members.size());
    for (std::size_t i = 0; i < members.size(); ++i) {
      REQUIRE_MESSAGE(members[i] == plan.first_seq + static_cast<int64_t>(i),
                      "window ", w, " members are not consecutive");
    }
    out.push_back(plan);
  }
  return out;
}

void check_same_plan(const std::vector<WindowPlan>& got, const std::vector<WindowPlan>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t w = 0; w < got.size(); ++w) {
    INFO("window ", w);
    CHECK(got[w].token_offset == want[w].token_offset);
    CHECK(got[w].num_tokens == want[w].num_tokens);
    CHECK(got[w].bucket == want[w].bucket);
    CHECK(got[w].first_seq == want[w].first_seq);
    CHECK(got[w].num_seqs == want[w].num_seqs);
  }
}

// The planning half of "windows run one after another == one unsplit run": the windows' local
// sequences, placed at their window offsets, give back every batch sequence's rows exactly
// once, each window's metadata is well formed and padded, and a sequence's later pieces
// continue from the state its earlier piece wrote.
void check_windows_reproduce_batch(const Batch& batch, const Config& config,
                                   const std::vector<WindowPlan>& windows,
                                   const std::vector<unsigned char>& staging,
                                   const StagingLayout& layout) {
  const int64_t total = batch.qsl.back();
  const int64_t max_seqs = config.runtime.max_seqs;
  const int32_t null_line = config.pools.null_line;
  std::vector<int> row_hits(static_cast<std::size_t>(total), 0);
  std::vector<int64_t> rows_of_seq(static_cast<std::size_t>(batch.num_seqs()), 0);
  std::vector<int> pieces_of_seq(static_cast<std::size_t>(batch.num_seqs()), 0);
  for (std::size_t w = 0; w < windows.size(); ++w) {
    INFO("window ", w);
    const WindowPlan& win = windows[w];
    Slot slot(max_seqs);
    std::memcpy(slot.bytes.data(), staging.data() + w * layout.slot_bytes, layout.slot_bytes);
    CHECK(slot.qsl(0) == 0);
    CHECK(slot.qsl(win.num_seqs) == win.num_tokens);
    for (int64_t i = win.num_seqs; i <= max_seqs; ++i) CHECK(slot.qsl(i) == win.num_tokens);
    for (int64_t i = win.num_seqs; i < max_seqs; ++i) {
      CHECK(slot.cache(i) == null_line);
      CHECK_FALSE(slot.flag(i));
    }
    for (int64_t i = 0; i < win.num_seqs; ++i) {
      const int64_t s = win.first_seq + i;
      INFO("local sequence ", i, " = batch sequence ", s);
      CHECK(slot.qsl(i) <= slot.qsl(i + 1));
      CHECK(slot.cache(i) == batch.cache[static_cast<std::size_t>(s)]);
      const bool started_earlier = batch.start(s) < win.token_offset;
      const bool on_null = batch.cache[static_cast<std::size_t>(s)] == null_line;
      const bool expected_flag =
          !on_null && (started_earlier || batch.flags[static_cast<std::size_t>(s)] != 0);
      CHECK(slot.flag(i) == expected_flag);
      if (started_earlier) CHECK(pieces_of_seq[static_cast<std::size_t>(s)] > 0);
      ++pieces_of_seq[static_cast<std::size_t>(s)];
      for (int64_t r = slot.qsl(i); r < slot.qsl(i + 1); ++r) {
        const int64_t row = win.token_offset + r;
        REQUIRE(row < total);
        CHECK(row >= batch.start(s));
        CHECK(row < batch.end(s));
        ++row_hits[static_cast<std::size_t>(row)];
        ++rows_of_seq[static_cast<std::size_t>(s)];
      }
    }
  }
  for (int64_t row = 0; row < total; ++row) {
    INFO("row ", row);
    CHECK(row_hits[static_cast<std::size_t>(row)] == 1);
  }
  for (int64_t s = 0; s < batch.num_seqs(); ++s) {
    INFO("batch sequence ", s);
    CHECK(rows_of_seq[static_cast<std::size_t>(s)] == batch.end(s) - batch.start(s));
    if (total > 0) CHECK(pieces_of_seq[static_cast<std::size_t>(s)] >= 1);
  }
}

}  // namespace

TEST_CASE("validation names the first problem of a batch and what was expected") {
  const Config config = serving_config();
  Batch good;
  for (int s = 0; s < 8; ++s) good.add(6, s + 1);
  REQUIRE_NOTHROW(kda::detail::validate_batch(good.view(), config));

  SUBCASE("a negative sequence count") {
    Batch b = good;
    b.num_seqs_override = -1;
    check_rejects(b, config, "num_seqs -1 must not be negative");
  }
  SUBCASE("more sequences than runtime.max_seqs") {
    Batch b;
    for (int s = 0; s < 300; ++s) b.add(1, s + 1);
    check_rejects(b, config, "num_seqs 300 exceeds runtime.max_seqs 256");
  }
  SUBCASE("a null query_start_loc") {
    Batch b = good;
    BatchView v = b.view();
    v.query_start_loc = nullptr;
    CHECK_THROWS_WITH_AS(kda::detail::validate_batch(v, config),
                         doctest::Contains("query_start_loc is null, expected 9 entries (num_seqs 8)"),
                         kda::Error);
  }
  SUBCASE("a null cache_indices") {
    BatchView v = good.view();
    v.cache_indices = nullptr;
    CHECK_THROWS_WITH_AS(kda::detail::validate_batch(v, config),
                         doctest::Contains("cache_indices is null, expected 8 entries (num_seqs 8)"),
                         kda::Error);
  }
  SUBCASE("a null has_initial_state") {
    BatchView v = good.view();
    v.has_initial_state = nullptr;
    BatchValidator validator(config);
    CHECK_THROWS_WITH_AS(validator.validate(v),
                         doctest::Contains("has_initial_state is null, expected 8 entries (num_seqs 8)"),
                         kda::Error);
  }
  SUBCASE("query_start_loc not starting at 0") {
    Batch b = good;
    for (auto& q : b.qsl) q += 4;
    check_rejects(b, config, "query_start_loc[0] must be 0, got 4");
  }
  SUBCASE("a decreasing query_start_loc") {
    Batch b = batch_of_lengths({5, 7, 0, 3});
    b.qsl = {0, 5, 12, 10, 13};
    check_rejects(b, config, "query_start_loc[3] = 10 < query_start_loc[2] = 12: must not decrease");
  }
  SUBCASE("more tokens than runtime.batch_token_capacity()") {
    Batch b = batch_of_lengths({30000, 30000, 10000});
    check_rejects(b, config, "batch has 70000 tokens, more than runtime.batch_token_capacity() 65536");
  }
  SUBCASE("the capacity is the largest bucket when max_batch_tokens is 0") {
    const Config small = make_config({512, 1024}, 0, 256, 513);
    check_rejects(batch_of_lengths({1000, 25}), small,
                  "batch has 1025 tokens, more than runtime.batch_token_capacity() 1024");
  }
  SUBCASE("a cache index past the pool") {
    Batch b = good;
    b.cache[5] = 600;
    check_rejects(b, config, "cache_indices[5] = 600 is outside the pool [0, 513)");
  }
  SUBCASE("a negative cache index") {
    Batch b = good;
    b.cache[2] = -1;
    check_rejects(b, config, "cache_indices[2] = -1 is outside the pool [0, 513)");
  }
  SUBCASE("two sequences on one real cache line") {
    Batch b = good;
    b.cache[2] = 9;
    b.cache[7] = 9;
    check_rejects(b, config,
                  "cache_indices[7] = 9 repeats cache_indices[2]: two sequences may not share a cache line");
  }
  SUBCASE("the first problem wins when there are several") {
    Batch b = good;
    b.cache[1] = 1;            // duplicate of sequence 0
    b.cache[3] = 9999;         // outside the pool
    b.qsl[5] = b.qsl[4] - 1;   // a decrease
    check_rejects(b, config, "query_start_loc[5] = 23 < query_start_loc[4] = 24: must not decrease");
    b.qsl = good.qsl;
    check_rejects(b, config, "cache_indices[3] = 9999 is outside the pool [0, 513)");
    b.cache[3] = 4;
    check_rejects(b, config, "cache_indices[1] = 1 repeats cache_indices[0]");
  }
}

TEST_CASE("validation errors come from begin_forward and carry the source location") {
  Batch b = batch_of_lengths({4});
  b.qsl = {2, 6};
  try {
    kda::detail::validate_batch(b.view(), serving_config());
    FAIL("validate_batch accepted query_start_loc[0] = 2");
  } catch (const kda::Error& e) {
    CHECK(e.function() == "kda::PrefillModule::begin_forward");
    CHECK(e.message() == "query_start_loc[0] must be 0, got 2");
    CHECK(std::string(e.what()).find("src/runtime/batch_plan.cpp:") != std::string::npos);
  }
}

TEST_CASE("validation accepts the null line repeated, empty batches and zero-length sequences") {
  const Config config = serving_config();
  BatchValidator validator(config);
  SUBCASE("sequences on the null line are skipped, so it may repeat") {
    Batch b;
    b.add(3, 0);
    b.add(2, 7);
    b.add(5, 0);
    b.add(0, 0);
    CHECK_NOTHROW(validator.validate(b.view()));
    CHECK_NOTHROW(kda::detail::validate_batch(b.view(), config));
  }
  SUBCASE("a non-zero null line may repeat, and line 0 is then a real line") {
    const Config other = make_config({512}, 0, 16, 9, 8);
    Batch b;
    b.add(3, 8);
    b.add(3, 8);
    b.add(3, 0);
    CHECK_NOTHROW(kda::detail::validate_batch(b.view(), other));
    b.add(1, 0);
    CHECK_THROWS_WITH_AS(kda::detail::validate_batch(b.view(), other),
                         doctest::Contains("cache_indices[3] = 0 repeats cache_indices[2]"), kda::Error);
  }
  SUBCASE("an empty batch needs no arrays") {
    BatchView v;
    CHECK_NOTHROW(validator.validate(v));
    CHECK_NOTHROW(kda::detail::validate_batch(v, config));
  }
  SUBCASE("exactly max_seqs sequences and exactly the capacity") {
    Batch b;
    for (int s = 0; s < 255; ++s) b.add(1, s + 1);
    b.add(65536 - 255, 300);
    REQUIRE(b.num_seqs() == 256);
    CHECK_NOTHROW(validator.validate(b.view()));
  }
  SUBCASE("a batch of only zero-length sequences") {
    Batch b = batch_of_lengths({0, 0, 0});
    CHECK_NOTHROW(validator.validate(b.view()));
  }
}

TEST_CASE("a reused BatchValidator forgets earlier batches, including rejected ones") {
  const Config config = serving_config();
  BatchValidator validator(config);
  Batch b = batch_of_lengths({3, 3, 3});
  b.cache = {9, 10, 11};
  for (int call = 0; call < 1000; ++call) REQUIRE_NOTHROW(validator.validate(b.view()));

  Batch dup = b;
  dup.cache = {12, 9, 9};
  CHECK_THROWS_WITH_AS(validator.validate(dup.view()),
                       doctest::Contains("cache_indices[2] = 9 repeats cache_indices[1]"), kda::Error);
  // The rejected call stamped lines 12 and 9; the next batch names them again and is valid.
  Batch again = b;
  again.cache = {9, 12, 13};
  CHECK_NOTHROW(validator.validate(again.view()));
  // The reported first index is from this call, not from an earlier one that used line 13.
  again.cache = {1, 13, 13};
  CHECK_THROWS_WITH_AS(validator.validate(again.view()),
                       doctest::Contains("cache_indices[2] = 13 repeats cache_indices[1]"), kda::Error);
}

TEST_CASE("a rejected batch stages nothing") {
  const Config config = serving_config();
  const StagingLayout layout = StagingLayout::for_max_seqs(config.runtime.max_seqs);
  const auto slots = static_cast<std::size_t>(kda::detail::max_windows(config));
  BatchValidator validator(config);
  std::vector<WindowPlan> windows;
  windows.reserve(slots);
  std::vector<unsigned char> staging(slots * layout.slot_bytes, 0xA5);
  const std::vector<unsigned char> pattern = staging;

  // Valid until the last sequence, which spans windows: a planner that ran before the check
  // finished would have staged the first windows already.
  Batch b;
  for (int s = 0; s < 20; ++s) b.add(1000, s + 1);
  b.add(30000, 5);
  const Batch before = b;

  CHECK_THROWS_WITH_AS(stage_forward(validator, b.view(), config, layout, windows, staging),
                       doctest::Contains("cache_indices[20] = 5 repeats cache_indices[4]"), kda::Error);
  CHECK(staging == pattern);
  CHECK(windows.empty());
  CHECK(b.qsl == before.qsl);
  CHECK(b.cache == before.cache);
  CHECK(b.flags == before.flags);

  // The same helper stages when the batch is fixed, so the check above can tell the difference.
  b.cache.back() = 500;
  REQUIRE_NOTHROW(stage_forward(validator, b.view(), config, layout, windows, staging));
  CHECK(windows.size() == 4);
  CHECK(staging != pattern);
}

TEST_CASE("choose_bucket picks the smallest bucket that holds the tokens") {
  const std::vector<int64_t> buckets{512, 1024, 4096, 16384};
  CHECK(kda::detail::choose_bucket(buckets, 1) == 512);
  CHECK(kda::detail::choose_bucket(buckets, 511) == 512);
  CHECK(kda::detail::choose_bucket(buckets, 512) == 512);
  CHECK(kda::detail::choose_bucket(buckets, 513) == 1024);
  CHECK(kda::detail::choose_bucket(buckets, 1024) == 1024);
  CHECK(kda::detail::choose_bucket(buckets, 1025) == 4096);
  CHECK(kda::detail::choose_bucket(buckets, 16383) == 16384);
  CHECK(kda::detail::choose_bucket(buckets, 16384) == 16384);
  CHECK(kda::detail::choose_bucket({7}, 7) == 7);

  SUBCASE("more tokens than the largest bucket") {
    CHECK_THROWS_WITH_AS(kda::detail::choose_bucket(buckets, 16385),
                         doctest::Contains("tokens 16385 exceed the largest bucket 16384"), kda::Error);
  }
  SUBCASE("no tokens") {
    CHECK_THROWS_WITH_AS(kda::detail::choose_bucket(buckets, 0),
                         doctest::Contains("tokens 0 must be at least 1"), kda::Error);
  }
  SUBCASE("no buckets") {
    CHECK_THROWS_WITH_AS(kda::detail::choose_bucket({}, 1),
                         doctest::Contains("runtime.token_buckets is empty"), kda::Error);
  }
}

TEST_CASE("max_windows is the capacity in largest buckets, rounded up") {
  CHECK(kda::detail::max_windows(make_config({512, 1024}, 0, 16, 9)) == 1);
  CHECK(kda::detail::max_windows(make_config({512, 1024}, 1024, 16, 9)) == 1);
  CHECK(kda::detail::max_windows(make_config({512, 1024}, 1025, 16, 9)) == 2);
  CHECK(kda::detail::max_windows(serving_config()) == 4);
  CHECK(kda::detail::max_windows(make_config({16384}, 50000, 16, 9)) == 4);
  CHECK_THROWS_WITH_AS(kda::detail::max_windows(make_config({}, 0, 16, 9)),
                       doctest::Contains("runtime.token_buckets has no positive bucket"), kda::Error);
}

TEST_CASE("a batch that fits the largest bucket is one window of the smallest fitting bucket") {
  const Config config = serving_config();
  std::vector<WindowPlan> windows;
  SUBCASE("several sequences") {
    Batch b = batch_of_lengths({100, 0, 400, 525});
    kda::detail::plan_windows(b.view(), config, windows);
    REQUIRE(windows.size() == 1);
    CHECK(windows[0].token_offset == 0);
    CHECK(windows[0].num_tokens == 1025);
    CHECK(windows[0].bucket == 2048);
    CHECK(windows[0].first_seq == 0);
    CHECK(windows[0].num_seqs == 4);
  }
  SUBCASE("one token") {
    kda::detail::plan_windows(batch_of_lengths({0, 1, 0}).view(), config, windows);
    REQUIRE(windows.size() == 1);
    CHECK(windows[0].num_tokens == 1);
    CHECK(windows[0].bucket == 512);
    CHECK(windows[0].num_seqs == 3);
  }
  SUBCASE("no tokens") {
    windows.resize(3);
    kda::detail::plan_windows(batch_of_lengths({0, 0}).view(), config, windows);
    CHECK(windows.empty());
    kda::detail::plan_windows(BatchView{}, config, windows);
    CHECK(windows.empty());
  }
}

TEST_CASE("a sequence longer than two windows is split across three, continuing in the later ones") {
  const Config config = serving_config();
  const StagingLayout layout = StagingLayout::for_max_seqs(config.runtime.max_seqs);
  std::vector<WindowPlan> windows;
  // Rows: seq0 [0, 100), seq1 [100, 40100) spans windows 0, 1, 2; seq2 [40100, 40200).
  Batch b;
  b.add(100, 3, true);
  b.add(40000, 4, false);
  b.add(100, 5, false);
  kda::detail::plan_windows(b.view(), config, windows);
  REQUIRE(windows.size() == 3);
  CHECK(windows[0].first_seq == 0);
  CHECK(windows[0].num_seqs == 2);
  CHECK(windows[0].bucket == 16384);
  CHECK(windows[1].first_seq == 1);
  CHECK(windows[1].num_seqs == 1);
  CHECK(windows[1].token_offset == 16384);
  CHECK(windows[2].first_seq == 1);
  CHECK(windows[2].num_seqs == 2);
  CHECK(windows[2].token_offset == 32768);
  CHECK(windows[2].num_tokens == 40200 - 32768);
  CHECK(windows[2].bucket == 8192);

  std::vector<unsigned char> staging(3 * layout.slot_bytes);
  for (std::size_t w = 0; w < 3; ++w) {
    kda::detail::fill_window_staging(b.view(), windows[w], config, layout,
                                     staging.data() + w * layout.slot_bytes);
  }
  Slot s0(256), s1(256), s2(256);
  std::memcpy(s0.bytes.data(), staging.data(), layout.slot_bytes);
  std::memcpy(s1.bytes.data(), staging.data() + layout.slot_bytes, layout.slot_bytes);
  std::memcpy(s2.bytes.data(), staging.data() + 2 * layout.slot_bytes, layout.slot_bytes);
  CHECK(s0.qsl(0) == 0);
  CHECK(s0.qsl(1) == 100);
  CHECK(s0.qsl(2) == 16384);
  CHECK(s0.flag(0));        // the batch's own flag
  CHECK_FALSE(s0.flag(1));  // starts here: the batch's own flag
  CHECK(s1.qsl(1) == 16384);
  CHECK(s1.cache(0) == 4);
  CHECK(s1.flag(0));        // continues from window 0
  CHECK(s2.qsl(1) == 40100 - 32768);
  CHECK(s2.qsl(2) == 40200 - 32768);
  CHECK(s2.flag(0));        // continues from window 1
  CHECK_FALSE(s2.flag(1));
  check_windows_reproduce_batch(b, config, windows, staging, layout);
}

TEST_CASE("a zero-length sequence at a window boundary belongs to the window that starts there") {
  const Config config = make_config({4, 8}, 24, 8, 17);
  std::vector<WindowPlan> windows;
  SUBCASE("at an inner boundary") {
    // seq0 [0, 8) fills window 0, seq1 is empty at row 8, seq2 [8, 10).
    Batch b = batch_of_lengths({8, 0, 2});
    kda::detail::plan_windows(b.view(), config, windows);
    REQUIRE(windows.size() == 2);
    CHECK(windows[0].first_seq == 0);
    CHECK(windows[0].num_seqs == 1);
    CHECK(windows[1].first_seq == 1);
    CHECK(windows[1].num_seqs == 2);
    CHECK(windows[1].bucket == 4);
  }
  SUBCASE("at the end of a batch that ends on a boundary") {
    Batch b = batch_of_lengths({3, 13, 0, 0});
    kda::detail::plan_windows(b.view(), config, windows);
    REQUIRE(windows.size() == 2);
    CHECK(windows[0].num_seqs == 2);
    CHECK(windows[1].first_seq == 1);
    CHECK(windows[1].num_seqs == 3);
  }
  SUBCASE("at the end of a batch that ends inside a window") {
    Batch b = batch_of_lengths({0, 9, 0});
    kda::detail::plan_windows(b.view(), config, windows);
    REQUIRE(windows.size() == 2);
    CHECK(windows[0].first_seq == 0);
    CHECK(windows[0].num_seqs == 2);
    CHECK(windows[1].first_seq == 1);
    CHECK(windows[1].num_seqs == 2);
    CHECK(windows[1].num_tokens == 1);
  }
  SUBCASE("at row 0") {
    Batch b = batch_of_lengths({0, 0, 8, 1});
    kda::detail::plan_windows(b.view(), config, windows);
    REQUIRE(windows.size() == 2);
    CHECK(windows[0].first_seq == 0);
    CHECK(windows[0].num_seqs == 3);
    CHECK(windows[1].first_seq == 3);
    CHECK(windows[1].num_seqs == 1);
  }
}

TEST_CASE("window planning of random batches matches the per-window membership rule") {
  struct Shape {
    std::vector<int64_t> buckets;
    int64_t max_batch_tokens;
    int64_t max_seqs;
  };
  const std::vector<Shape> shapes = {
      {{4, 8, 16}, 48, 32},      // capacity exactly 3 windows
      {{4, 8, 16}, 50, 32},      // a partial fourth window
      {{2, 3, 5}, 0, 8},         // one window; odd sizes
      {{1}, 12, 16},             // one-row windows: every boundary is a sequence boundary
  };
  std::mt19937 rng(20261202);
  for (const Shape& shape : shapes) {
    const Config config = make_config(shape.buckets, shape.max_batch_tokens, shape.max_seqs,
                                      shape.max_seqs * 2 + 1);
    const int64_t capacity = config.runtime.batch_token_capacity();
    const int64_t width = config.runtime.largest_bucket();
    const StagingLayout layout = StagingLayout::for_max_seqs(config.runtime.max_seqs);
    const auto slots = static_cast<std::size_t>(kda::detail::max_windows(config));
    BatchValidator validator(config);
    std::vector<WindowPlan> windows;
    windows.reserve(slots);
    const WindowPlan* const storage = windows.data();
    std::vector<unsigned char> staging(slots * layout.slot_bytes);
    int spanning_three = 0;
    for (int trial = 0; trial < 400; ++trial) {
      INFO("largest bucket ", width, ", capacity ", capacity, ", trial ", trial);
      Batch b;
      const int64_t seqs = std::uniform_int_distribution<int64_t>(0, shape.max_seqs)(rng);
      for (int64_t s = 0; s < seqs; ++s) {
        const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
        int64_t len = 0;
        if (kind < 3) len = 0;
        else if (kind < 8) len = std::uniform_int_distribution<int64_t>(1, width)(rng);
        else len = std::uniform_int_distribution<int64_t>(width, 3 * width)(rng);
        len = std::min<int64_t>(len, capacity - b.qsl.back());
        // Null line 0 now and then, else a distinct real line.
        const bool skipped = std::uniform_int_distribution<int>(0, 7)(rng) == 0;
        const bool initial = std::uniform_int_distribution<int>(0, 1)(rng) == 1;
        b.add(static_cast<int32_t>(len), skipped ? 0 : static_cast<int32_t>(s + 1), initial);
      }
      REQUIRE_NOTHROW(stage_forward(validator, b.view(), config, layout, windows, staging));
      check_same_plan(windows, naive_windows(b, config));
      check_windows_reproduce_batch(b, config, windows, staging, layout);
      CHECK(windows.data() == storage);  // the reserved storage is reused, never reallocated
      CHECK(windows.capacity() == slots);
      for (int64_t s = 0; s < b.num_seqs(); ++s) {
        if (b.end(s) - 1 >= b.start(s) && (b.end(s) - 1) / width - b.start(s) / width >= 2) {
          ++spanning_three;
        }
      }
    }
    if (capacity >= 3 * width) CHECK(spanning_three > 0);
  }
}

TEST_CASE("staging of a padded batch repeats the last offset, names the null line and clears flags") {
  const Config config = make_config({8, 16}, 0, 6, 40, 39);
  const StagingLayout layout = StagingLayout::for_max_seqs(6);
  Batch b;
  b.add(3, 7, true);
  b.add(0, 39, true);   // null line: never reads a state
  b.add(5, 39, false);
  b.add(2, 12, false);
  std::vector<WindowPlan> windows;
  kda::detail::plan_windows(b.view(), config, windows);
  REQUIRE(windows.size() == 1);
  CHECK(windows[0].bucket == 16);
  Slot slot(6);
  kda::detail::fill_window_staging(b.view(), windows[0], config, layout, slot.bytes.data());
  const std::vector<int32_t> want_qsl{0, 3, 3, 8, 10, 10, 10};
  const std::vector<int32_t> want_cache{7, 39, 39, 12, 39, 39};
  const std::vector<bool> want_flags{true, false, false, false, false, false};
  for (int64_t i = 0; i <= 6; ++i) CHECK(slot.qsl(i) == want_qsl[static_cast<std::size_t>(i)]);
  for (int64_t i = 0; i < 6; ++i) {
    INFO("entry ", i);
    CHECK(slot.cache(i) == want_cache[static_cast<std::size_t>(i)]);
    CHECK(slot.flag(i) == want_flags[static_cast<std::size_t>(i)]);
  }
  for (std::size_t i = layout.flags_offset; i < layout.flags_offset + 6; ++i) {
    CHECK(slot.bytes[i] <= 1);  // stored bools are 0 or 1
  }
}

TEST_CASE("the staging layout aligns every array to 16 bytes and leaves room for max_seqs") {
  for (int64_t m : {0, 1, 3, 4, 5, 15, 16, 17, 255, 256}) {
    INFO("max_seqs ", m);
    const StagingLayout l = StagingLayout::for_max_seqs(m);
    const auto n = static_cast<std::size_t>(m);
    CHECK(l.qsl_offset % 16 == 0);
    CHECK(l.cache_offset % 16 == 0);
    CHECK(l.flags_offset % 16 == 0);
    CHECK(l.slot_bytes % 16 == 0);
    CHECK(l.cache_offset >= l.qsl_offset + (n + 1) * 4);
    CHECK(l.flags_offset >= l.cache_offset + n * 4);
    CHECK(l.slot_bytes >= l.flags_offset + n);
    CHECK(l.slot_bytes < l.flags_offset + n + 16);
  }
  CHECK(StagingLayout::for_max_seqs(256).slot_bytes == 1040 + 1024 + 256);
  CHECK_THROWS_WITH_AS(StagingLayout::for_max_seqs(-1),
                       doctest::Contains("max_seqs -1 must not be negative"), kda::Error);
}

TEST_CASE("a staged slot's bytes depend only on the batch") {
  // 5 sequences of max_seqs 5: (6 * 4 = 24 -> 32) + (20 -> 32) + (5 -> 16), gaps in every array.
  const Config config = make_config({8}, 24, 5, 11);
  const StagingLayout layout = StagingLayout::for_max_seqs(5);
  REQUIRE(layout.slot_bytes == 80);
  Batch b;
  b.add(6, 1, true);
  b.add(11, 2, false);
  b.add(0, 0, true);
  b.add(1, 3, true);
  std::vector<WindowPlan> windows;
  kda::detail::plan_windows(b.view(), config, windows);
  REQUIRE(windows.size() == 3);
  for (const WindowPlan& w : windows) {
    INFO("window at row ", w.token_offset);
    std::vector<unsigned char> ones(layout.slot_bytes, 0xFF), zeros(layout.slot_bytes, 0x00);
    kda::detail::fill_window_staging(b.view(), w, config, layout, ones.data());
    kda::detail::fill_window_staging(b.view(), w, config, layout, zeros.data());
    CHECK(ones == zeros);
    CHECK(std::all_of(ones.begin() + 24, ones.begin() + 32, [](unsigned char c) { return c == 0; }));
    CHECK(std::all_of(ones.begin() + 52, ones.begin() + 64, [](unsigned char c) { return c == 0; }));
    CHECK(std::all_of(ones.begin() + 69, ones.end(), [](unsigned char c) { return c == 0; }));
  }
}

// Their host time is measured by bench/bench_host.cpp, not here.
TEST_CASE("256 sequences on random lines stage into one window at 16384 tokens and four at 65536") {
  const Config config = serving_config();
  const StagingLayout layout = StagingLayout::for_max_seqs(config.runtime.max_seqs);
  const auto slots = static_cast<std::size_t>(kda::detail::max_windows(config));
  BatchValidator validator(config);
  std::vector<WindowPlan> windows;
  windows.reserve(slots);
  std::vector<unsigned char> staging(slots * layout.slot_bytes);

  std::mt19937 rng(7);
  // Distinct lines drawn from the whole pool, so the duplicate table is hit at random.
  std::vector<int32_t> lines(512);
  for (int i = 0; i < 512; ++i) lines[static_cast<std::size_t>(i)] = i + 1;
  std::shuffle(lines.begin(), lines.end(), rng);

  Batch one_window;
  for (int s = 0; s < 256; ++s) one_window.add(64, lines[static_cast<std::size_t>(s)], s % 2 == 0);
  REQUIRE(one_window.qsl.back() == 16384);
  Batch four_windows;
  for (int s = 0; s < 256; ++s) four_windows.add(256, lines[static_cast<std::size_t>(s)], s % 2 == 0);
  REQUIRE(four_windows.qsl.back() == 65536);

  for (int repeat = 0; repeat < 3; ++repeat) {  // the validator's stamps are reused across calls
    stage_forward(validator, one_window.view(), config, layout, windows, staging);
    CHECK(windows.size() == 1);
    stage_forward(validator, four_windows.view(), config, layout, windows, staging);
    CHECK(windows.size() == 4);
  }
}
