// The tensors of step_paddle, in FastDeploy's argument order. Every C++ list
// of them is generated from this one table: the op's signatures, its inputs,
// outputs and in-place map, validation, StepPaddleParams and the GPU
// harness's pointer order. Adding or retyping a tensor is one line here.
// No framework types, so the Paddle-free GPU harness (tests/gpu) uses it too.
#pragma once

#include <cstdint>
#include <type_traits>

// X(name, element type, shape kind, access). Shape kinds, B = batch size
// (stop_flags.shape[0]): kBatchVector [B] or [B, 1]; kBatchOnly [B];
// kBatchRows [B, any]; kList [any]; kCounter [1]. Access: kWritten (updated
// in place, an output of the static op) or kReadOnly.
#define PADDLE_STEP_STEP_PADDLE_TENSORS(X)                       \
  X(stop_flags, bool, kBatchVector, kWritten)                    \
  X(seq_lens_this_time, int32_t, kBatchVector, kWritten)         \
  X(ori_seq_lens_encoder, int32_t, kBatchVector, kReadOnly)      \
  X(seq_lens_encoder, int32_t, kBatchVector, kWritten)           \
  X(seq_lens_decoder, int32_t, kBatchVector, kWritten)           \
  X(block_tables, int32_t, kBatchRows, kWritten)                 \
  X(encoder_block_lens, int32_t, kBatchVector, kWritten)         \
  X(is_block_step, bool, kBatchOnly, kWritten)                   \
  X(step_block_list, int32_t, kBatchVector, kWritten)            \
  X(step_lens, int32_t, kCounter, kWritten)                      \
  X(recover_block_list, int32_t, kBatchVector, kWritten)         \
  X(recover_lens, int32_t, kCounter, kWritten)                   \
  /* need_block_list is also the kernels' needy-list scratch. */ \
  X(need_block_list, int32_t, kBatchVector, kWritten)            \
  X(need_block_len, int32_t, kCounter, kWritten)                 \
  X(used_list_len, int32_t, kBatchVector, kWritten)              \
  X(free_list, int32_t, kList, kWritten)                         \
  X(free_list_len, int32_t, kCounter, kWritten)                  \
  X(input_ids, int64_t, kBatchRows, kWritten)                    \
  X(pre_ids, int64_t, kBatchRows, kReadOnly)                     \
  X(step_idx, int64_t, kBatchVector, kReadOnly)                  \
  X(next_tokens, int64_t, kBatchVector, kReadOnly)               \
  X(first_token_ids, int64_t, kBatchVector, kWritten)

namespace paddle_step {

enum class ShapeKind { kBatchVector, kBatchOnly, kBatchRows, kList, kCounter };
enum class Access { kWritten, kReadOnly };

// A tensor's position in the op's argument order:
// step_paddle_tensor::block_tables, ...; kCount after the last.
namespace step_paddle_tensor {
#define PADDLE_STEP_INDEX(name, type, shape, access) name,
enum Index { PADDLE_STEP_STEP_PADDLE_TENSORS(PADDLE_STEP_INDEX) kCount };
#undef PADDLE_STEP_INDEX
}  // namespace step_paddle_tensor

constexpr int kStepPaddleTensorCount = step_paddle_tensor::kCount;

// The pointer a kernel takes to the data of a tensor with this access.
template <typename T, Access access>
using TensorPointer =
    std::conditional_t<access == Access::kWritten, T*, const T*>;

}  // namespace paddle_step
