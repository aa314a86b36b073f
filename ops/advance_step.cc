// advance_step: validation, CPU kernel, place dispatch and registration.
// The kernel itself is ops/include/advance_step_kernel.h.
#include <string>

#include "advance_step_kernel.h"
#include "input_checks.h"
#include "paddle_step_ops.h"
#include "static_op.h"
#ifdef PADDLE_STEP_WITH_CUDA
#include "gpu_launchers.h"
#endif

namespace paddle_step {
namespace {

constexpr InputChecker kCheck("advance_step");

// The tensor arguments, in the op's input order (the table's, then active).
enum AdvanceStepInput {
  kInputTokens,
  kSampledTokenIds,
  kInputPositions,
  kSeqLens,
  kSlotMapping,
  kBlockTables,
  kActive,
  kAdvanceStepInputCount
};
#define PADDLE_STEP_NAME(name, access) #name,
constexpr const char* kNames[kAdvanceStepInputCount] = {
    PADDLE_STEP_ADVANCE_STEP_TENSORS(PADDLE_STEP_NAME) "active"};
#undef PADDLE_STEP_NAME

}  // namespace

void CheckAdvanceStepViews(const TensorView* views, int count, int64_t num_seqs,
                           int64_t num_queries, int64_t block_size) {
  const auto int64 = paddle::DataType::INT64;
  const auto int32 = paddle::DataType::INT32;
  const bool has_active = count > kActive;
  kCheck.Dtype(kNames[kInputTokens], views[kInputTokens], {int64});
  kCheck.Dtype(kNames[kSampledTokenIds], views[kSampledTokenIds], {int64});
  kCheck.Dtype(kNames[kInputPositions], views[kInputPositions], {int64});
  kCheck.Dtype(kNames[kSeqLens], views[kSeqLens], {int32, int64});
  kCheck.Dtype(kNames[kSlotMapping], views[kSlotMapping], {int64});
  kCheck.Dtype(kNames[kBlockTables], views[kBlockTables], {int32, int64});
  if (has_active) {
    kCheck.Dtype(kNames[kActive], views[kActive], {paddle::DataType::BOOL});
  }

  kCheck.Positive("num_seqs", num_seqs);
  kCheck.Positive("num_queries", num_queries);
  if (num_queries > num_seqs) {
    kCheck.Fail("num_queries",
                "at most num_seqs (" + std::to_string(num_seqs) + ")",
                std::to_string(num_queries));
  }
  kCheck.Positive("block_size", block_size);
  kCheck.Shape(kNames[kInputTokens], views[kInputTokens], {num_seqs});
  kCheck.BatchVector(kNames[kSampledTokenIds], views[kSampledTokenIds],
                     num_queries);
  kCheck.Shape(kNames[kInputPositions], views[kInputPositions], {num_seqs});
  kCheck.Shape(kNames[kSeqLens], views[kSeqLens], {num_seqs});
  kCheck.Shape(kNames[kSlotMapping], views[kSlotMapping], {num_seqs});
  kCheck.Shape(kNames[kBlockTables], views[kBlockTables], {num_seqs, -1});
  if (has_active) kCheck.Shape(kNames[kActive], views[kActive], {num_seqs});
}

void AdvanceStep(
    PADDLE_STEP_ADVANCE_STEP_TENSORS(PADDLE_STEP_ADVANCE_STEP_PARAMETER)
        const paddle::optional<paddle::Tensor>& active,
    int64_t num_seqs, int64_t num_queries, int64_t block_size) {
#define PADDLE_STEP_ADDRESS(name, access) &name,
  const paddle::Tensor* tensors[kAdvanceStepInputCount] = {
      PADDLE_STEP_ADVANCE_STEP_TENSORS(PADDLE_STEP_ADDRESS)
          active ? active.get_ptr() : nullptr};
#undef PADDLE_STEP_ADDRESS
  const int count = active ? kAdvanceStepInputCount : kActive;
  TensorView views[kAdvanceStepInputCount];
  for (int i = 0; i < count; ++i) views[i] = ViewOf(*tensors[i]);
  CheckAdvanceStepViews(views, count, num_seqs, num_queries, block_size);
  kCheck.SamePlace(kNames, tensors, count);

  // The kernel is instantiated per element type of seq_lens and block_tables.
  const auto run = [&](auto seq_len_type, auto block_type) {
    AdvanceStepParams<decltype(seq_len_type), decltype(block_type)> params;
    params.input_tokens = input_tokens.data<int64_t>();
    params.sampled_token_ids = sampled_token_ids.data<int64_t>();
    params.input_positions = input_positions.data<int64_t>();
    params.seq_lens = seq_lens.data<decltype(seq_len_type)>();
    params.slot_mapping = slot_mapping.data<int64_t>();
    params.block_tables = block_tables.data<decltype(block_type)>();
    params.active = active ? active->data<bool>() : nullptr;
    params.num_seqs = num_seqs;
    params.num_queries = num_queries;
    params.blocks_per_seq = block_tables.dims()[1];
    params.block_size = block_size;
    RunOnPlace(
        "advance_step", input_tokens, [&] { AdvanceStepCpu(params); },
        [&](auto stream) { return LaunchAdvanceStep(params, stream); });
  };
  const bool seq_lens_int64 = seq_lens.dtype() == paddle::DataType::INT64;
  const bool tables_int64 = block_tables.dtype() == paddle::DataType::INT64;
  if (seq_lens_int64 && tables_int64) {
    run(int64_t{}, int64_t{});
  } else if (seq_lens_int64) {
    run(int64_t{}, int32_t{});
  } else if (tables_int64) {
    run(int32_t{}, int64_t{});
  } else {
    run(int32_t{}, int32_t{});
  }
}

}  // namespace paddle_step

// Registers PD_BUILD_OP(static_op_advance_step). Paddle's setup() finds the ops
// of a library by searching its sources for that text, so it is spelled out.
PD_BUILD_STATIC_OP(advance_step)
    .Inputs({"input_tokens", "sampled_token_ids", "input_positions", "seq_lens",
             "slot_mapping", "block_tables", paddle::Optional("active")})
    .Outputs({"input_tokens_out", "input_positions_out", "seq_lens_out",
              "slot_mapping_out"})
    .Attrs({"num_seqs: int", "num_queries: int", "block_size: int"})
    .SetInplaceMap({{"input_tokens", "input_tokens_out"},
                    {"input_positions", "input_positions_out"},
                    {"seq_lens", "seq_lens_out"},
                    {"slot_mapping", "slot_mapping_out"}})
    .SetKernelFn(
        PD_KERNEL(paddle_step::StaticOpKernel<&paddle_step::AdvanceStep>::Run));
