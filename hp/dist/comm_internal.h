// hp/dist internals shared by comm.cpp and the Gloo backend: tensor checks,
// reserved tags, and PeerMonitor (which rank's process is gone).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>
#include <vector>

namespace c10d {
class Store;
}

namespace hp::dist::detail {

/// User tags live below 2^30; hp/dist's own p2p traffic uses tags above.
constexpr int kMaxUserTag = 1 << 30;
constexpr int kReduceScatterTag = kMaxUserTag + 1;

/// Checks what Gloo needs of a tensor: defined, dense, contiguous, on the CPU.
void check_tensor(const at::Tensor& t, const char* what);

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

}  // namespace hp::dist::detail
