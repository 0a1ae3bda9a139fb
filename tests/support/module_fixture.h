// Shared by the module GPU test programs: small configs, random batches, seeded modules, and
// bitwise comparisons of what a module writes (planes, output rows, every pool line).
#pragma once

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kda/config.h"
#include "kda/error.h"
#include "kda/prefill.h"
#include "runtime/random_weights.h"
#include "support/gpu_buffers.h"
#include "support/host_batch.h"
#include "support/test_data.h"

namespace kda::test {

using kda::PrefillModule;

inline kda::Config tiny_config() {
  kda::Config c;
  c.model.hidden_size = 256;
  c.model.num_heads = 2;
  c.runtime.token_buckets = {16, 64, 256};
  c.runtime.max_seqs = 16;
  c.runtime.max_batch_tokens = 1024;
  c.runtime.num_layers = 2;
  c.pools.cache_lines = 33;
  c.pools.null_line = 0;
  return c;
}

inline kda::Config big_config() {
  kda::Config c;
  c.model.hidden_size = 2304;
  c.model.num_heads = 4;
  c.runtime.token_buckets = {512, 2048};
  c.runtime.max_seqs = 64;
  c.runtime.max_batch_tokens = 0;
  c.runtime.num_layers = 2;
  c.pools.cache_lines = 65;
  c.pools.null_line = 0;
  return c;
}

// `tokens` rows cut into 1..max_seqs sequences (some empty), on distinct random lines, about
// one in seven on the null line, half of them continuing from their line's state.
inline HostBatch random_batch(std::mt19937_64& rng, int64_t tokens, const kda::Config& c) {
  const int64_t max_n = std::max<int64_t>(1, std::min<int64_t>(c.runtime.max_seqs, tokens));
  const int64_t n = std::uniform_int_distribution<int64_t>(1, max_n)(rng);
  std::vector<int32_t> cuts(n - 1);
  for (auto& x : cuts) x = static_cast<int32_t>(std::uniform_int_distribution<int64_t>(0, tokens)(rng));
  std::sort(cuts.begin(), cuts.end());
  cuts.insert(cuts.begin(), 0);
  cuts.push_back(static_cast<int32_t>(tokens));
  std::vector<int32_t> lines;
  for (int32_t l = 0; l < c.pools.cache_lines; ++l)
    if (l != c.pools.null_line) lines.push_back(l);
  std::shuffle(lines.begin(), lines.end(), rng);
  std::vector<int32_t> lengths, picked;
  std::vector<bool> initial;
  for (int64_t s = 0; s < n; ++s) {
    lengths.push_back(cuts[s + 1] - cuts[s]);
    picked.push_back(std::uniform_int_distribution<int>(0, 6)(rng) == 0 ? c.pools.null_line : lines[s]);
    initial.push_back(std::uniform_int_distribution<int>(0, 1)(rng) == 1);
  }
  return make_batch(lengths, picked, initial);
}

inline std::unique_ptr<PrefillModule> make_module(const kda::Config& c, uint64_t seed, bool eager = false) {
  auto m = std::make_unique<PrefillModule>(c);
  m->init_random_weights(seed);
  m->set_eager(eager);
  return m;
}

inline void fill_hidden(PrefillModule& m, int64_t tokens, uint64_t seed, cudaStream_t s) {
  kda::detail::fill_uniform_bf16(m.hidden_states(), tokens * m.config().model.hidden_size, seed,
                                 uint64_t{1} << 40, -1.0f, 1.0f, s);
}

inline std::vector<unsigned char> download(const void* p, std::size_t bytes, cudaStream_t s) {
  std::vector<unsigned char> h(bytes);
  KDA_TEST_CUDA(cudaStreamSynchronize(s));
  if (bytes) KDA_TEST_CUDA(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost));
  return h;
}

struct Dims {
  int64_t P, D, cap, H;
  std::size_t plane_bytes() const { return static_cast<std::size_t>(cap * P) * 2; }
  std::size_t conv_pool_bytes(int64_t lines) const { return static_cast<std::size_t>(lines * 3 * P * 3) * 4; }
  std::size_t rec_pool_bytes(int64_t lines) const { return static_cast<std::size_t>(lines * H * 128 * 128) * 4; }
};

inline Dims dims(const kda::Config& c) {
  return {c.model.part_dim(), c.model.hidden_size, c.runtime.batch_token_capacity(), c.model.num_heads};
}

// All three planes, capacity rows each.
inline std::vector<unsigned char> planes_of(const PrefillModule& m, cudaStream_t s) {
  return download(m.conv_planes(), 3 * dims(m.config()).plane_bytes(), s);
}

// Differing bits of rows [0, T) of the three planes.
inline int64_t plane_rows_diff(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b,
                        const Dims& d, int64_t T) {
  int64_t bits = 0;
  for (int i = 0; i < 3; ++i)
    bits += diff_bits(a.data() + i * d.plane_bytes(), b.data() + i * d.plane_bytes(),
                      static_cast<std::size_t>(T * d.P) * 2);
  return bits;
}

// Rows written by the conv: those of sequences that are not on the null line.
inline std::vector<bool> written_rows(const HostBatch& b, const kda::Config& c) {
  std::vector<bool> w(static_cast<std::size_t>(c.runtime.batch_token_capacity()), false);
  for (int64_t s = 0; s < b.num_seqs(); ++s)
    if (b.lines[s] != c.pools.null_line)
      for (int32_t r = b.qsl[s]; r < b.qsl[s + 1]; ++r) w[r] = true;
  return w;
}

// After a run on planes filled with 0xFF: counts written rows holding a non-finite value and
// other rows that lost the NaN poison.
struct PaddingReport {
  int64_t nonfinite_real = 0;
  int64_t unpoisoned_pad = 0;
};

inline PaddingReport padding_report(const std::vector<unsigned char>& planes, const HostBatch& b,
                             const kda::Config& c) {
  const Dims d = dims(c);
  const std::vector<bool> w = written_rows(b, c);
  PaddingReport r;
  for (int i = 0; i < 3; ++i) {
    for (int64_t row = 0; row < d.cap; ++row) {
      const unsigned char* p = planes.data() + i * d.plane_bytes() + row * d.P * 2;
      for (int64_t e = 0; e < d.P; ++e) {
        uint16_t v;
        std::memcpy(&v, p + 2 * e, 2);
        if (w[row]) r.nonfinite_real += (v & 0x7F80u) == 0x7F80u;
        else r.unpoisoned_pad += v != 0xFFFFu;
      }
    }
  }
  return r;
}

inline std::set<int32_t> named_lines(const HostBatch& b, const kda::Config& c) {
  std::set<int32_t> s;
  for (int64_t i = 0; i < b.num_seqs(); ++i)
    if (b.lines[i] != c.pools.null_line) s.insert(b.lines[i]);
  return s;
}

// Lines outside `named` whose bytes changed.
inline int64_t changed_unnamed_lines(const std::vector<unsigned char>& before, const std::vector<unsigned char>& after,
                              std::size_t line_bytes, const std::set<int32_t>& named) {
  int64_t changed = 0;
  const std::size_t lines = before.size() / line_bytes;
  for (std::size_t l = 0; l < lines; ++l) {
    if (named.count(static_cast<int32_t>(l))) continue;
    changed += std::memcmp(before.data() + l * line_bytes, after.data() + l * line_bytes, line_bytes) != 0;
  }
  return changed;
}

inline std::vector<unsigned char> conv_pool(PrefillModule& m, int layer, cudaStream_t s) {
  return download(m.conv_state_pool(layer), dims(m.config()).conv_pool_bytes(m.config().pools.cache_lines), s);
}

inline std::vector<unsigned char> rec_pool(PrefillModule& m, int layer, cudaStream_t s) {
  return download(m.recurrent_state_pool(layer), dims(m.config()).rec_pool_bytes(m.config().pools.cache_lines), s);
}

// Differing bits of the layer output's rows [0, T) of two modules (every layer writes the same
// output buffer: the last one's). With `batch`, only the rows of its sequences that ran (a
// skipped sequence's rows are unspecified); *first_row gets the first differing row, or -1.
inline int64_t output_rows_diff_bits(PrefillModule& a, PrefillModule& b, int64_t T, const HostBatch* batch,
                                     cudaStream_t s, int64_t* first_row = nullptr) {
  const std::size_t row = static_cast<std::size_t>(a.config().model.hidden_size) * 2;
  const auto oa = download(a.output(), T * row, s), ob = download(b.output(), T * row, s);
  const int32_t null_line = a.config().pools.null_line;
  int64_t bits = 0, first = -1;
  for (int64_t seq = 0; seq < (batch ? batch->num_seqs() : 1); ++seq) {
    if (batch && batch->lines[seq] == null_line) continue;
    const int64_t r0 = batch ? batch->qsl[seq] : 0, r1 = batch ? batch->qsl[seq + 1] : T;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t row_bits = diff_bits(oa.data() + r * row, ob.data() + r * row, row);
      if (row_bits && first < 0) first = r;
      bits += row_bits;
    }
  }
  if (first_row) *first_row = first;
  return bits;
}

// Differing bits between two modules after the same batch: planes (rows [0, T)), conv pools,
// recurrent pools (with_recurrent) and, for the full layer, the output rows of the sequences
// that ran. Output rows of skipped sequences are unspecified (the recurrence writes no o row
// for them, so o_proj reads whatever the scratch held): with `batch` given they are left out,
// without it every row [0, T) is compared (same history on both sides, e.g. graph vs eager).
// A non-zero result is broken down by component in a MESSAGE.
inline int64_t module_diff_bits(PrefillModule& a, PrefillModule& b, int64_t T, cudaStream_t s,
                         bool with_recurrent = true, const HostBatch* batch = nullptr) {
  const Dims d = dims(a.config());
  std::string parts;
  int64_t total = 0;
  auto add = [&](const std::string& what, int64_t bits) {
    total += bits;
    if (bits) parts += what + ": " + std::to_string(bits) + " bits; ";
  };
  add("planes", plane_rows_diff(planes_of(a, s), planes_of(b, s), d, T));
  for (int l = 0; l < static_cast<int>(a.config().runtime.num_layers); ++l) {
    const auto ca = conv_pool(a, l, s), cb = conv_pool(b, l, s);
    add("conv pool " + std::to_string(l), diff_bits(ca.data(), cb.data(), ca.size()));
    if (with_recurrent) {
      const auto ra = rec_pool(a, l, s), rb = rec_pool(b, l, s);
      add("recurrent pool " + std::to_string(l), diff_bits(ra.data(), rb.data(), ra.size()));
    }
  }
  if (a.config().runtime.layer_steps == kda::LayerSteps::Full) {
    int64_t first_row = -1;
    const int64_t bits = output_rows_diff_bits(a, b, T, batch, s, &first_row);
    add("output (first differing row " + std::to_string(first_row) + ")", bits);
  }
  if (total) MESSAGE("differing bits by component: ", parts);
  return total;
}

// Differing bits of what `batch` wrote in two modules with module-owned pools whose other lines
// may differ: planes rows [0, T), output rows of the sequences that ran, and every layer's conv
// and recurrent lines that the batch names.
inline int64_t batch_diff_bits(PrefillModule& a, PrefillModule& b, const HostBatch& batch, cudaStream_t s) {
  const kda::Config& c = a.config();
  const Dims d = dims(c);
  int64_t bits = plane_rows_diff(planes_of(a, s), planes_of(b, s), d, batch.tokens());
  const std::size_t conv_line = static_cast<std::size_t>(3 * d.P * 3) * 4, rec_line = static_cast<std::size_t>(d.H * 128 * 128) * 4;
  for (int l = 0; l < static_cast<int>(c.runtime.num_layers); ++l) {
    const auto ca = conv_pool(a, l, s), cb = conv_pool(b, l, s), ra = rec_pool(a, l, s), rb = rec_pool(b, l, s);
    for (int32_t line : named_lines(batch, c)) {
      bits += diff_bits(ca.data() + line * conv_line, cb.data() + line * conv_line, conv_line);
      bits += diff_bits(ra.data() + line * rec_line, rb.data() + line * rec_line, rec_line);
    }
  }
  if (c.runtime.layer_steps == kda::LayerSteps::Full) bits += output_rows_diff_bits(a, b, batch.tokens(), &batch, s);
  return bits;
}

// The what() of the kda::Error that `f` throws (a failed check when it throws none).
template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const kda::Error& e) {
    return e.what();
  }
  FAIL("expected a kda::Error");
  return {};
}

inline void poison_planes(PrefillModule& m, cudaStream_t s) {
  KDA_TEST_CUDA(cudaMemsetAsync(const_cast<void*>(m.conv_planes()), 0xFF, 3 * dims(m.config()).plane_bytes(), s));
}

inline int64_t replays_of_bucket(const kda::ModuleStats& st, int64_t bucket) {
  int64_t n = 0;
  for (const auto& g : st.graphs) n += g.bucket_tokens == bucket ? g.replays : 0;
  return n;
}

}  // namespace kda::test
