// The varlen map shared by the packed conv (src/conv) and the chunked recurrence
// (src/recurrence/kda_chunked*): which (sequence, token chunk) a chunk slot holds, computed from
// query_start_loc alone, so a grid sized by slot_count() depends only on capacities (CUDA
// graph safe). The conv runs one program per slot and column block, the chunked recurrence's
// phase 1 one block per slot and head.
//
// Chunk length C = 2^chunk_shift tokens. For sequence s let f(s) = floor(qsl[s] / C) + s.
// f is strictly increasing and f(s+1) - f(s) >= ceil(len(s) / C), because
// floor(b/C) - floor(a/C) >= floor((b-a)/C). Slot p belongs to the largest s in [0, num_seqs)
// with f(s) <= p; its chunk k = p - f(s) covers the tokens
// [qsl[s] + k*C, min(qsl[s] + (k+1)*C, qsl[s+1])), which may be empty. Chunks are relative to the
// sequence start, so only chunk 0 needs history carried in from a cache line. Since
// f(num_seqs - 1) + ceil(len / C) <= floor(qsl[num_seqs] / C) + num_seqs, every chunk of a batch
// with qsl[num_seqs] <= num_tokens has a slot below slot_count().
//
// The search is radix-32: search_steps levels (32^steps >= num_seqs); each level compares
// f(base + j*stride) with p for the 32 candidates j and keeps the last one that is <= p.
// On the host (and in tests) a loop counts the candidates; in the kernels the 32 lanes of a
// warp each load one candidate and count with __ballot_sync. Both go through
// find_sequence(), so they give the same answer when the predicates form a prefix.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "kda/varlen.h"

namespace kda::varlen {

constexpr int kRadix = 32;
constexpr int kRadixShift = 5;

KDA_HOST_DEVICE inline int popcount32(uint32_t mask) {
#if defined(__CUDA_ARCH__)
  return __popc(mask);
#else
  return __builtin_popcount(mask);
#endif
}

// Levels of the radix search for num_seqs sequences: the smallest n >= 1 with 32^n >= num_seqs.
KDA_HOST_DEVICE inline int search_steps(int64_t num_seqs) {
  int steps = 1;
  int64_t reach = kRadix;
  while (reach < num_seqs) {
    reach <<= kRadixShift;
    ++steps;
  }
  return steps;
}

// Candidate spacing at the first level: 32^(steps - 1).
KDA_HOST_DEVICE inline int64_t search_stride(int steps) {
  return int64_t{1} << (kRadixShift * (steps - 1));
}

// Chunk slots for capacities num_tokens and num_seqs.
KDA_HOST_DEVICE inline int64_t slot_count(int64_t num_tokens, int64_t num_seqs, int chunk_shift) {
  return (num_tokens >> chunk_shift) + num_seqs;
}

// f(s): the first slot of sequence s. An arithmetic shift is floor division, also for the
// negative qsl values of malformed input (the kernels skip such sequences afterwards).
KDA_HOST_DEVICE inline int64_t first_slot(int32_t qsl_s, int64_t s, int chunk_shift) {
  return (static_cast<int64_t>(qsl_s) >> chunk_shift) + s;
}

// The radix search. count(base, stride) returns how many of the candidates
// base + j*stride (j in [0, 32), candidate < num_seqs) have f(candidate) <= p; because f is
// increasing they are a prefix of j. Returns the sequence of slot p, or -1 when
// f(0) > p (no sequence starts at or before p).
template <typename CountFn>
KDA_HOST_DEVICE inline int64_t find_sequence(int steps, int64_t stride, CountFn&& count) {
  int64_t base = 0;
  for (int level = 0; level < steps; ++level) {
    const int n = count(base, stride);
    // Past level 0, candidate j = 0 is the previous level's answer, so n >= 1.
    if (n == 0) return -1;
    base += static_cast<int64_t>(n - 1) * stride;
    stride >>= kRadixShift;
  }
  return base;
}

// One level of the search as a plain loop over the 32 candidates.
KDA_HOST_DEVICE inline int count_candidates_scalar(const int32_t* qsl, int64_t num_seqs,
                                                   int chunk_shift, int64_t p, int64_t base,
                                                   int64_t stride) {
  int n = 0;
  for (int j = 0; j < kRadix; ++j) {
    const int64_t cand = base + j * stride;
    if (cand < num_seqs && first_slot(qsl[cand], cand, chunk_shift) <= p) ++n;
  }
  return n;
}

// What slot p holds: tokens [begin, end) of sequence seq, chunk index chunk; seq_begin /
// seq_end are qsl[seq] / qsl[seq + 1]. seq == -1 or begin >= end: nothing.
struct SlotChunk {
  int64_t seq = -1;
  int64_t chunk = 0;
  int64_t begin = 0;
  int64_t end = 0;
  int64_t seq_begin = 0;
  int64_t seq_end = 0;
};

// The chunk of slot p in sequence seq, whose tokens are [seq_begin, seq_end).
KDA_HOST_DEVICE inline SlotChunk chunk_in_bounds(int64_t seq, int32_t seq_begin, int32_t seq_end,
                                                 int chunk_shift, int64_t p) {
  SlotChunk pc;
  pc.seq = seq;
  pc.seq_begin = seq_begin;
  pc.seq_end = seq_end;
  pc.chunk = p - first_slot(seq_begin, seq, chunk_shift);
  pc.begin = pc.seq_begin + pc.chunk * (int64_t{1} << chunk_shift);
  const int64_t chunk_end = pc.begin + (int64_t{1} << chunk_shift);
  pc.end = chunk_end < pc.seq_end ? chunk_end : pc.seq_end;
  return pc;
}

KDA_HOST_DEVICE inline SlotChunk chunk_of_sequence(const int32_t* qsl, int64_t seq,
                                                   int chunk_shift, int64_t p) {
  if (seq < 0) return SlotChunk{};
  return chunk_in_bounds(seq, qsl[seq], qsl[seq + 1], chunk_shift, p);
}

// The chunk of slot next_p (> the slot pc was found for) without a search, when it belongs to
// pc's sequence: seq is still the largest s with f(s) <= next_p exactly when seq is the last
// sequence or next_p < f(seq + 1) = first_slot(qsl[seq + 1] = pc.seq_end, seq + 1).
// Returns false (the caller searches) otherwise, and when pc has no sequence. A warp that runs
// consecutive slots (the packed conv's chunks_per_cta) searches only at sequence boundaries.
KDA_HOST_DEVICE inline bool next_chunk_in_sequence(const SlotChunk& pc, int64_t num_seqs,
                                                   int chunk_shift, int64_t next_p,
                                                   SlotChunk& next) {
  if (pc.seq < 0) return false;
  if (pc.seq + 1 < num_seqs &&
      next_p >= first_slot(static_cast<int32_t>(pc.seq_end), pc.seq + 1, chunk_shift))
    return false;
  next = chunk_in_bounds(pc.seq, static_cast<int32_t>(pc.seq_begin), static_cast<int32_t>(pc.seq_end),
                         chunk_shift, next_p);
  return true;
}

// The scalar map (host and tests). steps and stride as from search_steps / search_stride.
KDA_HOST_DEVICE inline SlotChunk locate_slot_scalar(const int32_t* qsl, int64_t num_seqs,
                                                    int chunk_shift, int steps, int64_t stride,
                                                    int64_t p) {
  const int64_t seq = find_sequence(steps, stride, [&](int64_t base, int64_t st) {
    return count_candidates_scalar(qsl, num_seqs, chunk_shift, p, base, st);
  });
  return chunk_of_sequence(qsl, seq, chunk_shift, p);
}

// The warp-cooperative map, called by all 32 lanes of a warp with the same p: lane j tests
// candidate j, so each level is one load per lane and one ballot. load(i) reads qsl[i] (the
// kernels use the read-only cache); ballot(pred) returns the warp's 32 predicates as a mask;
// shfl(v, j) returns lane j's v (__ballot_sync / __shfl_sync on the device, an emulation in the
// CPU tests). Every lane gets the same chunk, the same as locate_slot_scalar's.
//
// The sequence's bounds qsl[seq] and qsl[seq + 1] come from the last level's loads by shuffle,
// not from two more loads that would wait for the last ballot: at that level (stride 1) lane j
// holds qsl[base + j], seq = base + n - 1, so qsl[seq] is lane n - 1's and qsl[seq + 1] lane
// n's. Lanes load candidates up to num_seqs inclusive (qsl has num_seqs + 1 entries; only
// candidates below num_seqs vote), so lane n's is loaded whenever n < 32; for n == 32 one load
// remains. This takes one dependent memory round trip off every warp's start-up.
template <typename LoadFn, typename BallotFn, typename ShflFn>
KDA_HOST_DEVICE inline SlotChunk locate_slot_warp(int64_t num_seqs, int chunk_shift, int steps,
                                                  int64_t stride, int64_t p, int lane,
                                                  LoadFn&& load, BallotFn&& ballot,
                                                  ShflFn&& shfl) {
  int32_t value = 0;  // this lane's qsl[candidate] at the latest level
  int n = 0;          // the latest level's count
  const int64_t seq = find_sequence(steps, stride, [&](int64_t base, int64_t st) {
    const int64_t cand = base + lane * st;
    value = cand <= num_seqs ? load(cand) : 0;
    const bool le = cand < num_seqs && first_slot(value, cand, chunk_shift) <= p;
    n = popcount32(ballot(le));
    return n;
  });
  if (seq < 0) return SlotChunk{};
  // The last level has stride 1 and answered seq = (its base) + n - 1.
  const int32_t seq_begin = shfl(value, n - 1);
  const int32_t next = shfl(value, n < kRadix ? n : 0);
  return chunk_in_bounds(seq, seq_begin, n < kRadix ? next : load(seq + 1), chunk_shift, p);
}

// The VarlenArgs fields that every op's kernel params hold flat under the same names, copied by
// each plan's make_params (host code). The null line each op carries its own way: a flag and a
// value (the conv paths), or -1 for none (the recurrence, the conv checkpoints).
template <typename Params>
void copy_varlen_fields(Params& p, const VarlenArgs& v) {
  p.query_start_loc = v.query_start_loc;
  p.num_seqs = v.num_seqs;
  p.cache_indices = v.cache_indices;
  p.has_initial_state = v.has_initial_state;
  p.cache_lines = v.cache_lines;
}

}  // namespace kda::varlen
