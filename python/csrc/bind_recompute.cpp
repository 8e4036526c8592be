// hyperparallel._C.recompute: bindings of hp/recompute for the Python package:
// checkpoint of a Python block, recompute sessions and handle collectors as
// context managers, prefetch handles, clear and the counters.
#include <torch/csrc/Exceptions.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings.h"
#include "hp/recompute/checkpoint.h"
#include "hp/recompute/session.h"

namespace hp::python {
namespace {

using hp::recompute::BlockFn;
using hp::recompute::CheckpointOptions;
using hp::recompute::HandleCollector;
using hp::recompute::RecomputeCounters;
using hp::recompute::RecomputeHandle;
using hp::recompute::RecomputeSession;
using hp::recompute::SessionId;
using hp::recompute::SessionOptions;
using hp::recompute::SessionStats;
using hp::recompute::TensorList;

bool interpreter_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// NOTE [A Python block inside the engine]
// A checkpointed block's function is a Python callable that C++ keeps (in the
// block's backward node) and calls from the autograd engine, which runs with
// the GIL released (NOTE [The GIL around the engine]) on the thread that
// called the backward, or on a device thread. So the callable is called with
// the GIL taken, a Python exception it raises crosses the engine as torch's
// python_error (which the engine knows how to carry to the caller, where it
// is raised again as itself), and its last reference is dropped with the GIL
// taken, on whatever thread frees the graph.
std::shared_ptr<py::object> hold(py::object obj) {
  return std::shared_ptr<py::object>(new py::object(std::move(obj)), [](py::object* o) {
    if (interpreter_alive()) {
      py::gil_scoped_acquire gil;
      delete o;
    } else {
      o->release();  // the interpreter is gone: leak the reference rather than crash
      delete o;
    }
  });
}

BlockFn python_block(std::shared_ptr<py::object> fn) {
  return [fn = std::move(fn)](const TensorList& inputs) -> TensorList {
    py::gil_scoped_acquire gil;
    try {
      py::object out = (*fn)(inputs);
      return out.cast<TensorList>();
    } catch (py::error_already_set& e) {
      e.restore();
      python_error err;
      err.persist();
      throw err;
    } catch (py::cast_error&) {
      TORCH_CHECK_TYPE(false,
                       "a checkpointed block's function must return a list of tensors "
                       "(hyperparallel.recompute.checkpoint wraps yours so that it does)");
    }
    return {};  // unreachable
  };
}

// NOTE [Guards as context managers]
// RecomputeSession and HandleCollector are C++ guards that must close on the
// thread that opened them, innermost first (they assert so, which in a
// destructor would end the process). Python's `with` keeps that order; a
// hand-driven __enter__/__exit__ may not, so each kind keeps its own stack of
// open Python guards per thread and refuses (RuntimeError) to close one that
// is not the innermost of the calling thread. A guard garbage-collected while
// open is closed if it is innermost on the collecting thread, else
// deliberately leaked (its session stays current on its thread) rather than
// crash.
template <class Guard>
struct GuardStack {
  static std::vector<const void*>& open() {
    static thread_local std::vector<const void*> stack;
    return stack;
  }
  static bool is_innermost(const void* g) { return !open().empty() && open().back() == g; }
  static void push(const void* g) { open().push_back(g); }
  static void pop() { open().pop_back(); }
};

struct PySession {
  SessionId id;
  SessionOptions options;
  std::unique_ptr<RecomputeSession> guard;

  PySession(SessionId id, bool retain_on_unpack)
      : id(id), options(SessionOptions().retain_on_unpack(retain_on_unpack)) {}
  ~PySession() {
    if (!guard) return;
    if (GuardStack<PySession>::is_innermost(this)) {
      GuardStack<PySession>::pop();
      guard.reset();
    } else {
      (void)guard.release();  // see NOTE [Guards as context managers]
    }
  }
  PySession* enter() {
    TORCH_CHECK(!guard, "recompute session ", id,
                ": this RecomputeSession is already open; open a new one for a nested scope");
    guard = std::make_unique<RecomputeSession>(id, options);
    GuardStack<PySession>::push(this);
    return this;
  }
  void exit() {
    TORCH_CHECK(guard, "recompute session ", id, ": __exit__ without __enter__");
    TORCH_CHECK(GuardStack<PySession>::is_innermost(this), "recompute session ", id,
                ": sessions must close on the thread that opened them, innermost first "
                "(use `with`)");
    GuardStack<PySession>::pop();
    guard.reset();
  }
};

struct PyCollector {
  std::unique_ptr<HandleCollector> guard;
  std::vector<RecomputeHandle> taken;

  ~PyCollector() {
    if (!guard) return;
    if (GuardStack<PyCollector>::is_innermost(this)) {
      GuardStack<PyCollector>::pop();
      guard.reset();
    } else {
      (void)guard.release();  // see NOTE [Guards as context managers]
    }
  }
  PyCollector* enter() {
    TORCH_CHECK(!guard, "this HandleCollector is already open; open a new one to nest");
    guard = std::make_unique<HandleCollector>();
    GuardStack<PyCollector>::push(this);
    return this;
  }
  void exit() {
    TORCH_CHECK(guard, "HandleCollector: __exit__ without __enter__");
    TORCH_CHECK(GuardStack<PyCollector>::is_innermost(this),
                "HandleCollectors must close on the thread that opened them, innermost first "
                "(use `with`)");
    auto rest = guard->take();
    taken.insert(taken.end(), rest.begin(), rest.end());
    GuardStack<PyCollector>::pop();
    guard.reset();
  }
  std::vector<RecomputeHandle> handles() const {
    auto all = taken;
    if (guard) all.insert(all.end(), guard->handles().begin(), guard->handles().end());
    return all;
  }
  std::vector<RecomputeHandle> take() {
    auto all = std::move(taken);
    taken.clear();
    if (guard) {
      auto rest = guard->take();
      all.insert(all.end(), rest.begin(), rest.end());
    }
    return all;
  }
};

std::string repr(const RecomputeCounters& c) {
  return "RecomputeCounters(recomputes=" + std::to_string(c.recomputes) +
         ", prefetches=" + std::to_string(c.prefetches) +
         ", consumed=" + std::to_string(c.consumed) + ", reused=" + std::to_string(c.reused) +
         ", cleared=" + std::to_string(c.cleared) + ")";
}

}  // namespace

void bind_recompute(py::module_& m) {
  auto sub = m.def_submodule(
      "recompute", "Checkpoints recomputed once for dx and dw (use hyperparallel.recompute)");

  py::class_<RecomputeCounters>(sub, "RecomputeCounters", "How much recompute work ran.")
      .def_readonly("recomputes", &RecomputeCounters::recomputes,
                    "re-runs of a block's function for backward (prefetches included)")
      .def_readonly("prefetches", &RecomputeCounters::prefetches,
                    "recomputes started by RecomputeHandle.recompute / prefetch")
      .def_readonly("consumed", &RecomputeCounters::consumed,
                    "backward requests (dx, dw or fused) served by a recomputed block")
      .def_readonly("reused", &RecomputeCounters::reused,
                    "requests served from a prefetched or retained recompute")
      .def_readonly("cleared", &RecomputeCounters::cleared,
                    "recomputed blocks dropped before their last consumer ran")
      .def("as_dict",
           [](const RecomputeCounters& c) {
             py::dict d;
             d["recomputes"] = c.recomputes;
             d["prefetches"] = c.prefetches;
             d["consumed"] = c.consumed;
             d["reused"] = c.reused;
             d["cleared"] = c.cleared;
             return d;
           })
      .def("__repr__", &repr);

  py::class_<SessionStats>(sub, "SessionStats", "What a recompute session holds right now.")
      .def_readonly("exists", &SessionStats::exists, "opened and not cleared since")
      .def_readonly("cached_blocks", &SessionStats::cached_blocks,
                    "recomputed blocks waiting for a consumer")
      .def_readonly("counters", &SessionStats::counters, "counters since the session opened")
      .def("__repr__", [](const SessionStats& s) {
        return std::string("SessionStats(exists=") + (s.exists ? "True" : "False") +
               ", cached_blocks=" + std::to_string(s.cached_blocks) +
               ", counters=" + repr(s.counters) + ")";
      });

  py::class_<PySession>(sub, "RecomputeSession",
                        "Context manager: makes recompute session `id` current on this thread.")
      .def(py::init<SessionId, bool>(), py::arg("id"), py::arg("retain_on_unpack") = false)
      .def_readonly("id", &PySession::id)
      .def_property_readonly("retain_on_unpack",
                             [](const PySession& s) { return s.options.retain_on_unpack(); })
      .def(
          "__enter__",
          [](PySession& s) {
            HANDLE_TH_ERRORS
            return s.enter();
            END_HANDLE_TH_ERRORS_PYBIND
          },
          py::return_value_policy::reference)
      .def("__exit__", [](PySession& s, const py::args&) {
        HANDLE_TH_ERRORS
        s.exit();
        return false;
        END_HANDLE_TH_ERRORS_PYBIND
      });

  py::class_<RecomputeHandle>(sub, "RecomputeHandle", "One checkpointed block, for a scheduler.")
      .def(
          "recompute",
          [](const RecomputeHandle& h) {
            HANDLE_TH_ERRORS
            py::gil_scoped_release no_gil;
            h.recompute();
            END_HANDLE_TH_ERRORS_PYBIND
          },
          "Recompute the block now (prefetch) unless a recompute already waits.")
      .def("is_recomputed", &RecomputeHandle::is_recomputed)
      .def("release", &RecomputeHandle::release, "Drop a result prefetched outside any session.")
      .def("alive", &RecomputeHandle::alive, "False once the block's graph is gone.")
      .def_property_readonly("block_id", &RecomputeHandle::block_id)
      .def("__repr__", [](const RecomputeHandle& h) {
        return "RecomputeHandle(block_id=" + std::to_string(h.block_id()) +
               ", alive=" + (h.alive() ? "True" : "False") + ")";
      });

  py::class_<PyCollector>(sub, "HandleCollector",
                          "Context manager: gathers one handle per checkpoint made inside it.")
      .def(py::init<>())
      .def(
          "__enter__",
          [](PyCollector& c) {
            HANDLE_TH_ERRORS
            return c.enter();
            END_HANDLE_TH_ERRORS_PYBIND
          },
          py::return_value_policy::reference)
      .def("__exit__",
           [](PyCollector& c, const py::args&) {
             HANDLE_TH_ERRORS
             c.exit();
             return false;
             END_HANDLE_TH_ERRORS_PYBIND
           })
      .def_property_readonly("handles", &PyCollector::handles,
                             "The handles gathered so far, in creation order.")
      .def("take", &PyCollector::take, "Move the gathered handles out.");

  sub.def(
      "checkpoint",
      [](py::object fn, const TensorList& inputs, const TensorList& weights,
         bool preserve_rng_state, bool check_versions) {
        HANDLE_TH_ERRORS
        TORCH_CHECK_TYPE(PyCallable_Check(fn.ptr()), "checkpoint: fn must be callable, not ",
                         Py_TYPE(fn.ptr())->tp_name);
        auto options = CheckpointOptions()
                           .preserve_rng_state(preserve_rng_state)
                           .check_versions(check_versions);
        return hp::recompute::checkpoint(python_block(hold(std::move(fn))), inputs, weights,
                                         options);
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("fn"), py::arg("inputs"), py::arg("weights") = TensorList{},
      py::arg("preserve_rng_state") = true, py::arg("check_versions") = true,
      "fn(list of tensors) -> list of tensors, checkpointed; weights: the tensors fn uses "
      "besides its inputs.");

  sub.def(
      "prefetch",
      [](const std::vector<RecomputeHandle>& handles) {
        HANDLE_TH_ERRORS
        py::gil_scoped_release no_gil;
        hp::recompute::prefetch(handles);
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("handles"));
  sub.def("clear_session", &hp::recompute::clear_session, py::arg("id"),
          "Drop what session `id` holds; returns the blocks dropped unconsumed.");
  sub.def("clear_all_sessions", &hp::recompute::clear_all_sessions);
  sub.def("session_stats", &hp::recompute::session_stats, py::arg("id"));
  sub.def("num_sessions", &hp::recompute::num_sessions);
  sub.def("counters", &hp::recompute::counters, "Process-wide counters.");
  sub.def("reset_counters", &hp::recompute::reset_counters);
}

}  // namespace hp::python
