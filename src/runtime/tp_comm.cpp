#include "runtime/tp_comm.h"

#if KDA_HAVE_NCCL
#include <nccl.h>
#endif

#include <string>

#include "common/check.h"

namespace kda::detail {

namespace {

#if KDA_HAVE_NCCL
// NCCL's own words for a failed call: the result's name and, when the communicator has one, the
// last error it recorded.
[[noreturn]] void nccl_fail(const char* fn, const char* call, ncclResult_t result, ncclComm_t comm) {
  const char* last = comm ? ncclGetLastError(comm) : nullptr;
  KDA_FAIL(fn, call, " failed: ", ncclGetErrorString(result), last && *last ? str_cat(" (", last, ")") : std::string());
}
#else
[[noreturn]] void no_nccl(const char* fn) {
  KDA_FAIL(fn, "kda-prefill was built without NCCL (meson found no usable nccl.h and libnccl; rebuild with NCCL ",
           ">= 2.10 installed, -Dnccl=enabled makes its absence an error), so there is no tensor-parallel ",
           "all-reduce: run a rank with set_partial_output(true) and sum the ranks' outputs yourself");
}
#endif

}  // namespace

CommunicatorShape communicator_shape(ncclComm_t comm, const char* fn) {
#if KDA_HAVE_NCCL
  KDA_CHECK(comm != nullptr, fn, "the communicator is null");
  CommunicatorShape s;
  if (const ncclResult_t r = ncclCommCount(comm, &s.size); r != ncclSuccess) nccl_fail(fn, "ncclCommCount", r, comm);
  if (const ncclResult_t r = ncclCommUserRank(comm, &s.rank); r != ncclSuccess)
    nccl_fail(fn, "ncclCommUserRank", r, comm);
  if (const ncclResult_t r = ncclCommCuDevice(comm, &s.device); r != ncclSuccess)
    nccl_fail(fn, "ncclCommCuDevice", r, comm);
  return s;
#else
  (void)comm;
  no_nccl(fn);
#endif
}

void check_communicator_matches(const TensorParallelConfig& tp, const CommunicatorShape& shape,
                                int module_device, const char* fn) {
  KDA_CHECK(shape.size == tp.size && shape.rank == tp.rank, fn, "the communicator has ", shape.size, " rank",
            shape.size == 1 ? "" : "s", " and this module is its rank ", shape.rank,
            ", but the config says tensor_parallel.size ", tp.size, ", tensor_parallel.rank ", tp.rank,
            ": the communicator must be the tensor-parallel group's, with this module's rank");
  KDA_CHECK(shape.device == module_device, fn, "the communicator is on CUDA device ", shape.device,
            " but the module was built on device ", module_device, ": each rank's communicator must be on its ",
            "module's device");
}

void all_reduce_sum_bf16(void* buffer, int64_t count, ncclComm_t comm, Stream stream, const char* fn) {
  KDA_CHECK(count >= 0, fn, "all-reduce of ", count, " elements");
#if KDA_HAVE_NCCL
  KDA_CHECK(comm != nullptr, fn, "the communicator is null");
  KDA_CHECK(buffer != nullptr || count == 0, fn, "the all-reduce buffer is null");
  if (count == 0) return;
  // In place: NCCL allows sendbuff == recvbuff, and the layer output needs no second buffer.
  const ncclResult_t r =
      ncclAllReduce(buffer, buffer, static_cast<size_t>(count), ncclBfloat16, ncclSum, comm, stream);
  if (r != ncclSuccess) nccl_fail(fn, "ncclAllReduce", r, comm);
#else
  (void)buffer;
  (void)comm;
  (void)stream;
  no_nccl(fn);
#endif
}

}  // namespace kda::detail

namespace kda {

bool nccl_available() {
#if KDA_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

}  // namespace kda
