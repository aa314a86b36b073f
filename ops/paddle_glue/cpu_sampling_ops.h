// The CPU sampling step's entry points on Paddle tensors (ops/cpu_sampling.cc),
// bound by the pybind11 fast path (bindings.cc). The kernel is
// ops/include/cpu_sampling_kernel.h, whose header states the semantics.
#pragma once

#include <cstdint>
#include <vector>

#include "paddle/extension.h"

namespace paddle_step {

// CpuSample's optional tensors, in its argument order.
#define PADDLE_STEP_CPU_SAMPLE_OPTIONAL_TENSORS(X)                           \
  X(top_k) X(min_p) X(uniforms) X(allowed_bits) X(stop_ids) X(min_tokens)  \
  X(step_idx) X(output_ids) X(bias_ids) X(bias_values) X(presence_penalty) \
  X(frequency_penalty) X(repetition_penalty) X(prompt_ids)

#define PADDLE_STEP_OPTIONAL_TENSOR_PARAMETER(name) \
  const paddle::optional<paddle::Tensor>& name,

// One token per row of `logits` float32 [B, V] (rows may be a column slice's:
// contiguous, any distance apart), under each row's controls; every optional
// one left none is off for the whole batch:
//   temperature, top_p float32 [B]; top_k int64 [B]; min_p float32 [B];
//   uniforms float64 [B] (none: every row greedy);
//   allowed_bits int32 [B, ceil(V / 32)], bit j of word w allowing token
//     32 w + j;
//   stop_ids int64 [B, S] masked while step_idx < min_tokens (int64 [B]);
//   output_ids int64 [B, L]: row r's generated tokens are columns
//     1 .. step_idx[r] (int64 [B]), for the penalties;
//   bias_ids int64 [B, K] and bias_values float32 [B, K] (column slices fine);
//   presence_penalty and frequency_penalty float32 [B] (both or neither);
//   repetition_penalty float32 [B], over output_ids and prompt_ids int64
//     [B, P] (each row's prompt, up to its first -1 pad).
// Returns {tokens int64 [B]}, and with top_logprobs >= 0 also the raw
// logits' logprobs: {chosen float32 [B], top_ids int64 [B, N], top_values
// float32 [B, N]} (N = top_logprobs <= V).
std::vector<paddle::Tensor> CpuSample(
    const paddle::Tensor& logits, const paddle::Tensor& temperature,
    const paddle::Tensor& top_p,
    PADDLE_STEP_CPU_SAMPLE_OPTIONAL_TENSORS(
        PADDLE_STEP_OPTIONAL_TENSOR_PARAMETER) int64_t top_logprobs);

// The raw logprobs of given tokens (prompt positions) of `logits` float32
// [R, V] (contiguous rows, any distance apart), tokens int64 [R] in [0, V):
// {chosen float32 [R], top_ids int64 [R, N], top_values float32 [R, N],
// ranks int64 [R]} (N = top_logprobs in 0 .. V; a rank counts the tokens
// whose logprob is at least the token's, itself included).
std::vector<paddle::Tensor> CpuTokenLogprobs(const paddle::Tensor& logits,
                                             const paddle::Tensor& tokens,
                                             int64_t top_logprobs);

}  // namespace paddle_step
