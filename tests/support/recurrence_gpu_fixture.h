// What the two GPU test programs of the KDA recurrence share (test_kda_recurrence_token_gpu.cpp
// and test_kda_chunked_gpu.cpp, one kernel each, both on RecurrenceArgs): a varlen batch padded
// as the module pads it, on the host and the device; the recurrent-state pool's layout; the
// inputs of one launch with their float64 reference; the check of a run against expected o and
// pool values (and that it wrote nothing else); batch metadata for runs on other metadata; and
// the per-line state helpers. Each program keeps its own cases and the values that pick them
// (sequence mixes, pool layouts, the shape of the inputs).
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "common/state_elements.h"
#include "kda/types.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_recurrence.h"
#include "support/bf16_pool.h"
#include "support/gpu_buffers.h"
#include "support/test_data.h"
#include "testing/layer_reference.h"

namespace kda::test::rec {

constexpr int64_t kD = 128;  // K = V

enum class SeqKind { Live, NullLine, OutsidePool };

struct SeqSpec {
  int32_t length;
  SeqKind kind = SeqKind::Live;
  bool initial = false;
};

// The cache indices of OutsidePool sequences: cache_lines + above for odd sequences, `below`
// (negative) for even ones.
struct OutsideLines {
  int32_t above, below;
};

// Batch metadata padded to max_seqs entries as the module pads it (query_start_loc repeated,
// the null line), on the host and on the device. Live sequences take distinct random lines
// other than the null line.
struct VarlenBatch {
  std::vector<int32_t> qsl, lines;
  std::unique_ptr<bool[]> initial;
  int64_t num_seqs = 0, max_seqs = 0, tokens = 0;
  int32_t null_line = 0;
  int64_t cache_lines = 0;
  std::vector<int64_t> processed;  // sequences that name a real line and have tokens
  DeviceBuffer d_qsl, d_lines, d_initial;

  VarlenBatch(const std::vector<SeqSpec>& seqs, int64_t padding, int64_t pool_lines, int32_t null,
              std::mt19937_64& rng, OutsideLines outside)
      : num_seqs(static_cast<int64_t>(seqs.size())),
        max_seqs(num_seqs + padding),
        null_line(null),
        cache_lines(pool_lines) {
    std::vector<int32_t> free_lines;
    for (int32_t l = 0; l < pool_lines; ++l)
      if (l != null) free_lines.push_back(l);
    std::shuffle(free_lines.begin(), free_lines.end(), rng);
    initial.reset(new bool[static_cast<size_t>(max_seqs)]);
    qsl.push_back(0);
    size_t next_line = 0;
    for (int64_t s = 0; s < max_seqs; ++s) {
      const bool pad = s >= num_seqs;
      const SeqSpec spec = pad ? SeqSpec{0, SeqKind::NullLine, true} : seqs[static_cast<size_t>(s)];
      qsl.push_back(qsl.back() + spec.length);
      initial[s] = spec.initial;
      switch (spec.kind) {
        case SeqKind::Live:
          REQUIRE(next_line < free_lines.size());
          lines.push_back(free_lines[next_line++]);
          if (spec.length > 0) processed.push_back(s);
          break;
        case SeqKind::NullLine:
          lines.push_back(null);
          break;
        case SeqKind::OutsidePool:
          lines.push_back(s % 2 ? static_cast<int32_t>(pool_lines + outside.above) : outside.below);
          break;
      }
    }
    tokens = qsl.back();
    upload();
  }

  // The host metadata to the device buffers.
  void upload() {
    d_qsl = to_device(qsl);
    d_lines = to_device(lines);
    d_initial = DeviceBuffer(static_cast<size_t>(max_seqs));
    d_initial.upload(initial.get(), static_cast<size_t>(max_seqs));
  }

  kda::ref::HostBatch host() const {
    kda::ref::HostBatch b;
    b.query_start_loc = qsl.data();
    b.cache_indices = lines.data();
    b.has_initial_state = initial.get();
    b.num_seqs = max_seqs;
    b.null_line = null_line;
    b.cache_lines = cache_lines;
    return b;
  }
};

// Recurrent-state pool layout: element (line, head, k, v) at these strides.
struct PoolLayout {
  const char* name;
  int64_t line, head, k, v;
  int64_t elements(int64_t lines) const { return lines * line; }
};

// How a program shapes the inputs of its launches.
struct InputShape {
  int64_t extra_rows;        // the bucket: the batch's tokens plus these rows past them
  bool padded_strides;       // q/k/v rows P + 12 and o rows P + 8 apart, else P
  double key_lo, key_hi;     // q and k ~ U(key_lo, key_hi)
  bool poison_unowned_rows;  // input rows of no processed sequence NaN (reading them shows in o)
};

// Everything one launch reads and writes, host and device. The pool is fp32 unless
// use_bf16_pool(); pool0, download_pool() and Result::pool hold a bf16 pool widened
// (widen_bf16), so the checks serve both types.
struct RecurrenceInputs {
  int64_t heads, part, bucket, qkv_stride, g1_stride, b_stride, b_offset, o_stride;
  std::optional<double> lower_bound;
  PoolLayout layout;
  VarlenBatch& batch;
  std::vector<uint16_t> q, k, v, g1, b;
  std::vector<float> a_log, dt_bias, pool0;
  kda::DType pool_dtype = kda::DType::FP32;
  int64_t segment_tokens = kda::kKdaAutoSegments;  // RecurrenceArgs::segment_tokens
  DeviceBuffer d_q, d_k, d_v, d_g1, d_b, d_a_log, d_dt_bias, d_pool, d_o;

  RecurrenceInputs(int64_t h, std::optional<double> bound, PoolLayout pool_layout, VarlenBatch& tb,
                   std::mt19937_64& rng, const InputShape& shape)
      : heads(h), part(h * kD), lower_bound(bound), layout(pool_layout), batch(tb) {
    bucket = batch.tokens + shape.extra_rows;
    qkv_stride = shape.padded_strides ? part + 12 : part;
    g1_stride = part + 4;
    b_offset = 3 * part;
    b_stride = (3 * part + heads + 256 + 63) / 64 * 64;  // an in_proj output row
    o_stride = shape.padded_strides ? part + 8 : part;
    q = random_bf16(rng, static_cast<size_t>(bucket * qkv_stride), shape.key_lo, shape.key_hi);
    k = random_bf16(rng, static_cast<size_t>(bucket * qkv_stride), shape.key_lo, shape.key_hi);
    v = random_bf16(rng, static_cast<size_t>(bucket * qkv_stride), -1, 1);
    g1 = random_bf16(rng, static_cast<size_t>(bucket * g1_stride), -1.5, 1.5);
    b = random_bf16(rng, static_cast<size_t>(bucket * b_stride), -3, 3);
    // exp(A_log) in [e^-1, e], softplus(g1 + dt_bias) <= softplus(1.5): the decay per step is
    // in about [exp(-5), 1), except two channels per head pushed past the softplus threshold
    // (x > 20: g = -exp(A_log) x, a channel that forgets everything at every token).
    a_log = random_floats(rng, static_cast<size_t>(heads), -1, 1);
    dt_bias = random_floats(rng, static_cast<size_t>(part), -4, 0);
    for (int64_t hh = 0; hh < heads; ++hh) {
      dt_bias[static_cast<size_t>(hh * kD + 5)] = 25.0f;
      dt_bias[static_cast<size_t>(hh * kD + 77)] = 21.0f;
    }
    if (shape.poison_unowned_rows) {
      std::vector<char> live(static_cast<size_t>(bucket), 0);
      for (int64_t s : batch.processed)
        for (int64_t r = batch.qsl[static_cast<size_t>(s)]; r < batch.qsl[static_cast<size_t>(s) + 1]; ++r)
          live[static_cast<size_t>(r)] = 1;
      for (int64_t r = 0; r < bucket; ++r) {
        if (live[static_cast<size_t>(r)]) continue;
        for (auto* plane : {&q, &k, &v})
          std::fill_n(plane->begin() + r * qkv_stride, qkv_stride, kPoison16);
        std::fill_n(g1.begin() + r * g1_stride, g1_stride, kPoison16);
        std::fill_n(b.begin() + r * b_stride, b_stride, kPoison16);
      }
    }
    // Lines of sequences without an initial state hold NaN: reading them would show.
    pool0 = random_floats(rng, static_cast<size_t>(layout.elements(batch.cache_lines)), -0.5, 0.5);
    for (int64_t s : batch.processed) {
      if (batch.initial[s]) continue;
      const int64_t line = batch.lines[static_cast<size_t>(s)];
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int64_t i = 0; i < kD; ++i)
          for (int64_t j = 0; j < kD; ++j)
            pool0[static_cast<size_t>(line * layout.line + hh * layout.head + i * layout.k + j * layout.v)] =
                std::numeric_limits<float>::quiet_NaN();
    }
    d_q = to_device(q);
    d_k = to_device(k);
    d_v = to_device(v);
    d_g1 = to_device(g1);
    d_b = to_device(b);
    d_a_log = to_device(a_log);
    d_dt_bias = to_device(dt_bias);
    d_pool = DeviceBuffer(pool0.size() * sizeof(float));
    d_o = DeviceBuffer(static_cast<size_t>(bucket * o_stride) * sizeof(uint16_t));
  }

  kda::RecurrenceArgs args() const {
    kda::RecurrenceArgs a;
    a.num_heads = heads;
    a.num_tokens = bucket;
    a.varlen.num_seqs = batch.max_seqs;
    a.varlen.query_start_loc = batch.d_qsl.as<int32_t>();
    a.varlen.cache_indices = batch.d_lines.as<int32_t>();
    a.varlen.has_initial_state = batch.d_initial.as<bool>();
    a.varlen.null_line = batch.null_line;
    a.q = d_q.get();
    a.k = d_k.get();
    a.v = d_v.get();
    a.qkv_row_stride = qkv_stride;
    a.g1 = d_g1.get();
    a.g1_row_stride = g1_stride;
    a.b = d_b.get();
    a.b_row_stride = b_stride;
    a.b_col_offset = b_offset;
    a.a_log = d_a_log.as<float>();
    a.dt_bias = d_dt_bias.as<float>();
    a.gate_lower_bound = lower_bound;
    a.states = d_pool.get();
    a.state_dtype = pool_dtype;
    a.varlen.cache_lines = batch.cache_lines;
    a.state_stride_line = layout.line;
    a.state_stride_head = layout.head;
    a.state_stride_k = layout.k;
    a.state_stride_v = layout.v;
    a.o = d_o.get();
    a.o_row_stride = o_stride;
    a.segment_tokens = segment_tokens;
    return a;
  }

  // Switches the device pool to bf16, starting from bf16_starting_pool (support/bf16_pool.h):
  // the initial states rounded, every other element poisoned. pool0 then holds the widened
  // values, what the fp32 reference starts from.
  void use_bf16_pool() {
    pool0 = bf16_starting_pool(pool0, batch, layout, heads, kD);
    set_pool_dtype(kda::DType::BF16);
  }
  // The device pool's element type; pool0 is kept (for BF16 it must hold widened values).
  void set_pool_dtype(kda::DType dtype) {
    pool_dtype = dtype;
    d_pool = DeviceBuffer(pool0.size() * kda::dtype_size(dtype));
  }
  void upload_pool(const std::vector<float>& pool) {
    if (pool_dtype == kda::DType::BF16) d_pool.upload(narrow_widened(pool));
    else d_pool.upload(pool);
  }
  // The device pool, widened when it is bf16.
  std::vector<float> download_pool() const {
    return pool_dtype == kda::DType::BF16 ? widen_bf16(d_pool.download_as<uint16_t>()) : d_pool.download_as<float>();
  }

  struct Result {
    std::vector<uint16_t> o;
    std::vector<float> pool;  // widened when the pool is bf16
  };
  Result result() const { return {d_o.download_as<uint16_t>(), download_pool()}; }

  struct Reference {
    kda::ref::Matrix o;
    std::vector<float> pool;
  };
  Reference reference() const { return reference(batch.host()); }
  // On other metadata over the same rows (e.g. kda::ref::truncated_batch of batch.host()).
  Reference reference(const kda::ref::HostBatch& host_batch) const {
    using kda::ref::matrix_from_bf16;
    Reference r;
    r.pool = pool0;
    kda::ref::StatePool sp{r.pool.data(), layout.line, layout.head, layout.k, layout.v};
    r.o = kda::ref::prep_recurrence(
        matrix_from_bf16(q.data(), bucket, part, qkv_stride), matrix_from_bf16(k.data(), bucket, part, qkv_stride),
        matrix_from_bf16(v.data(), bucket, part, qkv_stride), matrix_from_bf16(g1.data(), bucket, part, g1_stride),
        matrix_from_bf16(b.data() + b_offset, bucket, heads, b_stride), a_log.data(), dt_bias.data(),
        lower_bound, host_batch, sp, /*round_bf16=*/false);
    return r;
  }
};

struct Worst {
  double o = 0, state = 0;
};

// Per processed sequence: o rows and final state of `got` against `want_o(row, col)` /
// `want_pool` within the tolerances. Everything else must be untouched: o rows of no
// processed sequence and o's padding columns keep their NaN poison, pool elements outside the
// processed lines' states (other lines, the holes of a strided layout) are bit-identical to
// the start, except the states of `checkpoint_lines` (which the caller checks). Returns the
// worst per-sequence relative errors.
template <typename OAt>
Worst check_against(const RecurrenceInputs& pr, const RecurrenceInputs::Result& got, OAt want_o,
                    const std::vector<float>& want_pool, double o_tol, double state_tol,
                    const std::vector<int64_t>& checkpoint_lines = {}) {
  Worst worst;
  const VarlenBatch& tb = pr.batch;
  std::vector<char> row_written(static_cast<size_t>(pr.bucket), 0);
  std::vector<char> state_written(got.pool.size(), 0);
  for (int64_t s : tb.processed) {
    const int64_t bos = tb.qsl[static_cast<size_t>(s)], eos = tb.qsl[static_cast<size_t>(s) + 1];
    const int64_t line = tb.lines[static_cast<size_t>(s)];
    CAPTURE(s);
    CAPTURE(eos - bos);
    CAPTURE(tb.initial[s]);
    std::vector<double> g, w;
    bool finite = true;
    for (int64_t r = bos; r < eos; ++r) {
      row_written[static_cast<size_t>(r)] = 1;
      for (int64_t c = 0; c < pr.part; ++c) {
        const double x = kda::ref::bf16_value(got.o[static_cast<size_t>(r * pr.o_stride + c)]);
        finite = finite && std::isfinite(x);
        g.push_back(x);
        w.push_back(want_o(r, c));
      }
    }
    CHECK(finite);
    const double o_err = rel_frobenius(g, w);
    CHECK(o_err <= o_tol);
    worst.o = std::max(worst.o, o_err);
    g.clear();
    w.clear();
    for (int64_t h = 0; h < pr.heads; ++h)
      for (int64_t i = 0; i < kD; ++i)
        for (int64_t j = 0; j < kD; ++j) {
          const size_t at = static_cast<size_t>(line * pr.layout.line + h * pr.layout.head +
                                                i * pr.layout.k + j * pr.layout.v);
          state_written[at] = 1;
          g.push_back(got.pool[at]);
          w.push_back(want_pool[at]);
        }
    const double state_err = rel_frobenius(g, w);
    CHECK(state_err <= state_tol);
    worst.state = std::max(worst.state, state_err);
  }
  for (int64_t line : checkpoint_lines)
    for (int64_t h = 0; h < pr.heads; ++h)
      for (int64_t i = 0; i < kD; ++i)
        for (int64_t j = 0; j < kD; ++j)
          state_written[static_cast<size_t>(line * pr.layout.line + h * pr.layout.head +
                                            i * pr.layout.k + j * pr.layout.v)] = 1;
  int64_t o_changed = 0;
  for (int64_t r = 0; r < pr.bucket; ++r)
    for (int64_t c = 0; c < pr.o_stride; ++c)
      if ((!row_written[static_cast<size_t>(r)] || c >= pr.part) &&
          got.o[static_cast<size_t>(r * pr.o_stride + c)] != kPoison16)
        ++o_changed;
  CHECK(o_changed == 0);
  int64_t pool_changed = 0;
  for (size_t i = 0; i < got.pool.size(); ++i)
    if (!state_written[i] && std::memcmp(&got.pool[i], &pr.pool0[i], sizeof(float)) != 0) ++pool_changed;
  CHECK(pool_changed == 0);
  return worst;
}

// check_against the float64 reference: o within 1e-2 and the final states within 5e-3.
inline Worst check_reference(const RecurrenceInputs& pr, const RecurrenceInputs::Result& got,
                             const RecurrenceInputs::Reference& ref,
                             const std::vector<int64_t>& checkpoint_lines = {}) {
  return check_against(pr, got, [&](int64_t r, int64_t c) { return ref.o.at(r, c); }, ref.pool, 1e-2, 5e-3,
                       checkpoint_lines);
}

// Batch metadata of max_seqs entries and optional checkpoint tables on the device: a problem's
// inputs run on other metadata of the same capacity (a batch cut at a checkpoint, the
// continuation from checkpoints) or with checkpoints.
struct DeviceMeta {
  int64_t max_seqs = 0, max_checkpoints = 0;
  DeviceBuffer qsl, lines, initial, ck_seqs, ck_entries;

  DeviceMeta(const std::vector<int32_t>& q, const std::vector<int32_t>& l, const bool* init,
             const std::vector<kda::CheckpointSeq>& seqs = {},
             const std::vector<kda::CheckpointEntry>& entries = {})
      : max_seqs(static_cast<int64_t>(l.size())), max_checkpoints(static_cast<int64_t>(entries.size())) {
    REQUIRE(q.size() == l.size() + 1);
    qsl = to_device(q);
    lines = to_device(l);
    initial = DeviceBuffer(l.size());
    initial.upload(init, l.size());
    if (!seqs.empty()) {
      REQUIRE(seqs.size() == l.size());
      ck_seqs = to_device(seqs);
      ck_entries = to_device(entries);
    }
  }
  explicit DeviceMeta(const kda::ref::TruncatedBatch& t)
      : DeviceMeta(t.query_start_loc, t.cache_indices, t.has_initial_state.get()) {}

  kda::RecurrenceArgs apply(kda::RecurrenceArgs a) const {
    a.varlen.num_seqs = max_seqs;
    a.varlen.query_start_loc = qsl.as<int32_t>();
    a.varlen.cache_indices = lines.as<int32_t>();
    a.varlen.has_initial_state = initial.as<bool>();
    if (max_checkpoints > 0) {
      a.checkpoint_seqs = ck_seqs.as<kda::CheckpointSeq>();
      a.checkpoint_entries = ck_entries.as<kda::CheckpointEntry>();
      a.max_checkpoints = max_checkpoints;
    }
    return a;
  }
};

// The states (every head, (head, k, v) order) of pool line `line`.
inline std::vector<float> line_states(const RecurrenceInputs& pr, const std::vector<float>& pool, int64_t line) {
  std::vector<float> out;
  for (int64_t h = 0; h < pr.heads; ++h)
    for (int64_t i = 0; i < kD; ++i)
      for (int64_t j = 0; j < kD; ++j)
        out.push_back(pool[static_cast<size_t>(line * pr.layout.line + h * pr.layout.head + i * pr.layout.k +
                                               j * pr.layout.v)]);
  return out;
}
inline int64_t state_diff_bits(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  return diff_bits(a.data(), b.data(), a.size() * sizeof(float));
}

// Elements of the states (every head) of `lines` where the bf16 pool `half` does not hold the
// fp32 pool `full` rounded to nearest even (both widened, as download_pool() gives them).
inline int64_t rounding_mismatches(const RecurrenceInputs& pr, const std::vector<float>& half,
                                   const std::vector<float>& full, const std::vector<int64_t>& lines) {
  int64_t off = 0;
  for (int64_t line : lines) {
    const std::vector<float> h = line_states(pr, half, line), f = line_states(pr, full, line);
    for (size_t i = 0; i < h.size(); ++i) {
      const float want = kda::state_bf16_to_float(kda::state_float_to_bf16(f[i]));
      off += std::memcmp(&h[i], &want, sizeof(float)) != 0;
    }
  }
  return off;
}

}  // namespace kda::test::rec
