// Smallest program built against the installed library: parses a config, asks the packed conv
// whether it supports a shape, and reports. Needs no GPU, so CI runs it.
#include <cstdio>

#include "kda/config.h"
#include "kda/error.h"
#include "kda/packed_conv.h"
#include "kda/prefill.h"

int main() {
  try {
    kda::Config cfg = kda::parse_config(R"(
model: {hidden_size: 2304, num_heads: 4}
runtime: {token_buckets: [512, 2048]}
pools: {cache_lines: 65}
)",
                                        "consumer.cpp");
    kda::PackedConvArgs args;
    args.dim = 3 * cfg.model.part_dim();
    args.part_dim = cfg.model.part_dim();
    args.num_tokens = cfg.runtime.largest_bucket();
    std::string why;
    bool ok = kda::packed_causal_conv1d_supported(args, &why);
    std::printf("kda-prefill consumer: P = %lld, W_in = %lld; conv with null pointers supported: %s (%s); "
                "built with NCCL: %s\n",
                static_cast<long long>(cfg.model.part_dim()),
                static_cast<long long>(cfg.model.in_proj_cols()), ok ? "yes" : "no", why.c_str(),
                kda::nccl_available() ? "yes" : "no");
    return ok ? 1 : 0;  // null pointers must be refused
  } catch (const kda::Error& e) {
    std::fprintf(stderr, "kda-prefill consumer: %s\n", e.what());
    return 1;
  }
}
