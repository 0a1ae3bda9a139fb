// The stock-path baseline's launches (stock_conv.h): per part, its four kernels
// (stock_conv_kernel.cuh) on the params of its plan (stock_conv_plan.cpp).
#include "conv/stock_conv.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/arg_checks.h"
#include "common/check.h"
#include "common/cuda_check.h"
#include "conv/stock_conv_kernel.cuh"

namespace kda::baseline {
namespace {

constexpr const char* kFn = "kda::baseline::stock_causal_conv1d";
constexpr int64_t kMaxGridRows = 1 << 20;  // grid.x cap; kernels stride over further rows

template <typename T>
void run_parts(const PackedConvArgs& a, void* workspace, Stream stream) {
  const int64_t parts = a.dim / a.part_dim;
  const unsigned threads = threads_for(a.part_dim);
  const unsigned col_blocks = static_cast<unsigned>((a.part_dim + threads - 1) / threads);
  const dim3 token_grid(static_cast<unsigned>(std::min(a.num_tokens, kMaxGridRows)), col_blocks);
  const dim3 seq_grid(static_cast<unsigned>(std::min(a.varlen.num_seqs, kMaxGridRows)), col_blocks);
  cudaStream_t s = stream;
  for (int64_t part = 0; part < parts; ++part) {
    const StockPartParams p = make_part_params(a, part, workspace);
    cast_slice_to_fp32_kernel<T><<<token_grid, threads, 0, s>>>(p);
    KDA_CUDA_CHECK(kFn, cudaGetLastError());
    conv_fp32_kernel<<<token_grid, threads, 0, s>>>(p);
    KDA_CUDA_CHECK(kFn, cudaGetLastError());
    update_state_kernel<<<seq_grid, threads, 0, s>>>(p);
    KDA_CUDA_CHECK(kFn, cudaGetLastError());
    cast_back_kernel<T><<<token_grid, threads, 0, s>>>(p);
    KDA_CUDA_CHECK(kFn, cudaGetLastError());
  }
}

}  // namespace

void stock_causal_conv1d(const PackedConvArgs& args, void* workspace, std::size_t workspace_bytes,
                         Stream stream) {
  check_stock_supported(args, kFn);
  const std::size_t need = 2 * part_fp32_bytes(args);
  KDA_CHECK(workspace_bytes >= need, kFn, "workspace_bytes ", workspace_bytes, " is below the ",
            need, " bytes stock_causal_conv1d_workspace_bytes() asks for");
  KDA_CHECK(need == 0 || workspace != nullptr, kFn, "workspace is null");
  KDA_CHECK(detail::aligned_to(workspace, kStockWorkspaceAlign), kFn, "workspace is not ",
            kStockWorkspaceAlign, "-byte aligned");
  if (args.num_tokens == 0 || args.varlen.num_seqs == 0) return;
  switch (args.x_dtype) {
    case DType::BF16: run_parts<__nv_bfloat16>(args, workspace, stream); return;
    case DType::FP16: run_parts<__half>(args, workspace, stream); return;
    case DType::FP32: run_parts<float>(args, workspace, stream); return;
    default:
      KDA_FAIL(kFn, "x_dtype ", static_cast<int>(args.x_dtype), " is not one of bf16, fp16, fp32");
  }
}

}  // namespace kda::baseline
