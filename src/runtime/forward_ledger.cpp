#include "runtime/forward_ledger.h"

#include "common/check.h"

namespace kda::detail {

ForwardLedger::ForwardLedger(int num_layers)
    : why_none_("no batch is staged: call begin_forward first"), windows_ran_(num_layers, -1) {}

void ForwardLedger::begin() {
  state_ = State::None;
  why_none_ = "no batch is staged: the last begin_forward did not finish";
  windows_.clear();
  for (int& w : windows_ran_) w = -1;
}

void ForwardLedger::begin_failed(const std::string& why) {
  state_ = State::None;
  why_none_ = str_cat("no batch is staged: the last begin_forward failed (", why,
                      "), and a failed begin_forward drops the batch before it; call begin_forward again");
}

void ForwardLedger::staged(const std::vector<WindowPlan>& windows) {
  state_ = State::Staged;
  windows_ = windows;
  for (int& w : windows_ran_) w = -1;
}

void ForwardLedger::check_can_run(int layer, const char* fn) const {
  KDA_CHECK(state_ != State::None, fn, why_none_);
  KDA_CHECK(state_ != State::Failed, fn, "this batch can no longer run: ", why_failed_,
            "; call begin_forward with the next batch");
  KDA_CHECK(windows_ran_[layer] < 0, fn, "layer ", layer,
            " has already run this batch: a batch runs at most once per layer (a second run would advance ",
            "its sequences' state lines twice); call begin_forward with the next batch");
}

void ForwardLedger::layer_started(int layer) { windows_ran_[layer] = 0; }

void ForwardLedger::window_ran(int layer, int window) { windows_ran_[layer] = window + 1; }

void ForwardLedger::all_ran() {
  for (int& w : windows_ran_) w = static_cast<int>(windows_.size());
}

std::string ForwardLedger::rows_of(int first_window, int count) const {
  const WindowPlan& a = windows_[first_window];
  const WindowPlan& b = windows_[first_window + count - 1];
  return str_cat("rows ", a.token_offset, "-", b.token_offset + b.num_tokens - 1);
}

std::string ForwardLedger::written() const {
  std::string out;
  const int n = static_cast<int>(windows_.size());
  for (std::size_t l = 0; l < windows_ran_.size(); ++l) {
    const int w = windows_ran_[l];
    if (w <= 0) continue;
    if (!out.empty()) out += "; ";
    out += str_cat("layer ", l, ": ", w == 1 ? "window 0" : str_cat("windows 0-", w - 1), " (", rows_of(0, w),
                   w == n ? ", all of the batch)" : ")");
  }
  return out.empty() ? "nothing" : out;
}

std::string ForwardLedger::failed(int layer, int window, const std::string& why, const char* call) {
  const std::string wrote = written();
  // A window whose eager run finished before its graph's capture failed counts as written.
  const bool window_written = windows_ran_[layer] > window;
  why_failed_ = str_cat(call, "(", layer, ") failed in window ", window, " (", rows_of(window, 1), ": ", why,
                        "); written: ", wrote);
  state_ = State::Failed;
  return str_cat("written: ", wrote,
                 window_written ? "" : str_cat("; layer ", layer, " window ", window, " may be partly written"),
                 "; nothing else of the batch ran and it can no longer run (the state lines of the sequences in ",
                 "what was written have advanced)");
}

std::string ForwardLedger::failed_all(const char* call, const std::string& why) {
  why_failed_ = str_cat(call, " failed part way (", why, ") after it had started to run every layer of the batch");
  state_ = State::Failed;
  return "every layer and window of the batch may be partly written (each sequence's state lines may hold their "
         "starting state, one run's or a part of a window's, the conv and the recurrent pool alike or not); it can "
         "no longer run";
}

}  // namespace kda::detail
