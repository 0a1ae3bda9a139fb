// The algebra of the chunked KDA recurrence (src/recurrence/kda_chunked_kernel.cuh) checked on
// the CPU: the chunk formulas, evaluated in the kernel's order (64-token chunks from each sequence
// start, 16-token diagonal sub-blocks, reference tokens for the blocks below them, forward
// substitution, transposed state), against kda::ref::recurrence token by token.
// In float64 the two must agree to rounding; with the kernel's fp32 arithmetic and bf16
// operands where the kernel stores or feeds bf16 and fp16 where it feeds fp16, the error must
// stay well inside the GPU test's tolerances (1e-2 on o, 5e-3 on the final state).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <optional>
#include <random>
#include <vector>

#include "common/half_host.h"
#include "recurrence/kda_chunked.h"
#include "support/test_data.h"
#include "testing/layer_reference.h"

namespace {

constexpr int K = 128;   // key channels = value channels
constexpr int C = 64;    // chunk
constexpr int SB = 16;   // diagonal sub-block

// One head's prepared tokens (spec step 4 done): q (scaled), k normalised, g per channel, beta.
struct Tokens {
  int T = 0;
  std::vector<double> q, k, v, g, beta;  // (T, K) each, beta (T)
};

// bf16 inputs, normalised like the kernels; g from the softplus gate with realistic ranges.
Tokens make_tokens(int T, double decay_scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  auto bf = [](double x) { return static_cast<double>(kda::host::bf16_round(static_cast<float>(x))); };
  Tokens tk;
  tk.T = T;
  tk.q.resize(size_t(T) * K);
  tk.k.resize(size_t(T) * K);
  tk.v.resize(size_t(T) * K);
  tk.g.resize(size_t(T) * K);
  tk.beta.resize(T);
  for (int t = 0; t < T; ++t) {
    double qq = 0, kk = 0;
    std::vector<double> qr(K), kr(K);
    for (int c = 0; c < K; ++c) {
      qr[c] = bf(nd(rng));
      kr[c] = bf(nd(rng));
      qq += qr[c] * qr[c];
      kk += kr[c] * kr[c];
    }
    for (int c = 0; c < K; ++c) {
      tk.q[size_t(t) * K + c] = qr[c] / std::sqrt(qq + 1e-6) / std::sqrt(double(K));
      tk.k[size_t(t) * K + c] = kr[c] / std::sqrt(kk + 1e-6);
      tk.v[size_t(t) * K + c] = bf(nd(rng));
      tk.g[size_t(t) * K + c] = kda::ref::log_decay(bf(nd(rng)) - 2.0, std::log(decay_scale), std::nullopt);
    }
    tk.beta[t] = kda::ref::sigmoid(bf(nd(rng)));
  }
  return tk;
}

// float64 token-by-token result through the project's reference: o (T, K), final S[k][v].
void reference(const Tokens& tk, const std::vector<double>& s0, bool has_state,
               std::vector<double>& o, std::vector<double>& s_final) {
  kda::ref::PreparedTokens prep{kda::ref::Matrix(tk.T, K), kda::ref::Matrix(tk.T, K),
                                kda::ref::Matrix(tk.T, K), kda::ref::Matrix(tk.T, 1)};
  kda::ref::Matrix v(tk.T, K);
  for (int t = 0; t < tk.T; ++t) {
    for (int c = 0; c < K; ++c) {
      prep.q.at(t, c) = tk.q[size_t(t) * K + c];
      prep.k.at(t, c) = tk.k[size_t(t) * K + c];
      prep.log_decay.at(t, c) = tk.g[size_t(t) * K + c];
      v.at(t, c) = tk.v[size_t(t) * K + c];
    }
    prep.beta.at(t, 0) = tk.beta[t];
  }
  std::vector<float> pool(size_t(2) * K * K, 0.0f);  // line 0 is the null line
  for (int i = 0; i < K * K; ++i) pool[K * K + i] = static_cast<float>(s0[i]);
  const int32_t qsl[2] = {0, tk.T};
  const int32_t line[1] = {1};
  const bool init[1] = {has_state};
  kda::ref::HostBatch batch;
  batch.query_start_loc = qsl;
  batch.cache_indices = line;
  batch.has_initial_state = init;
  batch.num_seqs = 1;
  batch.null_line = 0;
  batch.cache_lines = 2;
  const kda::ref::Matrix out =
      kda::ref::recurrence(prep, v, batch, kda::ref::StatePool::contiguous(pool.data(), 1),
                           /*round_bf16=*/false, /*threads=*/1);
  o.assign(out.data.begin(), out.data.end());
  s_final.assign(pool.begin() + K * K, pool.end());
}

// The kernel's evaluation order. Kernel numerics (R = float): log2 units with the decay floor,
// bf16 wherever the kernel stores bf16 (Qt, M', W, the off-diagonal operands) or feeds a bf16
// tensor-core product (S0, U for U and O) and for o; fp16 for both operands of the state
// update (Kb', and U with each value row scaled by a power of two so that its largest |U| is
// in [2^14, 2^15), as update_state_f16 does); fp32 elsewhere (Uv, gamma, the state). Exact (R = double): no rounding
// at all. max_exponent records the largest argument ever given to exp.
template <typename R>
struct ChunkedModel {
  bool kernel_numerics = false;
  double max_exponent = -INFINITY;

  R rb(R x) const {
    return kernel_numerics ? static_cast<R>(kda::host::bf16_round(static_cast<float>(x))) : x;
  }
  // fp16, round to nearest even, after scaling by 2^k (exact), then scaled back.
  R rh(R x, int k = 0) const {
    if (!kernel_numerics) return x;
    return static_cast<R>(kda::host::fp16_round(std::ldexp(static_cast<float>(x), k)) *
                          std::ldexp(1.0f, -k));
  }
  // The row scale of update_state_f16: 2^k with k = clamp(14 - floor(log2 m), -100, 40).
  static int row_scale(double m) {
    if (!(m > 0)) return 40;
    return std::min(40, std::max(-100, 14 - static_cast<int>(std::floor(std::log2(m)))));
  }
  R ex(R x) {
    max_exponent = std::max(max_exponent, static_cast<double>(x));
    return kernel_numerics ? static_cast<R>(std::exp2(static_cast<float>(x))) : std::exp(x);
  }

  void run(const Tokens& tk, const std::vector<double>& s0, bool has_state,
           std::vector<double>& o, std::vector<double>& s_final) {
    std::vector<R> st(size_t(K) * K);  // S^T[v][c], as the state kernel holds it
    for (int c = 0; c < K; ++c)
      for (int v = 0; v < K; ++v) st[size_t(v) * K + c] = has_state ? static_cast<R>(s0[c * K + v]) : R(0);
    o.assign(size_t(tk.T) * K, 0.0);
    std::vector<R> G(C * K), kq(C * K), qq(C * K), vv(C * K), beta(C), A(C * C), Mp(C * C);
    std::vector<R> W(C * K), Qt(C * K), Kb(C * K), UvT(K * C), gam(K), x(C);
    for (int t0 = 0; t0 < tk.T; t0 += C) {
      const int len = std::min(C, tk.T - t0);
      // Phase 1 inputs; rows past the end are zeros with g = 0.
      for (int i = 0; i < C; ++i) {
        const bool real = i < len;
        for (int c = 0; c < K; ++c) {
          const size_t src = size_t(t0 + i) * K + c;
          kq[i * K + c] = real ? R(tk.k[src]) : R(0);
          qq[i * K + c] = real ? R(tk.q[src]) : R(0);
          vv[i * K + c] = real ? R(tk.v[src]) : R(0);
          R gl = real ? R(tk.g[src]) : R(0);
          if (kernel_numerics) gl = std::max(gl, R(-128)) * R(1.4426950408889634);
          G[i * K + c] = (i ? G[(i - 1) * K + c] : R(0)) + gl;
        }
        beta[i] = i < len ? R(tk.beta[t0 + i]) : R(0);
      }
      std::fill(A.begin(), A.end(), R(0));
      std::fill(Mp.begin(), Mp.end(), R(0));
      for (int I = 0; I < C / SB; ++I) {
        // Diagonal sub-block: pairwise factors directly (exponents G_i - G_j, j <= i).
        for (int i = I * SB; i < I * SB + SB; ++i)
          for (int j = I * SB; j <= i; ++j) {
            R a = 0, m = 0;
            for (int c = 0; c < K; ++c) {
              const R kj = kq[j * K + c] * ex(G[i * K + c] - G[j * K + c]);
              a += kq[i * K + c] * kj;
              m += qq[i * K + c] * kj;
            }
            if (j < i) A[i * C + j] = a * beta[j];
            Mp[i * C + j] = rb(m * beta[j]);
          }
        // Below it: split at r = 16I - 1 (exponents G_i - G_r and G_r - G_j).
        if (I == 0) continue;
        const int r = I * SB - 1;
        for (int i = I * SB; i < I * SB + SB; ++i)
          for (int j = 0; j < I * SB; ++j) {
            R a = 0, m = 0;
            for (int c = 0; c < K; ++c) {
              const R e = ex(G[i * K + c] - G[r * K + c]);
              const R f = ex(G[r * K + c] - G[j * K + c]);
              const R kf = rb(kq[j * K + c] * f);
              a += rb(kq[i * K + c] * e) * kf;
              m += rb(qq[i * K + c] * e) * kf;
            }
            A[i * C + j] = a * beta[j];
            Mp[i * C + j] = rb(m * beta[j]);
          }
      }
      // (I + A) [W | Uv] = [k 2^G | v], one column at a time.
      for (int col = 0; col < 2 * K; ++col) {
        for (int i = 0; i < C; ++i) {
          R acc = col < K ? kq[i * K + col] * ex(G[i * K + col]) : vv[i * K + col - K];
          for (int j = 0; j < i; ++j) acc -= A[i * C + j] * x[j];
          x[i] = acc;
        }
        for (int i = 0; i < C; ++i) {
          if (col < K) W[i * K + col] = rb(x[i]);
          else UvT[(col - K) * C + i] = x[i];
        }
      }
      for (int i = 0; i < C; ++i)
        for (int c = 0; c < K; ++c) {
          Qt[i * K + c] = rb(qq[i * K + c] * ex(G[i * K + c]));
          Kb[i * K + c] = rh(beta[i] * kq[i * K + c] * ex(G[(C - 1) * K + c] - G[i * K + c]));
        }
      for (int c = 0; c < K; ++c) gam[c] = ex(G[(C - 1) * K + c]);

      // Phase 2, transposed: U^T = Uv^T - S0^T W^T, O^T = S0^T Qt^T + U^T M'^T,
      // S^T = S0^T diag(gamma) + U^T Kb'.
      std::vector<R> sb(st.size()), ut(size_t(K) * C), ut32(size_t(K) * C);
      for (size_t e = 0; e < st.size(); ++e) sb[e] = rb(st[e]);
      for (int v = 0; v < K; ++v) {
        double umax = 0.0;
        for (int i = 0; i < C; ++i) {
          R u = 0;
          for (int c = 0; c < K; ++c) u += sb[size_t(v) * K + c] * W[i * K + c];
          ut32[size_t(v) * C + i] = UvT[v * C + i] - u;
          ut[size_t(v) * C + i] = rb(ut32[size_t(v) * C + i]);
          umax = std::max(umax, std::fabs(static_cast<double>(ut32[size_t(v) * C + i])));
        }
        const int k = row_scale(static_cast<double>(static_cast<float>(umax)));
        for (int i = 0; i < C; ++i) ut32[size_t(v) * C + i] = rh(ut32[size_t(v) * C + i], k);
        for (int i = 0; i < len; ++i) {
          R out = 0;
          for (int c = 0; c < K; ++c) out += sb[size_t(v) * K + c] * Qt[i * K + c];
          for (int j = 0; j <= i; ++j) out += ut[size_t(v) * C + j] * Mp[i * C + j];
          o[size_t(t0 + i) * K + v] = static_cast<double>(rb(out));
        }
        for (int c = 0; c < K; ++c) {
          R s = st[size_t(v) * K + c] * gam[c];
          for (int j = 0; j < C; ++j) s += ut32[size_t(v) * C + j] * Kb[j * K + c];
          st[size_t(v) * K + c] = s;
        }
      }
    }
    s_final.assign(size_t(K) * K, 0.0);
    for (int c = 0; c < K; ++c)
      for (int v = 0; v < K; ++v) s_final[c * K + v] = static_cast<double>(st[size_t(v) * K + c]);
  }
};

using kda::test::rel_frobenius;

std::vector<double> random_state(uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, 0.3);
  std::vector<double> s(size_t(K) * K);
  for (double& x : s) x = static_cast<float>(nd(rng));  // the pool is fp32
  return s;
}

}  // namespace

TEST_CASE("the chunked formulas reproduce the token-by-token recurrence in float64") {
  for (int T : {1, 15, 16, 17, 63, 64, 65, 130}) {
    for (bool has_state : {false, true}) {
      CAPTURE(T);
      CAPTURE(has_state);
      const Tokens tk = make_tokens(T, 1.0, 1000u + T);
      const std::vector<double> s0 = random_state(7u + T);
      std::vector<double> o_ref, s_ref, o, s;
      reference(tk, s0, has_state, o_ref, s_ref);
      ChunkedModel<double> model;
      model.run(tk, s0, has_state, o, s);
      CHECK(rel_frobenius(o, o_ref) < 1e-12);
      // The reference hands the final state back through the fp32 pool (2^-24 relative).
      CHECK(rel_frobenius(s, s_ref) < 1e-7);
      CHECK(model.max_exponent <= 0.0);
    }
  }
}

TEST_CASE("strong decays of -300 per token stay finite and exact") {
  Tokens tk = make_tokens(100, 1.0, 42u);
  // Alternate very strong and very weak decay per channel, so some channels forget within a
  // token and others carry across the whole chunk; Gam reaches about -9600.
  for (int t = 0; t < tk.T; ++t)
    for (int c = 0; c < K; ++c) tk.g[size_t(t) * K + c] = (c + t) % 3 == 0 ? -300.0 : -0.01;
  const std::vector<double> s0 = random_state(3u);
  std::vector<double> o_ref, s_ref, o, s;
  reference(tk, s0, true, o_ref, s_ref);
  ChunkedModel<double> exact;
  exact.run(tk, s0, true, o, s);
  CHECK(exact.max_exponent <= 0.0);
  CHECK(rel_frobenius(o, o_ref) < 1e-12);
  CHECK(rel_frobenius(s, s_ref) < 1e-7);
  ChunkedModel<float> kernel;
  kernel.kernel_numerics = true;
  kernel.run(tk, s0, true, o, s);
  CHECK(kernel.max_exponent <= 0.0);
  for (double x : o) REQUIRE(std::isfinite(x));
  CHECK(rel_frobenius(o, o_ref) < 1e-2);
  CHECK(rel_frobenius(s, s_ref) < 5e-3);
}

TEST_CASE("the kernel's fp32 and bf16 roundings keep the error inside the GPU tolerances") {
  // decay_scale = exp(A_log): 0.05 gives slow decays (per-step decay near 1, long memory),
  // 4 gives decays down to about exp(-5) per step.
  for (double decay_scale : {0.05, 1.0, 4.0}) {
    for (bool has_state : {false, true}) {
      CAPTURE(decay_scale);
      CAPTURE(has_state);
      const Tokens tk = make_tokens(300, decay_scale, 77u);
      const std::vector<double> s0 = random_state(5u);
      std::vector<double> o_ref, s_ref, o, s;
      reference(tk, s0, has_state, o_ref, s_ref);
      ChunkedModel<float> kernel;
      kernel.kernel_numerics = true;
      kernel.run(tk, s0, has_state, o, s);
      const double eo = rel_frobenius(o, o_ref), es = rel_frobenius(s, s_ref);
      MESSAGE("decay_scale ", decay_scale, " has_state ", has_state, ": o error ", eo,
              ", state error ", es);
      // o is floored by its own bf16 rounding; the bounds leave room for the GPU's different
      // summation order.
      CHECK(eo < 5e-3);
      CHECK(es < 1e-3);
    }
  }
}
