// kda_chunked (the chunked KDA recurrence on tensor cores) on the GPU, against the float64
// reference (kda::ref::prep_recurrence) and against the token-by-token kernel
// kda_recurrence_token, fed the same bf16 inputs; the batch, inputs and checks are
// support/recurrence_gpu_fixture.h's. KDA_TEST_QUICK=1 runs a reduced set (for
// compute-sanitizer).
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

#include "common/half_host.h"
#include "kda/error.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_recurrence.h"
#include "recurrence/kda_recurrence_token.h"
#include "testing/layer_reference.h"
#include "support/gpu_buffers.h"
#include "support/recurrence_gpu_fixture.h"
#include "support/test_data.h"

namespace {

using kda::test::DeviceBuffer;
using kda::test::kPoison16;
using kda::test::quick_mode;
using kda::test::rel_frobenius;

using namespace kda::test::rec;
using Kind = SeqKind;
using Seq = SeqSpec;

// Batch metadata padded to max_seqs entries as the module pads it (query_start_loc repeated,
// null line 0), on the host and on the device; outside-pool lines cache_lines + 2 and -3.
struct Batch : VarlenBatch {
  Batch(const std::vector<Seq>& seqs, int64_t padding, int64_t pool_lines, std::mt19937_64& rng)
      : VarlenBatch(seqs, padding, pool_lines, /*null=*/0, rng, {2, -3}) {}
};

// lengths as live sequences, alternately with and without an initial state, plus a skipped
// sequence (null line), an empty one and one outside the pool in the middle.
std::vector<Seq> varlen(const std::vector<int32_t>& lengths, bool flip) {
  std::vector<Seq> seqs;
  for (size_t i = 0; i < lengths.size(); ++i) seqs.push_back({lengths[i], Kind::Live, (i % 2 == 1) != flip});
  const auto at = [&](size_t i) { return seqs.begin() + static_cast<std::ptrdiff_t>(std::min(i, seqs.size())); };
  seqs.insert(at(1), Seq{20, Kind::NullLine, true});
  seqs.insert(at(3), Seq{0, Kind::Live, true});
  seqs.insert(at(4), Seq{9, Kind::OutsidePool, true});
  return seqs;
}

PoolLayout contiguous(int64_t heads) { return {"(line, head, k, v)", heads * kD * kD, kD * kD, kD, 1}; }
PoolLayout transposed_with_gaps(int64_t heads) {
  const int64_t head = kD * kD + 32;
  return {"(line, head, v, k) with gaps", heads * head + 96, head, 1, kD};
}

// Everything one launch reads and writes (RecurrenceInputs), with kda_chunked's workspace: a
// bucket of the batch's tokens + 29 rows; input rows that belong to no processed sequence
// (skipped sequences, rows past the batch) are NaN, so reading them would show in o. Keys
// either zero-mean (nearly orthogonal) or all positive-leaning, which makes them strongly
// correlated: A's entries near beta, the harder case for the chunk's solve.
struct Problem : RecurrenceInputs {
  DeviceBuffer d_work;

  Problem(int64_t h, std::optional<double> bound, PoolLayout pool_layout, Batch& tb,
          std::mt19937_64& rng, bool padded, bool centred_keys)
      : RecurrenceInputs(h, bound, pool_layout, tb, rng,
                         {29, padded, centred_keys ? -1.0 : -0.3, centred_keys ? 1.0 : 1.2, true}) {
    d_work = DeviceBuffer(std::max<size_t>(kda::kda_chunked_workspace_bytes(args()), 16));
  }

  // Cuts sequences into segments of n tokens (0: never, kKdaAutoSegments: the op's choice),
  // with a workspace sized for it.
  void set_segment_tokens(int64_t n) {
    segment_tokens = n;
    d_work = DeviceBuffer(std::max<size_t>(kda::kda_chunked_workspace_bytes(args()), 16));
  }

  // Poisons o and the workspace, restores the starting pool, launches, waits.
  void run_chunked(kda::Stream stream = nullptr) {
    reset();
    kda::kda_chunked(args(), d_work.get(), d_work.bytes(), stream);
    kda::test::device_synchronize();
  }
  void run_simple() {
    reset();
    kda::kda_recurrence_token(args(), nullptr);
    kda::test::device_synchronize();
  }
  void reset() {
    d_o.fill_bytes(0xFF);
    d_work.fill_bytes(0xFF);
    upload_pool(pool0);
  }
};

// The token-by-token kernel is itself within bf16 rounding of the reference, so the two GPU
// results must agree to the chunked kernel's tolerances as well.
Worst check_simple(const Problem& pr, const Problem::Result& got, const Problem::Result& simple,
                   const std::vector<int64_t>& checkpoint_lines = {}) {
  return check_against(
      pr, got,
      [&](int64_t r, int64_t c) { return kda::ref::bf16_value(simple.o[static_cast<size_t>(r * pr.o_stride + c)]); },
      simple.pool, 1e-2, 5e-3, checkpoint_lines);
}

std::string describe(const char* what, int64_t heads, const std::optional<double>& bound,
                     const PoolLayout& layout, const Worst& ref, const Worst& simple) {
  std::ostringstream os;
  os << what << ", H " << heads << (bound ? ", lower bound, " : ", softplus, ")
     << layout.name << ": worst relative error vs float64 o " << ref.o << ", state " << ref.state
     << "; vs kda_recurrence_token o " << simple.o << ", state " << simple.state;
  return os.str();
}

// One launch of kda_chunked (or kda_recurrence_token) on `meta`, from `pool`, with o and the
// workspace poisoned.
Problem::Result run_on(Problem& pr, const DeviceMeta& meta, const std::vector<float>& pool, bool chunked) {
  pr.d_o.fill_bytes(0xFF);
  pr.d_work.fill_bytes(0xFF);
  pr.upload_pool(pool);
  const kda::RecurrenceArgs a = meta.apply(pr.args());
  if (chunked) kda::kda_chunked(a, pr.d_work.get(), pr.d_work.bytes(), nullptr);
  else kda::kda_recurrence_token(a, nullptr);
  kda::test::device_synchronize();
  return pr.result();
}

double state_rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  return rel_frobenius(std::vector<double>(got.begin(), got.end()), std::vector<double>(want.begin(), want.end()));
}

// Differing bits of o rows [r0, r1) (P columns) between two results.
int64_t o_diff_bits(const Problem& pr, const Problem::Result& a, const Problem::Result& b, int64_t r0, int64_t r1) {
  int64_t bits = 0;
  for (int64_t r = r0; r < r1; ++r)
    bits += kda::test::diff_bits(a.o.data() + r * pr.o_stride, b.o.data() + r * pr.o_stride, pr.part * 2);
  return bits;
}

// Pool lines that no sequence of `batch` names (not the null line), in order.
std::vector<int32_t> unnamed_lines(const Batch& batch) {
  std::vector<int32_t> out;
  for (int32_t l = 0; l < batch.cache_lines; ++l)
    if (l != batch.null_line && std::find(batch.lines.begin(), batch.lines.end(), l) == batch.lines.end())
      out.push_back(l);
  return out;
}

// One sequence's checkpoints: ends first, first + interval, ... (count of them).
struct CheckpointSpec {
  int32_t seq, first, interval, count;
};

// The tables of `specs` as the module stages them (common/state_checkpoints.h), lines taken
// from `free_lines` in turn, `spare` unused entries (line -1) at the end.
void stage_checkpoints(const std::vector<CheckpointSpec>& specs, int64_t max_seqs, std::vector<int32_t>& free_lines,
                       int spare, std::vector<kda::CheckpointSeq>& seqs, std::vector<kda::CheckpointEntry>& entries) {
  seqs.assign(static_cast<size_t>(max_seqs), kda::CheckpointSeq{});
  entries.clear();
  for (const CheckpointSpec& c : specs) {
    seqs[static_cast<size_t>(c.seq)] = {c.first, c.interval, c.count, static_cast<int32_t>(entries.size())};
    for (int32_t j = 0; j < c.count; ++j) {
      REQUIRE(!free_lines.empty());
      entries.push_back({free_lines.front(), c.seq, c.first + j * c.interval, 0});
      free_lines.erase(free_lines.begin());
    }
  }
  for (int j = 0; j < spare; ++j) entries.push_back(kda::CheckpointEntry{});
}

// The lines of the processed sequences of `batch`.
std::vector<int64_t> processed_lines(const Batch& batch) {
  std::vector<int64_t> out;
  for (int64_t s : batch.processed) out.push_back(batch.lines[static_cast<size_t>(s)]);
  return out;
}

// Both kernels on pr's batch: kda_chunked against the float64 reference and against
// kda_recurrence_token (printed as `what`), then kda_chunked again from the same starting pool,
// which must repeat bit for bit (blocks of a launch may run in another order).
void check_chunked_repeats(Problem& pr, const std::string& what) {
  pr.run_simple();
  const Problem::Result simple = pr.result();
  const Problem::Reference ref = pr.reference();
  pr.run_chunked();
  const Problem::Result got = pr.result();
  const Worst vs_ref = check_reference(pr, got, ref);
  const Worst vs_simple = check_simple(pr, got, simple);
  MESSAGE(describe(what.c_str(), pr.heads, pr.lower_bound, pr.layout, vs_ref, vs_simple));
  pr.run_chunked();
  const Problem::Result again = pr.result();
  CHECK(kda::test::diff_bits(got.o.data(), again.o.data(), got.o.size() * 2) == 0);
  CHECK(kda::test::diff_bits(got.pool.data(), again.pool.data(), got.pool.size() * 4) == 0);
}

}  // namespace

TEST_CASE("kda_chunked matches the float64 reference and the token-by-token kernel on varlen batches") {
  const std::vector<int32_t> lengths = quick_mode() ? std::vector<int32_t>{1, 16, 17, 65}
                                                    : std::vector<int32_t>{1, 15, 16, 17, 63, 64, 65, 1000};
  const std::vector<int64_t> head_counts = quick_mode() ? std::vector<int64_t>{2} : std::vector<int64_t>{2, 12};
  for (int64_t heads : head_counts) {
    for (std::optional<double> bound : {std::optional<double>{}, std::optional<double>{-5.0}}) {
      for (bool transposed : {false, true}) {
        const PoolLayout layout = transposed ? transposed_with_gaps(heads) : contiguous(heads);
        CAPTURE(heads);
        CAPTURE(bound.has_value());
        CAPTURE(layout.name);
        std::mt19937_64 rng(2000 + heads * 10 + bound.has_value() * 2 + transposed);
        Batch batch(varlen(lengths, /*flip=*/transposed), /*padding=*/3,
                    /*pool_lines=*/static_cast<int64_t>(lengths.size()) + 6, rng);
        Problem pr(heads, bound, layout, batch, rng, /*padded=*/transposed, /*centred_keys=*/transposed);
        check_chunked_repeats(pr, "varlen");
      }
    }
  }
}

TEST_CASE("kda_chunked with sequences cut into segments matches the float64 reference") {
  // Segments of 64 .. 512 tokens: a 1000-token sequence has up to 16 (pass 1: its first
  // segment, the summaries and transitions of segments 1 .. 14; 14 scan steps; pass 3: the
  // other 15), shorter ones one or two; initial states on every other sequence, the skipped,
  // empty and out-of-pool sequences of varlen().
  const std::vector<int32_t> lengths = quick_mode() ? std::vector<int32_t>{1000, 65, 300}
                                                    : std::vector<int32_t>{1000, 1, 65, 300, 4000, 17, 640};
  const std::vector<int64_t> segments = quick_mode() ? std::vector<int64_t>{128} : std::vector<int64_t>{64, 128, 512};
  for (int64_t seg : segments) {
    for (bool transposed : {false, true}) {
      const int64_t heads = 2;
      const PoolLayout layout = transposed ? transposed_with_gaps(heads) : contiguous(heads);
      CAPTURE(seg);
      CAPTURE(layout.name);
      std::mt19937_64 rng(2500 + seg + transposed);
      Batch batch(varlen(lengths, transposed), /*padding=*/2, static_cast<int64_t>(lengths.size()) + 6, rng);
      Problem pr(heads, transposed ? std::optional<double>(-5.0) : std::nullopt, layout, batch, rng,
                 /*padded=*/transposed, /*centred_keys=*/!transposed);
      pr.set_segment_tokens(seg);
      check_chunked_repeats(pr, "segments of " + std::to_string(seg));
    }
  }
}

TEST_CASE("kda_chunked segments under weak decay: every segment's start comes from the scan") {
  // Weak decay and small beta (per-token decays above exp(-0.011), beta about 0.05): a segment's
  // transition P keeps most of the state, so a segment walked from a wrong start (a skipped or
  // wrong scan, a summary from the wrong records) stays far outside the tolerances to its end.
  // Under the gates of the test above such an error fades within a segment.
  const std::vector<int32_t> lengths = quick_mode() ? std::vector<int32_t>{1000, 65, 300}
                                                    : std::vector<int32_t>{1000, 1, 65, 300, 4000, 17};
  const std::vector<int64_t> segments = quick_mode() ? std::vector<int64_t>{128} : std::vector<int64_t>{64, 512};
  for (int64_t seg : segments) {
    CAPTURE(seg);
    const int64_t heads = 2;
    std::mt19937_64 rng(2700 + seg);
    Batch batch(varlen(lengths, false), /*padding=*/2, static_cast<int64_t>(lengths.size()) + 6, rng);
    Problem pr(heads, std::nullopt, contiguous(heads), batch, rng, /*padded=*/false, /*centred_keys=*/true);
    for (float& x : pr.dt_bias) x = -7.0f;
    for (int64_t r = 0; r < pr.bucket; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        uint16_t& beta = pr.b[static_cast<size_t>(r * pr.b_stride + pr.b_offset + h)];
        if (beta != kPoison16) beta = kda::host::float_to_bf16(-3.0f);
      }
    pr.d_dt_bias = kda::test::to_device(pr.dt_bias);
    pr.d_b = kda::test::to_device(pr.b);
    pr.set_segment_tokens(seg);
    check_chunked_repeats(pr, "weak decay, segments of " + std::to_string(seg));
  }
}

TEST_CASE("both kernels on bf16 state pools: the fp32 state, widened from and rounded to the pool lines") {
  // The kernels carry the state in fp32 and touch a bf16 pool only to load a line (widened,
  // exactly) and to store one (rounded to nearest even). So, against the float64 reference
  // started from the widened initial lines, o and the final lines stay within the fp32 pools'
  // tolerances (the store adds at most 2^-8 relative per element); and the same launch on an
  // fp32 pool holding those widened lines computes the same registers: o bit for bit, and
  // every bf16 line written is the fp32 run's line rounded. Both layouts, both gates.
  const std::vector<int32_t> lengths = {1, 16, 17, 65, 130};
  const int64_t heads = 2;
  for (bool transposed : {false, true}) {
    const PoolLayout layout = transposed ? transposed_with_gaps(heads) : contiguous(heads);
    const std::optional<double> bound = transposed ? std::optional<double>{-5.0} : std::nullopt;
    CAPTURE(layout.name);
    std::mt19937_64 rng(2500 + transposed);
    Batch batch(varlen(lengths, /*flip=*/transposed), /*padding=*/3,
                /*pool_lines=*/static_cast<int64_t>(lengths.size()) + 6, rng);
    Problem pr(heads, bound, layout, batch, rng, /*padded=*/transposed, /*centred_keys=*/transposed);
    pr.use_bf16_pool();
    const Problem::Reference ref = pr.reference();
    pr.run_simple();
    const Problem::Result simple = pr.result();
    pr.run_chunked();
    const Problem::Result got = pr.result();
    const Worst vs_ref = check_reference(pr, got, ref);
    const Worst simple_vs_ref = check_reference(pr, simple, ref);
    const Worst vs_simple = check_simple(pr, got, simple);
    MESSAGE(describe("bf16 pool", heads, bound, layout, vs_ref, vs_simple), "; kda_recurrence_token vs float64 o ",
            simple_vs_ref.o, ", state ", simple_vs_ref.state);

    pr.set_pool_dtype(kda::DType::FP32);  // pool0: the same widened lines
    pr.run_chunked();
    const Problem::Result got32 = pr.result();
    pr.run_simple();
    const Problem::Result simple32 = pr.result();
    const std::vector<int64_t> lines = processed_lines(batch);
    const int64_t o_bits = kda::test::diff_bits(got.o.data(), got32.o.data(), got.o.size() * 2) +
                           kda::test::diff_bits(simple.o.data(), simple32.o.data(), simple.o.size() * 2);
    const int64_t off = rounding_mismatches(pr, got.pool, got32.pool, lines) +
                        rounding_mismatches(pr, simple.pool, simple32.pool, lines);
    MESSAGE("against the runs on the widened fp32 pool: ", o_bits, " o bits differ, ", off,
            " bf16 state elements are not their states rounded");
    CHECK(o_bits == 0);
    CHECK(off == 0);
  }
}

TEST_CASE("bf16 state checkpoints are bitwise the final lines of runs cut there") {
  // A checkpoint line and the final line of a run cut at its offset are the same fp32
  // registers rounded the same way, in either kernel. Sequence 0 from an initial state with
  // checkpoints at 64 and 128; 1 on the null line; 2 from zeros at 64 and at 192, its last row
  // and a chunk end; 3 empty; 4 from an initial state at its last row, inside a chunk.
  // Checkpoint lines start poisoned, as every line but the initial ones.
  const std::vector<Seq> seqs = {{140, Kind::Live, true}, {20, Kind::NullLine, true}, {192, Kind::Live, false},
                                 {0, Kind::Live, true},   {65, Kind::Live, true}};
  const std::vector<CheckpointSpec> specs = {{0, 64, 64, 2}, {2, 64, 128, 2}, {4, 65, 0, 1}};
  const int64_t heads = 2;
  for (bool transposed : {false, true}) {
    const PoolLayout layout = transposed ? transposed_with_gaps(heads) : contiguous(heads);
    CAPTURE(layout.name);
    std::mt19937_64 rng(4500 + transposed);
    Batch batch(seqs, /*padding=*/2, /*pool_lines=*/static_cast<int64_t>(seqs.size()) + 10, rng);
    Problem pr(heads, std::nullopt, layout, batch, rng, /*padded=*/transposed, /*centred_keys=*/transposed);
    pr.use_bf16_pool();
    std::vector<int32_t> free_lines = unnamed_lines(batch);
    std::shuffle(free_lines.begin(), free_lines.end(), rng);
    std::vector<kda::CheckpointSeq> ck_seqs;
    std::vector<kda::CheckpointEntry> ck_entries;
    stage_checkpoints(specs, batch.max_seqs, free_lines, /*spare=*/2, ck_seqs, ck_entries);
    std::vector<int64_t> ck_lines;
    for (const kda::CheckpointEntry& e : ck_entries)
      if (e.line >= 0) ck_lines.push_back(e.line);
    const Problem::Reference ref = pr.reference();
    const DeviceMeta with_checkpoints(batch.qsl, batch.lines, batch.initial.get(), ck_seqs, ck_entries);
    for (bool chunked : {true, false}) {
      CAPTURE(chunked);
      const Problem::Result got = run_on(pr, with_checkpoints, pr.pool0, chunked);
      check_reference(pr, got, ref, ck_lines);
      int64_t worst_bits = 0;
      double worst_ref = 0;
      for (const kda::CheckpointEntry& e : ck_entries) {
        if (e.line < 0) continue;
        const size_t s = static_cast<size_t>(e.seq);
        const int64_t rows = batch.qsl[s + 1] - batch.qsl[s], line = batch.lines[s];
        CAPTURE(e.seq);
        CAPTURE(e.end);
        const std::vector<float> ck = line_states(pr, got.pool, e.line);
        const kda::ref::TruncatedBatch cut = kda::ref::truncated_batch(batch.host(), e.seq, e.end);
        const std::vector<float> want = e.end == rows
                                            ? line_states(pr, got.pool, line)
                                            : line_states(pr, run_on(pr, DeviceMeta(cut), pr.pool0, chunked).pool, line);
        const int64_t bits = state_diff_bits(ck, want);
        const double ref_err = state_rel_error(ck, line_states(pr, pr.reference(cut.batch).pool, line));
        CHECK(bits == 0);
        CHECK(ref_err <= 5e-3);
        worst_bits = std::max(worst_bits, bits);
        worst_ref = std::max(worst_ref, ref_err);
      }
      MESSAGE(std::string(chunked ? "kda_chunked" : "kda_recurrence_token"), ", ", std::string(layout.name), ", ",
              ck_lines.size(),
              " bf16 checkpoints: at most ", worst_bits, " bits differ from the cut runs' final lines; worst relative "
              "error vs float64 ", worst_ref);
    }
  }
}

TEST_CASE("kda_chunked stays accurate over long sequences and many short ones") {
  // One sequence of 16384 tokens and sixteen of 1024 (the benchmark's shapes), one of 65536 and
  // 300 of 37, few heads so that the float64 reference stays fast; the op picks its segments
  // (on 132 SMs it cuts the long single sequences). Quick mode: one sequence of 4096.
  struct Case {
    std::vector<int32_t> lengths;
    int64_t heads;
    std::optional<double> bound;
  };
  std::vector<Case> cases;
  if (quick_mode()) {
    cases.push_back({{4096}, 1, std::nullopt});
  } else {
    cases.push_back({{16384}, 2, std::nullopt});
    cases.push_back({std::vector<int32_t>(16, 1024), 1, -5.0});
    cases.push_back({{65536}, 1, std::nullopt});
    cases.push_back({std::vector<int32_t>(300, 37), 1, -5.0});
  }
  for (const Case& cs : cases) {
    CAPTURE(cs.lengths.size());
    std::mt19937_64 rng(3000 + cs.lengths.size());
    std::vector<Seq> seqs;
    for (size_t i = 0; i < cs.lengths.size(); ++i) seqs.push_back({cs.lengths[i], Kind::Live, i % 2 == 0});
    Batch batch(seqs, /*padding=*/1, static_cast<int64_t>(seqs.size()) + 3, rng);
    Problem pr(cs.heads, cs.bound, contiguous(cs.heads), batch, rng, false, /*centred_keys=*/false);
    pr.run_simple();
    const Problem::Result simple = pr.result();
    const Problem::Reference ref = pr.reference();
    pr.run_chunked();
    const Problem::Result got = pr.result();
    const Worst vs_ref = check_reference(pr, got, ref);
    const Worst vs_simple = check_simple(pr, got, simple);
    const int64_t seg = kda::kda_chunked_auto_segment_tokens(pr.bucket, cs.heads);
    const std::string name = std::to_string(cs.lengths.size()) + " x " + std::to_string(cs.lengths[0]) +
                             (seg > 0 && seg < cs.lengths[0] ? ", cut into segments of " + std::to_string(seg)
                                                             : ", whole");
    MESSAGE(describe(name.c_str(), cs.heads, cs.bound, contiguous(cs.heads), vs_ref, vs_simple));
  }
}

TEST_CASE("a captured kda_chunked replays with new batch metadata") {
  std::mt19937_64 rng(91);
  const int64_t heads = 2;
  // Two batches of the same capacity (7 sequences, 200 + 29 rows); the graph is recorded
  // holding the first batch's metadata and replayed with the second's.
  Batch first({{150, Kind::Live, false}, {50, Kind::Live, true}}, 5, 12, rng);
  Batch second({{5, Kind::Live, true}, {0, Kind::Live, true}, {70, Kind::NullLine, true},
                {64, Kind::Live, false}, {61, Kind::Live, true}},
               2, 12, rng);
  REQUIRE(first.max_seqs == second.max_seqs);
  REQUIRE(first.tokens == second.tokens);
  Problem pr(heads, std::nullopt, contiguous(heads), second, rng, false, true);
  pr.run_chunked();  // eager first launch (also the warm-up)
  const Problem::Result direct = pr.result();

  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  second.d_qsl.upload(first.qsl);
  second.d_lines.upload(first.lines);
  second.d_initial.upload(first.initial.get(), static_cast<size_t>(first.max_seqs));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
  kda::kda_chunked(pr.args(), pr.d_work.get(), pr.d_work.bytes(), stream);
  REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  pr.reset();
  REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);

  second.d_qsl.upload(second.qsl);
  second.d_lines.upload(second.lines);
  second.d_initial.upload(second.initial.get(), static_cast<size_t>(second.max_seqs));
  pr.reset();
  REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  const Problem::Result replayed = pr.result();
  CHECK(kda::test::diff_bits(direct.o.data(), replayed.o.data(), direct.o.size() * 2) == 0);
  CHECK(kda::test::diff_bits(direct.pool.data(), replayed.pool.data(), direct.pool.size() * 4) == 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST_CASE("kda_chunked with bad arguments or workspace throws and enqueues nothing") {
  std::mt19937_64 rng(8);
  Batch batch({{9, Kind::Live, true}, {70, Kind::Live, false}}, 0, 4, rng);
  Problem pr(2, std::nullopt, contiguous(2), batch, rng, false, true);
  pr.reset();
  kda::RecurrenceArgs a = pr.args();
  void* work = pr.d_work.get();
  size_t bytes = pr.d_work.bytes();
  std::string expected;
  SUBCASE("misaligned q") {
    a.q = static_cast<const char*>(a.q) + 2;
    expected = "aligned";
  }
  SUBCASE("head_dim 64") {
    a.head_dim = 64;
    expected = "head_dim";
  }
  SUBCASE("workspace one byte short") {
    bytes = kda::kda_chunked_workspace_bytes(a) - 1;
    expected = "workspace";
  }
  SUBCASE("no workspace") {
    work = nullptr;
    expected = "workspace";
  }
  SUBCASE("misaligned workspace") {
    work = static_cast<char*>(work) + 8;
    expected = "16-byte aligned";
  }
  CHECK_THROWS_WITH_AS(kda::kda_chunked(a, work, bytes, nullptr, kda::KdaChunkedPhases::Both),
                       doctest::Contains(expected.c_str()), kda::Error);
  kda::test::device_synchronize();
  const Problem::Result after = pr.result();
  CHECK(std::count(after.o.begin(), after.o.end(), kPoison16) == static_cast<std::ptrdiff_t>(after.o.size()));
  CHECK(kda::test::diff_bits(after.pool.data(), pr.pool0.data(), after.pool.size() * 4) == 0);
}

TEST_CASE("kda_chunked state checkpoints are bitwise the states of runs cut there and continue bitwise") {
  // Sequence 0 from an initial state with checkpoints every 64 rows; 1 on the null line; 2
  // from zeros every 128 rows up to its last row; 3 empty; 4 one checkpoint at its last row,
  // inside a chunk; 5 outside the pool; 6 none; 7 one checkpoint 8 rows before its end.
  const bool quick = quick_mode();
  const int32_t len0 = quick ? 140 : 300, len2 = quick ? 384 : 1024;
  const std::vector<Seq> seqs = {{len0, Kind::Live, true}, {20, Kind::NullLine, true}, {len2, Kind::Live, false},
                                 {0, Kind::Live, true},    {130, Kind::Live, false},   {9, Kind::OutsidePool, true},
                                 {65, Kind::Live, true},   {200, Kind::Live, true}};
  const std::vector<CheckpointSpec> specs = {
      {0, 64, 64, len0 / 64}, {2, 128, 128, len2 / 128}, {4, 130, 0, 1}, {7, 192, 0, 1}};
  // segment_tokens: 0 keeps sequences whole (continuations are bitwise then); 128 cuts them
  // into segments (sequence parallelism): a checkpoint is still bitwise the line of a run cut
  // there with the same segment length (both runs have the same segments up to it), but a
  // continuation is cut differently, so the continuation part runs uncut only.
  struct Config {
    int64_t heads;
    std::optional<double> bound;
    bool transposed;
    int64_t segment_tokens;
  };
  std::vector<Config> configs = {{2, std::nullopt, false, 0}, {2, std::nullopt, false, 128}};
  if (!quick) configs.push_back({12, -5.0, true, 0});
  for (const Config& cfg : configs) {
    const PoolLayout layout = cfg.transposed ? transposed_with_gaps(cfg.heads) : contiguous(cfg.heads);
    CAPTURE(cfg.heads);
    CAPTURE(layout.name);
    CAPTURE(cfg.segment_tokens);
    std::mt19937_64 rng(4000 + cfg.heads);
    Batch batch(seqs, /*padding=*/2, /*pool_lines=*/static_cast<int64_t>(seqs.size()) + 24, rng);
    Problem pr(cfg.heads, cfg.bound, layout, batch, rng, /*padded=*/cfg.transposed, /*centred_keys=*/cfg.transposed);
    pr.set_segment_tokens(cfg.segment_tokens);
    std::vector<int32_t> free_lines = unnamed_lines(batch);
    std::shuffle(free_lines.begin(), free_lines.end(), rng);
    std::vector<kda::CheckpointSeq> ck_seqs;
    std::vector<kda::CheckpointEntry> ck_entries;
    stage_checkpoints(specs, batch.max_seqs, free_lines, /*spare=*/5, ck_seqs, ck_entries);
    std::vector<int64_t> ck_lines;
    for (const kda::CheckpointEntry& e : ck_entries)
      if (e.line >= 0) ck_lines.push_back(e.line);
    // Checkpoint lines start as NaN: an element left unwritten shows.
    for (int64_t line : ck_lines)
      for (int64_t h = 0; h < pr.heads; ++h)
        for (int64_t i = 0; i < kD; ++i)
          for (int64_t j = 0; j < kD; ++j)
            pr.pool0[static_cast<size_t>(line * layout.line + h * layout.head + i * layout.k + j * layout.v)] =
                std::numeric_limits<float>::quiet_NaN();

    const DeviceMeta with_checkpoints(batch.qsl, batch.lines, batch.initial.get(), ck_seqs, ck_entries);
    const Problem::Result got = run_on(pr, with_checkpoints, pr.pool0, /*chunked=*/true);
    const Problem::Result simple = run_on(pr, with_checkpoints, pr.pool0, /*chunked=*/false);
    // The op is unchanged by its checkpoints; nothing outside the processed and the checkpoint
    // lines is written (by either kernel).
    const Worst vs_ref = check_reference(pr, got, pr.reference(), ck_lines);
    const Worst vs_simple = check_simple(pr, got, simple, ck_lines);
    MESSAGE(describe("with checkpoints", cfg.heads, cfg.bound, layout, vs_ref, vs_simple));

    // Each checkpoint: bitwise the final state of kda_chunked on the batch cut there (of the
    // same run when it sits at the last row), within the chunked tolerance of the float64
    // reference on the cut batch and of kda_recurrence_token's checkpoint.
    int64_t worst_bits = 0;
    double worst_ref = 0, worst_simple = 0;
    for (const kda::CheckpointEntry& e : ck_entries) {
      if (e.line < 0) continue;
      const size_t s = static_cast<size_t>(e.seq);
      const int64_t rows = batch.qsl[s + 1] - batch.qsl[s], line = batch.lines[s];
      CAPTURE(e.seq);
      CAPTURE(e.end);
      const std::vector<float> ck = line_states(pr, got.pool, e.line);
      const kda::ref::TruncatedBatch cut = kda::ref::truncated_batch(batch.host(), e.seq, e.end);
      std::vector<float> want;
      if (e.end == rows) {
        want = line_states(pr, got.pool, line);
      } else {
        want = line_states(pr, run_on(pr, DeviceMeta(cut), pr.pool0, /*chunked=*/true).pool, line);
      }
      const int64_t bits = state_diff_bits(ck, want);
      const double ref_err = state_rel_error(ck, line_states(pr, pr.reference(cut.batch).pool, line));
      const double simple_err = state_rel_error(ck, line_states(pr, simple.pool, e.line));
      CHECK(bits == 0);
      CHECK(ref_err <= 5e-3);
      CHECK(simple_err <= 5e-3);
      worst_bits = std::max(worst_bits, bits);
      worst_ref = std::max(worst_ref, ref_err);
      worst_simple = std::max(worst_simple, simple_err);
    }
    MESSAGE(ck_lines.size(), " checkpoints (segment_tokens ", cfg.segment_tokens, "): at most ", worst_bits,
            " bits differ from the cut runs' final states; worst relative error vs float64 ", worst_ref,
            ", vs kda_recurrence_token's checkpoints ", worst_simple);
    if (cfg.segment_tokens != 0) continue;

    // Continuing from checkpoints: sequence 0 after 128 rows, 2 after 256 (with checkpoints of
    // its own every 256 rows of the tail from 128) and 7 after 192, each over its remaining rows
    // from the checkpoint line (has_initial_state). The tail is cut into the same 64-token chunks
    // as the uninterrupted run (checkpoints sit on chunk ends, chunks start at a sequence's first
    // row), a chunk's phase-1 record depends on its tokens alone, and the state the tail starts
    // from is the fp32 state the uninterrupted run carried into that chunk, stored and loaded
    // without rounding: o rows, final states and the tail's checkpoints repeat bit for bit.
    struct Continue {
      int32_t seq, from;
    };
    const std::vector<Continue> cont = {{0, 128}, {2, 256}, {7, 192}};
    auto checkpoint_line = [&](int32_t seq, int32_t end) {
      for (const kda::CheckpointEntry& e : ck_entries)
        if (e.line >= 0 && e.seq == seq && e.end == end) return e.line;
      FAIL("no checkpoint of sequence " << seq << " at " << end);
      return int32_t{-1};
    };
    // Entries: rows before each tail unowned (null line), then the tail; padded to max_seqs.
    std::vector<int32_t> tqsl = {0}, tlines;
    std::unique_ptr<bool[]> tinit(new bool[static_cast<size_t>(batch.max_seqs)]);
    std::vector<std::pair<int64_t, int64_t>> tail_rows;  // [r0, r1) per continued sequence
    for (const Continue& c : cont) {
      const int32_t r0 = batch.qsl[static_cast<size_t>(c.seq)] + c.from, r1 = batch.qsl[static_cast<size_t>(c.seq) + 1];
      tinit[tlines.size()] = false;
      tlines.push_back(batch.null_line);
      tqsl.push_back(r0);
      tinit[tlines.size()] = true;
      tlines.push_back(checkpoint_line(c.seq, c.from));
      tqsl.push_back(r1);
      tail_rows.emplace_back(r0, r1);
    }
    const int32_t tail2 = 3;  // the entry of sequence 2's tail
    REQUIRE(static_cast<int64_t>(tlines.size()) <= batch.max_seqs);
    while (static_cast<int64_t>(tlines.size()) < batch.max_seqs) {
      tinit[tlines.size()] = false;
      tlines.push_back(batch.null_line);
      tqsl.push_back(tqsl.back());
    }
    std::vector<kda::CheckpointSeq> tseqs;
    std::vector<kda::CheckpointEntry> tentries;
    const int32_t tail2_rows = len2 - 256;
    stage_checkpoints({{tail2, 128, 256, (tail2_rows - 128) / 256 + 1}}, batch.max_seqs, free_lines, 1, tseqs,
                      tentries);
    const Problem::Result tail =
        run_on(pr, DeviceMeta(tqsl, tlines, tinit.get(), tseqs, tentries), got.pool, /*chunked=*/true);
    int64_t o_bits = 0, state_bits = 0, ck_bits = 0;
    for (size_t i = 0; i < cont.size(); ++i) {
      o_bits += o_diff_bits(pr, tail, got, tail_rows[i].first, tail_rows[i].second);
      state_bits += state_diff_bits(line_states(pr, tail.pool, checkpoint_line(cont[i].seq, cont[i].from)),
                                    line_states(pr, got.pool, batch.lines[static_cast<size_t>(cont[i].seq)]));
    }
    for (const kda::CheckpointEntry& e : tentries)
      if (e.line >= 0)
        ck_bits += state_diff_bits(line_states(pr, tail.pool, e.line),
                                   line_states(pr, got.pool, checkpoint_line(2, 256 + e.end)));
    MESSAGE("continued from checkpoints: ", o_bits, " o bits, ", state_bits, " final-state bits and ", ck_bits,
            " checkpoint bits differ from the uninterrupted run");
    CHECK(o_bits == 0);
    CHECK(state_bits == 0);
    CHECK(ck_bits == 0);
    // Nothing else changes: o rows outside the tails stay poisoned, pool elements outside the
    // tails' lines and the tail's checkpoint lines keep the uninterrupted run's values.
    std::vector<char> row_written(static_cast<size_t>(pr.bucket), 0);
    for (const auto& [r0, r1] : tail_rows)
      for (int64_t r = r0; r < r1; ++r) row_written[static_cast<size_t>(r)] = 1;
    int64_t o_changed = 0;
    for (int64_t r = 0; r < pr.bucket; ++r)
      for (int64_t c = 0; c < pr.o_stride; ++c)
        if ((!row_written[static_cast<size_t>(r)] || c >= pr.part) &&
            tail.o[static_cast<size_t>(r * pr.o_stride + c)] != kPoison16)
          ++o_changed;
    std::vector<char> state_written(tail.pool.size(), 0);
    std::vector<int64_t> tail_lines;
    for (const Continue& c : cont) tail_lines.push_back(checkpoint_line(c.seq, c.from));
    for (const kda::CheckpointEntry& e : tentries)
      if (e.line >= 0) tail_lines.push_back(e.line);
    for (int64_t line : tail_lines)
      for (int64_t h = 0; h < pr.heads; ++h)
        for (int64_t i = 0; i < kD; ++i)
          for (int64_t j = 0; j < kD; ++j)
            state_written[static_cast<size_t>(line * layout.line + h * layout.head + i * layout.k + j * layout.v)] = 1;
    int64_t pool_changed = 0;
    for (size_t i = 0; i < tail.pool.size(); ++i)
      if (!state_written[i] && std::memcmp(&tail.pool[i], &got.pool[i], sizeof(float)) != 0) ++pool_changed;
    CHECK(o_changed == 0);
    CHECK(pool_changed == 0);
  }
}
