// The element-wise parts of a Llama decoder layer on float32 rows, for the
// CPU decode layer (ops/cpu_decoder_layer.cc): RMSNorm, rotary embedding in the
// rotate-half layout, SwiGLU's silu(gate) * up, and the residual add.
// Framework-free: raw pointers only.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_isa.h"
#include "cpu_vector_exp.h"

namespace paddle_step::cpu {

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, rows of `width`.
inline void RmsNorm(const float* x, const float* weight, int64_t rows,
                    int64_t width, float eps, float* out) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* row = x + t * width;
    float sum = 0;
    for (int64_t i = 0; i < width; ++i) sum += row[i] * row[i];
    const float scale = 1.0f / std::sqrt(sum / width + eps);
    for (int64_t i = 0; i < width; ++i) {
      out[t * width + i] = row[i] * scale * weight[i];
    }
  }
}

// Rotary embedding, in place, on `heads` heads of `head_dim` at the start of
// each of `rows` rows (`stride` apart): with the halves a, b of a head and
// cos, sin [rows, head_dim] of each row's position, head = head * cos +
// [-b, a] * sin.
inline void RotateHalf(float* x, int64_t rows, int64_t stride, int64_t heads,
                       int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < rows; ++t) {
    const float* c = cos + t * head_dim;
    const float* s = sin + t * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* a = x + t * stride + h * head_dim;
      float* b = a + half;
      for (int64_t i = 0; i < half; ++i) {
        const float first = a[i], second = b[i];
        a[i] = first * c[i] - second * s[i];
        b[i] = second * c[half + i] + first * s[half + i];
      }
    }
  }
}

// x += y, `count` values.
inline void AddInPlace(float* x, const float* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) x[i] += y[i];
}

namespace swiglu_scalar {
// out[t, i] = silu(gate_up[t, i]) * gate_up[t, width + i].
inline void SiluTimesUp(const float* gate_up, int64_t rows, int64_t width,
                        float* out) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* gate = gate_up + t * 2 * width;
    const float* up = gate + width;
    for (int64_t i = 0; i < width; ++i) {
      out[t * width + i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  }
}
}  // namespace swiglu_scalar

#ifdef PADDLE_STEP_VECTOR_EXP_X86
#pragma GCC push_options
#pragma GCC target("avx512f,fma")
namespace swiglu_avx512 {
inline void SiluTimesUp(const float* gate_up, int64_t rows, int64_t width,
                        float* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t t = 0; t < rows; ++t) {
    const float* gate = gate_up + t * 2 * width;
    const float* up = gate + width;
    for (int64_t i = 0; i < width; i += 16) {
      const __mmask16 lanes = width - i >= 16
                                  ? __mmask16(0xFFFF)
                                  : __mmask16((1u << (width - i)) - 1);
      const __m512 g = _mm512_maskz_loadu_ps(lanes, gate + i);
      const __m512 silu = _mm512_div_ps(
          g, _mm512_add_ps(one, ExpAvx512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      _mm512_mask_storeu_ps(
          out + t * width + i, lanes,
          _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(lanes, up + i)));
    }
  }
}
}  // namespace swiglu_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace swiglu_avx2 {
inline void SiluTimesUp(const float* gate_up, int64_t rows, int64_t width,
                        float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const int64_t whole = width / 8 * 8;
  for (int64_t t = 0; t < rows; ++t) {
    const float* gate = gate_up + t * 2 * width;
    const float* up = gate + width;
    for (int64_t i = 0; i < whole; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 silu = _mm256_div_ps(
          g, _mm256_add_ps(one, ExpAvx2(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      _mm256_storeu_ps(out + t * width + i,
                       _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    for (int64_t i = whole; i < width; ++i) {
      out[t * width + i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  }
}
}  // namespace swiglu_avx2
#pragma GCC pop_options
#endif

inline void SiluTimesUp(Isa isa, const float* gate_up, int64_t rows,
                        int64_t width, float* out) {
#ifdef PADDLE_STEP_VECTOR_EXP_X86
  if (isa >= Isa::kAvx512) return swiglu_avx512::SiluTimesUp(gate_up, rows, width, out);
  if (isa == Isa::kAvx2) return swiglu_avx2::SiluTimesUp(gate_up, rows, width, out);
#endif
  (void)isa;
  swiglu_scalar::SiluTimesUp(gate_up, rows, width, out);
}

}  // namespace paddle_step::cpu
