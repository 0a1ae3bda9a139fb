#include "bench_util.h"

#include <cuda_runtime.h>

namespace kda::bench {
namespace {

__global__ void count_diff_bits_kernel(const uint32_t* a, const uint32_t* b, int64_t words,
                                       unsigned long long* bits) {
  unsigned long long n = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < words; i += int64_t{gridDim.x} * blockDim.x)
    n += __popc(a[i] ^ b[i]);
  if (n) atomicAdd(bits, n);
}

}  // namespace

uint64_t diff_bits(const void* a, const void* b, std::size_t bytes, cudaStream_t stream) {
  if (bytes % 4 != 0) throw std::runtime_error("diff_bits: the byte count is not a multiple of 4");
  DeviceMem count(sizeof(unsigned long long));
  BENCH_CUDA(cudaMemsetAsync(count.get(), 0, count.bytes(), stream));
  count_diff_bits_kernel<<<4096, 256, 0, stream>>>(static_cast<const uint32_t*>(a), static_cast<const uint32_t*>(b),
                                                   static_cast<int64_t>(bytes / 4), count.as<unsigned long long>());
  BENCH_CUDA(cudaGetLastError());
  unsigned long long n = 0;
  BENCH_CUDA(cudaMemcpyAsync(&n, count.get(), sizeof n, cudaMemcpyDeviceToHost, stream));
  BENCH_CUDA(cudaStreamSynchronize(stream));
  return n;
}

}  // namespace kda::bench
