// The host side of the tensor-parallel communicator (runtime/tp_comm.h), without a GPU: the
// check of a communicator's size, rank and device against the config, and what the NCCL entry
// points say before they would reach NCCL (a null communicator, a build without NCCL).
#include <doctest/doctest.h>

#include <cstdint>

#include "kda/config.h"
#include "kda/error.h"
#include "kda/prefill.h"
#include "runtime/tp_comm.h"

namespace {

using kda::detail::CommunicatorShape;

kda::TensorParallelConfig tp(int64_t size, int64_t rank) {
  kda::TensorParallelConfig t;
  t.size = size;
  t.rank = rank;
  return t;
}

CommunicatorShape shape(int size, int rank, int device) {
  CommunicatorShape s;
  s.size = size;
  s.rank = rank;
  s.device = device;
  return s;
}

constexpr const char* kFn = "kda::PrefillModule::set_communicator";

}  // namespace

TEST_CASE("a communicator of the config's size and rank on the module's device is accepted") {
  CHECK_NOTHROW(kda::detail::check_communicator_matches(tp(1, 0), shape(1, 0, 0), 0, kFn));
  CHECK_NOTHROW(kda::detail::check_communicator_matches(tp(4, 3), shape(4, 3, 2), 2, kFn));
}

TEST_CASE("a communicator whose size, rank or device differ is refused, naming both sides") {
  // A one-rank communicator handed to rank 0 of two (the GPU test makes the same mistake for real).
  CHECK_THROWS_WITH_AS(kda::detail::check_communicator_matches(tp(2, 0), shape(1, 0, 0), 0, kFn),
                       doctest::Contains("the communicator has 1 rank and this module is its rank 0, but the config "
                                         "says tensor_parallel.size 2, tensor_parallel.rank 0"),
                       kda::Error);
  CHECK_THROWS_WITH_AS(kda::detail::check_communicator_matches(tp(4, 1), shape(4, 2, 0), 0, kFn),
                       doctest::Contains("the communicator has 4 ranks and this module is its rank 2, but the config "
                                         "says tensor_parallel.size 4, tensor_parallel.rank 1"),
                       kda::Error);
  CHECK_THROWS_WITH_AS(kda::detail::check_communicator_matches(tp(2, 1), shape(2, 1, 0), 1, kFn),
                       doctest::Contains("the communicator is on CUDA device 0 but the module was built on device 1"),
                       kda::Error);
  try {
    kda::detail::check_communicator_matches(tp(2, 0), shape(1, 0, 0), 0, kFn);
  } catch (const kda::Error& e) {
    CHECK(e.function() == kFn);
  }
}

TEST_CASE("the NCCL entry points refuse a null communicator, or say the build has no NCCL") {
  if (kda::nccl_available()) {
    CHECK_THROWS_WITH_AS(kda::detail::communicator_shape(nullptr, kFn), doctest::Contains("the communicator is null"),
                         kda::Error);
    CHECK_THROWS_WITH_AS(kda::detail::all_reduce_sum_bf16(nullptr, 16, nullptr, nullptr, "f"),
                         doctest::Contains("the communicator is null"), kda::Error);
  } else {
    MESSAGE("this build has no NCCL");
    CHECK_THROWS_WITH_AS(kda::detail::communicator_shape(nullptr, kFn),
                         doctest::Contains("kda-prefill was built without NCCL"), kda::Error);
    CHECK_THROWS_WITH_AS(kda::detail::all_reduce_sum_bf16(nullptr, 16, nullptr, nullptr, "f"),
                         doctest::Contains("kda-prefill was built without NCCL"), kda::Error);
  }
  CHECK_THROWS_WITH_AS(kda::detail::all_reduce_sum_bf16(nullptr, -1, nullptr, nullptr, "f"),
                       doctest::Contains("all-reduce of -1 elements"), kda::Error);
}
