#include "gpu_spin.h"

#include <cuda_runtime.h>

namespace kda::bench {
namespace {

__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long start;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start >= ns) break;
    __nanosleep(1000);
  }
}

}  // namespace

void gpu_spin(cudaStream_t stream, double us) {
  spin_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long>(us * 1000.0));
}

}  // namespace kda::bench
