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
// the weighted sum run in the cache's type (float32 or float64); the vector
// paths (float32 only) differ from the scalar one only in the order of the sums
// inside a dot product.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"
#include "cpu_vector_exp.h"


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

// Per-path leaves: for one token and one KV head with `group` query heads,
// the scores of the `count` visible keys and the weighted sum of their values.
// `stride` is the distance between two slots (kv_heads * head_dim).
namespace attention_scalar {

template <typename T>
void Scores(const T* q, int64_t group, const T* key, const int64_t* slots,
            int64_t count, int64_t stride, int64_t head_dim, T scale,
            T* scores) {
  for (int64_t j = 0; j < count; ++j) {
    const T* k = key + slots[j] * stride;
    for (int64_t h = 0; h < group; ++h) {
      const T* qh = q + h * head_dim;
      T dot = 0;
      for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * k[d];
      scores[h * count + j] = dot * scale;
    }
  }
}

template <typename T>
void WeightedValues(const T* weights, int64_t group, const T* value,
                    const int64_t* slots, int64_t count, int64_t stride,
                    int64_t head_dim, T* out) {
  for (int64_t h = 0; h < group; ++h) {
    std::fill(out + h * head_dim, out + (h + 1) * head_dim, T(0));
  }
  for (int64_t j = 0; j < count; ++j) {
    const T* v = value + slots[j] * stride;
    for (int64_t h = 0; h < group; ++h) {
      const T w = weights[h * count + j];
      T* o = out + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] += w * v[d];
    }
  }
}

}  // namespace attention_scalar

#ifdef PADDLE_STEP_VECTOR_EXP_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace attention_avx512 {

// Lanes of the last, partial vector of a head_dim row.
inline __mmask16 TailMask(int64_t head_dim) {
  const int64_t rest = head_dim % 16;
  return rest == 0 ? __mmask16(0xFFFF) : __mmask16((1u << rest) - 1);
}

inline void Scores(const float* q, int64_t group, const float* key,
                   const int64_t* slots, int64_t count, int64_t stride,
                   int64_t head_dim, float scale, float* scores) {
  const int64_t vectors = (head_dim + 15) / 16;
  const __mmask16 tail = TailMask(head_dim);
  for (int64_t j = 0; j < count; ++j) {
    const float* k = key + slots[j] * stride;
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = q + h * head_dim;
      // Two accumulators: half the chain of dependent additions.
      __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 2 < vectors; i += 2) {
        even = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * i),
                               _mm512_loadu_ps(k + 16 * i), even);
        odd = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * i + 16),
                              _mm512_loadu_ps(k + 16 * i + 16), odd);
      }
      for (; i < vectors; ++i) {
        const __mmask16 lanes = i + 1 == vectors ? tail : __mmask16(0xFFFF);
        even = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, qh + 16 * i),
                               _mm512_maskz_loadu_ps(lanes, k + 16 * i), even);
      }
      scores[h * count + j] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd)) * scale;
    }
  }
}

inline void SoftmaxRows(float* scores, int64_t group, int64_t count) {
  const int64_t whole = count / 16 * 16;
  const __mmask16 tail = TailMask(count);
  for (int64_t h = 0; h < group; ++h) {
    float* row = scores + h * count;
    __m512 largest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < whole; j += 16) {
      largest = _mm512_max_ps(largest, _mm512_loadu_ps(row + j));
    }
    if (whole < count) {
      largest = _mm512_mask_max_ps(largest, tail, largest,
                                   _mm512_maskz_loadu_ps(tail, row + whole));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(largest));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < whole; j += 16) {
      const __m512 e = ExpAvx512(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift));
      _mm512_storeu_ps(row + j, e);
      total = _mm512_add_ps(total, e);
    }
    if (whole < count) {
      const __m512 e = _mm512_maskz_mov_ps(
          tail, ExpAvx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + whole), shift)));
      _mm512_mask_storeu_ps(row + whole, tail, e);
      total = _mm512_add_ps(total, e);
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int64_t j = 0; j < whole; j += 16) {
      _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), inverse));
    }
    if (whole < count) {
      _mm512_mask_storeu_ps(
          row + whole, tail,
          _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + whole), inverse));
    }
  }
}

// Columns [16 * first, 16 * (first + kVectors)) of each head's output, in
// kVectors registers across all the keys.
template <int kVectors>
void WeightedColumns(const float* weights, int64_t group, const float* value,
                     const int64_t* slots, int64_t count, int64_t stride,
                     int64_t head_dim, int64_t first, __mmask16 last_lanes,
                     float* out) {
  for (int64_t h = 0; h < group; ++h) {
    const float* w = weights + h * count;
    __m512 acc[kVectors];
    for (int i = 0; i < kVectors; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; ++j) {
      const float* v = value + slots[j] * stride + 16 * first;
      const __m512 wj = _mm512_set1_ps(w[j]);
      for (int i = 0; i + 1 < kVectors; ++i) {
        acc[i] = _mm512_fmadd_ps(wj, _mm512_loadu_ps(v + 16 * i), acc[i]);
      }
      acc[kVectors - 1] = _mm512_fmadd_ps(
          wj, _mm512_maskz_loadu_ps(last_lanes, v + 16 * (kVectors - 1)),
          acc[kVectors - 1]);
    }
    float* o = out + h * head_dim + 16 * first;
    for (int i = 0; i + 1 < kVectors; ++i) _mm512_storeu_ps(o + 16 * i, acc[i]);
    _mm512_mask_storeu_ps(o + 16 * (kVectors - 1), last_lanes, acc[kVectors - 1]);
  }
}

inline void WeightedValues(const float* weights, int64_t group,
                           const float* value, const int64_t* slots,
                           int64_t count, int64_t stride, int64_t head_dim,
                           float* out) {
  using Columns = void (*)(const float*, int64_t, const float*, const int64_t*,
                           int64_t, int64_t, int64_t, int64_t, __mmask16, float*);
  static constexpr Columns kColumns[] = {
      WeightedColumns<1>, WeightedColumns<2>, WeightedColumns<3>,
      WeightedColumns<4>, WeightedColumns<5>, WeightedColumns<6>,
      WeightedColumns<7>, WeightedColumns<8>};
  const int64_t vectors = (head_dim + 15) / 16;
  for (int64_t first = 0; first < vectors; first += 8) {
    const int64_t chunk = std::min<int64_t>(8, vectors - first);
    const __mmask16 lanes =
        first + chunk == vectors ? TailMask(head_dim) : __mmask16(0xFFFF);
    kColumns[chunk - 1](weights, group, value, slots, count, stride, head_dim,
                        first, lanes, out);
  }
}

}  // namespace attention_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace attention_avx2 {

inline float HorizontalSum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v),
                                 _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

inline void Scores(const float* q, int64_t group, const float* key,
                   const int64_t* slots, int64_t count, int64_t stride,
                   int64_t head_dim, float scale, float* scores) {
  const int64_t whole = head_dim / 8 * 8;
  for (int64_t j = 0; j < count; ++j) {
    const float* k = key + slots[j] * stride;
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = q + h * head_dim;
      __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 16 <= whole; d += 16) {
        even = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), _mm256_loadu_ps(k + d), even);
        odd = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d + 8),
                              _mm256_loadu_ps(k + d + 8), odd);
      }
      for (; d < whole; d += 8) {
        even = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), _mm256_loadu_ps(k + d), even);
      }
      float sum = HorizontalSum(_mm256_add_ps(even, odd));
      for (; d < head_dim; ++d) sum += qh[d] * k[d];
      scores[h * count + j] = sum * scale;
    }
  }
}

inline void SoftmaxRows(float* scores, int64_t group, int64_t count) {
  const int64_t whole = count / 8 * 8;
  for (int64_t h = 0; h < group; ++h) {
    float* row = scores + h * count;
    float largest = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < count; ++j) largest = std::max(largest, row[j]);
    const __m256 shift = _mm256_set1_ps(largest);
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < whole; j += 8) {
      const __m256 e = ExpAvx2(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift));
      _mm256_storeu_ps(row + j, e);
      total = _mm256_add_ps(total, e);
    }
    float sum = HorizontalSum(total);
    if (whole < count) {
      alignas(32) float rest[8];
      for (int64_t j = 0; j < 8; ++j) {
        rest[j] = whole + j < count ? row[whole + j] - largest : -87.0f;
      }
      _mm256_store_ps(rest, ExpAvx2(_mm256_load_ps(rest)));
      for (int64_t j = whole; j < count; ++j) {
        row[j] = rest[j - whole];
        sum += row[j];
      }
    }
    const float inverse = 1.0f / sum;
    for (int64_t j = 0; j < count; ++j) row[j] *= inverse;
  }
}

// Columns [8 * first, 8 * (first + kVectors)) of each head's output (all
// whole vectors), in kVectors registers across all the keys.
template <int kVectors>
void WeightedColumns(const float* weights, int64_t group, const float* value,
                     const int64_t* slots, int64_t count, int64_t stride,
                     int64_t head_dim, int64_t first, float* out) {
  for (int64_t h = 0; h < group; ++h) {
    const float* w = weights + h * count;
    __m256 acc[kVectors];
    for (int i = 0; i < kVectors; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; ++j) {
      const float* v = value + slots[j] * stride + 8 * first;
      const __m256 wj = _mm256_set1_ps(w[j]);
      for (int i = 0; i < kVectors; ++i) {
        acc[i] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(v + 8 * i), acc[i]);
      }
    }
    float* o = out + h * head_dim + 8 * first;
    for (int i = 0; i < kVectors; ++i) _mm256_storeu_ps(o + 8 * i, acc[i]);
  }
}

inline void WeightedValues(const float* weights, int64_t group,
                           const float* value, const int64_t* slots,
                           int64_t count, int64_t stride, int64_t head_dim,
                           float* out) {
  using Columns = void (*)(const float*, int64_t, const float*, const int64_t*,
                           int64_t, int64_t, int64_t, int64_t, float*);
  static constexpr Columns kColumns[] = {
      WeightedColumns<1>, WeightedColumns<2>, WeightedColumns<3>,
      WeightedColumns<4>, WeightedColumns<5>, WeightedColumns<6>,
      WeightedColumns<7>, WeightedColumns<8>};
  const int64_t vectors = head_dim / 8;
  for (int64_t first = 0; first < vectors; first += 8) {
    kColumns[std::min<int64_t>(8, vectors - first) - 1](
        weights, group, value, slots, count, stride, head_dim, first, out);
  }
  for (int64_t h = 0; h < group; ++h) {  // columns past the last whole vector
    const float* w = weights + h * count;
    for (int64_t d = vectors * 8; d < head_dim; ++d) {
      float sum = 0;
      for (int64_t j = 0; j < count; ++j) sum += w[j] * value[slots[j] * stride + d];
      out[h * head_dim + d] = sum;
    }
  }
}

}  // namespace attention_avx2
#pragma GCC pop_options
#endif  // PADDLE_STEP_VECTOR_EXP_X86

namespace attention_scalar {

// Softmax of each of the `group` rows of `count` scores, in place.
template <typename T>
void SoftmaxRows(T* scores, int64_t group, int64_t count) {
  for (int64_t h = 0; h < group; ++h) {
    T* row = scores + h * count;
    const T largest = *std::max_element(row, row + count);
    T total = 0;
    for (int64_t j = 0; j < count; ++j) {
      row[j] = std::exp(row[j] - largest);
      total += row[j];
    }
    const T inverse = T(1) / total;
    for (int64_t j = 0; j < count; ++j) row[j] *= inverse;
  }
}

}  // namespace attention_scalar

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
  T* s = scores->data();
  bool done = false;
#ifdef PADDLE_STEP_VECTOR_EXP_X86
  if constexpr (std::is_same_v<T, float>) {
    if (isa >= Isa::kAvx512) {
      attention_avx512::Scores(q, group, key, slots.data(), count, stride,
                               p.head_dim, p.scale, s);
      attention_avx512::SoftmaxRows(s, group, count);
      attention_avx512::WeightedValues(s, group, value, slots.data(), count,
                                       stride, p.head_dim, out);
      done = true;
    } else if (isa == Isa::kAvx2) {
      attention_avx2::Scores(q, group, key, slots.data(), count, stride,
                             p.head_dim, p.scale, s);
      attention_avx2::SoftmaxRows(s, group, count);
      attention_avx2::WeightedValues(s, group, value, slots.data(), count,
                                     stride, p.head_dim, out);
      done = true;
    }
  }
#endif
  (void)isa;
  if (!done) {
    attention_scalar::Scores(q, group, key, slots.data(), count, stride,
                             p.head_dim, p.scale, s);
    attention_scalar::SoftmaxRows(s, group, count);
    attention_scalar::WeightedValues(s, group, value, slots.data(), count,
                                     stride, p.head_dim, out);
  }
}

}  // namespace paddle_step::cpu
