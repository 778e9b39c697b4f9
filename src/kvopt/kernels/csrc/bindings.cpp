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

// ``kernel`` as a Python function recorded under ``name`` with its arguments (tensors' shapes among them).
template <typename Result, typename... Args>
auto recorded(const char* name, Result (*kernel)(Args...)) {
  return [name, kernel](Args... args) -> Result {
    RECORD_FUNCTION(name, std::vector<c10::IValue>({c10::IValue(args)...}));
    return kernel(args...);
  };
}

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
        RECORD_FUNCTION("kvopt_cpu::decode_attention", std::vector<c10::IValue>({query, keys, values}));
        const at::OptionalIntArrayRef fields = layout ? at::OptionalIntArrayRef(*layout) : at::OptionalIntArrayRef();
        return kvopt_cpu::decode_attention(query, keys, values, runs, offsets, scale, key_records, value_records, blocks,
                                           records, counts, fields, new_keys, new_values, slots);
      },
      py::arg("query"), py::arg("keys"), py::arg("values"), py::arg("runs"), py::arg("offsets"), py::arg("scale"),
      py::arg("key_records") = none, py::arg("value_records") = none, py::arg("blocks") = none,
      py::arg("records") = none, py::arg("counts") = none, py::arg("layout") = none, py::arg("new_keys") = none,
      py::arg("new_values") = none, py::arg("slots") = none, release);
  m.def("linear_rows", recorded("kvopt_cpu::linear_rows", &kvopt_cpu::linear_rows), py::arg("input"), py::arg("weight"),
        py::arg("scale") = none, py::arg("bias") = none, release);
  m.def("rms_norm", recorded("kvopt_cpu::rms_norm", &kvopt_cpu::rms_norm), release);
  m.def("add_rms_norm", recorded("kvopt_cpu::add_rms_norm", &kvopt_cpu::add_rms_norm), release);
  m.def("rotary", recorded("kvopt_cpu::rotary", &kvopt_cpu::rotary), release);
  m.def("silu_mul", recorded("kvopt_cpu::silu_mul", &kvopt_cpu::silu_mul), release);
}
