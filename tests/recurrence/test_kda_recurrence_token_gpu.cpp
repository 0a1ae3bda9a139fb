// kda_recurrence_token on the GPU against the float64 reference (kda::ref::prep_recurrence), fed
// the same bf16 inputs; the batch, inputs and checks are support/recurrence_gpu_fixture.h's,
// shared with the chunked kernel's test. KDA_TEST_QUICK=1 runs a reduced set (for
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

#include "kda/error.h"
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

template <typename T>
std::vector<T> download(const DeviceBuffer& b) {
  return b.download_as<T>();
}

// Host batch metadata padded to max_seqs entries as the module pads it (query_start_loc
// repeated, cache index null_line), and the same on the device; outside-pool lines
// cache_lines + 3 and -2.
struct TestBatch : VarlenBatch {
  TestBatch(const std::vector<SeqSpec>& seqs, int64_t padding, int64_t pool_lines, int32_t null,
            std::mt19937_64& rng)
      : VarlenBatch(seqs, padding, pool_lines, null, rng, {3, -2}) {}
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

PoolLayout contiguous_layout(int64_t heads) {
  return {"(line, head, k, v) contiguous", heads * kD * kD, kD * kD, kD, 1};
}
// (line, head, v, k) with gaps between heads and lines: a layout with holes that must stay put.
PoolLayout transposed_layout(int64_t heads) {
  const int64_t head = kD * kD + 32;
  return {"(line, head, v, k) with gaps", heads * head + 100, head, 1, kD};
}

// Everything one kda_recurrence_token launch reads and writes (RecurrenceInputs): a bucket of
// the batch's tokens + 37 rows, q and k ~ U(-0.3, 1.2).
struct RecurrenceProblem : RecurrenceInputs {
  RecurrenceProblem(int64_t h, std::optional<double> bound, PoolLayout pool_layout, TestBatch& tb,
                    std::mt19937_64& rng, bool padded_strides)
      : RecurrenceInputs(h, bound, pool_layout, tb, rng, {37, padded_strides, -0.3, 1.2, false}) {}

  // Poisons o, restores the starting pool, launches, waits.
  void run(kda::Stream stream = nullptr) {
    d_o.fill_bytes(0xFF);
    upload_pool(pool0);
    kda::kda_recurrence_token(args(), stream);
    kda::test::device_synchronize();
  }
};

using WorstErrors = Worst;
using RunResult = RecurrenceInputs::Result;

// One kda_recurrence_token launch on `meta` from `pool`, o poisoned.
RunResult run_on(RecurrenceProblem& pr, const DeviceMeta& meta, const std::vector<float>& pool) {
  pr.d_o.fill_bytes(0xFF);
  pr.upload_pool(pool);
  kda::kda_recurrence_token(meta.apply(pr.args()), nullptr);
  kda::test::device_synchronize();
  return {download<uint16_t>(pr.d_o), pr.download_pool()};
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
        const WorstErrors worst = check_reference(pr, {o1, pool1}, pr.reference());
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
    const WorstErrors worst = check_reference(pr, {o, pool}, pr.reference());
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
  const WorstErrors worst = check_reference(pr, got, pr.reference(), ck_lines);
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
