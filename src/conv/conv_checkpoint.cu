// The conv-state checkpoint kernel and its launcher (conv_checkpoint.h). The per-entry and
// per-element code is conv_checkpoint_body.h, which the CPU tests run on host arrays.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/check.h"
#include "common/cuda_check.h"
#include "conv/conv_checkpoint.h"
#include "conv/conv_checkpoint_body.h"

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
