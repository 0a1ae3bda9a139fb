// The float64 layer reference on cases that can be checked by hand or by an identity.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "common/half_host.h"
#include "kda/error.h"
#include "testing/layer_reference.h"

namespace {

using kda::ref::HostBatch;
using kda::ref::Matrix;
using kda::ref::PreparedTokens;
using kda::ref::StatePool;

constexpr int64_t kD = 128;  // head dim

// Owns the arrays a HostBatch points to.
struct BatchData {
  std::vector<int32_t> qsl;
  std::vector<int32_t> lines;
  std::unique_ptr<bool[]> initial;
  HostBatch view;

  BatchData(const std::vector<int32_t>& lengths, const std::vector<int32_t>& cache_lines_of,
            const std::vector<bool>& has_initial, int32_t null_line, int64_t cache_lines)
      : lines(cache_lines_of), initial(new bool[lengths.size() + 1]) {
    qsl.push_back(0);
    for (int32_t len : lengths) qsl.push_back(qsl.back() + len);
    for (size_t s = 0; s < lengths.size(); ++s) initial[s] = has_initial[s];
    view.query_start_loc = qsl.data();
    view.cache_indices = lines.data();
    view.has_initial_state = initial.get();
    view.num_seqs = static_cast<int64_t>(lengths.size());
    view.null_line = null_line;
    view.cache_lines = cache_lines;
  }
};

std::vector<float> random_floats(std::mt19937_64& rng, size_t n, double lo, double hi,
                                 bool bf16 = false) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = static_cast<float>(dist(rng));
    if (bf16) x = kda::host::bf16_round(x);
  }
  return v;
}

Matrix random_matrix(std::mt19937_64& rng, int64_t rows, int64_t cols, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Matrix m(rows, cols);
  for (auto& x : m.data) x = dist(rng);
  return m;
}

double rel_frobenius(const double* a, const double* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A normalised-and-scaled token set built directly, for recurrence cases.
PreparedTokens prepared(int64_t rows, int64_t heads) {
  const int64_t p = heads * kD;
  return PreparedTokens{Matrix(rows, p), Matrix(rows, p), Matrix(rows, p), Matrix(rows, heads)};
}

}  // namespace

TEST_CASE("round_to_bf16 rounds to nearest even in one step from double") {
  using kda::ref::round_to_bf16;
  const double ulp1 = std::ldexp(1.0, -7);  // bf16 spacing in [1, 2)
  CHECK(round_to_bf16(1.0) == 1.0);
  CHECK(round_to_bf16(1.0 + ulp1 / 2) == 1.0);                   // tie, even is 1
  CHECK(round_to_bf16(1.0 + 3 * ulp1 / 2) == 1.0 + 2 * ulp1);    // tie, even is 1 + 2 ulp
  CHECK(round_to_bf16(1.0 + ulp1 / 2 + std::ldexp(1.0, -40)) == 1.0 + ulp1);  // a float would tie
  CHECK(round_to_bf16(-1.0 - ulp1 / 2 - std::ldexp(1.0, -40)) == -1.0 - ulp1);
  CHECK(round_to_bf16(0.1) == static_cast<double>(kda::host::bf16_round(0.1f)));
  CHECK(round_to_bf16(std::ldexp(1.0, -133)) == std::ldexp(1.0, -133));  // smallest subnormal
  CHECK(round_to_bf16(std::ldexp(1.0, -135)) == 0.0);
  CHECK(round_to_bf16(3.0 * std::ldexp(1.0, -134)) == std::ldexp(1.0, -132));  // tie to even
  CHECK(std::isinf(round_to_bf16(3.4e38)));
  CHECK(round_to_bf16(3.389e38) == 3.3895313892515355e38);
  CHECK(std::signbit(round_to_bf16(-0.0)));
  CHECK(std::isnan(round_to_bf16(std::nan(""))));
  CHECK(kda::ref::bf16_bits(1.0) == 0x3F80);
  CHECK(kda::ref::bf16_bits(-2.0) == 0xC000);
  CHECK(kda::ref::bf16_bits(std::nan("")) == 0x7FFF);
  CHECK(kda::ref::bf16_value(0x3F81) == 1.0 + ulp1);
}

TEST_CASE("matmul_nt matches a naive product and does not depend on the thread count") {
  std::mt19937_64 rng(11);
  const int64_t m = 13, n = 300, k = 300, a_col0 = 5, ldb = 303;  // past the 256 x 256 blocking
  Matrix a = random_matrix(rng, m, a_col0 + k + 2, -1, 1);
  std::vector<float> b = random_floats(rng, static_cast<size_t>(n * ldb), -1, 1);
  Matrix c1 = kda::ref::matmul_nt(a, a_col0, k, b.data(), n, ldb, 1);
  REQUIRE(c1.rows == m);
  REQUIRE(c1.cols == n);
  double worst = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0;
      for (int64_t t = 0; t < k; ++t) ref += a.at(i, a_col0 + t) * b[j * ldb + t];
      worst = std::max(worst, std::fabs(c1.at(i, j) - ref));
    }
  CHECK(worst < 1e-12);
  for (int threads : {2, 3, 7, 16}) {
    CAPTURE(threads);
    Matrix ct = kda::ref::matmul_nt(a, a_col0, k, b.data(), n, ldb, threads);
    CHECK(std::memcmp(ct.data.data(), c1.data.data(), c1.data.size() * sizeof(double)) == 0);
  }
  CHECK_THROWS_AS(kda::ref::matmul_nt(a, a_col0, a.cols, b.data(), n, ldb), kda::Error);
}

TEST_CASE("one token from a zero state gives o = beta (k.q) v and S = beta k v^T") {
  std::mt19937_64 rng(1);
  const int64_t heads = 2, p = heads * kD;
  Matrix q = random_matrix(rng, 1, p, -1, 1), k = random_matrix(rng, 1, p, -1, 1);
  Matrix v = random_matrix(rng, 1, p, -1, 1), g1 = random_matrix(rng, 1, p, -2, 2);
  Matrix b = random_matrix(rng, 1, heads, -3, 3);
  std::vector<float> a_log = {0.3f, -0.7f};
  std::vector<float> dt_bias = random_floats(rng, p, -2, 1);
  std::vector<float> pool(static_cast<size_t>(2 * heads * kD * kD), 7.0f);
  BatchData batch({1}, {1}, {false}, 0, 2);
  Matrix o = kda::ref::prep_recurrence(q, k, v, g1, b, a_log.data(), dt_bias.data(),
                                       std::nullopt, batch.view,
                                       StatePool::contiguous(pool.data(), heads), false);
  for (int64_t h = 0; h < heads; ++h) {
    double qq = 0, kk = 0;
    for (int64_t c = h * kD; c < (h + 1) * kD; ++c) {
      qq += q.at(0, c) * q.at(0, c);
      kk += k.at(0, c) * k.at(0, c);
    }
    double kq = 0;
    for (int64_t c = h * kD; c < (h + 1) * kD; ++c)
      kq += (k.at(0, c) / std::sqrt(kk + 1e-6)) * (q.at(0, c) / std::sqrt(qq + 1e-6) / std::sqrt(128.0));
    const double beta = 1.0 / (1.0 + std::exp(-b.at(0, h)));
    for (int64_t j = 0; j < kD; ++j)
      CHECK(o.at(0, h * kD + j) == doctest::Approx(beta * kq * v.at(0, h * kD + j)).epsilon(1e-12));
    const StatePool sp = StatePool::contiguous(pool.data(), heads);
    for (int64_t i = 0; i < kD; i += 17)
      for (int64_t j = 0; j < kD; j += 13) {
        const double kn = k.at(0, h * kD + i) / std::sqrt(kk + 1e-6);
        CHECK(sp.at(1, h, i, j) == doctest::Approx(beta * kn * v.at(0, h * kD + j)).epsilon(1e-6));
        CHECK(sp.at(0, h, i, j) == 7.0f);  // line 0 is the null line: untouched
      }
  }
}

TEST_CASE("with g = 0 and beta = 1 a repeated key overwrites its value and other keys keep theirs") {
  const int64_t heads = 1;
  PreparedTokens prep = prepared(4, heads);
  Matrix v(4, kD);
  for (int64_t j = 0; j < kD; ++j) {
    v.at(0, j) = 1.0 + j;    // key e3
    v.at(1, j) = -2.0 * j;   // key e5
    v.at(2, j) = 0.5 - j;    // key e3 again: replaces token 0's value
    v.at(3, j) = 99.0;       // read-out token, beta 0: changes nothing
  }
  prep.k.at(0, 3) = prep.k.at(1, 5) = prep.k.at(2, 3) = 1.0;
  prep.k.at(3, 7) = 1.0;
  prep.q.at(0, 3) = prep.q.at(1, 3) = prep.q.at(2, 3) = 1.0;
  prep.q.at(3, 5) = 1.0;
  for (int t = 0; t < 3; ++t) prep.beta.at(t, 0) = 1.0;
  prep.beta.at(3, 0) = 0.0;
  std::vector<float> pool(static_cast<size_t>(kD * kD), 0.0f);
  BatchData batch({4}, {0}, {false}, -1, 1);
  Matrix o = kda::ref::recurrence(prep, v, batch.view, StatePool::contiguous(pool.data(), 1), false);
  for (int64_t j = 0; j < kD; ++j) {
    CHECK(o.at(0, j) == v.at(0, j));
    CHECK(o.at(1, j) == v.at(0, j));  // e5 written, e3 still holds token 0
    CHECK(o.at(2, j) == v.at(2, j));
    CHECK(o.at(3, j) == v.at(1, j));
  }
  const StatePool sp = StatePool::contiguous(pool.data(), 1);
  for (int64_t j = 0; j < kD; ++j) {
    CHECK(sp.at(0, 0, 3, j) == static_cast<float>(v.at(2, j)));
    CHECK(sp.at(0, 0, 5, j) == static_cast<float>(v.at(1, j)));
    CHECK(sp.at(0, 0, 7, j) == 0.0f);
  }
}

TEST_CASE("full forgetting (exp(g) = 0) drops the history; beta = 0 leaves only the decay") {
  std::mt19937_64 rng(3);
  const int64_t heads = 2, p = heads * kD, rows = 3;
  PreparedTokens prep = prepared(rows, heads);
  prep.q = random_matrix(rng, rows, p, -0.1, 0.1);
  prep.k = random_matrix(rng, rows, p, -0.1, 0.1);
  Matrix v = random_matrix(rng, rows, p, -1, 1);
  std::vector<float> pool0 = random_floats(rng, static_cast<size_t>(heads * kD * kD), -1, 1);
  BatchData batch({rows}, {0}, {true}, 5, 1);

  SUBCASE("exp(g) = 0 at the last token") {
    prep.log_decay = random_matrix(rng, rows, p, -2, 0);
    for (int64_t c = 0; c < p; ++c) prep.log_decay.at(rows - 1, c) = -1e4;
    prep.beta = random_matrix(rng, rows, heads, 0.1, 0.9);
    std::vector<float> pool = pool0;
    Matrix o = kda::ref::recurrence(prep, v, batch.view, StatePool::contiguous(pool.data(), heads), false);
    const StatePool sp = StatePool::contiguous(pool.data(), heads);
    const int64_t t = rows - 1;
    for (int64_t h = 0; h < heads; ++h) {
      double kq = 0;
      for (int64_t c = h * kD; c < (h + 1) * kD; ++c) kq += prep.k.at(t, c) * prep.q.at(t, c);
      const double beta = prep.beta.at(t, h);
      for (int64_t j = 0; j < kD; ++j) {
        CHECK(o.at(t, h * kD + j) == doctest::Approx(beta * kq * v.at(t, h * kD + j)).epsilon(1e-12));
        for (int64_t i = 0; i < kD; i += 9)
          CHECK(sp.at(0, h, i, j) == static_cast<float>(beta * prep.k.at(t, h * kD + i) * v.at(t, h * kD + j)));
      }
    }
  }
  SUBCASE("beta = 0 everywhere") {
    prep.log_decay = random_matrix(rng, rows, p, -1, 0);
    std::vector<float> pool = pool0;
    Matrix o = kda::ref::recurrence(prep, v, batch.view, StatePool::contiguous(pool.data(), heads), false);
    const StatePool s0 = StatePool::contiguous(pool0.data(), heads);
    const StatePool sp = StatePool::contiguous(pool.data(), heads);
    for (int64_t h = 0; h < heads; ++h) {
      std::vector<double> decay_sum(kD, 0.0);
      for (int64_t t = 0; t < rows; ++t) {
        for (int64_t i = 0; i < kD; ++i) decay_sum[i] += prep.log_decay.at(t, h * kD + i);
        for (int64_t j = 0; j < kD; j += 7) {
          double expect = 0;  // o_t = S_t^T q_t with S_t = diag(exp(sum g)) S_0
          for (int64_t i = 0; i < kD; ++i)
            expect += std::exp(decay_sum[i]) * s0.at(0, h, i, j) * prep.q.at(t, h * kD + i);
          CHECK(o.at(t, h * kD + j) == doctest::Approx(expect).epsilon(1e-10));
        }
      }
      for (int64_t i = 0; i < kD; i += 5)
        for (int64_t j = 0; j < kD; j += 3)
          CHECK(sp.at(0, h, i, j) == doctest::Approx(std::exp(decay_sum[i]) * s0.at(0, h, i, j)).epsilon(1e-6));
    }
  }
}

TEST_CASE("the decay formulas: softplus threshold and the lower-bound variant") {
  using kda::ref::log_decay;
  using kda::ref::softplus;
  CHECK(softplus(20.0) == std::log1p(std::exp(20.0)));
  CHECK(softplus(20.0) != 20.0);
  CHECK(softplus(20.000001) == 20.000001);
  CHECK(softplus(25.0) == 25.0);
  CHECK(softplus(-30.0) == std::log1p(std::exp(-30.0)));
  CHECK(softplus(0.0) == doctest::Approx(std::log(2.0)).epsilon(1e-15));
  // softplus(log(e - 1)) = 1, so g = -exp(log 2) * 1 = -2.
  CHECK(log_decay(std::log(std::exp(1.0) - 1.0), std::log(2.0), std::nullopt) ==
        doctest::Approx(-2.0).epsilon(1e-14));
  CHECK(log_decay(30.0, 0.0, std::nullopt) == -30.0);
  // lower_bound * sigmoid(exp(A_log) * x): sigmoid(0) = 1/2, sigmoid(log 3) = 3/4.
  CHECK(log_decay(0.0, 1.3, -5.0) == doctest::Approx(-2.5).epsilon(1e-15));
  CHECK(log_decay(std::log(3.0) / 2, std::log(2.0), -4.0) == doctest::Approx(-3.0).epsilon(1e-14));
  CHECK(log_decay(1e3, 0.0, -5.0) == -5.0);

  SUBCASE("prepare_tokens applies them per key channel with dt_bias and per-head A_log") {
    const int64_t heads = 2, p = heads * kD;
    std::mt19937_64 rng(5);
    Matrix q = random_matrix(rng, 2, p, -1, 1), k = random_matrix(rng, 2, p, -1, 1);
    Matrix g1 = random_matrix(rng, 2, p, -3, 3), b = random_matrix(rng, 2, heads, -3, 3);
    std::vector<float> a_log = {0.5f, -1.25f};
    std::vector<float> dt_bias = random_floats(rng, p, -1, 1);
    dt_bias[7] = 40.0f;  // past the softplus threshold
    for (std::optional<double> bound : {std::optional<double>{}, std::optional<double>{-5.0}}) {
      CAPTURE(bound.has_value());
      PreparedTokens prep = kda::ref::prepare_tokens(q, k, g1, b, a_log.data(), dt_bias.data(), bound);
      for (int64_t t = 0; t < 2; ++t)
        for (int64_t c = 0; c < p; ++c) {
          const double x = g1.at(t, c) + dt_bias[c];
          const double a = std::exp(static_cast<double>(a_log[c / kD]));
          const double expect = bound ? *bound / (1.0 + std::exp(-a * x))
                                      : -a * (x > 20 ? x : std::log1p(std::exp(x)));
          CHECK(prep.log_decay.at(t, c) == doctest::Approx(expect).epsilon(1e-14));
        }
      CHECK(prep.beta.at(1, 1) == doctest::Approx(1.0 / (1.0 + std::exp(-b.at(1, 1)))).epsilon(1e-15));
    }
  }
}

TEST_CASE("the L2 norm keeps eps 1e-6 under the square root and q gets 128^-0.5") {
  const int64_t p = kD;
  Matrix q(2, p, 0.0), k(2, p, 0.0), g1(2, p, 0.0), b(2, 1, 0.0);
  for (int64_t c = 0; c < p; ++c) {
    q.at(1, c) = 1e-4;
    k.at(1, c) = c % 2 ? 3.0 : -3.0;
  }
  std::vector<float> a_log = {0.0f}, dt_bias(p, 0.0f);
  PreparedTokens prep = kda::ref::prepare_tokens(q, k, g1, b, a_log.data(), dt_bias.data(), std::nullopt);
  for (int64_t c = 0; c < p; ++c) {
    CHECK(prep.q.at(0, c) == 0.0);  // a zero vector stays zero, no NaN
    CHECK(prep.k.at(0, c) == 0.0);
    // sum q^2 = 128e-8 is comparable to eps: the norm is sqrt(1.28e-6 + 1e-6).
    CHECK(prep.q.at(1, c) == doctest::Approx(1e-4 / std::sqrt(2.28e-6) / std::sqrt(128.0)).epsilon(1e-14));
    CHECK(prep.k.at(1, c) == doctest::Approx(k.at(1, c) / std::sqrt(9.0 * 128 + 1e-6)).epsilon(1e-14));
  }
  CHECK(prep.beta.at(0, 0) == 0.5);
}

TEST_CASE("the short conv follows the stock state rules for lengths 1, 2 and longer") {
  const int64_t p = kD, dim = 3 * p, lines = 4;
  std::mt19937_64 rng(9);
  // Sequences: len 1 with state (line 1), len 2 without (line 2), len 5 with state (line 3),
  // len 2 on the null line 0.
  BatchData batch({1, 2, 5, 2}, {1, 2, 3, 0}, {true, false, true, true}, 0, lines);
  Matrix x = random_matrix(rng, 10, dim + 5, -2, 2);
  std::vector<float> w = random_floats(rng, static_cast<size_t>(dim * 4), -1, 1);
  std::vector<float> state0 = random_floats(rng, static_cast<size_t>(lines * dim * 3), -1, 1);
  std::vector<float> state = state0;
  kda::ref::ConvPlanes planes = kda::ref::short_conv(x, p, w.data(), batch.view, state.data(), false);
  auto st0 = [&](int64_t line, int64_t c, int j) { return static_cast<double>(state0[(line * dim + c) * 3 + j]); };
  auto st = [&](int64_t line, int64_t c, int j) { return state[(line * dim + c) * 3 + j]; };
  auto silu = [](double a) { return a / (1.0 + std::exp(-a)); };
  auto plane = [&](int64_t c) -> const Matrix& { return c < p ? planes.q : c < 2 * p ? planes.k : planes.v; };
  for (int64_t c : {int64_t{0}, int64_t{131}, dim - 1}) {
    CAPTURE(c);
    const float* wc = w.data() + c * 4;
    // len 1 with state [a, b, c]: y = silu(a w0 + b w1 + c w2 + x0 w3); state -> [b, c, x0].
    CHECK(plane(c).at(0, c % p) == doctest::Approx(silu(st0(1, c, 0) * wc[0] + st0(1, c, 1) * wc[1] +
                                                        st0(1, c, 2) * wc[2] + x.at(0, c) * wc[3])).epsilon(1e-14));
    CHECK(st(1, c, 0) == static_cast<float>(st0(1, c, 1)));
    CHECK(st(1, c, 1) == static_cast<float>(st0(1, c, 2)));
    CHECK(st(1, c, 2) == static_cast<float>(x.at(0, c)));
    // len 2 without state: zero history; state -> [0, x1, x2].
    CHECK(plane(c).at(2, c % p) == doctest::Approx(silu(x.at(1, c) * wc[2] + x.at(2, c) * wc[3])).epsilon(1e-14));
    CHECK(st(2, c, 0) == 0.0f);
    CHECK(st(2, c, 1) == static_cast<float>(x.at(1, c)));
    CHECK(st(2, c, 2) == static_cast<float>(x.at(2, c)));
    // len 5 with state: token 4 of the sequence (row 7) sees rows 4..7; state -> rows 5..7.
    CHECK(plane(c).at(7, c % p) == doctest::Approx(silu(x.at(4, c) * wc[0] + x.at(5, c) * wc[1] +
                                                        x.at(6, c) * wc[2] + x.at(7, c) * wc[3])).epsilon(1e-14));
    CHECK(plane(c).at(3, c % p) == doctest::Approx(silu(st0(3, c, 0) * wc[0] + st0(3, c, 1) * wc[1] +
                                                        st0(3, c, 2) * wc[2] + x.at(3, c) * wc[3])).epsilon(1e-14));
    for (int j = 0; j < 3; ++j) CHECK(st(3, c, j) == static_cast<float>(x.at(5 + j, c)));
    // The null-line sequence: rows 8, 9 not written, line 0 untouched.
    CHECK(std::isnan(plane(c).at(8, c % p)));
    CHECK(std::isnan(plane(c).at(9, c % p)));
  }
  for (int64_t i = 0; i < dim * 3; ++i) CHECK(state[i] == state0[i]);
}

namespace {

// A small layer: D 24, H 2 (P 256), r 128, random bf16-valued weights.
struct SmallLayer {
  kda::ModelConfig model;
  std::vector<float> in_proj, conv_weight, f_b, g_b, a_log, dt_bias, o_norm, o_proj;
  kda::ref::HostLayerWeights weights;

  explicit SmallLayer(std::optional<double> lower_bound = std::nullopt, uint64_t seed = 21) {
    model.hidden_size = 24;
    model.num_heads = 2;
    model.gate_lower_bound = lower_bound;
    const int64_t d = model.hidden_size, p = model.part_dim(), r = model.gate_rank;
    std::mt19937_64 rng(seed);
    in_proj = random_floats(rng, static_cast<size_t>(model.in_proj_cols() * d), -0.4, 0.4, true);
    conv_weight = random_floats(rng, static_cast<size_t>(3 * p * 4), -0.6, 0.6);
    f_b = random_floats(rng, static_cast<size_t>(p * r), -0.15, 0.15, true);
    g_b = random_floats(rng, static_cast<size_t>(p * r), -0.15, 0.15, true);
    a_log = random_floats(rng, static_cast<size_t>(model.num_heads), -1, 1);
    dt_bias = random_floats(rng, static_cast<size_t>(p), -3, 0);
    o_norm = random_floats(rng, kD, 0.5, 1.5, true);
    o_proj = random_floats(rng, static_cast<size_t>(d * p), -0.1, 0.1, true);
    weights = {in_proj.data(), conv_weight.data(), f_b.data(), g_b.data(),
               a_log.data(), dt_bias.data(), o_norm.data(), o_proj.data()};
  }

  int64_t conv_line() const { return 3 * model.part_dim() * 3; }
  int64_t state_line() const { return model.num_heads * kD * kD; }
};

}  // namespace

TEST_CASE("layer_forward is its stages composed") {
  for (std::optional<double> bound : {std::optional<double>{}, std::optional<double>{-4.0}}) {
    CAPTURE(bound.has_value());
    SmallLayer layer(bound);
    std::mt19937_64 rng(4);
    const int64_t lines = 4;
    BatchData batch({3, 9, 1}, {2, 1, 3}, {false, true, true}, 0, lines);
    Matrix hidden = random_matrix(rng, 13, layer.model.hidden_size, -1, 1);
    kda::ref::round_matrix_to_bf16(hidden);
    std::vector<float> conv0 = random_floats(rng, static_cast<size_t>(lines * layer.conv_line()), -1, 1, true);
    std::vector<float> rec0 = random_floats(rng, static_cast<size_t>(lines * layer.state_line()), -0.3, 0.3);

    std::vector<float> conv = conv0, rec = rec0;
    const int64_t h = layer.model.num_heads, p = layer.model.part_dim(), r = layer.model.gate_rank;
    kda::ref::LayerTrace tr = kda::ref::layer_forward(layer.model, layer.weights, hidden, batch.view,
                                                      conv.data(), StatePool::contiguous(rec.data(), h));

    std::vector<float> conv2 = conv0, rec2 = rec0;
    Matrix x = kda::ref::matmul_nt(hidden, 0, 24, layer.in_proj.data(), layer.model.in_proj_cols(), 24);
    kda::ref::round_matrix_to_bf16(x);
    kda::ref::ConvPlanes planes = kda::ref::short_conv(x, p, layer.conv_weight.data(), batch.view, conv2.data());
    Matrix g1 = kda::ref::matmul_nt(x, 3 * p + h, r, layer.f_b.data(), p, r);
    Matrix g2 = kda::ref::matmul_nt(x, 3 * p + h + r, r, layer.g_b.data(), p, r);
    kda::ref::round_matrix_to_bf16(g1);
    kda::ref::round_matrix_to_bf16(g2);
    Matrix o = kda::ref::prep_recurrence(planes.q, planes.k, planes.v, g1, kda::ref::column_slice(x, 3 * p, h),
                                         layer.a_log.data(), layer.dt_bias.data(), bound, batch.view,
                                         StatePool::contiguous(rec2.data(), h));
    Matrix y = kda::ref::gated_rmsnorm(o, g2, layer.o_norm.data(), 1e-5);
    Matrix out = kda::ref::matmul_nt(y, 0, p, layer.o_proj.data(), 24, p);
    kda::ref::round_matrix_to_bf16(out);

    REQUIRE(tr.out.rows == 13);
    REQUIRE(tr.out.cols == 24);
    CHECK(std::memcmp(tr.out.data.data(), out.data.data(), out.data.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(tr.o.data.data(), o.data.data(), o.data.size() * sizeof(double)) == 0);
    CHECK(same_bits(conv, conv2));
    CHECK(same_bits(rec, rec2));
    for (double val : tr.out.data) CHECK(std::isfinite(val));
    for (double val : tr.x.data) CHECK(val == kda::ref::round_to_bf16(val));  // bf16 at the boundary
  }
}

TEST_CASE("state carry-over: two calls over a split batch equal one call over the whole") {
  SmallLayer layer;
  const int64_t h = layer.model.num_heads, d = layer.model.hidden_size, lines = 6;
  std::mt19937_64 rng(8);
  // Whole lengths and their split points: the second part has lengths 2, 3, 1, 1, 1.
  const std::vector<int32_t> first = {3, 1, 2, 6, 1}, second = {2, 3, 1, 1, 1};
  std::vector<int32_t> whole;
  for (size_t s = 0; s < first.size(); ++s) whole.push_back(first[s] + second[s]);
  const std::vector<int32_t> line_of = {5, 1, 2, 3, 4};
  const std::vector<bool> initial = {true, false, true, false, true};
  int64_t t_whole = 0;
  for (int32_t n : whole) t_whole += n;
  Matrix hidden = random_matrix(rng, t_whole, d, -1, 1);
  kda::ref::round_matrix_to_bf16(hidden);
  std::vector<float> conv0 = random_floats(rng, static_cast<size_t>(lines * layer.conv_line()), -1, 1, true);
  std::vector<float> rec0 = random_floats(rng, static_cast<size_t>(lines * layer.state_line()), -0.3, 0.3);

  for (bool round : {false, true}) {
    CAPTURE(round);
    const kda::ref::LayerOptions options{round, 0};
    std::vector<float> conv_one = conv0, rec_one = rec0;
    BatchData one(whole, line_of, initial, 0, lines);
    kda::ref::LayerTrace all = kda::ref::layer_forward(layer.model, layer.weights, hidden, one.view,
                                                       conv_one.data(), StatePool::contiguous(rec_one.data(), h), options);
    // Split: each sequence's first part in call 1, the rest in call 2 with the state carried.
    std::vector<float> conv_two = conv0, rec_two = rec0;
    Matrix h1(0, d), h2(0, d);
    int64_t row = 0;
    for (size_t s = 0; s < whole.size(); ++s) {
      for (int32_t i = 0; i < whole[s]; ++i, ++row) {
        Matrix& dst = i < first[s] ? h1 : h2;
        dst.data.insert(dst.data.end(), hidden.row(row), hidden.row(row) + d);
        ++dst.rows;
      }
    }
    BatchData b1(first, line_of, initial, 0, lines);
    BatchData b2(second, line_of, std::vector<bool>(whole.size(), true), 0, lines);
    kda::ref::LayerTrace t1 = kda::ref::layer_forward(layer.model, layer.weights, h1, b1.view,
                                                      conv_two.data(), StatePool::contiguous(rec_two.data(), h), options);
    kda::ref::LayerTrace t2 = kda::ref::layer_forward(layer.model, layer.weights, h2, b2.view,
                                                      conv_two.data(), StatePool::contiguous(rec_two.data(), h), options);
    // Reassemble the split outputs in the whole batch's row order.
    Matrix out_split(t_whole, d);
    int64_t r1 = 0, r2 = 0;
    row = 0;
    for (size_t s = 0; s < whole.size(); ++s)
      for (int32_t i = 0; i < whole[s]; ++i, ++row)
        std::copy_n(i < first[s] ? t1.out.row(r1++) : t2.out.row(r2++), d, out_split.row(row));
    const double out_err = rel_frobenius(out_split.data.data(), all.out.data.data(), all.out.data.size());
    std::vector<double> a(rec_two.begin(), rec_two.end()), b(rec_one.begin(), rec_one.end());
    const double state_err = rel_frobenius(a.data(), b.data(), a.size());
    CHECK(out_err < (round ? 1e-2 : 1e-6));
    CHECK(state_err < (round ? 1e-2 : 1e-6));
    // The conv state holds input tokens: exact when they are bf16 values.
    if (round) CHECK(same_bits(conv_two, conv_one));
    else CHECK(rel_frobenius(std::vector<double>(conv_two.begin(), conv_two.end()).data(),
                             std::vector<double>(conv_one.begin(), conv_one.end()).data(), conv_one.size()) < 1e-6);
  }
}

TEST_CASE("a skipped sequence is untouched and does not change the others") {
  SmallLayer layer;
  const int64_t h = layer.model.num_heads, d = layer.model.hidden_size, lines = 5;
  std::mt19937_64 rng(13);
  // Batch with: A (line 2), null-line sequence, B (line 4), line 7 (outside the pool),
  // an empty sequence on line 1.
  BatchData full({4, 3, 5, 2, 0}, {2, 0, 4, 7, 1}, {true, true, false, true, true}, 0, lines);
  BatchData live({4, 5}, {2, 4}, {true, false}, 0, lines);
  Matrix hidden = random_matrix(rng, 14, d, -1, 1);
  kda::ref::round_matrix_to_bf16(hidden);
  Matrix hidden_live(9, d);
  std::copy_n(hidden.row(0), 4 * d, hidden_live.row(0));
  std::copy_n(hidden.row(7), 5 * d, hidden_live.row(4));
  std::vector<float> conv0 = random_floats(rng, static_cast<size_t>(lines * layer.conv_line()), -1, 1, true);
  std::vector<float> rec0 = random_floats(rng, static_cast<size_t>(lines * layer.state_line()), -0.3, 0.3);

  std::vector<float> conv_a = conv0, rec_a = rec0, conv_b = conv0, rec_b = rec0;
  kda::ref::LayerTrace ta = kda::ref::layer_forward(layer.model, layer.weights, hidden, full.view,
                                                    conv_a.data(), StatePool::contiguous(rec_a.data(), h));
  kda::ref::LayerTrace tb = kda::ref::layer_forward(layer.model, layer.weights, hidden_live, live.view,
                                                    conv_b.data(), StatePool::contiguous(rec_b.data(), h));
  CHECK(same_bits(conv_a, conv_b));
  CHECK(same_bits(rec_a, rec_b));
  // Lines 0, 1 and 3 are named by no processed sequence.
  for (int64_t line : {0, 1, 3}) {
    CAPTURE(line);
    CHECK(std::memcmp(conv_a.data() + line * layer.conv_line(), conv0.data() + line * layer.conv_line(),
                      layer.conv_line() * sizeof(float)) == 0);
    CHECK(std::memcmp(rec_a.data() + line * layer.state_line(), rec0.data() + line * layer.state_line(),
                      layer.state_line() * sizeof(float)) == 0);
  }
  auto same_rows = [&](const Matrix& a, int64_t ra, const Matrix& b, int64_t rb, int64_t n) {
    return std::memcmp(a.row(ra), b.row(rb), n * a.cols * sizeof(double)) == 0;
  };
  CHECK(same_rows(ta.out, 0, tb.out, 0, 4));
  CHECK(same_rows(ta.out, 7, tb.out, 4, 5));
  CHECK(same_rows(ta.o, 0, tb.o, 0, 4));
  for (int64_t r : {4, 5, 6, 12, 13})
    for (int64_t c = 0; c < d; ++c) {
      CAPTURE(r);
      CHECK(std::isnan(ta.out.at(r, c)));
    }
}

TEST_CASE("the reference rejects inconsistent inputs with kda::Error") {
  SmallLayer layer;
  Matrix hidden(3, layer.model.hidden_size + 1);
  std::vector<float> conv(static_cast<size_t>(layer.conv_line())), rec(static_cast<size_t>(layer.state_line()));
  BatchData batch({3}, {0}, {false}, -1, 1);
  CHECK_THROWS_WITH_AS(kda::ref::layer_forward(layer.model, layer.weights, hidden, batch.view, conv.data(),
                                               StatePool::contiguous(rec.data(), 2)),
                       doctest::Contains("kda::ref::layer_forward"), kda::Error);
  BatchData too_long({5}, {0}, {false}, -1, 1);
  Matrix v(3, 256);
  CHECK_THROWS_WITH_AS(kda::ref::recurrence(prepared(3, 2), v, too_long.view, StatePool::contiguous(rec.data(), 2)),
                       doctest::Contains("only 3 rows"), kda::Error);
  CHECK_THROWS_AS(kda::ref::gated_rmsnorm(Matrix(2, 100), Matrix(2, 100), layer.o_norm.data(), 1e-5), kda::Error);
}
