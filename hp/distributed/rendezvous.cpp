// Rendezvous: a TCPStore (torchrun's variables) or a FileStore, the choice
// of the address Gloo binds to, and the Gloo group made over the store.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "hp/distributed/comm.h"
#include "hp/distributed/comm_internal.h"

namespace hp::distributed {
namespace {

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

std::string seconds(std::chrono::milliseconds t) {
  std::ostringstream os;
  os << double(t.count()) / 1000.0 << " s";
  return os.str();
}

// NOTE [Gloo device address]
// Gloo binds each rank's sockets to one local address and publishes it to the
// peers. createDefaultDevice() uses the address this machine's hostname
// resolves to, which fails or picks a useless address where the hostname does
// not resolve (containers, network namespaces) - so we never use it. In order:
//   1. CommOptions::interface_name or GLOO_SOCKET_IFNAME: that interface;
//   2. CommOptions::bind_address or HP_GLOO_ADDR: that address;
//   3. with a TCP rendezvous: the local address the kernel would use to reach
//      MASTER_ADDR (a UDP socket connect()ed to it, then getsockname(); no
//      packet is sent). That is 127.0.0.1 for a one-machine run, and the
//      address of the rank's own interface in a network namespace or on
//      another host - exactly the address its peers can reach;
//   4. with a FileStore (one machine): 127.0.0.1.
std::string local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || res == nullptr)
    throw CommError("cannot resolve MASTER_ADDR '" + host + "': " + gai_strerror(rc), {}, false);
  int fd = socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  bool ok = fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0;
  freeaddrinfo(res);
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ok = ok && getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0;
  int err = errno;
  if (fd >= 0) close(fd);
  if (!ok)
    throw CommError("no route from this machine to MASTER_ADDR " + host + ": " + std::strerror(err),
                    {}, false);
  char out[NI_MAXHOST];
  getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, out, sizeof(out), nullptr, 0, NI_NUMERICHOST);
  return out;
}

const char* env_or_null(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

using detail::GlooEndpoint;

GlooEndpoint pick_endpoint(const CommOptions& o, const std::string& fallback_address) {
  GlooEndpoint e;
  if (!o.interface_name.empty()) {
    e.interface_name = o.interface_name;
  } else if (const char* ifname = env_or_null("GLOO_SOCKET_IFNAME")) {
    e.interface_name = ifname;
  }
  if (!o.bind_address.empty())
    e.address = o.bind_address;
  else if (const char* a = env_or_null("HP_GLOO_ADDR"))
    e.address = a;
  else
    e.address = fallback_address;
  return e;
}

// NOTE [TCPStore connect backoff]
// LibTorch 1.13's TCPStore client sleeps a whole second after each refused
// connect, so a rank that starts before rank 0 listens loses up to 1 s. We
// first wait for the master's port ourselves (non-blocking connect, retried
// every 20 ms until the timeout), so TCPStore's own connect succeeds at once.
// Returns false when the timeout passed.
bool wait_for_listener(const std::string& host, int port, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    addrinfo* res = nullptr;
    if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) == 0 && res) {
      for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
        int fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) continue;
        bool ok = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
        if (!ok && errno == EINPROGRESS) {
          pollfd p{fd, POLLOUT, 0};
          int err = 0;
          socklen_t len = sizeof(err);
          ok = poll(&p, 1, int(left.count())) == 1 &&
               getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
        }
        close(fd);
        if (ok) {
          freeaddrinfo(res);
          return true;
        }
      }
      freeaddrinfo(res);
    }
    timespec ts{0, 20 * 1000 * 1000};
    nanosleep(&ts, nullptr);
  }
}

void check_world(int rank, int world_size) {
  TORCH_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " is not in [0, ", world_size, ")");
}

}  // namespace

std::shared_ptr<Comm> Comm::from_tcp(const std::string& master_addr, int master_port, int rank,
                                     int world_size, const CommOptions& options) {
  check_world(rank, world_size);
  TORCH_CHECK(master_port > 0 && master_port <= 65535, "master port ", master_port,
              " is not a TCP port (1..65535)");
  std::string where = master_addr + ":" + std::to_string(master_port);
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(master_port);
  so.isServer = rank == 0;
  so.numWorkers = world_size;
  so.waitWorkers = false;  // the process group's rendezvous does the waiting
  so.timeout = options.timeout;
  // NOTE [TCPStore and libuv]
  // LibTorch 2.4 made libuv the default TCPStore server backend, but Debian
  // 13's LibTorch 2.6 is built without libuv: rank 0 then cannot host the
  // store at all ("use_libuv was requested but PyTorch was build without
  // libuv support"). We always ask for the classic backend, which every
  // target has.
  so.useLibUV = false;
  c10::intrusive_ptr<c10d::Store> store;
  auto unreachable = [&](const std::string& detail) {
    return CommError("rank " + std::to_string(rank) + " could not reach MASTER_ADDR:MASTER_PORT (" +
                         where + ") within " + seconds(options.timeout) +
                         "; is rank 0 running and the address reachable from here?" + detail,
                     {}, true);
  };
  if (rank != 0 && !wait_for_listener(master_addr, master_port, options.timeout))
    throw unreachable("");
  try {
    store = c10::make_intrusive<c10d::TCPStore>(master_addr, so);
  } catch (...) {
    std::string msg = message_of(std::current_exception());
    if (rank == 0)
      throw CommError("rank 0 could not host the rendezvous store on port " +
                          std::to_string(master_port) + " (is MASTER_PORT in use?): " + msg,
                      {}, false);
    throw unreachable(" [" + msg + "]");
  }
  // The PeerMonitor binds to the endpoint address (towards the master when
  // Gloo is given an interface name).
  GlooEndpoint ep = pick_endpoint(options, "");
  if (ep.address.empty()) ep.address = local_address_towards(master_addr, master_port);
  return detail::gloo_comm_over_store(store, rank, world_size, ep, options);
}

namespace detail {

std::string monitor_address(const CommOptions& options) {
  const GlooEndpoint ep = pick_endpoint(options, "");
  if (!ep.address.empty()) return ep.address;
  const char* addr = env_or_null("MASTER_ADDR");
  const char* port = env_or_null("MASTER_PORT");
  if (addr != nullptr)
    return local_address_towards(addr, port != nullptr ? std::atoi(port) : 29500);
  return "127.0.0.1";
}

}  // namespace detail

std::shared_ptr<Comm> Comm::from_file_store(const std::string& path, int rank, int world_size,
                                            const CommOptions& options) {
  check_world(rank, world_size);
  TORCH_CHECK(!path.empty(), "from_file_store: the store path is empty");
  auto store = c10::make_intrusive<c10d::FileStore>(path, world_size);
  return detail::gloo_comm_over_store(store, rank, world_size, pick_endpoint(options, "127.0.0.1"),
                                      options);
}

}  // namespace hp::distributed
