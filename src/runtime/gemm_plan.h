// A small cuBLASLt wrapper for the module's row-major bf16 GEMMs with FP32 accumulation:
//   C (M x N, row stride ldc) = A (M x K, row stride lda) @ W (N x K, row stride ldw)^T
// used for in_proj (hidden @ in_proj^T), and later for g1/g2 (f_a @ f_b^T, g_a @ g_b^T,
// reading the f_a/g_a columns of the in_proj output with its row stride) and o_proj.
//
// One GemmPlan per (N, K, lda, ldw, ldc) shape holds the matmul descriptor, the layouts of every
// bucket M and ONE algorithm shared by all buckets. The algorithm never splits K or reduces
// partial sums, so an output row's bits depend only on its A row and W: a batch split into
// windows equals the unsplit run bitwise, and the same token gives the same row in any bucket.
// Nothing is allocated per call; run() may be captured into a CUDA graph.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kda::detail {

// Owns a cuBLASLt handle. One per module: handles are cheap but not free to create.
class LtHandle {
 public:
  LtHandle();
  ~LtHandle();
  LtHandle(const LtHandle&) = delete;
  LtHandle& operator=(const LtHandle&) = delete;
  cublasLtHandle_t get() const { return handle_; }

 private:
  cublasLtHandle_t handle_ = nullptr;
};

// Throws kda::Error naming the cuBLASLt call and the status (e.g. CUBLAS_STATUS_NOT_SUPPORTED).
void lt_check(cublasStatus_t status, const char* function, const char* expr, const char* file,
              int line);
#define KDA_LT_CHECK(function, expr) ::kda::detail::lt_check((expr), (function), #expr, __FILE__, __LINE__)

// Shape of one row-major GEMM; strides in elements, alignments in bytes (powers of two <= 256)
// that every pointer given to run() must have. They steer the algorithm choice: cuBLASLt's
// heuristic otherwise assumes 256-byte aligned operands.
struct GemmShape {
  int64_t n = 0, k = 0;                  // C is (M x n), A (M x k), W (n x k)
  int64_t lda = 0, ldw = 0, ldc = 0;     // row strides: lda >= k, ldw >= k, ldc >= n
  uint32_t align_a = 256, align_w = 256, align_c = 256;
};

class GemmPlan {
 public:
  // Builds descriptors for every M in `bucket_ms` (strictly increasing, >= 1) and picks the
  // algorithm the heuristic ranks best at a fixed M (16384, independent of the buckets, so equal
  // shapes give equal bits across modules) with at most `workspace_bytes`; checks it with
  // cublasLtMatmulAlgoCheck for every M. Throws kda::Error naming the shape when no
  // algorithm without split-K works for all of them.
  GemmPlan(cublasLtHandle_t handle, const GemmShape& shape, const std::vector<int64_t>& bucket_ms,
           std::size_t workspace_bytes);
  ~GemmPlan();
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;

  const GemmShape& shape() const { return shape_; }
  bool supports_m(int64_t m) const { return bucket_index(m) >= 0; }
  // Workspace the chosen algorithm needs (<= the plan's workspace_bytes).
  std::size_t workspace_needed() const { return workspace_needed_; }
  // A one-line description of the chosen algorithm (id, tile, stages, ...), for logs and tests.
  const char* algo_description() const { return algo_description_; }

  // Enqueues C = A @ W^T for `m` rows (one of the plan's bucket_ms). Throws kda::Error, and
  // enqueues nothing, when m is not a planned bucket, a pointer is null or misaligned, or the
  // workspace is smaller than workspace_needed(). Host cost: one cublasLtMatmul call.
  void run(int64_t m, const void* a, const void* w, void* c, void* workspace,
           std::size_t workspace_bytes, cudaStream_t stream) const;

 private:
  int bucket_index(int64_t m) const;

  cublasLtHandle_t handle_ = nullptr;
  GemmShape shape_;
  std::vector<int64_t> ms_;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t layout_w_ = nullptr;        // W as column-major (k x n), op T
  std::vector<cublasLtMatrixLayout_t> layouts_a_;    // per bucket: A as column-major (k x M)
  std::vector<cublasLtMatrixLayout_t> layouts_c_;    // per bucket: C as column-major (n x M)
  cublasLtMatmulAlgo_t algo_{};
  std::size_t workspace_needed_ = 0;
  char algo_description_[160] = {};
};

}  // namespace kda::detail
