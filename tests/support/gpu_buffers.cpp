#include "support/gpu_buffers.h"

#include <cuda_runtime_api.h>

namespace kda::test {

int64_t diff_elements(const void* a, const void* b, std::size_t bytes, std::size_t elem_bytes) {
  auto* pa = static_cast<const unsigned char*>(a);
  auto* pb = static_cast<const unsigned char*>(b);
  int64_t n = 0;
  for (std::size_t i = 0; i + elem_bytes <= bytes; i += elem_bytes)
    n += std::memcmp(pa + i, pb + i, elem_bytes) != 0;
  return n;
}

void device_synchronize() { KDA_TEST_CUDA(cudaDeviceSynchronize()); }

Stream::Stream() { KDA_TEST_CUDA(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
Stream::~Stream() { cudaStreamDestroy(s_); }

}  // namespace kda::test
