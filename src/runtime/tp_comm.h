// The NCCL side of tensor parallelism. tp_comm.cpp is the only file of the library that includes
// nccl.h or calls NCCL, so the rest of the module stays NCCL-free. A build without NCCL
// (KDA_HAVE_NCCL undefined, meson option nccl found nothing) compiles the same functions; those
// that would call NCCL then throw kda::Error saying that the library was built without it.
// kda::nccl_available() (kda/prefill.h) is defined here too.
#pragma once

#include <cstdint>

#include "kda/config.h"
#include "kda/prefill.h"  // ncclComm_t (forward-declared), kda::Stream

namespace kda::detail {

// What a communicator says about itself.
struct CommunicatorShape {
  int size = 0;     // ncclCommCount
  int rank = 0;     // ncclCommUserRank
  int device = -1;  // ncclCommCuDevice
};

// Queries `comm`. Throws kda::Error from `fn` when built without NCCL or when a query fails
// (a destroyed or foreign communicator, say).
CommunicatorShape communicator_shape(ncclComm_t comm, const char* fn);

// Plain host logic: throws kda::Error from `fn` unless the communicator's size and rank equal
// tensor_parallel's and it lives on `module_device` (the message names both sides).
void check_communicator_matches(const TensorParallelConfig& tp, const CommunicatorShape& shape,
                                int module_device, const char* fn);

// Enqueues the in-place sum over the communicator's ranks of `count` bf16 values at `buffer`
// on `stream` (ncclAllReduce, ncclBfloat16, ncclSum); capturable into a CUDA graph. Every rank
// must make the same call (count included) in the same order. Throws kda::Error from `fn` when
// built without NCCL or when NCCL refuses the call.
void all_reduce_sum_bf16(void* buffer, int64_t count, ncclComm_t comm, Stream stream, const char* fn);

}  // namespace kda::detail
