// cpu_decoder_layer: a whole decoder layer over a step's tokens in one call,
// so that a step pays one Python-to-C++ crossing per layer instead of a few
// dozen eager ops, and its element-wise parts run on every thread; and a
// model's layers in one call (CpuDecoderLayers), one crossing per step. The
// products are CpuLinear's, the attention and the cache write
// cpu_paged_attention's, the element-wise parts
// ops/include/cpu_decoder_layer_kernel.h.
#include <algorithm>
#include <cmath>
#include <string>

#include "cpu_attention_ops.h"
#include "cpu_decoder_layer_kernel.h"
#include "cpu_decoder_layer_ops.h"
#include "cpu_linear_ops.h"
#include "cpu_runtime.h"
#include "input_checks.h"

namespace paddle_step {
namespace {

constexpr InputChecker kCheck("cpu_decoder_layer");

// Values per task of an element-wise loop: below this, handing rows to
// another thread costs more than it saves.
constexpr int64_t kValuesPerTask = 16384;

// body(first, last) over ranges of rows [0, rows) of `width` values each, on
// the CPU kernels' pool; one inline call where the rows are few.
template <typename Body>
void ForRowRanges(int64_t rows, int64_t width, const Body& body) {
  cpu::ThreadPool& pool = CpuThreadPool();
  const int tasks = static_cast<int>(std::min<int64_t>(
      {int64_t{pool.size()} * 4, rows * width / kValuesPerTask, rows,
       cpu::ThreadPool::kMaxTasks}));
  if (tasks <= 1) {
    body(int64_t{0}, rows);
    return;
  }
  pool.Run(tasks, [&](int task) {
    body(rows * task / tasks, rows * (task + 1) / tasks);
  });
}

// RMSNorm of `rows` rows of x into out (cpu::RmsNorm), over the pool.
void RmsNormRows(const float* x, const float* weight, int64_t rows,
                 int64_t width, float eps, float* out) {
  ForRowRanges(rows, width, [&](int64_t first, int64_t last) {
    cpu::RmsNorm(x + first * width, weight, last - first, width, eps,
                 out + first * width);
  });
}

// x += y over `rows` rows of `width` values, over the pool.
void AddRows(float* x, const float* y, int64_t rows, int64_t width) {
  ForRowRanges(rows, width, [&](int64_t first, int64_t last) {
    cpu::AddInPlace(x + first * width, y + first * width,
                    (last - first) * width);
  });
}

void CheckFloatMatrix(const char* name, const paddle::Tensor& tensor,
                      std::initializer_list<int64_t> shape,
                      const InputChecker& check = kCheck) {
  check.Dtype(name, ViewOf(tensor), {paddle::DataType::FLOAT32});
  check.Shape(name, ViewOf(tensor), shape);
  check.DenseCpu(name, tensor);
}

paddle::Tensor Product(const paddle::Tensor& x, const PackedLinear& linear) {
  return CpuLinear(x, linear.weights, linear.scales, linear.bias, linear.n,
                   linear.group_size, linear.isa);
}

// Heads [first, first + count) of each row of the q/k/v product [T, width],
// as a tensor [T, count, head_dim] of their own (what the attention entry
// points take; a few KB per layer).
paddle::Tensor Columns(const paddle::Tensor& qkv, int64_t first, int64_t count,
                       int64_t head_dim) {
  const int64_t tokens = qkv.dims()[0];
  const int64_t width = qkv.dims()[1];
  auto out = paddle::empty({tokens, count, head_dim}, paddle::DataType::FLOAT32,
                           paddle::CPUPlace());
  const float* in = qkv.data<float>() + first * head_dim;
  float* to = out.data<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    std::copy(in + t * width, in + t * width + count * head_dim,
              to + t * count * head_dim);
  }
  return out;
}

// Rows `rows` (int64 [R], checked) of a tensor [T, ...], as [R, ...].
paddle::Tensor Rows(const paddle::Tensor& tensor, const paddle::Tensor& rows) {
  std::vector<int64_t> shape = tensor.shape();
  const int64_t width = shape[0] ? tensor.numel() / shape[0] : 0;
  shape[0] = rows.numel();
  auto out =
      paddle::empty(shape, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* in = tensor.data<float>();
  const int64_t* index = rows.data<int64_t>();
  for (int64_t r = 0; r < shape[0]; ++r) {
    std::copy(in + index[r] * width, in + (index[r] + 1) * width,
              out.data<float>() + r * width);
  }
  return out;
}

}  // namespace

paddle::Tensor CpuRmsNorm(const paddle::Tensor& x, const paddle::Tensor& weight,
                          double eps) {
  constexpr InputChecker kNormCheck("cpu_rms_norm");
  kNormCheck.Dtype("x", ViewOf(x), {paddle::DataType::FLOAT32});
  kNormCheck.Shape("x", ViewOf(x), {-1, -1});
  const int64_t rows = x.dims()[0];
  const int64_t width = x.dims()[1];
  CheckFloatMatrix("weight", weight, {width}, kNormCheck);
  auto out = paddle::empty({rows, width}, paddle::DataType::FLOAT32,
                           paddle::CPUPlace());
  if (rows == 0 && x.is_cpu()) return out;  // its strides may be anything
  kNormCheck.DenseCpu("x", x);
  RmsNormRows(x.data<float>(), weight.data<float>(), rows, width,
              static_cast<float>(eps), out.data<float>());
  return out;
}

paddle::Tensor CpuDecoderLayer(const paddle::Tensor& x,
                               const DecoderLayerWeights& weights,
                               const DecoderLayerShape& shape,
                               const DecoderLayerStep& step) {
  // Plain copies: lambdas below capture them (C++17 cannot capture bindings).
  const int64_t heads = shape.heads, kv_heads = shape.kv_heads;
  const int64_t head_dim = shape.head_dim;
  const double eps = shape.eps;
  const paddle::Tensor& cos = step.cos;
  const paddle::Tensor& sin = step.sin;
  CheckFloatMatrix("x", x, {-1, -1});
  const int64_t tokens = x.dims()[0];
  const int64_t hidden = x.dims()[1];
  CheckFloatMatrix("attn_norm", weights.attn_norm, {hidden});
  CheckFloatMatrix("mlp_norm", weights.mlp_norm, {hidden});
  CheckFloatMatrix("cos", cos, {tokens, head_dim});
  CheckFloatMatrix("sin", sin, {tokens, head_dim});
  kCheck.Positive("head_dim", head_dim);
  if (head_dim % 2 != 0) {
    kCheck.Fail("head_dim", "an even number (rotary embedding)",
                std::to_string(head_dim));
  }
  const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim;
  if (weights.qkv.n != qkv_width) {
    kCheck.Fail("qkv", "a product of (heads + 2 kv_heads) * head_dim = " +
                           std::to_string(qkv_width) + " columns",
                std::to_string(weights.qkv.n));
  }
  if (weights.o.n != hidden || weights.down.n != hidden ||
      weights.gate_up.n % 2 != 0) {
    kCheck.Fail("o, gate_up, down",
                "products of " + std::to_string(hidden) +
                    ", an even number and " + std::to_string(hidden) +
                    " columns",
                std::to_string(weights.o.n) + ", " +
                    std::to_string(weights.gate_up.n) + " and " +
                    std::to_string(weights.down.n));
  }
  const cpu::Isa isa = CpuActiveIsa();
  const float epsilon = static_cast<float>(eps);

  auto normed = paddle::empty({tokens, hidden}, paddle::DataType::FLOAT32,
                              paddle::CPUPlace());
  RmsNormRows(x.data<float>(), weights.attn_norm.data<float>(), tokens,
              hidden, epsilon, normed.data<float>());
  auto qkv = Product(normed, weights.qkv);
  float* qkv_rows = qkv.data<float>();
  ForRowRanges(tokens, qkv_width, [&](int64_t first, int64_t last) {
    cpu::RotateHalf(qkv_rows + first * qkv_width, last - first, qkv_width,
                    heads + kv_heads, head_dim,
                    cos.data<float>() + first * head_dim,
                    sin.data<float>() + first * head_dim);
  });
  const auto q = Columns(qkv, 0, heads, head_dim);
  // A float32 or bfloat16 cache: the float32 k and v are stored rounded in the
  // second, and attention reads it widened.
  paddle::Tensor key_cache = step.cache.key_cache;  // handles: written in place
  paddle::Tensor value_cache = step.cache.value_cache;
  CpuWriteKv(key_cache, value_cache, step.cache.layer, step.slots,
             Columns(qkv, heads, kv_heads, head_dim),
             Columns(qkv, heads + kv_heads, kv_heads, head_dim));
  auto attention =
      CpuDecodeAttention(q, step.cache, 1.0 / std::sqrt(head_dim));
  // The rest is row by row: on the rows asked for alone, where some are.
  paddle::Tensor input = x;
  int64_t rows = tokens;
  if (step.output_rows) {
    attention = Rows(attention, *step.output_rows);
    input = Rows(x, *step.output_rows);
    rows = step.output_rows->numel();
    normed = paddle::empty({rows, hidden}, paddle::DataType::FLOAT32,
                           paddle::CPUPlace());
  }

  auto residual = Product(attention, weights.o);  // x + o(attention)
  AddRows(residual.data<float>(), input.data<float>(), rows, hidden);
  RmsNormRows(residual.data<float>(), weights.mlp_norm.data<float>(), rows,
              hidden, epsilon, normed.data<float>());
  auto gate_up = Product(normed, weights.gate_up);
  const int64_t intermediate = weights.gate_up.n / 2;
  auto activation = paddle::empty(
      {rows, intermediate}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  ForRowRanges(rows, intermediate, [&](int64_t first, int64_t last) {
    cpu::SiluTimesUp(isa, gate_up.data<float>() + first * 2 * intermediate,
                     last - first, intermediate,
                     activation.data<float>() + first * intermediate);
  });
  auto out = Product(activation, weights.down);
  AddRows(out.data<float>(), residual.data<float>(), rows, hidden);
  return out;
}

paddle::Tensor CpuDecoderLayers(
    const paddle::Tensor& x, const DecoderStack& stack,
    const DecoderStackStep& step, int64_t layers,
    const paddle::optional<paddle::Tensor>& output_rows) {
  constexpr InputChecker kStackCheck("cpu_decoder_layers");
  const int64_t available = static_cast<int64_t>(stack.layers.size());
  if (layers < 0 || layers > available) {
    kStackCheck.Fail("layers",
                     "a layer count in [0, " + std::to_string(available) + "]",
                     std::to_string(layers));
  }
  const int64_t head_dim = stack.shape.head_dim;
  kStackCheck.Positive("head_dim", head_dim);
  const PagedKvView& cache = step.cache;
  kStackCheck.Dtype("positions", ViewOf(cache.positions),
                    {paddle::DataType::INT64});
  kStackCheck.Shape("positions", ViewOf(cache.positions), {-1});
  kStackCheck.DenseCpu("positions", cache.positions);
  const int64_t tokens = cache.positions.dims()[0];
  CheckFloatMatrix("cos_table", step.cos_table, {-1, head_dim}, kStackCheck);
  const int64_t table_rows = step.cos_table.dims()[0];
  CheckFloatMatrix("sin_table", step.sin_table, {table_rows, head_dim},
                   kStackCheck);
  // Each token's rotary rows, once for every layer.
  auto cos = paddle::empty({tokens, head_dim}, paddle::DataType::FLOAT32,
                           paddle::CPUPlace());
  auto sin = paddle::empty({tokens, head_dim}, paddle::DataType::FLOAT32,
                           paddle::CPUPlace());
  const int64_t* positions = cache.positions.data<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    if (positions[t] < 0 || positions[t] >= table_rows) {
      kStackCheck.Fail("positions",
                       "positions in [0, " + std::to_string(table_rows) +
                           ") (the rotary tables' rows)",
                       std::to_string(positions[t]) + " at token " +
                           std::to_string(t));
    }
    const int64_t from = positions[t] * head_dim;
    std::copy(step.cos_table.data<float>() + from,
              step.cos_table.data<float>() + from + head_dim,
              cos.data<float>() + t * head_dim);
    std::copy(step.sin_table.data<float>() + from,
              step.sin_table.data<float>() + from + head_dim,
              sin.data<float>() + t * head_dim);
  }
  if (output_rows) {
    kStackCheck.Dtype("output_rows", ViewOf(*output_rows),
                      {paddle::DataType::INT64});
    kStackCheck.Shape("output_rows", ViewOf(*output_rows), {-1});
    if (output_rows->numel() == 0) {
      kStackCheck.Fail("output_rows", "at least one token (None: every token)",
                       "none");
    }
    kStackCheck.DenseCpu("output_rows", *output_rows);
    const int64_t* rows = output_rows->data<int64_t>();
    for (int64_t r = 0; r < output_rows->numel(); ++r) {
      if (rows[r] < 0 || rows[r] >= tokens) {
        kStackCheck.Fail("output_rows",
                         "tokens in [0, " + std::to_string(tokens) + ")",
                         std::to_string(rows[r]) + " at " + std::to_string(r));
      }
    }
  }
  DecoderLayerStep layer_step{cos, sin, step.slots, cache, paddle::none};
  paddle::Tensor hidden = x;
  for (int64_t i = 0; i < layers; ++i) {
    layer_step.cache.layer = cache.layer + i;
    if (i == layers - 1) layer_step.output_rows = output_rows;
    hidden = CpuDecoderLayer(hidden, stack.layers[i], stack.shape, layer_step);
  }
  if (layers > 0) return hidden;
  // No layer run: a copy, so that the result never aliases x.
  return output_rows ? Rows(x, *output_rows)
                     : x.copy_to(paddle::CPUPlace(), true);
}

}  // namespace paddle_step
