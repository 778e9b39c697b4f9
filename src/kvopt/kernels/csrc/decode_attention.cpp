// One decode step's attention on a CPU: each sequence's single query (a GQA group of query heads per KV head)
// over its context, read in place from the paged pool through its runs of consecutive slots.
//
// PyTorch's CPU flash kernel serves a decode step at 2-5 GB/s in bf16 (its tiles are built for many queries);
// a decode step reads each key and value once, so it should run near the memory's bandwidth. Here a work unit is
// one (sequence, KV head, chunk of keys): the group's queries stay in registers, 16 keys at a time are scored
// (one vector of scores per query head), an online softmax keeps the running maximum and sum, and the values are
// accumulated in fp32. Units of one (sequence, KV head) are merged by their log-sum-exp at the end.
//
// Written with GCC/Clang vector extensions (no intrinsics): the compiler maps a 16-float vector onto AVX-512, two
// AVX2 registers, or whatever the build machine has (the extension is built with -march=native on the machine
// that runs it; kvopt/kernels/cpu.py keys its build by the CPU's flags).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vhalf __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vfloat4 __attribute__((vector_size(4 * sizeof(float))));

//: Keys per work unit (a sequence's context is cut into chunks so that short batches still use every thread).
constexpr int64_t kChunk = 256;
//: Most query heads per KV head (a GQA group) a unit holds.
constexpr int kMaxGroup = 16;

inline vfloat splat(float x) { return vfloat{} + x; }

inline vfloat load_row(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vfloat load_row(const c10::BFloat16* p) {
  vhalf bits;
  std::memcpy(&bits, p, sizeof(bits));
  vuint wide = __builtin_convertvector(bits, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

inline float sum_lanes(vfloat v) {
  vfloat8 a, b;
  std::memcpy(&a, &v, sizeof(a));
  std::memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof(a), sizeof(b));
  a += b;
  vfloat4 c, d;
  std::memcpy(&c, &a, sizeof(c));
  std::memcpy(&d, reinterpret_cast<const char*>(&a) + sizeof(c), sizeof(d));
  c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

inline float max_lanes(vfloat v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// The 16 lane sums of ``x[0..15]`` as one vector (lane j: the sum of x[j]'s lanes): a tree of shuffles and adds
// (15 steps of two shuffles and an add, where 16 separate reductions take ~8 steps each).
inline vfloat sum_lanes_of_16(vfloat* x) {
  vfloat y[8], z[4], w[2];
  for (int p = 0; p < 8; ++p) {
    y[p] = __builtin_shufflevector(x[2 * p], x[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * p], x[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int p = 0; p < 4; ++p) {
    z[p] = __builtin_shufflevector(y[2 * p], y[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(y[2 * p], y[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int p = 0; p < 2; ++p) {
    w[p] = __builtin_shufflevector(z[2 * p], z[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(z[2 * p], z[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// exp(x) for x <= 0 (scores minus their running maximum), Cephes' expf: 2^n * exp(r), |r| <= ln2 / 2, a degree-6
// polynomial; relative error ~1e-7, the float's own precision. Below -87 it returns 0.
inline vfloat exp_nonpositive(vfloat x) {
  const vint tiny = x < -87.0f;
  x = tiny ? splat(-87.0f) : x;
  // n = the nearest integer to x / ln2 (x <= 0: truncating x / ln2 - 0.5 toward zero rounds it)
  const vint n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vint);
  const vfloat nf = __builtin_convertvector(n, vfloat);
  vfloat r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vint bits = (n + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  vfloat out = p * scale;
  return tiny ? splat(0.0f) : out;
}

// A run of ``count`` keys from one chunk: the group's queries (pre-scaled) against them, accumulated into the
// unit's running maximum ``m``, sum ``l`` and unnormalised output ``acc`` (``G`` queries, ``V`` vectors each).
template <typename T, int V>
void attend_run(const float* __restrict q, int group, const T* __restrict keys, const T* __restrict values,
                int64_t count, float* __restrict m, float* __restrict l, float* __restrict acc) {
  constexpr int kDim = V * kLanes;
  alignas(64) float scores[kMaxGroup][kLanes];
  for (int64_t first = 0; first < count; first += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, count - first));
    const T* k = keys + first * kDim;
    const T* v = values + first * kDim;
    alignas(64) vfloat block[kLanes][V];  // the block's keys in fp32, converted once for every query of the group
    for (int j = 0; j < kLanes; ++j) {
      for (int i = 0; i < V; ++i) block[j][i] = j < n ? load_row(k + j * kDim + i * kLanes) : vfloat{};
    }
    for (int g = 0; g < group; ++g) {
      const float* qg = q + g * kDim;
      vfloat qv[V];
      for (int i = 0; i < V; ++i) qv[i] = load_row(qg + i * kLanes);
      vfloat dots[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        vfloat dot = qv[0] * block[j][0];
        for (int i = 1; i < V; ++i) dot += qv[i] * block[j][i];
        dots[j] = dot;
      }
      const vfloat sums = sum_lanes_of_16(dots);
      std::memcpy(scores[g], &sums, sizeof(sums));
    }
    for (int j = 0; j < kLanes; ++j) {  // the block's values, converted once too (rows past n weigh 0)
      for (int i = 0; i < V; ++i) block[j][i] = j < n ? load_row(v + j * kDim + i * kLanes) : vfloat{};
    }
    for (int g = 0; g < group; ++g) {
      for (int j = n; j < kLanes; ++j) scores[g][j] = -std::numeric_limits<float>::infinity();
      const vfloat block_scores = load_row(scores[g]);
      const float new_max = std::max(m[g], max_lanes(block_scores));
      const float correction = m[g] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m[g] - new_max);
      const vfloat weights = exp_nonpositive(block_scores - new_max);
      l[g] = l[g] * correction + sum_lanes(weights);
      m[g] = new_max;
      float* out = acc + g * kDim;
      vfloat o[V];
      for (int i = 0; i < V; ++i) o[i] = load_row(out + i * kLanes) * correction;
      for (int j = 0; j < n; ++j) {
        const vfloat w = splat(weights[j]);
        for (int i = 0; i < V; ++i) o[i] += w * block[j][i];
      }
      std::memcpy(out, o, sizeof(o));
    }
  }
}

struct Unit {
  int64_t sequence, head, begin, end;  // keys begin:end of the sequence's context, in its token order
};

template <typename T, int V>
void run(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const int64_t* runs,
         const int64_t* offsets, double scale, at::Tensor& out, at::Tensor& lse) {
  constexpr int kDim = V * kLanes;
  const int64_t sequences = query.size(0), heads = query.size(1);
  const int group = static_cast<int>(query.size(2));
  std::vector<Unit> units;
  std::vector<int64_t> first_unit(sequences * heads + 1);
  for (int64_t s = 0; s < sequences; ++s) {
    int64_t length = 0;
    for (int64_t r = offsets[s]; r < offsets[s + 1]; ++r) length += runs[2 * r + 1] - runs[2 * r];
    for (int64_t h = 0; h < heads; ++h) {
      first_unit[s * heads + h] = static_cast<int64_t>(units.size());
      for (int64_t begin = 0; begin < length; begin += kChunk) units.push_back({s, h, begin, std::min(length, begin + kChunk)});
    }
  }
  first_unit[sequences * heads] = static_cast<int64_t>(units.size());
  const int64_t count = static_cast<int64_t>(units.size());
  std::vector<float> part_acc(count * group * kDim), part_max(count * group), part_sum(count * group);
  std::vector<float> scaled(query.numel());
  const float* q_in = query.data_ptr<float>();
  for (int64_t i = 0; i < query.numel(); ++i) scaled[i] = q_in[i] * static_cast<float>(scale);
  const T* key_pool = keys.data_ptr<T>();
  const T* value_pool = values.data_ptr<T>();
  const int64_t key_head = keys.stride(0), value_head = values.stride(0);
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
    for (int64_t u = first; u < last; ++u) {
      const Unit& unit = units[u];
      float* m = part_max.data() + u * group;
      float* l = part_sum.data() + u * group;
      float* acc = part_acc.data() + u * group * kDim;
      std::fill(m, m + group, -std::numeric_limits<float>::infinity());
      std::fill(l, l + group, 0.0f);
      std::fill(acc, acc + group * kDim, 0.0f);
      const float* q = scaled.data() + (unit.sequence * heads + unit.head) * group * kDim;
      int64_t position = 0;  // the sequence's token index where the current run starts
      for (int64_t r = offsets[unit.sequence]; r < offsets[unit.sequence + 1] && position < unit.end; ++r) {
        const int64_t start = runs[2 * r], length = runs[2 * r + 1] - start;
        const int64_t from = std::max(unit.begin, position), to = std::min(unit.end, position + length);
        if (from < to) {
          const int64_t slot = start + (from - position);
          attend_run<T, V>(q, group, key_pool + unit.head * key_head + slot * kDim,
                           value_pool + unit.head * value_head + slot * kDim, to - from, m, l, acc);
        }
        position += length;
      }
    }
  });
  float* o = out.data_ptr<float>();
  float* log_sum = lse.data_ptr<float>();
  for (int64_t sh = 0; sh < sequences * heads; ++sh) {
    for (int g = 0; g < group; ++g) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t u = first_unit[sh]; u < first_unit[sh + 1]; ++u) top = std::max(top, part_max[u * group + g]);
      float* dst = o + (sh * group + g) * kDim;
      std::fill(dst, dst + kDim, 0.0f);
      float total = 0.0f;
      for (int64_t u = first_unit[sh]; u < first_unit[sh + 1]; ++u) {
        if (part_sum[u * group + g] == 0.0f) continue;
        const float w = std::exp(part_max[u * group + g] - top);
        total += part_sum[u * group + g] * w;
        const float* src = part_acc.data() + (u * group + g) * kDim;
        for (int d = 0; d < kDim; ++d) dst[d] += w * src[d];
      }
      if (total > 0.0f) {
        const float inverse = 1.0f / total;
        for (int d = 0; d < kDim; ++d) dst[d] *= inverse;
        log_sum[sh * group + g] = top + std::log(total);
      } else {
        log_sum[sh * group + g] = -std::numeric_limits<float>::infinity();
      }
    }
  }
}

template <typename T>
void dispatch_dim(int64_t dim, const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                  const int64_t* runs, const int64_t* offsets, double scale, at::Tensor& out, at::Tensor& lse) {
  switch (dim) {
    case 32: return run<T, 2>(query, keys, values, runs, offsets, scale, out, lse);
    case 64: return run<T, 4>(query, keys, values, runs, offsets, scale, out, lse);
    case 80: return run<T, 5>(query, keys, values, runs, offsets, scale, out, lse);
    case 96: return run<T, 6>(query, keys, values, runs, offsets, scale, out, lse);
    case 128: return run<T, 8>(query, keys, values, runs, offsets, scale, out, lse);
    case 256: return run<T, 16>(query, keys, values, runs, offsets, scale, out, lse);
    default: TORCH_CHECK(false, "decode_attention: head_dim ", dim, " is not one of 32, 64, 80, 96, 128, 256");
  }
}

// query [S, kv_heads, group, D] fp32 contiguous; keys/values [kv_heads, slots, D] (fp32 or bf16, rows contiguous);
// runs [R, 2] int64 (start, stop) slot ranges, each sequence's in its token order; offsets [S + 1] int64 (sequence
// s owns runs offsets[s]:offsets[s+1]). Returns (out [S, kv_heads, group, D] fp32, lse [S, kv_heads, group] fp32).
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& query, const at::Tensor& keys,
                                                    const at::Tensor& values, const at::Tensor& runs,
                                                    const at::Tensor& offsets, double scale) {
  TORCH_CHECK(query.dim() == 4 && query.scalar_type() == at::kFloat && query.is_contiguous(),
              "decode_attention: query must be a contiguous fp32 [sequences, kv_heads, group, head_dim] tensor");
  TORCH_CHECK(keys.dim() == 3 && values.dim() == 3 && keys.scalar_type() == values.scalar_type(),
              "decode_attention: keys and values must be [kv_heads, slots, head_dim] tensors of one dtype");
  const int64_t dim = query.size(3);
  for (const at::Tensor* pool : {&keys, &values}) {
    TORCH_CHECK(pool->size(0) == query.size(1) && pool->size(2) == dim && pool->stride(2) == 1 &&
                    pool->stride(1) == dim,
                "decode_attention: pool rows must be contiguous and match the query's heads and head_dim");
  }
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.is_contiguous() && offsets.scalar_type() == at::kLong &&
                  offsets.is_contiguous() && offsets.numel() == query.size(0) + 1,
              "decode_attention: runs [R, 2] and offsets [sequences + 1] must be contiguous int64");
  auto out = at::empty(query.sizes(), query.options());
  auto lse = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  const int64_t* run_data = runs.data_ptr<int64_t>();
  const int64_t* offset_data = offsets.data_ptr<int64_t>();
  if (keys.scalar_type() == at::kBFloat16) {
    dispatch_dim<c10::BFloat16>(dim, query, keys, values, run_data, offset_data, scale, out, lse);
  } else {
    TORCH_CHECK(keys.scalar_type() == at::kFloat, "decode_attention: keys must be bf16 or fp32");
    dispatch_dim<float>(dim, query, keys, values, run_data, offset_data, scale, out, lse);
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(kvopt_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor runs, Tensor offsets, float scale) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvopt_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
