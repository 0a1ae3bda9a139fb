// Internal helpers to raise kda::Error with function, file and line.
#pragma once

#include <sstream>
#include <string>

#include "kda/error.h"

namespace kda::detail {

// Concatenates anything streamable: str_cat("buckets[", i, "]: ", v).
template <typename... Ts>
std::string str_cat(const Ts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

}  // namespace kda::detail

// KDA_FAIL("kda::foo", "part_dim ", p, " must be a multiple of 64")
#define KDA_FAIL(function, ...) \
  throw ::kda::Error((function), ::kda::detail::str_cat(__VA_ARGS__), __FILE__, __LINE__)

#define KDA_CHECK(cond, function, ...)   \
  do {                                   \
    if (!(cond)) KDA_FAIL(function, __VA_ARGS__); \
  } while (0)
