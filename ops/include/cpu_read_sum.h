// The sum of a float32 array, as fast as the CPU can read it: the benchmark's
// measure of the machine's read bandwidth (the bound of a product whose
// weights come from memory once). Framework-free.
#pragma once

#include <cstdint>

#include "cpu_isa.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace paddle_step::cpu {

namespace read_sum_scalar {
inline double Sum(const float* data, int64_t count) {
  // Eight partial sums: one would make the loop an add-latency chain.
  float partial[8] = {};
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    for (int j = 0; j < 8; ++j) partial[j] += data[i + j];
  }
  double total = 0.0;
  for (; i < count; ++i) total += data[i];
  for (float value : partial) total += value;
  return total;
}
}  // namespace read_sum_scalar

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace read_sum_avx512 {
inline double Sum(const float* data, int64_t count) {
  __m512 partial[8];
  for (auto& value : partial) value = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 128 <= count; i += 128) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      partial[j] =
          _mm512_add_ps(partial[j], _mm512_loadu_ps(data + i + 16 * j));
    }
  }
  double total = read_sum_scalar::Sum(data + i, count - i);
  for (auto& value : partial) total += _mm512_reduce_add_ps(value);
  return total;
}
}  // namespace read_sum_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")
namespace read_sum_avx2 {
inline double Sum(const float* data, int64_t count) {
  __m256 partial[8];
  for (auto& value : partial) value = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= count; i += 64) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      partial[j] = _mm256_add_ps(partial[j], _mm256_loadu_ps(data + i + 8 * j));
    }
  }
  double total = read_sum_scalar::Sum(data + i, count - i);
  for (auto& value : partial) {
    float lanes[8];
    _mm256_storeu_ps(lanes, value);
    for (float lane : lanes) total += lane;
  }
  return total;
}
}  // namespace read_sum_avx2
#pragma GCC pop_options
#endif

inline double ReadSum(Isa isa, const float* data, int64_t count) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa >= Isa::kAvx512) return read_sum_avx512::Sum(data, count);
  if (isa == Isa::kAvx2) return read_sum_avx2::Sum(data, count);
#endif
  (void)isa;
  return read_sum_scalar::Sum(data, count);
}

}  // namespace paddle_step::cpu
