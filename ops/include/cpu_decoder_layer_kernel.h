// The element-wise parts of a Llama decoder layer on float32 rows, for the
// CPU decoder layer (ops/cpu_decoder_layer.cc): RMSNorm, rotary embedding in
// the rotate-half layout, SwiGLU's silu(gate) * up, and the residual add.
// Framework-free: raw pointers only.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_float_math.h"
#include "cpu_float_vectors.h"
#include "cpu_isa.h"

namespace paddle_step::cpu {

// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, rows of `width`.
inline void RmsNorm(const float* x, const float* weight, int64_t rows,
                    int64_t width, float eps, float* out) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* row = x + t * width;
    const float scale = 1.0f / std::sqrt(Dot(row, row, width) / width + eps);
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

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, width + i], with silu(g) =
// g / (1 + e^-g) computed from e = e^-|g| (cpu_float_math.h's e^x takes
// x <= 0): g / (1 + e) for g >= 0, g e / (1 + e) below.
struct SiluTimesUpLoop {
  template <typename Floats>
  PADDLE_STEP_LOOP_INLINE static int Run(const float* gate_up, int64_t rows,
                                         int64_t width, float* out) {
    for (int64_t t = 0; t < rows; ++t) {
      const float* gate = gate_up + t * 2 * width;
      const float* up = gate + width;
      float* o = out + t * width;
      for (int64_t i = 0; i < width; ++i) o[i] = -std::fabs(gate[i]);
      ExpNonPositive(o, o, width);
      for (int64_t i = 0; i < width; ++i) {
        const float g = gate[i];
        const float e = o[i];
        o[i] = g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e)) * up[i];
      }
    }
    return 0;
  }
};

inline void SiluTimesUp(Isa isa, const float* gate_up, int64_t rows,
                        int64_t width, float* out) {
  int lanes = 1;
  RunOn<SiluTimesUpLoop>(isa, &lanes, gate_up, rows, width, out);
}

}  // namespace paddle_step::cpu
