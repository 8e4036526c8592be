// Tests of hp/dist with real processes: dist_worker ranks started by the
// launcher (ops, exit codes, SIGKILL and the survivors' errors), the `hp launch`
// CLI, env parsing, rendezvous errors, FileStore ranks as threads, two netns.
#include <gtest/gtest.h>

#include "tests/common/netns.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/distributed/lanes.h"
#include "hp/distributed/mesh.h"
#include "hp/launch/launcher.h"

namespace {

using hp::distributed::Comm;
using hp::distributed::CommError;
using hp::launch::LaunchOptions;
using hp::launch::LaunchResult;
using hp::launch::RankStatus;

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// A fresh temporary folder, removed with its files at the end of the test.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/hp_dist_XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf '" + path + "'").c_str()); }
};

LaunchOptions worker_launch(int nproc, std::vector<std::string> args, const TempDir& dir,
                            int timeout_ms = 10000) {
  LaunchOptions o;
  o.nproc = nproc;
  o.command = {HP_DIST_WORKER};
  o.command.insert(o.command.end(), args.begin(), args.end());
  o.timeout = std::chrono::milliseconds(timeout_ms);
  o.run_timeout = std::chrono::seconds(60);  // a safety net for the test itself
  o.env.push_back({"HP_DIST_TIMEOUT_MS", std::to_string(timeout_ms)});
  o.output_dir = dir.path;
  return o;
}

std::string logs_of(const LaunchResult& r, const TempDir& dir) {
  std::string all;
  for (const auto& s : r.ranks)
    all += "--- rank " + std::to_string(s.rank) + " (" + s.describe() + ")\n" +
           read_file(dir.path + "/rank_" + std::to_string(s.rank) + ".log");
  return all;
}

class LaunchOps : public ::testing::TestWithParam<int> {};

TEST_P(LaunchOps, P2pAndCollectivesMatchFloat64References) {
  TempDir dir;
  auto r = hp::launch::launch_local(worker_launch(GetParam(), {"ops"}, dir));
  ASSERT_TRUE(r.ok()) << r.summary() << logs_of(r, dir);
  for (const auto& s : r.ranks)
    EXPECT_NE(read_file(dir.path + "/rank_" + std::to_string(s.rank) + ".log").find("ops ok"),
              std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Dist, LaunchOps, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "n" + std::to_string(i.param);
                         });

TEST(Launch, ReportsTheRankThatExitedWithItsCode) {
  TempDir dir;
  auto r = hp::launch::launch_local(worker_launch(2, {"exit", "1", "3"}, dir));
  ASSERT_EQ(r.ranks.size(), 2u);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.first_failed_rank, 1) << r.summary();
  EXPECT_EQ(r.ranks[1].state, RankStatus::State::Exited);
  EXPECT_EQ(r.ranks[1].exit_code, 3);
  EXPECT_EQ(r.ranks[1].describe(), "exit 3");
  EXPECT_TRUE(r.ranks[0].ok()) << r.summary() << logs_of(r, dir);
  EXPECT_EQ(r.exit_code(), 3);
  EXPECT_NE(r.summary().find("rank 1 (pid"), std::string::npos);
}

struct KillCase {
  int nproc;
  int victim;
  const char* how;
};

class LaunchKill : public ::testing::TestWithParam<KillCase> {};

TEST_P(LaunchKill, SurvivorsFailWithinTheTimeoutNamingTheLostRank) {
  const auto c = GetParam();
  TempDir dir;
  const int timeout_ms = 8000;
  auto t0 = std::chrono::steady_clock::now();
  auto r = hp::launch::launch_local(
      worker_launch(c.nproc, {"kill", std::to_string(c.victim), c.how}, dir, timeout_ms));
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string logs = logs_of(r, dir);
  ASSERT_EQ(int(r.ranks.size()), c.nproc);
  EXPECT_EQ(r.first_failed_rank, c.victim) << r.summary();
  EXPECT_EQ(r.ranks[c.victim].state, RankStatus::State::Signaled);
  EXPECT_EQ(r.ranks[c.victim].signal, SIGKILL);
  EXPECT_EQ(r.ranks[c.victim].describe(), "killed by SIGKILL");
  EXPECT_NE(r.summary().find("killed by SIGKILL"), std::string::npos);
  for (const auto& s : r.ranks) {
    if (s.rank == c.victim) continue;
    // Failed by itself (not terminated by the launcher), well within the
    // timeout after the victim died (startup, which on the pip target
    // includes importing torch to make the Gloo group, does not count).
    EXPECT_EQ(s.state, RankStatus::State::Exited) << r.summary() << logs;
    EXPECT_NE(s.exit_code, 0) << r.summary() << logs;
    EXPECT_LT(s.seconds - r.ranks[c.victim].seconds, timeout_ms / 1000.0) << r.summary() << logs;
    std::string log = read_file(dir.path + "/rank_" + std::to_string(s.rank) + ".log");
    // "lost connection to rank 1 (...", or, in a collective that a survivor
    // left too after its own error, "lost connection to rank 0 and 1 (...".
    const auto at = log.find("lost connection to rank ");
    ASSERT_NE(at, std::string::npos) << logs;
    std::istringstream lost(log.substr(at + 24, log.find(" (", at) - at - 24));
    std::vector<std::string> named;
    for (std::string w; lost >> w;)
      if (w != "and") named.push_back(w.back() == ',' ? w.substr(0, w.size() - 1) : w);
    EXPECT_NE(std::find(named.begin(), named.end(), std::to_string(c.victim)), named.end()) << log;
  }
  EXPECT_LT(elapsed - r.ranks[c.victim].seconds, timeout_ms / 1000.0 + 5) << r.summary();
}

INSTANTIATE_TEST_SUITE_P(Dist, LaunchKill,
                         ::testing::Values(KillCase{2, 1, "p2p"}, KillCase{3, 1, "coll"},
                                           KillCase{3, 0, "p2p"}),
                         [](const ::testing::TestParamInfo<KillCase>& i) {
                           return "n" + std::to_string(i.param.nproc) + "_kill" +
                                  std::to_string(i.param.victim) + "_" + i.param.how;
                         });

// A rank that died but was not reaped yet (a zombie) is gone for its peers
// over the shared-memory rings: they fail naming it at once, not at the
// timeout (NOTE [A dead peer is not a zombie] in hp/distributed/shm_p2p.cpp).
TEST(LaunchZombie, RingPeersFailNamingAnUnreapedDeadRank) {
  TempDir dir;
  auto r = hp::launch::launch_local(worker_launch(2, {"zombie", "1"}, dir, 20000));
  std::string log = read_file(dir.path + "/rank_0.log");
  EXPECT_NE(log.find("lost connection to rank 1"), std::string::npos) << logs_of(r, dir);
  const auto at = log.find("failed after ");
  ASSERT_NE(at, std::string::npos) << logs_of(r, dir);
  // Rank 1's process is reaped 5 s after it exits: before that, only a check
  // that sees a zombie as dead can fail rank 0.
  EXPECT_LT(std::stod(log.substr(at + 13)), 2.0) << log;
}

// Making a Gloo group (through an embedded Python on the pip target) leaves
// SIGINT's default in place: Ctrl-C ends a rank.
TEST(Launch, SigintEndsARankAfterItMadeItsGroup) {
  TempDir dir;
  auto r = hp::launch::launch_local(worker_launch(2, {"sigint", "1"}, dir));
  ASSERT_EQ(int(r.ranks.size()), 2);
  EXPECT_EQ(r.ranks[1].state, RankStatus::State::Signaled) << r.summary() << logs_of(r, dir);
  EXPECT_EQ(r.ranks[1].signal, SIGINT) << r.summary() << logs_of(r, dir);
}

TEST(Launch, TerminatesRanksThatOutliveTheTimeoutAfterAFailure) {
  LaunchOptions o;
  o.nproc = 2;
  // Rank 1 fails at once; rank 0 would sleep for a minute.
  o.command = {"sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 4; fi; exec sleep 60"};
  o.timeout = std::chrono::milliseconds(500);
  o.kill_grace = std::chrono::milliseconds(2000);
  auto t0 = std::chrono::steady_clock::now();
  auto r = hp::launch::launch_local(o);
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.first_failed_rank, 1) << r.summary();
  EXPECT_EQ(r.ranks[1].describe(), "exit 4");
  EXPECT_EQ(r.ranks[0].state, RankStatus::State::Terminated) << r.summary();
  EXPECT_EQ(r.ranks[0].signal, SIGTERM);
  EXPECT_EQ(r.exit_code(), 4);
  EXPECT_LT(elapsed, 10.0);
}

TEST(Launch, SetsTorchrunVariablesAndPinning) {
  TempDir dir;
  LaunchOptions o;
  o.nproc = 3;
  o.command = {"sh", "-c",
               "echo $RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $MASTER_PORT $HP_PIN_CORES $EXTRA"};
  o.pin_cores = true;
  o.master_port = 23456;
  o.env.push_back({"EXTRA", "x"});
  o.output_dir = dir.path;
  auto r = hp::launch::launch_local(o);
  ASSERT_TRUE(r.ok()) << r.summary();
  for (int k = 0; k < 3; ++k) {
    auto k_s = std::to_string(k);
    EXPECT_EQ(read_file(dir.path + "/rank_" + k_s + ".log"),
              k_s + " 3 " + k_s + " 127.0.0.1 23456 1 x\n");
  }
}

TEST(Launch, AMissingCommandThrows) {
  LaunchOptions o;
  o.nproc = 2;
  o.command = {"/nonexistent/hp_dist_no_such_program"};
  try {
    hp::launch::launch_local(o);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("cannot run '/nonexistent/hp_dist_no_such_program'"),
              std::string::npos)
        << e.what();
  }
}

TEST(Launch, PinningIsOffUnlessAsked) {
  unsetenv("HP_PIN_CORES");
  EXPECT_EQ(hp::launch::apply_rank_pinning(), -1);
}

/// Runs a shell command, returns (exit status, stdout+stderr).
std::pair<int, std::string> shell(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0)
    out.append(buf, n);
  int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

TEST(LaunchCli, ExitsWithTheFailedRanksCodeAndASummary) {
  struct stat sb;
  if (stat(HP_CLI, &sb) != 0) GTEST_SKIP() << "the hp binary is not built (" << HP_CLI << ")";
  auto [code, out] =
      shell(std::string(HP_CLI) + " launch -n 2 --timeout 10 -- " + HP_DIST_WORKER + " exit 0 3");
  EXPECT_EQ(code, 3) << out;
  EXPECT_NE(out.find("rank 0 failed (exit 3)"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 1 (pid"), std::string::npos) << out;
  auto [ok_code, ok_out] =
      shell(std::string(HP_CLI) + " launch -n 2 -- " + HP_DIST_WORKER + " allreduce");
  EXPECT_EQ(ok_code, 0) << ok_out;
}

// ---- environment and rendezvous errors (in process) -------------------------

struct EnvGuard {
  std::vector<std::pair<std::string, std::string>> saved;
  explicit EnvGuard(std::vector<std::pair<const char*, const char*>> vars) {
    for (const char* n :
         {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HP_DIST_TIMEOUT_MS"}) {
      const char* v = std::getenv(n);
      saved.push_back({n, v ? v : std::string("\x01")});
      unsetenv(n);
    }
    for (auto& [n, v] : vars)
      setenv(n, v, 1);
  }
  ~EnvGuard() {
    for (auto& [n, v] : saved) {
      if (v == "\x01")
        unsetenv(n.c_str());
      else
        setenv(n.c_str(), v.c_str(), 1);
    }
  }
};

std::string env_error(std::vector<std::pair<const char*, const char*>> vars) {
  EnvGuard g(vars);
  try {
    hp::distributed::read_env();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(DistEnv, NamesTheMissingOrInvalidVariableWithAnExample) {
  auto e = env_error({{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(e.find("RANK is not set"), std::string::npos) << e;
  EXPECT_NE(e.find("e.g. RANK=0 WORLD_SIZE=2"), std::string::npos) << e;
  e = env_error({{"RANK", "0"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(e.find("WORLD_SIZE is not set"), std::string::npos) << e;
  e = env_error({{"RANK", "x1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(e.find("RANK='x1' is not an integer"), std::string::npos) << e;
  e = env_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(e.find("RANK=2 must be smaller than WORLD_SIZE=2"), std::string::npos) << e;
  e = env_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(e.find("MASTER_ADDR is not set"), std::string::npos) << e;
  e = env_error(
      {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "99999"}});
  EXPECT_NE(e.find("MASTER_PORT='99999' is not a TCP port"), std::string::npos) << e;
  EXPECT_EQ(
      env_error(
          {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}}),
      "");
  EnvGuard g({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}});
  auto c = hp::distributed::read_env();
  EXPECT_EQ(c.rank, 1);
  EXPECT_EQ(c.local_rank, 1);  // defaults to RANK
  EXPECT_EQ(c.world_size, 2);
  EXPECT_EQ(c.master_addr, "h");
  EXPECT_EQ(c.master_port, 29500);
}

// NOTE [A Gloo group's connect, agreed] in hp/distributed/gloo_group.cpp: a
// member whose connect its peer closed makes every member make the group
// again (the world's group and a split), and the group then works; three
// closes in a row end every member, naming the member that failed.
TEST(DistRendezvous, AConnectClosedByThePeerIsMadeAgainOnEveryMember) {
  for (const std::string faults : {"1:0", "0:0,1:1", "1:0,1:1,1:2"}) {
    SCOPED_TRACE(faults);
    setenv("HP_FAULT_GLOO_CONNECT", faults.c_str(), 1);
    struct Unset {
      ~Unset() { unsetenv("HP_FAULT_GLOO_CONNECT"); }
    } unset;
    TempDir dir;
    std::vector<std::string> got(2);
    std::vector<std::thread> ts;
    for (int r = 0; r < 2; ++r)
      ts.emplace_back([&, r] {
        try {
          hp::distributed::CommOptions o;
          o.timeout = std::chrono::seconds(20);
          auto world = Comm::from_file_store(dir.path + "/s", r, 2, o);
          auto sub = world->split({0, 1});
          auto t = at::full({3}, double(r + 1), at::kDouble);
          sub->all_reduce(t);
          got[r] = std::to_string(int(t[0].item<double>()));
        } catch (const std::exception& e) {
          got[r] = std::string("error: ") + e.what();
        }
      });
    for (auto& t : ts)
      t.join();
    if (faults != "1:0,1:1,1:2") {
      EXPECT_EQ(got[0], "3");
      EXPECT_EQ(got[1], "3");
    } else {
      EXPECT_NE(got[0].find("member 1 of the group could not connect (try 3)"), std::string::npos)
          << got[0];
      for (const auto& e : got)
        EXPECT_NE(e.find("closed by peer (injected by HP_FAULT_GLOO_CONNECT)"), std::string::npos)
            << e;
    }
  }
}

TEST(DistRendezvous, UnreachableMasterFailsWithinTheTimeout) {
  int port = hp::launch::pick_free_port();  // nobody listens there
  EnvGuard g({{"RANK", "1"},
              {"WORLD_SIZE", "2"},
              {"MASTER_ADDR", "127.0.0.1"},
              {"MASTER_PORT", std::to_string(port).c_str()},
              {"HP_DIST_TIMEOUT_MS", "2000"}});
  auto t0 = std::chrono::steady_clock::now();
  try {
    Comm::from_env();
    FAIL() << "expected an error";
  } catch (const CommError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("could not reach MASTER_ADDR:MASTER_PORT (127.0.0.1:" + std::to_string(port) +
                     ") within 2 s"),
              std::string::npos)
        << m;
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 2.0 + 3.0);
}

// ---- FileStore ranks as threads of this process ---------------------------

TEST(DistFileStore, ThreadsAsRanksSendRecvAllReduceAndSubgroups) {
  TempDir dir;
  const int n = 3;
  std::vector<std::string> errors(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) {
    ts.emplace_back([&, r] {
      try {
        hp::distributed::CommOptions o;
        o.timeout = std::chrono::seconds(10);
        auto c = Comm::from_file_store(dir.path + "/store", r, n, o);
        auto t = at::full({4}, double(r + 1), at::kDouble);
        c->all_reduce(t);
        if (!t.eq(6.0).all().item<bool>()) errors[r] += "all_reduce; ";
        auto got = at::zeros({2}, at::kLong);
        auto recv = c->irecv(got, (r + n - 1) % n);
        c->send(at::full({2}, int64_t(r), at::kLong), (r + 1) % n);
        recv.wait();
        if (got[0].item<int64_t>() != (r + n - 1) % n) errors[r] += "ring p2p; ";
        if (r != 1) {
          auto sub = c->split({0, 2});
          auto s = at::full({1}, double(r), at::kDouble);
          sub->all_reduce(s, hp::distributed::ReduceOp::Max);
          if (s.item<double>() != 2.0) errors[r] += "subgroup max; ";
        }
        c->barrier();
        // Misuse is reported, not sent.
        try {
          c->isend(at::zeros({2, 2}).t(), (r + 1) % n);
          errors[r] += "non-contiguous accepted; ";
        } catch (const c10::Error& e) {
          if (std::string(e.what_without_backtrace()).find("contiguous") == std::string::npos)
            errors[r] += "contiguity message; ";
        }
      } catch (const std::exception& e) {
        errors[r] += e.what();
      }
    });
  }
  for (auto& t : ts)
    t.join();
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(errors[r], "") << "rank " << r;
}

// ---- point-to-point in posting order ------------------------------------------

// Runs `body` on two ranks (threads) with a 2 s timeout; returns each rank's
// error text ("" when it finished).
std::vector<std::string> two_ranks(const std::function<void(int, std::shared_ptr<Comm>)>& body) {
  TempDir dir;
  std::vector<std::string> errors(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      try {
        hp::distributed::CommOptions o;
        o.timeout = std::chrono::seconds(2);
        body(r, Comm::from_file_store(dir.path + "/s", r, 2, o));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts)
    t.join();
  return errors;
}

// NOTE [A failed step reaches the peers] over a plain Gloo group: rank 0
// abandons while rank 1 waits to receive from it (the timeout is 20 s). A
// slow but healthy message first (its wait outlasts a look at the store).
// Rank 1's wait must end at once, naming rank 0 and its reason; every later
// operation of the watched Comm fails at once too; the group itself still
// carries collectives (the abort broke none of its connections). With
// `lanes`, the watched group in lanes (a Python dispatcher's: bind_moe.cpp)
// and both ranks on lane 1: each lane is a copy that shares the watch.
void abandoned_rank_ends_its_peers_wait(bool lanes) {
  TempDir dir;
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(2), later(2);
  std::vector<double> sums(2, 0.0);
  double waited = -1;
  std::atomic<bool> rank1_failed{false};
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      try {
        hp::distributed::CommOptions o;
        o.timeout = std::chrono::seconds(20);
        auto group = Comm::from_file_store(dir.path + "/s", r, 2, o);
        auto c = hp::distributed::with_failure_store(group, store);
        if (lanes) c = hp::distributed::with_lanes(c, hp::distributed::kPairLanes);
        hp::distributed::LaneScope lane(lanes ? hp::distributed::kPartnerLane : 0);
        if (r == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          c->send(at::ones({4}), 1);
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          c->abandon("rank 0's step failed: a bad batch");
          while (!rank1_failed)
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        } else {
          auto t = at::zeros({4});
          c->recv(t, 0);
          EXPECT_EQ(t.sum().item<double>(), 4.0);
          const auto t0 = std::chrono::steady_clock::now();
          try {
            c->recv(t, 0);
          } catch (const CommError& e) {
            waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            errors[1] = e.what();
            EXPECT_EQ(e.lost_ranks(), std::vector<int>{0});
          }
          try {
            c->all_reduce(at::ones({1}));
          } catch (const CommError& e) {
            later[1] = e.what();
          }
          rank1_failed = true;
        }
        auto x = at::ones({2}, at::kDouble);
        group->all_reduce(x);
        sums[r] = x.sum().item<double>();
      } catch (const std::exception& e) {
        errors[r] += std::string(" [setup: ") + e.what() + "]";
        rank1_failed = true;
      }
    });
  for (auto& t : ts)
    t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_NE(errors[1].find("rank 1: rank 0 stopped taking part while this rank was receiving "
                           "from rank 0: rank 0's step failed: a bad batch"),
            std::string::npos)
      << errors[1];
  EXPECT_GE(waited, 0.0);
  EXPECT_LT(waited, 1.0);
  EXPECT_NE(later[1].find("rank 0 stopped taking part"), std::string::npos) << later[1];
  EXPECT_EQ(sums[0], 4.0);
  EXPECT_EQ(sums[1], 4.0);
}

TEST(DistFailureStore, AnAbandonedRankEndsItsPeersWaitAndTheGroupSurvives) {
  abandoned_rank_ends_its_peers_wait(false);
}

TEST(DistFailureStore, AnAbandonedRankEndsItsPeersWaitOnALaneOfTheGroup) {
  abandoned_rank_ends_its_peers_wait(true);
}

// An exchange started inside a NoExchangeScope throws its reason, which the
// thread can take back once (NOTE [Turns as messages arrive] in
// hp/pipeline/overlap.cpp).
TEST(DistLanes, AnExchangeInsideANoExchangeScopeThrowsItsReason) {
  {
    hp::distributed::NoExchangeScope no("not here");
    try {
      hp::distributed::check_exchange_allowed("an expert dispatch");
      ADD_FAILURE() << "no throw";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "an expert dispatch: not here");
    }
    EXPECT_EQ(hp::distributed::take_exchange_refusal(), "an expert dispatch: not here");
    EXPECT_EQ(hp::distributed::take_exchange_refusal(), "");  // once
    EXPECT_THROW(hp::distributed::check_exchange_allowed("a combine"), std::runtime_error);
  }
  {
    hp::distributed::NoExchangeScope again("a later scope");
    EXPECT_EQ(hp::distributed::take_exchange_refusal(), "");  // none left from the last one
  }
  EXPECT_NO_THROW(hp::distributed::check_exchange_allowed("an expert dispatch"));
}

// Each rank first receives, then (in a later batch) sends: fine where posts
// never block (Gloo), a deadlock where a rank's operations run in posting
// order (NCCL) - and the stream-ordered transport reports it as one.
TEST(DistOrdered, CrossedReceivesDeadlockOnlyInPostingOrder) {
  auto crossed = [](int r, const std::shared_ptr<Comm>& c) {
    auto in = at::zeros({3}, at::kDouble);
    auto recv = c->irecv(in, 1 - r);
    auto send = c->isend(at::full({3}, double(r), at::kDouble), 1 - r);
    recv.wait();
    send.wait();
    if (in[0].item<double>() != 1 - r) throw std::runtime_error("wrong data");
  };
  auto plain = two_ranks(crossed);
  EXPECT_EQ(plain[0], "");
  EXPECT_EQ(plain[1], "");
  auto ordered = two_ranks([&](int r, std::shared_ptr<Comm> c) {
    crossed(r, hp::distributed::with_stream_ordered_p2p(c));
  });
  // One rank's wait times out first; its Comm closes as its thread unwinds,
  // so the other may see the peer gone before its own timeout fires.
  bool timed_out = false;
  for (int r = 0; r < 2; ++r) {
    timed_out = timed_out || ordered[r].find("timed out") != std::string::npos;
    EXPECT_TRUE(ordered[r].find("timed out") != std::string::npos ||
                ordered[r].find("lost connection") != std::string::npos)
        << ordered[r];
  }
  EXPECT_TRUE(timed_out) << ordered[0] << " | " << ordered[1];
  // The same exchange as one batch is one group: no deadlock.
  auto batched = two_ranks([](int r, std::shared_ptr<Comm> c) {
    auto o = hp::distributed::with_stream_ordered_p2p(c);
    auto in = at::zeros({3}, at::kDouble);
    auto works =
        o->batch({hp::distributed::P2POp::recv(in, 1 - r),
                  hp::distributed::P2POp::send(at::full({3}, double(r), at::kDouble), 1 - r)});
    hp::distributed::wait_all(works);
    if (in[0].item<double>() != 1 - r) throw std::runtime_error("wrong data");
  });
  EXPECT_EQ(batched[0], "");
  EXPECT_EQ(batched[1], "");
}

// ---- shared-memory point-to-point ---------------------------------------------

// Two ranks post 48 MiB of sends to each other (more than a 32 MiB ring
// holds) before receiving anything: the messages that do not fit go over
// Gloo behind a header in the ring, in order. Mixed in: a receive posted
// before its send, a message over 8 MiB (always over Gloo), and collectives
// on the wrapped Comm. Messages are matched by order alone; contents are
// checked element by element. `overflow_on_inner`: the messages that leave
// the rings go over the wrapped Comm itself instead of a split of it (NOTE
// [Overflow of a borrowed group] in shm_p2p.cpp).
// Rank r of n (threads of this process) with shared-memory point-to-point
// over a Gloo group through a file store in `dir`; waits time out after 20 s.
std::shared_ptr<Comm> shm_rank(const TempDir& dir, int r, int n,
                               const hp::distributed::SharedMemoryOptions& shm) {
  hp::distributed::CommOptions o;
  o.timeout = std::chrono::seconds(20);
  return hp::distributed::with_shared_memory_p2p(Comm::from_file_store(dir.path + "/s", r, n, o),
                                                 shm);
}

// Runs body(r, errors[r]) for ranks 0 and 1 on threads of this process;
// an exception becomes that rank's error, and each rank must end without one.
void on_two_threads(const std::function<void(int, std::string&)>& body) {
  std::vector<std::string> errors(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      try {
        body(r, errors[r]);
      } catch (const std::exception& e) {
        errors[r] += e.what();
      }
    });
  for (auto& t : ts)
    t.join();
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(errors[r], "") << "rank " << r;
}

void exchange_through_full_rings(bool overflow_on_inner) {
  TempDir dir;
  on_two_threads([&](int r, std::string& error) {
    hp::distributed::SharedMemoryOptions shm;
    shm.overflow_on_inner = overflow_on_inner;
    auto c = shm_rank(dir, r, 2, shm);
    const int peer = 1 - r;
    if (c->backend_name() != "gloo+shm") error += "backend " + c->backend_name() + "; ";
    const int64_t n = (1 << 20) / 8;  // 1 MiB of doubles
    auto message = [&](int k, int from) { return at::arange(n, at::kDouble) + 1000 * k + from; };
    auto early = at::zeros({n}, at::kDouble);
    auto early_work = c->irecv(early, peer);  // posted before anything is sent: message 0
    std::vector<hp::distributed::Work> sends;
    std::vector<at::Tensor> sent;  // kept until their sends complete
    for (int k = 0; k < 48; ++k) {
      sent.push_back(message(k, r));
      sends.push_back(c->isend(sent.back(), peer));
    }
    auto big = at::arange(9 * n, at::kDouble) * (r + 1);  // 9 MiB: over the shm limit
    sends.push_back(c->isend(big, peer));
    early_work.wait();
    if (!early.equal(message(0, peer))) error += "early receive; ";
    for (int k = 1; k < 48; ++k) {
      auto got = at::zeros({n}, at::kDouble);
      c->recv(got, peer);
      if (!got.equal(message(k, peer))) error += "message " + std::to_string(k) + "; ";
    }
    auto big_in = at::zeros_like(big);
    c->recv(big_in, peer);
    hp::distributed::wait_all(sends);
    if (!big_in.equal(at::arange(9 * n, at::kDouble) * (peer + 1))) error += "large; ";
    auto sum = at::full({3}, double(r + 1), at::kDouble);
    c->all_reduce(sum);
    if (!sum.eq(3.0).all().item<bool>()) error += "all_reduce; ";
    c->barrier();
  });
}

TEST(DistSharedMemory, FullRingsEarlyReceiveLargeMessagesAndCollectives) {
  exchange_through_full_rings(/*overflow_on_inner=*/false);
}

TEST(DistSharedMemory, OverflowOnTheWrappedCommKeepsTheOrder) {
  exchange_through_full_rings(/*overflow_on_inner=*/true);
}

// Work::test of a receive over the rings: false before the peer sent,
// true once the message (or, for one over 8 MiB that goes over Gloo, its
// header) is in the ring, without waiting; the data then as sent.
TEST(DistSharedMemory, AReceiveTellsWhetherItsMessageIsThere) {
  TempDir dir;
  std::atomic<int> stage{0};
  on_two_threads([&](int r, std::string& error) {
    auto c = shm_rank(dir, r, 2, hp::distributed::SharedMemoryOptions{});
    const int64_t n = 9 * (1 << 20) / 8;  // 9 MiB of doubles: over Gloo
    auto small = at::arange(16, at::kDouble), big = at::arange(n, at::kDouble);
    if (r == 1) {
      while (stage.load() < 1)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      c->send(small, 0);
      c->send(big, 0);
    } else {
      auto got_small = at::zeros_like(small), got_big = at::zeros_like(big);
      auto w_small = c->irecv(got_small, 1);
      auto w_big = c->irecv(got_big, 1);
      if (w_small.test() != std::optional<bool>(false)) error += "there before sent; ";
      stage = 1;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (w_big.test() != std::optional<bool>(true) &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (w_small.test() != std::optional<bool>(true)) error += "small never there; ";
      if (w_big.test() != std::optional<bool>(true)) error += "large never there; ";
      w_small.wait();
      w_big.wait();
      if (!got_small.equal(small) || !got_big.equal(big)) error += "data; ";
    }
    c->barrier();
  });
}

// A receive whose message never comes fails after the timeout, saying so.
TEST(DistSharedMemory, AMissingMessageTimesOut) {
  TempDir dir;
  std::atomic<bool> finished{false};
  std::string error;
  double waited = 0;
  std::thread other([&] {
    hp::distributed::CommOptions o;
    o.timeout = std::chrono::seconds(1);
    auto c =
        hp::distributed::with_shared_memory_p2p(Comm::from_file_store(dir.path + "/s", 1, 2, o));
    while (!finished)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  });
  try {
    hp::distributed::CommOptions o;
    o.timeout = std::chrono::seconds(1);
    auto c =
        hp::distributed::with_shared_memory_p2p(Comm::from_file_store(dir.path + "/s", 0, 2, o));
    auto t0 = std::chrono::steady_clock::now();
    try {
      c->recv(at::zeros({4}), 1);
    } catch (const CommError& e) {
      waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      error = e.what();
      EXPECT_TRUE(e.timed_out());
    }
  } catch (const std::exception& e) {
    error = std::string("setup: ") + e.what();
  }
  finished = true;
  other.join();
  EXPECT_NE(error.find("timed out after 1 s while receiving from rank 1"), std::string::npos)
      << error;
  EXPECT_GE(waited, 0.9);
  EXPECT_LT(waited, 3.0);
}

// Mappings of shared-memory rings in this process (the rings are unlinked
// once mapped: /proc/self/maps names them "/dev/shm/hp-p2p-... (deleted)").
int mapped_rings() {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);)
    n += line.find("/hp-p2p-") != std::string::npos;
  return n;
}

// Three ranks with rings only between ranks 0 and 1 (links {(1, 0)}): two
// rings, each mapped by its two ends, instead of six; messages between every
// pair in both directions still arrive (0 <-> 2 and 1 <-> 2 over the wrapped
// Comm), each checked.
TEST(DistSharedMemory, RingsOnlyBetweenLinkedRanks) {
  TempDir dir;
  const int before = mapped_rings();
  std::vector<std::string> errors(3);
  std::vector<int> rings_seen(3, -1);
  std::atomic<int> made{0}, checked{0};
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; ++r) {
    ts.emplace_back([&, r] {
      try {
        hp::distributed::SharedMemoryOptions shm;
        shm.links = {{1, 0}};
        auto c = shm_rank(dir, r, 3, shm);
        if (c->backend_name() != (r == 2 ? "gloo" : "gloo+shm"))  // rank 2 has no rings
          errors[r] += "backend " + c->backend_name() + "; ";
        ++made;
        while (made < 3)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        rings_seen[r] = mapped_rings() - before;
        c->barrier();
        std::vector<hp::distributed::Work> sends;
        std::vector<at::Tensor> sent;
        for (int q = 0; q < 3; ++q)
          if (q != r) {
            sent.push_back(at::full({1000}, 10.0 * r + q, at::kDouble));
            sends.push_back(c->isend(sent.back(), q));
          }
        for (int q = 0; q < 3; ++q)
          if (q != r) {
            auto got = at::zeros({1000}, at::kDouble);
            c->recv(got, q);
            if (!got.equal(at::full({1000}, 10.0 * q + r, at::kDouble)))
              errors[r] += "from " + std::to_string(q) + "; ";
          }
        hp::distributed::wait_all(sends);
        c->barrier();
        ++checked;
      } catch (const std::exception& e) {
        errors[r] += e.what();
      }
    });
  }
  for (auto& t : ts)
    t.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(rings_seen[r], 4) << "rank " << r;  // 2 rings x 2 ends, all in this process
  }
  EXPECT_EQ(checked, 3);
  EXPECT_EQ(mapped_rings(), before);  // unmapped with their Comms
}

// Ranks that give different links, or a link that is not a pair of ranks,
// fail together at construction, naming the cause, instead of some of them
// waiting for the others.
TEST(DistSharedMemory, DisagreeingOrBadLinksFailOnEveryRank) {
  for (int bad_link : {0, 1}) {
    TempDir dir;
    std::vector<std::string> errors(2);
    std::vector<std::thread> ts;
    for (int r = 0; r < 2; ++r) {
      ts.emplace_back([&, r] {
        try {
          hp::distributed::SharedMemoryOptions shm;
          if (r == 1) shm.links = {{0, bad_link ? 5 : 1}};
          shm_rank(dir, r, 2, shm);
        } catch (const CommError& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : ts)
      t.join();
    if (bad_link) {
      EXPECT_NE(errors[1].find("the link (0, 5) is not a pair of two ranks of a group of 2"),
                std::string::npos)
          << errors[1];
      EXPECT_NE(errors[0].find("rank 1 gave other links than this rank"), std::string::npos)
          << errors[0];
    } else {
      EXPECT_NE(errors[0].find("rank 1 gave other links than this rank"), std::string::npos)
          << errors[0];
      EXPECT_NE(errors[1].find("rank 0 gave other links than this rank"), std::string::npos)
          << errors[1];
    }
  }
}

// with_point_to_point (NOTE [Choosing the point-to-point]): every rank takes
// the same path. Auto makes rings where both ranks are on the CPU and leaves
// them out, silently, when one rank is on another device ("meta" stands in
// for a GPU); SharedMemory then fails on both ranks, each naming the cause.
TEST(DistSharedMemory, ChoosingThePointToPointAgreesOnEveryRank) {
  using hp::distributed::PointToPoint;
  struct Case {
    PointToPoint how;
    bool rank1_on_meta;
    std::string backend;  // on both ranks; "" = both throw
  };
  for (const Case& k :
       {Case{PointToPoint::Auto, false, "gloo+shm"}, Case{PointToPoint::Auto, true, "gloo"},
        Case{PointToPoint::Group, false, "gloo"},
        Case{PointToPoint::SharedMemory, false, "gloo+shm"},
        Case{PointToPoint::SharedMemory, true, ""}}) {
    SCOPED_TRACE("how " + std::to_string(int(k.how)) + " meta " + std::to_string(k.rank1_on_meta));
    TempDir dir;
    std::vector<std::string> got(2), notes(2);
    std::vector<std::thread> ts;
    for (int r = 0; r < 2; ++r) {
      ts.emplace_back([&, r] {
        try {
          hp::distributed::CommOptions o;
          o.timeout = std::chrono::seconds(20);
          hp::distributed::SharedMemoryOptions shm;
          shm.links = {{0, 1}};
          if (r == 1 && k.rank1_on_meta) shm.device = c10::Device(c10::kMeta);
          auto c = hp::distributed::with_point_to_point(
              Comm::from_file_store(dir.path + "/s", r, 2, o), k.how, shm, &notes[r]);
          got[r] = c->backend_name();
          auto t = at::full({4}, double(r), at::kDouble);
          if (r == 0) c->send(t, 1);
          if (r == 1) {
            c->recv(t, 0);
            if (!t.equal(at::zeros({4}, at::kDouble))) got[r] += " (wrong message)";
          }
        } catch (const CommError& e) {
          got[r] = std::string("error: ") + e.what();
        }
      });
    }
    for (auto& t : ts)
      t.join();
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(notes[r], "") << "rank " << r;
      if (!k.backend.empty()) EXPECT_EQ(got[r], k.backend) << "rank " << r;
    }
    if (k.backend.empty()) {
      EXPECT_NE(got[0].find("rank 1's tensors are not on the CPU"), std::string::npos) << got[0];
      EXPECT_NE(got[1].find("this rank's tensors are on meta"), std::string::npos) << got[1];
    }
  }
}

// ---- two ranks in two network namespaces ------------------------------------

TEST(DistNetns, TwoRanksInTwoNamespacesRendezvousOverTcp) {
  hp::testing::NetnsPair net("hpdist");
  if (!net.error.empty() && !net.created[0]) GTEST_SKIP() << net.error;
  ASSERT_EQ(net.error, "");
  TempDir dir;
  LaunchOptions o;
  o.nproc = 2;
  // Rank r runs in namespace r; both rendezvous at rank 0's veth address.
  o.command = {"sh", "-c",
               "if [ \"$RANK\" = 0 ]; then NS=" + net.ns[0] + "; else NS=" + net.ns[1] +
                   "; fi; exec ip netns exec $NS env MASTER_ADDR=10.231.0.1 MASTER_PORT=29500 " +
                   HP_DIST_WORKER + " allreduce"};
  o.timeout = std::chrono::seconds(10);
  o.run_timeout = std::chrono::seconds(40);
  o.env.push_back({"HP_DIST_TIMEOUT_MS", "10000"});
  o.output_dir = dir.path;
  auto r = hp::launch::launch_local(o);
  ASSERT_TRUE(r.ok()) << r.summary() << logs_of(r, dir);
  EXPECT_NE(read_file(dir.path + "/rank_1.log").find("allreduce ok"), std::string::npos);
}

}  // namespace

// ---- the device mesh -------------------------------------------------------------

// dp = 2 x pp = 2 on 4 threads-as-ranks: coordinates are row-major (pp
// fastest), each slice's group sums only its own ranks, and a shape that does
// not cover the world is refused naming both numbers.
TEST(DistMesh, SlicesOfATwoByTwoMesh) {
  TempDir dir;
  std::vector<std::string> errors(4);
  std::vector<std::thread> ts;
  for (int r = 0; r < 4; ++r)
    ts.emplace_back([&, r] {
      try {
        hp::distributed::CommOptions o;
        o.timeout = std::chrono::seconds(20);
        auto world = Comm::from_file_store(dir.path + "/s", r, 4, o);
        hp::distributed::DeviceMesh mesh(world, {{"dp", "pp"}, {2, 2}});
        if (mesh.coordinate("dp") != r / 2 || mesh.coordinate("pp") != r % 2)
          errors[r] += "coordinates; ";
        if (mesh.size("tp") != 1 || mesh.coordinate("tp") != 0) errors[r] += "absent dim; ";
        auto pp = mesh.slice_ranks("pp"), dp = mesh.slice_ranks("dp");
        if (pp != std::vector<int>{r / 2 * 2, r / 2 * 2 + 1}) errors[r] += "pp slice; ";
        if (dp != std::vector<int>{r % 2, r % 2 + 2}) errors[r] += "dp slice; ";
        if (mesh.group("pp")->rank() != r % 2 || mesh.group("dp")->rank() != r / 2)
          errors[r] += "group ranks; ";
        auto t = at::full({1}, double(1 << r), at::kDouble);  // rank r contributes 2^r
        mesh.group("pp")->all_reduce(t);
        if (t.item<double>() != double((1 << pp[0]) + (1 << pp[1]))) errors[r] += "pp sum; ";
        auto u = at::full({1}, double(1 << r), at::kDouble);
        mesh.group("dp")->all_reduce(u);
        if (u.item<double>() != double((1 << dp[0]) + (1 << dp[1]))) errors[r] += "dp sum; ";
        if (mesh.rank_of(mesh.coordinates_of(r)) != r) errors[r] += "round trip; ";
        try {
          hp::distributed::DeviceMesh bad(world, {{"dp", "pp"}, {3, 2}});
          errors[r] += "3 x 2 accepted on 4 ranks; ";
        } catch (const std::invalid_argument& e) {
          if (std::string(e.what()).find("holds 6 ranks but there are 4") == std::string::npos)
            errors[r] += std::string("message: ") + e.what();
        }
        world->barrier();
      } catch (const std::exception& e) {
        errors[r] += e.what();
      }
    });
  for (auto& t : ts)
    t.join();
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(errors[r], "") << "rank " << r;
}
