// The CPU conv reference on hand-computed cases, and the host bf16/fp16 conversions.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "common/half_host.h"
#include "kda/error.h"
#include "support/test_data.h"
#include "testing/conv_reference.h"

using kda::DType;
using kda::PackedConvArgs;
using kda::reference::ConvMath;
namespace host = kda::host;

namespace {

uint32_t bits(float f) { return host::float_bits(f); }
using kda::test::kPoison16;
using kda::test::kPoison32;

// Host arrays of one conv call. x and the outputs are held as raw bytes of x_dtype.
struct HostConv {
  DType dtype = DType::FP32;
  int64_t tokens = 0, dim = 0, part_dim = 0, row_stride = 0;
  std::vector<unsigned char> x;
  std::vector<float> weight;  // (dim, 4) contiguous
  std::vector<float> bias;    // empty: no bias
  int64_t lines = 0, state_len = 3;
  bool transposed = false;    // (lines, state_len, dim) instead of (lines, dim, state_len)
  int64_t line_pad = 0;       // extra elements per line
  std::vector<float> states;
  std::vector<int32_t> qsl;
  std::vector<int32_t> cache;  // stored with cache_stride, odd slots hold junk
  int64_t cache_stride = 1;
  std::unique_ptr<bool[]> init;
  int64_t plane_stride = 0;  // 0: tokens * part_dim
  std::vector<unsigned char> out;
  bool silu = false;
  std::optional<int32_t> null_line = 0;

  std::size_t esize() const { return dtype == DType::FP32 ? 4 : 2; }
  int64_t planes() const { return dim / part_dim; }
  int64_t plane() const { return plane_stride ? plane_stride : tokens * part_dim; }
  int64_t sdim() const { return transposed ? 1 : state_len; }
  int64_t stap() const { return transposed ? dim : 1; }
  int64_t sline() const { return state_len * dim + line_pad; }

  void shape(int64_t t, int64_t d, int64_t p, int64_t stride) {
    tokens = t, dim = d, part_dim = p, row_stride = stride;
    x.assign(static_cast<std::size_t>(t * stride) * esize(), 0xFF);  // padding columns are NaN
    weight.assign(static_cast<std::size_t>(d * 4), 0.0f);
  }
  void set_x(int64_t t, int64_t c, float v) {
    const std::size_t i = static_cast<std::size_t>(t * row_stride + c);
    if (dtype == DType::FP32) {
      std::memcpy(&x[i * 4], &v, 4);
    } else {
      const uint16_t h = dtype == DType::BF16 ? host::float_to_bf16(v) : host::float_to_fp16(v);
      std::memcpy(&x[i * 2], &h, 2);
    }
  }
  void make_states(int64_t n, int64_t len, bool trans, float fill) {
    lines = n, state_len = len, transposed = trans;
    states.assign(static_cast<std::size_t>(n * sline()), fill);
  }
  float& st(int64_t line, int64_t c, int64_t tap) {
    return states[static_cast<std::size_t>(line * sline() + c * sdim() + tap * stap())];
  }
  void batch(std::vector<int32_t> q, std::vector<int32_t> lines_of_seqs, std::vector<bool> flags) {
    qsl = std::move(q);
    cache.assign(lines_of_seqs.size() * static_cast<std::size_t>(cache_stride), -12345);
    for (std::size_t s = 0; s < lines_of_seqs.size(); ++s) cache[s * cache_stride] = lines_of_seqs[s];
    init.reset(new bool[flags.size() + 1]);
    for (std::size_t s = 0; s < flags.size(); ++s) init[s] = flags[s];
  }
  void poison_out() {
    const int64_t n = (planes() - 1) * plane() + tokens * part_dim;
    out.assign(static_cast<std::size_t>(n) * esize(), 0xFF);
  }
  PackedConvArgs args() {
    PackedConvArgs a;
    a.x = x.data();
    a.x_dtype = dtype;
    a.num_tokens = tokens;
    a.dim = dim;
    a.x_row_stride = row_stride;
    a.weight = weight.data();
    a.bias = bias.empty() ? nullptr : bias.data();
    a.conv_states = states.data();
    a.varlen.cache_lines = lines;
    a.state_len = state_len;
    a.state_stride_line = sline();
    a.state_stride_dim = sdim();
    a.state_stride_tap = stap();
    a.varlen.query_start_loc = qsl.data();
    a.varlen.num_seqs = static_cast<int64_t>(qsl.size()) - 1;
    a.varlen.cache_indices = cache.data();
    a.cache_indices_stride = cache_stride;
    a.varlen.has_initial_state = init.get();
    a.part_dim = part_dim;
    a.silu = silu;
    a.varlen.null_line = null_line;
    a.out = out.data();
    a.out_plane_stride = plane_stride;
    return a;
  }
  std::size_t out_index(int64_t c, int64_t t) const {
    return static_cast<std::size_t>((c / part_dim) * plane() + t * part_dim + c % part_dim);
  }
  uint32_t out_bits(int64_t c, int64_t t) const {
    const std::size_t i = out_index(c, t);
    if (dtype == DType::FP32) {
      uint32_t u;
      std::memcpy(&u, &out[i * 4], 4);
      return u;
    }
    uint16_t h;
    std::memcpy(&h, &out[i * 2], 2);
    return h;
  }
  float out_value(int64_t c, int64_t t) const {
    const uint32_t u = out_bits(c, t);
    if (dtype == DType::FP32) return host::bits_float(u);
    return dtype == DType::BF16 ? host::bf16_to_float(static_cast<uint16_t>(u))
                                : host::fp16_to_float(static_cast<uint16_t>(u));
  }
  uint32_t poison() const { return dtype == DType::FP32 ? kPoison32 : kPoison16; }
};

// The "digits" batch: two channels, part_dim 1 (two planes), token t holds t + 1 in both.
// Channel 0 taps {1, 10, 100, 1000}: an output reads as the decimal digits h[i] h[i-1] h[i-2]
// h[i-3]. Channel 1 taps {1000, 100, 10, 1} and bias 0.25: digits h[i-3] h[i-2] h[i-1] h[i].
// Sequences: len 0 (line 1), len 1 init (line 2), len 2 no init (line 3, state ignored),
// len 3 init (line 4), len 4 no init (line 5). Line 0 is the null line, line 6 is not named.
void make_digits(HostConv& h, int64_t state_len, bool transposed) {
  h.shape(10, 2, 1, 3);
  for (int64_t t = 0; t < 10; ++t) {
    h.set_x(t, 0, static_cast<float>(t + 1));
    h.set_x(t, 1, static_cast<float>(t + 1));
  }
  h.weight = {1, 10, 100, 1000, 1000, 100, 10, 1};
  h.bias = {0.0f, 0.25f};
  h.make_states(7, state_len, transposed, 42.0f);
  for (int64_t line = 0; line < 7; ++line)
    for (int64_t c = 0; c < 2; ++c)
      for (int64_t k = 0; k < 3; ++k) h.st(line, c, k) = static_cast<float>(5 + line);  // "old"
  const float ch0_l2[3] = {7, 8, 9}, ch1_l2[3] = {3, 2, 1};
  const float ch0_l4[3] = {1, 2, 3}, ch1_l4[3] = {6, 5, 4};
  for (int k = 0; k < 3; ++k) {
    h.st(2, 0, k) = ch0_l2[k], h.st(2, 1, k) = ch1_l2[k];
    h.st(4, 0, k) = ch0_l4[k], h.st(4, 1, k) = ch1_l4[k];
  }
  h.batch({0, 0, 1, 3, 6, 10}, {1, 2, 3, 4, 5}, {true, true, false, true, false});
  h.poison_out();
}

const float kDigitsCh0[10] = {1987, 2000, 3200, 4321, 5432, 6543, 7000, 8700, 9870, 10987};
const float kDigitsCh1[10] = {3211.25f, 2.25f, 23.25f, 6544.25f, 5445.25f,
                              4456.25f, 7.25f, 78.25f, 789.25f, 7900.25f};
// New taps 0..2 of (line, channel) after the digits batch; line 1 (len 0) keeps its old value.
const float kDigitsState[6][2][3] = {
    {{5, 5, 5}, {5, 5, 5}},       // line 0: not run
    {{6, 6, 6}, {6, 6, 6}},       // line 1: len 0, unchanged
    {{8, 9, 1}, {2, 1, 1}},       // line 2: shifted by 1, token 1 appended
    {{0, 2, 3}, {0, 2, 3}},       // line 3: zeros then tokens 2, 3
    {{4, 5, 6}, {4, 5, 6}},       // line 4: the last three tokens
    {{8, 9, 10}, {8, 9, 10}},     // line 5
};

void check_digits_states(HostConv& h) {
  for (int64_t line = 0; line < 7; ++line)
    for (int64_t c = 0; c < 2; ++c) {
      for (int64_t k = 0; k < 3; ++k) {
        const float want = line < 6 ? kDigitsState[line][c][k] : 11.0f;
        CHECK_MESSAGE(h.st(line, c, k) == want, "line ", line, " channel ", c, " tap ", k);
      }
      for (int64_t k = 3; k < h.state_len; ++k)
        CHECK_MESSAGE(h.st(line, c, k) == 42.0f, "line ", line, " channel ", c, " tap ", k);
    }
}

}  // namespace

TEST_CASE("the reference convolves sequences of length 0 to 4 with and without initial state") {
  for (ConvMath math : {ConvMath::kStockFp32, ConvMath::kFloat64}) {
    for (int64_t state_len : {3, 4}) {
      for (bool transposed : {false, true}) {
        CAPTURE(static_cast<int>(math));
        CAPTURE(state_len);
        CAPTURE(transposed);
        HostConv h;
        make_digits(h, state_len, transposed);
        kda::reference::causal_conv1d(h.args(), math);
        for (int64_t t = 0; t < 10; ++t) {
          CHECK_MESSAGE(h.out_value(0, t) == kDigitsCh0[t], "token ", t);
          CHECK_MESSAGE(h.out_value(1, t) == kDigitsCh1[t], "token ", t);
        }
        check_digits_states(h);
      }
    }
  }
}

TEST_CASE("the reference writes nothing for skipped sequences and rows past the last one") {
  HostConv h;
  make_digits(h, 3, false);
  h.shape(14, 2, 1, 2);  // 14 rows of capacity, 4 of them past the last sequence
  for (int64_t t = 0; t < 14; ++t) {
    h.set_x(t, 0, static_cast<float>(t + 1));
    h.set_x(t, 1, static_cast<float>(t + 1));
  }
  h.weight = {1, 10, 100, 1000, 1000, 100, 10, 1};
  h.cache_stride = 2;
  SUBCASE("null line, negative line and a line past the pool are skipped") {
    // Sequences 1 (null line 0), 2 (-1) and 3 (7 = cache_lines) are skipped.
    h.batch({0, 0, 1, 3, 6, 10}, {1, 0, -1, 7, 5}, {true, true, false, true, false});
    h.poison_out();
    const std::vector<float> before = h.states;
    kda::reference::causal_conv1d(h.args());
    for (int64_t t = 0; t < 14; ++t)
      for (int64_t c = 0; c < 2; ++c) {
        CAPTURE(t);
        CAPTURE(c);
        if (t >= 6 && t < 10)
          CHECK(h.out_value(c, t) == (c == 0 ? kDigitsCh0[t] : kDigitsCh1[t]));
        else
          CHECK(h.out_bits(c, t) == h.poison());
      }
    for (int64_t line = 0; line < 7; ++line)
      for (int64_t c = 0; c < 2; ++c)
        for (int64_t k = 0; k < 3; ++k) {
          const float want = line == 5 ? kDigitsState[5][c][k] : before[static_cast<std::size_t>(line * 6 + c * 3 + k)];
          CHECK(h.st(line, c, k) == want);
        }
  }
  SUBCASE("without a null block id, line 0 is an ordinary line") {
    h.null_line = std::nullopt;
    h.batch({0, 0, 1, 3, 6, 10}, {1, 0, -1, 7, 5}, {true, false, false, true, false});
    h.poison_out();
    kda::reference::causal_conv1d(h.args());
    CHECK(h.out_value(0, 0) == 1000.0f);  // token 0 alone, zero history
    CHECK(h.out_value(1, 0) == 1.25f);
    CHECK(h.st(0, 0, 0) == 0.0f);
    CHECK(h.st(0, 0, 1) == 0.0f);
    CHECK(h.st(0, 0, 2) == 1.0f);
    CHECK(h.out_bits(0, 1) == h.poison());  // line -1 is still skipped
  }
}

TEST_CASE("the reference treats a null has_initial_state as no sequence having one") {
  HostConv h;
  make_digits(h, 3, false);
  PackedConvArgs a = h.args();
  a.varlen.has_initial_state = nullptr;
  kda::reference::causal_conv1d(a);
  const int64_t tokens[] = {0, 3, 4, 5};
  const float ch0[] = {1000, 4000, 5400, 6540};
  const float ch1[] = {1.25f, 4.25f, 45.25f, 456.25f};
  for (int i = 0; i < 4; ++i) {
    CHECK(h.out_value(0, tokens[i]) == ch0[i]);
    CHECK(h.out_value(1, tokens[i]) == ch1[i]);
  }
  CHECK(h.st(2, 0, 0) == 0.0f);
  CHECK(h.st(2, 0, 1) == 0.0f);
  CHECK(h.st(2, 0, 2) == 1.0f);
  CHECK(h.st(4, 1, 0) == 4.0f);
}

TEST_CASE("the reference writes planes out_plane_stride apart and leaves the gap alone") {
  HostConv h;
  make_digits(h, 3, false);
  h.plane_stride = 13;  // 3 elements of gap after plane 0
  h.poison_out();
  REQUIRE(h.out.size() == 23 * 4);
  kda::reference::causal_conv1d(h.args());
  for (int64_t t = 0; t < 10; ++t) {
    float v0, v1;
    std::memcpy(&v0, &h.out[static_cast<std::size_t>(t) * 4], 4);
    std::memcpy(&v1, &h.out[static_cast<std::size_t>(13 + t) * 4], 4);
    CHECK(v0 == kDigitsCh0[t]);
    CHECK(v1 == kDigitsCh1[t]);
  }
  for (std::size_t i = 10; i < 13; ++i) {
    uint32_t u;
    std::memcpy(&u, &h.out[i * 4], 4);
    CHECK(u == kPoison32);
  }
}

TEST_CASE("the reference applies SiLU after the bias and the taps") {
  HostConv h;
  h.shape(4, 2, 2, 2);
  const float xs[4] = {1.0f, -1.0f, 0.0f, 20.0f};
  for (int64_t t = 0; t < 4; ++t) {
    h.set_x(t, 0, xs[t]);
    h.set_x(t, 1, xs[t]);
  }
  h.weight = {0, 0, 0, 1, 0, 0, 0, 2};  // channel 0: y = x[t]; channel 1: y = 2 x[t] - 1
  h.bias = {0.0f, -1.0f};
  h.make_states(1, 3, false, 0.0f);
  h.batch({0, 4}, {0}, {false});
  h.null_line = std::nullopt;
  h.silu = true;
  for (ConvMath math : {ConvMath::kStockFp32, ConvMath::kFloat64}) {
    CAPTURE(static_cast<int>(math));
    h.poison_out();
    kda::reference::causal_conv1d(h.args(), math);
    for (int64_t t = 0; t < 4; ++t)
      for (int64_t c = 0; c < 2; ++c) {
        const double a = c == 0 ? xs[t] : 2.0 * xs[t] - 1.0;
        const double want = a / (1.0 + std::exp(-a));
        CHECK(h.out_value(c, t) == doctest::Approx(want).epsilon(1e-6));
      }
    CHECK(h.out_value(0, 0) == doctest::Approx(0.7310585786).epsilon(1e-7));  // silu(1)
    CHECK(bits(h.out_value(0, 2)) == 0u);  // silu(+0) is +0
  }
  SUBCASE("fp32 and float64 modes agree to a few fp32 ulps") {
    HostConv g;
    g.shape(5, 1, 1, 1);
    const float vals[5] = {0.3f, -2.5f, 7.75f, -0.125f, 3.0f};
    for (int64_t t = 0; t < 5; ++t) g.set_x(t, 0, vals[t]);
    g.weight = {0.1f, -0.7f, 0.33f, 1.9f};
    g.make_states(1, 3, false, 0.0f);
    g.batch({0, 5}, {0}, {false});
    g.null_line = std::nullopt;
    g.silu = true;
    g.poison_out();
    kda::reference::causal_conv1d(g.args(), ConvMath::kStockFp32);
    std::vector<float> fp32(5);
    for (int64_t t = 0; t < 5; ++t) fp32[t] = g.out_value(0, t);
    g.poison_out();
    kda::reference::causal_conv1d(g.args(), ConvMath::kFloat64);
    for (int64_t t = 0; t < 5; ++t) CHECK(fp32[t] == doctest::Approx(g.out_value(0, t)).epsilon(1e-6));
  }
}

TEST_CASE("the reference rounds outputs to bf16 and fp16 to nearest even") {
  // Output = x[t] * w3 with x[t] = 1: the weight is the exact fp32 result before rounding.
  struct Tie {
    float value;
    uint16_t bf16, fp16;
  };
  const Tie ties[] = {
      {1.0f + 0x1p-8f, 0x3F80, 0x3C04},         // bf16 tie to even (down)
      {1.0f + 3 * 0x1p-8f, 0x3F82, 0x3C0C},     // bf16 tie to even (up)
      {1.0f + 0x1p-11f, 0x3F80, 0x3C00},        // fp16 tie to even (down)
      {1.0f + 3 * 0x1p-11f, 0x3F80, 0x3C02},    // fp16 tie to even (up)
      {-(1.0f + 3 * 0x1p-8f), 0xBF82, 0xBC0C},  // negative bf16 tie
  };
  for (DType dtype : {DType::BF16, DType::FP16}) {
    CAPTURE(static_cast<int>(dtype));
    HostConv h;
    h.dtype = dtype;
    const int64_t n = sizeof ties / sizeof ties[0];
    h.shape(1, n, n, n);  // one token; channel c's last tap is ties[c]
    for (int64_t c = 0; c < n; ++c) {
      h.set_x(0, c, 1.0f);
      h.weight[static_cast<std::size_t>(c * 4 + 3)] = ties[c].value;
    }
    h.make_states(1, 3, false, 0.0f);
    h.batch({0, 1}, {0}, {false});
    h.null_line = std::nullopt;
    h.poison_out();
    kda::reference::causal_conv1d(h.args());
    for (int64_t c = 0; c < n; ++c)
      CHECK_MESSAGE(h.out_bits(c, 0) == (dtype == DType::BF16 ? ties[c].bf16 : ties[c].fp16),
                    "value ", ties[c].value);
  }
}

TEST_CASE("host bf16 and fp16 conversions round ties to even and keep specials") {
  CHECK(host::float_to_bf16(1.0f + 0x1p-8f) == 0x3F80);
  CHECK(host::float_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3F82);
  CHECK(host::float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3F81);  // just above the tie
  CHECK(host::float_to_bf16(-0.0f) == 0x8000);
  CHECK(host::float_to_bf16(host::bits_float(0x7F7FFFFFu)) == 0x7F80);  // max float -> inf
  CHECK(host::float_to_bf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(host::float_to_bf16(std::numeric_limits<float>::quiet_NaN()) == 0x7FFF);
  CHECK(host::float_to_bf16(host::bits_float(0xFF800001u)) == 0x7FFF);  // signalling NaN
  CHECK(host::float_to_bf16(host::bits_float(0x00018000u)) == 0x0002);  // subnormal tie, up
  CHECK(bits(host::bf16_to_float(0x3F81)) == bits(1.0f + 0x1p-7f));

  CHECK(host::float_to_fp16(1.0f + 0x1p-11f) == 0x3C00);
  CHECK(host::float_to_fp16(1.0f + 3 * 0x1p-11f) == 0x3C02);
  CHECK(host::float_to_fp16(65504.0f) == 0x7BFF);
  CHECK(host::float_to_fp16(65519.0f) == 0x7BFF);
  CHECK(host::float_to_fp16(65520.0f) == 0x7C00);  // the tie above the largest half rounds to inf
  CHECK(host::float_to_fp16(-1e10f) == 0xFC00);
  CHECK(host::float_to_fp16(0x1p-14f) == 0x0400);   // smallest normal
  CHECK(host::float_to_fp16(0x1p-24f) == 0x0001);   // smallest subnormal
  CHECK(host::float_to_fp16(0x1p-25f) == 0x0000);   // tie to even: zero
  CHECK(host::float_to_fp16(3 * 0x1p-25f) == 0x0002);  // tie to even: up
  CHECK(host::float_to_fp16(-0x1p-26f) == 0x8000);
  CHECK(host::float_to_fp16(0x1p-14f - 0x1p-25f) == 0x0400);  // subnormal tie carries into the normals
  CHECK(host::float_to_fp16(std::numeric_limits<float>::quiet_NaN()) == 0x7FFF);
  CHECK(bits(host::fp16_to_float(0x0001)) == bits(0x1p-24f));
  CHECK(bits(host::fp16_to_float(0x8400)) == bits(-0x1p-14f));
  CHECK(std::isinf(host::fp16_to_float(0x7C00)));
  CHECK(std::isnan(host::fp16_to_float(0x7E00)));

  // Round trip of every finite bf16 and fp16 value.
  int64_t bad = 0;
  for (uint32_t u = 0; u < 0x10000u; ++u) {
    const uint16_t h = static_cast<uint16_t>(u);
    if ((h & 0x7F80u) != 0x7F80u && host::float_to_bf16(host::bf16_to_float(h)) != h) ++bad;
    if ((h & 0x7C00u) != 0x7C00u && host::float_to_fp16(host::fp16_to_float(h)) != h) ++bad;
  }
  CHECK(bad == 0);
}

TEST_CASE("the reference reads bf16 and fp16 inputs exactly and ignores padding columns") {
  for (DType dtype : {DType::BF16, DType::FP16}) {
    CAPTURE(static_cast<int>(dtype));
    HostConv h;
    h.dtype = dtype;
    make_digits(h, 3, false);  // x in this dtype; padding column 2 holds NaN
    kda::reference::causal_conv1d(h.args());
    for (int64_t t = 0; t < 10; ++t) {
      const float want0 = dtype == DType::BF16 ? host::bf16_round(kDigitsCh0[t]) : host::fp16_round(kDigitsCh0[t]);
      const float want1 = dtype == DType::BF16 ? host::bf16_round(kDigitsCh1[t]) : host::fp16_round(kDigitsCh1[t]);
      CHECK(h.out_value(0, t) == want0);
      CHECK(h.out_value(1, t) == want1);
    }
    check_digits_states(h);  // states are fp32 copies of the (exact) inputs
  }
}

TEST_CASE("the reference on bf16 conv-state lines: the fp32 lines' results, the taps stored as bf16") {
  // Every tap the digits batch reads or writes is a small integer, exact in bf16; the inputs are
  // bf16. So the bf16 lines must give the fp32 lines' outputs bit for bit and hold the fp32
  // lines' taps rounded to bf16 (here: exactly).
  for (int64_t state_len : {3, 4}) {
    for (bool transposed : {false, true}) {
      CAPTURE(state_len);
      CAPTURE(transposed);
      HostConv h;
      h.dtype = DType::BF16;
      make_digits(h, state_len, transposed);
      std::vector<uint16_t> lines16(h.states.size());
      for (std::size_t i = 0; i < h.states.size(); ++i) lines16[i] = host::float_to_bf16(h.states[i]);
      HostConv f;
      f.dtype = DType::BF16;
      make_digits(f, state_len, transposed);
      kda::reference::causal_conv1d(f.args());
      PackedConvArgs a = h.args();
      a.conv_states = lines16.data();
      a.state_dtype = DType::BF16;
      kda::reference::causal_conv1d(a);
      CHECK(h.out == f.out);
      int64_t differ = 0;
      for (std::size_t i = 0; i < lines16.size(); ++i) differ += lines16[i] != host::float_to_bf16(f.states[i]);
      CHECK(differ == 0);
      // And the widened bf16 lines are the hand-computed taps (the fp32 pool h.states was not used).
      for (std::size_t i = 0; i < lines16.size(); ++i) h.states[i] = host::bf16_to_float(lines16[i]);
      check_digits_states(h);
    }
  }
}

TEST_CASE("the reference rejects malformed arguments and writes nothing") {
  HostConv h;
  make_digits(h, 3, false);
  const std::vector<float> states = h.states;
  const std::vector<unsigned char> out = h.out;
  auto run = [&](PackedConvArgs a) { kda::reference::causal_conv1d(a); };
  PackedConvArgs a = h.args();
  SUBCASE("decreasing query_start_loc") {
    h.qsl[3] = 0;
    CHECK_THROWS_WITH_AS(run(h.args()), doctest::Contains("query_start_loc decreases at 3"), kda::Error);
  }
  SUBCASE("query_start_loc past num_tokens") {
    h.qsl[5] = 11;
    CHECK_THROWS_WITH_AS(run(h.args()), doctest::Contains("exceeds num_tokens 10"), kda::Error);
  }
  SUBCASE("dim not a multiple of part_dim") {
    a.part_dim = 3;
    CHECK_THROWS_WITH_AS(run(a), doctest::Contains("dim 2 is not a positive multiple of part_dim 3"),
                         kda::Error);
  }
  SUBCASE("state_len below 3") {
    a.state_len = 2;
    CHECK_THROWS_WITH_AS(run(a), doctest::Contains("state_len is 2"), kda::Error);
  }
  SUBCASE("row stride below dim") {
    a.x_row_stride = 1;
    CHECK_THROWS_WITH_AS(run(a), doctest::Contains("x_row_stride 1 is below dim 2"), kda::Error);
  }
  SUBCASE("plane stride below a plane") {
    a.out_plane_stride = 9;
    CHECK_THROWS_WITH_AS(run(a), doctest::Contains("out_plane_stride 9"), kda::Error);
  }
  SUBCASE("null arrays") {
    a.varlen.cache_indices = nullptr;
    CHECK_THROWS_WITH_AS(run(a), doctest::Contains("must be non-null"), kda::Error);
  }
  SUBCASE("bf16 conv-state lines with fp16 inputs") {
    a.x_dtype = DType::FP16;
    a.state_dtype = DType::BF16;
    CHECK_THROWS_WITH_AS(run(a), doctest::Contains("state_dtype bf16 needs x_dtype bf16"), kda::Error);
  }
  SUBCASE("fp16 conv-state lines") {
    a.state_dtype = DType::FP16;
    CHECK_THROWS_WITH_AS(run(a), doctest::Contains("state_dtype 1 is not one of fp32, bf16"), kda::Error);
  }
  SUBCASE("the function is named") {
    a.state_len = 1;
    CHECK_THROWS_WITH_AS(run(a), doctest::Contains("kda::reference::causal_conv1d"), kda::Error);
  }
  CHECK(h.states == states);
  CHECK(h.out == out);
}
