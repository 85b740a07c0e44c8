// Python bindings of mfsdp2's native kernels (loaded by mfsdp2/precision/native.py, which holds the
// pure-PyTorch reference of each and decides which one runs).
#include <torch/extension.h>

#include "adamw.h"
#include "adamw_bf16.h"
#include "float8.h"

#ifndef MFSDP2_TORCH_VERSION
#error "build through setup.py: it defines MFSDP2_TORCH_VERSION, the torch this module is built against"
#endif

namespace py = pybind11;

// Bumped whenever a kernel's signature or meaning changes: mfsdp2/precision/native.py loads a module only
// if it reports the API it expects (a stale build from older sources is not used).
constexpr int kApiVersion = 6;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mfsdp2 native kernels over flat buffers and their segment tables (CPU)";
  m.def("api_version", [] { return kApiVersion; }, "The kernels' API version (see mfsdp2/precision/native.py).");
  m.def("torch_version", [] { return std::string(MFSDP2_TORCH_VERSION); },
        "The torch version this module was built against.");
  m.def("quantise_fp8", &mfsdp2::quantise_fp8, py::arg("src"), py::arg("dst"), py::arg("offsets"),
        py::arg("lengths"), py::arg("scales"), py::arg("max"), py::arg("e5m2"),
        py::call_guard<py::gil_scoped_release>());
  m.def("lookup_bytes", &mfsdp2::lookup_bytes, py::arg("src"), py::arg("dst"), py::arg("offsets"),
        py::arg("lengths"), py::arg("tables"), py::arg("allow_vbmi") = true,
        py::call_guard<py::gil_scoped_release>());
  m.def("adamw_step", &mfsdp2::adamw_step, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"), py::arg("steps"), py::arg("segments"), py::arg("hyper"),
        py::arg("fma_lerp"), py::arg("fma_addcmul"), py::arg("sqrt_mode"), py::call_guard<py::gil_scoped_release>());
  m.def("adamw_step_bf16", &mfsdp2::adamw_step_bf16, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"), py::arg("steps"), py::arg("segments"), py::arg("hyper"),
        py::arg("seed"), py::arg("fma_lerp"), py::arg("fma_addcmul"),
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_salt", &mfsdp2::bf16_salt, py::arg("seed"), py::arg("param_id"), py::arg("step"),
        "The hash salt of one parameter's step under adamw_step_bf16.");
  m.def("has_vml_sqrt", &mfsdp2::has_vml_sqrt, "Whether torch exports MKL's VML sqrt (torch's CPU sqrt).");
  m.def("has_vbmi", &mfsdp2::has_vbmi, "Whether lookup_bytes' AVX-512 VBMI path runs on this CPU.");
}
