// e^x on float32 vectors (AVX-512, AVX2), for the CPU kernels' softmax and
// SiLU. Each function is compiled for its instruction set only (per-function
// target), so the library still loads on any x86-64 CPU; callers pick one at
// run time (cpu_isa.h).
//
// x is clamped to [-87, 88] (the results stay normal floats), split as
// x = n ln 2 + r with |r| <= ln(2) / 2 (ln 2 in two parts, so n ln 2 is exact
// enough), e^r is its Taylor polynomial to r^7 / 7! (relative error below
// 2^-24 on that interval), times 2^n: within a few float32 ulps of e^x.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PADDLE_STEP_VECTOR_EXP_X86 1

namespace paddle_step::cpu {

#define PADDLE_STEP_EXP_STEPS(V, set1, fmadd, fnmadd, mul, max, min)          \
  x = min(max(x, set1(-87.0f)), set1(88.0f));                                 \
  const V n = ROUND(mul(x, set1(1.44269504088896341f)));                      \
  V r = fnmadd(n, set1(0.693145751953125f), x);                               \
  r = fnmadd(n, set1(1.428606765330187e-06f), r);                            \
  V p = set1(1.0f / 5040);                                                    \
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f,    \
                  1.0f}) {                                                    \
    p = fmadd(p, r, set1(c));                                                 \
  }

#pragma GCC push_options
#pragma GCC target("avx512f,fma")
inline __m512 ExpAvx512(__m512 x) {
#define ROUND(v) \
  _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
  PADDLE_STEP_EXP_STEPS(__m512, _mm512_set1_ps, _mm512_fmadd_ps,
                        _mm512_fnmadd_ps, _mm512_mul_ps, _mm512_max_ps,
                        _mm512_min_ps)
#undef ROUND
  return _mm512_scalef_ps(p, n);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
inline __m256 ExpAvx2(__m256 x) {
#define ROUND(v) \
  _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
  PADDLE_STEP_EXP_STEPS(__m256, _mm256_set1_ps, _mm256_fmadd_ps,
                        _mm256_fnmadd_ps, _mm256_mul_ps, _mm256_max_ps,
                        _mm256_min_ps)
#undef ROUND
  // 2^n into the exponent bits: -126 <= n <= 127 after the clamp.
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}
#pragma GCC pop_options

#undef PADDLE_STEP_EXP_STEPS

}  // namespace paddle_step::cpu

#endif
