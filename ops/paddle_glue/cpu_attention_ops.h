// Attention through the paged KV cache and the cache write on Paddle CPU
// tensors (ops/cpu_paged_attention.cc), bound by the pybind11 fast path
// (bindings.cc). The kernels are ops/include/cpu_paged_attention_kernel.h.
#pragma once

#include <cstdint>

#include "paddle/extension.h"

namespace paddle_step {

// Writes k[i], v[i] ([N, kv_heads, head_dim]) at slot slots[i] ([N] int64; -1
// writes nothing) of layer `layer` of key_cache / value_cache ([layers,
// num_slots, kv_heads, head_dim]), in place: float32 or float64, the dtype of
// k and v, or bfloat16 for float32 k and v, rounded to nearest even.
void CpuWriteKv(paddle::Tensor& key_cache, paddle::Tensor& value_cache,
                int64_t layer, const paddle::Tensor& slots,
                const paddle::Tensor& k, const paddle::Tensor& v);

// Where a step's tokens find their keys and values: layer `layer` of
// key_cache / value_cache ([layers, num_slots, kv_heads, head_dim], float32,
// float64 or bfloat16, both alike); token t reads block-table row rows[t] of
// block_tables ([B, M] int32 or int64) at positions 0..positions[t] ([T]
// int64 each), block_size slots a block.
struct PagedKvView {
  paddle::Tensor key_cache;
  paddle::Tensor value_cache;
  int64_t layer = 0;
  paddle::Tensor block_tables;
  paddle::Tensor rows;
  paddle::Tensor positions;
  int64_t block_size = 0;
};

// Attention of tokens q [T, heads, head_dim] over their keys in `cache`,
// scores scaled by `scale`. q has the cache's dtype, or float32 for a bfloat16
// cache (read widened, computed in float32). Returns [T, heads * head_dim] in
// q's dtype.
paddle::Tensor CpuDecodeAttention(const paddle::Tensor& q,
                                  const PagedKvView& cache, double scale);

}  // namespace paddle_step
