// prefill_driver --prefix-sharing (prefix_sharing.h).
//
// Prompt A has L tokens (L a multiple of 512, at most 2048 and the batch capacity) and is
// prefilled with a checkpoint every I = L / 8 tokens into 7 lines. Prompt B has L tokens too;
// its first S = 6 I (75%) are A's. B runs twice: in full from an empty state on its own line,
// and continued: A's checkpoint after S tokens is copied into a fresh line (the checkpoint line
// stays for other requests), and B's last L - S rows run from it with has_initial_state.
// The continued run sees B's suffix rows at other row offsets and in a smaller bucket than the
// full one; docs/design.md ("State checkpoints") says why its results are still bitwise those
// of the full run with fp32 recurrent pools and whole sequences, and within tolerance with bf16
// pools or sequences cut into segments (runtime.sequence_parallel).
#include "prefix_sharing.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "host_data.h"
#include "kda/config.h"

namespace {

constexpr int kCheckpoints = 7;  // prompt A's checkpoint lines
constexpr int64_t kLines = 11;   // A, its checkpoints, B in full, B continued, and the null line

// L: the prompts' length, the largest multiple of 512 up to 2048 that the batch capacity holds.
int64_t prompt_tokens(const kda::Config& cfg) {
  return std::min<int64_t>(2048, cfg.runtime.batch_token_capacity()) / 512 * 512;
}

void check(cudaError_t e, const char* what) {
  kda::detail::check_cuda(e, "prefill_driver --prefix-sharing", what, __FILE__, __LINE__);
}

// One sequence on `line`, rows [0, len) of hidden_states(), optionally with checkpoints.
struct OneSeq {
  int32_t qsl[2] = {0, 0};
  int32_t line = 0;
  bool initial = false;
  int32_t interval = 0;
  int32_t ckpt_start[2] = {0, 0};
  std::vector<int32_t> ckpt_lines;

  kda::BatchView view() const {
    kda::BatchView b;
    b.query_start_loc = qsl;
    b.cache_indices = &line;
    b.has_initial_state = &initial;
    b.num_seqs = 1;
    if (!ckpt_lines.empty()) {
      b.checkpoint_interval = &interval;
      b.checkpoint_start_loc = ckpt_start;
      b.checkpoint_lines = ckpt_lines.data();
    }
    return b;
  }
};

// `count` elements of type `dtype` (fp32 or bf16) at device address `src`, widened to fp32.
std::vector<float> download_widened(const void* src, int64_t count, kda::DType dtype) {
  std::vector<float> v(static_cast<size_t>(count));
  if (dtype == kda::DType::FP32) {
    check(cudaMemcpy(v.data(), src, v.size() * 4, cudaMemcpyDeviceToHost), "cudaMemcpy (state line)");
    return v;
  }
  std::vector<uint16_t> h(v.size());
  check(cudaMemcpy(h.data(), src, h.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy (state line)");
  for (size_t i = 0; i < h.size(); ++i) {
    const uint32_t bits = static_cast<uint32_t>(h[i]) << 16;  // bf16 is the top half of an fp32
    std::memcpy(&v[i], &bits, 4);
  }
  return v;
}

// Byte address of element `elems` of a pool of `dtype`.
char* pool_at(void* pool, int64_t elems, kda::DType dtype) {
  return static_cast<char*>(pool) + elems * static_cast<int64_t>(kda::dtype_size(dtype));
}

// The layer's conv and recurrent state of `line`, widened to fp32, as one host vector per layer.
std::vector<std::vector<float>> line_states(kda::PrefillModule& m, int32_t line) {
  const kda::Config& c = m.config();
  const kda::DType cd = c.pools.conv_dtype, rd = c.pools.recurrent_dtype;
  std::vector<std::vector<float>> out;
  for (int l = 0; l < static_cast<int>(c.runtime.num_layers); ++l) {
    std::vector<float> v =
        download_widened(pool_at(m.conv_state_pool(l), line * m.conv_state_strides(l).line, cd), c.conv_line_elems(), cd);
    const std::vector<float> r = download_widened(
        pool_at(m.recurrent_state_pool(l), line * m.recurrent_state_strides(l).line, rd), c.recurrent_line_elems(), rd);
    v.insert(v.end(), r.begin(), r.end());
    out.push_back(std::move(v));
  }
  return out;
}

// Copies line `from` to line `to` in both pools of every layer, on `stream`.
void copy_line(kda::PrefillModule& m, int32_t from, int32_t to, cudaStream_t stream) {
  const kda::Config& c = m.config();
  const kda::DType cd = c.pools.conv_dtype, rd = c.pools.recurrent_dtype;
  for (int l = 0; l < static_cast<int>(c.runtime.num_layers); ++l) {
    const int64_t cl = m.conv_state_strides(l).line, rl = m.recurrent_state_strides(l).line;
    check(cudaMemcpyAsync(pool_at(m.conv_state_pool(l), to * cl, cd), pool_at(m.conv_state_pool(l), from * cl, cd),
                          static_cast<size_t>(c.conv_line_elems()) * kda::dtype_size(cd), cudaMemcpyDeviceToDevice,
                          stream),
          "cudaMemcpyAsync (conv line)");
    check(cudaMemcpyAsync(pool_at(m.recurrent_state_pool(l), to * rl, rd),
                          pool_at(m.recurrent_state_pool(l), from * rl, rd),
                          static_cast<size_t>(c.recurrent_line_elems()) * kda::dtype_size(rd),
                          cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpyAsync (recurrent line)");
  }
}

// Writes rows of host bf16 data into hidden_states() rows [0, n) and waits for the copy.
void upload_rows(kda::PrefillModule& m, const uint16_t* rows, int64_t n) {
  check(cudaMemcpy(m.hidden_states(), rows, static_cast<size_t>(n * m.config().model.hidden_size) * 2,
                   cudaMemcpyHostToDevice),
        "cudaMemcpy (hidden states)");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

std::vector<uint16_t> download_rows(kda::PrefillModule& m, int64_t first, int64_t n, cudaStream_t s) {
  const int64_t D = m.config().model.hidden_size;
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  std::vector<uint16_t> v(static_cast<size_t>(n * D));
  check(cudaMemcpy(v.data(), static_cast<const uint16_t*>(m.output()) + first * D, v.size() * 2, cudaMemcpyDeviceToHost),
        "cudaMemcpy (output)");
  return v;
}

struct StateDiff {
  int64_t bits = 0;
  double max_abs = 0, num = 0, den = 0;
  double rel() const { return std::sqrt(num / (den > 0 ? den : 1)); }
};

StateDiff compare_states(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want) {
  StateDiff d;
  for (size_t l = 0; l < want.size(); ++l) {
    d.bits += driver::diff_bits(got[l].data(), want[l].data(), want[l].size() * 4);
    for (size_t i = 0; i < want[l].size(); ++i) {
      const double e = static_cast<double>(got[l][i]) - want[l][i];
      d.max_abs = std::max(d.max_abs, std::isfinite(e) ? std::fabs(e) : INFINITY);
      d.num += e * e;
      d.den += static_cast<double>(want[l][i]) * want[l][i];
    }
  }
  return d;
}

}  // namespace

std::string prefix_sharing_unmet(const kda::Config& cfg) {
  if (prompt_tokens(cfg) >= 512 && cfg.runtime.layer_steps == kda::LayerSteps::Full &&
      cfg.runtime.max_checkpoints >= kCheckpoints && cfg.pools.cache_lines >= kLines)
    return {};
  return "--prefix-sharing needs runtime.layer_steps: full, a batch token capacity of at least 512, "
         "runtime.max_checkpoints >= " + std::to_string(kCheckpoints) + " and pools.cache_lines >= " +
         std::to_string(kLines) + "; this config has " +
         (cfg.runtime.layer_steps == kda::LayerSteps::Full ? "full" : "conv") + ", " +
         std::to_string(cfg.runtime.batch_token_capacity()) + ", " + std::to_string(cfg.runtime.max_checkpoints) +
         " and " + std::to_string(cfg.pools.cache_lines);
}

int run_prefix_sharing(kda::PrefillModule& module, uint64_t seed, kda::Stream stream) {
  const kda::Config& cfg = module.config();
  if (const std::string unmet = prefix_sharing_unmet(cfg); !unmet.empty()) {
    std::fprintf(stderr, "prefill_driver: %s\n", unmet.c_str());
    return 2;
  }
  const int64_t D = cfg.model.hidden_size;
  const int64_t L = prompt_tokens(cfg);
  const int checkpoints = kCheckpoints;
  const int64_t I = L / 8, S = 6 * I;
  // Ten lines, none the null line: A, its 7 checkpoints, B in full, B continued.
  std::vector<int32_t> lines;
  for (int32_t l = 0; static_cast<int64_t>(lines.size()) < kLines - 1; ++l)
    if (l != cfg.pools.null_line) lines.push_back(l);
  const int32_t line_a = lines[0], line_full = lines[8], line_cont = lines[9];
  const int32_t ckpt_at_s = lines[1 + 5];  // the 6th checkpoint: after 6 I = S tokens

  const std::vector<uint16_t> a = driver::random_bf16(static_cast<size_t>(L * D), seed);
  std::vector<uint16_t> b = driver::random_bf16(static_cast<size_t>(L * D), seed + 1);
  std::copy(a.begin(), a.begin() + S * D, b.begin());  // B's first S rows are A's

  OneSeq run_a;
  run_a.qsl[1] = static_cast<int32_t>(L);
  run_a.line = line_a;
  run_a.interval = static_cast<int32_t>(I);
  run_a.ckpt_start[1] = checkpoints;
  run_a.ckpt_lines.assign(lines.begin() + 1, lines.begin() + 1 + checkpoints);
  OneSeq full_b;
  full_b.qsl[1] = static_cast<int32_t>(L);
  full_b.line = line_full;
  OneSeq cont_b;
  cont_b.qsl[1] = static_cast<int32_t>(L - S);
  cont_b.line = line_cont;
  cont_b.initial = true;

  std::printf("prefix sharing: prompt A %lld tokens, checkpoints every %lld tokens into %d lines; prompt B %lld "
              "tokens sharing A's first %lld\n",
              (long long)L, (long long)I, checkpoints, (long long)L, (long long)S);
  upload_rows(module, a.data(), L);
  module.run(run_a.view(), stream);
  upload_rows(module, b.data(), L);
  module.run(full_b.view(), stream);
  const std::vector<uint16_t> want_out = download_rows(module, S, L - S, stream);
  const auto want_states = line_states(module, line_full);

  upload_rows(module, b.data() + S * D, L - S);
  copy_line(module, ckpt_at_s, line_cont, stream);
  module.run(cont_b.view(), stream);
  const std::vector<uint16_t> got_out = download_rows(module, 0, L - S, stream);
  const auto got_states = line_states(module, line_cont);

  const int64_t out_bits = driver::diff_bits(got_out.data(), want_out.data(), want_out.size() * 2);
  double out_max = 0;
  for (size_t i = 0; i < want_out.size(); ++i)
    out_max = std::max(out_max, std::fabs(driver::bf16_value(got_out[i]) - driver::bf16_value(want_out[i])));
  const double out_rel = driver::rel_error_bf16(got_out, want_out);
  const StateDiff st = compare_states(got_states, want_states);

  // GPU time of B's forward, in full and continued (the line copy before each continued run is
  // outside the timed span), after the runs above captured both buckets' graphs.
  constexpr int kIters = 10;
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  auto time_run = [&](const OneSeq& seq, bool copy_first) {
    double total = 0;
    for (int i = 0; i < kIters; ++i) {
      if (copy_first) copy_line(module, ckpt_at_s, line_cont, stream);
      check(cudaEventRecord(e0, stream), "cudaEventRecord");
      module.run(seq.view(), stream);
      check(cudaEventRecord(e1, stream), "cudaEventRecord");
      check(cudaEventSynchronize(e1), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
      total += ms;
    }
    return total / kIters;
  };
  upload_rows(module, b.data(), L);
  const double full_ms = time_run(full_b, false);
  upload_rows(module, b.data() + S * D, L - S);
  const double cont_ms = time_run(cont_b, true);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);

  const bool bitwise = out_bits == 0 && st.bits == 0;
  const bool ok = bitwise || (out_rel <= 1e-2 && st.rel() <= 1e-2);
  std::printf("tokens saved: %lld of %lld (%.0f%%); B in full %.3f ms, continued from the checkpoint %.3f ms "
              "(%.2fx), %d layers\n",
              (long long)S, (long long)L, 100.0 * S / L, full_ms, cont_ms, full_ms / cont_ms,
              static_cast<int>(cfg.runtime.num_layers));
  std::printf("continued vs full prefill of B: output rows [%lld, %lld): %lld differing bits, max |diff| %.3g, "
              "rel err %.2e; final states (conv + recurrent, every layer): %lld differing bits, max |diff| %.3g, "
              "rel err %.2e\n",
              (long long)S, (long long)L, (long long)out_bits, out_max, out_rel, (long long)st.bits, st.max_abs,
              st.rel());
  std::printf("prefix sharing: %s\n", bitwise ? "OK (bitwise identical)"
                                      : ok    ? "OK (within 1e-2 relative error, not bitwise)"
                                              : "FAILED");
  return ok ? 0 : 1;
}
