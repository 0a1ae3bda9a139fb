// The stock-path baseline's plan (stock_conv.h): its argument check (the packed conv's), its
// workspace and the per-part params of its launches. Plain C++, no CUDA.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/check.h"
#include "common/state_elements.h"
#include "common/varlen_map.h"
#include "conv/stock_conv.h"
#include "kda/packed_conv.h"

namespace kda::baseline {
namespace {

constexpr const char* kWorkspaceFn = "kda::baseline::stock_causal_conv1d_workspace_bytes";

std::size_t align_up(std::size_t n) {
  return (n + kStockWorkspaceAlign - 1) / kStockWorkspaceAlign * kStockWorkspaceAlign;
}

// `p` advanced by `elements` elements of `dtype` (x and out are x_dtype arrays).
const void* offset_elems(const void* p, int64_t elements, DType dtype) {
  return static_cast<const char*>(p) + elements * static_cast<int64_t>(dtype_size(dtype));
}
void* offset_elems(void* p, int64_t elements, DType dtype) {
  return static_cast<char*>(p) + elements * static_cast<int64_t>(dtype_size(dtype));
}

}  // namespace

std::size_t part_fp32_bytes(const PackedConvArgs& a) {
  return align_up(static_cast<std::size_t>(a.num_tokens) * static_cast<std::size_t>(a.part_dim) *
                  sizeof(float));
}

void check_stock_supported(const PackedConvArgs& a, const char* fn) {
  std::string why;
  if (!packed_causal_conv1d_supported(a, &why))
    KDA_FAIL(fn, "arguments rejected by packed_causal_conv1d_supported: ", why);
}

// part_dim is a multiple of 64 (supported()), so a block covers whole 64-channel groups.
unsigned threads_for(int64_t part_dim) {
  if (part_dim % 256 == 0) return 256;
  if (part_dim % 128 == 0) return 128;
  return 64;
}

StockPartParams make_part_params(const PackedConvArgs& a, int64_t part, void* workspace) {
  const int64_t plane_stride = a.out_plane_stride ? a.out_plane_stride : a.num_tokens * a.part_dim;
  const int64_t ch0 = part * a.part_dim;
  StockPartParams p;
  p.x = offset_elems(a.x, ch0, a.x_dtype);
  p.x_row_stride = a.x_row_stride;
  p.num_tokens = a.num_tokens;
  p.part_dim = a.part_dim;
  p.weight = a.weight + ch0 * a.weight_stride_dim;
  p.weight_stride_dim = a.weight_stride_dim;
  p.weight_stride_tap = a.weight_stride_tap;
  p.bias = a.bias ? a.bias + ch0 : nullptr;
  p.state_dtype_is_bf16 = a.state_dtype == DType::BF16;
  p.states = state_elem_ptr(a.conv_states, ch0 * a.state_stride_dim, p.state_dtype_is_bf16);
  p.state_stride_line = a.state_stride_line;
  p.state_stride_dim = a.state_stride_dim;
  p.state_stride_tap = a.state_stride_tap;
  varlen::copy_varlen_fields(p, a.varlen);
  p.cache_indices_stride = a.cache_indices_stride;
  p.has_null_line = a.varlen.null_line.has_value();
  p.null_line = a.varlen.null_line.value_or(0);
  p.silu = a.silu;
  p.x32 = static_cast<float*>(workspace);
  p.y32 = reinterpret_cast<float*>(static_cast<char*>(workspace) + part_fp32_bytes(a));
  p.out = offset_elems(a.out, part * plane_stride, a.x_dtype);
  return p;
}

std::size_t stock_causal_conv1d_workspace_bytes(const PackedConvArgs& args) {
  check_stock_supported(args, kWorkspaceFn);
  return 2 * part_fp32_bytes(args);
}

}  // namespace kda::baseline
