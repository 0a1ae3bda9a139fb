// State pools a GPU test owns and hands a module with pools.external: lines `gap` elements
// further apart than a line holds, the lines zeroed (as module-owned pools start) and the gaps
// filled with a sentinel that the module must never overwrite. Elements are of the config's
// pools.conv_dtype / pools.recurrent_dtype.
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
  int64_t conv_elem = 4, rec_elem = 4;  // bytes per element

  ExternalPools(const kda::Config& c, int64_t conv_gap, int64_t rec_gap)
      : conv_line_elems(c.conv_line_elems()),
        rec_line_elems(c.recurrent_line_elems()),
        conv_elem(static_cast<int64_t>(kda::dtype_size(c.pools.conv_dtype))),
        rec_elem(static_cast<int64_t>(kda::dtype_size(c.pools.recurrent_dtype))) {
    const int64_t lines = c.pools.cache_lines;
    view.conv_line_stride = conv_line_elems + conv_gap;
    view.recurrent_line_stride = rec_line_elems + rec_gap;
    view.lines = lines;
    conv = DeviceBuffer(static_cast<std::size_t>(lines * view.conv_line_stride * conv_elem));
    rec = DeviceBuffer(static_cast<std::size_t>(lines * view.recurrent_line_stride * rec_elem));
    conv.fill_bytes(kSentinel);
    rec.fill_bytes(kSentinel);
    for (int64_t l = 0; l < lines; ++l) {
      KDA_TEST_CUDA(cudaMemset(conv.as<char>() + l * view.conv_line_stride * conv_elem, 0, conv_line_elems * conv_elem));
      KDA_TEST_CUDA(cudaMemset(rec.as<char>() + l * view.recurrent_line_stride * rec_elem, 0, rec_line_elems * rec_elem));
    }
    KDA_TEST_CUDA(cudaDeviceSynchronize());
    view.conv = conv.get();
    view.recurrent = rec.get();
  }

  // The lines packed, as a module-owned pool holds them; counts the gap bytes that lost the
  // sentinel into *gap_bytes_written.
  std::vector<unsigned char> packed_conv(int64_t* gap_bytes_written) const {
    return packed(conv, view.conv_line_stride * conv_elem, conv_line_elems * conv_elem, gap_bytes_written);
  }
  std::vector<unsigned char> packed_recurrent(int64_t* gap_bytes_written) const {
    return packed(rec, view.recurrent_line_stride * rec_elem, rec_line_elems * rec_elem, gap_bytes_written);
  }
  // Gap bytes of both pools that lost the sentinel.
  int64_t gap_bytes_written() const {
    int64_t n = 0;
    packed_conv(&n);
    packed_recurrent(&n);
    return n;
  }

 private:
  // stride and line in bytes.
  std::vector<unsigned char> packed(const DeviceBuffer& b, int64_t stride, int64_t line_bytes,
                                    int64_t* gap_bytes_written) const {
    const auto raw = b.download_as<unsigned char>();
    std::vector<unsigned char> out;
    for (int64_t l = 0; l < view.lines; ++l) {
      const unsigned char* line = raw.data() + l * stride;
      out.insert(out.end(), line, line + line_bytes);
      for (int64_t i = line_bytes; i < stride; ++i) *gap_bytes_written += line[i] != kSentinel;
    }
    return out;
  }
};

}  // namespace kda::test
