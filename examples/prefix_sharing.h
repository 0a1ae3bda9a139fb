// prefill_driver --prefix-sharing: prefix caching with state checkpoints, as a server would do it.
#pragma once

#include <cstdint>
#include <string>

#include "kda/config.h"
#include "kda/prefill.h"

// What run_prefix_sharing needs of the config that `config` does not give, as one sentence naming
// the keys and this config's values; empty when the scenario can run. Needs no CUDA, so that
// --validate refuses such a config as a GPU run would.
std::string prefix_sharing_unmet(const kda::Config& config);

// Prefills prompt A with state checkpoints every `interval` tokens (BatchView::checkpoint_*),
// then prompt B, whose first 75% are A's, twice: in full from an empty state, and from A's
// checkpoint at the shared prefix (copied into a fresh pool line, has_initial_state) over B's
// remaining 25% only. Prints the tokens saved, both GPU times, and how far the continued run's
// output rows and final states are from the full prefill of B (differing bits and max |diff|).
// `module` has weights and pools; its config must meet prefix_sharing_unmet (runtime.layer_steps:
// full, a batch token capacity of at least 512, runtime.max_checkpoints >= 7, pools.cache_lines
// >= 11: ten lines besides the null line); prints why and returns 2 otherwise. Returns 0 when the
// continued run agrees with the full one within the layer's tolerance, 1 otherwise. Throws
// kda::Error or std::runtime_error on CUDA errors.
int run_prefix_sharing(kda::PrefillModule& module, uint64_t seed, kda::Stream stream);
