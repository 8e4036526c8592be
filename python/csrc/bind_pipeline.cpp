// hyperparallel._C.pipeline: the C++ executor running a user's Python stages
// (any callables, nn.Modules included) with any schedule, over the
// torch.distributed ProcessGroup the user made (Gloo on CPU, NCCL on GPU).
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bindings.h"
#include "hp/core/memory.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/comm.h"
#include "hp/pipeline/data_parallel.h"
#include "hp/pipeline/executor.h"
#include "hp/pipeline/stage.h"
#include "hp/recompute/session.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/schedule.h"

namespace hp::python {
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

// Calls `fn(args...)`; the caller holds the GIL. A Python exception becomes
// a C++ one carrying its type and message (formatted while the GIL is held).
template <typename... Args>
py::object call_held(const py::object& fn, const char* what, Args&&... args) {
  try {
    return fn(std::forward<Args>(args)...);
  } catch (py::error_already_set& e) {
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

schedule::Schedule schedule_from_csv(const std::string& csv) {
  schedule::Schedule s = schedule::from_csv(csv);
  if (!s.lowered) s = schedule::lower(s);
  schedule::validate(s);
  return s;
}

// The ranks holding each model chunk: chunks held by more than one rank are
// replicas whose weight gradients are summed after each step.
std::map<int, std::vector<int>> chunk_holders(const schedule::Schedule& s) {
  std::map<int, std::set<int>> h;
  for (int st = 0; st < s.num_stages; ++st)
    h[s.stage_chunk[st]].insert(s.stage_rank[st]);
  std::map<int, std::vector<int>> out;
  for (auto& [c, ranks] : h)
    out[c] = std::vector<int>(ranks.begin(), ranks.end());
  return out;
}

/// One rank's pipeline: its stages, the executor and the group.
class Runtime {
 public:
  Runtime(const std::string& schedule_csv, const py::object& group,
          const std::map<int, py::object>& chunk_forward,
          const std::map<int, std::vector<torch::Tensor>>& chunk_parameters, py::object loss,
          py::object activation_shape, py::object dtype, py::object device, double timeout_s,
          const py::object& dp_group, int receive_lookahead, const std::string& p2p,
          bool cache_cpu_memory,
          const std::map<int, std::vector<torch::Tensor>>& chunk_dp_parameters = {},
          bool recompute_sessions = false)
      : sched_(schedule_from_csv(schedule_csv)),
        loss_(std::move(loss)),
        activation_shape_(std::move(activation_shape)),
        chunk_forward_(chunk_forward) {
    distributed::CommOptions options;
    options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    const torch::Device on =
        device.is_none() ? torch::Device(torch::kCPU) : device.cast<torch::Device>();
    // CUDA tensors over Gloo (e.g. two ranks sharing one GPU) go through host
    // memory; NCCL takes them as they are (NOTE [Ranks on devices]).
    auto borrowed = distributed::Comm::from_process_group(process_group_of(group), options);
    if (borrowed->world_size() != sched_.num_ranks)
      throw py::value_error("the group has " + std::to_string(borrowed->world_size()) +
                            " ranks but the schedule has " + std::to_string(sched_.num_ranks));
    if (p2p != "group" && p2p != "shm" && p2p != "auto")
      throw py::value_error("p2p must be 'auto', 'group' or 'shm', got '" + p2p + "'");
    // NOTE [Shared-memory point-to-point] and NOTE [Choosing the
    // point-to-point] in hp/distributed/shm_p2p.cpp: "auto" takes the rings
    // where every rank can have them, "shm" insists, and says at once what
    // this rank can tell on its own.
    std::string cannot;
    if (!on.is_cpu())
      cannot =
          "p2p='shm' moves CPU tensors between the processes of one host; this pipeline runs "
          "on " +
          on.str() + ": use p2p='group'";
    else if (borrowed->backend_name() != "gloo")
      cannot = "p2p='shm' goes beside a Gloo group; this group's backend is " +
               borrowed->backend_name() + ": use p2p='group'";
    if (p2p == "shm" && !cannot.empty()) throw py::value_error(cannot);
    distributed::SharedMemoryOptions shm;
    shm.overflow_on_inner = true;     // NOTE [Overflow of a borrowed group]
    shm.links = sched_.rank_links();  // rings only where the schedule sends
    shm.device = on;
    {
      // Making the rings waits on every rank of the group: without the GIL.
      py::gil_scoped_release release;
      borrowed =
          distributed::with_point_to_point(borrowed,
                                           p2p == "group" ? distributed::PointToPoint::Group
                                           : p2p == "shm" ? distributed::PointToPoint::SharedMemory
                                                          : distributed::PointToPoint::Auto,
                                           shm, &p2p_note_);
    }
    comm_ = distributed::for_device(borrowed, on);
    rank_ = comm_->rank();
    // This rank's stages and their chunks; every chunk must be given.
    std::map<int, pipeline::StageModule> modules;
    for (int st : sched_.stages_of_rank(rank_)) {
      const int c = sched_.stage_chunk[st];
      auto f = chunk_forward_.find(c);
      if (f == chunk_forward_.end())
        throw py::value_error("rank " + std::to_string(rank_) + " runs stage " +
                              std::to_string(st) + ", which computes model chunk " +
                              std::to_string(c) + ", but no module was given for chunk " +
                              std::to_string(c) + " (give one for each of chunks_of_rank())");
      pipeline::StageModule mod;
      py::object fn = f->second;
      mod.forward = [fn](const torch::Tensor& x) {
        return call_python(fn, "a stage's forward", x);
      };
      auto p = chunk_parameters.find(c);
      if (p != chunk_parameters.end()) mod.parameters = p->second;
      modules.emplace(st, std::move(mod));
    }
    for (const auto& [c, fn] : chunk_forward_) {
      bool used = false;
      for (int st : sched_.stages_of_rank(rank_))
        used = used || sched_.stage_chunk[st] == c;
      if (!used)
        throw py::value_error("a module was given for chunk " + std::to_string(c) +
                              ", which no stage of rank " + std::to_string(rank_) + " computes");
    }
    // Replicated chunks: their parameters, and who else holds them.
    for (const auto& [c, ranks] : chunk_holders(sched_)) {
      if (ranks.size() < 2 || !chunk_forward_.count(c)) continue;
      auto p = chunk_parameters.find(c);
      if (p == chunk_parameters.end()) continue;
      for (const auto& t : p->second) {
        replica_params_.push_back(t);
        replica_holders_.push_back(ranks);
      }
    }
    py::object loss_fn = loss_;
    auto stage_loss = [loss_fn](const torch::Tensor& out, int mb) {
      torch::Tensor l = call_python(loss_fn, "the loss function", out, mb);
      if (l.numel() != 1)
        throw std::runtime_error(
            "the loss function must return one number (a tensor of one "
            "element), got shape " +
            c10::str(l.sizes()));
      return l;  // counted 1/m times: the stage's loss_scale
    };
    pipeline::StageHooks hooks;
    // NOTE [One GIL hold per forward]
    // A forward calls Python once (the stage) or twice (and the loss), and
    // each call took the GIL and gave it back, with the Python thread state's
    // swaps each time. The whole of F runs under one hold instead: the calls
    // inside take it again at the cost of a counter. Nothing in F waits for
    // another thread (its input was received before F began), so holding it
    // longer blocks no one that F needs.
    hooks.around_forward = [](int, int, const std::function<torch::Tensor()>& run) {
      py::gil_scoped_acquire gil;
      return run();
    };
    // NOTE [Recompute sessions of a Python pipeline]
    // hyperparallel.recompute.checkpoint blocks inside a stage share one
    // recompute between the I and the W of a microbatch when both run inside
    // the same retaining RecomputeSession (hp/recompute): each I and W of
    // (stage, mb) opens session (stage, mb), its W (or B) clears it, as
    // hp train does (hp/train/trainer.cpp). A B retains nothing (nothing comes
    // after it). Outside such blocks a session costs a thread-local guard.
    // torch.utils.checkpoint keeps its recompute per engine call, so it
    // recomputes twice under a split: the Python side says so once.
    std::vector<std::function<void(int, int)>> done;
    if (recompute_sessions) {
      recompute_sessions_ = true;
      const auto retain = recompute::SessionOptions().retain_on_unpack(true);
      hooks.around_backward = [retain](int st, int mb, char kind,
                                       const std::function<void()>& run) {
        recompute::RecomputeSession session(session_id(st, mb),
                                            kind == 'B' ? recompute::SessionOptions() : retain);
        run();
      };
      done.push_back([](int st, int mb) { recompute::clear_session(session_id(st, mb)); });
    }
    // Data parallelism across pipelines: every replica of this pipeline
    // averages its stages' gradients over dp_group as soon as each stage has
    // run its last microbatch (NOTE [Gradient reduction in the cool-down]).
    if (!dp_group.is_none()) {
      dp_ = distributed::for_device(
          distributed::Comm::from_process_group(process_group_of(dp_group), options), on);
      // A chunk listed in chunk_dp_parameters has only those averaged here:
      // the others (FSDP2's, NOTE [FSDP2 stages] in
      // python/hyperparallel/pipeline.py) are reduced by their owner.
      std::map<int, std::vector<torch::Tensor>> stage_params;
      for (const auto& [st, mod] : modules) {
        auto own = chunk_dp_parameters.find(sched_.stage_chunk[st]);
        stage_params[st] = own != chunk_dp_parameters.end() ? own->second : mod.parameters;
      }
      reducer_ = std::make_unique<pipeline::GradientReducer>(
          dp_, stage_params, pipeline::microbatches_per_stage(sched_, rank()));
      done.push_back([r = reducer_.get()](int stage, int mb) { r->on_done(stage, mb); });
    }
    if (!done.empty())
      hooks.on_done = [done](int stage, int mb) {
        for (const auto& f : done)
          f(stage, mb);
      };
    // The step's loss is the mean over its microbatches (NOTE [The loss scale
    // is the backward's seed] in hp/pipeline/stage.cpp).
    stage_ = std::make_unique<pipeline::PipelineStage>(std::move(modules), stage_loss, hooks,
                                                       1.0 / sched_.num_microbatches);
    pipeline::ExecutorOptions eo;
    eo.input = [this](int mb) {
      if (mb >= int(inputs_.size()))
        throw std::runtime_error("step() was given " + std::to_string(inputs_.size()) +
                                 " microbatch inputs but the schedule has " +
                                 std::to_string(sched_.num_microbatches) + " microbatches");
      return inputs_[mb];
    };
    if (py::isinstance<py::tuple>(activation_shape_)) {
      // One shape for every message: no call into Python per receive.
      eo.activation_shape = [fixed = activation_shape_.cast<std::vector<int64_t>>()](int, int) {
        return fixed;
      };
    } else {
      py::object shape_fn = activation_shape_;
      eo.activation_shape = [shape_fn](int stage, int mb) {
        py::gil_scoped_acquire gil;
        return call_held(shape_fn, "activation_shape", stage, mb).cast<std::vector<int64_t>>();
      };
    }
    eo.dtype = dtype.cast<c10::ScalarType>();
    eo.device = on;
    eo.receive_lookahead = receive_lookahead;
    eo.cache_cpu_memory = cache_cpu_memory;
    {
      // The executor's agreement is a collective (NOTE [Ranks agree on the
      // pipeline]). Made with the GIL held, its all-gather over the group
      // that torch.distributed made timed out on both ranks (p2p="group"),
      // as waits on Gloo work under the GIL do here (NOTE [A Pipeline's
      // group dies with it]): every collective runs with the GIL released.
      py::gil_scoped_release release;
      executor_ =
          std::make_unique<pipeline::Executor>(sched_, rank_, *stage_, comm_, std::move(eo));
    }
  }

  // NOTE [A Pipeline's group dies with it]
  // The Comms hold the user's ProcessGroup (and the groups made beside it).
  // When ours is its last reference, ~ProcessGroupGloo joins its worker
  // threads, and a worker still freeing a finished collective that holds a
  // Python tensor takes the GIL to do so: with the GIL held here (a Python
  // object's dealloc), that join would never return. So the Comms go without
  // the GIL, after the executor, the stages and the reducer (which hold
  // Python callables) went with it. And the Python side keeps no reference
  // cycle through this object (the loss it is given does not hold the
  // Pipeline), so a dropped Pipeline lets its groups go at once instead of at
  // the interpreter's shutdown. (That alone does not end the abort at exit of
  // NOTE [Gloo work freed during shutdown] in bench/peers/common.py: a Gloo
  // worker of a group that Python still holds can free a finished
  // collective's Python tensor after the main thread began the shutdown.)
  ~Runtime() {
    executor_.reset();
    reducer_.reset();
    stage_.reset();
    std::shared_ptr<distributed::Comm> comm = std::move(comm_), dp = std::move(dp_);
    py::gil_scoped_release release;
    comm.reset();
    dp.reset();
  }
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  /// One step: every action of this rank once. Returns the mean loss over
  /// the microbatches (the same on every rank) and this rank's timings.
  py::dict step(std::vector<torch::Tensor> inputs) {
    if (broken_)
      throw std::runtime_error(
          "a previous step failed on this rank (" + broken_reason_ +
          "); its microbatches are half done and the group may be broken: make a new Pipeline "
          "(and, after a communication error, a new process group)");
    pipeline::StepStats stats;
    double loss = 0;
    // A Python exception raised by a signal handler during a wait (Ctrl-C's
    // KeyboardInterrupt): made and dropped with the GIL held.
    std::shared_ptr<py::error_already_set> interrupted;
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
        if (reducer_) reducer_->begin_step();
        stats = executor_->run_step();
        if (reducer_) reducer_->finish_step();
        if (!replica_params_.empty()) sum_replica_gradients();
        auto l = torch::tensor({stats.loss_sum}, torch::kFloat64);
        comm_->all_reduce(l);
        if (dp_) dp_->all_reduce(l, distributed::ReduceOp::Avg);
        loss = l.item<double>();
      } catch (const std::exception& e) {
        inputs_.clear();
        if (recompute_sessions_)
          for (int st : sched_.stages_of_rank(rank_))
            for (int mb = 0; mb < sched_.num_microbatches; ++mb)
              recompute::clear_session(session_id(st, mb));
        broken_ = true;
        broken_reason_ = e.what();
        if (broken_reason_.size() > 200) broken_reason_ = broken_reason_.substr(0, 200) + "...";
        if (!interrupted) throw;
      }
      inputs_.clear();
    }
    if (interrupted) throw *interrupted;  // the handler's own exception, e.g. KeyboardInterrupt
    py::dict d;
    d["loss"] = loss;
    d["wall"] = stats.wall;
    d["compute"] = stats.compute;
    d["comm_wait"] = stats.comm_wait;
    d["overhead"] = stats.overhead;
    d["dp_exposed"] = reducer_ ? reducer_->exposed_seconds() : 0.0;
    py::list events;
    for (const auto& e : stats.events)
      events.append(py::make_tuple(schedule::to_string(e.action), e.start, e.end));
    d["events"] = events;
    return d;
  }

  int rank() const { return rank_; }
  std::string backend() const { return comm_->backend_name(); }
  /// Why p2p="auto" left the rings out; empty when it did not.
  const std::string& p2p_note() const { return p2p_note_; }

 private:
  void sum_replica_gradients() {
    std::vector<torch::Tensor> grads;
    for (const auto& p : replica_params_)
      grads.push_back(p.grad().defined() ? p.grad() : torch::zeros_like(p));
    distributed::sum_among_holders(*comm_, grads, replica_holders_);
    for (size_t i = 0; i < grads.size(); ++i) {
      torch::Tensor p = replica_params_[i];
      p.mutable_grad() = grads[i];
    }
  }

  /// The recompute session of (stage, mb): the top bit keeps these apart
  /// from ids a user picks for hyperparallel.recompute.RecomputeSession.
  static uint64_t session_id(int stage, int mb) {
    return (uint64_t{1} << 63) | (static_cast<uint64_t>(stage) << 32) | static_cast<uint32_t>(mb);
  }

  schedule::Schedule sched_;
  bool recompute_sessions_ = false;
  py::object loss_, activation_shape_;
  std::map<int, py::object> chunk_forward_;
  std::shared_ptr<distributed::Comm> comm_;
  int rank_ = 0;
  std::unique_ptr<pipeline::PipelineStage> stage_;
  std::unique_ptr<pipeline::Executor> executor_;
  std::vector<torch::Tensor> inputs_;
  std::vector<torch::Tensor> replica_params_;
  std::vector<std::vector<int>> replica_holders_;
  std::shared_ptr<distributed::Comm> dp_;
  std::unique_ptr<pipeline::GradientReducer> reducer_;
  bool broken_ = false;
  std::string broken_reason_;
  std::string p2p_note_;
};

}  // namespace

void bind_pipeline(py::module_& m) {
  auto sub = m.def_submodule("pipeline", "the pipeline runtime over a torch.distributed group");
  sub.def(
      "keep_freed_memory_mapped", [] { keep_freed_memory_mapped(); },
      "Keeps freed CPU memory in the process for reuse instead of returning it to the kernel "
      "after every large free (NOTE [glibc malloc and page faults] in hp/core/memory.cpp).");
  sub.def("cpu_cache_bytes", &step_cache_free_bytes,
          "Bytes of free CPU blocks the step cache holds (NOTE [The step cache] in "
          "hp/core/memory.cpp).");
  sub.def("empty_cpu_cache", &empty_step_cache,
          "Hands every free block of the step cache back to malloc.");
  sub.def(
      "schedule_csv",
      [](const std::string& name, int ranks, int microbatches, int chunks) {
        schedule::BuildOptions o;
        o.chunks = chunks;
        try {
          return schedule::to_csv(schedule::build(name, ranks, microbatches, o));
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("name"), py::arg("ranks"), py::arg("microbatches"), py::arg("chunks") = 2,
      "The named schedule (any hyperparallel generator) as CSV text.");
  sub.def(
      "layout",
      [](const std::string& csv) {
        schedule::Schedule s;
        try {
          s = schedule::from_csv(csv);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
        py::dict d;
        d["num_ranks"] = s.num_ranks;
        d["num_stages"] = s.num_stages;
        d["num_chunks"] = s.num_chunks;
        d["num_microbatches"] = s.num_microbatches;
        d["stage_rank"] = s.stage_rank;
        d["stage_chunk"] = s.stage_chunk;
        std::vector<int> first, last;
        for (const auto& r : s.routes) {
          first.push_back(r.front());
          last.push_back(r.back());
        }
        d["first_stages"] = first;
        d["last_stages"] = last;
        return d;
      },
      py::arg("csv"), "Placement of a schedule given as CSV: ranks, stages and their chunks.");
  py::class_<Runtime>(sub, "Runtime")
      .def(py::init([](const std::string& csv, const py::object& group,
                       const std::map<int, py::object>& forward,
                       const std::map<int, std::vector<torch::Tensor>>& parameters, py::object loss,
                       py::object shape, py::object dtype, py::object device, double timeout_s,
                       const py::object& dp_group, int receive_lookahead, const std::string& p2p,
                       bool cache_cpu_memory,
                       const std::map<int, std::vector<torch::Tensor>>& dp_parameters,
                       bool recompute_sessions) {
             try {
               return std::make_unique<Runtime>(
                   csv, group, forward, parameters, loss, shape, dtype, device, timeout_s, dp_group,
                   receive_lookahead, p2p, cache_cpu_memory, dp_parameters, recompute_sessions);
             } catch (const std::invalid_argument& e) {
               throw py::value_error(e.what());
             }
           }),
           py::arg("schedule_csv"), py::arg("group"), py::arg("chunk_forward"),
           py::arg("chunk_parameters"), py::arg("loss"), py::arg("activation_shape"),
           py::arg("dtype"), py::arg("device") = py::none(), py::arg("timeout_s") = 300.0,
           py::arg("dp_group") = py::none(), py::arg("receive_lookahead") = 0,
           py::arg("p2p") = "auto", py::arg("cache_cpu_memory") = false,
           py::arg("chunk_dp_parameters") = std::map<int, std::vector<torch::Tensor>>{},
           py::arg("recompute_sessions") = false)
      .def("step", &Runtime::step, py::arg("inputs"),
           "Runs one step of this rank's actions; returns the loss and timings.")
      .def_property_readonly("rank", &Runtime::rank)
      .def_property_readonly("backend", &Runtime::backend)
      .def_property_readonly("p2p_note", &Runtime::p2p_note);
}

}  // namespace hp::python
