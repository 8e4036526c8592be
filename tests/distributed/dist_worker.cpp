// The rank program of test_dist: started as real processes by the launcher (or
// by `ip netns exec`), it rendezvouses from the environment and runs one
// scenario. Prints "dist_worker rank R: ..." and exits 0 when every check holds.
//
//   dist_worker ops              p2p (in order, irecv first, a batch) and all
//                                collectives, checked against float64 references
//   dist_worker exit F CODE      rank F exits with CODE after a barrier
//   dist_worker kill F p2p|coll  rank F SIGKILLs itself after a barrier; the others
//                                wait on a pending irecv from F (p2p) or start an
//                                all_reduce (coll), and must fail naming rank F
//   dist_worker zombie F         rank F runs in a child of its process that is
//                                not reaped for 5 s after it exits; the others,
//                                over shared-memory rings, wait on a receive from
//                                F and must fail naming it while F is a zombie
//   dist_worker sigint F         rank F sends itself SIGINT once its group is
//                                made: it must die of it (NOTE [The embedded
//                                interpreter keeps our signals])
//   dist_worker allreduce        one all_reduce, checked (the netns test)
// HP_DIST_TIMEOUT_MS sets the Comm timeout (default 10000).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

#include "hp/distributed/comm.h"
#include "hp/launch/launcher.h"

namespace {

using hp::distributed::Comm;
using hp::distributed::ReduceOp;
using hp::distributed::Work;

int g_rank = -1;

void check(bool cond, const std::string& what) {
  if (!cond) throw std::runtime_error("check failed: " + what);
}

void check_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  bool ok = got.sizes() == want.sizes() &&
            at::allclose(got.to(at::kDouble), want.to(at::kDouble), 1e-12, 1e-12);
  if (!ok) {
    std::ostringstream os;
    os << what << ": got " << got << " want " << want;
    check(false, os.str());
  }
}

/// Rank r's deterministic contribution: 6 float64 values.
at::Tensor data_of(int r, int64_t n = 6) {
  return at::arange(n, at::kDouble) * (r + 1) + 0.25 * r * r - 1.5;
}

void run_ops(Comm& c) {
  const int r = c.rank(), n = c.world_size();
  const int next = (r + 1) % n, prev = (r - 1 + n) % n;

  // p2p without tags: receives posted before the sends (a barrier between),
  // matched in posting order; waited for in reverse order.
  std::vector<at::Tensor> in;
  std::vector<Work> recvs;
  for (int k = 0; k < 4; ++k) {
    in.push_back(at::zeros({5}, at::kDouble));
    recvs.push_back(c.irecv(in.back(), prev));
  }
  c.barrier();  // every irecv is now posted before any isend
  std::vector<at::Tensor> out;
  std::vector<Work> sends;
  for (int k = 0; k < 4; ++k) {
    out.push_back(at::full({5}, 100.0 * r + k, at::kDouble));
    sends.push_back(c.isend(out.back(), next));
  }
  for (size_t i = recvs.size(); i-- > 0;)
    recvs[i].wait();
  hp::distributed::wait_all(sends);
  for (int k = 0; k < 4; ++k)
    check_close(in[k], at::full({5}, 100.0 * prev + k, at::kDouble), "irecv #" + std::to_string(k));
  // Blocking forms, float32, two messages stay in order; then a batch that
  // sends and receives between the same two ranks at once.
  if (n >= 2) {
    if (r == 0) {
      c.send(at::full({3}, 7.0f), 1);
      c.send(at::full({3}, 8.0f), 1);
    } else if (r == 1) {
      auto a = at::zeros({3}), b = at::zeros({3});
      c.recv(a, 0);
      c.recv(b, 0);
      check_close(a, at::full({3}, 7.0f), "first message");
      check_close(b, at::full({3}, 8.0f), "second message");
    }
    if (r <= 1) {
      auto got = at::zeros({2}, at::kDouble);
      auto mine = at::full({2}, 10.0 + r, at::kDouble);
      auto works = c.batch(
          {hp::distributed::P2POp::send(mine, 1 - r), hp::distributed::P2POp::recv(got, 1 - r)});
      hp::distributed::wait_all(works);
      check_close(got, at::full({2}, 11.0 - r, at::kDouble), "batch exchange");
    }
  }

  // Collectives against references computed locally in float64.
  auto sum = at::zeros({6}, at::kDouble), mx = at::full({6}, -1e300, at::kDouble);
  auto mn = at::full({6}, 1e300, at::kDouble);
  for (int q = 0; q < n; ++q) {
    sum += data_of(q);
    mx = at::maximum(mx, data_of(q) * (q % 2 ? -1 : 1));
    mn = at::minimum(mn, data_of(q) * (q % 2 ? -1 : 1));
  }
  auto t = data_of(r);
  c.all_reduce(t, ReduceOp::Sum);
  check_close(t, sum, "all_reduce sum");
  t = data_of(r);
  c.all_reduce(t, ReduceOp::Avg);
  check_close(t, sum / n, "all_reduce avg");
  t = data_of(r) * (r % 2 ? -1 : 1);
  c.all_reduce(t, ReduceOp::Max);
  check_close(t, mx, "all_reduce max");
  t = data_of(r) * (r % 2 ? -1 : 1);
  c.all_reduce(t, ReduceOp::Min);
  check_close(t, mn, "all_reduce min");
  auto ti = at::full({4}, int64_t(r + 1), at::kLong);
  c.all_reduce(ti);
  check(ti.eq(n * (n + 1) / 2).all().item<bool>(), "all_reduce int64 sum");

  // all_gather, list and flat forms.
  std::vector<at::Tensor> parts;
  for (int q = 0; q < n; ++q)
    parts.push_back(at::empty({6}, at::kDouble));
  c.all_gather(parts, data_of(r));
  for (int q = 0; q < n; ++q)
    check_close(parts[q], data_of(q), "all_gather part " + std::to_string(q));
  auto flat = at::empty({n * 2, 3}, at::kDouble);
  c.all_gather(flat, data_of(r).view({2, 3}));
  std::vector<at::Tensor> all;
  for (int q = 0; q < n; ++q)
    all.push_back(data_of(q).view({2, 3}));
  check_close(flat, at::cat(all), "all_gather flat");

  // reduce_scatter: input n*4 values per rank; rank r keeps slice r of the sum.
  auto rs_in = [&](int q) { return at::arange(n * 4, at::kDouble) * (q + 2) - q; };
  auto rs_sum = at::zeros({n * 4}, at::kDouble);
  for (int q = 0; q < n; ++q)
    rs_sum += rs_in(q);
  auto rs_out = at::empty({4}, at::kDouble);
  c.reduce_scatter(rs_out, rs_in(r));
  check_close(rs_out, rs_sum.narrow(0, 4 * r, 4), "reduce_scatter sum");
  c.reduce_scatter(rs_out, rs_in(r), ReduceOp::Avg);
  check_close(rs_out, rs_sum.narrow(0, 4 * r, 4) / n, "reduce_scatter avg");

  // broadcast from the last rank.
  auto b = data_of(r);
  c.broadcast(b, n - 1);
  check_close(b, data_of(n - 1), "broadcast from rank " + std::to_string(n - 1));

  // A subgroup of ranks {0, n-1} (the pair sharing a DualPipe chunk).
  if (n >= 2 && (r == 0 || r == n - 1)) {
    auto sub = c.split({0, n - 1});
    check(sub->world_size() == 2 && sub->rank() == (r == 0 ? 0 : 1), "subgroup ranks");
    auto s = data_of(r);
    sub->all_reduce(s);
    check_close(s, data_of(0) + data_of(n - 1), "subgroup all_reduce");
    auto p = at::zeros({2}, at::kDouble);
    if (sub->rank() == 0)
      sub->send(at::full({2}, 42.0, at::kDouble), 1);
    else
      sub->recv(p, 0);
    if (sub->rank() == 1) check_close(p, at::full({2}, 42.0, at::kDouble), "subgroup p2p");
  }
  c.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  try {
    hp::launch::apply_rank_pinning();
    if (mode == "zombie" && argc > 2 && std::getenv("RANK") &&
        std::atoi(std::getenv("RANK")) == std::atoi(argv[2])) {
      // The launcher's child forks the rank and does not reap it until 5 s
      // after it exited: the rank is a zombie meanwhile (as under a launcher that waits for its
      // ranks in order).
      pid_t child = fork();
      if (child < 0) throw std::runtime_error("fork failed");
      if (child > 0) {
        siginfo_t info{};
        waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT);  // exited, not reaped
        std::this_thread::sleep_for(std::chrono::seconds(5));
        int status = 0;
        waitpid(child, &status, 0);
        std::_Exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
      }
    }
    hp::distributed::CommOptions o;
    if (const char* t = std::getenv("HP_DIST_TIMEOUT_MS"))
      o.timeout = std::chrono::milliseconds(std::atoi(t));
    else
      o.timeout = std::chrono::seconds(10);
    auto comm = Comm::from_env(o);
    g_rank = comm->rank();
    if (mode == "ops") {
      run_ops(*comm);
    } else if (mode == "exit" && argc > 3) {
      comm->barrier();
      if (comm->rank() == std::atoi(argv[2])) {
        std::fflush(stdout);
        std::_Exit(std::atoi(argv[3]));
      }
    } else if (mode == "kill" && argc > 3) {
      const int f = std::atoi(argv[2]);
      const bool p2p = std::string(argv[3]) == "p2p";
      auto buf = at::zeros({4}, at::kDouble);
      Work pending;
      if (p2p && comm->rank() != f) pending = comm->irecv(buf, f);
      comm->barrier();
      if (comm->rank() == f) raise(SIGKILL);
      if (p2p) {
        pending.wait();
      } else {
        auto t = data_of(comm->rank());
        comm->all_reduce(t);
      }
      throw std::runtime_error("the operation with the killed rank succeeded");
    } else if (mode == "zombie" && argc > 2) {
      const int f = std::atoi(argv[2]);
      auto rings = hp::distributed::with_shared_memory_p2p(comm);
      auto buf = at::zeros({4}, at::kDouble);
      Work pending;
      if (rings->rank() != f) pending = rings->irecv(buf, f);
      comm->barrier();
      if (rings->rank() == f) std::_Exit(3);
      const auto t0 = std::chrono::steady_clock::now();
      try {
        pending.wait();
      } catch (const std::exception& e) {
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::fprintf(stderr, "dist_worker rank %d: failed after %.2f s: %s\n", g_rank, s, e.what());
        std::fflush(stderr);
        std::_Exit(2);
      }
      throw std::runtime_error("the receive from the dead rank succeeded");
    } else if (mode == "sigint" && argc > 2) {
      comm->barrier();  // every rank's group is complete
      if (comm->rank() == std::atoi(argv[2])) {
        raise(SIGINT);
        std::this_thread::sleep_for(std::chrono::seconds(2));
        throw std::runtime_error("survived SIGINT");
      }
    } else if (mode == "allreduce") {
      auto t = data_of(comm->rank());
      comm->all_reduce(t);
      auto want = at::zeros({6}, at::kDouble);
      for (int q = 0; q < comm->world_size(); ++q)
        want += data_of(q);
      check_close(t, want, "all_reduce");
    } else {
      throw std::runtime_error("unknown mode '" + mode + "'");
    }
    std::printf("dist_worker rank %d: %s ok\n", comm->rank(), mode.c_str());
    std::fflush(stdout);
    // Skip the destructors' wait on Gloo's threads: the run is over.
    std::_Exit(0);
  } catch (const std::exception& e) {
    auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    std::fprintf(stderr, "dist_worker rank %d: error: %s\n", g_rank,
                 c10_error ? c10_error->what_without_backtrace() : e.what());
    std::fflush(stderr);
    // NOTE: a Comm destroyed after a CommError may wait for Gloo's in-flight
    // work up to the timeout; a failed rank should just exit.
    std::_Exit(2);
  }
}
