// Stand-ins for device addresses in the CPU tests of the ops' supported() and plans: distinct,
// aligned, never dereferenced (supported() reads no device memory, and a refused launch throws
// before any CUDA call).
#pragma once

#include <cstdint>

namespace kda::test {

// Slot `slot` 2^40 bytes from the next (256-byte aligned and more), plus byte_offset: far enough
// apart that no extent a test builds reaches the next slot.
template <typename T>
T* fake_pointer(std::uintptr_t slot, std::uintptr_t byte_offset = 0) {
  return reinterpret_cast<T*>((slot << 40) + byte_offset);
}

// Slot `slot` of 4 KiB slots above 1 MiB: 4096-byte aligned.
template <typename T>
T* fake(std::uintptr_t slot) {
  return reinterpret_cast<T*>(std::uintptr_t{1} << 20 | slot << 12);
}

}  // namespace kda::test
