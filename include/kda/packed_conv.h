// kda-prefill: the packed Q|K|V causal depthwise conv1d (width 4) of a KDA layer's prefill.
//
// One launch reads the Q|K|V columns of the in_proj output in place, convolves them in FP32
// with the stock path's arithmetic, applies SiLU, writes `dim / part_dim` dense planes and
// updates the conv states. Outputs and states are bit-identical to the stock path
// (three times: cast the strided slice to a dense FP32 copy, FP32 conv, cast back).
// The (sequence, token chunk) program map is computed on the device from query_start_loc,
// so a launch can be captured in a CUDA graph and replayed with new batch metadata.
#pragma once

#include <cstdint>
#include <string>

#include "kda/error.h"
#include "kda/types.h"
#include "kda/varlen.h"

namespace kda {

// All strides are in elements. All pointers are device pointers.
struct PackedConvArgs {
  const void* x = nullptr;  DType x_dtype = DType::BF16;  // (num_tokens, dim), column stride 1
  int64_t num_tokens = 0, dim = 0, x_row_stride = 0;      // row stride >= dim
  const float* weight = nullptr;                          // (dim, 4), taps oldest first
  int64_t weight_stride_dim = 4, weight_stride_tap = 1;
  const float* bias = nullptr;                            // (dim) or nullptr
  void* conv_states = nullptr;                            // (varlen.cache_lines, dim, state_len), in place
  DType state_dtype = DType::FP32;                        // FP32, or BF16 with x_dtype BF16 (exact)
  int64_t state_len = 3;                                  // >= 3; only taps 0..2 are used
  int64_t state_stride_line = 0, state_stride_dim = 0, state_stride_tap = 0;
  VarlenArgs varlen;                                      // the batch; cache_lines >= 1
  int64_t cache_indices_stride = 1;                       // element stride of varlen.cache_indices
  int64_t part_dim = 0;                                   // dim = parts x part_dim
  bool silu = true;
  void* out = nullptr;                                    // (dim / part_dim, num_tokens, part_dim), x_dtype
  int64_t out_plane_stride = 0;                           // elements between planes; 0: num_tokens * part_dim
};

// num_tokens and varlen.num_seqs are capacities: the grid depends only on them and on
// dim/part_dim (and on x_dtype and the alignment of x and out, which pick the vector width; a
// captured graph fixes all of these), never on the contents of query_start_loc.
// Sequences past the real ones have zero length (repeated query_start_loc values), so one
// captured launch serves every batch that fits. A sequence whose cache index equals
// varlen.null_line, or lies outside [0, varlen.cache_lines), is skipped: it writes no output
// and touches no state. Output rows past query_start_loc[num_seqs] are never written.
// Two sequences naming the same cache line is undefined behaviour (validate on the host).

// True when packed_causal_conv1d reproduces the stock path bit for bit for these arguments
// and they are well formed; otherwise false, with the reason in *why when why is non-null.
// Reads no device memory.
bool packed_causal_conv1d_supported(const PackedConvArgs& args, std::string* why = nullptr);

// Enqueues the conv on `stream`. Throws kda::Error (and enqueues nothing) when
// packed_causal_conv1d_supported() is false. Makes no host synchronisation and allocates
// nothing, so it may be captured into a CUDA graph.
void packed_causal_conv1d(const PackedConvArgs& args, Stream stream);

}  // namespace kda
