// run_rank and train_reference: the training loop around one rank's Pipeline
// (models, data, optimizer, metrics gathering, checkpoints) and the
// single-process oracle it must equal.
#include "hp/train/trainer.h"

#include <c10/core/DeviceGuard.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdlib>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "hp/core/memory.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/mesh.h"
#include "hp/launch/launcher.h"
#include "hp/models/data.h"
#include "hp/pipeline/pipeline.h"
#include "hp/pipeline/stage.h"
#include "hp/recompute/checkpoint.h"
#include "hp/schedule/cost_file.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/progress.h"
#include "hp/schedule/render.h"
#include "hp/train/checkpoint.h"
#include "hp/train/fsdp.h"
#include "hp/train/progress.h"
#include "hp/train/report.h"

namespace hp::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c,
                                                        std::vector<torch::Tensor> params) {
  if (c.optimizer == "sgd")
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(c.lr).weight_decay(c.weight_decay));
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(c.lr).weight_decay(c.weight_decay));
}

// Serialises measured events for the trip to rank 0.
torch::Tensor pack_events(const std::vector<schedule::Event>& events) {
  auto t = torch::empty({static_cast<int64_t>(events.size()), 7}, torch::kFloat64);
  auto a = t.accessor<double, 2>();
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    a[i][0] = static_cast<double>(e.action.op);
    a[i][1] = e.action.stage;
    a[i][2] = e.action.microbatch;
    a[i][3] = e.action.stage2;
    a[i][4] = e.action.microbatch2;
    a[i][5] = e.start;
    a[i][6] = e.end;
  }
  return t;
}

void unpack_events(const torch::Tensor& t, int rank, std::vector<schedule::Event>& out) {
  auto a = t.accessor<double, 2>();
  for (int64_t i = 0; i < t.size(0); ++i) {
    schedule::Event e;
    e.rank = rank;
    e.action.op = static_cast<schedule::Op>(static_cast<int>(a[i][0]));
    e.action.stage = static_cast<int>(a[i][1]);
    e.action.microbatch = static_cast<int>(a[i][2]);
    e.action.stage2 = static_cast<int>(a[i][3]);
    e.action.microbatch2 = static_cast<int>(a[i][4]);
    e.start = a[i][5];
    e.end = a[i][6];
    out.push_back(e);
  }
}

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
constexpr int kStageMemFields = 6;

std::vector<double> measure_activation_bytes(
    const schedule::Schedule& sched, int rank, const std::map<int, pipeline::StageModule>& modules,
    const std::function<torch::Tensor(const torch::Tensor&, int)>& loss_fn,
    const std::function<torch::Tensor(int)>& data_input, const std::vector<int64_t>& act_shape,
    const torch::TensorOptions& act_options, double loss_scale) {
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
    auto forward = [&](int mb) {
      torch::Tensor input = first ? data_input(0) : torch::randn(act_shape, act_options);
      stage.forward(st, mb, input, /*input_needs_grad=*/!first, last);
      input = torch::Tensor();
      if (!last) stage.release_output(st, mb);
    };
    auto backward = [&](int mb, bool fused) {
      stage.prepare_backward(st, mb);
      torch::Tensor g = last ? torch::Tensor() : torch::randn(act_shape, act_options);
      torch::Tensor dx = fused ? stage.backward(st, mb, g) : stage.backward_input(st, mb, g);
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
// count, op by op in the rank's order).
double peak_with_transients(const schedule::Schedule& sched, int r,
                            const std::vector<double>& bytes) {
  auto at = [&](int st, int k) { return bytes.at(kStageMemFields * st + k); };
  double held = 0.0, peak = 0.0;
  for (const auto& a : sched.actions.at(r)) {
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

// NOTE [Pipeline x data parallel]
// With --dp D the nproc x D processes form a (dp, pp) mesh (NOTE [Mesh
// layout]: the ranks of one pipeline are consecutive). Each copy of the
// pipeline runs the schedule over its "pp" slice; copy d trains on
// microbatches d*m .. d*m + m - 1 of the step's global batch of D*m; each
// stage's gradients are averaged over the "dp" slice as soon as the stage has
// run its last microbatch (GradientReducer, NOTE [Gradient reduction in the
// cool-down]), and the step's loss is the mean over the copies. So D copies
// with m microbatches each train exactly as one process on D*m microbatches.
// Reports, traces and the progress line come from copy 0.
TrainResult run_rank(const TrainConfig& config, std::shared_ptr<distributed::Comm> world) {
  config.validate();
  TORCH_CHECK(world->world_size() == config.nproc * config.dp, "the Comm has ", world->world_size(),
              " ranks but the config asks for --pp ", config.nproc, " x --dp ", config.dp);
  std::shared_ptr<distributed::Comm> comm = world, dp_comm;
  int replica = 0;
  const distributed::LinkModel link = config.link.empty()
                                          ? distributed::LinkModel{}
                                          : distributed::LinkModel::parse(config.link, "--link");
  if (config.dp > 1) {
    distributed::DeviceMesh mesh(world,
                                 distributed::MeshShape{{"dp", "pp"}, {config.dp, config.nproc}});
    comm = mesh.group("pp");
    // --link: the experts' all-to-alls and the copies' reductions pay it too.
    dp_comm = distributed::with_link_model(mesh.group("dp"), link);
    replica = mesh.coordinate("dp");
  }
  const int rank = comm->rank();
  install_memory_tracker();
  const schedule::Schedule sched = config.build_schedule();
  const int m = config.microbatches;
  const char* local_env = std::getenv("LOCAL_RANK");
  const torch::Device device =
      config.resolve_device(local_env != nullptr ? std::atoi(local_env) : rank);
  c10::OptionalDeviceGuard on_device;
  if (!device.is_cpu()) on_device.reset_device(device);

  // Model chunks of this rank's stages (each chunk once), data, loss.
  std::map<int, std::shared_ptr<models::Chunk>> chunks;
  std::map<int, pipeline::ChunkModule> modules;
  for (int st : sched.stages_of_rank(rank)) {
    const int c = sched.stage_chunk[st];
    if (chunks.count(c)) continue;
    // --ep: the copies of the pipeline hold different experts (hp/moe).
    auto chunk =
        models::build_chunk(config.model, c, sched.num_chunks, config.seed,
                            config.ep > 1 ? distributed::for_device(dp_comm, device) : nullptr);
    chunk->to(device);              // initialised on the CPU: the same values on every device
    chunk->set_aux_scale(1.0 / m);  // NOTE [The load-balancing loss of the reference MoE]
    chunks[c] = chunk;
    pipeline::ChunkModule mod;
    if (config.recompute) {
      mod.forward = [chunk](const torch::Tensor& x) {
        return chunk->forward_with(x, [](const models::Chunk::BlockForward& block,
                                         torch::nn::Module& module, const torch::Tensor& h) {
          auto fn = [block](const recompute::TensorList& in) {
            return recompute::TensorList{block(in[0])};
          };
          return recompute::checkpoint(fn, {h}, module.parameters())[0];
        });
      };
    } else {
      mod.forward = [chunk](const torch::Tensor& x) { return chunk->forward(x); };
    }
    // Model-wide names: a tied head's weight is the embedding's, a DualPipe
    // mirror's the original's, so the Pipeline sums their gradients.
    for (const auto& item : chunk->named_parameters()) {
      mod.parameters.push_back(item.value());
      mod.names.push_back(item.key());
    }
    // --fsdp: the stage's gradients are averaged by FsdpShards, not by the
    // Pipeline's reducer (NOTE [PP x FSDP in hp train]).
    if (config.fsdp) mod.dp_parameters = std::vector<torch::Tensor>{};
    if (config.ep > 1) mod.expert_parameters = chunk->expert_parameters();
    modules[c] = std::move(mod);
  }
  models::Dataset data(config.model, config.data, config.microbatch_size, config.seed);
  int step = 0;
  const int first_mb = replica * m;  // this copy's microbatches of the global batch
  auto loss_fn = [&](const torch::Tensor& out, int mb) {
    return models::loss(config.model, out, data.get(step, first_mb + mb).target.to(device));
  };
  auto input_fn = [&](int mb) { return data.get(step, first_mb + mb).input.to(device); };
  const std::vector<int64_t> act_shape =
      models::activation_shape(config.model, config.microbatch_size);

  // One rank's pipeline (hp/pipeline/pipeline.h): --p2p, the stages, the
  // executor, the average over --dp copies, the replicas' sums.
  pipeline::PipelineOptions po;
  po.device = device;
  po.dtype = config.model.dtype;
  po.p2p = config.p2p;
  po.dp = dp_comm;
  po.recompute_sessions = config.recompute;
  po.prefetch_recompute = true;  // NOTE [Recompute in the pipeline] in hp/pipeline/pipeline.cpp
  po.receive_lookahead = config.receive_lookahead;
  po.cache_cpu_memory = true;  // the CPU's caching allocator (CUDA has its own)
  po.fb_overlap = config.fb_overlap;
  po.defer_wgrad = config.defer_wgrad;
  po.link = link;
  po.input = input_fn;
  po.activation_shape = [act_shape](int, int) { return act_shape; };
  pipeline::Pipeline pipe(sched, comm, modules, loss_fn, po);
  if (!pipe.p2p_note().empty() && rank == 0 && replica == 0)
    std::fprintf(stderr, "hp train: --p2p auto uses Gloo's point-to-point: %s\n",
                 pipe.p2p_note().c_str());
  comm = pipe.comm_ptr();

  // Parameters: this rank's tensors by model-wide name.
  std::vector<torch::Tensor> params;
  std::map<std::string, std::vector<torch::Tensor>> local_by_name;
  for (auto& [c, chunk] : chunks)
    for (const auto& item : chunk->named_parameters()) {
      params.push_back(item.value());
      local_by_name[item.key()].push_back(item.value());
    }
  // --fsdp: the optimizer steps this copy's shards (NOTE [PP x FSDP in hp train]).
  std::unique_ptr<FsdpShards> fsdp;
  if (config.fsdp) fsdp = std::make_unique<FsdpShards>(dp_comm, params);
  auto optimizer = make_optimizer(config, fsdp ? fsdp->shards() : params);

  TrainResult result;
  result.items_per_step = data.items_per_microbatch() * m * config.dp;  // all copies
  result.p2p_backend = pipe.backend();
  result.p2p_note = pipe.p2p_note();
  // Where to start (NOTE [Checkpoint integrity]): chosen by the launcher, or
  // here, under rank 0's lock, with every rank agreeing.
  const CheckpointFingerprint fingerprint = checkpoint_fingerprint(config, sched);
  std::unique_ptr<CheckpointLock> lock;
  int first = std::max(config.checkpoint_step, 0);
  if (config.checkpoint_step < 0 && !config.checkpoint_dir.empty()) {
    if (rank == 0) lock = std::make_unique<CheckpointLock>(config.checkpoint_dir);
    ResumePlan plan = plan_resume(config, fingerprint);
    if (rank == 0)
      for (const auto& note : plan.notes)
        std::fprintf(stderr, "hp train: %s\n", note.c_str());
    auto mine = torch::tensor({int64_t(plan.step)}, torch::kInt64);
    std::vector<torch::Tensor> steps(comm->world_size());
    for (auto& t : steps)
      t = torch::empty_like(mine);
    comm->all_gather(steps, mine);
    for (int r = 0; r < comm->world_size(); ++r)
      TORCH_CHECK(steps[r].item<int64_t>() == plan.step, "rank ", r, " would resume from step ",
                  steps[r].item<int64_t>(), " and rank ", rank, " from step ", plan.step,
                  ": the ranks do not see the same --checkpoint-dir");
    first = plan.step;
  }
  if (first > 0) load_checkpoint(config, fingerprint, first, rank, local_by_name, *optimizer);
  result.first_step = first;

  // Round trips of an activation between ranks 0 and 1 estimate the
  // communication cost: half the median round trip (the first connects).
  double comm_cost = 0.0;
  if (config.nproc > 1) {
    auto probe =
        torch::zeros(act_shape, torch::TensorOptions().dtype(config.model.dtype).device(device));
    comm_cost = distributed::one_way_latency(*comm, 0, 1, probe);
  }

  // NOTE [Memory measured against predicted]: every stage's mem_b and mem_w in bytes.
  std::vector<double> stage_bytes;
  // Not with --recompute: its hooks count every recompute of the run, and
  // what a checkpointed stage holds is another model (left out).
  if (device.is_cpu() && memory_tracker_installed() && !config.recompute) {
    std::map<int, pipeline::StageModule> stage_modules;
    for (int st : sched.stages_of_rank(rank))
      stage_modules[st] = pipe.stages().module(st);
    stage_bytes = measure_activation_bytes(
        sched, rank, stage_modules, loss_fn, input_fn, act_shape,
        torch::TensorOptions().dtype(config.model.dtype).device(device), 1.0 / m);
    auto all_bytes = torch::tensor(stage_bytes, torch::kFloat64);
    comm->all_reduce(all_bytes);  // each stage lives on one rank of the pipeline
    stage_bytes.assign(all_bytes.data_ptr<double>(),
                       all_bytes.data_ptr<double>() + all_bytes.numel());
  }

  Progress progress(config.progress && rank == 0 && replica == 0, first, config.steps);
  pipeline::PipelineStep last;
  int64_t peak_bytes = 0;
  for (step = first; step < config.steps; ++step) {
    launch::fault_point(std::to_string(step));  // NOTE [Fault injection]
    if (fsdp) fsdp->gather();
    // The weight gradients exist (zeros) before the step, so that the step's
    // peak above its start counts activations alone, whenever the first W
    // runs (NOTE [Memory measured against predicted]; subtracting them from
    // the peak undercounted a peak that comes before a rank's first W, as
    // V-Min's does at p = 2). Adding the first gradient to zeros gives its
    // own bits, and the split's dw started from zeros already.
    for (auto& p : params) {
      if (p.grad().defined())
        p.mutable_grad().zero_();
      else
        p.mutable_grad() = torch::zeros_like(p);
    }
    comm->barrier();  // aligns the ranks' clocks for the timeline
    const int64_t base = memory_allocated();
    reset_peak_memory();
    auto t0 = Clock::now();
    last = pipe.step();
    // Activation memory: the step's peak above its start (the weight
    // gradients were allocated before it).
    peak_bytes = std::max(peak_bytes, std::max<int64_t>(0, peak_memory_allocated() - base));
    if (fsdp) fsdp->scatter();
    optimizer->step();
    double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    result.losses.push_back(last.loss);
    result.step_seconds.push_back(secs);
    if (!std::isfinite(result.losses.back()))
      throw std::runtime_error("step " + std::to_string(step + 1) + ": the loss is " +
                               std::to_string(result.losses.back()) +
                               "; training stopped (nothing of this step was saved). Lower --lr, "
                               "or check the data");
    progress.update(step, result.losses.back(), result.items_per_step / secs);

    if (config.save_every > 0 && ((step + 1) % config.save_every == 0 || step + 1 == config.steps))
      save_checkpoint(config, fingerprint, step + 1, *comm, local_by_name, *optimizer);
  }

  result.executed = last.stats.executed;
  if (fsdp) fsdp->gather();  // the final parameters, whole

  // Final parameters and a checksum that counts each model-wide name once.
  // --ep: each copy holds other experts; theirs are summed over the copies.
  std::set<const void*> experts;
  for (const auto& [c, mod] : modules)
    for (const auto& t : mod.expert_parameters)
      experts.insert(t.unsafeGetTensorImpl());
  double own_sum = 0.0, expert_sum = 0.0;
  for (auto& [name, tensors] : local_by_name) {
    result.parameters[name] = tensors[0].detach().to(torch::kCPU, /*non_blocking=*/false,
                                                     /*copy=*/true);
    if (*pipe.holders().at(name).begin() == rank)
      (experts.count(tensors[0].unsafeGetTensorImpl()) ? expert_sum : own_sum) +=
          tensors[0].detach().to(torch::kFloat64).sum().item<double>();
  }
  if (config.ep > 1) {
    auto es = torch::tensor({expert_sum}, torch::kFloat64);
    dp_comm->all_reduce(es);
    expert_sum = es.item<double>();
  }
  auto cs = torch::tensor({own_sum + expert_sum}, torch::kFloat64);
  comm->all_reduce(cs);
  result.checksum = cs.item<double>();

  // Gather the last step's measurements and timeline on rank 0.
  auto mine =
      torch::tensor({last.stats.compute, last.stats.comm_wait, last.stats.overhead,
                     double(peak_bytes), last.stats.pair_hidden, last.stats.pair_exposed,
                     double(last.stats.deferred_w_in_waits), double(last.stats.deferred_w_at_end)},
                    torch::kFloat64);
  std::vector<torch::Tensor> all(comm->world_size());
  for (auto& t : all)
    t = torch::empty_like(mine);
  comm->all_gather(all, mine);
  auto events = distributed::gather_rows(*comm, pack_events(last.stats.events), 0);
  if (rank != 0 || replica != 0) return result;  // copy 0's rank 0 reports
  for (auto& t : all) {
    result.rank_compute.push_back(t[0].item<double>());
    result.rank_comm_wait.push_back(t[1].item<double>());
    result.rank_overhead.push_back(t[2].item<double>());
    result.rank_peak_bytes.push_back(t[3].item<double>());
    result.rank_pair_hidden.push_back(t[4].item<double>());
    result.rank_pair_exposed.push_back(t[5].item<double>());
    result.rank_deferred_w_in_waits.push_back(static_cast<int>(t[6].item<double>()));
    result.rank_deferred_w_at_end.push_back(static_cast<int>(t[7].item<double>()));
  }
  result.timeline.num_ranks = config.nproc;
  result.timeline.title = config.schedule + " (measured, last step)";
  for (int r = 0; r < config.nproc; ++r)
    unpack_events(events[r], r, result.timeline.events);
  auto measured = schedule::timeline_stats(result.timeline);
  result.measured_bubble = measured.bubble_rate;
  result.measured_makespan = measured.makespan;
  result.stage_costs = schedule::costs_from_timeline(sched, result.timeline, comm_cost);
  if (!stage_bytes.empty()) {
    // NOTE [Memory measured against predicted]: the simulator's memory count
    // under the measured bytes of every stage (it also lands in the report's
    // stage costs, as mem_b and mem_w in bytes).
    auto& sc = result.stage_costs;
    const int n = sched.num_stages;
    sc.stage_mem_b.clear(), sc.stage_mem_w.clear();
    for (int st = 0; st < n; ++st) {
      sc.stage_mem_b.push_back(stage_bytes[kStageMemFields * st]);
      sc.stage_mem_w.push_back(stage_bytes[kStageMemFields * st + 1]);
    }
    sc.mem_b = *std::max_element(sc.stage_mem_b.begin(), sc.stage_mem_b.end());
    sc.mem_w = *std::max_element(sc.stage_mem_w.begin(), sc.stage_mem_w.end());
  }
  auto sim = schedule::simulate(sched, result.stage_costs);
  result.simulated_bubble = sim.bubble_rate;
  result.simulated_makespan = sim.makespan;
  if (!stage_bytes.empty()) {
    // One microbatch's activations on a rank: the sum of mem_b over its stages.
    for (int r = 0; r < config.nproc; ++r) {
      double unit = 0.0;
      for (int st : sched.stages_of_rank(r))
        unit += result.stage_costs.stage_mem_b[st];
      result.rank_microbatch_bytes.push_back(unit);
      result.rank_predicted_peak_bytes.push_back(sim.peak_memory.at(r));
      result.rank_predicted_peak_transient_bytes.push_back(
          peak_with_transients(sched, r, stage_bytes));
    }
  }

  if (!config.trace.empty()) {
    // The renderers read one time unit as one millisecond.
    schedule::Timeline ms = result.timeline;
    for (auto& e : ms.events)
      e.start *= 1e3, e.end *= 1e3;
    write_file_atomically(config.trace, schedule::render_chrome_trace(ms));
    write_file_atomically(config.trace + ".svg", schedule::render_svg(ms));
  }
  if (!config.report.empty()) write_report(config, result, config.report);
  return result;
}

TrainResult train_reference(const TrainConfig& config) {
  config.model.check();
  const torch::Device device = config.resolve_device(0);
  c10::OptionalDeviceGuard on_device;
  if (!device.is_cpu()) on_device.reset_device(device);
  auto model = models::build_chunk(config.model, 0, 1, config.seed);
  model->to(device);
  model->set_aux_scale(1.0 / config.microbatches);
  models::Dataset data(config.model, config.data, config.microbatch_size, config.seed);
  std::vector<torch::Tensor> params = model->parameters();
  auto optimizer = make_optimizer(config, params);
  TrainResult result;
  for (int step = 0; step < config.steps; ++step) {
    for (auto& p : params)
      p.mutable_grad() = torch::Tensor();
    double loss_sum = 0.0;
    for (int mb = 0; mb < config.microbatches; ++mb) {
      auto batch = data.get(step, mb);
      auto loss = models::loss(config.model, model->forward(batch.input.to(device)),
                               batch.target.to(device)) /
                  config.microbatches;
      loss.backward();
      loss_sum += loss.item<double>();
    }
    optimizer->step();
    result.losses.push_back(loss_sum);
  }
  double sum = 0.0;
  for (const auto& item : model->named_parameters()) {
    result.parameters[item.key()] =
        item.value().detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
    sum += item.value().detach().to(torch::kFloat64).sum().item<double>();
  }
  result.checksum = sum;
  return result;
}

}  // namespace hp::train
