// measure_stage_bytes and the memory prediction of the report (NOTE [Memory
// measured against predicted]).
#include "hp/train/stage_memory.h"

#include <algorithm>

#include "hp/core/memory.h"
#include "hp/pipeline/stage.h"
#include "hp/schedule/progress.h"

namespace hp::train {

// NOTE [Memory measured against predicted]
// The report compares each rank's measured peak activation memory with the
// simulator's (schedule/simulate.h: F adds mem_b, I turns mem_b into mem_w,
// W frees mem_w, B frees mem_b). The per-stage mem_b and mem_w it predicts
// with are measured here, in bytes, on the rank's own chunks and through the
// pipeline's own PipelineStage, once, before the first step: microbatches
// run F, I and W (and F, B) on each of the rank's stages alone. As in the
// executor, a received input (a fresh tensor) is counted from before its
// F, a sent output is freed after its F (release_output), the received
// output gradient and the sent dx die after their I; mem_b is what F leaves
// allocated, mem_w what I leaves. Wherever an input is handed off locally
// (the V's turn) it is counted once, with the consumer. The first round
// allocates the stage's weight gradients; the values come from the second,
// with them allocated, as the step's peak counts (it subtracts them).
//
// The simulator counts memory between ops; inside an op autograd holds more
// for a moment (the gradients in flight through a block's backward, a
// forward's temporaries). So the op's own peak above what the rank held
// when it began is measured too ("transient": tF, tI, tW, tB), and
// `peak_with_transients` replays a rank's action list with them: the peak
// of held + the running op's transient. Which of the two the measured peak
// matches is the finding of docs/benchmarks.md ("Memory measured against
// predicted").
//
// Left out: runs on a device (the tracker counts host memory only) and
// --recompute runs (its hooks count every recompute of the run, and a
// checkpointed stage holds another model); their reports have no prediction.
//
// Returned: kStageMemFields values per stage, stage-major (0 for stages not
// on this rank; an all-reduce fills in the others): mem_b, mem_w, tF, tI, tW,
// tB.
namespace {

std::vector<double> measure_activation_bytes(
    const schedule::Schedule& sched, int rank, const std::map<int, pipeline::StageModule>& modules,
    const std::function<torch::Tensor(const torch::Tensor&, int)>& loss_fn,
    const std::function<torch::Tensor(int)>& data_input, const pipeline::Layout& received,
    const torch::Device& device, double loss_scale) {
  std::vector<double> out(kStageMemFields * sched.num_stages, 0.0);
  StepCacheScope scope;  // as the executor's steps run (the tracker counts requested bytes)
  pipeline::PipelineStage stage(modules, loss_fn, pipeline::StageHooks{}, loss_scale);
  for (int st : sched.stages_of_rank(rank)) {
    // A microbatch whose route runs through st (DualPipe's two directions
    // take different stages); the slots below are keyed 0..3 whatever it is.
    int on_route = -1;
    for (int mb = 0; mb < sched.num_microbatches && on_route < 0; ++mb) {
      const auto& route = sched.routes.at(sched.microbatch_route.at(mb));
      if (std::find(route.begin(), route.end(), st) != route.end()) on_route = mb;
    }
    if (on_route < 0) continue;  // no microbatch visits it: it holds nothing
    const auto in = schedule::forward_input(sched, st, on_route);
    const bool first = in.kind == schedule::InputSource::Kind::Data;
    const bool last =
        schedule::backward_input(sched, st, on_route).kind == schedule::InputSource::Kind::Loss;
    // The peak of `op` above the bytes allocated when it began.
    auto op_peak = [](const std::function<void()>& op) {
      const int64_t at = memory_allocated();
      reset_peak_memory();
      op();
      return std::max<int64_t>(0, peak_memory_allocated() - at);
    };
    // What a received message and its gradient hold: random values of the
    // layout (the numbers of integer leaves, e.g. documents, zeros).
    auto leaf = [&](const pipeline::Leaf& l) {
      auto o = torch::TensorOptions().dtype(l.dtype).device(device);
      return c10::isFloatingType(l.dtype) ? torch::randn(l.shape, o) : torch::zeros(l.shape, o);
    };
    std::vector<bool> takes_grad;
    for (const auto& l : received)
      takes_grad.push_back(l.grad);
    auto forward = [&](int mb) {
      pipeline::Message input;
      if (first) input.push_back(data_input(0));
      for (size_t k = 0; !first && k < received.size(); ++k)
        input.push_back(leaf(received[k]));
      stage.forward(st, mb, input, first ? std::vector<bool>{false} : takes_grad, last);
      input.clear();
      if (!last) stage.release_output(st, mb);
    };
    auto backward = [&](int mb, bool fused) {
      stage.prepare_backward(st, mb);
      pipeline::Message g;
      for (size_t k = 0; !last && k < received.size(); ++k)
        if (received[k].grad) g.push_back(leaf(received[k]));
      pipeline::Message dx = fused ? stage.backward(st, mb, g) : stage.backward_input(st, mb, g);
    };
    std::array<int64_t, kStageMemFields> v{};
    for (int round = 0; round < 2; ++round) {
      const int64_t before = memory_allocated();
      // The received input is allocated inside F's peak, as in the executor.
      const int64_t t_f = op_peak([&] { forward(2 * round); });
      const int64_t mem_b = memory_allocated() - before;
      const int64_t t_i = op_peak([&] { backward(2 * round, false); });
      const int64_t mem_w = memory_allocated() - before;
      const int64_t t_w = op_peak([&] { stage.backward_weight(st, 2 * round); });
      forward(2 * round + 1);
      const int64_t t_b = op_peak([&] { backward(2 * round + 1, true); });
      v = {mem_b, mem_w, t_f, t_i, t_w, t_b};
    }
    for (auto& p : modules.at(st).parameters)
      p.mutable_grad() = torch::Tensor();
    for (int k = 0; k < kStageMemFields; ++k)
      out[kStageMemFields * st + k] = double(std::max<int64_t>(0, v[k]));
  }
  stage.reset();
  reset_peak_memory();
  return out;
}

// NOTE [Memory measured against predicted]: rank r's peak when each op adds
// its transient on top of what the rank holds as it starts (the simulator's
// count, op by op in the order the simulation ran them: with overlapped
// pairs, their halves as they ran and the W's that defer_wgrad queued).
double peak_with_transients(const std::vector<schedule::Action>& ops,
                            const std::vector<double>& bytes) {
  auto at = [&](int st, int k) { return bytes.at(kStageMemFields * st + k); };
  double held = 0.0, peak = 0.0;
  for (const auto& a : ops) {
    switch (a.op) {
      case schedule::Op::F:
        peak = std::max(peak, held + at(a.stage, 2));
        held += at(a.stage, 0);
        break;
      case schedule::Op::I:
        peak = std::max(peak, held + at(a.stage, 3));
        held += at(a.stage, 1) - at(a.stage, 0);
        break;
      case schedule::Op::W:
        peak = std::max(peak, held + at(a.stage, 4));
        held -= at(a.stage, 1);
        break;
      case schedule::Op::B:
        peak = std::max(peak, held + at(a.stage, 5));
        held -= at(a.stage, 0);
        break;
      case schedule::Op::FB:  // the F, then the B
        peak = std::max(peak, held + at(a.stage, 2));
        held += at(a.stage, 0);
        peak = std::max(peak, held + at(a.stage2, 5));
        held -= at(a.stage2, 0);
        break;
      default:
        break;
    }
    peak = std::max(peak, held);
  }
  return peak;
}

}  // namespace

std::vector<double> measure_stage_bytes(const TrainConfig& config, const schedule::Schedule& sched,
                                        int rank, pipeline::Pipeline& pipe,
                                        const pipeline::LossFn& loss_fn,
                                        const std::function<torch::Tensor(int)>& input_fn,
                                        const pipeline::Layout& received,
                                        const torch::Device& device, distributed::Comm& comm) {
  // Not with --recompute: its hooks count every recompute of the run, and
  // what a checkpointed stage holds is another model (left out).
  if (!device.is_cpu() || !memory_tracker_installed() || config.recompute) return {};
  std::map<int, pipeline::StageModule> stage_modules;
  for (int st : sched.stages_of_rank(rank))
    stage_modules[st] = pipe.stages().module(st);
  std::vector<double> bytes = measure_activation_bytes(
      sched, rank, stage_modules, loss_fn, input_fn, received, device, 1.0 / config.microbatches);
  auto all = torch::tensor(bytes, torch::kFloat64);
  comm.all_reduce(all);  // each stage lives on one rank of the pipeline
  bytes.assign(all.data_ptr<double>(), all.data_ptr<double>() + all.numel());
  return bytes;
}

void set_stage_memory(schedule::CostModel& sc, const std::vector<double>& stage_bytes) {
  const int n = static_cast<int>(stage_bytes.size()) / kStageMemFields;
  sc.stage_mem_b.clear(), sc.stage_mem_w.clear();
  for (int st = 0; st < n; ++st) {
    sc.stage_mem_b.push_back(stage_bytes[kStageMemFields * st]);
    sc.stage_mem_w.push_back(stage_bytes[kStageMemFields * st + 1]);
  }
  sc.mem_b = *std::max_element(sc.stage_mem_b.begin(), sc.stage_mem_b.end());
  sc.mem_w = *std::max_element(sc.stage_mem_w.begin(), sc.stage_mem_w.end());
}

void predict_rank_memory(const schedule::Schedule& sched, const std::vector<double>& stage_bytes,
                         const schedule::SimResult& sim, TrainResult& result) {
  // One microbatch's activations on a rank: the sum of mem_b over its stages.
  for (int r = 0; r < sched.num_ranks; ++r) {
    double unit = 0.0;
    for (int st : sched.stages_of_rank(r))
      unit += result.stage_costs.stage_mem_b[st];
    result.rank_microbatch_bytes.push_back(unit);
    result.rank_predicted_peak_bytes.push_back(sim.peak_memory.at(r));
    // The rank's compute in the order it ran in the simulation (its
    // events do not overlap), else in list order.
    std::vector<schedule::Event> mine;
    for (const auto& e : sim.timeline.events)
      if (e.rank == r) mine.push_back(e);
    std::stable_sort(mine.begin(), mine.end(),
                     [](const auto& x, const auto& y) { return x.start < y.start; });
    std::vector<schedule::Action> ops;
    for (const auto& e : mine)
      ops.push_back(e.action);
    if (ops.empty()) ops = sched.actions.at(r);
    result.rank_predicted_peak_transient_bytes.push_back(peak_with_transients(ops, stage_bytes));
  }
}

}  // namespace hp::train
