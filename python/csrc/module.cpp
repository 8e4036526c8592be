// hyperparallel._C: the module's entry point. Each part of the API registers
// its bindings from its own file (bind_*.cpp); this file only calls them.
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"
#include "hp/core/compat.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "hyperparallel's C++ core (pipeline parallelism at close to zero bubble)";
  m.def(
      "torch_version", [] { return std::string(hp::torch_version()); },
      "The LibTorch version this extension was built against.");
  hp::python::bind_all(m);
}
