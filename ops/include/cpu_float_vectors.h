// Float32 vectors of each instruction set behind one interface, so that a
// loop is written once as a template over it (kLanes, Vec, Broadcast, Zero,
// Load, Store, Add, Mul, MulAdd, Sum, Transpose) and instantiated per
// instruction set.
// Load also takes bfloat16 (uint16_t bits) and widens them to float32 exactly
// (the bits shifted up 16), so a loop over a bfloat16 array computes on the
// very floats a float32 array of the widened values would give it.
// Framework-free.
//
// Each set's struct is compiled under its own `#pragma GCC target`. A loop
// is a struct with `template <typename Floats> static ... Run(...)`, marked
// always_inline: it is only ever compiled inside RunOn's function for one set,
// under that set's target, never on its own. GCC's -Wpsabi still warns that
// the template, read on its own, passes vectors without their instructions
// enabled; the loop headers silence that warning around their loops.
#pragma once

#include <cstdint>

#include "cpu_avx2_transpose.h"
#include "cpu_avx512_transpose.h"
#include "cpu_bfloat16.h"
#include "cpu_isa.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace paddle_step::cpu {

// Plain C++ floats: the path of any CPU.
struct ScalarFloats {
  using Vec = float;
  static constexpr int kLanes = 1;
  static Vec Broadcast(float value) { return value; }
  static Vec Zero() { return 0.0f; }
  static Vec Load(const float* data) { return *data; }
  static Vec Load(const uint16_t* data) { return FloatFromBFloat16(*data); }
  static void Store(float* data, Vec value) { *data = value; }
  static Vec Add(Vec a, Vec b) { return a + b; }
  static Vec Mul(Vec a, Vec b) { return a * b; }
  static Vec MulAdd(Vec a, Vec b, Vec c) { return a * b + c; }
  static float Sum(Vec value) { return value; }
  // v[r][j] -> v[j][r] over kLanes vectors: nothing to move for one lane.
  static void Transpose(Vec*) {}
};

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
struct Avx2Floats {
  using Vec = __m256;
  static constexpr int kLanes = 8;
  static Vec Broadcast(float value) { return _mm256_set1_ps(value); }
  static Vec Zero() { return _mm256_setzero_ps(); }
  static Vec Load(const float* data) { return _mm256_loadu_ps(data); }
  static Vec Load(const uint16_t* data) {
    const __m128i bits =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(data));
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static void Store(float* data, Vec value) { _mm256_storeu_ps(data, value); }
  static Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec MulAdd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  // Lane by lane, in order.
  static float Sum(Vec value) {
    float lanes[kLanes];
    _mm256_storeu_ps(lanes, value);
    float total = 0.0f;
    for (float lane : lanes) total += lane;
    return total;
  }
  static void Transpose(Vec* v) { Transpose8(v); }
};
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,fma")
struct Avx512Floats {
  using Vec = __m512;
  static constexpr int kLanes = 16;
  static Vec Broadcast(float value) { return _mm512_set1_ps(value); }
  static Vec Zero() { return _mm512_setzero_ps(); }
  static Vec Load(const float* data) { return _mm512_loadu_ps(data); }
  static Vec Load(const uint16_t* data) {
    const __m256i bits =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data));
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static void Store(float* data, Vec value) { _mm512_storeu_ps(data, value); }
  static Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec MulAdd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static float Sum(Vec value) { return _mm512_reduce_add_ps(value); }
  static void Transpose(Vec* v) { Transpose16(v); }
};
#pragma GCC pop_options
#endif

namespace vectors_detail {
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
template <typename Loop, typename... Args>
auto OnAvx2(Args... args) {
  return Loop::template Run<Avx2Floats>(args...);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,fma")
template <typename Loop, typename... Args>
auto OnAvx512(Args... args) {
  return Loop::template Run<Avx512Floats>(args...);
}
#pragma GCC pop_options
#endif
}  // namespace vectors_detail

// `Loop::Run<Floats>(args...)` on `isa`'s widest vectors (the AVX-512 paths
// for kAvx512 and kAvx512Bf16), with the lane count it ran on.
template <typename Loop, typename... Args>
auto RunOn(Isa isa, int* lanes, Args... args) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa >= Isa::kAvx512) {
    *lanes = Avx512Floats::kLanes;
    return vectors_detail::OnAvx512<Loop>(args...);
  }
  if (isa == Isa::kAvx2) {
    *lanes = Avx2Floats::kLanes;
    return vectors_detail::OnAvx2<Loop>(args...);
  }
#endif
  (void)isa;
  *lanes = ScalarFloats::kLanes;
  return Loop::template Run<ScalarFloats>(args...);
}

}  // namespace paddle_step::cpu
