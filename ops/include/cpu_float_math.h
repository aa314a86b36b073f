// Float32 array loops written as plain C++ that the compiler vectorizes: exp,
// sum, max and a dot product. They are meant to be inlined into a loop that
// RunOn (cpu_float_vectors.h) compiles once per instruction set, so the same
// source runs at each set's vector width. Framework-free.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__GNUC__)
#define PADDLE_STEP_LOOP_INLINE __attribute__((always_inline)) inline
#else
#define PADDLE_STEP_LOOP_INLINE inline
#endif

namespace paddle_step::cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 over an array (-inf gives 0), within a few ulp of expf
// above -87 and 0 below (where expf is denormal: mass no draw can reach).
// Branch-free, so the compiler vectorizes it at the baseline instruction set:
// the range reduction x = n ln2 + r rounds with the 1.5 * 2^23 shift, a
// degree-6 polynomial gives exp(r), and 2^n is built in the exponent bits.
PADDLE_STEP_LOOP_INLINE void ExpNonPositive(const float* in, float* out,
                                           int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    const float x = in[i];
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n =
        (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = clamped - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    out[i] = x < -87.0f ? 0.0f : y * scale;
  }
}

// Sum of `count` floats, in eight interleaved float lanes (vectorizable)
// added up in double.
PADDLE_STEP_LOOP_INLINE double Sum(const float* values, int64_t count) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    for (int j = 0; j < 8; ++j) lanes[j] += values[i + j];
  }
  double total = 0.0;
  for (; i < count; ++i) total += values[i];
  for (int j = 0; j < 8; ++j) total += lanes[j];
  return total;
}

PADDLE_STEP_LOOP_INLINE float Max(const float* values, int64_t count) {
  float lanes[8];
  for (int j = 0; j < 8; ++j) lanes[j] = kNegInf;
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    for (int j = 0; j < 8; ++j) {
      lanes[j] = values[i + j] > lanes[j] ? values[i + j] : lanes[j];
    }
  }
  float best = kNegInf;
  for (; i < count; ++i) best = values[i] > best ? values[i] : best;
  for (int j = 0; j < 8; ++j) best = lanes[j] > best ? lanes[j] : best;
  return best;
}

// The dot product of two float32 arrays, in sixteen interleaved lanes
// (vectorizable) added up at the end, and the rest one by one.
PADDLE_STEP_LOOP_INLINE float Dot(const float* a, const float* b,
                                  int64_t count) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    for (int j = 0; j < 16; ++j) lanes[j] += a[i + j] * b[i + j];
  }
  float total = 0.0f;
  for (; i < count; ++i) total += a[i] * b[i];
  for (int j = 0; j < 16; ++j) total += lanes[j];
  return total;
}

}  // namespace paddle_step::cpu
