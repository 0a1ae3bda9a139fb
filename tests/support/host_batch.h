// A batch's host arrays for the tests; view() points into them (so the HostBatch must outlive
// the view's use). Sequence s owns rows [qsl[s], qsl[s + 1]) and pool line lines[s].
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kda/prefill.h"

namespace kda::test {

struct HostBatch {
  std::vector<int32_t> qsl{0}, lines;
  std::unique_ptr<bool[]> flags;  // lines.size() entries
  // view()'s num_seqs when set (tests of bad metadata); lines.size() otherwise.
  std::optional<int64_t> num_seqs_override;
  // State checkpoints (BatchView::checkpoint_*): empty (none), or one interval per sequence
  // and the checkpoint_start_loc offsets (num_seqs + 1) into ckpt_lines.
  std::vector<int32_t> ckpt_interval, ckpt_start, ckpt_lines;

  // Gives sequence s (of the sequences already added) checkpoints every `every` rows on
  // `on_lines`, replacing any it had.
  void set_checkpoints(int64_t s, int32_t every, const std::vector<int32_t>& on_lines) {
    const std::size_t n = lines.size();
    std::vector<std::vector<int32_t>> per_seq(n);
    for (std::size_t i = 0; i < n && !ckpt_start.empty(); ++i)
      per_seq[i].assign(ckpt_lines.begin() + ckpt_start[i], ckpt_lines.begin() + ckpt_start[i + 1]);
    ckpt_interval.resize(n, 0);
    ckpt_interval[static_cast<std::size_t>(s)] = every;
    per_seq[static_cast<std::size_t>(s)] = on_lines;
    ckpt_start.assign(1, 0);
    ckpt_lines.clear();
    for (const auto& l : per_seq) {
      ckpt_lines.insert(ckpt_lines.end(), l.begin(), l.end());
      ckpt_start.push_back(static_cast<int32_t>(ckpt_lines.size()));
    }
  }

  int64_t num_seqs() const {
    return num_seqs_override ? *num_seqs_override : static_cast<int64_t>(lines.size());
  }
  kda::BatchView view() const {
    kda::BatchView v;
    v.query_start_loc = qsl.data();
    v.cache_indices = lines.data();
    v.has_initial_state = flags.get();
    v.num_seqs = num_seqs();
    if (!ckpt_start.empty()) {
      v.checkpoint_interval = ckpt_interval.data();
      v.checkpoint_start_loc = ckpt_start.data();
      v.checkpoint_lines = ckpt_lines.data();
    }
    return v;
  }
  int64_t tokens() const { return qsl.back(); }
};

// Sequences of the given lengths on the given lines, with the given has_initial_state flags
// (all three of one length).
inline HostBatch make_batch(const std::vector<int32_t>& lengths, const std::vector<int32_t>& lines,
                            const std::vector<bool>& initial) {
  HostBatch b;
  b.flags = std::make_unique<bool[]>(lengths.size() + 1);
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    b.qsl.push_back(b.qsl.back() + lengths[s]);
    b.lines.push_back(lines[s]);
    b.flags[s] = initial[s];
  }
  return b;
}

}  // namespace kda::test
