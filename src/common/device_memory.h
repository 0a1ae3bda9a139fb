// RAII owners of CUDA memory and events, for the module and for the tests and benches: device
// buffers, pinned host buffers, events. Every failure throws kda::Error naming what the memory
// was for.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

struct CUevent_st;

namespace kda::detail {

// Device memory; zero bytes holds no allocation. Not copyable; moving transfers ownership.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes, const char* what = "a device buffer");
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

  // Synchronous copies from / to host memory; throw when [offset, offset + bytes) leaves the
  // buffer.
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
  // Fills every byte with `byte` (synchronous; 0xFF gives NaN in bf16, fp16 and fp32).
  void fill_bytes(unsigned char byte);

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// Pinned host memory, zeroed at allocation (async copies from it are truly asynchronous).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(std::size_t bytes, const char* what = "a pinned host buffer");
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  char* get() const { return static_cast<char*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// A CUDA event, created on construction. Timing events can measure elapsed time; the others
// are cheaper to record and only order or fence work.
class Event {
 public:
  enum class Timing { Off, On };
  explicit Event(Timing timing = Timing::Off);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  CUevent_st* get() const { return event_; }
  // Milliseconds from `start` to this event; both must be timing events that have completed.
  float elapsed_ms_since(const Event& start) const;

 private:
  CUevent_st* event_ = nullptr;
};

}  // namespace kda::detail
