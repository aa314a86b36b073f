// cpu_sampling: validation of the CPU sampling step and its split over the
// CPU product's thread pool, on the product's instruction-set path. The
// kernel is ops/include/cpu_sampling_kernel.h; Python reaches this through
// the pybind11 fast path (bindings.cc).
#include <algorithm>
#include <string>
#include <vector>

#include "cpu_runtime.h"
#include "cpu_sampling_kernel.h"
#include "cpu_sampling_ops.h"
#include "input_checks.h"

namespace paddle_step {
namespace {

constexpr InputChecker kCheck("cpu_sample");

// Rows per task: a few tasks per thread, so that a thread that gets its core
// late leaves its rows to the others (cpu_thread_pool.h).
constexpr int kTasksPerThread = 4;

using Optional = paddle::optional<paddle::Tensor>;

// A dense CPU vector [rows] of `dtype`.
template <typename T>
const T* Vector(const char* name, const paddle::Tensor& tensor,
                paddle::DataType dtype, int64_t rows) {
  const TensorView view = ViewOf(tensor);
  kCheck.Dtype(name, view, {dtype});
  kCheck.Shape(name, view, {rows});
  kCheck.DenseCpu(name, tensor);
  return tensor.data<T>();
}

template <typename T>
const T* Vector(const char* name, const Optional& tensor,
                paddle::DataType dtype, int64_t rows) {
  return tensor ? Vector<T>(name, *tensor, dtype, rows) : nullptr;
}

// A CPU matrix [rows, any] of `dtype` with contiguous rows: its data, width
// and row stride.
template <typename T>
const T* Matrix(const char* name, const paddle::Tensor& tensor,
                paddle::DataType dtype, int64_t rows, int64_t* width,
                int64_t* stride) {
  const TensorView view = ViewOf(tensor);
  kCheck.Dtype(name, view, {dtype});
  kCheck.Shape(name, view, {rows, -1});
  *width = view.dims[1];
  *stride = kCheck.RowStride(name, tensor);
  return tensor.data<T>();
}

// A dense CPU matrix [rows, any] of `dtype`: its data and width.
template <typename T>
const T* DenseMatrix(const char* name, const paddle::Tensor& tensor,
                     paddle::DataType dtype, int64_t rows, int64_t* width) {
  const TensorView view = ViewOf(tensor);
  kCheck.Dtype(name, view, {dtype});
  kCheck.Shape(name, view, {rows, -1});
  kCheck.DenseCpu(name, tensor);
  *width = view.dims[1];
  return tensor.data<T>();
}

// b's logits from `logits` float32 [B, V >= 1] with contiguous rows: rows,
// vocab, data and row stride; a bad one is refused by `check` (the op's name).
void ReadLogits(const InputChecker& check, const paddle::Tensor& logits,
                cpu::SamplingBatch* b) {
  const TensorView view = ViewOf(logits);
  check.Dtype("logits", view, {paddle::DataType::FLOAT32});
  check.Shape("logits", view, {-1, -1});
  b->rows = view.dims[0];
  b->vocab = view.dims[1];
  if (b->vocab < 1) {
    check.Fail("logits", "shape [B, V] with V >= 1",
               "shape " + ShapeString(view.dims, view.rank));
  }
  b->logits = logits.data<float>();
  b->logits_stride = check.RowStride("logits", logits);
}

// Appends the logprob outputs of `rows` rows to `outputs` (the chosen token's
// logprob [rows], the top `top` ids and logprobs [rows, top]) and points `b`
// at them.
void AddLogprobOutputs(int64_t rows, int64_t top, cpu::SamplingBatch* b,
                       std::vector<paddle::Tensor>* outputs) {
  const paddle::Place cpu = paddle::CPUPlace();
  auto chosen = paddle::empty({rows}, paddle::DataType::FLOAT32, cpu);
  auto ids = paddle::empty({rows, top}, paddle::DataType::INT64, cpu);
  auto values = paddle::empty({rows, top}, paddle::DataType::FLOAT32, cpu);
  b->chosen_logprobs = chosen.data<float>();
  b->top_ids = ids.data<int64_t>();
  b->top_values = values.data<float>();
  outputs->insert(outputs->end(), {chosen, ids, values});
}

// body(begin, end, scratch) over ranges of b's rows on the CPU kernels' pool,
// as the products run: tasks are claimed one at a time, so a worker that
// starts late leaves its rows to the others; `scratch` is the thread's own.
template <typename Body>
void ForRowRanges(const cpu::SamplingBatch& b, const Body& body) {
  cpu::ThreadPool& pool = CpuThreadPool();
  const int tasks = static_cast<int>(
      std::min<int64_t>({int64_t{pool.size()} * kTasksPerThread, b.rows,
                         cpu::ThreadPool::kMaxTasks}));
  pool.Run(tasks, [&](int task) {
    thread_local cpu::sampling::RowScratch scratch;
    scratch.Reserve(b.vocab);
    body(b.rows * task / tasks, b.rows * (task + 1) / tasks, scratch);
  });
}

void Requires(const char* name, const Optional& tensor, const char* needed_by) {
  if (!tensor) {
    kCheck.Fail(name, std::string("a tensor (") + needed_by + " is given)",
                "none");
  }
}

}  // namespace

std::vector<paddle::Tensor> CpuSample(
    const paddle::Tensor& logits, const paddle::Tensor& temperature,
    const paddle::Tensor& top_p,
    PADDLE_STEP_CPU_SAMPLE_OPTIONAL_TENSORS(
        PADDLE_STEP_OPTIONAL_TENSOR_PARAMETER) int64_t top_logprobs) {
  using paddle::DataType;
  cpu::SamplingBatch b;
  ReadLogits(kCheck, logits, &b);
  const int64_t rows = b.rows;
  b.temperature =
      Vector<float>("temperature", temperature, DataType::FLOAT32, rows);
  b.top_p = Vector<float>("top_p", top_p, DataType::FLOAT32, rows);
  b.top_k = Vector<int64_t>("top_k", top_k, DataType::INT64, rows);
  b.min_p = Vector<float>("min_p", min_p, DataType::FLOAT32, rows);
  b.uniforms = Vector<double>("uniforms", uniforms, DataType::FLOAT64, rows);
  if (allowed_bits) {
    const TensorView view = ViewOf(*allowed_bits);
    kCheck.Dtype("allowed_bits", view, {DataType::INT32});
    kCheck.Shape("allowed_bits", view, {rows, (b.vocab + 31) / 32});
    kCheck.DenseCpu("allowed_bits", *allowed_bits);
    b.allowed_bits =
        reinterpret_cast<const uint32_t*>(allowed_bits->data<int32_t>());
  }
  if (stop_ids) {
    Requires("min_tokens", min_tokens, "stop_ids");
    Requires("step_idx", step_idx, "stop_ids");
    b.stop_ids = DenseMatrix<int64_t>("stop_ids", *stop_ids, DataType::INT64,
                                      rows, &b.stop_width);
    b.min_tokens =
        Vector<int64_t>("min_tokens", min_tokens, DataType::INT64, rows);
  }
  if (output_ids) {
    Requires("step_idx", step_idx, "output_ids");
    b.output_ids = DenseMatrix<int64_t>("output_ids", *output_ids,
                                        DataType::INT64, rows, &b.output_width);
  }
  b.step_idx = Vector<int64_t>("step_idx", step_idx, DataType::INT64, rows);
  if (bias_ids) {
    Requires("bias_values", bias_values, "bias_ids");
    b.bias_ids = Matrix<int64_t>("bias_ids", *bias_ids, DataType::INT64, rows,
                                 &b.bias_width, &b.bias_ids_stride);
    int64_t values_width = 0;
    b.bias_values =
        Matrix<float>("bias_values", *bias_values, DataType::FLOAT32, rows,
                      &values_width, &b.bias_values_stride);
    if (values_width != b.bias_width) {
      kCheck.Fail("bias_values",
                  "shape [" + std::to_string(rows) + ", " +
                      std::to_string(b.bias_width) + "] (like bias_ids)",
                  "shape " + ShapeString({rows, values_width}));
    }
  }
  if (presence_penalty || frequency_penalty) {
    Requires("presence_penalty", presence_penalty, "frequency_penalty");
    Requires("frequency_penalty", frequency_penalty, "presence_penalty");
    Requires("output_ids", output_ids, "a penalty");
  }
  b.presence_penalty = Vector<float>("presence_penalty", presence_penalty,
                                     DataType::FLOAT32, rows);
  b.frequency_penalty = Vector<float>("frequency_penalty", frequency_penalty,
                                      DataType::FLOAT32, rows);
  if (repetition_penalty) Requires("output_ids", output_ids, "a penalty");
  b.repetition_penalty = Vector<float>("repetition_penalty", repetition_penalty,
                                       DataType::FLOAT32, rows);
  if (prompt_ids) {
    Requires("repetition_penalty", repetition_penalty, "prompt_ids");
    b.prompt_ids = DenseMatrix<int64_t>("prompt_ids", *prompt_ids,
                                        DataType::INT64, rows, &b.prompt_width);
  }
  if (top_logprobs < -1 || top_logprobs > b.vocab) {
    kCheck.Fail("top_logprobs",
                "-1 (no logprobs) or 0 .. " + std::to_string(b.vocab),
                std::to_string(top_logprobs));
  }
  b.top_logprobs = top_logprobs;

  const paddle::Place cpu = paddle::CPUPlace();
  std::vector<paddle::Tensor> outputs;
  outputs.push_back(paddle::empty({rows}, DataType::INT64, cpu));
  b.tokens = outputs[0].data<int64_t>();
  if (top_logprobs >= 0) AddLogprobOutputs(rows, top_logprobs, &b, &outputs);
  if (rows == 0) return outputs;

  const cpu::Isa isa = CpuActiveIsa();
  ForRowRanges(
      b, [&](int64_t begin, int64_t end, cpu::sampling::RowScratch& scratch) {
        cpu::SampleRows(isa, b, begin, end, scratch);
      });
  return outputs;
}

std::vector<paddle::Tensor> CpuTokenLogprobs(const paddle::Tensor& logits,
                                             const paddle::Tensor& tokens,
                                             int64_t top_logprobs) {
  using paddle::DataType;
  constexpr InputChecker kLogprobsCheck("cpu_token_logprobs");
  cpu::SamplingBatch b;
  ReadLogits(kLogprobsCheck, logits, &b);
  const int64_t rows = b.rows;
  const TensorView tokens_view = ViewOf(tokens);
  kLogprobsCheck.Dtype("tokens", tokens_view, {DataType::INT64});
  kLogprobsCheck.Shape("tokens", tokens_view, {rows});
  kLogprobsCheck.DenseCpu("tokens", tokens);
  b.given_tokens = tokens.data<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    if (b.given_tokens[row] < 0 || b.given_tokens[row] >= b.vocab) {
      kLogprobsCheck.Fail("tokens",
                          "ids in [0, " + std::to_string(b.vocab) + ")",
                          std::to_string(b.given_tokens[row]) + " at row " +
                              std::to_string(row));
    }
  }
  if (top_logprobs < 0 || top_logprobs > b.vocab) {
    kLogprobsCheck.Fail("top_logprobs", "0 .. " + std::to_string(b.vocab),
                        std::to_string(top_logprobs));
  }
  b.top_logprobs = top_logprobs;

  std::vector<paddle::Tensor> outputs;
  AddLogprobOutputs(rows, top_logprobs, &b, &outputs);
  outputs.push_back(paddle::empty({rows}, DataType::INT64, paddle::CPUPlace()));
  b.ranks = outputs.back().data<int64_t>();
  if (rows == 0) return outputs;

  const cpu::Isa isa = CpuActiveIsa();
  ForRowRanges(
      b, [&](int64_t begin, int64_t end, cpu::sampling::RowScratch& scratch) {
        cpu::TokenLogprobsRows(isa, b, begin, end, scratch);
      });
  return outputs;
}

}  // namespace paddle_step
