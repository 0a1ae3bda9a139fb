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

  int64_t num_seqs() const {
    return num_seqs_override ? *num_seqs_override : static_cast<int64_t>(lines.size());
  }
  kda::BatchView view() const {
    kda::BatchView v;
    v.query_start_loc = qsl.data();
    v.cache_indices = lines.data();
    v.has_initial_state = flags.get();
    v.num_seqs = num_seqs();
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
