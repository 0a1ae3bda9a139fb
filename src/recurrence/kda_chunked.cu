// kda_chunked's launches (kda_chunked.h): the checks and params of its plan
// (kda_chunked_plan.cpp), the device facts the plan needs (the SM count) and the kernels'
// shared-memory opt-in, then the launches of the kernels of kda_chunked_kernel.cuh.
//
// Launches: phase 1 grid (chunk slots, H) x 256 threads, 111 KB of shared memory (two blocks
// per SM); phase 2 grid (2 num_seqs, H) x 256 threads, 181 KB of shared memory (the two record
// stages and the exchange of S0 and U fragments); when sequences are cut, pass 1 adds 4 blocks
// per segment window (the summaries' two roles), then the scan (segment windows, H, 4) x 256
// threads, 80 KB, and pass 3 (2 per segment window, H). All grids depend on capacities only
// (CUDA graph safe).
// Only sm_80+ instructions are used (mma.sync m16n8k16 bf16 / fp16, ldmatrix (.trans),
// cp.async, named barriers), identical in the sm_90a SASS and the compute_90
// PTX, so no __CUDA_ARCH_FEAT_SM90_ALL guard is needed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/arg_checks.h"
#include "common/check.h"
#include "common/cuda_check.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_chunked_kernel.cuh"
#include "recurrence/kda_recurrence.h"

namespace kda {
namespace {

using chunked::PrepSmem;
using chunked::PrepTraits;
using chunked::Record;
using chunked::ScanTraits;
using chunked::StateTraits;
using recurrence::RecurrenceParams;

constexpr const char* kFunction = "kda::kda_chunked";
static_assert(chunked::kChunk == kKdaChunk, "kda_chunked.h and the body disagree on the chunk");
static_assert(Record::kBytes == recurrence::kRecordBytes, "kda_chunked.h's record size");

// Opts the kernels into more than 48 KB of dynamic shared memory, once per device (the
// attribute is per device). After a first, eager launch nothing but cudaGetDevice runs here,
// so later launches are plain stream work, also while a stream is being captured.
void set_smem_attributes() {
  int device = 0;
  KDA_CUDA_CHECK(kFunction, cudaGetDevice(&device));
  static std::mutex mu;
  static std::vector<bool> done;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<std::size_t>(device) < done.size() && done[device]) return;
  KDA_CUDA_CHECK(kFunction, cudaFuncSetAttribute(kda_chunk_prep_kernel<false>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(sizeof(PrepSmem))));
  KDA_CUDA_CHECK(kFunction, cudaFuncSetAttribute(kda_chunk_prep_kernel<true>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(sizeof(PrepSmem))));
  // Two prep blocks per SM need 2 x 112.25 KB: ask for the largest shared-memory carveout.
  KDA_CUDA_CHECK(kFunction, cudaFuncSetAttribute(kda_chunk_prep_kernel<false>,
                                                 cudaFuncAttributePreferredSharedMemoryCarveout,
                                                 cudaSharedmemCarveoutMaxShared));
  KDA_CUDA_CHECK(kFunction, cudaFuncSetAttribute(kda_chunk_prep_kernel<true>,
                                                 cudaFuncAttributePreferredSharedMemoryCarveout,
                                                 cudaSharedmemCarveoutMaxShared));
  KDA_CUDA_CHECK(kFunction, cudaFuncSetAttribute(kda_chunk_state_kernel,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 StateTraits::kSmemBytes));
  KDA_CUDA_CHECK(kFunction, cudaFuncSetAttribute(kda_chunk_scan_kernel,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 ScanTraits::kSmemBytes));
  if (done.size() <= static_cast<std::size_t>(device)) done.resize(device + 1, false);
  done[device] = true;
}

// The current device's SM count, read once per device (the segment plan depends on it); 0
// without a device (host-only sizing: then the op does not cut).
int sm_count() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  static std::mutex mu;
  static std::vector<int> counts;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<std::size_t>(device) >= counts.size()) counts.resize(device + 1, 0);
  if (counts[device] == 0)
    KDA_CUDA_CHECK(kFunction, cudaDeviceGetAttribute(&counts[device],
                                                     cudaDevAttrMultiProcessorCount, device));
  return counts[device];
}

// The segment length for `a`: asks the device only when the op chooses it.
int64_t segment_tokens(const RecurrenceArgs& a) {
  return recurrence::segment_tokens_of(a, a.segment_tokens < 0 ? sm_count() : 0);
}

}  // namespace

int64_t kda_chunked_auto_segment_tokens(int64_t num_tokens, int64_t num_heads) {
  return recurrence::auto_segment_tokens(num_tokens, num_heads, sm_count());
}

std::size_t kda_chunked_workspace_bytes(const RecurrenceArgs& a) {
  return recurrence::chunked_workspace_bytes(a, a.segment_tokens < 0 ? sm_count() : 0);
}

void kda_chunked(const RecurrenceArgs& a, void* workspace, std::size_t workspace_bytes,
                 Stream stream, KdaChunkedPhases phases) {
  std::string why;
  if (!kda_chunked_supported(a, &why)) KDA_FAIL(kFunction, why);
  if (a.varlen.num_seqs == 0 || a.num_tokens == 0) return;
  const std::size_t need = kda_chunked_workspace_bytes(a);
  KDA_CHECK(workspace != nullptr && workspace_bytes >= need, kFunction, "the workspace has ",
            workspace_bytes, " bytes", workspace ? "" : " (null)", "; these capacities need ",
            need, " (kda_chunked_workspace_bytes)");
  KDA_CHECK(detail::aligned_to(workspace, 16), kFunction,
            "the workspace must be 16-byte aligned (cp.async copies 16-byte pieces)");

  bool prep = false, state = false;
  switch (phases) {
    case KdaChunkedPhases::Both: prep = state = true; break;
    case KdaChunkedPhases::PrepOnly: prep = true; break;
    case KdaChunkedPhases::StateOnly: state = true; break;
    default:
      KDA_FAIL(kFunction, "phases ", static_cast<int>(phases),
               " is not one of Both, PrepOnly, StateOnly");
  }
  const RecurrenceParams p = recurrence::make_chunked_params(a, workspace, segment_tokens(a));
  set_smem_attributes();
  if (prep) {
    const dim3 grid(static_cast<unsigned>(p.slots), static_cast<unsigned>(p.num_heads));
    // supported() admits head_dim 128 only, the one instance.
    if (a.gate_lower_bound)
      kda_chunk_prep_kernel<true><<<grid, PrepTraits::kThreads, sizeof(PrepSmem), stream>>>(p);
    else
      kda_chunk_prep_kernel<false><<<grid, PrepTraits::kThreads, sizeof(PrepSmem), stream>>>(p);
    KDA_CUDA_CHECK(kFunction, cudaGetLastError());
  }
  if (state) {
    // Pass 1; when sequences are cut, the scan (pass 2) and pass 3.
    const bool cut = chunked::segmented(p);
    const auto heads = static_cast<unsigned>(p.num_heads);
    const auto walk_grid = [&](int pass) {
      return dim3(static_cast<unsigned>(chunked::state_grid_blocks(p, pass)), heads);
    };
    kda_chunk_state_kernel<<<walk_grid(1), StateTraits::kThreads, StateTraits::kSmemBytes, stream>>>(p, 1);
    KDA_CUDA_CHECK(kFunction, cudaGetLastError());
    if (cut) {
      const dim3 scan(static_cast<unsigned>(chunked::segment_windows(p)), heads, ScanTraits::kSlices);
      kda_chunk_scan_kernel<<<scan, ScanTraits::kThreads, ScanTraits::kSmemBytes, stream>>>(p);
      KDA_CUDA_CHECK(kFunction, cudaGetLastError());
      kda_chunk_state_kernel<<<walk_grid(3), StateTraits::kThreads, StateTraits::kSmemBytes, stream>>>(p, 3);
      KDA_CUDA_CHECK(kFunction, cudaGetLastError());
    }
  }
}

}  // namespace kda
