// cpu_update_inputs: validation of the slot state and the per-slot loop of
// FastDeploy's update_inputs on the CPU. One call replaces some twenty eager
// Paddle ops of a decode step (ModelRunner.update_inputs keeps them for other
// devices). The kernel is ops/include/update_inputs_kernel.h.
#include <string>

#include "cpu_update_inputs_ops.h"
#include "input_checks.h"
#include "update_inputs_kernel.h"

namespace paddle_step {
namespace {

constexpr InputChecker kCheck("cpu_update_inputs");

void CheckVector(const char* name, const paddle::Tensor& tensor,
                 paddle::DataType dtype, int64_t batch) {
  kCheck.Dtype(name, ViewOf(tensor), {dtype});
  kCheck.BatchVector(name, ViewOf(tensor), batch);
  kCheck.DenseCpu(name, tensor);
}

// An int64 [batch, width] table with width >= 1; returns the width.
int64_t CheckTable(const char* name, const paddle::Tensor& tensor,
                   int64_t batch) {
  kCheck.Dtype(name, ViewOf(tensor), {paddle::DataType::INT64});
  kCheck.Shape(name, ViewOf(tensor), {batch, -1});
  kCheck.DenseCpu(name, tensor);
  const int64_t width = tensor.dims()[1];
  kCheck.Positive((std::string(name) + "'s width").c_str(), width);
  return width;
}

}  // namespace

void CpuUpdateInputs(
    const paddle::Tensor& running PADDLE_STEP_CPU_UPDATE_INPUTS_TENSORS(
        PADDLE_STEP_CPU_UPDATE_INPUTS_PARAMETER)) {
  constexpr auto kBool = paddle::DataType::BOOL;
  kCheck.Dtype("running", ViewOf(running), {kBool});
  kCheck.Shape("running", ViewOf(running), {-1});  // sets the batch
  const int64_t batch = running.dims()[0];
  constexpr auto kInt32 = paddle::DataType::INT32;
  constexpr auto kInt64 = paddle::DataType::INT64;
  kCheck.DenseCpu("running", running);
  CheckVector("ran", ran, kBool, batch);
  CheckVector("tokens", tokens, kInt64, batch);
  CheckVector("step_idx", step_idx, kInt64, batch);
  CheckVector("max_new_tokens", max_new_tokens, kInt64, batch);
  CheckVector("next_tokens", next_tokens, kInt64, batch);
  CheckVector("seq_lens_this_time", seq_lens_this_time, kInt32, batch);
  CheckVector("seq_lens_encoder", seq_lens_encoder, kInt32, batch);
  CheckVector("seq_lens_decoder", seq_lens_decoder, kInt32, batch);
  CheckVector("stop_flags", stop_flags, kBool, batch);
  cpu::UpdateInputsProblem problem;
  problem.batch = batch;
  problem.running = running.data<bool>();
  problem.ran = ran.data<bool>();
  problem.tokens = tokens.data<int64_t>();
  problem.step_idx = step_idx.data<int64_t>();
  problem.stop_width = CheckTable("stop_ids", stop_ids, batch);
  problem.stop_ids = stop_ids.data<int64_t>();
  problem.max_new_tokens = max_new_tokens.data<int64_t>();
  problem.pre_ids_width = CheckTable("pre_ids", pre_ids, batch);
  problem.pre_ids = pre_ids.data<int64_t>();
  problem.next_tokens = next_tokens.data<int64_t>();
  problem.input_ids_width = CheckTable("input_ids", input_ids, batch);
  problem.input_ids = input_ids.data<int64_t>();
  problem.seq_lens_this_time = seq_lens_this_time.data<int32_t>();
  problem.seq_lens_encoder = seq_lens_encoder.data<int32_t>();
  problem.seq_lens_decoder = seq_lens_decoder.data<int32_t>();
  problem.stop_flags = stop_flags.data<bool>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t column = cpu::PreIdsColumn(problem, b);
    if (column < 0 || column >= problem.pre_ids_width) {
      kCheck.Fail("pre_ids",
                  "a column for slot " + std::to_string(b) +
                      "'s next token (step_idx + 1) in [0, " +
                      std::to_string(problem.pre_ids_width) + ")",
                  std::to_string(column));
    }
  }
  for (int64_t b = 0; b < batch; ++b) cpu::UpdateInputsRow(problem, b);
}

}  // namespace paddle_step
