// hp/distributed's public face: `Comm`, a narrow communication interface over
// any c10d ProcessGroup (tag-free point-to-point matched in posting order,
// batches, collectives, subgroups, one timeout on everything), its `Work`
// handle, and rendezvous (torchrun's variables, a TCPStore or a FileStore).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace hp::distributed {

/// Reductions offered by `all_reduce` and `reduce_scatter`.
enum class ReduceOp { Sum, Avg, Max, Min };

/// How a `Comm` is made and how long it waits.
struct CommOptions {
  /// Applied to every operation (each wait, each collective, the rendezvous).
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  /// The local address Gloo binds to; empty picks one (see NOTE [Gloo device
  /// address]). Overridden by the HP_GLOO_ADDR environment variable.
  std::string bind_address;
  /// The network interface Gloo binds to (like GLOO_SOCKET_IFNAME, which is
  /// also honoured); wins over bind_address when set.
  std::string interface_name;
};

/// A failed or timed-out communication. `what()` names this rank, the
/// operation, the peer (for point-to-point) and, when a peer process is gone,
/// "lost connection to rank R while ...".
class CommError : public std::runtime_error {
 public:
  CommError(const std::string& message, std::vector<int> lost_ranks, bool timed_out)
      : std::runtime_error(message), lost_ranks_(std::move(lost_ranks)), timed_out_(timed_out) {}
  /// Ranks (of the Comm that failed) whose process is gone; empty if unknown or none.
  const std::vector<int>& lost_ranks() const { return lost_ranks_; }
  /// True when the operation ran into the timeout rather than a closed connection.
  bool timed_out() const { return timed_out_; }
  /// The same error with `context` put in front of the message (lost ranks and
  /// timeout kept): how a layer above says where the error reached it.
  CommError with_context(const std::string& context) const {
    return CommError(context + what(), lost_ranks_, timed_out_);
  }

 private:
  std::vector<int> lost_ranks_;
  bool timed_out_;
};

// NOTE [Stream-ordered waits]
// A Work over CPU tensors (Gloo, shared memory) is waited on the host: wait()
// returns when the data is there. A Work of NCCL over CUDA tensors is waited
// in stream order: wait() makes the calling thread's current CUDA stream wait
// for the transfer (NCCL runs it on its own stream; c10d orders the two with
// CUDA events) and returns at once, so what the thread enqueues next runs
// after the data arrived and the host never stops for it. (c10d's
// WorkNCCL::wait with a timeout would instead spin on the host until the
// transfer finished; without one it only orders the stream.) Such a wait
// cannot time out on the host: NCCL's watchdog aborts a transfer that
// exceeds the group's timeout, and a failure surfaces at the next host
// synchronization. `blocks_host()` says which kind a Work is, so that callers
// can count the points where the host waits (StepStats::host_syncs).

/// A pending asynchronous operation. `wait()` waits until it completes, for
/// at most the Comm's timeout, and throws `CommError` on failure; on the host,
/// or in stream order (NOTE [Stream-ordered waits]). Waiting twice is allowed
/// (the second returns at once or rethrows). The tensors given to the
/// operation must stay untouched until `wait()` returns (and, for a
/// stream-ordered Work, be used only by work enqueued after it).
class Work {
 public:
  /// The backend's side of a Work.
  struct Impl {
    virtual ~Impl() = default;
    virtual void wait() = 0;
    /// False when wait() only orders the caller's current device stream.
    virtual bool blocks_host() const { return true; }
    /// True when the operation completed when it was posted (wait() is free).
    virtual bool completed() const { return false; }
    /// Whether the operation has completed by now, asked without blocking
    /// (Work::test); nullopt where the backend cannot tell.
    virtual std::optional<bool> test() const { return std::nullopt; }
    /// Wakes a wait() in progress (or the next one), which then throws;
    /// from any thread. Where the backend cannot, does nothing.
    virtual void abort() {}
  };
  Work() = default;
  explicit Work(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  /// Waits until done (NOTE [Stream-ordered waits]); throws CommError (naming
  /// the peer and the operation).
  void wait();
  /// False for a default-constructed Work.
  bool valid() const { return impl_ != nullptr; }
  /// Whether wait() blocks the calling thread until the operation completed
  /// (true for CPU backends) or only orders its current device stream after
  /// it (NCCL over CUDA tensors).
  bool blocks_host() const { return impl_ != nullptr && impl_->blocks_host(); }
  /// Whether the operation is known to be complete: waited, or complete when
  /// posted (Work::done(), e.g. a send copied into a shared-memory ring).
  bool completed() const { return done_ || (impl_ != nullptr && impl_->completed()); }
  /// Whether a wait() now would return without waiting for the operation:
  /// asked without blocking, for an overlapped pair's deferred W's (NOTE
  /// [Weight gradients until the message is there] in
  /// hp/pipeline/overlap.cpp). nullopt where the backend cannot tell
  /// (Gloo's point-to-point before its wait); a Work that only orders a
  /// device stream answers for the transfer itself.
  std::optional<bool> test() const {
    if (completed()) return true;
    return impl_ != nullptr ? impl_->test() : std::nullopt;
  }
  /// Ends a wait() in progress on another thread (it throws CommError)
  /// where the backend can: Gloo's point-to-point (NOTE [A failed step
  /// reaches the peers]). Elsewhere does nothing.
  void abort() {
    if (impl_ != nullptr) impl_->abort();
  }
  /// A Work that is already complete.
  static Work done();

 private:
  std::shared_ptr<Impl> impl_;
  bool done_ = false;
};

// NOTE [A wait that lets a partner compute]
// DualPipe's overlap runs two halves of work (a forward and a backward of
// other microbatches) as partners on one CPU: when one half reaches a wait
// on communication (an expert all-to-all, a pipeline receive), the other
// half computes until it waits in turn (hp/pipeline/overlap.h). The hook is
// here, at the one place every wait passes: a thread may install a
// WaitObserver, whose before_wait runs as a Work's wait starts (it hands
// the CPU over) and after_wait as it ends, returned or thrown (it takes the
// CPU back). Every wait of such a thread calls both, even on a Work that has
// already completed: where the halves switch must depend on the code alone,
// never on timing, or two ranks of an expert-parallel group would post
// their exchanges in different orders. Waits made inside a wait (a batch's
// parts) do not call them again.

/// Told of every Work::wait() on the thread that installed it.
class WaitObserver {
 public:
  virtual ~WaitObserver() = default;
  /// The wait of `work` starts (`work` may be aborted from another thread).
  virtual void before_wait(const Work& work) = 0;
  /// The wait ended (returned or threw). May throw (e.g. when the partner
  /// failed); after a wait that threw, its own error is the one rethrown.
  virtual void after_wait() = 0;
};

/// Installs `observer` for the calling thread while alive; nests.
class WaitObserverScope {
 public:
  explicit WaitObserverScope(WaitObserver* observer);
  ~WaitObserverScope();
  WaitObserverScope(const WaitObserverScope&) = delete;
  WaitObserverScope& operator=(const WaitObserverScope&) = delete;

 private:
  WaitObserver* previous_;
};

/// Waits for every Work in order (all of them, even after one throws; the
/// first error is rethrown at the end).
void wait_all(std::vector<Work>& works);

/// Work::test of them all: false when one is not complete, nullopt when
/// none is known incomplete but one cannot tell, true when all are.
std::optional<bool> test_all(const std::vector<Work>& works);

/// Work::test of an exchange as "its data is there": test_all of the
/// receives, and false while one of the sends is known not to have left (a
/// link model holds it); a send that cannot tell (Gloo's) counts as gone.
/// An exchange's wait also waits for its sends, so without this a held send
/// of this rank's read as "there" too late, and one that Gloo cannot report
/// kept the answer unknown.
std::optional<bool> test_arrived(const std::vector<Work>& receives, const std::vector<Work>& sends);

/// One point-to-point operation of a batch (`Comm::batch`).
struct P2POp {
  enum class Kind { Send, Recv };
  Kind kind = Kind::Send;
  at::Tensor tensor;
  int peer = 0;
  static P2POp send(at::Tensor t, int dst) { return {Kind::Send, std::move(t), dst}; }
  static P2POp recv(at::Tensor t, int src) { return {Kind::Recv, std::move(t), src}; }
};

/// The rendezvous variables torchrun sets.
struct EnvConfig {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;
  int master_port = 0;
};

/// Reads RANK, WORLD_SIZE, LOCAL_RANK (optional, default RANK), MASTER_ADDR and
/// MASTER_PORT; throws naming the missing or invalid variable, with an example.
EnvConfig read_env();

// NOTE [Point-to-point without tags]
// NCCL ignores point-to-point tags (pytorch/pytorch#94819), so Comm has none:
// between two ranks, the k-th isend from A to B is matched with the k-th
// irecv on B from A, in posting order, whatever the backend. Every caller
// therefore posts its messages to one peer in an order both sides derive from
// the same data (the lowered schedule, a collective's fixed pattern), from
// one thread at a time. On a backend whose operations run in posting order on
// one stream (NCCL), a rank's sends also wait for the peer's receives: the
// whole sequence of operations, not only each direction, must be consistent
// (NOTE [Lowering and message order] in hp/schedule/lower.h says how the
// pipeline's schedules guarantee it). Operations that must be in flight
// together go in one `batch` (one coalesced group on NCCL).

/// A group of ranks that communicate. Every operation takes dense, contiguous
/// tensors on the group's device (CPU for Gloo), the same dtype and shape on
/// every rank where the operation implies it. Collectives must be called in
/// the same order on every rank of the group. After a CommError the Comm is
/// unusable (connections may be broken): let the error end the process.
class Comm {
 public:
  virtual ~Comm() = default;

  /// Rank of this process in the group, in [0, world_size()).
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// The timeout of every operation.
  virtual std::chrono::milliseconds timeout() const = 0;
  /// "gloo", "nccl", "gloo+shm", ...
  virtual std::string backend_name() const = 0;
  /// Whether a posted receive never holds back this rank's later operations
  /// (Gloo: each channel is matched on its own and posting never blocks), so
  /// that a runtime may post receives ahead of where a schedule lists them
  /// when asked to (NOTE [Receives posted ahead] in hp/pipeline/executor.cpp).
  /// False, the default, where a rank's operations run in posting order
  /// (NCCL's stream).
  virtual bool early_receives_are_free() const { return false; }

  /// Sends `tensor` to rank `dst`; matched in posting order with dst's
  /// irecv from this rank (NOTE [Point-to-point without tags]).
  virtual Work isend(const at::Tensor& tensor, int dst) = 0;
  /// Receives into `tensor` (preallocated, right shape and dtype) from `src`.
  virtual Work irecv(const at::Tensor& tensor, int src) = 0;
  /// Posts `ops` in order as one batch (NCCL: one coalesced group, so a send
  /// and a receive between the same ranks cannot block each other) and
  /// returns one Work per op. The default posts them one by one.
  virtual std::vector<Work> batch(const std::vector<P2POp>& ops);
  /// Blocking forms of isend/irecv.
  void send(const at::Tensor& tensor, int dst) { isend(tensor, dst).wait(); }
  void recv(const at::Tensor& tensor, int src) { irecv(tensor, src).wait(); }

  /// In place: `tensor` becomes the reduction over all ranks. Avg needs a
  /// floating dtype (sum, then divide by world_size()).
  virtual void all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::Sum) = 0;
  /// `out[r]` becomes rank r's `in`; out.size() == world_size(), each like `in`.
  virtual void all_gather(std::vector<at::Tensor>& out, const at::Tensor& in) = 0;
  /// Flat form: `out` (contiguous, numel == world_size() * in.numel()) holds
  /// rank 0's `in`, then rank 1's, ... (e.g. shape [world * n, ...] for `in` [n, ...]).
  void all_gather(const at::Tensor& out, const at::Tensor& in);
  /// `in` (numel == world_size() * out.numel()) is reduced over all ranks and
  /// rank r keeps the r-th slice in `out`: a ring over point-to-point
  /// (world-1 steps, each moving one slice), so the bytes moved per rank are
  /// (world-1)/world of `in`, as NCCL's would be, and the summation order is
  /// the same on every run.
  virtual void reduce_scatter(const at::Tensor& out, const at::Tensor& in,
                              ReduceOp op = ReduceOp::Sum);
  /// In place: every rank's `tensor` becomes `root`'s.
  virtual void broadcast(const at::Tensor& tensor, int root) = 0;
  /// Returns when every rank of the group has entered the barrier.
  virtual void barrier() = 0;

  /// Asynchronous collectives for overlapping communication with compute
  /// (graph mode's FSDP). Each is a direct exchange over point-to-point
  /// (every rank sends its part to every other), posted at once; the
  /// reduction, in rank order, runs in `wait()`. Same order on every rank.
  /// all_gather_async: `out` (dim 0 = world * in's dim 0) gets every rank's `in`.
  Work all_gather_async(const at::Tensor& out, const at::Tensor& in);
  /// reduce_scatter_async: `out` (in's dim 0 / world rows) gets this rank's
  /// rows of the reduction of every rank's `in`.
  Work reduce_scatter_async(const at::Tensor& out, const at::Tensor& in, ReduceOp op);
  /// all_reduce_async: `tensor` becomes the reduction of every rank's.
  Work all_reduce_async(const at::Tensor& tensor, ReduceOp op);

  /// all_to_all_async: rows of `in` go out in rank order, the first
  /// `in_rows[0]` to rank 0, the next `in_rows[1]` to rank 1, and so on;
  /// `out` (contiguous, `in`'s dtype and trailing shape) gets `out_rows[q]`
  /// rows from each rank q, in rank order. Both lists have world_size()
  /// entries, and `out_rows[q]` here must equal `in_rows[rank()]` on q (an
  /// exchange of counts says so first, as expert parallelism's does). A pair
  /// with 0 rows sends nothing; this rank's own rows are copied. One batch.
  Work all_to_all_async(const at::Tensor& out, const std::vector<int64_t>& out_rows,
                        const at::Tensor& in, const std::vector<int64_t>& in_rows);
  /// The blocking form of all_to_all_async.
  void all_to_all(const at::Tensor& out, const std::vector<int64_t>& out_rows, const at::Tensor& in,
                  const std::vector<int64_t>& in_rows) {
    all_to_all_async(out, out_rows, in, in_rows).wait();
  }

  /// Tells the peers that this rank stopped taking part (its step failed, or
  /// was interrupted, while the process lives on): their waits on it fail at
  /// once, naming this rank and `why`, instead of at the timeout (NOTE [A
  /// failed step reaches the peers]). After it this Comm is unusable, as
  /// after a CommError. A transport that cannot tell does nothing.
  virtual void abandon(const std::string& why) { (void)why; }

  /// A Comm over a subset of this group's `ranks` (ranks of this Comm, sorted,
  /// without duplicates, including rank()). Only the members call it, with the
  /// same list; calls with the same list are matched in order. In the subgroup,
  /// ranks are renumbered 0..ranks.size()-1 in the list's order.
  virtual std::shared_ptr<Comm> split(const std::vector<int>& ranks) = 0;

  /// Rendezvous from torchrun's variables (see read_env): rank 0 hosts a
  /// TCPStore at MASTER_ADDR:MASTER_PORT, the others connect to it within the
  /// timeout (else "could not reach MASTER_ADDR:MASTER_PORT within N s"), and
  /// the ranks make a Gloo group over it. HP_DIST_TIMEOUT_MS, when set (`hp
  /// launch --timeout` sets it), replaces options.timeout.
  static std::shared_ptr<Comm> from_env(const CommOptions& options = {});
  /// Rendezvous with explicit values over a TCPStore (what from_env calls).
  static std::shared_ptr<Comm> from_tcp(const std::string& master_addr, int master_port, int rank,
                                        int world_size, const CommOptions& options = {});
  /// Rendezvous through a FileStore at `path` (a fresh file per group; same
  /// path on every rank; ranks may be threads of one process or processes).
  static std::shared_ptr<Comm> from_file_store(const std::string& path, int rank, int world_size,
                                               const CommOptions& options = {});
  /// A Comm over a process group someone else made (Python's
  /// torch.distributed, with Gloo or NCCL, or our own rendezvous). Uses only
  /// c10d::ProcessGroup's interface; the group is shared, not copied.
  /// `options.timeout` bounds each wait. split() needs a backend that can
  /// split (Gloo and NCCL can).
  static std::shared_ptr<Comm> from_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                  const CommOptions& options = {});
  /// The same, watching its peers for being stopped (NOTE [A stopped peer] in
  /// comm_internal.h) through a monitor that publishes its address in
  /// `monitor_store` (a store the group's ranks share; a collective call).
  static std::shared_ptr<Comm> from_process_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                  const CommOptions& options,
                                                  c10::intrusive_ptr<c10d::Store> monitor_store);
};

/// Options of `with_shared_memory_p2p`.
struct SharedMemoryOptions {
  /// Messages that leave the rings (over 8 MiB, or finding a ring full) go
  /// over `inner`'s own point-to-point instead of a group split from it: for
  /// a caller whose `inner` carries no point-to-point of its own (NOTE
  /// [Overflow of a borrowed group] in shm_p2p.cpp).
  bool overflow_on_inner = false;
  /// The pairs of ranks that exchange messages (in either direction): rings
  /// are made only between these (two per pair, 32 MiB each), the others' go
  /// over `inner`. Empty: every pair of ranks of one host. Every rank gives
  /// the same pairs (checked).
  std::vector<std::pair<int, int>> links;
  /// Where this rank's tensors are. The rings move CPU tensors only: when
  /// any rank is on another device, every rank gives them up (checked in the
  /// rendezvous, so a group with mixed devices fails, or falls back, as one).
  c10::Device device = c10::Device(c10::kCPU);
};

/// `inner` with its point-to-point between ranks of the same host moved to
/// shared-memory rings (NOTE [Shared-memory point-to-point]); collectives and
/// split() stay on `inner`. Every rank of `inner` calls it (it rendezvouses
/// over `inner`). When any rank cannot make its rings (a /dev/shm without
/// room, a rank not on the CPU), every rank throws a CommError: the rank that
/// failed says why, the others name it (NOTE [Ranks agree on the rings]).
/// Same Work and CommError behaviour as `inner`, including the timeout and
/// naming a peer whose process is gone.
std::shared_ptr<Comm> with_shared_memory_p2p(std::shared_ptr<Comm> inner,
                                             const SharedMemoryOptions& options = {});

/// How a pipeline's ranks send each other activations and gradients.
enum class PointToPoint {
  Group,         ///< the group's own point-to-point (Gloo: loopback TCP between local ranks)
  SharedMemory,  ///< shared-memory rings (with_shared_memory_p2p), or an error
  Auto,          ///< the rings where every rank can have them, else the group
};

/// `group` with the point-to-point `how` asks for (NOTE [Choosing the
/// point-to-point] in shm_p2p.cpp); every rank of `group` calls it with the
/// same `how`. A group of one rank is returned as it is. SharedMemory throws
/// std::invalid_argument for a group that is not Gloo and a CommError where
/// with_shared_memory_p2p does. Auto returns the rings where the group is
/// Gloo, every rank is on the CPU and every rank made its rings, and the
/// group itself otherwise (on every rank alike); when a rank could not make
/// its rings, `note` (when given) gets the reason, as SharedMemory would
/// throw it (it stays empty where the rings do not apply: a group that is
/// not Gloo, a rank not on the CPU).
std::shared_ptr<Comm> with_point_to_point(std::shared_ptr<Comm> group, PointToPoint how,
                                          const SharedMemoryOptions& options = {},
                                          std::string* note = nullptr);

/// Options of `with_host_staging`.
struct HostStagingOptions {
  /// Stage CPU tensors too (through a fresh host buffer): the CPU check of the
  /// staging's logic. Off: CPU tensors go to `inner` as they are.
  bool stage_cpu_tensors = false;
};

/// `inner` (a CPU backend: Gloo, or shared memory over Gloo) carrying tensors
/// of any device: each device tensor is copied to host memory, moved by
/// `inner`, and copied back on the receiving side (NOTE [Staging through host
/// memory]). This is how ranks that share one GPU exchange CUDA tensors (NCCL
/// refuses two ranks on one device); every transfer synchronizes the host
/// with the device, so it is for tests and single-GPU machines, not for
/// speed. Point-to-point keeps posting order; collectives and split() are
/// staged the same way. Works stay host-blocking.
std::shared_ptr<Comm> with_host_staging(std::shared_ptr<Comm> inner,
                                        HostStagingOptions options = {});

/// `comm` as it must be to carry tensors on `device`: itself on the CPU or
/// over NCCL, else staged through host memory (`with_host_staging`; NOTE
/// [Ranks on devices] in hp/train/config.cpp).
std::shared_ptr<Comm> for_device(std::shared_ptr<Comm> comm, const c10::Device& device);

// NOTE [A failed step reaches the peers]
// A rank whose step fails while its process lives on (a notebook, a
// try/except around the step, Ctrl-C caught by Python) sends nothing more,
// and its peers used to wait for its next message until the timeout (300 s
// by default); a rank that dies is seen at once (its connections close, its
// pidfd fires). So the executor calls Comm::abandon on any failure of a step:
// * Over shared-memory rings it marks both ends of each of this rank's
//   rings, and a peer waiting on one of them fails at its next look (well
//   within 0.1 s), naming the rank and why.
// * Over a group's own point-to-point (p2p="group"; the rings' overflow)
//   nothing in the transport can tell, so with_failure_store carries it: the
//   failed rank writes its reason in a c10d Store the group's ranks share
//   ("failed/R", then "failed"). A wait on a Work of the group that lasts
//   over 0.1 s wakes the Comm's watcher thread, which looks at "failed"
//   (one store round trip) about every 0.1 s while waits are in progress,
//   never otherwise: a healthy step's short waits never reach the store.
//   When a peer's reason is there it calls Work::abort on every wait in
//   progress: Gloo's SendWork/RecvWork abort through the transport's
//   UnboundBuffer (abortWaitSend/abortWaitRecv), the wait returns false, and
//   the group's connections stay as they were (slicing the wait with a
//   timeout instead would not do: Gloo's waitRecv that times out signals the
//   exception to every pair of the context and breaks the whole group). The
//   wait then throws "rank 1: rank 0 stopped taking part while this rank was
//   receiving from rank 0: rank 0's step failed: ...", well within 0.3 s;
//   every later operation of that Comm throws the same at once.
//   hyperparallel.pipeline.Pipeline passes the store of the group it
//   borrows (torch.distributed's, under a prefix of its own: NOTE [The
//   failure store of a Pipeline] in python/csrc/bind_pipeline.cpp); without
//   one (a group torch.distributed does not know), and in `hp train`
//   (whose ranks end their process on a failed step, which the peers see at
//   once), the group's peers of a live failed rank wait their timeout.
//   Collectives are not woken (a Gloo collective cannot be aborted): a rank
//   already inside one when its peer failed waits its timeout, as does any
//   wait on NCCL (stream-ordered, NOTE [Stream-ordered waits]).
// Either way the peer's own step fails in turn and abandons, so the failure
// runs down the pipeline.
//
// NOTE [Signals during a wait]
// A Python rank waits inside Pipeline.step with the GIL released, so
// Python's SIGINT handler (KeyboardInterrupt) could not run until the wait
// ended: Ctrl-C did nothing for the whole timeout. A thread may install an
// InterruptCheck for the length of a call: waits on shared-memory rings call
// it about every 0.1 s, and what it throws ends the wait (then the step, and
// through NOTE [A failed step reaches the peers] the peers' steps).

/// What a transfer costs on a modelled network link (NOTE [The link
/// model] in link_model.cpp).
struct LinkModel {
  double latency_s = 0.0;    ///< added to every message
  double bytes_per_s = 0.0;  ///< the link's bandwidth; 0: no limit
  /// Seconds a message of `bytes` occupies the link (latency excluded).
  double busy_seconds(int64_t bytes) const {
    return bytes_per_s > 0 ? double(bytes) / bytes_per_s : 0.0;
  }
  bool active() const { return latency_s > 0 || bytes_per_s > 0; }
  /// Reads "LATENCY_US,GBPS": microseconds and gigabytes (1e9 bytes) per
  /// second, e.g. "20,12.5"; GBPS 0 means no limit. Throws
  /// std::invalid_argument naming `what` (the option or variable) on
  /// anything else.
  static LinkModel parse(const std::string& text, const std::string& what);
  /// "20 us, 12.5 GB/s".
  std::string describe() const;
};

/// `inner` whose point-to-point behaves as if sent over `link` (NOTE [The
/// link model]): each send reaches `inner` no earlier than latency + bytes /
/// bandwidth after it was posted, the messages of every such Comm of the
/// process leaving one after another, in posting order, as through one
/// network interface; waiting costs no CPU. Everything built
/// of point-to-point (batches, all_to_all_async, reduce_scatter) pays it;
/// all_reduce, all_gather, broadcast and barrier do not. split() gives
/// subgroups the same link. For benchmarks and tests on one host (CPU
/// tensors); an inactive `link` returns `inner` itself.
std::shared_ptr<Comm> with_link_model(std::shared_ptr<Comm> inner, LinkModel link);

/// `inner` whose ranks tell each other of a failed step through `store` (NOTE
/// [A failed step reaches the peers]): abandon() leaves this rank's reason
/// there, and a wait on `inner`'s point-to-point that goes on for a while
/// looks there about every 0.1 s; when a peer's reason appears the wait is
/// aborted (Gloo's point-to-point; other backends' waits are not woken) and
/// throws a CommError naming that rank and its reason, as does every later
/// operation. `store` is shared by every rank of `inner` and holds keys of
/// this group alone (a PrefixStore); every rank calls it. A null store, or a
/// group of one rank, returns `inner` itself.
std::shared_ptr<Comm> with_failure_store(std::shared_ptr<Comm> inner,
                                         c10::intrusive_ptr<c10d::Store> store);

/// Installs `check` for the calling thread while alive (NOTE [Signals during
/// a wait]); nests, restoring the previous one.
class InterruptCheck {
 public:
  explicit InterruptCheck(std::function<void()> check);
  ~InterruptCheck();
  InterruptCheck(const InterruptCheck&) = delete;
  InterruptCheck& operator=(const InterruptCheck&) = delete;

 private:
  std::function<void()> previous_;
};
/// The calling thread's check (empty if none): to install it on a helper.
std::function<void()> current_interrupt_check();
/// Calls the calling thread's InterruptCheck, if any (it may throw).
void poll_interrupt_check();

/// `inner` with its point-to-point run as a single stream runs NCCL's: each
/// rank's operations (a batch as one unit) start one after the other in
/// posting order, and each completes only together with its peer's matching
/// operation. Messages are matched by order alone. A schedule whose ranks post
/// in inconsistent orders deadlocks here (and fails with the timeout) as it
/// would on NCCL: the CPU check of the GPU protocol (NOTE [Point-to-point
/// without tags]). Collectives and split() stay on `inner`.
std::shared_ptr<Comm> with_stream_ordered_p2p(std::shared_ptr<Comm> inner);

}  // namespace hp::distributed
