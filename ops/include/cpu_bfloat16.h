// bfloat16 as the CPU kernels store it: the upper 16 bits of a float32, kept
// as uint16_t. Framework-free.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace paddle_step::cpu {

// Round to nearest even, as torch and numpy-based converters do; NaN stays NaN.
inline uint16_t BFloat16FromFloat(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// Exact: every bfloat16 is a float32.
inline float FloatFromBFloat16(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// An element of a float32, float64 or bfloat16 array as the type it is
// computed in: itself, or a bfloat16 widened to float32.
inline float Widened(float value) { return value; }
inline double Widened(double value) { return value; }
inline float Widened(uint16_t value) { return FloatFromBFloat16(value); }

}  // namespace paddle_step::cpu
