// The packed Q|K|V causal conv1d kernel and its launcher. The per-warp program is
// packed_conv_body.cuh; this file binds it to the device (DeviceOps), launches the instance the
// arguments need, and never sees host-side logic beyond the launch (conv_params.cpp plans it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>

#include "common/check.h"
#include "common/cuda_check.h"
#include "conv/conv_params.h"
#include "conv/packed_conv_body.cuh"
#include "conv/silu_recipe.h"
#include "kda/packed_conv.h"

namespace kda::conv {

namespace {

constexpr int kMaxThreadsPerCta = kMaxWarpsPerCta * 32;

// kBytes bytes of one row at ptr (aligned to min(16, kBytes)), through the read-only cache
// (x in global memory) or plain (a tile in shared memory).
template <int kBytes, bool kReadOnly>
__device__ __forceinline__ RowOf<kBytes> load_row_bits(const char* ptr) {
  RowOf<kBytes> r;
  if constexpr (kBytes == 32 || kBytes == 16) {
    const uint4* v = reinterpret_cast<const uint4*>(ptr);
    const uint4 a = kReadOnly ? __ldg(v) : v[0];
    r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
    if constexpr (kBytes == 32) {
      const uint4 b = kReadOnly ? __ldg(v + 1) : v[1];
      r.w[4] = b.x; r.w[5] = b.y; r.w[6] = b.z; r.w[7] = b.w;
    }
  } else if constexpr (kBytes == 8) {
    const uint2* v = reinterpret_cast<const uint2*>(ptr);
    const uint2 a = kReadOnly ? __ldg(v) : v[0];
    r.w[0] = a.x; r.w[1] = a.y;
  } else if constexpr (kBytes == 4) {
    const unsigned int* v = reinterpret_cast<const unsigned int*>(ptr);
    r.w[0] = kReadOnly ? __ldg(v) : v[0];
  } else {
    static_assert(kBytes == 2, "row bytes");
    const unsigned short* v = reinterpret_cast<const unsigned short*>(ptr);
    r.w[0] = kReadOnly ? __ldg(v) : v[0];
  }
  return r;
}

// The bulk-copy engine and its mbarrier (sm_90 PTX; the library builds for sm_90a and
// compute_90 only). A CTA-local shared address is a valid shared::cluster address.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbarrier_init_one(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
  // Makes the initialised barrier visible to the copy engine (the async proxy).
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// The one expected arrival, announcing `bytes` of copies that will complete on the barrier.
__device__ __forceinline__ void mbarrier_arrive_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  } while (done == 0);
}
// bytes (a multiple of 16, both addresses 16-byte aligned) from global src to shared dst.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes,
                                                    uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}

// The device side of packed_conv_body.cuh's Ops. x, the taps, the bias, query_start_loc,
// cache_indices and has_initial_state are read through the read-only cache: nothing writes
// them during the kernel (supported() rejects an out that overlaps x). The conv state is read
// with plain loads because the same warp writes it.
struct DeviceOps {
  float* stage_area;

  template <int kBytes>
  __device__ __forceinline__ RowOf<kBytes> load_x(const char* ptr) const {
    return load_row_bits<kBytes, true>(ptr);
  }

  // RowPath::Bulk: the warp's tile (tile_lane is this lane's first byte in slot 0) and the
  // mbarrier its copies complete on (phase 0: each CTA uses its tiles once).
  const char* tile_lane = nullptr;
  uint64_t* tile_ready = nullptr;
  __device__ __forceinline__ void wait_tile() const { mbarrier_wait_parity(tile_ready, 0); }
  template <int kBytes>
  __device__ __forceinline__ RowOf<kBytes> tile_row(int slot) const {
    return load_row_bits<kBytes, false>(tile_lane + slot * (32 * kBytes));
  }

  template <int kBytes>
  __device__ __forceinline__ void store_out(char* ptr, const RowOf<kBytes>& r) const {
    if constexpr (kBytes == 32) {
      reinterpret_cast<uint4*>(ptr)[0] = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
      reinterpret_cast<uint4*>(ptr)[1] = make_uint4(r.w[4], r.w[5], r.w[6], r.w[7]);
    } else if constexpr (kBytes == 16) {
      *reinterpret_cast<uint4*>(ptr) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
    } else if constexpr (kBytes == 8) {
      *reinterpret_cast<uint2*>(ptr) = make_uint2(r.w[0], r.w[1]);
    } else if constexpr (kBytes == 4) {
      *reinterpret_cast<unsigned int*>(ptr) = r.w[0];
    } else {
      static_assert(kBytes == 2, "row bytes");
      *reinterpret_cast<unsigned short*>(ptr) = static_cast<unsigned short>(r.w[0]);
    }
  }

  __device__ __forceinline__ float load_ro(const float* ptr) const { return __ldg(ptr); }
  __device__ __forceinline__ Float4 load4_ro(const float* ptr) const {
    const float4 v = __ldg(reinterpret_cast<const float4*>(ptr));
    return Float4{v.x, v.y, v.z, v.w};
  }
  __device__ __forceinline__ Float4 load4(const float* ptr) const {
    const float4 v = *reinterpret_cast<const float4*>(ptr);
    return Float4{v.x, v.y, v.z, v.w};
  }
  __device__ __forceinline__ void store4(float* ptr, Float4 v) const {
    *reinterpret_cast<float4*>(ptr) = make_float4(v.x, v.y, v.z, v.w);
  }
  __device__ __forceinline__ int32_t load_i32_ro(const int32_t* ptr) const { return __ldg(ptr); }
  __device__ __forceinline__ bool load_flag(const bool* ptr) const {
    return *reinterpret_cast<const unsigned char*>(ptr) != 0;
  }

  __device__ __forceinline__ float from_bits(uint32_t b) const { return __uint_as_float(b); }
  __device__ __forceinline__ uint32_t to_bits(float v) const { return __float_as_uint(v); }
  __device__ __forceinline__ float fp16_to_f32(uint16_t h) const {
    return load_f32(__ushort_as_half(h));
  }
  __device__ __forceinline__ uint16_t f32_to_bf16_rn(float v) const {
    return __bfloat16_as_ushort(store_rn<__nv_bfloat16>(v));
  }
  __device__ __forceinline__ uint16_t f32_to_fp16_rn(float v) const {
    return __half_as_ushort(store_rn<__half>(v));
  }
  // One cvt for two results; the same bits as two single conversions.
  __device__ __forceinline__ uint32_t pack2_bf16_rn(float lo, float hi) const {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ __forceinline__ uint32_t pack2_fp16_rn(float lo, float hi) const {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ __forceinline__ float silu(float acc) const { return silu_stock_fast(acc); }

  __device__ __forceinline__ uint32_t ballot(bool pred) const {
    return __ballot_sync(0xFFFFFFFFu, pred);
  }
  __device__ __forceinline__ int32_t shfl(int32_t v, int src) const {
    return __shfl_sync(0xFFFFFFFFu, v, src);
  }
  __device__ __forceinline__ void syncwarp() const { __syncwarp(); }
  __device__ __forceinline__ float* stage() const { return stage_area; }
};

// RowPath::Bulk: warp lanes issue one bulk copy per tile slot that tile_slot_row names (the
// warp's tile row of that x row), after lane 0 announced their bytes on the warp's barrier.
template <typename Traits>
__device__ __forceinline__ void issue_tile_copies(const PackedConvParams& p, const ProgramChunk& pc,
                                                  const ProgramRows& plan, int64_t plane,
                                                  int64_t plane_col_block, int lane, char* tile,
                                                  uint64_t* bar) {
  constexpr uint32_t kSlotBytes = 32 * Traits::kRowBytes;
  if (lane == 0) {
    const int copies = 1 + (plan.seed2 ? 1 : 0) + (plan.seed3 ? 1 : 0) + plan.rows;
    mbarrier_arrive_expect(bar, static_cast<uint32_t>(copies) * kSlotBytes);
  }
  __syncwarp();
  const char* x_tile = static_cast<const char*>(p.x) +
                       (plane * p.part_dim + plane_col_block * Traits::kTile) * Traits::kElemBytes;
  const int64_t x_row_bytes = p.x_row_stride * Traits::kElemBytes;
  for (int slot = lane; slot < kSeedSlots + plan.rows; slot += 32) {
    const int64_t row = tile_slot_row(plan, pc, slot);
    if (row >= 0) bulk_copy_to_shared(tile + slot * kSlotBytes, x_tile + row * x_row_bytes, kSlotBytes, bar);
  }
}

// CTA (x, y, z): chunk program x, column blocks y * warps + warp of plane z (conv_params.h).
// Warp 0 finds the chunk (the radix search's dependent loads) and shares it through shared
// memory, so the other warps spend no instructions on it. Dynamic shared memory: the warps'
// staging areas, then (kBulk) the warps' row tiles.
template <typename Traits, bool kSilu, bool kHasBias, bool kBulk>
__global__ void __launch_bounds__(kMaxThreadsPerCta)
packed_conv_kernel(const PackedConvParams p) {
  extern __shared__ float4 staging_storage[];
  __shared__ int64_t located[6];
  __shared__ uint64_t tile_ready[kBulk ? kMaxWarpsPerCta : 1];
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  char* const shared = reinterpret_cast<char*>(staging_storage);
  DeviceOps ops{reinterpret_cast<float*>(shared + warp * staging_bytes_per_warp(Traits::kTile))};
  char* tile = nullptr;
  if constexpr (kBulk) {
    tile = shared + p.warps_per_cta * staging_bytes_per_warp(Traits::kTile) +
           warp * bulk_tile_bytes_per_warp(Traits::kTile, Traits::kElemBytes, 1 << p.chunk_shift);
    ops.tile_lane = tile + lane * Traits::kRowBytes;
    ops.tile_ready = &tile_ready[warp];
    if (lane == 0) mbarrier_init_one(&tile_ready[warp]);  // ordered before use by the barrier below
  }
  if (warp == 0) {
    const ProgramChunk pc = locate_chunk(p, blockIdx.x, lane, ops);
    if (lane == 0) {
      located[0] = pc.seq;
      located[1] = pc.chunk;
      located[2] = pc.begin;
      located[3] = pc.end;
      located[4] = pc.seq_begin;
      located[5] = pc.seq_end;
    }
  }
  __syncthreads();
  ProgramChunk pc;
  pc.seq = located[0];
  pc.chunk = located[1];
  pc.begin = located[2];
  pc.end = located[3];
  pc.seq_begin = located[4];
  pc.seq_end = located[5];
  const int64_t plane_col_block = static_cast<int64_t>(blockIdx.y) * (blockDim.x / 32) + warp;
  if (plane_col_block >= p.cols_per_plane) return;  // the last group of a forced warps_per_cta
  const ProgramRows plan = program_rows(p, pc);
  if constexpr (kBulk) {
    if (plan.rows > 0) issue_tile_copies<Traits>(p, pc, plan, blockIdx.z, plane_col_block, lane, tile, ops.tile_ready);
  }
  packed_conv_program<Traits, kSilu, kHasBias, kBulk>(p, pc, plan, blockIdx.z, plane_col_block, lane, ops);
  // The program may return early (a skipped sequence) with copies in flight: none may outlive
  // the CTA's shared memory.
  if constexpr (kBulk) {
    if (plan.rows > 0) ops.wait_tile();
  }
}

template <typename Traits, bool kSilu, bool kHasBias, bool kBulk>
void launch_kernel(const PackedConvParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.programs_per_col_block),
                  static_cast<unsigned>(p.col_groups_per_plane), static_cast<unsigned>(p.planes));
  const dim3 block(static_cast<unsigned>(p.warps_per_cta * 32));
  const auto kernel = packed_conv_kernel<Traits, kSilu, kHasBias, kBulk>;
  if constexpr (kBulk) {
    // Once per instance: the opt-in shared memory the tiles may need, and the largest shared
    // carve-out (the rows bypass L1; the carve-out decides how many CTAs fit an SM).
    static std::once_flag configured;
    std::call_once(configured, [&] {
      KDA_CUDA_CHECK("kda::conv::launch_packed_conv",
                     cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kMaxBulkSharedBytes)));
      KDA_CUDA_CHECK("kda::conv::launch_packed_conv",
                     cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                          static_cast<int>(cudaSharedmemCarveoutMaxShared)));
    });
  }
  kernel<<<grid, block, static_cast<std::size_t>(shared_bytes(p)), stream>>>(p);
}

template <typename Traits, bool kBulk>
void launch_options(const PackedConvParams& p, cudaStream_t stream) {
  const bool has_bias = p.bias != nullptr;
  if (p.silu && has_bias) {
    launch_kernel<Traits, true, true, kBulk>(p, stream);
  } else if (p.silu) {
    launch_kernel<Traits, true, false, kBulk>(p, stream);
  } else if (has_bias) {
    launch_kernel<Traits, false, true, kBulk>(p, stream);
  } else {
    launch_kernel<Traits, false, false, kBulk>(p, stream);
  }
}

template <DType kDType, int kVec>
void launch_instance(const PackedConvParams& p, cudaStream_t stream) {
  using Traits = PackedConvTraits<kDType, kVec>;
  if (p.bulk_rows) {
    launch_options<Traits, true>(p, stream);
  } else {
    launch_options<Traits, false>(p, stream);
  }
}

template <DType kDType>
void launch_for_vec(const PackedConvParams& p, cudaStream_t stream, const char* function) {
  switch (p.vec) {
    case 8: return launch_instance<kDType, 8>(p, stream);
    case 4: return launch_instance<kDType, 4>(p, stream);
    case 2: return launch_instance<kDType, 2>(p, stream);
    case 1: return launch_instance<kDType, 1>(p, stream);
    default: KDA_FAIL(function, "vec ", p.vec, " has no kernel instance; supported are 8, 4, 2, 1");
  }
}

void run(const PackedConvArgs& args, const ConvTuning& tuning, Stream stream,
         const char* function) {
  std::string why;
  if (!packed_causal_conv1d_supported(args, &why)) KDA_FAIL(function, why);
  why = check_tuning(args, tuning);
  if (!why.empty()) KDA_FAIL(function, why);
  if (args.num_tokens == 0 || args.num_seqs == 0) return;
  const PackedConvParams p = make_params(args, tuning);
  // supported() and check_tuning() refused grids past CUDA's limits; checked again here because
  // a launch past them would fail silently in a captured graph.
  why = check_grid(p);
  if (!why.empty()) KDA_FAIL(function, why);
  const auto s = static_cast<cudaStream_t>(stream);
  switch (p.x_dtype) {
    case DType::BF16: launch_for_vec<DType::BF16>(p, s, function); break;
    case DType::FP16: launch_for_vec<DType::FP16>(p, s, function); break;
    case DType::FP32: launch_for_vec<DType::FP32>(p, s, function); break;
    default:
      KDA_FAIL(function, "x_dtype ", static_cast<int>(p.x_dtype),
               " has no kernel instance; supported are bf16, fp16 and fp32");
  }
  KDA_CUDA_CHECK(function, cudaGetLastError());
}

}  // namespace

void launch_packed_conv(const PackedConvArgs& args, const ConvTuning& tuning, Stream stream) {
  run(args, tuning, stream, "kda::conv::launch_packed_conv");
}

}  // namespace kda::conv

namespace kda {

void packed_causal_conv1d(const PackedConvArgs& args, Stream stream) {
  conv::run(args, conv::ConvTuning{}, stream, "kda::packed_causal_conv1d");
}

}  // namespace kda
