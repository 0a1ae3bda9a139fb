// The device code of the conv-state checkpoint op (conv_checkpoint.h): the per-entry and
// per-element code, shared by the kernel (at the end of this file) and the CPU tests, which run
// this very code on host arrays.
// Every read is a plain load through the argument pointers (device pointers in the kernel, host
// pointers in the tests). Pool elements are fp32 or bf16 (state_dtype), read and written through
// common/state_elements.h; a value is a bf16 input or an old tap, so either type holds it exactly.
// Plain C++ with KDA_HOST_DEVICE up to the kernel, which only nvcc sees.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "common/state_checkpoints.h"
#include "common/state_elements.h"
#include "conv/conv_checkpoint.h"

namespace kda::conv {

// Where one entry's taps come from and go to, in elements of conv_states; dst < 0: the entry
// writes nothing.
struct CheckpointSource {
  int64_t dst = -1;    // conv_states offset of the checkpoint line
  int64_t src = 0;     // conv_states offset of the sequence's own line (read when end < 3)
  int64_t row0 = 0;    // x row of tap 0, bos + end - 3 (below bos when end < 3)
  int64_t end = 0;     // the sequence's rows taken in
  bool init = false;   // the sequence has an initial state
};

// Entry i's source, or dst -1 for an unused entry (line < 0) and for every malformed one
// (conv_checkpoint.h lists the checks): nothing it then describes is out of bounds.
KDA_HOST_DEVICE inline CheckpointSource checkpoint_source(const ConvCheckpointParams& a, int64_t i) {
  CheckpointSource s;
  const CheckpointEntry e = a.entries[i];
  if (e.line < 0 || e.line >= a.cache_lines || e.line == a.null_line) return s;
  if (e.seq < 0 || e.seq >= a.num_seqs) return s;
  const int64_t line = a.cache_indices[e.seq];
  if (line == a.null_line || line < 0 || line >= a.cache_lines || line == e.line) return s;
  const int64_t bos = a.query_start_loc[e.seq];
  const int64_t eos = a.query_start_loc[e.seq + 1];
  if (bos < 0 || eos < bos || eos > a.num_tokens) return s;
  if (e.end < 1 || e.end > eos - bos) return s;
  s.dst = e.line * a.state_stride_line;
  s.src = line * a.state_stride_line;
  s.row0 = bos + e.end - 3;
  s.end = e.end;
  s.init = a.has_initial_state != nullptr &&
           reinterpret_cast<const unsigned char*>(a.has_initial_state)[e.seq] != 0;
  return s;
}

// Tap j (0 oldest, 2 most recent) of channel c of the checkpoint of a valid source s: the
// input row end - 3 + j of the sequence, or for a row before its first, the old tap 3 + r of
// its line (with an initial state) or zero.
KDA_HOST_DEVICE inline float checkpoint_value(const ConvCheckpointParams& a, const CheckpointSource& s,
                                              int64_t c, int j) {
  const int64_t r = s.end - 3 + j;
  if (r >= 0)
    return state_bf16_to_float(
        static_cast<const uint16_t*>(a.x)[(s.row0 + j) * a.x_row_stride + c]);
  if (!s.init) return 0.0f;
  return load_state_elem(a.conv_states,
                         s.src + c * a.state_stride_dim + (3 + r) * a.state_stride_tap,
                         a.state_dtype == DType::BF16);
}

// Stores v as the element (channel c, tap j) of a valid source's checkpoint line, in the pool's
// type. A bf16 store rounds, which changes no value here: v is a bf16 input or a tap of the same
// pool (a NaN is stored as the canonical 0x7FFF, as the packed conv stores it).
KDA_HOST_DEVICE inline void checkpoint_store(const ConvCheckpointParams& a, const CheckpointSource& s,
                                             int64_t c, int j, float v) {
  store_state_elem(a.conv_states, s.dst + c * a.state_stride_dim + j * a.state_stride_tap, v,
                   a.state_dtype == DType::BF16);
}

// One element: writes tap j of channel c of entry source s (nothing when s is not valid).
KDA_HOST_DEVICE inline void checkpoint_element(const ConvCheckpointParams& a, const CheckpointSource& s,
                                               int64_t c, int j) {
  if (s.dst < 0) return;
  checkpoint_store(a, s, c, j, checkpoint_value(a, s, c, j));
}

}  // namespace kda::conv

// The kernel: compiled in conv_checkpoint.cu alone (internal linkage); a host compiler, or a
// test defining KDA_EMULATED_BODIES_ONLY, sees the code above only.
#if defined(__CUDACC__) && !defined(KDA_EMULATED_BODIES_ONLY)

namespace kda::conv {
namespace {

// CTA (x, y): entry x, channels [y * kConvCheckpointChannelsPerCta, ...), one per thread, its 3
// taps read before any is written. An unused or malformed entry returns at once.
__global__ void __launch_bounds__(kConvCheckpointChannelsPerCta)
conv_checkpoint_kernel(const ConvCheckpointParams a) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kConvCheckpointChannelsPerCta + threadIdx.x;
  if (c >= a.dim) return;
  const CheckpointSource s = checkpoint_source(a, blockIdx.x);
  if (s.dst < 0) return;
  float v[3];
#pragma unroll
  for (int j = 0; j < 3; ++j) v[j] = checkpoint_value(a, s, c, j);
#pragma unroll
  for (int j = 0; j < 3; ++j) checkpoint_store(a, s, c, j, v[j]);
}

}  // namespace
}  // namespace kda::conv

#endif  // __CUDACC__ && !KDA_EMULATED_BODIES_ONLY
