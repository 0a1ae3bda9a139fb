// The chunked KDA recurrence: the same op as kda_prep_recurrence (docs/layer.md steps 4 and 5,
// same PrepRecurrenceArgs, state pools, varlen handling, skip rules and graph safety), computed
// 64 tokens at a time with the WY / UT form of the gated delta rule on tensor cores.
// CUDA-free: host code includes this header, the kernels live in kda_chunked.cu.
//
// Two phases on the caller's stream:
//   1. prep, one block per (chunk slot, head), all in parallel: per-token prep, the cumulative
//      log decay inside the chunk, A = strictly lower (beta_j k_i.k_j decayed), the solve of
//      (I + A) [W | Uv] = [k * exp(Gam) | v] (blocked, tf32 tensor cores), and the products
//      that need no state. It writes one record per (chunk slot, head) to the workspace.
//   2. state, one block per (sequence, head, 32-column value slice): carries the state across
//      the sequence's chunks in registers (fp32), O on bf16 and the state update on fp16
//      tensor cores (rows of U scaled into fp16's range), with a state warp and an output
//      warp per 16 value rows. The sequence's state checkpoints (PrepRecurrenceArgs) are
//      stored from the same registers at their chunk ends, so a checkpoint line is bitwise
//      the final line of a run cut there (in a bf16 pool too: the same registers rounded
//      alike). With an fp32 pool a run continued from it (has_initial_state) is bitwise the
//      uninterrupted one: the same 64-token chunks, the same records, the exact state. With a
//      bf16 pool it is not: it starts from the state rounded to bf16.
//      Sequence parallelism: with few heads (SMs idle) a long sequence is cut into segments
//      of PrepRecurrenceArgs::segment_tokens (or the op's choice) walked in parallel; phase 2
//      is then three launches: segment 0 and each other segment's summary (its end state
//      from zero, its 128 x 128 transition), a scan over segments that gives each segment
//      its true initial state, and the walks of segments 1.. (docs/design.md, "Segments").
//      Checkpoints stay bitwise the lines of runs cut there with the same segment length; a
//      run continued from one is then within tolerance of the uninterrupted run, not bitwise.
// Results are close to, not equal to, kda_prep_recurrence's (different rounding order,
// tensor-core operands); tests/layer states the error bounds against the float64 reference.
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

// Chunk length of the chunked recurrence (tokens); chunks start at each sequence's first token.
constexpr int64_t kKdaChunk = 64;
// PrepRecurrenceArgs::segment_tokens: the op picks the segment length.
constexpr int64_t kKdaAutoSegments = -1;

// Bytes of workspace kda_chunked needs for these capacities:
// ((num_tokens / 64) + num_seqs) chunk slots x num_heads x 90624 bytes, plus, when it cuts
// sequences into segments of L tokens, ((num_tokens / L) + num_seqs) x num_heads x 128 KB.
// Reads no device memory (with segment_tokens = kKdaAutoSegments it asks for the device's SM
// count).
// 0 when num_tokens or num_seqs is 0 (nothing to do).
std::size_t kda_chunked_workspace_bytes(const PrepRecurrenceArgs& args);

// True when kda_prep_recurrence_supported(args) holds and the chunk slots fit the grid;
// otherwise false with the reason in *why. Reads no device memory. The workspace is checked by
// kda_chunked itself.
bool kda_chunked_supported(const PrepRecurrenceArgs& args, std::string* why = nullptr);

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
void kda_chunked(const PrepRecurrenceArgs& args, void* workspace, std::size_t workspace_bytes,
                 Stream stream, KdaChunkedPhases phases = KdaChunkedPhases::Both);

}  // namespace kda
