// step_paddle: validation, CPU kernel, place dispatch and registration.
// The kernel itself is ops/include/step_paddle_kernel.h (CPU) and
// ops/gpu/step_paddle.cu (CUDA).
#include <string>
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

template <typename T>
T* Mutable(const paddle::Tensor& tensor) {
  // Paddle passes in-place tensors as const; the op's contract is to write
  // them (SetInplaceMap below).
  return const_cast<T*>(tensor.data<T>());
}

const InputChecker kCheck("step_paddle");

bool NameIs(const TensorSpec& spec, std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (spec.name == name) return true;
  }
  return false;
}

// `specs` in the op's input order; B is stop_flags' first dimension.
void CheckStepPaddleShapes(const std::vector<TensorSpec>& specs,
                           int64_t block_size) {
  kCheck.Positive("block_size", block_size);
  if (specs[0].shape.empty()) {
    kCheck.Fail("stop_flags", "shape [B] or [B, 1]", "a scalar");
  }
  const int64_t batch = specs[0].shape[0];
  for (const TensorSpec& spec : specs) {
    if (NameIs(spec, {"block_tables", "input_ids", "pre_ids"})) {
      kCheck.Shape(spec, {batch, -1});
    } else if (NameIs(spec, {"free_list"})) {
      kCheck.Shape(spec, {-1});
    } else if (NameIs(spec, {"is_block_step"})) {
      kCheck.Shape(spec, {batch});
    } else if (NameIs(spec, {"step_lens", "recover_lens", "need_block_len",
                             "free_list_len"})) {
      kCheck.Shape(spec, {1});
    } else {
      kCheck.BatchVector(spec, batch);
    }
  }
}

void CheckStepPaddleDtypes(const std::vector<TensorSpec>& specs) {
  for (const TensorSpec& spec : specs) {
    if (NameIs(spec, {"stop_flags", "is_block_step"})) {
      kCheck.Dtype(spec, {paddle::DataType::BOOL});
    } else if (NameIs(spec, {"input_ids", "pre_ids", "step_idx", "next_tokens",
                             "first_token_ids"})) {
      kCheck.Dtype(spec, {paddle::DataType::INT64});
    } else {
      kCheck.Dtype(spec, {paddle::DataType::INT32});
    }
  }
}

}  // namespace

void CheckStepPaddleSpecs(const std::vector<TensorSpec>& specs,
                          int64_t block_size) {
  CheckStepPaddleDtypes(specs);
  CheckStepPaddleShapes(specs, block_size);
}

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
                int64_t /*encoder_decoder_block_num: FastDeploy compat*/) {
  const std::vector<NamedTensor> tensors = {
      {"stop_flags", &stop_flags},
      {"seq_lens_this_time", &seq_lens_this_time},
      {"ori_seq_lens_encoder", &ori_seq_lens_encoder},
      {"seq_lens_encoder", &seq_lens_encoder},
      {"seq_lens_decoder", &seq_lens_decoder},
      {"block_tables", &block_tables},
      {"encoder_block_lens", &encoder_block_lens},
      {"is_block_step", &is_block_step},
      {"step_block_list", &step_block_list},
      {"step_lens", &step_lens},
      {"recover_block_list", &recover_block_list},
      {"recover_lens", &recover_lens},
      {"need_block_list", &need_block_list},
      {"need_block_len", &need_block_len},
      {"used_list_len", &used_list_len},
      {"free_list", &free_list},
      {"free_list_len", &free_list_len},
      {"input_ids", &input_ids},
      {"pre_ids", &pre_ids},
      {"step_idx", &step_idx},
      {"next_tokens", &next_tokens},
      {"first_token_ids", &first_token_ids}};
  std::vector<TensorSpec> specs;
  for (const NamedTensor& tensor : tensors) {
    specs.push_back(SpecOf(tensor.first, *tensor.second));
  }
  CheckStepPaddleSpecs(specs, block_size);
  kCheck.SamePlace(tensors);
  const int64_t batch = stop_flags.shape()[0];

  StepPaddleParams params;
  params.stop_flags = Mutable<bool>(stop_flags);
  params.seq_lens_this_time = Mutable<int32_t>(seq_lens_this_time);
  params.ori_seq_lens_encoder = ori_seq_lens_encoder.data<int32_t>();
  params.seq_lens_encoder = Mutable<int32_t>(seq_lens_encoder);
  params.seq_lens_decoder = Mutable<int32_t>(seq_lens_decoder);
  params.block_tables = Mutable<int32_t>(block_tables);
  params.encoder_block_lens = Mutable<int32_t>(encoder_block_lens);
  params.is_block_step = Mutable<bool>(is_block_step);
  params.step_block_list = Mutable<int32_t>(step_block_list);
  params.step_lens = Mutable<int32_t>(step_lens);
  params.recover_block_list = Mutable<int32_t>(recover_block_list);
  params.recover_lens = Mutable<int32_t>(recover_lens);
  params.need_block_list = Mutable<int32_t>(need_block_list);
  params.need_block_len = Mutable<int32_t>(need_block_len);
  params.used_list_len = Mutable<int32_t>(used_list_len);
  params.free_list = Mutable<int32_t>(free_list);
  params.free_list_len = Mutable<int32_t>(free_list_len);
  params.input_ids = Mutable<int64_t>(input_ids);
  params.pre_ids = pre_ids.data<int64_t>();
  params.step_idx = step_idx.data<int64_t>();
  params.next_tokens = next_tokens.data<int64_t>();
  params.first_token_ids = Mutable<int64_t>(first_token_ids);
  params.batch_size = batch;
  params.blocks_per_seq = block_tables.shape()[1];
  params.free_list_capacity = free_list.shape()[0];
  params.input_ids_len = input_ids.shape()[1];
  params.pre_ids_len = pre_ids.shape()[1];
  params.block_size = block_size;
  params.max_dec_blocks = params.input_ids_len / block_size;

  if (stop_flags.is_cpu()) {
    StepPaddleCpu(params);
    return;
  }
#ifdef PADDLE_STEP_WITH_CUDA
  const cudaError_t status = LaunchStepPaddle(params, stop_flags.stream());
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("paddle_step.step_paddle: CUDA "
                                         "launch failed: ") +
                             cudaGetErrorString(status));
  }
#endif
}

}  // namespace paddle_step

namespace {

void StepPaddleOp(const paddle::Tensor& stop_flags,
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
                  const paddle::Tensor& first_token_ids, int block_size,
                  int encoder_decoder_block_num) {
  paddle_step::RethrowForPaddle([&] {
    paddle_step::StepPaddle(
        stop_flags, seq_lens_this_time, ori_seq_lens_encoder, seq_lens_encoder,
        seq_lens_decoder, block_tables, encoder_block_lens, is_block_step,
        step_block_list, step_lens, recover_block_list, recover_lens,
        need_block_list, need_block_len, used_list_len, free_list, free_list_len,
        input_ids, pre_ids, step_idx, next_tokens, first_token_ids, block_size,
        encoder_decoder_block_num);
  });
}

}  // namespace

// Registers PD_BUILD_OP(static_op_step_paddle). Paddle's setup() finds the ops of
// a library by searching its sources for that text, so it is spelled out.
PD_BUILD_STATIC_OP(step_paddle)
    .Inputs({"stop_flags", "seq_lens_this_time", "ori_seq_lens_encoder",
             "seq_lens_encoder", "seq_lens_decoder", "block_tables",
             "encoder_block_lens", "is_block_step", "step_block_list",
             "step_lens", "recover_block_list", "recover_lens",
             "need_block_list", "need_block_len", "used_list_len", "free_list",
             "free_list_len", "input_ids", "pre_ids", "step_idx",
             "next_tokens", "first_token_ids"})
    .Attrs({"block_size: int", "encoder_decoder_block_num: int"})
    .Outputs({"stop_flags_out", "seq_lens_this_time_out",
              "seq_lens_encoder_out", "seq_lens_decoder_out",
              "block_tables_out", "encoder_block_lens_out",
              "is_block_step_out", "step_block_list_out", "step_lens_out",
              "recover_block_list_out", "recover_lens_out",
              "need_block_list_out", "need_block_len_out", "used_list_len_out",
              "free_list_out", "free_list_len_out", "input_ids_out",
              "first_token_ids_out"})
    .SetInplaceMap({{"stop_flags", "stop_flags_out"},
                    {"seq_lens_this_time", "seq_lens_this_time_out"},
                    {"seq_lens_encoder", "seq_lens_encoder_out"},
                    {"seq_lens_decoder", "seq_lens_decoder_out"},
                    {"block_tables", "block_tables_out"},
                    {"encoder_block_lens", "encoder_block_lens_out"},
                    {"is_block_step", "is_block_step_out"},
                    {"step_block_list", "step_block_list_out"},
                    {"step_lens", "step_lens_out"},
                    {"recover_block_list", "recover_block_list_out"},
                    {"recover_lens", "recover_lens_out"},
                    {"need_block_list", "need_block_list_out"},
                    {"need_block_len", "need_block_len_out"},
                    {"used_list_len", "used_list_len_out"},
                    {"free_list", "free_list_out"},
                    {"free_list_len", "free_list_len_out"},
                    {"input_ids", "input_ids_out"},
                    {"first_token_ids", "first_token_ids_out"}})
    .SetKernelFn(PD_KERNEL(StepPaddleOp));
