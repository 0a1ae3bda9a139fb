// kda_recurrence_token on the GPU against the float64 reference (kda::ref::prep_recurrence), fed
// the same bf16 inputs. KDA_TEST_QUICK=1 runs a reduced set (for compute-sanitizer).
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/state_elements.h"
#include "kda/error.h"
#include "recurrence/kda_recurrence.h"
#include "recurrence/kda_recurrence_token.h"
#include "testing/layer_reference.h"
#include "support/bf16_pool.h"
#include "support/gpu_buffers.h"
#include "support/test_data.h"

namespace {

using kda::test::DeviceBuffer;
using kda::test::narrow_widened;
using kda::test::widen_bf16;
using kda::test::kPoison16;
using kda::test::quick_mode;
using kda::test::random_bf16;
using kda::test::random_floats;
using kda::test::rel_frobenius;
using kda::test::to_device;

constexpr int64_t kD = 128;

template <typename T>
std::vector<T> download(const DeviceBuffer& b) {
  return b.download_as<T>();
}

enum class SeqKind { Live, NullLine, OutsidePool };

struct SeqSpec {
  int32_t length;
  SeqKind kind = SeqKind::Live;
  bool initial = false;
};

// Host batch metadata padded to max_seqs entries as the module pads it (query_start_loc
// repeated, cache index null_line), and the same on the device.
struct TestBatch {
  std::vector<int32_t> qsl, lines;
  std::unique_ptr<bool[]> initial;
  int64_t num_seqs = 0, max_seqs = 0, tokens = 0;
  int32_t null_line = 0;
  int64_t cache_lines = 0;
  std::vector<int64_t> processed;  // sequences that name a real line and have tokens
  DeviceBuffer d_qsl, d_lines, d_initial;

  TestBatch(const std::vector<SeqSpec>& seqs, int64_t padding, int64_t pool_lines, int32_t null,
            std::mt19937_64& rng)
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
          lines.push_back(s % 2 ? static_cast<int32_t>(pool_lines + 3) : -2);
          break;
      }
    }
    tokens = qsl.back();
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

// Every other sequence continues from an initial state (odd ones, or even ones when flipped).
std::vector<SeqSpec> spec_from_lengths(const std::vector<int32_t>& lengths, bool flip) {
  std::vector<SeqSpec> seqs;
  for (size_t i = 0; i < lengths.size(); ++i)
    seqs.push_back({lengths[i], SeqKind::Live, (i % 2 == 1) != flip});
  // A skipped sequence, an empty one and one outside the pool, in the middle of the batch.
  seqs.insert(seqs.begin() + 2, SeqSpec{20, SeqKind::NullLine, true});
  seqs.insert(seqs.begin() + 4, SeqSpec{0, SeqKind::Live, true});
  seqs.insert(seqs.begin() + 5, SeqSpec{7, SeqKind::OutsidePool, true});
  return seqs;
}

// Recurrent-state pool layout: element (line, head, k, v) at these strides.
struct PoolLayout {
  const char* name;
  int64_t line, head, k, v;
  int64_t elements(int64_t lines) const { return lines * line; }
};

PoolLayout contiguous_layout(int64_t heads) {
  return {"(line, head, k, v) contiguous", heads * kD * kD, kD * kD, kD, 1};
}
// (line, head, v, k) with gaps between heads and lines: a layout with holes that must stay put.
PoolLayout transposed_layout(int64_t heads) {
  const int64_t head = kD * kD + 32;
  return {"(line, head, v, k) with gaps", heads * head + 100, head, 1, kD};
}

// Everything one kda_recurrence_token launch reads and writes, host and device. The pool is
// fp32 unless use_bf16_pool(); pool0 and download_pool() hold a bf16 pool widened (widen_bf16),
// so the checks below serve both types.
struct RecurrenceProblem {
  int64_t heads, part, bucket, qkv_stride, g1_stride, b_stride, b_offset, o_stride;
  std::optional<double> lower_bound;
  PoolLayout layout;
  TestBatch& batch;
  std::vector<uint16_t> q, k, v, g1, b;
  std::vector<float> a_log, dt_bias, pool0;
  kda::DType pool_dtype = kda::DType::FP32;
  DeviceBuffer d_q, d_k, d_v, d_g1, d_b, d_a_log, d_dt_bias, d_pool, d_o;

  RecurrenceProblem(int64_t h, std::optional<double> bound, PoolLayout pool_layout, TestBatch& tb,
                    std::mt19937_64& rng, bool padded_strides)
      : heads(h), part(h * kD), lower_bound(bound), layout(pool_layout), batch(tb) {
    bucket = batch.tokens + 37;
    qkv_stride = padded_strides ? part + 12 : part;
    g1_stride = part + 4;
    b_offset = 3 * part;
    b_stride = (3 * part + heads + 256 + 63) / 64 * 64;  // an in_proj output row
    o_stride = padded_strides ? part + 8 : part;
    q = random_bf16(rng, static_cast<size_t>(bucket * qkv_stride), -0.3, 1.2);
    k = random_bf16(rng, static_cast<size_t>(bucket * qkv_stride), -0.3, 1.2);
    v = random_bf16(rng, static_cast<size_t>(bucket * qkv_stride), -1, 1);
    g1 = random_bf16(rng, static_cast<size_t>(bucket * g1_stride), -1.5, 1.5);
    b = random_bf16(rng, static_cast<size_t>(bucket * b_stride), -3, 3);
    // exp(A_log) in [e^-1, e], softplus(g1 + dt_bias) <= softplus(1.5): the decay per step is
    // in about [exp(-5), 1), except two channels per head pushed past the softplus threshold
    // (x > 20: g = -exp(A_log) x, a channel that forgets at once).
    a_log = random_floats(rng, static_cast<size_t>(heads), -1, 1);
    dt_bias = random_floats(rng, static_cast<size_t>(part), -4, 0);
    for (int64_t hh = 0; hh < heads; ++hh) {
      dt_bias[static_cast<size_t>(hh * kD + 5)] = 25.0f;
      dt_bias[static_cast<size_t>(hh * kD + 77)] = 21.0f;
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
    return a;
  }

  // Poisons o, restores the starting pool, launches, waits.
  void run(kda::Stream stream = nullptr) {
    d_o.fill_bytes(0xFF);
    upload_pool(pool0);
    kda::kda_recurrence_token(args(), stream);
    kda::test::device_synchronize();
  }

  // Switches the device pool to bf16, starting from bf16_starting_pool (support/bf16_pool.h):
  // the initial states rounded, every other element poisoned. pool0 then holds the widened
  // values, what the fp32 reference starts from.
  void use_bf16_pool() {
    pool0 = kda::test::bf16_starting_pool(pool0, batch, layout, heads, kD);
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
        matrix_from_bf16(q.data(), bucket, part, qkv_stride),
        matrix_from_bf16(k.data(), bucket, part, qkv_stride),
        matrix_from_bf16(v.data(), bucket, part, qkv_stride),
        matrix_from_bf16(g1.data(), bucket, part, g1_stride),
        matrix_from_bf16(b.data() + b_offset, bucket, heads, b_stride), a_log.data(),
        dt_bias.data(), lower_bound, host_batch, sp, /*round_bf16=*/false);
    return r;
  }
};

struct WorstErrors {
  double o = 0, state = 0;
};

// Checks one run's o and pool against the reference, and that nothing else was written
// (except the states of `checkpoint_lines`, which the caller checks). Returns the worst
// per-sequence relative errors.
WorstErrors check_recurrence(const RecurrenceProblem& pr, const RecurrenceProblem::Reference& ref,
                             const std::vector<uint16_t>& o, const std::vector<float>& pool,
                             const std::vector<int64_t>& checkpoint_lines = {}) {
  WorstErrors worst;
  const TestBatch& tb = pr.batch;
  std::vector<char> row_written(static_cast<size_t>(pr.bucket), 0);
  std::vector<char> state_written(pool.size(), 0);
  for (int64_t s : tb.processed) {
    const int64_t bos = tb.qsl[static_cast<size_t>(s)], eos = tb.qsl[static_cast<size_t>(s) + 1];
    const int64_t line = tb.lines[static_cast<size_t>(s)];
    CAPTURE(s);
    CAPTURE(eos - bos);
    CAPTURE(tb.initial[s]);
    std::vector<double> got, want;
    bool finite = true;
    for (int64_t r = bos; r < eos; ++r) {
      row_written[static_cast<size_t>(r)] = 1;
      for (int64_t c = 0; c < pr.part; ++c) {
        const double g = kda::ref::bf16_value(o[static_cast<size_t>(r * pr.o_stride + c)]);
        finite = finite && std::isfinite(g);
        got.push_back(g);
        want.push_back(ref.o.at(r, c));
      }
    }
    CHECK(finite);
    const double o_err = rel_frobenius(got, want);
    CHECK(o_err <= 1e-2);
    worst.o = std::max(worst.o, o_err);
    got.clear();
    want.clear();
    for (int64_t h = 0; h < pr.heads; ++h)
      for (int64_t i = 0; i < kD; ++i)
        for (int64_t j = 0; j < kD; ++j) {
          const size_t at = static_cast<size_t>(line * pr.layout.line + h * pr.layout.head +
                                                i * pr.layout.k + j * pr.layout.v);
          state_written[at] = 1;
          got.push_back(pool[at]);
          want.push_back(ref.pool[at]);
        }
    const double state_err = rel_frobenius(got, want);
    CHECK(state_err <= 5e-3);
    worst.state = std::max(worst.state, state_err);
  }
  for (int64_t line : checkpoint_lines)
    for (int64_t h = 0; h < pr.heads; ++h)
      for (int64_t i = 0; i < kD; ++i)
        for (int64_t j = 0; j < kD; ++j)
          state_written[static_cast<size_t>(line * pr.layout.line + h * pr.layout.head +
                                            i * pr.layout.k + j * pr.layout.v)] = 1;
  // o: rows of no processed sequence and the padding columns of every row stay poisoned.
  int64_t o_changed = 0;
  for (int64_t r = 0; r < pr.bucket; ++r)
    for (int64_t c = 0; c < pr.o_stride; ++c)
      if ((!row_written[static_cast<size_t>(r)] || c >= pr.part) &&
          o[static_cast<size_t>(r * pr.o_stride + c)] != kPoison16)
        ++o_changed;
  CHECK(o_changed == 0);
  // Pool: every element outside the processed lines' states (other lines, holes) is unchanged.
  int64_t pool_changed = 0;
  for (size_t i = 0; i < pool.size(); ++i)
    if (!state_written[i] && std::memcmp(&pool[i], &pr.pool0[i], sizeof(float)) != 0) ++pool_changed;
  CHECK(pool_changed == 0);
  return worst;
}

// Batch metadata of max_seqs entries and optional checkpoint tables on the device: a
// problem's inputs run on other metadata of the same capacity (a batch cut at a checkpoint,
// the continuation from checkpoints) or with checkpoints.
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

struct RunResult {
  std::vector<uint16_t> o;
  std::vector<float> pool;
};

// One kda_recurrence_token launch on `meta` from `pool`, o poisoned.
RunResult run_on(RecurrenceProblem& pr, const DeviceMeta& meta, const std::vector<float>& pool) {
  pr.d_o.fill_bytes(0xFF);
  pr.upload_pool(pool);
  kda::kda_recurrence_token(meta.apply(pr.args()), nullptr);
  kda::test::device_synchronize();
  return {download<uint16_t>(pr.d_o), pr.download_pool()};
}

// The states (every head, (head, k, v) order) of pool line `line`.
std::vector<float> line_states(const RecurrenceProblem& pr, const std::vector<float>& pool, int64_t line) {
  std::vector<float> out;
  for (int64_t h = 0; h < pr.heads; ++h)
    for (int64_t i = 0; i < kD; ++i)
      for (int64_t j = 0; j < kD; ++j)
        out.push_back(pool[static_cast<size_t>(line * pr.layout.line + h * pr.layout.head + i * pr.layout.k +
                                               j * pr.layout.v)]);
  return out;
}
int64_t state_diff_bits(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  return kda::test::diff_bits(a.data(), b.data(), a.size() * sizeof(float));
}

// Elements of the states (every head) of `lines` where the bf16 pool `half` does not hold the
// fp32 pool `full` rounded to nearest even (both as download_pool() gives them).
int64_t rounding_mismatches(const RecurrenceProblem& pr, const std::vector<float>& half,
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

}  // namespace

TEST_CASE("kda_recurrence_token matches the float64 reference on varlen batches") {
  const std::vector<int32_t> lengths = quick_mode() ? std::vector<int32_t>{1, 16, 17, 65}
                                               : std::vector<int32_t>{1, 15, 16, 17, 63, 64, 65, 1000};
  const std::vector<int64_t> head_counts = quick_mode() ? std::vector<int64_t>{2} : std::vector<int64_t>{2, 12};
  for (int64_t heads : head_counts) {
    for (std::optional<double> bound : {std::optional<double>{}, std::optional<double>{-5.0}}) {
      for (bool transposed : {false, true}) {
        const PoolLayout layout = transposed ? transposed_layout(heads) : contiguous_layout(heads);
        CAPTURE(heads);
        CAPTURE(bound.has_value());
        CAPTURE(layout.name);
        std::mt19937_64 rng(1000 + heads * 10 + bound.has_value() * 2 + transposed);
        TestBatch batch(spec_from_lengths(lengths, /*flip=*/transposed), /*padding=*/3,
                        /*pool_lines=*/static_cast<int64_t>(lengths.size()) + 5, /*null=*/0, rng);
        RecurrenceProblem pr(heads, bound, layout, batch, rng, /*padded_strides=*/transposed);
        pr.run();
        const auto o1 = download<uint16_t>(pr.d_o);
        const auto pool1 = pr.download_pool();
        const WorstErrors worst = check_recurrence(pr, pr.reference(), o1, pool1);
        std::ostringstream line;
        line << "H " << heads << (bound ? ", lower bound, " : ", softplus, ") << layout.name
             << ": worst relative error o " << worst.o << ", final state " << worst.state;
        MESSAGE(line.str());

        pr.run();  // from the same starting pool: bitwise the same
        CHECK(kda::test::diff_bits(o1.data(), download<uint16_t>(pr.d_o).data(), o1.size() * 2) == 0);
        CHECK(kda::test::diff_bits(pool1.data(), pr.download_pool().data(), pool1.size() * 4) == 0);
      }
    }
  }
}

TEST_CASE("kda_recurrence_token on bf16 state pools: the fp32 state, widened from and rounded to the pool lines") {
  // The kernel carries the state in fp32 and touches a bf16 pool only to load a line (widened,
  // exactly) and to store one (rounded to nearest even). So, against the float64 reference
  // started from the widened initial lines, o and the final lines stay within the fp32 pools'
  // tolerances (the store adds at most 2^-8 relative per element); and the same launch on an
  // fp32 pool holding those widened lines computes the same registers: o bit for bit, and
  // every bf16 line written is the fp32 run's line rounded. Both layouts, both gates.
  const std::vector<int32_t> lengths = {1, 16, 17, 65, 130};
  const int64_t heads = 2;
  for (bool transposed : {false, true}) {
    const PoolLayout layout = transposed ? transposed_layout(heads) : contiguous_layout(heads);
    const std::optional<double> bound = transposed ? std::optional<double>{-5.0} : std::nullopt;
    CAPTURE(layout.name);
    std::mt19937_64 rng(1500 + transposed);
    TestBatch batch(spec_from_lengths(lengths, /*flip=*/transposed), /*padding=*/3,
                    /*pool_lines=*/static_cast<int64_t>(lengths.size()) + 5, /*null=*/0, rng);
    RecurrenceProblem pr(heads, bound, layout, batch, rng, /*padded_strides=*/transposed);
    pr.use_bf16_pool();
    pr.run();
    const auto o = download<uint16_t>(pr.d_o);
    const auto pool = pr.download_pool();
    const WorstErrors worst = check_recurrence(pr, pr.reference(), o, pool);
    MESSAGE("bf16 pool, ", std::string(layout.name), ": worst relative error o ", worst.o, ", final state ", worst.state);
    pr.run();  // from the same starting pool: bitwise the same
    CHECK(kda::test::diff_bits(o.data(), download<uint16_t>(pr.d_o).data(), o.size() * 2) == 0);
    CHECK(kda::test::diff_bits(pool.data(), pr.download_pool().data(), pool.size() * 4) == 0);

    pr.set_pool_dtype(kda::DType::FP32);  // pool0: the same widened lines
    pr.run();
    const auto o32 = download<uint16_t>(pr.d_o);
    const auto pool32 = pr.download_pool();
    std::vector<int64_t> lines;
    for (int64_t s : batch.processed) lines.push_back(batch.lines[static_cast<size_t>(s)]);
    const int64_t o_bits = kda::test::diff_bits(o.data(), o32.data(), o.size() * 2);
    const int64_t off = rounding_mismatches(pr, pool, pool32, lines);
    MESSAGE("against the run on the widened fp32 pool: ", o_bits, " o bits differ, ", off,
            " bf16 state elements are not its states rounded");
    CHECK(o_bits == 0);
    CHECK(off == 0);
  }
}

TEST_CASE("a captured kda_recurrence_token replays with new batch metadata") {
  std::mt19937_64 rng(77);
  const int64_t heads = 2;
  // Two batches of the same capacity (6 sequences); the graph is recorded with the first.
  TestBatch first({{40, SeqKind::Live, false}, {3, SeqKind::Live, true}}, 4, 10, 0, rng);
  TestBatch second({{5, SeqKind::Live, true}, {0, SeqKind::Live, true}, {9, SeqKind::NullLine, true},
                    {17, SeqKind::Live, false}, {12, SeqKind::Live, true}},
                   1, 10, 0, rng);
  REQUIRE(first.max_seqs == second.max_seqs);
  RecurrenceProblem pr(heads, std::nullopt, contiguous_layout(heads), second, rng, false);
  pr.run();
  const auto o_direct = download<uint16_t>(pr.d_o);
  const auto pool_direct = pr.download_pool();

  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  // The launch reads the second batch's device metadata buffers; record it holding the first
  // batch, replay once with that, then once with the second batch.
  second.d_qsl.upload(first.qsl);
  second.d_lines.upload(first.lines);
  second.d_initial.upload(first.initial.get(), static_cast<size_t>(first.max_seqs));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  kda::kda_recurrence_token(pr.args(), stream);
  REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);

  second.d_qsl.upload(second.qsl);
  second.d_lines.upload(second.lines);
  second.d_initial.upload(second.initial.get(), static_cast<size_t>(second.max_seqs));
  pr.d_o.fill_bytes(0xFF);
  pr.upload_pool(pr.pool0);
  REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  CHECK(kda::test::diff_bits(o_direct.data(), download<uint16_t>(pr.d_o).data(), o_direct.size() * 2) == 0);
  CHECK(kda::test::diff_bits(pool_direct.data(), pr.download_pool().data(), pool_direct.size() * 4) == 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST_CASE("kda_recurrence_token with bad arguments throws and enqueues nothing") {
  std::mt19937_64 rng(5);
  TestBatch batch({{9, SeqKind::Live, true}, {4, SeqKind::Live, false}}, 0, 4, 0, rng);
  RecurrenceProblem pr(2, std::nullopt, contiguous_layout(2), batch, rng, false);
  pr.d_o.fill_bytes(0xFF);
  pr.upload_pool(pr.pool0);
  kda::RecurrenceArgs a = pr.args();
  SUBCASE("misaligned q") { a.q = static_cast<const char*>(a.q) + 2; }
  SUBCASE("head_dim 64") { a.head_dim = 64; }
  SUBCASE("positive lower bound") { a.gate_lower_bound = 0.5; }
  SUBCASE("overlapping state strides") { a.state_stride_k = 64; }
  CHECK_THROWS_AS(kda::kda_recurrence_token(a, nullptr), kda::Error);
  kda::test::device_synchronize();
  const auto o = download<uint16_t>(pr.d_o);
  CHECK(std::count(o.begin(), o.end(), kPoison16) == static_cast<std::ptrdiff_t>(o.size()));
  const auto pool = pr.download_pool();
  CHECK(kda::test::diff_bits(pool.data(), pr.pool0.data(), pool.size() * 4) == 0);
}

TEST_CASE("kda_recurrence_token state checkpoints are bitwise the states of runs cut there and continue bitwise") {
  // Checkpoint ends are multiples of 64 rows or a sequence's last row: ends of the kernel's
  // 16-token stages, where the update left pending by the stage's last token has just been
  // applied, so a checkpoint is the exact state of a run cut there. Sequence 0 (initial state)
  // every 64 rows; 1 on the null line; 2 (from zeros) every 128 rows up to its last row; 3
  // empty; 4 at its last row, inside a 64-row block; 5 outside the pool; 6 none.
  const bool quick = quick_mode();
  const int32_t len0 = quick ? 140 : 330, len2 = quick ? 256 : 768;
  const std::vector<SeqSpec> seqs = {{len0, SeqKind::Live, true}, {20, SeqKind::NullLine, true},
                                     {len2, SeqKind::Live, false}, {0, SeqKind::Live, true},
                                     {77, SeqKind::Live, false},   {7, SeqKind::OutsidePool, true},
                                     {33, SeqKind::Live, true}};
  struct Spec {
    int32_t seq, first, interval, count;
  };
  const std::vector<Spec> specs = {{0, 64, 64, len0 / 64}, {2, 128, 128, len2 / 128}, {4, 77, 0, 1}};
  std::mt19937_64 rng(1500);
  const int64_t heads = 3;
  TestBatch batch(seqs, /*padding=*/2, /*pool_lines=*/static_cast<int64_t>(seqs.size()) + 20, /*null=*/0, rng);
  RecurrenceProblem pr(heads, std::nullopt, transposed_layout(heads), batch, rng, /*padded_strides=*/true);
  const PoolLayout& layout = pr.layout;
  std::vector<int32_t> free_lines;
  for (int32_t l = 1; l < batch.cache_lines; ++l)
    if (std::find(batch.lines.begin(), batch.lines.end(), l) == batch.lines.end()) free_lines.push_back(l);
  std::shuffle(free_lines.begin(), free_lines.end(), rng);
  auto take_line = [&] {
    REQUIRE(!free_lines.empty());
    const int32_t l = free_lines.back();
    free_lines.pop_back();
    return l;
  };
  std::vector<kda::CheckpointSeq> ck_seqs(static_cast<size_t>(batch.max_seqs));
  std::vector<kda::CheckpointEntry> ck_entries;
  for (const Spec& c : specs) {
    ck_seqs[static_cast<size_t>(c.seq)] = {c.first, c.interval, c.count, static_cast<int32_t>(ck_entries.size())};
    for (int32_t j = 0; j < c.count; ++j) ck_entries.push_back({take_line(), c.seq, c.first + j * c.interval, 0});
  }
  ck_entries.resize(ck_entries.size() + 4);  // unused entries (line -1)
  std::vector<int64_t> ck_lines;
  for (const kda::CheckpointEntry& e : ck_entries)
    if (e.line >= 0) ck_lines.push_back(e.line);
  for (int64_t line : ck_lines)  // NaN: an element left unwritten shows
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < kD; ++i)
        for (int64_t j = 0; j < kD; ++j)
          pr.pool0[static_cast<size_t>(line * layout.line + h * layout.head + i * layout.k + j * layout.v)] =
              std::numeric_limits<float>::quiet_NaN();

  const RunResult got =
      run_on(pr, DeviceMeta(batch.qsl, batch.lines, batch.initial.get(), ck_seqs, ck_entries), pr.pool0);
  const WorstErrors worst = check_recurrence(pr, pr.reference(), got.o, got.pool, ck_lines);
  MESSAGE("with checkpoints: worst relative error o ", worst.o, ", final state ", worst.state);

  // Each checkpoint: bitwise the final state of a run on the batch cut there (of this run at
  // the last row), and within bf16-level error of the float64 reference on the cut batch.
  int64_t worst_bits = 0;
  double worst_ref = 0;
  auto checkpoint_line = [&](int32_t seq, int32_t end) {
    for (const kda::CheckpointEntry& e : ck_entries)
      if (e.line >= 0 && e.seq == seq && e.end == end) return e.line;
    FAIL("no checkpoint of sequence " << seq << " at " << end);
    return int32_t{-1};
  };
  for (const kda::CheckpointEntry& e : ck_entries) {
    if (e.line < 0) continue;
    const size_t s = static_cast<size_t>(e.seq);
    const int64_t rows = batch.qsl[s + 1] - batch.qsl[s], line = batch.lines[s];
    CAPTURE(e.seq);
    CAPTURE(e.end);
    const std::vector<float> ck = line_states(pr, got.pool, e.line);
    const kda::ref::TruncatedBatch cut = kda::ref::truncated_batch(batch.host(), e.seq, e.end);
    const std::vector<float> want =
        e.end == rows ? line_states(pr, got.pool, line) : line_states(pr, run_on(pr, DeviceMeta(cut), pr.pool0).pool, line);
    const int64_t bits = state_diff_bits(ck, want);
    const std::vector<float> ref = line_states(pr, pr.reference(cut.batch).pool, line);
    const double err = rel_frobenius(std::vector<double>(ck.begin(), ck.end()), std::vector<double>(ref.begin(), ref.end()));
    CHECK(bits == 0);
    CHECK(err <= 5e-3);
    worst_bits = std::max(worst_bits, bits);
    worst_ref = std::max(worst_ref, err);
  }
  MESSAGE(ck_lines.size(), " checkpoints: at most ", worst_bits,
          " bits differ from the cut runs' final states; worst relative error vs float64 ", worst_ref);

  // Continuing from a checkpoint: sequence 0 after 128 rows and 2 after 128 (with a checkpoint
  // of its own after 128 rows of the tail), from the checkpoint lines. The tail's stages are the
  // uninterrupted run's (128 is a multiple of 16), each stage starts with no update pending in
  // either run, and the tail starts from the fp32 state the uninterrupted run had there, stored
  // and loaded exactly: every o row, final state and the tail's checkpoint repeat bit for bit.
  const int32_t a0 = batch.qsl[0] + 128, a1 = batch.qsl[1], b0 = batch.qsl[2] + 128, b1 = batch.qsl[3];
  std::vector<int32_t> tqsl = {0, a0, a1, b0, b1};
  std::vector<int32_t> tlines = {0, checkpoint_line(0, 128), 0, checkpoint_line(2, 128)};
  while (static_cast<int64_t>(tlines.size()) < batch.max_seqs) {
    tlines.push_back(0);
    tqsl.push_back(tqsl.back());
  }
  std::unique_ptr<bool[]> tinit(new bool[tlines.size()]);
  for (size_t i = 0; i < tlines.size(); ++i) tinit[i] = i == 1 || i == 3;
  std::vector<kda::CheckpointSeq> tseqs(tlines.size());
  const int32_t tail_ck = take_line();
  tseqs[3] = {128, 0, 1, 0};
  const std::vector<kda::CheckpointEntry> tentries = {{tail_ck, 3, 128, 0}, {}};
  const RunResult tail = run_on(pr, DeviceMeta(tqsl, tlines, tinit.get(), tseqs, tentries), got.pool);
  int64_t o_bits = 0;
  for (const auto& [r0, r1] : {std::pair<int64_t, int64_t>{a0, a1}, std::pair<int64_t, int64_t>{b0, b1}})
    o_bits += kda::test::diff_bits(tail.o.data() + r0 * pr.o_stride, got.o.data() + r0 * pr.o_stride,
                                   static_cast<size_t>((r1 - r0) * pr.o_stride) * 2);
  const int64_t state_bits =
      state_diff_bits(line_states(pr, tail.pool, tlines[1]), line_states(pr, got.pool, batch.lines[0])) +
      state_diff_bits(line_states(pr, tail.pool, tlines[3]), line_states(pr, got.pool, batch.lines[2]));
  const int64_t ck_bits =
      state_diff_bits(line_states(pr, tail.pool, tail_ck), line_states(pr, got.pool, checkpoint_line(2, 256)));
  MESSAGE("continued from checkpoints: ", o_bits, " o bits, ", state_bits, " final-state bits and ", ck_bits,
          " checkpoint bits differ from the uninterrupted run");
  CHECK(o_bits == 0);
  CHECK(state_bits == 0);
  CHECK(ck_bits == 0);
  // Only the tails' o rows and lines and the tail's checkpoint line change.
  std::vector<char> state_written(tail.pool.size(), 0);
  for (int64_t line : {int64_t{tlines[1]}, int64_t{tlines[3]}, int64_t{tail_ck}})
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < kD; ++i)
        for (int64_t j = 0; j < kD; ++j)
          state_written[static_cast<size_t>(line * layout.line + h * layout.head + i * layout.k + j * layout.v)] = 1;
  int64_t pool_changed = 0, o_changed = 0;
  for (size_t i = 0; i < tail.pool.size(); ++i)
    if (!state_written[i] && std::memcmp(&tail.pool[i], &got.pool[i], sizeof(float)) != 0) ++pool_changed;
  for (int64_t r = 0; r < pr.bucket; ++r) {
    const bool tail_row = (r >= a0 && r < a1) || (r >= b0 && r < b1);
    for (int64_t c = 0; c < pr.o_stride; ++c)
      if ((!tail_row || c >= pr.part) && tail.o[static_cast<size_t>(r * pr.o_stride + c)] != kPoison16) ++o_changed;
  }
  CHECK(pool_changed == 0);
  CHECK(o_changed == 0);
}
