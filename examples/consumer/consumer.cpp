// A server-style program built against the installed kda-prefill, the way CI builds it (see
// meson.build here, and README.md, "Using the library from a server"):
//
//   kda_consumer [CONFIG.yaml]
//
// It loads a config (the file given, or the YAML embedded below) and shows that a broken config
// is refused with its file, line and key, which needs no GPU. Without a CUDA device it says so
// and exits 0 there. With one it builds a kda::PrefillModule, gives it seeded random weights,
// writes hidden states, runs a batch of three new sequences through every layer (each layer's
// output as the next one's input), then a second batch that continues them from their cache
// lines, checks that the layer output is finite, and shows that a bad batch is refused.
//
// Exit status: 0 ok (also without a GPU), 1 a kda::Error or CUDA error at run time, 2 a bad config.
#include <cuda_runtime_api.h>  // the server's own stream and copies; kda/prefill.h needs none

#include <kda/prefill.h>  // kda::PrefillModule, kda::BatchView; includes kda/config.h, kda/error.h

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// Small enough for any GPU: hidden 512, 2 heads, buckets of 64 and 256 tokens, batches of up to
// 1024 tokens (windows of 256), 2 layers.
constexpr const char* kEmbeddedConfig = R"(name: consumer-example
model: {hidden_size: 512, num_heads: 2}
runtime: {token_buckets: [64, 256], max_batch_tokens: 1024, max_seqs: 8, num_layers: 2}
pools: {cache_lines: 9}
)";

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// The server's stream; destroyed on every way out.
struct OwnedStream {
  cudaStream_t s = nullptr;
  OwnedStream() { cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~OwnedStream() { cudaStreamDestroy(s); }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
};

float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One forward: hidden states in, every layer run, the layer output's rows [0, T) back.
std::vector<uint16_t> forward(kda::PrefillModule& module, const kda::BatchView& batch, cudaStream_t stream) {
  const kda::Config& cfg = module.config();
  const int64_t T = batch.num_tokens(), D = cfg.model.hidden_size;
  // Hidden states: rows [0, T) of module.hidden_states(), bf16, row stride D. A server copies
  // its embeddings here; 0x3C3C is the bf16 value 0.0115.
  cuda_check(cudaMemsetAsync(module.hidden_states(), 0x3C, static_cast<size_t>(T * D) * 2, stream),
             "cudaMemsetAsync(hidden states)");
  module.begin_forward(batch, stream);  // validates (throws kda::Error, changes nothing), stages once
  const bool full = cfg.runtime.layer_steps == kda::LayerSteps::Full;
  for (int l = 0; l < static_cast<int>(cfg.runtime.num_layers); ++l) {
    // Every layer reads hidden_states() and writes output(). A server runs its other layers
    // (attention, MoE) in between and writes the next KDA layer's input; here output() is it.
    if (l > 0 && full)
      cuda_check(cudaMemcpyAsync(module.hidden_states(), module.output(), static_cast<size_t>(T * D) * 2,
                                 cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync(next layer's input)");
    module.run_layer(l, stream);  // graph replays (captured on first use)
  }
  std::vector<uint16_t> out(static_cast<size_t>(T * D));
  cuda_check(cudaMemcpyAsync(out.data(), module.output(), out.size() * 2, cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync(output)");
  cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return out;
}

int run_on_gpu(const kda::Config& cfg) {
  const int64_t num_seqs = 3;
  if (400 > cfg.runtime.batch_token_capacity() || num_seqs > cfg.runtime.max_seqs || cfg.pools.cache_lines < 4) {
    std::printf("kda-prefill consumer: the config is too small for the example batch (400 tokens, 3 sequences, "
                "4 cache lines); nothing run\n");
    return 0;
  }
  OwnedStream owned;  // declared before the module: destroyed after it
  const cudaStream_t stream = owned.s;
  int rc = 0;
  {
    kda::PrefillModule module(cfg);    // allocates everything once, on the current device
    module.init_random_weights(1234);  // a server calls set_layer_weights(l, its device pointers)

    // Three new sequences of 100, 37 and 263 tokens, each on its own cache line (never the pad
    // line pools.null_line). The flags are a bool array: std::vector<bool> has no data().
    std::vector<int32_t> query_start_loc = {0, 100, 137, 400};
    std::vector<int32_t> cache_indices;
    for (int32_t line = 0; static_cast<int64_t>(cache_indices.size()) < num_seqs; ++line)
      if (line != cfg.pools.null_line) cache_indices.push_back(line);
    std::unique_ptr<bool[]> has_initial_state(new bool[num_seqs]());  // all false: no state yet
    const kda::BatchView batch{query_start_loc.data(), cache_indices.data(), has_initial_state.get(), num_seqs};

    std::vector<uint16_t> out = forward(module, batch, stream);
    // The next chunk of the same sequences continues from the states on their cache lines.
    for (int64_t s = 0; s < num_seqs; ++s) has_initial_state[s] = true;
    out = forward(module, batch, stream);

    if (cfg.runtime.layer_steps == kda::LayerSteps::Full) {
      double sum = 0;
      int64_t bad = 0;
      for (uint16_t h : out) {
        const float f = bf16_to_float(h);
        if (!std::isfinite(f)) ++bad;
        else sum += std::fabs(f);
      }
      std::printf("kda-prefill consumer: two forwards of %lld tokens through %lld layers: mean |output| %.4g, "
                  "%lld non-finite values\n",
                  (long long)batch.num_tokens(), (long long)cfg.runtime.num_layers,
                  sum / static_cast<double>(out.size()), (long long)bad);
      if (bad) rc = 1;
    } else {
      std::printf("kda-prefill consumer: two forwards of %lld tokens (layer_steps: conv: the conv planes are "
                  "the output)\n",
                  (long long)batch.num_tokens());
    }

    // A bad batch throws before anything is enqueued and leaves the module as it was.
    cache_indices[0] = static_cast<int32_t>(cfg.pools.cache_lines);  // one past the last line
    try {
      module.begin_forward(batch, stream);
      std::printf("kda-prefill consumer: a cache index past the pool was NOT refused\n");
      rc = 1;
    } catch (const kda::Error& e) {
      std::printf("kda-prefill consumer: bad batch refused: %s\n", e.what());
    }
  }  // the module waits for the device and frees its memory
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 2) {
    std::fprintf(stderr, "usage: %s [CONFIG.yaml]\n", argv[0]);
    return 2;
  }
  const std::string source = argc == 2 ? argv[1] : "consumer.cpp (embedded)";
  kda::Config cfg;
  try {
    cfg = argc == 2 ? kda::load_config(source) : kda::parse_config(kEmbeddedConfig, source);
  } catch (const kda::Error& e) {
    std::fprintf(stderr, "kda-prefill consumer: %s\n", e.what());  // "...: FILE:LINE: key: what is wrong"
    return 2;
  }
  std::printf("kda-prefill consumer: config %s: hidden %lld, %lld heads (P = %lld), %lld layers, largest bucket "
              "%lld tokens; built with NCCL: %s\n",
              source.c_str(), (long long)cfg.model.hidden_size, (long long)cfg.model.num_heads,
              (long long)cfg.model.part_dim(), (long long)cfg.runtime.num_layers,
              (long long)cfg.runtime.largest_bucket(), kda::nccl_available() ? "yes" : "no");

  // Config checking needs no GPU: a bucket list out of order is refused, naming line and key.
  try {
    kda::parse_config("model: {hidden_size: 512, num_heads: 2}\n"
                      "runtime: {token_buckets: [256, 64]}\n"
                      "pools: {cache_lines: 9}\n",
                      "broken.yaml");
    std::fprintf(stderr, "kda-prefill consumer: a decreasing bucket list was NOT refused\n");
    return 1;
  } catch (const kda::Error& e) {
    std::printf("kda-prefill consumer: broken config refused: %s\n", e.what());
  }

  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("kda-prefill consumer: no CUDA device (%s): the config checks above ran, no module built\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "none found");
    return 0;
  }
  try {
    return run_on_gpu(cfg);
  } catch (const kda::Error& e) {
    std::fprintf(stderr, "kda-prefill consumer: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda-prefill consumer: %s\n", e.what());
    return 1;
  }
}
