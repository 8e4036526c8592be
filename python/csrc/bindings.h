// The bind_*.cpp files of hyperparallel._C: one function per part of the API,
// each registering its classes and functions in a submodule of _C.
#pragma once

#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace hp::distributed {
struct LinkModel;
}

namespace hp::python {

namespace py = pybind11;

/// The dx/dw split: _C.autograd (bind_autograd.cpp).
void bind_autograd(py::module_& m);
/// Recompute sessions and checkpoints: _C.recompute (bind_recompute.cpp).
void bind_recompute(py::module_& m);
/// Schedules as data: _C.schedule (bind_schedule.cpp).
void bind_schedule(py::module_& m);
/// The pipeline runtime over a torch.distributed group: _C.pipeline (bind_pipeline.cpp).
void bind_pipeline(py::module_& m);
/// Expert parallelism's dispatch and combine: _C.moe (bind_moe.cpp).
void bind_moe(py::module_& m);
/// Output files written as hp writes them: _C.text (bind_text.cpp).
void bind_text(py::module_& m);
/// Measured costs and predicted schedules: _C.profile (bind_profile.cpp).
void bind_profile(py::module_& m);
#ifdef HP_BIND_COMPILE
/// The pass plan's YAML reader: _C.compile (bind_compile.cpp).
void bind_compile(py::module_& m);
#endif

/// The c10d group behind a torch.distributed ProcessGroup (shared, not
/// copied); TypeError for anything else (bind_pipeline.cpp).
c10::intrusive_ptr<c10d::ProcessGroup> process_group_of(const py::object& group);

/// The c10d store behind a torch.distributed Store; null for None;
/// TypeError for anything else (bind_pipeline.cpp).
c10::intrusive_ptr<c10d::Store> store_of(const py::object& store);

/// The store through which the ranks of an expert-parallel (or data-
/// parallel) group tell each other of a failed step: `store` (a
/// torch.distributed Store, or None for none) under a prefix of the group's
/// name, the same for a Pipeline's dp_group and a TokenDispatcher's group
/// (NOTE [A failure reaches the expert-parallel peers] in bind_moe.cpp).
c10::intrusive_ptr<c10d::Store> group_failure_store(const py::object& store,
                                                    const c10d::ProcessGroup& group);

/// `store` (a torch.distributed Store, or None for none) under a prefix of
/// `kind`, the group's name and how many stores of that kind this process
/// made over the group before (NOTE [The failure store of a Pipeline] in
/// bind_pipeline.cpp).
c10::intrusive_ptr<c10d::Store> instance_store(const py::object& store,
                                               const c10d::ProcessGroup& group,
                                               const std::string& kind);

/// The link model the environment variable HP_LINK ("LATENCY_US,GBPS")
/// asks for, inactive when it is unset or empty; ValueError naming HP_LINK
/// when it is malformed (NOTE [The link model] in
/// hp/distributed/link_model.cpp; bind_moe.cpp).
distributed::LinkModel link_from_environment();

/// Registers every part in `m`.
inline void bind_all(py::module_& m) {
  bind_autograd(m);
  bind_recompute(m);
  bind_schedule(m);
  bind_pipeline(m);
  bind_moe(m);
  bind_text(m);
  bind_profile(m);
#ifdef HP_BIND_COMPILE
  bind_compile(m);
#endif
}

}  // namespace hp::python
