#include "common/device_guard.h"

#include <cuda_runtime_api.h>

#include "common/cuda_check.h"

namespace kda::detail {

int CudaDeviceApi::current(const char* fn) {
  int device = 0;
  KDA_CUDA_CHECK(fn, cudaGetDevice(&device));
  return device;
}

void CudaDeviceApi::make_current(int device, const char* fn) { KDA_CUDA_CHECK(fn, cudaSetDevice(device)); }

void CudaDeviceApi::restore(int device) noexcept {
  if (cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace kda::detail
