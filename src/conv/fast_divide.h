// Division by a divisor fixed at launch time, for dividends below 2^31: one multiply and one
// shift instead of the ~100 instructions of a 64-bit integer division. The packed conv's CTAs
// divide their linear index once per warp (cta_work); as 64-bit divisions that cost 5% of the
// whole kernel at one chunk program per CTA (H200, docs/perf-notes.md, session 7).
//
// For d >= 1 let l = ceil(log2 d) and m = ceil(2^(31 + l) / d). Then m * d - 2^(31 + l) < d <= 2^l,
// and for every 0 <= n < 2^31, floor(n / d) = floor(n * m / 2^(31 + l)) (Granlund and
// Montgomery, "Division by invariant integers using multiplication", 1994, theorem 4.2 with
// N = 31). m <= 2^32, so n * m < 2^63 fits in 64 bits.
#pragma once

#include <cstdint>

#ifndef KDA_HOST_DEVICE
#if defined(__CUDACC__)
#define KDA_HOST_DEVICE __host__ __device__
#else
#define KDA_HOST_DEVICE
#endif
#endif

namespace kda::conv {

constexpr int64_t kFastDivideLimit = int64_t{1} << 31;  // dividends must stay below this

struct FastDivisor {
  uint64_t multiplier = 1u << 31;  // the divisor 1 by default: n * 2^31 >> 31 = n
  int shift = 31;
};

// The multiplier and shift for d in [1, 2^31).
inline FastDivisor make_fast_divisor(int64_t d) {
  int l = 0;
  while ((int64_t{1} << l) < d) ++l;
  FastDivisor f;
  f.shift = 31 + l;
  // ceil(2^(31 + l) / d), computed without overflow: 2^(31 + l) <= 2^62.
  const uint64_t power = uint64_t{1} << f.shift;
  const uint64_t ud = static_cast<uint64_t>(d);
  f.multiplier = power / ud + (power % ud != 0 ? 1 : 0);
  return f;
}

// floor(n / d) for 0 <= n < 2^31.
KDA_HOST_DEVICE inline int64_t fast_divide(int64_t n, const FastDivisor& f) {
  return static_cast<int64_t>((static_cast<uint64_t>(n) * f.multiplier) >> f.shift);
}

}  // namespace kda::conv
