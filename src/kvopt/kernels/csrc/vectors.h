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

#include <algorithm>
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

// kLanes values of a row as floats, whichever of fp32 or bf16 it holds (the kernels are templates over both).
inline vfloat load_lanes(const float* p) { return load_floats(p); }
inline vfloat load_lanes(const c10::BFloat16* p) { return widen_bf16(p); }

// kLanes bytes zero-extended to 32-bit lanes (one vpmovzxbd; GCC's generic 4x widening came out as scalar code or
// a chain of 2x widenings and lane extracts).
inline vint widen_bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<vint>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<vint>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  uint8_t bytes[kLanes];
  std::memcpy(bytes, p, sizeof(bytes));
  vint v;
  for (int i = 0; i < kLanes; ++i) v[i] = bytes[i];
  return v;
#endif
}

// Asks for ``bytes`` from ``p`` on to be brought into the cache ahead of their use: a decode step's KV is read once,
// from memory (a layer's keys and values are evicted by the other layers' before the next step), in runs too short
// for the hardware prefetcher to ramp up (a quantized group's 1.3 KB records, one per block of the pool: 1.0 ms per
// layer for 8k 4-bit tokens from memory, 0.55 ms with the next group's records asked for).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* first = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(first + offset);
}

// exp(x) lane by lane, Cephes' expf: 2^n * exp(r), n the integer nearest x / ln2, |r| <= ln2 / 2, a degree-6
// polynomial; relative error ~1e-7, the float's own precision. Lanes below -87 give 0, above 88 exp(88).
inline vfloat exp_lanes(vfloat x) {
  const vint tiny = x < -87.0f;
  x = x > 88.0f ? vfloat{} + 88.0f : x;
  x = tiny ? vfloat{} - 87.0f : x;
  const vfloat nf = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // 1.5 * 2^23: rounds to an integer
  const vint n = __builtin_convertvector(nf, vint);
  const vfloat r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vfloat p = vfloat{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vint bits = (n + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return tiny ? vfloat{} : p * scale;
}

// kLanes floats rounded to bf16 (to nearest, ties to even, as c10::BFloat16 rounds; NaN aside), as 32-bit lanes whose
// upper halves are the bf16 values.
inline vuint bf16_bits(vfloat x) {
  vuint bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
}

// A value as a bf16 tensor holds it (rounded, then widened back).
inline vfloat round_bf16(vfloat x) {
  const vuint bits = bf16_bits(x);
  vfloat out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// kLanes floats stored as bf16.
inline void store_bf16(vfloat x, c10::BFloat16* out) {
  const vhalf halves = __builtin_convertvector(bf16_bits(x) >> 16, vhalf);
  std::memcpy(out, &halves, sizeof(halves));
}

// The largest of a vector's lanes.
inline float max_lanes(vfloat v) {
#if defined(__AVX512F__)
  const vfloat8 low = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const vfloat8 high = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vfloat8 half = low > high ? low : high;
#else
  const vfloat8 half = v;
#endif
  const vfloat4 front = __builtin_shufflevector(half, half, 0, 1, 2, 3);
  const vfloat4 back = __builtin_shufflevector(half, half, 4, 5, 6, 7);
  const vfloat4 quarter = front > back ? front : back;
  return std::max(std::max(quarter[0], quarter[2]), std::max(quarter[1], quarter[3]));
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
