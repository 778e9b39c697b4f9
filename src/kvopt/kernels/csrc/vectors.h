// The vector types and loads kvopt's CPU kernels share, written with GCC/Clang vector extensions.
//
// A vector holds one register of floats: 16 with AVX-512, else 8. GCC keeps wider generic vectors in memory on an
// AVX2 machine (the decode kernel ran 6x slower, the int8 linear at 3 GB/s, measured), so they are as wide as the
// machine's registers (the extension is built with -march=native on the machine that runs it).
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace kvopt_vectors {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vhalf __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vfloat4 __attribute__((vector_size(4 * sizeof(float))));

// kLanes consecutive floats.
inline vfloat load_floats(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// kLanes bf16 values widened to floats: a bf16 is the upper half of an fp32.
inline vfloat widen_bf16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<vfloat>(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
#elif defined(__AVX2__)
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<vfloat>(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
#else
  vhalf bits;
  std::memcpy(&bits, p, sizeof(bits));
  vuint wide = __builtin_convertvector(bits, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
#endif
}

// The sum of a vector's lanes (halved twice by shuffles, then four adds).
inline float sum_lanes(vfloat v) {
#if defined(__AVX512F__)
  const vfloat8 half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                       __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vfloat8 half = v;
#endif
  const vfloat4 quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

}  // namespace kvopt_vectors
