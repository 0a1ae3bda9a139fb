// The chunked KDA recurrence: the same op as kda_recurrence_token (docs/layer.md steps 4 and 5,
// same RecurrenceArgs, state pools, varlen handling, skip rules and graph safety), computed
// 64 tokens at a time with the WY / UT form of the gated delta rule on tensor cores.
// CUDA-free: host code includes this header. kda_chunked_plan.cpp is its plan (checks,
// workspace layout, the segment choice, params), its device code the block bodies of
// kda_chunked_kernel_prep.cuh (phase 1) and kda_chunked_kernel_state.cuh (phase 2) bound to the
// hardware in kda_chunked_kernel.cuh, kda_chunked.cu its launches.
//
// Two phases on the caller's stream:
//   1. prep, one block per (chunk slot, head), all in parallel: per-token prep, the cumulative
//      log decay inside the chunk, A = strictly lower (beta_j k_i.k_j decayed), the solve of
//      (I + A) [W | Uv] = [k * exp(Gam) | v] (blocked, tf32 tensor cores), and the products
//      that need no state. It writes one record per (chunk slot, head) to the workspace.
//   2. state, one block per (sequence, head, 64-column value slice): carries the state across
//      the sequence's chunks in registers (fp32), O on bf16 and the state update on fp16
//      tensor cores (rows of U scaled into fp16's range), with a state warp and an output
//      warp per 16 value rows. The sequence's state checkpoints (RecurrenceArgs) are
//      stored from the same registers at their chunk ends, so a checkpoint line is bitwise
//      the final line of a run cut there (in a bf16 pool too: the same registers rounded
//      alike). With an fp32 pool a run continued from it (has_initial_state) is bitwise the
//      uninterrupted one: the same 64-token chunks, the same records, the exact state. With a
//      bf16 pool it is not: it starts from the state rounded to bf16.
//      Sequence parallelism: with few heads (SMs idle) a long sequence is cut into segments
//      of RecurrenceArgs::segment_tokens (or the op's choice) walked in parallel; phase 2
//      is then three launches: segment 0 and each other segment's summary (its end state
//      from zero, its 128 x 128 transition), a scan over segments that gives each segment
//      its true initial state, and the walks of segments 1.. (docs/design.md, "Segments").
//      Checkpoints stay bitwise the lines of runs cut there with the same segment length; a
//      run continued from one is then within tolerance of the uninterrupted run, not bitwise.
// Results are close to, not equal to, kda_recurrence_token's (different rounding order,
// tensor-core operands); tests/recurrence states the error bounds against the float64
// reference.
//
// The workspace is asked for up front (CUTLASS style) and depends only on capacities
// (num_tokens, num_seqs, num_heads), never on the batch, so one allocation serves every
// replay of a captured graph.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "recurrence/kda_recurrence.h"

namespace kda {

// RecurrenceArgs::segment_tokens: the op picks the segment length.
constexpr int64_t kKdaAutoSegments = -1;

// Bytes of workspace kda_chunked needs for these capacities:
// ((num_tokens / 64) + num_seqs) chunk slots x num_heads x 90624 bytes, plus, when it cuts
// sequences into segments of L tokens, ((num_tokens / L) + num_seqs) x num_heads x 128 KB.
// Reads no device memory (with segment_tokens = kKdaAutoSegments it asks for the device's SM
// count).
// 0 when num_tokens or num_seqs is 0 (nothing to do).
std::size_t kda_chunked_workspace_bytes(const RecurrenceArgs& args);

// True when recurrence::args_supported(args) holds (the checks both kernels share), the chunk
// slots fit the grid and segment_tokens is kKdaAutoSegments, 0 or a power of two >= 64;
// otherwise false with the reason in *why. Reads no device memory. The workspace is checked by
// kda_chunked itself.
bool kda_chunked_supported(const RecurrenceArgs& args, std::string* why = nullptr);

// The segment length in tokens that kda_chunked picks for segment_tokens = kKdaAutoSegments
// with these capacities on the current device (docs/design.md, "Segments"), or 0 when it keeps
// every sequence whole. The bits of a sequence's results depend on its segment length: a caller
// that runs batches in buckets of several sizes passes this value for its largest bucket to all
// of them, so that a sequence is cut alike in every bucket (the module does). Asks the device
// for its SM count once per device; 0 without a device.
int64_t kda_chunked_auto_segment_tokens(int64_t num_tokens, int64_t num_heads);

// Which launches kda_chunked enqueues: both (the op), or one phase alone, for benchmarks
// (StateOnly reads the workspace a PrepOnly launch with the same arguments wrote).
enum class KdaChunkedPhases { Both, PrepOnly, StateOnly };

// Enqueues the launches on `stream`. `workspace` is device memory of at least
// kda_chunked_workspace_bytes(args) bytes, 16-byte aligned; its contents on entry do not
// matter and it is scratch afterwards. Throws kda::Error (and enqueues nothing) when the
// arguments are unsupported or the workspace is too small or misaligned. No host
// synchronisation, no allocation: capturable into a CUDA graph (after one eager launch per
// device, which opts the kernels into their shared-memory size).
void kda_chunked(const RecurrenceArgs& args, void* workspace, std::size_t workspace_bytes,
                 Stream stream, KdaChunkedPhases phases = KdaChunkedPhases::Both);

}  // namespace kda

// The plan (kda_chunked_plan.cpp): plain C++ that the launcher, the CPU tests and the
// emulation share. Segment lengths are in tokens throughout (0: sequences stay whole); only
// the params turn them into the kernels' chunk shift.
namespace kda::recurrence {

// Bytes of one (chunk slot, head) record of kda_chunked (chunked::Record::kBytes).
constexpr std::size_t kRecordBytes = 90624;
// Phase-2 blocks per (sequence or segment, head, walk role): value slices of 64 columns
// (chunked::StateTraits::kSlices), one block per SM; the segment cost model counts them.
constexpr int kStateSlices = 2;
// The shortest segment auto_segment_tokens picks: 16 chunks.
constexpr int64_t kMinAutoSegmentTokens = 16 * kKdaChunk;

// The segment length that kda_chunked picks for segment_tokens == kKdaAutoSegments on a
// device of `sm_count` SMs: the one with the smallest modelled phase-2 time for a single
// sequence of num_tokens, or 0 (no cut) when no cut saves a fifth of the uncut walk or
// sm_count is 0 (docs/design.md, "Segments", has the model). Host arithmetic only.
int64_t auto_segment_tokens(int64_t num_tokens, int64_t num_heads, int sm_count);

// The segment length kda_chunked runs `args` with on a device of sm_count SMs:
// args.segment_tokens rounded up to a power of two (64 << k) when set, auto_segment_tokens
// for kKdaAutoSegments, and 0 (no cut) for 0 or for segments at least as long as num_tokens.
int64_t segment_tokens_of(const RecurrenceArgs& args, int sm_count);

// The kernels' seg_chunk_shift for a segment length of segment_tokens_of(): log2 of its chunks,
// kNoSegments for 0.
int segment_chunk_shift(int64_t segment_tokens);

// kda_chunked's workspace for `args` cut into segments of `segment_tokens`
// (segment_tokens_of(); 0: not cut): the records, then the segment-end states E and
// transitions P.
struct ChunkedLayout {
  int seg_chunk_shift = kNoSegments;
  int64_t slots = 0, seg_slots = 0;
  std::size_t record_bytes = 0;  // slots x H x Record bytes
  std::size_t seg_bytes = 0;     // each of E and P: seg_slots x H x 64 KB (0 when not cut)
  std::size_t total() const { return record_bytes + 2 * seg_bytes; }
};
ChunkedLayout chunked_layout(const RecurrenceArgs& args, int64_t segment_tokens);

// kda_chunked_workspace_bytes on a device of sm_count SMs (read only for kKdaAutoSegments).
std::size_t chunked_workspace_bytes(const RecurrenceArgs& args, int sm_count);

// The params of kda_chunked's launches for `args` (which passed kda_chunked_supported()): the
// shared ones, the workspace and the segments of `segment_tokens` (segment_tokens_of()).
// Reads no device memory.
RecurrenceParams make_chunked_params(const RecurrenceArgs& args, void* workspace,
                                     int64_t segment_tokens);

}  // namespace kda::recurrence
