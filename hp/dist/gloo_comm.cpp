// The Gloo backend of Comm: c10d's ProcessGroupGloo held directly, its
// rendezvous over a TCPStore or FileStore, the choice of the Gloo device
// address, and the translation of Gloo's errors into CommError.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "hp/core/compat.h"
#include "hp/dist/comm.h"
#include "hp/dist/comm_internal.h"

namespace hp::dist {
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

struct Endpoint {
  std::string interface_name;  // wins when set
  std::string address;
};

Endpoint pick_endpoint(const CommOptions& o, const std::string& fallback_address) {
  Endpoint e;
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

class GlooComm;

// A pending isend/irecv. c10d's SendWork/RecvWork wait with a timeout and
// throw from Gloo on failure; we translate.
struct GlooWork : Work::Impl {
  std::shared_ptr<const GlooComm> comm;
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor tensor;  // keeps the buffer alive until the wait
  std::string what;
  int peer;
  void wait() override;
};

class GlooComm : public Comm, public std::enable_shared_from_this<GlooComm> {
 public:
  struct Shared {
    c10::intrusive_ptr<c10d::Store> store;  // the root store (no prefix)
    Endpoint endpoint;
    std::shared_ptr<detail::PeerMonitor> monitor;  // over the global ranks
    std::mutex mu;
    std::map<std::string, int> split_counts;
  };

  GlooComm(std::shared_ptr<Shared> shared, c10::intrusive_ptr<c10d::Store> group_store, int rank,
           std::vector<int> global_ranks, const CommOptions& options)
      : shared_(std::move(shared)),
        rank_(rank),
        global_ranks_(std::move(global_ranks)),
        options_(options) {
    auto& ep = shared_->endpoint;
    auto pg_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
    pg_options->devices.push_back(
        ep.interface_name.empty()
            ? c10d::ProcessGroupGloo::createDeviceForHostname(ep.address)
            : c10d::ProcessGroupGloo::createDeviceForInterface(ep.interface_name));
    pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(group_store, rank_, world_size(), pg_options);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return int(global_ranks_.size()); }
  std::chrono::milliseconds timeout() const override { return options_.timeout; }
  std::string backend_name() const override { return "gloo"; }

  Work isend(const at::Tensor& tensor, int dst, int tag) override {
    check_peer(dst, "isend");
    check_tensor(tensor, "isend");
    check_tag(tag, "isend");
    std::vector<at::Tensor> v{tensor};
    return p2p(pg_->send(v, dst, tag), tensor, describe("sending", tensor, "to", dst, tag), dst);
  }

  Work irecv(const at::Tensor& tensor, int src, int tag) override {
    check_peer(src, "irecv");
    check_tensor(tensor, "irecv");
    check_tag(tag, "irecv");
    std::vector<at::Tensor> v{tensor};
    return p2p(pg_->recv(v, src, tag), tensor, describe("receiving", tensor, "from", src, tag),
               src);
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
    run("all_reduce of " + std::to_string(tensor.numel()) + " elements",
        [&] { return pg_->allreduce(v, o); });
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
    run("all_gather of " + std::to_string(in.numel()) + " elements",
        [&] { return pg_->allgather(outputs, inputs); });
  }

  void broadcast(const at::Tensor& tensor, int root) override {
    check_tensor(tensor, "broadcast");
    TORCH_CHECK(root >= 0 && root < world_size(), "broadcast: root ", root,
                " is not a rank of this group (0..", world_size() - 1, ")");
    c10d::BroadcastOptions o;
    o.rootRank = root;
    std::vector<at::Tensor> v{tensor};
    run("broadcast from rank " + std::to_string(root), [&] { return pg_->broadcast(v, o); });
  }

  void barrier() override {
    run("barrier", [&] { return pg_->barrier(); });
  }

  std::shared_ptr<Comm> split(const std::vector<int>& ranks) override {
    TORCH_CHECK(!ranks.empty(), "split: the list of ranks is empty");
    int my = -1;
    std::vector<int> globals;
    std::string name;
    for (size_t i = 0; i < ranks.size(); ++i) {
      TORCH_CHECK(ranks[i] >= 0 && ranks[i] < world_size(), "split: rank ", ranks[i],
                  " is not in this group of ", world_size());
      TORCH_CHECK(i == 0 || ranks[i] > ranks[i - 1], "split: ranks must be sorted and unique");
      if (ranks[i] == rank_) my = int(i);
      globals.push_back(global_ranks_[ranks[i]]);
      name += (i ? "," : "") + std::to_string(globals.back());
    }
    TORCH_CHECK(my >= 0, "split: this rank (", rank_, ") is not in the list; only members call it");
    int n;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      n = shared_->split_counts[name]++;
    }
    auto store = c10::make_intrusive<c10d::PrefixStore>(
        "hp/group/" + name + "/" + std::to_string(n), shared_->store);
    try {
      return std::make_shared<GlooComm>(shared_, store, my, globals, options_);
    } catch (const std::exception& e) {
      throw CommError("rank " + std::to_string(rank_) + ": creating the subgroup {" + name +
                          "} failed (do all its members call split with the same list?): " +
                          message_of(std::current_exception()),
                      {}, false);
    }
  }

  /// Builds and throws the CommError for a failed `what` (see NOTE [Naming the lost peer]).
  [[noreturn]] void fail(const std::string& what, int peer, std::exception_ptr e) const {
    std::string msg = message_of(e);
    bool timed_out = contains(msg, "imed out") || contains(msg, "imeout");
    bool closed = contains(msg, "losed") || contains(msg, "reset") || contains(msg, "EOF") ||
                  contains(msg, "roken pipe") || contains(msg, "onnection");
    auto lost_global = shared_->monitor->lost_ranks(closed ? std::chrono::milliseconds(2000)
                                                           : std::chrono::milliseconds(0));
    std::vector<int> lost;
    for (int g : lost_global)
      for (size_t i = 0; i < global_ranks_.size(); ++i)
        if (global_ranks_[i] == g) lost.push_back(int(i));
    // Name the peer of a p2p operation first when it is among the lost.
    for (size_t i = 0; i < lost.size(); ++i)
      if (lost[i] == peer) std::swap(lost[0], lost[i]);
    std::ostringstream os;
    os << "rank " << rank_ << ": ";
    if (!lost.empty()) {
      os << "lost connection to rank " << lost[0] << name_global(lost[0]);
      for (size_t i = 1; i < lost.size(); ++i)
        os << (i + 1 == lost.size() ? " and " : ", ") << lost[i];
      os << " (its process is gone) while " << what;
    } else if (timed_out) {
      os << "timed out after " << seconds(options_.timeout) << " while " << what
         << "; the peer is alive but did not take part (a mismatched schedule or tag?) or is "
            "too slow (raise the timeout)";
    } else {
      os << what << " failed";
    }
    os << " [gloo: " << msg << "]";
    throw CommError(os.str(), lost, timed_out && lost.empty());
  }

 private:
  std::string name_global(int local) const {
    if (global_ranks_[local] == local && rank_ == global_rank()) return "";
    return " (global rank " + std::to_string(global_ranks_[local]) + ")";
  }
  int global_rank() const { return global_ranks_[rank_]; }

  void check_peer(int peer, const char* op) const {
    TORCH_CHECK(peer >= 0 && peer < world_size(), op, ": rank ", peer, " is not in this group of ",
                world_size(), " ranks");
    TORCH_CHECK(peer != rank_, op, ": rank ", rank_, " cannot ", op, " to/from itself");
  }
  static void check_tag(int tag, const char* op) {
    TORCH_CHECK(tag >= 0 && tag <= detail::kMaxUserTag + 1, op, ": tag ", tag,
                " is out of range; use 0 <= tag < 2^30");
  }

  static std::string describe(const char* verb, const at::Tensor& t, const char* dir, int peer,
                              int tag) {
    std::ostringstream os;
    os << verb << " " << t.numel() << " " << t.scalar_type() << " elements " << dir << " rank "
       << peer << " (tag " << tag << ")";
    return os.str();
  }

  Work p2p(c10::intrusive_ptr<c10d::Work> work, const at::Tensor& tensor, std::string what,
           int peer) {
    auto impl = std::make_shared<GlooWork>();
    impl->comm = shared_from_this();
    impl->work = std::move(work);
    impl->tensor = tensor;
    impl->what = std::move(what);
    impl->peer = peer;
    return Work(impl);
  }

  template <typename F>
  void run(const std::string& what, F&& start) {
    try {
      auto work = start();
      work->wait(options_.timeout);
    } catch (...) {
      fail(what, -1, std::current_exception());
    }
  }

  std::shared_ptr<Shared> shared_;
  int rank_;
  std::vector<int> global_ranks_;
  CommOptions options_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

void GlooWork::wait() {
  try {
    work->wait(comm->timeout());
  } catch (...) {
    comm->fail(what, peer, std::current_exception());
  }
  tensor = at::Tensor();
}

std::shared_ptr<Comm> make_gloo_comm(c10::intrusive_ptr<c10d::Store> store, int rank,
                                     int world_size, Endpoint endpoint,
                                     const CommOptions& options) {
  store->setTimeout(options.timeout);
  auto shared = std::make_shared<GlooComm::Shared>();
  shared->store = store;
  shared->endpoint = endpoint;
  std::vector<int> all(world_size);
  for (int r = 0; r < world_size; ++r)
    all[r] = r;
  std::shared_ptr<Comm> comm;
  try {
    comm = std::make_shared<GlooComm>(
        shared, c10::make_intrusive<c10d::PrefixStore>("hp/group/all", store), rank, all, options);
    shared->monitor = std::make_shared<detail::PeerMonitor>(store, rank, world_size,
                                                            endpoint.address, options.timeout);
  } catch (const CommError&) {
    throw;
  } catch (...) {
    throw CommError("rank " + std::to_string(rank) + ": rendezvous of " +
                        std::to_string(world_size) + " ranks did not complete within " +
                        seconds(options.timeout) +
                        " (are all ranks started, with the same WORLD_SIZE and master?): " +
                        message_of(std::current_exception()),
                    {}, true);
  }
  return comm;
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
  compat::use_classic_tcpstore(so);  // NOTE [TCPStore and libuv]
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
  Endpoint ep = pick_endpoint(options, "");
  if (ep.address.empty()) ep.address = local_address_towards(master_addr, master_port);
  return make_gloo_comm(store, rank, world_size, ep, options);
}

std::shared_ptr<Comm> Comm::from_file_store(const std::string& path, int rank, int world_size,
                                            const CommOptions& options) {
  check_world(rank, world_size);
  TORCH_CHECK(!path.empty(), "from_file_store: the store path is empty");
  auto store = c10::make_intrusive<c10d::FileStore>(path, world_size);
  return make_gloo_comm(store, rank, world_size, pick_endpoint(options, "127.0.0.1"), options);
}

}  // namespace hp::dist
