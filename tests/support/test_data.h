// Test data shared by the test programs: the reduced-set switch, the poison patterns a 0xFF
// byte fill leaves, seeded random inputs (bf16 rounded to nearest even, as the kernels' inputs
// arrive) and relative Frobenius errors. Header-only; host code only.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "testing/layer_reference.h"

namespace kda::test {

// KDA_TEST_QUICK=1: the tests that support it run a reduced set (for compute-sanitizer and
// the slow CPU emulations).
inline bool quick_mode() {
  const char* q = std::getenv("KDA_TEST_QUICK");
  return q && std::strcmp(q, "1") == 0;
}

// What a 0xFF byte fill leaves in an element: a NaN in bf16 and fp16 (16 bits) and in fp32.
// Outputs are poisoned with it before a launch, so an element that keeps it was not written.
constexpr uint16_t kPoison16 = 0xFFFFu;
constexpr uint32_t kPoison32 = 0xFFFFFFFFu;

// n values uniform in [lo, hi), rounded to bf16 (the bit patterns).
inline std::vector<uint16_t> random_bf16(std::mt19937_64& rng, std::size_t n, double lo,
                                         double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<uint16_t> out(n);
  for (auto& x : out) x = kda::ref::bf16_bits(dist(rng));
  return out;
}

// n values uniform in [lo, hi), rounded to fp32.
inline std::vector<float> random_floats(std::mt19937_64& rng, std::size_t n, double lo,
                                        double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<float> out(n);
  for (auto& x : out) x = static_cast<float>(dist(rng));
  return out;
}

// ||got - want||_F / ||want||_F, accumulated element by element; the absolute ||got - want||_F
// when want is all zero.
struct RelError {
  double num = 0, den = 0;
  void add(double got, double want) {
    num += (got - want) * (got - want);
    den += want * want;
  }
  double value() const { return den > 0 ? std::sqrt(num / den) : std::sqrt(num); }
};

// RelError over two equally long vectors.
inline double rel_frobenius(const std::vector<double>& got, const std::vector<double>& want) {
  RelError e;
  for (std::size_t i = 0; i < got.size(); ++i) e.add(got[i], want[i]);
  return e.value();
}

}  // namespace kda::test
