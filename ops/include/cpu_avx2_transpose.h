// An 8 x 8 transpose of floats in AVX2 registers, for the paged attention
// (8 keys' lane sums side by side). Framework-free.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace paddle_step::cpu {

#pragma GCC push_options
#pragma GCC target("avx2")

// v[r][j] -> v[j][r] in 24 shuffles: pairs, then quads, then the 128-bit
// halves.
__attribute__((always_inline)) inline void Transpose8(__m256 v[8]) {
  __m256 t[8];
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
  }
  __m256 s[8];
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    v[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

#pragma GCC pop_options

}  // namespace paddle_step::cpu

#endif
