// make_gloo_group where LibTorch ships no Gloo headers (PyTorch from pip):
// the Gloo backend is made by torch.distributed's Python binding, in the
// interpreter that hosts us or in one embedded on first use (NOTE [Making a
// Gloo group]).
#include <Python.h>
#include <pybind11/chrono.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <signal.h>

#include <array>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>

#include "hp/distributed/comm_internal.h"

namespace py = pybind11;

namespace hp::distributed::detail {
namespace {

// NOTE [Making a Gloo group]
// c10d's ProcessGroupGloo.hpp includes Gloo's own headers, which Debian's
// LibTorch packages ship and PyTorch's pip wheels do not; the wheel has Gloo
// compiled in, reachable from C++ only through a class we cannot name without
// those headers. So one file makes Gloo groups, chosen when the project is
// configured (hp/distributed/CMakeLists.txt):
// * gloo_group_native.cpp: ProcessGroupGloo constructed directly (Debian);
// * gloo_group_python.cpp (this file): torch.distributed's Python binding
//   constructs it. Inside `import hyperparallel` Python is already running;
//   in the `hp` tool and the C++ tests an interpreter is started on first use
//   with the virtual environment's Python (HP_PYTHON_EXECUTABLE) and the
//   site-packages of the very torch we linked (HP_TORCH_SITE) first on
//   sys.path, so the backend comes from the same libraries. It costs one
//   `import torch` (about a second) per process, once.
// Everything after construction is C++ over c10d::ProcessGroup: the backend
// object is shared with C++ (intrusive refcount) and Python keeps no
// reference. Python's signal handlers are not installed, so Ctrl-C and
// SIGTERM keep their C++ behaviour (NOTE [The embedded interpreter keeps our
// signals]).
std::once_flag g_init;

// NOTE [The embedded interpreter keeps our signals]
// install_signal_handlers = 0 keeps Python's own start-up from taking
// SIGINT, but `import torch.distributed` still did (a module imported on the
// way installs Python's default_int_handler): an `hp train` worker then
// caught Ctrl-C into a flag that no Python code ever reads, and trained on.
// The dispositions of the signals a user sends to end a rank are saved
// before the interpreter starts and put back once torch is imported.
class KeepSignalDispositions {
 public:
  KeepSignalDispositions() {
    for (size_t i = 0; i < kSignals.size(); ++i)
      sigaction(kSignals[i], nullptr, &saved_[i]);
  }
  ~KeepSignalDispositions() {
    for (size_t i = 0; i < kSignals.size(); ++i)
      sigaction(kSignals[i], &saved_[i], nullptr);
  }
  KeepSignalDispositions(const KeepSignalDispositions&) = delete;
  KeepSignalDispositions& operator=(const KeepSignalDispositions&) = delete;

 private:
  static constexpr std::array<int, 5> kSignals{SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE};
  std::array<struct sigaction, 5> saved_{};
};

void start_interpreter() {
  std::optional<KeepSignalDispositions> keep(std::in_place);
  PyConfig config;
  PyConfig_InitPythonConfig(&config);
  config.install_signal_handlers = 0;
  config.parse_argv = 0;
  PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, HP_PYTHON_EXECUTABLE);
  if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
  PyConfig_Clear(&config);
  if (PyStatus_Exception(status))
    throw std::runtime_error(
        std::string("could not start Python (") + HP_PYTHON_EXECUTABLE +
        ") to make a Gloo group: " + (status.err_msg ? status.err_msg : "unknown error"));
  // Still holding the GIL from the initialization: put our torch first and
  // import it now, once. (Threads that imported torch concurrently on first
  // use deadlocked inside torch's own import: one waited for the GIL that
  // pybind11 took for it under a second thread state, the others for the
  // import lock.)
  std::string error;
  bool interrupted = false;
  try {
    py::module_::import("sys").attr("path").attr("insert")(0, HP_TORCH_SITE);
    py::module_::import("torch.distributed");
  } catch (py::error_already_set& e) {
    error = e.what();
    interrupted = e.matches(PyExc_KeyboardInterrupt);
  }
  PyEval_SaveThread();  // release the GIL; every use takes it again
  keep.reset();         // our dispositions are back
  // Ctrl-C during the import reached the handler that a module on the way
  // installed (NOTE [The embedded interpreter keeps our signals]): it ends
  // the rank as Ctrl-C at any other time does, not as a failed rendezvous.
  if (interrupted) {
    ::raise(SIGINT);
    throw std::runtime_error("interrupted (SIGINT) while Python imported torch.distributed");
  }
  if (!error.empty())
    throw std::runtime_error("Python (" + std::string(HP_PYTHON_EXECUTABLE) +
                             ") could not import torch.distributed from " + HP_TORCH_SITE + ": " +
                             error);
}

// Holds the GIL for a scope, through the interpreter's own API (the thread
// may have no Python thread state yet).
class GilHolder {
 public:
  GilHolder() : state_(PyGILState_Ensure()) {}
  ~GilHolder() { PyGILState_Release(state_); }
  GilHolder(const GilHolder&) = delete;
  GilHolder& operator=(const GilHolder&) = delete;

 private:
  PyGILState_STATE state_;
};

// NOTE [Every thread through the once-flag]
// Py_IsInitialized() turns true half-way through start_interpreter, before
// its `import torch` has finished. A rank thread that checked it first and
// skipped the once-flag took the GIL at the import's next switch and ran
// torch.distributed while the first thread was still importing it, the
// concurrent import that deadlocked above. (The likely cause of a rare
// "rendezvous of 4 ranks did not complete ... Wait timeout" of tests that
// run ranks as threads beside other test processes; not proven, as it did
// not recur often enough to catch in a debugger.) So every thread waits on
// the once-flag, which is free when Python hosts us (import hyperparallel).
void ensure_python() {
  std::call_once(g_init, [] {
    if (!Py_IsInitialized()) start_interpreter();
  });
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                       int rank, int world_size,
                                                       const GlooEndpoint& endpoint,
                                                       std::chrono::milliseconds timeout) {
  ensure_python();
  c10::intrusive_ptr<c10d::Backend> backend;
  {
    GilHolder gil;
    try {
      py::module_::import("torch.distributed");  // imported already: a dictionary lookup
      py::object gloo = py::module_::import("torch._C._distributed_c10d").attr("ProcessGroupGloo");
      py::object options = gloo.attr("_Options")();
      py::object device =
          endpoint.interface_name.empty()
              ? gloo.attr("create_device")(py::arg("hostname") = endpoint.address)
              : gloo.attr("create_device")(py::arg("interface") = endpoint.interface_name);
      py::list devices;
      devices.append(device);
      options.attr("_devices") = devices;
      options.attr("_timeout") = py::cast(timeout);
      // The binding releases the GIL while the members connect.
      py::object made = gloo(py::cast(store), rank, world_size, options);
      backend = c10::intrusive_ptr<c10d::Backend>::reclaim_copy(made.cast<c10d::Backend*>());
    } catch (py::error_already_set& e) {
      throw std::runtime_error(std::string("torch.distributed could not make the Gloo group: ") +
                               e.what());
    }
  }
  return wrap_gloo_backend(store, rank, world_size, std::move(backend));
}

}  // namespace hp::distributed::detail
