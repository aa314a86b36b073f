// Decode attention straight from the paged KV cache on the CPU, and the cache
// write before it. Framework-free: raw pointers only.
//
// The cache of one layer is [num_slots, kv_heads, head_dim] (slot = block *
// block_size + offset). A decode token t of block-table row r at position p
// attends to the keys at positions 0..p of its own sequence: position j lives
// at slot table[r][j / block_size] * block_size + j % block_size; a column past
// the table or a negative block id holds no key (it gets no weight). Query
// head h reads KV head h / (heads / kv_heads) (grouped-query attention).
//
//   out[t, h] = sum_j softmax_j(scale * q[t, h] . k_j) v_j
//
// The keys a token sees are found once per token and read straight from the
// cache: nothing is gathered into a copy, and each key and value vector is
// loaded once for all the query heads that share it. Scores, the softmax and
// the weighted sum run in the cache's type (float32 or float64). float32 runs
// one source compiled per instruction set (its dot products in 16 lanes, e^x
// by cpu_float_math.h's polynomial); float64 runs plain loops and std::exp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_float_math.h"
#include "cpu_float_vectors.h"
#include "cpu_isa.h"


namespace paddle_step::cpu {

// Writes k[i], v[i] ([count, row] each, row = kv_heads * head_dim) at
// slots[i] of one layer's caches ([num_slots, row]); slot -1 writes nothing.
// The caller checks every slot is < num_slots.
template <typename T>
void WriteKv(const T* k, const T* v, const int64_t* slots, int64_t count,
             int64_t row, T* key_cache, T* value_cache) {
  for (int64_t i = 0; i < count; ++i) {
    if (slots[i] < 0) continue;
    std::memcpy(key_cache + slots[i] * row, k + i * row, row * sizeof(T));
    std::memcpy(value_cache + slots[i] * row, v + i * row, row * sizeof(T));
  }
}

template <typename T, typename Table>
struct DecodeAttentionProblem {
  const T* q;            // [tokens, heads, head_dim]
  const T* key;          // one layer: [num_slots, kv_heads, head_dim]
  const T* value;        // likewise
  const Table* tables;   // [rows, table_width] block ids, -1 unused
  const int64_t* rows;   // [tokens] block-table row of each token
  const int64_t* positions;  // [tokens] position of each token
  T* out;                // [tokens, heads, head_dim]
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t table_width = 0;
  int64_t block_size = 0;
  T scale = 1;
};

// The slots of the keys token `t` sees, in order of position.
template <typename T, typename Table>
void VisibleSlots(const DecodeAttentionProblem<T, Table>& p, int64_t t,
                  std::vector<int64_t>* slots) {
  slots->clear();
  const Table* table = p.tables + p.rows[t] * p.table_width;
  const int64_t last = std::min(p.positions[t], p.table_width * p.block_size - 1);
  for (int64_t j = 0; j <= last; ++j) {
    const int64_t block = static_cast<int64_t>(table[j / p.block_size]);
    if (block >= 0) slots->push_back(block * p.block_size + j % p.block_size);
  }
}

// One token and one KV head with `group` query heads (q: [group, head_dim]):
// the scores of the `count` visible keys (`stride` values between two slots),
// their softmax, and out [group, head_dim] = the weighted sum of the values.
// Plain loops over contiguous runs (a head's dims, a row of scores), so they
// vectorize at whatever instruction set they are compiled for.
template <typename T>
PADDLE_STEP_LOOP_INLINE void AttendRows(const T* q, int64_t group,
                                        const T* key, const T* value,
                                        const int64_t* slots, int64_t count,
                                        int64_t stride, int64_t head_dim,
                                        T scale, T* scores, T* out) {
  for (int64_t j = 0; j < count; ++j) {
    const T* k = key + slots[j] * stride;
    for (int64_t h = 0; h < group; ++h) {
      T dot;
      if constexpr (std::is_same_v<T, float>) {
        dot = Dot(q + h * head_dim, k, head_dim);
      } else {
        dot = 0;
        for (int64_t d = 0; d < head_dim; ++d) dot += q[h * head_dim + d] * k[d];
      }
      scores[h * count + j] = dot * scale;
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    T* row = scores + h * count;
    T largest = row[0];
    for (int64_t j = 1; j < count; ++j) largest = row[j] > largest ? row[j] : largest;
    for (int64_t j = 0; j < count; ++j) row[j] -= largest;
    double total = 0;
    if constexpr (std::is_same_v<T, float>) {
      ExpNonPositive(row, row, count);
      total = Sum(row, count);
    } else {
      for (int64_t j = 0; j < count; ++j) total += row[j] = std::exp(row[j]);
    }
    const T inverse = static_cast<T>(1.0 / total);
    for (int64_t j = 0; j < count; ++j) row[j] *= inverse;
  }
  for (int64_t h = 0; h < group; ++h) {
    const T* weights = scores + h * count;
    T* o = out + h * head_dim;
    std::fill(o, o + head_dim, T(0));
    for (int64_t j = 0; j < count; ++j) {
      const T* v = value + slots[j] * stride;
      for (int64_t d = 0; d < head_dim; ++d) o[d] += weights[j] * v[d];
    }
  }
}

// AttendRows<float> compiled once per instruction set (RunOn).
struct AttendRowsLoop {
  template <typename Floats>
  PADDLE_STEP_LOOP_INLINE static int Run(const float* q, int64_t group,
                                         const float* key, const float* value,
                                         const int64_t* slots, int64_t count,
                                         int64_t stride, int64_t head_dim,
                                         float scale, float* scores,
                                         float* out) {
    AttendRows(q, group, key, value, slots, count, stride, head_dim, scale,
               scores, out);
    return 0;
  }
};

// Working memory of one thread: the visible slots and the scores.
template <typename T>
struct AttentionScratch {
  std::vector<int64_t> slots;
  std::vector<T> scores;
};

// Token t, KV head g: out[t, g * group .. (g + 1) * group). A token that sees
// no key gets zeros.
template <typename T, typename Table>
void AttendGroup(Isa isa, const DecodeAttentionProblem<T, Table>& p, int64_t t,
                 int64_t g, const std::vector<int64_t>& slots,
                 std::vector<T>* scores) {
  const int64_t group = p.heads / p.kv_heads;
  const int64_t count = static_cast<int64_t>(slots.size());
  const int64_t stride = p.kv_heads * p.head_dim;
  const T* q = p.q + (t * p.heads + g * group) * p.head_dim;
  const T* key = p.key + g * p.head_dim;
  const T* value = p.value + g * p.head_dim;
  T* out = p.out + (t * p.heads + g * group) * p.head_dim;
  if (count == 0) {
    std::fill(out, out + group * p.head_dim, T(0));
    return;
  }
  scores->resize(group * count);
  if constexpr (std::is_same_v<T, float>) {
    int lanes = 1;
    RunOn<AttendRowsLoop>(isa, &lanes, q, group, key, value, slots.data(),
                          count, stride, p.head_dim, p.scale, scores->data(),
                          out);
  } else {
    (void)isa;  // float64 runs the plain loops as built
    AttendRows(q, group, key, value, slots.data(), count, stride, p.head_dim,
               p.scale, scores->data(), out);
  }
}

}  // namespace paddle_step::cpu
