// FastDeploy's update_inputs and stop checks over the engine's per-slot state
// on the CPU in one call (ops/cpu_update_inputs.cc), bound by the pybind11
// fast path (bindings.cc). The kernel is ops/include/update_inputs_kernel.h.
#pragma once

#include "paddle/extension.h"

namespace paddle_step {

// In place, for every slot b of the batch: running, ran, stop_flags bool;
// tokens, step_idx, max_new_tokens, next_tokens int64; stop_ids, pre_ids,
// input_ids int64 [batch, width]; seq_lens_* int32. Vectors are [batch] or
// [batch, 1]. Every input is checked, and every slot's pre_ids column, before
// anything is written.
void CpuUpdateInputs(const paddle::Tensor& running, const paddle::Tensor& ran,
                     const paddle::Tensor& tokens, paddle::Tensor& step_idx,
                     const paddle::Tensor& stop_ids,
                     const paddle::Tensor& max_new_tokens,
                     paddle::Tensor& pre_ids, paddle::Tensor& next_tokens,
                     paddle::Tensor& input_ids,
                     paddle::Tensor& seq_lens_this_time,
                     paddle::Tensor& seq_lens_encoder,
                     paddle::Tensor& seq_lens_decoder,
                     paddle::Tensor& stop_flags);

}  // namespace paddle_step
