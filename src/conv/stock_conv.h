// The stock-path baseline of the packed conv, on the GPU: per part (plane), exactly the three
// passes of vLLM's causal_conv1d_fn path (docs/stock-conv.md):
//   1. cast the strided x slice to a dense FP32 copy (num_tokens, part_dim),
//   2. FP32 conv into a dense FP32 output, then a separate kernel updates the conv states
//      (stream order puts every read of the old state before the write),
//   3. cast the FP32 output back to x_dtype into the plane, rows the conv produced only.
// The conv state is fp32 or bf16 (state_dtype, docs/stock-conv.md): a tap widens exactly on
// load; the new taps, bf16 inputs or old taps, round back to bf16 without changing value.
// It is the benchmark's baseline and the bit-exact reference of the GPU tests, so it is kept
// plain and separate from the packed kernel; only the per-element arithmetic
// (conv/conv_math.h) is shared. CUDA-free: stock_conv_plan.cpp is its plan (checks, workspace,
// the per-part params), stock_conv_kernel.cuh its device code, stock_conv.cu its launches.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kda/packed_conv.h"

namespace kda::baseline {

// Bytes of device workspace stock_causal_conv1d needs: the dense FP32 input and output of one
// part, 2 x num_tokens x part_dim floats (each 256-byte aligned). Throws kda::Error when
// packed_causal_conv1d_supported(args) is false.
std::size_t stock_causal_conv1d_workspace_bytes(const PackedConvArgs& args);

// Enqueues the stock path on `stream`: same arguments, outputs and state update as
// kda::packed_causal_conv1d. `workspace` is a device buffer of at least
// stock_causal_conv1d_workspace_bytes(args) bytes (256-byte aligned). Throws kda::Error
// (function "kda::baseline::stock_causal_conv1d") and enqueues nothing when
// packed_causal_conv1d_supported(args) is false or the workspace is missing or too small.
// Allocates nothing and does not synchronise.
void stock_causal_conv1d(const PackedConvArgs& args, void* workspace, std::size_t workspace_bytes,
                         Stream stream);

// The plan (stock_conv_plan.cpp).

// One part's (plane's) view of PackedConvArgs: every pointer already offset to the part's
// first channel, channel indices below run over [0, part_dim).
struct StockPartParams {
  const void* x = nullptr;  // (num_tokens, part_dim) slice, row stride x_row_stride
  int64_t x_row_stride = 0;
  int64_t num_tokens = 0, part_dim = 0;
  const float* weight = nullptr;  // (part_dim, 4)
  int64_t weight_stride_dim = 0, weight_stride_tap = 0;
  const float* bias = nullptr;  // (part_dim) or nullptr
  void* states = nullptr;       // (cache_lines, part_dim, >= 3), fp32 or bf16 elements
  bool state_dtype_is_bf16 = false;  // state_dtype BF16: taps widen on load, round back on store
  int64_t cache_lines = 0;
  int64_t state_stride_line = 0, state_stride_dim = 0, state_stride_tap = 0;
  const int32_t* query_start_loc = nullptr;  // (num_seqs + 1)
  int64_t num_seqs = 0;
  const int32_t* cache_indices = nullptr;
  int64_t cache_indices_stride = 0;
  const bool* has_initial_state = nullptr;  // nullptr: no sequence has an initial state
  bool has_null_line = false;
  int32_t null_line = 0;
  bool silu = true;
  float* x32 = nullptr;  // dense (num_tokens, part_dim) FP32 copy of the slice
  float* y32 = nullptr;  // dense (num_tokens, part_dim) FP32 conv output
  void* out = nullptr;   // the part's plane, dense (num_tokens, part_dim), x dtype
};

// Throws kda::Error for `function` unless packed_causal_conv1d_supported(args).
void check_stock_supported(const PackedConvArgs& args, const char* function);

// Bytes of one of the two dense fp32 (num_tokens, part_dim) buffers, 256-byte aligned.
std::size_t part_fp32_bytes(const PackedConvArgs& args);
constexpr std::size_t kStockWorkspaceAlign = 256;

// The params of part (plane) `part` of args (which passed the check), its dense fp32 buffers in
// `workspace` (stock_causal_conv1d_workspace_bytes()).
StockPartParams make_part_params(const PackedConvArgs& args, int64_t part, void* workspace);

// Threads per block over a part's channels: 256, 128 or 64, dividing part_dim (a multiple of
// 64, supported() says).
unsigned threads_for(int64_t part_dim);

}  // namespace kda::baseline
