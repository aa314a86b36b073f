// advance_step: validation, CPU kernel, place dispatch and registration.
// The kernel itself is ops/include/advance_step_kernel.h.
#include <string>
#include <vector>

#include "advance_step_kernel.h"
#include "input_checks.h"
#include "paddle_step_ops.h"
#include "static_op.h"
#ifdef PADDLE_STEP_WITH_CUDA
#include "gpu_launchers.h"
#endif

namespace paddle_step {
namespace {

// Order of the tensor arguments, as in the op's Inputs.
enum AdvanceStepInput {
  kInputTokens, kSampledTokenIds, kInputPositions, kSeqLens, kSlotMapping,
  kBlockTables, kActive
};

const InputChecker kCheck("advance_step");

// Shapes and the scalar arguments. `specs` has kActive only when given.
void CheckAdvanceStepShapes(const std::vector<TensorSpec>& specs,
                            int64_t num_seqs, int64_t num_queries,
                            int64_t block_size) {
  kCheck.Positive("num_seqs", num_seqs);
  kCheck.Positive("num_queries", num_queries);
  if (num_queries > num_seqs) {
    kCheck.Fail("num_queries",
                "at most num_seqs (" + std::to_string(num_seqs) + ")",
                std::to_string(num_queries));
  }
  kCheck.Positive("block_size", block_size);
  kCheck.Shape(specs[kInputTokens], {num_seqs});
  kCheck.BatchVector(specs[kSampledTokenIds], num_queries);
  kCheck.Shape(specs[kInputPositions], {num_seqs});
  kCheck.Shape(specs[kSeqLens], {num_seqs});
  kCheck.Shape(specs[kSlotMapping], {num_seqs});
  kCheck.Shape(specs[kBlockTables], {num_seqs, -1});
  if (specs.size() > kActive) kCheck.Shape(specs[kActive], {num_seqs});
}

void CheckAdvanceStepDtypes(const std::vector<TensorSpec>& specs) {
  const auto int64 = paddle::DataType::INT64;
  const auto int32 = paddle::DataType::INT32;
  kCheck.Dtype(specs[kInputTokens], {int64});
  kCheck.Dtype(specs[kSampledTokenIds], {int64});
  kCheck.Dtype(specs[kInputPositions], {int64});
  kCheck.Dtype(specs[kSeqLens], {int32, int64});
  kCheck.Dtype(specs[kSlotMapping], {int64});
  kCheck.Dtype(specs[kBlockTables], {int32, int64});
  if (specs.size() > kActive) {
    kCheck.Dtype(specs[kActive], {paddle::DataType::BOOL});
  }
}

template <typename SeqLenT, typename BlockT>
void RunAdvanceStep(const paddle::Tensor& input_tokens,
                    const paddle::Tensor& sampled_token_ids,
                    const paddle::Tensor& input_positions,
                    const paddle::Tensor& seq_lens,
                    const paddle::Tensor& slot_mapping,
                    const paddle::Tensor& block_tables,
                    const paddle::optional<paddle::Tensor>& active,
                    int64_t num_seqs, int64_t num_queries, int64_t block_size) {
  // Paddle passes in-place tensors as const; the op's contract is to write
  // them (SetInplaceMap below).
  AdvanceStepParams<SeqLenT, BlockT> params;
  params.input_tokens = const_cast<int64_t*>(input_tokens.data<int64_t>());
  params.sampled_token_ids = sampled_token_ids.data<int64_t>();
  params.input_positions =
      const_cast<int64_t*>(input_positions.data<int64_t>());
  params.seq_lens = const_cast<SeqLenT*>(seq_lens.data<SeqLenT>());
  params.slot_mapping = const_cast<int64_t*>(slot_mapping.data<int64_t>());
  params.block_tables = block_tables.data<BlockT>();
  params.active = active ? active->data<bool>() : nullptr;
  params.num_seqs = num_seqs;
  params.num_queries = num_queries;
  params.blocks_per_seq = block_tables.shape()[1];
  params.block_size = block_size;

  if (input_tokens.is_cpu()) {
    AdvanceStepCpu(params);
    return;
  }
#ifdef PADDLE_STEP_WITH_CUDA
  const cudaError_t status = LaunchAdvanceStep(params, input_tokens.stream());
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("paddle_step.advance_step: CUDA "
                                         "launch failed: ") +
                             cudaGetErrorString(status));
  }
#endif
}

}  // namespace

void CheckAdvanceStepSpecs(const std::vector<TensorSpec>& specs,
                           int64_t num_seqs, int64_t num_queries,
                           int64_t block_size) {
  CheckAdvanceStepDtypes(specs);
  CheckAdvanceStepShapes(specs, num_seqs, num_queries, block_size);
}

void AdvanceStep(const paddle::Tensor& input_tokens,
                 const paddle::Tensor& sampled_token_ids,
                 const paddle::Tensor& input_positions,
                 const paddle::Tensor& seq_lens,
                 const paddle::Tensor& slot_mapping,
                 const paddle::Tensor& block_tables,
                 const paddle::optional<paddle::Tensor>& active,
                 int64_t num_seqs, int64_t num_queries, int64_t block_size) {
  std::vector<NamedTensor> tensors = {
      {"input_tokens", &input_tokens},
      {"sampled_token_ids", &sampled_token_ids},
      {"input_positions", &input_positions},
      {"seq_lens", &seq_lens},
      {"slot_mapping", &slot_mapping},
      {"block_tables", &block_tables}};
  if (active) tensors.push_back({"active", active.get_ptr()});
  std::vector<TensorSpec> specs;
  for (const NamedTensor& tensor : tensors) {
    specs.push_back(SpecOf(tensor.first, *tensor.second));
  }
  CheckAdvanceStepSpecs(specs, num_seqs, num_queries, block_size);
  kCheck.SamePlace(tensors);

  const bool seq_lens_int64 = seq_lens.dtype() == paddle::DataType::INT64;
  const bool tables_int64 = block_tables.dtype() == paddle::DataType::INT64;
  auto run = seq_lens_int64
                 ? (tables_int64 ? RunAdvanceStep<int64_t, int64_t>
                                 : RunAdvanceStep<int64_t, int32_t>)
                 : (tables_int64 ? RunAdvanceStep<int32_t, int64_t>
                                 : RunAdvanceStep<int32_t, int32_t>);
  run(input_tokens, sampled_token_ids, input_positions, seq_lens,
      slot_mapping, block_tables, active, num_seqs, num_queries, block_size);
}

}  // namespace paddle_step

namespace {

void AdvanceStepOp(const paddle::Tensor& input_tokens,
                   const paddle::Tensor& sampled_token_ids,
                   const paddle::Tensor& input_positions,
                   const paddle::Tensor& seq_lens,
                   const paddle::Tensor& slot_mapping,
                   const paddle::Tensor& block_tables,
                   const paddle::optional<paddle::Tensor>& active,
                   int num_seqs, int num_queries, int block_size) {
  paddle_step::RethrowForPaddle([&] {
    paddle_step::AdvanceStep(input_tokens, sampled_token_ids, input_positions,
                             seq_lens, slot_mapping, block_tables, active,
                             num_seqs, num_queries, block_size);
  });
}

}  // namespace

// Registers PD_BUILD_OP(static_op_advance_step). Paddle's setup() finds the ops of
// a library by searching its sources for that text, so it is spelled out.
PD_BUILD_STATIC_OP(advance_step)
    .Inputs({"input_tokens", "sampled_token_ids", "input_positions",
             "seq_lens", "slot_mapping", "block_tables",
             paddle::Optional("active")})
    .Outputs({"input_tokens_out", "input_positions_out", "seq_lens_out",
              "slot_mapping_out"})
    .Attrs({"num_seqs: int", "num_queries: int", "block_size: int"})
    .SetInplaceMap({{"input_tokens", "input_tokens_out"},
                    {"input_positions", "input_positions_out"},
                    {"seq_lens", "seq_lens_out"},
                    {"slot_mapping", "slot_mapping_out"}})
    .SetKernelFn(PD_KERNEL(AdvanceStepOp));
