#include "kda/error.h"

#include <string>

#include "kda/packed_conv.h"

namespace kda {

namespace {
std::string compose(const std::string& function, const std::string& message, const char* file,
                    int line) {
  std::string where = file ? file : "?";
  // Keep the path relative to the source tree: "src/conv/packed_conv.cu", not the build path.
  for (const char* root : {"/src/", "/graphs/", "/include/"}) {
    auto pos = where.rfind(root);
    if (pos != std::string::npos) {
      where = where.substr(pos + 1);
      break;
    }
  }
  return function + ": " + message + " [" + where + ":" + std::to_string(line) + "]";
}
}  // namespace

Error::Error(const std::string& function, const std::string& message, const char* file, int line)
    : std::runtime_error(compose(function, message, file, line)),
      function_(function),
      message_(message) {}

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
