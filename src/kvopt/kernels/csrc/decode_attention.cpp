// One decode step's attention on a CPU: each sequence's single query (a GQA group of query heads per KV head)
// over its context, read in place from the paged pool through its runs of consecutive slots.
//
// PyTorch's CPU flash kernel serves a decode step at 2-5 GB/s in bf16 (its tiles are built for many queries);
// a decode step reads each key and value once, so it should run near the memory's bandwidth. Here a work unit is
// one (sequence, KV head, chunk of keys): the group's queries stay in registers, a vector's width of keys at a time
// (16 with AVX-512, 8 otherwise) are scored (one vector of scores per query head), an online softmax keeps the
// running maximum and sum, and the values are accumulated in fp32. Units of one (sequence, KV head) are merged by
// their log-sum-exp at the end.
//
// Written with GCC/Clang vector extensions as wide as the machine's registers (vectors.h; the extension is built with
// -march=native on the machine that runs it; kvopt/kernels/cpu.py keys its build by the CPU's flags).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "kernels.h"
#include "vectors.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using namespace kvopt_vectors;  // kLanes floats a vector: a block of keys is as many tokens

//: Keys per work unit (a sequence's context is cut into chunks so that short batches still use every thread).
constexpr int64_t kChunk = 256;
//: Most query heads per KV head (a GQA group) a unit holds.
constexpr int kMaxGroup = 16;

inline vfloat splat(float x) { return vfloat{} + x; }

// The lane sums of ``x[0..kLanes-1]`` as one vector (lane j: the sum of x[j]'s lanes): a tree of shuffles and adds
// (kLanes - 1 steps of two shuffles and an add, where kLanes separate reductions take log2(kLanes) + 4 steps each).
#if defined(__AVX512F__)
inline vfloat transposed_sums(vfloat* x) {
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
#else
inline vfloat transposed_sums(vfloat* x) {
  vfloat y[4], z[2];
  for (int p = 0; p < 4; ++p) {
    y[p] = __builtin_shufflevector(x[2 * p], x[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(x[2 * p], x[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int p = 0; p < 2; ++p) {
    z[p] = __builtin_shufflevector(y[2 * p], y[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(y[2 * p], y[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

// One block of kLanes scores (lanes without a key at -inf, at least one with) into a running softmax: the running
// maximum ``m`` and sum ``l`` updated, the block's weights returned, and the factor the earlier sum and outputs are
// scaled by in ``correction``.
inline vfloat softmax_block(vfloat scores, float& m, float& l, float& correction) {
  const float new_max = std::max(m, max_lanes(scores));
  correction = m == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m - new_max);
  const vfloat weights = exp_lanes(scores - new_max);
  l = l * correction + sum_lanes(weights);
  m = new_max;
  return weights;
}

// The kLanes scores of a block of keys ``[kLanes][V]`` (fp32) against one query (``V`` vectors).
template <int V>
inline vfloat score_block(const float* query, const vfloat (*keys)[V]) {
  vfloat qv[V];
  for (int i = 0; i < V; ++i) qv[i] = load_lanes(query + i * kLanes);
  vfloat dots[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    vfloat dot = qv[0] * keys[j][0];
    for (int i = 1; i < V; ++i) dot += qv[i] * keys[j][i];
    dots[j] = dot;
  }
  return transposed_sums(dots);
}

// A block's softmax weights (from its scores) times its first ``n`` value rows ``[kLanes][V]`` added into one query's
// running output ``out`` (V vectors), its running maximum ``m`` and sum ``l`` updated.
template <int V>
inline void accumulate_block(vfloat scores, const vfloat (*values)[V], int n, float& m, float& l, float* out) {
  float correction;
  const vfloat weights = softmax_block(scores, m, l, correction);
  vfloat o[V];
  for (int i = 0; i < V; ++i) o[i] = load_lanes(out + i * kLanes) * correction;
  for (int j = 0; j < n; ++j) {
    const vfloat w = splat(weights[j]);
    for (int i = 0; i < V; ++i) o[i] += w * values[j][i];
  }
  std::memcpy(out, o, sizeof(o));
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
      for (int i = 0; i < V; ++i) block[j][i] = j < n ? load_lanes(k + j * kDim + i * kLanes) : vfloat{};
    }
    for (int g = 0; g < group; ++g) {
      const vfloat sums = score_block<V>(q + g * kDim, block);
      std::memcpy(scores[g], &sums, sizeof(sums));
    }
    for (int j = 0; j < kLanes; ++j) {  // the block's values, converted once too (rows past n weigh 0)
      for (int i = 0; i < V; ++i) block[j][i] = j < n ? load_lanes(v + j * kDim + i * kLanes) : vfloat{};
    }
    for (int g = 0; g < group; ++g) {
      for (int j = n; j < kLanes; ++j) scores[g][j] = -std::numeric_limits<float>::infinity();
      accumulate_block<V>(load_lanes(scores[g]), block, n, m[g], l[g], acc + g * kDim);
    }
  }
}

// The queries [S, kv_heads, group, D] (fp32 or bf16, any strides but the last) times ``scale``, contiguous fp32.
template <typename T>
void scale_rows(const at::Tensor& query, float scale, float* out) {
  const T* q = query.data_ptr<T>();
  const int64_t dim = query.size(3);
  for (int64_t s = 0; s < query.size(0); ++s) {
    for (int64_t h = 0; h < query.size(1); ++h) {
      for (int64_t g = 0; g < query.size(2); ++g) {
        const T* row = q + s * query.stride(0) + h * query.stride(1) + g * query.stride(2);
        for (int64_t d = 0; d < dim; ++d) *out++ = static_cast<float>(row[d]) * scale;
      }
    }
  }
}

std::vector<float> scaled_queries(const at::Tensor& query, float scale) {
  std::vector<float> out(query.numel());
  if (query.scalar_type() == at::kFloat) scale_rows<float>(query, scale, out.data());
  else scale_rows<c10::BFloat16>(query, scale, out.data());
  return out;
}

// The step's new keys or values [tokens, kv_heads, D] (any strides but the last) written to their slots of a pool
// [kv_heads, slots, D], in the pool's dtype.
void write_rows(const at::Tensor& rows, const at::Tensor& slots, at::Tensor& pool) {
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t dim = pool.size(2), bytes = dim * pool.element_size();
  const char* source = static_cast<const char*>(rows.data_ptr());
  char* target = static_cast<char*>(pool.data_ptr());
  for (int64_t t = 0; t < rows.size(0); ++t) {
    for (int64_t h = 0; h < rows.size(1); ++h) {
      std::memcpy(target + (h * pool.stride(0) + slot[t] * dim) * pool.element_size(),
                  source + (t * rows.stride(0) + h * rows.stride(1)) * rows.element_size(), bytes);
    }
  }
}

struct Unit {
  int source;                          // 0: the pool's slots through runs, 1: quantized groups in their records
  int64_t sequence, head, begin, end;  // items begin:end of that source for the sequence (tokens, or groups)
};

// Where each sequence's items come from: how many there are, and how many a work unit takes.
struct Source {
  std::vector<int64_t> lengths;
  int64_t chunk;
};

// The shared driver: each (sequence, KV head)'s items of every source cut into units, ``visit(unit, q, m, l, acc)``
// run on the threads (q: the group's queries times ``scale``), the units of one (sequence, head) merged by their
// log-sum-exp into ``out`` and ``lse``.
template <int V, typename Visit>
void attend_units(const at::Tensor& query, double scale, const std::vector<Source>& sources, Visit visit,
                  at::Tensor& out, at::Tensor& lse) {
  constexpr int kDim = V * kLanes;
  const int64_t sequences = query.size(0), heads = query.size(1);
  const int group = static_cast<int>(query.size(2));
  std::vector<Unit> units;
  std::vector<int64_t> first_unit(sequences * heads + 1);
  for (int64_t s = 0; s < sequences; ++s) {
    for (int64_t h = 0; h < heads; ++h) {
      first_unit[s * heads + h] = static_cast<int64_t>(units.size());
      for (int source = 0; source < static_cast<int>(sources.size()); ++source) {
        const int64_t length = sources[source].lengths[s];
        for (int64_t begin = 0; begin < length; begin += sources[source].chunk) {
          units.push_back({source, s, h, begin, std::min(length, begin + sources[source].chunk)});
        }
      }
    }
  }
  first_unit[sequences * heads] = static_cast<int64_t>(units.size());
  const int64_t count = static_cast<int64_t>(units.size());
  std::vector<float> part_acc(count * group * kDim), part_max(count * group), part_sum(count * group);
  const std::vector<float> scaled = scaled_queries(query, static_cast<float>(scale));
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
    for (int64_t u = first; u < last; ++u) {
      const Unit& unit = units[u];
      float* m = part_max.data() + u * group;
      float* l = part_sum.data() + u * group;
      float* acc = part_acc.data() + u * group * kDim;
      std::fill(m, m + group, -std::numeric_limits<float>::infinity());
      std::fill(l, l + group, 0.0f);
      std::fill(acc, acc + group * kDim, 0.0f);
      visit(unit, scaled.data() + (unit.sequence * heads + unit.head) * group * kDim, m, l, acc);
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

// Keys and values in the pool's slots, each sequence's through its runs of consecutive slots.
template <typename T, int V>
struct SlotReader {
  static constexpr int kDim = V * kLanes;
  const T* keys;
  const T* values;
  int64_t key_head, value_head;
  const int64_t* runs;
  const int64_t* offsets;
  int group;

  std::vector<int64_t> lengths(int64_t sequences) const {
    std::vector<int64_t> out(sequences, 0);
    for (int64_t s = 0; s < sequences; ++s) {
      for (int64_t r = offsets[s]; r < offsets[s + 1]; ++r) out[s] += runs[2 * r + 1] - runs[2 * r];
    }
    return out;
  }

  void operator()(const Unit& unit, const float* q, float* m, float* l, float* acc) const {
    int64_t position = 0;  // the sequence's token index where the current run starts
    for (int64_t r = offsets[unit.sequence]; r < offsets[unit.sequence + 1] && position < unit.end; ++r) {
      const int64_t start = runs[2 * r], length = runs[2 * r + 1] - start;
      const int64_t from = std::max(unit.begin, position), to = std::min(unit.end, position + length);
      if (from < to) {
        const int64_t slot = start + (from - position);
        attend_run<T, V>(q, group, keys + unit.head * key_head + slot * kDim,
                         values + unit.head * value_head + slot * kDim, to - from, m, l, acc);
      }
      position += length;
    }
  }
};

// Where a quantized group's fields lie in its records (KIVI's layout, kvopt/cache/quant.py): keys per channel (codes
// [tokens / per_byte, D] packed planar along the tokens, fp16 scale and zero [D]), values per token in groups of
// ``channels`` (codes laid out alike, fp16 scale and zero [tokens, D / channels]).
struct CodeLayout {
  int64_t bits, tokens, channels;
  int64_t key_scale, key_zero, value_scale, value_zero;  // byte offsets within a record (codes at 0)
  int64_t key_record, value_record, groups_per_block;    // bytes per record; records per block
};

inline float half_to_float(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, sizeof(h));
  return static_cast<float>(h);
}

// ``n`` fp16 values (unaligned bytes) as floats: 8 at a time where the CPU converts them (F16C).
inline void halves_to_floats(const uint8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
  }
#endif
  for (; i < n; ++i) dst[i] = half_to_float(src + 2 * i);
}

// Quantized groups read in place from their records: group j of sequence s is record records[s, j] of block
// blocks[s, j]; the first counts[s] of each row are real.
template <int V>
struct CodeReader {
  static constexpr int kDim = V * kLanes;
  const uint8_t* keys;
  const uint8_t* values;
  int64_t key_head, value_head, block_bytes, width;
  const int64_t* blocks;
  const int64_t* records;
  CodeLayout layout;
  int group;
  int64_t channel_groups;
  int64_t channel_group_of[V];  // the value channel group of each vector of channels

  const uint8_t* key_record(const Unit& unit, int64_t j) const {
    const int64_t at = unit.sequence * width + j;
    return keys + unit.head * key_head + blocks[at] * block_bytes + records[at] * layout.key_record;
  }

  const uint8_t* value_record(const Unit& unit, int64_t j) const {
    const int64_t at = unit.sequence * width + j;
    return values + unit.head * value_head + blocks[at] * block_bytes + records[at] * layout.value_record;
  }

  // The codes of tokens first ... first + kLanes - 1 of a group as floats, unscaled: [kLanes][V] vectors. A byte row holds
  // tokens r, r + rows, ... (planar): the row and the field advance together.
  void code_block(const uint8_t* codes, int64_t first, vfloat (*out)[V]) const {
    const int64_t rows = layout.tokens * layout.bits / 8;
    const vint mask = vint{} + ((1 << layout.bits) - 1);
    int64_t row = first % rows, field = first / rows;
    for (int j = 0; j < kLanes; ++j) {
      const uint8_t* bytes_of_row = codes + row * kDim;
      const int shift = static_cast<int>(field * layout.bits);
      for (int i = 0; i < V; ++i) {
        out[j][i] = __builtin_convertvector((widen_bytes(bytes_of_row + i * kLanes) >> shift) & mask, vfloat);
      }
      if (++row == rows) row = 0, ++field;
    }
  }

  // Attention over quantized groups without dequantized keys: a key's score is (q * key scale) . codes + q . key zero
  // (scales and zero-points per channel, folded into each query once per group); values are dequantized kLanes tokens
  // at a time in registers, once for the group's queries.
  void operator()(const Unit& unit, const float* q, float* m, float* l, float* acc) const {
    std::vector<float> value_scale(layout.tokens * channel_groups), value_zero(layout.tokens * channel_groups);
    alignas(64) float key_scale[kDim], key_zero[kDim];
    alignas(64) float scaled_query[kMaxGroup][kDim];
    float query_zero[kMaxGroup];
    alignas(64) vfloat block[kLanes][V];
    alignas(64) float scores[kMaxGroup][kLanes];
    for (int64_t j = unit.begin; j < unit.end; ++j) {
      const uint8_t* key = key_record(unit, j);
      const uint8_t* value = value_record(unit, j);
      if (j + 1 < width) {  // the next group's records (past the unit's end too: the next unit reads them)
        prefetch_bytes(key_record(unit, j + 1), layout.key_record);
        prefetch_bytes(value_record(unit, j + 1), layout.value_record);
      }
      halves_to_floats(key + layout.key_scale, key_scale, kDim);
      halves_to_floats(key + layout.key_zero, key_zero, kDim);
      halves_to_floats(value + layout.value_scale, value_scale.data(), layout.tokens * channel_groups);
      halves_to_floats(value + layout.value_zero, value_zero.data(), layout.tokens * channel_groups);
      for (int g = 0; g < group; ++g) {
        vfloat zero_dot = vfloat{};
        for (int i = 0; i < V; ++i) {
          const vfloat qi = load_lanes(q + g * kDim + i * kLanes);
          const vfloat scaled = qi * load_lanes(key_scale + i * kLanes);
          std::memcpy(scaled_query[g] + i * kLanes, &scaled, sizeof(scaled));
          zero_dot += qi * load_lanes(key_zero + i * kLanes);
        }
        query_zero[g] = sum_lanes(zero_dot);
      }
      for (int64_t first = 0; first < layout.tokens; first += kLanes) {
        code_block(key, first, block);
        for (int g = 0; g < group; ++g) {
          const vfloat sums = score_block<V>(scaled_query[g], block) + query_zero[g];
          std::memcpy(scores[g], &sums, sizeof(sums));
        }
        code_block(value, first, block);
        for (int t = 0; t < kLanes; ++t) {  // values dequantized once for every query of the group
          const float* scale_of = value_scale.data() + (first + t) * channel_groups;
          const float* zero_of = value_zero.data() + (first + t) * channel_groups;
          for (int i = 0; i < V; ++i) {
            block[t][i] = block[t][i] * scale_of[channel_group_of[i]] + zero_of[channel_group_of[i]];
          }
        }
        for (int g = 0; g < group; ++g) {
          accumulate_block<V>(load_lanes(scores[g]), block, kLanes, m[g], l[g], acc + g * kDim);
        }
      }
    }
  }
};

struct Codes {
  const at::Tensor *key_pool, *value_pool, *blocks, *records, *counts;
  CodeLayout layout;
};

template <typename T, int V>
void run(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& runs,
         const at::Tensor& offsets, const Codes* codes, double scale, at::Tensor& out, at::Tensor& lse) {
  const int group = static_cast<int>(query.size(2));
  const SlotReader<T, V> slots{keys.data_ptr<T>(), values.data_ptr<T>(), keys.stride(0), values.stride(0),
                               runs.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), group};
  std::vector<Source> sources{{slots.lengths(query.size(0)), kChunk}};
  if (codes == nullptr) {
    attend_units<V>(query, scale, sources, slots, out, lse);
    return;
  }
  const CodeLayout& layout = codes->layout;
  CodeReader<V> coded{codes->key_pool->data_ptr<uint8_t>(), codes->value_pool->data_ptr<uint8_t>(),
                      codes->key_pool->stride(0), codes->value_pool->stride(0), codes->key_pool->size(2),
                      codes->blocks->size(1), codes->blocks->data_ptr<int64_t>(), codes->records->data_ptr<int64_t>(),
                      layout, group, V * kLanes / layout.channels, {}};
  for (int i = 0; i < V; ++i) coded.channel_group_of[i] = i / (layout.channels / kLanes);
  const int64_t* count_of = codes->counts->data_ptr<int64_t>();
  sources.push_back({std::vector<int64_t>(count_of, count_of + query.size(0)), std::max<int64_t>(1, kChunk / layout.tokens)});
  attend_units<V>(query, scale, sources,
                  [&](const Unit& unit, const float* q, float* m, float* l, float* acc) {
                    if (unit.source == 0) slots(unit, q, m, l, acc);
                    else coded(unit, q, m, l, acc);
                  },
                  out, lse);
}

#define KVOPT_FOR_EACH_DIM(dim, CALL)                                                              \
  switch (dim) {                                                                                  \
    case 32: { constexpr int V = 32 / kLanes; CALL; break; }                                                \
    case 64: { constexpr int V = 64 / kLanes; CALL; break; }                                                \
    case 80: { constexpr int V = 80 / kLanes; CALL; break; }                                                \
    case 96: { constexpr int V = 96 / kLanes; CALL; break; }                                                \
    case 128: { constexpr int V = 128 / kLanes; CALL; break; }                                               \
    case 256: { constexpr int V = 256 / kLanes; CALL; break; }                                              \
    default: TORCH_CHECK(false, "head_dim ", dim, " is not one of 32, 64, 80, 96, 128, 256");    \
  }

}  // namespace

// query [S, kv_heads, group, D] fp32 or bf16 (any strides but the last); keys/values [kv_heads, slots, D] (fp32 or
// bf16, rows contiguous); given new_keys/new_values [T, kv_heads, D] (the pool's dtype, any strides but the last)
// and slots [T] int64, those rows are written to their slots first (a decode step's own keys and values);
// runs [R, 2] int64 (start, stop) slot ranges, each sequence's in its token order; offsets [S + 1] int64 (sequence
// s owns runs offsets[s]:offsets[s+1]). With codes, each sequence also attends over quantized groups read in place:
// key_records/value_records one layer's pools as bytes [kv_heads, blocks, block bytes]; blocks/records [S, G] int64
// (where each sequence's groups lie), counts [S] int64 (its real groups, a prefix of the row); layout: bits, tokens
// per group, value channels per group, the byte offsets of the key scale, key zero, value scale and value zero in a
// record, key and value record bytes, records per block. Returns (out [S, kv_heads, group, D] fp32,
// lse [S, kv_heads, group] fp32), every part merged.
std::tuple<at::Tensor, at::Tensor> kvopt_cpu::decode_attention(
    const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& runs,
    const at::Tensor& offsets, double scale, const std::optional<at::Tensor>& key_records,
    const std::optional<at::Tensor>& value_records, const std::optional<at::Tensor>& blocks,
    const std::optional<at::Tensor>& records, const std::optional<at::Tensor>& counts,
    at::OptionalIntArrayRef layout, const std::optional<at::Tensor>& new_keys,
    const std::optional<at::Tensor>& new_values, const std::optional<at::Tensor>& slots) {
  TORCH_CHECK(query.dim() == 4 && (query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16) &&
                  query.stride(3) == 1,
              "decode_attention: query must be an fp32 or bf16 [sequences, kv_heads, group, head_dim] tensor with "
              "contiguous rows");
  TORCH_CHECK(keys.dim() == 3 && values.dim() == 3 && keys.scalar_type() == values.scalar_type(),
              "decode_attention: keys and values must be [kv_heads, slots, head_dim] tensors of one dtype");
  const int64_t dim = query.size(3), sequences = query.size(0);
  for (const at::Tensor* pool : {&keys, &values}) {
    TORCH_CHECK(pool->size(0) == query.size(1) && pool->size(2) == dim && pool->stride(2) == 1 &&
                    pool->stride(1) == dim,
                "decode_attention: pool rows must be contiguous and match the query's heads and head_dim");
  }
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.is_contiguous() && offsets.scalar_type() == at::kLong &&
                  offsets.is_contiguous() && offsets.numel() == sequences + 1,
              "decode_attention: runs [R, 2] and offsets [sequences + 1] must be contiguous int64");
  std::optional<Codes> codes;
  if (layout.has_value()) {
    TORCH_CHECK(layout->size() == 10 && key_records && value_records && blocks && records && counts,
                "decode_attention: codes need key_records, value_records, blocks, records, counts and a 10-field layout");
    const auto f = *layout;
    const CodeLayout code{f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9]};
    TORCH_CHECK((code.bits == 2 || code.bits == 4 || code.bits == 8) && code.tokens % kLanes == 0 &&
                    code.channels % kLanes == 0 && dim % code.channels == 0,
                "decode_attention: 2/4/8-bit codes, groups of a multiple of 16 tokens, value groups of a multiple of 16 channels "
                "dividing head_dim");
    for (const at::Tensor* pool : {&*key_records, &*value_records}) {
      TORCH_CHECK(pool->dim() == 3 && pool->scalar_type() == at::kByte && pool->size(0) == query.size(1) &&
                      pool->stride(2) == 1 && pool->stride(1) == pool->size(2),
                  "decode_attention: code pools must be [kv_heads, blocks, block bytes] uint8 with contiguous blocks");
    }
    TORCH_CHECK(blocks->scalar_type() == at::kLong && records->scalar_type() == at::kLong &&
                    counts->scalar_type() == at::kLong && blocks->is_contiguous() && records->is_contiguous() &&
                    counts->is_contiguous() && blocks->dim() == 2 && blocks->sizes() == records->sizes() &&
                    blocks->size(0) == sequences && counts->numel() == sequences,
                "decode_attention: blocks/records [sequences, groups] and counts [sequences] must be contiguous int64");
    codes = Codes{&*key_records, &*value_records, &*blocks, &*records, &*counts, code};
  }
  if (slots.has_value()) {
    TORCH_CHECK(new_keys && new_values && slots->scalar_type() == at::kLong && slots->is_contiguous(),
                "decode_attention: writing rows needs new_keys, new_values and int64 slots");
    for (const at::Tensor* rows : {&*new_keys, &*new_values}) {
      TORCH_CHECK(rows->dim() == 3 && rows->size(0) == slots->numel() && rows->size(1) == keys.size(0) &&
                      rows->size(2) == dim && rows->stride(2) == 1 && rows->scalar_type() == keys.scalar_type(),
                  "decode_attention: new rows must be [slots, kv_heads, head_dim] in the pool's dtype");
    }
    at::Tensor key_pool = keys, value_pool = values;
    write_rows(*new_keys, *slots, key_pool);
    write_rows(*new_values, *slots, value_pool);
  }
  const auto floats = query.options().dtype(at::kFloat);
  auto out = at::empty(query.sizes(), floats);
  auto lse = at::empty({sequences, query.size(1), query.size(2)}, floats);
  const Codes* coded = codes ? &*codes : nullptr;
  if (keys.scalar_type() == at::kBFloat16) {
    KVOPT_FOR_EACH_DIM(dim, (run<c10::BFloat16, V>(query, keys, values, runs, offsets, coded, scale, out, lse)));
  } else {
    TORCH_CHECK(keys.scalar_type() == at::kFloat, "decode_attention: keys must be bf16 or fp32");
    KVOPT_FOR_EACH_DIM(dim, (run<float, V>(query, keys, values, runs, offsets, coded, scale, out, lse)));
  }
  return {out, lse};
}

TORCH_LIBRARY(kvopt_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor(a!) keys, Tensor(b!) values, Tensor runs, Tensor offsets, float scale, "
        "Tensor? key_records=None, Tensor? value_records=None, Tensor? blocks=None, Tensor? records=None, "
        "Tensor? counts=None, int[]? layout=None, Tensor? new_keys=None, Tensor? new_values=None, "
        "Tensor? slots=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvopt_cpu, CPU, m) { m.impl("decode_attention", &kvopt_cpu::decode_attention); }

