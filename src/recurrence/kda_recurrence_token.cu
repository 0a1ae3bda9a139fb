// kda_recurrence_token's launch (kda_recurrence_token.h): the checks, the params built once,
// and the kernel instance of the gate variant. The device code is
// kda_recurrence_token_kernel.cuh.
#include <cuda_runtime.h>

#include <string>

#include "common/check.h"
#include "common/cuda_check.h"
#include "recurrence/kda_recurrence.h"
#include "recurrence/kda_recurrence_token.h"
#include "recurrence/kda_recurrence_token_kernel.cuh"

namespace kda {

void kda_recurrence_token(const RecurrenceArgs& a, Stream stream) {
  constexpr const char* kFunction = "kda::kda_recurrence_token";
  std::string why;
  if (!kda_recurrence_token_supported(a, &why)) KDA_FAIL(kFunction, why);
  if (a.varlen.num_seqs == 0 || a.num_tokens == 0) return;

  const RecurrenceParams p = recurrence::make_recurrence_params(a);
  const dim3 grid(static_cast<unsigned>(p.num_seqs),
                  static_cast<unsigned>(p.num_heads * Traits::kSlices));
  const dim3 block(Traits::kThreads);
  // supported() admits head_dim 128 only, the one instance.
  if (a.gate_lower_bound)
    kda_recurrence_token_kernel<true><<<grid, block, 0, stream>>>(p);
  else
    kda_recurrence_token_kernel<false><<<grid, block, 0, stream>>>(p);
  KDA_CUDA_CHECK(kFunction, cudaGetLastError());
}

}  // namespace kda
