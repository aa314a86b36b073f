// pybind11 fast path: the same C++ entry points as the registered ops, bound
// directly. A call through Paddle's generated custom-op API costs tens of
// microseconds of dispatch; through this binding about one.
//
// The module name must match the op library's name (setup_ops.py): Paddle's
// generated loader imports the library as a Python extension module of that
// name, which is what exposes these functions.
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_attention_ops.h"
#include "cpu_decoder_layer_ops.h"
#include "cpu_linear_ops.h"
#include "cpu_sampling_ops.h"
#include "cpu_update_inputs_ops.h"
#include "paddle/utils/pybind.h"
#include "paddle_step_ops.h"
#include "step_paddle_tensors.h"

namespace {

// (dtype name, shape) per argument, as the Python wrapper describes its
// static-mode variables, in the op's input order.
using Described = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// None or a tensor, as paddle::optional (see advance_step's `active`).
paddle::optional<paddle::Tensor> OptionalTensor(const pybind11::object& value) {
  if (value.is_none()) return paddle::none;
  return value.cast<paddle::Tensor>();
}

std::vector<paddle_step::TensorView> ToViews(const Described& described) {
  std::vector<paddle_step::TensorView> views;
  for (const auto& [dtype, shape] : described) {
    views.push_back({paddle_step::DataTypeFromName(dtype), shape.data(),
                     static_cast<int64_t>(shape.size())});
  }
  return views;
}

template <typename T>
constexpr const char* DTypeName() {
  if constexpr (std::is_same_v<T, bool>) return "bool";
  if constexpr (std::is_same_v<T, int32_t>) return "int32";
  if constexpr (std::is_same_v<T, int64_t>) return "int64";
}

// step_paddle_tensors.h as (name, dtype, shape kind, written) rows, so that a
// test can hold the C++ table against spec/tensor_table.py.
pybind11::list StepPaddleTensorTable() {
  pybind11::list table;
#define PADDLE_STEP_ROW(name, type, shape, access)                        \
  table.append(pybind11::make_tuple(                                      \
      #name, DTypeName<type>(), #shape,                                   \
      paddle_step::Access::access == paddle_step::Access::kWritten));
  PADDLE_STEP_STEP_PADDLE_TENSORS(PADDLE_STEP_ROW)
#undef PADDLE_STEP_ROW
  return table;
}

// Argument `name` of `op` is a tuple of `size` items, or a ValueError names
// what its items are.
void CheckItemCount(const char* op, const char* name,
                    const pybind11::tuple& tuple, size_t size,
                    const char* items) {
  if (tuple.size() != size) {
    throw std::invalid_argument(std::string(op) + ": argument '" + name +
                                "': expected (" + items + "), got a tuple of " +
                                std::to_string(tuple.size()));
  }
}

// (key_cache, value_cache, layer, block_tables, rows, positions, block_size):
// PagedKVCache.view's tuple (layers/paged_attention.py).
paddle_step::PagedKvView PagedKvViewOf(const char* op,
                                       const pybind11::tuple& cache) {
  CheckItemCount(op, "cache", cache, 7,
                 "key_cache, value_cache, layer, block_tables, rows, "
                 "positions, block_size");
  return {cache[0].cast<paddle::Tensor>(), cache[1].cast<paddle::Tensor>(),
          cache[2].cast<int64_t>(),        cache[3].cast<paddle::Tensor>(),
          cache[4].cast<paddle::Tensor>(), cache[5].cast<paddle::Tensor>(),
          cache[6].cast<int64_t>()};
}

// (weights, scales or None, bias or None, n, group_size[, isa]): a product as
// layers/cpu_linear.py describes it, and the path it runs on ("" or left out:
// the process's).
paddle_step::PackedLinear PackedLinearOf(const pybind11::tuple& linear) {
  if (linear.size() != 5 && linear.size() != 6) {
    throw std::invalid_argument(
        "cpu_decoder_layers: expected a product as (weights, scales, bias, n, "
        "group_size[, isa]), got a tuple of " + std::to_string(linear.size()));
  }
  return {linear[0].cast<paddle::Tensor>(), OptionalTensor(linear[1]),
          OptionalTensor(linear[2]), linear[3].cast<int64_t>(),
          linear[4].cast<int64_t>(),
          linear.size() == 6 ? linear[5].cast<std::string>() : std::string()};
}

// (attn_norm, qkv, o, mlp_norm, gate_up, down): norms as tensors, products as
// PackedLinearOf takes them.
paddle_step::DecoderLayerWeights DecoderLayerWeightsOf(
    const pybind11::tuple& weights) {
  CheckItemCount("cpu_decoder_layers", "weights", weights, 6,
                 "attn_norm, qkv, o, mlp_norm, gate_up, down");
  return {weights[0].cast<paddle::Tensor>(),
          PackedLinearOf(weights[1].cast<pybind11::tuple>()),
          PackedLinearOf(weights[2].cast<pybind11::tuple>()),
          weights[3].cast<paddle::Tensor>(),
          PackedLinearOf(weights[4].cast<pybind11::tuple>()),
          PackedLinearOf(weights[5].cast<pybind11::tuple>())};
}

// (heads, kv_heads, head_dim, eps).
paddle_step::DecoderLayerShape DecoderLayerShapeOf(
    const pybind11::tuple& shape) {
  CheckItemCount("cpu_decoder_layers", "shape", shape, 4,
                 "heads, kv_heads, head_dim, eps");
  return {shape[0].cast<int64_t>(), shape[1].cast<int64_t>(),
          shape[2].cast<int64_t>(), shape[3].cast<double>()};
}

// (cos_table, sin_table, slots, cache): cache as PagedKvViewOf takes it.
paddle_step::DecoderStackStep DecoderStackStepOf(const pybind11::tuple& step) {
  CheckItemCount("cpu_decoder_layers", "step", step, 4,
                 "cos_table, sin_table, slots, cache");
  return {step[0].cast<paddle::Tensor>(), step[1].cast<paddle::Tensor>(),
          step[2].cast<paddle::Tensor>(),
          PagedKvViewOf("cpu_decoder_layers", step[3].cast<pybind11::tuple>())};
}

// A tuple of layers' weights (as DecoderLayerWeightsOf takes each) and their
// shape, read once.
paddle_step::DecoderStack DecoderStackOf(const pybind11::tuple& layers,
                                         const pybind11::tuple& shape) {
  paddle_step::DecoderStack stack;
  stack.shape = DecoderLayerShapeOf(shape);
  for (const auto& layer : layers) {
    stack.layers.push_back(
        DecoderLayerWeightsOf(layer.cast<pybind11::tuple>()));
  }
  return stack;
}

}  // namespace

PYBIND11_MODULE(paddle_step_ops, module) {
  module.doc() = "paddle_step kernels: pybind11 fast path";
  // `active` comes in as a plain object: paddle 2.6's pybind caster for
  // paddle::optional does not compile.
  module.def(
      "advance_step",
      [](paddle::Tensor& input_tokens, const paddle::Tensor& sampled_token_ids,
         paddle::Tensor& input_positions, paddle::Tensor& seq_lens,
         paddle::Tensor& slot_mapping, const paddle::Tensor& block_tables,
         const pybind11::object& active, int64_t num_seqs, int64_t num_queries,
         int64_t block_size) {
        paddle::optional<paddle::Tensor> active_mask;
        if (!active.is_none()) active_mask = active.cast<paddle::Tensor>();
        paddle_step::AdvanceStep(input_tokens, sampled_token_ids,
                                 input_positions, seq_lens, slot_mapping,
                                 block_tables, active_mask, num_seqs,
                                 num_queries, block_size);
      },
      pybind11::arg("input_tokens"), pybind11::arg("sampled_token_ids"),
      pybind11::arg("input_positions"), pybind11::arg("seq_lens"),
      pybind11::arg("slot_mapping"), pybind11::arg("block_tables"),
      pybind11::arg("active"), pybind11::arg("num_seqs"),
      pybind11::arg("num_queries"), pybind11::arg("block_size"));
  module.def("step_paddle", &paddle_step::StepPaddle);
  module.def("step_paddle_tensor_table", &StepPaddleTensorTable);
  module.def(
      "check_advance_step", [](const Described& described, int64_t num_seqs,
                               int64_t num_queries, int64_t block_size) {
        const auto views = ToViews(described);
        paddle_step::CheckAdvanceStepViews(views.data(),
                                           static_cast<int>(views.size()),
                                           num_seqs, num_queries, block_size);
      });
  module.def("check_step_paddle",
             [](const Described& described, int64_t block_size) {
               const auto views = ToViews(described);
               if (views.size() != paddle_step::kStepPaddleTensorCount) {
                 throw std::invalid_argument(
                     "check_step_paddle: expected " +
                     std::to_string(paddle_step::kStepPaddleTensorCount) +
                     " tensors, got " + std::to_string(views.size()));
               }
               paddle_step::CheckStepPaddleViews(views.data(), block_size);
             });
  module.def(
      "cpu_linear",
      [](const paddle::Tensor& x, const paddle::Tensor& weights,
         const pybind11::object& scales, const pybind11::object& bias,
         int64_t n, int64_t group_size, const std::string& isa) {
        return paddle_step::CpuLinear(x, weights, OptionalTensor(scales),
                                      OptionalTensor(bias), n, group_size, isa);
      },
      pybind11::arg("x"), pybind11::arg("weights"), pybind11::arg("scales"),
      pybind11::arg("bias"), pybind11::arg("n"), pybind11::arg("group_size"),
      pybind11::arg("isa") = "");
  module.def("cpu_linear_pack_float32", &paddle_step::CpuLinearPackFloat32,
             pybind11::arg("w"), pybind11::arg("transposed") = false);
  module.def("cpu_linear_pack_bfloat16", &paddle_step::CpuLinearPackBFloat16,
             pybind11::arg("w"), pybind11::arg("transposed") = false);
  module.def("cpu_linear_pack_int8", &paddle_step::CpuLinearPackInt8,
             pybind11::arg("w"), pybind11::arg("group_size"),
             pybind11::arg("transposed") = false);
  module.def("cpu_linear_set_num_threads",
             &paddle_step::CpuLinearSetNumThreads, pybind11::arg("threads"));
  module.def("cpu_linear_num_threads", &paddle_step::CpuLinearNumThreads);
  module.def("cpu_linear_set_isa", &paddle_step::CpuLinearSetIsa,
             pybind11::arg("name"));
  module.def("cpu_linear_isa", &paddle_step::CpuLinearIsa);
  module.def("cpu_linear_best_isa", &paddle_step::CpuLinearBestIsa);
  module.def("cpu_linear_set_prefetch_bytes",
             &paddle_step::CpuLinearSetPrefetchBytes, pybind11::arg("one_row"),
             pybind11::arg("several_rows"), pybind11::arg("l2_one_row") = 0,
             pybind11::arg("l2_several_rows") = 0);
  module.def("cpu_linear_prefetch_bytes", &paddle_step::CpuLinearPrefetchBytes);
  module.def("cpu_write_kv", &paddle_step::CpuWriteKv,
             pybind11::arg("key_cache"), pybind11::arg("value_cache"),
             pybind11::arg("layer"), pybind11::arg("slots"), pybind11::arg("k"),
             pybind11::arg("v"));
  module.def(
      "cpu_decode_attention",
      [](const paddle::Tensor& q, const pybind11::tuple& cache, double scale) {
        return paddle_step::CpuDecodeAttention(
            q, PagedKvViewOf("cpu_decode_attention", cache), scale);
      },
      pybind11::arg("q"), pybind11::arg("cache"), pybind11::arg("scale"));
  pybind11::class_<paddle_step::DecoderStack>(
      module, "DecoderStack",
      "A model's decoder layers, their weights read once; called with a step, "
      "runs its first `layers` layers in one call (cpu_decoder_layers)")
      .def(pybind11::init(&DecoderStackOf), pybind11::arg("layers"),
           pybind11::arg("shape"))
      .def("__len__",
           [](const paddle_step::DecoderStack& stack) {
             return stack.layers.size();
           })
      .def(
          "__call__",
          [](const paddle_step::DecoderStack& stack, const paddle::Tensor& x,
             const pybind11::tuple& step, int64_t layers,
             const pybind11::object& output_rows) {
            return paddle_step::CpuDecoderLayers(
                x, stack, DecoderStackStepOf(step), layers,
                OptionalTensor(output_rows));
          },
          pybind11::arg("x"), pybind11::arg("step"), pybind11::arg("layers"),
          pybind11::arg("output_rows") = pybind11::none());
  module.def("cpu_rms_norm", &paddle_step::CpuRmsNorm, pybind11::arg("x"),
             pybind11::arg("weight"), pybind11::arg("eps"));
  module.def("cpu_token_logprobs", &paddle_step::CpuTokenLogprobs,
             pybind11::arg("logits"), pybind11::arg("tokens"),
             pybind11::arg("top_logprobs"));
  module.def(
      "cpu_sample",
      [](const paddle::Tensor& logits, const paddle::Tensor& temperature,
         const paddle::Tensor& top_p, const pybind11::object& top_k,
         const pybind11::object& min_p, const pybind11::object& uniforms,
         const pybind11::object& allowed_bits, const pybind11::object& stop_ids,
         const pybind11::object& min_tokens, const pybind11::object& step_idx,
         const pybind11::object& output_ids, const pybind11::object& bias_ids,
         const pybind11::object& bias_values,
         const pybind11::object& presence_penalty,
         const pybind11::object& frequency_penalty,
         const pybind11::object& repetition_penalty,
         const pybind11::object& prompt_ids, int64_t top_logprobs) {
        return paddle_step::CpuSample(
            logits, temperature, top_p, OptionalTensor(top_k),
            OptionalTensor(min_p), OptionalTensor(uniforms),
            OptionalTensor(allowed_bits), OptionalTensor(stop_ids),
            OptionalTensor(min_tokens), OptionalTensor(step_idx),
            OptionalTensor(output_ids), OptionalTensor(bias_ids),
            OptionalTensor(bias_values), OptionalTensor(presence_penalty),
            OptionalTensor(frequency_penalty),
            OptionalTensor(repetition_penalty), OptionalTensor(prompt_ids),
            top_logprobs);
      },
      pybind11::arg("logits"), pybind11::arg("temperature"),
      pybind11::arg("top_p"), pybind11::arg("top_k"), pybind11::arg("min_p"),
      pybind11::arg("uniforms"), pybind11::arg("allowed_bits"),
      pybind11::arg("stop_ids"), pybind11::arg("min_tokens"),
      pybind11::arg("step_idx"), pybind11::arg("output_ids"),
      pybind11::arg("bias_ids"), pybind11::arg("bias_values"),
      pybind11::arg("presence_penalty"), pybind11::arg("frequency_penalty"),
      pybind11::arg("repetition_penalty"), pybind11::arg("prompt_ids"),
      pybind11::arg("top_logprobs"));
#define PADDLE_STEP_KEYWORD(name, access) pybind11::arg(#name),
  module.def("cpu_update_inputs", &paddle_step::CpuUpdateInputs,
             pybind11::arg("running"),
             PADDLE_STEP_CPU_UPDATE_INPUTS_TENSORS(PADDLE_STEP_KEYWORD)
             "FastDeploy's update_inputs and stop checks over the slot state");
#undef PADDLE_STEP_KEYWORD
  module.def("cpu_read_sum", &paddle_step::CpuReadSum, pybind11::arg("data"));
  module.def("cpu_fma_rate", &paddle_step::CpuFmaRate,
             pybind11::arg("iterations"));
}
