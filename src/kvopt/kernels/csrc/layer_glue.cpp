// The small steps of a decoder layer between its matmuls, one op each: RMSNorm (with the residual add before it),
// rotate-half RoPE on the queries and keys, and the gated MLP's SiLU(gate) * up.
//
// In PyTorch each is 3-6 ops (an RMSNorm: a cast, the norm's own 5 kernels, a cast back, the weight's multiply),
// and at a decode step's one row per sequence their cost is dispatch, not arithmetic: 8-14 us an RMSNorm over
// 576 values on one core, where the values take well under one. They round where Hugging Face's modules round (a
// bf16 model's intermediate results rounded to bf16 at each of HF's ops; fp32 untouched), computing in fp32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "kernels.h"
#include "vectors.h"

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using namespace kvopt_vectors;

// A value as the model's dtype holds it (a bf16 model rounds each op's result to bf16).
inline float held(float x, float) { return x; }
inline float held(float x, c10::BFloat16) { return static_cast<float>(c10::BFloat16(x)); }

template <typename T>
inline void store(T* out, float x) {
  *out = static_cast<T>(x);
}

// The same a vector at a time (kLanes values).
inline vfloat held(vfloat x, float) { return x; }
inline vfloat held(vfloat x, c10::BFloat16) { return round_bf16(x); }
inline void store_lanes(vfloat x, float* out) { std::memcpy(out, &x, sizeof(x)); }
inline void store_lanes(vfloat x, c10::BFloat16* out) { store_bf16(x, out); }

// One row of RMSNorm: llama's rounds the normalised row to the model's dtype, then multiplies by the weight (in that
// dtype); Gemma's scales by 1 + weight in fp32 and rounds once. A vector at a time, the rest of a row one by one.
template <typename T>
void norm_row(const T* x, const T* weight, int64_t width, double eps, bool plus_one, T* out) {
  vfloat lanes = vfloat{};
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    const vfloat v = load_lanes(x + i);
    lanes += v * v;
  }
  float squares = sum_lanes(lanes);
  for (; i < width; ++i) squares += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
  for (i = 0; i + kLanes <= width; i += kLanes) {
    const vfloat normed = load_lanes(x + i) * inverse, w = load_lanes(weight + i);
    store_lanes(plus_one ? normed * (1.0f + w) : held(normed, T{}) * w, out + i);
  }
  for (; i < width; ++i) {
    const float normed = static_cast<float>(x[i]) * inverse;
    const float w = static_cast<float>(weight[i]);
    out[i] = static_cast<T>(plus_one ? normed * (1.0f + w) : held(normed, T{}) * w);
  }
}

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* addend, const at::Tensor& weight, double eps, bool plus_one,
               at::Tensor& sum, at::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* in = x.data_ptr<T>();
  const T* add = addend ? addend->data_ptr<T>() : nullptr;
  T* summed = add ? sum.data_ptr<T>() : nullptr;
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* row = in + r * width;
      if (add) {  // the residual add, rounded as the model's dtype rounds it, is the row normalised
        T* s = summed + r * width;
        const T* addend_row = add + r * width;
        int64_t i = 0;
        for (; i + kLanes <= width; i += kLanes) store_lanes(load_lanes(row + i) + load_lanes(addend_row + i), s + i);
        for (; i < width; ++i) store(s + i, static_cast<float>(row[i]) + static_cast<float>(addend_row[i]));
        row = s;
      }
      norm_row(row, w, width, eps, plus_one, o + r * width);
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": rows must be a contiguous [tokens, width] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": rows must be fp32 or bf16");
}

// Rotate-half RoPE of the query and key heads at the front of each row of the fused q/k/v projection:
// x * cos + roll(x, D / 2) * sin per head, sin's first half already negated (HF's rotate_half, element for element).
template <typename T>
void rotate_rows(const T* qkv, int64_t rows, int64_t stride, int64_t heads, int64_t dim, const T* cos, const T* sin,
                 T* out) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* c = cos + r * dim;
      const T* s = sin + r * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = qkv + r * stride + h * dim;
        T* o = out + (r * heads + h) * dim;
        if (half % kLanes == 0) {  // each half a whole number of vectors: the rolled row is read a vector at a time
          for (int64_t i = 0; i < dim; i += kLanes) {
            const vfloat rolled = load_lanes(x + (i < half ? i + half : i - half));
            store_lanes(held(load_lanes(x + i) * load_lanes(c + i), T{}) + held(rolled * load_lanes(s + i), T{}), o + i);
          }
          continue;
        }
        for (int64_t i = 0; i < dim; ++i) {
          const float rolled = static_cast<float>(x[i < half ? i + half : i - half]);
          const float a = held(static_cast<float>(x[i]) * static_cast<float>(c[i]), T{});
          const float b = held(rolled * static_cast<float>(s[i]), T{});
          store(o + i, a + b);
        }
      }
    }
  });
}

// SiLU(gate) * up of the fused gate/up projection's rows [tokens, 2 * width]: [tokens, width].
template <typename T>
void gate_rows(const T* gate_up, int64_t rows, int64_t width, T* out) {
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* gate = gate_up + r * 2 * width;
      const T* up = gate + width;
      T* o = out + r * width;
      int64_t i = 0;
      for (; i + kLanes <= width; i += kLanes) {
        const vfloat g = load_lanes(gate + i);
        store_lanes(held(g / (1.0f + exp_lanes(-g)), T{}) * load_lanes(up + i), o + i);
      }
      for (; i < width; ++i) {  // a row not a multiple of the vector: the rest one by one
        const float g = static_cast<float>(gate[i]);
        store(o + i, held(g / (1.0f + std::exp(-g)), T{}) * static_cast<float>(up[i]));
      }
    }
  });
}

}  // namespace

// RMSNorm of each row of x [tokens, width] by weight [width] (x's dtype).
at::Tensor kvopt_cpu::rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool plus_one) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [width] in the rows' dtype");
  at::Tensor out = at::empty_like(x), unused;
  if (x.scalar_type() == at::kFloat) norm_rows<float>(x, nullptr, weight, eps, plus_one, unused, out);
  else norm_rows<c10::BFloat16>(x, nullptr, weight, eps, plus_one, unused, out);
  return out;
}

// (x + addend, RMSNorm(x + addend)): a residual add and the norm after it in one pass.
std::tuple<at::Tensor, at::Tensor> kvopt_cpu::add_rms_norm(const at::Tensor& x, const at::Tensor& addend,
                                                           const at::Tensor& weight, double eps, bool plus_one) {
  check_rows(x, "add_rms_norm");
  TORCH_CHECK(addend.sizes() == x.sizes() && addend.is_contiguous() && addend.scalar_type() == x.scalar_type(),
              "add_rms_norm: the addend must be shaped and typed as the rows");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be [width] in the rows' dtype");
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) norm_rows<float>(x, &addend, weight, eps, plus_one, sum, out);
  else norm_rows<c10::BFloat16>(x, &addend, weight, eps, plus_one, sum, out);
  return {sum, out};
}

// qkv [tokens, (heads + 2 kv_heads) * D], cos and sin [tokens, D] (sin's first half negated) -> the rotated queries
// and keys [tokens, heads + kv_heads, D].
at::Tensor kvopt_cpu::rotary(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t dim) {
  check_rows(qkv, "rotary");
  TORCH_CHECK(dim % 2 == 0 && heads * dim <= qkv.size(1), "rotary: heads * dim must fit in a row, dim even");
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->is_contiguous() && table->numel() == qkv.size(0) * dim && table->scalar_type() == qkv.scalar_type(),
                "rotary: cos and sin must be contiguous [tokens, dim] in the rows' dtype");
  }
  at::Tensor out = at::empty({qkv.size(0), heads, dim}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    rotate_rows(qkv.data_ptr<float>(), qkv.size(0), qkv.size(1), heads, dim, cos.data_ptr<float>(),
                sin.data_ptr<float>(), out.data_ptr<float>());
  } else {
    rotate_rows(qkv.data_ptr<c10::BFloat16>(), qkv.size(0), qkv.size(1), heads, dim, cos.data_ptr<c10::BFloat16>(),
                sin.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  }
  return out;
}

at::Tensor kvopt_cpu::silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: rows must hold the gate and the up halves");
  const int64_t width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    gate_rows(gate_up.data_ptr<float>(), gate_up.size(0), width, out.data_ptr<float>());
  } else {
    gate_rows(gate_up.data_ptr<c10::BFloat16>(), gate_up.size(0), width, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvopt_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool plus_one) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor addend, Tensor weight, float eps, bool plus_one) -> (Tensor, Tensor)");
  m.def("rotary(Tensor qkv, Tensor cos, Tensor sin, int heads, int dim) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvopt_cpu, CPU, m) {
  m.impl("rms_norm", &kvopt_cpu::rms_norm);
  m.impl("add_rms_norm", &kvopt_cpu::add_rms_norm);
  m.impl("rotary", &kvopt_cpu::rotary);
  m.impl("silu_mul", &kvopt_cpu::silu_mul);
}
