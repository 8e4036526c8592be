// hyperparallel._C.profile: what hyperparallel.profile needs from C++ - one
// stage's measurement (hp/train/profile.h's, as `hp profile` measures), the
// cost model of measured stages, every schedule's predicted step at a target
// p and m (hp/train/profile.h, the same code as `hp profile`), the paper's
// Table 5 rows, and the CPU tracking allocator for activation memory.
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

#include "bindings.h"
#include "hp/core/memory.h"
#include "hp/train/profile.h"

namespace hp::python {
namespace {

train::StageCosts costs_of(const py::dict& d) {
  train::StageCosts c;
  c.f = d["f"].cast<double>();
  c.i = d["i"].cast<double>();
  c.w = d["w"].cast<double>();
  c.b = d.contains("b") ? d["b"].cast<double>() : c.i + c.w;
  c.mem_b = d.contains("mem_b") && !d["mem_b"].is_none() ? d["mem_b"].cast<int64_t>() : -1;
  c.mem_w = d.contains("mem_w") && !d["mem_w"].is_none() ? d["mem_w"].cast<int64_t>() : -1;
  return c;
}

// `fn(x)` under the GIL, which must return a tensor.
torch::Tensor tensor_from(const py::object& fn, const torch::Tensor& x, const char* what) {
  py::gil_scoped_acquire gil;
  py::object o = fn(x);
  if (!THPVariable_Check(o.ptr()))
    throw py::type_error(std::string(what) + " must return a torch.Tensor, got " +
                         std::string(py::str(py::type::of(o))));
  return THPVariable_Unpack(o.ptr());
}

py::object bytes_or_none(int64_t bytes) {
  return bytes < 0 ? py::none() : py::object(py::int_(bytes));
}

}  // namespace

void bind_profile(py::module_& m) {
  auto sub = m.def_submodule("profile", "measured costs and predicted schedules (hp profile)");
  sub.def(
      "measure_stage",
      [](const py::object& forward, const torch::Tensor& input, bool input_needs_grad,
         const std::vector<torch::Tensor>& weights, const py::object& loss,
         const py::object& grad_output, int warmup, int repeats, const py::object& memory_allocated,
         bool measure_memory) {
        // The Python callables take the GIL back; the measurement runs
        // without it (the autograd engine's device threads may run Python).
        train::StageSample s;
        s.module.forward = [&forward](const torch::Tensor& x) {
          return tensor_from(forward, x, "the stage");
        };
        s.module.parameters = weights;
        s.input = input;
        s.input_needs_grad = input_needs_grad;
        if (!loss.is_none())
          s.loss = [&loss](const torch::Tensor& out) { return tensor_from(loss, out, "loss_fn"); };
        else
          s.grad_output = grad_output.cast<torch::Tensor>();
        train::MeasureOptions o;
        o.warmup = warmup;
        o.repeats = repeats;
        o.measure_memory = measure_memory;
        if (!memory_allocated.is_none())
          o.memory_allocated = [&memory_allocated]() {
            py::gil_scoped_acquire gil;
            return memory_allocated().cast<int64_t>();
          };
        train::StageCosts c;
        {
          py::gil_scoped_release release;
          c = train::measure_stage(s, o);
        }
        py::dict d;
        d["f"] = c.f, d["i"] = c.i, d["w"] = c.w, d["b"] = c.b;
        d["mem_b"] = bytes_or_none(c.mem_b), d["mem_w"] = bytes_or_none(c.mem_w);
        return d;
      },
      py::arg("forward"), py::arg("input"), py::arg("input_needs_grad"), py::arg("weights"),
      py::arg("loss"), py::arg("grad_output"), py::arg("warmup"), py::arg("repeats"),
      py::arg("memory_allocated"), py::arg("measure_memory"),
      "F, I, W and a fused B of a stage in seconds (medians) and its mem_b / mem_w in bytes "
      "(None: not measured): hp::train::measure_stage, as hp profile measures a stage.");
  sub.def(
      "stage_cost_model",
      [](const py::dict& first, const py::dict& middle, const py::dict& last, double comm, int p) {
        try {
          return train::stage_cost_model(costs_of(first), costs_of(middle), costs_of(last), comm,
                                         p);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("first"), py::arg("middle"), py::arg("last"), py::arg("comm"), py::arg("p"),
      "The CostModel of p stages measured as dicts {f, i, w, b, mem_b, mem_w} (seconds, bytes; "
      "mem None: not measured): stage 0 is `first`, stage p-1 `last`, the others `middle`.");
  sub.def(
      "predict",
      [](const schedule::CostModel& costs, int p, int microbatches,
         const std::vector<std::string>& names) {
        std::vector<train::SchedulePrediction> out;
        std::string error;
        {
          py::gil_scoped_release release;  // zb-auto's search may take a while
          try {
            out = train::predict_schedules(
                costs, p, microbatches,
                names.empty() ? train::default_prediction_schedules() : names);
          } catch (const std::invalid_argument& e) {
            error = e.what();
          }
        }
        if (!error.empty()) throw py::value_error(error);
        py::list rows;
        for (const auto& r : out) {
          py::dict d;
          d["schedule"] = r.schedule;
          d["ok"] = r.ok;
          d["error"] = r.error;
          d["num_stages"] = r.num_stages;
          d["step_seconds"] = r.step_seconds;
          d["bubble_rate"] = r.bubble_rate;
          d["peak_memory"] = r.peak_memory;
          rows.append(d);
        }
        return rows;
      },
      py::arg("costs"), py::arg("p"), py::arg("microbatches"),
      py::arg("schedules") = std::vector<std::string>{},
      "Each schedule's simulated step at p ranks and m microbatches under `costs` (per-stage "
      "vectors of p entries apply to schedules with one stage per rank); schedules that cannot "
      "be built there have ok False and the reason.");
  sub.def("default_schedules", &train::default_prediction_schedules,
          "The schedules predict() runs when given none.");
  sub.def(
      "paper_rows",
      [](int p, int microbatches) {
        py::list rows;
        for (const auto& r : train::paper_rows(p, microbatches)) {
          py::dict d;
          d["model"] = r.model;
          d["p"] = r.p;
          d["m"] = r.m;
          d["f"] = r.f;
          d["b"] = r.b;
          d["w"] = r.w;
          d["comm"] = r.comm;
          d["1f1b"] = r.r_1f1b;
          d["zb-h1"] = r.r_zbh1;
          d["zb-h2"] = r.r_zbh2;
          d["zb-1p"] = r.r_zb1p;
          d["zb-2p"] = r.r_zb2p;
          rows.append(d);
        }
        return rows;
      },
      py::arg("p"), py::arg("microbatches"),
      "The Zero Bubble paper's Table 5 rows at p and m: its profiled T_F, T_B (our I), T_W, "
      "T_comm and its bubble rates.");
  sub.def("install_memory_tracker", &install_memory_tracker,
          "Counts CPU tensor memory allocated from now on (process-wide, once).");
  sub.def("memory_allocated", &memory_allocated,
          "Bytes of CPU tensor storage allocated through the tracker now.");
  sub.def("memory_tracker_installed", &memory_tracker_installed);
  sub.def("peak_memory_allocated", &peak_memory_allocated,
          "Highest memory_allocated() since the last reset_peak_memory() (inside an op too).");
  sub.def("reset_peak_memory", &reset_peak_memory, "Sets the peak to the current value.");
}

}  // namespace hp::python
