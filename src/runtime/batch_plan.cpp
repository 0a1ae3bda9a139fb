#include "runtime/batch_plan.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "common/check.h"
#include "common/state_checkpoints.h"

namespace kda::detail {

namespace {

constexpr const char* kBeginForward = "kda::PrefillModule::begin_forward";

constexpr std::size_t round_up_16(std::size_t bytes) { return (bytes + 15) / 16 * 16; }

// Everything validate_batch checks except duplicate lines; returns nothing, throws on the first
// problem. Shared by the free function and BatchValidator so their messages cannot drift apart.
void check_shape(const BatchView& batch, int64_t max_seqs, int64_t token_capacity,
                 int64_t cache_lines, int32_t null_line) {
  const int64_t n = batch.num_seqs;
  KDA_CHECK(n >= 0, kBeginForward, "num_seqs ", n, " must not be negative");
  KDA_CHECK(n <= max_seqs, kBeginForward, "num_seqs ", n, " exceeds runtime.max_seqs ", max_seqs);
  if (n == 0) return;
  KDA_CHECK(batch.query_start_loc != nullptr, kBeginForward,
            "query_start_loc is null, expected ", n + 1, " entries (num_seqs ", n, ")");
  KDA_CHECK(batch.cache_indices != nullptr, kBeginForward,
            "cache_indices is null, expected ", n, " entries (num_seqs ", n, ")");
  KDA_CHECK(batch.has_initial_state != nullptr, kBeginForward,
            "has_initial_state is null, expected ", n, " entries (num_seqs ", n, ")");

  const int32_t* qsl = batch.query_start_loc;
  KDA_CHECK(qsl[0] == 0, kBeginForward, "query_start_loc[0] must be 0, got ", qsl[0]);
  for (int64_t s = 1; s <= n; ++s) {
    if (qsl[s] < qsl[s - 1]) {
      KDA_FAIL(kBeginForward, "query_start_loc[", s, "] = ", qsl[s], " < query_start_loc[", s - 1,
               "] = ", qsl[s - 1], ": must not decrease");
    }
  }
  KDA_CHECK(qsl[n] <= token_capacity, kBeginForward, "batch has ", qsl[n],
            " tokens, more than runtime.batch_token_capacity() ", token_capacity);

  const int32_t* ci = batch.cache_indices;
  for (int64_t s = 0; s < n; ++s) {
    if (ci[s] == null_line) continue;
    if (ci[s] < 0 || ci[s] >= cache_lines) {
      KDA_FAIL(kBeginForward, "cache_indices[", s, "] = ", ci[s], " is outside the pool [0, ",
               cache_lines, ")");
    }
  }
}

[[noreturn]] void fail_duplicate(const BatchView& batch, int64_t s, int64_t first) {
  KDA_FAIL(kBeginForward, "cache_indices[", s, "] = ", batch.cache_indices[s],
           " repeats cache_indices[", first, "]: two sequences may not share a cache line");
}

}  // namespace

void validate_batch(const BatchView& batch, const Config& config) {
  BatchValidator validator(config);
  validator.validate(batch);
}

BatchValidator::BatchValidator(const Config& config)
    : max_seqs_(config.runtime.max_seqs),
      token_capacity_(config.runtime.batch_token_capacity()),
      cache_lines_(config.pools.cache_lines),
      null_line_(config.pools.null_line),
      max_checkpoints_(config.runtime.max_checkpoints),
      window_rows_(config.runtime.largest_bucket()),
      stamps_(static_cast<std::size_t>(std::max<int64_t>(config.pools.cache_lines, 0))) {}

void BatchValidator::validate(const BatchView& batch) {
  check_shape(batch, max_seqs_, token_capacity_, cache_lines_, null_line_);
  if (batch.num_seqs == 0) return;

  // A new generation invalidates every stamp of earlier calls (failed ones included) at once.
  if (++generation_ == 0) {
    std::fill(stamps_.begin(), stamps_.end(), Stamp{});
    generation_ = 1;
  }
  const int32_t* ci = batch.cache_indices;
  for (int64_t s = 0; s < batch.num_seqs; ++s) {
    if (ci[s] == null_line_) continue;
    Stamp& stamp = stamps_[static_cast<std::size_t>(ci[s])];  // in range: check_shape
    if (stamp.generation == generation_) fail_duplicate(batch, s, stamp.seq);
    stamp.generation = generation_;
    stamp.seq = static_cast<int32_t>(s);
    stamp.checkpoint = false;
  }
  check_checkpoints(batch);
}

// Runs after the cache lines are stamped, so a checkpoint line that a sequence also names is
// found in the same table.
void BatchValidator::check_checkpoints(const BatchView& batch) {
  const int32_t* interval = batch.checkpoint_interval;
  const int32_t* start = batch.checkpoint_start_loc;
  const int32_t* lines = batch.checkpoint_lines;
  if (!interval && !start && !lines) return;
  const int64_t n = batch.num_seqs;
  // Which of the three are null and which set, by name (at least one is set).
  if (!interval || !start) {
    std::string null_ones, set_ones;
    for (const auto& [name, set] : {std::pair<const char*, bool>{"checkpoint_interval", interval != nullptr},
                                    {"checkpoint_start_loc", start != nullptr},
                                    {"checkpoint_lines", lines != nullptr}}) {
      std::string& list = set ? set_ones : null_ones;
      list += list.empty() ? name : str_cat(" and ", name);
    }
    KDA_FAIL(kBeginForward, null_ones, null_ones.find(" and ") == std::string::npos ? " is" : " are",
             " null while ", set_ones, set_ones.find(" and ") == std::string::npos ? " is" : " are",
             " set: give checkpoint_interval, checkpoint_start_loc and checkpoint_lines together");
  }
  KDA_CHECK(start[0] == 0, kBeginForward, "checkpoint_start_loc[0] must be 0, got ", start[0]);
  for (int64_t s = 1; s <= n; ++s) {
    if (start[s] < start[s - 1]) {
      KDA_FAIL(kBeginForward, "checkpoint_start_loc[", s, "] = ", start[s], " < checkpoint_start_loc[",
               s - 1, "] = ", start[s - 1], ": must not decrease");
    }
  }
  const int64_t total = start[n];
  if (total == 0) return;
  KDA_CHECK(max_checkpoints_ > 0, kBeginForward, "the batch names ", total,
            " checkpoint lines but runtime.max_checkpoints is 0 (checkpoints are off)");
  KDA_CHECK(total <= max_checkpoints_, kBeginForward, "the batch names ", total,
            " checkpoint lines, more than runtime.max_checkpoints ", max_checkpoints_);
  KDA_CHECK(lines != nullptr, kBeginForward, "checkpoint_lines is null, expected ", total,
            " entries (checkpoint_start_loc[num_seqs])");

  const int32_t* qsl = batch.query_start_loc;
  const int32_t* ci = batch.cache_indices;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t count = start[s + 1] - start[s];
    if (count == 0) continue;
    KDA_CHECK(ci[s] != null_line_, kBeginForward, "sequence ", s, " names ", count,
              " checkpoint lines but is skipped (cache_indices[", s, "] is pools.null_line ", null_line_, ")");
    const int64_t every = interval[s];
    KDA_CHECK(every > 0 && every % kCheckpointChunk == 0, kBeginForward, "checkpoint_interval[", s, "] = ",
              every, " is not a positive multiple of ", kCheckpointChunk, " (the recurrence's chunk)");
    const int64_t seq_begin = qsl[s], rows = qsl[s + 1] - qsl[s];
    KDA_CHECK(count * every <= rows, kBeginForward, "sequence ", s, " names ", count,
              " checkpoint lines, more than the ", rows / every, " offsets its ", rows,
              " rows have at checkpoint_interval ", every);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t k = start[s] + j;
      const int32_t line = lines[k];
      KDA_CHECK(line >= 0 && line < cache_lines_, kBeginForward, "checkpoint_lines[", k, "] = ", line,
                " is outside the pool [0, ", cache_lines_, ")");
      KDA_CHECK(line != null_line_, kBeginForward, "checkpoint_lines[", k, "] = ", line,
                " is pools.null_line, which holds no state");
      Stamp& stamp = stamps_[static_cast<std::size_t>(line)];
      if (stamp.generation == generation_) {
        if (stamp.checkpoint)
          KDA_FAIL(kBeginForward, "checkpoint_lines[", k, "] = ", line, " repeats checkpoint_lines[", stamp.seq,
                   "]: each checkpoint needs its own line");
        KDA_FAIL(kBeginForward, "checkpoint_lines[", k, "] = ", line, " is also cache_indices[", stamp.seq,
                 "]: a checkpoint line may not be a line the batch reads or writes");
      }
      stamp.generation = generation_;
      stamp.seq = static_cast<int32_t>(k);
      stamp.checkpoint = true;

      // The window that holds the checkpoint's last row starts its chunks of this sequence at
      // offset `before`; the checkpoint must end one of them.
      const int64_t offset = (j + 1) * every;
      const int64_t w = (seq_begin + offset - 1) / window_rows_;
      const int64_t before = std::max<int64_t>(seq_begin, w * window_rows_) - seq_begin;
      const int64_t upto = std::min<int64_t>(seq_begin + rows, (w + 1) * window_rows_) - seq_begin;
      if ((offset - before) % kCheckpointChunk != 0 && offset != upto) {
        KDA_FAIL(kBeginForward, "checkpoint_lines[", k, "] (sequence ", s, ", after ", offset,
                 " rows) falls inside a ", kCheckpointChunk, "-token chunk: the window boundary at batch row ",
                 w * window_rows_, " splits sequence ", s, " after ", before, " rows, which is not a multiple of ",
                 kCheckpointChunk, " (start the sequence at a row that is a multiple of ", kCheckpointChunk,
                 ", with a largest bucket that is one, or move the checkpoint)");
      }
    }
  }
}

int64_t choose_bucket(const std::vector<int64_t>& buckets, int64_t tokens) {
  constexpr const char* fn = "kda::detail::choose_bucket";
  KDA_CHECK(!buckets.empty(), fn, "runtime.token_buckets is empty, expected at least one bucket");
  KDA_CHECK(tokens >= 1, fn, "tokens ", tokens, " must be at least 1");
  KDA_CHECK(tokens <= buckets.back(), fn, "tokens ", tokens,
            " exceed the largest bucket ", buckets.back(), " of runtime.token_buckets");
  return *std::lower_bound(buckets.begin(), buckets.end(), tokens);
}

int64_t max_windows(const Config& config) {
  const int64_t largest = config.runtime.largest_bucket();
  KDA_CHECK(largest > 0, "kda::detail::max_windows",
            "runtime.token_buckets has no positive bucket, largest is ", largest);
  return (config.runtime.batch_token_capacity() + largest - 1) / largest;
}

void plan_windows(const BatchView& batch, const Config& config, std::vector<WindowPlan>& windows) {
  windows.clear();
  const int64_t total = batch.num_tokens();
  if (total == 0) return;
  const int64_t width = config.runtime.largest_bucket();
  KDA_CHECK(width > 0, "kda::detail::plan_windows",
            "runtime.token_buckets has no positive bucket, largest is ", width);
  const int32_t* qsl = batch.query_start_loc;
  const int64_t n = batch.num_seqs;
  const int64_t count = (total + width - 1) / width;

  // Both bounds only move forward: adjacent windows share at most the one sequence that spans
  // their boundary, so the whole plan is one pass over query_start_loc.
  int64_t first = 0;
  for (int64_t w = 0; w < count; ++w) {
    const int64_t begin = w * width;
    const int64_t end = std::min(begin + width, total);
    // First sequence that has rows at or after `begin`, or is zero-length starting at `begin`.
    while (first < n && qsl[first + 1] <= begin && qsl[first] < begin) ++first;
    int64_t last = first;  // one past the window's last sequence
    if (w + 1 == count) {
      last = n;  // every later start is <= total, so the rest (zero-length at the end) is here
    } else {
      while (last < n && qsl[last] < end) ++last;
    }
    WindowPlan plan;
    plan.token_offset = begin;
    plan.num_tokens = end - begin;
    plan.bucket = choose_bucket(config.runtime.token_buckets, plan.num_tokens);
    plan.first_seq = first;
    plan.num_seqs = last - first;
    windows.push_back(plan);
  }
}

StagingLayout StagingLayout::for_max_seqs(int64_t max_seqs, int64_t max_checkpoints) {
  constexpr const char* fn = "kda::detail::StagingLayout::for_max_seqs";
  KDA_CHECK(max_seqs >= 0, fn, "max_seqs ", max_seqs, " must not be negative");
  KDA_CHECK(max_checkpoints >= 0, fn, "max_checkpoints ", max_checkpoints, " must not be negative");
  const auto m = static_cast<std::size_t>(max_seqs);
  StagingLayout layout;
  layout.qsl_offset = 0;
  layout.cache_offset = layout.qsl_offset + round_up_16((m + 1) * sizeof(int32_t));
  layout.flags_offset = layout.cache_offset + round_up_16(m * sizeof(int32_t));
  layout.checkpoint_seq_offset = layout.flags_offset + round_up_16(m * sizeof(bool));
  layout.has_checkpoints = max_checkpoints > 0;
  layout.checkpoint_entry_offset =
      layout.checkpoint_seq_offset + (layout.has_checkpoints ? m * sizeof(CheckpointSeq) : 0);
  layout.slot_bytes = layout.checkpoint_entry_offset +
                      static_cast<std::size_t>(max_checkpoints) * sizeof(CheckpointEntry);
  return layout;
}

StagingLayout StagingLayout::for_config(const Config& config) {
  return for_max_seqs(config.runtime.max_seqs, config.runtime.max_checkpoints);
}

void fill_window_staging(const BatchView& batch, const WindowPlan& window, const Config& config,
                         const StagingLayout& layout, void* slot) {
  const int64_t max_seqs = config.runtime.max_seqs;
  KDA_CHECK(window.num_seqs <= max_seqs, "kda::detail::fill_window_staging", "window has ",
            window.num_seqs, " sequences, more than runtime.max_seqs ", max_seqs);
  auto* bytes = static_cast<unsigned char*>(slot);
  auto* qsl = reinterpret_cast<int32_t*>(bytes + layout.qsl_offset);
  auto* cache = reinterpret_cast<int32_t*>(bytes + layout.cache_offset);
  auto* flags = reinterpret_cast<bool*>(bytes + layout.flags_offset);
  const int32_t null_line = config.pools.null_line;
  const int64_t n = window.num_seqs;
  const int64_t offset = window.token_offset;
  const int32_t* src_qsl = batch.query_start_loc + window.first_seq;
  const int32_t* src_cache = batch.cache_indices + window.first_seq;
  const bool* src_flags = batch.has_initial_state + window.first_seq;

  // Clamping to the window cuts a spanning sequence at the boundary; entry 0 is 0 and entry n
  // is num_tokens for every planned window.
  for (int64_t i = 0; i <= n; ++i) {
    const int64_t local = std::clamp<int64_t>(src_qsl[i] - offset, 0, window.num_tokens);
    qsl[i] = static_cast<int32_t>(local);
  }
  std::fill(qsl + n + 1, qsl + max_seqs + 1, qsl[n]);

  for (int64_t i = 0; i < n; ++i) {
    cache[i] = src_cache[i];
    // A sequence that started before this window continues from the state the earlier window
    // wrote into its line; a null-line sequence is skipped and never reads a state.
    const bool continues = src_qsl[i] < offset;
    flags[i] = src_cache[i] != null_line && (continues || src_flags[i]);
  }
  std::fill(cache + n, cache + max_seqs, null_line);
  std::fill(flags + n, flags + max_seqs, false);

  // Alignment gaps, so the slot's bytes depend on the batch only.
  const auto zero = [&](std::size_t from, std::size_t to) {
    if (to > from) std::memset(bytes + from, 0, to - from);
  };
  const auto m = static_cast<std::size_t>(max_seqs);
  zero(layout.qsl_offset + (m + 1) * sizeof(int32_t), layout.cache_offset);
  zero(layout.cache_offset + m * sizeof(int32_t), layout.flags_offset);
  zero(layout.flags_offset + m * sizeof(bool), layout.checkpoint_seq_offset);

  if (!layout.has_checkpoints) return;
  auto* seqs = reinterpret_cast<CheckpointSeq*>(bytes + layout.checkpoint_seq_offset);
  auto* entries = reinterpret_cast<CheckpointEntry*>(bytes + layout.checkpoint_entry_offset);
  const int64_t max_entries = config.runtime.max_checkpoints;
  std::fill(seqs, seqs + max_seqs, CheckpointSeq{});
  std::fill(entries, entries + max_entries, CheckpointEntry{});
  if (!batch.checkpoint_start_loc) return;
  const int64_t window_end = offset + window.num_tokens;
  int32_t used = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = window.first_seq + i;
    const int64_t first_k = batch.checkpoint_start_loc[s];
    const int64_t count = batch.checkpoint_start_loc[s + 1] - first_k;
    if (count == 0) continue;
    const int64_t every = batch.checkpoint_interval[s];
    const int64_t seq_begin = batch.query_start_loc[s], seq_end = batch.query_start_loc[s + 1];
    // The sequence's rows before the window (L0) and up to the window's end (L1): offsets
    // (j + 1) x every in (L0, L1] are this window's, j < count.
    const int64_t before = std::clamp<int64_t>(offset - seq_begin, 0, seq_end - seq_begin);
    const int64_t upto = std::clamp<int64_t>(window_end - seq_begin, 0, seq_end - seq_begin);
    const int64_t j_lo = before / every;
    const int64_t j_hi = std::min<int64_t>(count, upto / every);  // one past the last
    if (j_hi <= j_lo) continue;
    KDA_CHECK(used + (j_hi - j_lo) <= max_entries, "kda::detail::fill_window_staging", "window has ",
              used + (j_hi - j_lo), " checkpoints, more than runtime.max_checkpoints ", max_entries);
    CheckpointSeq& cs = seqs[i];
    cs.first = static_cast<int32_t>((j_lo + 1) * every - before);
    cs.interval = static_cast<int32_t>(every);
    cs.count = static_cast<int32_t>(j_hi - j_lo);
    cs.base = used;
    for (int64_t j = j_lo; j < j_hi; ++j) {
      CheckpointEntry& e = entries[used++];
      e.line = batch.checkpoint_lines[first_k + j];
      e.seq = static_cast<int32_t>(i);
      e.end = static_cast<int32_t>((j + 1) * every - before);
    }
  }
}

void fill_padding_staging(const Config& config, const StagingLayout& layout, void* slot) {
  // A batch of one empty sequence on the null line, widened to every entry.
  const int32_t qsl[2] = {0, 0};
  const int32_t line = config.pools.null_line;
  const bool no_state = false;
  BatchView batch;
  batch.query_start_loc = qsl;
  batch.cache_indices = &line;
  batch.has_initial_state = &no_state;
  batch.num_seqs = 1;
  WindowPlan window;
  window.num_seqs = 1;
  fill_window_staging(batch, window, config, layout, slot);
}

}  // namespace kda::detail
