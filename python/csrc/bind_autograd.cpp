// hyperparallel._C.autograd: bindings of hp/autograd for the Python package:
// GradFunction built from an already-run forward (the forward runs in Python,
// see hyperparallel/split.py), its dx, dw and fused backward, and its stats.
#include <torch/csrc/Exceptions.h>

#include <chrono>
#include <ctime>
#include <vector>

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
          "weight_grad_into_grad",
          [](GradFunction& self, bool keep_graph) {
            HANDLE_TH_ERRORS
            py::gil_scoped_release no_gil;
            self.weight_grad_into_grad(keep_graph);
            END_HANDLE_TH_ERRORS_PYBIND
          },
          py::arg("keep_graph") = false,
          "dw only into each weight's .grad, through the engine's own accumulation (the "
          "pipeline's W); returns nothing.")
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
          "separate_dw_calls", [](GradFunction& self, bool on) { self.separate_dw_calls(on); },
          py::arg("on"), "Run dw as one engine call per weight group (identical results).")
      .def_property_readonly("num_inputs", &GradFunction::num_inputs)
      .def_property_readonly("num_weights", &GradFunction::num_weights)
      .def_property_readonly("stats", &GradFunction::stats);

  // For bench/python/bench_split.py: the split of an already-run forward driven
  // from C++ as bench/bench_split.cpp drives it (GradFunction built untimed,
  // then dx and dw, or the fused backward, timed), so that the same process can
  // alternate it with the split driven through the Python API on identical
  // graphs. Returns wall-clock seconds, then this thread's CPU seconds (with
  // one intra-op thread on the CPU the engine runs all the work on this
  // thread; CPU time does not count the time other processes hold the core).
  sub.def(
      "_time_split_from_cpp",
      [](TensorList outputs, TensorList inputs, TensorList weights, bool fused) {
        HANDLE_TH_ERRORS
        using Clock = std::chrono::steady_clock;
        auto wall = [] {
          return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
        };
        auto cpu = [] {
          timespec ts{};
          clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
          return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
        };
        std::vector<double> times;
        {
          py::gil_scoped_release no_gil;
          GradFunction gf(std::move(outputs), std::move(inputs), std::move(weights));
          double w0 = wall(), c0 = cpu();
          if (fused) {
            gf();
            double w1 = wall(), c1 = cpu();
            times = {w1 - w0, c1 - c0};
          } else {
            gf.compute_input_grad();
            double w1 = wall(), c1 = cpu();
            gf.compute_weight_grad();
            double w2 = wall(), c2 = cpu();
            times = {w1 - w0, w2 - w1, c1 - c0, c2 - c1};
          }
        }
        return times;
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("outputs"), py::arg("inputs"), py::arg("weights"), py::arg("fused"),
      "Benchmark helper: [wall, cpu] seconds of the fused backward, or [dx wall, dw wall, dx "
      "cpu, dw cpu] of the split, of a GradFunction driven from C++.");
}

}  // namespace hp::python
