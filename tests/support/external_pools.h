// State pools a GPU test owns and hands a module with pools.external: lines `gap` elements
// further apart than a line holds, the lines zeroed (as module-owned pools start) and the gaps
// filled with a sentinel that the module must never overwrite.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kda/config.h"
#include "kda/prefill.h"
#include "support/gpu_buffers.h"

namespace kda::test {

struct ExternalPools {
  static constexpr unsigned char kSentinel = 0xA5;
  DeviceBuffer conv, rec;
  kda::StatePools view;
  int64_t conv_line_elems = 0, rec_line_elems = 0;

  ExternalPools(const kda::Config& c, int64_t conv_gap, int64_t rec_gap)
      : conv_line_elems(c.conv_line_elems()), rec_line_elems(c.recurrent_line_elems()) {
    const int64_t lines = c.pools.cache_lines;
    view.conv_line_stride = conv_line_elems + conv_gap;
    view.recurrent_line_stride = rec_line_elems + rec_gap;
    view.lines = lines;
    conv = DeviceBuffer(static_cast<std::size_t>(lines * view.conv_line_stride) * 4);
    rec = DeviceBuffer(static_cast<std::size_t>(lines * view.recurrent_line_stride) * 4);
    conv.fill_bytes(kSentinel);
    rec.fill_bytes(kSentinel);
    for (int64_t l = 0; l < lines; ++l) {
      KDA_TEST_CUDA(cudaMemset(conv.as<float>() + l * view.conv_line_stride, 0, conv_line_elems * 4));
      KDA_TEST_CUDA(cudaMemset(rec.as<float>() + l * view.recurrent_line_stride, 0, rec_line_elems * 4));
    }
    KDA_TEST_CUDA(cudaDeviceSynchronize());
    view.conv = conv.as<float>();
    view.recurrent = rec.as<float>();
  }

  // The lines packed, as a module-owned pool holds them; counts the gap bytes that lost the
  // sentinel into *gap_bytes_written.
  std::vector<unsigned char> packed_conv(int64_t* gap_bytes_written) const {
    return packed(conv, view.conv_line_stride, conv_line_elems, gap_bytes_written);
  }
  std::vector<unsigned char> packed_recurrent(int64_t* gap_bytes_written) const {
    return packed(rec, view.recurrent_line_stride, rec_line_elems, gap_bytes_written);
  }
  // Gap bytes of both pools that lost the sentinel.
  int64_t gap_bytes_written() const {
    int64_t n = 0;
    packed_conv(&n);
    packed_recurrent(&n);
    return n;
  }

 private:
  std::vector<unsigned char> packed(const DeviceBuffer& b, int64_t stride, int64_t line_elems,
                                    int64_t* gap_bytes_written) const {
    const auto raw = b.download_as<unsigned char>();
    std::vector<unsigned char> out;
    for (int64_t l = 0; l < view.lines; ++l) {
      const unsigned char* line = raw.data() + l * stride * 4;
      out.insert(out.end(), line, line + line_elems * 4);
      for (int64_t i = line_elems * 4; i < stride * 4; ++i) *gap_bytes_written += line[i] != kSentinel;
    }
    return out;
  }
};

}  // namespace kda::test
