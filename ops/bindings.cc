// pybind11 fast path: the same C++ entry points as the registered ops, bound
// directly. A call through Paddle's generated custom-op API costs tens of
// microseconds of dispatch; through this binding about one.
//
// The module name must match the op library's name (setup_ops.py): Paddle's
// generated loader imports the library as a Python extension module of that
// name, which is what exposes these functions.
#include "paddle/utils/pybind.h"
#include "paddle_step_ops.h"

PYBIND11_MODULE(paddle_step_ops, module) {
  module.doc() = "paddle_step kernels: pybind11 fast path";
  module.def("advance_step", &paddle_step::AdvanceStep,
             pybind11::arg("input_tokens"), pybind11::arg("sampled_token_ids"),
             pybind11::arg("input_positions"), pybind11::arg("seq_lens"),
             pybind11::arg("slot_mapping"), pybind11::arg("block_tables"),
             pybind11::arg("active"), pybind11::arg("num_seqs"),
             pybind11::arg("num_queries"), pybind11::arg("block_size"));
  module.def("step_paddle", &paddle_step::StepPaddle);
}
