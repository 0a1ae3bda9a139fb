// What the module knows of the batch in flight: whether one is staged, which (layer, window)s of
// it have been enqueued, and why it can no longer run. Plain C++ (tested on the CPU).
//
// The rules it holds the module to (the contract after an error, kda/prefill.h):
//  - begin_forward drops the previous batch before it validates the new one, so after a failed
//    begin_forward no batch is staged and run_layer throws until a begin_forward succeeds;
//  - a batch runs at most once per layer: a second run_layer of a layer throws, writing nothing;
//  - a run_layer (or profile_steps, self_check) that throws part way marks the batch failed:
//    every later run_layer of it throws, and the error says which layers and windows were
//    written.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/batch_plan.h"

namespace kda::detail {

class ForwardLedger {
 public:
  explicit ForwardLedger(int num_layers);

  // A begin_forward starts: the previous batch is dropped, whatever happens next.
  void begin();
  // It failed with `why` (repeated by later run_layer refusals).
  void begin_failed(const std::string& why);
  // It staged a batch cut into `windows` (their rows name what was written after a failure).
  void staged(const std::vector<WindowPlan>& windows);

  // Throws kda::Error from `fn` when layer `layer` of the staged batch may not run now: no batch
  // is staged, the batch failed, or the layer has run (or started to run) already.
  void check_can_run(int layer, const char* fn) const;
  // Layer `layer` starts running the batch (after check_can_run).
  void layer_started(int layer);
  // Window `window` of `layer` has been enqueued in full.
  void window_ran(int layer, int window);
  // Every layer has run the batch in full (self_check runs each layer).
  void all_ran();
  // A run of `layer` (by `call`: run_layer or profile_steps) threw at `window`: the batch can no
  // longer run. Returns the sentence that says what of the batch was written, for the error.
  std::string failed(int layer, int window, const std::string& why, const char* call = "run_layer");
  // A call that runs every layer (self_check, after all_ran) threw part way: the batch can no
  // longer run, and any of its layers and windows may be partly written. Returns the sentence for
  // the error.
  std::string failed_all(const char* call, const std::string& why);

  bool batch_staged() const { return state_ == State::Staged; }
  // Which (layer, window)s were enqueued, e.g. "layer 0: windows 0-1 (rows 0-4095, all of the
  // batch); layer 1: window 0 (rows 0-2047)"; "nothing" when none.
  std::string written() const;

 private:
  enum class State { None, Staged, Failed };
  std::string rows_of(int first_window, int count) const;

  State state_ = State::None;
  std::string why_none_;    // why no batch is staged
  std::string why_failed_;  // the failure that ended the batch, and what it had written
  std::vector<int> windows_ran_;  // per layer: windows enqueued in full; -1 never started
  std::vector<WindowPlan> windows_;
};

}  // namespace kda::detail
