#include "support/gpu_buffers.h"

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <utility>

namespace kda::test {

void cuda_ok(int status, const char* what) {
  auto err = static_cast<cudaError_t>(status);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(err));
}

DeviceBuffer::DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes_ > 0) KDA_TEST_CUDA(cudaMalloc(&ptr_, bytes_));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::upload(const void* host, std::size_t bytes, std::size_t offset) {
  if (offset + bytes > bytes_) throw std::runtime_error("DeviceBuffer::upload past the end");
  if (bytes) KDA_TEST_CUDA(cudaMemcpy(static_cast<char*>(ptr_) + offset, host, bytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::download(void* host, std::size_t bytes, std::size_t offset) const {
  if (offset + bytes > bytes_) throw std::runtime_error("DeviceBuffer::download past the end");
  if (bytes) KDA_TEST_CUDA(cudaMemcpy(host, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost));
}

void DeviceBuffer::fill_bytes(unsigned char byte) {
  if (bytes_) KDA_TEST_CUDA(cudaMemset(ptr_, byte, bytes_));
}

int64_t diff_bits(const void* a, const void* b, std::size_t bytes) {
  auto* pa = static_cast<const unsigned char*>(a);
  auto* pb = static_cast<const unsigned char*>(b);
  int64_t bits = 0;
  for (std::size_t i = 0; i < bytes; ++i) bits += __builtin_popcount(static_cast<unsigned>(pa[i] ^ pb[i]));
  return bits;
}

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
