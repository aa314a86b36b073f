// step_paddle: validation, CPU kernel, place dispatch and registration.
// The kernel itself is ops/include/step_paddle_kernel.h (CPU) and
// ops/gpu/step_paddle.cu (CUDA).
#include <string>
#include <unordered_map>
#include <vector>

#include "input_checks.h"
#include "paddle_step_ops.h"
#include "static_op.h"
#include "step_paddle_kernel.h"
#ifdef PADDLE_STEP_WITH_CUDA
#include "gpu_launchers.h"
#endif

namespace paddle_step {
namespace {

constexpr InputChecker kCheck("step_paddle");

// What each argument must be, in the op's input order.
struct Argument {
  const char* name;
  paddle::DataType dtype;
  ShapeKind shape;
  Access access;
};
#define PADDLE_STEP_ARGUMENT(name, type, shape, access)           \
  {#name, phi::CppTypeToDataType<type>::Type(), ShapeKind::shape, \
   Access::access},
constexpr Argument kArguments[kStepPaddleTensorCount] = {
    PADDLE_STEP_STEP_PADDLE_TENSORS(PADDLE_STEP_ARGUMENT)};
#undef PADDLE_STEP_ARGUMENT

}  // namespace

void CheckStepPaddleViews(const TensorView* views, int64_t block_size) {
  for (int i = 0; i < kStepPaddleTensorCount; ++i) {
    kCheck.Dtype(kArguments[i].name, views[i], {kArguments[i].dtype});
  }
  kCheck.Positive("block_size", block_size);
  if (views[0].rank == 0) {
    kCheck.Fail("stop_flags", "shape [B] or [B, 1]", "a scalar");
  }
  const int64_t batch = views[0].dims[0];
  for (int i = 0; i < kStepPaddleTensorCount; ++i) {
    const char* name = kArguments[i].name;
    switch (kArguments[i].shape) {
      case ShapeKind::kBatchVector:
        kCheck.BatchVector(name, views[i], batch);
        break;
      case ShapeKind::kBatchOnly:
        kCheck.Shape(name, views[i], {batch});
        break;
      case ShapeKind::kBatchRows:
        kCheck.Shape(name, views[i], {batch, -1});
        break;
      case ShapeKind::kList:
        kCheck.Shape(name, views[i], {-1});
        break;
      case ShapeKind::kCounter:
        kCheck.Shape(name, views[i], {1});
        break;
    }
  }
}

void StepPaddle(PADDLE_STEP_STEP_PADDLE_TENSORS(PADDLE_STEP_TENSOR_PARAMETER)
                    int64_t block_size,
                int64_t /*encoder_decoder_block_num: FastDeploy compat*/) {
#define PADDLE_STEP_ADDRESS(name, type, shape, access) &name,
  const paddle::Tensor* tensors[kStepPaddleTensorCount] = {
      PADDLE_STEP_STEP_PADDLE_TENSORS(PADDLE_STEP_ADDRESS)};
#undef PADDLE_STEP_ADDRESS
  TensorView views[kStepPaddleTensorCount];
  const char* names[kStepPaddleTensorCount];
  for (int i = 0; i < kStepPaddleTensorCount; ++i) {
    views[i] = ViewOf(*tensors[i]);
    names[i] = kArguments[i].name;
  }
  CheckStepPaddleViews(views, block_size);
  kCheck.SamePlace(names, tensors, kStepPaddleTensorCount);
  const int64_t batch = views[0].dims[0];

  StepPaddleParams params;
#define PADDLE_STEP_DATA(name, type, shape, access) \
  params.name = name.data<type>();
  PADDLE_STEP_STEP_PADDLE_TENSORS(PADDLE_STEP_DATA)
#undef PADDLE_STEP_DATA
  params.batch_size = batch;
  params.blocks_per_seq = block_tables.dims()[1];
  params.free_list_capacity = free_list.dims()[0];
  params.input_ids_len = input_ids.dims()[1];
  params.pre_ids_len = pre_ids.dims()[1];
  params.block_size = block_size;
  params.max_dec_blocks = params.input_ids_len / block_size;

  RunOnPlace(
      "step_paddle", stop_flags, [&] { StepPaddleCpu(params); },
      [&](auto stream) { return LaunchStepPaddle(params, stream); });
}

}  // namespace paddle_step

namespace {

// The op's inputs are the table's tensors. Each one it writes is also an
// output, "<name>_out", in the table's order: the order ops.py assigns the
// static op's results back in.
std::vector<std::string> StepPaddleInputs(bool written_only) {
  std::vector<std::string> inputs;
  for (const auto& argument : paddle_step::kArguments) {
    if (!written_only || argument.access == paddle_step::Access::kWritten) {
      inputs.push_back(argument.name);
    }
  }
  return inputs;
}

std::string OutputOf(const std::string& input) { return input + "_out"; }

std::vector<std::string> StepPaddleOutputs() {
  std::vector<std::string> outputs;
  for (const auto& input : StepPaddleInputs(/*written_only=*/true)) {
    outputs.push_back(OutputOf(input));
  }
  return outputs;
}

std::unordered_map<std::string, std::string> StepPaddleInplaceMap() {
  std::unordered_map<std::string, std::string> inplace;
  for (const auto& input : StepPaddleInputs(/*written_only=*/true)) {
    inplace.emplace(input, OutputOf(input));
  }
  return inplace;
}

}  // namespace

// Registers PD_BUILD_OP(static_op_step_paddle). Paddle's setup() finds the ops
// of a library by searching its sources for that text, so it is spelled out.
PD_BUILD_STATIC_OP(step_paddle)
    .Inputs(StepPaddleInputs(/*written_only=*/false))
    .Attrs({"block_size: int", "encoder_decoder_block_num: int"})
    .Outputs(StepPaddleOutputs())
    .SetInplaceMap(StepPaddleInplaceMap())
    .SetKernelFn(
        PD_KERNEL(paddle_step::StaticOpKernel<&paddle_step::StepPaddle>::Run));
