// The layer program of the prefill module: the buffers one layer's steps run on (allocated from
// the MemoryPlan), the cuBLASLt plans of its four GEMMs, the built-in step table, and every
// StepInputs -> kernel-arguments adapter. It knows nothing of batches, windows' metadata
// contents, graphs or pools: those are the module's (forward.cpp); it gets them through
// StepInputs. docs/design.md, "How to add a step", says what a new step touches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/device_memory.h"
#include "common/state_checkpoints.h"
#include "conv/conv_checkpoint.h"
#include "kda/config.h"
#include "kda/packed_conv.h"
#include "kda/prefill.h"
#include "norm/gated_rmsnorm.h"
#include "recurrence/kda_recurrence.h"
#include "runtime/batch_plan.h"
#include "runtime/gemm_plan.h"
#include "runtime/module_memory.h"
#include "runtime/state_pools.h"

namespace kda::detail {

// Everything a built-in step reads, for one (layer, window): the StepContext that user steps
// see too, and the module-owned scratch that only built-in steps use. Built-in steps take every
// pointer from here and only shapes and GEMM plans from the program: one channel, so a step's
// graph records exactly what its StepInputs named.
struct StepInputs {
  StepContext ctx;
  // The window's state checkpoints (runtime.max_checkpoints > 0, else null): per sequence
  // (max_seqs) and per checkpoint (max_checkpoints; line -1 when unused), window-local
  // (docs/design.md, "State checkpoints").
  const CheckpointSeq* checkpoint_seqs = nullptr;
  const CheckpointEntry* checkpoint_entries = nullptr;
  int64_t segment_tokens = 0;  // the chunked recurrence's segment length (MemoryPlan)
  // (ctx.bucket_tokens, P) bf16 scratch with row stride P, shared by layers and windows:
  // g1 = f_a f_b^T, g2 = g_a g_b^T, the recurrence output o and the gated-RMSNorm output y.
  void* g1 = nullptr;
  void* g2 = nullptr;
  void* o = nullptr;
  void* y = nullptr;
  void* gemm_workspace = nullptr;
  std::size_t gemm_workspace_bytes = 0;
  void* chunked_workspace = nullptr;  // kda_chunked's records (runtime.recurrence: chunked)
  std::size_t chunked_workspace_bytes = 0;
};

// The kernel arguments of the conv, recurrence and norm steps. Plain C++ reading only the
// inputs and ctx.config, so the module's layout is testable on the CPU:
//  - conv: the Q|K|V columns of ctx.in_proj_out (row stride in_proj_stride()) into the planes
//    q, k, v (plane stride batch_token_capacity() x P), the layer's conv pool (ctx.conv_strides);
//  - recurrence: planes (row stride P), g1, the b columns of ctx.in_proj_out (offset 3P), the
//    recurrent pool (ctx.recurrent_strides), o;
//  - norm: o, g2, the norm weight, y;
//  - conv checkpoints: the conv's x and pool, and the window's checkpoint entries (the
//    recurrence gets the per-sequence records and the entries too).
PackedConvArgs conv_args_for_step(const StepContext& ctx);
ConvCheckpointArgs conv_checkpoint_args_for_step(const StepInputs& in);
RecurrenceArgs recurrence_args_for_step(const StepInputs& in);
GatedRmsNormArgs rmsnorm_args_for_step(const StepInputs& in);


// A row-major bf16 GEMM C (M x n) = A (M x k) @ W (n x k)^T whose W is caller-owned (16-byte
// aligned, as set_layer_weights requires) and whose A and C start at the given alignments.
GemmShape weight_gemm_shape(int64_t n, int64_t k, int64_t lda, int64_t ldc, uint32_t align_a, uint32_t align_c);

// Largest power of two <= 256 dividing `bytes`: the alignment of a buffer offset.
uint32_t pow2_alignment(std::size_t bytes);

class LayerProgram {
 public:
  // Allocates every buffer of `plan` (zeroed) and builds the GEMM plans on the current device.
  // `config` is validated and, like `plan` (plan_memory(config, ...)), outlives the program.
  LayerProgram(const Config& config, const MemoryPlan& plan);

  // The scratch buffers (ScratchBuffer bits) the built-in steps enabled by `config` use.
  static unsigned scratch_needed(const Config& config);
  LayerProgram(const LayerProgram&) = delete;
  LayerProgram& operator=(const LayerProgram&) = delete;

  const Config& config() const { return config_; }
  bool full_layer() const { return config_.runtime.layer_steps == LayerSteps::Full; }
  bool chunked() const { return full_layer() && config_.runtime.recurrence == Recurrence::Chunked; }

  // Shapes.
  int64_t D = 0, P = 0, H = 0;
  int64_t in_cols = 0, in_stride = 0;  // W_in and the in_proj output's row stride
  int64_t B = 0;            // largest bucket: rows per window
  int64_t capacity = 0;     // runtime.batch_token_capacity()
  int64_t windows_max = 0;  // window slots
  int64_t padded_rows = 0;  // windows_max * B >= capacity: every window's bucket rows exist

  // Buffers (bf16). hidden and output: (padded_rows, D); in_proj_out: (B, in_proj_stride), shared
  // by layers and windows; planes: (3, capacity, P) plus the tail that the last window's bucket
  // rows of plane 2 reach.
  DeviceBuffer hidden, output, in_proj_out, planes;

  // Every device buffer the program owns, named (external pools must not overlap any of them).
  struct NamedBuffer {
    const char* name;
    const DeviceBuffer* buffer;
  };
  std::vector<NamedBuffer> buffers() const;

  // The inputs of window `window`'s steps for `layer` at `bucket` rows, with the window's staging
  // slot (StagingLayout), the layer's weights and pools.
  StepInputs inputs(int layer, int window, int64_t bucket, const char* staging_slot, const StagingLayout& staging,
                    const LayerWeights* weights, void* conv_pool, const ConvStateStrides& conv_strides,
                    void* recurrent_pool, const RecurrentStateStrides& recurrent_strides) const;

  // The enabled built-in steps in recorded order (the step table in layer_program.cpp):
  // in_proj GEMM, the conv checkpoints (only with runtime.max_checkpoints > 0: they read the
  // sequences' conv lines before the packed conv rewrites them), packed conv, and with
  // layer_steps: full the gate GEMMs, prep + recurrence (which writes the recurrent
  // checkpoints), gated RMSNorm and o_proj.
  int num_steps() const { return static_cast<int>(steps_.size()); }
  const char* step_name(int i) const { return steps_[i]->name; }
  void run_step(int i, const StepInputs& in, Stream stream) const { (this->*steps_[i]->run)(in, stream); }

  // The first enabled step whose supported() check refuses `in`, and why; step is null when
  // every step can run it. Reads no device memory.
  struct Unsupported {
    const char* step = nullptr;
    std::string why;
  };
  Unsupported why_unsupported(const StepInputs& in) const;

 private:
  // One row of the step table: everything the program knows of a built-in step.
  struct BuiltinStep {
    const char* name;                    // as profile_steps and errors name it
    bool (*enabled)(const Config&);      // whether the config's layer has the step
    unsigned scratch;                    // ScratchBuffer bits it writes or reads
    // Its kernels' supported() check on the step's arguments (null: nothing to check).
    bool (LayerProgram::*supported)(const StepInputs&, std::string* why) const;
    void (LayerProgram::*run)(const StepInputs&, Stream) const;  // enqueues it
  };
  static const BuiltinStep kBuiltinSteps[];

  bool conv_checkpoints_supported(const StepInputs& in, std::string* why) const;
  bool conv_supported(const StepInputs& in, std::string* why) const;
  bool recurrence_supported(const StepInputs& in, std::string* why) const;
  bool rmsnorm_supported(const StepInputs& in, std::string* why) const;
  void run_in_proj(const StepInputs& in, Stream stream) const;
  void run_conv_checkpoints(const StepInputs& in, Stream stream) const;
  void run_conv(const StepInputs& in, Stream stream) const;
  void run_gates(const StepInputs& in, Stream stream) const;
  void run_recurrence(const StepInputs& in, Stream stream) const;
  void run_rmsnorm(const StepInputs& in, Stream stream) const;
  void run_o_proj(const StepInputs& in, Stream stream) const;

  const Config& config_;
  int64_t f_a_col_ = 0, g_a_col_ = 0;  // first columns of f_a and g_a in the in_proj output
  DeviceBuffer g1_, g2_, o_, y_, gemm_workspace_, chunked_workspace_;
  LtHandle lt_;
  // in_proj over the unpadded width W_in, and over the padded width for weights padded to
  // in_proj_stride() (LayerWeights::in_proj_rows); the latter is null when the widths agree.
  std::unique_ptr<GemmPlan> in_proj_gemm_, in_proj_gemm_padded_, g1_gemm_, g2_gemm_, o_proj_gemm_;
  const MemoryPlan& plan_;
  std::vector<const BuiltinStep*> steps_;  // the enabled rows of kBuiltinSteps, in order
};

}  // namespace kda::detail
