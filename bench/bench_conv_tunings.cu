// Sweep of the packed conv's launch shapes (kda::conv::launch_packed_conv with a forced
// ConvTuning) against a device copy of the same bytes, at the seed scale (part_dim 1536 x 3,
// in_proj row stride 4864, bf16, fp32 (lines, dim, 3) state, SiLU, no bias). One run shows
// which (vec, chunk_len, warps_per_cta) to make the default.
//
//   bench_conv_tunings [--quick] [--patterns | --walks | --copies | --band-bulk | --block-walks]
//
// For each batch shape it prints the copy time, the default launch, the best tuning and every
// tuning (mean GPU time per launch over back-to-back launches, buffer sets rotated so that
// L2 holds none of them). Every tuning's output and state are compared bitwise with the
// default launch's. Exits 2 without a usable GPU, 1 on a mismatch or an error, else 0.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "conv/conv_params.h"
#include "kda/error.h"
#include "kda/packed_conv.h"

namespace {

constexpr int64_t kPartDim = 1536;
constexpr int64_t kDim = 3 * kPartDim;
constexpr int64_t kRowStride = 4864;
constexpr int64_t kRotateBytes = 256ll << 20;  // > 5 x the H200's 50 MB L2

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#define BENCH_CUDA(expr) cuda_ok((expr), #expr)

struct Shape {
  int64_t tokens, seqs;
};

// One set of device buffers for a shape.
struct BufferSet {
  void* x = nullptr;
  void* out = nullptr;
  float* state = nullptr;
  void* copy_dst = nullptr;
  kda::PackedConvArgs args;
};

struct Batch {
  void* weight = nullptr;
  int32_t* qsl = nullptr;
  int32_t* cache = nullptr;
  bool* flags = nullptr;
  std::vector<BufferSet> sets;
  int64_t tokens = 0, seqs = 0, lines = 0;

  ~Batch() {
    cudaFree(weight);
    cudaFree(qsl);
    cudaFree(cache);
    cudaFree(flags);
    for (auto& s : sets) {
      cudaFree(s.x);
      cudaFree(s.out);
      cudaFree(s.state);
      cudaFree(s.copy_dst);
    }
  }
};

void make_batch(Batch& b, const Shape& shape, std::mt19937_64& rng) {
  b.tokens = shape.tokens;
  b.seqs = shape.seqs;
  b.lines = shape.seqs + 1;  // line 0 is the null line
  std::vector<int32_t> qsl(static_cast<std::size_t>(b.seqs + 1));
  for (int64_t s = 0; s <= b.seqs; ++s) qsl[s] = static_cast<int32_t>(s * b.tokens / b.seqs);
  std::vector<int32_t> cache(static_cast<std::size_t>(b.seqs));
  std::vector<uint8_t> flags(static_cast<std::size_t>(b.seqs));
  for (int64_t s = 0; s < b.seqs; ++s) {
    cache[s] = static_cast<int32_t>(s + 1);
    flags[s] = s % 2;
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> weight(static_cast<std::size_t>(kDim * 4));
  for (auto& w : weight) w = normal(rng) * 0.5f;
  BENCH_CUDA(cudaMalloc(&b.weight, weight.size() * 4));
  BENCH_CUDA(cudaMemcpy(b.weight, weight.data(), weight.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMalloc(&b.qsl, qsl.size() * 4));
  BENCH_CUDA(cudaMemcpy(b.qsl, qsl.data(), qsl.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMalloc(&b.cache, cache.size() * 4));
  BENCH_CUDA(cudaMemcpy(b.cache, cache.data(), cache.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMalloc(&b.flags, flags.size()));
  BENCH_CUDA(cudaMemcpy(b.flags, flags.data(), flags.size(), cudaMemcpyHostToDevice));

  const int64_t x_bytes = b.tokens * kRowStride * 2;
  const int64_t out_bytes = b.tokens * kDim * 2;
  const int64_t state_bytes = b.lines * kDim * 3 * 4;
  const int64_t set_bytes = x_bytes + out_bytes;
  const int64_t num_sets = std::max<int64_t>(1, (kRotateBytes + set_bytes - 1) / set_bytes);
  std::vector<__nv_bfloat16> x(static_cast<std::size_t>(b.tokens * kRowStride));
  for (auto& e : x) e = __float2bfloat16_rn(normal(rng));
  std::vector<float> state(static_cast<std::size_t>(b.lines * kDim * 3));
  for (auto& e : state) e = normal(rng);
  b.sets.resize(static_cast<std::size_t>(num_sets));
  for (auto& s : b.sets) {
    BENCH_CUDA(cudaMalloc(&s.x, x_bytes));
    BENCH_CUDA(cudaMemcpy(s.x, x.data(), x_bytes, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMalloc(&s.out, out_bytes));
    BENCH_CUDA(cudaMalloc(&s.copy_dst, out_bytes));
    BENCH_CUDA(cudaMalloc(&s.state, state_bytes));
    BENCH_CUDA(cudaMemcpy(s.state, state.data(), state_bytes, cudaMemcpyHostToDevice));
    kda::PackedConvArgs& a = s.args;
    a.x = s.x;
    a.x_dtype = kda::DType::BF16;
    a.num_tokens = b.tokens;
    a.dim = kDim;
    a.x_row_stride = kRowStride;
    a.weight = static_cast<const float*>(b.weight);
    a.conv_states = s.state;
    a.num_cache_lines = b.lines;
    a.state_len = 3;
    a.state_stride_line = kDim * 3;
    a.state_stride_dim = 3;
    a.state_stride_tap = 1;
    a.query_start_loc = b.qsl;
    a.num_seqs = b.seqs;
    a.cache_indices = b.cache;
    a.has_initial_state = b.flags;
    a.part_dim = kPartDim;
    a.silu = true;
    a.null_block_id = 0;
    a.out = s.out;
  }
}

// Mean microseconds per call of `launch(set)` over `reps` back-to-back calls, rotating sets.
template <typename Launch>
double time_us(Batch& b, int reps, Launch&& launch) {
  for (auto& s : b.sets) launch(s);  // warm-up
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  BENCH_CUDA(cudaEventRecord(start));
  for (int r = 0; r < reps; ++r) launch(b.sets[static_cast<std::size_t>(r) % b.sets.size()]);
  BENCH_CUDA(cudaEventRecord(stop));
  BENCH_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 1000.0 * ms / reps;
}

std::vector<char> download(const void* p, int64_t bytes) {
  std::vector<char> h(static_cast<std::size_t>(bytes));
  BENCH_CUDA(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost));
  return h;
}

// Output and state of set 0 after one launch from the initial state.
std::pair<std::vector<char>, std::vector<char>> result_of(Batch& b, const std::vector<char>& state0,
                                                          const kda::conv::ConvTuning& t) {
  BufferSet& s = b.sets[0];
  BENCH_CUDA(cudaMemcpy(s.state, state0.data(), state0.size(), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemset(s.out, 0xFF, b.tokens * kDim * 2));
  kda::conv::launch_packed_conv(s.args, t, nullptr);
  BENCH_CUDA(cudaDeviceSynchronize());
  return {download(s.out, b.tokens * kDim * 2), download(s.state, state0.size())};
}

// --patterns: copies with the packed kernel's access pattern and no arithmetic, to tell how much
// of the gap to a flat copy is the pattern itself. A warp moves 16-row programs of a 32-lane x
// kLaneBytes column band of one plane (the packed kernel's default tile: 128 bf16 channels,
// 4 warps a CTA), optionally also reading the 3 rows before its chunk (the seed rows), with
// default or streaming cache hints. Grid (tokens / 16, column groups, 3 planes). kFlat: the
// same programs on a flat layout instead (rows kDim apart in and out, one output matrix), to
// tell the layout's cost (strided rows, three planes) from the programs' shape.
template <int kSeeds, int kLaneBytes, bool kStreamStore, bool kNoAllocLoad, bool kFlat = false>
__global__ void __launch_bounds__(128) pattern_copy_kernel(const char* x, char* out, int64_t tokens) {
  constexpr int64_t kInStride = kFlat ? kDim : kRowStride;
  using V = typename std::conditional<kLaneBytes == 8, uint2, uint4>::type;
  constexpr int kRows = 16;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int64_t col = (static_cast<int64_t>(blockIdx.y) * (blockDim.x / 32) + warp) * (32 * kLaneBytes / 2) +
                      lane * (kLaneBytes / 2);
  if (col >= kPartDim) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const char* src = x + (blockIdx.z * kPartDim + col) * 2;
  const int64_t plane_begin = kFlat ? blockIdx.z * kPartDim : blockIdx.z * tokens * kPartDim;  // in elements
  char* dst = out + (plane_begin + col) * 2;
  constexpr int64_t kOutStride = kFlat ? kDim : kPartDim;
  auto load = [&](int64_t row) {
    const V* p = reinterpret_cast<const V*>(src + row * kInStride * 2);
    V v;
    if constexpr (kNoAllocLoad && kLaneBytes == 8) {
      asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    } else if constexpr (kNoAllocLoad) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else {
      v = __ldg(p);
    }
    return v;
  };
  V seed{};
  for (int i = 0; i < kSeeds; ++i) {
    if (t0 - 1 - i >= 0) {
      const V v = load(t0 - 1 - i);
      seed.x ^= v.x;
      seed.y ^= v.y;
    }
  }
  V q[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) q[i] = load(t0 + i);
  q[0].x ^= seed.x;
  q[0].y ^= seed.y;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    V* p = reinterpret_cast<V*>(dst + (t0 + i) * kOutStride * 2);
    if constexpr (kStreamStore) {
      __stcs(p, q[i]);
    } else {
      *p = q[i];
    }
  }
}

template <int kSeeds, int kLaneBytes, bool kStreamStore, bool kNoAllocLoad, bool kFlat = false>
void launch_pattern(const BufferSet& s, int64_t tokens) {
  constexpr int kWarps = kLaneBytes == 8 ? 4 : 2;
  const int64_t cols = kPartDim / (32 * kLaneBytes / 2);  // column blocks per plane
  const dim3 grid(static_cast<unsigned>(tokens / 16), static_cast<unsigned>((cols + kWarps - 1) / kWarps), 3);
  pattern_copy_kernel<kSeeds, kLaneBytes, kStreamStore, kNoAllocLoad, kFlat>
      <<<grid, kWarps * 32>>>(static_cast<const char*>(s.x), static_cast<char*>(s.copy_dst), tokens);
}

// The band pattern walked by long-lived warps: each warp moves kChunks consecutive 16-row
// chunks of its band (no seed rows: a conv warp walking consecutive chunks carries its history)
// and, with kPipelined, issues the next chunk's 16 loads before it stores the current chunk
// (two register buffers), so its loads never wait for its stores. Grid (ceil(tokens / (16 *
// kChunks)), column groups, 3 planes). The question: does a walk whose loads stay in flight
// come closer to the flat copy than one-shot programs?
template <int kChunks, bool kPipelined>
__global__ void __launch_bounds__(128) walk_copy_kernel(const char* x, char* out, int64_t tokens) {
  constexpr int kRows = 16;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int64_t col = (static_cast<int64_t>(blockIdx.y) * 4 + warp) * 128 + lane * 4;
  if (col >= kPartDim) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRows * kChunks;
  const int chunks = static_cast<int>(std::min<int64_t>(kChunks, (tokens - t0) / kRows));
  const char* src = x + (blockIdx.z * kPartDim + col) * 2 + t0 * kRowStride * 2;
  char* dst = out + (blockIdx.z * tokens * kPartDim + col) * 2 + t0 * kPartDim * 2;
  uint2 a[kRows], b[kRows];
  const auto load = [&](uint2 (&q)[kRows], int c) {
#pragma unroll
    for (int i = 0; i < kRows; ++i)
      q[i] = __ldg(reinterpret_cast<const uint2*>(src + (static_cast<int64_t>(c) * kRows + i) * kRowStride * 2));
  };
  const auto store = [&](const uint2 (&q)[kRows], int c) {
#pragma unroll
    for (int i = 0; i < kRows; ++i)
      __stcs(reinterpret_cast<uint2*>(dst + (static_cast<int64_t>(c) * kRows + i) * kPartDim * 2), q[i]);
  };
  if constexpr (kPipelined) {
    if (chunks > 0) load(a, 0);
    for (int c = 0; c < chunks; c += 2) {
      if (c + 1 < chunks) load(b, c + 1);
      store(a, c);
      if (c + 1 >= chunks) break;
      if (c + 2 < chunks) load(a, c + 2);
      store(b, c + 1);
    }
  } else {
    for (int c = 0; c < chunks; ++c) {
      load(a, c);
      store(a, c);
    }
  }
}

template <int kChunks, bool kPipelined>
void launch_walk(const BufferSet& s, int64_t tokens) {
  const int64_t rows = 16 * kChunks;
  const dim3 grid(static_cast<unsigned>((tokens + rows - 1) / rows), static_cast<unsigned>(kPartDim / 512), 3);
  walk_copy_kernel<kChunks, kPipelined><<<grid, 128>>>(static_cast<const char*>(s.x), static_cast<char*>(s.copy_dst), tokens);
}

// --copies: is the flat cudaMemcpy itself the floor? Copy kernels of our own over the same
// bytes, in two families. Flat: the bytes of a dense (tokens, dim) matrix, each thread moving
// kUnroll lanes of kLaneBytes (a CTA's lanes are consecutive, all its loads issued before its
// stores), one-shot CTAs of 256 threads, or kGridStride CTAs (8 per SM) looping over the bytes.
// Row blocks: the packed kernel's real layout (in_proj rows kRowStride apart, three planes out),
// a CTA moving kRows consecutive rows of kPlanes whole plane rows (1536 channels, 3 KB each)
// with one kLaneBytes lane per thread, so each warp reads and writes 512 contiguous bytes (16-byte
// lanes) and a CTA of 3 planes reads whole 9 KB rows. The question: does any structure beat the
// driver's copy, and does a row-block structure beat the packed kernel's 256-byte band (the
// pattern tables' 1.05-1.08)?
template <int kUnroll, int kLaneBytes, bool kGridStride>
__global__ void __launch_bounds__(256) flat_copy_kernel(const char* src, char* dst, int64_t bytes) {
  using V = typename std::conditional<kLaneBytes == 8, uint2, uint4>::type;
  const int64_t lanes = bytes / kLaneBytes;
  const V* in = reinterpret_cast<const V*>(src);
  V* out = reinterpret_cast<V*>(dst);
  const int64_t step = static_cast<int64_t>(kGridStride ? gridDim.x : 1) * 256 * kUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * 256 * kUnroll + threadIdx.x; base < lanes;
       base += step) {
    V v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      if (base + j * 256 < lanes) v[j] = __ldg(in + base + j * 256);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j)
      if (base + j * 256 < lanes) __stcs(out + base + j * 256, v[j]);
    if constexpr (!kGridStride) break;
  }
}

template <int kUnroll, int kLaneBytes, bool kGridStride>
void launch_flat_copy(const BufferSet& s, int64_t tokens) {
  const int64_t bytes = tokens * kDim * 2;
  int sms = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t per_cta = 256ll * kUnroll * kLaneBytes;
  const int64_t ctas = kGridStride ? 8ll * sms : (bytes + per_cta - 1) / per_cta;
  flat_copy_kernel<kUnroll, kLaneBytes, kGridStride>
      <<<static_cast<unsigned>(ctas), 256>>>(static_cast<const char*>(s.x), static_cast<char*>(s.copy_dst), bytes);
}

template <int kRows, int kLaneBytes, int kPlanes>
__global__ void __launch_bounds__(kPlanes * kPartDim * 2 / kLaneBytes)
row_block_copy_kernel(const char* x, char* out, int64_t tokens) {
  using V = typename std::conditional<kLaneBytes == 8, uint2, uint4>::type;
  constexpr int kThreadsPerPlane = kPartDim * 2 / kLaneBytes;
  const int plane = static_cast<int>(blockIdx.y) * kPlanes + static_cast<int>(threadIdx.x) / kThreadsPerPlane;
  const int64_t col_byte = static_cast<int64_t>(threadIdx.x % kThreadsPerPlane) * kLaneBytes;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const char* src = x + (t0 * kRowStride + plane * kPartDim) * 2 + col_byte;
  char* dst = out + (plane * tokens + t0) * kPartDim * 2 + col_byte;
  V q[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) q[i] = __ldg(reinterpret_cast<const V*>(src + i * kRowStride * 2));
#pragma unroll
  for (int i = 0; i < kRows; ++i) __stcs(reinterpret_cast<V*>(dst + i * kPartDim * 2), q[i]);
}

template <int kRows, int kLaneBytes, int kPlanes>
void launch_row_block_copy(const BufferSet& s, int64_t tokens) {
  const dim3 grid(static_cast<unsigned>(tokens / kRows), static_cast<unsigned>(3 / kPlanes));
  row_block_copy_kernel<kRows, kLaneBytes, kPlanes><<<grid, kPlanes * kPartDim * 2 / kLaneBytes>>>(
      static_cast<const char*>(s.x), static_cast<char*>(s.copy_dst), tokens);
}

// The two references of a pattern table: a flat copy of the bytes the kernel moves, and the
// packed kernel's default launch.
std::pair<double, double> flat_and_packed_us(Batch& b, int reps) {
  const int64_t t = b.tokens;
  const double flat = time_us(b, reps, [&](BufferSet& s) {
    BENCH_CUDA(cudaMemcpyAsync(s.copy_dst, s.x, static_cast<std::size_t>(t * kDim * 2), cudaMemcpyDeviceToDevice));
  });
  const double packed = time_us(b, reps, [&](BufferSet& s) { kda::packed_causal_conv1d(s.args, nullptr); });
  return {flat, packed};
}

// Lets kKernel launch with up to `bytes` of dynamic shared memory. The attribute is set by the
// first call only: each launcher passes one constant per kernel instance.
template <auto kKernel>
void allow_dynamic_smem(int bytes) {
  static const bool done = [bytes] {
    BENCH_CUDA(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return true;
  }();
  (void)done;
}

// The most dynamic shared memory one CTA may ask for on the H200 (227 KiB).
constexpr int kMaxSmemPerCta = 227 * 1024;

// The dynamic shared memory per CTA that lets at most `ctas` CTAs share an SM (the shared memory
// of an SM split `ctas` ways, less the per-CTA reservation), and at least `need` bytes. `ctas` 0:
// `need` itself, the kernel's natural occupancy.
int smem_for_ctas_per_sm(int ctas, int need) {
  if (ctas == 0) return need;
  static const std::pair<int, int> sm = [] {
    int per_sm = 0, reserved = 0;
    BENCH_CUDA(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    BENCH_CUDA(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, 0));
    return std::make_pair(per_sm, reserved);
  }();
  // More than what n + 1 CTAs could each get, so at most n fit; no more than what n can each get.
  const int bytes = (sm.first / ctas - sm.second) / 128 * 128;
  return std::max(bytes, need);
}

// Prints (once per kKernel and smem) how many CTAs of kKernel share an SM at `threads` threads
// and `smem` bytes, by the occupancy calculator, so that each column's occupancy in a table is a
// measured fact, not an intent. `what` names the variant.
template <auto kKernel>
void report_occupancy(const std::string& what, int threads, int smem) {
  static std::vector<int> reported;
  if (std::find(reported.begin(), reported.end(), smem) != reported.end()) return;
  reported.push_back(smem);
  int n = 0;
  BENCH_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, threads, smem));
  std::fprintf(stderr, "%s, %d B shared: %d CTAs per SM\n", what.c_str(), smem, n);
}

// The same copy through a ring of shared-memory stages filled by bulk copies (cp.async.bulk, one
// per row, completing on the stage's mbarrier): one producer warp keeps up to kStages stages of
// kStageRows rows in flight while 4 consumer warps read their 8 bytes per lane of each row from
// shared memory and store them as the packed kernel does. A CTA moves rows_per_cta rows of a
// 512-channel (1 KB) band of one plane and, like a packed-kernel walk, first reads the 3 rows
// before them (seed rows, direct loads). The question it answers: how close to the flat copy a
// row stream gets when its loads never wait for the arithmetic. Grid (tokens / rows_per_cta,
// part_dim / 512, 3 planes).
constexpr int kRingConsumers = 4;
constexpr int kRingRowBytes = kRingConsumers * 32 * 8;  // 512 bf16 channels

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int kStages, int kStageRows, int kSeeds>
__global__ void __launch_bounds__(32 * (kRingConsumers + 1))
ring_copy_kernel(const char* x, char* out, int64_t tokens, int rows_per_cta) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * (kRingRowBytes / 2);
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * rows_per_cta;
  const int stages = rows_per_cta / kStageRows;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(&empty[s])), "r"(kRingConsumers));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const auto wait = [](uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n .reg .pred done;\n RING_WAIT:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra RING_WAIT;\n}" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
  };
  if (warp == kRingConsumers) {  // the producer
    if (lane != 0) return;
    const char* src = x + (blockIdx.z * kPartDim + col0) * 2 + t0 * kRowStride * 2;
    for (int i = 0; i < stages; ++i) {
      const int s = i % kStages;
      if (i >= kStages) wait(&empty[s], static_cast<uint32_t>((i / kStages - 1) & 1));
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&full[s])),
                   "r"(kStageRows * kRingRowBytes) : "memory");
      for (int r = 0; r < kStageRows; ++r) {
        const char* row = src + static_cast<int64_t>(i * kStageRows + r) * kRowStride * 2;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem_u32(ring + (s * kStageRows + r) * kRingRowBytes)), "l"(row),
                     "r"(kRingRowBytes), "r"(smem_u32(&full[s])) : "memory");
      }
    }
    return;
  }
  const int64_t lane_col = col0 + warp * 128 + lane * 4;
  uint2 seed{0u, 0u};
  for (int i = 0; i < kSeeds; ++i) {
    if (t0 - 1 - i >= 0) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(x + ((t0 - 1 - i) * kRowStride + blockIdx.z * kPartDim + lane_col) * 2));
      seed.x ^= v.x;
      seed.y ^= v.y;
    }
  }
  char* dst = out + (blockIdx.z * tokens * kPartDim + t0 * kPartDim + lane_col) * 2;
  for (int i = 0; i < stages; ++i) {
    const int s = i % kStages;
    wait(&full[s], static_cast<uint32_t>((i / kStages) & 1));
    uint2 v[kStageRows];
#pragma unroll
    for (int r = 0; r < kStageRows; ++r)
      v[r] = *reinterpret_cast<const uint2*>(ring + (s * kStageRows + r) * kRingRowBytes + warp * 256 + lane * 8);
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(&empty[s])) : "memory");
    if (i == 0) {
      v[0].x ^= seed.x;
      v[0].y ^= seed.y;
    }
#pragma unroll
    for (int r = 0; r < kStageRows; ++r)
      *reinterpret_cast<uint2*>(dst + static_cast<int64_t>(i * kStageRows + r) * kPartDim * 2) = v[r];
  }
#endif
}

template <int kStages, int kStageRows, int kSeeds>
void launch_ring(const BufferSet& s, int64_t tokens, int rows_per_cta) {
  const int smem = kStages * kStageRows * kRingRowBytes;
  allow_dynamic_smem<ring_copy_kernel<kStages, kStageRows, kSeeds>>(smem);
  const dim3 grid(static_cast<unsigned>(tokens / rows_per_cta), static_cast<unsigned>(kPartDim * 2 / kRingRowBytes), 3);
  ring_copy_kernel<kStages, kStageRows, kSeeds><<<grid, 32 * (kRingConsumers + 1), smem>>>(
      static_cast<const char*>(s.x), static_cast<char*>(s.copy_dst), tokens, rows_per_cta);
}

// Bulk-copy (TMA engine) forms of the same copies, to tell whether the driver's copy wins by
// moving bytes without the SMs' load/store path. Flat: one lane of a one-warp CTA moves
// kPieces pieces of 16 KB through shared memory (cp.async.bulk in, complete on an mbarrier, then
// cp.async.bulk out). Row blocks: kRows rows of kPlanes plane rows (3 KB each) loaded by
// per-plane-row bulk copies into a plane-major tile, each plane's kRows x 3 KB stored by one
// bulk copy (its output rows are contiguous). kRegLoads: the rows come in by the threads' own
// 16-byte loads instead and are written to the tile (the packed kernel's results would be),
// then the same bulk stores: does the store path alone separate our copies from the driver's?
__device__ __forceinline__ void bulk_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n BULK_WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra BULK_WAIT;\n}" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(smem)), "l"(gmem), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void bulk_store(void* gmem, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               ::"l"(gmem), "r"(smem_u32(smem)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_store_drain() {
  asm volatile("cp.async.bulk.commit_group;\n cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// Each thread's kRows rows of x (kRowStride elements apart from src) into registers, every load
// issued before any store, then into the shared tile at tile_lane + i * tile_pitch, made visible
// to the bulk-copy engine (the async proxy). The register-load copies below stage through it.
template <int kRows, typename V>
__device__ __forceinline__ void rows_to_tile(const char* src, char* tile_lane, int tile_pitch) {
  V q[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) q[i] = __ldg(reinterpret_cast<const V*>(src + i * kRowStride * 2));
#pragma unroll
  for (int i = 0; i < kRows; ++i) *reinterpret_cast<V*>(tile_lane + i * tile_pitch) = q[i];
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

constexpr int kBulkPiece = 16384;

template <int kPieces>
__global__ void __launch_bounds__(32) flat_bulk_copy_kernel(const char* src, char* dst, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) char tile[];
  __shared__ __align__(8) uint64_t bar;
  if (threadIdx.x != 0) return;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kPieces * kBulkPiece;
  const uint32_t total = static_cast<uint32_t>(std::min<int64_t>(kPieces * kBulkPiece, bytes - begin));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&bar)), "r"(total) : "memory");
  for (uint32_t off = 0; off < total; off += kBulkPiece)
    bulk_load(tile + off, src + begin + off, std::min<uint32_t>(kBulkPiece, total - off), &bar);
  bulk_wait(&bar, 0);
  for (uint32_t off = 0; off < total; off += kBulkPiece)
    bulk_store(dst + begin + off, tile + off, std::min<uint32_t>(kBulkPiece, total - off));
  bulk_store_drain();
#endif
}

template <int kPieces>
void launch_flat_bulk_copy(const BufferSet& s, int64_t tokens) {
  const int64_t bytes = tokens * kDim * 2;
  const int smem = kPieces * kBulkPiece;
  allow_dynamic_smem<flat_bulk_copy_kernel<kPieces>>(smem);
  const int64_t per_cta = static_cast<int64_t>(kPieces) * kBulkPiece;
  flat_bulk_copy_kernel<kPieces><<<static_cast<unsigned>((bytes + per_cta - 1) / per_cta), 32, smem>>>(
      static_cast<const char*>(s.x), static_cast<char*>(s.copy_dst), bytes);
}

constexpr int kPlaneRowBytes = kPartDim * 2;

template <int kRows, int kPlanes, bool kRegLoads>
__global__ void __launch_bounds__(kRegLoads ? kPlanes * kPlaneRowBytes / 16 : 32)
row_block_bulk_kernel(const char* x, char* out, int64_t tokens) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) char tile[];  // [plane][row][3 KB]
  __shared__ __align__(8) uint64_t bar;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int plane0 = static_cast<int>(blockIdx.y) * kPlanes;
  if constexpr (kRegLoads) {
    constexpr int kThreadsPerPlane = kPlaneRowBytes / 16;
    const int p = static_cast<int>(threadIdx.x) / kThreadsPerPlane;
    const int col_byte = (static_cast<int>(threadIdx.x) % kThreadsPerPlane) * 16;
    const char* src = x + (t0 * kRowStride + (plane0 + p) * kPartDim) * 2 + col_byte;
    rows_to_tile<kRows, uint4>(src, tile + p * kRows * kPlaneRowBytes + col_byte, kPlaneRowBytes);
    __syncthreads();
    if (threadIdx.x != 0) return;
  } else {
    if (threadIdx.x != 0) return;
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&bar)),
                 "r"(kPlanes * kRows * kPlaneRowBytes) : "memory");
    for (int p = 0; p < kPlanes; ++p)
      for (int i = 0; i < kRows; ++i)
        bulk_load(tile + (p * kRows + i) * kPlaneRowBytes, x + ((t0 + i) * kRowStride + (plane0 + p) * kPartDim) * 2,
                  kPlaneRowBytes, &bar);
    bulk_wait(&bar, 0);
  }
  for (int p = 0; p < kPlanes; ++p)
    bulk_store(out + ((plane0 + p) * tokens + t0) * kPartDim * 2, tile + p * kRows * kPlaneRowBytes,
               kRows * kPlaneRowBytes);
  bulk_store_drain();
#endif
}

template <int kRows, int kPlanes, bool kRegLoads>
void launch_row_block_bulk(const BufferSet& s, int64_t tokens) {
  const int smem = kPlanes * kRows * kPlaneRowBytes;
  allow_dynamic_smem<row_block_bulk_kernel<kRows, kPlanes, kRegLoads>>(smem);
  const dim3 grid(static_cast<unsigned>(tokens / kRows), static_cast<unsigned>(3 / kPlanes));
  row_block_bulk_kernel<kRows, kPlanes, kRegLoads><<<grid, kRegLoads ? kPlanes * kPlaneRowBytes / 16 : 32, smem>>>(
      static_cast<const char*>(s.x), static_cast<char*>(s.copy_dst), tokens);
}

// Which part of the row-block bulk copy's gain would a conv keep? The band pattern's register
// loads with its results staged in shared memory and written by bulk copies: per warp (each
// warp's 32 x kLaneBytes band, one bulk store per row), per CTA (the CTA's band, one store per
// row, after a barrier) or, when the CTA spans the whole plane row, one store of all kRows rows
// (they are contiguous in the plane). Grid (tokens / kRows, column groups, 3 planes).
enum class BulkScope { kWarpRows, kCtaRows, kCtaBlock };

template <int kRows, int kLaneBytes, int kWarps, BulkScope kScope>
__global__ void __launch_bounds__(kWarps * 32) band_bulk_kernel(const char* x, char* out, int64_t tokens) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using V = typename std::conditional<kLaneBytes == 8, uint2, uint4>::type;
  constexpr int kWarpBand = 32 * kLaneBytes, kCtaBand = kWarps * kWarpBand;
  static_assert(kScope != BulkScope::kCtaBlock || kCtaBand == kPlaneRowBytes, "one block: whole plane rows");
  extern __shared__ __align__(128) char tile[];  // [kRows][kCtaBand]
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int64_t band_byte = static_cast<int64_t>(blockIdx.y) * kCtaBand;  // in the plane row
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const char* src = x + (t0 * kRowStride + blockIdx.z * kPartDim) * 2 + band_byte + warp * kWarpBand + lane * kLaneBytes;
  char* dst = out + (blockIdx.z * tokens + t0) * kPlaneRowBytes + band_byte;
  rows_to_tile<kRows, V>(src, tile + warp * kWarpBand + lane * kLaneBytes, kCtaBand);
  if constexpr (kScope == BulkScope::kWarpRows) {
    __syncwarp();
    if (lane != 0) return;
    for (int i = 0; i < kRows; ++i)
      bulk_store(dst + i * kPlaneRowBytes + warp * kWarpBand, tile + i * kCtaBand + warp * kWarpBand, kWarpBand);
  } else {
    __syncthreads();
    if (threadIdx.x != 0) return;
    if constexpr (kScope == BulkScope::kCtaRows) {
      for (int i = 0; i < kRows; ++i) bulk_store(dst + i * kPlaneRowBytes, tile + i * kCtaBand, kCtaBand);
    } else {
      bulk_store(dst, tile, kRows * kCtaBand);
    }
  }
  bulk_store_drain();
#endif
}

// kCtasPerSm: the launch asks for enough shared memory that at most that many CTAs share an SM
// (0: the tile's own need). 1 is what the block-store conv's 141 KiB gave it (12 warps' staging
// areas and two 48 KiB result buffers): does the one-block write keep its gain at that occupancy?
template <int kRows, int kLaneBytes, int kWarps, BulkScope kScope, int kCtasPerSm = 0>
void launch_band_bulk(const BufferSet& s, int64_t tokens) {
  constexpr int kCtaBand = kWarps * 32 * kLaneBytes;
  constexpr auto kernel = band_bulk_kernel<kRows, kLaneBytes, kWarps, kScope>;
  const int smem = smem_for_ctas_per_sm(kCtasPerSm, kRows * kCtaBand);
  // The most any launch of this kernel asks for (the launchers of every kCtasPerSm share it).
  allow_dynamic_smem<kernel>(kMaxSmemPerCta);
  if (kCtasPerSm != 0) report_occupancy<kernel>("one block " + std::to_string(kRows) + " rows", kWarps * 32, smem);
  const dim3 grid(static_cast<unsigned>(tokens / kRows), static_cast<unsigned>(kPlaneRowBytes / kCtaBand), 3);
  kernel<<<grid, kWarps * 32, smem>>>(static_cast<const char*>(s.x), static_cast<char*>(s.copy_dst), tokens);
}

// --block-walks: does the one-block write keep its gain with the occupancy and the walk a conv
// of whole-plane-row CTAs could have? A conv CTA holding taps, history and a row queue for 12
// warps gets 2 or 3 CTAs per SM, not the 5 of the copy that gained (session 10), and it walks
// several consecutive chunks, carrying its history. So: the one-shot block copy held to n CTAs
// per SM by its shared-memory request, and block walks. A walk CTA moves kChunks consecutive
// chunks of kRows rows of one plane (12 warps, 8-byte lanes: the whole 3 KB plane row), each
// chunk through one of two shared-memory buffers and out by one bulk copy. One barrier per
// chunk: thread 0 waits until the previous chunk's bulk copy has read its buffer before the
// barrier, so after it the other buffer (that copy's) is free for the next chunk. kPipelined:
// the next chunk's loads are issued before this chunk's rows go into the buffer (two register
// sets, as a conv would need to overlap its loads with its arithmetic).
constexpr int kBlockWarps = kPlaneRowBytes / 256;  // 12 warps of 8-byte lanes span a plane row

template <int kRows, int kChunks, bool kPipelined>
__global__ void __launch_bounds__(kBlockWarps * 32) block_walk_kernel(const char* x, char* out, int64_t tokens) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) char tile[];  // [2][kRows][kPlaneRowBytes]
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRows * kChunks;
  const char* src = x + (t0 * kRowStride + blockIdx.y * kPartDim) * 2 + threadIdx.x * 8;
  char* dst = out + (blockIdx.y * tokens + t0) * kPlaneRowBytes;
  constexpr int64_t kChunkIn = kRows * kRowStride * 2, kChunkOut = kRows * kPlaneRowBytes;
  // Chunk j's rows of this thread's 8 bytes into rows.
  const auto load_chunk = [&](uint2 (&rows)[kRows], int j) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) rows[i] = __ldg(reinterpret_cast<const uint2*>(src + j * kChunkIn + i * kRowStride * 2));
  };
  uint2 q[kRows], next[kRows];
  load_chunk(q, 0);
  for (int j = 0; j < kChunks; ++j) {
    if constexpr (kPipelined) {
      if (j + 1 < kChunks) load_chunk(next, j + 1);
    }
    char* buf = tile + (j & 1) * kChunkOut;
#pragma unroll
    for (int i = 0; i < kRows; ++i) *reinterpret_cast<uint2*>(buf + i * kPlaneRowBytes + threadIdx.x * 8) = q[i];
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
      bulk_store(dst + j * kChunkOut, buf, kChunkOut);
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    if (j + 1 < kChunks) {
      if constexpr (kPipelined) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) q[i] = next[i];
      } else {
        load_chunk(q, j + 1);
      }
    }
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}

template <int kRows, int kChunks, bool kPipelined>
void launch_block_walk(const BufferSet& s, int64_t tokens, int ctas_per_sm) {
  constexpr auto kernel = block_walk_kernel<kRows, kChunks, kPipelined>;
  const int smem = smem_for_ctas_per_sm(ctas_per_sm, 2 * kRows * kPlaneRowBytes);
  allow_dynamic_smem<kernel>(kMaxSmemPerCta);
  report_occupancy<kernel>("block walk " + std::to_string(kRows) + " rows x " + std::to_string(kChunks) + " chunks" +
                               (kPipelined ? " pipelined" : ""),
                           kBlockWarps * 32, smem);
  const dim3 grid(static_cast<unsigned>(tokens / (kRows * kChunks)), 3);
  kernel<<<grid, kBlockWarps * 32, smem>>>(static_cast<const char*>(s.x), static_cast<char*>(s.copy_dst), tokens);
}

// The band pattern with its results written by one TMA tensor store per CTA: the planes seen as
// a 3D tensor (256 channels, part_dim / 256 halves of 512 bytes, 3 x tokens rows), the CTA's
// kWarps x 128-channel band of kRows rows one box of (256, kWarps / 2, kRows), staged in shared
// memory in the box's own layout. The question: does a strided 2D block written by the TMA
// engine keep the gain of one contiguous bulk block, with the band's small CTAs?
template <int kRows, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
band_tma_kernel(const char* x, const __grid_constant__ CUtensorMap out_map, int64_t tokens) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kCtaBand = kWarps * 256;  // bytes: 128 bf16 channels a warp
  extern __shared__ __align__(128) char tile[];  // [kRows][kCtaBand]
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const char* src = x + (t0 * kRowStride + blockIdx.z * kPartDim) * 2 + blockIdx.y * kCtaBand + warp * 256 + lane * 8;
  rows_to_tile<kRows, uint2>(src, tile + warp * 256 + lane * 8, kCtaBand);
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int c1 = static_cast<int>(blockIdx.y) * (kWarps / 2);
  const int c2 = static_cast<int>(blockIdx.z * tokens + t0);
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
      "cp.async.bulk.commit_group;\n cp.async.bulk.wait_group.read 0;" ::"l"(&out_map),
      "r"(0), "r"(c1), "r"(c2), "r"(smem_u32(tile)) : "memory");
#endif
}

// The output planes as the 3D tensor of band_tma_kernel, boxes of (256, halves, rows).
CUtensorMap plane_tensor_map(void* out, int64_t tokens, int halves, int rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    BENCH_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    if (fn == nullptr || q != cudaDriverEntryPointSuccess) throw std::runtime_error("no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map{};
  const cuuint64_t dims[3] = {256, static_cast<cuuint64_t>(kPartDim / 256), static_cast<cuuint64_t>(3 * tokens)};
  const cuuint64_t strides[2] = {512, static_cast<cuuint64_t>(kPlaneRowBytes)};
  const cuuint32_t box[3] = {256, static_cast<cuuint32_t>(halves), static_cast<cuuint32_t>(rows)};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, out, dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw std::runtime_error("cuTensorMapEncodeTiled failed: " + std::to_string(r));
  return map;
}

template <int kRows, int kWarps>
void launch_band_tma(const BufferSet& s, int64_t tokens) {
  static_assert(kWarps % 2 == 0, "whole 256-channel halves");
  constexpr int smem = kRows * kWarps * 256;
  allow_dynamic_smem<band_tma_kernel<kRows, kWarps>>(smem);
  // One map per output buffer and shape, encoded once (host work stays out of the timing).
  static std::map<std::pair<void*, int64_t>, CUtensorMap> maps;
  auto it = maps.find({s.copy_dst, tokens});
  if (it == maps.end()) it = maps.emplace(std::make_pair(s.copy_dst, tokens), plane_tensor_map(s.copy_dst, tokens, kWarps / 2, kRows)).first;
  const dim3 grid(static_cast<unsigned>(tokens / kRows), static_cast<unsigned>(kPlaneRowBytes / (kWarps * 256)), 3);
  band_tma_kernel<kRows, kWarps><<<grid, kWarps * 32, smem>>>(static_cast<const char*>(s.x), it->second, tokens);
}

// Bitwise check of a pattern copy (seed rows off) against the rows it copies: plane p of out
// row r is x row r's columns p * part_dim ... (p + 1) * part_dim - 1; or, for a flat copy, out
// is x's first tokens x dim elements.
template <typename Launch>
bool copies_exactly(Batch& b, Launch&& launch, bool flat = false) {
  BufferSet& s = b.sets[0];
  const int64_t t = b.tokens;
  BENCH_CUDA(cudaMemset(s.copy_dst, 0xFF, static_cast<std::size_t>(t * kDim * 2)));
  launch(s, t);
  BENCH_CUDA(cudaDeviceSynchronize());
  const std::vector<char> got = download(s.copy_dst, t * kDim * 2);
  std::vector<char> xs = download(s.x, t * kRowStride * 2);
  if (flat) return std::memcmp(got.data(), xs.data(), got.size()) == 0;
  for (int64_t r = 0; r < t; ++r)
    for (int64_t plane = 0; plane < 3; ++plane)
      if (std::memcmp(&got[static_cast<std::size_t>((plane * t + r) * kPartDim * 2)],
                      &xs[static_cast<std::size_t>((r * kRowStride + plane * kPartDim) * 2)], kPartDim * 2) != 0)
        return false;
  return true;
}

using PatternLaunch = std::function<void(BufferSet&, int64_t)>;

// One table of pattern copies: per shape the flat copy, the packed kernel's default launch and
// each variant (us, and the ratio to the flat copy), then whether every launch of `checked`
// (plane layout) and of `flat_checked` (flat copies) copies exactly.
void run_pattern_table(const std::vector<Shape>& shapes, std::mt19937_64& rng, int reps, const char* columns,
                       const std::vector<PatternLaunch>& variants, const std::vector<PatternLaunch>& checked,
                       const std::vector<PatternLaunch>& flat_checked = {}) {
  std::printf("\n| tokens x seqs | flat copy us | packed (default) | %s | exact |\n", columns);
  std::printf("| --- | --- | ---");
  for (std::size_t i = 0; i <= variants.size(); ++i) std::printf(" | ---");
  std::printf(" |\n");
  for (const Shape& shape : shapes) {
    Batch b;
    make_batch(b, shape, rng);
    const int64_t t = b.tokens;
    const auto [flat, packed] = flat_and_packed_us(b, reps);
    std::vector<double> us;
    for (const PatternLaunch& v : variants) us.push_back(time_us(b, reps, [&](BufferSet& s) { v(s, t); }));
    BENCH_CUDA(cudaGetLastError());
    bool exact = true;
    for (const PatternLaunch& c : checked) exact = exact && copies_exactly(b, c);
    for (const PatternLaunch& c : flat_checked) exact = exact && copies_exactly(b, c, true);
    std::printf("| %lld x %lld | %.1f | %.1f (%.3f)", static_cast<long long>(t), static_cast<long long>(shape.seqs),
                flat, packed, packed / flat);
    for (double u : us) std::printf(" | %.1f (%.3f)", u, u / flat);
    std::printf(" | %s |\n", exact ? "yes" : "NO");
    std::fflush(stdout);
  }
}

void run_ring_patterns(const std::vector<Shape>& shapes, std::mt19937_64& rng, int reps) {
  run_pattern_table(shapes, rng, reps,
                    "ring 4x8 rows, 32 per CTA | 4x8, 64 | 4x8, 128 | 4x8, 256 | 4x16, 128 | 2x16, 32 | 8x8, 256 "
                    "| 4x8, 64, no seeds",
                    {[](BufferSet& s, int64_t t) { launch_ring<4, 8, 3>(s, t, 32); },
                     [](BufferSet& s, int64_t t) { launch_ring<4, 8, 3>(s, t, 64); },
                     [](BufferSet& s, int64_t t) { launch_ring<4, 8, 3>(s, t, 128); },
                     [](BufferSet& s, int64_t t) { launch_ring<4, 8, 3>(s, t, 256); },
                     [](BufferSet& s, int64_t t) { launch_ring<4, 16, 3>(s, t, 128); },
                     [](BufferSet& s, int64_t t) { launch_ring<2, 16, 3>(s, t, 32); },
                     [](BufferSet& s, int64_t t) { launch_ring<8, 8, 3>(s, t, 256); },
                     [](BufferSet& s, int64_t t) { launch_ring<4, 8, 0>(s, t, 64); }},
                    {[](BufferSet& s, int64_t t) { launch_ring<4, 8, 0>(s, t, 64); }});
}

// Walks read no seed rows, so each copies its rows unchanged; the table checks the pipelined
// 4-chunk walk.
void run_walk_patterns(const std::vector<Shape>& shapes, std::mt19937_64& rng, int reps) {
  run_pattern_table(shapes, rng, reps, "walk 2 chunks | 4 | 8 | 16 | pipelined 2 | 4 | 8 | 16 | 32",
                    {[](BufferSet& s, int64_t t) { launch_walk<2, false>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_walk<4, false>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_walk<8, false>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_walk<16, false>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_walk<2, true>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_walk<4, true>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_walk<8, true>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_walk<16, true>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_walk<32, true>(s, t); }},
                    {[](BufferSet& s, int64_t t) { launch_walk<4, true>(s, t); }});
}

// The pattern table checks the plain 16-row programs (no seeds: seeded variants fold their
// seed rows into row 0, so they do not copy exactly).
void run_patterns(const std::vector<Shape>& shapes, std::mt19937_64& rng, int reps) {
  run_pattern_table(shapes, rng, reps,
                    "pattern: 16 rows | + 3 seed rows | + streaming stores | + no-L1 loads | 16-byte lanes, seeds "
                    "| no seeds, streaming stores | flat layout, no seeds | flat layout, seeds",
                    {[](BufferSet& s, int64_t t) { launch_pattern<0, 8, false, false>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_pattern<3, 8, false, false>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_pattern<3, 8, true, false>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_pattern<3, 8, true, true>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_pattern<3, 16, false, false>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_pattern<0, 8, true, false>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_pattern<0, 8, false, false, true>(s, t); },
                     [](BufferSet& s, int64_t t) { launch_pattern<3, 8, false, false, true>(s, t); }},
                    {[](BufferSet& s, int64_t t) { launch_pattern<0, 8, false, false>(s, t); }});
  std::printf("\n(ratios to the flat copy in parentheses)\n");
  run_walk_patterns(shapes, rng, reps);
  run_ring_patterns(shapes, rng, reps);
}

// --copies: the flat copy kernels and the row-block copies, by the SMs' loads and stores and
// by bulk copies, against the driver's flat copy and the packed kernel's band pattern; every
// variant is checked.
void run_copy_patterns(const std::vector<Shape>& shapes, std::mt19937_64& rng, int reps, bool band_bulk_only) {
  if (!band_bulk_only) {
    run_pattern_table(shapes, rng, reps,
                      "flat 16B x4 | flat 16B x8 | flat 8B x8 | flat 16B x4, grid-stride | band 16 rows (the pattern) "
                      "| plane rows 16B x8 | plane rows 16B x16 | plane rows 8B x16 | whole rows 16B x8 | whole rows 16B x16",
                      {[](BufferSet& s, int64_t t) { launch_flat_copy<4, 16, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_flat_copy<8, 16, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_flat_copy<8, 8, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_flat_copy<4, 16, true>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_pattern<0, 8, true, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_copy<8, 16, 1>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_copy<16, 16, 1>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_copy<16, 8, 1>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_copy<8, 16, 3>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_copy<16, 16, 3>(s, t); }},
                      {[](BufferSet& s, int64_t t) { launch_pattern<0, 8, true, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_copy<8, 16, 1>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_copy<16, 16, 1>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_copy<16, 8, 1>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_copy<8, 16, 3>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_copy<16, 16, 3>(s, t); }},
                      {[](BufferSet& s, int64_t t) { launch_flat_copy<4, 16, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_flat_copy<8, 16, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_flat_copy<8, 8, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_flat_copy<4, 16, true>(s, t); }});
    std::printf("\n(bulk copies through shared memory)\n");
    run_pattern_table(shapes, rng, reps,
                      "flat bulk 16 KB | flat bulk 32 KB | flat bulk 64 KB | plane rows bulk x8 | plane rows bulk x16 "
                      "| whole rows bulk x8 | plane rows, register loads, bulk stores x8 | x16 | whole rows, register "
                      "loads, bulk stores x8",
                      {[](BufferSet& s, int64_t t) { launch_flat_bulk_copy<1>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_flat_bulk_copy<2>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_flat_bulk_copy<4>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_bulk<8, 1, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_bulk<16, 1, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_bulk<8, 3, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_bulk<8, 1, true>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_bulk<16, 1, true>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_bulk<8, 3, true>(s, t); }},
                      {[](BufferSet& s, int64_t t) { launch_row_block_bulk<8, 1, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_bulk<16, 1, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_bulk<8, 3, false>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_bulk<8, 1, true>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_bulk<16, 1, true>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_row_block_bulk<8, 3, true>(s, t); }},
                      {[](BufferSet& s, int64_t t) { launch_flat_bulk_copy<1>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_flat_bulk_copy<2>(s, t); },
                       [](BufferSet& s, int64_t t) { launch_flat_bulk_copy<4>(s, t); }});
  }
  std::printf("\n(the band pattern's register loads, results written by bulk copies)\n");
  using BS = BulkScope;
  const std::vector<PatternLaunch> band_bulk = {
      [](BufferSet& s, int64_t t) { launch_band_bulk<16, 8, 4, BS::kWarpRows>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<16, 8, 4, BS::kCtaRows>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<16, 8, 12, BS::kCtaBlock>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<8, 8, 12, BS::kCtaBlock>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<8, 16, 2, BS::kWarpRows>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<8, 16, 2, BS::kCtaRows>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<16, 16, 2, BS::kWarpRows>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<8, 16, 6, BS::kCtaBlock>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_tma<16, 4>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_tma<32, 4>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_tma<16, 2>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_tma<8, 12>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<8, 8, 12, BS::kCtaBlock, 1>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<16, 8, 12, BS::kCtaBlock, 1>(s, t); }};
  run_pattern_table(shapes, rng, reps,
                    "8B lanes x16, 4 warps, per-warp row stores | per-CTA row stores | 8B x16, 12 warps, one block "
                    "| 8B x8, 12 warps, one block | 16B x8, 2 warps, per-warp rows | per-CTA rows | 16B x16, 2 warps, "
                    "per-warp rows | 16B x8, 6 warps, one block | TMA box, 8B x16, 4 warps | TMA 8B x32, 4 warps "
                    "| TMA 8B x16, 2 warps | TMA 8B x8, 12 warps | one block 8B x8, 12 warps, one CTA per SM | x16, one CTA per SM",
                    band_bulk, band_bulk);
}

// --block-walks: the one-block copy at forced occupancy, and block walks (block_walk_kernel).
void run_block_walks(const std::vector<Shape>& shapes, std::mt19937_64& rng, int reps) {
  using BS = BulkScope;
  const std::vector<PatternLaunch> variants = {
      [](BufferSet& s, int64_t t) { launch_band_bulk<8, 8, 12, BS::kCtaBlock>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<8, 8, 12, BS::kCtaBlock, 1>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<8, 8, 12, BS::kCtaBlock, 2>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<8, 8, 12, BS::kCtaBlock, 3>(s, t); },
      [](BufferSet& s, int64_t t) { launch_band_bulk<8, 8, 12, BS::kCtaBlock, 4>(s, t); },
      [](BufferSet& s, int64_t t) { launch_block_walk<8, 4, false>(s, t, 0); },
      [](BufferSet& s, int64_t t) { launch_block_walk<8, 2, false>(s, t, 2); },
      [](BufferSet& s, int64_t t) { launch_block_walk<8, 4, false>(s, t, 2); },
      [](BufferSet& s, int64_t t) { launch_block_walk<8, 8, false>(s, t, 2); },
      [](BufferSet& s, int64_t t) { launch_block_walk<8, 2, false>(s, t, 3); },
      [](BufferSet& s, int64_t t) { launch_block_walk<8, 4, false>(s, t, 3); },
      [](BufferSet& s, int64_t t) { launch_block_walk<8, 4, true>(s, t, 2); },
      [](BufferSet& s, int64_t t) { launch_block_walk<8, 4, true>(s, t, 3); },
      [](BufferSet& s, int64_t t) { launch_block_walk<16, 4, false>(s, t, 0); },
      [](BufferSet& s, int64_t t) { launch_block_walk<16, 2, true>(s, t, 0); }};
  run_pattern_table(shapes, rng, reps,
                    "one block 8 rows | at 1 CTA per SM | 2 | 3 | 4 | walk 8 rows x 4, natural | 8 x 2, 2 per SM "
                    "| 8 x 4, 2 per SM | 8 x 8, 2 per SM | 8 x 2, 3 per SM | 8 x 4, 3 per SM | pipelined 8 x 4, 2 per SM "
                    "| pipelined 8 x 4, 3 per SM | walk 16 rows x 4, natural | pipelined 16 x 2, natural",
                    variants, variants);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, patterns = false, walks = false, copies = false, band_bulk_only = false, block_walks = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--patterns") == 0) {
      patterns = true;
    } else if (std::strcmp(argv[i], "--walks") == 0) {
      walks = true;
    } else if (std::strcmp(argv[i], "--copies") == 0) {
      copies = true;
    } else if (std::strcmp(argv[i], "--band-bulk") == 0) {  // the last table of --copies alone
      copies = band_bulk_only = true;
    } else if (std::strcmp(argv[i], "--block-walks") == 0) {
      block_walks = true;
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--patterns | --walks | --copies | --band-bulk | --block-walks]\n", argv[0]);
      return 1;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no usable CUDA device\n");
    return 2;
  }
  try {
    const std::vector<Shape> shapes = quick ? std::vector<Shape>{{2048, 1}, {16384, 256}}
                                            : std::vector<Shape>{{2048, 1},   {4096, 64},
                                                                 {8192, 1},   {16384, 1},
                                                                 {16384, 256}, {65536, 4}};
    std::mt19937_64 pattern_rng(7);
    if (patterns) {
      run_patterns(shapes, pattern_rng, quick ? 20 : 100);
      return 0;
    }
    if (walks) {  // the walk table of --patterns alone
      run_walk_patterns(shapes, pattern_rng, quick ? 20 : 100);
      return 0;
    }
    if (block_walks) {
      run_block_walks(shapes, pattern_rng, quick ? 20 : 100);
      return 0;
    }
    if (copies) {
      run_copy_patterns(shapes, pattern_rng, quick ? 20 : 100, band_bulk_only);
      return 0;
    }
    // Around the default (vec 4, 16-token chunks): chunk programs per CTA and the CTA size;
    // then vec 8 with 8-token chunks (its row queue's length) and vec 2. Earlier sweeps
    // (docs/perf-notes.md) found 8- and 32-token chunks of vec 4 slower at every shape.
    // 1-warp CTAs measured within 1% of the 4-warp default (session 8) and stay in the sweep.
    std::vector<kda::conv::ConvTuning> tunings;
    for (int per_cta : {1, 2, 4, 8, 16})
      for (int warps : {1, 2, 4, 8}) tunings.push_back({4, 16, warps, per_cta});
    for (int per_cta : {2, 4, 8}) tunings.push_back({8, 8, 4, per_cta});
    for (int per_cta : {1, 2, 4}) tunings.push_back({2, 16, 4, per_cta});
    std::mt19937_64 rng(42);
    bool mismatch = false;
    std::printf("| tokens x seqs | copy us | default (vec/chunk/warps/per_cta) us | x copy | best us | x copy | best tuning |\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
    std::string details;
    for (const Shape& shape : shapes) {
      Batch b;
      make_batch(b, shape, rng);
      const int reps = quick ? 20 : 100;
      const double copy = time_us(b, reps, [&](BufferSet& s) {
        BENCH_CUDA(cudaMemcpy2DAsync(s.copy_dst, kDim * 2, s.x, kRowStride * 2, kDim * 2,
                                     static_cast<std::size_t>(b.tokens), cudaMemcpyDeviceToDevice));
      });
      const kda::conv::PackedConvParams def = kda::conv::make_params(b.sets[0].args);
      const double def_us = time_us(b, reps, [&](BufferSet& s) {
        kda::packed_causal_conv1d(s.args, nullptr);
      });
      const std::vector<char> state0 = download(b.sets[0].state, b.lines * kDim * 3 * 4);
      const auto reference = result_of(b, state0, {});
      double best = 1e30;
      kda::conv::ConvTuning best_t{};
      char line[256];
      for (const auto& t : tunings) {
        if (!kda::conv::check_tuning(b.sets[0].args, t).empty()) continue;
        const double us = time_us(b, reps, [&](BufferSet& s) {
          kda::conv::launch_packed_conv(s.args, t, nullptr);
        });
        const bool same = result_of(b, state0, t) == reference;
        mismatch = mismatch || !same;
        if (us < best) {
          best = us;
          best_t = t;
        }
        std::snprintf(line, sizeof line,
                      "  %lld x %lld  vec %d chunk %3d warps %d per_cta %2d: %8.2f us (%.3f x copy)%s\n",
                      static_cast<long long>(shape.tokens), static_cast<long long>(shape.seqs),
                      t.vec, t.chunk_len, t.warps_per_cta, t.chunks_per_cta, us, us / copy,
                      same ? "" : "  OUTPUT DIFFERS FROM THE DEFAULT LAUNCH");
        details += line;
        std::fputs(line, stderr);  // as it is measured, in case the run is cut short
      }
      std::printf("| %lld x %lld | %.1f | %.1f (%d/%d/%d/%d) | %.3f | %.1f | %.3f | vec %d chunk %d warps %d per_cta %d |\n",
                  static_cast<long long>(shape.tokens), static_cast<long long>(shape.seqs), copy,
                  def_us, def.vec, 1 << def.chunk_shift, def.warps_per_cta, def.chunks_per_cta, def_us / copy,
                  best, best / copy, best_t.vec, best_t.chunk_len, best_t.warps_per_cta, best_t.chunks_per_cta);
      std::fflush(stdout);
    }
    std::printf("\nAll tunings:\n%s", details.c_str());
    if (mismatch) {
      std::printf("\nFAILED: some tuning's output or state differs from the default launch\n");
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_conv_tunings: %s\n", e.what());
    return 1;
  }
}
