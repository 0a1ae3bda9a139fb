// GPU tests of state checkpoints through the prefill module (BatchView::checkpoint_*): every
// checkpoint line holds, bitwise, the states that a run of the sequence cut at that offset
// leaves in its own line; a sequence continued from a checkpoint line gives the uninterrupted
// run's output rows and final states bitwise; lines no one names stay untouched; graphs replay
// with new checkpoint lines without re-recording; a refused batch changes nothing.
// Both recurrences, one window and a batch split into windows. With bf16 recurrent pools the
// checkpoint lines are still bitwise the cut runs' lines (the same registers, rounded the same
// way), but a continued run starts from the rounded state, so it is compared within the layer
// tolerances instead (docs/design.md says why).
//
// Why bitwise holds (docs/design.md, "State checkpoints"): every GEMM row depends only on its
// input row; the conv state is a copy of inputs; checkpoints sit on ends of the recurrence's
// 64-token chunks, which start at the sequence's first row (in each window), so the cut run and
// the continued run see the same chunks with the same fp32 state.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/half_host.h"
#include "kda/config.h"
#include "kda/error.h"
#include "kda/prefill.h"
#include "support/gpu_buffers.h"
#include "support/host_batch.h"
#include "support/test_data.h"

namespace {

using kda::PrefillModule;
using kda::test::diff_bits;
using kda::test::HostBatch;
using kda::test::make_batch;
using kda::test::Stream;

kda::Config checkpoint_config(kda::Recurrence recurrence) {
  kda::Config c;
  c.model.hidden_size = 256;
  c.model.num_heads = 2;
  c.runtime.token_buckets = {64, 256, 1024};
  c.runtime.max_seqs = 8;
  c.runtime.max_batch_tokens = 2048;
  c.runtime.num_layers = 2;
  c.runtime.recurrence = recurrence;
  c.runtime.max_checkpoints = 16;
  c.pools.cache_lines = 48;
  c.pools.null_line = 0;
  return c;
}

// Host copies of every layer's two pools, with line access.
struct Pools {
  std::size_t conv_line = 0, rec_line = 0;  // bytes
  std::vector<std::vector<unsigned char>> conv, rec;

  static Pools of(PrefillModule& m, cudaStream_t s) {
    const kda::Config& c = m.config();
    Pools p;
    p.conv_line = static_cast<std::size_t>(c.conv_line_elems()) * kda::dtype_size(c.pools.conv_dtype);
    p.rec_line = static_cast<std::size_t>(c.recurrent_line_elems()) * kda::dtype_size(c.pools.recurrent_dtype);
    KDA_TEST_CUDA(cudaStreamSynchronize(s));
    for (int l = 0; l < c.runtime.num_layers; ++l) {
      p.conv.emplace_back(p.conv_line * static_cast<std::size_t>(c.pools.cache_lines));
      p.rec.emplace_back(p.rec_line * static_cast<std::size_t>(c.pools.cache_lines));
      KDA_TEST_CUDA(cudaMemcpy(p.conv.back().data(), m.conv_state_pool(l), p.conv.back().size(), cudaMemcpyDeviceToHost));
      KDA_TEST_CUDA(cudaMemcpy(p.rec.back().data(), m.recurrent_state_pool(l), p.rec.back().size(), cudaMemcpyDeviceToHost));
    }
    return p;
  }
  const unsigned char* conv_at(int l, int32_t line) const { return conv[l].data() + line * conv_line; }
  const unsigned char* rec_at(int l, int32_t line) const { return rec[l].data() + line * rec_line; }
  // Differing bits between line `a` here and line `b` of `o`, both pools, every layer.
  int64_t line_diff(int32_t a, const Pools& o, int32_t b) const {
    int64_t bits = 0;
    for (std::size_t l = 0; l < conv.size(); ++l) {
      bits += diff_bits(conv_at(static_cast<int>(l), a), o.conv_at(static_cast<int>(l), b), conv_line);
      bits += diff_bits(rec_at(static_cast<int>(l), a), o.rec_at(static_cast<int>(l), b), rec_line);
    }
    return bits;
  }
  // Lines outside `named` that differ from `before`.
  int64_t changed_lines(const Pools& before, const std::set<int32_t>& named) const {
    int64_t changed = 0;
    const auto lines = static_cast<int32_t>(conv[0].size() / conv_line);
    for (int32_t line = 0; line < lines; ++line)
      if (!named.count(line)) changed += line_diff(line, before, line) != 0;
    return changed;
  }
};

// Writes line `line` of every pool of `m` from line `from` of `src`.
void put_line(PrefillModule& m, int32_t line, const Pools& src, int32_t from) {
  for (int l = 0; l < static_cast<int>(src.conv.size()); ++l) {
    KDA_TEST_CUDA(cudaMemcpy(reinterpret_cast<unsigned char*>(m.conv_state_pool(l)) + line * src.conv_line,
                             src.conv_at(l, from), src.conv_line, cudaMemcpyHostToDevice));
    KDA_TEST_CUDA(cudaMemcpy(reinterpret_cast<unsigned char*>(m.recurrent_state_pool(l)) + line * src.rec_line,
                             src.rec_at(l, from), src.rec_line, cudaMemcpyHostToDevice));
  }
}

// Fills line `line` of every pool with 0xFF bytes (NaN in fp32 and bf16): a checkpoint that is
// not written shows.
void poison_line(PrefillModule& m, int32_t line) {
  const kda::Config& c = m.config();
  const std::size_t conv = static_cast<std::size_t>(c.conv_line_elems()) * kda::dtype_size(c.pools.conv_dtype);
  const std::size_t rec = static_cast<std::size_t>(c.recurrent_line_elems()) * kda::dtype_size(c.pools.recurrent_dtype);
  for (int l = 0; l < c.runtime.num_layers; ++l) {
    KDA_TEST_CUDA(cudaMemset(reinterpret_cast<unsigned char*>(m.conv_state_pool(l)) + line * conv, 0xFF, conv));
    KDA_TEST_CUDA(cudaMemset(reinterpret_cast<unsigned char*>(m.recurrent_state_pool(l)) + line * rec, 0xFF, rec));
  }
}

// Hidden rows [row0, row0 + rows) of `hidden` (bf16 bits, D per row) into rows [0, rows).
void put_hidden(PrefillModule& m, const std::vector<uint16_t>& hidden, int64_t row0, int64_t rows) {
  const int64_t D = m.config().model.hidden_size;
  KDA_TEST_CUDA(cudaMemcpy(m.hidden_states(), hidden.data() + row0 * D, static_cast<std::size_t>(rows * D) * 2,
                           cudaMemcpyHostToDevice));
}

// Relative Frobenius error of n bf16 values `got` against `ref`.
double rel_err_bf16(const uint16_t* got, const uint16_t* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = kda::host::bf16_to_float(got[i]), r = kda::host::bf16_to_float(ref[i]);
    num += (g - r) * (g - r);
    den += r * r;
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

std::vector<uint16_t> output_rows(PrefillModule& m, int64_t rows, cudaStream_t s) {
  const int64_t D = m.config().model.hidden_size;
  std::vector<uint16_t> out(static_cast<std::size_t>(rows * D));
  KDA_TEST_CUDA(cudaStreamSynchronize(s));
  KDA_TEST_CUDA(cudaMemcpy(out.data(), m.output(), out.size() * 2, cudaMemcpyDeviceToHost));
  return out;
}

struct Checkpoint {
  int64_t seq;
  int32_t offset, line;
};

std::vector<Checkpoint> checkpoints_of(const HostBatch& b) {
  std::vector<Checkpoint> out;
  for (std::size_t s = 0; s + 1 < b.ckpt_start.size(); ++s)
    for (int32_t k = b.ckpt_start[s]; k < b.ckpt_start[s + 1]; ++k)
      out.push_back({static_cast<int64_t>(s), (k - b.ckpt_start[s] + 1) * b.ckpt_interval[s], b.ckpt_lines[k]});
  return out;
}

std::set<int32_t> named_lines(const HostBatch& b, int32_t null_line) {
  std::set<int32_t> named(b.ckpt_lines.begin(), b.ckpt_lines.end());
  for (int32_t l : b.lines)
    if (l != null_line) named.insert(l);
  return named;
}

// Runs `batch` on module `a` (graphs) and checks each checkpoint against a run of its sequence
// cut at the checkpoint on module `r` (same weights), and the continuation of the sequences in
// `continue_at` (one checkpoint index each) from their checkpoint lines.
void check_checkpoints(PrefillModule& a, PrefillModule& r, const HostBatch& batch, const std::vector<uint16_t>& hidden,
                       const std::vector<std::size_t>& continue_at, cudaStream_t s) {
  const kda::Config& c = a.config();
  const int64_t D = c.model.hidden_size;
  const std::vector<Checkpoint> cps = checkpoints_of(batch);
  for (const Checkpoint& cp : cps) poison_line(a, cp.line);
  const Pools before = Pools::of(a, s);
  put_hidden(a, hidden, 0, batch.tokens());
  a.run(batch.view(), s);
  const Pools after = Pools::of(a, s);
  const std::vector<uint16_t> out = output_rows(a, batch.tokens(), s);
  CHECK(after.changed_lines(before, named_lines(batch, c.pools.null_line)) == 0);

  int64_t cut_bits = 0;
  for (const Checkpoint& cp : cps) {
    CAPTURE(cp.seq);
    CAPTURE(cp.offset);
    // The sequence cut at the checkpoint, from the same starting line state.
    const int32_t line = batch.lines[cp.seq];
    put_line(r, line, before, line);
    HostBatch cut = make_batch({cp.offset}, {line}, {batch.flags[cp.seq]});
    put_hidden(r, hidden, batch.qsl[cp.seq], cp.offset);
    r.run(cut.view(), s);
    const int64_t bits = Pools::of(r, s).line_diff(line, after, cp.line);
    cut_bits += bits;
    CHECK(bits == 0);
  }
  MESSAGE(cps.size(), " checkpoints vs runs cut at their offsets: ", cut_bits, " differing bits");

  for (std::size_t i : continue_at) {
    const Checkpoint& cp = cps[i];
    CAPTURE(cp.seq);
    CAPTURE(cp.offset);
    const int32_t rest = batch.qsl[cp.seq + 1] - batch.qsl[cp.seq] - cp.offset;
    const int32_t line = 40;  // a line the batch does not name
    put_line(r, line, after, cp.line);
    HostBatch tail = make_batch({rest}, {line}, {true});
    put_hidden(r, hidden, batch.qsl[cp.seq] + cp.offset, rest);
    r.run(tail.view(), s);
    const std::vector<uint16_t> tail_out = output_rows(r, rest, s);
    const int64_t out_bits = diff_bits(tail_out.data(), out.data() + (batch.qsl[cp.seq] + cp.offset) * D,
                                       static_cast<std::size_t>(rest * D) * 2);
    const Pools cont = Pools::of(r, s);
    const int64_t state_bits = cont.line_diff(line, after, batch.lines[cp.seq]);
    MESSAGE("sequence ", cp.seq, " continued from its checkpoint after ", cp.offset, " rows (", rest,
            " rows recomputed instead of ", cp.offset + rest, "): output ", out_bits, " and final states ",
            state_bits, " differing bits");
    if (c.pools.recurrent_dtype == kda::DType::FP32) {
      CHECK(out_bits == 0);
      CHECK(state_bits == 0);
      continue;
    }
    // bf16 recurrent lines: the continuation starts from the rounded state. The conv lines are
    // exact either way; output and recurrent states stay within the layer's tolerances.
    const double out_err = rel_err_bf16(tail_out.data(), out.data() + (batch.qsl[cp.seq] + cp.offset) * D, rest * D);
    double state_err = 0;
    int64_t conv_bits = 0;
    for (int l = 0; l < c.runtime.num_layers; ++l) {
      state_err = std::max(state_err, rel_err_bf16(reinterpret_cast<const uint16_t*>(cont.rec_at(l, line)),
                                                   reinterpret_cast<const uint16_t*>(after.rec_at(l, batch.lines[cp.seq])),
                                                   c.recurrent_line_elems()));
      conv_bits += diff_bits(cont.conv_at(l, line), after.conv_at(l, batch.lines[cp.seq]), cont.conv_line);
    }
    MESSAGE("  bf16 recurrent lines: output error ", out_err, ", final-state error ", state_err,
            " against the uninterrupted run; conv lines ", conv_bits, " differing bits");
    CHECK(out_err <= 1e-2);
    CHECK(state_err <= 5e-3);
    CHECK(conv_bits == 0);
  }
}

std::vector<uint16_t> random_hidden(int64_t rows, int64_t D, uint64_t seed) {
  std::mt19937_64 rng(seed);
  return kda::test::random_bf16(rng, static_cast<std::size_t>(rows * D), -1.0, 1.0);
}

}  // namespace

TEST_CASE("checkpoint lines hold the states of the cut runs, and continuing from them gives the same bits") {
  Stream stream;
  const cudaStream_t s = stream.get();
  for (kda::Recurrence rec : {kda::Recurrence::Chunked, kda::Recurrence::TokenByToken}) {
    CAPTURE(static_cast<int>(rec));
    const kda::Config cfg = checkpoint_config(rec);
    PrefillModule a(cfg), r(cfg);
    a.init_random_weights(21);
    r.init_random_weights(21);
    const int64_t D = cfg.model.hidden_size;

    // Line 2 holds a state from an earlier prompt, so sequence 1 continues from it.
    const std::vector<uint16_t> warm = random_hidden(77, D, 5);
    HostBatch first = make_batch({77}, {2}, {false});
    put_hidden(a, warm, 0, 77);
    a.run(first.view(), s);

    SUBCASE("one window: four sequences, one skipped, checkpoints every 128 and every 64 rows") {
      HostBatch b = make_batch({700, 130, 10, 50}, {1, 2, 0, 3}, {false, true, false, false});
      b.set_checkpoints(0, 128, {20, 21, 22, 23, 24});
      b.set_checkpoints(1, 64, {25, 26});
      const std::vector<uint16_t> hidden = random_hidden(b.tokens(), D, 6);
      check_checkpoints(a, r, b, hidden, {2, 6}, s);

      // The same batch with other checkpoint lines replays the same graphs.
      const kda::ModuleStats st = a.stats(s);
      HostBatch again = make_batch({700, 130, 10, 50}, {1, 2, 0, 3}, {false, true, false, false});
      again.set_checkpoints(0, 128, {31, 32, 33, 34, 35});
      again.set_checkpoints(1, 64, {36, 37});
      check_checkpoints(a, r, again, hidden, {}, s);
      const kda::ModuleStats st2 = a.stats(s);
      CHECK(st2.graphs.size() == st.graphs.size());
      CHECK(st2.eager_layer_runs == st.eager_layer_runs);

      // Graph replay against eager launches and the stock conv, checkpoint lines included.
      const kda::SelfCheckReport report = a.self_check(b.view(), s);
      MESSAGE(report.detail);
      CHECK(report.ok);
    }
    SUBCASE("a sequence split across windows at row 1024 has checkpoints in both") {
      HostBatch b = make_batch({1800, 100}, {1, 3}, {false, false});
      b.set_checkpoints(0, 256, {20, 21, 22, 23, 24, 25, 26});  // 1024 ends window 0
      b.set_checkpoints(1, 64, {27});
      const std::vector<uint16_t> hidden = random_hidden(b.tokens(), D, 7);
      check_checkpoints(a, r, b, hidden, {3, 5}, s);
    }
  }
}

TEST_CASE("bf16 state pools: checkpoint lines equal the cut runs' lines bitwise, continuations stay close") {
  Stream stream;
  const cudaStream_t s = stream.get();
  for (kda::Recurrence rec : {kda::Recurrence::Chunked, kda::Recurrence::TokenByToken}) {
    CAPTURE(static_cast<int>(rec));
    kda::Config cfg = checkpoint_config(rec);
    cfg.pools.recurrent_dtype = kda::DType::BF16;
    cfg.pools.conv_dtype = kda::DType::BF16;
    cfg.pools.recurrent_layout = kda::RecurrentLayout::HVK;
    PrefillModule a(cfg), r(cfg);
    a.init_random_weights(22);
    r.init_random_weights(22);
    const int64_t D = cfg.model.hidden_size;
    const std::vector<uint16_t> warm = random_hidden(77, D, 8);
    HostBatch first = make_batch({77}, {2}, {false});
    put_hidden(a, warm, 0, 77);
    a.run(first.view(), s);

    HostBatch b = make_batch({700, 130, 10, 50}, {1, 2, 0, 3}, {false, true, false, false});
    b.set_checkpoints(0, 128, {20, 21, 22, 23, 24});
    b.set_checkpoints(1, 64, {25, 26});
    const std::vector<uint16_t> hidden = random_hidden(b.tokens(), D, 9);
    check_checkpoints(a, r, b, hidden, {2, 6}, s);
    const kda::SelfCheckReport report = a.self_check(b.view(), s);
    MESSAGE(report.detail);
    CHECK(report.ok);
  }
}

TEST_CASE("a batch whose checkpoints are refused changes no pool, staging or statistic") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = checkpoint_config(kda::Recurrence::Chunked);
  PrefillModule m(cfg);
  m.init_random_weights(3);
  HostBatch good = make_batch({300, 40}, {1, 2}, {false, false});
  good.set_checkpoints(0, 128, {10, 11});
  m.run(good.view(), s);
  const Pools before = Pools::of(m, s);
  const kda::ModuleStats st = m.stats(s);

  HostBatch bad = make_batch({300, 40}, {1, 2}, {true, true});
  bad.set_checkpoints(0, 128, {10, 2});  // line 2 is sequence 1's
  CHECK_THROWS_WITH_AS(m.run(bad.view(), s), doctest::Contains("checkpoint_lines[1] = 2 is also cache_indices[1]"),
                       kda::Error);
  bad.set_checkpoints(0, 100, {10, 11});
  CHECK_THROWS_WITH_AS(m.run(bad.view(), s), doctest::Contains("checkpoint_interval[0] = 100"), kda::Error);
  const Pools after = Pools::of(m, s);
  CHECK(after.changed_lines(before, {}) == 0);
  CHECK(m.stats(s).forwards == st.forwards);

  // Checkpoints on a module configured without them are refused too.
  kda::Config off = cfg;
  off.runtime.max_checkpoints = 0;
  PrefillModule plain(off);
  plain.init_random_weights(3);
  CHECK_THROWS_WITH_AS(plain.run(good.view(), s), doctest::Contains("runtime.max_checkpoints is 0"), kda::Error);
}
