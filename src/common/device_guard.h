// Ties work to one CUDA device whatever device is current on the calling thread: a guard makes
// the device current for its scope and gives the caller's device back when the scope ends (by
// return or by throw). The device API is a template parameter so that the bookkeeping is tested
// on the CPU with a fake one (tests/common/test_device_guard.cpp); CudaDeviceApi is the real one.
#pragma once

namespace kda::detail {

// The CUDA runtime's current device. current() and make_current() throw kda::Error from `fn`;
// restore() is for destructors and ignores failures (it clears the error it may leave).
struct CudaDeviceApi {
  static int current(const char* fn);
  static void make_current(int device, const char* fn);
  static void restore(int device) noexcept;
};

template <typename Api>
class BasicDeviceGuard {
 public:
  // Makes `device` current; remembers the caller's device to restore. Throws (changing nothing)
  // when the current device cannot be read or `device` cannot be made current.
  BasicDeviceGuard(int device, const char* fn) : device_(device), previous_(Api::current(fn)) {
    if (previous_ != device_) Api::make_current(device_, fn);
  }
  ~BasicDeviceGuard() {
    if (previous_ != device_) Api::restore(previous_);
  }
  BasicDeviceGuard(const BasicDeviceGuard&) = delete;
  BasicDeviceGuard& operator=(const BasicDeviceGuard&) = delete;

  // The device that was current when the guard was made.
  int caller_device() const { return previous_; }

 private:
  int device_;
  int previous_;
};

using DeviceGuard = BasicDeviceGuard<CudaDeviceApi>;

}  // namespace kda::detail
