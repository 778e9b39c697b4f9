// The kernels as the extension module's functions, beside their registration as ``torch.ops.kvopt_cpu`` ops.
//
// A decode step calls them ~270 times (a few per layer): through the dispatcher a call costs ~1.2 us of argument
// boxing and schema matching, through pybind11 ~0.2 us (a 4-argument call, measured). The engine's eager decode path
// takes these; the registered ops stay for what traces or compiles (torch.compile, torch.library's checks). Each call
// is recorded under the op's name with its tensors' shapes, as the dispatcher records an op (a no-op unless a
// profiler runs): torch.profiler, and benchmarks/decode_profile.py's split of a step, see them. Only this file
// includes pybind11 and Python's headers (each file that does takes seconds more to compile).

#include <ATen/record_function.h>
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

namespace py = pybind11;

#define KVOPT_RECORD(name, ...) RECORD_FUNCTION("kvopt_cpu::" name, std::vector<c10::IValue>({__VA_ARGS__}))

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto release = py::call_guard<py::gil_scoped_release>();  // an HTTP server's threads run meanwhile
  const auto none = py::none();
  m.def(
      "decode_attention",
      [](const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& runs,
         const at::Tensor& offsets, double scale, const std::optional<at::Tensor>& key_records,
         const std::optional<at::Tensor>& value_records, const std::optional<at::Tensor>& blocks,
         const std::optional<at::Tensor>& records, const std::optional<at::Tensor>& counts,
         const std::optional<std::vector<int64_t>>& layout, const std::optional<at::Tensor>& new_keys,
         const std::optional<at::Tensor>& new_values, const std::optional<at::Tensor>& slots) {
        KVOPT_RECORD("decode_attention", query, keys, values);
        const at::OptionalIntArrayRef fields = layout ? at::OptionalIntArrayRef(*layout) : at::OptionalIntArrayRef();
        return kvopt_cpu::decode_attention(query, keys, values, runs, offsets, scale, key_records, value_records, blocks,
                                           records, counts, fields, new_keys, new_values, slots);
      },
      py::arg("query"), py::arg("keys"), py::arg("values"), py::arg("runs"), py::arg("offsets"), py::arg("scale"),
      py::arg("key_records") = none, py::arg("value_records") = none, py::arg("blocks") = none,
      py::arg("records") = none, py::arg("counts") = none, py::arg("layout") = none, py::arg("new_keys") = none,
      py::arg("new_values") = none, py::arg("slots") = none, release);
  m.def(
      "linear_rows",
      [](const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
         const std::optional<at::Tensor>& bias) {
        KVOPT_RECORD("linear_rows", input, weight);
        return kvopt_cpu::linear_rows(input, weight, scale, bias);
      },
      py::arg("input"), py::arg("weight"), py::arg("scale") = none, py::arg("bias") = none, release);
  m.def(
      "rms_norm",
      [](const at::Tensor& x, const at::Tensor& weight, double eps, bool plus_one) {
        KVOPT_RECORD("rms_norm", x);
        return kvopt_cpu::rms_norm(x, weight, eps, plus_one);
      },
      release);
  m.def(
      "add_rms_norm",
      [](const at::Tensor& x, const at::Tensor& addend, const at::Tensor& weight, double eps, bool plus_one) {
        KVOPT_RECORD("add_rms_norm", x);
        return kvopt_cpu::add_rms_norm(x, addend, weight, eps, plus_one);
      },
      release);
  m.def(
      "rotary",
      [](const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t dim) {
        KVOPT_RECORD("rotary", qkv);
        return kvopt_cpu::rotary(qkv, cos, sin, heads, dim);
      },
      release);
  m.def(
      "silu_mul",
      [](const at::Tensor& gate_up) {
        KVOPT_RECORD("silu_mul", gate_up);
        return kvopt_cpu::silu_mul(gate_up);
      },
      release);
}
