// PipelineStage alone (no communication): two stages of a small network run
// F, I, W by hand in zero-bubble order and through a released output; the
// gradients must equal one plain backward of the whole network. Then the GPU
// paths' logic on the CPU: the device timer (on a fake device with events),
// the executor's host synchronizations per step, host-staged transfers, and
// the trainer's choice of device.
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>

#include "hp/core/memory.h"
#include "hp/distributed/comm.h"
#include "hp/pipeline/executor.h"
#include "hp/pipeline/stage.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/train/profile.h"
#include "hp/train/trainer.h"
#include "tests/common/forwarding_comm.h"
#include "tests/common/threads_as_ranks.h"

using hp::distributed::Comm;
using hp::distributed::P2POp;
using hp::distributed::Work;
using hp::pipeline::PipelineStage;
using hp::pipeline::StageModule;

namespace {

const auto kF64 = torch::TensorOptions().dtype(torch::kFloat64);

struct Net {
  torch::Tensor w0 = torch::randn({6, 6}, kF64).requires_grad_(true);
  torch::Tensor w1 = torch::randn({6, 3}, kF64).requires_grad_(true);
  torch::Tensor stage0(const torch::Tensor& x) const { return torch::tanh(x.matmul(w0)); }
  torch::Tensor stage1(const torch::Tensor& h) const { return h.matmul(w1).exp(); }
};

/// m microbatch inputs of 4 x 6.
std::vector<torch::Tensor> microbatches(int m) {
  std::vector<torch::Tensor> xs;
  for (int mb = 0; mb < m; ++mb)
    xs.push_back(torch::randn({4, 6}, kF64));
  return xs;
}

/// A loss that weighs each microbatch differently.
torch::Tensor squares_loss(const torch::Tensor& y, int mb) {
  return y.pow(2).sum() * (mb + 1);
}

}  // namespace

TEST(PipelineStage, SplitBackwardAcrossTwoStagesEqualsOneBackward) {
  torch::manual_seed(3);
  Net net;
  std::vector<torch::Tensor> xs{torch::randn({4, 6}, kF64), torch::randn({4, 6}, kF64)};
  auto loss_of = [](const torch::Tensor& y, int mb) { return y.sum() * (mb + 1) / 2.0; };

  // Reference: plain autograd, accumulated over the microbatches.
  torch::Tensor g0 = torch::zeros_like(net.w0), g1 = torch::zeros_like(net.w1);
  for (int mb = 0; mb < 2; ++mb) {
    auto grads =
        torch::autograd::grad({loss_of(net.stage1(net.stage0(xs[mb])), mb)}, {net.w0, net.w1});
    g0 += grads[0];
    g1 += grads[1];
  }

  std::map<int, StageModule> modules;
  modules[0] = {[&](const torch::Tensor& x) { return net.stage0(x); }, {net.w0}, {}};
  modules[1] = {[&](const torch::Tensor& h) { return net.stage1(h); }, {net.w1}, {}};
  PipelineStage stage(modules, loss_of);
  for (int mb = 0; mb < 2; ++mb) {
    auto h = stage.forward(0, mb, {xs[mb]}, /*takes_grad=*/{}, /*is_last=*/false);
    stage.forward(1, mb, h, /*takes_grad=*/{true}, /*is_last=*/true);
    stage.release_output(0, mb);  // as after a send: only the history is needed
    EXPECT_EQ(stage.output(0, mb).at(0).numel(), 0);
  }
  EXPECT_EQ(stage.in_flight(), 4u);
  // Zero-bubble order: both dx first, weights later and out of order.
  auto dh1 = stage.backward_input(1, 1, {});
  auto dh0 = stage.backward_input(1, 0, {});
  EXPECT_FALSE(net.w0.grad().defined());
  EXPECT_TRUE(stage.backward_input(0, 1, dh1).empty()) << "the first stage has no dx";
  stage.backward_weight(1, 0);
  stage.backward_weight(0, 1);
  stage.backward(0, 0, dh0);  // fused B for the last one
  stage.backward_weight(1, 1);
  EXPECT_EQ(stage.in_flight(), 0u);
  EXPECT_LE((net.w0.grad() - g0).abs().max().item<double>(), 1e-12);
  EXPECT_LE((net.w1.grad() - g1).abs().max().item<double>(), 1e-12);
  stage.reset();
}

// NOTE [The loss scale is the backward's seed]: a loss_scale of 1/3 (no
// power of two) on the unscaled loss gives the gradients and the loss of
// plain autograd on loss / 3, through I + W and through B; the default 1
// starts from the engine's ones. A scale of 0 or NaN is refused.
TEST(PipelineStage, LossScaleSeedsTheBackwardLikeDividingTheLoss) {
  torch::manual_seed(5);
  Net net;
  const int m = 3;
  const std::vector<torch::Tensor> xs = microbatches(m);
  auto loss_of = squares_loss;

  torch::Tensor g0 = torch::zeros_like(net.w0), g1 = torch::zeros_like(net.w1);
  double loss_sum = 0;
  for (int mb = 0; mb < m; ++mb) {
    auto loss = loss_of(net.stage1(net.stage0(xs[mb])), mb) / m;
    auto grads = torch::autograd::grad({loss}, {net.w0, net.w1});
    g0 += grads[0];
    g1 += grads[1];
    loss_sum += loss.item<double>();
  }

  for (double scale : {1.0 / m, 1.0}) {
    net.w0.mutable_grad() = torch::Tensor();
    net.w1.mutable_grad() = torch::Tensor();
    std::map<int, StageModule> modules;
    modules[0] = {[&](const torch::Tensor& x) { return net.stage0(x); }, {net.w0}, {}};
    modules[1] = {[&](const torch::Tensor& h) { return net.stage1(h); }, {net.w1}, {}};
    PipelineStage stage(modules, loss_of, {}, scale);
    for (int mb = 0; mb < m; ++mb) {
      auto h = stage.forward(0, mb, {xs[mb]}, /*takes_grad=*/{}, /*is_last=*/false);
      stage.forward(1, mb, h, /*takes_grad=*/{true}, /*is_last=*/true);
      // Microbatch 0 through I + W, the others through B.
      auto dh = mb == 0 ? stage.backward_input(1, mb, {}) : stage.backward(1, mb, {});
      if (mb == 0) stage.backward_weight(1, mb);
      stage.backward(0, mb, dh);
    }
    const double k = scale * m;  // 1 for 1/m, m for the default
    for (auto [got, want] : {std::make_pair(net.w0.grad(), g0 * k), {net.w1.grad(), g1 * k}})
      EXPECT_LE((got - want).abs().max().item<double>(),
                1e-12 * std::max(1.0, want.abs().max().item<double>()))
          << scale;
    EXPECT_NEAR(stage.loss_sum(), loss_sum * k, 1e-12 * loss_sum * k) << scale;
    stage.reset();
    EXPECT_EQ(stage.loss_sum(), 0.0);
  }
  std::map<int, StageModule> one;
  one[0] = {[&](const torch::Tensor& x) { return net.stage0(x); }, {net.w0}, {}};
  for (double bad : {0.0, std::nan("")})
    EXPECT_THROW(
        {
          try {
            PipelineStage(one, loss_of, {}, bad);
          } catch (const c10::Error& e) {
            EXPECT_NE(std::string(e.what()).find("loss_scale must be finite and not 0"),
                      std::string::npos)
                << e.what();
            throw;
          }
        },
        c10::Error);
}

// NOTE [A pair that computes itself]: a caller that runs the module and the
// engine itself (DualPipe's hook) through forward_computed, backward_roots
// and backward_computed gives the gradients, the input gradients and the
// loss of forward() and backward(), also from a released output and with a
// loss scale (1/3) seeding a last stage's roots.
TEST(PipelineStage, ComputedHalvesEqualTheStagesOwn) {
  torch::manual_seed(7);
  Net net;
  const int m = 3;
  const std::vector<torch::Tensor> xs = microbatches(m);
  auto loss_of = squares_loss;
  std::map<int, StageModule> modules;
  modules[0] = {[&](const torch::Tensor& x) { return net.stage0(x); }, {net.w0}, {}};
  modules[1] = {[&](const torch::Tensor& h) { return net.stage1(h); }, {net.w1}, {}};
  auto engine_backward = [](const hp::pipeline::Message& roots,
                            const hp::pipeline::Message& grads) {
    // What DualPipe's run_backward does: the engine, no shape comparison.
    torch::autograd::variable_list g(grads.begin(), grads.end());
    if (g.empty()) g.push_back(torch::ones_like(roots.at(0)));
    torch::autograd::Engine::get_default_engine().execute(
        torch::autograd::collect_next_edges(roots), g, /*keep_graph=*/false, /*create_graph=*/false,
        /*accumulate_grad=*/true, {});
  };
  std::vector<torch::Tensor> want_g, got_g;
  std::vector<torch::Tensor> want_dh, got_dh;
  double want_loss = 0, got_loss = 0;
  for (bool computed : {false, true}) {
    net.w0.mutable_grad() = torch::Tensor();
    net.w1.mutable_grad() = torch::Tensor();
    PipelineStage stage(modules, loss_of, {}, 1.0 / m);
    auto& dhs = computed ? got_dh : want_dh;
    for (int mb = 0; mb < m; ++mb) {
      hp::pipeline::Message h;
      if (!computed) {
        h = stage.forward(0, mb, {xs[mb]}, {}, false);
        stage.forward(1, mb, h, {true}, true);
      } else {
        h = stage.forward_computed(0, mb, {xs[mb]}, {}, false, [&](const auto& in) {
          return hp::pipeline::Message{net.stage0(in.at(0))};
        });
        stage.forward_computed(1, mb, h, {true}, true, [&](const auto& in) {
          return hp::pipeline::Message{loss_of(net.stage1(in.at(0)), mb)};
        });
      }
      stage.release_output(0, mb);
      hp::pipeline::Message dh;
      if (!computed) {
        dh = stage.backward(1, mb, {});
        stage.backward(0, mb, dh);
      } else {
        auto [roots1, seeds1] = stage.backward_roots(1, mb, {});
        EXPECT_EQ(roots1.size(), 1u);
        EXPECT_EQ(seeds1.size(), 1u) << "a loss scale of 1/3 seeds the loss";
        engine_backward(roots1, seeds1);
        dh = stage.backward_computed(1, mb);
        auto [roots0, seeds0] = stage.backward_roots(0, mb, dh);
        EXPECT_EQ(roots0.at(0).numel(), 0) << "a released output keeps its history";
        engine_backward(roots0, seeds0);
        EXPECT_TRUE(stage.backward_computed(0, mb).empty()) << "the first stage has no dx";
      }
      dhs.push_back(dh.at(0));
    }
    EXPECT_EQ(stage.in_flight(), 0u);
    (computed ? got_g : want_g) =
        std::vector<torch::Tensor>{net.w0.grad().clone(), net.w1.grad().clone()};
    (computed ? got_loss : want_loss) = stage.loss_sum();
    stage.reset();
  }
  for (size_t i = 0; i < 2; ++i)
    EXPECT_LE((got_g[i] - want_g[i]).abs().max().item<double>(), 1e-12) << i;
  for (int mb = 0; mb < m; ++mb)
    EXPECT_LE((got_dh[mb] - want_dh[mb]).abs().max().item<double>(), 1e-12) << mb;
  EXPECT_NEAR(got_loss, want_loss, 1e-12 * std::abs(want_loss));
}

TEST(PipelineStage, OutOfOrderUseIsAClearError) {
  Net net;
  std::map<int, StageModule> modules;
  modules[0] = {[&](const torch::Tensor& x) { return net.stage0(x); }, {net.w0}, {}};
  PipelineStage stage(modules, [](const torch::Tensor& y, int) { return y.sum(); });
  EXPECT_THROW(stage.backward_input(0, 0, {}), c10::Error);
  stage.forward(0, 0, {torch::randn({2, 6}, kF64)}, {}, true);
  EXPECT_THROW(stage.forward(0, 0, {torch::randn({2, 6}, kF64)}, {}, true), c10::Error);
  EXPECT_THROW(stage.backward_weight(0, 0), c10::Error) << "W before I";
  EXPECT_THROW(stage.reset(), c10::Error) << "a microbatch is still in flight";
  EXPECT_THROW(stage.forward(5, 0, {torch::randn({2, 6}, kF64)}, {}, true), c10::Error);
}

// ---------------------------------------------------------------------------
// The GPU paths, tested on the CPU.

namespace {

// A fake device with events (PrivateUse1): an event records the host clock
// when it is recorded (its "stream" runs everything at once, as the CPU
// does), and every synchronization is counted. It lets the device timer's
// code (c10::Event, the same calls as on CUDA) run here.
std::atomic<int> fake_event_syncs{0};
struct FakeEvent {
  std::chrono::steady_clock::time_point t;
};
struct FakeDeviceGuardImpl final : c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device) const override { return c10::Device(kType, 0); }
  c10::Device getDevice() const override { return c10::Device(kType, 0); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kType, 0));
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 0; }  // no engine thread
  void record(void** event, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    if (*event == nullptr) *event = new FakeEvent();
    static_cast<FakeEvent*>(*event)->t = std::chrono::steady_clock::now();
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<FakeEvent*>(event);
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void synchronizeEvent(void*) const override { fake_event_syncs++; }
  double elapsedTime(void* a, void* b, const c10::DeviceIndex) const override {
    return std::chrono::duration<double, std::milli>(static_cast<FakeEvent*>(b)->t -
                                                     static_cast<FakeEvent*>(a)->t)
        .count();
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeDeviceGuardImpl);
const torch::Device kFakeDevice(c10::DeviceType::PrivateUse1, 0);

// A Comm whose works report stream-ordered waits (as NCCL's on CUDA do): on
// the CPU wait() must still block, but the executor can only tell from
// blocks_host(), which is what its count of host synchronizations reads.
class StreamOrderedWorks : public hp::testing::ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  std::string backend_name() const override { return inner_->backend_name() + "+streams"; }
  bool early_receives_are_free() const override { return false; }  // as NCCL
  std::vector<Work> batch(const std::vector<P2POp>& ops) override {
    std::vector<Work> out;
    for (auto& w : inner_->batch(ops))
      out.push_back(Work(std::make_shared<Ordered>(w)));
    return out;
  }

 private:
  struct Ordered : Work::Impl {
    explicit Ordered(Work w) : inner(std::move(w)) {}
    void wait() override { inner.wait(); }
    bool blocks_host() const override { return false; }
    Work inner;
  };
};

// A Comm that records the storage of every tensor handed to it.
class RecordingComm : public hp::testing::ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  std::vector<Work> batch(const std::vector<P2POp>& ops) override {
    for (const auto& op : ops)
      see(op.tensor);
    return inner_->batch(ops);
  }
  void all_reduce(const at::Tensor& t, hp::distributed::ReduceOp op) override {
    see(t);
    inner_->all_reduce(t, op);
  }
  void all_gather(std::vector<at::Tensor>& out, const at::Tensor& in) override {
    see(in);
    for (const auto& t : out)
      see(t);
    inner_->all_gather(out, in);
  }
  void broadcast(const at::Tensor& t, int root) override {
    see(t);
    inner_->broadcast(t, root);
  }
  std::shared_ptr<Comm> split(const std::vector<int>& ranks) override {
    return std::make_shared<RecordingComm>(inner_->split(ranks));
  }
  std::set<const void*> seen() {
    std::lock_guard<std::mutex> lock(mu_);
    std::set<const void*> out;
    for (const auto& t : seen_)
      out.insert(t.data_ptr());
    return out;
  }

 private:
  // Keeps every tensor it saw alive: a freed buffer's address could be
  // reused by a later tensor of the caller and look like one.
  void see(const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(mu_);
    seen_.push_back(t);
  }
  std::mutex mu_;
  std::vector<at::Tensor> seen_;
};

// Two stages of a float64 MLP on two ranks with zb-h1 and m microbatches: the
// executor's stats of the second step on rank `rank`.
hp::pipeline::StepStats two_stage_step(int rank, std::shared_ptr<Comm> comm, int m,
                                       const hp::pipeline::ExecutorOptions& extra) {
  // Its own generator: ranks are threads, and the global one is shared.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11 + rank);
  auto w = at::randn({8, 8}, gen, kF64).requires_grad_(true);
  std::map<int, StageModule> modules;
  modules[rank] = {[w](const torch::Tensor& x) { return torch::tanh(x.matmul(w)); }, {w}, {}};
  PipelineStage stage(modules, [m](const torch::Tensor& y, int) { return y.pow(2).sum() / m; });
  auto sched = hp::schedule::lower(hp::schedule::build("zb-h1", 2, m));
  hp::pipeline::ExecutorOptions opts = extra;
  opts.input = [](int mb) { return torch::full({4, 8}, 0.1 * (mb + 1), kF64); };
  opts.activation_shape = [](int, int) { return std::vector<int64_t>{4, 8}; };
  opts.dtype = torch::kFloat64;
  hp::pipeline::Executor executor(sched, rank, stage, comm, opts);
  executor.run_step();
  return executor.run_step();
}

int recv_actions(int rank, int m) {
  int n = 0;
  const auto sched = hp::schedule::lower(hp::schedule::build("zb-h1", 2, m));
  for (const auto& a : sched.actions[rank])
    n += a.op == hp::schedule::Op::RECV_F || a.op == hp::schedule::Op::RECV_B;
  return n;
}

}  // namespace

TEST(StepTimer, DeviceEventsAreReadBehindOneSynchronizationPerStep) {
  auto timer = hp::pipeline::make_device_timer(kFakeDevice);
  for (int step = 0; step < 2; ++step) {
    fake_event_syncs = 0;
    timer->start();
    const int a = timer->mark();
    auto t = torch::randn({64, 64}, kF64);
    for (int k = 0; k < 20; ++k)
      t = t.matmul(t).tanh();
    const int b = timer->mark();
    const int c = timer->mark();
    EXPECT_EQ(fake_event_syncs.load(), 0) << "a mark never synchronizes";
    EXPECT_GE(timer->seconds(c), timer->seconds(b));
    EXPECT_GT(timer->seconds(b), 0.0) << "the matmuls ran between a and b";
    EXPECT_EQ(timer->seconds(a), 0.0);
    EXPECT_EQ(fake_event_syncs.load(), 1) << "one synchronization, on the last mark";
    EXPECT_EQ(timer->host_syncs(), 1);
  }
  EXPECT_THROW(hp::pipeline::make_device_timer(torch::kCPU), c10::Error);
}

// NOTE [No host synchronization per action]: with stream-ordered receives
// the executor stops the host a fixed number of times per step, whatever the
// number of microbatches; over a host-blocking transport once more per
// receive. Two ranks as threads over Gloo, zb-h1, m = 4 and 8.
TEST(Executor, HostSynchronizationsPerStepDoNotGrowWithTheActions) {
  for (int m : {4, 8}) {
    std::vector<hp::pipeline::StepStats> gloo(2), ordered(2), device(2);
    hp::testing::run_ranks_as_threads(2, [&](int r, std::shared_ptr<Comm> comm) {
      gloo[r] = two_stage_step(r, comm, m, {});
      auto streams = std::make_shared<StreamOrderedWorks>(comm);
      ordered[r] = two_stage_step(r, streams, m, {});
      hp::pipeline::ExecutorOptions on_device;
      on_device.make_timer = [] { return hp::pipeline::make_device_timer(kFakeDevice); };
      device[r] = two_stage_step(r, streams, m, on_device);
    });
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE("m=" + std::to_string(m) + " rank " + std::to_string(r));
      EXPECT_EQ(ordered[r].host_syncs, 0) << "host clock, stream-ordered receives";
      EXPECT_EQ(device[r].host_syncs, 1) << "the device timer's one read-out";
      // Gloo: every receive's wait, and the end-of-step wait for the sends.
      EXPECT_EQ(gloo[r].host_syncs, recv_actions(r, m) + 1);
      EXPECT_EQ(device[r].loss_sum, gloo[r].loss_sum);
      // The device timer's timeline: every compute action, inside the step.
      int computes = 0;
      for (const auto& e : device[r].events) {
        EXPECT_LE(0.0, e.start);
        EXPECT_LE(e.start, e.end);
        EXPECT_LE(e.end, device[r].wall);
        computes += hp::schedule::is_compute(e.action.op);
      }
      EXPECT_EQ(computes, int(device[r].executed.size()));
      EXPECT_EQ(device[r].executed, gloo[r].executed);
    }
  }
}

// NOTE [Staging through host memory], on CPU tensors staged like device ones:
// what the wrapped Comm moves are host buffers, never the caller's tensors,
// and a receive's tensor is written by its wait, not before.
TEST(HostStaging, MovesHostCopiesInPostingOrder) {
  hp::testing::run_ranks_as_threads(2, [&](int r, std::shared_ptr<Comm> comm) {
    auto recording = std::make_shared<RecordingComm>(comm);
    hp::distributed::HostStagingOptions o;
    o.stage_cpu_tensors = true;
    auto staged = hp::distributed::with_host_staging(recording, o);
    EXPECT_EQ(staged->backend_name(), "gloo+host");
    std::vector<torch::Tensor> mine;  // every tensor the test hands over, alive to the end
    auto keep = [&](const torch::Tensor& t) {
      mine.push_back(t);
      return t;
    };
    const int peer = 1 - r;
    // Two messages each way in one batch, matched in posting order.
    auto a = keep(torch::full({3}, 10.0 * r + 1, kF64));
    auto b = keep(torch::full({2, 2}, 10.0 * r + 2, kF64));
    auto ra = keep(torch::full({3}, -1.0, kF64));
    auto rb = keep(torch::full({2, 2}, -1.0, kF64));
    auto works = staged->batch(
        {P2POp::send(a, peer), P2POp::recv(ra, peer), P2POp::send(b, peer), P2POp::recv(rb, peer)});
    EXPECT_TRUE(torch::equal(ra, torch::full({3}, -1.0, kF64))) << "written by its wait";
    hp::distributed::wait_all(works);
    EXPECT_TRUE(torch::equal(ra, torch::full({3}, 10.0 * peer + 1, kF64)));
    EXPECT_TRUE(torch::equal(rb, torch::full({2, 2}, 10.0 * peer + 2, kF64)));
    // Collectives.
    auto sum = keep(torch::full({4}, double(r + 1), kF64));
    staged->all_reduce(sum);
    EXPECT_TRUE(torch::equal(sum, torch::full({4}, 3.0, kF64)));
    auto root = keep(torch::full({2}, double(r + 5), kF64));
    staged->broadcast(root, 1);
    EXPECT_TRUE(torch::equal(root, torch::full({2}, 6.0, kF64)));
    auto flat = keep(torch::zeros({4}, kF64));
    staged->all_gather(flat, keep(torch::full({2}, double(r), kF64)));
    EXPECT_TRUE(torch::equal(flat, torch::tensor({0.0, 0.0, 1.0, 1.0}, kF64)));
    auto part = keep(torch::zeros({2}, kF64));
    staged->reduce_scatter(part, keep(torch::arange(4, kF64) * (r + 1)));
    EXPECT_TRUE(torch::equal(part, torch::arange(4, kF64).narrow(0, 2 * r, 2) * 3));
    staged->barrier();
    for (const void* p : recording->seen())
      for (const auto& t : mine)
        EXPECT_NE(t.data_ptr(), p) << "the wrapped Comm saw a caller's tensor";
    EXPECT_GE(recording->seen().size(), 8u);
    // Without stage_cpu_tensors CPU tensors pass through untouched.
    auto plain = hp::distributed::with_host_staging(recording);
    auto x = torch::full({2}, double(r), kF64);
    plain->all_reduce(x);
    EXPECT_EQ(recording->seen().count(x.data_ptr()), 1u);
    // for_device: the CPU keeps the Comm; a GPU over Gloo stages through host
    // memory (NOTE [Ranks on devices]; no device is touched to decide).
    EXPECT_EQ(hp::distributed::for_device(comm, torch::kCPU), comm);
    auto on_gpu = hp::distributed::for_device(comm, torch::Device(torch::kCUDA, 0));
    EXPECT_NE(on_gpu, comm);
    EXPECT_EQ(on_gpu->backend_name(), "gloo+host");
  });
}

// The pipeline through host staging (every activation and gradient through a
// host buffer, as two ranks on one GPU exchange them) equals single-process
// training in float64.
TEST(HostStaging, PipelineTrainsLikeOneProcess) {
  hp::train::TrainConfig c;
  c.model.kind = "gpt";
  c.model.dtype = torch::kFloat64;
  c.model.layers = 4;
  c.model.d_model = 16;
  c.model.heads = 2;
  c.model.seq_len = 8;
  c.nproc = 2;
  c.schedule = "zb-h1";
  c.microbatches = 4;
  c.microbatch_size = 2;
  c.steps = 2;
  c.seed = 3;
  c.progress = false;
  std::vector<hp::train::TrainResult> ranks(2);
  hp::testing::run_ranks_as_threads(2, [&](int r, std::shared_ptr<Comm> comm) {
    hp::distributed::HostStagingOptions o;
    o.stage_cpu_tensors = true;
    ranks[r] = hp::train::run_rank(c, hp::distributed::with_host_staging(comm, o));
  });
  auto ref = hp::train::train_reference(c);
  ASSERT_EQ(ranks[0].losses.size(), ref.losses.size());
  for (size_t s = 0; s < ref.losses.size(); ++s)
    EXPECT_NEAR(ranks[0].losses[s], ref.losses[s], 1e-9 * std::max(1.0, std::abs(ref.losses[s])));
  size_t seen = 0;
  for (const auto& r : ranks)
    for (const auto& [name, p] : r.parameters) {
      const auto& q = ref.parameters.at(name);
      EXPECT_LE((p - q).abs().max().item<double>(),
                1e-9 * std::max(1.0, q.abs().max().item<double>()))
          << name;
      ++seen;
    }
  EXPECT_GE(seen, ref.parameters.size());
}

// NOTE [Ranks on devices]: "cuda" without a GPU says so before anything
// starts; "auto" takes the CPU then. With GPUs, rank r takes GPU r mod count.
TEST(TrainDevice, CudaWithoutAGpuIsAClearErrorAndAutoFallsBackToTheCpu) {
  hp::train::TrainConfig c;
  c.model.kind = "mlp";
  c.progress = false;
  c.device = "auto";
  EXPECT_NO_THROW(c.validate());
  if (!torch::cuda::is_available()) {
    EXPECT_TRUE(c.resolve_device(1).is_cpu());
    c.device = "cuda";
    try {
      c.validate();
      ADD_FAILURE() << "--device cuda validated without a GPU";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
    }
  } else {
    const int n = static_cast<int>(torch::cuda::device_count());
    EXPECT_EQ(c.resolve_device(n + 1), torch::Device(torch::kCUDA, (n + 1) % n));
  }
  c.device = "gpu";
  EXPECT_THROW(c.validate(), std::invalid_argument);
  c.device = "cpu";
  EXPECT_TRUE(c.resolve_device(3).is_cpu());
}

// ---------------------------------------------------------------------------
// hp profile (hp/train/profile.h) on the CPU.

// measure_stage's memory against an oracle: the bytes autograd saves for the
// backward, collected by a pack hook on a plain forward of the same stage
// (tensors it did not allocate - the input, the weights - left out). The
// stage x W1 -> tanh -> W2 saves tanh's output t, used by tanh's and the
// second product's backward: mem_b is t's bytes.
TEST(Profile, MeasuresTheStageAndItsActivationMemory) {
  hp::install_memory_tracker();
  torch::manual_seed(5);
  auto w1 = torch::randn({8, 16}, kF64).requires_grad_(true);
  auto w2 = torch::randn({16, 8}, kF64).requires_grad_(true);
  hp::train::StageSample s;
  s.module = {
      [=](const torch::Tensor& x) { return torch::tanh(x.matmul(w1)).matmul(w2); }, {w1, w2}, {}};
  s.input = torch::randn({4, 8}, kF64);
  s.grad_output = torch::randn({4, 8}, kF64);
  hp::train::MeasureOptions o;
  o.warmup = 1;
  o.repeats = 3;
  auto c = hp::train::measure_stage(s, o);
  EXPECT_GT(c.f, 0.0);
  EXPECT_GT(c.i, 0.0);
  EXPECT_GT(c.w, 0.0);
  EXPECT_GT(c.b, 0.0);
  EXPECT_EQ(c.mem_b, 4 * 16 * 8) << "tanh's output, the one activation saved";
  EXPECT_GE(c.mem_w, c.mem_b) << "W still needs t, and the gradient captured for W1";
  EXPECT_FALSE(w1.grad().defined()) << "measuring leaves no gradient behind";
  // The last stage: a loss instead of an output gradient.
  hp::train::StageSample last = s;
  last.grad_output = torch::Tensor();
  last.loss = [](const torch::Tensor& y) { return y.pow(2).sum(); };
  EXPECT_GT(hp::train::measure_stage(last, o).w, 0.0);
  hp::train::StageSample bad = s;
  bad.grad_output = torch::Tensor();
  EXPECT_THROW(hp::train::measure_stage(bad, o), c10::Error);
}

// Predictions are the simulator's: with F = I = W = 1 and no transfer time
// 1F1B's step is (m + p - 1)(F + I + W); on the Zero Bubble paper's 1.5B
// costs (Table 9) at p = 8, m = 24 the bubble rates are its Table 5's.
TEST(Profile, PredictionsAreTheSimulatorsOnTheMeasuredCosts) {
  hp::train::StageCosts unit;
  unit.f = unit.i = unit.w = 1.0;
  unit.b = 2.0;
  auto c = hp::train::stage_cost_model(unit, unit, unit, 0.0, 4);
  auto preds = hp::train::predict_schedules(c, 4, 8, {"1f1b", "zb-h1", "zbv", "no-such"});
  ASSERT_EQ(preds.size(), 4u);
  EXPECT_TRUE(preds[0].ok);
  EXPECT_DOUBLE_EQ(preds[0].step_seconds, (8 + 4 - 1) * 3.0);
  EXPECT_TRUE(preds[1].ok);
  EXPECT_LT(preds[1].step_seconds, preds[0].step_seconds);
  EXPECT_TRUE(preds[2].ok) << preds[2].error;
  EXPECT_EQ(preds[2].num_stages, 8);
  EXPECT_FALSE(preds[3].ok);
  EXPECT_NE(preds[3].error.find("unknown schedule"), std::string::npos);

  auto rows = hp::train::paper_rows(8, 24);
  ASSERT_EQ(rows.size(), 2u);
  const auto& row = rows[0];  // 1.5B
  hp::train::StageCosts paper;
  paper.f = row.f, paper.i = row.b, paper.w = row.w, paper.b = row.b + row.w;
  auto pc = hp::train::stage_cost_model(paper, paper, paper, row.comm, 8);
  auto pp = hp::train::predict_schedules(pc, 8, 24, {"1f1b", "zb-h1", "zb-h2"});
  EXPECT_NEAR(pp[0].bubble_rate, row.r_1f1b, 6e-4);
  EXPECT_NEAR(pp[1].bubble_rate, row.r_zbh1, 6e-4);
  EXPECT_NEAR(pp[2].bubble_rate, row.r_zbh2, 6e-4);
  EXPECT_TRUE(hp::train::paper_rows(8, 25).empty());
}

// NOTE [Per-stage costs of other cuts]: a heavy last chunk (the head) weighs
// on every schedule, also on those that cut the model into 2p stages.
TEST(Profile, AHeavyLastStageWeighsOnEveryCut) {
  hp::train::StageCosts mid, head;
  mid.f = mid.i = mid.w = 1.0;
  head = mid;
  head.f = head.i = head.w = 3.0;
  auto even = hp::train::stage_cost_model(mid, mid, mid, 0.0, 4);
  auto heavy = hp::train::stage_cost_model(mid, mid, head, 0.0, 4);
  for (const std::string name : {"1f1b", "interleaved-1f1b", "zbv"}) {
    auto a = hp::train::predict_schedules(even, 4, 8, {name})[0];
    auto b = hp::train::predict_schedules(heavy, 4, 8, {name})[0];
    ASSERT_TRUE(a.ok && b.ok) << name << ": " << a.error << b.error;
    EXPECT_GT(b.step_seconds, a.step_seconds + 8 * 5.0)
        << name << ": the head's extra work per microbatch";
  }
}

TEST(Profile, ProfilesAReferenceModelOnTheCpu) {
  hp::train::ProfileConfig c;
  c.model.kind = "gpt";
  c.model.layers = 4;
  c.model.d_model = 16;
  c.model.heads = 2;
  c.model.seq_len = 8;
  c.microbatch_size = 2;
  c.p = 4;
  c.m = 8;
  c.device = "cpu";
  c.warmup = 1;
  c.repeats = 1;
  c.comm = 1e-4;
  c.schedules = {"1f1b", "zb-h1"};
  auto r = hp::train::profile_model(c);
  EXPECT_EQ(r.chunks, (std::vector<int>{0, 2, 3}));
  ASSERT_EQ(r.measured.size(), 3u);
  for (const auto& m : r.measured) {
    EXPECT_GT(m.f, 0.0);
    EXPECT_GT(m.mem_b, 0);
  }
  EXPECT_EQ(r.costs.stage_f.size(), 4u);
  EXPECT_DOUBLE_EQ(r.costs.comm, 1e-4);
  ASSERT_EQ(r.predictions.size(), 2u);
  // Sorted by predicted step (which one wins depends on the measured costs).
  EXPECT_LE(r.predictions[0].step_seconds, r.predictions[1].step_seconds);
  EXPECT_EQ((std::set<std::string>{r.predictions[0].schedule, r.predictions[1].schedule}),
            (std::set<std::string>{"1f1b", "zb-h1"}));
  EXPECT_EQ(r.items_per_step, 2 * 8 * 8);
  auto text = hp::train::profile_text(c, r);
  EXPECT_NE(text.find("predicted step at p = 4, m = 8"), std::string::npos) << text;
  EXPECT_NE(text.find("has no row at p = 4, m = 8"), std::string::npos) << text;
  c.p = 5;
  EXPECT_THROW(hp::train::profile_model(c), std::invalid_argument) << "more chunks than layers";
}

// ---------------------------------------------------------------------------
// On a GPU (skipped loudly elsewhere; the CPU siblings are above).

// Two ranks on one GPU (NOTE [Ranks on devices]: through host memory) train
// like one process on that GPU, within float32 rounding.
TEST(Gpu, TwoRanksOnOneGpuTrainLikeOneProcess) {
  if (!torch::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: the CPU sibling is HostStaging.PipelineTrainsLikeOneProcess";
  hp::train::TrainConfig c;
  c.model.kind = "gpt";
  c.model.dtype = torch::kFloat32;
  c.model.layers = 4;
  c.model.d_model = 64;
  c.model.heads = 4;
  c.model.seq_len = 32;
  c.nproc = 2;
  c.schedule = "zb-h1";
  c.microbatches = 4;
  c.microbatch_size = 4;
  c.steps = 3;
  c.seed = 3;
  c.progress = false;
  c.device = "cuda";
  std::vector<hp::train::TrainResult> ranks(2);
  hp::testing::run_ranks_as_threads(
      2, [&](int r, std::shared_ptr<Comm> comm) { ranks[r] = hp::train::run_rank(c, comm); });
  auto ref = hp::train::train_reference(c);
  for (size_t s = 0; s < ref.losses.size(); ++s)
    EXPECT_NEAR(ranks[0].losses[s], ref.losses[s], 1e-4 * std::max(1.0, std::abs(ref.losses[s])));
  for (const auto& r : ranks)
    for (const auto& [name, p] : r.parameters) {
      const auto& q = ref.parameters.at(name);
      EXPECT_LE((p - q).abs().max().item<double>(),
                1e-4 * std::max(1.0, q.abs().max().item<double>()))
          << name;
    }
  EXPECT_GT(ranks[0].measured_makespan, 0.0) << "device-timed timeline";
}

// The executor on one GPU (one rank, F, I and W of every microbatch) stops
// the host twice per step - the timer's read-out and the loss - whatever the
// number of actions.
TEST(Gpu, HostSynchronizationsPerStepOnCuda) {
  if (!torch::cuda::is_available())
    GTEST_SKIP() << "no CUDA device: the CPU sibling is "
                    "Executor.HostSynchronizationsPerStepDoNotGrowWithTheActions";
  const torch::Device cuda(torch::kCUDA, 0);
  auto on = torch::TensorOptions().dtype(torch::kFloat32).device(cuda);
  for (int m : {4, 16}) {
    torch::manual_seed(1);
    auto w0 = torch::randn({64, 64}, on).requires_grad_(true);
    auto w1 = torch::randn({64, 64}, on).requires_grad_(true);
    std::map<int, StageModule> modules;
    modules[0] = {[w0, w1](const torch::Tensor& x) {
                    return torch::tanh(torch::tanh(x.matmul(w0)).matmul(w1));
                  },
                  {w0, w1},
                  {}};
    PipelineStage stage(modules, [m](const torch::Tensor& y, int) { return y.pow(2).sum() / m; });
    auto sched = hp::schedule::lower(hp::schedule::build("zb-h1", 1, m));
    hp::pipeline::ExecutorOptions o;
    o.input = [on](int mb) { return torch::full({32, 64}, 0.01 * (mb + 1), on); };
    o.activation_shape = [](int, int) { return std::vector<int64_t>{32, 64}; };
    o.device = cuda;
    hp::testing::run_ranks_as_threads(1, [&](int, std::shared_ptr<Comm> comm) {
      hp::pipeline::Executor ex(sched, 0, stage, comm, o);
      ex.run_step();
      auto stats = ex.run_step();
      EXPECT_EQ(stats.host_syncs, 2) << "m=" << m;
      EXPECT_GT(stats.compute, 0.0);
    });
  }
}
