// Portable SIMD without -march=native: the hot loops are plain scalar loops, compiled several
// times by GCC's target_clones (baseline x86-64 = SSE2, x86-64-v3 = AVX2, x86-64-v4 = AVX-512)
// and vectorised by the compiler for each; the dynamic loader picks the clone for the CPU it
// runs on, so one binary runs on any x86-64 and uses the widest vectors there. (GCC 12's
// generic vector types are lowered before cloning and lose their float comparisons to scalar
// code, hence loops.) No reassociation is involved (no -ffast-math) and the build
// uses -ffp-contract=off, so every clone computes the same bits.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define MFSDP2_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define MFSDP2_CLONES
#endif

namespace mfsdp2 {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace mfsdp2
