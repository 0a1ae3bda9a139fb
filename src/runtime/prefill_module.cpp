// PrefillModule: construction, accessors, the step list and tensor-parallel switches, stats.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <exception>
#include <utility>

#include "common/check.h"
#include "common/cuda_check.h"
#include "runtime/module_impl.h"
#include "runtime/tp_comm.h"

namespace kda {

namespace {
// The current device, where the module allocates everything; a clear error when there is none
// (before cuBLASLt or an allocation fails with a less telling one).
int usable_current_device(const char* fn) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    KDA_FAIL(fn, "no CUDA device is usable: ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  }
  return device;
}

int sm_count_of(int device, const char* fn) {
  int sms = 0;
  KDA_CUDA_CHECK(fn, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}
}  // namespace

PrefillModule::Impl::Impl(const Config& cfg)
    : config(cfg),
      device(usable_current_device("kda::PrefillModule::PrefillModule")),
      num_layers(static_cast<int>(cfg.runtime.num_layers)),
      memory(detail::plan_memory(cfg, sm_count_of(device, "kda::PrefillModule::PrefillModule"))),
      program(config, memory),
      staging(detail::StagingLayout::for_config(cfg)),
      validator(cfg),
      ledger(static_cast<int>(cfg.runtime.num_layers)) {
  constexpr const char* fn = "kda::PrefillModule::PrefillModule";
  pools.assign(num_layers, StatePools{});
  has_pools.assign(num_layers, 0);
  if (!config.pools.external) {
    const std::size_t conv_bytes = memory.conv_pool, rec_bytes = memory.recurrent_pool;
    for (int l = 0; l < num_layers; ++l) {
      owned_conv_pools.emplace_back(conv_bytes, "conv-state pool");
      owned_rec_pools.emplace_back(rec_bytes, "recurrent-state pool");
      KDA_CUDA_CHECK(fn, cudaMemset(owned_conv_pools[l].get(), 0, conv_bytes));
      KDA_CUDA_CHECK(fn, cudaMemset(owned_rec_pools[l].get(), 0, rec_bytes));
      pools[l] = StatePools{owned_conv_pools[l].get(), config.conv_line_elems(), owned_rec_pools[l].get(),
                            config.recurrent_line_elems(), config.pools.cache_lines};
      has_pools[l] = 1;
    }
  }
  staging_dev = detail::DeviceBuffer(memory.staging_device, "metadata staging");
  for (auto& h : staging_host) h = detail::PinnedBuffer(memory.staging_host, "host staging");
  padding_slot = detail::PinnedBuffer(memory.padding_slot, "padding slot");
  detail::fill_padding_staging(config, staging, padding_slot.get());
  // Every device slot starts as padding (no sequence, no checkpoint line), so no kernel ever
  // reads a slot that a forward has not written as a batch.
  for (int64_t w = 0; w < program.windows_max; ++w)
    KDA_CUDA_CHECK(fn, cudaMemcpy(staging_dev.as<char>() + w * staging.slot_bytes, padding_slot.get(),
                                  staging.slot_bytes, cudaMemcpyHostToDevice));
  KDA_CUDA_CHECK(fn, cudaDeviceSynchronize());

  weights.assign(num_layers, LayerWeights{});
  has_weights.assign(num_layers, 0);
  layer_version.assign(num_layers, 0);
  windows.reserve(program.windows_max);
  next_windows.reserve(program.windows_max);
}

PrefillModule::Impl::~Impl() {
  // Work enqueued on the caller's stream may still read these buffers; the module does not
  // know that stream, so wait for the device before freeing. ~PrefillModule has made the
  // module's device current.
  cudaDeviceSynchronize();
}

void PrefillModule::Impl::check_layer(int layer, const char* fn) const {
  KDA_CHECK(layer >= 0 && layer < num_layers, fn, "layer ", layer, " is out of range: the module holds ",
            num_layers, " layer", num_layers == 1 ? "" : "s", " (runtime.num_layers), valid are 0..",
            num_layers - 1);
}

void PrefillModule::Impl::check_layer_ready(int layer, const char* fn) const {
  check_layer(layer, fn);
  KDA_CHECK(has_weights[layer], fn, "layer ", layer,
            " has no weights: call set_layer_weights, upload_layer_weights or init_random_weights (a reload of ",
            "them that failed part way leaves the layers whose weights it was overwriting without any)");
  KDA_CHECK(has_pools[layer], fn, "layer ", layer,
            " has no state pools: pools.external is true, so call set_layer_pools first");
}

ConvStateStrides PrefillModule::Impl::conv_strides(int layer) const {
  return detail::conv_state_strides(config, pools[layer].conv_line_stride);
}

RecurrentStateStrides PrefillModule::Impl::recurrent_strides(int layer) const {
  return detail::recurrent_state_strides(config, pools[layer].recurrent_line_stride);
}

std::size_t PrefillModule::Impl::conv_span_bytes(int layer) const {
  return detail::conv_pool_span_bytes(config, pools[layer].conv_line_stride);
}

std::size_t PrefillModule::Impl::rec_span_bytes(int layer) const {
  return detail::recurrent_pool_span_bytes(config, pools[layer].recurrent_line_stride);
}

void PrefillModule::Impl::check_tp_ready(const char* fn) const {
  const TensorParallelConfig& tp = config.tensor_parallel;
  KDA_CHECK(tp.size == 1 || !program.full_layer() || comm != nullptr || partial_output, fn, "tensor_parallel.size is ",
            tp.size, " (rank ", tp.rank, ") with runtime.layer_steps: full, so the ranks' partial o_proj outputs ",
            "must be summed: call set_communicator with the tensor-parallel group's NCCL communicator, or ",
            "set_partial_output(true) to sum them yourself, before the first forward");
}

detail::StepInputs PrefillModule::Impl::inputs(int layer, int window, int64_t bucket) const {
  return program.inputs(layer, window, bucket, staging_slot(window), staging, &weights[layer], pools[layer].conv,
                        conv_strides(layer), pools[layer].recurrent, recurrent_strides(layer));
}

void PrefillModule::Impl::check_stream(Stream stream, const char* fn) const {
  int stream_device = 0;
  KDA_CUDA_CHECK(fn, cudaStreamGetDevice(stream, &stream_device));
  KDA_CHECK(stream_device == device, fn, "the stream belongs to CUDA device ", stream_device,
            ", the module to device ", device, " (where it allocated everything): use a stream of device ", device);
}

void PrefillModule::Impl::drop_graphs() {
  graphs.clear();
  eager_graphs_current = false;
  kernels_warm = false;  // a new step may load modules of its own: warm up before capturing again
}

void PrefillModule::Impl::run_steps(const detail::StepInputs& in, Stream stream) const {
  for_each_step([&](const std::string& name, const auto& run) { run_step(name, run, in, stream); });
}

// With a communicator: the sum of the ranks' outputs, in place over the bucket's rows (every
// rank runs the same batch, so the same bucket and element count). Rows past the batch and rows
// of skipped sequences are summed too; they hold unspecified values either way.
void PrefillModule::Impl::all_reduce(const detail::StepInputs& in, Stream stream) const {
  detail::all_reduce_sum_bf16(in.ctx.out, in.ctx.bucket_tokens * program.D, comm, stream,
                              "kda::PrefillModule (all-reduce step)");
}

// The config is validated before anything is created on the device.
PrefillModule::PrefillModule(const Config& config)
    : impl_((validate_config(config), std::make_unique<Impl>(config))) {}

PrefillModule::~PrefillModule() {
  // The module's device stays current while its buffers, graphs and events are destroyed.
  try {
    const detail::DeviceGuard on_device(impl_->device, "kda::PrefillModule::~PrefillModule");
    impl_.reset();
  } catch (...) {
    impl_.reset();
  }
}

const Config& PrefillModule::config() const { return impl_->config; }
void* PrefillModule::hidden_states() { return impl_->program.hidden.get(); }
const void* PrefillModule::output() const { return impl_->program.output.get(); }
const void* PrefillModule::conv_planes() const { return impl_->program.planes.get(); }
const void* PrefillModule::in_proj_output() const { return impl_->program.in_proj_out.get(); }

void* PrefillModule::conv_state_pool(int layer) {
  impl_->check_layer(layer, "kda::PrefillModule::conv_state_pool");
  return impl_->pools[layer].conv;
}

void* PrefillModule::recurrent_state_pool(int layer) {
  impl_->check_layer(layer, "kda::PrefillModule::recurrent_state_pool");
  return impl_->pools[layer].recurrent;
}

StatePools PrefillModule::state_pools(int layer) const {
  impl_->check_layer(layer, "kda::PrefillModule::state_pools");
  return impl_->pools[layer];
}

ConvStateStrides PrefillModule::conv_state_strides(int layer) const {
  impl_->check_layer(layer, "kda::PrefillModule::conv_state_strides");
  return impl_->conv_strides(layer);
}

RecurrentStateStrides PrefillModule::recurrent_state_strides(int layer) const {
  impl_->check_layer(layer, "kda::PrefillModule::recurrent_state_strides");
  return impl_->recurrent_strides(layer);
}

void PrefillModule::add_step(Step step) {
  constexpr const char* fn = "kda::PrefillModule::add_step";
  KDA_CHECK(static_cast<bool>(step), fn, "the step is empty");
  KDA_CHECK(!impl_->forward_started, fn,
            "steps must be added before the first forward: graphs record the step list");
  impl_->user_steps.push_back(std::move(step));
  impl_->drop_graphs();
}

void PrefillModule::set_communicator(ncclComm_t comm) {
  constexpr const char* fn = "kda::PrefillModule::set_communicator";
  Impl& m = *impl_;
  const detail::DeviceGuard on_device(m.device, fn);
  KDA_CHECK(m.program.full_layer(), fn,
            "runtime.layer_steps is conv: the module writes no layer output, so there is nothing to all-reduce");
  KDA_CHECK(!m.forward_started, fn,
            "the communicator must be set before the first forward: graphs record the all-reduce");
  // Throws without NCCL, for a null communicator and when NCCL cannot query it.
  const detail::CommunicatorShape shape = detail::communicator_shape(comm, fn);
  detail::check_communicator_matches(m.config.tensor_parallel, shape, m.device, fn);
  m.comm = comm;
  m.drop_graphs();
  // NCCL's captured nodes cannot be updated in place (see GraphCache::set_exec_update).
  m.graphs.set_exec_update(false);
}

void PrefillModule::set_partial_output(bool partial) {
  constexpr const char* fn = "kda::PrefillModule::set_partial_output";
  KDA_CHECK(!impl_->forward_started, fn,
            "the partial-output switch must be set before the first forward: graphs record the step list");
  if (impl_->partial_output != partial) impl_->drop_graphs();
  impl_->partial_output = partial;
}

void PrefillModule::set_eager(bool eager) { impl_->eager = eager; }

ModuleStats PrefillModule::stats(Stream stream) const {
  constexpr const char* fn = "kda::PrefillModule::stats";
  const Impl& m = *impl_;
  const detail::DeviceGuard on_device(m.device, fn);
  m.check_stream(stream, fn);
  KDA_CUDA_CHECK(fn, cudaStreamSynchronize(stream));
  ModuleStats s;
  for (const detail::GraphStats& g : impl_->graphs.stats()) {
    BucketStats b;
    b.bucket_tokens = g.key.bucket;
    b.layer = g.key.layer;
    b.window = g.key.window;
    b.capture_us = g.capture_us;
    b.instantiate_us = g.instantiate_us;
    b.graph_nodes = g.nodes;
    b.replays = g.replays;
    b.mean_replay_us = g.mean_replay_us;
    s.graphs.push_back(b);
  }
  s.forwards = m.forwards;
  s.mean_host_us_begin = m.forwards ? m.begin_us_total / m.forwards : 0.0;
  s.mean_host_us_layer = m.layer_calls ? m.layer_us_total / m.layer_calls : 0.0;
  s.eager_layer_runs = m.eager_runs;
  return s;
}

}  // namespace kda
