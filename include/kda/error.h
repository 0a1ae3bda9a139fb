// kda-prefill: the one exception type thrown by the public API.
#pragma once

#include <stdexcept>
#include <string>

namespace kda {

// Every failure the library reports (bad arguments, bad config, bad batch metadata, a CUDA or
// cuBLASLt error) is a kda::Error. what() reads
//   "<function>: <what is wrong and what was expected> [<file>:<line>]"
// with the library source location of the check. A config error (load_config, parse_config,
// validate_config) has no such suffix: its message names where the user fixes it, the config's
// "<file>:<line>: <key path>" (docs/config.md). A null `file` gives that form.
// When an API call throws because of bad input, it has changed nothing: no device buffer or
// state pool was written and no stream work was enqueued.
class Error : public std::runtime_error {
 public:
  Error(const std::string& function, const std::string& message, const char* file, int line);

  // The API function that failed, e.g. "kda::packed_causal_conv1d".
  const std::string& function() const noexcept { return function_; }
  // The message without function name and source location.
  const std::string& message() const noexcept { return message_; }

 private:
  std::string function_;
  std::string message_;
};

}  // namespace kda
