// hp/distributed internals shared by its files: tensor checks, the Gloo
// group factory, and PeerMonitor (which rank's process is gone).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include "hp/distributed/comm.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
class ProcessGroup;
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

 private:
  int rank_;
  int listen_fd_ = -1;
  std::vector<int> fds_;  // fds_[r]: our connection to rank r's listener (-1 for us)
};

}  // namespace hp::distributed::detail
