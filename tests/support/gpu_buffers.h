// Test-only helpers for device memory: the library's RAII buffers, bitwise comparison that
// counts differing bits, and a stream owned for a test's duration.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/bit_compare.h"
#include "common/cuda_check.h"
#include "common/device_memory.h"
#include "kda/types.h"

namespace kda::test {

// Throws kda::Error naming the call when a CUDA runtime call fails: the library's check.
#define KDA_TEST_CUDA(expr) KDA_CUDA_CHECK("kda::test", expr)

using kda::detail::DeviceBuffer;

template <typename T>
DeviceBuffer to_device(const std::vector<T>& v) {
  DeviceBuffer b(v.size() * sizeof(T));
  b.upload(v);
  return b;
}

using kda::detail::diff_bits;  // differing bits between two equally long byte ranges
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
