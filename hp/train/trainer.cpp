// run_rank and train_reference: one rank's run as a story (its groups, its
// model, its Pipeline, where to start, the step loop, the final parameters)
// and the single-process oracle it must equal. Where to resume is decided
// in checkpoint.cpp, the stages' memory measured in stage_memory.cpp, and
// the report's tail (gather, fit, simulate, write) is report.cpp's.
#include "hp/train/trainer.h"

#include <c10/core/DeviceGuard.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdlib>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <set>
#include <stdexcept>

#include "hp/core/memory.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/lanes.h"
#include "hp/distributed/mesh.h"
#include "hp/launch/launcher.h"
#include "hp/models/data.h"
#include "hp/pipeline/pipeline.h"
#include "hp/pipeline/stage.h"
#include "hp/recompute/checkpoint.h"
#include "hp/train/checkpoint.h"
#include "hp/train/fsdp.h"
#include "hp/train/progress.h"
#include "hp/train/report.h"
#include "hp/train/stage_memory.h"

namespace hp::train {
namespace {

using Clock = std::chrono::steady_clock;

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c,
                                                        std::vector<torch::Tensor> params) {
  if (c.optimizer == "sgd")
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(c.lr).weight_decay(c.weight_decay));
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(c.lr).weight_decay(c.weight_decay));
}

}  // namespace

namespace {

/// This rank's groups: the pipeline's ("pp"), the copies' ("dp", null
/// without --dp) and which copy this is (NOTE [Pipeline x data parallel]).
struct RankGroups {
  std::shared_ptr<distributed::Comm> pp, dp;
  /// --ep: the copies whose experts differ (the EP group: `dp`, or with
  /// --ep < --dp consecutive copies within it) and, with --ep < --dp, the
  /// copies holding the same experts (NOTE [Expert gradients]).
  std::shared_ptr<distributed::Comm> ep, expert_dp;
  int replica = 0;
  distributed::LinkModel link;  ///< --link
};

RankGroups make_groups(const TrainConfig& config, std::shared_ptr<distributed::Comm> world) {
  TORCH_CHECK(world->world_size() == config.nproc * config.dp, "the Comm has ", world->world_size(),
              " ranks but the config asks for --pp ", config.nproc, " x --dp ", config.dp);
  RankGroups g;
  g.pp = world;
  if (!config.link.empty()) g.link = distributed::LinkModel::parse(config.link, "--link");
  if (config.dp > 1) {
    // NOTE [The training mesh] in hp/distributed/mesh.h: (edp, ep, pp), the
    // copies edp x ep; the (dp, pp) mesh is the same layout, edp and ep
    // flattened.
    distributed::DeviceMesh copies(world,
                                   distributed::MeshShape{{"dp", "pp"}, {config.dp, config.nproc}});
    g.pp = copies.group("pp");
    // --link: the experts' all-to-alls and the copies' reductions pay it too.
    g.dp = distributed::with_link_model(copies.group("dp"), g.link);
    g.replica = copies.coordinate("dp");
    g.ep = g.dp;
    if (config.ep > 1 && config.ep < config.dp) {
      distributed::DeviceMesh mesh(
          world,
          distributed::training_mesh(world->world_size(), config.nproc, config.dp, config.ep));
      g.ep = distributed::with_link_model(mesh.group("ep"), g.link);
      g.expert_dp = distributed::with_link_model(mesh.group("edp"), g.link);
    }
  }
  // --pair-turns ready: the groups whose posts a pair's halves and its W's
  // make, in lanes (NOTE [Turns as messages arrive] in
  // hp/pipeline/overlap.cpp). With --ep always: an expert dispatch sends
  // its counts at the head of its rows on a group in lanes only (NOTE
  // [Counts at the head of the rows] in hp/moe/all_to_all.cpp). The
  // pipeline's own group needs none (NOTE [A half's sends leave when it
  // ends]), nor the expert copies' (reduced at the step's end).
  if ((config.pairs_take_ready_turns() || config.ep > 1) && g.dp) {
    const bool shared = g.ep == g.dp;
    g.dp = distributed::with_lanes(g.dp, distributed::kPairLanes);
    g.ep = shared ? g.dp : distributed::with_lanes(g.ep, distributed::kPairLanes);
  }
  return g;
}

/// The chunks of this rank's stages (each once), as models and as the
/// Pipeline's modules, and its parameters by model-wide name.
struct RankModel {
  std::map<int, std::shared_ptr<models::Chunk>> chunks;
  std::map<int, pipeline::ChunkModule> modules;
  std::vector<torch::Tensor> params;
  std::map<std::string, std::vector<torch::Tensor>> by_name;
};

RankModel build_rank_model(const TrainConfig& config, const schedule::Schedule& sched, int rank,
                           const RankGroups& groups, const torch::Device& device) {
  RankModel model;
  for (int st : sched.stages_of_rank(rank)) {
    const int c = sched.stage_chunk[st];
    if (model.chunks.count(c)) continue;
    // --ep: the copies of the pipeline hold different experts (hp/moe).
    auto chunk =
        models::build_chunk(config.model, c, sched.num_chunks, config.seed,
                            config.ep > 1 ? distributed::for_device(groups.ep, device) : nullptr);
    chunk->to(device);  // initialised on the CPU: the same values on every device
    chunk->set_aux_scale(
        1.0 / config.microbatches);  // NOTE [The load-balancing loss of the reference MoE]
    model.chunks[c] = chunk;
    pipeline::ChunkModule mod;
    // --recompute: each block checkpointed; else each block as it is.
    models::Chunk::BlockRunner run_block;
    if (config.recompute)
      run_block = [](const models::Chunk::BlockForward& block, torch::nn::Module& module,
                     const torch::Tensor& h) {
        auto fn = [block](const recompute::TensorList& in) {
          return recompute::TensorList{block(in[0])};
        };
        return recompute::checkpoint(fn, {h}, module.parameters())[0];
      };
    // --documents: the gpt's chunks hand on a message of two tensors (NOTE
    // [Documents in the reference GPT] in hp/models/models.cpp).
    if (config.model.documents)
      mod.forward_message = [chunk, run_block](const pipeline::Message& in) {
        return chunk->forward_message(in, run_block);
      };
    else
      mod.forward = [chunk, run_block](const torch::Tensor& x) {
        return run_block ? chunk->forward_with(x, run_block) : chunk->forward(x);
      };
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
    model.modules[c] = std::move(mod);
  }
  // In chunk order (the optimizer's, and so its checkpoints' order).
  for (const auto& [c, chunk] : model.chunks)
    for (const auto& item : chunk->named_parameters()) {
      model.params.push_back(item.value());
      model.by_name[item.key()].push_back(item.value());
    }
  return model;
}

/// The rank's expert parameters (--ep), by tensor.
std::set<const void*> expert_set(const RankModel& model) {
  std::set<const void*> experts;
  for (const auto& [c, mod] : model.modules)
    for (const auto& t : mod.expert_parameters)
      experts.insert(t.unsafeGetTensorImpl());
  return experts;
}

/// The Pipeline's options as `hp train` sets them.
pipeline::PipelineOptions pipeline_options(const TrainConfig& config, const RankGroups& groups,
                                           const torch::Device& device) {
  pipeline::PipelineOptions po;
  po.device = device;
  po.dtype = config.model.dtype;
  po.p2p = config.p2p;
  po.dp = groups.dp;
  po.expert_dp = groups.expert_dp;
  po.recompute_sessions = config.recompute;
  po.prefetch_recompute = true;  // NOTE [Recompute in the pipeline] in hp/pipeline/pipeline.cpp
  po.receive_lookahead = config.receive_lookahead;
  po.cache_cpu_memory = true;  // the CPU's caching allocator (CUDA has its own)
  po.fb_overlap = config.fb_overlap;
  po.defer_wgrad = config.defer_wgrad;
  po.deferred_w_parts = config.w_parts;
  po.pair_first_ready = config.pairs_take_ready_turns();
  po.link = groups.link;
  return po;
}

/// The final parameters and a checksum that counts each model-wide name
/// once; --ep: each copy holds other experts, theirs summed over the copies.
void final_parameters(const TrainConfig& config, const RankModel& model,
                      const pipeline::Pipeline& pipe, const RankGroups& groups,
                      distributed::Comm& comm, TrainResult& result) {
  const std::set<const void*> experts = expert_set(model);
  double own_sum = 0.0, expert_sum = 0.0;
  for (const auto& [name, tensors] : model.by_name) {
    result.parameters[name] = tensors[0].detach().to(torch::kCPU, /*non_blocking=*/false,
                                                     /*copy=*/true);
    if (*pipe.holders().at(name).begin() == pipe.rank())
      (experts.count(tensors[0].unsafeGetTensorImpl()) ? expert_sum : own_sum) +=
          tensors[0].detach().to(torch::kFloat64).sum().item<double>();
  }
  if (config.ep > 1) {
    auto es = torch::tensor({expert_sum}, torch::kFloat64);
    groups.ep->all_reduce(es);  // each expert once: its EP group holds every one
    expert_sum = es.item<double>();
  }
  auto cs = torch::tensor({own_sum + expert_sum}, torch::kFloat64);
  comm.all_reduce(cs);
  result.checksum = cs.item<double>();
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
  const RankGroups groups = make_groups(config, world);
  const int rank = groups.pp->rank();
  const bool reporter = groups.replica == 0;  // copy 0 reports
  install_memory_tracker();
  const schedule::Schedule sched = config.build_schedule();
  const int m = config.microbatches;
  const char* local_env = std::getenv("LOCAL_RANK");
  const torch::Device device =
      config.resolve_device(local_env != nullptr ? std::atoi(local_env) : rank);
  c10::OptionalDeviceGuard on_device;
  if (!device.is_cpu()) on_device.reset_device(device);

  // The model, the data, and one rank's pipeline over them
  // (hp/pipeline/pipeline.h: --p2p, the stages, the executor, the average
  // over --dp copies, the replicas' sums).
  RankModel model = build_rank_model(config, sched, rank, groups, device);
  models::Dataset data(config.model, config.data, config.microbatch_size, config.seed);
  int step = 0;
  const int first_mb = groups.replica * m;  // this copy's microbatches of the global batch
  auto loss_fn = [&](const torch::Tensor& out, int mb) {
    return models::loss(config.model, out, data.get(step, first_mb + mb).target.to(device));
  };
  auto input_fn = [&](int mb) { return data.get(step, first_mb + mb).input.to(device); };
  const std::vector<int64_t> act_shape =
      models::activation_shape(config.model, config.microbatch_size);
  // What a stage after the first receives: the activation, and with
  // --documents each token's document number, which takes no gradient.
  pipeline::Layout received = {{config.model.dtype, act_shape, true}};
  pipeline::PipelineOptions po = pipeline_options(config, groups, device);
  if (config.model.documents) {
    received.push_back({torch::kLong, {config.microbatch_size, config.model.seq_len}, false});
    po.input_message = [&](int mb) { return pipeline::Message{input_fn(mb)}; };
    po.layout = [received](int, int) { return received; };
  } else {
    po.input = input_fn;
    po.activation_shape = [act_shape](int, int) { return act_shape; };
  }
  pipeline::Pipeline pipe(sched, groups.pp, model.modules, loss_fn, po);
  if (!pipe.p2p_note().empty() && rank == 0 && reporter)
    std::fprintf(stderr, "hp train: --p2p auto uses Gloo's point-to-point: %s\n",
                 pipe.p2p_note().c_str());
  distributed::Comm& comm = pipe.comm();

  // --fsdp: the optimizer steps this copy's shards (NOTE [PP x FSDP in hp train]).
  std::unique_ptr<FsdpShards> fsdp;
  std::vector<torch::Tensor> stepped = model.params;
  if (config.fsdp) {
    const std::set<const void*> experts = expert_set(model);  // --ep: stepped whole
    std::vector<torch::Tensor> plain, whole;
    for (const auto& p : model.params)
      (experts.count(p.unsafeGetTensorImpl()) ? whole : plain).push_back(p);
    fsdp = std::make_unique<FsdpShards>(groups.dp, plain);
    stepped = fsdp->shards();
    stepped.insert(stepped.end(), whole.begin(), whole.end());
  }
  auto optimizer = make_optimizer(config, stepped);

  TrainResult result;
  result.items_per_step = data.items_per_microbatch() * m * config.dp;  // all copies
  result.p2p_backend = pipe.backend();
  result.p2p_note = pipe.p2p_note();
  // Where to start (NOTE [Checkpoint integrity]).
  const CheckpointFingerprint fingerprint = checkpoint_fingerprint(config, sched);
  std::unique_ptr<CheckpointLock> lock;
  const int first = agree_on_first_step(config, fingerprint, comm, lock);
  if (first > 0) load_checkpoint(config, fingerprint, first, rank, model.by_name, *optimizer);
  result.first_step = first;

  // What the report fits and predicts with: one transfer's cost (half the
  // median round trip of an activation between ranks 0 and 1; the first
  // connects) and every stage's activation bytes.
  double comm_cost = 0.0;
  if (config.nproc > 1) {
    auto probe =
        torch::zeros(act_shape, torch::TensorOptions().dtype(config.model.dtype).device(device));
    comm_cost = distributed::one_way_latency(comm, 0, 1, probe);
  }
  const std::vector<double> stage_bytes =
      measure_stage_bytes(config, sched, rank, pipe, loss_fn, input_fn, received, device, comm);

  Progress progress(config.progress && rank == 0 && reporter, first, config.steps);
  // With --fb-overlap and --defer-wgrad auto (the default) the run decides
  // after its second step whether its pairs' W's defer (NOTE [The deferred
  // W's chosen in the run] in hp/pipeline/pipeline.cpp), under the costs
  // fitted to that step with the stages' measured bytes, so that the
  // report's `defer_wgrad_auto` gives both predicted peaks in bytes. A run of
  // fewer than 3 steps never defers, nor a schedule without FB pairs.
  TrainConfig ran = config;  // as the pipeline runs after the choice
  const bool choosing =
      sched.has_pairs() && config.fb_overlap && !config.defer_wgrad && config.defer_wgrad_auto;
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
    for (auto& p : model.params) {
      if (p.grad().defined())
        p.mutable_grad().zero_();
      else
        p.mutable_grad() = torch::zeros_like(p);
    }
    comm.barrier();  // aligns the ranks' clocks for the timeline
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
    if (choosing && step == first + 1 && step + 1 < config.steps) {
      DeferredWInRun& d = result.deferred_w_in_run;
      pipeline::DeferredWAuto how;
      how.gain = config.defer_wgrad_gain;
      how.pair_turns = config.pair_turns;
      how.comm_cost = comm_cost;
      if (!stage_bytes.empty())
        how.adjust = [&stage_bytes](schedule::CostModel& c) { set_stage_memory(c, stage_bytes); };
      d.decided = true;
      d.after_step = step + 1;
      d.choice = pipe.choose_deferred_w(last.stats, how);
      if (d.choice.defer) ran.defer_wgrad = true;
      if (rank == 0 && reporter) progress.note(deferred_w_line(d));  // with or without the bar
    }

    if (config.save_every > 0 && ((step + 1) % config.save_every == 0 || step + 1 == config.steps))
      save_checkpoint(config, fingerprint, step + 1, comm, model.by_name, *optimizer);
  }

  result.executed = last.stats.executed;
  if (fsdp) fsdp->gather();  // the final parameters, whole
  final_parameters(config, model, pipe, groups, comm, result);
  gather_and_report(ran, sched, last.stats, double(peak_bytes), stage_bytes, comm_cost, comm,
                    groups.dp.get(), reporter, result);
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
