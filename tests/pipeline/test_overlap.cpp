// DualPipe's F&B overlap (NOTE [Overlapped pairs] in hp/pipeline/overlap.cpp)
// and the link model it is measured under (NOTE [The link model] in
// hp/distributed/link_model.cpp): the PairRunner's turns and errors, the
// link's delays over real Gloo, and overlapped pipelines (dense and pp 2 x
// ep 2 MoE, ranks as threads) equal to one process in float64.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/distributed/lanes.h"
#include "hp/pipeline/data_parallel.h"
#include "hp/pipeline/overlap.h"
#include "hp/pipeline/step_timer.h"
#include "hp/schedule/fuse.h"
#include "hp/train/report.h"
#include "hp/train/trainer.h"
#include "tests/common/threads_as_ranks.h"
#include "tests/pipeline/tiny_train.h"

using hp::distributed::LinkModel;
using hp::distributed::Work;
using hp::pipeline::PairRunner;
using hp::train::TrainConfig;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A Work whose wait sleeps: communication that costs time and no CPU.
struct SleepWork : Work::Impl {
  std::chrono::milliseconds ms;
  explicit SleepWork(std::chrono::milliseconds m) : ms(m) {}
  void wait() override { std::this_thread::sleep_for(ms); }
};
Work sleep_work(int ms) {
  return Work(std::make_shared<SleepWork>(std::chrono::milliseconds(ms)));
}

// Communication due `ms` after it was posted, whose test() tells whether
// it has come (Work::test).
struct DueWork : Work::Impl {
  Clock::time_point due;
  explicit DueWork(int ms) : due(Clock::now() + std::chrono::milliseconds(ms)) {}
  void wait() override { std::this_thread::sleep_until(due); }
  std::optional<bool> test() const override { return Clock::now() >= due; }
};
Work due_in(int ms) {
  return Work(std::make_shared<DueWork>(ms));
}

void busy(int ms) {  // compute: the CPU is used
  const auto end = Clock::now() + std::chrono::milliseconds(ms);
  volatile double x = 0;
  while (Clock::now() < end)
    x = x + 1;
}

TEST(PairRunner, HalvesTakeTurnsAtEveryWaitInAnOrderFixedByTheCode) {
  PairRunner runner;
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<std::string> log;
    std::mutex m;
    auto note = [&](const std::string& s) {
      std::lock_guard<std::mutex> lock(m);
      log.push_back(s);
    };
    // Waits on works that are already complete switch too: where the halves
    // switch must not depend on timing.
    auto first = [&] {
      note("F1");
      Work::done().wait();
      note("F2");
      sleep_work(trial).wait();
      note("F3");
    };
    auto second = [&] {
      note("B1");
      sleep_work(2 - trial).wait();
      note("B2");
      Work::done().wait();
      note("B3");
      Work::done().wait();
      note("B4");
    };
    auto stats = runner.run(first, second);
    EXPECT_EQ(log, (std::vector<std::string>{"F1", "B1", "F2", "B2", "F3", "B3", "B4"}))
        << "trial " << trial;
    EXPECT_EQ(stats.switches, 4);
  }
}

// NOTE [Turns as messages arrive]: with first_ready the half whose wait
// ended takes the CPU, out of the code's order; the second half posts on
// its own lane.
TEST(PairRunner, FirstReadyGivesTheCpuToTheHalfWhoseWaitEnded) {
  PairRunner fixed, ready(c10::Device(c10::kCPU), /*first_ready=*/true);
  for (PairRunner* runner : {&fixed, &ready}) {
    std::vector<std::string> log;
    std::mutex m;
    auto note = [&](const std::string& s) {
      std::lock_guard<std::mutex> lock(m);
      log.push_back(s);
    };
    int lanes[2] = {-1, -1};
    // The forward's one wait is long; the backward's two are short.
    auto first = [&] {
      lanes[0] = hp::distributed::current_lane();
      note("F1");
      sleep_work(150).wait();
      note("F2");
    };
    auto second = [&] {
      lanes[1] = hp::distributed::current_lane();
      note("B1");
      sleep_work(5).wait();
      note("B2");
      sleep_work(5).wait();
      note("B3");
    };
    const auto t0 = Clock::now();
    const auto stats = runner->run(first, second);
    const double took = since(t0);
    EXPECT_EQ(lanes[0], hp::distributed::kMainLane);
    EXPECT_EQ(lanes[1], hp::distributed::kPartnerLane);
    if (runner == &fixed) {
      EXPECT_EQ(log, (std::vector<std::string>{"F1", "B1", "F2", "B2", "B3"}));
      EXPECT_GT(took, 0.155) << "the backward's second wait comes after the forward's";
      EXPECT_EQ(stats.reordered, 0);
      // Only the backward's second wait (5 ms) comes after the forward ended.
      EXPECT_GT(stats.exposed_alone, 0.003);
      EXPECT_LT(stats.exposed_alone, 0.08);
    } else {
      EXPECT_EQ(log, (std::vector<std::string>{"F1", "B1", "B2", "B3", "F2"}));
      EXPECT_LT(took, 0.155 + 0.1);
      EXPECT_EQ(stats.reordered, 2) << "B2 and B3 came before F2";
      // The forward's wait outlasts the backward by about 140 ms.
      EXPECT_GT(stats.exposed_alone, 0.12);
    }
    // Nothing computes while they wait: the time both halves wait counts as
    // exposed for each, and no compute hid it.
    EXPECT_LT(stats.hidden, 0.02);
    EXPECT_GT(stats.exposed, 0.15);
    EXPECT_LE(stats.exposed_alone, stats.exposed);
    // Counted once, the pair's whole time went idle inside the chunks.
    EXPECT_GT(stats.chunk_idle, took - 0.03);
    EXPECT_LE(stats.chunk_idle, took);
  }
}

// PairStats::chunk_idle counts the time nothing computed only while no half
// waited on a pipeline receive (the executor counts that one as
// communication): here the backward's own wait falls inside the forward's
// receive. The same forward waiting inside its chunk leaves the CPU idle
// for 80-90 ms (the backward computes 20 of its 100).
TEST(PairRunner, ChunkIdleLeavesOutTheTimeAReceiveIsWaitedFor) {
  auto second = [] {
    busy(10);
    sleep_work(30).wait();
    busy(10);
  };
  for (bool first_ready : {false, true}) {
    PairRunner runner(c10::Device(c10::kCPU), first_ready);
    auto receive = [] {
      hp::pipeline::ReceiveScope receiving;
      sleep_work(100).wait();
    };
    EXPECT_LT(runner.run(receive, second).chunk_idle, 0.02) << first_ready;
    auto own = [] { sleep_work(100).wait(); };
    const double idle = runner.run(own, second).chunk_idle;
    EXPECT_GT(idle, 0.07) << first_ready;
    EXPECT_LT(idle, 0.2) << first_ready;
  }
}

// NOTE [Lanes]: two threads per rank post on one laned group in orders
// that differ between the ranks; each lane keeps its own order, so every
// message reaches the right receive. A subgroup keeps the lanes.
TEST(Lanes, EachLaneKeepsItsOwnOrder) {
  hp::testing::run_ranks_as_threads(2, [](int r, std::shared_ptr<hp::distributed::Comm> g) {
    EXPECT_EQ(hp::distributed::with_lanes(g, 1), g);
    EXPECT_THROW(hp::distributed::with_lanes(g, 0), c10::Error);
    auto laned = hp::distributed::with_lanes(g, hp::distributed::kPairLanes);
    const int peer = 1 - r;
    EXPECT_EQ(hp::distributed::lane_count(*g), 1);
    for (auto comm : {laned, laned->split({0, 1})}) {
      EXPECT_EQ(hp::distributed::lane_count(*comm), hp::distributed::kPairLanes);
      EXPECT_EQ(comm->rank(), r);
      EXPECT_EQ(comm->world_size(), 2);
      // Lane L sends L*100 + k, k = 0..2; rank 0 runs lane 1 before lane 0,
      // rank 1 lane 0 before lane 1 (without lanes the first messages would
      // cross between the threads' receives).
      std::vector<torch::Tensor> got[2];
      auto post = [&](int lane) {
        hp::distributed::LaneScope scope(lane);
        EXPECT_EQ(hp::distributed::current_lane(), lane);
        for (int k = 0; k < 3; ++k) {
          auto in = torch::empty({1}, torch::kFloat64);
          auto works = comm->batch({hp::distributed::P2POp::send(
                                        torch::full({1}, 100.0 * lane + k, torch::kFloat64), peer),
                                    hp::distributed::P2POp::recv(in, peer)});
          hp::distributed::wait_all(works);
          got[lane].push_back(in);
        }
      };
      std::thread other([&] { post(r == 0 ? 0 : 1); });
      post(r == 0 ? 1 : 0);
      other.join();
      for (int lane = 0; lane < 2; ++lane)
        for (int k = 0; k < 3; ++k)
          EXPECT_EQ(got[lane][k].item<double>(), 100.0 * lane + k) << "lane " << lane;
      // A collective on the thread's lane; a lane beyond the count is lane 0.
      hp::distributed::LaneScope beyond(7);
      auto t = torch::full({2}, 1.0 + r, torch::kFloat64);
      comm->all_reduce(t);
      EXPECT_TRUE(torch::equal(t, torch::full({2}, 3.0, torch::kFloat64)));
    }
    EXPECT_EQ(hp::distributed::current_lane(), hp::distributed::kMainLane);
  });
}

TEST(PairRunner, OneHalfComputesWhileTheOtherWaits) {
  PairRunner runner;
  // Each half: compute 100 ms, wait 100 ms, compute 100 ms. Alone: 600 ms;
  // as partners each wait hides behind the other's compute: 400 ms.
  auto half = [] {
    busy(100);
    sleep_work(100).wait();
    busy(100);
  };
  // The best of three tries: on a loaded machine a try can lose its core for
  // a while, which no overlap hides.
  hp::pipeline::PairStats stats;
  double took = 1e9;
  for (int attempt = 0; attempt < 3 && took >= 0.52; ++attempt) {
    const auto t0 = Clock::now();
    stats = runner.run(half, half);
    took = since(t0);
  }
  EXPECT_LT(took, 0.52) << "the waits were not hidden";
  EXPECT_GT(took, 0.39);
  EXPECT_GT(stats.hidden, 0.15);
  EXPECT_LT(stats.exposed, 0.05);
  // Each half held the CPU for its 200 ms of compute, its wait left out
  // (more only where the machine took the core away).
  for (double c : stats.compute) {
    EXPECT_GT(c, 0.19);
    EXPECT_LT(c, took - 0.15);
  }
}

TEST(PairRunner, SecondHalfSeesTheFirstsGradModeAndErrorsComeBackWhole) {
  PairRunner runner;
  bool grad_enabled = true;
  {
    torch::NoGradGuard no_grad;
    runner.run([] {}, [&] { grad_enabled = torch::GradMode::is_enabled(); });
  }
  EXPECT_FALSE(grad_enabled) << "the second half must run under the first's autograd state";

  // The first half fails after its first wait; the second is told at its
  // next switch (the end of its first wait) and goes no further; run()
  // rethrows the first half's own error.
  bool second_ran_on = false;
  try {
    runner.run(
        [] {
          Work::done().wait();
          throw std::runtime_error("forward broke");
        },
        [&] {
          Work::done().wait();
          second_ran_on = true;
          Work::done().wait();
        });
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "forward broke");
  }
  EXPECT_FALSE(second_ran_on);
  // The second fails: its error, and the runner is usable afterwards.
  EXPECT_THROW(runner.run([] { Work::done().wait(); }, [] { throw std::logic_error("b"); }),
               std::logic_error);
  int n = 0;
  runner.run([&] { ++n; }, [&] { ++n; });
  EXPECT_EQ(n, 2);
}

// NOTE [Weight gradients in the waits]: `idle` runs once in every wait but
// the pair's first (the partner has ended or is stopped at a wait).
TEST(PairRunner, IdleWorkFillsOnlyWaitsThatNoPartnerCanFill) {
  PairRunner runner;
  std::vector<std::string> log;
  std::mutex m;
  auto note = [&](const std::string& s) {
    std::lock_guard<std::mutex> lock(m);
    log.push_back(s);
  };
  int queued = 3;
  auto idle = [&] {
    if (queued == 0) return false;
    note("W" + std::to_string(queued--));
    return true;
  };
  // F's first wait hands the CPU to the backward; its second, after the
  // backward ended, is filled.
  auto stats = runner.run(
      [&] {
        note("F1");
        sleep_work(20).wait();
        note("F2");
        sleep_work(20).wait();
        note("F3");
      },
      [&] { note("B1"); }, idle);
  EXPECT_EQ(log, (std::vector<std::string>{"F1", "B1", "F2", "W3", "F3"}));
  EXPECT_EQ(stats.filled, 1);
  // Both wait: the backward's wait, begun while the forward is stopped at
  // its own, is filled.
  log.clear();
  stats = runner.run(
      [&] {
        note("F1");
        sleep_work(30).wait();
        note("F2");
      },
      [&] {
        note("B1");
        sleep_work(10).wait();
        note("B2");
      },
      idle);
  EXPECT_EQ(log, (std::vector<std::string>{"F1", "B1", "W2", "F2", "B2"}));
  EXPECT_EQ(stats.filled, 1);
  EXPECT_EQ(queued, 1);
  // The W's time is not the halves' compute.
  auto w_then = [&] {
    if (queued == 0) return false;
    --queued;
    busy(40);
    return true;
  };
  queued = 1;
  stats = runner.run([&] { sleep_work(30).wait(); }, [&] { sleep_work(10).wait(); }, w_then);
  EXPECT_EQ(stats.filled, 1);
  EXPECT_LT(stats.compute[0] + stats.compute[1], 0.02);
}

// NOTE [Weight gradients until the message is there]: with first-ready
// turns a wait takes parts of W's for as long as neither its message nor
// the partner's is there; where a Work cannot tell, one part; with fixed
// turns, one W.
TEST(PairRunner, ReadyTurnsFillAWaitWithPartsUntilAMessageIsThere) {
  PairRunner ready(c10::Device(c10::kCPU), /*first_ready=*/true), fixed;
  int parts = 0;
  auto part = [&] {  // an endless queue of 5 ms parts
    ++parts;
    busy(5);
    return true;
  };
  // The forward's second wait, after the backward ended: parts until its
  // message is there (50 ms: ten parts at most, one more started at 50).
  auto t0 = Clock::now();
  auto stats = ready.run(
      [&] {
        due_in(5).wait();
        due_in(50).wait();
      },
      [] {}, part, /*fill_until_there=*/true);
  EXPECT_GE(parts, 4);
  EXPECT_LE(parts, 11);
  EXPECT_EQ(stats.filled, parts);
  EXPECT_LT(since(t0), 0.5);
  // Both halves wait: the backward's wait fills until its own 15 ms
  // message is there, before the forward's 60 ms one.
  parts = 0;
  stats = ready.run([&] { due_in(60).wait(); }, [&] { due_in(15).wait(); }, part, true);
  EXPECT_GE(parts, 1);
  EXPECT_LE(parts, 4);
  // Until the partner's message is there: the forward waits 10 ms, the
  // backward 80 ms, and the backward's wait stops filling once the
  // forward's has come.
  parts = 0;
  stats = ready.run([&] { due_in(10).wait(); }, [&] { due_in(80).wait(); }, part, true);
  EXPECT_GE(parts, 1);
  EXPECT_LE(parts, 3);
  // A wait that cannot tell: one part.
  parts = 0;
  ready.run(
      [&] {
        sleep_work(5).wait();
        sleep_work(30).wait();
      },
      [] {}, part, true);
  EXPECT_EQ(parts, 1);
  // Without fill_until_there, or with fixed turns: one piece of work per
  // wait, however long.
  auto one_wait = [&] {
    due_in(5).wait();
    due_in(50).wait();
  };
  for (PairRunner* r : {&ready, &fixed})
    for (bool until : {false, true}) {
      if (r == &ready && until) continue;
      parts = 0;
      r->run(
          one_wait, [] {}, part, until);
      EXPECT_EQ(parts, 1) << (r == &ready ? "ready" : "fixed") << " " << until;
    }
}

TEST(PairRunner, WorkTestsWithoutBlocking) {
  EXPECT_EQ(Work::done().test(), std::optional<bool>(true));
  EXPECT_EQ(Work().test(), std::nullopt);
  EXPECT_EQ(sleep_work(1).test(), std::nullopt);
  Work w = due_in(20);
  EXPECT_EQ(w.test(), std::optional<bool>(false));
  std::vector<Work> all{Work::done(), w};
  EXPECT_EQ(hp::distributed::test_all(all), std::optional<bool>(false));
  std::this_thread::sleep_for(std::chrono::milliseconds(25));
  EXPECT_EQ(w.test(), std::optional<bool>(true));
  EXPECT_EQ(hp::distributed::test_all(all), std::optional<bool>(true));
  all.push_back(sleep_work(1));
  EXPECT_EQ(hp::distributed::test_all(all), std::nullopt);
  // An exchange's data is there once its receives are; a send holds it back
  // only while known not to have left.
  using hp::distributed::test_arrived;
  const std::vector<Work> there{Work::done()}, late{due_in(50)}, unknown{sleep_work(1)};
  EXPECT_EQ(test_arrived(there, unknown), std::optional<bool>(true));
  EXPECT_EQ(test_arrived(there, late), std::optional<bool>(false));
  EXPECT_EQ(test_arrived(late, there), std::optional<bool>(false));
  EXPECT_EQ(test_arrived(unknown, there), std::nullopt);
}

TEST(LinkModel, ParsesItsSpellingAndRefusesOthers) {
  const LinkModel l = LinkModel::parse("20,12.5", "--link");
  EXPECT_DOUBLE_EQ(l.latency_s, 20e-6);
  EXPECT_DOUBLE_EQ(l.bytes_per_s, 12.5e9);
  EXPECT_TRUE(LinkModel::parse("0,0", "x").latency_s == 0);
  for (const char* bad : {"", "20", "a,1", "1,", "-1,2", "1,2,3", "1,nan"}) {
    try {
      LinkModel::parse(bad, "--link");
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("LATENCY_US,GBPS"), std::string::npos) << e.what();
    }
  }
}

TEST(LinkModel, MessagesArriveLateExactAndInOrderOverGloo) {
  // 40 ms latency, 1 MB/s: a 20 kB message takes 20 ms on the link.
  const LinkModel link = LinkModel::parse("40000,0.001", "test");
  // A message is due 60 ms after its sender posted it, and the two threads
  // leave the barrier at different moments (several ms apart on a loaded
  // machine), so arrival is timed from the peer's posting, not one's own.
  std::array<Clock::time_point, 2> posted_at;
  hp::testing::run_ranks_as_threads(2, [&](int r, std::shared_ptr<hp::distributed::Comm> g) {
    auto comm = hp::distributed::with_link_model(g, link);
    const int peer = 1 - r;
    auto a = torch::arange(5000, torch::kFloat32) + r;  // 20 kB
    auto b = torch::full({3}, 7.0 + r, torch::kFloat64);
    auto ra = torch::empty_like(a), rb = torch::empty_like(b);
    comm->barrier();
    posted_at[r] = Clock::now();
    auto works = comm->batch(
        {hp::distributed::P2POp::send(a, peer), hp::distributed::P2POp::send(b, peer),
         hp::distributed::P2POp::recv(ra, peer), hp::distributed::P2POp::recv(rb, peer)});
    // Held by the link until due (Work::test, without blocking).
    EXPECT_EQ(works[0].test(), std::optional<bool>(false));
    works[2].wait();
    const auto first_at = Clock::now();
    works[3].wait();
    const auto second_at = Clock::now();
    hp::distributed::wait_all(works);
    comm->barrier();  // both posting times are written
    auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
    const double first = seconds(first_at - posted_at[peer]);
    const double second = seconds(second_at - posted_at[peer]);
    EXPECT_GE(first, 0.060) << "40 ms + 20 ms on the link, from the peer's posting";
    EXPECT_LT(first, 0.5);
    EXPECT_GE(second, first) << "a later message never overtakes";
    EXPECT_TRUE(torch::equal(ra, torch::arange(5000, torch::kFloat32) + peer));
    EXPECT_TRUE(torch::equal(rb, torch::full({3}, 7.0 + peer, torch::kFloat64)));
    // An all-to-all through the link: exact, and no faster than the latency.
    auto in = torch::arange(6, torch::kFloat64).view({3, 2}) + 10 * r;
    auto out = torch::empty({3, 2}, torch::kFloat64);
    std::vector<int64_t> send = r == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{2, 1};
    std::vector<int64_t> recv = r == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{2, 1};
    comm->barrier();
    posted_at[r] = Clock::now();
    comm->all_to_all(out, recv, in, send);
    const auto exchanged_at = Clock::now();
    comm->barrier();
    EXPECT_GE(seconds(exchanged_at - posted_at[peer]), 0.040);
    auto other = torch::arange(6, torch::kFloat64).view({3, 2}) + 10 * peer;
    auto expect = r == 0 ? torch::cat({in.narrow(0, 0, 1), other.narrow(0, 0, 2)})
                         : torch::cat({other.narrow(0, 1, 2), in.narrow(0, 2, 1)});
    EXPECT_TRUE(torch::equal(out, expect)) << out;
  });
}

// NOTE [Reductions in a fixed order] in data_parallel.h: two ranks whose
// stages end in opposite orders (and on other threads' lanes) still post
// their reductions in one order, so each gradient is the average of its
// own copies; the stage order comes from the schedule's last backwards.
TEST(GradientReducer, StagesThatEndInEitherOrderReduceInTheScheduleOrder) {
  hp::testing::run_ranks_as_threads(
      2,
      [](int r, std::shared_ptr<hp::distributed::Comm> plain) {
        auto g = hp::distributed::with_lanes(plain, hp::distributed::kPairLanes);
        auto a = torch::zeros({3}, torch::kDouble), b = torch::zeros({5}, torch::kDouble);
        a.mutable_grad() = torch::full({3}, 1.0 + r, torch::kDouble);
        b.mutable_grad() = torch::full({5}, 10.0 * (1 + r), torch::kDouble);
        hp::pipeline::GradientReducer reducer(g, {{0, {a}}, {1, {b}}}, {{0, 2}, {1, 1}}, {1, 0});
        reducer.begin_step();
        // Rank 0 ends stage 0 first, on the main lane; rank 1 stage 1, on the
        // partner's. Neither posts before stage 1 (first in the order) is done.
        for (int k = 0; k < 3; ++k) {
          const int st = r == 0 ? (k < 2 ? 0 : 1) : (k == 0 ? 1 : 0);
          hp::distributed::LaneScope lane(r == 0 ? hp::distributed::kMainLane
                                                 : hp::distributed::kPartnerLane);
          reducer.on_done(st, k);
        }
        reducer.finish_step();
        EXPECT_TRUE(torch::equal(a.grad(), torch::full({3}, 1.5, torch::kDouble))) << a.grad();
        EXPECT_TRUE(torch::equal(b.grad(), torch::full({5}, 15.0, torch::kDouble))) << b.grad();
      },
      std::chrono::seconds(10));
}

TEST(GradientReducer, StagesByLastBackwardFollowTheActionList) {
  const auto s = hp::train::TrainConfig{}.build_schedule();  // 1F1B, 2 ranks
  EXPECT_EQ(hp::pipeline::stages_by_last_backward(s, 0), std::vector<int>{0});
  auto v = hp::testing::tiny("dualpipev", 2, 6, "gpt").build_schedule();
  for (int r = 0; r < 2; ++r) {
    const auto order = hp::pipeline::stages_by_last_backward(v, r);
    ASSERT_EQ(order.size(), 2u) << "rank " << r;
    // The last action that is a backward names the last stage of the order.
    int last = -1;
    for (const auto& a : v.actions[r])
      if (a.op == hp::schedule::Op::B || a.op == hp::schedule::Op::W)
        last = a.stage;
      else if (a.op == hp::schedule::Op::FB)
        last = a.stage2;
    EXPECT_EQ(order.back(), last) << "rank " << r;
  }
}

struct OverlapCase {
  std::string schedule;
  int m;
  int ep;
  bool recompute;
  bool defer_wgrad = false;
  std::string pair_turns = "auto";  // NOTE [Turns as messages arrive]
  int w_parts = 1;                  // NOTE [Weight gradients until the message is there]
};

class OverlappedPipelines : public ::testing::TestWithParam<OverlapCase> {};

// The pairs of dualpipe, dualpipev and the -fb variants of interleaved 1F1B
// and ZB-V (NOTE [Pairs in interleaved 1F1B and ZB-V]) run overlapped, under a link slow
// enough that every wait switches halves with its message still in flight:
// still exactly one process's training, dense and pp 2 x ep 2 MoE, with
// recompute sessions.
TEST_P(OverlappedPipelines, EqualOneProcess) {
  const OverlapCase& k = GetParam();
  TrainConfig c = hp::testing::tiny(k.schedule, 2, k.m, "gpt");
  if (k.ep > 1) {
    c.model.experts = 4;
    c.model.top_k = 2;
    c.dp = c.ep = k.ep;
  }
  c.recompute = k.recompute;
  c.fb_overlap = true;
  c.defer_wgrad = k.defer_wgrad;
  c.pair_turns = k.pair_turns;
  c.w_parts = k.w_parts;
  if (k.w_parts > 1) {  // parts fill the waits of ready turns only
    TrainConfig fixed = c;
    fixed.pair_turns = "fixed";
    EXPECT_THROW(fixed.validate(), std::invalid_argument);
  }
  // auto: ready turns, fixed with deferred W's (NOTE [Turns as messages
  // arrive]); ready with deferred W's is refused with recompute sessions.
  EXPECT_EQ(c.pairs_take_ready_turns(),
            k.pair_turns == "ready" || (k.pair_turns == "auto" && !k.defer_wgrad));
  if (k.defer_wgrad && k.recompute) {
    TrainConfig ready = c;
    ready.pair_turns = "ready";
    EXPECT_THROW(ready.validate(), std::invalid_argument);
  }
  c.link = "2000,0.05";  // 2 ms, 50 MB/s
  if (hp::schedule::is_fb_variant(k.schedule)) {
    // Some of their pairs lead with the B (NOTE [The half that leads] in
    // hp/schedule/fuse.cpp): the runner starts those with the B half.
    int b_led = 0;
    for (const auto& row : c.build_schedule().actions)
      for (const auto& a : row)
        b_led += a.backward_first;
    EXPECT_GT(b_led, 0);
  }
  const auto ranks = hp::testing::run_threads(c);
  TrainConfig whole = c;  // one process on every copy's microbatches
  whole.dp = whole.ep = 1;
  whole.microbatches = c.dp * c.microbatches;
  whole.fb_overlap = whole.defer_wgrad = false;
  whole.link.clear();
  hp::testing::expect_copies_equal_the_reference(ranks, hp::train::train_reference(whole));
  // Rank 0 reports every rank's pairs: each rank's waited on communication,
  // and some of it was hidden. Not necessarily on every rank: a wait counts
  // as hidden only while the CPU computed, and on a loaded machine a rank
  // that lost its core finds every message of its last step already there.
  ASSERT_EQ(ranks[0].rank_pair_hidden.size(), size_t(c.nproc));
  double hidden = 0.0, chunk_wait = 0.0, predicted = 0.0;
  for (int r = 0; r < c.nproc; ++r) {
    EXPECT_GT(ranks[0].rank_pair_hidden[r] + ranks[0].rank_pair_exposed[r], 0.0) << "rank " << r;
    EXPECT_GE(ranks[0].rank_pair_exposed_alone[r], 0.0) << "rank " << r;
    EXPECT_LE(ranks[0].rank_pair_exposed_alone[r], ranks[0].rank_pair_exposed[r]) << "rank " << r;
    hidden += ranks[0].rank_pair_hidden[r];
    // The simulator's count of the same pairs under the fitted costs
    // (NOTE [What a pair hides, predicted]); a dense rank whose inputs the
    // model has there in time has none.
    EXPECT_GE(ranks[0].rank_predicted_pair_hidden.at(r), 0.0) << "rank " << r;
    EXPECT_GE(ranks[0].rank_predicted_pair_exposed.at(r), 0.0) << "rank " << r;
    predicted += ranks[0].rank_predicted_pair_hidden[r] + ranks[0].rank_predicted_pair_exposed[r];
    EXPECT_GE(ranks[0].rank_chunk_wait[r], 0.0) << "rank " << r;
    chunk_wait += ranks[0].rank_chunk_wait[r];
    // With defer_wgrad some W's filled waits (and none without).
    EXPECT_EQ(ranks[0].rank_deferred_w_in_waits[r] > 0, k.defer_wgrad) << "rank " << r;
  }
  EXPECT_GT(hidden, 0.0);
  EXPECT_GT(predicted, 0.0);  // under the 2 ms link some pair waits for its input
  // The expert exchanges left the CPU idle somewhere (StepStats::chunk_wait).
  if (k.ep > 1) {
    EXPECT_GT(chunk_wait, 0.0);
  }
  // NOTE [The copies' compute] in hp/train/report.cpp: each rank's compute
  // on every copy, copy 0's its own; the summary shows their spread.
  ASSERT_EQ(ranks[0].rank_copies_compute.size(), k.ep > 1 ? size_t(c.nproc) : 0u);
  for (int r = 0; r < int(ranks[0].rank_copies_compute.size()); ++r) {
    const auto& copies = ranks[0].rank_copies_compute[r];
    ASSERT_EQ(copies.size(), size_t(c.dp)) << "rank " << r;
    EXPECT_EQ(copies[0], ranks[0].rank_compute[r]) << "rank " << r;
    EXPECT_EQ(ranks[0].rank_copies_pair_hidden[r][0], ranks[0].rank_pair_hidden[r]);
    EXPECT_EQ(ranks[0].rank_copies_pair_exposed[r][0], ranks[0].rank_pair_exposed[r]);
    for (int d = 0; d < c.dp; ++d) {
      EXPECT_GT(copies[d], 0.0) << "rank " << r << " copy " << d;
      EXPECT_GT(ranks[0].rank_copies_pair_hidden[r][d] + ranks[0].rank_copies_pair_exposed[r][d],
                0.0)
          << "rank " << r << " copy " << d;
    }
  }
  EXPECT_EQ(
      hp::train::summary_text(c, ranks[0]).find("expert-parallel copies") != std::string::npos,
      k.ep > 1);
  // NOTE [A chunk's own waits] in step_timer.h: counted apart from the
  // receives, none on the dense GPT; on the expert stages each F makes as
  // many as every other F of its stage, in a pair or alone, and each I (B)
  // as many as every other I (B) of its stage.
  std::map<std::pair<int, int>, std::set<int>> counts;  // (stage, op) -> waits seen
  for (const auto& e : ranks[0].timeline.events) {
    const auto op = e.action.op;
    if (op != hp::schedule::Op::F && op != hp::schedule::Op::I && op != hp::schedule::Op::B)
      continue;
    counts[{e.action.stage, static_cast<int>(op)}].insert(e.waits);
    EXPECT_EQ(e.waits > 0, e.waited > 0) << hp::schedule::to_string(e.action);
    // Its compute between them: one node more than waits, none without.
    EXPECT_EQ(e.nodes.size(), e.waits > 0 ? size_t(e.waits + 1) : 0u)
        << hp::schedule::to_string(e.action);
    for (double v : e.nodes)
      EXPECT_GE(v, 0.0) << hp::schedule::to_string(e.action);
  }
  // Each W is one event (a deferred one however many parts it ran in).
  std::map<std::tuple<int, int, int>, int> ws;  // (rank, stage, microbatch) -> events
  for (const auto& e : ranks[0].timeline.events)
    if (e.action.op == hp::schedule::Op::W) ++ws[{e.rank, e.action.stage, e.action.microbatch}];
  if (k.defer_wgrad) {
    EXPECT_FALSE(ws.empty());
  }
  for (const auto& [key, n] : ws)
    EXPECT_EQ(n, 1) << "W of stage " << std::get<1>(key) << " microbatch " << std::get<2>(key);
  for (const auto& [key, seen] : counts) {
    const bool forward = key.second == static_cast<int>(hp::schedule::Op::F);
    EXPECT_EQ(seen.size(), 1u) << "stage " << key.first << " op " << key.second;
    if (forward || k.ep == 1) {
      EXPECT_EQ(*seen.begin() > 0, k.ep > 1) << "stage " << key.first;
    }
  }
  // NOTE [A half's sends leave when it ends]: some pair's forward output was
  // sent before the pair ended (the backward half still computing). Not on
  // dualpipe at p = 2, m = 4: there each pair's F output is listed behind
  // the B's input gradient to the same peer, and the B half ends last. Nor
  // with experts, where the halves switch at every all-to-all and the F
  // half may end last (its send then leaves at the pair's end).
  if (k.schedule == "dualpipe" || k.ep > 1) return;
  // NOTE [An overlapped pair's events] in step_timer.cpp: a pair's halves are
  // F and B (I with defer_wgrad) events of their own.
  const auto& events = ranks[0].timeline.events;
  auto end_of = [&](int rank, hp::schedule::Op op, int stage, int mb) {
    for (const auto& e : events)
      if (e.rank == rank && e.action == hp::schedule::Action::make(op, stage, mb)) return e.end;
    ADD_FAILURE() << "no event for a half on rank " << rank;
    return 0.0;
  };
  const auto sched = c.build_schedule();
  int early = 0, pairs = 0;
  for (int r = 0; r < c.nproc; ++r)
    for (const auto& a : sched.actions[r]) {
      if (a.op != hp::schedule::Op::FB) continue;
      ++pairs;
      const double pair_end =
          std::max(end_of(r, hp::schedule::Op::F, a.stage, a.microbatch),
                   end_of(r, k.defer_wgrad ? hp::schedule::Op::I : hp::schedule::Op::B, a.stage2,
                          a.microbatch2));
      for (const auto& send : events)
        if (send.rank == r &&
            send.action ==
                hp::schedule::Action::make(hp::schedule::Op::SEND_F, a.stage, a.microbatch) &&
            send.start < pair_end)
          ++early;
    }
  EXPECT_GT(pairs, 0);
  for (const auto& e : events)
    EXPECT_NE(e.action.op, hp::schedule::Op::FB);
  EXPECT_GT(early, 0) << "no forward half's output left before its pair's end";
}

// NOTE [The deferred W's chosen in the run] in hp/pipeline/pipeline.cpp: pp 2 x
// ep 2 MoE on dualpipev, overlapped under the slow link, 4 steps. After step
// 2 every rank of both copies takes copy 0's choice: with a gain of -1 the
// W's defer from step 3 (whatever the prediction), with a gain of 1 never.
// Either way one process's training.
TEST(OverlappedPipelines, TheRunDefersItsWsFromTheThirdStepAsChosen) {
  for (const double gain : {-1.0, 1.0}) {
    SCOPED_TRACE("gain " + std::to_string(gain));
    TrainConfig c = hp::testing::tiny("dualpipev", 2, 6, "gpt");
    c.model.experts = 4;
    c.model.top_k = 2;
    c.dp = c.ep = 2;
    c.fb_overlap = true;
    c.steps = 4;
    c.defer_wgrad_gain = gain;
    c.link = "2000,0.05";
    const auto ranks = hp::testing::run_threads(c);
    TrainConfig whole = c;
    whole.dp = whole.ep = 1;
    whole.microbatches = c.dp * c.microbatches;
    whole.fb_overlap = false;
    whole.link.clear();
    hp::testing::expect_copies_equal_the_reference(ranks, hp::train::train_reference(whole));
    const bool on = gain < 0;
    for (size_t r = 0; r < ranks.size(); ++r) {
      const auto& d = ranks[r].deferred_w_in_run;
      EXPECT_TRUE(d.decided) << "world rank " << r;
      EXPECT_EQ(d.after_step, 2) << "world rank " << r;
      EXPECT_EQ(d.choice.defer, on) << "world rank " << r;
      EXPECT_EQ(d.choice.step_with, ranks[0].deferred_w_in_run.choice.step_with);
    }
    const auto& d = ranks[0].deferred_w_in_run.choice;
    EXPECT_GT(d.step_without, 0.0);
    EXPECT_GT(d.step_with, 0.0);
    EXPECT_GT(d.peak_without, 0.0);
    EXPECT_GT(d.peak_with, 0.0);
    // The last step's W's filled waits only where they were deferred.
    for (int r = 0; r < c.nproc; ++r)
      EXPECT_EQ(ranks[0].rank_deferred_w_in_waits[r] > 0, on) << "rank " << r;
  }
  // A schedule without FB pairs has nothing to defer: no choice.
  TrainConfig plain = hp::testing::tiny("1f1b", 2, 4, "gpt");
  plain.fb_overlap = true;
  plain.steps = 3;
  plain.defer_wgrad_gain = -1.0;
  for (const auto& r : hp::testing::run_threads(plain))
    EXPECT_FALSE(r.deferred_w_in_run.decided);
  TrainConfig bad = hp::testing::tiny("dualpipev", 2, 6, "gpt");
  bad.defer_wgrad_gain = 1.5;
  EXPECT_THROW(bad.validate(), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(
    Pairs, OverlappedPipelines,
    ::testing::Values(OverlapCase{"dualpipev", 6, 1, false},
                      OverlapCase{"dualpipev", 6, 2, false, false, "fixed"},
                      OverlapCase{"dualpipe", 4, 2, false}, OverlapCase{"dualpipev", 6, 2, true},
                      OverlapCase{"dualpipev", 6, 1, false, true},
                      OverlapCase{"dualpipev", 6, 2, false, true, "ready"},
                      OverlapCase{"dualpipev", 6, 2, false, true, "ready", 3},
                      OverlapCase{"dualpipe", 4, 2, true, true},
                      OverlapCase{"interleaved-1f1b-fb", 8, 2, false},
                      OverlapCase{"zbv-fb", 8, 1, false, true, "ready"}),
    [](const ::testing::TestParamInfo<OverlapCase>& info) {
      std::string n = info.param.schedule;
      std::replace(n.begin(), n.end(), '-', '_');
      n += std::string(info.param.ep > 1 ? "_ep2" : "_dense") +
           (info.param.recompute ? "_recompute" : "") +
           (info.param.defer_wgrad ? "_defer_wgrad" : "") +
           (info.param.pair_turns == "auto" ? "" : "_" + info.param.pair_turns + "_turns") +
           (info.param.w_parts > 1 ? "_w_parts_" + std::to_string(info.param.w_parts) : "");
      return n;
    });

}  // namespace
