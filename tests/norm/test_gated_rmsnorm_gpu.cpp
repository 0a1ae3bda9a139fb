// gated_rmsnorm on the GPU against the float64 reference stage (kda::ref::gated_rmsnorm), fed
// the same bf16 inputs. KDA_TEST_QUICK=1 runs a reduced set (for compute-sanitizer).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "kda/error.h"
#include "norm/gated_rmsnorm.h"
#include "support/gpu_buffers.h"
#include "support/test_data.h"
#include "testing/layer_reference.h"

namespace {

using kda::test::DeviceBuffer;
using kda::test::kPoison16;
using kda::test::quick_mode;
using kda::test::random_bf16;
using kda::test::rel_frobenius;
using kda::test::to_device;

constexpr int64_t kD = 128;

template <typename T>
std::vector<T> download(const DeviceBuffer& b) {
  return b.download_as<T>();
}

struct RmsNormProblem {
  int64_t heads, part, rows, bucket, o_stride, g2_stride, y_stride;
  std::vector<uint16_t> o, g2, weight;
  DeviceBuffer d_o, d_g2, d_weight, d_y, d_qsl;
  std::vector<int32_t> qsl;

  RmsNormProblem(int64_t h, const std::vector<int32_t>& lengths, int64_t padding, std::mt19937_64& rng)
      : heads(h), part(h * kD) {
    qsl.push_back(0);
    for (int32_t n : lengths) qsl.push_back(qsl.back() + n);
    for (int64_t i = 0; i < padding; ++i) qsl.push_back(qsl.back());
    rows = qsl.back();
    bucket = rows + 29;
    o_stride = part + 4;
    g2_stride = part;
    y_stride = part + 8;
    o = random_bf16(rng, static_cast<size_t>(bucket * o_stride), -2, 2);
    // Special rows: all zero (eps keeps it finite), tiny (eps dominates), large.
    for (int64_t c = 0; c < part; ++c) {
      o[static_cast<size_t>(0 * o_stride + c)] = 0;
      o[static_cast<size_t>(1 * o_stride + c)] = kda::ref::bf16_bits((c % 3 - 1) * 1e-4);
      o[static_cast<size_t>(2 * o_stride + c)] = kda::ref::bf16_bits((c % 7) * 300.0);
    }
    g2 = random_bf16(rng, static_cast<size_t>(bucket * g2_stride), -4, 4);
    weight = random_bf16(rng, kD, 0.5, 1.5);
    d_o = to_device(o);
    d_g2 = to_device(g2);
    d_weight = to_device(weight);
    d_qsl = to_device(qsl);
    d_y = DeviceBuffer(static_cast<size_t>(bucket * y_stride) * 2);
  }

  kda::GatedRmsNormArgs args(bool use_qsl) const {
    kda::GatedRmsNormArgs a;
    a.num_heads = heads;
    a.num_tokens = bucket;
    a.varlen.query_start_loc = use_qsl ? d_qsl.as<int32_t>() : nullptr;
    a.varlen.num_seqs = static_cast<int64_t>(qsl.size()) - 1;
    a.o = d_o.get();
    a.o_row_stride = o_stride;
    a.g2 = d_g2.get();
    a.g2_row_stride = g2_stride;
    a.weight = d_weight.get();
    a.eps = 1e-5;
    a.y = d_y.get();
    a.y_row_stride = y_stride;
    return a;
  }
};

}  // namespace

TEST_CASE("gated_rmsnorm matches the float64 reference to bf16 rounding on every element") {
  const std::vector<int32_t> lengths = quick_mode() ? std::vector<int32_t>{5, 17, 64}
                                               : std::vector<int32_t>{1, 15, 16, 17, 63, 64, 65, 1000};
  for (int64_t heads : {int64_t{2}, int64_t{12}}) {
    for (bool use_qsl : {true, false}) {
      CAPTURE(heads);
      CAPTURE(use_qsl);
      std::mt19937_64 rng(300 + heads + use_qsl);
      RmsNormProblem pr(heads, lengths, 3, rng);
      pr.d_y.fill_bytes(0xFF);
      kda::gated_rmsnorm(pr.args(use_qsl), nullptr);
      kda::test::device_synchronize();
      const auto y = download<uint16_t>(pr.d_y);

      std::vector<float> w(kD);
      for (int64_t c = 0; c < kD; ++c) w[static_cast<size_t>(c)] = static_cast<float>(kda::ref::bf16_value(pr.weight[static_cast<size_t>(c)]));
      const kda::ref::Matrix ref = kda::ref::gated_rmsnorm(
          kda::ref::matrix_from_bf16(pr.o.data(), pr.bucket, pr.part, pr.o_stride),
          kda::ref::matrix_from_bf16(pr.g2.data(), pr.bucket, pr.part, pr.g2_stride), w.data(), 1e-5,
          /*round_bf16=*/false);
      const int64_t rows_written = use_qsl ? pr.rows : pr.bucket;
      int64_t off = 0, untouched_changed = 0;
      std::vector<double> got, want;
      for (int64_t r = 0; r < pr.bucket; ++r)
        for (int64_t c = 0; c < pr.y_stride; ++c) {
          const uint16_t bits = y[static_cast<size_t>(r * pr.y_stride + c)];
          if (r >= rows_written || c >= pr.part) {
            untouched_changed += bits != kPoison16;
            continue;
          }
          const double g = kda::ref::bf16_value(bits), e = ref.at(r, c);
          // bf16 rounding of an fp32 result within a few fp32 ulps of the exact value.
          if (!(std::fabs(g - e) <= std::fabs(e) * (std::ldexp(1.0, -8) + 1e-5) + 1e-30)) ++off;
          got.push_back(g);
          want.push_back(e);
        }
      CHECK(off == 0);
      CHECK(untouched_changed == 0);
      CHECK(rel_frobenius(got, want) <= 1e-2);
      for (int64_t c = 0; c < pr.part; ++c) CHECK(y[static_cast<size_t>(c)] == 0);  // the zero row

      kda::gated_rmsnorm(pr.args(use_qsl), nullptr);  // deterministic
      kda::test::device_synchronize();
      CHECK(kda::test::diff_bits(y.data(), download<uint16_t>(pr.d_y).data(), y.size() * 2) == 0);
    }
  }
}

TEST_CASE("gated_rmsnorm with bad arguments throws and enqueues nothing") {
  std::mt19937_64 rng(6);
  RmsNormProblem pr(2, {7, 9}, 0, rng);
  pr.d_y.fill_bytes(0xFF);
  kda::GatedRmsNormArgs a = pr.args(true);
  SUBCASE("misaligned y") { a.y = static_cast<char*>(a.y) + 2; }
  SUBCASE("row stride below P") { a.o_row_stride = pr.part - 4; }
  SUBCASE("eps 0") { a.eps = 0.0; }
  CHECK_THROWS_AS(kda::gated_rmsnorm(a, nullptr), kda::Error);
  kda::test::device_synchronize();
  const auto y = download<uint16_t>(pr.d_y);
  CHECK(std::count(y.begin(), y.end(), kPoison16) == static_cast<std::ptrdiff_t>(y.size()));
}
