// The ops' C++ entry points on Paddle tensors. The registered static ops and
// the pybind11 fast path (bindings.cc) both call these, so both run the same
// validation and kernels.
#pragma once

#include <cstdint>
#include <type_traits>

#include "input_checks.h"
#include "paddle/extension.h"
#include "step_paddle_tensors.h"

namespace paddle_step {

// How an entry point takes a tensor: one it writes as a non-const reference
// (Paddle's form for an in-place input), one it only reads as const.
template <Access access>
using TensorArgument =
    std::conditional_t<access == Access::kWritten, paddle::Tensor&,
                       const paddle::Tensor&>;

// The tensor parameters of StepPaddle, in the table's order.
#define PADDLE_STEP_TENSOR_PARAMETER(name, type, shape, access) \
  TensorArgument<Access::access> name,

// Runs an op's kernel where `on` lies (SamePlace has checked: the CPU, or a
// GPU in a CUDA build): `cpu()`, or the CUDA launch `launch(stream)` on the
// tensor's stream, a failed launch raised as op_name's. `launch` is a generic
// lambda: a CPU build, which declares no launcher, never instantiates it.
template <typename Cpu, typename Launch>
void RunOnPlace([[maybe_unused]] const char* op_name, const paddle::Tensor& on,
                Cpu cpu, [[maybe_unused]] Launch launch) {
  if (on.is_cpu()) {
    cpu();
    return;
  }
#ifdef PADDLE_STEP_WITH_CUDA
  ThrowIfLaunchFailed(op_name, launch(on.stream()));
#endif
}

// The dtype and shape checks alone, on views of the tensors in the op's
// input order (advance_step: 6, or 7 with `active`). Static mode runs them
// from Python while the program is built: an exception thrown by a kernel
// inside Paddle's program executor aborts the process instead of reaching
// Python.
void CheckAdvanceStepViews(const TensorView* views, int count, int64_t num_seqs,
                           int64_t num_queries, int64_t block_size);
void CheckStepPaddleViews(const TensorView* views, int64_t block_size);

// advance_step's tensors before the optional `active`, in the op's input
// order: X(name, access).
#define PADDLE_STEP_ADVANCE_STEP_TENSORS(X) \
  X(input_tokens, kWritten)                 \
  X(sampled_token_ids, kReadOnly)           \
  X(input_positions, kWritten)              \
  X(seq_lens, kWritten)                     \
  X(slot_mapping, kWritten)                 \
  X(block_tables, kReadOnly)

#define PADDLE_STEP_ADVANCE_STEP_PARAMETER(name, access) \
  TensorArgument<Access::access> name,

void AdvanceStep(
    PADDLE_STEP_ADVANCE_STEP_TENSORS(PADDLE_STEP_ADVANCE_STEP_PARAMETER)
        const paddle::optional<paddle::Tensor>& active,
    int64_t num_seqs, int64_t num_queries, int64_t block_size);

void StepPaddle(PADDLE_STEP_STEP_PADDLE_TENSORS(PADDLE_STEP_TENSOR_PARAMETER)
                    int64_t block_size,
                int64_t encoder_decoder_block_num);

}  // namespace paddle_step
