// The host-visible parts of conv/conv_math.h: the 4-fma tap chain (order, +0 start) and the
// host SiLU approximation used by the CPU reference. The device SiLU (ex2.approx, div.full)
// is checked bit for bit against the stock baseline by the GPU tests.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "conv/conv_math.h"

namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

}  // namespace

TEST_CASE("conv4_tap_fma is four fmas, oldest tap first, each rounded once") {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  int64_t differs_from_chain = 0, differs_from_reversed = 0, differs_from_unfused = 0;
  for (int i = 0; i < 200000; ++i) {
    const float h3 = value(rng), h2 = value(rng), h1 = value(rng), h0 = value(rng);
    const float w0 = value(rng), w1 = value(rng), w2 = value(rng), w3 = value(rng);
    const float bias = value(rng);
    const float got = kda::conv::conv4_tap_fma(h3, h2, h1, h0, w0, w1, w2, w3, bias);
    const float chain =
        std::fma(h0, w3, std::fma(h1, w2, std::fma(h2, w1, std::fma(h3, w0, bias))));
    const float reversed =
        std::fma(h3, w0, std::fma(h2, w1, std::fma(h1, w2, std::fma(h0, w3, bias))));
    volatile float p0 = h3 * w0, p1 = h2 * w1, p2 = h1 * w2, p3 = h0 * w3;
    volatile float unfused = bias + p0;
    unfused = unfused + p1;
    unfused = unfused + p2;
    unfused = unfused + p3;
    if (bits(got) != bits(chain)) ++differs_from_chain;
    if (bits(got) != bits(reversed)) ++differs_from_reversed;
    if (bits(got) != bits(unfused)) ++differs_from_unfused;
  }
  CHECK(differs_from_chain == 0);
  // The order and the fusion matter, so a wrong chain would be caught.
  CHECK(differs_from_reversed > 1000);
  CHECK(differs_from_unfused > 1000);
}

TEST_CASE("conv4_tap_fma keeps +0 where a plain first multiply would give -0") {
  // -1 * +0 = -0; fma(-1, +0, +0) = +0, and the remaining zero products keep it +0.
  const float y = kda::conv::conv4_tap_fma(-1.0f, -1.0f, -1.0f, -1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
  CHECK(bits(y) == 0u);
  CHECK(bits(-1.0f * 0.0f) == 0x80000000u);
}

TEST_CASE("silu_host_approx follows acc / (1 + exp(-acc)) within the recipe's rounding") {
  // t = (0 - acc) * log2(e) is rounded to fp32, so exp2(t) carries a relative error of about
  // |t| ln 2 * 2^-24 = |acc| * 2^-24 on top of a few ulp: the tolerance grows with |acc|.
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> value(-30.0f, 30.0f);
  int64_t far = 0;
  for (int i = 0; i < 100000; ++i) {
    const float acc = value(rng);
    const double exact = acc / (1.0 + std::exp(-static_cast<double>(acc)));
    const double got = kda::conv::silu_host_approx(acc);
    const double tolerance = (std::fabs(acc) + 4.0) * std::ldexp(std::fabs(exact), -23);
    if (std::fabs(got - exact) > tolerance) ++far;
  }
  CHECK(far == 0);
  CHECK(kda::conv::silu_host_approx(0.0f) == 0.0f);
  CHECK(kda::conv::silu_host_approx(-100.0f) == 0.0f);
  CHECK(kda::conv::silu_host_approx(100.0f) == 100.0f);
  CHECK(kda::conv::kLog2e == 1.44269502f);
  CHECK(bits(kda::conv::kLog2e) == 0x3FB8AA3Bu);
}
