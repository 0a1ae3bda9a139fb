// The conv-state checkpoint op on the CPU: its body (conv/conv_checkpoint_kernel.cuh, the code the
// kernel runs) over every (entry, channel, tap) of random batches gives, bit for bit, the conv
// state that the independent CPU conv reference (testing/conv_reference.h) leaves on a line
// after running the sequence cut at the entry's end; nothing else in the pool changes;
// malformed entries write nothing; conv_checkpoint_supported() refuses bad arguments with
// their reasons and conv_checkpoint() throws them before touching CUDA.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/bit_compare.h"
#include "common/half_host.h"
#include "common/state_checkpoints.h"
#include "conv/conv_checkpoint.h"
#include "conv/conv_checkpoint_kernel.cuh"
#include "kda/error.h"
#include "kda/packed_conv.h"
#include "support/fake_pointers.h"
#include "support/test_data.h"
#include "support/test_errors.h"
#include "testing/conv_reference.h"

namespace {

using kda::CheckpointEntry;
using kda::ConvCheckpointArgs;
namespace host = kda::host;

// Float bit patterns the pool holds besides ordinary values: quiet and signalling NaNs with
// payloads, both infinities, -0, subnormals, and the 0xFF fill (kPoison32).
const uint32_t kOddFloats[] = {0x7FC00000u, 0x7FA00001u, 0xFFC12345u, 0xFF800001u, 0x7F800000u,
                               0xFF800000u, 0x80000000u, 0x00000001u, 0x807FFFFFu, 0xFFFFFFFFu};
// bf16 patterns the inputs hold besides ordinary values: NaNs with payloads, infinities, -0,
// subnormals, the 0xFFFF fill.
const uint16_t kOddBf16[] = {0x7FC1u, 0x7F81u, 0xFFC0u, 0x7F80u, 0xFF80u,
                             0x8000u, 0x0001u, 0x807Fu, 0xFFFFu};

float bits_float(uint32_t u) { return host::bits_float(u); }

struct Case {
  int64_t dim = 77;
  int64_t row_pad = 0;     // x_row_stride = dim + row_pad
  int64_t state_len = 3;   // taps per line in the pool (only 0..2 are the state)
  int64_t line_pad = 0;    // extra elements per line
  bool tap_dim = false;    // (lines, taps, dim) instead of (lines, dim, taps)
  std::vector<int32_t> lens;
  double init_frac = 0.5;
  int64_t seq_pad = 0, token_pad = 0;  // capacity past the real sequences / rows
  int64_t spare_lines = 3;             // lines named by nobody
  int64_t entry_pad = 0;               // unused entries (line -1), shuffled in
  double null_frac = 0.0;              // sequences on the null line (no checkpoints)
};

// One problem's host arrays.
struct Host {
  Case cs;
  int64_t dim = 0, x_stride = 0, tokens = 0, seqs = 0, lines = 0;
  int32_t null_line = 0;
  int64_t sl = 0, sd = 0, st = 0;  // pool strides
  std::vector<uint16_t> x;
  std::vector<float> pool;
  std::vector<int32_t> qsl, cache;
  std::unique_ptr<bool[]> init;
  std::vector<CheckpointEntry> entries;
  int64_t used_entries = 0;

  // Over `states`, a pool of this problem's shape whose elements are fp32 or bf16.
  ConvCheckpointArgs args(void* states, kda::DType state_dtype = kda::DType::FP32) const {
    ConvCheckpointArgs a;
    a.x = x.data();
    a.x_row_stride = x_stride;
    a.num_tokens = tokens;
    a.dim = dim;
    a.conv_states = states;
    a.state_dtype = state_dtype;
    a.varlen.cache_lines = lines;
    a.state_stride_line = sl;
    a.state_stride_dim = sd;
    a.state_stride_tap = st;
    a.varlen.query_start_loc = qsl.data();
    a.varlen.num_seqs = seqs;
    a.varlen.cache_indices = cache.data();
    a.varlen.has_initial_state = init.get();
    a.varlen.null_line = null_line;
    a.entries = entries.data();
    a.max_entries = static_cast<int64_t>(entries.size());
    return a;
  }
  std::size_t at(int64_t line, int64_t c, int64_t tap) const {
    return static_cast<std::size_t>(line * sl + c * sd + tap * st);
  }
};

float random_pool_value(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> pick(0, 9);
  if (pick(rng) == 0) {
    std::uniform_int_distribution<std::size_t> odd(0, std::size(kOddFloats) - 1);
    return bits_float(kOddFloats[odd(rng)]);
  }
  return std::uniform_real_distribution<float>(-3.0f, 3.0f)(rng);
}

uint16_t random_x_value(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> pick(0, 19);
  if (pick(rng) == 0) {
    std::uniform_int_distribution<std::size_t> odd(0, std::size(kOddBf16) - 1);
    return kOddBf16[odd(rng)];
  }
  return host::float_to_bf16(std::uniform_real_distribution<float>(-3.0f, 3.0f)(rng));
}

// Checkpoint ends for a sequence of `len` rows: the small ends and chunk ends that can occur,
// the last row, and a random one, each at most once.
std::vector<int32_t> ends_for(std::mt19937_64& rng, int32_t len) {
  std::vector<int32_t> ends;
  auto add = [&](int32_t e) {
    if (e < 1 || e > len) return;
    for (int32_t have : ends)
      if (have == e) return;
    ends.push_back(e);
  };
  for (int32_t e : {1, 2, 3, 4, 64, 128}) add(e);
  add(len);
  add(len - 1);
  if (len > 1) add(std::uniform_int_distribution<int32_t>(1, len)(rng));
  if (ends.empty()) return ends;  // an empty sequence has no checkpoint
  // Not every sequence checkpoints every end: drop some at random, keep at least one.
  std::vector<int32_t> kept;
  for (int32_t e : ends)
    if (std::uniform_int_distribution<int>(0, 3)(rng) != 0) kept.push_back(e);
  if (kept.empty()) kept.push_back(ends.back());
  return kept;
}

Host make_host(const Case& cs, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Host h;
  h.cs = cs;
  h.dim = cs.dim;
  h.x_stride = cs.dim + cs.row_pad;
  int64_t total = 0;
  for (int32_t l : cs.lens) total += l;
  h.tokens = total + cs.token_pad;
  h.seqs = static_cast<int64_t>(cs.lens.size()) + cs.seq_pad;

  // Lines: one per sequence, then one per checkpoint, the spare ones, the null line somewhere.
  std::vector<std::vector<int32_t>> ends(cs.lens.size());
  int64_t checkpoints = 0;
  std::bernoulli_distribution null_seq(cs.null_frac);
  std::vector<bool> on_null(cs.lens.size());
  for (std::size_t s = 0; s < cs.lens.size(); ++s) {
    on_null[s] = null_seq(rng);
    if (!on_null[s]) ends[s] = ends_for(rng, cs.lens[s]);
    checkpoints += static_cast<int64_t>(ends[s].size());
  }
  h.lines = static_cast<int64_t>(cs.lens.size()) + checkpoints + cs.spare_lines + 1;
  h.null_line = static_cast<int32_t>(std::uniform_int_distribution<int64_t>(0, h.lines - 1)(rng));
  std::vector<int32_t> free_lines;
  for (int32_t l = 0; l < h.lines; ++l)
    if (l != h.null_line) free_lines.push_back(l);
  std::shuffle(free_lines.begin(), free_lines.end(), rng);

  const int64_t taps = cs.state_len;
  h.sd = cs.tap_dim ? 1 : taps;
  h.st = cs.tap_dim ? h.dim : 1;
  h.sl = taps * h.dim + cs.line_pad;
  h.pool.resize(static_cast<std::size_t>(h.lines * h.sl));
  for (float& v : h.pool) v = random_pool_value(rng);

  // Padding columns and rows past the batch hold the 0xFFFF fill: reading them would show.
  h.x.assign(static_cast<std::size_t>(std::max<int64_t>(h.tokens * h.x_stride, 1)), kda::test::kPoison16);
  for (int64_t t = 0; t < total; ++t)
    for (int64_t c = 0; c < h.dim; ++c) h.x[static_cast<std::size_t>(t * h.x_stride + c)] = random_x_value(rng);

  h.qsl.assign(static_cast<std::size_t>(h.seqs + 1), 0);
  h.cache.assign(static_cast<std::size_t>(std::max<int64_t>(h.seqs, 1)), h.null_line);
  h.init.reset(new bool[static_cast<std::size_t>(h.seqs + 1)]());
  std::bernoulli_distribution init(cs.init_frac);
  for (int64_t s = 0; s < h.seqs; ++s) {
    const bool real = s < static_cast<int64_t>(cs.lens.size());
    h.qsl[static_cast<std::size_t>(s + 1)] = h.qsl[static_cast<std::size_t>(s)] + (real ? cs.lens[s] : 0);
    if (real && !on_null[s]) {
      h.cache[static_cast<std::size_t>(s)] = free_lines.back();
      free_lines.pop_back();
    }
    h.init[s] = init(rng);
  }
  for (std::size_t s = 0; s < cs.lens.size(); ++s)
    for (int32_t e : ends[s]) {
      CheckpointEntry entry;
      entry.line = free_lines.back();
      free_lines.pop_back();
      entry.seq = static_cast<int32_t>(s);
      entry.end = e;
      h.entries.push_back(entry);
    }
  h.used_entries = static_cast<int64_t>(h.entries.size());
  for (int64_t i = 0; i < cs.entry_pad; ++i) {
    CheckpointEntry unused;  // line -1; the other fields as an unused staged entry may hold
    unused.seq = static_cast<int32_t>(i % std::max<int64_t>(h.seqs, 1));
    unused.end = 1;
    h.entries.push_back(unused);
  }
  std::shuffle(h.entries.begin(), h.entries.end(), rng);
  // The checkpoint lines before the op: what a 0xFF fill leaves (whatever state the line held
  // before is overwritten). Taps past 2 and the line padding keep their values.
  for (const CheckpointEntry& e : h.entries) {
    if (e.line < 0) continue;
    for (int64_t c = 0; c < h.dim; ++c)
      for (int64_t k = 0; k < 3; ++k) h.pool[h.at(e.line, c, k)] = bits_float(kda::test::kPoison32);
  }
  return h;
}

// Runs the body over every (entry, channel, tap), as the kernel does, on `pool` (fp32 elements,
// or bf16 bits).
template <typename T>
void run_body(const Host& h, std::vector<T>& pool) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "an fp32 or a bf16 pool");
  const kda::conv::ConvCheckpointParams a = kda::conv::make_checkpoint_params(
      h.args(pool.data(), sizeof(T) == 2 ? kda::DType::BF16 : kda::DType::FP32));
  for (int64_t i = 0; i < a.max_entries; ++i) {
    const kda::conv::CheckpointSource s = kda::conv::checkpoint_source(a, i);
    for (int64_t c = 0; c < a.dim; ++c)
      for (int j = 0; j < 3; ++j) kda::conv::checkpoint_element(a, s, c, j);
  }
}

// The pool the op must leave: for every used entry, its line's taps 0..2 are those the CPU
// conv reference leaves on the sequence's line after running the sequence's first `end` rows
// alone (on a copy of the original pool); every other element as it was. `start` is the
// original pool: h.pool (fp32), or bf16 bits of the same shape.
template <typename T>
std::vector<T> expected_pool(const Host& h, const std::vector<T>& start) {
  std::vector<T> want = start;
  const std::vector<float> weight(static_cast<std::size_t>(h.dim * 4), 0.0f);
  std::vector<uint16_t> out(static_cast<std::size_t>(std::max<int64_t>(h.tokens * h.dim, 1)));
  for (const CheckpointEntry& e : h.entries) {
    if (e.line < 0) continue;
    std::vector<T> pool = start;
    const int32_t bos = h.qsl[static_cast<std::size_t>(e.seq)];
    const int32_t qsl[2] = {bos, bos + e.end};
    const int32_t line = h.cache[static_cast<std::size_t>(e.seq)];
    bool init[1] = {h.init[e.seq]};
    kda::PackedConvArgs a;
    a.x = h.x.data();
    a.x_dtype = kda::DType::BF16;
    a.num_tokens = h.tokens;
    a.dim = h.dim;
    a.x_row_stride = h.x_stride;
    a.weight = weight.data();
    a.conv_states = pool.data();
    a.state_dtype = sizeof(T) == 2 ? kda::DType::BF16 : kda::DType::FP32;
    a.varlen.cache_lines = h.lines;
    a.state_len = h.cs.state_len;
    a.state_stride_line = h.sl;
    a.state_stride_dim = h.sd;
    a.state_stride_tap = h.st;
    a.varlen.query_start_loc = qsl;
    a.varlen.num_seqs = 1;
    a.varlen.cache_indices = &line;
    a.varlen.has_initial_state = init;
    a.part_dim = h.dim;
    a.silu = false;
    a.varlen.null_line = h.null_line;
    a.out = out.data();
    kda::reference::causal_conv1d(a, kda::reference::ConvMath::kStockFp32);
    for (int64_t c = 0; c < h.dim; ++c)
      for (int64_t k = 0; k < 3; ++k) want[h.at(e.line, c, k)] = pool[h.at(line, c, k)];
  }
  return want;
}

struct Outcome {
  int64_t checkpoint_bits = 0;     // differing bits on the checkpoint taps
  int64_t checkpoint_elements = 0; // differing checkpoint tap elements
  int64_t other_elements = 0;      // pool elements outside the checkpoint taps that changed
  int64_t checkpoint_taps = 0;     // checkpoint tap elements compared
};

Outcome compare(const Host& h, const std::vector<float>& got, const std::vector<float>& want) {
  Outcome o;
  std::vector<unsigned char> is_tap(h.pool.size(), 0);
  for (const CheckpointEntry& e : h.entries) {
    if (e.line < 0) continue;
    for (int64_t c = 0; c < h.dim; ++c)
      for (int64_t k = 0; k < 3; ++k) is_tap[h.at(e.line, c, k)] = 1;
  }
  for (std::size_t i = 0; i < got.size(); ++i) {
    const int64_t bits = kda::detail::diff_bits(&got[i], &want[i], sizeof(float));
    if (is_tap[i]) {
      ++o.checkpoint_taps;
      o.checkpoint_bits += bits;
      o.checkpoint_elements += bits != 0;
    } else {
      o.other_elements += bits != 0;
    }
  }
  return o;
}

std::string describe(const Host& h) {
  std::ostringstream os;
  os << "dim " << h.dim << " (row stride dim+" << h.cs.row_pad << "), " << h.cs.lens.size() << " seqs (cap "
     << h.seqs << "), " << h.qsl.back() << " rows (cap " << h.tokens << "), pool "
     << (h.cs.tap_dim ? "(lines, taps, dim)" : "(lines, dim, taps)") << " taps " << h.cs.state_len << " pad "
     << h.cs.line_pad << ", " << h.lines << " lines (null " << h.null_line << "), " << h.used_entries
     << " checkpoints in " << h.entries.size() << " entries";
  return os.str();
}

// Body vs reference on one problem; the counts printed, every one checked.
Outcome check_case(const Case& cs, uint64_t seed) {
  const Host h = make_host(cs, seed);
  const std::string what = describe(h);
  std::string why;
  std::vector<float> got = h.pool;
  REQUIRE_MESSAGE(kda::conv_checkpoint_supported(h.args(got.data()), &why), what, ": unsupported: ", why);
  run_body(h, got);
  const std::vector<float> want = expected_pool(h, h.pool);
  const Outcome o = compare(h, got, want);
  MESSAGE(what << ": " << o.checkpoint_taps << " checkpoint taps, " << o.checkpoint_elements << " differ ("
               << o.checkpoint_bits << " bits) from the reference; " << o.other_elements
               << " other pool elements changed");
  CHECK(o.checkpoint_bits == 0);
  CHECK(o.checkpoint_elements == 0);
  CHECK(o.other_elements == 0);
  return o;
}

using kda::test::fake_pointer;

// The seed-scale module's arguments: 3 x 1536 channels of the 4928-wide in_proj output, a pool
// of 17 (lines, dim, 3) lines.
constexpr int64_t kModulePoolElements = 17 * 3 * (3 * 1536);

ConvCheckpointArgs module_args() {
  ConvCheckpointArgs a;
  a.x = fake_pointer<const void>(1);
  a.x_row_stride = 4928;
  a.num_tokens = 2048;
  a.dim = 3 * 1536;
  a.conv_states = fake_pointer<void>(2);
  a.varlen.cache_lines = 17;
  a.state_stride_line = 3 * a.dim;
  a.state_stride_dim = 3;
  a.state_stride_tap = 1;
  a.varlen.query_start_loc = fake_pointer<const int32_t>(3);
  a.varlen.num_seqs = 8;
  a.varlen.cache_indices = fake_pointer<const int32_t>(4);
  a.varlen.has_initial_state = fake_pointer<const bool>(5);
  a.varlen.null_line = 0;
  a.entries = fake_pointer<const CheckpointEntry>(6);
  a.max_entries = 16;
  return a;
}

std::string why_not(const ConvCheckpointArgs& a) {
  std::string why = "(not set)";
  return kda::conv_checkpoint_supported(a, &why) ? std::string("supported") : why;
}

}  // namespace

TEST_CASE("checkpoints equal the reference's state of the truncated sequence, bit for bit") {
  const std::vector<int32_t> awkward = {1, 2, 3, 64, 130, 4, 65, 0, 200, 63, 128, 129};
  int64_t taps = 0, bits = 0, elements = 0, others = 0;
  int cases = 0;
  auto run = [&](const Case& cs, uint64_t seed) {
    const Outcome o = check_case(cs, seed);
    taps += o.checkpoint_taps, bits += o.checkpoint_bits, elements += o.checkpoint_elements;
    others += o.other_elements;
    ++cases;
  };
  SUBCASE("random batches: awkward dims and lengths, both pool layouts, with and without initial state") {
  const int64_t dims[] = {77, 1, 100, 257, 3 * 40, 5};
  for (int i = 0; i < 12; ++i) {
    Case cs;
    cs.dim = dims[i % 6];
    cs.row_pad = (i % 3) * 7;
    cs.state_len = 3 + i % 2;
    cs.line_pad = (i / 2) % 3 == 0 ? 0 : 5;
    cs.tap_dim = (i / 3) % 2 == 1;
    cs.init_frac = i % 4 == 0 ? 0.0 : i % 4 == 1 ? 1.0 : 0.5;
    cs.lens = awkward;
    std::shuffle(cs.lens.begin(), cs.lens.end(), std::mt19937_64(1000 + i));
    cs.seq_pad = i % 3;
    cs.token_pad = (i % 4) * 9;
    cs.entry_pad = i % 5;
    cs.null_frac = i % 3 == 2 ? 0.2 : 0.0;
    run(cs, 7000 + i);
  }
  }
  SUBCASE("one long sequence with checkpoints every 64 rows, vLLM's (lines, taps, dim) pool") {
    Case cs;
    cs.dim = 3 * 64 + 1;
    cs.tap_dim = true;
    cs.lens = {1000};
    cs.init_frac = 1.0;
    run(cs, 42);
  }
  SUBCASE("sequences of 1 and 2 rows, every one with an initial state (the shifted taps)") {
    Case cs;
    cs.dim = 33;
    cs.lens = {1, 2, 1, 2, 2, 1};
    cs.init_frac = 1.0;
    cs.entry_pad = 3;
    run(cs, 43);
  }
  MESSAGE(cases << " problems: " << taps << " checkpoint taps compared, " << elements << " differ (" << bits
                << " bits); " << others << " other pool elements changed");
  CHECK(bits == 0);
  CHECK(others == 0);
  CHECK(taps > 0);
}

// The bf16 bits of a pool whose elements are all bf16 values (their top halves).
std::vector<uint16_t> top_halves(const std::vector<float>& pool) {
  std::vector<uint16_t> bits(pool.size());
  for (std::size_t i = 0; i < pool.size(); ++i) bits[i] = static_cast<uint16_t>(host::float_bits(pool[i]) >> 16);
  return bits;
}

TEST_CASE("checkpoints on bf16 lines are the fp32 lines' checkpoints rounded to bf16, bit for bit") {
  // A checkpoint value is a bf16 input or an old tap of the same pool, so a bf16 line holds it
  // exactly: the bf16 run's taps are the fp32 run's rounded to nearest even (exact for every
  // value; a NaN becomes the canonical 0x7FFF, as the rounding store gives). The bf16 run is
  // also compared with the CPU reference run on bf16 lines, and nothing else of the pool changes.
  const std::vector<int32_t> awkward = {1, 2, 3, 64, 130, 4, 65, 0, 63, 128, 129};
  const int64_t dims[] = {77, 5, 3 * 40 + 1, 64};
  int64_t taps = 0, rounded_bits = 0, reference_bits = 0, unwritten = 0, others = 0;
  for (int i = 0; i < 8; ++i) {
    Case cs;
    cs.dim = dims[i % 4];
    cs.row_pad = (i % 3) * 7;
    cs.state_len = 3 + i % 2;
    cs.line_pad = i < 4 ? 0 : 5;
    cs.tap_dim = (i / 2) % 2 == 1;  // (lines, taps, dim) and (lines, dim, taps), both state lengths
    cs.init_frac = i % 3 == 0 ? 1.0 : 0.5;
    cs.lens = awkward;
    std::shuffle(cs.lens.begin(), cs.lens.end(), std::mt19937_64(3000 + i));
    cs.seq_pad = i % 3;
    cs.token_pad = (i % 4) * 9;
    cs.entry_pad = i % 5;
    cs.null_frac = i % 4 == 3 ? 0.2 : 0.0;
    Host h = make_host(cs, 9000 + i);
    // Both runs start from the same values: every pool element cut to its top half (the odd
    // patterns stay NaNs, infinities, -0 and zeros; the checkpoint lines' fill is the bf16 NaN
    // 0xFFFF, which no write leaves).
    for (float& v : h.pool) v = host::bits_float(host::float_bits(v) & 0xFFFF0000u);
    const std::vector<uint16_t> start16 = top_halves(h.pool);
    std::vector<float> got32 = h.pool;
    std::vector<uint16_t> got16 = start16;
    std::string why;
    REQUIRE_MESSAGE(kda::conv_checkpoint_supported(h.args(got16.data(), kda::DType::BF16), &why), why);
    run_body(h, got32);
    run_body(h, got16);
    const std::vector<uint16_t> want16 = expected_pool(h, start16);

    std::vector<unsigned char> is_tap(h.pool.size(), 0);
    for (const CheckpointEntry& e : h.entries) {
      if (e.line < 0) continue;
      for (int64_t c = 0; c < h.dim; ++c)
        for (int64_t k = 0; k < 3; ++k) is_tap[h.at(e.line, c, k)] = 1;
    }
    int64_t case_taps = 0, case_rounded = 0, case_reference = 0, case_unwritten = 0, case_others = 0;
    for (std::size_t j = 0; j < got16.size(); ++j) {
      case_reference += kda::detail::diff_bits(&got16[j], &want16[j], 2);
      if (is_tap[j]) {
        ++case_taps;
        const uint16_t rounded = host::float_to_bf16(got32[j]);
        case_rounded += kda::detail::diff_bits(&got16[j], &rounded, 2);
        case_unwritten += got16[j] == kda::test::kPoison16;
      } else {
        case_others += got16[j] != start16[j];
      }
    }
    MESSAGE(describe(h) << ", bf16 lines: " << case_taps << " checkpoint taps, " << case_rounded
                        << " bits differ from the fp32 run's rounded, " << case_reference
                        << " pool bits from the reference on bf16 lines, " << case_unwritten << " taps unwritten, "
                        << case_others << " other elements changed");
    taps += case_taps, rounded_bits += case_rounded, reference_bits += case_reference;
    unwritten += case_unwritten, others += case_others;
  }
  CHECK(taps > 0);
  CHECK(rounded_bits == 0);
  CHECK(reference_bits == 0);
  CHECK(unwritten == 0);
  CHECK(others == 0);
}

TEST_CASE("a checkpoint at the sequence's last row equals the line the reference conv leaves") {
  // The whole batch through the reference at once: a checkpoint at end == rows is the new state
  // of the sequence's own line.
  Case cs;
  cs.dim = 50;
  cs.lens = {1, 2, 3, 5, 64, 70};
  cs.init_frac = 0.5;
  Host h = make_host(cs, 99);
  h.entries.clear();
  std::vector<int32_t> free_lines;
  std::vector<bool> named(static_cast<std::size_t>(h.lines), false);
  named[static_cast<std::size_t>(h.null_line)] = true;
  for (int64_t s = 0; s < h.seqs; ++s) named[static_cast<std::size_t>(h.cache[s])] = true;
  for (int32_t l = 0; l < h.lines; ++l)
    if (!named[static_cast<std::size_t>(l)]) free_lines.push_back(l);
  for (int64_t s = 0; s < h.seqs; ++s) {
    REQUIRE(!free_lines.empty());
    CheckpointEntry e;
    e.line = free_lines.back();
    free_lines.pop_back();
    e.seq = static_cast<int32_t>(s);
    e.end = h.qsl[s + 1] - h.qsl[s];
    h.entries.push_back(e);
  }
  std::vector<float> got = h.pool;
  run_body(h, got);
  std::vector<float> conv = h.pool;
  const std::vector<float> weight(static_cast<std::size_t>(h.dim * 4), 0.5f);
  std::vector<uint16_t> out(static_cast<std::size_t>(h.tokens * h.dim));
  kda::PackedConvArgs a;
  a.x = h.x.data();
  a.num_tokens = h.tokens;
  a.dim = h.dim;
  a.x_row_stride = h.x_stride;
  a.weight = weight.data();
  a.conv_states = conv.data();
  a.varlen.cache_lines = h.lines;
  a.state_stride_line = h.sl;
  a.state_stride_dim = h.sd;
  a.state_stride_tap = h.st;
  a.varlen.query_start_loc = h.qsl.data();
  a.varlen.num_seqs = h.seqs;
  a.varlen.cache_indices = h.cache.data();
  a.varlen.has_initial_state = h.init.get();
  a.part_dim = h.dim;
  a.varlen.null_line = h.null_line;
  a.out = out.data();
  kda::reference::causal_conv1d(a);
  int64_t bits = 0;
  for (const CheckpointEntry& e : h.entries)
    for (int64_t c = 0; c < h.dim; ++c)
      for (int64_t k = 0; k < 3; ++k)
        bits += kda::detail::diff_bits(&got[h.at(e.line, c, k)], &conv[h.at(h.cache[e.seq], c, k)], 4);
  MESSAGE(h.entries.size() << " final-row checkpoints vs the lines of the whole-batch reference: " << bits
                           << " bits differ");
  CHECK(bits == 0);
}

TEST_CASE("hand-computed taps: inputs, shifted initial taps and zeros") {
  // One channel; sequence 0 has 5 rows (inputs 1..5) on line 1 with taps {10, 20, 30}, sequence
  // 1 has 2 rows (6, 7) on line 2 without initial state.
  Host h;
  h.cs.dim = 1;
  h.dim = 1;
  h.x_stride = 1;
  h.tokens = 7;
  h.seqs = 2;
  h.lines = 8;
  h.null_line = 0;
  h.sl = 3, h.sd = 3, h.st = 1;
  for (int t = 0; t < 7; ++t) h.x.push_back(host::float_to_bf16(static_cast<float>(t + 1)));
  h.pool.assign(24, -1.0f);
  h.pool[3] = 10, h.pool[4] = 20, h.pool[5] = 30;
  h.pool[6] = 40, h.pool[7] = 50, h.pool[8] = 60;
  h.qsl = {0, 5, 7};
  h.cache = {1, 2};
  h.init.reset(new bool[2]{true, false});
  h.entries = {{3, 0, 1, 0}, {4, 0, 2, 0}, {5, 0, 3, 0}, {6, 0, 5, 0}, {7, 1, 1, 0}, {-1, 1, 2, 0}};
  std::vector<float> got = h.pool;
  run_body(h, got);
  const float want[8][3] = {{-1, -1, -1}, {10, 20, 30}, {40, 50, 60}, {20, 30, 1},
                            {30, 1, 2},   {1, 2, 3},    {3, 4, 5},    {0, 0, 6}};
  for (int l = 0; l < 8; ++l)
    for (int k = 0; k < 3; ++k) CHECK_MESSAGE(got[static_cast<std::size_t>(3 * l + k)] == want[l][k], "line ", l, " tap ", k);
}

TEST_CASE("malformed entries and metadata write nothing") {
  Case cs;
  cs.dim = 40;
  cs.lens = {5, 2, 70};
  cs.init_frac = 1.0;
  cs.spare_lines = 4;
  Host h = make_host(cs, 5);
  // Two sequences with all of their metadata sane, a third whose row range is corrupted below.
  const int32_t l0 = h.cache[0];
  std::vector<int32_t> spare;
  std::vector<bool> named(static_cast<std::size_t>(h.lines), false);
  named[static_cast<std::size_t>(h.null_line)] = true;
  for (int64_t s = 0; s < h.seqs; ++s) named[static_cast<std::size_t>(h.cache[s])] = true;
  for (int32_t l = 0; l < h.lines; ++l)
    if (!named[static_cast<std::size_t>(l)]) spare.push_back(l);
  REQUIRE(spare.size() >= 2);
  const int32_t free_line = spare[0];
  struct Bad {
    const char* what;
    CheckpointEntry e;
  };
  const int32_t lines = static_cast<int32_t>(h.lines);
  const Bad bad[] = {
      {"unused (line -1)", {-1, 0, 1, 0}},
      {"line -7", {-7, 0, 1, 0}},
      {"line past the pool", {lines, 0, 1, 0}},
      {"line int32 max", {std::numeric_limits<int32_t>::max(), 0, 1, 0}},
      {"the null line", {h.null_line, 0, 1, 0}},
      {"the sequence's own line", {l0, 0, 1, 0}},
      {"seq -1", {free_line, -1, 1, 0}},
      {"seq past num_seqs", {free_line, static_cast<int32_t>(h.seqs), 1, 0}},
      {"end 0", {free_line, 0, 0, 0}},
      {"end -3", {free_line, 0, -3, 0}},
      {"end past the sequence's rows", {free_line, 1, 3, 0}},
      {"end int32 max", {free_line, 0, std::numeric_limits<int32_t>::max(), 0}},
  };
  for (const Bad& b : bad) {
    CAPTURE(b.what);
    Host m = make_host(cs, 5);
    m.entries = {b.e};
    std::vector<float> got = m.pool;
    run_body(m, got);
    CHECK(kda::detail::diff_bits(got.data(), m.pool.data(), got.size() * 4) == 0);
    CHECK(kda::conv::checkpoint_source(kda::conv::make_checkpoint_params(m.args(got.data())), 0).dst < 0);
  }
  struct BadMeta {
    const char* what;
    void (*edit)(Host&);
  };
  const BadMeta meta[] = {
      {"the sequence on the null line", [](Host& m) { m.cache[0] = m.null_line; }},
      {"the sequence's line out of range", [](Host& m) { m.cache[0] = static_cast<int32_t>(m.lines); }},
      {"the sequence's line negative", [](Host& m) { m.cache[0] = -2; }},
      {"query_start_loc negative", [](Host& m) { m.qsl[0] = -1; }},
      {"query_start_loc decreasing", [](Host& m) { m.qsl[1] = -5; }},
      {"query_start_loc past num_tokens", [](Host& m) { m.qsl[1] = static_cast<int32_t>(m.tokens + 1); }},
  };
  for (const BadMeta& b : meta) {
    CAPTURE(b.what);
    Host m = make_host(cs, 5);
    b.edit(m);
    m.entries = {{free_line, 0, 1, 0}};
    std::vector<float> got = m.pool;
    run_body(m, got);
    CHECK(kda::detail::diff_bits(got.data(), m.pool.data(), got.size() * 4) == 0);
  }
  // A well-formed entry next to them still works: the counter-check that the cases above were
  // refused for their fault, not for a broken fixture.
  Host m = make_host(cs, 5);
  m.entries = {{free_line, 0, 1, 0}, {spare[1], 1, 2, 0}};
  std::vector<float> got = m.pool;
  run_body(m, got);
  for (int64_t c = 0; c < m.dim; ++c) {
    CHECK(host::float_bits(got[m.at(free_line, c, 0)]) == host::float_bits(m.pool[m.at(l0, c, 1)]));
    CHECK(host::float_bits(got[m.at(spare[1], c, 2)]) ==
          host::float_bits(host::bf16_to_float(m.x[static_cast<std::size_t>((m.qsl[1] + 1) * m.x_stride + c)])));
  }
}

TEST_CASE("conv_checkpoint_supported accepts the module's arguments and clears the reason") {
  std::string why = "stale";
  CHECK(kda::conv_checkpoint_supported(module_args(), &why));
  CHECK(why.empty());
  ConvCheckpointArgs a = module_args();
  SUBCASE("no has_initial_state array") {
    a.varlen.has_initial_state = nullptr;
    CHECK(why_not(a) == "supported");
  }
  SUBCASE("the (lines, taps, dim) pool, a dense x, a dim that is no multiple of 32") {
    a.state_stride_dim = 1;
    a.state_stride_tap = a.dim;
    CHECK(why_not(a) == "supported");
    a.dim = 77;
    a.x_row_stride = 77;
    a.state_stride_line = 3 * 77 + 5;
    a.state_stride_tap = 77;
    CHECK(why_not(a) == "supported");
  }
  SUBCASE("no entries: no pointer is needed") {
    a.max_entries = 0;
    a.x = nullptr;
    a.conv_states = nullptr;
    a.varlen.query_start_loc = nullptr;
    a.varlen.cache_indices = nullptr;
    a.entries = nullptr;
    CHECK(why_not(a) == "supported");
    // and conv_checkpoint enqueues nothing (it would need a GPU otherwise)
    CHECK_NOTHROW(kda::conv_checkpoint(a, nullptr));
  }
  SUBCASE("no token rows, no sequences") {
    a.num_tokens = 0;
    a.varlen.num_seqs = 0;
    CHECK(why_not(a) == "supported");
  }
  SUBCASE("a bf16 pool in both layouts, on a 2-byte boundary") {
    a.state_dtype = kda::DType::BF16;
    CHECK(why_not(a) == "supported");
    a.state_stride_dim = 1;
    a.state_stride_tap = a.dim;
    a.conv_states = fake_pointer<void>(2, 2);
    CHECK(why_not(a) == "supported");
  }
  SUBCASE("a bf16 pool just below x, where an fp32 pool of the same lines would reach into x") {
    // The overlap check counts the pool's bytes in its own element size.
    a.state_dtype = kda::DType::BF16;
    a.conv_states = fake_pointer<void>(1, -(kModulePoolElements * 4) + 4);
    CHECK(why_not(a) == "supported");
    a.state_dtype = kda::DType::FP32;
    CHECK(why_not(a) == "conv_states overlaps x");
  }
}

TEST_CASE("conv_checkpoint_supported refuses bad arguments with their reason, and conv_checkpoint throws it") {
  struct Bad {
    const char* what;
    void (*edit)(ConvCheckpointArgs&);
    const char* reason;
  };
  const Bad bad[] = {
      {"negative max_entries", [](ConvCheckpointArgs& a) { a.max_entries = -1; }, "max_entries -1 is negative"},
      {"max_entries past the grid", [](ConvCheckpointArgs& a) { a.max_entries = int64_t{1} << 31; },
       "max_entries 2147483648 exceeds the 2147483647 CTAs a grid's x extent can hold (one per entry)"},
      {"dim 0", [](ConvCheckpointArgs& a) { a.dim = 0; }, "dim 0 must be positive"},
      {"dim past the grid", [](ConvCheckpointArgs& a) { a.dim = int64_t{256} * 65535 + 1; a.x_row_stride = a.dim; },
       "dim 16776961 needs 65536 column blocks of 256 channels, more than the 65535 a grid's y extent can hold"},
      {"negative num_tokens", [](ConvCheckpointArgs& a) { a.num_tokens = -1; }, "num_tokens -1 is negative"},
      {"num_tokens past int32", [](ConvCheckpointArgs& a) { a.num_tokens = int64_t{1} << 31; },
       "num_tokens 2147483648 exceeds 2147483647 (query_start_loc is int32)"},
      {"negative num_seqs", [](ConvCheckpointArgs& a) { a.varlen.num_seqs = -2; }, "num_seqs -2 is negative"},
      {"num_seqs int32 max", [](ConvCheckpointArgs& a) { a.varlen.num_seqs = 2147483647; },
       "num_seqs 2147483647 must be below 2147483647"},
      {"row stride below dim", [](ConvCheckpointArgs& a) { a.x_row_stride = a.dim - 1; },
       "x_row_stride 4607 is smaller than dim 4608"},
      {"x extent overflow", [](ConvCheckpointArgs& a) { a.x_row_stride = int64_t{1} << 53; },
       "x's extent (num_tokens, x_row_stride) overflows 64-bit addressing"},
      {"no cache lines", [](ConvCheckpointArgs& a) { a.varlen.cache_lines = 0; }, "cache_lines 0 must be at least 1"},
      {"negative stride", [](ConvCheckpointArgs& a) { a.state_stride_tap = -1; },
       "conv_states strides (13824, 3, -1) must not be negative"},
      {"taps overlap channels", [](ConvCheckpointArgs& a) { a.state_stride_dim = 2; },
       "conv_states strides (13824, 2, 1) make different (line, channel, tap) elements overlap or overflow "
       "64-bit addressing"},
      {"lines overlap", [](ConvCheckpointArgs& a) { a.state_stride_line = 3 * a.dim - 1; },
       "conv_states strides (13823, 3, 1) make different (line, channel, tap) elements overlap or overflow "
       "64-bit addressing"},
      {"tap_dim with taps too close", [](ConvCheckpointArgs& a) { a.state_stride_dim = 1; a.state_stride_tap = a.dim - 1; },
       "conv_states strides (13824, 1, 4607) make different (line, channel, tap) elements overlap or overflow "
       "64-bit addressing"},
      {"pool extent overflow", [](ConvCheckpointArgs& a) { a.state_stride_line = int64_t{1} << 62; },
       "conv_states strides (4611686018427387904, 3, 1) make different (line, channel, tap) elements overlap "
       "or overflow 64-bit addressing"},
      {"null x", [](ConvCheckpointArgs& a) { a.x = nullptr; }, "x is null"},
      {"null conv_states", [](ConvCheckpointArgs& a) { a.conv_states = nullptr; }, "conv_states is null"},
      {"null query_start_loc", [](ConvCheckpointArgs& a) { a.varlen.query_start_loc = nullptr; }, "query_start_loc is null"},
      {"null cache_indices", [](ConvCheckpointArgs& a) { a.varlen.cache_indices = nullptr; }, "cache_indices is null"},
      {"null entries", [](ConvCheckpointArgs& a) { a.entries = nullptr; }, "entries is null"},
      {"misaligned x", [](ConvCheckpointArgs& a) { a.x = fake_pointer<const void>(1, 1); },
       "x is not aligned to its 2-byte bf16 elements"},
      {"an invalid state_dtype value", [](ConvCheckpointArgs& a) { a.state_dtype = static_cast<kda::DType>(5); },
       "state_dtype has the invalid value 5; supported are fp32 and bf16"},
      {"fp16 conv states", [](ConvCheckpointArgs& a) { a.state_dtype = kda::DType::FP16; },
       "state_dtype fp16 is not supported; conv states are fp32 or bf16"},
      {"an fp32 pool on a bf16 element boundary", [](ConvCheckpointArgs& a) { a.conv_states = fake_pointer<void>(2, 2); },
       "conv_states is not aligned to its 4-byte fp32 elements (state_dtype)"},
      {"a bf16 pool on an odd address",
       [](ConvCheckpointArgs& a) {
         a.state_dtype = kda::DType::BF16;
         a.conv_states = fake_pointer<void>(2, 1);
       },
       "conv_states is not aligned to its 2-byte bf16 elements (state_dtype)"},
      {"misaligned cache_indices", [](ConvCheckpointArgs& a) { a.varlen.cache_indices = fake_pointer<const int32_t>(4, 2); },
       "query_start_loc and cache_indices must be aligned to their 4-byte elements"},
      {"misaligned entries", [](ConvCheckpointArgs& a) { a.entries = fake_pointer<const CheckpointEntry>(6, 4); },
       "entries is not aligned to its 16-byte CheckpointEntry records"},
      {"pool overlapping x", [](ConvCheckpointArgs& a) { a.conv_states = fake_pointer<void>(1, 4096); },
       "conv_states overlaps x"},
      {"a bf16 pool overlapping x", [](ConvCheckpointArgs& a) {
         a.state_dtype = kda::DType::BF16;
         a.conv_states = fake_pointer<void>(1, 4096);
       },
       "conv_states overlaps x"},
      {"an fp32 pool whose last element reaches x",
       [](ConvCheckpointArgs& a) { a.conv_states = fake_pointer<void>(1, -(kModulePoolElements * 4) + 4); },
       "conv_states overlaps x"},
  };
  for (const Bad& b : bad) {
    CAPTURE(b.what);
    ConvCheckpointArgs a = module_args();
    b.edit(a);
    CHECK(why_not(a) == b.reason);
    CHECK(kda::test::error_of([&] { kda::conv_checkpoint(a, nullptr); }, "kda::conv_checkpoint") == b.reason);
  }
}
