// The ops' C++ entry points on Paddle tensors. The registered static ops and
// the pybind11 fast path (bindings.cc) both call these, so both run the same
// validation and kernels.
#pragma once

#include <cstdint>

#include "input_checks.h"
#include "paddle/extension.h"

namespace paddle_step {

constexpr int kStepPaddleInputCount = 22;

// The dtype and shape checks alone, on views of the tensors in the op's
// input order (advance_step: 6, or 7 with `active`). Static mode runs them
// from Python while the program is built: an exception thrown by a kernel
// inside Paddle's program executor aborts the process instead of reaching
// Python.
void CheckAdvanceStepViews(const TensorView* views, int count,
                           int64_t num_seqs, int64_t num_queries,
                           int64_t block_size);
void CheckStepPaddleViews(const TensorView* views, int64_t block_size);

void AdvanceStep(const paddle::Tensor& input_tokens,
                 const paddle::Tensor& sampled_token_ids,
                 const paddle::Tensor& input_positions,
                 const paddle::Tensor& seq_lens,
                 const paddle::Tensor& slot_mapping,
                 const paddle::Tensor& block_tables,
                 const paddle::optional<paddle::Tensor>& active,
                 int64_t num_seqs, int64_t num_queries, int64_t block_size);

void StepPaddle(const paddle::Tensor& stop_flags,
                const paddle::Tensor& seq_lens_this_time,
                const paddle::Tensor& ori_seq_lens_encoder,
                const paddle::Tensor& seq_lens_encoder,
                const paddle::Tensor& seq_lens_decoder,
                const paddle::Tensor& block_tables,
                const paddle::Tensor& encoder_block_lens,
                const paddle::Tensor& is_block_step,
                const paddle::Tensor& step_block_list,
                const paddle::Tensor& step_lens,
                const paddle::Tensor& recover_block_list,
                const paddle::Tensor& recover_lens,
                const paddle::Tensor& need_block_list,
                const paddle::Tensor& need_block_len,
                const paddle::Tensor& used_list_len,
                const paddle::Tensor& free_list,
                const paddle::Tensor& free_list_len,
                const paddle::Tensor& input_ids,
                const paddle::Tensor& pre_ids,
                const paddle::Tensor& step_idx,
                const paddle::Tensor& next_tokens,
                const paddle::Tensor& first_token_ids, int64_t block_size,
                int64_t encoder_decoder_block_num);

}  // namespace paddle_step
