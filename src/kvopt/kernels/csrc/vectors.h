// Loads shared by kvopt's CPU kernels, written with GCC/Clang vector extensions for any vector width.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstring>

namespace kvopt_vectors {

// ``Floats`` (a vector of N floats) read from N consecutive floats.
template <typename Floats>
inline Floats load_floats(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// N bf16 values widened to N floats: a bf16 is the upper half of an fp32 (``Words``: N uint32, ``Halves``: N uint16).
template <typename Floats, typename Words, typename Halves>
inline Floats widen_bf16(const c10::BFloat16* p) {
  Halves bits;
  std::memcpy(&bits, p, sizeof(bits));
  Words wide = __builtin_convertvector(bits, Words) << 16;
  Floats v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

}  // namespace kvopt_vectors
