// Pipeline: the one place a rank's pipeline is assembled (point-to-point,
// device, stages, executor, data-parallel reducer, replicas) and one step of
// it is run and reduced. hp train (hp/train/trainer.cpp) and the Python
// package (python/csrc/bind_pipeline.cpp) call it.
#include "hp/pipeline/pipeline.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <utility>

#include "hp/distributed/collectives.h"
#include "hp/distributed/lanes.h"
#include "hp/pipeline/agreement.h"
#include "hp/pipeline/step_timeline.h"
#include "hp/recompute/checkpoint.h"
#include "hp/recompute/session.h"
#include "hp/schedule/lower.h"

namespace hp::pipeline {
namespace {

void invalid(const std::string& what) {
  throw std::invalid_argument(what);
}

void check_deferred_w(const PipelineOptions& o) {
  if (o.defer_wgrad && !o.fb_overlap)
    invalid("defer_wgrad defers the W of overlapped pairs: set fb_overlap too");
  if (o.deferred_w_parts < 1 || (o.deferred_w_parts > 1 && !(o.defer_wgrad && o.pair_first_ready)))
    invalid("deferred_w_parts " + std::to_string(o.deferred_w_parts) +
            ": at least 1, and above 1 only with defer_wgrad and pair_first_ready");
}

/// The recompute session of (stage, mb) of the Pipeline numbered `pipeline`
/// in this process: the top bit keeps these apart from ids a user picks for
/// a RecomputeSession of their own. NOTE [Sessions of several pipelines in
/// one process]: the sessions are process-wide, and ranks run as threads of
/// one process (the tests) or two Pipelines of one Python process hold the
/// same (stage, mb); without the pipeline's number, the expert-parallel peer
/// that recomputed a block first left it in the session, the other took it
/// there and skipped the block's recompute and so its all-to-alls, which its
/// peer then waited for (seen as a Gloo size mismatch under load).
uint64_t session_id(uint32_t pipeline, int stage, int mb) {
  return (uint64_t{1} << 63) | (static_cast<uint64_t>(pipeline & 0x7fff) << 48) |
         (static_cast<uint64_t>(stage & 0xffff) << 32) | static_cast<uint32_t>(mb);
}

uint32_t next_pipeline_number() {
  static std::atomic<uint32_t> next{0};
  return next++;
}

// NOTE [Recompute in the pipeline]
// Checkpointed blocks inside a stage (hp/recompute, from C++ or from
// hyperparallel.recompute) share one recompute between the I and the W of a
// microbatch: each I and W of (stage, mb) runs inside a retaining
// RecomputeSession (stage, mb), and its W (or B) clears it. A fused B does
// not retain (nothing comes after it): a block's recomputed activations are
// freed as soon as its backward is done. With `prefetch_recompute` F also
// collects one handle per block, and before the executor waits for the
// output gradient, the last block (the first one backward needs) is
// recomputed, so that recompute overlaps the wait; the other blocks
// recompute when backward reaches them, one at a time. So each block runs
// one extra forward per microbatch, never two, and at most one block's
// recomputed activations (plus what W keeps) are alive at once; prefetching
// every block had kept them all alive together (1F1B's peak was 58 % of the
// run without recompute instead of under half). Outside checkpointed blocks
// a session costs a thread-local guard. torch.utils.checkpoint keeps its
// recompute per engine call, so it recomputes twice under a split (the
// Python side says so once).
StageHooks recompute_hooks(bool prefetch, uint32_t pipeline) {
  using Handles = std::vector<recompute::RecomputeHandle>;
  auto handles = std::make_shared<std::map<std::pair<int, int>, Handles>>();
  const auto retain = recompute::SessionOptions().retain_on_unpack(true);
  StageHooks h;
  if (prefetch) {
    h.around_forward = [handles](int st, int mb, const std::function<Message()>& run) {
      recompute::HandleCollector collector;
      Message out = run();
      (*handles)[{st, mb}] = collector.take();
      return out;
    };
    h.before_backward = [handles, retain, pipeline](int st, int mb) {
      auto it = handles->find({st, mb});
      if (it == handles->end() || it->second.empty()) return;
      recompute::RecomputeSession session(session_id(pipeline, st, mb), retain);
      recompute::prefetch({it->second.back()});
    };
  }
  h.around_backward = [retain, pipeline](int st, int mb, char kind,
                                         const std::function<void()>& run) {
    recompute::RecomputeSession session(session_id(pipeline, st, mb),
                                        kind == 'B' ? recompute::SessionOptions() : retain);
    run();
  };
  h.on_done = [handles, pipeline](int st, int mb) {
    recompute::clear_session(session_id(pipeline, st, mb));
    handles->erase({st, mb});
  };
  return h;
}

/// One hook of two: either alone where the other is unset, else `both`.
template <typename Hook, typename Both>
Hook join(const Hook& outer, const Hook& inner, Both both) {
  if (!outer) return inner;
  if (!inner) return outer;
  return both(outer, inner);
}

/// `outer` around `inner`: each hook runs outer's part outside inner's
/// (on_done: inner's first, then outer's).
StageHooks nest(const StageHooks& outer, const StageHooks& inner) {
  using Run = std::function<Message()>;
  using Part = std::function<void()>;
  StageHooks h;
  h.around_forward = join(outer.around_forward, inner.around_forward, [](auto o, auto i) {
    return [o, i](int st, int mb, const Run& run) {
      return o(st, mb, [&] { return i(st, mb, run); });
    };
  });
  h.before_backward = join(outer.before_backward, inner.before_backward, [](auto o, auto i) {
    return [o, i](int st, int mb) { o(st, mb), i(st, mb); };
  });
  h.around_backward = join(outer.around_backward, inner.around_backward, [](auto o, auto i) {
    return [o, i](int st, int mb, char kind, const Part& run) {
      o(st, mb, kind, [&] { i(st, mb, kind, run); });
    };
  });
  h.on_done = join(outer.on_done, inner.on_done,
                   [](auto o, auto i) { return [o, i](int st, int mb) { i(st, mb), o(st, mb); }; });
  return h;
}

/// A stable 63-bit hash of a parameter's name (the same in every process).
int64_t name_hash(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h & 0x7fffffffffffffffull);
}

/// What a data-parallel copy of this pipeline rank holds: its rank, its
/// chunks and its expert parameters (count and sizes), for the agreement
/// over `dp` (NOTE [Ranks agree on the pipeline] in agreement.cpp).
std::vector<int64_t> what_a_copy_holds(int rank, const std::map<int, ChunkModule>& chunks) {
  int64_t experts = 0, expert_numel = 0, chunk_ids = 0;
  for (const auto& [c, chunk] : chunks) {
    chunk_ids = chunk_ids * 1000003 + c + 1;
    experts += static_cast<int64_t>(chunk.expert_parameters.size());
    for (const auto& t : chunk.expert_parameters)
      expert_numel += t.numel();
  }
  return {rank, chunk_ids, experts, expert_numel};
}

/// Every copy runs the same pipeline rank's chunks with the same expert
/// parameters, else every rank throws naming the copy that differs.
void check_the_copies(const std::vector<std::vector<int64_t>>& copies,
                      const std::vector<int64_t>& mine, int rank) {
  static const char* kWhat[] = {"is pipeline rank", "holds other model chunks",
                                "holds another number of expert parameters",
                                "holds expert parameters of other sizes"};
  for (size_t q = 0; q < copies.size(); ++q)
    for (size_t f = 0; f < mine.size(); ++f)
      if (copies[q][f] != mine[f])
        invalid("pipeline rank " + std::to_string(rank) + ": its data-parallel copy " +
                std::to_string(q) + " (rank " + std::to_string(q) + " of dp) " + kWhat[f] +
                (f == 0 ? " " + std::to_string(copies[q][0]) : "") +
                ": every copy of a pipeline runs the same stages with the same experts' shapes "
                "(data- and expert-parallel groups join ranks of one pipeline rank)");
}

/// This rank's parameters by name (a tensor given twice counts once).
std::map<std::string, std::vector<torch::Tensor>> parameters_by_name(
    const std::map<int, ChunkModule>& chunks) {
  std::map<std::string, std::vector<torch::Tensor>> local;
  for (const auto& [c, chunk] : chunks)
    for (size_t i = 0; i < chunk.parameters.size(); ++i) {
      const std::string name = chunk.names.empty()
                                   ? "chunk" + std::to_string(c) + "." + std::to_string(i)
                                   : chunk.names[i];
      auto& list = local[name];
      const auto& t = chunk.parameters[i];
      bool seen = false;
      for (const auto& u : list)
        seen = seen || u.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
      if (!seen) list.push_back(t);
    }
  return local;
}

}  // namespace

distributed::PointToPoint parse_point_to_point(const std::string& p2p) {
  if (p2p == "group") return distributed::PointToPoint::Group;
  if (p2p == "shm") return distributed::PointToPoint::SharedMemory;
  if (p2p == "auto") return distributed::PointToPoint::Auto;
  invalid("p2p must be 'auto', 'group' or 'shm', got '" + p2p + "'" +
          (p2p == "gloo" ? " (the group's own point-to-point is spelled 'group')" : ""));
  return distributed::PointToPoint::Auto;
}

Pipeline::Pipeline(schedule::Schedule schedule, std::shared_ptr<distributed::Comm> group,
                   std::map<int, ChunkModule> chunks, LossFn loss, PipelineOptions options)
    : options_(std::move(options)), number_(next_pipeline_number()) {
  if (group == nullptr) invalid("Pipeline: no group given");
  rank_ = group->rank();
  // What this rank can check alone; the ranks then agree (NOTE [Ranks agree
  // on the pipeline] in agreement.cpp) before the first collective that would
  // wait for a rank that failed here.
  std::exception_ptr failed;
  distributed::PointToPoint how = distributed::PointToPoint::Auto;
  std::map<int, StageModule> modules;
  try {
    if (!schedule.lowered) schedule = schedule::lower(schedule);
    schedule::validate(schedule);
    sched_ = schedule;
    if (group->world_size() != sched_.num_ranks)
      invalid("the group has " + std::to_string(group->world_size()) +
              " ranks but the schedule has " + std::to_string(sched_.num_ranks));
    how = parse_point_to_point(options_.p2p);
    // NOTE [Choosing the point-to-point] in hp/distributed/shm_p2p.cpp:
    // "shm" insists on the rings, and says at once what this rank can tell.
    if (how == distributed::PointToPoint::SharedMemory && !options_.device.is_cpu())
      invalid(
          "p2p='shm' moves CPU tensors between the processes of one host; this pipeline "
          "runs on " +
          options_.device.str() + ": use p2p='group'");
    if (how == distributed::PointToPoint::SharedMemory && group->backend_name() != "gloo")
      invalid("p2p='shm' goes beside a Gloo group; this group's backend is " +
              group->backend_name() + ": use p2p='group'");
    if (options_.fb_overlap && !options_.device.is_cpu() && !options_.device.is_cuda())
      invalid(
          "fb_overlap runs on the CPU and on CUDA (a stream per half: NOTE [An overlapped "
          "pair on a device]), not on " +
          options_.device.str());
    check_deferred_w(options_);
    if (options_.link.active()) {
      if (!options_.device.is_cpu())
        invalid("a link model delays CPU transfers; this pipeline runs on " +
                options_.device.str());
      if (how == distributed::PointToPoint::SharedMemory)
        invalid("p2p='shm' would bypass the link model: use p2p='group' or 'auto'");
      how = distributed::PointToPoint::Group;
    }
    // This rank's stages and their chunks: every chunk they compute, no other.
    std::set<int> used;
    for (int st : sched_.stages_of_rank(rank_)) {
      const int c = sched_.stage_chunk[st];
      used.insert(c);
      auto it = chunks.find(c);
      if (it == chunks.end())
        invalid("rank " + std::to_string(rank_) + " runs stage " + std::to_string(st) +
                ", which computes model chunk " + std::to_string(c) +
                ", but no module was given for chunk " + std::to_string(c) +
                " (give one for each of chunks_of_rank())");
      if (!it->second.forward && !it->second.forward_message)
        invalid("chunk " + std::to_string(c) + " has no forward");
      if (!it->second.names.empty() && it->second.names.size() != it->second.parameters.size())
        invalid("chunk " + std::to_string(c) + " names " + std::to_string(it->second.names.size()) +
                " parameters but has " + std::to_string(it->second.parameters.size()));
      modules[st] =
          StageModule{it->second.forward, it->second.parameters, it->second.forward_message};
    }
    for (const auto& [c, chunk] : chunks)
      if (!used.count(c))
        invalid("a module was given for chunk " + std::to_string(c) + ", which no stage of rank " +
                std::to_string(rank_) + " computes");
  } catch (...) {
    failed = std::current_exception();
  }
  // A group of another size than the schedule cannot agree with it: the
  // error is the whole story, on every rank.
  if (failed && group->world_size() != schedule.num_ranks) std::rethrow_exception(failed);
  // One agreement over the group (and one over dp): NOTE [Ranks agree on
  // the pipeline] in agreement.cpp. On the host, except where the group
  // wants device tensors (NCCL); a device the rank could not use (its own
  // error) is no place for it.
  const torch::Device on = options_.device.is_cuda() ? options_.device : torch::Device(torch::kCPU);
  const auto named = parameters_by_name(chunks);
  const bool carried = !options_.layout && !options_.activation_shape;
  const int64_t pairs = pairs_word(options_.fb_overlap, options_.defer_wgrad,
                                   options_.pair_first_ready, options_.deferred_w_parts);
  const auto names_held =
      agree_on_the_pipeline(*distributed::for_device(group, on), schedule, options_.dtype, carried,
                            pairs, on, rank_, !failed, {static_cast<int64_t>(named.size())});
  // The copies agree too: a data-parallel group whose ranks ran other
  // stages or schedules would mix their gradients, and an expert-parallel
  // one (the same group) would wait in an all-to-all that a peer never
  // starts (NOTE [The all-to-all in the backward] in hp/moe/all_to_all.h).
  if (options_.dp) {
    const auto mine = what_a_copy_holds(rank_, chunks);
    const auto copies =
        agree_on_the_pipeline(*distributed::for_device(options_.dp, on), schedule, options_.dtype,
                              carried, pairs, on, options_.dp->rank(), !failed, mine);
    if (!failed) check_the_copies(copies, mine, rank_);
  }
  if (failed) std::rethrow_exception(failed);
  // Ready turns post the data-parallel reductions by timing, beside a
  // pair's expert exchanges over the same ranks: the group in lanes (NOTE
  // [Turns as messages arrive] in overlap.cpp), where it has none yet.
  if (options_.dp && options_.pair_first_ready &&
      distributed::lane_count(*options_.dp) < distributed::kPairLanes)
    options_.dp = distributed::with_lanes(options_.dp, distributed::kPairLanes);

  // The point-to-point: rings only between the ranks the schedule's
  // transfers join; nothing else sends over this group, so messages too
  // large for a ring use its own point-to-point (NOTE [Overflow of a
  // borrowed group]).
  distributed::SharedMemoryOptions shm;
  shm.overflow_on_inner = true;
  shm.links = sched_.rank_links();
  shm.device = options_.device;
  // NOTE [A failed step reaches the peers] in hp/distributed/comm.h: over
  // the group's own point-to-point (and the rings' overflow), through the store.
  group = distributed::with_failure_store(group, options_.failure_store);
  comm_ = distributed::with_point_to_point(group, how, shm, &p2p_note_);
  comm_ = distributed::with_link_model(comm_, options_.link);  // NOTE [The link model]
  // NOTE [Ranks on devices]: CUDA tensors over a CPU backend go through host memory.
  comm_ = distributed::for_device(comm_, options_.device);
  std::shared_ptr<distributed::Comm> dp =
      options_.dp ? distributed::for_device(options_.dp, options_.device) : nullptr;

  StageHooks hooks = options_.hooks;
  if (options_.recompute_sessions)
    hooks = nest(hooks, recompute_hooks(options_.prefetch_recompute, number_));
  if (dp) {
    // Data parallelism across copies of the pipeline: every copy averages
    // its stages' gradients over dp as soon as each stage has run its last
    // microbatch (NOTE [Gradient reduction in the cool-down]).
    std::map<int, std::vector<torch::Tensor>> stage_params;
    for (const auto& [st, mod] : modules) {
      const auto& chunk = chunks.at(sched_.stage_chunk[st]);
      std::vector<torch::Tensor> plain;
      for (const auto& t : chunk.dp_parameters ? *chunk.dp_parameters : mod.parameters) {
        bool expert = false;
        for (const auto& e : chunk.expert_parameters)
          expert = expert || e.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
        if (!expert) plain.push_back(t);
      }
      stage_params[st] = plain;
    }
    reducer_ =
        std::make_unique<GradientReducer>(dp, stage_params, microbatches_per_stage(sched_, rank_),
                                          stages_by_last_backward(sched_, rank_));
    StageHooks reduce;
    reduce.on_done = [r = reducer_.get()](int st, int mb) { r->on_done(st, mb); };
    hooks = nest(reduce, hooks);  // the reduction starts after the caller's on_done
  }
  options_.dp = dp;
  for (const auto& [c, chunk] : chunks)
    for (const auto& t : chunk.expert_parameters) {
      bool seen = false;
      for (const auto& u : experts_)
        seen = seen || u.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
      if (!seen) experts_.push_back(t);
    }
  // The step's loss is the mean over its microbatches (NOTE [The loss scale
  // is the backward's seed] in hp/pipeline/stage.cpp).
  stage_ = std::make_unique<PipelineStage>(std::move(modules), std::move(loss), hooks,
                                           1.0 / sched_.num_microbatches);
  ExecutorOptions eo;
  eo.input = options_.input;
  eo.input_message = options_.input_message;
  eo.layout = options_.layout;
  eo.activation_shape = options_.activation_shape;
  eo.first_frame_bytes = options_.first_frame_bytes;
  eo.dtype = options_.dtype;
  eo.device = options_.device;
  eo.receive_lookahead = options_.receive_lookahead;
  eo.cache_cpu_memory = options_.cache_cpu_memory;
  eo.fb_overlap = options_.fb_overlap;
  eo.defer_wgrad = options_.defer_wgrad;
  eo.pair_first_ready = options_.pair_first_ready;
  eo.deferred_w_parts = options_.deferred_w_parts;
  eo.pair_function = options_.pair_function;
  try {
    executor_ = std::make_unique<Executor>(sched_, rank_, *stage_, comm_, std::move(eo));
  } catch (...) {
    failed = std::current_exception();
  }
  learn_holders(named, names_held, *distributed::for_device(group, on), on, failed);
}

Pipeline::~Pipeline() {
  // The executor's helper thread uses the stages: it goes first.
  executor_.reset();
  reducer_.reset();
  stage_.reset();
}

void Pipeline::learn_holders(const std::map<std::string, std::vector<torch::Tensor>>& local,
                             const std::vector<std::vector<int64_t>>& counts,
                             distributed::Comm& group, const torch::Device& on,
                             std::exception_ptr failed) {
  // Who holds what: every rank's name hashes, in one all-gather of a list
  // padded to the longest (each rank's length came with the agreement),
  // behind whether the rank made its executor (a peer that could not must
  // not be waited for at the first step).
  const int n = group.world_size();
  int64_t longest = 0;
  for (const auto& c : counts)
    longest = std::max(longest, c.at(0));
  std::vector<int64_t> mine(static_cast<size_t>(longest) + 1, -1);
  mine[0] = failed ? 1 : 0;
  size_t k = 1;
  for (const auto& [name, list] : local)
    mine[k++] = name_hash(name);
  const int64_t width = static_cast<int64_t>(mine.size());
  auto all = torch::empty({n * width}, torch::TensorOptions().dtype(torch::kLong).device(on));
  group.all_gather(all, torch::tensor(mine, torch::kLong).to(on));
  all = all.cpu();
  const int64_t* row = all.data_ptr<int64_t>();
  if (failed) std::rethrow_exception(failed);
  for (int r = 0; r < n; ++r)
    if (row[r * width] != 0)
      invalid("rank " + std::to_string(rank_) + ": rank " + std::to_string(r) +
              " could not make its executor (its own error says why); no rank starts");
  std::map<int64_t, std::set<int>> by_hash;
  for (int r = 0; r < n; ++r)
    for (int64_t j = 0; j < counts[r].at(0); ++j)
      by_hash[row[r * width + 1 + j]].insert(r);
  for (const auto& [name, list] : local) {
    const auto& ranks = by_hash.at(name_hash(name));
    holders_[name] = ranks;
    if (ranks.size() > 1 || list.size() > 1)
      replicas_.push_back(Replica{list, std::vector<int>(ranks.begin(), ranks.end())});
  }
}

// Replicas (DualPipe's mirrored chunks, a tied head): every copy's gradient
// becomes the sum over all copies, added in rank order so the copies get the
// same bits and stay identical (distributed::sum_among_holders).
void Pipeline::sum_replica_gradients() {
  if (replicas_.empty()) return;
  std::vector<torch::Tensor> sums;
  std::vector<std::vector<int>> ranks;
  for (const auto& r : replicas_) {
    torch::Tensor sum;
    for (const auto& t : r.local) {
      torch::Tensor g = t.grad().defined() ? t.grad() : torch::zeros_like(t);
      sum = sum.defined() ? sum + g : g.clone();
    }
    sums.push_back(sum);
    ranks.push_back(r.ranks);
  }
  distributed::sum_among_holders(*comm_, sums, ranks);
  for (size_t i = 0; i < replicas_.size(); ++i)
    for (const auto& t : replicas_[i].local) {
      torch::Tensor p = t;
      p.mutable_grad() = replicas_[i].local.size() > 1 ? sums[i].clone() : sums[i];
    }
}

// NOTE [Expert gradients]
// Expert parallelism is carved out of data parallelism (as torchtitan does):
// the ranks of an EP group run the same stages on their own parts of the
// global batch, and each holds other experts of every MoE layer. The plain
// parameters are copies, averaged over the data-parallel group (`dp`, which
// is the EP group or holds it) as always. An expert's gradient is different:
// its rank received the rows of every rank of the group that routed tokens
// to it, so after the step's backward it already holds the sum over the
// group's losses; averaging it over `dp` would mix other experts in. It is
// divided by the group's size instead, which makes it the gradient of the
// global batch's mean loss, as one process computes it. Where `dp` holds
// several EP groups (PipelineOptions::expert_dp: the EP group is smaller),
// each expert is held once in every EP group and its holder saw only its
// own group's rows: the holders' gradients are summed over `expert_dp` (one
// all-reduce of them all, an expert no token reached counting zeros), then
// divided by `dp`'s size, the copies that computed the global batch.
void Pipeline::scale_expert_gradients() {
  if (experts_.empty() || !options_.dp || options_.dp->world_size() == 1) return;
  if (options_.expert_dp && options_.expert_dp->world_size() > 1) {
    std::vector<torch::Tensor> grads;
    for (const auto& t : experts_) {
      if (!t.grad().defined()) t.mutable_grad() = torch::zeros_like(t);
      grads.push_back(t.grad().reshape({-1}));
    }
    auto flat = torch::cat(grads);
    options_.expert_dp->all_reduce(flat);
    int64_t at = 0;
    for (const auto& t : experts_) {
      t.grad().copy_(flat.narrow(0, at, t.numel()).view_as(t));
      at += t.numel();
    }
  }
  const double n = options_.dp->world_size();
  for (const auto& t : experts_)
    if (t.grad().defined()) t.grad().div_(n);
}

void Pipeline::clear_recompute_sessions() {
  if (!options_.recompute_sessions) return;
  for (int st : sched_.stages_of_rank(rank_))
    for (int mb = 0; mb < sched_.num_microbatches; ++mb)
      recompute::clear_session(session_id(number_, st, mb));
}

void Pipeline::set_pair_function(std::function<void(PairCall&)> fn) {
  options_.pair_function = fn;
  if (executor_) executor_->set_pair_function(std::move(fn));
}

void Pipeline::check_ready_turns(bool pair_first_ready) const {
  if (pair_first_ready && options_.dp &&
      distributed::lane_count(*options_.dp) < distributed::kPairLanes)
    invalid(
        "ready turns (pair_first_ready) post by timing, which the data-parallel group of a "
        "Pipeline made with fixed turns cannot take (it has no lanes): make the Pipeline "
        "with pair_first_ready");
}

void Pipeline::set_deferred_w(bool defer_wgrad, bool pair_first_ready) {
  PipelineOptions o = options_;
  o.defer_wgrad = defer_wgrad;
  o.pair_first_ready = pair_first_ready;
  check_deferred_w(o);
  check_ready_turns(pair_first_ready);
  options_ = std::move(o);
  if (executor_) executor_->set_deferred_w(defer_wgrad, pair_first_ready);
}

// NOTE [The deferred W's chosen in the run]
// With fb_overlap a pair's W's may defer (NOTE [Weight gradients in the
// waits] in overlap.cpp): they fill the waits where the W's fit in them, and
// hold their microbatches' activations until they run. Which way is faster
// cannot be told from the schedule alone (NOTE [Deferred W's where they
// lower the step] in hp/schedule/simulate.cpp), so a run decides from its
// own step: `hp train --fb-overlap` after its second step (the first warms
// the allocator and the connections; `--defer-wgrad auto`, the default),
// Python's Pipeline(fb_overlap=True) the same (defer_wgrad="auto", the
// default). Every rank of the pipeline's group sends its events of that
// step to rank 0, which fits the stage costs to them as the report does
// (costs_from_timeline, with one transfer's measured latency: under a link
// model the link's) and simulates the schedule both ways
// (schedule::choose_deferred_w). On when the predicted step is the gain
// (kDeferredWGain) shorter; the turns then become fixed where "auto" turns
// would take them with deferred W's. Where a W of the step recomputed on
// any rank (DeferredWAuto::recomputes), ready turns with deferred W's are
// refused as hp train refuses them (NOTE [Turns as messages arrive] in
// overlap.cpp): the answer is off. Rank 0's answer goes to the group,
// then that of `dp`'s rank 0 (copy 0 in hp train's mesh) to every copy, so
// the peers of an expert-parallel group keep posting alike. Each copy
// gathers and simulates its own step (one gather per run) rather than copy
// 0's alone: a user's groups need not place one copy's ranks at rank 0 of
// every `dp` group.
schedule::DeferredWChoice Pipeline::choose_deferred_w(const StepStats& last,
                                                      const DeferredWAuto& how) {
  schedule::check_deferred_w_gain(how.gain);  // on every rank, before any communication
  if (!sched_.has_pairs() || !options_.fb_overlap || options_.defer_wgrad) return {};
  const bool cpu = options_.device.is_cpu();
  const bool ready_with = cpu && schedule::pair_turns_ready(how.pair_turns, true);
  check_ready_turns(ready_with);
  const torch::TensorOptions on =
      torch::TensorOptions().dtype(torch::kFloat64).device(options_.device);
  double comm_cost = how.comm_cost;
  if (comm_cost < 0.0 && comm_->world_size() > 1) {
    // The link as the step's messages meet it: a probe of the largest one.
    auto bytes = torch::tensor({double(last.largest_message_bytes)}, on);
    comm_->all_reduce(bytes, distributed::ReduceOp::Max);
    const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(bytes.item<double>()));
    comm_cost = distributed::one_way_latency(
        *comm_, 0, 1,
        torch::empty({n}, torch::TensorOptions().dtype(torch::kUInt8).device(options_.device)));
  }
  bool recompute = how.recomputes.value_or(options_.recompute_sessions);
  if (how.recomputes && comm_->world_size() > 1) {  // any rank's
    auto any = torch::tensor({recompute ? 1.0 : 0.0}, on);
    comm_->all_reduce(any, distributed::ReduceOp::Max);
    recompute = any.item<double>() > 0.5;
  }
  const schedule::Timeline timeline =
      gather_step_timeline(last, *comm_, "the step that chose deferred W's", options_.device);
  auto numbers = torch::zeros({5}, on);
  if (rank_ == 0) {
    schedule::CostModel costs =
        schedule::costs_from_timeline(sched_, timeline, std::max(0.0, comm_cost));
    if (how.adjust) how.adjust(costs);
    const schedule::DeferredWChoice c =
        schedule::choose_deferred_w(sched_, costs, how.pair_turns, cpu, recompute, how.gain);
    numbers = torch::tensor(
        {c.defer ? 1.0 : 0.0, c.step_without, c.step_with, c.peak_without, c.peak_with}, on);
  }
  comm_->broadcast(numbers, 0);
  if (options_.dp) options_.dp->broadcast(numbers, 0);
  const auto n = numbers.cpu();
  const double* v = n.data_ptr<double>();
  schedule::DeferredWChoice out{v[1], v[2], v[3], v[4], v[0] > 0.5};
  if (out.defer) set_deferred_w(true, ready_with);
  return out;
}

PipelineStep Pipeline::step() {
  if (broken())
    throw std::runtime_error(
        "a previous step failed on this rank (" + broken_reason_ +
        "); its microbatches are half done and the group may be broken: make a new Pipeline "
        "(and, after a communication error, a new process group)");
  PipelineStep out;
  bool owner_began = false;  // before_step returned: after_step is owed
  try {
    if (options_.before_step) options_.before_step();
    owner_began = true;
    if (reducer_) reducer_->begin_step();
    out.stats = executor_->run_step();
    if (reducer_) reducer_->finish_step();
    scale_expert_gradients();
    sum_replica_gradients();
    owner_began = false;
    if (options_.after_step) options_.after_step(true);
    // The loss (and the extra sum) over the pipeline's ranks, then the mean
    // over the copies and the loss groups: one collective each.
    const double extra = options_.extra_sum ? options_.extra_sum() : 0.0;
    auto sums = torch::tensor({out.stats.loss_sum, extra}, torch::kFloat64);
    comm_->all_reduce(sums);
    if (options_.dp) options_.dp->all_reduce(sums, distributed::ReduceOp::Avg);
    for (const auto& g : options_.loss_groups) {
      // NCCL's groups (FSDP2's on GPUs) take device tensors.
      auto t = g->backend_name() == "nccl" ? sums.to(options_.device) : sums;
      g->all_reduce(t, distributed::ReduceOp::Avg);
      sums = t.cpu();
    }
    out.loss = sums[0].item<double>();
    out.extra = sums[1].item<double>();
    out.dp_exposed = reducer_ ? reducer_->exposed_seconds() : 0.0;
  } catch (const std::exception& e) {
    clear_recompute_sessions();
    if (owner_began && options_.after_step) {
      try {
        options_.after_step(false);
      } catch (...) {  // the step's error is the one to report
      }
    }
    std::string why = e.what();
    if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e))
      why = c10_error->what_without_backtrace();
    // The data-parallel copies (and expert-parallel peers, waiting in an
    // all-to-all over the same group) learn of it as the pipeline's do.
    if (options_.dp)
      options_.dp->abandon("rank " + std::to_string(options_.dp->rank()) +
                           " of the data-parallel "
                           "group (pipeline rank " +
                           std::to_string(rank_) + ") failed its step: " + why.substr(0, 300));
    broken_reason_ = why.size() > 200 ? why.substr(0, 200) + "..." : why;
    if (broken_reason_.empty()) broken_reason_ = "unknown error";
    throw;
  }
  return out;
}

}  // namespace hp::pipeline
