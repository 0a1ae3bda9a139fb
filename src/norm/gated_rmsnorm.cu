// The gated RMSNorm's launch (gated_rmsnorm.h): the checks and params of its plan
// (gated_rmsnorm_plan.cpp), then the kernel of gated_rmsnorm_kernel.cuh.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/check.h"
#include "common/cuda_check.h"
#include "norm/gated_rmsnorm.h"
#include "norm/gated_rmsnorm_kernel.cuh"

namespace kda {

void gated_rmsnorm(const GatedRmsNormArgs& a, Stream stream) {
  constexpr const char* kFunction = "kda::gated_rmsnorm";
  std::string why;
  if (!gated_rmsnorm_supported(a, &why)) KDA_FAIL(kFunction, why);
  if (a.num_tokens == 0) return;

  const RmsNormParams p = norm::make_params(a);
  const int64_t vectors = a.num_tokens * a.num_heads;
  const dim3 grid(static_cast<unsigned>((vectors + Traits::kWarps - 1) / Traits::kWarps));
  switch (a.head_dim) {
    case kHeadDim:
      gated_rmsnorm_kernel<<<grid, Traits::kThreads, 0, stream>>>(p);
      break;
    default:
      KDA_FAIL(kFunction, "head_dim ", a.head_dim, " is not supported; only 128 is");
  }
  KDA_CUDA_CHECK(kFunction, cudaGetLastError());
}

}  // namespace kda
