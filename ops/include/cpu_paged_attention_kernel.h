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
// the weighted sum run in the compute type T (float32 or float64). float32
// runs one source compiled per instruction set (its dot products in 16 lanes,
// e^x by cpu_float_math.h's polynomial); float64 runs plain loops and std::exp.
//
// The cache's storage type `Cache` is T, or bfloat16 (uint16_t bits) for a
// float32 T: its keys and values are stored rounded to nearest even and read
// widened (exactly) as they are loaded, which halves the bytes a long
// context's attention reads, its cost. Everything after the load is the
// float32 kernel's chain of operations: over a bfloat16 cache a result is bit
// for bit the float32 kernel's over a float32 cache of the widened values.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_bfloat16.h"
#include "cpu_float_math.h"
#include "cpu_float_vectors.h"
#include "cpu_isa.h"


namespace paddle_step::cpu {

// Writes k[i], v[i] ([count, row] each, row = kv_heads * head_dim) at
// slots[i] of one layer's caches ([num_slots, row]); slot -1 writes nothing.
// The caller checks every slot is < num_slots. A Cache of T is copied as is,
// a bfloat16 one (uint16_t, from float32) gets each value rounded to nearest
// even.
template <typename T, typename Cache>
void WriteKv(const T* k, const T* v, const int64_t* slots, int64_t count,
             int64_t row, Cache* key_cache, Cache* value_cache) {
  for (int64_t i = 0; i < count; ++i) {
    if (slots[i] < 0) continue;
    if constexpr (std::is_same_v<T, Cache>) {
      std::memcpy(key_cache + slots[i] * row, k + i * row, row * sizeof(T));
      std::memcpy(value_cache + slots[i] * row, v + i * row, row * sizeof(T));
    } else {
      static_assert(std::is_same_v<T, float> &&
                    std::is_same_v<Cache, uint16_t>);
      for (int64_t e = 0; e < row; ++e) {
        key_cache[slots[i] * row + e] = BFloat16FromFloat(k[i * row + e]);
        value_cache[slots[i] * row + e] = BFloat16FromFloat(v[i * row + e]);
      }
    }
  }
}

// Cache: how the cache stores its values (T, or uint16_t bfloat16 bits for a
// float32 T).
template <typename T, typename Table, typename Cache = T>
struct DecodeAttentionProblem {
  const T* q;            // [tokens, heads, head_dim]
  const Cache* key;      // one layer: [num_slots, kv_heads, head_dim]
  const Cache* value;    // likewise
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
template <typename T, typename Table, typename Cache>
void VisibleSlots(const DecodeAttentionProblem<T, Table, Cache>& p, int64_t t,
                  std::vector<int64_t>* slots) {
  slots->clear();
  const Table* table = p.tables + p.rows[t] * p.table_width;
  const int64_t last = std::min(p.positions[t], p.table_width * p.block_size - 1);
  for (int64_t j = 0; j <= last; ++j) {
    const int64_t block = static_cast<int64_t>(table[j / p.block_size]);
    if (block >= 0) slots->push_back(block * p.block_size + j % p.block_size);
  }
}

// Keys and values are read through the block tables, a head's row at a time
// from slots that jump between blocks: the hardware prefetcher cannot see
// where the next one is, so each loop asks for the row kRowsAhead ahead of it
// (a B = 32 decode step spent most of its attention waiting on these loads).
constexpr int64_t kRowsAhead = 16;

PADDLE_STEP_LOOP_INLINE void PrefetchRow(const void* row, int64_t bytes) {
#if defined(__GNUC__)
  for (int64_t offset = 0; offset < bytes; offset += 64) {
    __builtin_prefetch(static_cast<const char*>(row) + offset);
  }
#else
  (void)row, (void)bytes;
#endif
}

// The keys of a bfloat16 cache that plain C++ loops read (Dot) are widened into
// float32 scratch first, and those loops run on it as on a float32 cache: the
// compiler compiles such a loop by its form (vectorized with each product
// rounded, or one fused multiply-add at a time), so only the same loop over
// float32 arrays surely gets the float32 kernel's bits. The vector code
// (intrinsics) widens in registers as it loads. The values' last dims, gathered
// one key at a time, widen in place: GCC keeps that loop scalar for float32 too
// (the bfloat16 tests check the bits).

// out[0 .. count) = in[0 .. count) widened, on Floats' vectors.
template <typename Floats>
PADDLE_STEP_LOOP_INLINE void WidenRow(const uint16_t* in, int64_t count,
                                      float* out) {
  int64_t e = 0;
  for (; e + Floats::kLanes <= count; e += Floats::kLanes) {
    Floats::Store(out + e, Floats::Load(in + e));
  }
  for (; e < count; ++e) out[e] = Widened(in[e]);
}

// A pass over the values of one KV head: `count` rows at `slots`, `stride`
// values apart from `value` (the KV head's first value), query heads'
// weights and outputs `count` and `head_dim` apart, prefetching `rows_ahead`
// slots ahead.
template <typename Cache>
struct ValuePass {
  const Cache* value;
  const int64_t* slots;
  int64_t count;
  int64_t stride;
  int64_t head_dim;
  int64_t rows_ahead;
};

// For kHeads query heads h reading the pass's KV head: o_h[first .. first +
// kVectors * Floats::kLanes) = sum over j of weights_h[j] * v_j (from `first`
// of each value row, float32 or widened bfloat16), in order of j, the sums
// kept in registers; weights_h = weights + h * count, o_h = o + h * head_dim.
// Each value vector is loaded once for the kHeads heads. Prefetches the rows'
// `ahead_bytes` (0: none).
template <typename Floats, int kVectors, int kHeads, typename Cache>
PADDLE_STEP_LOOP_INLINE void WeightedVectors(const ValuePass<Cache>& pass,
                                             const float* weights, float* o,
                                             int64_t first,
                                             int64_t ahead_bytes) {
  const int64_t count = pass.count;
  typename Floats::Vec sum[kHeads][kVectors];
  for (int h = 0; h < kHeads; ++h) {
    for (int i = 0; i < kVectors; ++i) sum[h][i] = Floats::Zero();
  }
  for (int64_t j = 0; j < count; ++j) {
    if (ahead_bytes > 0 && j + pass.rows_ahead < count) {
      PrefetchRow(pass.value + pass.slots[j + pass.rows_ahead] * pass.stride,
                  ahead_bytes);
    }
    const Cache* v = pass.value + pass.slots[j] * pass.stride + first;
    typename Floats::Vec loaded[kVectors];
    for (int i = 0; i < kVectors; ++i) {
      loaded[i] = Floats::Load(v + i * Floats::kLanes);
    }
    for (int h = 0; h < kHeads; ++h) {
      const typename Floats::Vec w = Floats::Broadcast(weights[h * count + j]);
      for (int i = 0; i < kVectors; ++i) {
        sum[h][i] = Floats::MulAdd(w, loaded[i], sum[h][i]);
      }
    }
  }
  for (int h = 0; h < kHeads; ++h) {
    for (int i = 0; i < kVectors; ++i) {
      Floats::Store(o + h * pass.head_dim + first + i * Floats::kLanes,
                    sum[h][i]);
    }
  }
}

// WeightedVectors for `heads` (1 .. kMaxHeads) heads.
template <typename Floats, int kVectors, int kMaxHeads, typename Cache>
PADDLE_STEP_LOOP_INLINE void WeightedVectorsOf(int64_t heads,
                                               const ValuePass<Cache>& pass,
                                               const float* weights, float* o,
                                               int64_t first,
                                               int64_t ahead_bytes) {
  static_assert(kMaxHeads == 2 || kMaxHeads == 4);
  if (heads == 1) {
    WeightedVectors<Floats, kVectors, 1>(pass, weights, o, first, ahead_bytes);
  } else if (heads == 2) {
    WeightedVectors<Floats, kVectors, 2>(pass, weights, o, first, ahead_bytes);
  } else if constexpr (kMaxHeads == 4) {
    if (heads == 3) {
      WeightedVectors<Floats, kVectors, 3>(pass, weights, o, first,
                                           ahead_bytes);
    } else {
      WeightedVectors<Floats, kVectors, 4>(pass, weights, o, first,
                                           ahead_bytes);
    }
  }
}

// out[k] = Dot(q, key row of slots[k], head_dim) * scale for Floats::kLanes
// keys (8 on AVX2, 16 on AVX-512), head_dim a multiple of 16, with Dot's own
// sums (16 lanes of multiply-adds in order of the dims, then the lanes in
// order) computed for the keys side by side. Dot's 16 lanes are 16 / kLanes
// vectors: each part's sums for the keys (kLanes sums and q in registers),
// transposed so that key k's lane e is lane k of one vector; the vectors are
// then added in order of the lane. Bit for bit Dot's result, at a fraction of
// its horizontal adds. Keys of float32 or bfloat16 (widened as loaded).
template <typename Floats, typename Cache>
PADDLE_STEP_LOOP_INLINE void ScoresOfKeys(const float* q, const Cache* key,
                                          const int64_t* slots, int64_t stride,
                                          int64_t head_dim, float scale,
                                          float* out) {
  constexpr int kKeys = Floats::kLanes;
  constexpr int kParts = 16 / kKeys;
  typename Floats::Vec lanes[kParts][kKeys];
  for (int part = 0; part < kParts; ++part) {
    typename Floats::Vec* sums = lanes[part];
    for (int k = 0; k < kKeys; ++k) sums[k] = Floats::Zero();
    for (int64_t d = kKeys * part; d < head_dim; d += 16) {
      const typename Floats::Vec qv = Floats::Load(q + d);
      for (int k = 0; k < kKeys; ++k) {
        sums[k] = Floats::MulAdd(qv, Floats::Load(key + slots[k] * stride + d),
                                 sums[k]);
      }
    }
    Floats::Transpose(sums);
  }
  typename Floats::Vec total = Floats::Zero();
  for (int part = 0; part < kParts; ++part) {
    for (int e = 0; e < kKeys; ++e) total = Floats::Add(total, lanes[part][e]);
  }
  Floats::Store(out, Floats::Mul(total, Floats::Broadcast(scale)));
}

// o[d] = sum over j of weights[j] * v_j[d] for the dims d in [first,
// head_dim), one by one (float64, and a float32 head's last dims).
template <typename T, typename Cache>
PADDLE_STEP_LOOP_INLINE void LastDims(const T* weights, const Cache* value,
                                      const int64_t* slots, int64_t count,
                                      int64_t stride, int64_t first,
                                      int64_t head_dim, T* o) {
  for (int64_t d = first; d < head_dim; ++d) {
    T sum = 0;
    for (int64_t j = 0; j < count; ++j) {
      sum += weights[j] * Widened(value[slots[j] * stride + d]);
    }
    o[d] = sum;
  }
}

// One token and a run of KV heads, `group` query heads each (q: [heads,
// head_dim], query head h reading KV head h / group of the run): the scores
// of the `count` visible keys (`stride` values between two slots; key and
// value point at the run's first KV head), their softmax, and out [heads,
// head_dim] = the weighted sums of the values. A run of several KV heads reads
// each slot's row of them at once, as one stretch of memory.
// float32 runs on `Floats` (RunOn: one instantiation per instruction set);
// each output is the same chain of multiply-adds in order of j on every
// instruction set's vectors, so the vector width changes no bit of it. A
// bfloat16 Cache is widened as the vectors load it, and staged (WidenRow) for
// the plain loops in `staged` (StagedFloats floats; unused otherwise): nothing
// else differs from a float32 one.
template <typename T, typename Floats = ScalarFloats, typename Cache = T>
PADDLE_STEP_LOOP_INLINE void AttendRows(
    const T* q, int64_t group, int64_t heads, const Cache* key,
    const Cache* value, const int64_t* slots, int64_t count, int64_t stride,
    int64_t head_dim, T scale, T* scores, T* out, float* staged) {
  const int64_t row_bytes =
      heads / group * head_dim * static_cast<int64_t>(sizeof(Cache));
  int64_t j = 0;
  // Vector sets score Floats::kLanes keys at once (ScoresOfKeys), only where
  // head_dim is a multiple of 16: Dot's result is then its 16 lanes alone. Its
  // last dims one by one are a loop the compiler vectorizes its own way
  // wherever it is inlined: no copy matches its bits.
  if constexpr (Floats::kLanes >= 8) {
    constexpr int64_t kKeys = Floats::kLanes;
    const int64_t grouped = head_dim % 16 == 0 ? count : 0;
    const int64_t rows_per_head = (kKeys + heads - 1) / heads;
    for (; j + kKeys <= grouped; j += kKeys) {
      for (int64_t h = 0; h < heads; ++h) {
        // The next kKeys keys' rows, spread over the heads' turns.
        const int64_t end = std::min(
            {count, j + kKeys + (h + 1) * rows_per_head, j + 2 * kKeys});
        for (int64_t next = j + kKeys + h * rows_per_head; next < end; ++next) {
          PrefetchRow(key + slots[next] * stride, row_bytes);
        }
        ScoresOfKeys<Floats>(q + h * head_dim, key + h / group * head_dim,
                             slots + j, stride, head_dim, scale,
                             scores + h * count + j);
      }
    }
  }
  for (; j < count; ++j) {
    if (j + kRowsAhead < count) {
      PrefetchRow(key + slots[j + kRowsAhead] * stride, row_bytes);
    }
    if constexpr (std::is_same_v<Cache, uint16_t>) {
      WidenRow<Floats>(key + slots[j] * stride, heads / group * head_dim,
                       staged);
    }
    for (int64_t h = 0; h < heads; ++h) {
      T dot;
      if constexpr (std::is_same_v<Cache, uint16_t>) {
        dot = Dot(q + h * head_dim, staged + h / group * head_dim, head_dim);
      } else if constexpr (std::is_same_v<T, float>) {
        const T* k = key + slots[j] * stride + h / group * head_dim;
        dot = Dot(q + h * head_dim, k, head_dim);
      } else {
        const T* k = key + slots[j] * stride + h / group * head_dim;
        dot = 0;
        for (int64_t d = 0; d < head_dim; ++d) {
          dot += q[h * head_dim + d] * k[d];
        }
      }
      scores[h * count + j] = dot * scale;
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    T* row = scores + h * count;
    T largest = row[0];
    for (int64_t j = 1; j < count; ++j) {
      largest = row[j] > largest ? row[j] : largest;
    }
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
  // The values: one pass over the rows per KV head and run of up to
  // kMaxHeads of its query heads, each value vector loaded once for the run:
  // a long context's rows, which do not stay in the L2 cache, come from
  // memory once per KV head, not once per query head. The first pass over a
  // KV head's values prefetches them, as many rows further ahead as the run
  // has KV heads: the bytes in flight of a whole row kRowsAhead slots ahead
  // (a bfloat16 cache's 128-byte parts 16 rows ahead left the memory idle).
  const int64_t kv_bytes = head_dim * static_cast<int64_t>(sizeof(Cache));
  const int64_t rows_ahead = kRowsAhead * (heads / group);
  for (int64_t g = 0; g < heads / group; ++g) {
    const ValuePass<Cache> pass{value + g * head_dim, slots, count, stride,
                                head_dim, rows_ahead};
    for (int64_t j = 0; j < std::min(count, rows_ahead); ++j) {
      PrefetchRow(pass.value + slots[j] * stride, kv_bytes);
    }
    int64_t ahead = kv_bytes;
    for (int64_t h = g * group; h < (g + 1) * group;) {
      const T* weights = scores + h * count;
      T* o = out + h * head_dim;
      int64_t d = 0;
      int64_t run = 1;
      if constexpr (std::is_same_v<T, float>) {
        constexpr int64_t kLanes = Floats::kLanes;
        // Accumulators of 4 heads fill 16 of AVX-512's 32 registers; AVX2
        // has 16: 2 heads.
        constexpr int kMaxHeads = kLanes >= 16 ? 4 : 2;
        run = std::min<int64_t>(kMaxHeads, (g + 1) * group - h);
        for (; d + 4 * kLanes <= head_dim; d += 4 * kLanes, ahead = 0) {
          WeightedVectorsOf<Floats, 4, kMaxHeads>(run, pass, weights, o, d,
                                                  ahead);
        }
        for (; d + kLanes <= head_dim; d += kLanes, ahead = 0) {
          WeightedVectorsOf<Floats, 1, kMaxHeads>(run, pass, weights, o, d,
                                                  ahead);
        }
      }
      // The run's last dims (all of float64's), one head at a time.
      for (int64_t r = 0; r < run; ++r) {
        LastDims(weights + r * count, pass.value, slots, count, stride, d,
                 head_dim, o + r * head_dim);
      }
      h += run;
    }
  }
}

// AttendRows<float> over a float32 or bfloat16 Cache, compiled once per
// instruction set (RunOn).
template <typename Cache>
struct AttendRowsLoop {
  template <typename Floats>
  PADDLE_STEP_LOOP_INLINE static int Run(
      const float* q, int64_t group, int64_t heads, const Cache* key,
      const Cache* value, const int64_t* slots, int64_t count, int64_t stride,
      int64_t head_dim, float scale, float* scores, float* out, float* staged) {
    AttendRows<float, Floats, Cache>(q, group, heads, key, value, slots, count,
                                     stride, head_dim, scale, scores, out,
                                     staged);
    return 0;
  }
};

// The floats AttendRows stages a bfloat16 cache's values in: a row of the
// run's KV heads (Dot's keys).
inline int64_t StagedFloats(int64_t kv_heads, int64_t head_dim) {
  return kv_heads * head_dim;
}

// Working memory of one thread: the visible slots, the scores and (bfloat16
// cache) AttendRows' staged values.
template <typename T>
struct AttentionScratch {
  std::vector<int64_t> slots;
  std::vector<T> scores;
  std::vector<float> staged;
};

// Token t, KV heads [g, g + span): out[t, g * group .. (g + span) * group).
// A token that sees no key gets zeros.
template <typename T, typename Table, typename Cache>
void AttendGroup(Isa isa, const DecodeAttentionProblem<T, Table, Cache>& p,
                 int64_t t, int64_t g, int64_t span,
                 AttentionScratch<T>* scratch) {
  const std::vector<int64_t>& slots = scratch->slots;
  std::vector<T>* scores = &scratch->scores;
  const int64_t group = p.heads / p.kv_heads;
  const int64_t heads = span * group;
  const int64_t count = static_cast<int64_t>(slots.size());
  const int64_t stride = p.kv_heads * p.head_dim;
  const T* q = p.q + (t * p.heads + g * group) * p.head_dim;
  const Cache* key = p.key + g * p.head_dim;
  const Cache* value = p.value + g * p.head_dim;
  T* out = p.out + (t * p.heads + g * group) * p.head_dim;
  if (count == 0) {
    std::fill(out, out + heads * p.head_dim, T(0));
    return;
  }
  scores->resize(heads * count);
  float* staged = nullptr;
  if constexpr (std::is_same_v<Cache, uint16_t>) {
    scratch->staged.resize(StagedFloats(span, p.head_dim));
    staged = scratch->staged.data();
  }
  if constexpr (std::is_same_v<T, float>) {
    int lanes = 1;
    RunOn<AttendRowsLoop<Cache>>(isa, &lanes, q, group, heads, key, value,
                                 slots.data(), count, stride, p.head_dim,
                                 p.scale, scores->data(), out, staged);
  } else {
    (void)isa;  // float64 runs the plain loops as built
    AttendRows(q, group, heads, key, value, slots.data(), count, stride,
               p.head_dim, p.scale, scores->data(), out, staged);
  }
}

}  // namespace paddle_step::cpu
