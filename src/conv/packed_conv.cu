// The packed Q|K|V causal conv1d kernel and its launcher. The per-warp program is
// packed_conv_body.cuh; this file binds it to the device (DeviceOps), launches the instance the
// arguments need, and never sees host-side logic beyond the launch (conv_params.cpp plans it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
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

// The device side of packed_conv_body.cuh's Ops. x, the taps, the bias, query_start_loc,
// cache_indices and has_initial_state are read through the read-only cache: nothing writes
// them during the kernel (supported() rejects an out that overlaps x). The conv state is read
// with plain loads because the same warp writes it.
//
// Results are stored streaming (st.global.cs, evict first from L1 and L2): the kernel never
// reads them again, and L2 keeps more of the row stream (the seed rows that neighbouring
// programs re-read; docs/perf.md).
struct DeviceOps {
  float* stage_area;

  template <int kBytes>
  __device__ __forceinline__ RowOf<kBytes> load_x(const char* ptr) const {
    RowOf<kBytes> r;
    if constexpr (kBytes == 32) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(ptr));
      const uint4 b = __ldg(reinterpret_cast<const uint4*>(ptr) + 1);
      r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
      r.w[4] = b.x; r.w[5] = b.y; r.w[6] = b.z; r.w[7] = b.w;
    } else if constexpr (kBytes == 16) {
      const uint4 a = __ldg(reinterpret_cast<const uint4*>(ptr));
      r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w;
    } else if constexpr (kBytes == 8) {
      const uint2 a = __ldg(reinterpret_cast<const uint2*>(ptr));
      r.w[0] = a.x; r.w[1] = a.y;
    } else if constexpr (kBytes == 4) {
      r.w[0] = __ldg(reinterpret_cast<const unsigned int*>(ptr));
    } else {
      static_assert(kBytes == 2, "row bytes");
      r.w[0] = __ldg(reinterpret_cast<const unsigned short*>(ptr));
    }
    return r;
  }

  template <class T>
  __device__ __forceinline__ static void store(T* ptr, T v) { __stcs(ptr, v); }

  template <int kBytes>
  __device__ __forceinline__ void store_out(char* ptr, const RowOf<kBytes>& r) const {
    if constexpr (kBytes == 32) {
      store(reinterpret_cast<uint4*>(ptr), make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]));
      store(reinterpret_cast<uint4*>(ptr) + 1, make_uint4(r.w[4], r.w[5], r.w[6], r.w[7]));
    } else if constexpr (kBytes == 16) {
      store(reinterpret_cast<uint4*>(ptr), make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]));
    } else if constexpr (kBytes == 8) {
      store(reinterpret_cast<uint2*>(ptr), make_uint2(r.w[0], r.w[1]));
    } else if constexpr (kBytes == 4) {
      store(reinterpret_cast<unsigned int*>(ptr), r.w[0]);
    } else {
      static_assert(kBytes == 2, "row bytes");
      store(reinterpret_cast<unsigned short*>(ptr), static_cast<unsigned short>(r.w[0]));
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

// CTA (x, y, z): chunk programs x * chunks_per_cta + j, column blocks y * warps + warp of plane z
// (conv_params.h). Each warp finds its first program's chunk itself (the radix search's
// dependent loads; its CTA's other warps load the same words, which L1 serves) and walks the
// CTA's programs (packed_conv_programs). No barrier: the warps of a CTA never wait for each
// other, so each issues its row loads as soon as its own search answers.
//
// Registers: instances of up to 4 channels per lane are held to 128 per thread (2 CTAs of the
// largest block, 256 threads, per SM: 16 warps, so 4 CTAs of 4 warps or 8 of 2). The bias instances,
// which keep 4 more values live through the chunk loop, would take 165-171 and fit 2 CTAs.
template <typename Traits, bool kSilu, bool kHasBias>
__global__ void __launch_bounds__(kMaxThreadsPerCta, Traits::kVec <= 4 ? 2 : 1)
packed_conv_kernel(const PackedConvParams p) {
  extern __shared__ float4 staging_storage[];
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t plane_col_block = static_cast<int64_t>(blockIdx.y) * (blockDim.x / 32) + warp;
  if (plane_col_block >= p.cols_per_plane) return;  // the last group of a forced warps_per_cta
  DeviceOps ops{reinterpret_cast<float*>(staging_storage) +
                warp * staging_floats_per_warp(Traits::kTile)};
  const int64_t first_program = static_cast<int64_t>(blockIdx.x) * p.chunks_per_cta;
  const varlen::SlotChunk first = locate_chunk(p, first_program, lane, ops);
  packed_conv_programs<Traits, kSilu, kHasBias>(p, first, first_program, cta_program_count(p, blockIdx.x),
                                                blockIdx.z, plane_col_block, lane, ops);
}

template <DType kDType, int kVec>
void launch_instance(const PackedConvParams& p, cudaStream_t stream) {
  using Traits = PackedConvTraits<kDType, kVec>;
  const dim3 grid(static_cast<unsigned>(p.cta_programs),
                  static_cast<unsigned>(p.col_groups_per_plane), static_cast<unsigned>(p.planes));
  const dim3 block(static_cast<unsigned>(p.warps_per_cta * 32));
  const std::size_t staging_bytes =
      static_cast<std::size_t>(p.warps_per_cta) * staging_bytes_per_warp(Traits::kTile);
  const bool has_bias = p.bias != nullptr;
  if (p.silu && has_bias) {
    packed_conv_kernel<Traits, true, true><<<grid, block, staging_bytes, stream>>>(p);
  } else if (p.silu) {
    packed_conv_kernel<Traits, true, false><<<grid, block, staging_bytes, stream>>>(p);
  } else if (has_bias) {
    packed_conv_kernel<Traits, false, true><<<grid, block, staging_bytes, stream>>>(p);
  } else {
    packed_conv_kernel<Traits, false, false><<<grid, block, staging_bytes, stream>>>(p);
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
  // The checks that need no launch shape, then the params of this launch, built once, and the
  // grid check on them (a launch past CUDA's limits would fail silently in a captured graph).
  std::string why;
  if (!args_supported(args, &why)) KDA_FAIL(function, why);
  why = check_tuning_values(args, tuning);
  if (!why.empty()) KDA_FAIL(function, why);
  if (args.num_tokens == 0 || args.varlen.num_seqs == 0) return;
  const PackedConvParams p = make_params(args, tuning);
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
