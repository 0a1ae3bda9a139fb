// PrefillModule forward: validate and stage a batch, then per layer run each window's steps as
// a graph replay (recorded on first use) or eagerly.
#include <cuda_runtime_api.h>

#include <chrono>

#include "common/check.h"
#include "common/cuda_check.h"
#include "runtime/module_impl.h"

namespace kda {

namespace {
using Clock = std::chrono::steady_clock;

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}
}  // namespace

void PrefillModule::Impl::stage(const BatchView& batch, Stream stream) {
  constexpr const char* fn = "kda::PrefillModule::begin_forward";
  ledger.begin();  // the previous batch is gone, whether this one stages or not
  check_tp_ready(fn);
  validator.validate(batch);  // throws, changing nothing, on bad input
  detail::plan_windows(batch, config, next_windows);
  if (graphs_active() && config.runtime.capture == CaptureMode::Eager && !eager_graphs_current) {
    capture_eager_graphs(stream);
    eager_graphs_current = true;
  }

  const int h = staging_next;
  char* host = staging_host[h].get();
  // The copy out of this buffer kHostStagingSlots forwards ago must be done before it is overwritten.
  KDA_CUDA_CHECK(fn, cudaEventSynchronize(staging_done[h].get()));
  for (std::size_t w = 0; w < next_windows.size(); ++w)
    detail::fill_window_staging(batch, next_windows[w], config, staging, host + w * staging.slot_bytes);
  if (!next_windows.empty()) {
    KDA_CUDA_CHECK(fn, cudaMemcpyAsync(staging_dev.get(), host, next_windows.size() * staging.slot_bytes,
                                       cudaMemcpyHostToDevice, stream));
    KDA_CUDA_CHECK(fn, cudaEventRecord(staging_done[h].get(), stream));
    staging_next = (h + 1) % kHostStagingSlots;
  }
  windows.swap(next_windows);
  ledger.staged(windows);
  staged_stream = stream;
  forward_started = true;
}

void PrefillModule::Impl::run_window(int layer, int window, Mode mode, Stream stream) {
  const detail::WindowPlan& win = windows[window];
  const detail::StepInputs in = inputs(layer, window, win.bucket);
  const bool replay = mode == Mode::Replay || (mode == Mode::Auto && graphs_active());
  if (!replay) {
    run_steps(in, stream);
    ++eager_runs;
    ledger.window_ran(layer, window);
    return;
  }
  const detail::GraphKey key{win.bucket, layer, window};
  const uint64_t version = layer_version[layer];
  detail::GraphCache::Entry* graph = graphs.find(key, version);
  if (!graph) {
    auto record = [this, &in](cudaStream_t s) { run_steps(in, s); };
    if (mode == Mode::Auto && !graphs.contains_any(key)) {
      // First use of the key: this eager run is the batch's work and loads every kernel and
      // cuBLASLt module before the capture, which then only records.
      run_steps(in, stream);
      ++eager_runs;
      ledger.window_ran(layer, window);  // written, even if the capture below fails
      graphs.capture(key, version, record);
      return;
    }
    graph = graphs.capture(key, version, record);
  }
  graphs.launch(graph, stream);
  ledger.window_ran(layer, window);
}

// runtime.capture: eager. Records the (bucket, layer, window 0) graph of every layer that has
// weights and pools, after one eager run per (bucket, layer) over an all-padding batch (it writes only
// scratch rows and touches no pool line) so that every module is loaded before capturing.
void PrefillModule::Impl::capture_eager_graphs(Stream stream) {
  constexpr const char* fn = "kda::PrefillModule::begin_forward";
  for (int l = 0; l < num_layers; ++l) {
    if (!has_weights[l] || !has_pools[l]) continue;
    for (int64_t bucket : config.runtime.token_buckets) {
      const detail::GraphKey key{bucket, l, 0};
      if (graphs.find(key, layer_version[l])) continue;
      if (!kernels_warm) {
        KDA_CUDA_CHECK(fn, cudaMemcpyAsync(staging_dev.get(), padding_slot.get(), staging.slot_bytes,
                                           cudaMemcpyHostToDevice, stream));
        for (int wl = 0; wl < num_layers; ++wl) {
          if (!has_weights[wl] || !has_pools[wl]) continue;
          for (int64_t b : config.runtime.token_buckets) {
            run_steps(inputs(wl, 0, b), stream);
            ++eager_runs;
          }
        }
        KDA_CUDA_CHECK(fn, cudaStreamSynchronize(stream));
        kernels_warm = true;
      }
      const detail::StepInputs in = inputs(l, 0, bucket);
      graphs.capture(key, layer_version[l], [this, &in](cudaStream_t s) { run_steps(in, s); });
    }
  }
}

void PrefillModule::begin_forward(const BatchView& batch, Stream stream) {
  constexpr const char* fn = "kda::PrefillModule::begin_forward";
  const auto t0 = Clock::now();
  Impl& m = *impl_;
  try {
    // Inside the try: a device that cannot be made current also drops the previous batch.
    const detail::DeviceGuard on_device(m.device, fn);
    m.check_stream(stream, fn);
    m.stage(batch, stream);
  } catch (const std::exception& e) {
    m.ledger.begin_failed(e.what());
    throw;
  }
  ++m.forwards;
  m.begin_us_total += us_since(t0);
}

void PrefillModule::run_layer(int layer, Stream stream) {
  constexpr const char* fn = "kda::PrefillModule::run_layer";
  const auto t0 = Clock::now();
  Impl& m = *impl_;
  const detail::DeviceGuard on_device(m.device, fn);
  // Refusals before anything is enqueued leave the batch as it was.
  m.check_layer_ready(layer, fn);
  m.ledger.check_can_run(layer, fn);
  m.check_stream(stream, fn);
  KDA_CHECK(stream == m.staged_stream, fn, "layer ", layer, " was given stream ", static_cast<const void*>(stream),
            ", but this batch's begin_forward staged its metadata on stream ",
            static_cast<const void*>(m.staged_stream),
            ": the staging is single-buffered and ordered on that stream, so use one stream per module");
  m.ledger.layer_started(layer);
  for (int w = 0; w < static_cast<int>(m.windows.size()); ++w) {
    try {
      m.run_window(layer, w, Impl::Mode::Auto, stream);
    } catch (const std::exception& e) {
      const std::string written = m.ledger.failed(layer, w, e.what());
      KDA_FAIL(fn, "layer ", layer, " window ", w, " failed: ", e.what(), "; ", written);
    }
  }
  ++m.layer_calls;
  m.layer_us_total += us_since(t0);
}

void PrefillModule::run(const BatchView& batch, Stream stream) {
  // Every layer must be runnable before anything is staged, so a failure changes nothing.
  for (int l = 0; l < impl_->num_layers; ++l) impl_->check_layer_ready(l, "kda::PrefillModule::run");
  begin_forward(batch, stream);
  for (int l = 0; l < impl_->num_layers; ++l) run_layer(l, stream);
}

}  // namespace kda
