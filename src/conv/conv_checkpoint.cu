// The conv-state checkpoint op's launch (conv_checkpoint.h): the checks and params of its plan
// (conv_checkpoint_plan.cpp), then the kernel of conv_checkpoint_kernel.cuh.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/check.h"
#include "common/cuda_check.h"
#include "conv/conv_checkpoint.h"
#include "conv/conv_checkpoint_kernel.cuh"

namespace kda {

void conv_checkpoint(const ConvCheckpointArgs& args, Stream stream) {
  constexpr const char* kFn = "kda::conv_checkpoint";
  std::string why;
  if (!conv_checkpoint_supported(args, &why)) KDA_FAIL(kFn, why);
  if (args.max_entries == 0) return;
  const int64_t col_blocks =
      (args.dim + kConvCheckpointChannelsPerCta - 1) / kConvCheckpointChannelsPerCta;
  const dim3 grid(static_cast<unsigned>(args.max_entries), static_cast<unsigned>(col_blocks));
  conv::conv_checkpoint_kernel<<<grid, kConvCheckpointChannelsPerCta, 0,
                                 static_cast<cudaStream_t>(stream)>>>(conv::make_checkpoint_params(args));
  KDA_CUDA_CHECK(kFn, cudaGetLastError());
}

}  // namespace kda
