// The CPU's float32 multiply-add rate on one thread, measured with nothing
// but registers: the benchmark's measure of the machine's matmul peak (what
// a product whose operands sit in cache could reach at best). Framework-free.
#pragma once

#include <cstdint>

#include "cpu_float_vectors.h"
#include "cpu_isa.h"

namespace paddle_step::cpu {

// Independent accumulator chains: enough to cover an FMA's latency times the
// FMA units of any current x86 core (4 cycles x 2 units), with room to spare.
constexpr int kFmaChains = 12;

// The multiply-add chains on `Floats`' vectors.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // see cpu_float_vectors.h
struct FmaChainsLoop {
  template <typename Floats>
  __attribute__((always_inline)) static float Run(int64_t iterations) {
    typename Floats::Vec acc[kFmaChains];
    for (int j = 0; j < kFmaChains; ++j) acc[j] = Floats::Broadcast(j);
    const auto a = Floats::Broadcast(0.999999f), b = Floats::Broadcast(1e-7f);
    for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
      for (int j = 0; j < kFmaChains; ++j)
        acc[j] = Floats::MulAdd(acc[j], a, b);
    }
    float total = 0.0f;
    for (auto& value : acc) total += Floats::Sum(value);
    return total;
  }
};
#pragma GCC diagnostic pop

// Float32 operations (a multiply-add counts two) one call makes on `isa`'s
// widest vectors; `*result` keeps the loop from being optimized away.
inline double FmaLoop(Isa isa, int64_t iterations, float* result) {
  int lanes = 1;
  *result = RunOn<FmaChainsLoop>(isa, &lanes, iterations);
  return 2.0 * lanes * kFmaChains * static_cast<double>(iterations);
}

}  // namespace paddle_step::cpu
