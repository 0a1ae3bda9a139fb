// CPU reference of the packed causal conv1d and its conv-state update, on host arrays.
// Plain C++ (no CUDA) so CI runs it. Not bit-exact to the GPU (see ConvMath): tests compare
// against it with a tolerance and use it for hand-computed cases.
#pragma once

#include "kda/packed_conv.h"

namespace kda::reference {

enum class ConvMath {
  // The stock order in fp32: acc = bias or +0, four std::fma oldest tap first, then
  // conv::silu_host_approx. Differs from the device only through SiLU (a few fp32 ulps).
  kStockFp32,
  // float64 sum of the four products and the bias, exact SiLU acc / (1 + exp(-acc)),
  // rounded to fp32 and then to the output dtype.
  kFloat64,
};

// Runs the conv described by `host_args` on the host. Every pointer in host_args is a HOST
// pointer; shapes, element strides, skipping rules and out_plane_stride mean exactly what they
// mean for kda::packed_causal_conv1d (a null has_initial_state means no sequence has one).
// The conv states are fp32 or bf16 (state_dtype; bf16 only with bf16 x, as the kernel): taps
// widen exactly on load; the new taps, bf16 inputs or old taps, round back to bf16 (nearest even)
// without changing value.
// Writes the output rows of the sequences it runs and the
// first three taps of their state lines, nothing else. Sequences run in batch order, each
// reading its whole old state before writing the new one.
// Throws kda::Error (function "kda::reference::causal_conv1d") for malformed arguments,
// including a decreasing query_start_loc or one that ends past num_tokens; it checks them all
// before writing anything.
void causal_conv1d(const PackedConvArgs& host_args, ConvMath math = ConvMath::kStockFp32);

}  // namespace kda::reference
