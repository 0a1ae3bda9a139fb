// Internal: turn CUDA runtime / cuBLASLt status codes into kda::Error.
#pragma once

#include <cuda_runtime_api.h>

#include "common/check.h"

#define KDA_CUDA_CHECK(function, expr)                                                      \
  do {                                                                                      \
    cudaError_t kda_err_ = (expr);                                                          \
    if (kda_err_ != cudaSuccess)                                                            \
      KDA_FAIL(function, #expr, " failed: ", cudaGetErrorName(kda_err_), " (",             \
               cudaGetErrorString(kda_err_), ")");                                          \
  } while (0)
