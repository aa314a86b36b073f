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

// The dtype and shape checks alone, on views of the tensors in the op's
// input order (advance_step: 6, or 7 with `active`). Static mode runs them
// from Python while the program is built: an exception thrown by a kernel
// inside Paddle's program executor aborts the process instead of reaching
// Python.
void CheckAdvanceStepViews(const TensorView* views, int count, int64_t num_seqs,
                           int64_t num_queries, int64_t block_size);
void CheckStepPaddleViews(const TensorView* views, int64_t block_size);

void AdvanceStep(paddle::Tensor& input_tokens,
                 const paddle::Tensor& sampled_token_ids,
                 paddle::Tensor& input_positions, paddle::Tensor& seq_lens,
                 paddle::Tensor& slot_mapping,
                 const paddle::Tensor& block_tables,
                 const paddle::optional<paddle::Tensor>& active,
                 int64_t num_seqs, int64_t num_queries, int64_t block_size);

void StepPaddle(PADDLE_STEP_STEP_PADDLE_TENSORS(PADDLE_STEP_TENSOR_PARAMETER)
                    int64_t block_size,
                int64_t encoder_decoder_block_num);

}  // namespace paddle_step
