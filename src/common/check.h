// Internal helpers to raise kda::Error with function, file and line, and to report why a
// *_supported() check refused its arguments.
#pragma once

#include <sstream>
#include <string>
#include <utility>

#include "kda/error.h"

namespace kda::detail {

// Concatenates anything streamable: str_cat("buckets[", i, "]: ", v).
template <typename... Ts>
std::string str_cat(const Ts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

// The refusal of a supported() check: stores `reason` in *why (when why is set) and returns
// false, so a check reads `if (bad) return fail(why, str_cat(...));`.
inline bool fail(std::string* why, std::string reason) {
  if (why) *why = std::move(reason);
  return false;
}

}  // namespace kda::detail

// KDA_FAIL("kda::foo", "part_dim ", p, " must be a multiple of 64")
#define KDA_FAIL(function, ...) \
  throw ::kda::Error((function), ::kda::detail::str_cat(__VA_ARGS__), __FILE__, __LINE__)

// KDA_FAIL_AT_INPUT("kda::load_config", file, ":", line, ": ", what): for an error whose message
// names its place in the user's input (a config's file:line: key path). what() then carries no
// library source location: that would name a helper of the parser, not anything the user fixes.
#define KDA_FAIL_AT_INPUT(function, ...) \
  throw ::kda::Error((function), ::kda::detail::str_cat(__VA_ARGS__), nullptr, 0)

#define KDA_CHECK(cond, function, ...)   \
  do {                                   \
    if (!(cond)) KDA_FAIL(function, __VA_ARGS__); \
  } while (0)
