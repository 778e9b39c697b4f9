// The kernels' entry points: each .cpp registers its own as a ``torch.ops.kvopt_cpu`` op, and bindings.cpp binds them
// all as the extension module's functions. What each computes is said where it is defined.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/OptionalArrayRef.h>

#include <optional>
#include <tuple>

namespace kvopt_cpu {

// decode_attention.cpp
std::tuple<at::Tensor, at::Tensor> decode_attention(
    const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& runs,
    const at::Tensor& offsets, double scale, const std::optional<at::Tensor>& key_records,
    const std::optional<at::Tensor>& value_records, const std::optional<at::Tensor>& blocks,
    const std::optional<at::Tensor>& records, const std::optional<at::Tensor>& counts, at::OptionalIntArrayRef layout,
    const std::optional<at::Tensor>& new_keys, const std::optional<at::Tensor>& new_values,
    const std::optional<at::Tensor>& slots);

// weight_rows.cpp
at::Tensor linear_rows(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                       const std::optional<at::Tensor>& bias);

// layer_glue.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool plus_one);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& addend, const at::Tensor& weight,
                                                double eps, bool plus_one);
at::Tensor rotary(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t dim);
at::Tensor silu_mul(const at::Tensor& gate_up);

}  // namespace kvopt_cpu
