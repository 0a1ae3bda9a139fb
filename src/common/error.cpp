#include "kda/error.h"

#include <string>


namespace kda {

namespace {
std::string compose(const std::string& function, const std::string& message, const char* file,
                    int line) {
  if (!file) return function + ": " + message;  // the message names its own location
  std::string where = file;
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

}  // namespace kda
