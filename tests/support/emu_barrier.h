// Test-only: the barrier that the CPU emulations of GPU code (one std::thread per lane or
// thread) use for __syncwarp / __syncthreads.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace kda::test {

// A reusable barrier for n threads. A thread that waits for more than a minute means the body
// reached a barrier non-uniformly: that is reported and the program stops, instead of hanging
// the test run.
class EmuBarrier {
 public:
  explicit EmuBarrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return generation_ != gen; })) {
      std::fprintf(stderr, "emulation: a barrier of %d threads timed out (reached non-uniformly?)\n", n_);
      std::abort();
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

}  // namespace kda::test
