// PeerMonitor (see NOTE [Naming the lost peer] in comm_internal.h): one idle
// TCP connection per peer, polled after a failure to say which peer is gone.
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "hp/distributed/comm_internal.h"

namespace hp::distributed::detail {

void check_tensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), what, ": the tensor is undefined");
  TORCH_CHECK(t.layout() == at::kStrided, what, ": communication needs dense tensors");
  TORCH_CHECK(t.is_contiguous(), what,
              ": communication needs a contiguous tensor; call .contiguous() first (and copy the "
              "result back for a receive)");
}

namespace {

std::string key_of(int rank) {
  return "hp/live/" + std::to_string(rank);
}

std::vector<uint8_t> bytes_of(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

}  // namespace

PeerMonitor::PeerMonitor(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                         const std::string& address, std::chrono::milliseconds timeout)
    : rank_(rank), fds_(world_size, -1) {
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
  store->set(key_of(rank), bytes_of(std::string(host) + " " + port));

  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r)
    if (r != rank) keys.push_back(key_of(r));
  if (!keys.empty()) store->wait(keys, timeout);
  for (int r = 0; r < world_size; ++r) {
    if (r == rank) continue;
    auto v = store->get(key_of(r));
    std::string s(v.begin(), v.end());
    auto sp = s.find(' ');
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
}

PeerMonitor::~PeerMonitor() {
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

}  // namespace hp::distributed::detail
