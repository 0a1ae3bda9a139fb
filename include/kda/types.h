// kda-prefill: the small types every public header shares: the stream handle and element types.
// Needs no CUDA header.
#pragma once

#include <cstddef>

#include "kda/error.h"  // dtype_size throws kda::Error

// cudaStream_t is `CUstream_st*`; declaring the struct keeps the public headers free of CUDA
// headers.
struct CUstream_st;

namespace kda {

using Stream = CUstream_st*;  // a cudaStream_t; nullptr is the legacy default stream

enum class DType { BF16, FP16, FP32 };

const char* dtype_name(DType dtype);     // "bf16", "fp16", "fp32"
std::size_t dtype_size(DType dtype);     // bytes per element; throws kda::Error for a bad value

}  // namespace kda
