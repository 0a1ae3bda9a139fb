// GPU tests of tensor parallelism that need only one GPU:
//  - the ranks of TP = 2 and 4 emulated one after another on one GPU, in partial-output mode (no
//    communicator): their outputs summed on the host against a TP = 1 module of the same full
//    weights, and their pools against the matching slices of the TP = 1 pools;
//  - a one-rank NCCL communicator (the all-reduce is then an identity): the same bits as without
//    it, graph replay equal to eager, the step recorded (when the build has NCCL);
//  - the refusals: a communicator of the wrong size, and a rank of several with neither a
//    communicator nor partial output, both changing nothing.
// The real multi-GPU all-reduce is run by examples/prefill_driver --tp N.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#if KDA_HAVE_NCCL
#include <dlfcn.h>
#include <nccl.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/half_host.h"
#include "kda/config.h"
#include "kda/error.h"
#include "kda/prefill.h"
#include "runtime/random_weights.h"
#include "testing/host_layer_tensors.h"
#include "testing/tp_shard.h"
#include "support/gpu_buffers.h"
#include "support/host_batch.h"

#if KDA_HAVE_NCCL
// Every ncclAllReduce of this program, the library's included, goes through this definition:
// the executable's symbol comes first in the dynamic lookup, ahead of libnccl's. It counts the
// calls made while their stream is being captured, i.e. the all-reduces recorded into graphs,
// then calls NCCL's own. A one-rank in-place all-reduce may record no node at all, so the graph
// node counts cannot tell whether the step was recorded; this count can.
namespace {
int g_all_reduce_calls = 0, g_all_reduce_recorded = 0;
}
extern "C" ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                      ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  using Fn = ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
  static const Fn nccl_own = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "ncclAllReduce"));
  if (!nccl_own) return ncclSystemError;
  ++g_all_reduce_calls;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) == cudaSuccess && status == cudaStreamCaptureStatusActive)
    ++g_all_reduce_recorded;
  return nccl_own(sendbuff, recvbuff, count, datatype, op, comm, stream);
}
#endif

namespace {

using kda::PrefillModule;
using kda::detail::HostLayerTensors;
using kda::test::diff_bits;
using kda::test::HostBatch;
using kda::test::Stream;

template <typename T>
std::vector<T> download(const void* p, int64_t count) {
  std::vector<T> v(static_cast<std::size_t>(count));
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  if (count) KDA_TEST_CUDA(cudaMemcpy(v.data(), p, v.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// The modules run on non-blocking streams, which do not wait for the legacy stream that
// cudaMemcpy / cudaMemset use, and a pageable cudaMemcpy may return before its DMA is done: wait
// for the device after each.
template <typename T>
void upload(void* dst, const std::vector<T>& v) {
  KDA_TEST_CUDA(cudaMemcpy(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  KDA_TEST_CUDA(cudaDeviceSynchronize());
}

// The full model: 8 heads, so that TP 2 and 4 give every rank 4 or 2 whole heads.
kda::Config full_config() {
  kda::Config c;
  c.model.hidden_size = 256;
  c.model.num_heads = 8;
  c.runtime.token_buckets = {16, 64, 256};
  c.runtime.max_seqs = 16;
  c.runtime.max_batch_tokens = 1024;  // batches past 256 tokens run in windows
  c.runtime.num_layers = 2;
  c.pools.cache_lines = 17;
  c.pools.null_line = 0;
  return c;
}

// The tiny module of the other GPU tests (2 heads), for the communicator paths.
kda::Config tiny_config() {
  kda::Config c = full_config();
  c.model.num_heads = 2;
  return c;
}

// Rank `rank` of `size` of the full model: its heads, its tensor_parallel section.
kda::Config rank_config(const kda::Config& full, int64_t size, int64_t rank) {
  kda::Config c = full;
  c.model = kda::detail::rank_model(full.model, size, rank);
  c.tensor_parallel.size = size;
  c.tensor_parallel.rank = rank;
  return c;
}


// 736 tokens in 8 sequences (one empty), 3 windows of the 256-token bucket; sequence s on line
// s + 1 except every fourth, which sits on the null line (skipped).
HostBatch make_batch(bool initial) {
  const std::vector<int32_t> lengths = {1, 37, 64, 200, 0, 129, 300, 5};
  HostBatch b;
  b.flags = std::make_unique<bool[]>(lengths.size());
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    b.qsl.push_back(b.qsl.back() + lengths[s]);
    b.lines.push_back(s % 4 == 2 ? 0 : static_cast<int32_t>(s + 1));
    b.flags[s] = initial && s % 2 == 1;
  }
  return b;
}

// Rows of the sequences that ran (the others' output rows are unspecified).
std::vector<int64_t> rows_that_ran(const HostBatch& b) {
  std::vector<int64_t> rows;
  for (std::size_t s = 0; s < b.lines.size(); ++s)
    if (b.lines[s] != 0)
      for (int32_t t = b.qsl[s]; t < b.qsl[s + 1]; ++t) rows.push_back(t);
  return rows;
}




void poison_output(PrefillModule& m) {
  const kda::Config& c = m.config();
  KDA_TEST_CUDA(cudaMemset(const_cast<void*>(m.output()), 0xFF,
                           static_cast<std::size_t>(c.runtime.batch_token_capacity() * c.model.hidden_size) * 2));
  KDA_TEST_CUDA(cudaDeviceSynchronize());
}

struct Comparison {
  double rel_frobenius = 0;  // ||got - want|| / ||want||
  double max_rel = 0;        // max |got - want| / max |want|
  int64_t nonfinite = 0;
};

Comparison compare(const std::vector<double>& got, const std::vector<double>& want) {
  Comparison c;
  double num = 0, den = 0, max_diff = 0, max_want = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++c.nonfinite;
      continue;
    }
    const double d = got[i] - want[i];
    num += d * d;
    den += want[i] * want[i];
    max_diff = std::max(max_diff, std::fabs(d));
    max_want = std::max(max_want, std::fabs(want[i]));
  }
  c.rel_frobenius = std::sqrt(num / (den > 0 ? den : 1));
  c.max_rel = max_diff / (max_want > 0 ? max_want : 1);
  return c;
}

std::vector<double> widen(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// What the TP = 1 run leaves: the starting pools, the batch's output and final pools.
struct Reference {
  std::vector<HostLayerTensors> weights;       // per layer, full model
  std::vector<uint16_t> hidden;                // the batch's rows
  std::vector<std::vector<float>> conv0, rec0;  // pools before the batch, per layer
  std::vector<uint16_t> out;                   // the batch's rows [0, T), bf16
  std::vector<std::vector<float>> conv, rec;   // pools after the batch
};

// A TP = 1 module of the full model runs a warm-up batch (leaving states to continue from) and
// then `batch`.
Reference run_reference(const kda::Config& full, const HostBatch& batch, cudaStream_t s) {
  PrefillModule ref(full);
  ref.init_random_weights(31);
  const int64_t D = full.model.hidden_size, T = batch.tokens();
  const int layers = static_cast<int>(full.runtime.num_layers);
  Reference r;
  for (int l = 0; l < layers; ++l) r.weights.push_back(kda::detail::download_layer_tensors(ref, l));
  const HostBatch warm = make_batch(false);
  kda::detail::fill_uniform_bf16(ref.hidden_states(), warm.tokens() * D, 41, uint64_t{1} << 40, -1.0f, 1.0f, s);
  ref.run(warm.view(), s);
  kda::detail::fill_uniform_bf16(ref.hidden_states(), T * D, 42, uint64_t{1} << 40, -1.0f, 1.0f, s);
  KDA_TEST_CUDA(cudaStreamSynchronize(s));
  r.hidden = download<uint16_t>(ref.hidden_states(), T * D);
  for (int l = 0; l < layers; ++l) {
    r.conv0.push_back(download<float>(ref.conv_state_pool(l), full.conv_pool_elems()));
    r.rec0.push_back(download<float>(ref.recurrent_state_pool(l), full.recurrent_pool_elems()));
  }
  ref.run(batch.view(), s);
  KDA_TEST_CUDA(cudaStreamSynchronize(s));
  r.out = download<uint16_t>(ref.output(), T * D);
  for (int l = 0; l < layers; ++l) {
    r.conv.push_back(download<float>(ref.conv_state_pool(l), full.conv_pool_elems()));
    r.rec.push_back(download<float>(ref.recurrent_state_pool(l), full.recurrent_pool_elems()));
  }
  return r;
}

// The recurrent pools of a rank may differ from the TP = 1 slices where a GEMM of another width
// rounds a gate differently; this bounds how far.
constexpr double kRecurrentTolerance = 1e-3;

// Runs the `size` ranks one after another on this GPU in partial-output mode, each from its
// share of the reference's weights and starting pools; checks the summed output and the pools.
void check_emulated_ranks(const kda::Config& full, const Reference& ref, const HostBatch& batch, int64_t size,
                          cudaStream_t s) {
  const int64_t D = full.model.hidden_size, T = batch.tokens(), lines = full.pools.cache_lines;
  const int layers = static_cast<int>(full.runtime.num_layers);
  const std::vector<int64_t> rows = rows_that_ran(batch);
  std::vector<double> sum(rows.size() * static_cast<std::size_t>(D), 0.0);
  for (int64_t rank = 0; rank < size; ++rank) {
    CAPTURE(rank);
    kda::Config cfg = rank_config(full, size, rank);
    cfg.runtime.capture = kda::CaptureMode::Eager;  // window-0 graphs replay from the first batch
    PrefillModule m(cfg);
    m.set_partial_output(true);
    for (int l = 0; l < layers; ++l) {
      const HostLayerTensors shard = kda::detail::shard_layer(full.model, ref.weights[l], size, rank);
      m.upload_layer_weights(l, kda::detail::host_weights_view(shard));
      upload(m.conv_state_pool(l), kda::detail::shard_conv_pool(full.model, ref.conv0[l], lines, size, rank));
      upload(m.recurrent_state_pool(l), kda::detail::shard_recurrent_pool(full.model, ref.rec0[l], lines, size, rank));
    }
    upload(m.hidden_states(), ref.hidden);
    poison_output(m);
    m.run(batch.view(), s);
    KDA_TEST_CUDA(cudaStreamSynchronize(s));
    const auto out = download<uint16_t>(m.output(), T * D);
    for (std::size_t i = 0; i < rows.size(); ++i)
      for (int64_t c = 0; c < D; ++c)
        sum[i * D + c] += kda::host::bf16_to_float(out[rows[i] * D + c]);

    for (int l = 0; l < layers; ++l) {
      CAPTURE(l);
      const auto conv = download<float>(m.conv_state_pool(l), cfg.conv_pool_elems());
      const auto conv_want = kda::detail::shard_conv_pool(full.model, ref.conv[l], lines, size, rank);
      REQUIRE(conv.size() == conv_want.size());
      const int64_t conv_bits = diff_bits(conv.data(), conv_want.data(), conv.size() * 4);
      const auto rec = download<float>(m.recurrent_state_pool(l), cfg.recurrent_pool_elems());
      const auto rec_want = kda::detail::shard_recurrent_pool(full.model, ref.rec[l], lines, size, rank);
      REQUIRE(rec.size() == rec_want.size());
      const int64_t rec_bits = diff_bits(rec.data(), rec_want.data(), rec.size() * 4);
      const Comparison rc = compare(widen(rec), widen(rec_want));
      MESSAGE("TP ", size, " rank ", rank, " layer ", l, ": conv pool vs TP 1 slice ", conv_bits,
              " differing bits; recurrent pool ", rec_bits, " differing bits, relative error ", rc.rel_frobenius,
              " (max ", rc.max_rel, ")");
      CHECK(conv_bits == 0);
      CHECK(rc.nonfinite == 0);
      CHECK(rc.rel_frobenius <= kRecurrentTolerance);
    }
  }
  std::vector<double> want(sum.size());
  for (std::size_t i = 0; i < rows.size(); ++i)
    for (int64_t c = 0; c < D; ++c) want[i * D + c] = kda::host::bf16_to_float(ref.out[rows[i] * D + c]);
  const Comparison oc = compare(sum, want);
  MESSAGE("TP ", size, ": summed partial outputs vs TP 1, ", rows.size(), " rows: relative error ", oc.rel_frobenius,
          " (max ", oc.max_rel, "), ", oc.nonfinite, " non-finite");
  CHECK(oc.nonfinite == 0);
  CHECK(oc.rel_frobenius <= 1e-2);
}


std::vector<std::string> step_names(const std::vector<kda::StepTiming>& t) {
  std::vector<std::string> n;
  for (const auto& x : t) n.push_back(x.name);
  return n;
}

#if KDA_HAVE_NCCL
// A communicator of one rank on the current device, destroyed last (declare it before modules).
class OneRankComm {
 public:
  OneRankComm() {
    int device = 0;
    KDA_TEST_CUDA(cudaGetDevice(&device));
    const ncclResult_t r = ncclCommInitAll(&comm_, 1, &device);
    REQUIRE_MESSAGE(r == ncclSuccess, "ncclCommInitAll: ", ncclGetErrorString(r));
  }
  ~OneRankComm() {
    if (comm_) ncclCommDestroy(comm_);
  }
  OneRankComm(const OneRankComm&) = delete;
  OneRankComm& operator=(const OneRankComm&) = delete;
  ncclComm_t get() const { return comm_; }

 private:
  ncclComm_t comm_ = nullptr;
};
#endif

}  // namespace

TEST_CASE("emulated ranks of TP 2 and 4 sum to the TP 1 layer, and hold its pools' slices") {
  Stream stream;
  const kda::Config full = full_config();
  const HostBatch batch = make_batch(true);
  const Reference ref = run_reference(full, batch, stream.get());
  for (int64_t size : {2, 4}) {
    CAPTURE(size);
    check_emulated_ranks(full, ref, batch, size, stream.get());
  }
}

TEST_CASE("a rank of several with neither a communicator nor partial output refuses its first forward") {
  Stream stream;
  const cudaStream_t s = stream.get();
  const kda::Config cfg = rank_config(full_config(), 2, 1);
  PrefillModule m(cfg);
  m.init_random_weights(7);
  const HostBatch batch = make_batch(false);
  kda::detail::fill_uniform_bf16(m.hidden_states(), batch.tokens() * cfg.model.hidden_size, 8, uint64_t{1} << 40,
                                 -1.0f, 1.0f, s);
  poison_output(m);
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  const int64_t out_elems = cfg.runtime.batch_token_capacity() * cfg.model.hidden_size;
  const auto out0 = download<uint16_t>(m.output(), out_elems);
  const auto conv0 = download<float>(m.conv_state_pool(0), cfg.conv_pool_elems());
  const auto rec0 = download<float>(m.recurrent_state_pool(0), cfg.recurrent_pool_elems());
  const char* const why = "tensor_parallel.size is 2 (rank 1) with runtime.layer_steps: full, so the ranks' partial "
                          "o_proj outputs must be summed: call set_communicator";
  CHECK_THROWS_WITH_AS(m.begin_forward(batch.view(), s), doctest::Contains(why), kda::Error);
  CHECK_THROWS_WITH_AS(m.run(batch.view(), s), doctest::Contains(why), kda::Error);
  CHECK_THROWS_WITH_AS(m.self_check(batch.view(), s), doctest::Contains(why), kda::Error);
  CHECK_THROWS_WITH_AS(m.profile_steps(batch.view(), 0, s), doctest::Contains(why), kda::Error);
  CHECK_THROWS_WITH_AS(m.run_layer(0, s), doctest::Contains("no batch is staged: the last begin_forward failed"), kda::Error);
  KDA_TEST_CUDA(cudaDeviceSynchronize());
  CHECK(diff_bits(download<uint16_t>(m.output(), out_elems).data(), out0.data(), out0.size() * 2) == 0);
  CHECK(diff_bits(download<float>(m.conv_state_pool(0), cfg.conv_pool_elems()).data(), conv0.data(), conv0.size() * 4) == 0);
  CHECK(diff_bits(download<float>(m.recurrent_state_pool(0), cfg.recurrent_pool_elems()).data(), rec0.data(),
                  rec0.size() * 4) == 0);
  CHECK(m.stats(s).forwards == 0);
  CHECK(m.stats(s).graphs.empty());

  // Partial output makes the same module runnable; the switch is then fixed.
  m.set_partial_output(true);
  m.run(batch.view(), s);
  const auto out = download<uint16_t>(m.output(), batch.tokens() * cfg.model.hidden_size);
  int64_t nonfinite = 0;
  for (int64_t row : rows_that_ran(batch))
    for (int64_t c = 0; c < cfg.model.hidden_size; ++c)
      nonfinite += !std::isfinite(kda::host::bf16_to_float(out[row * cfg.model.hidden_size + c]));
  CHECK(nonfinite == 0);
  CHECK_THROWS_WITH_AS(m.set_partial_output(false), doctest::Contains("before the first forward"), kda::Error);
  const auto names = step_names(m.profile_steps(batch.view(), 0, s));
  CHECK(std::find(names.begin(), names.end(), "all-reduce") == names.end());
}

#if KDA_HAVE_NCCL

TEST_CASE("a one-rank communicator all-reduces as an identity, recorded in the graphs") {
  Stream stream;
  const cudaStream_t s = stream.get();
  OneRankComm comm;  // outlives the modules
  const kda::Config cfg = tiny_config();
  const int64_t D = cfg.model.hidden_size;
  PrefillModule with(cfg), without(cfg);
  with.init_random_weights(5);
  without.init_random_weights(5);
  with.set_communicator(comm.get());

  // The first batch records the graphs (after its eager run), the second replays them.
  g_all_reduce_calls = g_all_reduce_recorded = 0;
  for (bool initial : {false, true}) {
    CAPTURE(initial);
    const HostBatch b = make_batch(initial);
    const int64_t T = b.tokens();
    for (PrefillModule* m : {&with, &without}) {
      kda::detail::fill_uniform_bf16(m->hidden_states(), T * D, initial ? 52 : 51, uint64_t{1} << 40, -1.0f, 1.0f, s);
      poison_output(*m);
      m->run(b.view(), s);
    }
    KDA_TEST_CUDA(cudaStreamSynchronize(s));
    // Same weights, inputs and history: every row of [0, T) is comparable, skipped ones too.
    const auto ow = download<uint16_t>(with.output(), T * D), oo = download<uint16_t>(without.output(), T * D);
    const int64_t out_bits = diff_bits(ow.data(), oo.data(), ow.size() * 2);
    int64_t pool_bits = 0;
    for (int l = 0; l < static_cast<int>(cfg.runtime.num_layers); ++l) {
      const auto cw = download<float>(with.conv_state_pool(l), cfg.conv_pool_elems());
      const auto co = download<float>(without.conv_state_pool(l), cfg.conv_pool_elems());
      const auto rw = download<float>(with.recurrent_state_pool(l), cfg.recurrent_pool_elems());
      const auto ro = download<float>(without.recurrent_state_pool(l), cfg.recurrent_pool_elems());
      pool_bits += diff_bits(cw.data(), co.data(), cw.size() * 4) + diff_bits(rw.data(), ro.data(), rw.size() * 4);
    }
    MESSAGE("with vs without the one-rank communicator: output ", out_bits, " differing bits, pools ", pool_bits);
    CHECK(out_bits == 0);
    CHECK(pool_bits == 0);
  }

  const kda::ModuleStats sw = with.stats(s), so = without.stats(s);
  REQUIRE(sw.graphs.size() == so.graphs.size());
  REQUIRE_FALSE(sw.graphs.empty());
  int64_t replays = 0;
  for (std::size_t i = 0; i < sw.graphs.size(); ++i) {
    // NCCL records nothing for an in-place all-reduce over one rank (it is a no-op there), so the
    // node counts may be equal; with ranks > 1 the all-reduce adds its kernel node(s).
    MESSAGE("graph (bucket ", sw.graphs[i].bucket_tokens, ", layer ", sw.graphs[i].layer, ", window ",
            sw.graphs[i].window, "): ", sw.graphs[i].graph_nodes, " nodes with the communicator, ",
            so.graphs[i].graph_nodes, " without");
    CHECK(sw.graphs[i].graph_nodes >= so.graphs[i].graph_nodes);
    replays += sw.graphs[i].replays;
  }
  CHECK(replays > 0);
  // One all-reduce recorded into each graph of the module with the communicator (none for the
  // other), and one more per eager (layer, window) run of the first batch.
  MESSAGE("ncclAllReduce calls: ", g_all_reduce_calls, ", of them recorded into graphs: ", g_all_reduce_recorded);
  CHECK(g_all_reduce_recorded == static_cast<int>(sw.graphs.size()));
  CHECK(g_all_reduce_calls > g_all_reduce_recorded);

  // Graph replay against eager launches of the same step list, all-reduce included.
  const HostBatch b = make_batch(true);
  const kda::SelfCheckReport r = with.self_check(b.view(), s);
  MESSAGE(r.detail);
  CHECK(r.ok);
  CHECK(r.graph_vs_eager_diff_bits == 0);

  // The step is in the list, right after o_proj; profile_steps times it.
  const auto names = step_names(with.profile_steps(b.view(), 0, s));
  const auto it = std::find(names.begin(), names.end(), "all-reduce");
  REQUIRE(it != names.end());
  CHECK(it != names.begin());
  CHECK(*(it - 1) == "o_proj GEMM");
  const auto plain = step_names(without.profile_steps(b.view(), 0, s));
  CHECK(std::find(plain.begin(), plain.end(), "all-reduce") == plain.end());
  CHECK(names.size() == plain.size() + 1);

  CHECK_THROWS_WITH_AS(with.set_communicator(comm.get()), doctest::Contains("before the first forward"), kda::Error);
}

TEST_CASE("a communicator that does not match the config is refused and changes nothing") {
  Stream stream;
  const cudaStream_t s = stream.get();
  OneRankComm comm;
  const kda::Config cfg = rank_config(full_config(), 2, 0);
  PrefillModule m(cfg);
  m.init_random_weights(9);
  CHECK_THROWS_WITH_AS(m.set_communicator(comm.get()),
                       doctest::Contains("the communicator has 1 rank and this module is its rank 0, but the config "
                                         "says tensor_parallel.size 2, tensor_parallel.rank 0"),
                       kda::Error);
  CHECK_THROWS_WITH_AS(m.set_communicator(nullptr), doctest::Contains("the communicator is null"), kda::Error);
  // Nothing was kept: the first forward still asks for a communicator or partial output.
  const HostBatch b = make_batch(false);
  CHECK_THROWS_WITH_AS(m.run(b.view(), s), doctest::Contains("must be summed: call set_communicator"), kda::Error);
  CHECK(m.stats(s).forwards == 0);

  kda::Config conv = tiny_config();
  conv.runtime.layer_steps = kda::LayerSteps::InProjConv;
  PrefillModule c(conv);
  CHECK_THROWS_WITH_AS(c.set_communicator(comm.get()), doctest::Contains("layer_steps is conv"), kda::Error);
}

#else

TEST_CASE("built without NCCL, set_communicator says so") {
  CHECK_FALSE(kda::nccl_available());
  PrefillModule m(tiny_config());
  CHECK_THROWS_WITH_AS(m.set_communicator(nullptr), doctest::Contains("kda-prefill was built without NCCL"),
                       kda::Error);
}

#endif
