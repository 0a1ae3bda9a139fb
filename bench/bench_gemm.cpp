// cuBLASLt probe for the module's GEMM shapes: times the heuristic's candidates (split-K or
// not) and the module's GemmPlan choice, so the in_proj / o_proj rate can be compared with what
// the library offers on this GPU, at the seed scale (bench_util.h's seed_model()).
//
//   bench_gemm [--out FILE] [--help]
//
// Prints a markdown table (and writes it to FILE with --out). Exits 0 after --help, 2 without a
// usable GPU, 1 on a bad argument or a CUDA error, else 0.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "bench_util.h"
#include "kda/config.h"
#include "runtime/gemm_plan.h"
#include "runtime/random_weights.h"

namespace {

// Median GPU time of 15 launches of launch() on s, after 3 untimed ones.
template <typename F>
double median_us(F&& launch, cudaStream_t s) {
  return kda::bench::time_each(s, 3, 15, [&](int) { launch(); }).median_us;
}

struct Shape {
  std::string name;
  int64_t m, n, k, lda, ldw, ldc;
};

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

}  // namespace

int main(int argc, char** argv) {
  std::string out_path;
  constexpr const char* kArgs = "[--out FILE] [--help]";
  for (int i = 1; i < argc; ++i) {
    if (kda::bench::is_help(argv[i])) kda::bench::usage_exit(argv[0], kArgs);
    else if (std::string(argv[i]) == "--out" && i + 1 < argc) out_path = argv[++i];
    else kda::bench::usage_exit(argv[0], kArgs, argv[i]);
  }
  kda::bench::require_gpu("bench_gemm");
  try {
    cudaStream_t s;
    BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const std::size_t ws_bytes = 32u << 20;
    void* ws = nullptr;
    BENCH_CUDA(cudaMalloc(&ws, ws_bytes));
    kda::detail::LtHandle lt;

    // The seed scale (D 7168, P 1536, W_in 4876, in_proj row stride 4928): in_proj with its own N
    // and with N padded to 16, to the row stride and to 128; o_proj; and an 8192^3 reference product.
    const kda::ModelConfig model = kda::bench::seed_model();
    const int64_t d = model.hidden_size, p = model.part_dim(), w_in = model.in_proj_cols();
    const int64_t stride = model.in_proj_stride();
    const auto in_proj = [&](int64_t tokens, int64_t n, int64_t ldc) {
      const std::string padded = n == w_in ? "" : "padded " + std::to_string(n) + ", ";
      return Shape{"in_proj " + padded + std::to_string(tokens), tokens, n, d, d, d, ldc};
    };
    const std::vector<Shape> shapes = {
        in_proj(16384, w_in, stride),
        in_proj(16384, round_up(w_in, 16), stride),
        in_proj(16384, stride, stride),
        in_proj(16384, round_up(w_in, 128), round_up(w_in, 128)),
        in_proj(2048, w_in, stride),
        in_proj(2048, stride, stride),
        {"o_proj 16384", 16384, d, p, p, p, d},
        {"square 8192", 8192, 8192, 8192, 8192, 8192, 8192},
    };
    std::string table = kda::bench::md_head({"shape", "candidate", "split-K", "us", "TFLOP/s"}, "llrrr");
    char line[256];
    for (const Shape& sh : shapes) {
      void *a, *w, *c;
      BENCH_CUDA(cudaMalloc(&a, sh.m * sh.lda * 2));
      BENCH_CUDA(cudaMalloc(&w, sh.n * sh.ldw * 2));
      BENCH_CUDA(cudaMalloc(&c, sh.m * sh.ldc * 2));
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
        cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk),
                                             &wr);
        cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
        double us = median_us([&] {
          st = cublasLtMatmul(lt.get(), desc, &alpha, w, lw, a, la, &beta, c, lc, c, lc, &res[i].algo, ws, ws_bytes, s);
        }, s);
        std::snprintf(line, sizeof line, "| %s | heuristic #%d%s | %d | %.1f | %.0f |\n", sh.name.c_str(), i,
                      st == CUBLAS_STATUS_SUCCESS ? "" : " (failed)", splitk, us, flops / us * 1e-6);
        table += line;
      }
      // The module's choice: one split-free algorithm for all buckets.
      if (sh.name.rfind("square", 0) != 0) {
        kda::detail::GemmShape gs;
        gs.n = sh.n;
        gs.k = sh.k;
        gs.lda = sh.lda;
        gs.ldw = sh.ldw;
        gs.ldc = sh.ldc;
        gs.align_w = 16;
        kda::detail::GemmPlan plan(lt.get(), gs, {sh.m}, ws_bytes);
        double us = median_us([&] { plan.run(sh.m, a, w, c, ws, ws_bytes, s); }, s);
        std::snprintf(line, sizeof line, "| %s | GemmPlan (%s) | 1 | %.1f | %.0f |\n", sh.name.c_str(),
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
    kda::bench::emit(table, out_path);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gemm: %s\n", e.what());
    return 1;
  }
  return 0;
}
