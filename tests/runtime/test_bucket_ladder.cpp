// Bucket ladders from traffic histograms: CSV parsing, the padded-token share (windows
// included, checked against plan_windows) and propose_buckets against brute force.
#include "runtime/bucket_ladder.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kda/config.h"
#include "kda/error.h"
#include "support/test_errors.h"
#include "kda/prefill.h"
#include "runtime/batch_plan.h"

using kda::detail::LadderLimits;
using kda::detail::TokenHistogram;
using kda::detail::ladder_cost;
using kda::detail::padded_share;
using kda::detail::parse_token_histogram;
using kda::detail::propose_buckets;
using Ladder = std::vector<int64_t>;

namespace {

using kda::test::error_of;
using kda::test::source_path;

std::string parse_error(const std::string& csv) {
  return error_of([&] { parse_token_histogram(csv, "traffic.csv"); },
                  "kda::detail::parse_token_histogram");
}

TokenHistogram histogram(std::vector<std::pair<int64_t, int64_t>> counts) {
  TokenHistogram h;
  h.counts = std::move(counts);
  return h;
}

int64_t padded_tokens(const TokenHistogram& h, const Ladder& buckets) {
  return ladder_cost(h, buckets).padded_tokens;
}

// The tie order propose_buckets promises: less padding, fewer buckets, then smaller buckets
// compared from the largest down.
bool better(const TokenHistogram& h, const Ladder& a, const Ladder& b) {
  const int64_t pa = padded_tokens(h, a);
  const int64_t pb = padded_tokens(h, b);
  if (pa != pb) return pa < pb;
  if (a.size() != b.size()) return a.size() < b.size();
  return std::lexicographical_compare(a.rbegin(), a.rend(), b.rbegin(), b.rend());
}

// Best ladder of at most `graphs` buckets drawn from every multiple of align up to the largest
// allowed bucket, whose top passes `top_allowed`.
template <typename TopAllowed>
Ladder brute_force(const TokenHistogram& h, int graphs, const LadderLimits& limits,
                   TopAllowed top_allowed) {
  std::vector<int64_t> values;
  for (int64_t v = limits.align; v <= limits.max_bucket; v += limits.align) values.push_back(v);
  REQUIRE(values.size() <= 16);
  Ladder best;
  for (uint32_t mask = 1; mask < (1u << values.size()); ++mask) {
    Ladder ladder;
    for (std::size_t i = 0; i < values.size(); ++i)
      if (mask & (1u << i)) ladder.push_back(values[i]);
    if (static_cast<int>(ladder.size()) > graphs || !top_allowed(ladder.back())) continue;
    if (best.empty() || better(h, ladder, best)) best = ladder;
  }
  return best;
}

int64_t round_up(int64_t v, int64_t align) { return (v + align - 1) / align * align; }

int64_t largest_batch(const TokenHistogram& h) {
  int64_t largest = 0;
  for (const auto& [size, count] : h.counts)
    if (count > 0) largest = std::max(largest, size);
  return largest;
}

// Up to `sizes` random (size, count) entries with sizes in [1, max_size], at least one count > 0.
TokenHistogram random_histogram(std::mt19937& rng, int sizes, int64_t max_size) {
  std::uniform_int_distribution<int64_t> size(1, max_size);
  std::uniform_int_distribution<int64_t> count(0, 9);
  TokenHistogram h;
  const int n = std::uniform_int_distribution<int>(1, sizes)(rng);
  for (int i = 0; i < n; ++i) h.counts.emplace_back(size(rng), count(rng));
  h.counts.emplace_back(size(rng), 1 + count(rng));
  return h;
}

void check_within_limits(const Ladder& ladder, int graphs, const LadderLimits& limits,
                         int64_t largest) {
  REQUIRE(!ladder.empty());
  CHECK(static_cast<int>(ladder.size()) <= graphs);
  for (std::size_t i = 0; i < ladder.size(); ++i) {
    CHECK(ladder[i] % limits.align == 0);
    CHECK(ladder[i] >= limits.align);
    if (i > 0) CHECK(ladder[i] > ladder[i - 1]);
  }
  CHECK(ladder.back() <= limits.max_bucket);
  const int64_t max_allowed = limits.max_bucket / limits.align * limits.align;
  const int64_t min_top =
      limits.min_largest > 0 ? limits.min_largest : std::min(largest, max_allowed);
  CHECK(ladder.back() >= min_top);
}

}  // namespace

TEST_CASE("a tokens,count CSV with header, comments and repeated sizes parses to merged sorted counts") {
  const TokenHistogram h = parse_token_histogram(
      "# logged by the server\r\n"
      "tokens,count\r\n"
      "\n"
      "512, 3   # three batches\n"
      "  17 ,2\n"
      "512,4\n"
      "4096,0\n"
      "64,1\n",
      "traffic.csv");
  const std::vector<std::pair<int64_t, int64_t>> expected{{17, 2}, {64, 1}, {512, 7}};
  CHECK(h.counts == expected);
  const auto totals = kda::detail::histogram_totals(h);
  CHECK(totals.batches == 10);
  CHECK(totals.tokens == 17 * 2 + 64 + 512 * 7);
  CHECK(totals.largest == 512);
  CHECK(totals.distinct == 3);
}

TEST_CASE("a single column of raw batch sizes counts every line as one batch") {
  const std::vector<std::pair<int64_t, int64_t>> expected{{5, 1}, {300, 2}, {9000, 1}};
  CHECK(parse_token_histogram("300\n5\n# a comment\n9000\n300\n", "raw.csv").counts == expected);
  CHECK(parse_token_histogram("tokens\n300\n5\n9000\n300\n", "raw.csv").counts == expected);
}

TEST_CASE("parse errors name the source, the line and what is wrong") {
  CHECK(parse_error("tokens,count\n12,3\n1x,4\n") ==
        "traffic.csv:3: tokens \"1x\" is not an integer");
  CHECK(parse_error("12,3\n40,many\n") == "traffic.csv:2: count \"many\" is not an integer");
  CHECK(parse_error("12,3\n40,\n") == "traffic.csv:2: count \"\" is not an integer");
  CHECK(parse_error("# c\n0,3\n") == "traffic.csv:2: tokens 0 must be at least 1");
  CHECK(parse_error("-5\n") == "traffic.csv:1: tokens -5 must be at least 1");
  CHECK(parse_error("12,3\n\n40,-1\n") == "traffic.csv:3: count -1 must not be negative");
  CHECK(parse_error("16777217,1\n") ==
        "traffic.csv:1: tokens 16777217 is more than the limit 16777216");
  CHECK(error_of([] { parse_token_histogram("100\n2000\n", "small.csv", 1024); },
                 "kda::detail::parse_token_histogram") ==
        "small.csv:2: tokens 2000 is more than the limit 1024");
  CHECK(parse_error("12,3\n40\n") ==
        "traffic.csv:2: 1 field, expected 2 (tokens,count) as on line 1");
  CHECK(parse_error("tokens\n12\n40,2\n") ==
        "traffic.csv:3: 2 fields, expected 1 (a batch size) as on line 1");
  CHECK(parse_error("1,2,3\n") ==
        "traffic.csv:1: 3 fields; expected `tokens,count` or a single batch size");
  CHECK(parse_error("a,b,c\n") ==
        "traffic.csv:1: header has 3 fields; expected `tokens,count` or `tokens`");
  CHECK(parse_error("tokens,count\n12,1\ntokens,count\n") ==
        "traffic.csv:3: tokens \"tokens\" is not an integer");
  CHECK(parse_error("99999999999999999999,1\n") ==
        "traffic.csv:1: tokens \"99999999999999999999\" is not an integer");
  CHECK(parse_error("1,1099511627776\n1,1\n") ==
        "traffic.csv:2: more than 1099511627776 batches in all");
  CHECK(parse_error("tokens,count\n# nothing logged\n") ==
        "traffic.csv: no batches (the histogram is empty)");
  CHECK(parse_error("12,0\n") == "traffic.csv: no batches (the histogram is empty)");
  CHECK(parse_error("") == "traffic.csv: no batches (the histogram is empty)");
}

TEST_CASE("a bad line of a histogram file is reported by its path and line") {
  const std::string path = source_path("tests/data/histograms/bad_count.csv");
  CHECK(error_of([&] { kda::detail::load_token_histogram(path); },
                 "kda::detail::parse_token_histogram") ==
        path + ":5: count \"\" is not an integer");
}

TEST_CASE("a missing histogram file is reported by its path") {
  CHECK(error_of([] { kda::detail::load_token_histogram("/nonexistent/traffic.csv"); },
                 "kda::detail::load_token_histogram") ==
        "/nonexistent/traffic.csv: cannot open the histogram: No such file or directory");
}

TEST_CASE("the padded share of batches within the largest bucket counts each batch's round-up") {
  // 100 -> 128 (28 padded) x3, 128 -> 128 x1, 129 -> 512 (383) x2, 512 -> 512 x1.
  const TokenHistogram h = histogram({{100, 3}, {128, 1}, {129, 2}, {512, 1}});
  const auto cost = ladder_cost(h, {128, 512});
  CHECK(cost.real_tokens == 300 + 128 + 258 + 512);
  CHECK(cost.padded_tokens == 3 * 28 + 2 * 383);
  CHECK(cost.share() == doctest::Approx(850.0 / (1198.0 + 850.0)));
  CHECK(padded_share(h, {128, 512}) == cost.share());
  CHECK(padded_share(histogram({{64, 5}, {256, 2}}), {64, 256}) == 0.0);
}

TEST_CASE("a batch above the largest bucket pads only its last window") {
  // 1100 tokens in windows of 512: 512 + 512 + 76, the last run in 128: 52 padded.
  CHECK(padded_tokens(histogram({{1100, 1}}), {128, 512}) == 52);
  // An exact multiple of the largest bucket pads nothing.
  CHECK(padded_tokens(histogram({{1536, 4}}), {128, 512}) == 0);
  // The last window of 513 tokens holds 1 row and runs in 128.
  CHECK(padded_tokens(histogram({{513, 2}}), {128, 512}) == 2 * 127);
  // Last window 400 rows runs in 512.
  CHECK(padded_tokens(histogram({{912, 1}}), {128, 512}) == 112);
  const auto cost = ladder_cost(histogram({{1100, 1}, {100, 1}}), {128, 512});
  CHECK(cost.real_tokens == 1200);
  CHECK(cost.padded_tokens == 52 + 28);
}

TEST_CASE("ladder_cost pads exactly what plan_windows and choose_bucket run, batch by batch") {
  const std::vector<Ladder> ladders{{512, 1024, 2048, 4096, 8192, 16384}, {16, 64, 256}, {48},
                                    {1, 2, 3, 1000}};
  std::mt19937 rng(3);
  for (const Ladder& buckets : ladders) {
    kda::Config config;
    config.model.hidden_size = 256;
    config.model.num_heads = 2;
    config.runtime.token_buckets = buckets;
    config.runtime.max_batch_tokens = 70000;
    config.runtime.max_seqs = 8;
    config.pools.cache_lines = 16;
    std::uniform_int_distribution<int32_t> size(1, 70000);
    for (int trial = 0; trial < 300; ++trial) {
      // The first trials are exact multiples of the largest bucket.
      const int32_t largest = static_cast<int32_t>(buckets.back());
      const int32_t tokens = trial < 3 ? largest * (trial + 1) : size(rng);
      // Two sequences splitting the batch: only the total decides the windows.
      const int32_t qsl[3] = {0, tokens / 3, tokens};
      const int32_t cache[2] = {1, 2};
      const bool initial[2] = {false, false};
      kda::BatchView batch;
      batch.query_start_loc = qsl;
      batch.cache_indices = cache;
      batch.has_initial_state = initial;
      batch.num_seqs = 2;
      std::vector<kda::detail::WindowPlan> windows;
      kda::detail::plan_windows(batch, config, windows);
      int64_t padded = 0;
      for (const auto& w : windows) padded += w.bucket - w.num_tokens;
      CAPTURE(tokens);
      CHECK(padded_tokens(histogram({{tokens, 1}}), buckets) == padded);
    }
  }
}

TEST_CASE("ladder_cost refuses ladders the config would refuse") {
  const TokenHistogram h = histogram({{10, 1}});
  const char* fn = "kda::detail::ladder_cost";
  CHECK(error_of([&] { ladder_cost(h, {}); }, fn) == "no buckets");
  CHECK(error_of([&] { ladder_cost(h, {64, 32}); }, fn) ==
        "bucket[1] = 32 after 64: buckets must increase");
  CHECK(error_of([&] { ladder_cost(h, {0, 32}); }, fn) == "bucket[0] = 0 must be in [1, 1048576]");
  CHECK(error_of([&] { ladder_cost(histogram({{0, 1}}), {32}); }, fn) ==
        "batch size 0 must be at least 1");
  CHECK(error_of([&] { ladder_cost(histogram({{4, 0}}), {32}); }, fn) ==
        "the histogram has no batch");
}

TEST_CASE("the proposed ladder equals a brute-force search over every aligned ladder") {
  std::mt19937 rng(20240611);
  int with_windows = 0;
  for (int trial = 0; trial < 300; ++trial) {
    LadderLimits limits;
    limits.align = std::array<int64_t, 3>{1, 8, 16}[trial % 3];
    limits.max_bucket = limits.align * std::uniform_int_distribution<int64_t>(1, 12)(rng);
    if (trial % 5 == 0) limits.max_bucket += limits.align / 2;  // not a multiple of align
    // Sizes up to three times the largest bucket: many batches run in windows.
    const TokenHistogram h = random_histogram(rng, 8, 3 * limits.max_bucket);
    const int graphs = std::uniform_int_distribution<int>(1, 5)(rng);
    const int64_t max_allowed = limits.max_bucket / limits.align * limits.align;
    const int64_t lo = std::min(round_up(largest_batch(h), limits.align), max_allowed);
    if (largest_batch(h) > max_allowed) ++with_windows;
    const Ladder expected =
        brute_force(h, graphs, limits, [&](int64_t top) { return top >= lo; });
    const Ladder got = propose_buckets(h, graphs, limits);
    CAPTURE(trial);
    CAPTURE(limits.align);
    CAPTURE(limits.max_bucket);
    CAPTURE(graphs);
    CHECK(got == expected);
    check_within_limits(got, graphs, limits, largest_batch(h));
  }
  CHECK(with_windows > 100);
}

TEST_CASE("with a smaller allowed top the top is searched too and matches brute force over its tops") {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 300; ++trial) {
    LadderLimits limits;
    limits.align = trial % 2 == 0 ? 8 : 16;
    limits.max_bucket = limits.align * 12;
    limits.min_largest = std::uniform_int_distribution<int64_t>(1, limits.max_bucket)(rng);
    const TokenHistogram h = random_histogram(rng, 8, 2 * limits.max_bucket);
    const int graphs = std::uniform_int_distribution<int>(1, 4)(rng);
    // The tops propose_buckets tries: lo, hi and the rounded batch sizes between them.
    const int64_t lo = round_up(limits.min_largest, limits.align);
    const int64_t hi = std::max(lo, std::min(round_up(largest_batch(h), limits.align),
                                             limits.max_bucket));
    const auto allowed = [&](int64_t top) {
      if (top == lo || top == hi) return true;
      if (top < lo || top > hi) return false;
      for (const auto& [size, count] : h.counts)
        if (count > 0 && round_up(size, limits.align) == top) return true;
      return false;
    };
    CAPTURE(trial);
    CAPTURE(limits.min_largest);
    CAPTURE(graphs);
    const Ladder got = propose_buckets(h, graphs, limits);
    CHECK(got == brute_force(h, graphs, limits, allowed));
    check_within_limits(got, graphs, limits, largest_batch(h));
  }
}

TEST_CASE("more graphs never increase the best padded share") {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 40; ++trial) {
    const TokenHistogram h = random_histogram(rng, 200, 40000);
    LadderLimits limits;
    limits.max_bucket = trial % 2 == 0 ? kda::detail::kLadderMaxBucket : 8192;
    double previous = 1.0;
    for (int graphs = 1; graphs <= 12; ++graphs) {
      const Ladder ladder = propose_buckets(h, graphs, limits);
      check_within_limits(ladder, graphs, limits, largest_batch(h));
      const double share = padded_share(h, ladder);
      CHECK(share <= previous);
      previous = share;
    }
  }
}

TEST_CASE("k distinct aligned sizes within the largest bucket and at least k graphs pad nothing") {
  std::mt19937 rng(8);
  for (int trial = 0; trial < 50; ++trial) {
    const int k = std::uniform_int_distribution<int>(1, 20)(rng);
    TokenHistogram h;
    std::vector<int64_t> sizes;
    while (static_cast<int>(sizes.size()) < k) {
      const int64_t size = 16 * std::uniform_int_distribution<int64_t>(1, 4096)(rng);
      if (std::find(sizes.begin(), sizes.end(), size) == sizes.end()) sizes.push_back(size);
    }
    for (int64_t size : sizes) h.counts.emplace_back(size, 1 + trial % 7);
    std::sort(sizes.begin(), sizes.end());
    for (int graphs : {k, k + 3, 64}) {
      if (graphs > 64) continue;
      const Ladder ladder = propose_buckets(h, graphs);
      CHECK(padded_share(h, ladder) == 0.0);
      CHECK(ladder == sizes);  // fewest buckets: exactly the sizes
    }
  }
}

TEST_CASE("ties go to fewer buckets and then to smaller ones") {
  // One size: one bucket, however many graphs are allowed.
  CHECK(propose_buckets(histogram({{100, 5}}), 8) == Ladder{112});
  // 16 and 48 pad nothing in {16, 48} and in {16, 32, 48}: the two-bucket ladder wins.
  CHECK(propose_buckets(histogram({{16, 1}, {48, 1}}), 3) == Ladder{16, 48});
  // One graph below a top of 64 for sizes 20 (x1) and 40 (x1): 32 pads 12 + 24 = 36 (40 in 64),
  // 48 pads 28 + 8 = 36 too; the smaller one wins.
  const LadderLimits limits{};
  CHECK(padded_tokens(histogram({{20, 1}, {40, 1}, {64, 1}}), {32, 64}) ==
        padded_tokens(histogram({{20, 1}, {40, 1}, {64, 1}}), {48, 64}));
  CHECK(propose_buckets(histogram({{20, 1}, {40, 1}, {64, 1}}), 2, limits) == Ladder{32, 64});
}

TEST_CASE("a batch bigger than the largest allowed bucket makes that bucket the top") {
  LadderLimits limits;
  limits.max_bucket = 16384;
  const TokenHistogram h = histogram({{300, 50}, {2000, 10}, {60000, 1}});
  const Ladder ladder = propose_buckets(h, 3, limits);
  CHECK(ladder.back() == 16384);
  // 60000 = 3 x 16384 + 10848: the last window's 10848 rows need a bucket of their own.
  CHECK(ladder == Ladder{304, 2000, 16384});
  CHECK(padded_tokens(h, ladder) == 50 * 4 + 16384 - 10848);
}

TEST_CASE("the thinned candidate grid stays within 1/512 of the exact share") {
  std::mt19937 rng(12);
  for (int trial = 0; trial < 20; ++trial) {
    const TokenHistogram h = random_histogram(rng, 3000, 200000);
    for (int graphs : {2, 8, 32}) {
      LadderLimits exact;
      exact.align = trial % 2 == 0 ? 1 : 16;
      exact.max_exact_candidates = 1 << 20;
      LadderLimits thinned = exact;
      thinned.max_exact_candidates = 16;
      const double best = padded_share(h, propose_buckets(h, graphs, exact));
      const Ladder ladder = propose_buckets(h, graphs, thinned);
      check_within_limits(ladder, graphs, thinned, largest_batch(h));
      const double share = padded_share(h, ladder);
      CHECK(share >= best);
      CHECK(share <= best + 1.0 / 512);
    }
  }
}

// Its time is measured by bench/bench_host.cpp, not here.
TEST_CASE("a hundred thousand distinct sizes and 64 graphs give ladders within the limits") {
  std::mt19937 rng(1);
  TokenHistogram h;
  for (int64_t size = 1; size <= 100000; ++size)
    h.counts.emplace_back(size * 10, std::uniform_int_distribution<int64_t>(1, 1000)(rng));
  LadderLimits limits;
  const Ladder ladder = propose_buckets(h, 64, limits);
  check_within_limits(ladder, 64, limits, largest_batch(h));
  CHECK(ladder.size() == 64);
  // With windows and a smaller allowed top, up to 32 tops are tried.
  limits.min_largest = 65536;
  const Ladder windowed = propose_buckets(h, 64, limits);
  check_within_limits(windowed, 64, limits, largest_batch(h));
}

TEST_CASE("bad graph counts and limits are refused with the reason") {
  const TokenHistogram h = histogram({{100, 1}});
  const char* fn = "kda::detail::propose_buckets";
  CHECK(error_of([&] { propose_buckets(h, 0); }, fn) == "num_graphs 0 must be in [1, 64]");
  CHECK(error_of([&] { propose_buckets(h, 65); }, fn) == "num_graphs 65 must be in [1, 64]");
  LadderLimits limits;
  limits.max_bucket = (1 << 20) + 1;
  CHECK(error_of([&] { propose_buckets(h, 4, limits); }, fn) ==
        "max_bucket 1048577 must be in [1, 1048576]");
  limits = {};
  limits.align = 0;
  CHECK(error_of([&] { propose_buckets(h, 4, limits); }, fn) ==
        "align 0 must be in [1, max_bucket 1048576]");
  limits = {};
  limits.max_bucket = 1000;
  limits.min_largest = 1000;
  CHECK(error_of([&] { propose_buckets(h, 4, limits); }, fn) ==
        "no multiple of align 16 lies in [min_largest 1000, max_bucket 1000]");
  limits.min_largest = 2000;
  CHECK(error_of([&] { propose_buckets(h, 4, limits); }, fn) ==
        "min_largest 2000 must be in [0, max_bucket 1000]");
  CHECK(error_of([&] { propose_buckets(TokenHistogram{}, 4); }, fn) ==
        "the histogram has no batch");
}

TEST_CASE("the power-of-two comparison ladder ends at the smallest power of two holding the top") {
  using kda::detail::power_of_two_ladder;
  const TokenHistogram h = histogram({{300, 1}, {9000, 1}});
  CHECK(power_of_two_ladder(h, 6) == Ladder{512, 1024, 2048, 4096, 8192, 16384});
  CHECK(power_of_two_ladder(histogram({{3, 1}}), 4) == Ladder{2, 4, 8, 16});
  CHECK(power_of_two_ladder(histogram({{3, 1}}), 8) == Ladder{1, 2, 4, 8, 16});
  LadderLimits limits;
  limits.max_bucket = 12000;  // 16384 is not allowed: the top is 8192, 9000 runs in windows
  CHECK(power_of_two_ladder(h, 3, limits) == Ladder{2048, 4096, 8192});
}

TEST_CASE("the made-up server histograms load and their ladders beat powers of two") {
  for (const char* name : {"tests/data/histograms/chat_mixed.csv",
                           "tests/data/histograms/completion_raw.csv"}) {
    CAPTURE(name);
    const TokenHistogram h = kda::detail::load_token_histogram(source_path(name));
    const auto totals = kda::detail::histogram_totals(h);
    CHECK(totals.batches > 100);
    for (const int64_t max_bucket : {int64_t{16384}, kda::detail::kLadderMaxBucket}) {
      LadderLimits limits;
      limits.max_bucket = max_bucket;
      double previous = 1.0;
      for (int graphs : {2, 4, 6, 8, 12}) {
        const Ladder ladder = propose_buckets(h, graphs, limits);
        check_within_limits(ladder, graphs, limits, totals.largest);
        const double share = padded_share(h, ladder);
        const double pow2 = padded_share(h, kda::detail::power_of_two_ladder(h, graphs, limits));
        CHECK(share <= pow2);
        CHECK(share <= previous);
        previous = share;
      }
    }
  }
}
