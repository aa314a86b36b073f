// The CPU's float32 multiply-add rate on one thread, measured with nothing
// but registers: the benchmark's measure of the machine's matmul peak (what
// a product whose operands sit in cache could reach at best). Framework-free.
#pragma once

#include <cstdint>

#include "cpu_isa.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace paddle_step::cpu {

// Independent accumulator chains: enough to cover an FMA's latency times the
// FMA units of any current x86 core (4 cycles x 2 units), with room to spare.
constexpr int kFmaChains = 12;

namespace fma_peak_scalar {
inline float Run(int64_t iterations) {
  float acc[kFmaChains];
  for (int j = 0; j < kFmaChains; ++j) acc[j] = static_cast<float>(j);
  const float a = 0.999999f, b = 1e-7f;
  for (int64_t i = 0; i < iterations; ++i) {
    for (int j = 0; j < kFmaChains; ++j) acc[j] = acc[j] * a + b;
  }
  float total = 0.0f;
  for (float value : acc) total += value;
  return total;
}
}  // namespace fma_peak_scalar

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,fma")
namespace fma_peak_avx512 {
inline float Run(int64_t iterations) {
  __m512 acc[kFmaChains];
  for (int j = 0; j < kFmaChains; ++j) acc[j] = _mm512_set1_ps(j);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < kFmaChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
  }
  float total = 0.0f;
  for (auto& value : acc) total += _mm512_reduce_add_ps(value);
  return total;
}
}  // namespace fma_peak_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace fma_peak_avx2 {
inline float Run(int64_t iterations) {
  __m256 acc[kFmaChains];
  for (int j = 0; j < kFmaChains; ++j) acc[j] = _mm256_set1_ps(j);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < kFmaChains; ++j) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
  }
  float total = 0.0f;
  for (auto& value : acc) {
    float lanes[8];
    _mm256_storeu_ps(lanes, value);
    for (float lane : lanes) total += lane;
  }
  return total;
}
}  // namespace fma_peak_avx2
#pragma GCC pop_options
#endif

// Float32 operations (a multiply-add counts two) one call makes on `isa`'s
// widest vectors; `*result` keeps the loop from being optimized away.
inline double FmaLoop(Isa isa, int64_t iterations, float* result) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa >= Isa::kAvx512) {
    *result = fma_peak_avx512::Run(iterations);
    return 2.0 * 16 * kFmaChains * static_cast<double>(iterations);
  }
  if (isa == Isa::kAvx2) {
    *result = fma_peak_avx2::Run(iterations);
    return 2.0 * 8 * kFmaChains * static_cast<double>(iterations);
  }
#endif
  (void)isa;
  *result = fma_peak_scalar::Run(iterations);
  return 2.0 * kFmaChains * static_cast<double>(iterations);
}

}  // namespace paddle_step::cpu
