#include "runtime/gemm_plan.h"

#include <cstdio>
#include <string>

#include "common/check.h"

namespace kda::detail {

namespace {

constexpr const char* kPlanFn = "kda::detail::GemmPlan";
constexpr const char* kRunFn = "kda::detail::GemmPlan::run";
// Heuristic results asked for; enough that some avoid split-K.
constexpr int kHeuristicResults = 32;
// The heuristic is asked at this M, whatever the buckets are, so that two modules with the same
// GEMM shape but different bucket lists pick the same algorithm and give the same bits for a
// token row (a split batch on one module equals the unsplit run on another).
constexpr int64_t kHeuristicM = 16384;

bool is_pow2_upto_256(uint32_t v) { return v >= 1 && v <= 256 && (v & (v - 1)) == 0; }

std::string shape_text(const GemmShape& s) {
  return str_cat("C(M x ", s.n, ", ldc ", s.ldc, ") = A(M x ", s.k, ", lda ", s.lda, ") @ W(", s.n,
                 " x ", s.k, ", ldw ", s.ldw, ")^T");
}

template <typename T>
T algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T value{};
  std::size_t written = 0;
  KDA_LT_CHECK(kPlanFn, cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written));
  return value;
}

// True when the algorithm accumulates every output element in one pass over K.
bool has_no_split(const cublasLtMatmulAlgo_t& algo) {
  return algo_config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) <= 1 &&
         algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) ==
             CUBLASLT_REDUCTION_SCHEME_NONE;
}

}  // namespace

void lt_check(cublasStatus_t status, const char* function, const char* expr, const char* file,
              int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw ::kda::Error(function,
                     str_cat(expr, " failed: ", cublasLtGetStatusName(status), " (",
                             cublasLtGetStatusString(status), ")"),
                     file, line);
}

LtHandle::LtHandle() { KDA_LT_CHECK("kda::detail::LtHandle", cublasLtCreate(&handle_)); }

LtHandle::~LtHandle() {
  if (handle_) cublasLtDestroy(handle_);
}

GemmPlan::GemmPlan(cublasLtHandle_t handle, const GemmShape& shape,
                   const std::vector<int64_t>& bucket_ms, std::size_t workspace_bytes)
    : handle_(handle), shape_(shape), ms_(bucket_ms) {
  KDA_CHECK(handle != nullptr, kPlanFn, "the cuBLASLt handle is null");
  KDA_CHECK(shape.n >= 1 && shape.k >= 1, kPlanFn, shape_text(shape), ": n and k must be >= 1");
  KDA_CHECK(shape.lda >= shape.k && shape.ldw >= shape.k && shape.ldc >= shape.n, kPlanFn,
            shape_text(shape), ": row strides must be at least the row lengths (lda, ldw >= k, ldc >= n)");
  KDA_CHECK(is_pow2_upto_256(shape.align_a) && is_pow2_upto_256(shape.align_w) &&
                is_pow2_upto_256(shape.align_c),
            kPlanFn, "alignments ", shape.align_a, ", ", shape.align_w, ", ", shape.align_c,
            " must be powers of two in [1, 256]");
  KDA_CHECK(!ms_.empty(), kPlanFn, "no bucket M given");
  for (std::size_t i = 0; i < ms_.size(); ++i)
    KDA_CHECK(ms_[i] >= 1 && (i == 0 || ms_[i] > ms_[i - 1]), kPlanFn, "bucket M[", i, "] = ",
              ms_[i], ": bucket sizes must be >= 1 and strictly increasing");

  try {
    KDA_LT_CHECK(kPlanFn, cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // Column-major view of the row-major product: C^T (n x M) = W (n x k) . A^T (k x M), i.e.
    // a TN GEMM whose first operand is W stored as (k x n) and transposed.
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    KDA_LT_CHECK(kPlanFn, cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
    KDA_LT_CHECK(kPlanFn, cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));

    KDA_LT_CHECK(kPlanFn, cublasLtMatrixLayoutCreate(&layout_w_, CUDA_R_16BF, shape.k, shape.n, shape.ldw));
    for (int64_t m : ms_) {
      cublasLtMatrixLayout_t la = nullptr, lc = nullptr;
      KDA_LT_CHECK(kPlanFn, cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, shape.k, m, shape.lda));
      layouts_a_.push_back(la);
      KDA_LT_CHECK(kPlanFn, cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, shape.n, m, shape.ldc));
      layouts_c_.push_back(lc);
    }

    cublasLtMatmulPreference_t pref = nullptr;
    KDA_LT_CHECK(kPlanFn, cublasLtMatmulPreferenceCreate(&pref));
    cublasLtMatmulHeuristicResult_t results[kHeuristicResults] = {};
    int returned = 0;
    cublasStatus_t heuristic_status = CUBLAS_STATUS_SUCCESS;
    {
      const uint64_t max_ws = workspace_bytes;
      // cuBLASLt's operand A is our W, its B our A.
      const uint32_t aligns[4] = {shape.align_w, shape.align_a, shape.align_c, shape.align_c};
      cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws));
      if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aligns[0], sizeof(uint32_t));
      if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &aligns[1], sizeof(uint32_t));
      if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &aligns[2], sizeof(uint32_t));
      if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &aligns[3], sizeof(uint32_t));
      cublasLtMatrixLayout_t ref_a = nullptr, ref_c = nullptr;
      if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatrixLayoutCreate(&ref_a, CUDA_R_16BF, shape.k, kHeuristicM, shape.lda);
      if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatrixLayoutCreate(&ref_c, CUDA_R_16BF, shape.n, kHeuristicM, shape.ldc);
      if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulAlgoGetHeuristic(handle_, desc_, layout_w_, ref_a, ref_c, ref_c, pref,
                                            kHeuristicResults, results, &returned);
      if (ref_a) cublasLtMatrixLayoutDestroy(ref_a);
      if (ref_c) cublasLtMatrixLayoutDestroy(ref_c);
      heuristic_status = st;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    KDA_CHECK(heuristic_status == CUBLAS_STATUS_SUCCESS || heuristic_status == CUBLAS_STATUS_NOT_SUPPORTED,
              kPlanFn, shape_text(shape), ": cublasLtMatmulAlgoGetHeuristic failed: ",
              cublasLtGetStatusName(heuristic_status));
    if (heuristic_status != CUBLAS_STATUS_SUCCESS) returned = 0;

    // Candidates in heuristic order: results without split-K first; then split-K results
    // forced to one pass (a fallback, checked like the others).
    std::vector<cublasLtMatmulAlgo_t> candidates;
    std::vector<cublasLtMatmulAlgo_t> forced;
    for (int i = 0; i < returned; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      if (has_no_split(results[i].algo)) {
        candidates.push_back(results[i].algo);
      } else {
        cublasLtMatmulAlgo_t algo = results[i].algo;
        const int32_t one = 1;
        const uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
        if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof(one)) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none, sizeof(none)) == CUBLAS_STATUS_SUCCESS)
          forced.push_back(algo);
      }
    }
    candidates.insert(candidates.end(), forced.begin(), forced.end());

    bool found = false;
    for (const cublasLtMatmulAlgo_t& algo : candidates) {
      std::size_t needed = 0;
      bool all_ok = true;
      for (std::size_t i = 0; i < ms_.size() && all_ok; ++i) {
        cublasLtMatmulHeuristicResult_t check = {};
        cublasStatus_t st = cublasLtMatmulAlgoCheck(handle_, desc_, layout_w_, layouts_a_[i],
                                                    layouts_c_[i], layouts_c_[i], &algo, &check);
        all_ok = st == CUBLAS_STATUS_SUCCESS && check.state == CUBLAS_STATUS_SUCCESS &&
                 check.workspaceSize <= workspace_bytes;
        if (all_ok && check.workspaceSize > needed) needed = check.workspaceSize;
      }
      if (!all_ok) continue;
      algo_ = algo;
      workspace_needed_ = needed;
      found = true;
      break;
    }
    KDA_CHECK(found, kPlanFn, shape_text(shape), ": cuBLASLt offers no algorithm without split-K that runs every bucket M from ",
              ms_.front(), " to ", ms_.back(), " within ", workspace_bytes, " bytes of workspace (",
              returned, " heuristic results, ", candidates.size(), " one-pass candidates)");

    std::snprintf(algo_description_, sizeof(algo_description_),
                  "algo %d tile %u stages %u splitk %d swizzle %u custom %u cluster %u workspace %zu",
                  algo_config<int32_t>(algo_, CUBLASLT_ALGO_CONFIG_ID),
                  algo_config<uint32_t>(algo_, CUBLASLT_ALGO_CONFIG_TILE_ID),
                  algo_config<uint32_t>(algo_, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                  algo_config<int32_t>(algo_, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                  algo_config<uint32_t>(algo_, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                  algo_config<uint32_t>(algo_, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
                  static_cast<unsigned>(algo_config<uint16_t>(algo_, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)),
                  workspace_needed_);
  } catch (...) {
    for (auto l : layouts_c_) cublasLtMatrixLayoutDestroy(l);
    for (auto l : layouts_a_) cublasLtMatrixLayoutDestroy(l);
    if (layout_w_) cublasLtMatrixLayoutDestroy(layout_w_);
    if (desc_) cublasLtMatmulDescDestroy(desc_);
    throw;
  }
}

GemmPlan::~GemmPlan() {
  for (auto l : layouts_c_) cublasLtMatrixLayoutDestroy(l);
  for (auto l : layouts_a_) cublasLtMatrixLayoutDestroy(l);
  if (layout_w_) cublasLtMatrixLayoutDestroy(layout_w_);
  if (desc_) cublasLtMatmulDescDestroy(desc_);
}

int GemmPlan::bucket_index(int64_t m) const {
  for (std::size_t i = 0; i < ms_.size(); ++i)
    if (ms_[i] == m) return static_cast<int>(i);
  return -1;
}

void GemmPlan::run(int64_t m, const void* a, const void* w, void* c, void* workspace,
                   std::size_t workspace_bytes, cudaStream_t stream) const {
  const int i = bucket_index(m);
  if (i < 0) {
    std::string planned;
    for (std::size_t j = 0; j < ms_.size(); ++j) planned += (j ? ", " : "") + std::to_string(ms_[j]);
    KDA_FAIL(kRunFn, "M = ", m, " is not a planned bucket (planned: ", planned, ")");
  }
  KDA_CHECK(a && w && c, kRunFn, "null operand pointer (A ", a, ", W ", w, ", C ", c, ")");
  auto aligned = [](const void* p, uint32_t align) {
    return reinterpret_cast<uintptr_t>(p) % align == 0;
  };
  KDA_CHECK(aligned(a, shape_.align_a) && aligned(w, shape_.align_w) && aligned(c, shape_.align_c),
            kRunFn, "operands must be aligned to the plan's ", shape_.align_a, " (A), ",
            shape_.align_w, " (W), ", shape_.align_c, " (C) bytes; got A ", a, ", W ", w, ", C ", c);
  KDA_CHECK(workspace_bytes >= workspace_needed_ && (workspace || workspace_needed_ == 0), kRunFn,
            "the algorithm needs ", workspace_needed_, " bytes of workspace, got ", workspace_bytes,
            workspace ? "" : " (null)");
  const float alpha = 1.0f, beta = 0.0f;
  KDA_LT_CHECK(kRunFn, cublasLtMatmul(handle_, desc_, &alpha, w, layout_w_, a, layouts_a_[i], &beta,
                                      c, layouts_c_[i], c, layouts_c_[i], &algo_, workspace,
                                      workspace_bytes, stream));
}

}  // namespace kda::detail
