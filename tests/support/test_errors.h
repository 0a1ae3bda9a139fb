// Shared by the CPU tests that check messages and read files of the source tree.
#pragma once

#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

#include "kda/error.h"

namespace kda::test {

// A path in the source tree: meson sets KDA_SOURCE_ROOT; run by hand from the source tree, the
// relative path works.
inline std::string source_path(const std::string& relative) {
  const char* root = std::getenv("KDA_SOURCE_ROOT");
  return root && *root ? std::string(root) + "/" + relative : relative;
}

// The message of the kda::Error that `f` throws, checked to come from `function`.
template <typename F>
std::string error_of(F&& f, const std::string& function) {
  try {
    f();
  } catch (const kda::Error& e) {
    CHECK(e.function() == function);
    return e.message();
  }
  FAIL("expected a kda::Error from " << function);
  return {};
}

}  // namespace kda::test
