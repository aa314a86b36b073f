// FastDeploy's update_inputs and stop checks over the engine's per-slot state
// on the CPU in one call (ops/cpu_update_inputs.cc), bound by the pybind11
// fast path (bindings.cc). The kernel is ops/include/update_inputs_kernel.h.
#pragma once

#include "paddle/extension.h"
#include "paddle_step_ops.h"

namespace paddle_step {

// cpu_update_inputs' tensors after `running` (bool [batch]: the slots not
// stopped before the step, which sets the batch), in its argument order:
// X(name, access). ran, stop_flags bool; tokens, step_idx, max_new_tokens,
// next_tokens int64; stop_ids, pre_ids, input_ids int64 [batch, width];
// seq_lens_* int32. Vectors are [batch] or [batch, 1].
#define PADDLE_STEP_CPU_UPDATE_INPUTS_TENSORS(X) \
  X(ran, kReadOnly)                              \
  X(tokens, kReadOnly)                           \
  X(step_idx, kWritten)                          \
  X(stop_ids, kReadOnly)                         \
  X(max_new_tokens, kReadOnly)                   \
  X(pre_ids, kWritten)                           \
  X(next_tokens, kWritten)                       \
  X(input_ids, kWritten)                         \
  X(seq_lens_this_time, kWritten)                \
  X(seq_lens_encoder, kWritten)                  \
  X(seq_lens_decoder, kWritten)                  \
  X(stop_flags, kWritten)

#define PADDLE_STEP_CPU_UPDATE_INPUTS_PARAMETER(name, access) \
  , TensorArgument<Access::access> name

// In place, for every slot of the batch. Every input is checked, and every
// slot's pre_ids column, before anything is written.
void CpuUpdateInputs(
    const paddle::Tensor& running PADDLE_STEP_CPU_UPDATE_INPUTS_TENSORS(
        PADDLE_STEP_CPU_UPDATE_INPUTS_PARAMETER));

}  // namespace paddle_step
