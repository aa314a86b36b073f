// One Llama decoder layer over a step's tokens on the CPU, in one call
// (ops/cpu_decoder_layer.cc), bound by the pybind11 fast path (bindings.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cpu_attention_ops.h"
#include "paddle/extension.h"

namespace paddle_step {

// A product's packed weights and bias, and its path, as CpuLinear takes them.
struct PackedLinear {
  paddle::Tensor weights;
  paddle::optional<paddle::Tensor> scales;
  paddle::optional<paddle::Tensor> bias;
  int64_t n = 0;
  int64_t group_size = 0;
  std::string isa;  // "": the process's path
};

struct DecoderLayerWeights {
  paddle::Tensor attn_norm;  // [hidden]
  PackedLinear qkv;          // [hidden, (heads + 2 kv_heads) head_dim]
  PackedLinear o;            // [heads head_dim, hidden]
  paddle::Tensor mlp_norm;   // [hidden]
  PackedLinear gate_up;      // [hidden, 2 intermediate]
  PackedLinear down;         // [intermediate, hidden]
};

// A layer's head counts, head size and RMSNorm epsilon.
struct DecoderLayerShape {
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  double eps = 0.0;
};

// A step's tokens as a layer sees them: rotary tables cos, sin ([T, head_dim],
// rotate-half layout), the cache slot each token's K/V goes to (slots [T]
// int64, -1: none), and where the tokens read their keys (`cache`). With
// output_rows (int64 [R], tokens in [0, T)), the layer returns those tokens'
// rows alone, in that order: every token's K/V is written and attended as
// without, then the output product and the MLP run on those R rows only.
struct DecoderLayerStep {
  paddle::Tensor cos;
  paddle::Tensor sin;
  paddle::Tensor slots;
  PagedKvView cache;
  paddle::optional<paddle::Tensor> output_rows;
};

// x float32 [T, hidden] (a step's tokens) through RMSNorm, the fused q/k/v
// product, rotary embedding, the K/V write at the step's slots, attention
// (CpuDecodeAttention: a token at position p sees the cache's keys 0..p, its
// own step's included), the output product and its residual, RMSNorm, SwiGLU
// and its residual: float32 [T, hidden] (or [R, hidden]: step.output_rows).
paddle::Tensor CpuDecoderLayer(const paddle::Tensor& x,
                               const DecoderLayerWeights& weights,
                               const DecoderLayerShape& shape,
                               const DecoderLayerStep& step);

// A model's decoder layers on one rank, as CpuDecoderLayers runs them: each
// layer's weights (their products on the path each names) and the shape they
// share. Built once from the model's weights, so that a step hands over only
// its own tensors.
struct DecoderStack {
  std::vector<DecoderLayerWeights> layers;
  DecoderLayerShape shape;
};

// A step's tokens as the layers of a stack see them: `cos_table` and
// `sin_table` ([P, head_dim], rotate-half layout) hold the rotary values of
// positions 0..P-1, of which each token takes the row of its position
// (cache.positions, every one below P); slots and cache as in
// DecoderLayerStep, cache.layer being the cache layer of the stack's first
// layer (the stack's layer i reads and writes cache layer cache.layer + i).
struct DecoderStackStep {
  paddle::Tensor cos_table;
  paddle::Tensor sin_table;
  paddle::Tensor slots;
  PagedKvView cache;
};

// x float32 [T, hidden] through the first `layers` layers of `stack`
// (0 <= layers <= stack.layers.size()), each as CpuDecoderLayer: the same
// result as that many CpuDecoderLayer calls, in one crossing from Python.
// With output_rows (int64 [R], tokens in [0, T)), the last layer returns those
// tokens' rows alone ([R, hidden]; DecoderLayerStep): the rows a step's logits
// read, so that the others skip that layer's output product and MLP (as
// llama.cpp's output ids do). Their bits are those of the full result's rows.
paddle::Tensor CpuDecoderLayers(
    const paddle::Tensor& x, const DecoderStack& stack,
    const DecoderStackStep& step, int64_t layers,
    const paddle::optional<paddle::Tensor>& output_rows = paddle::none);

// RMSNorm of x float32 [T, width] times weight float32 [width], as a layer
// normalizes (the same float32 operations in the same order): for the final
// norm after the layers, one call where the eager expression is seven ops.
paddle::Tensor CpuRmsNorm(const paddle::Tensor& x, const paddle::Tensor& weight,
                          double eps);

}  // namespace paddle_step
