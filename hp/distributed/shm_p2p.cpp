// with_shared_memory_p2p: point-to-point between ranks of one host through
// shared-memory rings; collectives, subgroups and large messages stay on the
// wrapped Comm (NOTE [Shared-memory point-to-point]).
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "hp/core/subprocess.h"
#include "hp/distributed/comm.h"
#include "hp/distributed/comm_internal.h"

namespace hp::distributed {
namespace {

// NOTE [Shared-memory point-to-point]
// Gloo moves a point-to-point message between two processes of one host over
// loopback TCP: the sender's thread runs the kernel's whole TCP path (0.3-0.8
// ms for a 128 KiB activation here) and the receiver needs two wake-ups (Gloo's
// socket thread, then the waiting thread). For pipelines whose schedule puts
// transfers on the critical path (1F1B at p = 2 has two per microbatch) that
// latency is the step's largest cost after compute. Here each ordered pair of
// ranks on one host (of the pairs the caller links, SharedMemoryOptions::links)
// gets a ring in shared memory:
// * The sender copies the message (a 64-byte record header, then the data)
//   into the ring and publishes it by advancing `head`; the send is complete
//   when isend returns.
// * isend never blocks: a message above a quarter of the ring, or one that
//   does not fit in the ring's free space, leaves only a header ("comes over
//   Gloo") in the ring and goes through a second Gloo group (a split of the
//   wrapped Comm over all its ranks, whose own order is kept). A
//   blocking sender could
//   deadlock against a receiver blocked in a Gloo operation, which does not
//   drain rings. Headers keep the ring's order, so matching stays FIFO.
// * The receiver copies records out in order: straight into the tensor of the
//   oldest posted irecv, or into a mailbox when none is posted yet; a
//   redirect header becomes a Gloo irecv into the same tensor. Waiting spins
//   briefly (the next message is usually close), then sleeps on a futex in
//   the ring that the sender wakes.
// * Matching is by source in posting order (NOTE [Point-to-point without
//   tags]), as on the wrapped Comm. Peers on other
//   hosts go through the wrapped Comm directly.
// * A peer that dies is noticed while waiting (NOTE [A dead peer is not a
//   zombie]); the error names it like the Gloo path does.
// The rings are created by their receiver, opened by their sender, and
// unlinked as soon as both mapped them, so a crash leaves nothing behind.
constexpr uint64_t kRecord = 64;             // header size and record alignment
constexpr uint64_t kCapacity = 32ull << 20;  // bytes of data per direction
constexpr uint64_t kMaxMessage = kCapacity / 4;
constexpr uint64_t kWrapMark = ~0ull;       // header flags: the rest of the ring is empty
constexpr uint64_t kRedirect = 1ull << 62;  // header flag: the data comes over the wrapped Comm
constexpr uint64_t kReserve = 1ull << 20;   // ring space kept for redirect headers
constexpr auto kSpin = std::chrono::microseconds(50);

// One end of a ring telling the other that it stopped taking part (NOTE [A
// failed step reaches the peers] in comm.h): `why` is written first, then
// `flag` is set with release order.
struct Abandoned {
  std::atomic<uint32_t> flag;
  char why[252];
};
struct RingControl {
  alignas(64) std::atomic<uint64_t> head;  // bytes published, only grows
  alignas(64) std::atomic<uint64_t> tail;  // bytes consumed, only grows
  alignas(64) std::atomic<uint32_t> seq;   // bumped on each publish: the futex word
  std::atomic<uint32_t> sleepers;
  alignas(64) Abandoned by_writer;  // the sender stopped: its receiver stops waiting
  alignas(64) Abandoned by_reader;  // the receiver stopped: a sender waiting for room stops
};
struct RecordHeader {
  uint64_t flags;  // 0, kRedirect or kWrapMark
  uint64_t bytes;
};
constexpr size_t kMapBytes = sizeof(RingControl) + kCapacity;

uint64_t round_up(uint64_t n) {
  return (n + kRecord - 1) / kRecord * kRecord;
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, std::chrono::microseconds limit) {
  timespec ts{};
  ts.tv_sec = limit.count() / 1000000;
  ts.tv_nsec = (limit.count() % 1000000) * 1000;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}
void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

struct Ring {
  RingControl* ctl = nullptr;
  char* data = nullptr;
  void* map = nullptr;
};

Ring map_ring(const std::string& name, bool create, int rank) {
  int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                  : shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0)
    throw CommError("rank " + std::to_string(rank) + ": shared-memory point-to-point: cannot " +
                        (create ? "create " : "open ") + name + ": " + std::strerror(errno),
                    {}, false);
  // NOTE [Rings take their memory up front]: a tmpfs file's size is only a
  // promise; a ring sized with ftruncate alone in a /dev/shm too small for it
  // (a container's default is 64 MiB) would kill the process with SIGBUS at
  // the first write past the room left, mid-step. posix_fallocate takes the
  // pages now, so a full /dev/shm is an error here that says so.
  if (create) {
    if (int err = posix_fallocate(fd, 0, static_cast<off_t>(kMapBytes)); err != 0) {
      close(fd);
      shm_unlink(name.c_str());
      throw CommError("rank " + std::to_string(rank) +
                          ": shared-memory point-to-point: cannot reserve " +
                          std::to_string(kMapBytes >> 20) + " MiB for " + name + " in /dev/shm (" +
                          std::strerror(err) +
                          "): give /dev/shm more room (docker run --shm-size) or use the "
                          "group's point-to-point",
                      {}, false);
    }
  }
  if (create && ftruncate(fd, static_cast<off_t>(kMapBytes)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    throw CommError("rank " + std::to_string(rank) + ": shared-memory point-to-point: sizing " +
                        name + ": " + std::strerror(err),
                    {}, false);
  }
  void* p = mmap(nullptr, kMapBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED)
    throw CommError("rank " + std::to_string(rank) + ": shared-memory point-to-point: mapping " +
                        name + ": " + std::strerror(err),
                    {}, false);
  Ring r;
  r.map = p;
  r.ctl = static_cast<RingControl*>(p);
  if (create) new (r.ctl) RingControl{};  // a fresh file is zeros; make the atomics explicit
  r.data = static_cast<char*>(p) + sizeof(RingControl);
  return r;
}

// Identifies "one host, one process-id space": boot id, host name and the pid
// namespace. Ranks with equal keys can share memory and see each other's pids.
int64_t host_key() {
  std::string s;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> s;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  s += host;
  char ns[128] = {};
  ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  if (n > 0) s += std::string(ns, static_cast<size_t>(n));
  return static_cast<int64_t>(std::hash<std::string>{}(s)&0x7fffffffffffffffull);
}

struct PendingRecv {
  at::Tensor tensor;
  bool done = false;
  Work redirected;  // valid when the data comes over the wrapped Comm
};

// A rank that could not make its rings; every rank throws one (NOTE [Ranks
// agree on the rings]), which with_point_to_point's Auto turns into the group.
class RingsUnavailable : public CommError {
 public:
  explicit RingsUnavailable(const std::string& message) : CommError(message, {}, false) {}
};

class ShmComm : public Comm, public std::enable_shared_from_this<ShmComm> {
 public:
  ShmComm(std::shared_ptr<Comm> inner, const SharedMemoryOptions& options)
      : inner_(std::move(inner)) {
    const int n = inner_->world_size(), me = inner_->rank();
    // Bad links are reported after the rendezvous, so that the other ranks
    // fail with this one instead of waiting for it.
    std::set<std::pair<int, int>> links;
    std::string bad;
    for (auto [a, b] : options.links) {
      if (a < 0 || a >= n || b < 0 || b >= n || a == b)
        bad = "rank " + std::to_string(me) + ": with_shared_memory_p2p: the link (" +
              std::to_string(a) + ", " + std::to_string(b) +
              ") is not a pair of two ranks of a group of " + std::to_string(n);
      links.insert({std::min(a, b), std::max(a, b)});
    }
    int64_t links_hash = 0;
    for (auto [a, b] : links)
      links_hash = (links_hash * 1000003 + a * 4099 + b + 1) & 0x3fffffffffffffffll;
    auto nonce = at::empty({1}, at::kLong);
    if (me == 0) nonce.fill_(static_cast<int64_t>(std::random_device{}() & 0x7fffffff));
    inner_->broadcast(nonce, 0);
    constexpr int kFields = 4;  // host, pid, links, on the CPU
    auto mine = at::tensor({host_key(), static_cast<int64_t>(getpid()), links_hash,
                            static_cast<int64_t>(options.device.is_cpu() ? 1 : 0)},
                           at::kLong);
    auto all = at::empty({n * kFields}, at::kLong);
    inner_->all_gather(all, mine);
    const int64_t key = mine[0].item<int64_t>();
    pid_.resize(n);
    stopped_since_.resize(n);
    pidfd_.assign(n, -1);
    in_.resize(n);
    out_.resize(n);
    local_.assign(n, false);
    if (!bad.empty()) throw CommError(bad, {}, false);
    for (int q = 0; q < n; ++q) {
      const int64_t* got = all.data_ptr<int64_t>() + kFields * q;
      pid_[q] = static_cast<pid_t>(got[1]);
      if (got[2] != links_hash)
        throw CommError("rank " + std::to_string(me) + ": with_shared_memory_p2p: rank " +
                            std::to_string(q) +
                            " gave other links than this rank; every rank must give the same",
                        {}, false);
      if (got[3] == 0)
        throw RingsUnavailable(
            "rank " + std::to_string(me) + ": shared-memory point-to-point moves CPU tensors, " +
            (q == me ? "but this rank's tensors are on " + options.device.str()
                     : "but rank " + std::to_string(q) + "'s tensors are not on the CPU") +
            "; use the group's own point-to-point");
      local_[q] = q != me && got[0] == key &&
                  (links.empty() || links.count({std::min(q, me), std::max(q, me)}));
    }
    auto name = [&](int src, int dst) {
      return "/hp-p2p-" + std::to_string(nonce.item<int64_t>()) + "-" + std::to_string(src) + "-" +
             std::to_string(dst);
    };
    // NOTE [Ranks agree on the rings]
    // A rank that cannot make a ring (its /dev/shm is full, or is another
    // mount than its peer's) must not leave the others waiting in a barrier
    // until the timeout: after each phase (every receiver creates its
    // incoming rings; every sender opens its outgoing ones) the ranks gather
    // who failed, and if anyone did, all of them let go of what they made
    // and throw RingsUnavailable together.
    std::vector<std::string> created;
    auto phase = [&](bool create) {
      std::string failure;
      try {
        for (int q = 0; q < n; ++q)
          if (local_[q]) {
            if (create) {
              in_[q] = map_ring(name(q, me), /*create=*/true, me);
              created.push_back(name(q, me));
            } else {
              out_[q] = map_ring(name(me, q), /*create=*/false, me);
            }
          }
      } catch (const std::exception& e) {
        failure = e.what();
      }
      auto failed = at::tensor({static_cast<int64_t>(failure.empty() ? 0 : 1)}, at::kLong);
      auto everyone = at::empty({n}, at::kLong);
      inner_->all_gather(everyone, failed);
      int first = -1;
      for (int q = 0; q < n && first < 0; ++q)
        if (everyone[q].item<int64_t>() != 0) first = q;
      if (first < 0) return;
      for (const auto& c : created)
        shm_unlink(c.c_str());
      unmap();
      throw RingsUnavailable(
          !failure.empty()
              ? failure
              : "rank " + std::to_string(me) + ": shared-memory point-to-point: rank " +
                    std::to_string(first) +
                    " could not make its rings (its own error says why), so no rank uses them");
    };
    phase(/*create=*/true);
    phase(/*create=*/false);
    for (int q = 0; q < n; ++q)
      if (local_[q]) pidfd_[q] = static_cast<int>(::syscall(SYS_pidfd_open, pid_[q], 0));
    for (const auto& c : created)
      shm_unlink(c.c_str());
    std::vector<int> everyone(n);
    for (int q = 0; q < n; ++q)
      everyone[q] = q;
    // NOTE [Overflow of a borrowed group]
    // Redirected messages need a channel whose order between two ranks is
    // theirs alone. A group split from `inner` gives one whatever else uses
    // `inner`. A group that Python made (Pipeline(p2p="shm")) carries no
    // point-to-point but ours while a step runs, so its own channel serves;
    // and splitting such a group is not safe: splits of the pipelines'
    // subgroups of a torch DeviceMesh (pp x dp, Gloo, torch 2.11) hung in
    // Gloo's connect on one rank while its peer had finished the same split,
    // in about half of the runs that made 5 pipelines in turn; with no split,
    // 4 of 4 such runs passed.
    overflow_ = options.overflow_on_inner ? inner_ : inner_->split(everyone);
  }
  ~ShmComm() override {
    unmap();
    for (int fd : pidfd_)
      if (fd >= 0) ::close(fd);
  }

  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  // A receive posted early waits in posted_ and holds back no send (isend
  // never blocks); one that comes over `inner` is as free as `inner` says.
  bool early_receives_are_free() const override { return inner_->early_receives_are_free(); }
  // "+shm" where this rank has rings (a rank with no peer on its host has none).
  std::string backend_name() const override {
    const bool rings = std::find(local_.begin(), local_.end(), true) != local_.end();
    return inner_->backend_name() + (rings ? "+shm" : "");
  }

  Work isend(const at::Tensor& tensor, int dst) override {
    if (!shm_route(tensor, dst, "isend")) return inner_->isend(tensor, dst);
    if (write(dst, tensor)) return Work::done();
    return overflow_->isend(tensor, dst);
  }

  Work irecv(const at::Tensor& tensor, int src) override {
    if (!shm_route(tensor, src, "irecv")) return inner_->irecv(tensor, src);
    std::lock_guard<std::mutex> lock(mu_);
    auto& box = mailbox_[src];
    if (!box.empty()) {
      Mail mail = std::move(box.front());
      box.pop_front();
      if (mail.redirected) return overflow_->irecv(tensor, src);
      check_size(src, mail.bytes.size(), tensor);
      std::memcpy(tensor.data_ptr(), mail.bytes.data(), mail.bytes.size());
      return Work::done();
    }
    auto p = std::make_shared<PendingRecv>();
    p->tensor = tensor;
    posted_[src].push_back(p);
    return Work(std::make_shared<RecvWork>(shared_from_this(), p, src));
  }

  void all_reduce(const at::Tensor& t, ReduceOp op) override { inner_->all_reduce(t, op); }
  void all_gather(std::vector<at::Tensor>& out, const at::Tensor& in) override {
    inner_->all_gather(out, in);
  }
  void broadcast(const at::Tensor& t, int root) override { inner_->broadcast(t, root); }
  void barrier() override { inner_->barrier(); }
  std::shared_ptr<Comm> split(const std::vector<int>& ranks) override {
    return inner_->split(ranks);
  }

 private:
  struct RecvWork : Work::Impl {
    RecvWork(std::shared_ptr<ShmComm> c, std::shared_ptr<PendingRecv> p, int s)
        : comm(std::move(c)), pending(std::move(p)), src(s) {}
    void wait() override { comm->wait_for(*pending, src); }
    std::optional<bool> test() const override { return comm->arrived(*pending); }
    std::shared_ptr<ShmComm> comm;
    std::shared_ptr<PendingRecv> pending;
    int src;
  };

  bool shm_route(const at::Tensor& t, int peer, const char* op) const {
    TORCH_CHECK(peer >= 0 && peer < world_size(), op, ": rank ", peer, " is not in a group of ",
                world_size());
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), op,
                ": tensors must be contiguous CPU tensors");
    return local_[peer];
  }

  void check_size(int src, uint64_t got, const at::Tensor& t) const {
    if (got != static_cast<uint64_t>(t.nbytes()))
      throw CommError("rank " + std::to_string(rank()) + ": receiving from rank " +
                          std::to_string(src) + ": " + std::to_string(got) +
                          " bytes arrived for a tensor of " + std::to_string(t.nbytes()) + " bytes",
                      {}, false);
  }

  // Copies every published record of every incoming ring to its receiver.
  // Caller holds mu_.
  void drain_locked() {
    for (int q = 0; q < world_size(); ++q) {
      if (!local_[q]) continue;
      Ring& r = in_[q];
      uint64_t tail = r.ctl->tail.load(std::memory_order_relaxed);
      const uint64_t head = r.ctl->head.load(std::memory_order_acquire);
      if (tail == head) continue;
      while (tail < head) {
        const uint64_t pos = tail % kCapacity;
        RecordHeader h;
        std::memcpy(&h, r.data + pos, sizeof h);
        if (h.flags == kWrapMark) {
          tail += kCapacity - pos;
          continue;
        }
        const char* payload = r.data + pos + kRecord;
        const bool redirected = (h.flags & kRedirect) != 0;
        const uint64_t bytes = redirected ? 0 : h.bytes;
        auto pit = posted_.find(q);
        if (pit != posted_.end() && !pit->second.empty()) {
          auto p = pit->second.front();
          pit->second.pop_front();
          if (redirected) {
            p->redirected = overflow_->irecv(p->tensor, q);
          } else {
            check_size(q, bytes, p->tensor);
            std::memcpy(p->tensor.data_ptr(), payload, bytes);
          }
          p->done = true;
        } else {
          Mail mail;
          mail.redirected = redirected;
          mail.bytes.assign(payload, payload + bytes);
          mailbox_[q].push_back(std::move(mail));
        }
        tail += kRecord + round_up(bytes);
      }
      r.ctl->tail.store(tail, std::memory_order_release);
    }
  }

  void abandon(const std::string& why) override {
    auto mark = [&](Abandoned& a) {
      if (a.flag.load(std::memory_order_acquire)) return;
      const size_t n = std::min(why.size(), sizeof(a.why) - 1);
      std::memcpy(a.why, why.data(), n);
      a.why[n] = '\0';
      a.flag.store(1, std::memory_order_release);
    };
    for (size_t q = 0; q < out_.size(); ++q) {
      if (out_[q].ctl) {
        mark(out_[q].ctl->by_writer);
        out_[q].ctl->seq.fetch_add(1);  // a receiver asleep on the futex wakes and sees it
        futex_wake(&out_[q].ctl->seq);
      }
      if (in_[q].ctl) mark(in_[q].ctl->by_reader);
    }
    inner_->abandon(why);
  }

  // Throws when `a` says the peer at the other end stopped taking part.
  void check_abandoned(const Abandoned& a, int peer, const std::string& what) const {
    if (!a.flag.load(std::memory_order_acquire)) return;
    throw CommError("rank " + std::to_string(rank()) + ": rank " + std::to_string(peer) +
                        " stopped taking part while this rank was " + what + ": " + a.why,
                    {peer}, false);
  }

  [[noreturn]] void fail_waiting(int peer, const std::string& what, bool lost) const {
    std::ostringstream os;
    os << "rank " << rank() << ": ";
    if (lost)
      os << "lost connection to rank " << peer << " (its process is gone) while " << what;
    else
      os << "timed out after " << timeout().count() / 1000.0 << " s while " << what
         << "; the peer is alive but did not take part (a mismatched schedule or message order?) "
            "or is "
            "too slow (raise the timeout)";
    throw CommError(os.str(), lost ? std::vector<int>{peer} : std::vector<int>{}, !lost);
  }

  [[noreturn]] void fail_stopped(int peer, const std::string& what) const {
    throw CommError("rank " + std::to_string(rank()) + ": " +
                        detail::stopped_peer_text("rank " + std::to_string(peer)) + " while " +
                        what,
                    {peer}, false);
  }

  // NOTE [A dead peer is not a zombie]
  // kill(pid, 0) succeeds on a zombie: a rank that died but whose launcher
  // has not reaped it yet (torchrun waits for its ranks in order) looked
  // alive, and its peer waited the whole timeout. A pidfd polls readable as
  // soon as the process exits, reaped or not, and cannot name a reused pid.
  // Where pidfd_open is missing (Linux < 5.3) the process's state in
  // /proc/PID/stat tells a zombie ('Z') or a dead one ('X').
  bool peer_alive(int q) const {
    if (pidfd_[q] >= 0) {
      pollfd pfd{pidfd_[q], POLLIN, 0};
      return ::poll(&pfd, 1, 0) == 0;
    }
    if (::kill(pid_[q], 0) != 0 && errno == ESRCH) return false;
    const char state = process_state(pid_[q]);
    return state != 'Z' && state != 'X';
  }

  // Whether peer q has been stopped (SIGSTOP, Ctrl-Z, a debugger) for
  // detail::stopped_peer_after_s() (NOTE [A stopped peer] in comm_internal.h).
  bool peer_stopped(int q) {
    const double after = detail::stopped_peer_after_s();
    if (after <= 0) return false;
    auto& since = stopped_since_[q];
    if (!process_stopped(pid_[q])) {
      since = {};
      return false;
    }
    const auto now = std::chrono::steady_clock::now();
    if (since == std::chrono::steady_clock::time_point{}) since = now;
    return std::chrono::duration<double>(now - since).count() >= after;
  }

  // Whether the receive's message is there, without waiting (Work::test).
  // A redirected one counts once its header is: the sender posted its data
  // over the wrapped Comm with it, and that Comm (Gloo) cannot tell before
  // its wait; an early yes only ends a wait's fill a little early.
  std::optional<bool> arrived(PendingRecv& p) {
    std::lock_guard<std::mutex> lock(mu_);
    drain_locked();
    return p.done;
  }

  void wait_for(PendingRecv& p, int src) {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + timeout();
    auto last_check = start;
    RingControl* ctl = in_[src].ctl;
    while (true) {
      const uint32_t seen = ctl->seq.load(std::memory_order_acquire);
      {
        std::unique_lock<std::mutex> lock(mu_);
        drain_locked();
        if (p.done) {
          lock.unlock();
          if (p.redirected.valid()) p.redirected.wait();  // Gloo's own timeout and errors
          return;
        }
      }
      auto now = std::chrono::steady_clock::now();
      if (now - start < kSpin) {
        std::this_thread::yield();
        continue;
      }
      check_abandoned(ctl->by_writer, src, "receiving from it");
      if (now > deadline) fail_waiting(src, "receiving from rank " + std::to_string(src), false);
      if (now - last_check > std::chrono::milliseconds(100)) {
        last_check = now;
        if (!peer_alive(src)) fail_waiting(src, "receiving from rank " + std::to_string(src), true);
        if (peer_stopped(src)) fail_stopped(src, "receiving from it");
        poll_interrupt_check();
      }
      ctl->sleepers.fetch_add(1);
      if (ctl->seq.load(std::memory_order_acquire) == seen)
        futex_wait(&ctl->seq, seen, std::chrono::microseconds(20000));
      ctl->sleepers.fetch_sub(1);
    }
  }

  // Puts the message in dst's ring and returns true, or, when it is large or
  // does not fit, puts a redirect header there and returns false: the caller
  // then sends the data over the wrapped Comm. Never waits for the receiver,
  // unless even the space kept for redirect headers is used up.
  bool write(int dst, const at::Tensor& t) {
    std::lock_guard<std::mutex> sending(send_mu_);  // one writer per ring, whatever the threads
    Ring& r = out_[dst];
    const uint64_t bytes = static_cast<uint64_t>(t.nbytes());
    const auto start = std::chrono::steady_clock::now();
    auto last_check = start;
    while (true) {
      uint64_t head = r.ctl->head.load(std::memory_order_relaxed);
      const uint64_t tail = r.ctl->tail.load(std::memory_order_acquire);
      auto fits = [&](uint64_t need, uint64_t keep) {
        const uint64_t pos = head % kCapacity;
        const uint64_t skip = need > kCapacity - pos ? kCapacity - pos : 0;
        return head + skip + need + keep - tail <= kCapacity;
      };
      const uint64_t need = kRecord + round_up(bytes);
      const bool data = bytes <= kMaxMessage && fits(need, kReserve);
      if (data || fits(kRecord, 0)) {
        const uint64_t len = data ? need : kRecord;
        const uint64_t pos = head % kCapacity;
        if (len > kCapacity - pos) {
          RecordHeader wrap{kWrapMark, 0};
          std::memcpy(r.data + pos, &wrap, sizeof wrap);
          head += kCapacity - pos;
        }
        char* rec = r.data + head % kCapacity;
        RecordHeader h{data ? 0 : kRedirect, data ? bytes : 0};
        std::memcpy(rec, &h, sizeof h);
        if (data) std::memcpy(rec + kRecord, t.data_ptr(), bytes);
        r.ctl->head.store(head + len, std::memory_order_release);
        r.ctl->seq.fetch_add(1);  // seq_cst: ordered before the sleepers load
        if (r.ctl->sleepers.load()) futex_wake(&r.ctl->seq);
        return data;
      }
      // Not even a header fits: the receiver has not read for a long time.
      {
        std::lock_guard<std::mutex> lock(mu_);
        drain_locked();
      }
      auto now = std::chrono::steady_clock::now();
      if (now - start > timeout())
        fail_waiting(dst, "sending to rank " + std::to_string(dst) + " (its ring is full)", false);
      check_abandoned(r.ctl->by_reader, dst, "sending to it");
      if (now - last_check > std::chrono::milliseconds(100)) {
        last_check = now;
        if (!peer_alive(dst)) fail_waiting(dst, "sending to rank " + std::to_string(dst), true);
        if (peer_stopped(dst)) fail_stopped(dst, "sending to it");
        poll_interrupt_check();
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void unmap() {
    for (auto* v : {&in_, &out_})
      for (auto& r : *v)
        if (r.map) {
          munmap(r.map, kMapBytes);
          r = Ring{};
        }
  }

  std::shared_ptr<Comm> inner_;
  std::shared_ptr<Comm> overflow_;  // messages that do not go through a ring
  std::vector<bool> local_;
  std::vector<pid_t> pid_;
  std::vector<int> pidfd_;  // -1: none (this rank, or no pidfd_open); see peer_alive
  std::vector<std::chrono::steady_clock::time_point> stopped_since_;  // see peer_stopped
  std::vector<Ring> in_, out_;  // by peer: rings from it / to it
  std::mutex mu_;               // the incoming rings' tails, posted_ and mailbox_
  std::mutex send_mu_;          // the outgoing rings' heads
  std::map<int, std::deque<std::shared_ptr<PendingRecv>>> posted_;  // by source
  struct Mail {
    bool redirected = false;
    std::vector<char> bytes;
  };
  std::map<int, std::deque<Mail>> mailbox_;  // by source
};

}  // namespace

std::shared_ptr<Comm> with_shared_memory_p2p(std::shared_ptr<Comm> inner,
                                             const SharedMemoryOptions& options) {
  TORCH_CHECK(inner != nullptr, "with_shared_memory_p2p: no Comm given");
  return std::make_shared<ShmComm>(std::move(inner), options);
}

// NOTE [Choosing the point-to-point]
// A pipeline asks for its transport as Group, SharedMemory or Auto. Auto is
// what a user wants without thinking about it: the rings wherever they work,
// the group elsewhere, and every rank taking the same path (a rank that
// skipped the rings would leave its peers in their rendezvous). So Auto takes
// the group at once for a group that is not Gloo (every rank sees the same
// backend), then all-reduces whether every rank is on the CPU (the device is
// each rank's own), and only then makes the rings, whose failure to reserve
// (NOTE [Ranks agree on the rings]) reaches every rank alike and is turned
// into the group and a note for the caller to show.
std::shared_ptr<Comm> with_point_to_point(std::shared_ptr<Comm> group, PointToPoint how,
                                          const SharedMemoryOptions& options, std::string* note) {
  TORCH_CHECK(group != nullptr, "with_point_to_point: no Comm given");
  if (how == PointToPoint::Group || group->world_size() < 2) return group;
  const bool gloo = group->backend_name() == "gloo";
  if (how == PointToPoint::SharedMemory) {
    if (!gloo)
      throw std::invalid_argument(
          "shared-memory point-to-point goes beside a Gloo group; this group's backend is " +
          group->backend_name() + ": use the group's own point-to-point");
    return with_shared_memory_p2p(std::move(group), options);
  }
  if (!gloo) return group;
  auto all_cpu = at::tensor({static_cast<int64_t>(options.device.is_cpu() ? 1 : 0)}, at::kLong);
  group->all_reduce(all_cpu, ReduceOp::Min);
  if (all_cpu.item<int64_t>() == 0) return group;
  try {
    return with_shared_memory_p2p(group, options);
  } catch (const RingsUnavailable& e) {
    if (note != nullptr) *note = e.what();
    return group;
  }
}

}  // namespace hp::distributed
