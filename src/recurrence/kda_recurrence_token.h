// kda_recurrence_token: the KDA recurrence token by token (docs/layer.md steps 4 and 5), the
// reference path of the two kernels of kda_recurrence.h. One block per (sequence, head, value
// slice of 32 columns); the grid is (varlen.num_seqs, H x 4), capacities only. Its plan is the
// op's shared one (kda_recurrence_plan.cpp), its device code kda_recurrence_token_kernel.cuh.
// CUDA-free.
#pragma once

#include <string>

#include "kda/types.h"
#include "recurrence/kda_recurrence.h"

namespace kda {

// True when kda_recurrence_token can run `args` (recurrence::args_supported: the checks both
// kernels share, bounded by this kernel's grid); otherwise false with the reason in *why. Reads
// no device memory.
bool kda_recurrence_token_supported(const RecurrenceArgs& args, std::string* why = nullptr);

// Enqueues the kernel on `stream`. Throws kda::Error (and enqueues nothing) when
// kda_recurrence_token_supported() is false. No host synchronisation, no allocation:
// capturable into a CUDA graph. segment_tokens is ignored (sequences are walked whole).
void kda_recurrence_token(const RecurrenceArgs& args, Stream stream);

}  // namespace kda
