// kda-prefill: the varlen batch metadata, spelled one way for every op that reads it.
// Needs no CUDA header.
#pragma once

#include <cstdint>
#include <optional>

#include "kda/error.h"  // each public header makes kda::Error usable

namespace kda {

// A batch of sequences packed row after row, each with its line in a state pool. All pointers
// are device pointers (host pointers for the CPU references). The counts are capacities: a
// launch's grid depends on them only, never on the arrays' contents, so one captured launch
// replays with new metadata. Sequences past the batch's real ones have zero rows (repeated
// query_start_loc values). Each op says which fields it reads and what it skips.
struct VarlenArgs {
  const int32_t* query_start_loc = nullptr;  // (num_seqs + 1), non-decreasing: s owns [qsl[s], qsl[s+1])
  int64_t num_seqs = 0;                      // entries of the arrays below (a capacity)
  const int32_t* cache_indices = nullptr;    // (num_seqs): each sequence's pool line
  const bool* has_initial_state = nullptr;   // (num_seqs); nullptr: no sequence has one
  std::optional<int32_t> null_line = 0;      // sequences on this line are skipped; nullopt: none
  int64_t cache_lines = 0;                   // lines of the pool: an index outside [0, cache_lines) is skipped
};

}  // namespace kda
