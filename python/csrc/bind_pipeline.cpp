// hyperparallel._C.pipeline: the C++ executor running a user's Python stages
// (any callables, nn.Modules included) with any schedule, over the
// torch.distributed ProcessGroup the user made (Gloo on CPU, NCCL on GPU).
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "hp/core/memory.h"
#include "hp/distributed/comm.h"
#include "hp/distributed/mesh.h"
#include "hp/pipeline/pipeline.h"
#include "hp/schedule/schedule.h"

namespace hp::python {

c10::intrusive_ptr<c10d::ProcessGroup> process_group_of(const py::object& group) {
  c10d::ProcessGroup* pg = nullptr;
  try {
    pg = group.cast<c10d::ProcessGroup*>();
  } catch (const py::cast_error&) {
    throw py::type_error(
        "group must be a torch.distributed.ProcessGroup (e.g. "
        "torch.distributed.group.WORLD after init_process_group), got " +
        std::string(py::str(py::type::of(group))));
  }
  if (pg == nullptr) throw py::value_error("group is None");
  return c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(pg);
}

c10::intrusive_ptr<c10d::Store> store_of(const py::object& store) {
  if (store.is_none()) return {};
  c10d::Store* s = nullptr;
  try {
    s = store.cast<c10d::Store*>();
  } catch (const py::cast_error&) {
    throw py::type_error("failure_store must be a torch.distributed.Store or None, got " +
                         std::string(py::str(py::type::of(store))));
  }
  if (s == nullptr) return {};
  return c10::intrusive_ptr<c10d::Store>::reclaim_copy(s);
}

// NOTE [The failure store of a Pipeline]
// Over the group's own point-to-point, a rank whose step failed while its
// process lives on tells its peers through a store (NOTE [A failed step
// reaches the peers] in hp/distributed/comm.h). Python passes the store of
// the group (torch.distributed's, shared by the group's ranks) or None; the
// Pipeline's keys go under a prefix of their own: the group's name and how
// many Pipelines this process made over that group before (the same count on
// every rank, since making a Pipeline is collective), so two Pipelines over
// one group never see each other's failures. (A failure is final for a
// Pipeline: one key per failed rank is all it needs.) The PeerMonitors that
// watch a group's peers for being stopped (NOTE [A stopped peer] in
// hp/distributed/comm_internal.h) publish their addresses the same way, one
// prefix per monitor: the Pipeline's over its group, its data-parallel
// Comm's ("dp"), and the one the dispatchers of an expert_parallel call
// share ("ep", bind_moe.cpp): made in the same order on every rank.
c10::intrusive_ptr<c10d::Store> instance_store(const py::object& store,
                                               const c10d::ProcessGroup& group,
                                               const std::string& kind) {
  auto s = store_of(store);
  if (!s) return {};
  static std::mutex mu;
  static std::map<std::string, int> made;
  const std::string name = kind + "/" + group.getGroupName();
  int n;
  {
    std::lock_guard<std::mutex> lock(mu);
    n = made[name]++;
  }
  return c10::make_intrusive<c10d::PrefixStore>("hyperparallel/" + name + "/" + std::to_string(n),
                                                s);
}

namespace {

// NOTE [Python stages on the C++ executor]
// The executor walks the rank's action list with the GIL released: the
// engine's dx/dw calls, every wait and every send run without it. Only the
// user's Python - a stage's forward, the loss - takes the GIL, for as long as
// the F runs (NOTE [One GIL hold per forward]); a Python exception there
// becomes a RuntimeError naming the rank, action and the exception, raised
// from step(). The stages' parameters are the Python tensors themselves:
// weight gradients accumulate into their .grad, as loss.backward() would, and
// the user's optimizer steps them.

// A KeyboardInterrupt raised inside a stage's forward or the loss (Ctrl-C
// while the user's Python runs): kept here, and step() raises it as itself
// once the executor has unwound, as it does for one raised during a wait
// (NOTE [Signals during a wait] in hp/distributed/comm.h). Made and dropped
// with the GIL held.
std::mutex g_interrupt_mu;
std::shared_ptr<py::error_already_set> g_interrupt;

std::shared_ptr<py::error_already_set> take_interrupt() {
  std::lock_guard<std::mutex> lock(g_interrupt_mu);
  return std::exchange(g_interrupt, nullptr);
}

// Calls `fn(args...)`; the caller holds the GIL. A Python exception becomes
// a C++ one carrying its type and message (formatted while the GIL is held).
template <typename... Args>
py::object call_held(const py::object& fn, const char* what, Args&&... args) {
  try {
    return fn(std::forward<Args>(args)...);
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_KeyboardInterrupt)) {
      std::lock_guard<std::mutex> lock(g_interrupt_mu);
      if (!g_interrupt) g_interrupt = std::make_shared<py::error_already_set>(std::move(e));
      throw std::runtime_error(std::string(what) + " was interrupted (KeyboardInterrupt)");
    }
    throw std::runtime_error(std::string(what) + " raised " + e.what());
  }
}

// Calls `fn(args...)` under the GIL and returns the tensor it returned; a
// result that is no tensor is an error like an exception.
template <typename... Args>
torch::Tensor call_python(const py::object& fn, const char* what, Args&&... args) {
  py::gil_scoped_acquire gil;
  py::object o = call_held(fn, what, std::forward<Args>(args)...);
  if (!THPVariable_Check(o.ptr()))
    throw std::runtime_error(std::string(what) + " must return a torch.Tensor, got " +
                             std::string(py::str(py::type::of(o))));
  return THPVariable_Unpack(o.ptr());
}

// Calls `fn(args...)` under the GIL and returns the message (a list of
// tensors) it returned.
template <typename... Args>
pipeline::Message call_python_message(const py::object& fn, const char* what, Args&&... args) {
  py::gil_scoped_acquire gil;
  py::object o = call_held(fn, what, std::forward<Args>(args)...);
  if (!py::isinstance<py::list>(o) && !py::isinstance<py::tuple>(o))
    throw std::runtime_error(std::string(what) + " must return a list of tensors, got " +
                             std::string(py::str(py::type::of(o))));
  pipeline::Message m;
  for (py::handle h : o) {
    if (!THPVariable_Check(h.ptr()))
      throw std::runtime_error(std::string(what) + " must return a list of tensors, got a " +
                               std::string(py::str(py::type::of(h))) + " in it");
    m.push_back(THPVariable_Unpack(h.ptr()));
  }
  return m;
}

/// A Python object that C++ copies freely without the GIL (only the
/// shared_ptr's count changes) and that takes the GIL to be dropped: the
/// callables a Pipeline holds go with it where no GIL is held (NOTE [A
/// Pipeline's group dies with it]).
using Held = std::shared_ptr<py::object>;
Held held(py::object o) {
  return Held(new py::object(std::move(o)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

/// One rank's pipeline over the user's group: a thin caller of
/// hp::pipeline::Pipeline that turns Python callables into chunks and a
/// step's Python inputs into the executor's.
class Runtime {
 public:
  /// `options` holds the Pipeline's plain options (device, dtype, p2p, ...;
  /// PipelineOptions as bound below); the rest are what Python gives and C++
  /// turns into them: groups, stores and callables.
  Runtime(const schedule::Schedule& sched, const py::object& group,
          const std::map<int, py::object>& chunk_forward,
          const std::map<int, std::vector<torch::Tensor>>& chunk_parameters, py::object loss,
          py::object activation_shape, pipeline::PipelineOptions options, double timeout_s,
          const py::object& dp_group,
          const std::map<int, std::vector<torch::Tensor>>& chunk_dp_parameters,
          py::object extra_sum, const py::object& failure_store,
          const std::map<int, std::vector<torch::Tensor>>& chunk_expert_parameters,
          const py::object& dp_failure_store, const std::vector<py::object>& loss_groups,
          const std::map<int, std::vector<std::string>>& chunk_parameter_names,
          py::object before_step, py::object after_step, const py::object& expert_dp_group) {
    distributed::CommOptions comm_options;
    comm_options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    auto pg = process_group_of(group);
    pipeline::PipelineOptions po = std::move(options);
    // NOTE [The failure store of a Pipeline]
    po.failure_store = instance_store(failure_store, *pg, "pipeline");
    c10::intrusive_ptr<c10d::ProcessGroup> dp_pg;
    c10::intrusive_ptr<c10d::Store> dp_failures, dp_monitor;
    if (!dp_group.is_none()) {
      // NOTE [A failure reaches the expert-parallel peers] in bind_moe.cpp.
      dp_pg = process_group_of(dp_group);
      dp_failures = group_failure_store(dp_failure_store, *dp_pg);
      dp_monitor = instance_store(dp_failure_store, *dp_pg, "dp");
    }
    for (const auto& g : loss_groups)
      po.loss_groups.push_back(
          distributed::Comm::from_process_group(process_group_of(g), comm_options));
    po.link = link_from_environment();
    // NOTE [One GIL hold per forward]
    // A forward calls Python once (the stage) or twice (and the loss), and
    // each call took the GIL and gave it back, with the Python thread state's
    // swaps each time. The whole of F runs under one hold instead: the calls
    // inside take it again at the cost of a counter. Nothing in F waits for
    // another thread (its input was received before F began), so holding it
    // longer blocks no one that F needs.
    // The forward is told its stage and microbatch (for the step's keyword
    // arguments and structures between stages, NOTE [Keyword arguments of
    // every stage] in python/hyperparallel/pipeline/stage_forward.py and
    // NOTE [Pytrees between stages] in .../pipeline/transfers.py): F runs on
    // the executor's thread,
    // one at a time, so the hook sets them for the call inside.
    po.hooks.around_forward = [this](int stage, int mb,
                                     const std::function<pipeline::Message()>& run) {
      py::gil_scoped_acquire gil;
      forward_stage_ = stage, forward_mb_ = mb;
      return run();
    };
    po.input = [this](int mb) {
      if (mb >= int(inputs_.size()))
        throw std::runtime_error("step() was given " + std::to_string(inputs_.size()) +
                                 " microbatch inputs but the schedule has more microbatches");
      return inputs_[mb];
    };
    const bool messages = activation_shape.is_none();
    if (messages) {
      // NOTE [Pytrees between stages] in python/hyperparallel/pipeline/transfers.py:
      // messages that describe themselves, nothing declared.
    } else if (py::isinstance<py::tuple>(activation_shape)) {
      // One shape for every message: no call into Python per receive.
      po.activation_shape = [fixed = activation_shape.cast<std::vector<int64_t>>()](int, int) {
        return fixed;
      };
    } else {
      po.activation_shape = [shape_fn = held(activation_shape)](int stage, int mb) {
        py::gil_scoped_acquire gil;
        return call_held(*shape_fn, "activation_shape", stage, mb).cast<std::vector<int64_t>>();
      };
    }
    // The owner of some weights around each step (FSDP2's: NOTE [FSDP2
    // stages] in python/hyperparallel/pipeline/fsdp2.py).
    if (!before_step.is_none())
      po.before_step = [fn = held(before_step)]() {
        py::gil_scoped_acquire gil;
        call_held(*fn, "the step's before_step hook");
      };
    if (!after_step.is_none())
      po.after_step = [fn = held(after_step)](bool ok) {
        py::gil_scoped_acquire gil;
        call_held(*fn, "the step's after_step hook", ok);
      };
    if (!extra_sum.is_none())
      po.extra_sum = [fn = held(extra_sum)]() {
        py::gil_scoped_acquire gil;
        return call_held(*fn, "the auxiliary losses' sum").cast<double>();
      };
    std::map<int, pipeline::ChunkModule> chunks;
    for (const auto& [c, fn] : chunk_forward) {
      pipeline::ChunkModule mod;
      if (messages) {
        mod.forward_message = [f = held(fn), mb = &forward_mb_,
                               st = &forward_stage_](const pipeline::Message& x) {
          return call_python_message(*f, "a stage's forward", x, *mb, *st);
        };
      } else {
        mod.forward = [f = held(fn), mb = &forward_mb_,
                       st = &forward_stage_](const torch::Tensor& x) {
          return call_python(*f, "a stage's forward", x, *mb, *st);
        };
      }
      auto p = chunk_parameters.find(c);
      if (p != chunk_parameters.end()) mod.parameters = p->second;
      // A chunk listed in chunk_dp_parameters has only those averaged over
      // dp_group: the others (FSDP2's, NOTE [FSDP2 stages] in
      // python/hyperparallel/pipeline/fsdp2.py) are reduced by their owner.
      auto own = chunk_dp_parameters.find(c);
      if (own != chunk_dp_parameters.end()) mod.dp_parameters = own->second;
      // Expert parallelism's shards: NOTE [Expert gradients] in hp/pipeline/pipeline.cpp.
      auto experts = chunk_expert_parameters.find(c);
      if (experts != chunk_expert_parameters.end()) mod.expert_parameters = experts->second;
      // Parameters held under one name on several ranks are summed over them
      // (NOTE [Parameters shared by chunks] in python/hyperparallel/split_model.py).
      auto names = chunk_parameter_names.find(c);
      if (names != chunk_parameter_names.end()) mod.names = names->second;
      chunks.emplace(c, std::move(mod));
    }
    auto stage_loss = [loss_fn = held(loss)](const torch::Tensor& out, int mb) {
      torch::Tensor l = call_python(*loss_fn, "the loss function", out, mb);
      if (l.numel() != 1)
        throw std::runtime_error(
            "the loss function must return one number (a tensor of one "
            "element), got shape " +
            c10::str(l.sizes()));
      return l;  // counted 1/m times: the stage's loss_scale
    };
    // Making the rings and agreeing on the pipeline wait on every rank of the
    // group: without the GIL. Made with the GIL held, the agreement's
    // all-gather over the group that torch.distributed made timed out on
    // both ranks (p2p="group"), as waits on Gloo work under the GIL do here
    // (NOTE [A Pipeline's group dies with it]): every collective runs with
    // the GIL released.
    py::gil_scoped_release release;
    // With the group's store, its peers are watched for being stopped (NOTE
    // [A stopped peer] in hp/distributed/comm_internal.h): over the group's
    // own point-to-point a stopped peer fails the waits within seconds. The
    // monitor's rendezvous waits on every rank too, the data-parallel
    // Comm's (over dp_group) before the pipeline's on every rank.
    // NOTE [Expert gradients] in hp/pipeline/pipeline.cpp.
    if (!expert_dp_group.is_none())
      po.expert_dp =
          distributed::Comm::from_process_group(process_group_of(expert_dp_group), comm_options);
    if (dp_pg)
      po.dp = distributed::with_failure_store(
          distributed::Comm::from_process_group(dp_pg, comm_options, dp_monitor), dp_failures);
    auto borrowed = distributed::Comm::from_process_group(pg, comm_options, po.failure_store);
    pipe_ = std::make_unique<pipeline::Pipeline>(sched, borrowed, std::move(chunks),
                                                 std::move(stage_loss), std::move(po));
  }

  // NOTE [A Pipeline's group dies with it]
  // The Pipeline holds the user's ProcessGroup (and the groups made beside
  // it). When ours is its last reference, ~ProcessGroupGloo joins its worker
  // threads, and a worker still freeing a finished collective that holds a
  // Python tensor takes the GIL to do so: with the GIL held here (a Python
  // object's dealloc), that join would never return. So the Pipeline goes
  // without the GIL; the Python callables it holds (Held) take it back to
  // be dropped. And the Python
  // side keeps no reference cycle through this object (the loss it is given
  // does not hold the Pipeline), so a dropped Pipeline lets its groups go at
  // once instead of at the interpreter's shutdown. (That alone does not end
  // the abort at exit of NOTE [Gloo work freed during shutdown] in
  // bench/peers/common.py: a Gloo worker of a group that Python still holds
  // can free a finished collective's Python tensor after the main thread
  // began the shutdown.)
  ~Runtime() {
    py::gil_scoped_release release;
    pipe_.reset();
  }
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  /// A Python function run for each FB pair, fn(pair) with pair a PairCall
  /// (NOTE [A pair function] in hp/pipeline/overlap.cpp); None: the
  /// built-in order.
  void set_pair_function(py::object fn) {
    std::function<void(pipeline::PairCall&)> f;
    if (!fn.is_none()) {
      Held h = held(std::move(fn));
      f = [h](pipeline::PairCall& call) {
        py::gil_scoped_acquire gil;
        call_held(*h, "the pair function", py::cast(&call, py::return_value_policy::reference));
      };
    }
    py::gil_scoped_release release;
    pipe_->set_pair_function(std::move(f));
  }

  /// One step: every action of this rank once. Returns the mean loss over
  /// the microbatches (the same on every rank) and this rank's timings.
  py::dict step(std::vector<torch::Tensor> inputs) {
    pipeline::PipelineStep out;
    // A Python exception raised by a signal handler during a wait (Ctrl-C's
    // KeyboardInterrupt): made and dropped with the GIL held.
    std::shared_ptr<py::error_already_set> interrupted;
    take_interrupt();  // one left by an earlier step is not this one's
    {
      py::gil_scoped_release release;
      inputs_ = std::move(inputs);
      // NOTE [Signals during a wait] in hp/distributed/comm.h.
      distributed::InterruptCheck check([&interrupted] {
        py::gil_scoped_acquire gil;
        if (PyErr_CheckSignals() == 0) return;
        interrupted = std::make_shared<py::error_already_set>();
        throw std::runtime_error(
            "interrupted: a signal handler raised " +
            std::string(interrupted->type().attr("__name__").cast<std::string>()));
      });
      try {
        out = pipe_->step();
      } catch (const std::exception&) {
        inputs_.clear();
        py::gil_scoped_acquire gil;
        if (!interrupted) interrupted = take_interrupt();
        if (!interrupted) throw;
      }
      inputs_.clear();
    }
    if (interrupted) throw *interrupted;  // the handler's own exception, e.g. KeyboardInterrupt
    last_ = out.stats;                    // what choose_deferred_w fits its costs to
    py::dict d;
    d["loss"] = out.loss;
    d["extra"] = out.extra;
    d["wall"] = out.stats.wall;
    d["compute"] = out.stats.compute;
    d["comm_wait"] = out.stats.comm_wait;
    d["overhead"] = out.stats.overhead;
    d["chunk_wait"] = out.stats.chunk_wait;  // NOTE [A chunk's own waits]
    d["dp_exposed"] = out.dp_exposed;
    d["pairs"] = out.stats.pairs;  // fb_overlap: NOTE [Overlapped pairs]
    d["pair_hidden"] = out.stats.pair_hidden;
    d["pair_exposed"] = out.stats.pair_exposed;
    d["pair_exposed_alone"] = out.stats.pair_exposed_alone;
    d["pair_reordered"] = out.stats.pair_reordered;            // ready turns
    d["deferred_w_in_waits"] = out.stats.deferred_w_in_waits;  // defer_wgrad
    d["deferred_w_at_end"] = out.stats.deferred_w_at_end;
    py::list events;
    for (const auto& e : out.stats.events)
      events.append(py::make_tuple(schedule::to_string(e.action), e.start, e.end));
    d["events"] = events;
    return d;
  }

  /// Tells the peers that this rank will not take part in the step they may
  /// be waiting in: the failure of a step that never started (its arguments
  /// refused on this rank alone), through the same rings and store a failed
  /// step uses (NOTE [A failed step reaches the peers] in
  /// hp/distributed/comm.h). Final: the peers' steps fail naming `why`.
  void abandon(const std::string& why) {
    py::gil_scoped_release release;
    pipe_->comm().abandon(why);
  }

  /// NOTE [The deferred W's chosen in the run] in hp/pipeline/pipeline.cpp:
  /// from the last step, collective over the group and dp_group; applied.
  py::dict choose_deferred_w(double gain, const std::string& pair_turns, bool recomputes) {
    schedule::DeferredWChoice c;
    {
      py::gil_scoped_release release;
      pipeline::DeferredWAuto how;
      how.gain = gain;
      how.pair_turns = pair_turns;
      how.recomputes = recomputes;
      c = pipe_->choose_deferred_w(last_, how);
    }
    py::dict d;
    d["defer"] = c.defer;
    d["step_with"] = c.step_with;
    d["step_without"] = c.step_without;
    d["peak_with"] = c.peak_with;
    d["peak_without"] = c.peak_without;
    return d;
  }

  int rank() const { return pipe_->rank(); }
  std::string backend() const { return pipe_->backend(); }
  /// Why p2p="auto" left the rings out; empty when it did not.
  const std::string& p2p_note() const { return pipe_->p2p_note(); }

 private:
  std::vector<torch::Tensor> inputs_;
  pipeline::StepStats last_;                  ///< the last step's, for choose_deferred_w
  int forward_stage_ = -1, forward_mb_ = -1;  // the stage and microbatch of the running F
  std::unique_ptr<pipeline::Pipeline> pipe_;
};

}  // namespace

void bind_pipeline(py::module_& m) {
  auto sub = m.def_submodule("pipeline", "the pipeline runtime over a torch.distributed group");
  sub.def(
      "keep_freed_memory_mapped", [] { keep_freed_memory_mapped(); },
      "Keeps freed CPU memory in the process for reuse instead of returning it to the kernel "
      "after every large free (NOTE [glibc malloc and page faults] in hp/core/memory.cpp).");
  // The step cache around work outside a step (a benchmark of one stage run
  // as the Pipeline runs it): a scope per thread, entered and left in pairs.
  py::class_<StepCacheScope>(sub, "StepCacheScope")
      .def(py::init<>(),
           "Until it is deleted, CPU tensors this thread allocates take their memory from "
           "the step cache, as a step's do (NOTE [The step cache] in hp/core/memory.cpp).");
  sub.def("cpu_cache_bytes", &step_cache_free_bytes,
          "Bytes of free CPU blocks the step cache holds (NOTE [The step cache] in "
          "hp/core/memory.cpp).");
  sub.def("empty_cpu_cache", &empty_step_cache,
          "Hands every free block of the step cache back to malloc.");
  sub.def(
      "training_mesh",
      [](int world, int pp, int dp, int ep) {
        try {
          const auto shape = distributed::training_mesh(world, pp, dp, ep);
          std::vector<std::pair<std::string, int>> out;
          for (size_t d = 0; d < shape.names.size(); ++d)
            out.emplace_back(shape.names[d], shape.sizes[d]);
          return out;
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("world"), py::arg("pp"), py::arg("dp"), py::arg("ep"),
      "[(name, size)] of the training mesh, outermost first (NOTE [The training mesh] in "
      "hp/distributed/mesh.h); ValueError saying what to change.");
  // The Pipeline's plain options, said once: hp/pipeline/pipeline.h has
  // what each means.
  py::class_<pipeline::PipelineOptions>(sub, "PipelineOptions")
      .def(py::init<>())
      .def_readwrite("device", &pipeline::PipelineOptions::device)
      .def_readwrite("dtype", &pipeline::PipelineOptions::dtype)
      .def_readwrite("p2p", &pipeline::PipelineOptions::p2p)
      .def_readwrite("recompute_sessions", &pipeline::PipelineOptions::recompute_sessions)
      .def_readwrite("prefetch_recompute", &pipeline::PipelineOptions::prefetch_recompute)
      .def_readwrite("receive_lookahead", &pipeline::PipelineOptions::receive_lookahead)
      .def_readwrite("cache_cpu_memory", &pipeline::PipelineOptions::cache_cpu_memory)
      .def_readwrite("fb_overlap", &pipeline::PipelineOptions::fb_overlap)
      .def_readwrite("defer_wgrad", &pipeline::PipelineOptions::defer_wgrad)
      .def_readwrite("pair_first_ready", &pipeline::PipelineOptions::pair_first_ready)
      .def_readwrite("deferred_w_parts", &pipeline::PipelineOptions::deferred_w_parts);
  // One FB pair as a pair function sees it; each half runs without the GIL
  // (a chunk's forward takes it back).
  py::class_<pipeline::PairInputs>(sub, "PairInputs")
      .def_readonly("forward_input", &pipeline::PairInputs::forward_input)
      .def_readonly("forward_is_last", &pipeline::PairInputs::forward_is_last)
      .def_readonly("backward_roots", &pipeline::PairInputs::backward_roots)
      .def_readonly("backward_grads", &pipeline::PairInputs::backward_grads)
      .def_readonly("backward_is_last", &pipeline::PairInputs::backward_is_last);
  py::class_<pipeline::PairCall>(sub, "PairCall")
      .def_property_readonly(
          "action", [](const pipeline::PairCall& c) { return schedule::to_string(c.action); })
      .def_property_readonly("forward_stage",
                             [](const pipeline::PairCall& c) { return c.action.stage; })
      .def_property_readonly("forward_microbatch",
                             [](const pipeline::PairCall& c) { return c.action.microbatch; })
      .def_property_readonly("backward_stage",
                             [](const pipeline::PairCall& c) { return c.action.stage2; })
      .def_property_readonly("backward_microbatch",
                             [](const pipeline::PairCall& c) { return c.action.microbatch2; })
      .def(
          "forward", [](pipeline::PairCall& c) { c.forward(); },
          py::call_guard<py::gil_scoped_release>(), "Runs the pair's forward half (once).")
      .def(
          "backward", [](pipeline::PairCall& c) { c.backward(); },
          py::call_guard<py::gil_scoped_release>(),
          "Runs the pair's backward half (once; I alone under defer_wgrad).")
      .def(
          "overlapped", [](pipeline::PairCall& c) { c.overlapped(); },
          py::call_guard<py::gil_scoped_release>(),
          "Runs both halves as partners (the built-in runner of fb_overlap), instead of "
          "forward() and backward().")
      .def(
          "computed",
          [](pipeline::PairCall& c, py::function fn) {
            py::gil_scoped_release release;
            c.computed([&](const pipeline::PairInputs& p) {
              py::gil_scoped_acquire gil;  // for the cast of p
              return call_python_message(fn, "the pair's computed function",
                                         py::cast(&p, py::return_value_policy::reference));
            });
          },
          "Runs both halves through fn(inputs), which computes them itself (DualPipe's "
          "overlapped_forward_backward): once both inputs arrived, fn runs the forward "
          "from inputs.forward_input and returns its output tensors (its loss where "
          "inputs.forward_is_last), and the backward from inputs.backward_roots and "
          "inputs.backward_grads into .grad.")
      .def("__repr__", [](const pipeline::PairCall& c) {
        return "PairCall(" + schedule::to_string(c.action) + ")";
      });
  sub.def(
      "stand_in_overlap",
      [](const std::string& device, int64_t n, int iterations, int64_t transfer_bytes) {
        const auto t =
            pipeline::stand_in_overlap(c10::Device(device), n, iterations, transfer_bytes);
        return py::make_tuple(t.compute, t.transfer, t.pair);
      },
      py::arg("device"), py::arg("n") = 4096, py::arg("iterations") = 8,
      py::arg("transfer_bytes") = int64_t(256) << 20, py::call_guard<py::gil_scoped_release>(),
      "(compute ms, transfer ms, pair ms): a stand-in transfer on a communication stream and "
      "matrix products as an overlapped pair on a device (NOTE [An overlapped pair on a device]).");
  py::class_<Runtime>(sub, "Runtime")
      .def(py::init<const schedule::Schedule&, const py::object&, const std::map<int, py::object>&,
                    const std::map<int, std::vector<torch::Tensor>>&, py::object, py::object,
                    pipeline::PipelineOptions, double, const py::object&,
                    const std::map<int, std::vector<torch::Tensor>>&, py::object, const py::object&,
                    const std::map<int, std::vector<torch::Tensor>>&, const py::object&,
                    const std::vector<py::object>&, const std::map<int, std::vector<std::string>>&,
                    py::object, py::object, const py::object&>(),
           // std::invalid_argument (a bad option) reaches Python as ValueError.
           py::arg("schedule"), py::arg("group"), py::arg("chunk_forward"),
           py::arg("chunk_parameters"), py::arg("loss"), py::arg("activation_shape"),
           py::arg("options"), py::kw_only(), py::arg("timeout_s") = 300.0,
           py::arg("dp_group") = py::none(),
           py::arg("chunk_dp_parameters") = std::map<int, std::vector<torch::Tensor>>{},
           py::arg("extra_sum") = py::none(), py::arg("failure_store") = py::none(),
           py::arg("chunk_expert_parameters") = std::map<int, std::vector<torch::Tensor>>{},
           py::arg("dp_failure_store") = py::none(),
           py::arg("loss_groups") = std::vector<py::object>{},
           py::arg("chunk_parameter_names") = std::map<int, std::vector<std::string>>{},
           py::arg("before_step") = py::none(), py::arg("after_step") = py::none(),
           py::arg("expert_dp_group") = py::none())
      .def("step", &Runtime::step, py::arg("inputs"),
           "Runs one step of this rank's actions; returns the loss and timings.")
      .def("set_pair_function", &Runtime::set_pair_function, py::arg("fn"),
           "fn(pair) runs each FB pair (NOTE [A pair function]); None: the built-in order.")
      .def("choose_deferred_w", &Runtime::choose_deferred_w, py::arg("gain"),
           py::arg("pair_turns") = "fixed", py::arg("recomputes") = true,
           "Whether the pairs' W's defer from the next step, from the last step's costs "
           "(collective; applied): a dict of the choice and both predictions. pair_turns: "
           "DeferredWAuto::pair_turns; recomputes: whether this rank's W's may recompute.")
      .def("abandon", &Runtime::abandon, py::arg("why"),
           "Tells the peers that this rank will not take part in the running step (final).")
      .def_property_readonly("rank", &Runtime::rank)
      .def_property_readonly("backend", &Runtime::backend)
      .def_property_readonly("p2p_note", &Runtime::p2p_note);
}

}  // namespace hp::python
