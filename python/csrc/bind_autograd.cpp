// hyperparallel._C.autograd: bindings of hp/autograd for the Python package:
// GradFunction built from an already-run forward (the forward runs in Python,
// see hyperparallel/split.py), its dx, dw and fused backward, and its stats.
#include <torch/csrc/Exceptions.h>

#include "bindings.h"
#include "hp/autograd/grad_function.h"

namespace hp::python {

using hp::autograd::GradFunction;
using hp::autograd::Grads;
using hp::autograd::SplitStats;
using hp::autograd::TensorList;

// NOTE [The GIL around the engine]
// Every call that runs LibTorch's autograd engine releases the GIL first:
// the engine runs Python nodes (a torch.autograd.Function written in Python,
// tensor hooks) by taking the GIL itself, on the calling thread (CPU) or on a
// device thread (CUDA), and torch's Python engine refuses to start while the
// calling thread holds it. HANDLE_TH_ERRORS around the release turns C++
// errors into Python ones (c10::ValueError -> ValueError, a Python exception
// raised inside a node -> that exception) after the GIL is back.

void bind_autograd(py::module_& m) {
  auto sub = m.def_submodule(
      "autograd", "The dx/dw split of hp/autograd (use hyperparallel.forward_and_gradfn)");

  py::class_<SplitStats>(sub, "SplitStats",
                         "What the split's graph analysis found (filled by compute_input_grad).")
      .def_readonly("num_nodes", &SplitStats::num_nodes,
                    "backward nodes reachable from the outputs")
      .def_readonly("num_dx_nodes", &SplitStats::num_dx_nodes,
                    "nodes that lead to an input (run by dx)")
      .def_readonly("num_join_nodes", &SplitStats::num_join_nodes,
                    "dx nodes where a weight's branch joins")
      .def_readonly("num_groups", &SplitStats::num_groups, "weight groups")
      .def("__repr__", [](const SplitStats& s) {
        return "SplitStats(num_nodes=" + std::to_string(s.num_nodes) +
               ", num_dx_nodes=" + std::to_string(s.num_dx_nodes) +
               ", num_join_nodes=" + std::to_string(s.num_join_nodes) +
               ", num_groups=" + std::to_string(s.num_groups) + ")";
      });

  py::class_<GradFunction>(sub, "GradFunction",
                           "The backward of an already-run forward, split into dx "
                           "(compute_input_grad) and dw (compute_weight_grad).")
      .def(py::init([](TensorList outputs, TensorList inputs, TensorList weights) {
             HANDLE_TH_ERRORS
             return GradFunction(std::move(outputs), std::move(inputs), std::move(weights));
             END_HANDLE_TH_ERRORS_PYBIND
           }),
           py::arg("outputs"), py::arg("inputs"), py::arg("weights"),
           "Differentiates `outputs` with respect to `inputs` (dx) and `weights` (dw); each "
           "must require grad.")
      .def(
          "compute_input_grad",
          [](GradFunction& self, const TensorList& sens) {
            HANDLE_TH_ERRORS
            TensorList dx;
            {
              py::gil_scoped_release no_gil;
              dx = self.compute_input_grad(sens);
            }
            return dx;
            END_HANDLE_TH_ERRORS_PYBIND
          },
          py::arg("sens") = TensorList{},
          "dx, one per input; `sens` one gradient per output (empty: ones).")
      .def(
          "compute_weight_grad",
          [](GradFunction& self, bool keep_graph) {
            HANDLE_TH_ERRORS
            TensorList dw;
            {
              py::gil_scoped_release no_gil;
              dw = self.compute_weight_grad(keep_graph);
            }
            return dw;
            END_HANDLE_TH_ERRORS_PYBIND
          },
          py::arg("keep_graph") = false,
          "dw, one per weight, also accumulated into each weight's .grad.")
      .def(
          "__call__",
          [](GradFunction& self, const TensorList& sens, bool keep_graph) {
            HANDLE_TH_ERRORS
            Grads g;
            {
              py::gil_scoped_release no_gil;
              g = self(sens, keep_graph);
            }
            return py::make_tuple(g.input_grads, g.weight_grads);
            END_HANDLE_TH_ERRORS_PYBIND
          },
          py::arg("sens") = TensorList{}, py::arg("keep_graph") = false,
          "(dx, dw) of one fused backward; dw is accumulated into .grad too.")
      .def(
          "separate_dw_calls",
          [](GradFunction& self, bool on) { self.separate_dw_calls(on); }, py::arg("on"),
          "Run dw as one engine call per weight group (identical results).")
      .def_property_readonly("num_inputs", &GradFunction::num_inputs)
      .def_property_readonly("num_weights", &GradFunction::num_weights)
      .def_property_readonly("stats", &GradFunction::stats);
}

}  // namespace hp::python
