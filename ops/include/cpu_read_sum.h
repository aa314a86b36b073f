// The sum of a float32 array, as fast as the CPU can read it: the benchmark's
// measure of the machine's read bandwidth (the bound of a product whose
// weights come from memory once). Framework-free.
#pragma once

#include <cstdint>

#include "cpu_float_vectors.h"
#include "cpu_isa.h"

namespace paddle_step::cpu {

// Eight partial sums of `Floats`' vectors: one would make the loop an
// add-latency chain. What is left over goes through the scalar path's partial
// sums, and its last few elements one by one.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // see cpu_float_vectors.h
struct ReadSumLoop {
  template <typename Floats>
  __attribute__((always_inline)) static double Run(const float* data,
                                                   int64_t count) {
    constexpr int64_t kStride = 8 * Floats::kLanes;
    typename Floats::Vec partial[8];
    for (auto& value : partial) value = Floats::Zero();
    int64_t i = 0;
    for (; i + kStride <= count; i += kStride) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        partial[j] = Floats::Add(partial[j],
                                 Floats::Load(data + i + Floats::kLanes * j));
      }
    }
    double total = 0.0;
    if constexpr (Floats::kLanes == 1) {
      for (; i < count; ++i) total += data[i];
    } else {
      total = Run<ScalarFloats>(data + i, count - i);
    }
    for (auto& value : partial) total += Floats::Sum(value);
    return total;
  }
};
#pragma GCC diagnostic pop

inline double ReadSum(Isa isa, const float* data, int64_t count) {
  int lanes = 1;
  return RunOn<ReadSumLoop>(isa, &lanes, data, count);
}

}  // namespace paddle_step::cpu
