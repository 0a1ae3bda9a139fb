// Overlap of pool lines on the CPU: contiguous buffers, strided pools with gaps, interleaved
// pools (one pool's lines in the other's gaps) and the messages that name both ranges.
#include "runtime/state_pools.h"

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>

using kda::detail::LineSpan;
using kda::detail::overlap_message;
using kda::detail::spans_overlap;

namespace {
LineSpan lines(const char* name, uintptr_t base, uint64_t stride, uint64_t line, int64_t n) {
  LineSpan s;
  s.name = name;
  s.base = base;
  s.stride_bytes = stride;
  s.line_bytes = line;
  s.lines = n;
  return s;
}

// Byte by byte: the lowest byte in a line of both, or 0 for none (bases are never 0 here).
uintptr_t brute_first_common(const LineSpan& a, const LineSpan& b) {
  for (uintptr_t p = std::max(a.base, b.base); p < std::min(a.end(), b.end()); ++p) {
    auto in = [p](const LineSpan& s) {
      if (p < s.base || p >= s.end()) return false;
      return (p - s.base) % s.stride_bytes < s.line_bytes;
    };
    if (in(a) && in(b)) return p;
  }
  return 0;
}
}  // namespace

TEST_CASE("contiguous ranges overlap when they share a byte, not when they only touch") {
  const LineSpan a = LineSpan::contiguous("a", reinterpret_cast<void*>(0x1000), 0x100);
  CHECK_FALSE(spans_overlap(a, LineSpan::contiguous("b", reinterpret_cast<void*>(0x1100), 0x10)));
  CHECK_FALSE(spans_overlap(a, LineSpan::contiguous("b", reinterpret_cast<void*>(0xF00), 0x100)));
  uintptr_t first = 0;
  CHECK(spans_overlap(a, LineSpan::contiguous("b", reinterpret_cast<void*>(0x10FF), 0x10), &first));
  CHECK(first == 0x10FF);
  CHECK_FALSE(spans_overlap(a, LineSpan::contiguous("empty", reinterpret_cast<void*>(0x1010), 0)));
}

TEST_CASE("interleaved pools whose lines sit in each other's gaps do not overlap") {
  // conv lines of 64 B and recurrent lines of 192 B in 256-B pages, as a server's paged cache
  // may lay them out.
  const LineSpan conv = lines("conv", 0x10000, 256, 64, 100);
  const LineSpan rec = lines("recurrent", 0x10040, 256, 192, 100);
  CHECK_FALSE(spans_overlap(conv, rec));
  CHECK(overlap_message(conv, rec).empty());
  // One byte more per recurrent line reaches the next page's conv line.
  const LineSpan rec_long = lines("recurrent", 0x10040, 256, 193, 100);
  uintptr_t first = 0;
  REQUIRE(spans_overlap(conv, rec_long, &first));
  CHECK(first == 0x10100);
  const std::string msg = overlap_message(rec_long, conv);
  CHECK(msg.find("recurrent [0x10040, 0x16401): 100 lines of 193 B, 256 B apart overlaps conv [0x10000, 0x16340): "
                 "100 lines of 64 B, 256 B apart (first common byte 0x10100)") != std::string::npos);
}

TEST_CASE("a buffer in a pool's gap does not overlap; one reaching a line does") {
  const LineSpan pool = lines("pool", 0x20000, 0x1000, 0x800, 512);
  CHECK_FALSE(spans_overlap(pool, LineSpan::contiguous("buf", reinterpret_cast<void*>(0x20000 + 300 * 0x1000 + 0x800), 0x800)));
  CHECK(spans_overlap(pool, LineSpan::contiguous("buf", reinterpret_cast<void*>(0x20000 + 300 * 0x1000 + 0x800), 0x801)));
  CHECK(spans_overlap(LineSpan::contiguous("huge", reinterpret_cast<void*>(0x10), 0x10000000), pool));
}

TEST_CASE("spans_overlap agrees with a byte-by-byte search on random strided spans") {
  std::mt19937_64 rng(7);
  auto pick = [&](uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng); };
  int overlapping = 0;
  for (int i = 0; i < 3000; ++i) {
    const uint64_t la = pick(1, 40), lb = pick(1, 40);
    const LineSpan a = lines("a", 0x1000 + pick(0, 300), la + pick(0, 40), la, static_cast<int64_t>(pick(1, 12)));
    const LineSpan b = lines("b", 0x1000 + pick(0, 300), lb + pick(0, 40), lb, static_cast<int64_t>(pick(1, 12)));
    uintptr_t first = 0;
    const bool got = spans_overlap(a, b, &first);
    const uintptr_t want = brute_first_common(a, b);
    CAPTURE(a.describe());
    CAPTURE(b.describe());
    REQUIRE(got == (want != 0));
    if (got) {
      CHECK(first == want);
      ++overlapping;
    }
    CHECK(spans_overlap(b, a) == got);
  }
  CHECK(overlapping > 300);
  CHECK(overlapping < 2700);
}
