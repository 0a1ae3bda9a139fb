// The varlen map of the packed conv and the chunked recurrence (common/varlen_map.h), checked
// on the CPU against a naive scan: every token is covered exactly once, chunks stay inside their sequence, only
// chunk 0 starts at a sequence start, and the radix-32 search (scalar and ballot-style) finds
// the same sequence as a plain search.
#include <doctest/doctest.h>

#include <algorithm>
#include <bitset>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/varlen_map.h"

namespace {

using kda::varlen::SlotChunk;

// f(s) for every s, and the naive answer: the largest s with f(s) <= p, or -1.
struct NaiveMap {
  std::vector<int64_t> first;
  explicit NaiveMap(const std::vector<int32_t>& qsl, int64_t num_seqs, int shift) {
    for (int64_t s = 0; s < num_seqs; ++s)
      first.push_back(kda::varlen::first_slot(qsl[s], s, shift));
  }
  int64_t sequence_of(int64_t p) const {
    auto it = std::upper_bound(first.begin(), first.end(), p);
    return (it - first.begin()) - 1;
  }
};

// The warp-cooperative count as the kernel does it: lane j's predicate into bit j of a ballot
// mask, then a population count. On a well-formed map the set bits are a prefix of the lanes.
int count_by_ballot(const std::vector<int32_t>& qsl, int64_t num_seqs, int shift, int64_t p,
                    int64_t base, int64_t stride, bool* prefix) {
  uint32_t mask = 0;
  for (int lane = 0; lane < 32; ++lane) {
    const int64_t cand = base + lane * stride;
    const bool le = cand < num_seqs && kda::varlen::first_slot(qsl[cand], cand, shift) <= p;
    if (le) mask |= 1u << lane;
  }
  const int n = static_cast<int>(std::bitset<32>(mask).count());
  const uint32_t expected = n == 32 ? 0xFFFFFFFFu : ((1u << n) - 1u);
  if (mask != expected) *prefix = false;
  return n;
}

struct Batch {
  std::vector<int32_t> qsl;  // num_seqs + 1 entries
  int64_t num_seqs = 0;      // capacity
  int64_t num_tokens = 0;    // capacity >= qsl[num_seqs]
  std::string name;
};

// Checks the whole map of one batch for one chunk length; returns the number of programs
// that did work.
int64_t check_map(const Batch& b, int shift) {
  const int64_t chunk = int64_t{1} << shift;
  const int steps = kda::varlen::search_steps(b.num_seqs);
  const int64_t stride = kda::varlen::search_stride(steps);
  const int64_t programs = kda::varlen::slot_count(b.num_tokens, b.num_seqs, shift);
  const NaiveMap naive(b.qsl, b.num_seqs, shift);

  std::vector<int> covered(static_cast<std::size_t>(b.num_tokens), 0);
  std::vector<int> first_chunks(static_cast<std::size_t>(b.num_seqs), 0);
  int64_t working = 0;
  int64_t search_mismatches = 0, ballot_mismatches = 0, not_prefix = 0, outside = 0,
          too_long = 0, bad_chunk0 = 0, derived = 0, derived_mismatches = 0, same_sequence = 0;
  SlotChunk prev;
  for (int64_t p = 0; p < programs; ++p) {
    const SlotChunk pc = kda::varlen::locate_slot_scalar(b.qsl.data(), b.num_seqs, shift,
                                                             steps, stride, p);
    if (pc.seq != naive.sequence_of(p)) ++search_mismatches;
    // A warp that ran p - 1 derives p without a search whenever next_chunk_in_sequence says so:
    // the result must be the search's, field for field.
    SlotChunk next;
    if (p > 0 && prev.seq >= 0 && pc.seq == prev.seq) ++same_sequence;
    if (p > 0 && kda::varlen::next_chunk_in_sequence(prev, b.num_seqs, shift, p, next)) {
      ++derived;
      if (next.seq != pc.seq || next.chunk != pc.chunk || next.begin != pc.begin || next.end != pc.end ||
          next.seq_begin != pc.seq_begin || next.seq_end != pc.seq_end)
        ++derived_mismatches;
    }
    prev = pc;

    bool prefix = true;
    const int64_t seq_ballot = kda::varlen::find_sequence(steps, stride, [&](int64_t base, int64_t st) {
      return count_by_ballot(b.qsl, b.num_seqs, shift, p, base, st, &prefix);
    });
    if (seq_ballot != pc.seq) ++ballot_mismatches;
    if (!prefix) ++not_prefix;

    if (pc.seq < 0 || pc.begin >= pc.end) continue;
    ++working;
    if (pc.seq_begin != b.qsl[pc.seq] || pc.seq_end != b.qsl[pc.seq + 1]) ++outside;
    if (pc.begin < pc.seq_begin || pc.end > pc.seq_end) ++outside;
    if (pc.end - pc.begin > chunk) ++too_long;
    // Chunk 0 is exactly the one that starts at the sequence start.
    if ((pc.chunk == 0) != (pc.begin == pc.seq_begin)) ++bad_chunk0;
    if (pc.chunk == 0) ++first_chunks[static_cast<std::size_t>(pc.seq)];
    for (int64_t t = pc.begin; t < pc.end; ++t) ++covered[static_cast<std::size_t>(t)];
  }
  CHECK(search_mismatches == 0);
  CHECK(derived_mismatches == 0);
  // Derived exactly when the sequence stays the same: a search only at sequence boundaries.
  CHECK(derived == same_sequence);
  CHECK(ballot_mismatches == 0);
  CHECK(not_prefix == 0);
  CHECK(outside == 0);
  CHECK(too_long == 0);
  CHECK(bad_chunk0 == 0);

  int64_t wrong_cover = 0, wrong_first = 0;
  const int64_t lo = b.qsl[0], hi = b.qsl[static_cast<std::size_t>(b.num_seqs)];
  for (int64_t t = 0; t < b.num_tokens; ++t) {
    const int expected = (t >= lo && t < hi) ? 1 : 0;
    if (covered[static_cast<std::size_t>(t)] != expected) ++wrong_cover;
  }
  for (int64_t s = 0; s < b.num_seqs; ++s) {
    const int expected = b.qsl[s + 1] > b.qsl[s] ? 1 : 0;
    if (first_chunks[static_cast<std::size_t>(s)] != expected) ++wrong_first;
  }
  CHECK(wrong_cover == 0);
  CHECK(wrong_first == 0);
  return working;
}

// Sequence lengths drawn from a mix that stresses the map: zero-length, 1..3 tokens,
// around a chunk, long.
Batch random_batch(std::mt19937_64& rng, int64_t real_seqs, int64_t extra_seqs,
                   int64_t extra_tokens, bool huge, const std::string& name) {
  Batch b;
  b.name = name;
  std::uniform_int_distribution<int> kind(0, 9);
  std::uniform_int_distribution<int> tiny(1, 3);
  std::uniform_int_distribution<int> medium(4, 300);
  std::uniform_int_distribution<int> long_len(300, 3000);
  b.qsl.push_back(0);
  const int64_t huge_at = huge ? real_seqs / 2 : -1;
  for (int64_t s = 0; s < real_seqs; ++s) {
    int64_t len;
    if (s == huge_at) {
      len = 100003;
    } else {
      switch (kind(rng)) {
        case 0: case 1: len = 0; break;
        case 2: case 3: len = tiny(rng); break;
        case 9: len = long_len(rng); break;
        default: len = medium(rng); break;
      }
    }
    b.qsl.push_back(static_cast<int32_t>(b.qsl.back() + len));
  }
  // Capacity padding: repeated query_start_loc values, spare token rows.
  for (int64_t s = 0; s < extra_seqs; ++s) b.qsl.push_back(b.qsl.back());
  b.num_seqs = real_seqs + extra_seqs;
  b.num_tokens = b.qsl.back() + extra_tokens;
  return b;
}

}  // namespace

TEST_CASE("search_steps is the smallest level count n >= 1 with 32^n >= num_seqs") {
  CHECK(kda::varlen::search_steps(0) == 1);
  CHECK(kda::varlen::search_steps(1) == 1);
  CHECK(kda::varlen::search_steps(32) == 1);
  CHECK(kda::varlen::search_steps(33) == 2);
  CHECK(kda::varlen::search_steps(1024) == 2);
  CHECK(kda::varlen::search_steps(1025) == 3);
  CHECK(kda::varlen::search_steps(40000) == 4);
  CHECK(kda::varlen::search_steps(int64_t{1} << 30) == 6);
  CHECK(kda::varlen::search_steps((int64_t{1} << 30) + 1) == 7);
  CHECK(kda::varlen::search_stride(1) == 1);
  CHECK(kda::varlen::search_stride(2) == 32);
  CHECK(kda::varlen::search_stride(4) == 32768);
}

TEST_CASE("the grid has num_tokens / C + num_seqs programs per column block") {
  CHECK(kda::varlen::slot_count(2048, 1, 6) == 33);
  CHECK(kda::varlen::slot_count(2047, 4, 6) == 35);
  CHECK(kda::varlen::slot_count(16384, 256, 6) == 512);
  CHECK(kda::varlen::slot_count(0, 7, 4) == 7);
}

TEST_CASE("f(s) = qsl[s] / C + s is strictly increasing with room for every chunk") {
  // f(s+1) - f(s) >= ceil(len / C) for all alignments of a sequence against chunk boundaries.
  for (int shift = 3; shift <= 8; ++shift) {
    const int64_t c = int64_t{1} << shift;
    int64_t bad = 0;
    for (int32_t a = 0; a < 3 * c; ++a) {
      for (int32_t len = 0; len < 5 * c; ++len) {
        const int64_t fa = kda::varlen::first_slot(a, 7, shift);
        const int64_t fb = kda::varlen::first_slot(a + len, 8, shift);
        if (fb - fa < (len + c - 1) / c || fb <= fa) ++bad;
      }
    }
    CHECK_MESSAGE(bad == 0, "chunk ", c);
  }
}

TEST_CASE("a single sequence is cut into chunks of C tokens, the last one partial") {
  const Batch b{{0, 1000}, 1, 1000, "one sequence"};
  const int shift = 6;
  const int steps = kda::varlen::search_steps(1);
  const int64_t stride = kda::varlen::search_stride(steps);
  for (int64_t p = 0; p < kda::varlen::slot_count(1000, 1, shift); ++p) {
    const SlotChunk pc = kda::varlen::locate_slot_scalar(b.qsl.data(), 1, shift, steps, stride, p);
    CAPTURE(p);
    CHECK(pc.seq == 0);
    CHECK(pc.chunk == p);
    CHECK(pc.begin == 64 * p);
    CHECK(pc.end == std::min<int64_t>(64 * (p + 1), 1000));
  }
  CHECK(check_map(b, shift) == 16);
}

TEST_CASE("chunks start at the sequence start, not at multiples of C in the batch") {
  // Sequence 1 starts at token 70: its chunks are [70, 134), [134, 150); chunk 0 of each
  // sequence is the one that reads the conv state.
  const std::vector<int32_t> qsl = {0, 70, 150};
  const int shift = 6, steps = 1;
  const int64_t stride = 1;
  // f(0) = 0, f(1) = 70 / 64 + 1 = 2.
  auto at = [&](int64_t p) {
    return kda::varlen::locate_slot_scalar(qsl.data(), 2, shift, steps, stride, p);
  };
  CHECK(at(0).seq == 0);
  CHECK(at(0).begin == 0);
  CHECK(at(0).end == 64);
  CHECK(at(1).seq == 0);
  CHECK(at(1).begin == 64);
  CHECK(at(1).end == 70);
  CHECK(at(2).seq == 1);
  CHECK(at(2).chunk == 0);
  CHECK(at(2).begin == 70);
  CHECK(at(2).end == 134);
  CHECK(at(3).seq == 1);
  CHECK(at(3).chunk == 1);
  CHECK(at(3).begin == 134);
  CHECK(at(3).end == 150);
  // Program 4 exists (150 / 64 + 2 = 4 programs), but has nothing to do.
  CHECK(at(4).seq == 1);
  CHECK(at(4).begin >= at(4).end);
}

TEST_CASE("programs before the first sequence's f(0) do nothing when qsl[0] > 0") {
  const Batch b{{200, 260, 260, 300}, 3, 300, "offset start"};
  for (int shift = 3; shift <= 6; ++shift) {
    CAPTURE(shift);
    const int64_t f0 = kda::varlen::first_slot(200, 0, shift);
    for (int64_t p = 0; p < f0; ++p) {
      const SlotChunk pc = kda::varlen::locate_slot_scalar(b.qsl.data(), 3, shift, 1, 1, p);
      CHECK(pc.seq == -1);
    }
    check_map(b, shift);
  }
}

TEST_CASE("the map covers every token exactly once for random batches") {
  std::mt19937_64 rng(20261202);
  std::vector<Batch> batches;
  batches.push_back(random_batch(rng, 1, 0, 0, false, "1 sequence"));
  batches.push_back(random_batch(rng, 5, 0, 0, false, "5 sequences"));
  batches.push_back(random_batch(rng, 31, 1, 17, false, "31 + 1 padding"));
  batches.push_back(random_batch(rng, 33, 0, 0, false, "33 sequences (2 levels)"));
  batches.push_back(random_batch(rng, 200, 56, 4093, true, "200 + 56 padding, one huge"));
  batches.push_back(random_batch(rng, 1025, 0, 1, false, "1025 sequences (3 levels)"));
  batches.push_back(random_batch(rng, 3, 1021, 5000, false, "3 real of 1024 capacity"));
  {
    Batch zero;
    zero.name = "all sequences empty";
    zero.qsl.assign(65, 0);
    zero.num_seqs = 64;
    zero.num_tokens = 512;
    batches.push_back(zero);
  }
  {
    Batch tiny;
    tiny.name = "1..3-token sequences";
    std::uniform_int_distribution<int> len(1, 3);
    tiny.qsl.push_back(0);
    for (int s = 0; s < 3000; ++s) tiny.qsl.push_back(tiny.qsl.back() + len(rng));
    tiny.num_seqs = 3000;
    tiny.num_tokens = tiny.qsl.back();
    batches.push_back(tiny);
  }
  for (const Batch& b : batches) {
    for (int shift : {3, 4, 5, 6, 7, 8}) {
      CAPTURE(b.name);
      CAPTURE(shift);
      check_map(b, shift);
    }
  }
}

TEST_CASE("the map handles 40000 sequences, padded capacity and a huge sequence") {
  std::mt19937_64 rng(7);
  const Batch b = random_batch(rng, 39000, 1000, 12345, true, "40000 capacity");
  REQUIRE(b.num_seqs == 40000);
  REQUIRE(kda::varlen::search_steps(b.num_seqs) == 4);
  for (int shift : {4, 6}) {
    CAPTURE(shift);
    const int64_t working = check_map(b, shift);
    // Every sequence of len tokens needs ceil(len / C) programs.
    int64_t needed = 0;
    for (int64_t s = 0; s < b.num_seqs; ++s) {
      const int64_t len = b.qsl[s + 1] - b.qsl[s];
      needed += (len + (int64_t{1} << shift) - 1) >> shift;
    }
    CHECK(working == needed);
  }
}
