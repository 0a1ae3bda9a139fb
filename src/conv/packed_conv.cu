// The packed Q|K|V causal conv1d's launch: the checks and params of its plan
// (packed_conv_plan.cpp), then the kernel instance (packed_conv_kernel.cuh) the arguments need.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/check.h"
#include "common/cuda_check.h"
#include "conv/packed_conv.h"
#include "conv/packed_conv_kernel.cuh"
#include "kda/packed_conv.h"

namespace kda::conv {

namespace {

template <DType kDType, int kVec>
void launch_instance(const PackedConvParams& p, cudaStream_t stream) {
  using Traits = PackedConvTraits<kDType, kVec>;
  const dim3 grid(static_cast<unsigned>(p.cta_programs),
                  static_cast<unsigned>(p.col_groups_per_plane), static_cast<unsigned>(p.planes));
  const dim3 block(static_cast<unsigned>(p.warps_per_cta * 32));
  const std::size_t staging_bytes =
      static_cast<std::size_t>(p.warps_per_cta) * staging_bytes_per_warp(Traits::kTile);
  const bool has_bias = p.bias != nullptr;
  if (p.silu && has_bias) {
    packed_conv_kernel<Traits, true, true><<<grid, block, staging_bytes, stream>>>(p);
  } else if (p.silu) {
    packed_conv_kernel<Traits, true, false><<<grid, block, staging_bytes, stream>>>(p);
  } else if (has_bias) {
    packed_conv_kernel<Traits, false, true><<<grid, block, staging_bytes, stream>>>(p);
  } else {
    packed_conv_kernel<Traits, false, false><<<grid, block, staging_bytes, stream>>>(p);
  }
}

template <DType kDType>
void launch_for_vec(const PackedConvParams& p, cudaStream_t stream, const char* function) {
  switch (p.vec) {
    case 8: return launch_instance<kDType, 8>(p, stream);
    case 4: return launch_instance<kDType, 4>(p, stream);
    case 2: return launch_instance<kDType, 2>(p, stream);
    case 1: return launch_instance<kDType, 1>(p, stream);
    default: KDA_FAIL(function, "vec ", p.vec, " has no kernel instance; supported are 8, 4, 2, 1");
  }
}

void run(const PackedConvArgs& args, const ConvTuning& tuning, Stream stream,
         const char* function) {
  // The checks that need no launch shape, then the params of this launch, built once, and the
  // grid check on them (a launch past CUDA's limits would fail silently in a captured graph).
  std::string why;
  if (!args_supported(args, &why)) KDA_FAIL(function, why);
  why = check_tuning_values(args, tuning);
  if (!why.empty()) KDA_FAIL(function, why);
  if (args.num_tokens == 0 || args.varlen.num_seqs == 0) return;
  const PackedConvParams p = make_params(args, tuning);
  why = check_grid(p);
  if (!why.empty()) KDA_FAIL(function, why);
  const auto s = static_cast<cudaStream_t>(stream);
  switch (p.x_dtype) {
    case DType::BF16: launch_for_vec<DType::BF16>(p, s, function); break;
    case DType::FP16: launch_for_vec<DType::FP16>(p, s, function); break;
    case DType::FP32: launch_for_vec<DType::FP32>(p, s, function); break;
    default:
      KDA_FAIL(function, "x_dtype ", static_cast<int>(p.x_dtype),
               " has no kernel instance; supported are bf16, fp16 and fp32");
  }
  KDA_CUDA_CHECK(function, cudaGetLastError());
}

}  // namespace

void launch_packed_conv(const PackedConvArgs& args, const ConvTuning& tuning, Stream stream) {
  run(args, tuning, stream, "kda::conv::launch_packed_conv");
}

}  // namespace kda::conv

namespace kda {

void packed_causal_conv1d(const PackedConvArgs& args, Stream stream) {
  conv::run(args, conv::ConvTuning{}, stream, "kda::packed_causal_conv1d");
}

}  // namespace kda
