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
  kAvx512Bf16,  // AVX-512 with AVX512-BF16 (vdpbf16ps) and AVX512-VNNI
                // (vpdpbusd): every CPU with the first has the second
};

inline const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
  }
  return "unknown";
}

// The Isa of a name IsaName returns; false for any other name.
inline bool IsaFromName(const std::string& name, Isa* isa) {
  for (Isa candidate :
       {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (name == IsaName(candidate)) {
      *isa = candidate;
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
  if (avx512 && __builtin_cpu_supports("avx512bf16") &&
      __builtin_cpu_supports("avx512vnni")) {
    return Isa::kAvx512Bf16;
  }
  if (avx512) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return Isa::kAvx2;
  }
#endif
  return Isa::kScalar;
}

}  // namespace paddle_step::cpu
