#include "kda/types.h"

#include <string>

#include "kda/error.h"

namespace kda {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::BF16: return "bf16";
    case DType::FP16: return "fp16";
    case DType::FP32: return "fp32";
  }
  return "invalid DType";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::BF16: return 2;
    case DType::FP16: return 2;
    case DType::FP32: return 4;
  }
  throw Error("kda::dtype_size", "invalid DType value " + std::to_string(static_cast<int>(dtype)),
              __FILE__, __LINE__);
}

}  // namespace kda
