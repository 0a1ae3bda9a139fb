// State checkpoints on the host: BatchView::checkpoint_* validation (every refusal names what is
// wrong and stages nothing) and the window-local records fill_window_staging writes for the
// kernels (common/state_checkpoints.h), checked against a rule stated independently here.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/state_checkpoints.h"
#include "kda/error.h"
#include "recurrence/kda_chunked.h"
#include "runtime/batch_plan.h"

using kda::BatchView;
using kda::CheckpointEntry;
using kda::CheckpointSeq;
using kda::Config;
using kda::detail::BatchValidator;
using kda::detail::StagingLayout;
using kda::detail::WindowPlan;

namespace {

Config make_config(std::vector<int64_t> buckets, int64_t max_batch_tokens, int64_t max_seqs,
                   int64_t cache_lines, int64_t max_checkpoints) {
  Config config;
  config.model.hidden_size = 256;
  config.model.num_heads = 2;
  config.runtime.token_buckets = std::move(buckets);
  config.runtime.max_batch_tokens = max_batch_tokens;
  config.runtime.max_seqs = max_seqs;
  config.runtime.max_checkpoints = max_checkpoints;
  config.pools.cache_lines = cache_lines;
  config.pools.null_line = 0;
  return config;
}

// Buckets up to 1024 rows, batches of up to 4 windows, 64 checkpoints per batch.
Config small_config() { return make_config({256, 512, 1024}, 4096, 32, 200, 64); }

// A batch with checkpoints; view() points into the arrays.
struct Batch {
  std::vector<int32_t> qsl{0};
  std::vector<int32_t> cache;
  std::vector<unsigned char> flags;
  std::vector<int32_t> interval;
  std::vector<int32_t> ckpt_start{0};
  std::vector<int32_t> ckpt_lines;

  // A sequence of `length` rows on `line` whose checkpoints (every `every` rows) go to `lines`.
  void add(int32_t length, int32_t line, int32_t every = 0, std::vector<int32_t> lines = {},
           bool initial = false) {
    qsl.push_back(qsl.back() + length);
    cache.push_back(line);
    flags.push_back(initial ? 1 : 0);
    interval.push_back(every);
    ckpt_lines.insert(ckpt_lines.end(), lines.begin(), lines.end());
    ckpt_start.push_back(static_cast<int32_t>(ckpt_lines.size()));
  }
  int64_t num_seqs() const { return static_cast<int64_t>(cache.size()); }
  BatchView view() const {
    BatchView v;
    v.query_start_loc = qsl.data();
    v.cache_indices = cache.data();
    v.has_initial_state = reinterpret_cast<const bool*>(flags.data());
    v.num_seqs = num_seqs();
    v.checkpoint_interval = interval.data();
    v.checkpoint_start_loc = ckpt_start.data();
    v.checkpoint_lines = ckpt_lines.data();
    return v;
  }
};

void check_rejects(const BatchView& view, const Config& config, const std::string& message) {
  CHECK_THROWS_WITH_AS(kda::detail::validate_batch(view, config), doctest::Contains(message.c_str()),
                       kda::Error);
  BatchValidator validator(config);
  CHECK_THROWS_WITH_AS(validator.validate(view), doctest::Contains(message.c_str()), kda::Error);
}
void check_rejects(const Batch& batch, const Config& config, const std::string& message) {
  check_rejects(batch.view(), config, message);
}

// Validates, plans and stages every window into `staging` (one slot per window).
void stage_forward(BatchValidator& validator, const BatchView& batch, const Config& config,
                   const StagingLayout& layout, std::vector<WindowPlan>& windows,
                   std::vector<unsigned char>& staging) {
  validator.validate(batch);
  kda::detail::plan_windows(batch, config, windows);
  for (std::size_t w = 0; w < windows.size(); ++w)
    kda::detail::fill_window_staging(batch, windows[w], config, layout, staging.data() + w * layout.slot_bytes);
}

template <typename T>
T read_record(const std::vector<unsigned char>& bytes, std::size_t offset, int64_t i) {
  T value;
  std::memcpy(&value, bytes.data() + offset + static_cast<std::size_t>(i) * sizeof(T), sizeof(T));
  return value;
}

// One staged checkpoint in batch terms: which sequence, which line, after how many of its rows,
// staged in which window at which window-local end.
struct Staged {
  int64_t window, seq, line, end;
  bool operator==(const Staged& o) const {
    return window == o.window && seq == o.seq && line == o.line && end == o.end;
  }
};

// The rule, per checkpoint: the one after `offset` rows of a sequence starting at batch row
// `begin` is staged in the window holding its last row, batch row begin + offset - 1, with the
// end counted from the sequence's first row in that window.
std::vector<Staged> expected_checkpoints(const Batch& b, int64_t window_rows) {
  std::vector<Staged> out;
  for (int64_t s = 0; s < b.num_seqs(); ++s) {
    for (int32_t k = b.ckpt_start[s]; k < b.ckpt_start[s + 1]; ++k) {
      const int64_t offset = static_cast<int64_t>(k - b.ckpt_start[s] + 1) * b.interval[s];
      const int64_t begin = b.qsl[s];
      const int64_t w = (begin + offset - 1) / window_rows;
      const int64_t first_row_in_window = std::max(begin, w * window_rows);
      out.push_back({w, s, b.ckpt_lines[k], begin + offset - first_row_in_window});
    }
  }
  return out;
}

// What the staged slots say, decoded through CheckpointSeq (as the recurrence reads it) and
// checked against the entry table (as the conv checkpoint reads it).
std::vector<Staged> staged_checkpoints(const std::vector<unsigned char>& staging, const StagingLayout& layout,
                                       const std::vector<WindowPlan>& windows, const Config& config) {
  std::vector<Staged> out;
  for (std::size_t w = 0; w < windows.size(); ++w) {
    const std::size_t slot = w * layout.slot_bytes;
    int64_t used = 0;
    for (int64_t i = 0; i < config.runtime.max_seqs; ++i) {
      const auto cs = read_record<CheckpointSeq>(staging, slot + layout.checkpoint_seq_offset, i);
      if (i >= windows[w].num_seqs) {
        CHECK(cs.count == 0);
        continue;
      }
      for (int32_t j = 0; j < cs.count; ++j) {
        const int64_t end = cs.first + static_cast<int64_t>(j) * cs.interval;
        const int32_t idx = kda::checkpoint_at(cs, end);
        REQUIRE(idx == cs.base + j);
        const auto e = read_record<CheckpointEntry>(staging, slot + layout.checkpoint_entry_offset, idx);
        CHECK(e.seq == i);
        CHECK(e.end == end);
        CHECK(e.pad == 0);
        out.push_back({static_cast<int64_t>(w), windows[w].first_seq + i, e.line, end});
      }
      used += cs.count;
    }
    for (int64_t k = used; k < config.runtime.max_checkpoints; ++k)
      CHECK(read_record<CheckpointEntry>(staging, slot + layout.checkpoint_entry_offset, k).line == -1);
  }
  return out;
}

}  // namespace

TEST_CASE("checkpoint_at finds the checkpoint owed at a chunk end, and only there") {
  CheckpointSeq none;
  CHECK(kda::checkpoint_at(none, 64) == -1);
  CheckpointSeq cs;
  cs.first = 128;
  cs.interval = 192;
  cs.count = 3;
  cs.base = 5;
  for (int64_t end = 0; end <= 1024; ++end) {
    int32_t want = -1;
    if (end == 128) want = 5;
    if (end == 320) want = 6;
    if (end == 512) want = 7;
    CHECK(kda::checkpoint_at(cs, end) == want);
  }
  // A window's only checkpoint at a sequence's last row, which need not be a chunk end.
  CheckpointSeq tail;
  tail.first = 37;
  tail.count = 1;
  tail.interval = 64;
  CHECK(kda::checkpoint_at(tail, 37) == 0);
  CHECK(kda::checkpoint_at(tail, 101) == -1);
  CHECK(kda::kCheckpointChunk == kda::kKdaChunk);
}

TEST_CASE("checkpoint validation names the first problem and what was expected") {
  const Config config = small_config();
  Batch good;
  good.add(300, 1, 64, {10, 11, 12, 13});
  good.add(100, 2);
  good.add(256, 3, 128, {14, 15});
  REQUIRE_NOTHROW(kda::detail::validate_batch(good.view(), config));

  SUBCASE("checkpoints while runtime.max_checkpoints is 0") {
    Config off = config;
    off.runtime.max_checkpoints = 0;
    check_rejects(good, off, "names 6 checkpoint lines but runtime.max_checkpoints is 0");
  }
  SUBCASE("more lines than runtime.max_checkpoints") {
    Config few = config;
    few.runtime.max_checkpoints = 5;
    check_rejects(good, few, "the batch names 6 checkpoint lines, more than runtime.max_checkpoints 5");
  }
  SUBCASE("one array of three") {
    BatchView v = good.view();
    v.checkpoint_start_loc = nullptr;
    check_rejects(v, config, "checkpoint_start_loc is null while checkpoint_interval and checkpoint_lines are set");
    v = good.view();
    v.checkpoint_interval = nullptr;
    check_rejects(v, config, "checkpoint_interval is null while checkpoint_start_loc and checkpoint_lines are set");
    v = good.view();
    v.checkpoint_lines = nullptr;
    check_rejects(v, config, "checkpoint_lines is null, expected 6 entries");
    v = good.view();
    v.checkpoint_interval = v.checkpoint_start_loc = nullptr;
    check_rejects(v, config,
                  "checkpoint_interval and checkpoint_start_loc are null while checkpoint_lines is set");
    v = good.view();
    v.checkpoint_start_loc = v.checkpoint_lines = nullptr;
    check_rejects(v, config,
                  "checkpoint_start_loc and checkpoint_lines are null while checkpoint_interval is set");
  }
  SUBCASE("checkpoint_start_loc that does not start at 0 or decreases") {
    Batch b = good;
    b.ckpt_start[0] = 1;
    check_rejects(b, config, "checkpoint_start_loc[0] must be 0, got 1");
    b = good;
    b.ckpt_start[2] = 3;
    check_rejects(b, config, "checkpoint_start_loc[2] = 3 < checkpoint_start_loc[1] = 4");
  }
  SUBCASE("an interval that is not a positive multiple of the chunk") {
    Batch b = good;
    b.interval[0] = 100;
    check_rejects(b, config, "checkpoint_interval[0] = 100 is not a positive multiple of 64");
    b.interval[0] = 0;
    check_rejects(b, config, "checkpoint_interval[0] = 0 is not a positive multiple of 64");
    b.interval[0] = -64;
    check_rejects(b, config, "checkpoint_interval[0] = -64 is not a positive multiple of 64");
  }
  SUBCASE("more lines than offsets") {
    Batch b;
    b.add(300, 1, 64, {10, 11, 12, 13, 14});
    check_rejects(b, config, "sequence 0 names 5 checkpoint lines, more than the 4 offsets its 300 rows have");
    Batch empty;
    empty.add(0, 1, 64, {10});
    check_rejects(empty, config, "sequence 0 names 1 checkpoint lines, more than the 0 offsets its 0 rows");
  }
  SUBCASE("lines on a skipped sequence") {
    Batch b;
    b.add(300, 0, 64, {10});
    check_rejects(b, config, "sequence 0 names 1 checkpoint lines but is skipped (cache_indices[0] is pools.null_line 0)");
  }
  SUBCASE("a line outside the pool or on the null line") {
    Batch b = good;
    b.ckpt_lines[2] = 200;
    check_rejects(b, config, "checkpoint_lines[2] = 200 is outside the pool [0, 200)");
    b.ckpt_lines[2] = -3;
    check_rejects(b, config, "checkpoint_lines[2] = -3 is outside the pool [0, 200)");
    b.ckpt_lines[2] = 0;
    check_rejects(b, config, "checkpoint_lines[2] = 0 is pools.null_line");
  }
  SUBCASE("a line named twice, or also a sequence's line") {
    Batch b = good;
    b.ckpt_lines[5] = 11;
    check_rejects(b, config, "checkpoint_lines[5] = 11 repeats checkpoint_lines[1]");
    b = good;
    b.ckpt_lines[4] = 2;  // sequence 1's line
    check_rejects(b, config, "checkpoint_lines[4] = 2 is also cache_indices[1]");
    b = good;
    b.ckpt_lines[0] = 1;  // its own sequence's line
    check_rejects(b, config, "checkpoint_lines[0] = 1 is also cache_indices[0]");
  }
  SUBCASE("a window boundary that puts a checkpoint inside a chunk") {
    // Sequence 1 starts at row 1000 and the window boundary at row 1024 splits it after 24
    // rows: its chunks in the second window end at offsets 24 + 64 m, never at 128.
    Batch b;
    b.add(1000, 1);
    b.add(400, 2, 128, {20});
    check_rejects(b, config,
                  "checkpoint_lines[0] (sequence 1, after 128 rows) falls inside a 64-token chunk: the window "
                  "boundary at batch row 1024 splits sequence 1 after 24 rows");
    // The same split refuses every multiple of 64 that is not the sequence's last row.
    Batch misaligned;
    misaligned.add(1000, 1);
    misaligned.add(24 + 64 + 10, 2, 64, {20});
    CHECK_THROWS_WITH_AS(kda::detail::validate_batch(misaligned.view(), config),
                         doctest::Contains("after 64 rows) falls inside"), kda::Error);
    // A sequence whose last row is the checkpoint passes wherever the split is: it is the
    // state the window leaves in the line anyway.
    Batch last_row;
    last_row.add(1000, 1);
    last_row.add(128, 2, 128, {20});
    CHECK_NOTHROW(kda::detail::validate_batch(last_row.view(), config));
    Batch aligned;
    aligned.add(960, 1);
    aligned.add(400, 2, 128, {20, 21, 22});  // split after 64 rows: every multiple of 64 is a chunk end
    CHECK_NOTHROW(kda::detail::validate_batch(aligned.view(), config));
  }
}

TEST_CASE("a batch without checkpoints needs none of the arrays, and zero lines need no lines array") {
  const Config config = small_config();
  Batch b;
  b.add(300, 1);
  BatchView v = b.view();
  v.checkpoint_interval = v.checkpoint_start_loc = v.checkpoint_lines = nullptr;
  CHECK_NOTHROW(kda::detail::validate_batch(v, config));
  v = b.view();
  v.checkpoint_lines = nullptr;  // checkpoint_start_loc[num_seqs] == 0
  CHECK_NOTHROW(kda::detail::validate_batch(v, config));
  Config off = config;
  off.runtime.max_checkpoints = 0;
  CHECK_NOTHROW(kda::detail::validate_batch(b.view(), off));
}

TEST_CASE("a batch whose checkpoints are refused stages nothing") {
  const Config config = small_config();
  const StagingLayout layout = StagingLayout::for_config(config);
  const auto slots = static_cast<std::size_t>(kda::detail::max_windows(config));
  BatchValidator validator(config);
  std::vector<WindowPlan> windows;
  windows.reserve(slots);
  std::vector<unsigned char> staging(slots * layout.slot_bytes, 0xA5);
  const std::vector<unsigned char> pattern = staging;

  Batch b;
  b.add(2048, 1, 64, {10, 11, 12});
  b.add(1536, 2, 512, {13, 14, 10});  // the last line repeats sequence 0's first
  CHECK_THROWS_WITH_AS(stage_forward(validator, b.view(), config, layout, windows, staging),
                       doctest::Contains("checkpoint_lines[5] = 10 repeats checkpoint_lines[0]"), kda::Error);
  CHECK(staging == pattern);
  CHECK(windows.empty());

  b.ckpt_lines[5] = 15;
  REQUIRE_NOTHROW(stage_forward(validator, b.view(), config, layout, windows, staging));
  CHECK(windows.size() == 4);
  CHECK(staging != pattern);
}

TEST_CASE("checkpoints are staged in the window of their last row, window-local") {
  const Config config = small_config();
  const StagingLayout layout = StagingLayout::for_config(config);
  REQUIRE(layout.has_checkpoints);
  CHECK(layout.checkpoint_seq_offset % 16 == 0);
  CHECK(layout.checkpoint_entry_offset % 16 == 0);
  CHECK(layout.slot_bytes == layout.checkpoint_entry_offset + 64 * sizeof(CheckpointEntry));
  const auto slots = static_cast<std::size_t>(kda::detail::max_windows(config));
  BatchValidator validator(config);
  std::vector<WindowPlan> windows;
  std::vector<unsigned char> staging(slots * layout.slot_bytes, 0xEE);

  // Sequence 1 spans windows 0..2 from row 320 (a multiple of 64); one checkpoint lands exactly
  // on the boundary at row 1024 (offset 704 = 11 x 64), where it belongs to window 0.
  Batch b;
  b.add(320, 1, 64, {10, 11, 12, 13, 14});
  b.add(2000, 2, 704, {15, 16});
  b.add(7, 3);
  b.add(500, 4, 128, {17}, /*initial=*/true);
  stage_forward(validator, b.view(), config, layout, windows, staging);
  REQUIRE(windows.size() == 3);
  const std::vector<Staged> got = staged_checkpoints(staging, layout, windows, config);
  const std::vector<Staged> want = expected_checkpoints(b, config.runtime.largest_bucket());
  CHECK(got == want);
  // Spot checks of the rule: offset 704 of sequence 1 ends window 0 (local end 704), offset
  // 1408 ends at row 1728, window 1, after 1408 - 704 = 704 of its rows there.
  REQUIRE(want.size() == 8);
  CHECK(want[5] == Staged{0, 1, 15, 704});
  CHECK(want[6] == Staged{1, 1, 16, 704});
}

TEST_CASE("staged checkpoints of random batches follow the rule, and validation accepts exactly the aligned ones") {
  std::mt19937 rng(2026);
  int refused = 0, staged = 0, split_staged = 0;
  for (int trial = 0; trial < 400; ++trial) {
    // Largest buckets that are multiples of 64 and ones that are not.
    const int64_t largest = trial % 3 == 0 ? 1000 : 1024;
    Config config = make_config({128, largest}, 4 * largest, 16, 400, 48);
    const StagingLayout layout = StagingLayout::for_config(config);
    const auto slots = static_cast<std::size_t>(kda::detail::max_windows(config));
    Batch b;
    int32_t next_line = 1, next_ckpt = 200;
    const int seqs = 1 + static_cast<int>(rng() % 12);
    int64_t room = config.runtime.max_checkpoints;
    for (int s = 0; s < seqs; ++s) {
      const int64_t rows_left = 4 * largest - b.qsl.back();
      if (rows_left <= 0) break;
      // Half the trials keep every sequence start a multiple of 64 (the layout that always
      // validates when the largest bucket is a multiple of 64 too).
      int64_t want_len = rng() % 900;
      if (trial % 2 == 1) want_len = want_len / 64 * 64;
      const auto len = static_cast<int32_t>(std::min<int64_t>(rows_left, want_len));
      const int32_t every = 64 * static_cast<int32_t>(1 + rng() % 4);
      int64_t count = rng() % 3 == 0 ? 0 : std::min<int64_t>(len / every, room);
      if (count > 0) count = 1 + static_cast<int64_t>(rng() % static_cast<uint32_t>(count));
      room -= count;
      std::vector<int32_t> lines;
      for (int64_t j = 0; j < count; ++j) lines.push_back(next_ckpt++);
      b.add(len, next_line++, count > 0 ? every : 0, lines, rng() % 2 == 0);
    }
    const std::vector<Staged> want = expected_checkpoints(b, largest);
    // Aligned: every checkpoint ends one of the chunks its window starts at the sequence's
    // first row there (or ends the sequence's rows in that window).
    bool aligned = true;
    for (const Staged& st : want) {
      const int64_t begin = b.qsl[st.seq], end_row = b.qsl[st.seq + 1];
      const int64_t rows_in_window = std::min(end_row, (st.window + 1) * largest) - std::max(begin, st.window * largest);
      if (st.end % 64 != 0 && st.end != rows_in_window) aligned = false;
    }
    BatchValidator validator(config);
    std::vector<WindowPlan> windows;
    std::vector<unsigned char> staging(slots * layout.slot_bytes, 0x5A);
    if (!aligned) {
      CHECK_THROWS_WITH_AS(validator.validate(b.view()), doctest::Contains("falls inside a 64-token chunk"),
                           kda::Error);
      ++refused;
      continue;
    }
    REQUIRE_NOTHROW(stage_forward(validator, b.view(), config, layout, windows, staging));
    CHECK(staged_checkpoints(staging, layout, windows, config) == want);
    ++staged;
    for (const Staged& st : want)
      if (b.qsl[st.seq] < st.window * largest) {
        ++split_staged;  // a checkpoint staged in a later window of its sequence
        break;
      }
  }
  MESSAGE("random batches: ", staged, " staged (", split_staged, " with a checkpoint past a window boundary), ",
          refused, " refused");
  CHECK(refused >= 20);
  CHECK(staged >= 100);
  CHECK(split_staged >= 20);
}

TEST_CASE("the padding slot names no sequence line and no checkpoint line") {
  const Config config = small_config();
  const StagingLayout layout = StagingLayout::for_config(config);
  std::vector<unsigned char> slot(layout.slot_bytes, 0xCD);
  kda::detail::fill_padding_staging(config, layout, slot.data());
  for (int64_t i = 0; i <= config.runtime.max_seqs; ++i) CHECK(read_record<int32_t>(slot, layout.qsl_offset, i) == 0);
  for (int64_t i = 0; i < config.runtime.max_seqs; ++i) {
    CHECK(read_record<int32_t>(slot, layout.cache_offset, i) == config.pools.null_line);
    CHECK(slot[layout.flags_offset + static_cast<std::size_t>(i)] == 0);
    CHECK(read_record<CheckpointSeq>(slot, layout.checkpoint_seq_offset, i).count == 0);
  }
  for (int64_t k = 0; k < config.runtime.max_checkpoints; ++k)
    CHECK(read_record<CheckpointEntry>(slot, layout.checkpoint_entry_offset, k).line == -1);
  // Without checkpoints the slot is the three metadata arrays only.
  Config off = config;
  off.runtime.max_checkpoints = 0;
  const StagingLayout plain = StagingLayout::for_config(off);
  CHECK_FALSE(plain.has_checkpoints);
  CHECK(plain.slot_bytes == plain.checkpoint_seq_offset);
  CHECK(plain.slot_bytes == StagingLayout::for_max_seqs(off.runtime.max_seqs).slot_bytes);
}

// Their host time is measured by bench/bench_host.cpp, not here.
TEST_CASE("64 sequences with 256 checkpoints stage into four windows, again and again") {
  Config config = make_config({512, 1024, 2048, 4096, 8192, 16384}, 65536, 256, 1024, 256);
  const StagingLayout layout = StagingLayout::for_config(config);
  const auto slots = static_cast<std::size_t>(kda::detail::max_windows(config));
  BatchValidator validator(config);
  std::vector<WindowPlan> windows;
  windows.reserve(slots);
  std::vector<unsigned char> staging(slots * layout.slot_bytes);
  // 64 sequences of 1024 rows (4 windows), each with 4 checkpoints every 256 rows.
  Batch b;
  for (int s = 0; s < 64; ++s) {
    std::vector<int32_t> lines;
    for (int j = 0; j < 4; ++j) lines.push_back(512 + 4 * s + j);
    b.add(1024, s + 1, 256, lines);
  }
  REQUIRE(b.qsl.back() == 65536);
  for (int repeat = 0; repeat < 3; ++repeat) {  // the validator's stamps are reused across calls
    stage_forward(validator, b.view(), config, layout, windows, staging);
    CHECK(windows.size() == 4);
  }
}
