// cuBLASLt probe for the module's GEMM shapes: times the heuristic's candidates (split-K or
// not) and the module's GemmPlan choice, so the in_proj / o_proj rate can be compared with what
// the library offers on this GPU.   bench_gemm [--out FILE]
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "runtime/gemm_plan.h"
#include "runtime/random_weights.h"

namespace {

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_gemm: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <typename F>
double median_us(F&& launch, cudaStream_t s, int reps = 15) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) launch();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, s);
    launch();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms * 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Shape {
  const char* name;
  int64_t m, n, k, lda, ldw, ldc;
};

}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--out" && i + 1 < argc) out_path = argv[++i];
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "bench_gemm: no CUDA device is usable; this benchmark needs a GPU\n");
    return 2;
  }
  cudaStream_t s;
  ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  const std::size_t ws_bytes = 32u << 20;
  void* ws = nullptr;
  ok(cudaMalloc(&ws, ws_bytes), "workspace");
  kda::detail::LtHandle lt;

  // Seed scale: D 7168, P 1536, W_in 4876 (stride 4928); and an 8192^3 reference product.
  const std::vector<Shape> shapes = {
      {"in_proj 16384", 16384, 4876, 7168, 7168, 7168, 4928},
      {"in_proj padded 4880, 16384", 16384, 4880, 7168, 7168, 7168, 4928},
      {"in_proj padded 4928, 16384", 16384, 4928, 7168, 7168, 7168, 4928},
      {"in_proj padded 4992, 16384", 16384, 4992, 7168, 7168, 7168, 4992},
      {"in_proj 2048", 2048, 4876, 7168, 7168, 7168, 4928},
      {"in_proj padded 4928, 2048", 2048, 4928, 7168, 7168, 7168, 4928},
      {"o_proj 16384", 16384, 7168, 1536, 1536, 1536, 7168},
      {"square 8192", 8192, 8192, 8192, 8192, 8192, 8192},
  };
  std::string table = "| shape | candidate | split-K | us | TFLOP/s |\n| --- | --- | ---: | ---: | ---: |\n";
  char line[256];
  for (const Shape& sh : shapes) {
    void *a, *w, *c;
    ok(cudaMalloc(&a, sh.m * sh.lda * 2), "A");
    ok(cudaMalloc(&w, sh.n * sh.ldw * 2), "W");
    ok(cudaMalloc(&c, sh.m * sh.ldc * 2), "C");
    kda::detail::fill_uniform_bf16(a, sh.m * sh.lda, 1, 0, -1.0f, 1.0f, s);
    kda::detail::fill_uniform_bf16(w, sh.n * sh.ldw, 2, 0, -0.02f, 0.02f, s);
    const double flops = 2.0 * sh.m * sh.n * sh.k;

    cublasLtMatmulDesc_t desc;
    cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn));
    cublasLtMatrixLayout_t lw, la, lc;
    cublasLtMatrixLayoutCreate(&lw, CUDA_R_16BF, sh.k, sh.n, sh.ldw);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, sh.k, sh.m, sh.lda);
    cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, sh.n, sh.m, sh.ldc);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    uint64_t max_ws = ws_bytes;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof(max_ws));
    cublasLtMatmulHeuristicResult_t res[16];
    int n = 0;
    cublasLtMatmulAlgoGetHeuristic(lt.get(), desc, lw, la, lc, lc, pref, 16, res, &n);
    const float alpha = 1.0f, beta = 0.0f;
    for (int i = 0; i < n && i < 4; ++i) {
      if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
      int32_t splitk = 1;
      std::size_t wr = 0;
      cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &wr);
      cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
      double us = median_us([&] {
        st = cublasLtMatmul(lt.get(), desc, &alpha, w, lw, a, la, &beta, c, lc, c, lc, &res[i].algo, ws, ws_bytes, s);
      }, s);
      std::snprintf(line, sizeof line, "| %s | heuristic #%d%s | %d | %.1f | %.0f |\n", sh.name, i,
                    st == CUBLAS_STATUS_SUCCESS ? "" : " (failed)", splitk, us, flops / us * 1e-6);
      table += line;
    }
    // The module's choice: one split-free algorithm for all buckets.
    if (std::string(sh.name).rfind("square", 0) != 0) {
      kda::detail::GemmShape gs;
      gs.n = sh.n;
      gs.k = sh.k;
      gs.lda = sh.lda;
      gs.ldw = sh.ldw;
      gs.ldc = sh.ldc;
      gs.align_w = 16;
      kda::detail::GemmPlan plan(lt.get(), gs, {sh.m}, ws_bytes);
      double us = median_us([&] { plan.run(sh.m, a, w, c, ws, ws_bytes, s); }, s);
      std::snprintf(line, sizeof line, "| %s | GemmPlan (%s) | 1 | %.1f | %.0f |\n", sh.name,
                    plan.algo_description(), us, flops / us * 1e-6);
      table += line;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(lw);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
    cudaFree(a);
    cudaFree(w);
    cudaFree(c);
  }
  std::fputs(table.c_str(), stdout);
  if (!out_path.empty())
    if (FILE* f = std::fopen(out_path.c_str(), "w")) {
      std::fputs(table.c_str(), f);
      std::fclose(f);
    }
  return 0;
}
