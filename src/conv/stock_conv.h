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
// (conv/silu_recipe.h) is shared.
#pragma once

#include <cstddef>

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

}  // namespace kda::baseline
