// step_paddle: validation, CPU kernel, place dispatch and registration.
// The kernel itself is ops/include/step_paddle_kernel.h (CPU) and
// ops/gpu/step_paddle.cu (CUDA).
#include <string>

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

constexpr InputChecker kCheck("step_paddle");

// What each argument must be, in the op's input order.
enum class Kind {
  kBatchVector,  // [B] or [B, 1]
  kBatchOnly,    // [B]
  kBatchRows,    // [B, any]
  kList,         // [any]
  kCounter,      // [1]
};
struct Argument {
  const char* name;
  paddle::DataType dtype;
  Kind kind;
};
constexpr auto kBool = paddle::DataType::BOOL;
constexpr auto kInt32 = paddle::DataType::INT32;
constexpr auto kInt64 = paddle::DataType::INT64;
constexpr Argument kArguments[kStepPaddleInputCount] = {
    {"stop_flags", kBool, Kind::kBatchVector},
    {"seq_lens_this_time", kInt32, Kind::kBatchVector},
    {"ori_seq_lens_encoder", kInt32, Kind::kBatchVector},
    {"seq_lens_encoder", kInt32, Kind::kBatchVector},
    {"seq_lens_decoder", kInt32, Kind::kBatchVector},
    {"block_tables", kInt32, Kind::kBatchRows},
    {"encoder_block_lens", kInt32, Kind::kBatchVector},
    {"is_block_step", kBool, Kind::kBatchOnly},
    {"step_block_list", kInt32, Kind::kBatchVector},
    {"step_lens", kInt32, Kind::kCounter},
    {"recover_block_list", kInt32, Kind::kBatchVector},
    {"recover_lens", kInt32, Kind::kCounter},
    {"need_block_list", kInt32, Kind::kBatchVector},
    {"need_block_len", kInt32, Kind::kCounter},
    {"used_list_len", kInt32, Kind::kBatchVector},
    {"free_list", kInt32, Kind::kList},
    {"free_list_len", kInt32, Kind::kCounter},
    {"input_ids", kInt64, Kind::kBatchRows},
    {"pre_ids", kInt64, Kind::kBatchRows},
    {"step_idx", kInt64, Kind::kBatchVector},
    {"next_tokens", kInt64, Kind::kBatchVector},
    {"first_token_ids", kInt64, Kind::kBatchVector}};

}  // namespace

void CheckStepPaddleViews(const TensorView* views, int64_t block_size) {
  for (int i = 0; i < kStepPaddleInputCount; ++i) {
    kCheck.Dtype(kArguments[i].name, views[i], {kArguments[i].dtype});
  }
  kCheck.Positive("block_size", block_size);
  if (views[0].rank == 0) {
    kCheck.Fail("stop_flags", "shape [B] or [B, 1]", "a scalar");
  }
  const int64_t batch = views[0].dims[0];
  for (int i = 0; i < kStepPaddleInputCount; ++i) {
    const char* name = kArguments[i].name;
    switch (kArguments[i].kind) {
      case Kind::kBatchVector:
        kCheck.BatchVector(name, views[i], batch);
        break;
      case Kind::kBatchOnly:
        kCheck.Shape(name, views[i], {batch});
        break;
      case Kind::kBatchRows:
        kCheck.Shape(name, views[i], {batch, -1});
        break;
      case Kind::kList:
        kCheck.Shape(name, views[i], {-1});
        break;
      case Kind::kCounter:
        kCheck.Shape(name, views[i], {1});
        break;
    }
  }
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
  const paddle::Tensor* tensors[kStepPaddleInputCount] = {
      &stop_flags,         &seq_lens_this_time, &ori_seq_lens_encoder,
      &seq_lens_encoder,   &seq_lens_decoder,   &block_tables,
      &encoder_block_lens, &is_block_step,      &step_block_list,
      &step_lens,          &recover_block_list, &recover_lens,
      &need_block_list,    &need_block_len,     &used_list_len,
      &free_list,          &free_list_len,      &input_ids,
      &pre_ids,            &step_idx,           &next_tokens,
      &first_token_ids};
  TensorView views[kStepPaddleInputCount];
  const char* names[kStepPaddleInputCount];
  for (int i = 0; i < kStepPaddleInputCount; ++i) {
    views[i] = ViewOf(*tensors[i]);
    names[i] = kArguments[i].name;
  }
  CheckStepPaddleViews(views, block_size);
  kCheck.SamePlace(names, tensors, kStepPaddleInputCount);
  const int64_t batch = views[0].dims[0];

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
  params.blocks_per_seq = block_tables.dims()[1];
  params.free_list_capacity = free_list.dims()[0];
  params.input_ids_len = input_ids.dims()[1];
  params.pre_ids_len = pre_ids.dims()[1];
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
