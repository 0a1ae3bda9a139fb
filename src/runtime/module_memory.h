// Every allocation a PrefillModule makes at construction, sized in one place: the constructor
// (PrefillModule::Impl, LayerProgram) allocates from this plan, kda::module_memory turns it into
// the public table that prefill_driver --validate prints, and a CPU test holds
// docs/design.md's buffer table to it. Plain C++ (no CUDA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kda/config.h"
#include "kda/prefill.h"

namespace kda::detail {

// Pinned host copies of the metadata staging: the host may stage this many forwards ahead of
// the GPU before begin_forward waits (docs/design.md, "Metadata staging").
constexpr int kHostStagingCopies = 4;

// The module-owned scratch buffers a built-in step uses (LayerProgram's step table names them;
// the plan allocates each one some enabled step uses).
enum ScratchBuffer : unsigned {
  kScratchG1 = 1u << 0,                // g1 = f_a f_b^T
  kScratchG2 = 1u << 1,                // g2 = g_a g_b^T
  kScratchO = 1u << 2,                 // the recurrence output o
  kScratchY = 1u << 3,                 // the gated RMSNorm output y
  kScratchChunkedWorkspace = 1u << 4,  // kda_chunked's records (and segment states)
};

struct MemoryPlan {
  int64_t windows = 0;      // window slots: ceil(batch_token_capacity / largest bucket)
  int64_t padded_rows = 0;  // windows x largest bucket: every window's bucket rows exist
  // The chunked recurrence's segment length for every bucket and window (0: sequences stay
  // whole): the op's choice for the largest bucket on a device of the plan's SM count, so a
  // sequence is cut alike in whichever bucket or window runs it (docs/design.md, "Segments").
  int64_t segment_tokens = 0;

  // Device buffers of the layer program, bytes (0: not allocated). hidden and output:
  // (padded_rows, D) bf16; in_proj_out: (B, in_proj_stride) bf16; planes: (3, capacity, P) bf16
  // plus the rows the last window's bucket reaches past plane 2's capacity; the scratch
  // (B, P) bf16 each, only for the steps that need it (LayerProgram's step table).
  std::size_t hidden = 0, output = 0, in_proj_out = 0, planes = 0;
  std::size_t g1 = 0, g2 = 0, o = 0, y = 0;
  std::size_t gemm_workspace = 0, chunked_workspace = 0;
  // The module's: one staging slot per window on the device; kHostStagingSlots pinned host
  // copies of all slots and one pinned padding slot; per layer, the two pools unless
  // pools.external.
  std::size_t staging_slot = 0, staging_device = 0, staging_host = 0, padding_slot = 0;
  int host_staging_copies = 0;
  std::size_t conv_pool = 0, recurrent_pool = 0;

  // The table kda::module_memory returns: one row per allocation, in the order the
  // constructor makes them, with how its size comes from the config.
  std::vector<ModuleAllocation> table(const Config& config) const;
};

// The plan for a valid config on a device of `sm_count` multiprocessors (0: no sequence is
// cut, as on a machine without a device).
MemoryPlan plan_memory(const Config& config, int sm_count);

}  // namespace kda::detail
