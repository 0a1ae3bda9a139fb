// The chunked KDA kernels' block bodies (src/recurrence/kda_chunked_kernel_prep.cuh and
// kda_chunked_kernel_state.cuh, through kda_chunked_kernel.cuh) executed on the
// CPU: one std::thread per CUDA thread, barriers for __syncthreads and for named barriers
// (bar.sync id, n and bar.arrive id, n), and the warp collectives (shuffle, ldmatrix, mma.sync
// m16n8k16 bf16 / fp16 and m16n8k8 tf32, cp.async) emulated from the PTX ISA's fragment
// layouts. So the fragment index math, the record layout shared by the two phases, phase 2's
// publications between its state and output warps, the varlen map and the skip rules are
// checked without a GPU, on the very code the kernels run, against the float64 reference
// (kda::ref::prep_recurrence).
// What this cannot check: the hardware's own behaviour (the layouts are taken from the PTX
// ISA, as the kernels take them), timing, shared-memory limits and launch configuration.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/half_host.h"
#include "common/state_elements.h"
#include "recurrence/kda_chunked.h"
#include "recurrence/kda_recurrence.h"
// The block bodies alone: this file runs them with its own Ops (HostOps).
#define KDA_EMULATED_BODIES_ONLY
#include "recurrence/kda_chunked_kernel.cuh"
#include "support/emu_barrier.h"
#include "support/test_data.h"
#include "testing/layer_reference.h"

namespace {

using kda::recurrence::RecurrenceParams;

using Barrier = kda::test::EmuBarrier;

// bar.sync id, n and bar.arrive id, n: a barrier of n threads (whole warps) under a name,
// which arriving threads pass at once and waiting threads once n have arrived. It also checks
// that every generation is completed by the same warps as the first one: two groups of warps
// that used one name by mistake would pair up at random on the GPU, and fail here (as would a
// warp arriving twice at one generation).
class NamedBarrier {
 public:
  explicit NamedBarrier(int threads) : threads_(threads) {}
  int threads() const { return threads_; }
  // Returns false when the warps completing this generation differ from the first's.
  bool wait(int warp) { return enter(warp, /*arrive_only=*/false); }
  bool arrive(int warp) { return enter(warp, /*arrive_only=*/true); }

 private:
  bool enter(int warp, bool arrive_only) {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t gen = generation_;
    warps_ |= uint64_t{1} << warp;
    if (++arrived_ == threads_) {
      bool same = true;
      if (first_warps_ == 0) first_warps_ = warps_;
      else same = warps_ == first_warps_;
      // n arrivals from fewer than n / 32 warps: some warp arrived twice.
      if (__builtin_popcountll(warps_) * 32 != threads_) same = false;
      same_ = same;
      arrived_ = 0;
      warps_ = 0;
      ++generation_;
      cv_.notify_all();
      return same;
    }
    if (arrive_only) return true;
    if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return generation_ != gen; })) {
      std::fprintf(stderr, "emulation: named barrier of %d threads timed out\n", threads_);
      std::abort();
    }
    return same_;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  int threads_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  uint64_t warps_ = 0, first_warps_ = 0;
  bool same_ = true;
};

// What the 32 lanes of a warp exchange in one collective. Two alternating slots let a lane
// fill the next collective's slot while a slower lane still reads the current one: the
// barrier between them orders the reuse.
struct WarpSlot {
  uint32_t u[32][6];
  float f[32][4];
};

struct BlockShared {
  BlockShared(int threads, std::size_t smem_bytes, bool late_copies)
      : threads(threads), smem(smem_bytes / 16 + 1), block(threads), late_copies(late_copies) {
    for (int w = 0; w < threads / 32; ++w) warps.emplace_back(new Barrier(32));
    slots.resize(static_cast<std::size_t>(threads / 32) * 2);
    smem_size = smem_bytes;
    // Uninitialised shared memory on the GPU: NaN patterns make a read-before-write visible.
    std::memset(smem.data(), 0xFF, smem.size() * 16);
  }
  unsigned char* base() { return reinterpret_cast<unsigned char*>(smem.data()); }

  int threads;
  std::vector<uint4> smem;  // 16-byte aligned
  std::size_t smem_size = 0;
  Barrier block;
  std::vector<std::unique_ptr<Barrier>> warps;
  std::vector<WarpSlot> slots;
  std::mutex named_mu;
  std::unique_ptr<NamedBarrier> named[16];  // created by the first thread to use an id
  bool late_copies;
  std::atomic<int> errors{0};
  std::mutex error_mu;
  std::string first_error;

  void error(const std::string& what) {
    if (errors.fetch_add(1) == 0) {
      std::lock_guard<std::mutex> lock(error_mu);
      first_error = what;
    }
  }
};

// The thread-level operations of the bodies (see DeviceOps in kda_chunked.cu), per emulated
// thread.
struct HostOps {
  HostOps(BlockShared* block, int thread) : blk(block), tid(thread) {}
  BlockShared* blk;
  int tid;
  int phase = 0;  // which of the warp's two exchange slots the next collective uses
  struct Copy {
    uint32_t dst;
    const void* src;
  };
  std::vector<Copy> open_group;
  std::vector<std::vector<Copy>> committed;

  int lane() const { return tid & 31; }
  WarpSlot& slot() { return blk->slots[static_cast<std::size_t>(tid >> 5) * 2 + phase]; }
  void warp_wait() {
    blk->warps[tid >> 5]->wait();
    phase ^= 1;
  }
  bool in_smem(uint32_t offset, uint32_t bytes) {
    if (offset + bytes <= blk->smem_size) return true;
    blk->error("shared access at byte " + std::to_string(offset) + " + " + std::to_string(bytes) +
               " past " + std::to_string(blk->smem_size));
    return false;
  }

  unsigned char* smem() { return blk->base(); }
  uint32_t smem_addr(const void* p) {
    const auto off = static_cast<const unsigned char*>(p) - blk->base();
    if (off < 0 || static_cast<std::size_t>(off) > blk->smem_size) blk->error("pointer outside shared memory");
    return static_cast<uint32_t>(off);
  }
  void sync() { blk->block.wait(); }

  // bar.sync id, threads (id 0 is __syncthreads': the bodies use 1 .. 15).
  void named_sync(int id, int threads) { named(id, threads, /*arrive_only=*/false); }
  // bar.arrive id, threads.
  void named_arrive(int id, int threads) { named(id, threads, /*arrive_only=*/true); }
  void named(int id, int threads, bool arrive_only) {
    if (id <= 0 || id >= 16 || threads <= 0 || threads % 32 != 0 || threads > blk->threads) {
      blk->error("named barrier " + std::to_string(id) + " of " + std::to_string(threads) +
                 " threads is not a legal bar.sync");
      return;
    }
    NamedBarrier* b = nullptr;
    {
      std::lock_guard<std::mutex> lock(blk->named_mu);
      if (!blk->named[id]) blk->named[id].reset(new NamedBarrier(threads));
      b = blk->named[id].get();
    }
    if (b->threads() != threads) {
      blk->error("named barrier " + std::to_string(id) + " used with different thread counts");
      return;
    }
    if (!(arrive_only ? b->arrive(tid >> 5) : b->wait(tid >> 5))) blk->error("named barrier " + std::to_string(id) + " completed by other warps");
  }

  float shfl_xor(float v, int mask) {
    WarpSlot& s = slot();
    s.f[lane()][0] = v;
    warp_wait();
    return s.f[lane() ^ mask][0];
  }

  // __ballot_sync(0xFFFFFFFF, pred): every lane of the warp must call it (a lane that does not
  // leaves the others waiting at the warp barrier, and the emulation stops).
  uint32_t ballot(bool pred) {
    WarpSlot& s = slot();
    s.u[lane()][0] = pred ? 1u : 0u;
    warp_wait();
    uint32_t mask = 0;
    for (int l = 0; l < 32; ++l) mask |= (s.u[l][0] & 1u) << l;
    return mask;
  }
  int32_t load_i32_ro(const int32_t* ptr) { return *ptr; }

  uint32_t load32(uint32_t offset) {
    uint32_t w = 0;
    if (in_smem(offset, 4)) std::memcpy(&w, blk->base() + offset, 4);
    return w;
  }


  // ldmatrix's address exchange: every lane publishes its row address (16-byte aligned);
  // returns the slot that holds all 32 once the warp has met (the slot of the phase before the
  // wait, which flips the phase).
  WarpSlot& share_row_addresses(uint32_t addr) {
    if (addr % 16 != 0) blk->error("ldmatrix row address not 16-byte aligned");
    WarpSlot& s = slot();
    s.u[lane()][0] = addr;
    warp_wait();
    return s;
  }

  // ldmatrix x4: lane 8m + i gives the address of row i of matrix m.
  void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    const WarpSlot& s = share_row_addresses(addr);
    const int g = lane() >> 2, t = lane() & 3;
    for (int m = 0; m < 4; ++m) r[m] = load32(s.u[8 * m + g][0] + 4 * t);
  }

  uint16_t load16(uint32_t offset) {
    uint16_t h = 0;
    if (in_smem(offset, 2)) std::memcpy(&h, blk->base() + offset, 2);
    return h;
  }

  // ldmatrix x4 .trans: the same row addresses; r[m] receives (row 2t, column g) of matrix m
  // in its low half and (row 2t + 1, column g) in its high half.
  void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    const WarpSlot& s = share_row_addresses(addr);
    const int g = lane() >> 2, t = lane() & 3;
    for (int m = 0; m < 4; ++m)
      r[m] = uint32_t{load16(s.u[8 * m + 2 * t][0] + 2 * g)} |
             uint32_t{load16(s.u[8 * m + 2 * t + 1][0] + 2 * g)} << 16;
  }


  // mma.sync m16n8k16 row.col bf16 -> fp32: every lane publishes its fragments, then computes
  // its own four outputs from the whole warp's.
  void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma16(d, a, b0, b1, [](uint16_t h) { return kda::host::bf16_to_float(h); });
  }
  // The same with fp16 operands.
  void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma16(d, a, b0, b1, [](uint16_t h) { return kda::host::fp16_to_float(h); });
  }
  template <class Widen>
  void mma16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, Widen widen) {
    WarpSlot& s = slot();
    for (int i = 0; i < 4; ++i) s.u[lane()][i] = a[i];
    s.u[lane()][4] = b0;
    s.u[lane()][5] = b1;
    warp_wait();
    auto bf = [&](uint32_t word, int hi) {
      return widen(static_cast<uint16_t>(hi ? word >> 16 : word & 0xFFFFu));
    };
    // A(row, k): lane 4 (row % 8) + (k % 8) / 2, register (row / 8) + 2 (k / 8), half k % 2.
    auto A = [&](int row, int k) {
      return bf(s.u[4 * (row % 8) + (k % 8) / 2][(row / 8) + 2 * (k / 8)], k % 2);
    };
    // B(k, n): lane 4 n + (k % 8) / 2, register 4 + k / 8, half k % 2.
    auto B = [&](int k, int n) { return bf(s.u[4 * n + (k % 8) / 2][4 + k / 8], k % 2); };
    const int g = lane() >> 2, t = lane() & 3;
    for (int r = 0; r < 4; ++r) {
      const int row = g + 8 * (r >> 1), n = 2 * t + (r & 1);
      float acc = 0.0f;
      for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, n);
      d[r] += acc;
    }
  }

  // mma.sync m16n8k8 row.col tf32 -> fp32; the hardware reads the upper 19 bits of each
  // operand word.
  void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    WarpSlot& s = slot();
    for (int i = 0; i < 4; ++i) s.u[lane()][i] = a[i];
    s.u[lane()][4] = b0;
    s.u[lane()][5] = b1;
    warp_wait();
    auto tf = [](uint32_t word) {
      const uint32_t bits = word & 0xFFFFE000u;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    };
    // A(row, k): lane 4 (row % 8) + k % 4, register (row / 8) + 2 (k / 4).
    auto A = [&](int row, int k) { return tf(s.u[4 * (row % 8) + k % 4][(row / 8) + 2 * (k / 4)]); };
    // B(k, n): lane 4 n + k % 4, register 4 + k / 4.
    auto B = [&](int k, int n) { return tf(s.u[4 * n + k % 4][4 + k / 4]); };
    const int g = lane() >> 2, t = lane() & 3;
    for (int r = 0; r < 4; ++r) {
      const int row = g + 8 * (r >> 1), n = 2 * t + (r & 1);
      float acc = 0.0f;
      for (int k = 0; k < 8; ++k) acc += A(row, k) * B(k, n);
      d[r] += acc;
    }
  }

  // cp.async: with late_copies a group lands only when a wait requires it (the latest
  // possible moment), otherwise at once (the earliest); both must give the same results.
  void cp16(uint32_t dst, const void* src) {
    if (!in_smem(dst, 16)) return;
    if (dst % 16 != 0) blk->error("cp.async destination not 16-byte aligned");
    if (blk->late_copies) open_group.push_back({dst, src});
    else std::memcpy(blk->base() + dst, src, 16);
  }
  void cp_commit() {
    committed.push_back(std::move(open_group));
    open_group.clear();
  }
  // cp.async.wait_all: commits the open group, then every group lands.
  void cp_wait_all() {
    cp_commit();
    while (!committed.empty()) {
      for (const Copy& c : committed.front()) std::memcpy(blk->base() + c.dst, c.src, 16);
      committed.erase(committed.begin());
    }
  }
};

template <class Body>
void run_block(int threads, std::size_t smem_bytes, bool late_copies, Body body) {
  BlockShared blk(threads, smem_bytes, late_copies);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int tid = 0; tid < threads; ++tid)
    pool.emplace_back([&blk, &body, tid] {
      HostOps ops(&blk, tid);
      body(ops, tid);
    });
  for (auto& th : pool) th.join();
  INFO(blk.first_error);
  REQUIRE(blk.errors.load() == 0);
}

// The segment length kda_chunked uses for args: without a device, args.segment_tokens (the
// tests set it) or no cut.
int64_t segment_tokens(const kda::RecurrenceArgs& args) {
  return kda::recurrence::segment_tokens_of(args, 0);
}

// The records kda_chunked's phase 1 leaves, with room for these capacities: NaN at first,
// so a record phase 2 reads but phase 1 did not write shows.
std::vector<uint4> new_workspace(const kda::RecurrenceArgs& args) {
  std::vector<uint4> workspace(kda::kda_chunked_workspace_bytes(args) / 16);
  std::memset(workspace.data(), 0xFF, workspace.size() * 16);
  return workspace;
}

// kda_chunked's phase 1, every block emulated in turn, last first (the blocks of a launch may
// run in any order; see emulate_state).
void emulate_prep(const kda::RecurrenceArgs& args, std::vector<uint4>& workspace, bool late_copies) {
  std::string why;
  REQUIRE_MESSAGE(kda::kda_chunked_supported(args, &why), why);
  const RecurrenceParams p = kda::recurrence::make_chunked_params(args, workspace.data(), 0);
  REQUIRE(kda::recurrence::chunked_layout(args, segment_tokens(args)).total() <= workspace.size() * 16);
  using kda::chunked::PrepSmem;
  for (int64_t slot = p.slots - 1; slot >= 0; --slot)
    for (int head = p.num_heads - 1; head >= 0; --head)
      run_block(kda::chunked::PrepTraits::kThreads, sizeof(PrepSmem), late_copies,
                [&](HostOps& ops, int tid) {
                  if (args.gate_lower_bound)
                    kda::chunked::prep_block<true>(ops, p, slot, head, tid);
                  else
                    kda::chunked::prep_block<false>(ops, p, slot, head, tid);
                });
}

// Phase 2 (the grids and blocks of kda_chunked's launches of it) on the records: pass 1, and
// when the op cuts sequences into segments the scan and pass 3.
void emulate_state(const kda::RecurrenceArgs& args, std::vector<uint4>& workspace, bool late_copies) {
  const RecurrenceParams p =
      kda::recurrence::make_chunked_params(args, workspace.data(), segment_tokens(args));
  using kda::chunked::StateTraits;
  const bool cut = kda::chunked::segmented(p);
  // Blocks of a launch may run in any order: every launch runs its blocks last first, so that a
  // block reading what another block of the same launch writes (a state, a segment's E or P)
  // would see the unwritten (NaN) workspace, or the state from before the batch.
  const auto pass = [&](int which) {
    const int64_t blocks = kda::chunked::state_grid_blocks(p, which);
    for (int64_t x = blocks - 1; x >= 0; --x) {
      for (int head = p.num_heads - 1; head >= 0; --head)
        run_block(StateTraits::kThreads, StateTraits::kSmemBytes, late_copies, [&](HostOps& ops, int tid) {
          kda::chunked::state_block(ops, p, which, x, head, tid);
        });
    }
  };
  pass(1);
  if (!cut) return;
  using kda::chunked::ScanTraits;
  for (int64_t w = kda::chunked::segment_windows(p) - 1; w >= 0; --w)
    for (int head = p.num_heads - 1; head >= 0; --head)
      for (int slice = ScanTraits::kSlices - 1; slice >= 0; --slice)
        run_block(ScanTraits::kThreads, ScanTraits::kSmemBytes, late_copies,
                  [&](HostOps& ops, int tid) { kda::chunked::scan_block(ops, p, w, head, slice, tid); });
  pass(3);
}

// kda_chunked's two launches.
void emulate_kda_chunked(const kda::RecurrenceArgs& args, bool late_copies) {
  std::vector<uint4> workspace = new_workspace(args);
  emulate_prep(args, workspace, late_copies);
  emulate_state(args, workspace, late_copies);
}

// A host-side batch in the op's layout: planes with padded rows, b inside a wider in_proj
// row, a pool in (line, head, v, k) order (transposed against the module's, to exercise the
// strides) with gaps between heads and lines, o poisoned with NaN. The pool is `pool` (fp32),
// or `pool_bf16` (bf16 bit patterns at the same element positions) when bf16_pool is set.
struct HostBatchData {
  int64_t heads = 0, tokens = 0, lines = 0;
  int64_t head_stride = 0, line_stride = 0;  // pool
  int64_t plane_stride = 0, b_stride = 0, b_offset = 0, o_stride = 0;
  std::vector<uint16_t> q, k, v, g1, b, o;
  std::vector<float> a_log, dt_bias, pool;
  bool bf16_pool = false;
  int64_t segment_tokens = 0;  // RecurrenceArgs::segment_tokens: no cut unless a test asks
  std::vector<uint16_t> pool_bf16;
  std::vector<int32_t> qsl, cache;
  std::vector<uint8_t> init;  // bool storage
  std::optional<double> lower_bound;
  // State checkpoints: none when both are empty, else num_seqs and max_checkpoints entries.
  std::vector<kda::CheckpointSeq> checkpoint_seqs;
  std::vector<kda::CheckpointEntry> checkpoint_entries;

  int64_t pool_index(int64_t line, int64_t h, int64_t kc, int64_t vc) const {
    return line * line_stride + h * head_stride + vc * 128 + kc;
  }

  kda::RecurrenceArgs args() {
    kda::RecurrenceArgs a;
    a.num_heads = heads;
    a.num_tokens = tokens;
    a.varlen.num_seqs = static_cast<int64_t>(cache.size());
    a.varlen.query_start_loc = qsl.data();
    a.varlen.cache_indices = cache.data();
    a.varlen.has_initial_state = reinterpret_cast<const bool*>(init.data());
    a.varlen.null_line = 0;
    a.q = q.data();
    a.k = k.data();
    a.v = v.data();
    a.qkv_row_stride = plane_stride;
    a.g1 = g1.data();
    a.g1_row_stride = plane_stride;
    a.b = b.data();
    a.b_row_stride = b_stride;
    a.b_col_offset = b_offset;
    a.a_log = a_log.data();
    a.dt_bias = dt_bias.data();
    a.gate_lower_bound = lower_bound;
    if (bf16_pool) {
      a.states = pool_bf16.data();
      a.state_dtype = kda::DType::BF16;
    } else {
      a.states = pool.data();
    }
    a.varlen.cache_lines = lines;
    a.state_stride_line = line_stride;
    a.state_stride_head = head_stride;
    a.state_stride_v = 128;
    a.state_stride_k = 1;
    a.o = o.data();
    a.o_row_stride = o_stride;
    if (!checkpoint_seqs.empty()) {
      a.checkpoint_seqs = checkpoint_seqs.data();
      a.checkpoint_entries = checkpoint_entries.data();
      a.max_checkpoints = static_cast<int64_t>(checkpoint_entries.size());
    }
    a.segment_tokens = segment_tokens;
    return a;
  }

  kda::ref::HostBatch host_batch() const {
    kda::ref::HostBatch batch;
    batch.query_start_loc = qsl.data();
    batch.cache_indices = cache.data();
    batch.has_initial_state = reinterpret_cast<const bool*>(init.data());
    batch.num_seqs = static_cast<int64_t>(cache.size());
    batch.null_line = 0;
    batch.cache_lines = lines;
    return batch;
  }
};

// lens[s] tokens for sequence s (0 allowed); lines[s] its cache line (0 = null line);
// pad_tokens extra rows past the batch that nothing may write.
HostBatchData make_batch(int64_t heads, const std::vector<int>& lens, const std::vector<int>& lines,
                         const std::vector<int>& init, int64_t pad_tokens,
                         std::optional<double> lower_bound, uint32_t seed,
                         bool correlated_keys = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  auto bf = [](float x) { return kda::host::float_to_bf16(x); };
  HostBatchData d;
  d.heads = heads;
  d.lower_bound = lower_bound;
  const int64_t P = heads * 128;
  d.qsl.push_back(0);
  for (int len : lens) d.qsl.push_back(d.qsl.back() + len);
  d.tokens = d.qsl.back() + pad_tokens;
  d.cache.assign(lines.begin(), lines.end());
  d.init.assign(init.begin(), init.end());
  d.lines = 1 + *std::max_element(lines.begin(), lines.end()) + 1;  // one line nobody names
  d.plane_stride = P + 4;
  d.b_offset = 3;
  d.b_stride = d.b_offset + heads + 5;
  d.o_stride = P + 8;
  d.q.resize(d.tokens * d.plane_stride);
  d.k.resize(d.q.size());
  d.v.resize(d.q.size());
  d.g1.resize(d.q.size());
  d.b.resize(d.tokens * d.b_stride);
  for (auto* plane : {&d.q, &d.k, &d.v})
    for (auto& x : *plane) x = bf(nd(rng));
  // Optionally q, k ~ U(-0.3, 1.2) as in test_kda_chunked_gpu: positive-leaning, so strongly
  // correlated keys (A's entries near beta, the largest pairwise products).
  if (correlated_keys)
    for (auto* plane : {&d.q, &d.k})
      for (auto& x : *plane) x = bf(-0.3f + 1.5f * ud(rng));
  for (auto& x : d.g1) x = bf(nd(rng));
  for (auto& x : d.b) x = bf(nd(rng));
  d.o.assign(d.tokens * d.o_stride, 0xFFFFu);
  // Realistic gates: exp(A_log) in [0.5, 2], g1 + dt_bias around -2, so per-step decays
  // range from about exp(-5) to almost 1 (and the bounded variant from exp(lb) to 1).
  for (int64_t h = 0; h < heads; ++h) d.a_log.push_back(std::log(0.5f + 1.5f * ud(rng)));
  for (int64_t c = 0; c < P; ++c) d.dt_bias.push_back(-2.0f + 0.5f * nd(rng));
  d.head_stride = 128 * 128 + 32;
  d.line_stride = heads * d.head_stride + 96;
  d.pool.resize(d.lines * d.line_stride);
  for (auto& x : d.pool) x = 0.3f * nd(rng);
  return d;
}

// The float64 reference on the same inputs; returns o (T, P) and updates a copy of the pool
// (given in the reference's (line, head, k, v) order).
struct Reference {
  kda::ref::Matrix o;
  std::vector<float> pool;  // (line, head, k, v)
};

// On `batch` (d's metadata or one with the same rows, e.g. kda::ref::truncated_batch of it).
Reference run_reference(const HostBatchData& d, const kda::ref::HostBatch& batch) {
  const int64_t P = d.heads * 128, T = d.qsl.back();
  auto plane = [&](const std::vector<uint16_t>& src) {
    return kda::ref::matrix_from_bf16(src.data(), T, P, d.plane_stride);
  };
  kda::ref::Matrix b = kda::ref::matrix_from_bf16(d.b.data() + d.b_offset, T, d.heads, d.b_stride);
  Reference r;
  r.pool.resize(d.pool.size());
  for (int64_t line = 0; line < d.lines; ++line)
    for (int64_t h = 0; h < d.heads; ++h)
      for (int kc = 0; kc < 128; ++kc)
        for (int vc = 0; vc < 128; ++vc)
          r.pool[((line * d.heads + h) * 128 + kc) * 128 + vc] = d.pool[d.pool_index(line, h, kc, vc)];
  r.o = kda::ref::prep_recurrence(plane(d.q), plane(d.k), plane(d.v), plane(d.g1), b,
                                  d.a_log.data(), d.dt_bias.data(), d.lower_bound, batch,
                                  kda::ref::StatePool::contiguous(r.pool.data(), d.heads),
                                  /*round_bf16=*/false);
  return r;
}
Reference run_reference(const HostBatchData& d) { return run_reference(d, d.host_batch()); }

// Compares the emulated op with the reference: per processed sequence, the o rows and the
// final state; everything else must be untouched, except the states of `checkpoint_lines`
// (which the caller checks).
void check_against_reference(const HostBatchData& before, const HostBatchData& after,
                             const Reference& ref, const std::vector<int>& checkpoint_lines = {}) {
  const int64_t P = before.heads * 128;
  for (size_t s = 0; s + 1 < before.qsl.size(); ++s) {
    const int64_t bos = before.qsl[s], eos = before.qsl[s + 1];
    const int line = before.cache[s];
    CAPTURE(s);
    CAPTURE(eos - bos);
    if (eos == bos || line == 0) continue;
    kda::test::RelError o_err, state_err;
    for (int64_t t = bos; t < eos; ++t)
      for (int64_t c = 0; c < P; ++c)
        o_err.add(kda::host::bf16_to_float(after.o[t * before.o_stride + c]), ref.o.at(t, c));
    for (int64_t h = 0; h < before.heads; ++h)
      for (int kc = 0; kc < 128; ++kc)
        for (int vc = 0; vc < 128; ++vc)
          state_err.add(after.pool[before.pool_index(line, h, kc, vc)],
                        ref.pool[((line * before.heads + h) * 128 + kc) * 128 + vc]);
    MESSAGE("sequence ", s, " (", eos - bos, " tokens): o error ", o_err.value(),
            ", state error ", state_err.value());
    CHECK(o_err.value() < 1e-2);
    CHECK(state_err.value() < 5e-3);
  }
  // o: rows of skipped sequences and rows past the batch, and the padding columns of every
  // row, keep their NaN poison.
  std::vector<bool> written(before.tokens, false);
  for (size_t s = 0; s + 1 < before.qsl.size(); ++s)
    if (before.cache[s] != 0)
      for (int64_t t = before.qsl[s]; t < before.qsl[s + 1]; ++t) written[t] = true;
  int64_t bad_rows = 0, bad_pad = 0;
  for (int64_t t = 0; t < before.tokens; ++t) {
    for (int64_t c = 0; c < before.o_stride; ++c) {
      const bool poisoned = after.o[t * before.o_stride + c] == 0xFFFFu;
      if (c >= P) bad_pad += !poisoned;
      else if (!written[t]) bad_rows += !poisoned;
    }
  }
  CHECK(bad_rows == 0);
  CHECK(bad_pad == 0);
  // Pool elements outside the states of processed sequences (lines nobody names, the gaps
  // between heads and lines) are bit-identical.
  std::vector<bool> state_element(before.pool.size(), false);
  for (size_t s = 0; s + 1 < before.qsl.size(); ++s) {
    if (before.qsl[s + 1] == before.qsl[s] || before.cache[s] == 0) continue;
    for (int64_t h = 0; h < before.heads; ++h)
      for (int kc = 0; kc < 128; ++kc)
        for (int vc = 0; vc < 128; ++vc) state_element[before.pool_index(before.cache[s], h, kc, vc)] = true;
  }
  for (int line : checkpoint_lines)
    for (int64_t h = 0; h < before.heads; ++h)
      for (int kc = 0; kc < 128; ++kc)
        for (int vc = 0; vc < 128; ++vc) state_element[before.pool_index(line, h, kc, vc)] = true;
  int64_t pool_changed = 0;
  for (size_t i = 0; i < before.pool.size(); ++i)
    if (!state_element[i] && std::memcmp(&after.pool[i], &before.pool[i], sizeof(float)) != 0) ++pool_changed;
  CHECK(pool_changed == 0);
}

// One sequence's checkpoints: ends first, first + interval, ... (count of them), into `lines`.
struct SeqCheckpoints {
  int seq, first, interval, count;
  std::vector<int> lines;
};

// Stages the checkpoint tables as the module does (common/state_checkpoints.h): one
// CheckpointSeq per sequence, the entries of each sequence consecutive, `spare` unused entries
// (line -1) at the end of the table.
void set_checkpoints(HostBatchData& d, const std::vector<SeqCheckpoints>& list, int spare) {
  d.checkpoint_seqs.assign(d.cache.size(), kda::CheckpointSeq{});
  d.checkpoint_entries.clear();
  for (const SeqCheckpoints& c : list) {
    REQUIRE(static_cast<int>(c.lines.size()) == c.count);
    d.checkpoint_seqs[c.seq] = {c.first, c.interval, c.count,
                                static_cast<int32_t>(d.checkpoint_entries.size())};
    for (int j = 0; j < c.count; ++j)
      d.checkpoint_entries.push_back({c.lines[j], c.seq, c.first + j * c.interval, 0});
  }
  for (int j = 0; j < spare; ++j) d.checkpoint_entries.push_back(kda::CheckpointEntry{});
}

// Every pool element becomes the NaN pattern of a 0xFF fill except the states of processed
// sequences that start from one: an element read without cause, or due to be written and not
// written, shows.
void poison_pool(HostBatchData& d) {
  std::vector<bool> keep(d.pool.size(), false);
  for (size_t s = 0; s + 1 < d.qsl.size(); ++s) {
    if (d.qsl[s + 1] == d.qsl[s] || d.cache[s] == 0 || !d.init[s]) continue;
    for (int64_t h = 0; h < d.heads; ++h)
      for (int kc = 0; kc < 128; ++kc)
        for (int vc = 0; vc < 128; ++vc) keep[d.pool_index(d.cache[s], h, kc, vc)] = true;
  }
  for (size_t i = 0; i < d.pool.size(); ++i)
    if (!keep[i]) std::memcpy(&d.pool[i], &kda::test::kPoison32, sizeof(float));
}

// Differing bits between the states (every head) of line `la` of `a` and line `lb` of `b`.
int64_t state_diff_bits(const HostBatchData& a, int64_t la, const HostBatchData& b, int64_t lb) {
  int64_t bits = 0;
  for (int64_t h = 0; h < a.heads; ++h)
    for (int kc = 0; kc < 128; ++kc)
      for (int vc = 0; vc < 128; ++vc) {
        uint32_t x, y;
        std::memcpy(&x, &a.pool[a.pool_index(la, h, kc, vc)], 4);
        std::memcpy(&y, &b.pool[b.pool_index(lb, h, kc, vc)], 4);
        bits += __builtin_popcount(x ^ y);
      }
  return bits;
}

// Differing bits between o rows [r0, r1) (P columns) of a and b.
int64_t o_diff_bits(const HostBatchData& a, const HostBatchData& b, int64_t r0, int64_t r1) {
  int64_t bits = 0;
  for (int64_t t = r0; t < r1; ++t)
    for (int64_t c = 0; c < a.heads * 128; ++c)
      bits += __builtin_popcount(static_cast<unsigned>(a.o[t * a.o_stride + c] ^ b.o[t * b.o_stride + c]));
  return bits;
}

// d with the metadata of `t` (the same rows, tokens and pool) and no checkpoints.
HostBatchData with_metadata(const HostBatchData& d, const kda::ref::TruncatedBatch& t) {
  HostBatchData r = d;
  r.qsl = t.query_start_loc;
  r.cache = t.cache_indices;
  for (size_t s = 0; s < r.init.size(); ++s) r.init[s] = t.has_initial_state[s];
  r.checkpoint_seqs.clear();
  r.checkpoint_entries.clear();
  return r;
}

}  // namespace

TEST_CASE("phase 1's short scalar forms follow float64 and the triangle map is the row-major one") {
  // The host stand-ins compute ex2 / lg2 / rcp with libm, so this checks the formulas
  // (softplus's series and branch, the flushing) and not the GPU's MUFU error, which the GPU
  // test's comparison with float64 covers. The measure is the error relative to max(1, value):
  // a gate enters the recurrence as a decay factor e^(c g), whose relative error is the
  // absolute error of c g (c = exp(A_log) for softplus, |lower_bound| for sigmoid). Relative
  // to tiny values the error is larger (e^x through 2^(x log2 e) carries the rounding of
  // x log2 e: ~3.5e-6 relative at |x| = 80), which moves no factor measurably.
  double worst_softplus = 0.0, worst_sigmoid = 0.0;
  for (int n = -800000; n <= 800000; ++n) {
    const float x = static_cast<float>(n) * 1e-4f;  // [-80, 80] in steps of 1e-4
    const double xd = x;
    const double sp = xd > 20.0 ? xd : std::log1p(std::exp(xd));
    const double sg = 1.0 / (1.0 + std::exp(-xd));
    const double got_sp = kda::chunked::softplus_fast(x);
    const double got_sg = kda::chunked::sigmoid_fast(x);
      worst_softplus = std::max(worst_softplus, std::fabs(got_sp - sp) / std::max(1.0, sp));
    worst_sigmoid = std::max(worst_sigmoid, std::fabs(got_sg - sg));
  }
  MESSAGE("worst error relative to max(1, value): softplus_fast ", worst_softplus, ", sigmoid_fast ", worst_sigmoid);
  CHECK(worst_softplus < 5e-7);
  CHECK(worst_sigmoid < 5e-7);
  CHECK(kda::chunked::softplus_fast(30.0f) == 30.0f);
  CHECK(kda::chunked::sigmoid_fast(-200.0f) == 0.0f);
  CHECK(kda::chunked::sigmoid_fast(200.0f) == 1.0f);
  CHECK(kda::chunked::exp2_nonpos(-130.0f) == 0.0f);  // subnormal results flush
  CHECK(kda::chunked::exp2_nonpos(0.0f) == 1.0f);
  int l = 0;
  for (int il = 0; il < 8; ++il)
    for (int jl = 0; jl <= il; ++jl, ++l) {
      CAPTURE(l);
      CHECK(kda::chunked::triangle_row(l) == il);
    }
}

TEST_CASE("the state update's row scale puts every row of U inside fp16's range") {
  using kda::chunked::fp16_scale_exponent;
  using kda::chunked::pow2f;
  // The largest |U| of a row lands in [2^14, 2^15) for row maxima in [2^-26, 2^114] ...
  for (int e = -26; e <= 114; ++e)
    for (float f : {1.0f, 1.5f, 1.99999988f}) {
      const float m = std::ldexp(f, e);
      const int k = fp16_scale_exponent(m);
      CAPTURE(m);
      const float scaled = m * pow2f(k), unit = pow2f(k) * pow2f(-k);
      CHECK(scaled >= 16384.0f);
      CHECK(scaled < 32768.0f);
      CHECK(unit == 1.0f);  // both normal: the rescale is exact
    }
  // ... and outside that the scale is clamped, so neither 2^k nor 2^-k leaves the normal range
  // and a row of zeros (padding) keeps finite, harmless scales.
  CHECK(fp16_scale_exponent(0.0f) == 40);
  CHECK(fp16_scale_exponent(1e-30f) == 40);
  CHECK(fp16_scale_exponent(1e38f) == -100);
  CHECK(fp16_scale_exponent(INFINITY) == -100);
  CHECK(pow2f(40) == std::ldexp(1.0f, 40));
  CHECK(pow2f(-100) == std::ldexp(1.0f, -100));
}

TEST_CASE("the emulated chunked kernels match the float64 reference on a varlen batch") {
  // Lengths around the chunk (64) and sub-block (16) edges, an empty sequence, a sequence on
  // the null line; initial states present and absent.
  const std::vector<int> lens = {1, 15, 16, 17, 0, 63, 64, 65, 9, 130};
  const std::vector<int> lines = {3, 1, 7, 2, 5, 4, 6, 9, 0, 8};
  const std::vector<int> init = {1, 0, 1, 0, 1, 1, 0, 1, 1, 0};
  for (bool bounded : {false, true}) {
    CAPTURE(bounded);
    MESSAGE(std::string(bounded ? "lower-bound gate" : "softplus gate"));
    const std::optional<double> lb = bounded ? std::optional<double>(-5.0) : std::nullopt;
    HostBatchData before = make_batch(/*heads=*/bounded ? 1 : 2, lens, lines, init, 20, lb, 11u + bounded);
    const Reference ref = run_reference(before);
    HostBatchData after = before;
    emulate_kda_chunked(after.args(), /*late_copies=*/bounded);
    check_against_reference(before, after, ref);
  }
}

TEST_CASE("emulated copies landing early or late give bit-identical results") {
  // A missing wait or barrier around the double-buffered stages (or around the publications
  // of phase 2's state warps) would make the two differ.
  const std::vector<int> lens = {200, 3};
  const std::vector<int> lines = {1, 2};
  const std::vector<int> init = {1, 0};
  HostBatchData early = make_batch(1, lens, lines, init, 0, std::nullopt, 5u);
  HostBatchData late = early;
  HostBatchData again = early;
  kda::RecurrenceArgs a_early = early.args(), a_late = late.args(), a_again = again.args();
  emulate_kda_chunked(a_early, false);
  emulate_kda_chunked(a_late, true);
  emulate_kda_chunked(a_again, false);
  CHECK(early.o == late.o);
  CHECK(std::memcmp(early.pool.data(), late.pool.data(), early.pool.size() * sizeof(float)) == 0);
  CHECK(early.o == again.o);
  CHECK(std::memcmp(early.pool.data(), again.pool.data(), early.pool.size() * sizeof(float)) == 0);
}

TEST_CASE("the emulated chunked kernels match the float64 reference with correlated keys") {
  // Positive-leaning q and k make the diagonal sub-blocks' entries (formed partly on CUDA
  // cores in fp32, partly as bf16 products) the largest of A and M'.
  const std::vector<int> lens = {64, 130, 17};
  const std::vector<int> lines = {2, 1, 3};
  const std::vector<int> init = {1, 0, 1};
  HostBatchData before = make_batch(1, lens, lines, init, 4, std::nullopt, 23u, /*correlated_keys=*/true);
  const Reference ref = run_reference(before);
  HostBatchData after = before;
  emulate_kda_chunked(after.args(), /*late_copies=*/false);
  check_against_reference(before, after, ref);
}

TEST_CASE("value channels 2^40 apart in magnitude keep their own accuracy (fp16 row scaling)") {
  // Each value channel vc evolves on its own (o[:, vc] and S[:, vc] depend on v[:, vc] and the
  // initial S[:, vc] only, linearly), so scaling v and the initial state of channel vc by
  // 2^e_vc scales its results by 2^e_vc exactly. Exponents from -20 to 20 are dealt so that
  // every 16-row tile of U^T holds the whole range: a scale shared by a tile (or a warp) would
  // push its small rows below fp16's range (2^-24) and lose them; the per-row scale of
  // update_state_f16 keeps each channel's relative error at the unscaled level.
  const std::vector<int> lens = {130, 64, 17};
  const std::vector<int> lines = {2, 1, 3};
  const std::vector<int> init = {1, 0, 1};
  HostBatchData before = make_batch(1, lens, lines, init, 3, std::nullopt, 31u);
  auto exponent = [](int vc) { return 5 * ((vc * 7) % 9) - 20; };
  for (int64_t t = 0; t < before.tokens; ++t)
    for (int vc = 0; vc < 128; ++vc) {
      uint16_t& x = before.v[t * before.plane_stride + vc];
      x = kda::host::float_to_bf16(std::ldexp(kda::host::bf16_to_float(x), exponent(vc)));
    }
  for (int64_t line = 0; line < before.lines; ++line)
    for (int kc = 0; kc < 128; ++kc)
      for (int vc = 0; vc < 128; ++vc) {
        float& s = before.pool[before.pool_index(line, 0, kc, vc)];
        s = std::ldexp(s, exponent(vc));
      }
  const Reference ref = run_reference(before);
  HostBatchData after = before;
  emulate_kda_chunked(after.args(), /*late_copies=*/false);
  double worst_o = 0, worst_state = 0;
  for (size_t s = 0; s < lens.size(); ++s) {
    const int64_t bos = before.qsl[s], eos = before.qsl[s + 1];
    const int line = before.cache[s];
    for (int vc = 0; vc < 128; ++vc) {
      kda::test::RelError o_err, state_err;
      for (int64_t t = bos; t < eos; ++t)
        o_err.add(kda::host::bf16_to_float(after.o[t * before.o_stride + vc]), ref.o.at(t, vc));
      for (int kc = 0; kc < 128; ++kc)
        state_err.add(after.pool[before.pool_index(line, 0, kc, vc)],
                      ref.pool[(line * 128 + kc) * 128 + vc]);
      worst_o = std::max(worst_o, o_err.value());
      worst_state = std::max(worst_state, state_err.value());
    }
  }
  MESSAGE("per value channel, worst relative error: o ", worst_o, ", state ", worst_state);
  CHECK(worst_o < 2e-2);
  CHECK(worst_state < 1e-2);
}

TEST_CASE("emulated state checkpoints are bitwise the states of runs cut there and continue bitwise") {
  // Sequence 0: 130 rows from an initial state, checkpoints every 64 rows (64, 128). 1: on the
  // null line (skipped; the host stages no checkpoints for it). 2: 192 rows from zeros, every
  // 128 rows from 64 (64 and 192, its last row and a chunk end). 3: 100 rows, one checkpoint
  // at its last row, inside a chunk. 4: 20 rows from an initial state, none. Two heads, so a
  // checkpoint line's head offset counts.
  const std::vector<int> lens = {130, 20, 192, 100, 20};
  const std::vector<int> lines = {3, 0, 1, 4, 2};
  const std::vector<int> init = {1, 1, 0, 0, 1};
  HostBatchData before = make_batch(/*heads=*/2, lens, lines, init, /*pad_tokens=*/7, std::nullopt, 41u);
  // Lines 0..5 exist (5 named by nobody); 6..10 take the checkpoints, 11 the continuation's,
  // 12 nobody's.
  before.lines = 13;
  before.pool.resize(before.lines * before.line_stride);
  poison_pool(before);
  set_checkpoints(before, {{0, 64, 64, 2, {6, 7}}, {2, 64, 128, 2, {8, 9}}, {3, 100, 0, 1, {10}}},
                  /*spare=*/3);
  std::vector<int> ck_lines;
  for (const kda::CheckpointEntry& e : before.checkpoint_entries)
    if (e.line >= 0) ck_lines.push_back(e.line);

  HostBatchData run = before;
  emulate_kda_chunked(run.args(), /*late_copies=*/true);
  // The op itself is unchanged by its checkpoints, and nothing outside the processed lines and
  // the checkpoint lines is written.
  check_against_reference(before, run, run_reference(before), ck_lines);

  // (a) Each checkpoint line holds bitwise the final state of the emulated kernels on the batch
  // cut at the checkpoint (the final state of the same run when the checkpoint is at the last
  // row); (c) it is within the chunked tolerance of the float64 reference on that cut batch.
  for (const kda::CheckpointEntry& e : before.checkpoint_entries) {
    if (e.line < 0) continue;
    const int64_t rows = before.qsl[e.seq + 1] - before.qsl[e.seq];
    CAPTURE(e.seq);
    CAPTURE(e.end);
    const kda::ref::TruncatedBatch cut = kda::ref::truncated_batch(before.host_batch(), e.seq, e.end);
    int64_t bits = 0;
    if (e.end == rows) {
      bits = state_diff_bits(run, e.line, run, before.cache[e.seq]);
    } else {
      HostBatchData alone = with_metadata(before, cut);
      emulate_kda_chunked(alone.args(), /*late_copies=*/false);
      bits = state_diff_bits(run, e.line, alone, before.cache[e.seq]);
    }
    const Reference ref = run_reference(before, cut.batch);
    kda::test::RelError err;
    for (int64_t h = 0; h < before.heads; ++h)
      for (int kc = 0; kc < 128; ++kc)
        for (int vc = 0; vc < 128; ++vc)
          err.add(run.pool[before.pool_index(e.line, h, kc, vc)],
                  ref.pool[((before.cache[e.seq] * before.heads + h) * 128 + kc) * 128 + vc]);
    MESSAGE("sequence ", e.seq, ", checkpoint after ", e.end, " of ", rows, " rows: ", bits,
            " bits differ from the cut run's final state; error vs float64 ", err.value());
    CHECK(bits == 0);
    CHECK(err.value() < 5e-3);
  }

  // (b) Continuing from a checkpoint: sequences 0 and 2 again from their checkpoint after 64
  // rows (has_initial_state on the checkpoint line), over their remaining rows. The tail is cut
  // into the same 64-token chunks as the uninterrupted run (checkpoints sit on chunk ends and
  // chunks start at a sequence's first row), phase 1's record of a chunk depends on the chunk's
  // tokens alone, and the state it starts from is the very fp32 state the uninterrupted run
  // carried into that chunk (stored and loaded without rounding): every operation, and so every
  // o row and the final state, repeats bit for bit. The tail's own checkpoint after 64 rows
  // (row 128 of sequence 0) likewise matches the uninterrupted run's.
  HostBatchData tail = run;
  const int32_t a0 = before.qsl[0] + 64, a1 = before.qsl[1];
  const int32_t b0 = before.qsl[2] + 64, b1 = before.qsl[3];
  // Entries: rows [0, a0) unowned (null line), sequence 0's tail, [a1, b0) unowned, sequence
  // 2's tail.
  tail.qsl = {0, a0, a1, b0, b1};
  tail.cache = {0, 6, 0, 8};
  tail.init = {0, 1, 0, 1};
  set_checkpoints(tail, {{1, 64, 0, 1, {11}}}, /*spare=*/1);
  std::fill(tail.o.begin(), tail.o.end(), kda::test::kPoison16);
  emulate_kda_chunked(tail.args(), /*late_copies=*/false);
  const int64_t o_bits = o_diff_bits(tail, run, a0, a1) + o_diff_bits(tail, run, b0, b1);
  const int64_t state_bits = state_diff_bits(tail, 6, run, 3) + state_diff_bits(tail, 8, run, 1);
  const int64_t ck_bits = state_diff_bits(tail, 11, run, 7);
  MESSAGE("continued from checkpoints: ", o_bits, " o bits, ", state_bits,
          " final-state bits and ", ck_bits, " checkpoint bits differ from the uninterrupted run");
  CHECK(o_bits == 0);
  CHECK(state_bits == 0);
  CHECK(ck_bits == 0);
  // The tail run writes its o rows, lines 6, 8 and 11, nothing else.
  int64_t o_changed = 0, pool_changed = 0;
  for (int64_t t = 0; t < before.tokens; ++t)
    for (int64_t c = 0; c < before.o_stride; ++c) {
      const bool tail_row = (t >= a0 && t < a1) || (t >= b0 && t < b1);
      if ((!tail_row || c >= before.heads * 128) && tail.o[t * before.o_stride + c] != kda::test::kPoison16)
        ++o_changed;
    }
  std::vector<bool> written(before.pool.size(), false);
  for (int line : {6, 8, 11})
    for (int64_t h = 0; h < before.heads; ++h)
      for (int kc = 0; kc < 128; ++kc)
        for (int vc = 0; vc < 128; ++vc) written[before.pool_index(line, h, kc, vc)] = true;
  for (size_t i = 0; i < before.pool.size(); ++i)
    if (!written[i] && std::memcmp(&tail.pool[i], &run.pool[i], sizeof(float)) != 0) ++pool_changed;
  CHECK(o_changed == 0);
  CHECK(pool_changed == 0);
}

TEST_CASE("emulated segments match the float64 reference; their checkpoints are bitwise the cut runs' lines") {
  // Segments of 128 rows (2 chunks). Sequence 0 (700 rows, 11 chunks, from an initial state)
  // has 6 segments: pass 1 walks its segment 0 and the summaries and transitions of segments
  // 1 .. 4, the scan takes 4 steps, pass 3 walks segments 1 .. 5 from the scanned states.
  // Sequence 3 (200 rows: 2 segments, no scan step), sequence 1 (100 rows, one segment, from
  // an initial state), an empty sequence 2.
  const std::vector<int> lens = {700, 100, 0, 200};
  const std::vector<int> lines = {1, 2, 3, 4};
  const std::vector<int> init = {1, 1, 0, 0};
  HostBatchData before = make_batch(/*heads=*/1, lens, lines, init, /*pad_tokens=*/5, std::nullopt, 77u);
  before.segment_tokens = 128;
  // Weak decay and small beta (per-token decays above exp(-0.01), beta about 0.05): a segment's
  // transition P keeps most of the state (with the batch's usual gates it keeps a few percent,
  // and a wrong start would fade below the tolerances within a segment).
  for (float& x : before.dt_bias) x = -7.0f;
  for (auto& x : before.b) x = kda::host::float_to_bf16(-3.0f);
  // Lines 0..4 exist; 5..7 take the checkpoints: sequence 0 after 192 rows (inside segment 1)
  // and 640 (the end of segment 4, whose start the scan gives), sequence 3 after 128 (the end
  // of its segment 0).
  before.lines = 8;
  before.pool.resize(before.lines * before.line_stride);
  poison_pool(before);
  set_checkpoints(before, {{0, 192, 448, 2, {5, 6}}, {3, 128, 0, 1, {7}}}, 0);
  HostBatchData run = before;
  emulate_kda_chunked(run.args(), /*late_copies=*/true);
  check_against_reference(before, run, run_reference(before), {5, 6, 7});

  for (const kda::CheckpointEntry& e : before.checkpoint_entries) {
    CAPTURE(e.seq);
    CAPTURE(e.end);
    const kda::ref::TruncatedBatch cut = kda::ref::truncated_batch(before.host_batch(), e.seq, e.end);
    HostBatchData alone = with_metadata(before, cut);
    emulate_kda_chunked(alone.args(), /*late_copies=*/false);
    const int64_t bits = state_diff_bits(run, e.line, alone, before.cache[e.seq]);
    MESSAGE("segmented, sequence ", e.seq, ", checkpoint after ", e.end, " rows: ", bits,
            " bits differ from the cut run's final state");
    CHECK(bits == 0);
  }

  // The same batch uncut: the segments change the rounding, not the result beyond it.
  HostBatchData uncut = before;
  uncut.segment_tokens = 0;
  emulate_kda_chunked(uncut.args(), /*late_copies=*/false);
  kda::test::RelError o_err, s_err;
  for (size_t i = 0; i < run.o.size(); ++i)
    if (run.o[i] != kda::test::kPoison16)
      o_err.add(kda::host::bf16_to_float(run.o[i]), kda::host::bf16_to_float(uncut.o[i]));
  for (int line : {1, 2, 4})
    for (int kc = 0; kc < 128; ++kc)
      for (int vc = 0; vc < 128; ++vc)
        s_err.add(run.pool[before.pool_index(line, 0, kc, vc)], uncut.pool[before.pool_index(line, 0, kc, vc)]);
  MESSAGE("segmented against uncut: o ", o_err.value(), ", final states ", s_err.value());
  CHECK(o_err.value() < 1e-2);
  CHECK(s_err.value() < 5e-3);
}

TEST_CASE("emulated segments of a batch of more than 32 sequences match the float64 reference") {
  // 40 sequences, so the windows' search over query_start_loc takes two radix levels: short
  // ones (one segment; some empty), and past the first 32 long ones cut into segments of 128
  // rows: 300 rows (3 segments, a scan step), 200 (2, on the null line: skipped), 257 (3) and
  // 129 (2, the second of one row). The batch starts at row 10 (query_start_loc[0] = 10), so
  // segment starts fall inside the windows of 128 rows, not on their bounds. Two heads.
  std::vector<int> lens, lines, init;
  for (int i = 0; i < 40; ++i) {
    lens.push_back(i % 7 == 2 ? 0 : 1 + (i * 13) % 40);  // 31, the last of the first 32, is not empty
    lines.push_back(i + 1);
    init.push_back(i % 2);
  }
  lens[33] = 300;
  lens[35] = 200;
  lines[35] = 0;
  lens[36] = 257;
  lens[39] = 129;
  HostBatchData before = make_batch(/*heads=*/2, lens, lines, init, /*pad_tokens=*/70, std::nullopt, 91u);
  for (int32_t& q : before.qsl) q += 10;
  before.segment_tokens = 128;
  for (float& x : before.dt_bias) x = -7.0f;  // weak decay: a wrong segment start shows
  for (auto& x : before.b) x = kda::host::float_to_bf16(-3.0f);
  HostBatchData run = before;
  emulate_kda_chunked(run.args(), /*late_copies=*/false);
  check_against_reference(before, run, run_reference(before));
}

TEST_CASE("an emulated bf16 pool holds the fp32 run's lines rounded to nearest even and is read widened") {
  // The kernels carry the state in fp32 whatever the pool holds: a bf16 line is widened when
  // loaded and the registers are rounded (state_float_to_bf16) when stored. So a run on a bf16
  // pool and a run on an fp32 pool whose lines hold the widened values of the same bf16 lines
  // compute the same fp32 state from the same start: o repeats bit for bit, and every line the
  // bf16 run writes (final states and checkpoints) is the fp32 run's line rounded, bit for bit.
  // Two heads and a pool with gaps between heads and lines, so that the element offsets of
  // the bf16 lines (2-byte elements) are checked at every level. Sequence 0: 130 rows from an
  // initial state, checkpoints at 64 and 128. 1: on the null line. 2: 64 rows from zeros. 3: 17
  // rows from an initial state, a checkpoint at its last row.
  const std::vector<int> lens = {130, 20, 64, 17};
  const std::vector<int> lines = {3, 0, 1, 2};
  const std::vector<int> init = {1, 1, 0, 1};
  HostBatchData fp32 = make_batch(/*heads=*/2, lens, lines, init, /*pad_tokens=*/5, std::nullopt, 53u);
  // Lines 0..4 exist (4 named by nobody); 5..7 take the checkpoints.
  fp32.lines = 8;
  fp32.pool.resize(fp32.lines * fp32.line_stride);
  poison_pool(fp32);
  set_checkpoints(fp32, {{0, 64, 64, 2, {5, 6}}, {3, 17, 0, 1, {7}}}, /*spare=*/1);
  const std::vector<int> ck_lines = {5, 6, 7};

  // The bf16 pool: the fp32 values rounded, the poison (NaN) as the 0xFFFF pattern of a 0xFF
  // fill. The fp32 run's pool: exactly those bf16 values widened (poison becomes 0xFFFF0000, a
  // NaN as well).
  HostBatchData bf16 = fp32;
  bf16.bf16_pool = true;
  bf16.pool_bf16.resize(fp32.pool.size());
  int64_t inexact = 0;  // initial elements that the rounding changed
  for (size_t i = 0; i < fp32.pool.size(); ++i) {
    const float x = fp32.pool[i];
    bf16.pool_bf16[i] = std::isnan(x) ? kda::test::kPoison16 : kda::state_float_to_bf16(x);
    fp32.pool[i] = kda::state_bf16_to_float(bf16.pool_bf16[i]);
    inexact += !std::isnan(x) && fp32.pool[i] != x;
  }
  bf16.pool.clear();  // the bf16 run must not touch an fp32 pool
  REQUIRE(inexact > 0);
  const HostBatchData fp32_before = fp32, bf16_before = bf16;

  emulate_kda_chunked(fp32.args(), /*late_copies=*/false);
  emulate_kda_chunked(bf16.args(), /*late_copies=*/true);
  // The fp32 run itself is the op (within the chunked tolerances of float64, nothing else
  // written), from the widened lines.
  check_against_reference(fp32_before, fp32, run_reference(fp32_before), ck_lines);

  int64_t o_bits = 0;
  for (size_t i = 0; i < fp32.o.size(); ++i)
    o_bits += __builtin_popcount(static_cast<unsigned>(fp32.o[i] ^ bf16.o[i]));
  // Elements the runs write: the states of processed sequences and the checkpoint lines.
  std::vector<bool> written(fp32.pool.size(), false);
  std::vector<int> written_lines = ck_lines;
  for (size_t s = 0; s < lens.size(); ++s)
    if (lens[s] > 0 && lines[s] != 0) written_lines.push_back(lines[s]);
  for (int line : written_lines)
    for (int64_t h = 0; h < fp32.heads; ++h)
      for (int kc = 0; kc < 128; ++kc)
        for (int vc = 0; vc < 128; ++vc) written[fp32.pool_index(line, h, kc, vc)] = true;
  // Each element of the bf16 pool: the fp32 run's value rounded where written, its starting
  // bits elsewhere (other lines and the gaps).
  int64_t written_off = 0, untouched_changed = 0, rounded = 0, written_count = 0;
  for (size_t i = 0; i < fp32.pool.size(); ++i) {
    if (written[i]) {
      ++written_count;
      written_off += bf16.pool_bf16[i] != kda::state_float_to_bf16(fp32.pool[i]);
      rounded += kda::state_bf16_to_float(bf16.pool_bf16[i]) != fp32.pool[i];
    } else {
      untouched_changed += bf16.pool_bf16[i] != bf16_before.pool_bf16[i];
    }
  }
  MESSAGE("bf16 pool: ", o_bits, " o bits differ from the fp32 run; ", written_off, " of ", written_count,
          " written elements differ from its lines rounded (", rounded, " of them inexact in bf16); ",
          untouched_changed, " other elements changed");
  CHECK(o_bits == 0);
  CHECK(written_off == 0);
  CHECK(untouched_changed == 0);
  CHECK(rounded > written_count / 2);  // the stores did round: the fp32 lines are not bf16 values
}
