// kda_chunked: the KDA prep + gated delta rule in chunks of 64 tokens (kda_chunked.h). The
// math and the block bodies are in kda_chunked_body.cuh; this file maps their thread-level
// operations to the hardware (DeviceOps), defines the two kernels and the host launcher.
//
// Launches: phase 1 grid (chunk slots, H) x 256 threads, 111 KB of shared memory (two blocks
// per SM); phase 2 grid (segment slots, H, 4) x 128 threads, 151 KB of shared memory (the two
// record stages and the exchange of S0 and U fragments), with segment slots = num_seqs when
// sequences stay whole; when they are cut, pass 1 has z = 8 (the summaries' two roles), then
// the scan (num_seqs, H, 4) x 256 threads, 80 KB, and pass 3. All grids depend on capacities
// only (CUDA graph safe).
// Only sm_80+ instructions are used (mma.sync m16n8k16 bf16 / fp16, ldmatrix (.trans),
// cp.async, named barriers), identical in the sm_90a SASS and the compute_90
// PTX, so no __CUDA_ARCH_FEAT_SM90_ALL guard is needed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/cuda_check.h"
#include "common/varlen_map.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_chunked_body.cuh"
#include "recurrence/kda_recurrence.h"
#include "recurrence/recurrence_params.h"

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
static_assert(Record::kBytes == recurrence::kRecordBytes, "recurrence_params.h's record size");

// The thread-level operations of the block bodies on the GPU.
struct DeviceOps {
  unsigned char* smem_ptr;

  __device__ __forceinline__ unsigned char* smem() const { return smem_ptr; }
  __device__ __forceinline__ uint32_t smem_addr(const void* p) const {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
  }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
  __device__ __forceinline__ float shfl_xor(float v, int mask) const {
    return __shfl_xor_sync(0xFFFFFFFFu, v, mask);
  }
  // The radix search of common/varlen_map.h, warp-cooperative: every lane of the warp calls it
  // with the same slot, lane j tests candidate j of each level and a ballot counts them.
  __device__ __forceinline__ int64_t locate_sequence(const RecurrenceParams& p, int64_t slot,
                                                     int lane, int shift) const {
    return varlen::find_sequence(p.search_steps, p.search_stride, [&](int64_t base, int64_t st) {
      const int64_t cand = base + lane * st;
      const bool le = cand < p.num_seqs &&
                      varlen::first_slot(__ldg(p.query_start_loc + cand), cand, shift) <= slot;
      return __popc(__ballot_sync(0xFFFFFFFFu, le));
    });
  }
  __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) const {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }

  // The same with .trans: r[m] receives (row 2t, column g) and (row 2t + 1, column g) of
  // matrix m, low half first (the phase-1 solve reads row-major [token][column] tiles as
  // column-major fragments with it).
  __device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) const {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }

  // d += a b (m16n8k16, bf16 in, fp32 accumulate).
  __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                      uint32_t b1) const {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // d += a b (m16n8k16, fp16 in, fp32 accumulate).
  __device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) const {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // d += a b (m16n8k8, tf32 in, fp32 accumulate); tf32 operands as fp32 bit patterns.
  __device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                           uint32_t b1) const {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // 16 bytes global -> shared through L2 only (the records are read once per block).
  __device__ __forceinline__ void cp16(uint32_t dst, const void* src) const {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
  }
  __device__ __forceinline__ void cp_commit() const {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  // Every cp.async of this thread is complete (commits the open group first).
  __device__ __forceinline__ void cp_wait_all() const {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  }
};

// The barriers of a body whose warps reach them from role-dependent code (state_block:
// the state and the output warps call the block barrier, and the two ends of each named
// barrier, at different instructions). bar.sync / bar.arrive / __syncthreads are the .aligned
// forms, which require every participating thread to execute the same barrier instruction
// (compute-sanitizer's synccheck reports "divergent threads" otherwise); the non-aligned
// barrier.sync / barrier.arrive do not. Same semantics otherwise.
struct DivergentBarrierOps : DeviceOps {
  __device__ __forceinline__ void sync() const { asm volatile("barrier.sync 0;\n" ::: "memory"); }
  // Barrier `id` (1 .. 15; 0 is the block barrier) among `threads` threads, whole warps.
  __device__ __forceinline__ void named_sync(int id, int threads) const {
    asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  }
  // Arrives at barrier `id` without waiting (a producer): its earlier memory accesses are
  // performed for the threads that wait there once the barrier completes.
  __device__ __forceinline__ void named_arrive(int id, int threads) const {
    asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  }
};

template <bool kLowerBound>
__global__ void __launch_bounds__(PrepTraits::kThreads, 2)
    kda_chunk_prep_kernel(const RecurrenceParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DeviceOps ops{smem_raw};
  chunked::prep_block<kLowerBound>(ops, p, blockIdx.x, blockIdx.y, threadIdx.x);
}

// Phase 2's walks: pass 1 (every sequence's first segment, and the other segments' summaries
// and transitions) or pass 3 (the segments after the first, from their true initial states).
__global__ void __launch_bounds__(StateTraits::kThreads, 1)
    kda_chunk_state_kernel(const RecurrenceParams p, int pass) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DivergentBarrierOps ops{{smem_raw}};
  chunked::state_block(ops, p, pass, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
}

// Phase 2's pass 2: the scan over each sequence's segments.
__global__ void __launch_bounds__(ScanTraits::kThreads)
    kda_chunk_scan_kernel(const RecurrenceParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DeviceOps ops{smem_raw};
  chunked::scan_block(ops, p, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
}

// ---------------------------------------------------------------------------------------------
// Host side.

int64_t chunk_slots(const PrepRecurrenceArgs& a) {
  return varlen::slot_count(a.num_tokens, a.varlen.num_seqs, chunked::kChunkShift);
}

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
int segment_shift(const PrepRecurrenceArgs& a) {
  return recurrence::segment_shift_of(a, a.segment_tokens < 0 ? sm_count() : 0);
}

}  // namespace

int64_t kda_chunked_auto_segment_tokens(int64_t num_tokens, int64_t num_heads) {
  const int shift = recurrence::auto_segment_shift(num_tokens, num_heads, sm_count());
  return shift >= recurrence::kNoSegments ? 0 : kKdaChunk << shift;
}

std::size_t kda_chunked_workspace_bytes(const PrepRecurrenceArgs& a) {
  if (a.num_tokens <= 0 || a.varlen.num_seqs <= 0 || a.num_heads <= 0) return 0;
  return recurrence::chunked_layout(a, segment_shift(a)).total();
}

bool kda_chunked_supported(const PrepRecurrenceArgs& a, std::string* why) {
  using detail::fail;
  using detail::str_cat;
  // The shared checks bound num_heads by 16383, below the 65535 of both grids' y extent.
  static_assert(recurrence::kMaxHeads <= 65535, "gridDim.y = H");
  if (!kda_prep_recurrence_supported(a, why)) return false;
  if (chunk_slots(a) > std::numeric_limits<int32_t>::max())
    return fail(why, str_cat("num_tokens / 64 + num_seqs = ", chunk_slots(a),
                             " chunk slots exceed 2^31 - 1 (gridDim.x)"));
  const int64_t st = a.segment_tokens;
  if (st != kKdaAutoSegments && st != 0 && (st < kKdaChunk || (st & (st - 1)) != 0))
    return fail(why, str_cat("segment_tokens ", st, " is not ", kKdaAutoSegments,
                             " (the op's choice), 0 (no cut) or a power of two >= 64"));
  return true;
}

void kda_chunked(const PrepRecurrenceArgs& a, void* workspace, std::size_t workspace_bytes,
                 Stream stream, KdaChunkedPhases phases) {
  std::string why;
  if (!kda_chunked_supported(a, &why)) KDA_FAIL(kFunction, why);
  if (a.varlen.num_seqs == 0 || a.num_tokens == 0) return;
  const std::size_t need = kda_chunked_workspace_bytes(a);
  KDA_CHECK(workspace != nullptr && workspace_bytes >= need, kFunction, "the workspace has ",
            workspace_bytes, " bytes", workspace ? "" : " (null)", "; these capacities need ",
            need, " (kda_chunked_workspace_bytes)");
  KDA_CHECK(reinterpret_cast<std::uintptr_t>(workspace) % 16 == 0, kFunction,
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
  const RecurrenceParams p = recurrence::make_recurrence_params(a, workspace, segment_shift(a));
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
    const auto slots = static_cast<unsigned>(p.seg_slots);
    const auto heads = static_cast<unsigned>(p.num_heads);
    const dim3 pass1(slots, heads, (cut ? 2 : 1) * StateTraits::kSlices);
    kda_chunk_state_kernel<<<pass1, StateTraits::kThreads, StateTraits::kSmemBytes, stream>>>(p, 1);
    KDA_CUDA_CHECK(kFunction, cudaGetLastError());
    if (cut) {
      const dim3 scan(static_cast<unsigned>(p.num_seqs), heads, StateTraits::kSlices);
      kda_chunk_scan_kernel<<<scan, ScanTraits::kThreads, ScanTraits::kSmemBytes, stream>>>(p);
      KDA_CUDA_CHECK(kFunction, cudaGetLastError());
      const dim3 pass3(slots, heads, StateTraits::kSlices);
      kda_chunk_state_kernel<<<pass3, StateTraits::kThreads, StateTraits::kSmemBytes, stream>>>(p, 3);
      KDA_CUDA_CHECK(kFunction, cudaGetLastError());
    }
  }
}

}  // namespace kda
