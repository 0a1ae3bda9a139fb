#include "common/device_memory.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <utility>

#include "common/check.h"
#include "common/cuda_check.h"

namespace kda::detail {

namespace {
// A failed allocation leaves a sticky-free error behind; clear it so later calls don't see it.
[[noreturn]] void allocation_failed(const char* fn, const char* call, std::size_t bytes, const char* what,
                                    cudaError_t err) {
  cudaGetLastError();
  KDA_FAIL(fn, call, " of ", bytes, " bytes for ", what, " failed: ", cudaGetErrorName(err), " (",
           cudaGetErrorString(err), ")");
}
}  // namespace

DeviceBuffer::DeviceBuffer(std::size_t bytes, const char* what) : bytes_(bytes) {
  if (bytes_ == 0) return;
  const cudaError_t err = cudaMalloc(&ptr_, bytes_);
  if (err != cudaSuccess) {
    ptr_ = nullptr;
    allocation_failed("kda::DeviceBuffer", "cudaMalloc", bytes, what, err);
  }
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
  constexpr const char* fn = "kda::DeviceBuffer::upload";
  KDA_CHECK(offset + bytes <= bytes_, fn, "bytes [", offset, ", ", offset + bytes, ") leave the buffer of ",
            bytes_, " bytes");
  if (bytes) KDA_CUDA_CHECK(fn, cudaMemcpy(as<char>() + offset, host, bytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::download(void* host, std::size_t bytes, std::size_t offset) const {
  constexpr const char* fn = "kda::DeviceBuffer::download";
  KDA_CHECK(offset + bytes <= bytes_, fn, "bytes [", offset, ", ", offset + bytes, ") leave the buffer of ",
            bytes_, " bytes");
  if (bytes) KDA_CUDA_CHECK(fn, cudaMemcpy(host, as<const char>() + offset, bytes, cudaMemcpyDeviceToHost));
}

void DeviceBuffer::fill_bytes(unsigned char byte) {
  if (bytes_) KDA_CUDA_CHECK("kda::DeviceBuffer::fill_bytes", cudaMemset(ptr_, byte, bytes_));
  KDA_CUDA_CHECK("kda::DeviceBuffer::fill_bytes", cudaDeviceSynchronize());
}

PinnedBuffer::PinnedBuffer(std::size_t bytes, const char* what) : bytes_(bytes) {
  if (bytes_ == 0) return;
  const cudaError_t err = cudaMallocHost(&ptr_, bytes_);
  if (err != cudaSuccess) {
    ptr_ = nullptr;
    allocation_failed("kda::PinnedBuffer", "cudaMallocHost", bytes, what, err);
  }
  std::memset(ptr_, 0, bytes_);
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_) cudaFreeHost(ptr_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_) cudaFreeHost(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

Event::Event(Timing timing) {
  KDA_CUDA_CHECK("kda::Event", cudaEventCreateWithFlags(&event_, timing == Timing::On ? cudaEventDefault
                                                                                        : cudaEventDisableTiming));
}

Event::~Event() {
  if (event_) cudaEventDestroy(event_);
}

float Event::elapsed_ms_since(const Event& start) const {
  float ms = 0;
  KDA_CUDA_CHECK("kda::Event::elapsed_ms_since", cudaEventElapsedTime(&ms, start.event_, event_));
  return ms;
}

}  // namespace kda::detail
