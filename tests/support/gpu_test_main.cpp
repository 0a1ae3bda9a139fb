// main() of every GPU test program: exit 77 (meson's "skipped") when no CUDA device can be
// used, unless KDA_REQUIRE_GPU=1 asks for a loud failure instead.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  int devices = 0;
  cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    const char* why = err != cudaSuccess ? cudaGetErrorString(err) : "no device";
    const char* require = std::getenv("KDA_REQUIRE_GPU");
    if (require && std::strcmp(require, "1") == 0) {
      std::fprintf(stderr, "KDA_REQUIRE_GPU=1 but no CUDA device is usable: %s\n", why);
      return 1;
    }
    std::printf("no CUDA device is usable (%s): GPU tests skipped\n", why);
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
