// A batch's host arrays for the GPU tests; view() points into them (so the HostBatch must
// outlive the view's use). Sequence s owns rows [qsl[s], qsl[s + 1]) and pool line lines[s].
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kda/prefill.h"

namespace kda::test {

struct HostBatch {
  std::vector<int32_t> qsl{0}, lines;
  std::unique_ptr<bool[]> flags;  // lines.size() entries

  kda::BatchView view() const {
    kda::BatchView v;
    v.query_start_loc = qsl.data();
    v.cache_indices = lines.data();
    v.has_initial_state = flags.get();
    v.num_seqs = static_cast<int64_t>(lines.size());
    return v;
  }
  int64_t tokens() const { return qsl.back(); }
};

}  // namespace kda::test
