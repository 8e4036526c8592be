// ProcessGroupComm: Comm over any c10d::ProcessGroup (Gloo, NCCL, ...), using
// ProcessGroup.hpp only: tag-free point-to-point, batches (coalesced where
// the backend coalesces), collectives, subgroups, stream-ordered waits on
// NCCL's CUDA work, and the translation of the backend's errors into
// CommError (naming a lost peer when we can).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>

#include "hp/core/compat.h"
#include "hp/distributed/comm.h"
#include "hp/distributed/comm_internal.h"

namespace hp::distributed {
namespace {

using detail::check_tensor;

std::string message_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown error";
  }
}

bool contains(const std::string& s, const char* sub) {
  return s.find(sub) != std::string::npos;
}

std::string seconds(std::chrono::milliseconds t) {
  std::ostringstream os;
  os << double(t.count()) / 1000.0 << " s";
  return os.str();
}

// The point-to-point tag every message carries (NOTE [Point-to-point without
// tags]): matching is by order alone, as on NCCL.
constexpr int kTag = 0;

class ProcessGroupComm;

// A pending operation: c10d's Work waited with our timeout, or in stream
// order (NOTE [Stream-ordered waits] in comm.h); failures become CommError.
// Ops of one coalesced batch share one c10d Work.
struct PgWork : Work::Impl {
  std::shared_ptr<const ProcessGroupComm> comm;
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<at::Tensor> tensors;  // keep the buffers alive until the wait
  std::string what;
  int peer = -1;
  bool stream_ordered = false;  // NCCL over CUDA tensors
  void wait() override;
  bool blocks_host() const override { return !stream_ordered; }
  // c10d's isCompleted: NCCL's answers from its events; Gloo's point-to-point
  // completes only in its wait, so false there means "cannot tell".
  std::optional<bool> test() const override {
    if (work->isCompleted()) return true;
    if (stream_ordered) return false;
    return std::nullopt;
  }
  void abort() override;
};

class ProcessGroupComm : public Comm, public std::enable_shared_from_this<ProcessGroupComm> {
 public:
  /// What the groups split from one root share.
  struct Shared {
    c10::intrusive_ptr<c10d::Store> store;  // the root store; null for a borrowed group
    detail::GlooEndpoint endpoint;
    std::shared_ptr<detail::PeerMonitor> monitor;  // over the root's ranks; may be null
    std::mutex mu;
    std::map<std::string, int> split_counts;
    std::atomic<bool> broken{false};  // a CommError was thrown (NOTE [A broken group is kept])
  };

  ProcessGroupComm(std::shared_ptr<Shared> shared, c10::intrusive_ptr<c10d::ProcessGroup> pg,
                   std::vector<int> root_ranks, const CommOptions& options)
      : shared_(std::move(shared)),
        pg_(std::move(pg)),
        rank_(pg_->getRank()),
        root_ranks_(std::move(root_ranks)),
        options_(options),
        backend_(pg_->getBackendName()) {
    TORCH_CHECK(int(root_ranks_.size()) == pg_->getSize(), "internal: ", root_ranks_.size(),
                " root ranks for a group of ", pg_->getSize());
  }

  // NOTE [A broken group is kept]
  // c10d's ProcessGroupGloo destructor waits for the collectives still in
  // its queue, up to the timeout. After a failure (a peer stopped or gone,
  // a timeout) one may still be there, blocked on the peer: a rank that
  // failed then spent the whole timeout unwinding before it could report
  // (a stopped peer: 30 s after a failure found in 2). The groups of a root
  // whose operation failed are therefore never destroyed: the process is
  // about to end (NOTE [A failed rank exits at once]), and a Comm is broken
  // after a CommError anyway.
  ~ProcessGroupComm() override {
    if (shared_->broken) new c10::intrusive_ptr<c10d::ProcessGroup>(std::move(pg_));  // kept
  }

  int rank() const override { return rank_; }
  int world_size() const override { return int(root_ranks_.size()); }
  std::chrono::milliseconds timeout() const override { return options_.timeout; }
  std::string backend_name() const override { return backend_; }
  bool early_receives_are_free() const override { return backend_ == "gloo"; }

  Work isend(const at::Tensor& tensor, int dst) override {
    auto w = post(P2POp::send(tensor, dst));
    return p2p_work(std::move(w), {tensor}, describe(P2POp::send(tensor, dst)), dst);
  }

  Work irecv(const at::Tensor& tensor, int src) override {
    auto w = post(P2POp::recv(tensor, src));
    return p2p_work(std::move(w), {tensor}, describe(P2POp::recv(tensor, src)), src);
  }

  std::vector<Work> batch(const std::vector<P2POp>& ops) override {
    if (ops.empty()) return {};
    const c10::DeviceType device =
        ops[0].tensor.defined() ? ops[0].tensor.device().type() : c10::DeviceType::CPU;
    if (!coalesces(device)) return Comm::batch(ops);
    // One coalesced group: every op is in flight together, and one Work
    // completes them all.
    std::vector<at::Tensor> keep;
    std::string what = "a batch of " + std::to_string(ops.size()) + " operations (";
    for (size_t i = 0; i < ops.size(); ++i)
      what += (i ? ", " : "") + describe(ops[i]);
    what += ")";
    c10::intrusive_ptr<c10d::Work> work;
    try {
      pg_->startCoalescing(device);
      for (const auto& op : ops) {
        post(op);
        keep.push_back(op.tensor);
      }
      work = pg_->endCoalescing(device);
    } catch (const CommError&) {
      throw;
    } catch (...) {
      fail(what, -1, std::current_exception());
    }
    auto impl = p2p_impl(work, std::move(keep), what, -1);
    impl->stream_ordered = stream_ordered(device);
    return std::vector<Work>(ops.size(), Work(impl));
  }

  void all_reduce(const at::Tensor& tensor, ReduceOp op) override {
    check_tensor(tensor, "all_reduce");
    TORCH_CHECK(op != ReduceOp::Avg || at::isFloatingType(tensor.scalar_type()),
                "all_reduce: Avg needs a floating dtype, got ", tensor.scalar_type());
    c10d::AllreduceOptions o;
    o.reduceOp = op == ReduceOp::Max   ? c10d::ReduceOp::MAX
                 : op == ReduceOp::Min ? c10d::ReduceOp::MIN
                                       : c10d::ReduceOp::SUM;  // Avg: sum, then divide
    std::vector<at::Tensor> v{tensor};
    run(
        "all_reduce of " + std::to_string(tensor.numel()) + " elements",
        [&] { return pg_->allreduce(v, o); }, tensor);
    if (op == ReduceOp::Avg) tensor.div_(world_size());
  }

  void all_gather(std::vector<at::Tensor>& out, const at::Tensor& in) override {
    check_tensor(in, "all_gather (input)");
    TORCH_CHECK(int(out.size()) == world_size(), "all_gather: ", out.size(),
                " output tensors for a group of ", world_size(), " ranks");
    for (auto& t : out) {
      check_tensor(t, "all_gather (output)");
      TORCH_CHECK(t.numel() == in.numel() && t.scalar_type() == in.scalar_type(),
                  "all_gather: every output must have the input's numel (", in.numel(),
                  ") and dtype (", in.scalar_type(), ")");
    }
    std::vector<std::vector<at::Tensor>> outputs{out};
    std::vector<at::Tensor> inputs{in};
    run(
        "all_gather of " + std::to_string(in.numel()) + " elements",
        [&] { return pg_->allgather(outputs, inputs); }, in);
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    check_tensor(tensor, "broadcast");
    TORCH_CHECK(root >= 0 && root < world_size(), "broadcast: root ", root,
                " is not a rank of this group (0..", world_size() - 1, ")");
    c10d::BroadcastOptions o;
    o.rootRank = root;
    std::vector<at::Tensor> v{tensor};
    run(
        "broadcast from rank " + std::to_string(root), [&] { return pg_->broadcast(v, o); },
        tensor);
  }

  // NOTE [ProcessGroup::barrier is not thread-safe]
  // c10d::ProcessGroup::barrier (torch 2.6 to 2.11 at least) keeps its
  // one-byte tensor in a function-local `static at::Tensor` and assigns it
  // on every call without a lock, so two groups' barriers on two threads
  // (ranks as threads in the tests; a rank's groups on several threads)
  // race on that tensor's refcount and corrupt the heap: crashes in later,
  // unrelated allocations. The backend's own barrier keeps no such state.
  void barrier() override {
    run(
        "barrier", [&] { return pg_->getDefaultBackend()->barrier(c10d::BarrierOptions()); },
        at::Tensor());
  }

  std::shared_ptr<Comm> split(const std::vector<int>& ranks) override {
    TORCH_CHECK(!ranks.empty(), "split: the list of ranks is empty");
    int my = -1;
    std::vector<int> roots;
    std::string name;
    for (size_t i = 0; i < ranks.size(); ++i) {
      TORCH_CHECK(ranks[i] >= 0 && ranks[i] < world_size(), "split: rank ", ranks[i],
                  " is not in this group of ", world_size());
      TORCH_CHECK(i == 0 || ranks[i] > ranks[i - 1], "split: ranks must be sorted and unique");
      if (ranks[i] == rank_) my = int(i);
      roots.push_back(root_ranks_[ranks[i]]);
      name += (i ? "," : "") + std::to_string(roots.back());
    }
    TORCH_CHECK(my >= 0, "split: this rank (", rank_, ") is not in the list; only members call it");
    int n;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      n = shared_->split_counts[name]++;
    }
    try {
      c10::intrusive_ptr<c10d::ProcessGroup> sub;
      if (shared_->store) {
        // Our own rendezvous: a fresh Gloo group over a prefix of the root store.
        auto store = c10::make_intrusive<c10d::PrefixStore>(
            "hp/group/" + name + "/" + std::to_string(n), shared_->store);
        sub = detail::make_agreed_gloo_group(store, my, int(ranks.size()), shared_->endpoint,
                                             options_.timeout);
      } else {
        sub = compat::split_process_group(*pg_, ranks, options_.timeout, borrowed_split_name(name));
      }
      return std::make_shared<ProcessGroupComm>(shared_, sub, roots, options_);
    } catch (const std::exception& e) {
      throw CommError("rank " + std::to_string(rank_) + ": creating the subgroup {" + name +
                          "} failed (do all its members call split with the same list?): " +
                          message_of(std::current_exception()),
                      {}, false);
    }
  }

  // NOTE [Names of borrowed groups' splits]
  // c10d names a split's rendezvous after the name it is given, in the
  // parent's store. Our own counter (split_counts) lives with one Comm, and a
  // program may borrow one group for several Comms (a Pipeline per model,
  // one after the other) and different groups with the same member ranks
  // (the pipelines of a data-parallel mesh, each over its ranks 0..p-1):
  // with "hp/<ranks>/<n>" alone those splits would meet under one name. So
  // the name carries the parent's group name (c10d's, unique in the job and
  // equal on its members) and a count of this process's splits of that
  // parent, which the members agree on because splitting is collective.
  // (Unique names did not cure the hang of NOTE [Overflow of a borrowed
  // group] in shm_p2p.cpp.)
  std::string borrowed_split_name(const std::string& members) const {
    static std::mutex mu;
    static std::map<std::string, int> made;
#if HP_TORCH_AT_LEAST(2, 8)
    const std::string parent = pg_->getGroupName() + "/" + members;
#else
    const std::string parent = members;  // compat::split_process_group refuses before 2.8
#endif
    int n;
    {
      std::lock_guard<std::mutex> lock(mu);
      n = made[parent]++;
    }
    return "hp/" + parent + "/" + std::to_string(n);
  }

  /// Builds and throws the CommError for a failed `what` (see NOTE [Naming the lost peer]).
  [[noreturn]] void fail(const std::string& what, int peer, std::exception_ptr e) const {
    shared_->broken = true;
    std::string msg = message_of(e);
    bool timed_out = contains(msg, "imed out") || contains(msg, "imeout");
    bool closed = contains(msg, "losed") || contains(msg, "reset") || contains(msg, "EOF") ||
                  contains(msg, "roken pipe") || contains(msg, "onnection");
    std::vector<int> lost;
    if (shared_->monitor) {
      auto lost_root = shared_->monitor->lost_ranks(closed ? std::chrono::milliseconds(2000)
                                                           : std::chrono::milliseconds(0));
      for (int g : lost_root)
        for (size_t i = 0; i < root_ranks_.size(); ++i)
          if (root_ranks_[i] == g) lost.push_back(int(i));
    }
    // Name the peer of a p2p operation first when it is among the lost.
    for (size_t i = 0; i < lost.size(); ++i)
      if (lost[i] == peer) std::swap(lost[0], lost[i]);
    std::ostringstream os;
    os << "rank " << rank_ << ": ";
    if (!lost.empty()) {
      os << "lost connection to rank " << lost[0] << name_root(lost[0]);
      for (size_t i = 1; i < lost.size(); ++i)
        os << (i + 1 == lost.size() ? " and " : ", ") << lost[i];
      os << " (its process is gone) while " << what;
    } else if (timed_out) {
      os << "timed out after " << seconds(options_.timeout) << " while " << what
         << "; the peer is alive but did not take part (a mismatched schedule or message "
            "order?) or is too slow (raise the timeout)";
    } else {
      os << what << " failed";
    }
    os << " [" << backend_ << ": " << msg << "]";
    throw CommError(os.str(), lost, timed_out && lost.empty());
  }

 private:
  std::string name_root(int local) const {
    if (root_ranks_[local] == local && rank_ == root_ranks_[rank_]) return "";
    return " (global rank " + std::to_string(root_ranks_[local]) + ")";
  }

  bool coalesces(c10::DeviceType device) const {
    // Only NCCL needs (and implements) coalesced point-to-point; Gloo posts
    // each operation on its own and makes progress on all of them anyway.
    return backend_ == "nccl" && device == c10::DeviceType::CUDA;
  }
  // Whether NCCL's work on tensors of `device` is waited in stream order
  // (NOTE [Stream-ordered waits] in comm.h).
  bool stream_ordered(c10::DeviceType device) const {
    return backend_ == "nccl" && device == c10::DeviceType::CUDA;
  }
  bool stream_ordered(const at::Tensor& t) const {
    return t.defined() && stream_ordered(t.device().type());
  }

  void check_peer(int peer, const char* op) const {
    TORCH_CHECK(peer >= 0 && peer < world_size(), op, ": rank ", peer, " is not in this group of ",
                world_size(), " ranks");
    TORCH_CHECK(peer != rank_, op, ": rank ", rank_, " cannot ", op, " to/from itself");
  }

  static std::string describe(const P2POp& op) {
    std::ostringstream os;
    const at::Tensor& t = op.tensor;
    os << (op.kind == P2POp::Kind::Send ? "sending " : "receiving ")
       << (t.defined() ? t.numel() : 0) << " "
       << (t.defined() ? c10::toString(t.scalar_type()) : "undefined") << " elements "
       << (op.kind == P2POp::Kind::Send ? "to" : "from") << " rank " << op.peer;
    return os.str();
  }

  // Posts one operation (inside or outside a coalesced group).
  c10::intrusive_ptr<c10d::Work> post(const P2POp& op) {
    const bool send = op.kind == P2POp::Kind::Send;
    check_peer(op.peer, send ? "isend" : "irecv");
    check_tensor(op.tensor, send ? "isend" : "irecv");
    TORCH_CHECK(backend_ != "gloo" || op.tensor.device().is_cpu(), send ? "isend" : "irecv",
                ": Gloo's point-to-point needs CPU tensors, got one on ", op.tensor.device());
    std::vector<at::Tensor> v{op.tensor};
    try {
      return send ? pg_->send(v, op.peer, kTag) : pg_->recv(v, op.peer, kTag);
    } catch (...) {
      fail(describe(op), op.peer, std::current_exception());
    }
  }

  std::shared_ptr<PgWork> p2p_impl(c10::intrusive_ptr<c10d::Work> work,
                                   std::vector<at::Tensor> tensors, std::string what, int peer) {
    auto impl = std::make_shared<PgWork>();
    impl->comm = shared_from_this();
    impl->work = std::move(work);
    impl->tensors = std::move(tensors);
    impl->what = std::move(what);
    impl->peer = peer;
    return impl;
  }
  Work p2p_work(c10::intrusive_ptr<c10d::Work> work, std::vector<at::Tensor> tensors,
                std::string what, int peer) {
    const bool ordered = stream_ordered(tensors.empty() ? at::Tensor() : tensors[0]);
    auto impl = p2p_impl(std::move(work), std::move(tensors), std::move(what), peer);
    impl->stream_ordered = ordered;
    return Work(impl);
  }

  // A collective over `tensor` (undefined: none, e.g. a barrier), waited on
  // the host with the timeout, or in stream order for NCCL over CUDA tensors:
  // the result is then ready for whatever the caller's stream runs next.
  template <typename F>
  void run(const std::string& what, F&& start, const at::Tensor& tensor) {
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = start();
      if (stream_ordered(tensor)) {
        work->wait();  // kNoTimeout: orders the current stream, returns at once
        return;
      }
    } catch (...) {
      fail(what, -1, std::current_exception());
    }
    if (!wait_on_host(*work, what, -1))
      throw CommError("rank " + std::to_string(rank_) + ": " + what + " was aborted", {}, false);
  }

 public:
  /// Waits for `work` on the host within the timeout: true when it completed,
  /// false when Work::abort woke it; a failure throws CommError. With a
  /// PeerMonitor that sees peers on this host, a stopped peer fails the wait
  /// (NOTE [A stopped peer] in comm_internal.h): a point-to-point wait
  /// (`peer` >= 0) through abort, a collective's in slices.
  bool wait_on_host(c10d::Work& work, const std::string& what, int peer) const {
    detail::PeerMonitor* monitor = shared_->monitor.get();
    try {
      if (monitor == nullptr || !monitor->watches()) return work.wait(options_.timeout);
      if (peer >= 0) {
        if (!monitor->enter(&work)) stopped(what, monitor->stopped_peer());
        bool done = false;
        try {
          done = work.wait(options_.timeout);
        } catch (...) {
          monitor->leave(&work);
          throw;
        }
        monitor->leave(&work);
        if (!done && monitor->stopped_peer() >= 0) stopped(what, monitor->stopped_peer());
        return done;
      }
      const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
      for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        const auto slice = std::min(left, std::chrono::milliseconds(200));
        try {
          return work.wait(std::max(slice, std::chrono::milliseconds(1)));
        } catch (...) {
          // Gloo's collectives keep running past a wait that times out.
          if (work.isCompleted() || left <= std::chrono::milliseconds(200)) throw;
        }
        const int s = monitor->stopped_peer();
        if (s >= 0) stopped(what, s);
      }
    } catch (const CommError&) {
      throw;
    } catch (...) {
      fail(what, peer, std::current_exception());
    }
  }

 private:
  /// Throws the CommError of a stopped peer (`root`: its rank in the root group).
  [[noreturn]] void stopped(const std::string& what, int root) const {
    shared_->broken = true;
    std::vector<int> lost;
    std::string who = "global rank " + std::to_string(root);
    for (size_t i = 0; i < root_ranks_.size(); ++i)
      if (root_ranks_[i] == root) {
        lost.push_back(int(i));
        who = "rank " + std::to_string(i) + name_root(int(i));
      }
    throw CommError("rank " + std::to_string(rank_) + ": " +
                        detail::stopped_peer_text(who, shared_->monitor->remote(root)) + " while " +
                        what,
                    lost, false);
  }

  std::shared_ptr<Shared> shared_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int rank_;
  std::vector<int> root_ranks_;
  CommOptions options_;
  std::string backend_;
};

void PgWork::wait() {
  try {
    if (stream_ordered) {
      // NOTE [Stream-ordered waits]: without a timeout, WorkNCCL::wait makes
      // the current stream wait for NCCL's and returns; with one it would spin
      // on the host until the transfer is done.
      work->wait();
    } else if (!comm->wait_on_host(*work, what, peer)) {
      // Work::abort() woke the wait (NOTE [A failed step reaches the peers]).
      throw CommError("rank " + std::to_string(comm->rank()) + ": " + what + " was aborted", {},
                      false);
    }
  } catch (const CommError&) {
    throw;
  } catch (...) {
    comm->fail(what, peer, std::current_exception());
  }
  tensors.clear();
}

// Gloo's SendWork and RecvWork wake their wait through the transport's
// UnboundBuffer (abortWaitSend/abortWaitRecv): the wait returns false, the
// group's connections stay as they are. Other backends' abort tears down the
// whole communicator (NCCL) or is not implemented: left alone.
void PgWork::abort() {
  if (stream_ordered || comm->backend_name() != "gloo") return;
  try {
    work->abort();
  } catch (...) {
    // A Work that cannot be aborted waits for its timeout, as before.
  }
}

std::vector<int> iota(int n) {
  std::vector<int> v(n);
  for (int r = 0; r < n; ++r)
    v[r] = r;
  return v;
}

}  // namespace

namespace detail {

std::shared_ptr<Comm> gloo_comm_over_store(c10::intrusive_ptr<c10d::Store> store, int rank,
                                           int world_size, const GlooEndpoint& endpoint,
                                           const CommOptions& options) {
  // NOTE [Flight recorder off by default]
  // torch's flight recorder (a process-wide ring of every collective, for
  // post-mortem dumps) records each Gloo operation and, in torch 2.11, updates
  // its map of groups outside its lock: groups used from several threads
  // at once (ranks as threads) loop forever or corrupt it. Our groups keep
  // it off unless TORCH_FR_BUFFER_SIZE is set; it must be set before torch
  // makes its first group, which is why it is set here (the Python binding
  // and a group handed to hyperparallel.Pipeline keep the user's setting).
  static const bool fr_default = ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0) == 0;
  (void)fr_default;
  store->setTimeout(options.timeout);
  auto shared = std::make_shared<ProcessGroupComm::Shared>();
  shared->store = store;
  shared->endpoint = endpoint;
  std::shared_ptr<Comm> comm;
  try {
    auto pg = make_agreed_gloo_group(c10::make_intrusive<c10d::PrefixStore>("hp/group/all", store),
                                     rank, world_size, endpoint, options.timeout);
    comm = std::make_shared<ProcessGroupComm>(shared, pg, iota(world_size), options);
    shared->monitor =
        std::make_shared<PeerMonitor>(store, rank, world_size, endpoint.address, options.timeout);
  } catch (const CommError&) {
    throw;
  } catch (...) {
    // Only a rendezvous that ran out of time says so (a Python that could
    // not start or import torch is no timeout).
    const std::string msg = message_of(std::current_exception());
    const bool timed_out = contains(msg, "imeout") || contains(msg, "imed out");
    throw CommError("rank " + std::to_string(rank) + ": rendezvous of " +
                        std::to_string(world_size) + " ranks " +
                        (timed_out ? "did not complete within " + seconds(options.timeout) +
                                         " (are all ranks started, with the same WORLD_SIZE "
                                         "and master?)"
                                   : std::string("failed")) +
                        ": " + msg,
                    {}, timed_out);
  }
  return comm;
}

}  // namespace detail

std::shared_ptr<Comm> Comm::from_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                               const CommOptions& options) {
  TORCH_CHECK(group, "from_process_group: the process group is null");
  const int size = group->getSize();
  auto shared = std::make_shared<ProcessGroupComm::Shared>();
  return std::make_shared<ProcessGroupComm>(shared, std::move(group), iota(size), options);
}

std::shared_ptr<Comm> Comm::from_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                               const CommOptions& options,
                                               c10::intrusive_ptr<c10d::Store> monitor_store) {
  TORCH_CHECK(group, "from_process_group: the process group is null");
  const int size = group->getSize();
  auto shared = std::make_shared<ProcessGroupComm::Shared>();
  if (monitor_store && size > 1) {
    shared->monitor = std::make_shared<detail::PeerMonitor>(
        c10::make_intrusive<c10d::PrefixStore>("hp/monitor", monitor_store), group->getRank(), size,
        detail::monitor_address(options), options.timeout);
    // NOTE [Splits of a borrowed group]
    // c10d's own split of a group Python made (splitGroup) hung in Gloo's
    // connect on one rank while its peer had finished it (NOTE [Overflow of
    // a borrowed group] in shm_p2p.cpp; again for the lanes of an expert
    // group, 1 run in 2). With a store the ranks share, the splits are
    // ours: a Gloo group over a prefix of it, its connect agreed (NOTE [A
    // Gloo group's connect, agreed] in gloo_group.cpp), as a root's are.
    if (group->getBackendName() == "gloo") {
      shared->store = c10::make_intrusive<c10d::PrefixStore>("hp/splits", monitor_store);
      shared->endpoint.address = detail::monitor_address(options);
    }
  }
  return std::make_shared<ProcessGroupComm>(shared, std::move(group), iota(size), options);
}

}  // namespace hp::distributed
