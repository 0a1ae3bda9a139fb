// The module's forward bookkeeping on the CPU: a failed begin_forward leaves no batch, a layer
// runs a batch once, a failure part way ends the batch and says what was written.
#include "runtime/forward_ledger.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "kda/error.h"
#include "support/test_errors.h"

using kda::detail::ForwardLedger;
using kda::detail::WindowPlan;
using kda::test::error_of;

namespace {
constexpr const char* kFn = "kda::PrefillModule::run_layer";

// Three windows of a 2048-row largest bucket over a 5000-row batch.
std::vector<WindowPlan> three_windows() {
  std::vector<WindowPlan> w(3);
  for (int i = 0; i < 3; ++i) {
    w[i].token_offset = 2048 * i;
    w[i].num_tokens = i < 2 ? 2048 : 5000 - 4096;
    w[i].bucket = 2048;
  }
  return w;
}

std::string refusal(const ForwardLedger& l, int layer) {
  return error_of([&] { l.check_can_run(layer, kFn); }, kFn);
}
}  // namespace

TEST_CASE("no layer runs before a batch is staged, nor after a failed begin_forward") {
  ForwardLedger l(2);
  CHECK(refusal(l, 0).find("no batch is staged: call begin_forward first") != std::string::npos);
  l.begin();
  l.staged(three_windows());
  CHECK_NOTHROW(l.check_can_run(0, kFn));
  // The next begin_forward fails: the staged batch is gone.
  l.begin();
  l.begin_failed("kda::PrefillModule::begin_forward: query_start_loc[2] = 5 after 9");
  const std::string why = refusal(l, 0);
  CHECK(why.find("the last begin_forward failed (kda::PrefillModule::begin_forward: query_start_loc[2] = 5 after 9)") !=
        std::string::npos);
  CHECK(refusal(l, 1) == why);
  CHECK_FALSE(l.batch_staged());
  l.begin();
  l.staged(three_windows());
  CHECK(l.batch_staged());
  CHECK_NOTHROW(l.check_can_run(1, kFn));
}

TEST_CASE("a layer runs a batch once; the next batch runs every layer again") {
  ForwardLedger l(2);
  l.begin();
  l.staged(three_windows());
  l.layer_started(1);
  for (int w = 0; w < 3; ++w) l.window_ran(1, w);
  CHECK(refusal(l, 1).find("layer 1 has already run this batch") != std::string::npos);
  CHECK_NOTHROW(l.check_can_run(0, kFn));
  // A layer that has started counts as run even before its first window is done.
  l.layer_started(0);
  CHECK(refusal(l, 0).find("layer 0 has already run this batch") != std::string::npos);
  CHECK(l.written() == "layer 1: windows 0-2 (rows 0-4999, all of the batch)");
  l.begin();
  l.staged(three_windows());
  CHECK_NOTHROW(l.check_can_run(0, kFn));
  CHECK_NOTHROW(l.check_can_run(1, kFn));
  CHECK(l.written() == "nothing");
}

TEST_CASE("all_ran marks every layer of the batch as run") {
  ForwardLedger l(3);
  l.begin();
  l.staged(three_windows());
  l.all_ran();
  for (int layer = 0; layer < 3; ++layer) CHECK(refusal(l, layer).find("has already run this batch") != std::string::npos);
}

TEST_CASE("a failure part way through a call that runs every layer ends the batch") {
  ForwardLedger l(2);
  l.begin();
  l.staged(three_windows());
  l.all_ran();
  const std::string said = l.failed_all("self_check", "cudaMemcpyAsync: an illegal memory access");
  CHECK(said.find("every layer and window of the batch may be partly written (each sequence's state lines may "
                  "hold their starting state") != std::string::npos);
  for (int layer = 0; layer < 2; ++layer) {
    CAPTURE(layer);
    CHECK(refusal(l, layer).find("this batch can no longer run: self_check failed part way (cudaMemcpyAsync: an "
                                 "illegal memory access)") != std::string::npos);
  }
  CHECK_FALSE(l.batch_staged());
}

TEST_CASE("a failure part way ends the batch and names the layers and windows written") {
  ForwardLedger l(3);
  l.begin();
  l.staged(three_windows());
  l.layer_started(0);
  for (int w = 0; w < 3; ++w) l.window_ran(0, w);
  l.layer_started(1);
  l.window_ran(1, 0);
  SUBCASE("the failing window may be partly written") {
    const std::string said = l.failed(1, 1, "user step 0 threw: boom");
    CHECK(said ==
          "written: layer 0: windows 0-2 (rows 0-4999, all of the batch); layer 1: window 0 (rows 0-2047); layer 1 "
          "window 1 may be partly written; nothing else of the batch ran and it can no longer run (the state lines "
          "of the sequences in what was written have advanced)");
  }
  SUBCASE("a window whose eager run finished before its capture failed counts as written") {
    l.window_ran(1, 1);
    const std::string said = l.failed(1, 1, "capture failed");
    CHECK(said.find("layer 1: windows 0-1 (rows 0-4095)") != std::string::npos);
    CHECK(said.find("may be partly written") == std::string::npos);
  }
  SUBCASE("profile_steps names itself") {
    l.failed(1, 1, "user step 0 threw: boom", "profile_steps");
    CHECK(refusal(l, 0).find("this batch can no longer run: profile_steps(1) failed in window 1") != std::string::npos);
    return;  // the refusals below name run_layer
  }
  for (int layer = 0; layer < 3; ++layer) {
    CAPTURE(layer);
    const std::string why = refusal(l, layer);
    CHECK(why.find("this batch can no longer run: run_layer(1) failed in window 1 (rows 2048-4095: ") !=
          std::string::npos);
    CHECK(why.find("written: layer 0: windows 0-2") != std::string::npos);
  }
  CHECK_FALSE(l.batch_staged());
  l.begin();
  l.staged(three_windows());
  CHECK_NOTHROW(l.check_can_run(1, kFn));
}
