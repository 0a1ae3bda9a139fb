// The packed conv kernel's program body (src/conv/packed_conv_kernel.cuh) executed on the CPU:
// 32 std::threads play the lanes of a warp, a barrier stands for __syncwarp and carries the
// ballots, and every program of the grid runs in turn. The outputs and the conv-state pool
// must equal the CPU reference (kda::reference::causal_conv1d, stock fp32 order) bit for bit:
// the emulation uses the same host SiLU approximation as the reference, so any difference is
// an indexing, chunking, history or state-update error in the code the GPU runs. Every access
// the body routes through its Ops is also checked for alignment and bounds.
// What this cannot check: the device SiLU bits (the GPU tests compare with the stock
// baseline), timing, occupancy and the launch itself.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/emu_barrier.h"
#include "common/half_host.h"
#include "common/state_elements.h"
#include "conv/packed_conv.h"
#include "testing/conv_reference.h"
#include "conv/packed_conv_kernel.cuh"
#include "kda/packed_conv.h"

namespace {

using kda::DType;
using kda::conv::Float4;
using kda::conv::RowOf;

using Barrier = kda::test::EmuBarrier;

// Byte ranges an access may touch, by kind.
struct Range {
  const char* begin = nullptr;
  const char* end = nullptr;
  bool holds(const void* p, std::size_t bytes) const {
    const char* c = static_cast<const char*>(p);
    return c >= begin && c + bytes <= end;
  }
};

template <typename T>
Range range_of(const std::vector<T>& v) {
  const char* b = reinterpret_cast<const char*>(v.data());
  return {b, b + v.size() * sizeof(T)};
}

struct Warp {
  Barrier barrier{32};
  uint32_t votes[32] = {};
  int32_t shuffled[32] = {};
  std::vector<Float4> stage_storage;  // 16-byte aligned, as the shared staging area
  Range x, out, weight, bias, qsl, cache, flags, state, stage;
  std::atomic<int64_t> bad_access{0};
};

struct HostOps {
  Warp* warp;
  int lane;

  void check(bool ok) const {
    if (!ok) warp->bad_access.fetch_add(1);
  }
  static bool aligned(const void* p, std::size_t a) {
    return reinterpret_cast<std::uintptr_t>(p) % a == 0;
  }

  template <int kBytes>
  RowOf<kBytes> load_x(const char* ptr) const {
    check(warp->x.holds(ptr, kBytes) && aligned(ptr, kBytes < 16 ? kBytes : 16));
    RowOf<kBytes> r{};
    std::memcpy(r.w, ptr, kBytes);
    return r;
  }
  template <int kBytes>
  void store_out(char* ptr, const RowOf<kBytes>& r) const {
    check(warp->out.holds(ptr, kBytes) && aligned(ptr, kBytes < 16 ? kBytes : 16));
    std::memcpy(ptr, r.w, kBytes);
  }
  float load_ro(const float* ptr) const {
    check((warp->weight.holds(ptr, 4) || warp->bias.holds(ptr, 4)) && aligned(ptr, 4));
    return *ptr;
  }
  Float4 load4_ro(const float* ptr) const {
    check(warp->weight.holds(ptr, 16) && aligned(ptr, 16));
    Float4 v;
    std::memcpy(&v, ptr, 16);
    return v;
  }
  Float4 load4(const float* ptr) const {
    check((warp->state.holds(ptr, 16) || warp->stage.holds(ptr, 16)) && aligned(ptr, 16));
    Float4 v;
    std::memcpy(&v, ptr, 16);
    return v;
  }
  void store4(float* ptr, Float4 v) const {
    check((warp->state.holds(ptr, 16) || warp->stage.holds(ptr, 16)) && aligned(ptr, 16));
    std::memcpy(ptr, &v, 16);
  }
  int32_t load_i32_ro(const int32_t* ptr) const {
    check((warp->qsl.holds(ptr, 4) || warp->cache.holds(ptr, 4)) && aligned(ptr, 4));
    return *ptr;
  }
  bool load_flag(const bool* ptr) const {
    check(warp->flags.holds(ptr, 1));
    return *reinterpret_cast<const unsigned char*>(ptr) != 0;
  }
  float from_bits(uint32_t b) const { return kda::host::bits_float(b); }
  uint32_t to_bits(float v) const { return kda::host::float_bits(v); }
  float fp16_to_f32(uint16_t h) const { return kda::host::fp16_to_float(h); }
  uint16_t f32_to_bf16_rn(float v) const { return kda::host::float_to_bf16(v); }
  uint16_t f32_to_fp16_rn(float v) const { return kda::host::float_to_fp16(v); }
  uint32_t pack2_bf16_rn(float lo, float hi) const {
    return kda::host::float_to_bf16(lo) | (static_cast<uint32_t>(kda::host::float_to_bf16(hi)) << 16);
  }
  uint32_t pack2_fp16_rn(float lo, float hi) const {
    return kda::host::float_to_fp16(lo) | (static_cast<uint32_t>(kda::host::float_to_fp16(hi)) << 16);
  }
  float silu(float acc) const { return kda::conv::silu_host_approx(acc); }

  uint32_t ballot(bool pred) const {
    warp->votes[lane] = pred ? 1u : 0u;
    warp->barrier.wait();
    uint32_t mask = 0;
    for (int l = 0; l < 32; ++l) mask |= warp->votes[l] << l;
    warp->barrier.wait();  // nobody votes again before every lane has read this ballot
    return mask;
  }
  int32_t shfl(int32_t v, int src) const {
    check(src >= 0 && src < 32);
    warp->shuffled[lane] = v;
    warp->barrier.wait();
    const int32_t r = warp->shuffled[src & 31];
    warp->barrier.wait();  // nobody writes again before every lane has read
    return r;
  }
  void syncwarp() const { warp->barrier.wait(); }
  float* stage() const { return reinterpret_cast<float*>(warp->stage_storage.data()); }
};

// Host buffers of one problem; the element type of x and out is stored as raw 16- or 32-bit
// words so the comparison is bitwise.
struct Problem {
  DType dtype = DType::BF16;
  int64_t num_tokens = 0, dim = 0, part_dim = 0, x_row_stride = 0, out_plane_stride = 0;
  int64_t cache_lines = 0, state_len = 3;
  int64_t state_stride_line = 0, state_stride_dim = 0, state_stride_tap = 0;
  int64_t state_offset = 0;  // elements before line 0 (misaligns the state when odd)
  bool state_dtype_is_bf16 = false;  // the pool holds bf16 (state_dtype BF16); `state` then holds its values
  int64_t weight_stride_dim = 4, weight_stride_tap = 1;
  int64_t cache_stride = 1;
  bool silu = true, bias = false, flags = true;
  std::optional<int32_t> null_line = 0;
  std::vector<int32_t> qsl, cache;
  std::vector<uint8_t> init;  // bool storage
  std::vector<uint32_t> x;    // raw elements, 16-bit values in the low half
  std::vector<float> weight, bias_v, state;
  std::vector<char> out;      // raw output bytes

  std::size_t elem() const { return dtype == DType::FP32 ? 4 : 2; }
};

std::vector<char> pack_x(const Problem& pr) {
  std::vector<char> bytes(pr.x.size() * pr.elem());
  for (std::size_t i = 0; i < pr.x.size(); ++i) {
    if (pr.elem() == 2) {
      const uint16_t h = static_cast<uint16_t>(pr.x[i]);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(bytes.data() + 4 * i, &pr.x[i], 4);
    }
  }
  return bytes;
}

// The bf16 bits of pr.state, whose values fill() made bf16 values (exact).
std::vector<uint16_t> bf16_pool(const Problem& pr) {
  std::vector<uint16_t> bits(pr.state.size());
  for (std::size_t i = 0; i < bits.size(); ++i) bits[i] = kda::host::float_to_bf16(pr.state[i]);
  return bits;
}

// Arguments over `pool`, the problem's pool: fp32 elements, or bf16 bits with bf16 == true.
kda::PackedConvArgs args_for(const Problem& pr, const std::vector<char>& x_bytes, void* pool,
                             bool bf16, std::vector<char>& out) {
  kda::PackedConvArgs a;
  a.x = x_bytes.data();
  a.x_dtype = pr.dtype;
  a.num_tokens = pr.num_tokens;
  a.dim = pr.dim;
  a.x_row_stride = pr.x_row_stride;
  a.weight = pr.weight.data();
  a.weight_stride_dim = pr.weight_stride_dim;
  a.weight_stride_tap = pr.weight_stride_tap;
  a.bias = pr.bias ? pr.bias_v.data() : nullptr;
  a.conv_states = kda::state_elem_ptr(pool, pr.state_offset, bf16);
  a.state_dtype = bf16 ? DType::BF16 : DType::FP32;
  a.varlen.cache_lines = pr.cache_lines;
  a.state_len = pr.state_len;
  a.state_stride_line = pr.state_stride_line;
  a.state_stride_dim = pr.state_stride_dim;
  a.state_stride_tap = pr.state_stride_tap;
  a.varlen.query_start_loc = pr.qsl.data();
  a.varlen.num_seqs = static_cast<int64_t>(pr.qsl.size()) - 1;
  a.varlen.cache_indices = pr.cache.data();
  a.cache_indices_stride = pr.cache_stride;
  a.varlen.has_initial_state = pr.flags ? reinterpret_cast<const bool*>(pr.init.data()) : nullptr;
  a.part_dim = pr.part_dim;
  a.silu = pr.silu;
  a.varlen.null_line = pr.null_line;
  a.out = out.data();
  a.out_plane_stride = pr.out_plane_stride;
  return a;
}

template <DType kDType, int kVec>
void run_instance(const kda::conv::PackedConvParams& p, const std::vector<char>& x_bytes,
                  const Problem& pr, Range state, const std::vector<char>& out, int64_t& bad_access) {
  using Traits = kda::conv::PackedConvTraits<kDType, kVec>;
  Warp warp;
  warp.stage_storage.resize(static_cast<std::size_t>(kda::conv::staging_floats_per_warp(Traits::kTile)) / 4 + 1);
  warp.x = range_of(x_bytes);
  warp.out = range_of(out);
  warp.weight = range_of(pr.weight);
  warp.bias = range_of(pr.bias_v);
  warp.qsl = range_of(pr.qsl);
  warp.cache = range_of(pr.cache);
  warp.flags = range_of(pr.init);
  warp.state = state;
  warp.stage = range_of(warp.stage_storage);

  // Every (CTA program group, plane, column block) of the grid, one after another on one
  // emulated warp; each searches its first chunk as every warp of the kernel does.
  std::vector<std::thread> lanes;
  for (int lane = 0; lane < 32; ++lane) {
    lanes.emplace_back([&, lane] {
      HostOps ops{&warp, lane};
      for (int64_t cta = 0; cta < p.cta_programs; ++cta)
        for (int64_t plane = 0; plane < p.planes; ++plane)
          for (int64_t col = 0; col < p.cols_per_plane; ++col) {
            const int64_t first = cta * p.chunks_per_cta;
            const int count = kda::conv::cta_program_count(p, cta);
            const kda::varlen::SlotChunk pc = kda::conv::locate_chunk(p, first, lane, ops);
            warp.barrier.wait();  // the search's ballots are done before the body's
            if (p.silu && p.bias) {
              kda::conv::packed_conv_programs<Traits, true, true>(p, pc, first, count, plane, col, lane, ops);
            } else if (p.silu) {
              kda::conv::packed_conv_programs<Traits, true, false>(p, pc, first, count, plane, col, lane, ops);
            } else if (p.bias) {
              kda::conv::packed_conv_programs<Traits, false, true>(p, pc, first, count, plane, col, lane, ops);
            } else {
              kda::conv::packed_conv_programs<Traits, false, false>(p, pc, first, count, plane, col, lane, ops);
            }
            warp.barrier.wait();  // the next group starts when every lane is done with this one
          }
    });
  }
  for (auto& t : lanes) t.join();
  bad_access += warp.bad_access.load();
}

template <DType kDType>
void run_for_vec(const kda::conv::PackedConvParams& p, const std::vector<char>& x_bytes,
                 const Problem& pr, Range state, const std::vector<char>& out, int64_t& bad) {
  switch (p.vec) {
    case 8: return run_instance<kDType, 8>(p, x_bytes, pr, state, out, bad);
    case 4: return run_instance<kDType, 4>(p, x_bytes, pr, state, out, bad);
    case 2: return run_instance<kDType, 2>(p, x_bytes, pr, state, out, bad);
    default: return run_instance<kDType, 1>(p, x_bytes, pr, state, out, bad);
  }
}

// Random data for a problem whose shape fields and metadata are set.
void fill(Problem& pr, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  pr.x.resize(static_cast<std::size_t>(pr.num_tokens > 0 ? (pr.num_tokens - 1) * pr.x_row_stride + pr.dim : 0));
  for (auto& e : pr.x) {
    const float v = normal(rng);
    e = pr.dtype == DType::BF16 ? kda::host::float_to_bf16(v)
        : pr.dtype == DType::FP16 ? kda::host::float_to_fp16(v)
                                  : kda::host::float_bits(v);
  }
  pr.weight.resize(static_cast<std::size_t>((pr.dim - 1) * pr.weight_stride_dim + 3 * pr.weight_stride_tap + 1));
  for (auto& w : pr.weight) w = normal(rng) * 0.5f;
  pr.bias_v.resize(static_cast<std::size_t>(pr.dim));
  for (auto& b : pr.bias_v) b = normal(rng);
  const int64_t line_extent = (pr.dim - 1) * pr.state_stride_dim + (pr.state_len - 1) * pr.state_stride_tap + 1;
  pr.state.resize(static_cast<std::size_t>(pr.state_offset + (pr.cache_lines - 1) * pr.state_stride_line + line_extent + 5));
  for (auto& s : pr.state) s = pr.state_dtype_is_bf16 ? kda::host::bf16_round(normal(rng)) : normal(rng);
  const int64_t planes = pr.dim / pr.part_dim;
  const int64_t plane_stride = pr.out_plane_stride ? pr.out_plane_stride : pr.num_tokens * pr.part_dim;
  pr.out.assign(static_cast<std::size_t>(((planes - 1) * plane_stride + pr.num_tokens * pr.part_dim) * static_cast<int64_t>(pr.elem())), static_cast<char>(0xFF));  // NaN poison
}

// Runs the emulated kernel and the reference on copies of the same buffers; returns the
// differing output bytes and state elements. A bf16-state problem also runs the emulation on an
// fp32 pool of the same values: the bf16 run's outputs must be its outputs and its taps its
// taps rounded to bf16 (exact: they are bf16 inputs and old bf16 taps).
struct Outcome {
  int64_t out_diff = 0, state_diff = 0, bad_access = 0, out_written = 0, state_written = 0;
  int64_t fp32_out_diff = 0, fp32_state_diff = 0;  // bf16 state only: vs the fp32-pool run
};

// The emulated kernel over the problem with `pool` (whose bytes `state` spans) as its state.
void run_emulation(const Problem& pr, const kda::conv::ConvTuning& tuning, const std::vector<char>& x_bytes,
                   void* pool, bool bf16, Range state, std::vector<char>& out, int64_t& bad_access) {
  const kda::PackedConvArgs a = args_for(pr, x_bytes, pool, bf16, out);
  std::string why;
  REQUIRE_MESSAGE(kda::packed_causal_conv1d_supported(a, &why), why);
  REQUIRE_MESSAGE(kda::conv::check_tuning(a, tuning).empty(), kda::conv::check_tuning(a, tuning));
  const kda::conv::PackedConvParams p = kda::conv::make_params(a, tuning);
  REQUIRE(p.state_dtype_is_bf16 == bf16);
  if (pr.num_tokens == 0 || a.varlen.num_seqs == 0) return;
  switch (pr.dtype) {
    case DType::BF16: run_for_vec<DType::BF16>(p, x_bytes, pr, state, out, bad_access); break;
    case DType::FP16: run_for_vec<DType::FP16>(p, x_bytes, pr, state, out, bad_access); break;
    case DType::FP32: run_for_vec<DType::FP32>(p, x_bytes, pr, state, out, bad_access); break;
  }
}

Outcome compare(const Problem& pr, const kda::conv::ConvTuning& tuning) {
  const std::vector<char> x_bytes = pack_x(pr);
  std::vector<float> state_emu = pr.state, state_ref = pr.state;
  std::vector<char> out_emu = pr.out, out_ref = pr.out;

  Outcome o;
  if (!pr.state_dtype_is_bf16) {
    run_emulation(pr, tuning, x_bytes, state_emu.data(), false, range_of(state_emu), out_emu, o.bad_access);
    kda::reference::causal_conv1d(args_for(pr, x_bytes, state_ref.data(), false, out_ref),
                                  kda::reference::ConvMath::kStockFp32);
    for (std::size_t i = 0; i < state_emu.size(); ++i) {
      if (std::memcmp(&state_emu[i], &state_ref[i], 4) != 0) ++o.state_diff;
      if (std::memcmp(&state_ref[i], &pr.state[i], 4) != 0) ++o.state_written;
    }
  } else {
    const std::vector<uint16_t> start16 = bf16_pool(pr);
    std::vector<uint16_t> emu16 = start16, ref16 = start16;
    run_emulation(pr, tuning, x_bytes, emu16.data(), true, range_of(emu16), out_emu, o.bad_access);
    kda::reference::causal_conv1d(args_for(pr, x_bytes, ref16.data(), true, out_ref),
                                  kda::reference::ConvMath::kStockFp32);
    std::vector<char> out32 = pr.out;
    run_emulation(pr, tuning, x_bytes, state_emu.data(), false, range_of(state_emu), out32, o.bad_access);
    for (std::size_t i = 0; i < emu16.size(); ++i) {
      o.state_diff += emu16[i] != ref16[i];
      o.state_written += ref16[i] != start16[i];
      o.fp32_state_diff += emu16[i] != kda::host::float_to_bf16(state_emu[i]);
    }
    for (std::size_t i = 0; i < out_emu.size(); ++i) o.fp32_out_diff += out_emu[i] != out32[i];
  }
  for (std::size_t i = 0; i < out_emu.size(); ++i) {
    if (out_emu[i] != out_ref[i]) ++o.out_diff;
    if (out_ref[i] != pr.out[i]) ++o.out_written;
  }
  return o;
}

// A batch with every awkward sequence kind: 0..3 tokens, chunk-sized and chunk-plus-one,
// long ones, skipped ones (null block, out of range), sequences without initial state, and
// capacity padding; rows past the last sequence stay unwritten.
void awkward_batch(Problem& pr, int64_t lines) {
  const std::vector<int32_t> lens = {5, 0, 1, 2, 3, 16, 17, 64, 65, 8, 9, 130, 2, 1, 33, 7, 0, 0};
  pr.qsl = {0};
  for (int32_t len : lens) pr.qsl.push_back(pr.qsl.back() + len);
  pr.num_tokens = pr.qsl.back() + 11;  // spare rows
  const int64_t n = static_cast<int64_t>(lens.size());
  // Distinct lines 1..; sequence 3 and 9 on the null line 0, sequence 6 out of range, 12 negative.
  pr.cache.assign(static_cast<std::size_t>(n * pr.cache_stride), -77);
  int32_t next_line = 1;
  for (int64_t s = 0; s < n; ++s) {
    int32_t line = next_line++;
    if (s == 3 || s == 9) line = 0;
    if (s == 6) line = static_cast<int32_t>(lines);
    if (s == 12) line = -2;
    pr.cache[static_cast<std::size_t>(s * pr.cache_stride)] = line;
  }
  REQUIRE(next_line <= lines);
  pr.cache_lines = lines;
  pr.init.assign(static_cast<std::size_t>(n), 0);
  for (int64_t s = 0; s < n; ++s) pr.init[static_cast<std::size_t>(s)] = (s % 3 != 1) ? 1 : 0;
}

void set_state_layout(Problem& pr, const std::string& layout) {
  if (layout == "contiguous") {
    pr.state_len = 3;
    pr.state_stride_dim = 3;
    pr.state_stride_tap = 1;
    pr.state_stride_line = 3 * pr.dim;
  } else if (layout == "transposed") {
    pr.state_len = 3;
    pr.state_stride_dim = 1;
    pr.state_stride_tap = pr.dim;
    pr.state_stride_line = 3 * pr.dim;
  } else if (layout == "state_len 4, padded lines") {
    pr.state_len = 4;
    pr.state_stride_dim = 4;
    pr.state_stride_tap = 1;
    pr.state_stride_line = 4 * pr.dim + 12;
  } else {  // "odd strides": scalar walks only
    pr.state_len = 3;
    pr.state_stride_dim = 1;
    pr.state_stride_tap = pr.dim + 1;
    pr.state_stride_line = 3 * (pr.dim + 1) + 1;
  }
}

Problem base_problem(DType dtype) {
  Problem pr;
  pr.dtype = dtype;
  pr.part_dim = 256;
  pr.dim = 2 * 256;
  pr.x_row_stride = pr.dim + 64;
  awkward_batch(pr, 24);
  set_state_layout(pr, "contiguous");
  return pr;
}

// One 700-token sequence with an initial state on line 3 (44 chunks of 16 tokens).
Problem one_long_sequence() {
  Problem pr = base_problem(DType::BF16);
  pr.qsl = {0, 700};
  pr.cache = {3};
  pr.init = {1};
  pr.num_tokens = 700;
  return pr;
}

void check_outcome(const Outcome& o) {
  CHECK(o.bad_access == 0);
  CHECK(o.out_diff == 0);
  CHECK(o.state_diff == 0);
  // The comparison is not vacuous: the reference wrote outputs and states.
  CHECK(o.out_written > 0);
  CHECK(o.state_written > 0);
  CHECK(o.fp32_out_diff == 0);
  CHECK(o.fp32_state_diff == 0);
}

}  // namespace

// The kernel's map (locate_chunk: radix search by ballots, the sequence's bounds by shuffles
// from the last level's loads) against the scalar map, for every lane, on batches that hit
// its edge cases: one sequence, a last-level answer in lane 31 (the bound then needs a load),
// empty sequences, 40,000 sequences (three levels), and a malformed (decreasing) qsl.
TEST_CASE("the warp map with shuffled sequence bounds equals the scalar map on every lane") {
  std::mt19937_64 rng(2026);
  struct Case {
    const char* name;
    std::vector<int32_t> qsl;
  };
  std::vector<Case> cases;
  cases.push_back({"one sequence", {0, 1000}});
  {
    std::vector<int32_t> q{0};
    for (int s = 0; s < 64; ++s) q.push_back(q.back() + static_cast<int32_t>(rng() % 40));
    cases.push_back({"64 sequences of 0..39 tokens", q});
  }
  {
    std::vector<int32_t> q{0};
    for (int s = 0; s < 32; ++s) q.push_back(q.back() + (s == 31 ? 500 : 3));
    cases.push_back({"32 sequences, the long one last (lane 31)", q});
  }
  {
    std::vector<int32_t> q{0};
    for (int s = 0; s < 40000; ++s) q.push_back(q.back() + static_cast<int32_t>(rng() % 4));
    cases.push_back({"40000 sequences of 0..3 tokens", q});
  }
  cases.push_back({"malformed: decreasing", {0, 50, 20, 90, 90, 10, 200}});
  for (const Case& c : cases) {
    CAPTURE(c.name);
    const int64_t num_seqs = static_cast<int64_t>(c.qsl.size()) - 1;
    const int shift = 4;
    const int steps = kda::varlen::search_steps(num_seqs);
    const int64_t stride = kda::varlen::search_stride(steps);
    const int64_t programs = kda::varlen::slot_count(c.qsl.back() + 64, num_seqs, shift);
    std::vector<int64_t> ps;
    for (int64_t p = 0; p < programs; ++p)
      if (programs <= 3000 || p % 37 == 0 || p < 200 || p > programs - 200) ps.push_back(p);
    kda::conv::PackedConvParams params;
    params.query_start_loc = c.qsl.data();
    params.num_seqs = num_seqs;
    params.chunk_shift = shift;
    params.search_steps = steps;
    params.search_stride = stride;
    Warp warp;
    warp.qsl = range_of(c.qsl);
    std::atomic<int64_t> mismatches{0};
    std::vector<std::thread> lanes;
    for (int lane = 0; lane < 32; ++lane) {
      lanes.emplace_back([&, lane] {
        HostOps ops{&warp, lane};
        for (const int64_t p : ps) {
          const kda::varlen::SlotChunk w = kda::conv::locate_chunk(params, p, lane, ops);
          const kda::varlen::SlotChunk r =
              kda::varlen::locate_slot_scalar(c.qsl.data(), num_seqs, shift, steps, stride, p);
          const bool same = w.seq == r.seq && (r.seq < 0 || (w.chunk == r.chunk && w.begin == r.begin &&
                                                            w.end == r.end && w.seq_begin == r.seq_begin &&
                                                            w.seq_end == r.seq_end));
          if (!same) mismatches.fetch_add(1);
        }
      });
    }
    for (auto& t : lanes) t.join();
    CHECK(mismatches.load() == 0);
    CHECK(warp.bad_access.load() == 0);
    MESSAGE(std::string(c.name) << ": " << ps.size() << " programs x 32 lanes, " << mismatches.load() << " differ");
  }
}

TEST_CASE("the emulated kernel equals the reference bit for bit for every vector width and chunk length") {
  for (int vec : {8, 4, 2, 1}) {
    for (int chunk : {8, 16, 64}) {
      CAPTURE(vec);
      CAPTURE(chunk);
      Problem pr = base_problem(DType::BF16);
      fill(pr, 100 + vec * 10 + chunk);
      check_outcome(compare(pr, {vec, chunk, 4}));
    }
  }
}

TEST_CASE("the emulated kernel equals the reference with several chunk programs per CTA") {
  // A warp walks consecutive programs: history carried inside a sequence, a new search and
  // the state update at each boundary, empty programs between sequences skipped.
  for (int per_cta : {2, 4, 16}) {
    for (int chunk : {8, 16}) {
      CAPTURE(per_cta);
      CAPTURE(chunk);
      Problem pr = base_problem(DType::BF16);
      fill(pr, 300 + per_cta * 10 + chunk);
      check_outcome(compare(pr, {4, chunk, 4, per_cta}));
    }
  }
  SUBCASE("fp32 with a bias, no flags, vec 8") {
    Problem pr = base_problem(DType::FP32);
    pr.bias = true;
    pr.flags = false;
    fill(pr, 41);
    check_outcome(compare(pr, {8, 16, 2, 4}));
  }
  SUBCASE("one long sequence") {
    Problem pr = one_long_sequence();
    fill(pr, 42);
    check_outcome(compare(pr, {4, 16, 4, 8}));
  }
}

TEST_CASE("the emulated kernel equals the reference for fp16 and fp32 inputs") {
  for (DType dtype : {DType::FP16, DType::FP32}) {
    for (int vec : {8, 4, 1}) {
      CAPTURE(static_cast<int>(dtype));
      CAPTURE(vec);
      Problem pr = base_problem(dtype);
      fill(pr, 7 + vec);
      check_outcome(compare(pr, {vec, 16, 2}));
    }
  }
}

TEST_CASE("the emulated kernel equals the reference for every conv-state and weight layout") {
  for (const char* layout : {"contiguous", "transposed", "state_len 4, padded lines", "odd strides"}) {
    for (int vec : {4, 8, 1}) {
      CAPTURE(layout);
      CAPTURE(vec);
      Problem pr = base_problem(DType::BF16);
      set_state_layout(pr, layout);
      fill(pr, 31 + vec);
      check_outcome(compare(pr, {vec, 16, 1}));
    }
  }
  SUBCASE("a misaligned state pool takes the scalar walks") {
    Problem pr = base_problem(DType::BF16);
    pr.state_offset = 1;
    fill(pr, 5);
    check_outcome(compare(pr, {8, 16, 4}));
  }
  SUBCASE("transposed (4, dim) weights") {
    Problem pr = base_problem(DType::BF16);
    pr.weight_stride_dim = 1;
    pr.weight_stride_tap = pr.dim;
    fill(pr, 6);
    check_outcome(compare(pr, {4, 32, 4}));
  }
  SUBCASE("strided weights") {
    Problem pr = base_problem(DType::FP16);
    pr.weight_stride_dim = 5;
    pr.weight_stride_tap = 1;
    fill(pr, 8);
    check_outcome(compare(pr, {4, 32, 4}));
  }
}

// A bf16 pool moves by the bf16 scalar walks in every layout: the (lines, dim, 3) and (lines, 3,
// dim) pools, padded lines with state_len 4, odd strides, an address that is no fp32 element
// boundary. Each run is compared with the reference on bf16 lines and with the emulation on an
// fp32 pool of the same values (outputs bitwise, taps rounded to bf16).
TEST_CASE("the emulated kernel with bf16 conv-state lines equals the reference and the fp32 lines rounded") {
  SUBCASE("every pool layout, vec 4 and 1") {
    for (const char* layout : {"contiguous", "transposed", "state_len 4, padded lines", "odd strides"}) {
      for (int vec : {4, 1}) {
        CAPTURE(layout);
        CAPTURE(vec);
        Problem pr = base_problem(DType::BF16);
        pr.state_dtype_is_bf16 = true;
        set_state_layout(pr, layout);
        fill(pr, 61 + vec);
        check_outcome(compare(pr, {vec, 16, 2}));
      }
    }
  }
  SUBCASE("a pool one bf16 element past a 16-byte boundary, vec 8") {
    Problem pr = base_problem(DType::BF16);
    pr.state_dtype_is_bf16 = true;
    pr.state_offset = 1;
    fill(pr, 71);
    check_outcome(compare(pr, {8, 16, 4}));
  }
  SUBCASE("several chunk programs per CTA, bias, no flags, transposed pool") {
    Problem pr = base_problem(DType::BF16);
    pr.state_dtype_is_bf16 = true;
    pr.bias = true;
    pr.flags = false;
    set_state_layout(pr, "transposed");
    fill(pr, 72);
    check_outcome(compare(pr, {4, 8, 2, 4}));
  }
}

// Dense (dim, 4) weights load per lane as vectors, every other layout through the staging area:
// both paths at every vector width, with and without a bias.
TEST_CASE("the emulated kernel equals the reference with taps loaded per lane and staged") {
  for (DType dtype : {DType::BF16, DType::FP32}) {
    for (bool bias : {false, true}) {
      for (int vec : {1, 2, 4, 8}) {
        CAPTURE(vec);
        CAPTURE(bias);
        Problem pr = base_problem(dtype);
        pr.bias = bias;
        fill(pr, 41 + vec);
        check_outcome(compare(pr, {vec, 16, 2, 2}));
        Problem strided = pr;
        strided.weight_stride_dim = 5;
        fill(strided, 51 + vec);
        check_outcome(compare(strided, {vec, 16, 2, 2}));
      }
    }
  }
}

TEST_CASE("the emulated kernel honours bias, SiLU, flags, null block and plane stride options") {
  Problem pr = base_problem(DType::BF16);
  SUBCASE("bias and SiLU") { pr.bias = true; }
  SUBCASE("bias without SiLU") {
    pr.bias = true;
    pr.silu = false;
  }
  SUBCASE("no SiLU, no bias") { pr.silu = false; }
  SUBCASE("no has_initial_state array") { pr.flags = false; }
  SUBCASE("no null block: line 0 is an ordinary line") {
    pr.null_line.reset();
    pr.cache[9] = 20;  // sequence 3 keeps line 0; two sequences on one line would be UB
  }
  SUBCASE("a strided cache_indices") {
    pr.cache_stride = 3;
    awkward_batch(pr, 24);
  }
  SUBCASE("planes of a larger batch") { pr.out_plane_stride = (pr.num_tokens + 40) * pr.part_dim; }
  SUBCASE("four planes of 128 channels, dense rows") {
    pr.part_dim = 128;
    pr.dim = 4 * 128;
    pr.x_row_stride = pr.dim;
    set_state_layout(pr, "contiguous");
  }
  fill(pr, 99);
  for (int vec : {4, 8}) {
    if (pr.part_dim % (32 * vec) != 0) continue;
    CAPTURE(vec);
    check_outcome(compare(pr, {vec, 16, 4}));
  }
}

TEST_CASE("the emulated kernel with the default launch shape on one long sequence") {
  Problem pr = one_long_sequence();
  fill(pr, 1234);
  check_outcome(compare(pr, {}));
}

TEST_CASE("no program reads x past the last token when the batch fills the buffer") {
  // Chunks longer than the row queue end exactly at the end of x: a prefetch past a chunk's
  // end would leave the buffer and be counted as a bad access.
  for (int vec : {4, 8, 1}) {
    for (int chunk : {32, 64}) {
      CAPTURE(vec);
      CAPTURE(chunk);
      Problem pr = base_problem(DType::BF16);
      pr.qsl = {0, 40, 45, 145};
      pr.cache = {1, 2, 3};
      pr.init = {1, 0, 1};
      pr.num_tokens = 145;
      fill(pr, 77);
      check_outcome(compare(pr, {vec, chunk, 4}));
      check_outcome(compare(pr, {vec, chunk, 4, 4}));
    }
  }
}
