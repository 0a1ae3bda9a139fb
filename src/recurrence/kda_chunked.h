// The chunked KDA recurrence: the same op as kda_prep_recurrence (spec steps 4 and 5, same
// PrepRecurrenceArgs, state pools, varlen handling, skip rules and graph safety), computed 64
// tokens at a time with the WY / UT form of the gated delta rule on tensor cores.
// CUDA-free: host code includes this header, the kernels live in kda_chunked.cu.
//
// Two launches on the caller's stream:
//   1. prep, one block per (chunk slot, head), all in parallel: per-token prep, the cumulative
//      log decay inside the chunk, A = strictly lower (beta_j k_i.k_j decayed), the solve of
//      (I + A) [W | Uv] = [k * exp(Gam) | v] (blocked, tf32 tensor cores), and the products
//      that need no state. It writes one record per (chunk slot, head) to the workspace.
//   2. state, one block per (sequence, head, 32-column value slice): carries the state across
//      the sequence's chunks in registers (fp32), O on bf16 and the state update on fp16
//      tensor cores (rows of U scaled into fp16's range); by default a state warp and an output
//      warp per 16 value rows (Specialized; the other forms in KdaStateKernel).
// Results are close to, not equal to, kda_prep_recurrence's (different rounding order,
// tensor-core operands): about 3e-3 relative Frobenius error on o (its own bf16 rounding is
// 1.7e-3) and 3e-4 .. 8e-4 on the final states against the float64 reference
// (docs/perf-notes-kda-core.md).
//
// The workspace is asked for up front (CUTLASS style) and depends only on capacities
// (num_tokens, max_seqs, num_heads), never on the batch, so one allocation serves every
// replay of a captured graph.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "recurrence/kda_recurrence.h"

namespace kda {

// Chunk length of the chunked recurrence (tokens); chunks start at each sequence's first token.
constexpr int64_t kKdaChunk = 64;

// Bytes of workspace kda_chunked needs for these capacities:
// ((num_tokens / 64) + max_seqs) chunk slots x num_heads x 90624 bytes. Reads no device
// memory.
// 0 when num_tokens or max_seqs is 0 (nothing to do).
std::size_t kda_chunked_workspace_bytes(const PrepRecurrenceArgs& args);

// True when kda_prep_recurrence_supported(args) holds and the grids fit; otherwise false with
// the reason in *why. Reads no device memory. The workspace is checked by kda_chunked itself.
bool kda_chunked_supported(const PrepRecurrenceArgs& args, std::string* why = nullptr);

// Which launches kda_chunked enqueues: both (the op), or one phase alone, for benchmarks
// (StateOnly reads the workspace a PrepOnly launch with the same arguments wrote).
enum class KdaChunkedPhases { Both, PrepOnly, StateOnly };

// Which phase-2 kernel runs (same records, same results up to the summation order of the key
// channels; docs/perf-notes-kda-core.md):
//   KSplit   two warps per 16 value rows, 64 key channels each, exchanging their partial U and
//            O per chunk through shared memory;
//   Unsplit  the KSplit body with one warp per 16 value rows (its unrolled record copies and
//            single barrier per chunk, no exchange). Measured on the H200: 599 us against
//            KSplit's 651 for one 16384-token sequence at 12 heads (the case where phase 2 is
//            the critical path), within 2% of it elsewhere, and bit-identical to Original;
//   Original the first kernel (one warp per 16 value rows and all 128 channels), kept for
//            comparison;
//   Specialized  (default) Unsplit's work in two warps per 16 value rows: a state warp (S, U
//            and the state update) and an output warp (O and the o rows), which gets the state
//            warp's bf16 S0 and U fragments through shared memory; the state warp's chain per
//            chunk drops from 148 bf16 + 64 fp16 mma to 64 + 64, and the output warps do the
//            record copies. Bit-identical to Unsplit and Original. Measured on the H200: 441.5
//            us against Unsplit's 531 (one 16384-token sequence, 12 heads), 3-6% faster
//            elsewhere.
enum class KdaStateKernel { KSplit, Unsplit, Original, Specialized };
// The enumerator's name ("KSplit", ...), for logs and test output.
const char* kda_state_kernel_name(KdaStateKernel kernel);

// Enqueues the launches on `stream`. `workspace` is device memory of at least
// kda_chunked_workspace_bytes(args) bytes, 16-byte aligned; its contents on entry do not
// matter and it is scratch afterwards. Throws kda::Error (and enqueues nothing) when the
// arguments are unsupported or the workspace is too small or misaligned. No host
// synchronisation, no allocation: capturable into a CUDA graph (after one eager launch per
// device, which opts the kernels into their shared-memory size).
void kda_chunked(const PrepRecurrenceArgs& args, void* workspace, std::size_t workspace_bytes,
                 Stream stream, KdaChunkedPhases phases = KdaChunkedPhases::Both,
                 KdaStateKernel state_kernel = KdaStateKernel::Specialized);

}  // namespace kda
