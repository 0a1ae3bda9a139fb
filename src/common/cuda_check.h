// Internal: the one check of CUDA runtime status codes, turning a failure into kda::Error. The
// library, the tests (KDA_TEST_CUDA), the benchmarks (BENCH_CUDA) and the example driver all
// report a failed CUDA call through it.
#pragma once

#include <cuda_runtime_api.h>

#include "common/check.h"

namespace kda::detail {

// Throws kda::Error for `function`, "<what> failed: <CUDA's name> (<CUDA's reason>)" at
// file:line, when `status` is not cudaSuccess.
inline void check_cuda(cudaError_t status, const char* function, const char* what,
                       const char* file, int line) {
  if (status != cudaSuccess)
    throw Error(function,
                str_cat(what, " failed: ", cudaGetErrorName(status), " (",
                        cudaGetErrorString(status), ")"),
                file, line);
}

}  // namespace kda::detail

// KDA_CUDA_CHECK("kda::foo", cudaGetLastError())
#define KDA_CUDA_CHECK(function, expr) \
  ::kda::detail::check_cuda((expr), (function), #expr, __FILE__, __LINE__)
