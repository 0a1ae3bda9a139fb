// Keyed CUDA-graph cache of the prefill module: (bucket, layer, window) -> instantiated graph,
// with capture/instantiate times, node count, replay count and sampled GPU replay time (one
// replay in kTimingPeriod).
//
// Capture runs on a cache-owned non-blocking stream in cudaStreamCaptureModeThreadLocal, because
// the caller's stream may be the legacy default stream, which cannot be captured; replays are
// launched on the caller's stream. Each graph carries the `version` it was recorded at (the
// module bumps a layer's version when its weights change): a stale graph is re-recorded and
// cudaGraphExecUpdate is tried before instantiating anew.
//
// Not thread-safe: one host thread drives a cache (as it drives its module).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>


namespace kda::detail {

struct GraphKey {
  int64_t bucket = 0;
  int layer = 0;
  int window = 0;
  bool operator<(const GraphKey& o) const {
    if (bucket != o.bucket) return bucket < o.bucket;
    if (layer != o.layer) return layer < o.layer;
    return window < o.window;
  }
};

// What the cache knows of one graph.
struct GraphStats {
  GraphKey key;
  double capture_us = 0;      // stream capture of the recorded work
  double instantiate_us = 0;  // instantiate, or update when an update succeeded
  int64_t nodes = 0;
  int64_t replays = 0;
  double mean_replay_us = 0;  // GPU time per timed replay; 0 until one is timed
};

class GraphCache {
 public:
  struct Entry;  // one instantiated graph with its statistics

  GraphCache();
  ~GraphCache();
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;

  // Enqueues the work to record on the stream it is given; must not synchronise or allocate.
  using Record = std::function<void(cudaStream_t stream)>;

  // The graph of `key` recorded at `version`, or nullptr when there is none or it is stale.
  // The pointer stays valid until the cache is destroyed.
  Entry* find(const GraphKey& key, uint64_t version);
  // True when `key` holds a graph of any version.
  bool contains_any(const GraphKey& key) const { return entries_.count(key) != 0; }

  // Records `record` into a graph and makes it the key's graph at `version`; returns it.
  // When the key holds a stale graph, tries cudaGraphExecUpdate first (unless set_exec_update
  // turned it off), then re-instantiates.
  // On failure (record throws, the capture is invalidated, instantiation fails) the capture is
  // ended and discarded, no stream is left capturing, the key keeps what it held, and
  // kda::Error is thrown (record's own exception is rethrown as is).
  Entry* capture(const GraphKey& key, uint64_t version, const Record& record);

  // Launches the graph on `stream`. Every kTimingPeriod-th replay is a timing sample: it is
  // bracketed by an event pair when one of the entry's timing slots is free (a slot frees once
  // its end event has completed). Other replays cost one cudaGraphLaunch of host time.
  void launch(Entry* entry, cudaStream_t stream);

  std::size_t size() const { return entries_.size(); }
  // Destroys every graph (an in-flight replay still completes).
  void clear() { entries_.clear(); }

  // Whether capture() may refresh a stale graph with cudaGraphExecUpdate (default true). Graphs
  // holding NCCL work must be instantiated anew instead: NCCL does not support updates of its
  // captured nodes, and its per-capture resources belong to the graph they were recorded into.
  void set_exec_update(bool allowed) { exec_update_ = allowed; }

  // One GraphStats per graph, in key order. Waits for the replays it has timed.
  std::vector<GraphStats> stats();

 private:
  cudaStream_t capture_stream_ = nullptr;
  bool exec_update_ = true;
  std::map<GraphKey, std::unique_ptr<Entry>> entries_;
};

struct GraphCache::Entry {
  static constexpr int kTimingSlots = 16;
  static constexpr int64_t kTimingPeriod = 8;  // replays 0, 8, 16, ... are timing samples

  Entry() = default;
  ~Entry();  // destroys the exec and events (an in-flight replay still completes)
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;

  GraphKey key;
  uint64_t version = 0;
  cudaGraphExec_t exec = nullptr;
  double capture_us = 0;
  double instantiate_us = 0;  // instantiate, or update when an update succeeded
  int64_t nodes = 0;
  int64_t replays = 0;
  int64_t updates = 0;        // successful cudaGraphExecUpdate re-recordings

  // Timing slots: an event pair per slot, pending until its end event is read.
  std::array<cudaEvent_t, kTimingSlots> start{};
  std::array<cudaEvent_t, kTimingSlots> end{};
  std::array<bool, kTimingSlots> pending{};
  int next_slot = 0;
  int64_t timed_replays = 0;
  double timed_ms = 0;
};

}  // namespace kda::detail
