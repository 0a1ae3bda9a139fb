// A kernel that keeps the GPU busy for a while, for benchmarks that time host work while the
// stream is not drained (the state a pipelining server is in).
#pragma once

#include <cuda_runtime_api.h>

namespace kda::bench {

// Enqueues one single-thread kernel that spins for about `us` microseconds of GPU time.
void gpu_spin(cudaStream_t stream, double us);

}  // namespace kda::bench
