// GPU tests of the packed conv: bit-exact against the stock-path baseline
// (kda::baseline::stock_causal_conv1d); within a few ulps of the CPU reference in the stock
// fp32 order and within an error bound of the float64 reference (so a bug in the arithmetic
// the two GPU paths share would show); nothing written outside the rows and state lines a
// batch names; CUDA graph replays equal to eager launches. Also the conv-state checkpoint op
// (conv/conv_checkpoint.h) run before the packed conv, as the module does: every checkpoint
// line bitwise the state the stock path (and the CPU reference) leaves after the sequence cut at
// the checkpoint's end, malformed entries writing nothing, eager and replayed graphs alike.
//
// Every run draws fresh random data; the seed is printed first and KDA_TEST_SEED=<n>
// reproduces it. KDA_TEST_QUICK=1 runs the reduced set meant for compute-sanitizer: one input
// dtype per part_dim instead of three (each dtype still appears), 8x fewer elements per case,
// the 16384-token sequence at part_dim 64 and not the fp32 4096-wide one, smaller graph
// capacities with 8 replays instead of 20, and a quarter of the tunings; every other feature
// of the full set is still covered.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/half_host.h"
#include "common/state_checkpoints.h"
#include "conv/conv_checkpoint.h"
#include "conv/packed_conv.h"
#include "testing/conv_reference.h"
#include "conv/conv_math.h"
#include "conv/stock_conv.h"
#include "kda/error.h"
#include "kda/packed_conv.h"
#include "support/gpu_buffers.h"
#include "support/test_data.h"

namespace {

using kda::DType;
using kda::PackedConvArgs;
using kda::test::DeviceBuffer;
using kda::test::diff_bits;
using kda::test::Stream;

bool quick() { return kda::test::quick_mode(); }

uint64_t base_seed() {
  static const uint64_t seed = [] {
    const char* v = std::getenv("KDA_TEST_SEED");
    uint64_t s = 0;
    if (v && *v) {
      s = std::strtoull(v, nullptr, 0);
    } else {
      std::random_device rd;
      s = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
          static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    std::printf("test_packed_conv_gpu: seed %llu (set KDA_TEST_SEED=%llu to reproduce)%s\n",
                static_cast<unsigned long long>(s), static_cast<unsigned long long>(s),
                quick() ? ", KDA_TEST_QUICK=1 (reduced set)" : "");
    std::fflush(stdout);
    return s;
  }();
  return seed;
}

// splitmix64: fast, and plenty for test data.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  int64_t range(int64_t lo, int64_t hi) { return lo + below(hi - lo + 1); }  // inclusive
  float uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(static_cast<double>(next() >> 40) * 0x1p-24);
  }
  bool chance(double p) { return static_cast<double>(next() >> 11) * 0x1p-53 < p; }
  template <typename T>
  void shuffle(std::vector<T>& v) {
    for (std::size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[static_cast<std::size_t>(below(static_cast<int64_t>(i)))]);
  }

 private:
  uint64_t state_;
};

// Each test case gets its own stream of numbers, so one case reproduces alone (-tc=...).
Rng rng_for(const char* test_name) {
  uint64_t h = 1469598103934665603ull;
  for (const char* c = test_name; *c; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
  return Rng(base_seed() ^ h);
}

const char* dtype_str(DType d) {
  switch (d) {
    case DType::BF16: return "bf16";
    case DType::FP16: return "fp16";
    case DType::FP32: return "fp32";
    default: return "?";
  }
}

std::size_t elem_size(DType d) { return d == DType::FP32 ? 4 : 2; }

// One test problem. Capacities: seqs = lens.size() + seq_pad, tokens = sum(lens) + token_pad.
struct Spec {
  DType dtype = DType::BF16;
  int64_t part_dim = 128, parts = 3;
  int64_t row_pad = 0;     // x_row_stride = dim + row_pad
  int64_t x_offset = 0;    // x starts this many elements into its buffer (vector alignment)
  int64_t out_offset = 0;  // same for out
  bool explicit_plane_stride = false;  // false: out_plane_stride = 0
  int64_t plane_pad = 0;   // with explicit_plane_stride: stride = tokens * part_dim + plane_pad
  int64_t state_len = 3;
  bool transposed = false;  // (lines, state_len, dim) instead of (lines, dim, state_len)
  int64_t line_pad = 0;     // extra elements per pool line
  bool bias = false, silu = true;
  // 0: dense (dim, 4), which the kernel loads per lane; 1: (4, dim); 2: (dim, 4) rows 5 floats
  // apart; 3: dense but 4 bytes past a 16-byte boundary. 1-3 take the staged walks.
  int weight_layout = 0;
  int64_t cache_stride = 1;
  std::optional<int32_t> null_line = 0;
  bool null_init_flags = false;  // has_initial_state = nullptr
  int64_t seq_pad = 0, token_pad = 0;
  std::vector<int32_t> lens;
  double init_frac = 0.5, null_frac = 0.1, oob_frac = 0.05;
  int64_t extra_lines = 0;  // pool lines past those the batch can name (checkpoint lines)
};

struct HostProblem {
  Spec spec;
  int64_t dim = 0, tokens = 0, seqs = 0, lines = 0, x_stride = 0;
  int64_t plane = 0;      // effective plane stride in elements
  int64_t out_elems = 0;  // the whole out buffer: offset, planes, gaps and a guard
  int64_t state_line = 0, state_dim = 0, state_tap = 0;
  int64_t weight_offset = 0, weight_dim = 4, weight_tap = 1;  // the weight view, in floats
  std::vector<unsigned char> x;  // x_dtype elements
  std::vector<float> weight, bias, states;
  // Batch metadata and what it implies.
  std::vector<int32_t> qsl, cache;
  std::vector<unsigned char> init;       // 0/1 bytes, as bool on the device
  std::vector<unsigned char> row_runs;   // per token: some running sequence owns it
  std::vector<unsigned char> line_runs;  // per line: a running sequence names it
  int64_t running_seqs = 0, produced_rows = 0;

  std::size_t esize() const { return elem_size(spec.dtype); }
  std::unique_ptr<bool[]> init_bools() const {
    std::unique_ptr<bool[]> b(new bool[init.size() + 1]);
    for (std::size_t i = 0; i < init.size(); ++i) b[i] = init[i] != 0;
    return b;
  }
};

constexpr int64_t kGuardElems = 64;

void store_x(HostProblem& hp, int64_t index, float v) {
  if (hp.spec.dtype == DType::FP32) {
    std::memcpy(&hp.x[static_cast<std::size_t>(index) * 4], &v, 4);
  } else {
    const uint16_t h =
        hp.spec.dtype == DType::BF16 ? kda::host::float_to_bf16(v) : kda::host::float_to_fp16(v);
    std::memcpy(&hp.x[static_cast<std::size_t>(index) * 2], &h, 2);
  }
}

bool is_skipped(const HostProblem& hp, int32_t line) {
  if (hp.spec.null_line && line == *hp.spec.null_line) return true;
  return line < 0 || line >= hp.lines;
}

// New batch metadata for `lens` (at most hp.seqs sequences, at most hp.tokens tokens): real
// lines are distinct, some sequences name the null line or an out-of-range index, sequences
// past lens have zero length and name the null line (or -1 without one).
void fill_batch(Rng& rng, HostProblem& hp, const std::vector<int32_t>& lens) {
  const Spec& s = hp.spec;
  const int64_t real = static_cast<int64_t>(lens.size());
  REQUIRE(real <= hp.seqs);
  hp.qsl.assign(static_cast<std::size_t>(hp.seqs + 1), 0);
  for (int64_t i = 0; i < hp.seqs; ++i) hp.qsl[i + 1] = hp.qsl[i] + (i < real ? lens[i] : 0);
  REQUIRE(hp.qsl[hp.seqs] <= hp.tokens);

  std::vector<int32_t> free_lines;
  for (int32_t l = 0; l < hp.lines; ++l)
    if (!(s.null_line && l == *s.null_line)) free_lines.push_back(l);
  rng.shuffle(free_lines);
  const int32_t pad_line = s.null_line ? *s.null_line : -1;
  const int32_t oob[] = {-1, -2, static_cast<int32_t>(hp.lines), static_cast<int32_t>(hp.lines + 1),
                         std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
  hp.cache.assign(static_cast<std::size_t>(std::max<int64_t>(hp.seqs, 1) * s.cache_stride), 0x3FFFFFFF);
  hp.init.assign(static_cast<std::size_t>(std::max<int64_t>(hp.seqs, 1)), 0);
  for (int64_t i = 0; i < hp.seqs; ++i) {
    int32_t line = pad_line;
    if (i < real) {
      if (s.null_line && rng.chance(s.null_frac))
        line = *s.null_line;
      else if (rng.chance(s.oob_frac))
        line = oob[rng.below(6)];
      else if (!free_lines.empty()) {
        line = free_lines.back();
        free_lines.pop_back();
      }
    }
    hp.cache[static_cast<std::size_t>(i * s.cache_stride)] = line;
    hp.init[static_cast<std::size_t>(i)] = rng.chance(s.init_frac) ? 1 : 0;
  }

  hp.row_runs.assign(static_cast<std::size_t>(hp.tokens), 0);
  hp.line_runs.assign(static_cast<std::size_t>(hp.lines), 0);
  hp.running_seqs = hp.produced_rows = 0;
  for (int64_t i = 0; i < hp.seqs; ++i) {
    const int32_t line = hp.cache[static_cast<std::size_t>(i * s.cache_stride)];
    if (hp.qsl[i + 1] == hp.qsl[i] || is_skipped(hp, line)) continue;
    ++hp.running_seqs;
    hp.line_runs[static_cast<std::size_t>(line)] = 1;
    for (int64_t t = hp.qsl[i]; t < hp.qsl[i + 1]; ++t) hp.row_runs[static_cast<std::size_t>(t)] = 1;
    hp.produced_rows += hp.qsl[i + 1] - hp.qsl[i];
  }
}

HostProblem make_problem(const Spec& spec, Rng& rng) {
  HostProblem hp;
  hp.spec = spec;
  hp.dim = spec.part_dim * spec.parts;
  int64_t total = 0;
  for (int32_t l : spec.lens) total += l;
  hp.tokens = total + spec.token_pad;
  hp.seqs = static_cast<int64_t>(spec.lens.size()) + spec.seq_pad;
  hp.lines = std::max<int64_t>(static_cast<int64_t>(spec.lens.size()) + 4, 9) + spec.extra_lines;  // null line 7 fits
  hp.x_stride = hp.dim + spec.row_pad;
  hp.plane = hp.tokens * spec.part_dim + (spec.explicit_plane_stride ? spec.plane_pad : 0);
  hp.out_elems = spec.out_offset + (spec.parts - 1) * hp.plane + hp.tokens * spec.part_dim + kGuardElems;

  // Padding columns and rows past the batch hold NaN: using them would show in the outputs.
  hp.x.assign(static_cast<std::size_t>(spec.x_offset + hp.tokens * hp.x_stride) * hp.esize(), 0xFF);
  for (int64_t t = 0; t < total; ++t)
    for (int64_t c = 0; c < hp.dim; ++c) store_x(hp, spec.x_offset + t * hp.x_stride + c, rng.uniform(-3.0f, 3.0f));
  switch (spec.weight_layout) {
    case 1: hp.weight_dim = 1; hp.weight_tap = hp.dim; break;
    case 2: hp.weight_dim = 5; break;
    case 3: hp.weight_offset = 1; break;
    default: break;
  }
  hp.weight.resize(static_cast<std::size_t>(hp.weight_offset + (hp.dim - 1) * hp.weight_dim + 3 * hp.weight_tap + 1));
  for (float& w : hp.weight) w = rng.uniform(-1.0f, 1.0f);
  if (spec.bias) {
    hp.bias.resize(static_cast<std::size_t>(hp.dim));
    for (float& b : hp.bias) b = rng.uniform(-1.0f, 1.0f);
  }
  hp.state_tap = spec.transposed ? hp.dim : 1;
  hp.state_dim = spec.transposed ? 1 : spec.state_len;
  hp.state_line = spec.state_len * hp.dim + spec.line_pad;
  hp.states.resize(static_cast<std::size_t>(hp.lines * hp.state_line));
  for (float& v : hp.states) v = rng.uniform(-3.0f, 3.0f);
  fill_batch(rng, hp, spec.lens);
  return hp;
}

// Arguments over either device or host copies of the problem's arrays.
PackedConvArgs make_args(const HostProblem& hp, const void* x, const float* weight, const float* bias,
                         float* states, const int32_t* qsl, const int32_t* cache, const bool* init,
                         void* out) {
  const Spec& s = hp.spec;
  PackedConvArgs a;
  a.x = static_cast<const char*>(x) + s.x_offset * hp.esize();
  a.x_dtype = s.dtype;
  a.num_tokens = hp.tokens;
  a.dim = hp.dim;
  a.x_row_stride = hp.x_stride;
  a.weight = weight + hp.weight_offset;
  a.weight_stride_dim = hp.weight_dim;
  a.weight_stride_tap = hp.weight_tap;
  a.bias = s.bias ? bias : nullptr;
  a.conv_states = states;
  a.varlen.cache_lines = hp.lines;
  a.state_len = s.state_len;
  a.state_stride_line = hp.state_line;
  a.state_stride_dim = hp.state_dim;
  a.state_stride_tap = hp.state_tap;
  a.varlen.query_start_loc = qsl;
  a.varlen.num_seqs = hp.seqs;
  a.varlen.cache_indices = cache;
  a.cache_indices_stride = s.cache_stride;
  a.varlen.has_initial_state = s.null_init_flags ? nullptr : init;
  a.part_dim = s.part_dim;
  a.silu = s.silu;
  a.varlen.null_line = s.null_line;
  a.out = static_cast<char*>(out) + s.out_offset * hp.esize();
  a.out_plane_stride = s.explicit_plane_stride ? hp.plane : 0;
  return a;
}

DeviceBuffer upload_bytes(const void* data, std::size_t bytes) {
  DeviceBuffer b(std::max<std::size_t>(bytes, 64));  // never null, even for empty arrays
  b.fill_bytes(0);
  b.upload(data, bytes);
  return b;
}

template <typename T>
DeviceBuffer upload_vec(const std::vector<T>& v) {
  return upload_bytes(v.data(), v.size() * sizeof(T));
}

struct DeviceInputs {
  DeviceBuffer x, weight, bias, qsl, cache, init;
  explicit DeviceInputs(const HostProblem& hp)
      : x(upload_vec(hp.x)), weight(upload_vec(hp.weight)), bias(upload_vec(hp.bias)),
        qsl(upload_vec(hp.qsl)), cache(upload_vec(hp.cache)), init(upload_vec(hp.init)) {}
  // New metadata of the same capacities into the same buffers (graph replays read them).
  void upload_batch(const HostProblem& hp) {
    qsl.upload(hp.qsl);
    cache.upload(hp.cache);
    init.upload(hp.init);
    kda::test::device_synchronize();
  }
};

struct Result {
  std::vector<unsigned char> out;
  std::vector<float> states;
};

struct DeviceOutputs {
  DeviceBuffer states, out;
  explicit DeviceOutputs(const HostProblem& hp)
      : states(hp.states.size() * sizeof(float)), out(static_cast<std::size_t>(hp.out_elems) * hp.esize()) {}
  // Uploads and memsets run on the legacy stream, which the tests' non-blocking stream does
  // not wait for, and may return before they finish: synchronise before any launch.
  void reset(const HostProblem& hp) {
    states.upload(hp.states);
    out.fill_bytes(0xFF);
    kda::test::device_synchronize();
  }
  Result download() const {
    Result r;
    r.out.resize(out.bytes());
    out.download(r.out.data(), r.out.size());
    r.states = states.download_as<float>();
    return r;
  }
};

PackedConvArgs device_args(const HostProblem& hp, const DeviceInputs& in, DeviceOutputs& o) {
  return make_args(hp, in.x.get(), in.weight.as<float>(), in.bias.as<float>(), o.states.as<float>(),
                   in.qsl.as<int32_t>(), in.cache.as<int32_t>(), in.init.as<bool>(), o.out.get());
}

void run_stock(const PackedConvArgs& a, cudaStream_t stream) {
  const std::size_t bytes = kda::baseline::stock_causal_conv1d_workspace_bytes(a);
  DeviceBuffer ws(bytes);
  kda::baseline::stock_causal_conv1d(a, ws.get(), bytes, stream);
  KDA_TEST_CUDA(cudaStreamSynchronize(stream));
}

std::size_t out_elem_offset(const HostProblem& hp, int64_t part, int64_t t, int64_t c) {
  return static_cast<std::size_t>(hp.spec.out_offset + part * hp.plane + t * hp.spec.part_dim + c);
}

bool is_poison(const unsigned char* p, std::size_t n) {
  static const std::vector<unsigned char> poison(4096, 0xFF);
  for (std::size_t done = 0; done < n; done += poison.size())
    if (std::memcmp(p + done, poison.data(), std::min(poison.size(), n - done)) != 0) return false;
  return true;
}

// Calls f(byte offset of the row in out) for every output row a running sequence owns.
template <typename F>
void for_running_rows(const HostProblem& hp, F&& f) {
  for (int64_t part = 0; part < hp.spec.parts; ++part)
    for (int64_t t = 0; t < hp.tokens; ++t)
      if (hp.row_runs[static_cast<std::size_t>(t)]) f(out_elem_offset(hp, part, t, 0) * hp.esize());
}

// What a result wrote where it must not, and what it failed to write.
struct Leaks {
  int64_t out_outside = 0;     // elements outside the running rows that are not poison
  int64_t out_unwritten = 0;   // elements of running rows still poison
  int64_t state_outside = 0;   // state elements other than taps 0..2 of running lines that changed
};

Leaks find_leaks(const HostProblem& hp, const Result& r) {
  Leaks k;
  const std::size_t e = hp.esize();
  const std::size_t row_bytes = static_cast<std::size_t>(hp.spec.part_dim) * e;
  std::vector<unsigned char> out = r.out;
  for_running_rows(hp, [&](std::size_t row) {
    for (std::size_t i = row; i < row + row_bytes; i += e) k.out_unwritten += is_poison(&out[i], e);
    std::memset(&out[row], 0xFF, row_bytes);
  });
  if (!is_poison(out.data(), out.size()))
    for (std::size_t i = 0; i + e <= out.size(); i += e) k.out_outside += !is_poison(&out[i], e);

  std::vector<float> st = r.states;
  for (int64_t line = 0; line < hp.lines; ++line) {
    if (!hp.line_runs[static_cast<std::size_t>(line)]) continue;
    for (int64_t c = 0; c < hp.dim; ++c)
      for (int64_t tap = 0; tap < 3; ++tap) {
        const std::size_t i = static_cast<std::size_t>(line * hp.state_line + c * hp.state_dim + tap * hp.state_tap);
        st[i] = hp.states[i];
      }
  }
  k.state_outside = kda::test::diff_elements(st.data(), hp.states.data(), st.size() * sizeof(float), sizeof(float));
  return k;
}

Result run_reference(const HostProblem& hp) {
  Result ref;
  ref.states = hp.states;
  ref.out.assign(static_cast<std::size_t>(hp.out_elems) * hp.esize(), 0xFF);
  const std::unique_ptr<bool[]> init = hp.init_bools();
  const PackedConvArgs a = make_args(hp, hp.x.data(), hp.weight.data(), hp.bias.data(), ref.states.data(),
                                     hp.qsl.data(), hp.cache.data(), init.get(), ref.out.data());
  kda::reference::causal_conv1d(a, kda::reference::ConvMath::kStockFp32);
  return ref;
}

// Sign-magnitude bits mapped to a line, so that a difference counts ulps (+0 and -0 coincide).
int64_t ordered(uint32_t u, int bits) {
  const uint32_t sign = 1u << (bits - 1);
  const int64_t mag = u & (sign - 1);
  return (u & sign) ? -mag : mag;
}

struct RefDiff {
  int64_t state_bits = 0;  // the state is a copy of inputs: exact
  int64_t out_bits = 0;    // without SiLU the arithmetic is exactly the stock one
  int64_t beyond_tol = 0;  // with SiLU: elements more than max_ulps_allowed apart
  int64_t max_ulps = 0;
};

// ex2.approx.f32 and div.full.f32 against std::exp2 and IEEE division: a few fp32 ulps,
// at most one ulp after rounding to 16 bits.
int64_t allowed_ulps(DType d) { return d == DType::FP32 ? 8 : 2; }

RefDiff compare_with_reference(const HostProblem& hp, const Result& ref, const Result& gpu) {
  RefDiff d;
  d.state_bits = diff_bits(ref.states.data(), gpu.states.data(), ref.states.size() * sizeof(float));
  d.out_bits = diff_bits(ref.out.data(), gpu.out.data(), ref.out.size());
  const std::size_t e = hp.esize();
  const int bits = static_cast<int>(e * 8);
  const int64_t allowed = allowed_ulps(hp.spec.dtype);
  const std::size_t row_bytes = static_cast<std::size_t>(hp.spec.part_dim) * e;
  for_running_rows(hp, [&](std::size_t row) {
    if (std::memcmp(&ref.out[row], &gpu.out[row], row_bytes) == 0) return;
    for (std::size_t i = row; i < row + row_bytes; i += e) {
      uint32_t a = 0, b = 0;
      std::memcpy(&a, &ref.out[i], e);
      std::memcpy(&b, &gpu.out[i], e);
      const int64_t u = std::llabs(ordered(a, bits) - ordered(b, bits));
      d.max_ulps = std::max(d.max_ulps, u);
      d.beyond_tol += u > allowed;
    }
  });
  return d;
}

// The float64 reference (std::exp, no fp32 rounding inside) and, for its tolerance, the same
// conv over |x|, |w|, |bias|, |state| without SiLU: the sum of the magnitudes of the terms,
// which bounds the fp32 accumulation error of the stock order.
struct Float64Ref {
  Result value, magnitude;
};

Float64Ref run_float64_reference(const HostProblem& hp) {
  Float64Ref r;
  const std::unique_ptr<bool[]> init = hp.init_bools();
  r.value.states = hp.states;
  r.value.out.assign(static_cast<std::size_t>(hp.out_elems) * hp.esize(), 0xFF);
  kda::reference::causal_conv1d(make_args(hp, hp.x.data(), hp.weight.data(), hp.bias.data(), r.value.states.data(),
                                          hp.qsl.data(), hp.cache.data(), init.get(), r.value.out.data()),
                                kda::reference::ConvMath::kFloat64);
  std::vector<unsigned char> x = hp.x;  // clear every sign bit (NaN padding stays NaN)
  for (std::size_t i = hp.esize() - 1; i < x.size(); i += hp.esize()) x[i] &= 0x7F;
  std::vector<float> weight = hp.weight, bias = hp.bias;
  r.magnitude.states = hp.states;
  for (std::vector<float>* v : {&weight, &bias, &r.magnitude.states})
    for (float& f : *v) f = std::fabs(f);
  r.magnitude.out.assign(static_cast<std::size_t>(hp.out_elems) * hp.esize(), 0xFF);
  PackedConvArgs a = make_args(hp, x.data(), weight.data(), bias.data(), r.magnitude.states.data(), hp.qsl.data(),
                               hp.cache.data(), init.get(), r.magnitude.out.data());
  a.silu = false;
  kda::reference::causal_conv1d(a, kda::reference::ConvMath::kFloat64);
  return r;
}

float out_value(const HostProblem& hp, const Result& r, std::size_t elem) {
  const std::size_t e = hp.esize();
  uint32_t u = 0;
  std::memcpy(&u, &r.out[elem * e], e);
  switch (hp.spec.dtype) {
    case DType::BF16: return kda::host::bf16_to_float(static_cast<uint16_t>(u));
    case DType::FP16: return kda::host::fp16_to_float(static_cast<uint16_t>(u));
    default: return kda::host::bits_float(u);
  }
}

// One ulp of |v| (a value of the output dtype) in that dtype; subnormal spacing below the
// normals. Exponent arithmetic on the fp32 bits: this runs for every output element.
double dtype_ulp(DType d, float v) {
  const int digits = d == DType::BF16 ? 8 : d == DType::FP16 ? 11 : 24;
  const int min_exp = d == DType::FP16 ? -14 : -126;
  const int biased = static_cast<int>((kda::host::float_bits(v) >> 23) & 0xFF);
  const int e = std::max(biased - 127, min_exp);
  return std::ldexp(1.0, e - (digits - 1));
}

// Elements of `gpu` farther from the float64 reference than allowed_ulps output ulps plus
// 8 fp32 ulps of the terms' magnitude (four rounded fmas; SiLU's slope is below 1.1).
int64_t beyond_float64_tolerance(const HostProblem& hp, const Float64Ref& ref, const Result& gpu, double* worst) {
  int64_t n = 0;
  const std::size_t e = hp.esize();
  const double allowed = static_cast<double>(allowed_ulps(hp.spec.dtype));
  for_running_rows(hp, [&](std::size_t row) {
    const std::size_t first = row / e;
    for (std::size_t i = first; i < first + static_cast<std::size_t>(hp.spec.part_dim); ++i) {
      const float want = out_value(hp, ref.value, i), got = out_value(hp, gpu, i);
      const double tol = allowed * dtype_ulp(hp.spec.dtype, want) + 8.0 * 0x1p-24 * out_value(hp, ref.magnitude, i);
      const double err = std::fabs(static_cast<double>(got) - want) / tol;
      if (!(err <= 1.0)) ++n;
      if (worst && err > *worst) *worst = err;
    }
  });
  return n;
}

std::string describe(const HostProblem& hp) {
  const Spec& s = hp.spec;
  std::ostringstream os;
  os << dtype_str(s.dtype) << " " << s.parts << " x " << s.part_dim << ", " << s.lens.size() << " seqs (cap "
     << hp.seqs << ", " << hp.running_seqs << " run), " << hp.qsl[hp.seqs] << " tokens (cap " << hp.tokens
     << "), row stride dim+" << s.row_pad << ", x/out offset " << s.x_offset << "/" << s.out_offset
     << ", plane stride " << (s.explicit_plane_stride ? "+" + std::to_string(s.plane_pad) : std::string("0"))
     << ", state " << (s.transposed ? "(lines, len, dim)" : "(lines, dim, len)") << " len " << s.state_len
     << " pad " << s.line_pad << ", weights " << hp.weight_dim << "/" << hp.weight_tap << " +" << hp.weight_offset
     << (s.bias ? ", bias" : "") << (s.silu ? ", silu" : ", no silu")
     << ", cache stride " << s.cache_stride << ", null "
     << (s.null_line ? std::to_string(*s.null_line) : std::string("none"))
     << (s.null_init_flags ? ", no flags" : "");
  return os.str();
}

void check_leaks(const Leaks& k, const char* who) {
  CHECK_MESSAGE(k.out_outside == 0, who, ": output elements written outside the running rows");
  CHECK_MESSAGE(k.out_unwritten == 0, who, ": output elements of running rows left unwritten");
  CHECK_MESSAGE(k.state_outside == 0, who, ": state elements changed outside taps 0..2 of running lines");
}

// Packed vs stock vs reference on one problem; everything printed, everything checked.
void check_problem(const Spec& spec, Rng& rng, cudaStream_t stream) {
  const HostProblem hp = make_problem(spec, rng);
  const std::string what = describe(hp);
  CAPTURE(what);
  DeviceInputs in(hp);
  DeviceOutputs packed(hp), stock(hp);
  packed.reset(hp);
  stock.reset(hp);
  const PackedConvArgs pa = device_args(hp, in, packed), sa = device_args(hp, in, stock);
  std::string why;
  REQUIRE_MESSAGE(kda::packed_causal_conv1d_supported(pa, &why), "unsupported: ", why);
  kda::packed_causal_conv1d(pa, stream);
  KDA_TEST_CUDA(cudaStreamSynchronize(stream));
  run_stock(sa, stream);
  const Result rp = packed.download(), rs = stock.download();
  const Result ref = run_reference(hp);
  const Float64Ref ref64 = run_float64_reference(hp);

  const int64_t out_bits = diff_bits(rp.out.data(), rs.out.data(), rp.out.size());
  const int64_t state_bits = diff_bits(rp.states.data(), rs.states.data(), rp.states.size() * sizeof(float));
  // Bitwise equal results pass the same checks: look at the stock result separately only
  // when it differs (to tell which side is wrong).
  const bool same = out_bits == 0 && state_bits == 0;
  const Leaks lp = find_leaks(hp, rp), ls = same ? lp : find_leaks(hp, rs);
  const RefDiff dp = compare_with_reference(hp, ref, rp), ds = same ? dp : compare_with_reference(hp, ref, rs);
  double worst64 = 0.0;
  const int64_t beyond64 = beyond_float64_tolerance(hp, ref64, rp, &worst64) +
                           (same ? 0 : beyond_float64_tolerance(hp, ref64, rs, &worst64));
  std::ostringstream msg;
  msg << what << "\n  packed vs stock: " << out_bits << " output bits, " << state_bits
      << " state bits differ; vs CPU reference: max " << dp.max_ulps << " / " << ds.max_ulps
      << " ulps (packed / stock), state bits " << dp.state_bits << " / " << ds.state_bits
      << "; vs float64: worst error " << worst64 << " of the tolerance";
  MESSAGE(msg.str());
  CHECK(out_bits == 0);
  CHECK(state_bits == 0);
  check_leaks(lp, "packed");
  check_leaks(ls, "stock");
  for (const RefDiff* d : {&dp, &ds}) {
    CHECK(d->state_bits == 0);
    CHECK(d->beyond_tol == 0);
    if (!spec.silu) CHECK(d->out_bits == 0);
  }
  CHECK(beyond64 == 0);
}


// 7 fixed lengths (0, 1, 2, 3 and both sides of a 64-token chunk) plus random ones, up to
// max_seqs sequences and about token_budget tokens, shuffled.
std::vector<int32_t> random_lengths(Rng& rng, int64_t max_seqs, int64_t token_budget) {
  std::vector<int32_t> lens = {0, 1, 2, 3, 63, 64, 65};
  int64_t total = 198;
  const int64_t extra = rng.range(0, std::max<int64_t>(max_seqs - 7, 0));
  for (int64_t k = 0; k < extra; ++k) {
    const int64_t r = rng.below(10);
    int64_t len = r < 5 ? rng.range(0, 8) : r < 8 ? rng.range(9, 130) : rng.range(131, 700);
    len = std::max<int64_t>(std::min(len, token_budget - total), 0);
    lens.push_back(static_cast<int32_t>(len));
    total += len;
  }
  rng.shuffle(lens);
  return lens;
}

}  // namespace

// silu_stock_fast (the packed kernel's) against silu_stock (the baseline's literal recipe) on
// every input in [begin, begin + count * step) with the given step; kVariant 1 is a deliberately
// wrong fast form (no range scaling before rcp), which the comparison must catch.
template <int kVariant>
__global__ void silu_forms_diff_kernel(uint64_t begin, uint64_t count, uint64_t step,
                                       unsigned long long* mismatches, unsigned int* first_bad) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t bits = static_cast<uint32_t>(begin + i * step);
    const float acc = __uint_as_float(bits);
    float fast;
    if constexpr (kVariant == 0) {
      fast = kda::conv::silu_stock_fast(acc);
    } else {
      float e;
      asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(__fmul_rn(acc, -kda::conv::kLog2e)));
      float r;
      asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(__fadd_rn(e, 1.0f)));
      fast = __fmul_rn(r, acc);
    }
    if (__float_as_uint(fast) != __float_as_uint(kda::conv::silu_stock(acc))) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_bad, bits);
    }
  }
}

template <int kVariant>
std::pair<uint64_t, uint32_t> silu_forms_diff(uint64_t step) {
  DeviceBuffer counter(sizeof(unsigned long long)), first(sizeof(unsigned int));
  counter.fill_bytes(0);
  first.fill_bytes(0xFF);
  const uint64_t count = (uint64_t{1} << 32) / step;
  silu_forms_diff_kernel<kVariant><<<132 * 16, 256>>>(0, count, step, counter.as<unsigned long long>(),
                                                      first.as<unsigned int>());
  KDA_TEST_CUDA(cudaGetLastError());
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  unsigned long long n = 0;
  unsigned int f = 0;
  counter.download(&n, sizeof n);
  first.download(&f, sizeof f);
  return {n, f};
}

TEST_CASE("the packed kernel's SiLU form gives the stock recipe's bits for every fp32 input") {
  // All 2^32 inputs (every 61st under KDA_TEST_QUICK: compute-sanitizer is slow). 61 is odd, so
  // the sample still meets every exponent and both signs.
  const uint64_t step = quick() ? 61 : 1;
  const auto [bad, first_bad] = silu_forms_diff<0>(step);
  MESSAGE("silu_stock_fast vs silu_stock over " << (uint64_t{1} << 32) / step << " fp32 inputs: " << bad
                                                << " differ");
  CHECK(bad == 0);
  if (bad) MESSAGE("first differing input bits 0x" << std::hex << first_bad);
  // The comparison has the power to fail: without the range scaling (inputs below about -87.3)
  // the results differ.
  const auto [wrong, wrong_first] = silu_forms_diff<1>(step);
  MESSAGE("a fast form without the range scaling: " << wrong << " inputs differ (first 0x" << std::hex
                                                     << wrong_first << ")");
  CHECK(wrong > 0);
}

TEST_CASE("the packed conv equals the stock path bit for bit over part_dim, dtype and layout variants") {
  Rng rng = rng_for("matrix");
  Stream stream;
  const int64_t part_dims[] = {64, 128, 512, 1536, 4096};
  const DType dtypes[] = {DType::BF16, DType::FP16, DType::FP32};
  const int64_t row_pads[] = {0, 8, 256, 2, 1};
  const int64_t x_offsets[] = {0, 0, 1, 4}, out_offsets[] = {0, 2, 0, 1}, plane_pads[] = {0, 0, 64, 3};
  const double init_fracs[] = {0.5, 0.0, 1.0, 0.8};
  const int64_t budget = quick() ? 1500000 : 12000000;  // x elements per case (CPU checks dominate)
  for (int i = 0; i < 15; ++i) {
    if (quick() && i % 3 != (i / 3) % 3) continue;  // one dtype per part_dim, rotating
    Spec s;
    s.part_dim = part_dims[i / 3];
    s.dtype = dtypes[i % 3];
    s.parts = 1 + (i + i / 3) % 3;
    s.row_pad = row_pads[i % 5];
    s.x_offset = x_offsets[i % 4];
    s.out_offset = out_offsets[(i / 2) % 4];
    s.explicit_plane_stride = i % 4 != 0;
    s.plane_pad = plane_pads[i % 4];
    s.state_len = 3 + i % 2;
    s.transposed = (i / 2) % 2 == 1;
    s.line_pad = (i % 3) * 5;
    s.weight_layout = (3 * i + i / 3) % 4;  // every layout in the quick set too
    s.bias = ((i / 3) + i) % 2 == 0;
    s.silu = i % 4 != 1;
    s.cache_stride = i % 3 == 1 ? 2 : 1;
    s.null_line = i % 5 == 3 ? std::nullopt : std::optional<int32_t>(i % 5 == 4 ? 7 : 0);
    s.init_frac = init_fracs[i % 4];
    s.seq_pad = rng.range(0, 5);
    s.token_pad = rng.range(0, 300);
    s.lens = random_lengths(rng, 300, std::max<int64_t>(budget / (s.part_dim * s.parts), 400));
    check_problem(s, rng, stream.get());
  }
}

TEST_CASE("the packed conv equals the stock path on a 16384-token sequence next to short ones") {
  Rng rng = rng_for("long");
  Stream stream;
  SUBCASE("bf16, 3 planes, vLLM's transposed state and in_proj row stride") {
    Spec s;
    s.part_dim = quick() ? 64 : 1536;
    s.row_pad = quick() ? 40 : 4928 - 3 * 1536;  // seed scale: in_proj_stride() 4928
    s.transposed = true;
    s.lens = {16384, 0, 1, 2, 3, 63, 64, 65};
    rng.shuffle(s.lens);
    s.seq_pad = 3;
    s.token_pad = 77;
    s.init_frac = 0.7;
    s.null_frac = 0.0;
    s.oob_frac = 0.0;
    check_problem(s, rng, stream.get());
  }
  if (!quick()) {
    SUBCASE("fp32, one 4096-wide plane, state_len 4, bias, no SiLU") {
      Spec s;
      s.dtype = DType::FP32;
      s.part_dim = 4096;
      s.parts = 1;
      s.state_len = 4;
      s.bias = true;
      s.silu = false;
      s.lens = {5, 16384};
      s.init_frac = 1.0;
      s.null_frac = 0.0;
      s.oob_frac = 0.0;
      check_problem(s, rng, stream.get());
    }
  }
}

TEST_CASE("the packed conv equals the stock path on batch shapes at the edges") {
  Rng rng = rng_for("edges");
  Stream stream;
  Spec s;
  SUBCASE("300 sequences, capacity exactly the batch, line 0 an ordinary line") {
    s.dtype = DType::FP16;
    s.part_dim = 128;
    s.parts = 2;
    s.cache_stride = 2;
    s.null_line = std::nullopt;
    for (int i = 0; i < 300; ++i) s.lens.push_back(static_cast<int32_t>(rng.range(0, 70)));
  }
  SUBCASE("one sequence, no has_initial_state array") {
    s.part_dim = 512;
    s.lens = {777};
    s.null_init_flags = true;
    s.null_frac = 0.0;
    s.oob_frac = 0.0;
    s.token_pad = 5;
  }
  SUBCASE("every sequence skipped: null line or out of range") {
    s.part_dim = 64;
    s.lens = {5, 64, 1, 200, 3};
    s.null_frac = 0.5;
    s.oob_frac = 1.0;
    s.bias = true;
  }
  SUBCASE("only zero-length sequences") {
    s.part_dim = 64;
    s.lens = {0, 0, 0};
    s.token_pad = 50;
    s.seq_pad = 2;
  }
  SUBCASE("sequences but no token rows") {
    s.part_dim = 128;
    s.lens = {0, 0, 0};
  }
  SUBCASE("no sequences, token rows") {
    s.part_dim = 128;
    s.token_pad = 40;
  }
  SUBCASE("no sequences, no tokens") {
    s.part_dim = 64;
  }
  SUBCASE("a 64-token-chunk boundary in every position") {
    s.dtype = DType::BF16;
    s.part_dim = 256;
    s.parts = 3;
    s.state_len = 4;
    s.transposed = true;
    for (int i = 0; i < 70; ++i) s.lens.push_back(static_cast<int32_t>(60 + i % 9));
    s.null_frac = 0.0;
    s.oob_frac = 0.0;
  }
  check_problem(s, rng, stream.get());
}

TEST_CASE("every valid tuning of the packed kernel gives the stock bits") {
  Rng rng = rng_for("tunings");
  Stream stream;
  for (DType dtype : {DType::BF16, DType::FP32}) {
    Spec s;
    s.dtype = dtype;
    s.part_dim = 512;
    s.parts = 3;
    s.bias = dtype == DType::FP32;
    s.transposed = dtype == DType::BF16;
    s.lens = random_lengths(rng, 40, quick() ? 800 : 3000);
    s.seq_pad = 2;
    s.token_pad = 30;
    const HostProblem hp = make_problem(s, rng);
    CAPTURE(describe(hp));
    DeviceInputs in(hp);
    DeviceOutputs packed(hp), stock(hp);
    stock.reset(hp);
    run_stock(device_args(hp, in, stock), stream.get());
    const Result rs = stock.download();
    const PackedConvArgs pa = device_args(hp, in, packed);
    int run = 0, invalid = 0;
    int64_t total_bits = 0;
    const std::vector<int> chunks = quick() ? std::vector<int>{8, 64, 256} : std::vector<int>{8, 16, 32, 64, 128, 256};
    const std::vector<int> warps = quick() ? std::vector<int>{1, 4} : std::vector<int>{1, 2, 4, 8};
    for (int per_cta : {1, 4, 16})
    for (int vec : {1, 2, 4, 8})
      for (int chunk : chunks)
        for (int w : warps) {
          kda::conv::ConvTuning t;
          t.vec = vec;
          t.chunk_len = chunk;
          t.warps_per_cta = w;
          t.chunks_per_cta = per_cta;
          if (!kda::conv::check_tuning(pa, t).empty()) {
            ++invalid;
            continue;
          }
          CAPTURE(per_cta);
          CAPTURE(vec);
          CAPTURE(chunk);
          CAPTURE(w);
          packed.reset(hp);
          kda::conv::launch_packed_conv(pa, t, stream.get());
          KDA_TEST_CUDA(cudaStreamSynchronize(stream.get()));
          const Result rp = packed.download();
          const int64_t bits = diff_bits(rp.out.data(), rs.out.data(), rp.out.size()) +
                               diff_bits(rp.states.data(), rs.states.data(), rp.states.size() * sizeof(float));
          total_bits += bits;
          CHECK(bits == 0);
          check_leaks(find_leaks(hp, rp), "packed");
          ++run;
        }
    std::ostringstream msg;
    msg << dtype_str(dtype) << ": " << run << " tunings run (" << invalid << " rejected by check_tuning), "
        << total_bits << " bits differ from the stock path in total";
    MESSAGE(msg.str());
    CHECK(run >= 24);
  }
}

TEST_CASE("a captured packed launch replays new batches exactly like eager launches") {
  Rng rng = rng_for("graph");
  Stream stream;
  Spec s;
  s.part_dim = quick() ? 128 : 512;
  s.parts = 3;
  s.row_pad = 64;
  s.transposed = true;
  s.cache_stride = 2;
  s.explicit_plane_stride = true;
  s.plane_pad = 128;
  const int64_t token_cap = quick() ? 1024 : 4096, seq_cap = quick() ? 16 : 64;
  // The first batch fills every row, so the x rows later batches use all hold data.
  s.lens.assign(static_cast<std::size_t>(seq_cap), static_cast<int32_t>(token_cap / seq_cap));
  HostProblem hp = make_problem(s, rng);
  REQUIRE(hp.tokens == token_cap);
  REQUIRE(hp.seqs == seq_cap);
  DeviceInputs in(hp);
  DeviceOutputs graph_out(hp), eager_out(hp), stock_out(hp);
  const PackedConvArgs ga = device_args(hp, in, graph_out), ea = device_args(hp, in, eager_out),
                       sa = device_args(hp, in, stock_out);

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  KDA_TEST_CUDA(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  kda::packed_causal_conv1d(ga, stream.get());
  KDA_TEST_CUDA(cudaStreamEndCapture(stream.get(), &graph));
  KDA_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  const int replays = quick() ? 8 : 20;
  int64_t total_bits = 0, total_stock_bits = 0;
  for (int r = 0; r < replays; ++r) {
    CAPTURE(r);
    const int64_t n = rng.range(1, seq_cap);
    std::vector<int32_t> lens;
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t room = token_cap - total;
      const int64_t want = rng.chance(0.2) ? rng.range(0, 3) : rng.range(0, 2 * token_cap / n);
      lens.push_back(static_cast<int32_t>(std::min(want, room)));
      total += lens.back();
    }
    fill_batch(rng, hp, lens);
    in.upload_batch(hp);

    graph_out.reset(hp);
    KDA_TEST_CUDA(cudaGraphLaunch(exec, stream.get()));
    KDA_TEST_CUDA(cudaStreamSynchronize(stream.get()));
    const Result rg = graph_out.download();
    eager_out.reset(hp);
    kda::packed_causal_conv1d(ea, stream.get());
    KDA_TEST_CUDA(cudaStreamSynchronize(stream.get()));
    const Result re = eager_out.download();
    stock_out.reset(hp);
    run_stock(sa, stream.get());
    const Result rs = stock_out.download();

    const int64_t bits = diff_bits(rg.out.data(), re.out.data(), rg.out.size()) +
                         diff_bits(rg.states.data(), re.states.data(), rg.states.size() * sizeof(float));
    const int64_t stock_bits = diff_bits(re.out.data(), rs.out.data(), re.out.size()) +
                               diff_bits(re.states.data(), rs.states.data(), re.states.size() * sizeof(float));
    total_bits += bits;
    total_stock_bits += stock_bits;
    CHECK(bits == 0);
    CHECK(stock_bits == 0);
    check_leaks(find_leaks(hp, rg), "graph replay");
  }
  std::ostringstream msg;
  msg << replays << " replays of one captured launch (capacity " << token_cap << " tokens, " << seq_cap
      << " seqs): " << total_bits << " bits differ from eager launches, " << total_stock_bits
      << " between eager launches and the stock path";
  MESSAGE(msg.str());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_CASE("the packed kernel and the stock baseline reject the same malformed arguments and change nothing") {
  Rng rng = rng_for("reject");
  Stream stream;
  Spec s;
  s.part_dim = 128;
  s.lens = {5, 70, 0, 3};
  s.null_frac = 0.0;
  s.oob_frac = 0.0;
  const HostProblem hp = make_problem(s, rng);
  DeviceInputs in(hp);
  DeviceOutputs packed(hp), stock(hp);
  packed.reset(hp);
  stock.reset(hp);
  const PackedConvArgs good_p = device_args(hp, in, packed), good_s = device_args(hp, in, stock);
  REQUIRE(kda::packed_causal_conv1d_supported(good_p));
  const std::size_t need = kda::baseline::stock_causal_conv1d_workspace_bytes(good_s);
  DeviceBuffer ws(need);

  struct Bad {
    const char* what;
    std::function<void(PackedConvArgs&)> edit;
  };
  const Bad bad[] = {
      {"part_dim not a multiple of 64", [](PackedConvArgs& a) { a.part_dim = 96; }},
      {"dim not a multiple of part_dim", [](PackedConvArgs& a) { a.part_dim = 256; }},
      {"state_len 2", [](PackedConvArgs& a) { a.state_len = 2; }},
      {"row stride below dim", [](PackedConvArgs& a) { a.x_row_stride = a.dim - 1; }},
      {"null x", [](PackedConvArgs& a) { a.x = nullptr; }},
      {"null out", [](PackedConvArgs& a) { a.out = nullptr; }},
      {"null weight", [](PackedConvArgs& a) { a.weight = nullptr; }},
      {"null conv_states", [](PackedConvArgs& a) { a.conv_states = nullptr; }},
      {"null query_start_loc", [](PackedConvArgs& a) { a.varlen.query_start_loc = nullptr; }},
      {"no cache lines", [](PackedConvArgs& a) { a.varlen.cache_lines = 0; }},
      {"plane stride below a plane", [](PackedConvArgs& a) { a.out_plane_stride = a.num_tokens * a.part_dim - 1; }},
      {"cache_indices_stride 0", [](PackedConvArgs& a) { a.cache_indices_stride = 0; }},
      {"negative num_tokens", [](PackedConvArgs& a) { a.num_tokens = -1; }},
  };
  for (const Bad& b : bad) {
    CAPTURE(b.what);
    PackedConvArgs pa = good_p, sa = good_s;
    b.edit(pa);
    b.edit(sa);
    std::string why;
    const bool ok = kda::packed_causal_conv1d_supported(pa, &why);
    CHECK_FALSE(ok);
    if (ok) continue;  // launching would touch memory the arguments do not describe
    CHECK_FALSE(why.empty());
    CHECK_THROWS_AS(kda::packed_causal_conv1d(pa, stream.get()), kda::Error);
    CHECK_THROWS_WITH_AS(kda::baseline::stock_causal_conv1d(sa, ws.get(), need, stream.get()),
                         doctest::Contains(why.c_str()), kda::Error);
    CHECK_THROWS_WITH_AS(kda::baseline::stock_causal_conv1d_workspace_bytes(sa),
                         doctest::Contains("kda::baseline::stock_causal_conv1d_workspace_bytes"), kda::Error);
  }
  SUBCASE("the stock baseline names a missing or short workspace") {
    CHECK_THROWS_WITH_AS(kda::baseline::stock_causal_conv1d(good_s, ws.get(), need - 1, stream.get()),
                         doctest::Contains("workspace_bytes"), kda::Error);
    CHECK_THROWS_WITH_AS(kda::baseline::stock_causal_conv1d(good_s, nullptr, need, stream.get()),
                         doctest::Contains("workspace is null"), kda::Error);
    CHECK_THROWS_WITH_AS(kda::baseline::stock_causal_conv1d(good_s, ws.as<char>() + 4, need, stream.get()),
                         doctest::Contains("aligned"), kda::Error);
  }
  KDA_TEST_CUDA(cudaStreamSynchronize(stream.get()));
  for (const DeviceOutputs* o : {&packed, &stock}) {
    const Result r = o->download();
    CHECK(r.states == hp.states);
    CHECK(is_poison(r.out.data(), r.out.size()));
  }
}

// ---- conv-state checkpoints (conv/conv_checkpoint.h), run before the packed conv ----

namespace {

using kda::CheckpointEntry;
using kda::ConvCheckpointArgs;

// A window's staged checkpoint entries: `entries` is the whole table (max_entries, unused ones
// line -1, shuffled); `valid` the well-formed ones, which must be written; the malformed ones
// name lines that nothing else names, which must stay untouched.
struct CheckpointPlan {
  std::vector<CheckpointEntry> entries, valid;
  int64_t malformed = 0;
};

bool seq_runs(const HostProblem& hp, int64_t s) {
  const int32_t line = hp.cache[static_cast<std::size_t>(s * hp.spec.cache_stride)];
  return hp.qsl[s + 1] > hp.qsl[s] && !is_skipped(hp, line);
}

// Checkpoints of the batch now in hp: per running sequence, its chunk ends (multiples of 64
// below its rows), its last row and sometimes a small end (1, 2, 3: the taps that come partly
// from the line), on lines no sequence names; then (with `malformed`) entries the kernel must
// skip; then unused entries up to max_entries.
CheckpointPlan plan_checkpoints(Rng& rng, const HostProblem& hp, int64_t max_entries, bool malformed) {
  CheckpointPlan plan;
  // Lines no sequence of the batch names (running or not) and not the null line, as the host
  // guarantees for checkpoint lines (common/state_checkpoints.h).
  std::vector<unsigned char> named(static_cast<std::size_t>(hp.lines), 0);
  for (int64_t s = 0; s < hp.seqs; ++s) {
    const int32_t line = hp.cache[static_cast<std::size_t>(s * hp.spec.cache_stride)];
    if (line >= 0 && line < hp.lines) named[static_cast<std::size_t>(line)] = 1;
  }
  std::vector<int32_t> free_lines;
  for (int32_t l = 0; l < hp.lines; ++l)
    if (!named[static_cast<std::size_t>(l)] && !(hp.spec.null_line && l == *hp.spec.null_line))
      free_lines.push_back(l);
  rng.shuffle(free_lines);
  const int64_t reserve = malformed ? 6 : 0;
  auto room = [&] {
    return !free_lines.empty() && static_cast<int64_t>(plan.entries.size()) + reserve < max_entries;
  };
  auto take_line = [&] {
    const int32_t l = free_lines.back();
    free_lines.pop_back();
    return l;
  };
  for (int64_t s = 0; s < hp.seqs; ++s) {
    if (!seq_runs(hp, s)) continue;
    const int32_t len = hp.qsl[s + 1] - hp.qsl[s];
    std::vector<int32_t> ends;
    if (len > 3 && rng.chance(0.3)) ends.push_back(static_cast<int32_t>(rng.range(1, 3)));
    for (int32_t e = 64; e < len; e += 64) ends.push_back(e);
    ends.push_back(len);
    for (int32_t e : ends) {
      if (!room()) break;
      CheckpointEntry c;
      c.line = take_line();
      c.seq = static_cast<int32_t>(s);
      c.end = e;
      plan.entries.push_back(c);
      plan.valid.push_back(c);
    }
  }
  if (malformed) {
    int64_t running = -1, skipped = -1;
    for (int64_t s = 0; s < hp.seqs; ++s) {
      if (seq_runs(hp, s)) running = s;
      else if (hp.qsl[s + 1] > hp.qsl[s]) skipped = s;
    }
    auto add = [&](int32_t line, int64_t seq, int64_t end) {
      if (static_cast<int64_t>(plan.entries.size()) >= max_entries) return;
      CheckpointEntry c;
      c.line = line;
      c.seq = static_cast<int32_t>(seq);
      c.end = static_cast<int32_t>(end);
      plan.entries.push_back(c);
      ++plan.malformed;
    };
    if (running >= 0) {
      const int64_t rows = hp.qsl[running + 1] - hp.qsl[running];
      if (!free_lines.empty()) add(take_line(), running, rows + 1);  // past the sequence's rows
      if (!free_lines.empty()) add(take_line(), running, 0);         // end 0
      add(static_cast<int32_t>(hp.lines), running, 1);               // line past the pool
      if (hp.spec.null_line) add(*hp.spec.null_line, running, 1);  // the null line
    }
    if (skipped >= 0 && !free_lines.empty()) add(take_line(), skipped, 1);  // a skipped sequence
    if (!free_lines.empty()) add(take_line(), hp.seqs, 1);                  // seq past the capacity
  }
  while (static_cast<int64_t>(plan.entries.size()) < max_entries) {
    CheckpointEntry unused;  // line -1
    unused.seq = static_cast<int32_t>(rng.below(std::max<int64_t>(hp.seqs, 1)));
    unused.end = 64;
    plan.entries.push_back(unused);
  }
  rng.shuffle(plan.entries);
  return plan;
}

std::size_t state_index(const HostProblem& hp, int64_t line, int64_t c, int64_t tap) {
  return static_cast<std::size_t>(line * hp.state_line + c * hp.state_dim + tap * hp.state_tap);
}

// The checkpoint lines before the op hold what a 0xFF fill leaves (any earlier state).
void poison_checkpoint_lines(HostProblem& hp, const CheckpointPlan& plan) {
  for (const CheckpointEntry& e : plan.valid)
    for (int64_t c = 0; c < hp.dim; ++c)
      for (int64_t tap = 0; tap < 3; ++tap)
        hp.states[state_index(hp, e.line, c, tap)] = kda::host::bits_float(kda::test::kPoison32);
}

ConvCheckpointArgs checkpoint_args(const HostProblem& hp, const DeviceInputs& in, DeviceOutputs& o,
                                   const DeviceBuffer& entries, int64_t max_entries) {
  const PackedConvArgs p = device_args(hp, in, o);  // the packed conv's view of the same arrays
  REQUIRE(p.cache_indices_stride == 1);
  REQUIRE(p.x_dtype == DType::BF16);
  ConvCheckpointArgs a;
  a.x = p.x;
  a.x_row_stride = p.x_row_stride;
  a.num_tokens = p.num_tokens;
  a.dim = p.dim;
  a.conv_states = p.conv_states;
  a.varlen.cache_lines = p.varlen.cache_lines;
  a.state_stride_line = p.state_stride_line;
  a.state_stride_dim = p.state_stride_dim;
  a.state_stride_tap = p.state_stride_tap;
  a.varlen.query_start_loc = p.varlen.query_start_loc;
  a.varlen.num_seqs = p.varlen.num_seqs;
  a.varlen.cache_indices = p.varlen.cache_indices;
  a.varlen.has_initial_state = p.varlen.has_initial_state;
  a.varlen.null_line = p.varlen.null_line.value_or(-1);
  a.entries = entries.as<const CheckpointEntry>();
  a.max_entries = max_entries;
  return a;
}

// The pool the checkpoint op then the packed conv must leave: the stock path's pool for the
// whole batch (`stock_states`), with every valid checkpoint line's taps 0..2 set to those the
// stock path leaves on the sequence's line after running the sequence cut at the checkpoint's
// end. The cut runs go in rounds (the r-th checkpoint of every sequence at once): sequence s
// becomes [bos, bos + end) on its line and a filler [bos + end, eos) on a skipped line, so the
// rounds keep the batch's rows. The CPU reference runs the same rounds: *reference_bits counts
// the state bits in which it differs from the stock path.
std::vector<float> expected_checkpoint_pool(const HostProblem& hp, const DeviceInputs& in,
                                            const CheckpointPlan& plan, const std::vector<float>& stock_states,
                                            cudaStream_t stream, int64_t* reference_bits) {
  std::vector<float> want = stock_states;
  const int32_t skip_line = hp.spec.null_line ? *hp.spec.null_line : -1;
  const std::unique_ptr<bool[]> host_init = hp.init_bools();
  std::vector<std::vector<CheckpointEntry>> per_seq(static_cast<std::size_t>(hp.seqs));
  for (const CheckpointEntry& e : plan.valid) per_seq[static_cast<std::size_t>(e.seq)].push_back(e);
  for (std::size_t round = 0;; ++round) {
    std::vector<int32_t> qsl{0}, cache;
    std::vector<unsigned char> init;
    std::vector<CheckpointEntry> in_round;
    for (int64_t s = 0; s < hp.seqs; ++s) {
      const int32_t bos = hp.qsl[s], eos = hp.qsl[s + 1];
      const bool flag = hp.init[static_cast<std::size_t>(s)] != 0;
      const auto& mine = per_seq[static_cast<std::size_t>(s)];
      if (round < mine.size()) {
        const CheckpointEntry& e = mine[round];
        in_round.push_back(e);
        qsl.push_back(bos + e.end);
        cache.push_back(hp.cache[static_cast<std::size_t>(s)]);
        init.push_back(flag);
      }
      qsl.push_back(eos);  // the rest of the sequence (or all of it) on a skipped line
      cache.push_back(skip_line);
      init.push_back(flag);
    }
    if (in_round.empty()) break;
    const int64_t n = static_cast<int64_t>(cache.size());

    // The stock path on the device.
    DeviceOutputs o(hp);
    o.reset(hp);
    DeviceBuffer dq = upload_vec(qsl), dc = upload_vec(cache), di = upload_vec(init);
    kda::test::device_synchronize();
    PackedConvArgs a = device_args(hp, in, o);
    a.varlen.query_start_loc = dq.as<int32_t>();
    a.varlen.num_seqs = n;
    a.varlen.cache_indices = dc.as<int32_t>();
    a.cache_indices_stride = 1;
    if (a.varlen.has_initial_state) a.varlen.has_initial_state = di.as<bool>();
    run_stock(a, stream);
    const std::vector<float> stock = o.download().states;

    // The CPU reference on host copies.
    std::vector<float> ref_states = hp.states;
    std::vector<unsigned char> ref_out(static_cast<std::size_t>(hp.out_elems) * hp.esize(), 0xFF);
    std::unique_ptr<bool[]> flags(new bool[init.size()]);
    for (std::size_t i = 0; i < init.size(); ++i) flags[i] = init[i] != 0;
    PackedConvArgs h = make_args(hp, hp.x.data(), hp.weight.data(), hp.bias.data(), ref_states.data(), qsl.data(),
                                 cache.data(), host_init.get(), ref_out.data());
    h.varlen.num_seqs = n;
    h.cache_indices_stride = 1;
    if (h.varlen.has_initial_state) h.varlen.has_initial_state = flags.get();
    kda::reference::causal_conv1d(h, kda::reference::ConvMath::kStockFp32);
    *reference_bits += diff_bits(ref_states.data(), stock.data(), stock.size() * sizeof(float));

    for (const CheckpointEntry& e : in_round) {
      const int32_t line = hp.cache[static_cast<std::size_t>(e.seq)];
      for (int64_t c = 0; c < hp.dim; ++c)
        for (int64_t tap = 0; tap < 3; ++tap)
          want[state_index(hp, e.line, c, tap)] = stock[state_index(hp, line, c, tap)];
    }
  }
  return want;
}

struct CheckpointDiff {
  int64_t taps = 0;            // checkpoint tap elements compared
  int64_t tap_bits = 0;        // bits in which they differ from the expected ones
  int64_t tap_elements = 0;
  int64_t other_elements = 0;  // other pool elements that differ from the expected pool
};

CheckpointDiff compare_checkpoint_pool(const HostProblem& hp, const CheckpointPlan& plan,
                                       const std::vector<float>& got, const std::vector<float>& want) {
  CheckpointDiff d;
  std::vector<unsigned char> is_tap(got.size(), 0);
  for (const CheckpointEntry& e : plan.valid)
    for (int64_t c = 0; c < hp.dim; ++c)
      for (int64_t tap = 0; tap < 3; ++tap) is_tap[state_index(hp, e.line, c, tap)] = 1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const int64_t bits = diff_bits(&got[i], &want[i], sizeof(float));
    if (is_tap[i]) {
      ++d.taps;
      d.tap_bits += bits;
      d.tap_elements += bits != 0;
    } else {
      d.other_elements += bits != 0;
    }
  }
  return d;
}

// Checkpoints then the packed conv on the device (eager), against the stock path and the
// reference: everything printed, everything checked.
void check_checkpoints(const Spec& spec, Rng& rng, cudaStream_t stream) {
  HostProblem hp = make_problem(spec, rng);
  // Capacity: room for a checkpoint on every line, the malformed ones and a few unused entries.
  const CheckpointPlan plan = plan_checkpoints(rng, hp, hp.lines + 8, true);
  const int64_t max_entries = static_cast<int64_t>(plan.entries.size());
  poison_checkpoint_lines(hp, plan);
  const std::string what = describe(hp);
  CAPTURE(what);
  DeviceInputs in(hp);
  DeviceOutputs dev(hp), stock(hp);
  dev.reset(hp);
  stock.reset(hp);
  DeviceBuffer entries = upload_vec(plan.entries);
  kda::test::device_synchronize();
  const ConvCheckpointArgs ca = checkpoint_args(hp, in, dev, entries, max_entries);
  const PackedConvArgs pa = device_args(hp, in, dev);
  std::string why;
  REQUIRE_MESSAGE(kda::conv_checkpoint_supported(ca, &why), "unsupported: ", why);
  REQUIRE_MESSAGE(kda::packed_causal_conv1d_supported(pa, &why), "unsupported: ", why);
  kda::conv_checkpoint(ca, stream);
  kda::packed_causal_conv1d(pa, stream);
  KDA_TEST_CUDA(cudaStreamSynchronize(stream));
  run_stock(device_args(hp, in, stock), stream);
  const Result rd = dev.download(), rs = stock.download();
  int64_t reference_bits = 0;
  const std::vector<float> want = expected_checkpoint_pool(hp, in, plan, rs.states, stream, &reference_bits);
  const CheckpointDiff d = compare_checkpoint_pool(hp, plan, rd.states, want);
  const int64_t out_bits = diff_bits(rd.out.data(), rs.out.data(), rd.out.size());
  MESSAGE(what << "\n  " << plan.valid.size() << " checkpoints (+" << plan.malformed << " malformed) in "
               << max_entries << " entries: " << d.taps << " checkpoint taps, " << d.tap_elements << " differ ("
               << d.tap_bits << " bits) from the stock path on the cut sequences; " << d.other_elements
               << " other pool elements differ from the stock path; packed conv output " << out_bits
               << " bits; CPU reference vs stock on the cut sequences " << reference_bits << " state bits");
  CHECK(d.taps > 0);
  CHECK(d.tap_bits == 0);
  CHECK(d.other_elements == 0);
  CHECK(out_bits == 0);
  CHECK(reference_bits == 0);
}

}  // namespace

TEST_CASE("conv-state checkpoints then the packed conv: checkpoint lines are the stock state of the cut sequences") {
  Rng rng = rng_for("checkpoints");
  Stream stream;
  Spec s;
  SUBCASE("module layout: bf16 3 x 128 of a wider in_proj row, (lines, dim, 3) pool") {
    s.part_dim = 128;
    s.row_pad = 64;
    s.init_frac = 0.5;
    s.extra_lines = 160;
    s.lens = random_lengths(rng, 30, quick() ? 1500 : 6000);
  }
  SUBCASE("vLLM's (lines, 3, dim) pool, state_len 4, padded lines, no null line") {
    s.part_dim = 64;
    s.parts = 3;
    s.transposed = true;
    s.state_len = 4;
    s.line_pad = 5;
    s.row_pad = 2;
    s.null_line = std::nullopt;
    s.init_frac = 0.8;
    s.extra_lines = 160;
    s.seq_pad = 3;
    s.token_pad = 40;
    s.lens = random_lengths(rng, 30, quick() ? 1500 : 6000);
  }
  SUBCASE("short sequences only, every one with an initial state") {
    s.part_dim = 192;
    s.parts = 1;
    s.init_frac = 1.0;
    s.null_frac = 0.0;
    s.oob_frac = 0.0;
    s.extra_lines = 40;
    s.lens = {1, 2, 3, 1, 2, 4, 5, 2};
  }
  SUBCASE("no has_initial_state array") {
    s.part_dim = 512;
    s.null_init_flags = true;
    s.extra_lines = 40;
    s.lens = {700, 3, 130, 1};
  }
  check_checkpoints(s, rng, stream.get());
}

TEST_CASE("a captured checkpoint + packed conv replays new batches and new entries exactly") {
  Rng rng = rng_for("checkpoint graph");
  Stream stream;
  Spec s;
  s.part_dim = quick() ? 64 : 256;
  s.parts = 3;
  s.row_pad = 32;
  s.transposed = true;
  const int64_t token_cap = quick() ? 1024 : 4096, seq_cap = quick() ? 8 : 32, entry_cap = 96;
  s.extra_lines = entry_cap + 8;
  s.lens.assign(static_cast<std::size_t>(seq_cap), static_cast<int32_t>(token_cap / seq_cap));
  HostProblem hp = make_problem(s, rng);
  const std::vector<float> pristine = hp.states;
  DeviceInputs in(hp);
  DeviceOutputs graph_out(hp), stock_out(hp);
  DeviceBuffer entries(static_cast<std::size_t>(entry_cap) * sizeof(CheckpointEntry));
  entries.fill_bytes(0xFF);  // line -1: unused, until a batch stages its entries
  kda::test::device_synchronize();
  const ConvCheckpointArgs ca = checkpoint_args(hp, in, graph_out, entries, entry_cap);
  const PackedConvArgs pa = device_args(hp, in, graph_out), sa = device_args(hp, in, stock_out);
  REQUIRE(kda::conv_checkpoint_supported(ca));

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  KDA_TEST_CUDA(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  kda::conv_checkpoint(ca, stream.get());
  kda::packed_causal_conv1d(pa, stream.get());
  KDA_TEST_CUDA(cudaStreamEndCapture(stream.get(), &graph));
  KDA_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  const int replays = quick() ? 4 : 10;
  int64_t taps = 0, tap_bits = 0, others = 0, out_bits = 0, reference_bits = 0;
  for (int r = 0; r < replays; ++r) {
    CAPTURE(r);
    const int64_t n = rng.range(1, seq_cap);
    std::vector<int32_t> lens;
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t want = rng.chance(0.2) ? rng.range(0, 3) : rng.range(0, 2 * token_cap / n);
      lens.push_back(static_cast<int32_t>(std::min(want, token_cap - total)));
      total += lens.back();
    }
    fill_batch(rng, hp, lens);
    hp.states = pristine;
    const CheckpointPlan plan = plan_checkpoints(rng, hp, entry_cap, r % 2 == 1);
    poison_checkpoint_lines(hp, plan);
    in.upload_batch(hp);
    entries.upload(plan.entries);
    graph_out.reset(hp);
    stock_out.reset(hp);
    KDA_TEST_CUDA(cudaGraphLaunch(exec, stream.get()));
    KDA_TEST_CUDA(cudaStreamSynchronize(stream.get()));
    run_stock(sa, stream.get());
    const Result rg = graph_out.download(), rs = stock_out.download();
    const std::vector<float> want = expected_checkpoint_pool(hp, in, plan, rs.states, stream.get(), &reference_bits);
    const CheckpointDiff d = compare_checkpoint_pool(hp, plan, rg.states, want);
    const int64_t ob = diff_bits(rg.out.data(), rs.out.data(), rg.out.size());
    taps += d.taps, tap_bits += d.tap_bits, others += d.other_elements, out_bits += ob;
    CHECK(d.tap_bits == 0);
    CHECK(d.other_elements == 0);
    CHECK(ob == 0);
  }
  MESSAGE(replays << " replays of one captured checkpoint + packed conv (capacity " << token_cap << " tokens, "
                  << seq_cap << " seqs, " << entry_cap << " entries): " << taps << " checkpoint taps, " << tap_bits
                  << " bits differ from the stock path on the cut sequences; " << others
                  << " other pool elements differ; packed conv output " << out_bits
                  << " bits; CPU reference vs stock " << reference_bits << " state bits");
  CHECK(taps > 0);
  CHECK(reference_bits == 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_CASE("conv_checkpoint refuses malformed arguments, enqueues nothing, and max_entries 0 is a no-op") {
  Rng rng = rng_for("checkpoint reject");
  Stream stream;
  Spec s;
  s.part_dim = 64;
  s.lens = {5, 70, 3};
  s.null_frac = 0.0;
  s.oob_frac = 0.0;
  s.extra_lines = 8;
  HostProblem hp = make_problem(s, rng);
  const CheckpointPlan plan = plan_checkpoints(rng, hp, 16, false);
  DeviceInputs in(hp);
  DeviceOutputs o(hp);
  o.reset(hp);
  DeviceBuffer entries = upload_vec(plan.entries);
  kda::test::device_synchronize();
  const ConvCheckpointArgs good = checkpoint_args(hp, in, o, entries, 16);
  REQUIRE(kda::conv_checkpoint_supported(good));
  ConvCheckpointArgs a = good;
  a.x_row_stride = a.dim - 1;
  CHECK_THROWS_AS(kda::conv_checkpoint(a, stream.get()), kda::Error);
  a = good;
  a.state_stride_dim = 1;  // taps overlap channels
  CHECK_THROWS_AS(kda::conv_checkpoint(a, stream.get()), kda::Error);
  a = good;
  a.entries = reinterpret_cast<const CheckpointEntry*>(entries.as<char>() + 4);
  CHECK_THROWS_AS(kda::conv_checkpoint(a, stream.get()), kda::Error);
  a = good;
  a.max_entries = 0;
  kda::conv_checkpoint(a, stream.get());
  KDA_TEST_CUDA(cudaStreamSynchronize(stream.get()));
  const Result r = o.download();
  CHECK(diff_bits(r.states.data(), hp.states.data(), r.states.size() * sizeof(float)) == 0);
}

// ---- bf16 conv-state lines (state_dtype BF16) ----

namespace {

// The bf16 bits of pool values that are all bf16 values (the fixture makes them so).
std::vector<uint16_t> narrow_exact(const std::vector<float>& pool) {
  std::vector<uint16_t> bits(pool.size());
  int64_t inexact = 0;
  for (std::size_t i = 0; i < pool.size(); ++i) {
    const uint32_t u = kda::host::float_bits(pool[i]);
    inexact += (u & 0xFFFFu) != 0;
    bits[i] = static_cast<uint16_t>(u >> 16);
  }
  REQUIRE(inexact == 0);
  return bits;
}

std::vector<float> widen(const std::vector<uint16_t>& bits) {
  std::vector<float> pool(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) pool[i] = kda::host::bf16_to_float(bits[i]);
  return pool;
}

// Makes hp's pool a pool of bf16 values, poisoned where the conv must write without reading and
// where it must not write: the taps of running lines with an initial state are random bf16
// values (they are read); taps 0..2 of running lines without one, and every other element (lines
// no running sequence names, taps past 2, line padding), hold the bf16 NaN 0xFFFF (widened
// 0xFFFF0000 in fp32). A written tap is a bf16 input or an old tap, never that NaN, so a tap
// still holding it was not written.
void make_bf16_pool(HostProblem& hp) {
  const float poison = kda::host::bf16_to_float(kda::test::kPoison16);
  std::vector<unsigned char> read(hp.states.size(), 0), written(hp.states.size(), 0);
  for (int64_t s = 0; s < hp.seqs; ++s) {
    const int32_t line = hp.cache[static_cast<std::size_t>(s * hp.spec.cache_stride)];
    if (hp.qsl[s + 1] == hp.qsl[s] || is_skipped(hp, line)) continue;
    const bool init = !hp.spec.null_init_flags && hp.init[static_cast<std::size_t>(s)] != 0;
    for (int64_t c = 0; c < hp.dim; ++c)
      for (int64_t tap = 0; tap < 3; ++tap) {
        const std::size_t i = state_index(hp, line, c, tap);
        written[i] = 1;
        read[i] = init;
      }
  }
  for (std::size_t i = 0; i < hp.states.size(); ++i)
    hp.states[i] = read[i] ? kda::host::bf16_round(hp.states[i]) : poison;
}

// Taps 0..2 of running lines that still hold the poison: not written.
int64_t unwritten_taps(const HostProblem& hp, const std::vector<uint16_t>& lines) {
  int64_t n = 0;
  for (int64_t line = 0; line < hp.lines; ++line) {
    if (!hp.line_runs[static_cast<std::size_t>(line)]) continue;
    for (int64_t c = 0; c < hp.dim; ++c)
      for (int64_t tap = 0; tap < 3; ++tap) n += lines[state_index(hp, line, c, tap)] == kda::test::kPoison16;
  }
  return n;
}

// A bf16 pool and an output buffer on the device, poisoned as the fixture says.
struct Bf16Outputs {
  DeviceBuffer lines, out;
  Bf16Outputs(const HostProblem& hp, const std::vector<uint16_t>& start)
      : lines(upload_vec(start)), out(static_cast<std::size_t>(hp.out_elems) * hp.esize()) {
    out.fill_bytes(0xFF);
    kda::test::device_synchronize();
  }
  // The conv's arguments over this pool and output, with the inputs of `fp32_args`.
  PackedConvArgs args(const HostProblem& hp, const PackedConvArgs& fp32_args) {
    PackedConvArgs a = fp32_args;
    a.conv_states = lines.get();
    a.state_dtype = DType::BF16;
    a.out = out.as<char>() + hp.spec.out_offset * hp.esize();
    return a;
  }
  Result download_widened(std::vector<uint16_t>& bits) const {
    Result r;
    r.out.resize(out.bytes());
    out.download(r.out.data(), r.out.size());
    bits = lines.download_as<uint16_t>();
    r.states = widen(bits);
    return r;
  }
};

// The packed conv on bf16 lines against the stock path on bf16 lines, the packed conv on fp32
// lines of the same values and the CPU reference on bf16 lines: everything printed and checked.
void check_bf16_lines(const Spec& spec, Rng& rng, cudaStream_t stream) {
  REQUIRE(spec.dtype == DType::BF16);
  HostProblem hp = make_problem(spec, rng);
  make_bf16_pool(hp);
  const std::string what = describe(hp);
  CAPTURE(what);
  const std::vector<uint16_t> start16 = narrow_exact(hp.states);
  DeviceInputs in(hp);
  DeviceOutputs fp32(hp);
  fp32.reset(hp);
  Bf16Outputs packed(hp, start16), stock(hp, start16);
  const PackedConvArgs a32 = device_args(hp, in, fp32);
  const PackedConvArgs a16 = packed.args(hp, a32), s16 = stock.args(hp, a32);
  std::string why;
  REQUIRE_MESSAGE(kda::packed_causal_conv1d_supported(a16, &why), "unsupported: ", why);
  kda::packed_causal_conv1d(a16, stream);
  kda::packed_causal_conv1d(a32, stream);
  KDA_TEST_CUDA(cudaStreamSynchronize(stream));
  run_stock(s16, stream);
  std::vector<uint16_t> p16, st16;
  const Result rp = packed.download_widened(p16), rs = stock.download_widened(st16), r32 = fp32.download();

  // The CPU reference on host bf16 lines (the state is a copy of inputs and taps: exact).
  std::vector<uint16_t> ref16 = start16;
  std::vector<unsigned char> ref_out(static_cast<std::size_t>(hp.out_elems) * hp.esize(), 0xFF);
  const std::unique_ptr<bool[]> init = hp.init_bools();
  PackedConvArgs h16 = make_args(hp, hp.x.data(), hp.weight.data(), hp.bias.data(), nullptr, hp.qsl.data(),
                                 hp.cache.data(), init.get(), ref_out.data());
  h16.conv_states = ref16.data();
  h16.state_dtype = DType::BF16;
  kda::reference::causal_conv1d(h16, kda::reference::ConvMath::kStockFp32);

  const int64_t out_bits = diff_bits(rp.out.data(), rs.out.data(), rp.out.size());
  const int64_t line_bits = diff_bits(p16.data(), st16.data(), p16.size() * 2);
  const int64_t fp32_out_bits = diff_bits(rp.out.data(), r32.out.data(), rp.out.size());
  // The fp32 run's pool narrowed exactly (compared widened: equal bits there are equal bf16
  // bits), and its written taps rounded to bf16 as a bf16 store rounds them.
  const int64_t fp32_line_bits = diff_bits(rp.states.data(), r32.states.data(), rp.states.size() * sizeof(float));
  int64_t rounded_bits = 0, taps = 0;
  for (int64_t line = 0; line < hp.lines; ++line) {
    if (!hp.line_runs[static_cast<std::size_t>(line)]) continue;
    for (int64_t c = 0; c < hp.dim; ++c)
      for (int64_t tap = 0; tap < 3; ++tap) {
        const std::size_t i = state_index(hp, line, c, tap);
        const uint16_t rounded = kda::host::float_to_bf16(r32.states[i]);
        rounded_bits += diff_bits(&p16[i], &rounded, 2);
        ++taps;
      }
  }
  const int64_t reference_bits = diff_bits(p16.data(), ref16.data(), p16.size() * 2);
  const int64_t unwritten = unwritten_taps(hp, p16);
  const bool same = out_bits == 0 && line_bits == 0;
  const Leaks lp = find_leaks(hp, rp), ls = same ? lp : find_leaks(hp, rs);
  MESSAGE(what << "\n  bf16 lines, packed vs stock: " << out_bits << " output bits, " << line_bits
               << " line bits differ; vs the fp32 lines' run: " << fp32_out_bits << " output bits, "
               << fp32_line_bits << " pool bits (narrowed), " << rounded_bits << " bits of " << taps
               << " written taps (rounded); vs the CPU reference on bf16 lines: " << reference_bits
               << " line bits; " << unwritten << " running taps unwritten");
  CHECK(taps > 0);
  CHECK(out_bits == 0);
  CHECK(line_bits == 0);
  CHECK(fp32_out_bits == 0);
  CHECK(fp32_line_bits == 0);
  CHECK(rounded_bits == 0);
  CHECK(reference_bits == 0);
  CHECK(unwritten == 0);
  check_leaks(lp, "packed, bf16 lines");
  check_leaks(ls, "stock, bf16 lines");
}

// Checkpoints then the packed conv on bf16 lines against the same on fp32 lines of the same
// values (whose checkpoints the test above checks against the stock path): the bf16 pool must be
// the fp32 pool narrowed, bit for bit, and every checkpoint tap written.
void check_bf16_checkpoints(const Spec& spec, Rng& rng, cudaStream_t stream) {
  HostProblem hp = make_problem(spec, rng);
  make_bf16_pool(hp);  // checkpoint lines are named by no sequence: poisoned whole
  const CheckpointPlan plan = plan_checkpoints(rng, hp, hp.lines + 8, true);
  const int64_t max_entries = static_cast<int64_t>(plan.entries.size());
  const std::string what = describe(hp);
  CAPTURE(what);
  const std::vector<uint16_t> start16 = narrow_exact(hp.states);
  DeviceInputs in(hp);
  DeviceOutputs fp32(hp);
  fp32.reset(hp);
  Bf16Outputs b16(hp, start16);
  DeviceBuffer entries = upload_vec(plan.entries);
  kda::test::device_synchronize();
  const ConvCheckpointArgs c32 = checkpoint_args(hp, in, fp32, entries, max_entries);
  ConvCheckpointArgs c16 = c32;
  c16.conv_states = b16.lines.get();
  c16.state_dtype = DType::BF16;
  const PackedConvArgs a32 = device_args(hp, in, fp32);
  const PackedConvArgs a16 = b16.args(hp, a32);
  std::string why;
  REQUIRE_MESSAGE(kda::conv_checkpoint_supported(c16, &why), "unsupported: ", why);
  REQUIRE_MESSAGE(kda::packed_causal_conv1d_supported(a16, &why), "unsupported: ", why);
  kda::conv_checkpoint(c32, stream);
  kda::packed_causal_conv1d(a32, stream);
  kda::conv_checkpoint(c16, stream);
  kda::packed_causal_conv1d(a16, stream);
  KDA_TEST_CUDA(cudaStreamSynchronize(stream));
  std::vector<uint16_t> got16;
  const Result r16 = b16.download_widened(got16), r32 = fp32.download();
  int64_t taps = 0, unwritten = 0;
  for (const CheckpointEntry& e : plan.valid)
    for (int64_t c = 0; c < hp.dim; ++c)
      for (int64_t tap = 0; tap < 3; ++tap) {
        ++taps;
        unwritten += got16[state_index(hp, e.line, c, tap)] == kda::test::kPoison16;
      }
  const int64_t pool_bits = diff_bits(r16.states.data(), r32.states.data(), r16.states.size() * sizeof(float));
  const int64_t out_bits = diff_bits(r16.out.data(), r32.out.data(), r16.out.size());
  MESSAGE(what << "\n  " << plan.valid.size() << " checkpoints (+" << plan.malformed << " malformed) on bf16 lines: "
               << pool_bits << " pool bits differ from the fp32 lines' run (narrowed), " << unwritten << " of " << taps
               << " checkpoint taps unwritten; packed conv output " << out_bits << " bits");
  CHECK(taps > 0);
  CHECK(pool_bits == 0);
  CHECK(unwritten == 0);
  CHECK(out_bits == 0);
}

}  // namespace

TEST_CASE("the packed conv on bf16 conv-state lines equals the stock path and the fp32 lines bit for bit") {
  Rng rng = rng_for("bf16 lines");
  Stream stream;
  Spec s;
  SUBCASE("the (lines, dim, 3) pool: strides (3 dim, 3, 1)") {
    s.part_dim = 128;
    s.row_pad = 64;
    s.init_frac = 0.5;
    s.lens = random_lengths(rng, 30, quick() ? 1500 : 6000);
  }
  SUBCASE("the (lines, 3, dim) pool: strides (3 dim, 1, dim), capacity past the batch") {
    s.part_dim = 64;
    s.transposed = true;
    s.row_pad = 2;
    s.out_offset = 1;
    s.init_frac = 0.7;
    s.seq_pad = 3;
    s.token_pad = 40;
    s.lens = random_lengths(rng, 30, quick() ? 1500 : 6000);
  }
  check_bf16_lines(s, rng, stream.get());
}

TEST_CASE("conv-state checkpoints then the packed conv on bf16 lines equal the fp32 lines narrowed") {
  Rng rng = rng_for("bf16 checkpoints");
  Stream stream;
  Spec s;
  s.part_dim = 128;
  s.init_frac = 0.5;
  s.extra_lines = 120;
  SUBCASE("the (lines, dim, 3) pool") { s.row_pad = 64; }
  SUBCASE("the (lines, 3, dim) pool") { s.transposed = true; }
  s.lens = random_lengths(rng, 30, quick() ? 1500 : 4000);
  check_bf16_checkpoints(s, rng, stream.get());
}
