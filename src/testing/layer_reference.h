// Float64 CPU reference of one KDA layer's prefill, exactly as docs/layer.md writes
// it, for tests. Plain C++ (no CUDA), so CI runs it.
//
// Conventions:
// - Every arithmetic operation is done in double. Weights (bf16 in the model) are passed as
//   float arrays holding the bf16 values (kda::host::bf16_to_float of the bits); fp32 weights
//   as they are.
// - Activations are Matrix values (row-major double). With round_bf16 (the default) a value is
//   rounded to bf16 (to nearest, ties to even, straight from double) wherever the spec stores
//   bf16: X, the q/k/v planes, g1, g2, o, y and out. That is the dataflow the GPU implements;
//   the per-token prep (L2 norms, decay, beta) stays unrounded, as it is fp32 in registers there.
// - Rows that the GPU never writes (the tokens of a skipped sequence in the conv planes, o, y and
//   out) are NaN here, so a comparison that reads them fails loudly.
// - A sequence is skipped when its cache index is the null line or lies outside
//   [0, cache_lines): it reads and writes no pool line. Zero-length sequences touch nothing.
// - Pools are fp32, as on the GPU; the recurrent state is carried in double inside one call and
//   rounded to fp32 when written back to its line.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kda/config.h"

namespace kda::ref {

// Rounds to the nearest bf16 value, ties to even, in one step from double (going through float
// first could round twice). Overflow gives infinity, NaN stays NaN.
double round_to_bf16(double x);
// The bf16 bit pattern of round_to_bf16(x); NaN gives the canonical 0x7FFF.
uint16_t bf16_bits(double x);
double bf16_value(uint16_t bits);

struct Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<double> data;  // rows x cols, row-major

  Matrix() = default;
  Matrix(int64_t rows, int64_t cols, double fill = 0.0);

  double* row(int64_t r) { return data.data() + r * cols; }
  const double* row(int64_t r) const { return data.data() + r * cols; }
  double& at(int64_t r, int64_t c) { return data[static_cast<size_t>(r * cols + c)]; }
  double at(int64_t r, int64_t c) const { return data[static_cast<size_t>(r * cols + c)]; }
};

// Columns [col0, col0 + ncols) of m.
Matrix column_slice(const Matrix& m, int64_t col0, int64_t ncols);
// Rows of bf16 bits with a row stride (elements) -> Matrix of their values.
Matrix matrix_from_bf16(const uint16_t* bits, int64_t rows, int64_t cols, int64_t row_stride);
void round_matrix_to_bf16(Matrix& m);

// Batch metadata, as in kda::BatchView, plus the pool facts that decide skipping.
struct HostBatch {
  const int32_t* query_start_loc = nullptr;  // num_seqs + 1, non-decreasing
  const int32_t* cache_indices = nullptr;    // num_seqs
  const bool* has_initial_state = nullptr;   // num_seqs, or nullptr: no sequence has one
  int64_t num_seqs = 0;
  int32_t null_line = 0;
  int64_t cache_lines = 0;

  int64_t num_tokens() const { return num_seqs > 0 ? query_start_loc[num_seqs] : 0; }
  // The sequence names a real pool line (not the null line, inside the pool).
  bool names_line(int64_t s) const;
  bool initial_state(int64_t s) const { return has_initial_state && has_initial_state[s]; }
};

// `batch` with sequence `seq` alone, cut to its first `rows` rows (0 <= rows <= its length):
// every other sequence is empty, every row keeps its position (the inputs of `batch` serve
// unchanged), seq keeps its line and initial-state flag. A run on it from the same pools
// leaves in seq's line the states that a checkpoint of seq after `rows` rows of the window
// holds (common/state_checkpoints.h). Owns the arrays `batch` points into; moving keeps them
// valid, copying is not possible.
struct TruncatedBatch {
  std::vector<int32_t> query_start_loc, cache_indices;
  std::unique_ptr<bool[]> has_initial_state;
  HostBatch batch;
};
TruncatedBatch truncated_batch(const HostBatch& batch, int64_t seq, int64_t rows);

// The fp32 recurrent-state pool, (cache_lines, H, K, V) addressed with explicit strides.
struct StatePool {
  float* data = nullptr;
  int64_t stride_line = 0, stride_head = 0, stride_k = 0, stride_v = 0;

  static StatePool contiguous(float* data, int64_t num_heads);
  float& at(int64_t line, int64_t head, int64_t k, int64_t v) const {
    return data[line * stride_line + head * stride_head + k * stride_k + v * stride_v];
  }
};

// threads <= 0: std::thread::hardware_concurrency().
// C = A[:, a_col0 : a_col0 + K] @ B^T with B (N, K) row-major fp32 values, leading dimension
// ldb. Rows are spread over threads; each element's sum runs in the same order whatever the
// thread count, so the result does not depend on it.
Matrix matmul_nt(const Matrix& a, int64_t a_col0, int64_t k, const float* b, int64_t n,
                 int64_t ldb, int threads = 0);

// Spec step 2 over the Q|K|V columns [0, 3P) of x: width-4 causal conv per sequence (taps
// oldest first, history from the conv-state line when has_initial_state), SiLU, three planes.
// conv_states is (cache_lines, 3P, 3) contiguous fp32, column 2 the most recent token; it is
// updated per stock-conv.md (the last three inputs of the sequence, shifted in for length 1, 2).
struct ConvPlanes {
  Matrix q, k, v;  // (T, P) each
};
ConvPlanes short_conv(const Matrix& x, int64_t part_dim, const float* conv_weight,
                      const HostBatch& batch, float* conv_states, bool round_bf16 = true);

// Spec step 4, scalar pieces.
double softplus(double x);  // x for x > 20, else log(1 + exp(x))
double sigmoid(double x);
// The log-space decay g of one key channel, x = g1 + dt_bias:
// -exp(a_log) * softplus(x), or lower_bound * sigmoid(exp(a_log) * x) when a bound is given.
double log_decay(double x, double a_log, std::optional<double> lower_bound);

// Spec step 4 for every row of the inputs (NaN rows stay NaN).
struct PreparedTokens {
  Matrix q;          // (T, P): L2-normalised per head (eps 1e-6), times 128^-0.5
  Matrix k;          // (T, P): L2-normalised per head (eps 1e-6)
  Matrix log_decay;  // (T, P): g per key channel
  Matrix beta;       // (T, H): sigmoid(b)
};
PreparedTokens prepare_tokens(const Matrix& q, const Matrix& k, const Matrix& g1,
                              const Matrix& b_logits, const float* a_log, const float* dt_bias,
                              std::optional<double> lower_bound);

// Spec step 5: the token-by-token gated delta rule per sequence and head, from the state line
// (zeros without an initial state) to the final state written back to it. Returns o (T, P),
// NaN on rows of skipped sequences and rows past the last sequence.
Matrix recurrence(const PreparedTokens& prep, const Matrix& v, const HostBatch& batch,
                  const StatePool& pool, bool round_bf16 = true, int threads = 0);

// What the fused GPU op kda_recurrence_token computes: prepare_tokens, then recurrence.
Matrix prep_recurrence(const Matrix& q, const Matrix& k, const Matrix& v, const Matrix& g1,
                       const Matrix& b_logits, const float* a_log, const float* dt_bias,
                       std::optional<double> lower_bound, const HostBatch& batch,
                       const StatePool& pool, bool round_bf16 = true, int threads = 0);

// Spec step 6 per (row, head) vector of o: x * rsqrt(mean(x^2) + eps) * weight * sigmoid(g2).
Matrix gated_rmsnorm(const Matrix& o, const Matrix& g2, const float* weight, double eps,
                     bool round_bf16 = true);

// Host copies of one layer's weights, shapes as in kda::LayerWeights; bf16 weights as float
// values.
struct HostLayerWeights {
  const float* in_proj = nullptr;        // (3P + H + 2r, D)
  const float* conv_weight = nullptr;    // (3P, 4)
  const float* f_b = nullptr;            // (P, r)
  const float* g_b = nullptr;            // (P, r)
  const float* a_log = nullptr;          // (H)
  const float* dt_bias = nullptr;        // (P)
  const float* o_norm_weight = nullptr;  // (128)
  const float* o_proj = nullptr;         // (D, P)
};

struct LayerOptions {
  bool round_bf16 = true;
  int threads = 0;
};

// Every stage's result of one layer forward.
struct LayerTrace {
  Matrix x;           // (T, W_in) in_proj output, W_in = model.in_proj_cols() (no padding)
  ConvPlanes planes;  // (T, P) x 3
  Matrix g1, g2;      // (T, P)
  PreparedTokens prep;
  Matrix o;    // (T, P)
  Matrix y;    // (T, P)
  Matrix out;  // (T, D)
};

// The whole layer over hidden (T, D) for the batch (T = batch.num_tokens()); updates
// conv_states ((cache_lines, 3P, 3) contiguous) and the recurrent pool in place.
LayerTrace layer_forward(const ModelConfig& model, const HostLayerWeights& weights,
                         const Matrix& hidden, const HostBatch& batch, float* conv_states,
                         const StatePool& recurrent_pool, const LayerOptions& options = {});

}  // namespace kda::ref
