// Test-only helpers for device memory: RAII buffers, uploads/downloads, NaN poisoning and
// bitwise comparison that counts differing bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kda/packed_conv.h"  // kda::Stream

namespace kda::test {

// Throws std::runtime_error naming the call when a CUDA runtime call fails.
void cuda_ok(int status, const char* what);
#define KDA_TEST_CUDA(expr) ::kda::test::cuda_ok(static_cast<int>(expr), #expr)

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

  void upload(const void* host, std::size_t bytes, std::size_t offset = 0);
  void download(void* host, std::size_t bytes, std::size_t offset = 0) const;
  template <typename T>
  void upload(const std::vector<T>& v) { upload(v.data(), v.size() * sizeof(T)); }
  template <typename T>
  std::vector<T> download_as() const {
    std::vector<T> v(bytes_ / sizeof(T));
    download(v.data(), v.size() * sizeof(T));
    return v;
  }
  // Fills every byte with `byte` (0xFF gives NaN in bf16, fp16 and fp32).
  void fill_bytes(unsigned char byte);

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

template <typename T>
DeviceBuffer to_device(const std::vector<T>& v) {
  DeviceBuffer b(v.size() * sizeof(T));
  b.upload(v);
  return b;
}

// Number of differing bits between two equally long byte ranges.
int64_t diff_bits(const void* a, const void* b, std::size_t bytes);
// Number of differing elements of `elem_bytes` each.
int64_t diff_elements(const void* a, const void* b, std::size_t bytes, std::size_t elem_bytes);

void device_synchronize();

// A non-blocking CUDA stream owned for a test's duration.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  kda::Stream get() const { return s_; }

 private:
  kda::Stream s_ = nullptr;
};

}  // namespace kda::test
