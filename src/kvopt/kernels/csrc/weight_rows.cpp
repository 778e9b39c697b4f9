// A linear layer over a few rows of input on a CPU: y = (x @ W^T) * scale + bias, W read once, row by row.
//
// A decode step multiplies one row per sequence by every weight matrix, so it is bound by reading the weights.
// Weight-only int8 halves what bf16 reads, but PyTorch's CPU kernels for it (_weight_int8pack_mm) are slow in
// fp32 (650 us for a 1536 x 576 layer at one row, ~1.4 GB/s) and re-read the weights for every row of input.
// Here each weight row is streamed once, in its own layout (no packed copy), converted to fp32 in registers
// (int8 per-output-channel with its scale, bf16 or fp32) and dotted with every input row at once, in fp32.
// The products of int8 or bf16 weights with bf16 or fp32 inputs are exact in fp32; only the sum's order differs
// from a BLAS's.
//
// Written with GCC/Clang vector extensions as wide as the machine's registers (16 floats with AVX-512, else 8); the
// loads that widen int8 or bf16 to fp32 use AVX-512 or AVX2 intrinsics where the build machine has them (the
// extension is built with -march=native by kvopt/kernels/cpu.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "kernels.h"
#include "vectors.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using namespace kvopt_vectors;

typedef int8_t vbyte __attribute__((vector_size(kLanes)));
typedef int16_t vshort __attribute__((vector_size(kLanes * sizeof(int16_t))));
//: Input rows dotted with one weight row per pass (their accumulators stay in registers).
constexpr int kRowsPerPass = 4;
//: How far ahead the weight rows of bf16 or int8 are asked for (prefetch): their widening loads take half or a quarter
//: of the bytes per instruction that fp32's do, and the hardware prefetcher alone left one core's stream at ~22 GB/s,
//: 8 KB ahead at ~25 (the default model's linears at one row, alternated in one process; fp32 gained nothing).
constexpr int64_t kPrefetchBytes = 8192;
//: Weight rows per unit of parallel work.
constexpr int64_t kGrain = 64;

using kvopt_vectors::load_lanes;  // fp32 and bf16, beside int8's below

inline vfloat load_lanes(const int8_t* p) {
#if defined(__AVX512F__)
  __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<vfloat>(_mm512_cvtepi32_ps(wide));
#elif defined(__AVX2__)
  __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<vfloat>(_mm256_cvtepi32_ps(wide));
#else
  vbyte bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  // widened in two steps: GCC scalarizes a single 4x widening conversion
  return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(bytes, vshort), vint), vfloat);
#endif
}

inline float to_float(float w) { return w; }
inline float to_float(c10::BFloat16 w) { return static_cast<float>(w); }
inline float to_float(int8_t w) { return static_cast<float>(w); }

// Dot products of one weight row (K values) with XS input rows of fp32 (row stride K): two accumulators per input
// row, 32 weights a step, a scalar tail for K not a multiple of 32.
template <int XS, typename W>
inline void dot_row(const W* weight, const float* x, int64_t K, float* out) {
  vfloat acc[XS][2];
#pragma GCC unroll 4
  for (int i = 0; i < XS; ++i) acc[i][0] = acc[i][1] = vfloat{};
  int64_t k = 0;
  for (; k + 2 * kLanes <= K; k += 2 * kLanes) {
    vfloat w0 = load_lanes(weight + k), w1 = load_lanes(weight + k + kLanes);
#pragma GCC unroll 4
    for (int i = 0; i < XS; ++i) {
      acc[i][0] += w0 * load_lanes(x + i * K + k);
      acc[i][1] += w1 * load_lanes(x + i * K + k + kLanes);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < XS; ++i) {
    float tail = 0.0f;
    for (int64_t t = k; t < K; ++t) tail += to_float(weight[t]) * x[i * K + t];
    out[i] = sum_lanes(acc[i][0] + acc[i][1]) + tail;
  }
}

template <typename W, typename Out>
void linear(const W* weight, const float* x, int64_t M, int64_t K, int64_t N, const float* scale, const float* bias,
            Out* y) {
  at::parallel_for(0, N, kGrain, [&](int64_t first, int64_t last) {
    float dots[kRowsPerPass];
    const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / (K * static_cast<int64_t>(sizeof(W))));
    for (int64_t n = first; n < last; ++n) {
      const W* row = weight + n * K;
      if (sizeof(W) < sizeof(float) && n + ahead < last) prefetch_bytes(row + ahead * K, K * sizeof(W));
      const float s = scale ? scale[n] : 1.0f, b = bias ? bias[n] : 0.0f;
      for (int64_t m = 0; m < M; m += kRowsPerPass) {
        const float* xs = x + m * K;
        const int64_t count = std::min<int64_t>(kRowsPerPass, M - m);
        switch (count) {
          case 4: dot_row<4>(row, xs, K, dots); break;
          case 3: dot_row<3>(row, xs, K, dots); break;
          case 2: dot_row<2>(row, xs, K, dots); break;
          default: dot_row<1>(row, xs, K, dots); break;
        }
        for (int64_t i = 0; i < count; ++i) y[(m + i) * N + n] = static_cast<Out>(dots[i] * s + b);
      }
    }
  });
}

// Rows of input, converted to fp32 once (a view of the input where it is already fp32 and contiguous).
const float* fp32_rows(const at::Tensor& input, std::vector<float>& storage) {
  if (input.scalar_type() == at::kFloat) return input.data_ptr<float>();
  const c10::BFloat16* source = input.data_ptr<c10::BFloat16>();
  storage.resize(input.numel());
  for (int64_t i = 0; i < input.numel(); ++i) storage[i] = static_cast<float>(source[i]);
  return storage.data();
}

template <typename W>
void dispatch_output(const at::Tensor& weight, const float* x, int64_t M, int64_t K, const float* scale,
                     const float* bias, at::Tensor& out) {
  const W* w = weight.data_ptr<W>();
  const int64_t N = weight.size(0);
  if (out.scalar_type() == at::kFloat) {
    linear(w, x, M, K, N, scale, bias, out.data_ptr<float>());
  } else {
    linear(w, x, M, K, N, scale, bias, out.data_ptr<c10::BFloat16>());
  }
}

}  // namespace

at::Tensor kvopt_cpu::linear_rows(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && input.size(1) == weight.size(1),
              "linear_rows: input [M, K] and weight [N, K] must share K");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16,
              "linear_rows: input must be fp32 or bf16");
  TORCH_CHECK(weight.is_contiguous(), "linear_rows: weight must be contiguous");
  const auto kind = weight.scalar_type();
  TORCH_CHECK(kind == at::kChar || kind == at::kBFloat16 || kind == at::kFloat,
              "linear_rows: weight must be int8, bf16 or fp32");
  const int64_t M = input.size(0), K = input.size(1), N = weight.size(0);
  at::Tensor scales, biases;
  if (scale) {
    scales = scale->to(at::kFloat).contiguous();
    TORCH_CHECK(scales.numel() == N, "linear_rows: scale must hold one value per output row");
  }
  if (bias) {
    biases = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(biases.numel() == N, "linear_rows: bias must hold one value per output row");
  }
  const at::Tensor rows = input.contiguous();
  std::vector<float> converted;
  const float* x = fp32_rows(rows, converted);
  at::Tensor out = at::empty({M, N}, input.options());
  const float* s = scale ? scales.data_ptr<float>() : nullptr;
  const float* b = bias ? biases.data_ptr<float>() : nullptr;
  if (kind == at::kChar) {
    dispatch_output<int8_t>(weight, x, M, K, s, b, out);
  } else if (kind == at::kBFloat16) {
    dispatch_output<c10::BFloat16>(weight, x, M, K, s, b, out);
  } else {
    dispatch_output<float>(weight, x, M, K, s, b, out);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvopt_cpu, m) {
  m.def("linear_rows(Tensor input, Tensor weight, Tensor? scale=None, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvopt_cpu, CPU, m) { m.impl("linear_rows", &kvopt_cpu::linear_rows); }
