// The device code of the chunked KDA recurrence (kda_chunked.h): the block bodies, written
// once for the GPU and for a CPU emulation of one CUDA block
// (tests/recurrence/test_kda_chunked_emu.cu), and at the end of this file their binding to the
// hardware (DeviceOps) and the kernels.
// Include from .cu files only (nvcc); the emulation defines KDA_EMULATED_BODIES_ONLY to take
// the bodies without the binding and the kernels.
//
// Math, per sequence, head and chunk of tokens i = 0..C-1 starting from state S0 (K x V), with
// Gam_i = sum_{j<=i} g_j per key channel (cumulative inside the chunk, so <= 0 and
// non-increasing; kept in log2 units, G = Gam * log2(e)):
//   A_ij  = beta_j sum_c k_ic k_jc 2^(G_ic - G_jc)            (j < i, strictly lower)
//   M'_ij = beta_j sum_c q_ic k_jc 2^(G_ic - G_jc)            (j <= i)
//   (I + A) [W | Uv] = [k_i * 2^G_i | v_i]                    (unit lower-triangular solve)
//   Qt_i = q_i * 2^G_i,  Kb'_j = beta_j k_j * 2^(G_C-1 - G_j),  gamma = 2^G_C-1
//   U = Uv - W S0,  O = Qt S0 + M' U,  S_C = diag(gamma) S0 + Kb'^T U.
// Only exponentials of non-positive numbers appear, so nothing overflows however strong the
// decay. The pairwise factors of A and M' are formed directly only inside the 8 x 8
// diagonal triangles; below them the factor is split at the reference token r = 16I - 1
// (the last token before row block I; inside a 16 x 16 diagonal sub-block b, at its middle
// token r = 16b + 7): 2^(G_i - G_j) = 2^(G_i - G_r) * 2^(G_r - G_j), both factors <= 1
// because j <= r < i, so each such block is a plain bf16 product on tensor cores of rows
// scaled once. tests/recurrence/test_kda_chunked_math.cpp checks this
// algebra against the token-by-token recurrence in float64.
//
// The bodies of the two phases: kda_chunked_kernel_prep.cuh (phase 1, the chunk records) and
// kda_chunked_kernel_state.cuh (phase 2, the walks and the scan), over
// kda_chunked_kernel_common.cuh (sizes, the record layout, conversions).
//
// Pool lines hold fp32 or bf16 elements (RecurrenceParams::state_dtype_is_bf16, a run-time flag):
// load_state widens, store_state rounds to nearest even (common/state_elements.h); the carried
// state stays fp32 in registers. A checkpoint line is bitwise the final line of a run cut at its
// offset in either type: the same registers, rounded the same way. A run continued from a bf16
// line starts from the rounded state and so is not bitwise the uninterrupted run (from an fp32
// line, which holds the state exactly, it is).
//
// The bodies run per thread and reach other threads only through `Ops` (barriers, named
// barriers (sync and arrive), shuffles, ballots, ldmatrix (.trans), mma in bf16,
// fp16 and tf32, cp.async); DeviceOps (end of this file) maps them to the hardware
// instructions. Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16" and "for
// mma.m16n8k8"), with g = lane / 4 and t = lane % 4:
//   A (16 x 16, row-major), 4 regs of 2 bf16: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..),
//     a3 (g+8, 2t+8..)
//   B (16 x 8, k x n), 2 regs: b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C/D (16 x 8, fp32), 4 regs: c0, c1 (g, 2t, 2t+1), c2, c3 (g+8, 2t, 2t+1)
// The lower-index element of a pair sits in the low 16 bits. ldmatrix x4: lanes 8m..8m+7
// give the row addresses of 8 x 8 matrix m; r[m] receives (row g, columns 2t, 2t+1) of it,
// with .trans (rows 2t, 2t+1; column g). fp16 fragments are laid out as the bf16 ones.
// mma.sync m16n8k8 tf32 (one fp32 word per element):
//   A (16 x 8): a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)
//   B (8 x 8, k x n): b0 (k t, n g), b1 (k t+4, n g);  C/D as above.
#pragma once

#include "recurrence/kda_chunked_kernel_prep.cuh"
#include "recurrence/kda_chunked_kernel_state.cuh"


#ifndef KDA_EMULATED_BODIES_ONLY

// The bodies on the GPU: the hardware mapping of their thread-level operations and the three
// kernels. Internal linkage: kda_chunked.cu is the one translation unit that launches them.
namespace kda {
namespace {

using chunked::PrepTraits;
using chunked::ScanTraits;
using chunked::StateTraits;
using recurrence::RecurrenceParams;

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
  // __ballot_sync over the whole warp: every lane must call it (locate_sequence, locate_row).
  __device__ __forceinline__ uint32_t ballot(bool pred) const {
    return __ballot_sync(0xFFFFFFFFu, pred);
  }
  // A read of metadata no thread writes (query_start_loc), through the read-only cache.
  __device__ __forceinline__ int32_t load_i32_ro(const int32_t* ptr) const { return __ldg(ptr); }
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
// Grid (state_grid_blocks, H).
__global__ void __launch_bounds__(StateTraits::kThreads, 1)
    kda_chunk_state_kernel(const RecurrenceParams p, int pass) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DivergentBarrierOps ops{{smem_raw}};
  chunked::state_block(ops, p, pass, blockIdx.x, blockIdx.y, threadIdx.x);
}

// Phase 2's pass 2: the scan over each sequence's segments. Grid (segment windows, H,
// ScanTraits::kSlices).
__global__ void __launch_bounds__(ScanTraits::kThreads)
    kda_chunk_scan_kernel(const RecurrenceParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  DeviceOps ops{smem_raw};
  chunked::scan_block(ops, p, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x);
}

}  // namespace
}  // namespace kda

#endif  // KDA_EMULATED_BODIES_ONLY
