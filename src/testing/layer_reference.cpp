#include "testing/layer_reference.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <thread>

#include "common/check.h"
#include "common/half_host.h"

namespace kda::ref {
namespace {

constexpr int64_t kHeadDim = 128;
constexpr int kConvTaps = 4;
constexpr int kConvHistory = kConvTaps - 1;  // state columns, column 2 the most recent
constexpr double kL2Eps = 1e-6;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

int resolve_threads(int threads) {
  if (threads > 0) return threads;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

// Runs fn(begin, end) over `threads` contiguous slices of [0, n).
template <typename Fn>
void parallel_ranges(int64_t n, int threads, const Fn& fn) {
  const int64_t t = std::min<int64_t>(resolve_threads(threads), n);
  if (t <= 1) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) pool.emplace_back(fn, n * i / t, n * (i + 1) / t);
  for (auto& th : pool) th.join();
}

// Runs fn(i) for every i in [0, n), handing tasks out one at a time (tasks of uneven cost).
template <typename Fn>
void parallel_tasks(int64_t n, int threads, const Fn& fn) {
  const int64_t t = std::min<int64_t>(resolve_threads(threads), n);
  if (t <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) pool.emplace_back(worker);
  for (auto& th : pool) th.join();
}

void check_batch(const HostBatch& batch, int64_t rows, const char* function) {
  KDA_CHECK(batch.num_seqs >= 0, function, "num_seqs ", batch.num_seqs, " is negative");
  if (batch.num_seqs == 0) return;
  KDA_CHECK(batch.query_start_loc && batch.cache_indices, function,
            "query_start_loc and cache_indices are required when num_seqs > 0");
  KDA_CHECK(batch.query_start_loc[0] >= 0, function, "query_start_loc[0] is ",
            batch.query_start_loc[0], "; it must be >= 0");
  for (int64_t s = 0; s < batch.num_seqs; ++s)
    KDA_CHECK(batch.query_start_loc[s + 1] >= batch.query_start_loc[s], function,
              "query_start_loc decreases at entry ", s + 1);
  KDA_CHECK(batch.num_tokens() <= rows, function, "the batch has ", batch.num_tokens(),
            " tokens but the inputs have only ", rows, " rows");
}

void check_heads(int64_t part_dim, const char* function) {
  KDA_CHECK(part_dim > 0 && part_dim % kHeadDim == 0, function, "part_dim ", part_dim,
            " is not a positive multiple of the head dim 128");
}

// C rows [i0, i1) of A[:, a_col0:+K] @ B^T, in blocks so that a (kNb x kKb) tile of B (256 KB,
// an L2) stays in cache while the thread's rows pass over it. C must hold zeros on entry.
// Every element sums its K blocks in order and each block in k order: the result is
// independent of how rows are split.
void matmul_rows(const Matrix& a, int64_t a_col0, int64_t k, const float* b, int64_t n,
                 int64_t ldb, Matrix& c, int64_t i0, int64_t i1) {
  constexpr int64_t kNb = 256;
  constexpr int64_t kKb = 256;
  constexpr int kMr = 4, kNr = 4;  // register tile: 16 independent accumulators
  for (int64_t jb = 0; jb < n; jb += kNb) {
    const int64_t je = std::min(n, jb + kNb);
    for (int64_t kb = 0; kb < k; kb += kKb) {
      const int64_t kn = std::min(k, kb + kKb) - kb;
      for (int64_t i = i0; i < i1; i += kMr) {
        // Rows past the range repeat the last one; their results are dropped.
        const double* ar[kMr];
        for (int r = 0; r < kMr; ++r) ar[r] = a.row(std::min(i + r, i1 - 1)) + a_col0 + kb;
        for (int64_t j = jb; j < je; j += kNr) {
          const float* br[kNr];
          for (int q = 0; q < kNr; ++q) br[q] = b + std::min(j + q, je - 1) * ldb + kb;
          double acc[kMr][kNr] = {};
          for (int64_t kk = 0; kk < kn; ++kk) {
            double av[kMr], bv[kNr];
            for (int r = 0; r < kMr; ++r) av[r] = ar[r][kk];
            for (int q = 0; q < kNr; ++q) bv[q] = static_cast<double>(br[q][kk]);
            for (int r = 0; r < kMr; ++r)
              for (int q = 0; q < kNr; ++q) acc[r][q] += av[r] * bv[q];
          }
          for (int r = 0; r < kMr && i + r < i1; ++r)
            for (int q = 0; q < kNr && j + q < je; ++q) c.at(i + r, j + q) += acc[r][q];
        }
      }
    }
  }
}

}  // namespace

double round_to_bf16(double x) {
  if (!std::isfinite(x) || x == 0.0) return x;
  // |x| = m * 2^e with m in [0.5, 1): bf16 keeps 8 significant bits, so the last kept bit
  // weighs 2^(e - 8), but never less than the bf16 subnormal step 2^-133.
  int e = 0;
  std::frexp(x, &e);
  const int quantum = std::max(e - 8, -133);
  const double rounded = std::ldexp(std::nearbyint(std::ldexp(x, -quantum)), quantum);
  constexpr double kMaxBf16 = 3.3895313892515355e38;  // 0x7F7F = (2 - 2^-7) * 2^127
  if (std::fabs(rounded) > kMaxBf16) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return rounded;
}

uint16_t bf16_bits(double x) {
  if (std::isnan(x)) return 0x7FFF;
  // round_to_bf16 is a float value (or infinity), so the float conversion is exact.
  return host::float_to_bf16(static_cast<float>(round_to_bf16(x)));
}

double bf16_value(uint16_t bits) { return static_cast<double>(host::bf16_to_float(bits)); }

Matrix::Matrix(int64_t r, int64_t c, double fill)
    : rows(r), cols(c), data(static_cast<size_t>(r * c), fill) {}

Matrix column_slice(const Matrix& m, int64_t col0, int64_t ncols) {
  KDA_CHECK(col0 >= 0 && ncols >= 0 && col0 + ncols <= m.cols, "kda::ref::column_slice",
            "columns [", col0, ", ", col0 + ncols, ") are outside the matrix's ", m.cols);
  Matrix out(m.rows, ncols);
  for (int64_t r = 0; r < m.rows; ++r) std::copy_n(m.row(r) + col0, ncols, out.row(r));
  return out;
}

Matrix matrix_from_bf16(const uint16_t* bits, int64_t rows, int64_t cols, int64_t row_stride) {
  KDA_CHECK(row_stride >= cols, "kda::ref::matrix_from_bf16", "row stride ", row_stride,
            " is below the column count ", cols);
  Matrix out(rows, cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out.at(r, c) = bf16_value(bits[r * row_stride + c]);
  return out;
}

void round_matrix_to_bf16(Matrix& m) {
  for (double& x : m.data) x = round_to_bf16(x);
}

bool HostBatch::names_line(int64_t s) const {
  const int32_t line = cache_indices[s];
  return line != null_line && line >= 0 && line < cache_lines;
}

StatePool StatePool::contiguous(float* data, int64_t num_heads) {
  StatePool p;
  p.data = data;
  p.stride_v = 1;
  p.stride_k = kHeadDim;
  p.stride_head = kHeadDim * kHeadDim;
  p.stride_line = num_heads * kHeadDim * kHeadDim;
  return p;
}

Matrix matmul_nt(const Matrix& a, int64_t a_col0, int64_t k, const float* b, int64_t n,
                 int64_t ldb, int threads) {
  const char* fn = "kda::ref::matmul_nt";
  KDA_CHECK(a_col0 >= 0 && k >= 0 && a_col0 + k <= a.cols, fn, "columns [", a_col0, ", ",
            a_col0 + k, ") of A are outside its ", a.cols);
  KDA_CHECK(n >= 0 && ldb >= k, fn, "B needs n >= 0 and ldb >= K; got n ", n, ", ldb ", ldb);
  KDA_CHECK(b || n == 0 || k == 0, fn, "B is null");
  Matrix c(a.rows, n, 0.0);
  if (a.rows == 0 || n == 0 || k == 0) return c;
  parallel_ranges(a.rows, threads, [&](int64_t i0, int64_t i1) {
    matmul_rows(a, a_col0, k, b, n, ldb, c, i0, i1);
  });
  return c;
}

ConvPlanes short_conv(const Matrix& x, int64_t part_dim, const float* conv_weight,
                      const HostBatch& batch, float* conv_states, bool round_bf16) {
  const char* fn = "kda::ref::short_conv";
  check_heads(part_dim, fn);
  const int64_t dim = 3 * part_dim;
  KDA_CHECK(x.cols >= dim, fn, "x has ", x.cols, " columns; the Q|K|V columns need ", dim);
  check_batch(batch, x.rows, fn);
  ConvPlanes planes{Matrix(x.rows, part_dim, kNaN), Matrix(x.rows, part_dim, kNaN),
                    Matrix(x.rows, part_dim, kNaN)};
  Matrix* plane_of[3] = {&planes.q, &planes.k, &planes.v};
  for (int64_t s = 0; s < batch.num_seqs; ++s) {
    const int64_t bos = batch.query_start_loc[s];
    const int64_t len = batch.query_start_loc[s + 1] - bos;
    if (len == 0 || !batch.names_line(s)) continue;
    const int64_t line = batch.cache_indices[s];
    const bool from_state = batch.initial_state(s);
    for (int64_t c = 0; c < dim; ++c) {
      float* state = conv_states + (line * dim + c) * kConvHistory;
      const float* w = conv_weight + c * kConvTaps;
      // ext(j) for j in [-3, len): history before the sequence, then its inputs.
      double history[kConvHistory];
      for (int j = 0; j < kConvHistory; ++j) history[j] = from_state ? state[j] : 0.0;
      auto ext = [&](int64_t j) { return j < 0 ? history[j + kConvHistory] : x.at(bos + j, c); };
      Matrix& plane = *plane_of[c / part_dim];
      for (int64_t i = 0; i < len; ++i) {
        double acc = 0.0;
        for (int j = 0; j < kConvTaps; ++j) acc += ext(i - kConvHistory + j) * w[j];
        double y = acc / (1.0 + std::exp(-acc));
        plane.at(bos + i, c % part_dim) = round_bf16 ? round_to_bf16(y) : y;
      }
      for (int j = 0; j < kConvHistory; ++j)
        state[j] = static_cast<float>(ext(len - kConvHistory + j));
    }
  }
  return planes;
}

double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

double log_decay(double x, double a_log, std::optional<double> lower_bound) {
  if (lower_bound) return *lower_bound * sigmoid(std::exp(a_log) * x);
  return -std::exp(a_log) * softplus(x);
}

PreparedTokens prepare_tokens(const Matrix& q, const Matrix& k, const Matrix& g1,
                              const Matrix& b_logits, const float* a_log, const float* dt_bias,
                              std::optional<double> lower_bound) {
  const char* fn = "kda::ref::prepare_tokens";
  const int64_t rows = q.rows, part_dim = q.cols;
  check_heads(part_dim, fn);
  const int64_t heads = part_dim / kHeadDim;
  KDA_CHECK(k.rows == rows && k.cols == part_dim && g1.rows == rows && g1.cols == part_dim, fn,
            "q, k and g1 must all be (", rows, ", ", part_dim, ")");
  KDA_CHECK(b_logits.rows == rows && b_logits.cols == heads, fn, "b must be (", rows, ", ",
            heads, "), got (", b_logits.rows, ", ", b_logits.cols, ")");
  PreparedTokens prep{Matrix(rows, part_dim), Matrix(rows, part_dim), Matrix(rows, part_dim),
                      Matrix(rows, heads)};
  const double q_scale = 1.0 / std::sqrt(static_cast<double>(kHeadDim));
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t c0 = h * kHeadDim;
      double qq = 0.0, kk = 0.0;
      for (int64_t c = c0; c < c0 + kHeadDim; ++c) {
        qq += q.at(t, c) * q.at(t, c);
        kk += k.at(t, c) * k.at(t, c);
      }
      const double q_norm = std::sqrt(qq + kL2Eps), k_norm = std::sqrt(kk + kL2Eps);
      for (int64_t c = c0; c < c0 + kHeadDim; ++c) {
        prep.q.at(t, c) = q.at(t, c) / q_norm * q_scale;
        prep.k.at(t, c) = k.at(t, c) / k_norm;
        prep.log_decay.at(t, c) = log_decay(g1.at(t, c) + dt_bias[c], a_log[h], lower_bound);
      }
      prep.beta.at(t, h) = sigmoid(b_logits.at(t, h));
    }
  }
  return prep;
}

TruncatedBatch truncated_batch(const HostBatch& batch, int64_t seq, int64_t rows) {
  const char* fn = "kda::ref::truncated_batch";
  KDA_CHECK(seq >= 0 && seq < batch.num_seqs, fn, "sequence ", seq, " is outside [0, ",
            batch.num_seqs, ")");
  const int64_t bos = batch.query_start_loc[seq];
  const int64_t length = batch.query_start_loc[seq + 1] - bos;
  KDA_CHECK(rows >= 0 && rows <= length, fn, "rows ", rows, " is outside [0, ", length,
            "], the length of sequence ", seq);
  TruncatedBatch t;
  const auto n = static_cast<size_t>(batch.num_seqs);
  t.query_start_loc.resize(n + 1);
  for (size_t s = 0; s <= n; ++s)
    t.query_start_loc[s] = static_cast<int32_t>(static_cast<int64_t>(s) <= seq ? bos : bos + rows);
  t.cache_indices.assign(batch.cache_indices, batch.cache_indices + n);
  t.has_initial_state.reset(new bool[n]);
  for (size_t s = 0; s < n; ++s)
    t.has_initial_state[s] = batch.initial_state(static_cast<int64_t>(s));
  t.batch = batch;
  t.batch.query_start_loc = t.query_start_loc.data();
  t.batch.cache_indices = t.cache_indices.data();
  t.batch.has_initial_state = t.has_initial_state.get();
  return t;
}

Matrix recurrence(const PreparedTokens& prep, const Matrix& v, const HostBatch& batch,
                  const StatePool& pool, bool round_bf16, int threads) {
  const char* fn = "kda::ref::recurrence";
  const int64_t rows = v.rows, part_dim = v.cols;
  check_heads(part_dim, fn);
  const int64_t heads = part_dim / kHeadDim;
  KDA_CHECK(prep.q.rows == rows && prep.q.cols == part_dim && prep.k.rows == rows &&
                prep.k.cols == part_dim && prep.log_decay.rows == rows &&
                prep.log_decay.cols == part_dim && prep.beta.rows == rows &&
                prep.beta.cols == heads,
            fn, "the prepared tokens do not match v's shape (", rows, ", ", part_dim, ")");
  check_batch(batch, rows, fn);
  KDA_CHECK(pool.data || batch.num_seqs == 0, fn, "the state pool is null");
  Matrix o(rows, part_dim, kNaN);
  parallel_tasks(batch.num_seqs * heads, threads, [&](int64_t task) {
    const int64_t s = task / heads, h = task % heads;
    const int64_t bos = batch.query_start_loc[s], eos = batch.query_start_loc[s + 1];
    if (eos == bos || !batch.names_line(s)) return;
    const int64_t line = batch.cache_indices[s];
    constexpr int64_t K = kHeadDim, V = kHeadDim;
    std::vector<double> state(K * V, 0.0);  // S[k][v]
    if (batch.initial_state(s))
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) state[i * V + j] = pool.at(line, h, i, j);
    std::vector<double> u(V), out(V);
    const int64_t c0 = h * kHeadDim;
    for (int64_t t = bos; t < eos; ++t) {
      const double* qt = prep.q.row(t) + c0;
      const double* kt = prep.k.row(t) + c0;
      const double* gt = prep.log_decay.row(t) + c0;
      const double* vt = v.row(t) + c0;
      const double beta = prep.beta.at(t, h);
      for (int64_t i = 0; i < K; ++i) {
        const double decay = std::exp(gt[i]);
        for (int64_t j = 0; j < V; ++j) state[i * V + j] *= decay;
      }
      for (int64_t j = 0; j < V; ++j) u[j] = vt[j];
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) u[j] -= state[i * V + j] * kt[i];
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) state[i * V + j] += beta * kt[i] * u[j];
      std::fill(out.begin(), out.end(), 0.0);
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) out[j] += state[i * V + j] * qt[i];
      for (int64_t j = 0; j < V; ++j) o.at(t, c0 + j) = round_bf16 ? round_to_bf16(out[j]) : out[j];
    }
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) pool.at(line, h, i, j) = static_cast<float>(state[i * V + j]);
  });
  return o;
}

Matrix prep_recurrence(const Matrix& q, const Matrix& k, const Matrix& v, const Matrix& g1,
                       const Matrix& b_logits, const float* a_log, const float* dt_bias,
                       std::optional<double> lower_bound, const HostBatch& batch,
                       const StatePool& pool, bool round_bf16, int threads) {
  const PreparedTokens prep = prepare_tokens(q, k, g1, b_logits, a_log, dt_bias, lower_bound);
  return recurrence(prep, v, batch, pool, round_bf16, threads);
}

Matrix gated_rmsnorm(const Matrix& o, const Matrix& g2, const float* weight, double eps,
                     bool round_bf16) {
  const char* fn = "kda::ref::gated_rmsnorm";
  check_heads(o.cols, fn);
  KDA_CHECK(g2.rows == o.rows && g2.cols == o.cols, fn, "g2 must be shaped like o (", o.rows,
            ", ", o.cols, ")");
  Matrix y(o.rows, o.cols);
  for (int64_t t = 0; t < o.rows; ++t) {
    for (int64_t c0 = 0; c0 < o.cols; c0 += kHeadDim) {
      double sum_sq = 0.0;
      for (int64_t c = c0; c < c0 + kHeadDim; ++c) sum_sq += o.at(t, c) * o.at(t, c);
      const double inv_rms = 1.0 / std::sqrt(sum_sq / kHeadDim + eps);
      for (int64_t c = c0; c < c0 + kHeadDim; ++c) {
        const double val = o.at(t, c) * inv_rms * weight[c - c0] * sigmoid(g2.at(t, c));
        y.at(t, c) = round_bf16 ? round_to_bf16(val) : val;
      }
    }
  }
  return y;
}

LayerTrace layer_forward(const ModelConfig& model, const HostLayerWeights& w,
                         const Matrix& hidden, const HostBatch& batch, float* conv_states,
                         const StatePool& recurrent_pool, const LayerOptions& options) {
  const char* fn = "kda::ref::layer_forward";
  KDA_CHECK(model.head_dim == kHeadDim, fn, "head_dim ", model.head_dim,
            " is not supported; only 128 is");
  KDA_CHECK(model.conv_width == kConvTaps, fn, "conv_width ", model.conv_width,
            " is not supported; only 4 is");
  KDA_CHECK(model.num_heads > 0 && model.gate_rank > 0 && model.hidden_size > 0, fn,
            "num_heads, gate_rank and hidden_size must be positive");
  KDA_CHECK(hidden.cols == model.hidden_size, fn, "hidden has ", hidden.cols,
            " columns; hidden_size is ", model.hidden_size);
  KDA_CHECK(w.in_proj && w.conv_weight && w.f_b && w.g_b && w.a_log && w.dt_bias &&
                w.o_norm_weight && w.o_proj,
            fn, "every weight pointer must be set");
  KDA_CHECK(conv_states || batch.num_seqs == 0, fn, "the conv-state pool is null");
  check_batch(batch, hidden.rows, fn);

  const int64_t d = model.hidden_size, heads = model.num_heads, p = model.part_dim();
  const int64_t r = model.gate_rank;
  const int64_t b_col = 3 * p, fa_col = b_col + heads, ga_col = fa_col + r;
  const bool round = options.round_bf16;
  auto rounded = [round](Matrix m) {
    if (round) round_matrix_to_bf16(m);
    return m;
  };

  LayerTrace tr;
  tr.x = rounded(matmul_nt(hidden, 0, d, w.in_proj, model.in_proj_cols(), d, options.threads));
  tr.planes = short_conv(tr.x, p, w.conv_weight, batch, conv_states, round);
  tr.g1 = rounded(matmul_nt(tr.x, fa_col, r, w.f_b, p, r, options.threads));
  tr.g2 = rounded(matmul_nt(tr.x, ga_col, r, w.g_b, p, r, options.threads));
  tr.prep = prepare_tokens(tr.planes.q, tr.planes.k, tr.g1, column_slice(tr.x, b_col, heads),
                           w.a_log, w.dt_bias, model.gate_lower_bound);
  tr.o = recurrence(tr.prep, tr.planes.v, batch, recurrent_pool, round, options.threads);
  tr.y = gated_rmsnorm(tr.o, tr.g2, w.o_norm_weight, model.norm_eps, round);
  tr.out = rounded(matmul_nt(tr.y, 0, p, w.o_proj, d, p, options.threads));
  return tr;
}

}  // namespace kda::ref
