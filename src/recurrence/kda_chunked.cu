// kda_chunked: the KDA prep + gated delta rule in chunks of 64 tokens (kda_chunked.h). The
// math and the block bodies are in kda_chunked_body.cuh; this file maps their thread-level
// operations to the hardware (DeviceOps), defines the two kernels and the host launcher.
//
// Launches: phase 1 grid (chunk slots, H) x 256 threads, 111 KB of shared memory (two blocks
// per SM); phase 2 grid (max_seqs, H, 4) with, by KdaStateKernel, 128 threads and 171 KB of
// shared memory (KSplit: double-buffered chunk records and the exchange of partials), 128
// threads and 151 KB (Specialized: the records and the exchange of S0 and U fragments) or 64
// threads and 139 KB (Unsplit, Original). Both grids depend on capacities only (CUDA graph
// safe).
// Only sm_80+ instructions are used (mma.sync m16n8k16 bf16 / fp16, ldmatrix (.trans),
// cp.async, named barriers), identical in the sm_90a SASS and the compute_90
// PTX, so no __CUDA_ARCH_FEAT_SM90_ALL guard is needed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/cuda_check.h"
#include "common/varlen_map.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_chunked_body.cuh"
#include "recurrence/kda_recurrence.h"

namespace kda {
namespace {

using chunked::ChunkedParams;
using chunked::PrepSmem;
using chunked::PrepTraits;
using chunked::Record;
using chunked::SpecTraits;
using chunked::SplitTraits;
using chunked::StateTraits;

constexpr const char* kFunction = "kda::kda_chunked";
constexpr int kHeadDim = chunked::kHeadDim;
static_assert(chunked::kChunk == kKdaChunk, "kda_chunked.h and the body disagree on the chunk");

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
  __device__ __forceinline__ int64_t locate_sequence(const ChunkedParams& p, int64_t slot,
                                                     int lane) const {
    return conv::find_sequence(p.search_steps, p.search_stride, [&](int64_t base, int64_t st) {
      const int64_t cand = base + lane * st;
      const bool le = cand < p.max_seqs &&
                      conv::first_program(__ldg(p.query_start_loc + cand), cand,
                                          chunked::kChunkShift) <= slot;
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
  // All but the most recently committed group of this thread are complete.
  __device__ __forceinline__ void cp_wait_prior() const {
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  }
  // Every cp.async of this thread is complete (commits the open group first).
  __device__ __forceinline__ void cp_wait_all() const {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  }
  // Barrier `id` (1 .. 15; 0 is __syncthreads') among `threads` threads, whole warps.
  __device__ __forceinline__ void named_sync(int id, int threads) const {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  }
};

// The barriers of a body whose warps reach them from role-dependent code (state_block_spec:
// the state and the output warps call the block barrier, and the two ends of each named
// barrier, at different instructions). bar.sync / bar.arrive / __syncthreads are the .aligned
// forms, which require every participating thread to execute the same barrier instruction
// (compute-sanitizer's synccheck reports "divergent threads" otherwise); the non-aligned
// barrier.sync / barrier.arrive do not. Same semantics otherwise.
struct DivergentBarrierOps : DeviceOps {
  __device__ __forceinline__ void sync() const { asm volatile("barrier.sync 0;\n" ::: "memory"); }
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
    kda_chunk_prep_kernel(const ChunkedParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DeviceOps ops{smem_raw};
  chunked::prep_block<kLowerBound>(ops, p, blockIdx.x, blockIdx.y, threadIdx.x);
}

__global__ void __launch_bounds__(StateTraits::kThreads, 1)
    kda_chunk_state_kernel(const ChunkedParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DeviceOps ops{smem_raw};
  chunked::state_block(ops, p, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
}

template <int kKSplit>
__global__ void __launch_bounds__(SplitTraits<kKSplit>::kThreads, 1)
    kda_chunk_state_split_kernel(const ChunkedParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DeviceOps ops{smem_raw};
  chunked::state_block_split<kKSplit>(ops, p, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
}

__global__ void __launch_bounds__(SpecTraits::kThreads, 1)
    kda_chunk_state_spec_kernel(const ChunkedParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DivergentBarrierOps ops{{smem_raw}};
  chunked::state_block_spec(ops, p, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
}

// ---------------------------------------------------------------------------------------------
// Host side.

bool fail(std::string* why, std::string reason) {
  if (why) *why = std::move(reason);
  return false;
}

int64_t chunk_slots(const PrepRecurrenceArgs& a) {
  return conv::programs_per_col_block(a.num_tokens, a.max_seqs, chunked::kChunkShift);
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
  KDA_CUDA_CHECK(kFunction, cudaFuncSetAttribute(kda_chunk_state_split_kernel<1>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 SplitTraits<1>::kSmemBytes));
  KDA_CUDA_CHECK(kFunction, cudaFuncSetAttribute(kda_chunk_state_split_kernel<2>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 SplitTraits<2>::kSmemBytes));
  KDA_CUDA_CHECK(kFunction, cudaFuncSetAttribute(kda_chunk_state_spec_kernel,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 SpecTraits::kSmemBytes));
  if (done.size() <= static_cast<std::size_t>(device)) done.resize(device + 1, false);
  done[device] = true;
}

}  // namespace

namespace chunked {

ChunkedParams make_chunked_params(const PrepRecurrenceArgs& a, void* workspace) {
  ChunkedParams p{};
  p.query_start_loc = a.query_start_loc;
  p.cache_indices = a.cache_indices;
  p.has_initial_state = a.has_initial_state;
  p.null_line = a.null_line;
  p.cache_lines = a.cache_lines;
  p.num_tokens = a.num_tokens;
  p.max_seqs = a.max_seqs;
  p.slots = conv::programs_per_col_block(a.num_tokens, a.max_seqs, kChunkShift);
  p.search_steps = conv::search_steps(a.max_seqs);
  p.search_stride = conv::search_stride(p.search_steps);
  p.num_heads = static_cast<int>(a.num_heads);
  p.q = static_cast<const __nv_bfloat16*>(a.q);
  p.k = static_cast<const __nv_bfloat16*>(a.k);
  p.v = static_cast<const __nv_bfloat16*>(a.v);
  p.qkv_stride = a.qkv_row_stride;
  p.g1 = static_cast<const __nv_bfloat16*>(a.g1);
  p.g1_stride = a.g1_row_stride;
  p.b = static_cast<const __nv_bfloat16*>(a.b) + a.b_col_offset;
  p.b_stride = a.b_row_stride;
  p.a_log = a.a_log;
  p.dt_bias = a.dt_bias;
  p.lower_bound = a.gate_lower_bound ? static_cast<float>(*a.gate_lower_bound) : 0.0f;
  p.states = a.states;
  p.state_line = a.state_stride_line;
  p.state_head = a.state_stride_head;
  p.state_k = a.state_stride_k;
  p.state_v = a.state_stride_v;
  p.o = static_cast<__nv_bfloat16*>(a.o);
  p.o_stride = a.o_row_stride;
  p.workspace = static_cast<unsigned char*>(workspace);
  return p;
}

}  // namespace chunked

const char* kda_state_kernel_name(KdaStateKernel kernel) {
  switch (kernel) {
    case KdaStateKernel::KSplit: return "KSplit";
    case KdaStateKernel::Unsplit: return "Unsplit";
    case KdaStateKernel::Original: return "Original";
    case KdaStateKernel::Specialized: return "Specialized";
  }
  return "?";
}

std::size_t kda_chunked_workspace_bytes(const PrepRecurrenceArgs& a) {
  if (a.num_tokens <= 0 || a.max_seqs <= 0 || a.num_heads <= 0) return 0;
  return static_cast<std::size_t>(chunk_slots(a)) * static_cast<std::size_t>(a.num_heads) *
         static_cast<std::size_t>(Record::kBytes);
}

bool kda_chunked_supported(const PrepRecurrenceArgs& a, std::string* why) {
  using detail::str_cat;
  if (!kda_prep_recurrence_supported(a, why)) return false;
  if (a.num_heads > 65535)
    return fail(why, str_cat("num_heads ", a.num_heads, " exceeds 65535 (gridDim.y)"));
  if (chunk_slots(a) > std::numeric_limits<int32_t>::max())
    return fail(why, str_cat("num_tokens / 64 + max_seqs = ", chunk_slots(a),
                             " chunk slots exceed 2^31 - 1 (gridDim.x)"));
  return true;
}

void kda_chunked(const PrepRecurrenceArgs& a, void* workspace, std::size_t workspace_bytes,
                 Stream stream, KdaChunkedPhases phases, KdaStateKernel state_kernel) {
  std::string why;
  if (!kda_chunked_supported(a, &why)) KDA_FAIL(kFunction, why);
  if (a.max_seqs == 0 || a.num_tokens == 0) return;
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
  switch (state_kernel) {
    case KdaStateKernel::KSplit:
    case KdaStateKernel::Unsplit:
    case KdaStateKernel::Original:
    case KdaStateKernel::Specialized: break;
    default:
      KDA_FAIL(kFunction, "state_kernel ", static_cast<int>(state_kernel),
               " is not one of KSplit, Unsplit, Original, Specialized");
  }
  const ChunkedParams p = chunked::make_chunked_params(a, workspace);
  set_smem_attributes();
  if (prep) {
    const dim3 grid(static_cast<unsigned>(p.slots), static_cast<unsigned>(a.num_heads));
    switch (a.head_dim) {
      case kHeadDim:
        if (a.gate_lower_bound)
          kda_chunk_prep_kernel<true><<<grid, PrepTraits::kThreads, sizeof(PrepSmem), stream>>>(p);
        else
          kda_chunk_prep_kernel<false><<<grid, PrepTraits::kThreads, sizeof(PrepSmem), stream>>>(p);
        break;
      default:
        KDA_FAIL(kFunction, "head_dim ", a.head_dim, " is not supported; only 128 is");
    }
    KDA_CUDA_CHECK(kFunction, cudaGetLastError());
  }
  if (state) {
    static_assert(StateTraits::kSlices == SplitTraits<1>::kSlices &&
                      StateTraits::kSlices == SplitTraits<2>::kSlices &&
                      StateTraits::kSlices == SpecTraits::kSlices,
                  "all phase-2 forms have one grid");
    const dim3 grid(static_cast<unsigned>(a.max_seqs), static_cast<unsigned>(a.num_heads),
                    StateTraits::kSlices);
    switch (state_kernel) {
      case KdaStateKernel::KSplit:
        kda_chunk_state_split_kernel<2>
            <<<grid, SplitTraits<2>::kThreads, SplitTraits<2>::kSmemBytes, stream>>>(p);
        break;
      case KdaStateKernel::Unsplit:
        kda_chunk_state_split_kernel<1>
            <<<grid, SplitTraits<1>::kThreads, SplitTraits<1>::kSmemBytes, stream>>>(p);
        break;
      case KdaStateKernel::Original:
        kda_chunk_state_kernel<<<grid, StateTraits::kThreads, StateTraits::kSmemBytes, stream>>>(p);
        break;
      case KdaStateKernel::Specialized:
        kda_chunk_state_spec_kernel
            <<<grid, SpecTraits::kThreads, SpecTraits::kSmemBytes, stream>>>(p);
        break;
    }
    KDA_CUDA_CHECK(kFunction, cudaGetLastError());
  }
}

}  // namespace kda
