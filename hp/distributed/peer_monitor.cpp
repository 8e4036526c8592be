// PeerMonitor (see NOTE [Naming the lost peer] in comm_internal.h): one idle
// TCP connection per peer, polled after a failure to say which peer is gone,
// and the state of peers on this host (NOTE [A stopped peer]).
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "hp/core/subprocess.h"
#include "hp/distributed/comm_internal.h"

namespace hp::distributed::detail {

void check_tensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), what, ": the tensor is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, what, ": communication needs dense tensors");
  TORCH_CHECK(t.is_contiguous(), what,
              ": communication needs a contiguous tensor; call .contiguous() first (and copy the "
              "result back for a receive)");
}

double stopped_peer_after_s() {
  static const double s = [] {
    const char* v = std::getenv("HP_STOPPED_PEER_AFTER_S");
    if (v == nullptr || *v == 0) return 2.0;
    char* end = nullptr;
    const double x = std::strtod(v, &end);
    TORCH_CHECK(end != v && *end == 0 && x >= 0,
                "HP_STOPPED_PEER_AFTER_S must be a number of seconds >= 0 (0: off), not '", v, "'");
    return x;
  }();
  return s;
}

std::string stopped_peer_text(const std::string& peer, bool remote) {
  std::ostringstream os;
  if (remote)
    os << peer << " is stopped or unreachable (on another host, it has sent nothing for "
       << stopped_peer_after_s() + 0.5
       << " s: SIGSTOP, a debugger, a frozen host or a cut link; HP_STOPPED_PEER_AFTER_S sets "
          "how long, 0 waits the timeout)";
  else
    os << peer << " is stopped (SIGSTOP, Ctrl-Z or a debugger: its process has not run for "
       << stopped_peer_after_s()
       << " s; HP_STOPPED_PEER_AFTER_S sets how long, 0 waits the timeout)";
  return os.str();
}

namespace {

std::string read_first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

// What says "this host, and pids that mean the same process": the boot id
// and the pid namespace (containers on one host share the boot id only).
std::string host_identity() {
  char ns[256] = {0};
  const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  const std::string boot = read_first_line("/proc/sys/kernel/random/boot_id");
  if (boot.empty() || n <= 0) return "";
  return boot + "/" + std::string(ns, size_t(n));
}

std::string key_of(int rank) {
  return "hp/live/" + std::to_string(rank);
}

std::vector<uint8_t> bytes_of(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

// NOTE [A stopped peer] in comm_internal.h: the heartbeat period, and a test's
// way to see every peer as on another host.
constexpr auto kBeat = std::chrono::milliseconds(500);

bool peers_on_other_hosts() {
  const char* v = std::getenv("HP_PEERS_ON_OTHER_HOSTS");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace

PeerMonitor::PeerMonitor(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                         const std::string& address, std::chrono::milliseconds timeout)
    : rank_(rank),
      fds_(world_size, -1),
      pids_(world_size, -1),
      stopped_after_s_(stopped_peer_after_s()),
      stopped_since_(world_size) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(address.c_str(), "0", &hints, &res);
  TORCH_CHECK(rc == 0 && res != nullptr, "rank ", rank, ": cannot resolve local address '", address,
              "': ", gai_strerror(rc));
  listen_fd_ = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  bool ok = listen_fd_ >= 0 && bind(listen_fd_, res->ai_addr, res->ai_addrlen) == 0 &&
            listen(listen_fd_, SOMAXCONN) == 0;
  freeaddrinfo(res);
  TORCH_CHECK(ok, "rank ", rank, ": cannot listen on ", address, ": ", std::strerror(errno));
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  char host[NI_MAXHOST], port[NI_MAXSERV];
  getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof(host), port, sizeof(port),
              NI_NUMERICHOST | NI_NUMERICSERV);
  const std::string here = host_identity();
  store->set(key_of(rank), bytes_of(std::string(host) + " " + port + " " +
                                    std::to_string(::getpid()) + " " + here));

  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r)
    if (r != rank) keys.push_back(key_of(r));
  if (!keys.empty()) store->wait(keys, timeout);
  for (int r = 0; r < world_size; ++r) {
    if (r == rank) continue;
    auto v = store->get(key_of(r));
    std::string s(v.begin(), v.end());
    {
      std::istringstream fields(s);
      std::string h, p, identity;
      int pid = -1;
      if ((fields >> h >> p >> pid >> identity) && !here.empty() && identity == here &&
          !peers_on_other_hosts())
        pids_[r] = pid;
    }
    auto sp = s.find(' ');
    const auto sp2 = s.find(' ', sp + 1);
    if (sp2 != std::string::npos) s = s.substr(0, sp2);
    addrinfo h{};
    h.ai_family = AF_UNSPEC;
    h.ai_socktype = SOCK_STREAM;
    h.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    addrinfo* peer = nullptr;
    rc = getaddrinfo(s.substr(0, sp).c_str(), s.substr(sp + 1).c_str(), &h, &peer);
    TORCH_CHECK(rc == 0 && peer != nullptr, "rank ", rank, ": bad monitor address of rank ", r,
                ": '", s, "'");
    int fd = socket(peer->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    bool connected = fd >= 0 && connect(fd, peer->ai_addr, peer->ai_addrlen) == 0;
    freeaddrinfo(peer);
    if (!connected) {
      int err = errno;
      if (fd >= 0) close(fd);
      TORCH_CHECK(false, "rank ", rank, ": cannot connect to rank ", r, " at ", s, ": ",
                  std::strerror(err));
    }
    fds_[r] = fd;
  }
  // Peers on other hosts: say who we are on each connection to one, then
  // send heartbeats (and read theirs) from a thread of our own.
  const auto now = std::chrono::steady_clock::now();
  last_heard_.assign(world_size, now);
  for (int r = 0; r < world_size; ++r) {
    if (r == rank || !remote(r)) continue;
    any_remote_ = true;
    const int32_t me = rank;
    TORCH_CHECK(::send(fds_[r], &me, sizeof(me), MSG_NOSIGNAL) == ssize_t(sizeof(me)), "rank ",
                rank, ": cannot reach rank ", r, "'s monitor: ", std::strerror(errno));
  }
  if (any_remote_ && stopped_after_s_ > 0) {
    TORCH_CHECK(::pipe2(wake_, O_CLOEXEC) == 0, "rank ", rank, ": pipe: ", std::strerror(errno));
    beat_thread_ = std::thread([this] { beat_loop(); });
  }
}

PeerMonitor::~PeerMonitor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (beat_thread_.joinable()) {
    const char b = 0;
    ssize_t ignored = ::write(wake_[1], &b, 1);
    (void)ignored;
    beat_thread_.join();
  }
  for (int fd : wake_)
    if (fd >= 0) close(fd);
  for (int fd : fds_)
    if (fd >= 0) close(fd);
  if (listen_fd_ >= 0) close(listen_fd_);
}

std::vector<int> PeerMonitor::lost_ranks(std::chrono::milliseconds wait_up_to) const {
  std::vector<pollfd> pfds;
  std::vector<int> ranks;
  for (size_t r = 0; r < fds_.size(); ++r) {
    if (fds_[r] < 0) continue;
    pfds.push_back(pollfd{fds_[r], POLLIN | POLLRDHUP, 0});
    ranks.push_back(int(r));
  }
  std::vector<int> lost;
  if (pfds.empty()) return lost;
  auto deadline = std::chrono::steady_clock::now() + wait_up_to;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    int n = poll(pfds.data(), pfds.size(), int(std::max<int64_t>(0, left.count())));
    if (n < 0 && errno == EINTR) continue;
    for (size_t i = 0; i < pfds.size(); ++i)
      if (pfds[i].revents != 0) lost.push_back(ranks[i]);
    if (!lost.empty() || left.count() <= 0 || n <= 0) return lost;
  }
}

bool PeerMonitor::watches() const {
  return stopped_after_s_ > 0 &&
         (beat_thread_.joinable() ||
          std::any_of(pids_.begin(), pids_.end(), [](int pid) { return pid > 0; }));
}

int PeerMonitor::stopped_peer() {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_ >= 0 || !watches()) return stopped_;
  const auto now = std::chrono::steady_clock::now();
  for (size_t r = 0; r < pids_.size(); ++r) {
    if (int(r) != rank_ && remote(int(r)) && beat_thread_.joinable()) {
      if (std::chrono::duration<double>(now - last_heard_[r]).count() >=
          stopped_after_s_ + std::chrono::duration<double>(kBeat).count()) {
        stopped_ = int(r);
        break;
      }
      continue;
    }
    if (pids_[r] <= 0) continue;
    if (!process_stopped(pids_[r])) {
      stopped_since_[r] = {};
      continue;
    }
    if (stopped_since_[r] == std::chrono::steady_clock::time_point{}) stopped_since_[r] = now;
    if (std::chrono::duration<double>(now - stopped_since_[r]).count() >= stopped_after_s_) {
      stopped_ = int(r);
      break;
    }
  }
  return stopped_;
}

bool PeerMonitor::enter(c10d::Work* work) {
  if (!watches()) return true;
  std::lock_guard<std::mutex> lock(mu_);
  if (stopped_ >= 0) return false;
  waiting_.push_back(work);
  if (!thread_.joinable()) thread_ = std::thread([this] { watch_loop(); });
  cv_.notify_all();
  return true;
}

void PeerMonitor::leave(c10d::Work* work) {
  if (!watches()) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::find(waiting_.begin(), waiting_.end(), work);
  if (it != waiting_.end()) waiting_.erase(it);
}

void PeerMonitor::watch_loop() {
  // Once a peer is found stopped, every wait still in (or entered between
  // the look and its wait) is aborted again at each look.
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (waiting_.empty()) {
      cv_.wait(lock, [&] { return stop_ || !waiting_.empty(); });
      continue;
    }
    cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stop_; });
    if (stop_) break;
    lock.unlock();
    const int stopped = stopped_peer();
    lock.lock();
    if (stopped < 0) continue;
    for (c10d::Work* w : waiting_) {
      try {
        w->abort();  // Gloo's send and receive: the wait returns false
      } catch (...) {
      }
    }
  }
}

void PeerMonitor::beat_loop() {
  // Accepted connections: who they are from (the first 4 bytes) and, after
  // that, any byte is a sign of life.
  struct In {
    int fd;
    int rank = -1;
    int32_t id = 0;
    size_t got = 0;
  };
  std::vector<In> ins;
  auto next_beat = std::chrono::steady_clock::now();
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_beat) {
      const char b = 1;
      for (size_t r = 0; r < fds_.size(); ++r)
        if (int(r) != rank_ && remote(int(r)) && fds_[r] >= 0)
          (void)::send(fds_[r], &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      next_beat = now + kBeat;
    }
    std::vector<pollfd> pfds{{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    for (const In& in : ins)
      pfds.push_back({in.fd, POLLIN, 0});
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(next_beat - now).count();
    const int n = ::poll(pfds.data(), pfds.size(), int(std::max<int64_t>(1, left)));
    if ((n < 0 && errno != EINTR) || (n > 0 && pfds[0].revents != 0)) break;  // the destructor
    if (n <= 0) continue;
    std::vector<In> keep;
    for (size_t i = 0; i < pfds.size() - 2; ++i) {
      In in = ins[i];
      bool open = true;
      if (pfds[i + 2].revents != 0) {
        char buf[256];
        const ssize_t got = ::recv(in.fd, buf, sizeof(buf), 0);
        if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
          open = false;  // the peer is gone: lost_ranks says so, not us
        } else if (got > 0) {
          size_t used = 0;
          while (in.got < sizeof(in.id) && used < size_t(got))
            reinterpret_cast<char*>(&in.id)[in.got++] = buf[used++];
          if (in.got == sizeof(in.id) && in.id >= 0 && size_t(in.id) < last_heard_.size())
            in.rank = in.id;
          if (in.rank >= 0) {
            std::lock_guard<std::mutex> lock(mu_);
            last_heard_[in.rank] = std::chrono::steady_clock::now();
          }
        }
      }
      if (open)
        keep.push_back(in);
      else
        ::close(in.fd);
    }
    if (pfds[1].revents & POLLIN) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) keep.push_back(In{fd});
    }
    ins.swap(keep);
  }
  for (const In& in : ins)
    ::close(in.fd);
}

}  // namespace hp::distributed::detail
