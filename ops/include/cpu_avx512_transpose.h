// A 16 x 16 transpose of floats in AVX-512 registers, for the kernels that
// turn rows into columns: the CPU products (x's rows into tiles) and the
// paged attention (16 keys' lane sums side by side). Framework-free.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace paddle_step::cpu {

#pragma GCC push_options
#pragma GCC target("avx512f")

// The 128-bit-lane step of the transpose, which it takes twice: out[i + 4j]
// gathers lane pairs (0x88: even lanes, 0xDD: odd lanes) of in[i], in[i + 4]
// and of in[i + 8], in[i + 12].
__attribute__((always_inline)) inline void Lanes128Step(const __m512 in[16],
                                                        __m512 out[16]) {
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm512_shuffle_f32x4(in[i], in[i + 4], 0x88);
    out[i + 4] = _mm512_shuffle_f32x4(in[i + 8], in[i + 12], 0x88);
    out[i + 8] = _mm512_shuffle_f32x4(in[i], in[i + 4], 0xDD);
    out[i + 12] = _mm512_shuffle_f32x4(in[i + 8], in[i + 12], 0xDD);
  }
}

// v[r][j] -> v[j][r] in 64 shuffles: pairs, then quads, then 128-bit lanes
// twice.
__attribute__((always_inline)) inline void Transpose16(__m512 v[16]) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    v[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    v[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    v[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  Lanes128Step(v, t);
  Lanes128Step(t, v);
}

#pragma GCC pop_options

}  // namespace paddle_step::cpu

#endif
