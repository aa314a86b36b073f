// One Llama decoder layer over a step's tokens on the CPU, in one call
// (ops/cpu_decoder_layer.cc), bound by the pybind11 fast path (bindings.cc).
#pragma once

#include <cstdint>
#include <string>

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

// x float32 [T, hidden] (a step's tokens) through RMSNorm, the fused q/k/v
// product, rotary embedding (cos, sin [T, head_dim], rotate-half layout), the
// K/V write at `slots` of layer `layer` of the caches, attention over each
// token's block-table row (CpuDecodeAttention: a token at position p sees the
// cache's keys 0..p, its own step's included), the output product and its
// residual, RMSNorm, SwiGLU and its residual: float32 [T, hidden].
paddle::Tensor CpuDecoderLayer(const paddle::Tensor& x,
                               const DecoderLayerWeights& weights,
                               int64_t heads, int64_t kv_heads,
                               int64_t head_dim, double eps,
                               const paddle::Tensor& cos,
                               const paddle::Tensor& sin,
                               paddle::Tensor& key_cache,
                               paddle::Tensor& value_cache, int64_t layer,
                               const paddle::Tensor& slots,
                               const paddle::Tensor& block_tables,
                               const paddle::Tensor& rows,
                               const paddle::Tensor& positions,
                               int64_t block_size);

}  // namespace paddle_step
