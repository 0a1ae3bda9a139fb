// PrefillModule::Impl: the module's state, shared by the files that implement it by job:
//   prefill_module.cpp  construction, accessors, step list and tensor-parallel switches, stats
//   forward.cpp         staging, windows, graph capture and replay
//   weights.cpp         set / upload / random weights
//   diagnostics.cpp     self_check and profile_steps
// The layer's buffers, GEMM plans, built-in steps and kernel-argument adapters are the
// LayerProgram's (layer_program.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/check.h"
#include "common/device_guard.h"
#include "common/device_memory.h"
#include "graph_cache.h"
#include "kda/prefill.h"
#include "runtime/batch_plan.h"
#include "runtime/forward_ledger.h"
#include "runtime/layer_program.h"
#include "runtime/module_memory.h"
#include "runtime/state_pools.h"

namespace kda {

struct PrefillModule::Impl {
  // How run_window executes a (layer, window): as configured, forced eager, or forced graph
  // replay (capturing a missing graph without the warm-up run, for self_check).
  enum class Mode { Auto, Eager, Replay };

  explicit Impl(const Config& cfg);
  ~Impl();

  // Fixed at construction.
  const Config config;
  int device = 0;  // the CUDA device everything is allocated on; every member function makes it
                   // current (DeviceGuard) and gives the caller's device back
  int num_layers = 0;
  const detail::MemoryPlan memory;  // every allocation's size, for this device's SM count
  detail::LayerProgram program;
  detail::StagingLayout staging;

  // State pools, one conv and one recurrent pool per layer: where they are (module-owned
  // buffers, zeroed at construction, or the server's with pools.external) and their strides.
  std::vector<StatePools> pools;  // line strides resolved (never 0) once a layer has pools
  std::vector<char> has_pools;    // per layer, 0 or 1
  std::vector<detail::DeviceBuffer> owned_conv_pools, owned_rec_pools;
  ConvStateStrides conv_strides(int layer) const;
  RecurrentStateStrides recurrent_strides(int layer) const;
  // Bytes from a pool's first element to the end of line cache_lines - 1.
  std::size_t conv_span_bytes(int layer) const;
  std::size_t rec_span_bytes(int layer) const;

  // Staging. Device: one slot per window, single-buffered (the stream orders every forward's
  // copy after the previous forward's reads). Host: a ring of kHostStagingSlots pinned buffers;
  // staging_done[h] is recorded after the copy out of buffer h, so refilling it waits only for
  // the copy kHostStagingSlots forwards back, and the host may run that many forwards ahead of
  // the GPU without blocking in begin_forward.
  static constexpr int kHostStagingSlots = detail::kHostStagingCopies;
  detail::DeviceBuffer staging_dev;
  detail::PinnedBuffer staging_host[kHostStagingSlots];
  detail::Event staging_done[kHostStagingSlots];
  int staging_next = 0;
  detail::PinnedBuffer padding_slot;  // one slot of an all-padding batch: every sequence empty

  detail::GraphCache graphs;
  detail::BatchValidator validator;

  // Weights. Graphs record weight and pool pointers: a layer's version changes when either
  // changes, which makes its graphs stale (re-recorded on next use).
  std::vector<LayerWeights> weights;
  std::vector<char> has_weights;  // per layer, 0 or 1
  std::vector<uint64_t> layer_version;
  uint64_t next_version = 1;
  std::vector<detail::DeviceBuffer> uploaded_weights;  // per layer, for upload_layer_weights
  detail::DeviceBuffer random_storage;                 // init_random_weights

  // Steps after the built-in ones. Tensor parallelism: the server's communicator (not owned)
  // and the partial-output switch. All three are fixed from the first staged forward on, so
  // every recorded graph and eager run has the same step list; a change before then (after a
  // begin_forward whose eager capture failed, say) drops every graph recorded so far.
  std::vector<Step> user_steps;
  ncclComm_t comm = nullptr;
  bool partial_output = false;

  // The forward in flight: its windows, and what of it has run (the ledger refuses a second
  // run of a layer and any run after a failure).
  std::vector<detail::WindowPlan> windows, next_windows;
  detail::ForwardLedger ledger;
  bool forward_started = false;  // a begin_forward has staged a batch: the step list is fixed
  // The stream of the staged batch's begin_forward: its metadata copy is ordered on it, and the
  // next begin_forward overwrites the single device staging, so run_layer must use it too.
  Stream staged_stream = nullptr;
  bool eager = false;
  bool kernels_warm = false;          // the eager-capture warm-up has run
  bool eager_graphs_current = false;  // every window-0 graph of every layer with weights is recorded

  // Statistics.
  int64_t forwards = 0, layer_calls = 0, eager_runs = 0;
  double begin_us_total = 0, layer_us_total = 0;

  bool graphs_active() const { return config.runtime.use_graphs && !eager; }
  bool all_reduce_active() const { return program.full_layer() && comm != nullptr && !partial_output; }
  const char* staging_slot(int window) const { return staging_dev.as<const char>() + window * staging.slot_bytes; }

  void check_layer(int layer, const char* fn) const;
  void check_layer_ready(int layer, const char* fn) const;
  void check_tp_ready(const char* fn) const;
  // Throws naming both devices when `stream` belongs to another device than the module's (the
  // legacy default stream is the current device's, which a DeviceGuard has made the module's).
  void check_stream(Stream stream, const char* fn) const;
  // The step list changed: no recorded graph holds it any more.
  void drop_graphs();

  // The inputs of (layer, window) at `bucket` rows, reading the window's device staging slot.
  detail::StepInputs inputs(int layer, int window, int64_t bucket) const;
  // Calls f(name, run) for every step in recorded order: built-ins, the all-reduce when active,
  // then user steps; run(inputs, stream) enqueues the step.
  template <typename F>
  void for_each_step(F&& f) const;
  // Enqueues one step, a runner of for_each_step: a step that throws something other than
  // kda::Error (a user step) has it turned into a kda::Error naming the step.
  template <typename Run>
  static void run_step(const std::string& name, const Run& run, const detail::StepInputs& in,
                       Stream stream);
  // Enqueues every step (run_step each).
  void run_steps(const detail::StepInputs& in, Stream stream) const;
  void all_reduce(const detail::StepInputs& in, Stream stream) const;

  // forward.cpp
  void stage(const BatchView& batch, Stream stream);
  void run_window(int layer, int window, Mode mode, Stream stream);
  void capture_eager_graphs(Stream stream);

  // weights.cpp
  void set_weights(int layer, const LayerWeights& w, const char* fn);
  // Storage [begin, begin + bytes) is about to be overwritten or freed: every layer whose weights
  // lie in it has none until set_weights gives it new ones, so a copy that fails part way leaves
  // it refusing to run instead of running on a mix of old and new weights.
  void drop_weights_in(const void* begin, std::size_t bytes);
  void set_pools(int layer, const StatePools& p, const char* fn);
  // Throws naming both ranges when p's pools share a byte with each other, with another
  // layer's pools or with a module buffer.
  void check_pools_overlap_nothing(int layer, const StatePools& p, const char* fn) const;
  // Throws naming the first step whose can_implement check refuses the layer's weights and
  // pools at some bucket.
  void check_steps_can_run(int layer, const char* what, const char* fn) const;
  void bump_version(int layer);
};

template <typename F>
void PrefillModule::Impl::for_each_step(F&& f) const {
  for (int i = 0; i < program.num_steps(); ++i)
    f(std::string(program.step_name(i)),
      [this, i](const detail::StepInputs& in, Stream s) { program.run_step(i, in, s); });
  if (all_reduce_active())
    f(std::string("all-reduce"), [this](const detail::StepInputs& in, Stream s) { all_reduce(in, s); });
  for (std::size_t i = 0; i < user_steps.size(); ++i)
    f("user step " + std::to_string(i),
      [this, i](const detail::StepInputs& in, Stream s) { user_steps[i](in.ctx, s); });
}

template <typename Run>
void PrefillModule::Impl::run_step(const std::string& name, const Run& run,
                                   const detail::StepInputs& in, Stream stream) {
  try {
    run(in, stream);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    KDA_FAIL("kda::PrefillModule", name, " threw: ", e.what());
  } catch (...) {
    KDA_FAIL("kda::PrefillModule", name, " threw an exception that is not a std::exception");
  }
}

}  // namespace kda
