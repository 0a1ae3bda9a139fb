// Recurrent-state pools of bf16 elements as the recurrence tests hold them on the host: each
// element widened to fp32 (kda::state_bf16_to_float), which keeps every bit of the bf16 pattern
// (NaN payloads too), so pools of either element type compare bitwise as floats and feed the
// fp32 reference as they are.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/state_elements.h"
#include "support/test_data.h"

namespace kda::test {

inline std::vector<float> widen_bf16(const std::vector<uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) out[i] = kda::state_bf16_to_float(bits[i]);
  return out;
}

// The bf16 patterns of widened values: their upper halves. Throws when an element has a nonzero
// lower half: it is no widened bf16 value, a bug of the test.
inline std::vector<uint16_t> narrow_widened(const std::vector<float>& widened) {
  std::vector<uint16_t> out(widened.size());
  int64_t not_bf16 = 0;
  for (std::size_t i = 0; i < widened.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &widened[i], 4);
    not_bf16 += (u & 0xFFFFu) != 0;
    out[i] = static_cast<uint16_t>(u >> 16);
  }
  if (not_bf16 != 0)
    throw std::logic_error("narrow_widened: " + std::to_string(not_bf16) + " elements are no widened bf16 values");
  return out;
}

// A bf16 starting pool from an fp32 one: the states that processed sequences with an initial
// state start from (the lines `batch` names for them, all heads, through `layout`'s element
// strides), rounded to nearest even; every other element poisoned (kPoison16, a NaN: an element
// read without cause shows in o, one written without cause in the checks). Returned widened.
template <class Batch, class Layout>
std::vector<float> bf16_starting_pool(const std::vector<float>& pool, const Batch& batch, const Layout& layout,
                                      int64_t heads, int64_t head_dim) {
  std::vector<char> initial(pool.size(), 0);
  for (int64_t s : batch.processed) {
    if (!batch.initial[s]) continue;
    const int64_t line = batch.lines[static_cast<std::size_t>(s)];
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < head_dim; ++i)
        for (int64_t j = 0; j < head_dim; ++j)
          initial[static_cast<std::size_t>(line * layout.line + h * layout.head + i * layout.k + j * layout.v)] = 1;
  }
  std::vector<uint16_t> bits(pool.size());
  for (std::size_t i = 0; i < pool.size(); ++i) bits[i] = initial[i] ? kda::state_float_to_bf16(pool[i]) : kPoison16;
  return widen_bf16(bits);
}

}  // namespace kda::test
