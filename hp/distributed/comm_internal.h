// hp/distributed internals shared by its files: tensor checks, the Gloo
// group factory, and PeerMonitor (which rank's process is gone).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include "hp/distributed/comm.h"

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace c10d {
class Store;
class ProcessGroup;
class Work;
class Backend;
}  // namespace c10d

namespace hp::distributed::detail {

/// Checks what every backend needs of a tensor: defined, dense, contiguous.
void check_tensor(const at::Tensor& t, const char* what);

/// Where a Gloo group binds its sockets (NOTE [Gloo device address]).
struct GlooEndpoint {
  std::string interface_name;  ///< wins when set
  std::string address;
};

/// A c10d::ProcessGroup with a Gloo backend for CPU tensors, rendezvoused over
/// `store` (every member calls it with the same store). Made natively where
/// LibTorch ships Gloo's headers and through Python's torch.distributed where
/// it does not (NOTE [Making a Gloo group]). Throws what c10d throws.
c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                       int rank, int world_size,
                                                       const GlooEndpoint& endpoint,
                                                       std::chrono::milliseconds timeout);

/// make_gloo_group, with the members agreeing through `store` that every one
/// of them connected, and making the group again where one could not
/// (NOTE [A Gloo group's connect, agreed] in gloo_group.cpp).
c10::intrusive_ptr<c10d::ProcessGroup> make_agreed_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
    const GlooEndpoint& endpoint, std::chrono::milliseconds timeout);

/// A ProcessGroup (default backend Gloo, for CPU tensors) around `backend`.
c10::intrusive_ptr<c10d::ProcessGroup> wrap_gloo_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
    c10::intrusive_ptr<c10d::Backend> backend);

/// The Comm of our own rendezvous: a Gloo group over `store` (every rank
/// calls it), a PeerMonitor, and subgroups made over prefixes of `store`.
/// Throws CommError naming the rendezvous when it does not complete.
std::shared_ptr<Comm> gloo_comm_over_store(c10::intrusive_ptr<c10d::Store> store, int rank,
                                           int world_size, const GlooEndpoint& endpoint,
                                           const CommOptions& options);

/// NOTE [Naming the lost peer]
/// Gloo reports a dead peer as "Connection closed by peer [ip]:port", an
/// address that does not say which rank it was (and collectives do not say
/// which pair failed at all). So every rank also opens one idle TCP connection
/// to every other rank's PeerMonitor listener at rendezvous. Nothing is ever
/// sent on them: when a process dies the kernel closes its sockets, and the
/// connection to it becomes readable (EOF or reset). On a failed operation we
/// poll these sockets and name the ranks whose connection is gone. The
/// listener never accepts: a connection parked in the backlog is enough, and
/// the kernel resets it when the listener's process exits.
/// NOTE [A stopped peer]
/// A peer process that is stopped (SIGSTOP, Ctrl-Z, a debugger's stop) keeps
/// its connections open, so nothing above notices it: its peers used to wait
/// their whole timeout. Each rank also publishes its pid, the machine's boot
/// id and its pid namespace; a peer with the same boot id and namespace is
/// on this host and visible, and its state can be read in /proc (T: stopped,
/// t: stopped by a tracer). While waits of the group are in progress a
/// watcher thread looks every 0.1 s; a peer stopped for
/// `stopped_after()` (2 s; HP_STOPPED_PEER_AFTER_S, 0 turns it off, e.g.
/// while debugging a rank) fails the waits in progress: point-to-point
/// waits through Work::abort (NOTE [A failed step reaches the peers] in
/// comm.h), collectives by waiting in slices of 0.2 s and looking between
/// them (a Gloo collective cannot be aborted; slicing its wait is harmless,
/// unlike a point-to-point wait's). A peer on another host cannot be read in
/// /proc: each rank sends every such peer a byte every 0.5 s over the
/// monitor's connection (a thread of its own, which a stopped process stops
/// too), and a peer heard nothing from for `stopped_after()` + 0.5 s is taken
/// as stopped (or frozen, or cut off) the same way. HP_PEERS_ON_OTHER_HOSTS=1
/// treats every peer as on another host (how the tests reach this on one
/// machine). The shared-memory rings read the same state of their peers
/// (shm_p2p.cpp).
/// The address a PeerMonitor of a borrowed group listens on (NOTE [Gloo
/// device address] in rendezvous.cpp): the one given, else the local address
/// towards MASTER_ADDR, else 127.0.0.1.
std::string monitor_address(const CommOptions& options);

/// "rank R is stopped (...)" for the errors of NOTE [A stopped peer];
/// `remote`: a peer on another host, known by its silence.
std::string stopped_peer_text(const std::string& peer, bool remote = false);

/// The seconds a peer must stay stopped before its peers fail (NOTE [A
/// stopped peer]); 0: never.
double stopped_peer_after_s();

class PeerMonitor {
 public:
  /// Listens on `address`, publishes "hp/live/<rank>" in `store`, connects to
  /// every other rank's listener (waiting for their keys up to `timeout`).
  PeerMonitor(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
              const std::string& address, std::chrono::milliseconds timeout);
  ~PeerMonitor();
  PeerMonitor(const PeerMonitor&) = delete;
  PeerMonitor& operator=(const PeerMonitor&) = delete;

  /// Ranks whose connection is closed; if none is yet, waits up to `wait_up_to`
  /// for one to close (the kernel closes a dead process's sockets one by one).
  std::vector<int> lost_ranks(std::chrono::milliseconds wait_up_to) const;

  /// The rank (of the root group) of a peer on this host that has been
  /// stopped for stopped_peer_after_s(), or -1 (NOTE [A stopped peer]).
  int stopped_peer();

  /// A wait on `work` begins: false when a stopped peer is already known
  /// (then do not wait). While any wait is in, the watcher looks; when it
  /// finds a stopped peer it aborts every work that is in.
  bool enter(c10d::Work* work);
  void leave(c10d::Work* work);
  /// Whether this monitor can see any peer's state (a peer on this host,
  /// or one on another host that it hears from).
  bool watches() const;
  /// Whether rank `r` is on another host (known by its heartbeats).
  bool remote(int r) const { return r >= 0 && r < int(pids_.size()) && pids_[r] <= 0; }

 private:
  void watch_loop();
  void beat_loop();  // sends heartbeats to remote peers, reads theirs

  int rank_;
  int listen_fd_ = -1;
  std::vector<int> fds_;   // fds_[r]: our connection to rank r's listener (-1 for us)
  std::vector<int> pids_;  // pids_[r]: rank r's pid when on this host, else -1
  double stopped_after_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::chrono::steady_clock::time_point> stopped_since_;  // per rank; 0: running
  std::vector<c10d::Work*> waiting_;
  int stopped_ = -1;  // a stopped peer, once found
  bool stop_ = false;
  std::thread thread_;
  // Heartbeats of peers on other hosts (NOTE [A stopped peer]).
  bool any_remote_ = false;
  std::vector<std::chrono::steady_clock::time_point> last_heard_;  // per rank
  int wake_[2] = {-1, -1};                                         // a pipe that ends beat_loop
  std::thread beat_thread_;
};

}  // namespace hp::distributed::detail
