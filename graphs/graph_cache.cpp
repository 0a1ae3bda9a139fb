#include "graph_cache.h"

#include <chrono>
#include <string>
#include <utility>

#include "common/check.h"
#include "common/cuda_check.h"

namespace kda::detail {

namespace {

using Clock = std::chrono::steady_clock;

double us_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

std::string key_text(const GraphKey& key) {
  return str_cat("graph (bucket ", key.bucket, ", layer ", key.layer, ", window ", key.window, ")");
}

// Destroys a recorded (not instantiated) graph when it goes out of scope.
struct GraphGuard {
  cudaGraph_t graph = nullptr;
  ~GraphGuard() {
    if (graph) cudaGraphDestroy(graph);
  }
};

}  // namespace

GraphCache::Entry::~Entry() {
  for (int i = 0; i < kTimingSlots; ++i) {
    if (start[i]) cudaEventDestroy(start[i]);
    if (end[i]) cudaEventDestroy(end[i]);
  }
  if (exec) cudaGraphExecDestroy(exec);
}

GraphCache::GraphCache() {
  KDA_CUDA_CHECK("kda::detail::GraphCache",
                 cudaStreamCreateWithFlags(&capture_stream_, cudaStreamNonBlocking));
}

GraphCache::~GraphCache() {
  entries_.clear();
  if (capture_stream_) cudaStreamDestroy(capture_stream_);
}

GraphCache::Entry* GraphCache::find(const GraphKey& key, uint64_t version) {
  auto it = entries_.find(key);
  if (it == entries_.end() || it->second->version != version) return nullptr;
  return it->second.get();
}

GraphCache::Entry* GraphCache::capture(const GraphKey& key, uint64_t version, const Record& record) {
  constexpr const char* fn = "kda::detail::GraphCache::capture";
  const auto t0 = Clock::now();
  KDA_CUDA_CHECK(fn, cudaStreamBeginCapture(capture_stream_, cudaStreamCaptureModeThreadLocal));
  GraphGuard recorded;
  try {
    record(capture_stream_);
  } catch (...) {
    // End the capture whatever state it is in, so the stream is usable again.
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(capture_stream_, &partial);
    if (partial) cudaGraphDestroy(partial);
    cudaGetLastError();  // the invalidated capture's error belongs to this failure
    throw;
  }
  const cudaError_t end_err = cudaStreamEndCapture(capture_stream_, &recorded.graph);
  if (end_err != cudaSuccess) {
    cudaGetLastError();
    KDA_FAIL(fn, "capture of ", key_text(key), " failed: cudaStreamEndCapture returned ",
             cudaGetErrorName(end_err), " (", cudaGetErrorString(end_err),
             "); a step synchronised, allocated, or used a stream other than the one it was given");
  }
  const auto t1 = Clock::now();
  std::size_t nodes = 0;
  KDA_CUDA_CHECK(fn, cudaGraphGetNodes(recorded.graph, nullptr, &nodes));

  auto it = entries_.find(key);
  if (it != entries_.end() && exec_update_) {
    Entry& e = *it->second;
    cudaGraphExecUpdateResultInfo info{};
    if (cudaGraphExecUpdate(e.exec, recorded.graph, &info) == cudaSuccess) {
      e.version = version;
      e.capture_us = us_between(t0, t1);
      e.instantiate_us = us_between(t1, Clock::now());
      e.nodes = static_cast<int64_t>(nodes);
      ++e.updates;
      return &e;
    }
    cudaGetLastError();  // a refused update leaves the exec as it was; instantiate anew below
  }

  cudaGraphExec_t exec = nullptr;
  KDA_CUDA_CHECK(fn, cudaGraphInstantiate(&exec, recorded.graph, 0));
  const auto t2 = Clock::now();

  if (it != entries_.end()) {
    Entry& e = *it->second;
    // A launch of the old exec still in flight completes; the exec is freed after it.
    cudaGraphExecDestroy(e.exec);
    e.exec = exec;
    e.version = version;
    e.capture_us = us_between(t0, t1);
    e.instantiate_us = us_between(t1, t2);
    e.nodes = static_cast<int64_t>(nodes);
    return &e;
  }

  auto entry = std::make_unique<Entry>();
  entry->exec = exec;  // owned by the entry from here on, also if event creation throws
  entry->key = key;
  entry->version = version;
  entry->capture_us = us_between(t0, t1);
  entry->instantiate_us = us_between(t1, t2);
  entry->nodes = static_cast<int64_t>(nodes);
  for (int i = 0; i < Entry::kTimingSlots; ++i) {
    KDA_CUDA_CHECK(fn, cudaEventCreate(&entry->start[i]));
    KDA_CUDA_CHECK(fn, cudaEventCreate(&entry->end[i]));
  }
  Entry* raw = entry.get();
  entries_.emplace(key, std::move(entry));
  return raw;
}

void GraphCache::launch(Entry* entry, cudaStream_t stream) {
  constexpr const char* fn = "kda::detail::GraphCache::launch";
  KDA_CHECK(entry != nullptr, fn, "no graph to launch");
  // Only every kTimingPeriod-th replay is a timing sample: an event query and two event records
  // cost about as much host time as the graph launch itself (docs/perf.md, host time).
  bool timed = false;
  const int slot = entry->next_slot;
  if (entry->replays % Entry::kTimingPeriod == 0) {
    timed = !entry->pending[slot];
    if (!timed) {
      const cudaError_t q = cudaEventQuery(entry->end[slot]);
      if (q == cudaSuccess) {
        float ms = 0;
        KDA_CUDA_CHECK(fn, cudaEventElapsedTime(&ms, entry->start[slot], entry->end[slot]));
        entry->timed_ms += ms;
        ++entry->timed_replays;
        entry->pending[slot] = false;
        timed = true;
      } else if (q == cudaErrorNotReady) {
        // Not an error, but the runtime records it as the last error; a later launch check
        // (cudaGetLastError) must not see it.
        cudaGetLastError();
      } else {
        KDA_CUDA_CHECK(fn, q);
      }
    }
  }
  if (timed) KDA_CUDA_CHECK(fn, cudaEventRecord(entry->start[slot], stream));
  KDA_CUDA_CHECK(fn, cudaGraphLaunch(entry->exec, stream));
  if (timed) {
    KDA_CUDA_CHECK(fn, cudaEventRecord(entry->end[slot], stream));
    entry->pending[slot] = true;
    entry->next_slot = (slot + 1) % Entry::kTimingSlots;
  }
  ++entry->replays;
}

std::vector<GraphStats> GraphCache::stats() {
  constexpr const char* fn = "kda::detail::GraphCache::stats";
  std::vector<GraphStats> out;
  out.reserve(entries_.size());
  for (auto& [key, entry] : entries_) {
    for (int i = 0; i < Entry::kTimingSlots; ++i) {
      if (!entry->pending[i]) continue;
      KDA_CUDA_CHECK(fn, cudaEventSynchronize(entry->end[i]));
      float ms = 0;
      KDA_CUDA_CHECK(fn, cudaEventElapsedTime(&ms, entry->start[i], entry->end[i]));
      entry->timed_ms += ms;
      ++entry->timed_replays;
      entry->pending[i] = false;
    }
    GraphStats s;
    s.key = key;
    s.capture_us = entry->capture_us;
    s.instantiate_us = entry->instantiate_us;
    s.nodes = entry->nodes;
    s.replays = entry->replays;
    s.mean_replay_us = entry->timed_replays > 0 ? entry->timed_ms * 1000.0 / entry->timed_replays : 0.0;
    out.push_back(s);
  }
  return out;
}

}  // namespace kda::detail
