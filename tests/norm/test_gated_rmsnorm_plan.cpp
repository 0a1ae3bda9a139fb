// The gated RMSNorm's plan (src/norm/gated_rmsnorm_plan.cpp) on the CPU: the launcher's argument
// checks; host only, no device memory is touched (the pointers are never dereferenced).
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "kda/error.h"
#include "norm/gated_rmsnorm.h"
#include "support/fake_pointers.h"

namespace {

using kda::test::fake;

kda::GatedRmsNormArgs valid_rmsnorm_args() {
  kda::GatedRmsNormArgs a;
  a.num_heads = 3;
  a.num_tokens = 100;
  a.varlen.query_start_loc = fake<const int32_t>(1);
  a.varlen.num_seqs = 8;
  a.o = fake<const void>(2);
  a.o_row_stride = 384;
  a.g2 = fake<const void>(3);
  a.g2_row_stride = 392;
  a.weight = fake<const void>(4);
  a.y = fake<void>(5);
  a.y_row_stride = 384;
  return a;
}

}  // namespace

TEST_CASE("gated_rmsnorm_supported accepts well-formed arguments and names what is wrong") {
  kda::GatedRmsNormArgs a = valid_rmsnorm_args();
  std::string why;
  REQUIRE(kda::gated_rmsnorm_supported(a, &why));

  std::string expect;
  SUBCASE("head_dim") { a.head_dim = 256; expect = "only 128"; }
  SUBCASE("no heads") { a.num_heads = 0; expect = "num_heads 0"; }
  SUBCASE("missing weight") { a.weight = nullptr; expect = "must be set"; }
  SUBCASE("misaligned g2") { a.g2 = static_cast<const char*>(a.g2) + 4; expect = "8-byte aligned"; }
  SUBCASE("y row stride below P") { a.y_row_stride = 256; expect = "y_row_stride 256"; }
  SUBCASE("o row stride not a multiple of 4") { a.o_row_stride = 390; expect = "o_row_stride 390"; }
  SUBCASE("eps zero") { a.eps = 0.0; expect = "eps 0"; }
  SUBCASE("eps NaN") { a.eps = std::numeric_limits<double>::quiet_NaN(); expect = "positive and finite"; }
  SUBCASE("no query_start_loc is fine") {
    a.varlen.query_start_loc = nullptr;
    CHECK(kda::gated_rmsnorm_supported(a, &why));
    return;
  }
  CAPTURE(expect);
  CHECK_FALSE(kda::gated_rmsnorm_supported(a, &why));
  CHECK(why.find(expect) != std::string::npos);
  CHECK_THROWS_WITH_AS(kda::gated_rmsnorm(a, nullptr), doctest::Contains(why.c_str()), kda::Error);
}

TEST_CASE("a launch with no tokens enqueues nothing") {
  // Without a device a launch would fail; this returns before any CUDA call.
  kda::GatedRmsNormArgs g = valid_rmsnorm_args();
  g.num_tokens = 0;
  CHECK_NOTHROW(kda::gated_rmsnorm(g, nullptr));
}
