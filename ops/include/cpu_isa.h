// The CPU instruction sets the CPU kernels have paths for, and which of them
// the running CPU supports. Chosen at run time: the library is built without
// -march flags, so one build loads and runs on any x86-64 CPU (and elsewhere,
// on the scalar path).
#pragma once

#include <string>

namespace paddle_step::cpu {

// Ordered from the least to the most capable; each one's CPU also runs every
// path before it.
enum class Isa {
  kScalar,      // plain C++: any CPU
  kAvx2,        // AVX2 + FMA, 256-bit vectors
  kAvx512,      // AVX-512 F/BW/VL, 512-bit vectors
  kAvx512Bf16,  // AVX-512 with AVX512-BF16 (vdpbf16ps)
};

// The paths' names, in Isa's order (flags and reports use them).
constexpr const char* kIsaNames[] = {"scalar", "avx2", "avx512", "avx512_bf16"};
constexpr int kIsaCount = sizeof(kIsaNames) / sizeof(kIsaNames[0]);
static_assert(static_cast<int>(Isa::kAvx512Bf16) == kIsaCount - 1,
              "kIsaNames names every Isa");

inline const char* IsaName(Isa isa) {
  const int index = static_cast<int>(isa);
  return 0 <= index && index < kIsaCount ? kIsaNames[index] : "unknown";
}

// The Isa of a name IsaName returns; false for any other name.
inline bool IsaFromName(const std::string& name, Isa* isa) {
  for (int index = 0; index < kIsaCount; ++index) {
    if (name == kIsaNames[index]) {
      *isa = static_cast<Isa>(index);
      return true;
    }
  }
  return false;
}

// The most capable path this CPU (and its OS: libgcc's checks include the
// XSAVE state the OS enables) can run.
inline Isa DetectIsa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("fma");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return Isa::kAvx512Bf16;
  if (avx512) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kScalar;
}

}  // namespace paddle_step::cpu
