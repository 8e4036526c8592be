// run_rank and train_reference: the training loop around the Executor
// (replica gradient sums, optimizer, metrics gathering, checkpoints) and the
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
#include "hp/pipeline/data_parallel.h"
#include "hp/pipeline/executor.h"
#include "hp/pipeline/stage.h"
#include "hp/recompute/checkpoint.h"
#include "hp/recompute/session.h"
#include "hp/schedule/cost_file.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/progress.h"
#include "hp/schedule/render.h"
#include "hp/train/checkpoint.h"
#include "hp/train/progress.h"
#include "hp/train/report.h"

namespace hp::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string c10_message(const c10::Error& e) {
  return e.what_without_backtrace();
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c,
                                                        std::vector<torch::Tensor> params) {
  if (c.optimizer == "sgd")
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(c.lr).weight_decay(c.weight_decay));
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(c.lr).weight_decay(c.weight_decay));
}

// Every model-wide parameter name of every chunk, and which ranks hold it.
std::map<std::string, std::set<int>> holders(const TrainConfig& c, const schedule::Schedule& s) {
  std::map<int, std::vector<std::string>> names_of_chunk;
  for (int chunk = 0; chunk < s.num_chunks; ++chunk)
    for (const auto& item :
         models::build_chunk(c.model, chunk, s.num_chunks, c.seed)->named_parameters())
      names_of_chunk[chunk].push_back(item.key());
  std::map<std::string, std::set<int>> out;
  for (int st = 0; st < s.num_stages; ++st)
    for (const auto& n : names_of_chunk[s.stage_chunk[st]])
      out[n].insert(s.stage_rank[st]);
  return out;
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

// Replicas (DualPipe copies, a tied head): every copy's gradient becomes the
// sum over all copies, added in rank order so the copies get the same bits
// and stay identical (distributed::sum_among_holders).
void sum_replica_gradients(int rank, distributed::Comm& comm,
                           const std::map<std::string, std::set<int>>& holders,
                           std::map<std::string, std::vector<torch::Tensor>>& local_by_name) {
  std::vector<std::string> names;
  std::vector<torch::Tensor> sums;
  std::vector<std::vector<int>> holder_lists;
  for (const auto& [name, ranks] : holders) {
    auto local = local_by_name.find(name);
    if (local == local_by_name.end()) continue;
    auto& copies = local->second;
    if (copies.size() == 1 && ranks.size() == 1) continue;
    torch::Tensor sum = copies[0].grad().clone();
    for (size_t k = 1; k < copies.size(); ++k)
      sum += copies[k].grad();
    names.push_back(name);
    sums.push_back(sum);
    holder_lists.emplace_back(ranks.begin(), ranks.end());
  }
  distributed::sum_among_holders(comm, sums, holder_lists);
  for (size_t i = 0; i < names.size(); ++i)
    for (auto& t : local_by_name.at(names[i]))
      t.mutable_grad() = sums[i].clone();
}

// NOTE [Recompute in the pipeline]
// With --recompute every gpt block is checkpointed. A (stage, microbatch)
// gets a recompute session that retains the recomputed blocks from its I to
// its W: F collects one handle per block; before the executor waits for the
// output gradient, the last block (the first one backward needs) is
// recomputed (prefetch), so that recompute overlaps the wait; the other
// blocks recompute when backward reaches them, one at a time. I and W consume
// them; the session is cleared after W (or B). A fused B does not retain: a
// block's recomputed activations are freed as soon as its backward is done.
// So each block runs one extra forward per microbatch, never two, and at most
// one block's recomputed activations (plus what W keeps) are alive at once;
// prefetching every block had kept them all alive together (1F1B's peak was
// 58 % of the run without recompute instead of under half).
pipeline::StageHooks recompute_hooks() {
  using Handles = std::vector<recompute::RecomputeHandle>;
  auto handles = std::make_shared<std::map<std::pair<int, int>, Handles>>();
  auto id = [](int st, int mb) {
    return (static_cast<uint64_t>(st) << 32) | static_cast<uint32_t>(mb);
  };
  const auto opts = recompute::SessionOptions().retain_on_unpack(true);
  pipeline::StageHooks h;
  h.around_forward = [handles](int st, int mb, const std::function<torch::Tensor()>& run) {
    recompute::HandleCollector collector;
    torch::Tensor out = run();
    (*handles)[{st, mb}] = collector.take();
    return out;
  };
  h.before_backward = [handles, id, opts](int st, int mb) {
    auto it = handles->find({st, mb});
    if (it == handles->end() || it->second.empty()) return;
    recompute::RecomputeSession session(id(st, mb), opts);
    recompute::prefetch({it->second.back()});
  };
  h.around_backward = [id, opts](int st, int mb, char kind, const std::function<void()>& run) {
    recompute::RecomputeSession session(
        id(st, mb), kind == 'B' ? recompute::SessionOptions() : opts);  // B: nothing after it
    run();
  };
  h.on_done = [handles, id](int st, int mb) {
    recompute::clear_session(id(st, mb));
    handles->erase({st, mb});
  };
  return h;
}

// NOTE [Bounds of a run]
// Every size is checked before any work starts, against what it costs:
// * ranks: at most kMaxRanks (hp launch's limit), and on one machine as
//   many as its memory holds: a rank of the pip target is the hp binary,
//   LibTorch and an embedded Python with torch imported, about 265 MiB of
//   private memory measured (kRankStartupBytes), before its model;
// * the schedule: NOTE [One size rule] in hp/schedule/schedule.h, checked
//   before it is built (ranks x microbatches^2; chunks only add to it) and
//   as built;
// * memory: check_memory refuses a run whose lower bound (start-up, the
//   parameters with their gradients and optimizer state, one microbatch's
//   activations) exceeds the memory this machine has available;
// * data: at most models::kMaxCorpusBytes of regular files.
constexpr int kMaxRanks = 4096;
constexpr double kRankStartupBytes = 256.0 * (1 << 20);

// Available memory in bytes (MemAvailable, capped by a cgroup v2 limit), or
// a negative number when unknown.
double available_memory_bytes() {
  double avail = -1;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kb = 0;
  std::string unit;
  while (meminfo >> key >> kb >> unit)
    if (key == "MemAvailable:") avail = kb * 1024;
  std::ifstream max_file("/sys/fs/cgroup/memory.max"), cur_file("/sys/fs/cgroup/memory.current");
  std::string max_text;
  double current = 0;
  if (max_file >> max_text && max_text != "max" && cur_file >> current) {
    const double left = std::strtod(max_text.c_str(), nullptr) - current;
    if (avail < 0 || left < avail) avail = std::max(0.0, left);
  }
  return avail;
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / double(1 << 30));
  return buf;
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
    const torch::TensorOptions& act_options, bool recompute, double loss_scale) {
  std::vector<double> out(kStageMemFields * sched.num_stages, 0.0);
  StepCacheScope scope;  // as the executor's steps run (the tracker counts requested bytes)
  pipeline::PipelineStage stage(modules, loss_fn,
                                recompute ? recompute_hooks() : pipeline::StageHooks{}, loss_scale);
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

void TrainConfig::check_memory(int local_ranks) const {
  const auto& m = model;
  const double d = double(m.d_model), L = double(m.layers),
               bytes = m.dtype == torch::kFloat64 ? 8 : 4;
  double params = 0, activations = 0;
  if (m.kind == "gpt") {
    const double T = double(m.seq_len), V = double(m.vocab), H = double(m.heads);
    params = L * (12 * d * d + 13 * d) + (V + T) * d + 2 * d + (m.tied_head ? 0 : V * d);
    // Saved for backward per block: about 16 d values per token and the
    // attention scores; the logits and their softmax at the end.
    activations = double(microbatch_size) * T * (L * (16 * d + 2 * H * T) + 2 * V);
  } else {
    const double in = double(m.in_features);
    params = 2 * in * d + d + in + (L - 1) * (d * d + d);
    activations = double(microbatch_size) * (2 * L * d + 2 * in);
  }
  const double state = params * bytes * (optimizer == "adamw" ? 4 : 2);  // + grads (+ moments)
  // Graph mode builds the whole model on every rank; the pipeline splits it.
  const double share = graph ? double(local_ranks) : double(local_ranks) / double(nproc);
  const double startup = local_ranks * kRankStartupBytes;
  const double need = startup + share * (state + activations * bytes);
  const double avail = available_memory_bytes();
  if (avail < 0 || need <= avail) return;
  char count[32];
  std::snprintf(count, sizeof count, "%.3g", params);
  throw std::invalid_argument(
      "this run needs at least " + gib(need) + " of memory on this machine but " + gib(avail) +
      " is available: " + std::to_string(local_ranks) + " rank processes take " + gib(startup) +
      " to start (about 256 MiB each), the " + std::string(count) + " parameters with their " +
      "gradients and " + optimizer + " state " + gib(share * state) +
      ", one microbatch's activations " + gib(share * activations * bytes) +
      "; use fewer ranks, a smaller model or --microbatch-size");
}

distributed::PointToPoint TrainConfig::point_to_point() const {
  return p2p == "gloo"  ? distributed::PointToPoint::Group
         : p2p == "shm" ? distributed::PointToPoint::SharedMemory
                        : distributed::PointToPoint::Auto;
}

void TrainConfig::validate() const {
  try {
    model.check();
  } catch (const c10::Error& e) {
    throw std::invalid_argument(c10_message(e));
  }
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  need(p2p == "gloo" || p2p == "shm" || p2p == "auto",
       "--p2p must be gloo, shm or auto, not '" + p2p + "'");
  need(p2p != "shm" || device == "cpu",
       "--p2p shm moves CPU tensors between the ranks of one host; with --device " + device +
           " use --p2p auto (the rings where the ranks are on the CPU) or gloo");
  need(receive_lookahead >= 0, "--receive-lookahead " + std::to_string(receive_lookahead) +
                                   " is out of range: a number of batches (0: none ahead)");
  need(nproc >= 1 && nproc <= kMaxRanks, "--nproc " + std::to_string(nproc) +
                                             " is out of range: 1 to " + std::to_string(kMaxRanks) +
                                             " ranks (each rank is a process)");
  need(dp >= 1 && double(dp) * nproc <= kMaxRanks,
       "--dp " + std::to_string(dp) + " is out of range: at least 1, and --pp x --dp (" +
           std::to_string(double(dp) * nproc) + ") at most " + std::to_string(kMaxRanks) +
           " processes");
  need(microbatches >= 1, "--microbatches must be at least 1");
  need(microbatch_size >= 1, "--microbatch-size must be at least 1");
  need(steps >= 1, "--steps must be at least 1");
  need(optimizer == "adamw" || optimizer == "sgd",
       "unknown optimizer '" + optimizer + "'; use adamw or sgd");
  need(std::isfinite(lr) && lr > 0,
       "--lr must be a finite positive number, not " + std::to_string(lr));
  need(std::isfinite(weight_decay) && weight_decay >= 0,
       "--weight-decay must be a finite number >= 0, not " + std::to_string(weight_decay));
  need(timeout_s >= 1 && timeout_s <= 7 * 24 * 3600,
       "--timeout must be 1 to 604800 seconds (a week), not " + std::to_string(timeout_s));
  need(save_every >= 0,
       "--save-every must be at least 1 (or 0 for never), not " + std::to_string(save_every));
  need(!(resume && resume_or_start), "--resume and --resume-or-start exclude each other; pick one");
  need(device == "cpu" || device == "cuda" || device == "auto",
       "--device must be cpu, cuda or auto, not '" + device + "'");
  if (device == "cuda") resolve_device(0);  // throws when there is no CUDA device
  need(!graph || resolve_device(0).is_cpu(),
       "--graph runs on the CPU only; drop --device " + device + " or --graph");
  const bool checkpoints = save_every > 0 || resume || resume_or_start;
  need(!checkpoints || !checkpoint_dir.empty(),
       "--save-every, --resume and --resume-or-start need --checkpoint-dir");
  if (model.kind == "gpt") {
    try {
      models::check_corpus(data, model.seq_len);
    } catch (const c10::Error& e) {
      throw std::invalid_argument(c10_message(e));
    }
  }
  // Output paths, before any work (nothing learned is lost at the end).
  check_output_file(report, "--report");
  check_output_file(trace, "--trace");
  if (!trace.empty()) check_output_file(trace + ".svg", "--trace");
  if (checkpoints) check_output_dir(checkpoint_dir, "--checkpoint-dir");
  need(dp == 1 || !checkpoints,
       "--dp does not save checkpoints yet; drop --save-every/--resume or --dp");
  if (graph) {
    need(dp == 1,
         "--graph is data parallel over all its ranks already (with FSDP); drop --dp "
         "and give the processes as --nproc");
    need(microbatches % nproc == 0,
         "--graph gives every rank the same number of microbatches: --microbatches " +
             std::to_string(microbatches) + " does not divide by --nproc " + std::to_string(nproc) +
             "; use a multiple of it");
    need(!checkpoints,
         "--graph does not save checkpoints yet; drop --save-every/--resume or run without "
         "--graph");
    return;
  }
  schedule::Schedule s = build_schedule();
  need(s.num_chunks <= model.cuttable_layers(),
       "schedule '" + schedule + "' cuts the model into " + std::to_string(s.num_chunks) +
           " chunks but the " + model.kind + " has only " +
           std::to_string(model.cuttable_layers()) +
           " cuttable layers; use more --layers, fewer --nproc or fewer --chunks");
}

// NOTE [Ranks on devices]
// With --device cuda the rank of local rank r computes on GPU r mod the
// number of GPUs: its chunks, receive buffers, loss and optimizer state live
// there, and its inputs and targets are moved there per microbatch (the data
// is drawn on the CPU, so every device trains on the same numbers). The ranks
// talk over our Gloo group: between GPUs of one host NCCL would be faster,
// but hp train makes no NCCL group yet (the Python runtime uses whatever
// group the user made, NCCL included); over Gloo every CUDA tensor is staged
// through host memory (with_host_staging), which is also the only way for
// ranks that share a GPU, as on a machine with one. "auto" is cuda when
// LibTorch sees a GPU, else the CPU; "cuda" without one is an error that
// says so.
torch::Device TrainConfig::resolve_device(int local_rank) const {
  if (device == "cpu") return torch::kCPU;
  const bool cuda = torch::cuda::is_available();
  if (device == "auto" && !cuda) return torch::kCPU;
  if (!cuda)
    throw std::invalid_argument(
        "--device cuda: no CUDA device (this LibTorch sees none: no GPU, no driver, or a "
        "build without CUDA); use --device cpu, or auto to take a GPU when there is one");
  const int count = static_cast<int>(torch::cuda::device_count());
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % count));
}

schedule::Schedule TrainConfig::build_schedule() const {
  if (!schedule_file.empty()) {
    // A schedule someone made (hp schedule tune): read strictly, checked
    // against this run, lowered when it is not yet.
    schedule::Schedule s =
        schedule::from_csv(schedule::read_input_file(schedule_file), schedule_file);
    if (s.num_ranks != nproc || s.num_microbatches != microbatches)
      throw std::invalid_argument(
          "--schedule-file '" + schedule_file + "' is for " + std::to_string(s.num_ranks) +
          " ranks and " + std::to_string(s.num_microbatches) +
          " microbatches, but this run has --nproc " + std::to_string(nproc) +
          " and --microbatches " + std::to_string(microbatches) + "; give the same numbers");
    if (!s.lowered) s = schedule::lower(s);
    schedule::validate(s);
    return s;
  }
  // NOTE [Bounds of a run]: the schedule's size (NOTE [One size rule] in
  // hp/schedule/schedule.h), before it is built and again as built.
  const std::string what = "schedule '" + schedule + "'";
  // Only the interleaved schedules take --chunks; the others fix their own.
  const int v = schedule.rfind("interleaved", 0) == 0 ? std::max(1, chunks) : 1;
  schedule::check_schedule_size(what, nproc, microbatches, v);
  schedule::BuildOptions opts;
  opts.chunks = chunks;
  schedule::Schedule built = schedule::build(schedule, nproc, microbatches, opts);
  schedule::check_schedule_size(what, nproc, microbatches,
                                double(built.num_stages) / double(nproc));
  schedule::Schedule s = schedule::lower(built);
  schedule::validate(s);
  return s;
}

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
  if (config.dp > 1) {
    distributed::DeviceMesh mesh(world,
                                 distributed::MeshShape{{"dp", "pp"}, {config.dp, config.nproc}});
    comm = mesh.group("pp");
    dp_comm = mesh.group("dp");
    replica = mesh.coordinate("dp");
  }
  const int rank = comm->rank();
  install_memory_tracker();
  const schedule::Schedule sched = config.build_schedule();
  const int m = config.microbatches;
  const char* local_env = std::getenv("LOCAL_RANK");
  const torch::Device device =
      config.resolve_device(local_env != nullptr ? std::atoi(local_env) : rank);
  // --p2p (NOTE [Choosing the point-to-point]): rings only between the
  // ranks the schedule's transfers join; nothing else sends over this group,
  // so messages too large for a ring use its own point-to-point.
  std::string p2p_note;
  {
    distributed::SharedMemoryOptions shm;
    shm.overflow_on_inner = true;
    shm.links = sched.rank_links();
    shm.device = device;
    comm = distributed::with_point_to_point(comm, config.point_to_point(), shm, &p2p_note);
  }
  if (!p2p_note.empty() && rank == 0 && replica == 0)
    std::fprintf(stderr, "hp train: --p2p auto uses Gloo's point-to-point: %s\n", p2p_note.c_str());
  const std::string p2p_backend = comm->backend_name();
  c10::OptionalDeviceGuard on_device;
  if (!device.is_cpu()) {
    on_device.reset_device(device);
    // NOTE [Ranks on devices]: CUDA tensors over a CPU backend go through host memory.
    comm = distributed::for_device(comm, device);
    if (dp_comm) dp_comm = distributed::for_device(dp_comm, device);
  }

  // Model chunks of this rank's stages, data, loss.
  std::map<int, std::shared_ptr<models::Chunk>> chunks;
  std::map<int, pipeline::StageModule> modules;
  for (int st : sched.stages_of_rank(rank)) {
    auto chunk =
        models::build_chunk(config.model, sched.stage_chunk[st], sched.num_chunks, config.seed);
    chunk->to(device);  // initialised on the CPU: the same values on every device
    chunks[st] = chunk;
    pipeline::StageModule mod;
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
    mod.parameters = chunk->parameters();
    modules[st] = std::move(mod);
  }
  models::Dataset data(config.model, config.data, config.microbatch_size, config.seed);
  int step = 0;
  const int first_mb = replica * m;  // this copy's microbatches of the global batch
  auto loss_fn = [&](const torch::Tensor& out, int mb) {
    return models::loss(config.model, out, data.get(step, first_mb + mb).target.to(device));
  };
  pipeline::StageHooks hooks = config.recompute ? recompute_hooks() : pipeline::StageHooks{};
  std::unique_ptr<pipeline::GradientReducer> reducer;
  if (dp_comm) {
    std::map<int, std::vector<torch::Tensor>> stage_params;
    for (const auto& [st, mod] : modules)
      stage_params[st] = mod.parameters;
    reducer = std::make_unique<pipeline::GradientReducer>(
        dp_comm, stage_params, pipeline::microbatches_per_stage(sched, rank));
    hooks.on_done = [r = reducer.get(), then = hooks.on_done](int st, int mb) {
      if (then) then(st, mb);
      r->on_done(st, mb);
    };
  }
  // Each microbatch's loss counts 1/m: the step's loss is their mean (NOTE
  // [The loss scale is the backward's seed] in hp/pipeline/stage.cpp).
  pipeline::PipelineStage stage(modules, loss_fn, hooks, 1.0 / m);
  pipeline::ExecutorOptions eopts;
  eopts.input = [&](int mb) { return data.get(step, first_mb + mb).input.to(device); };
  eopts.activation_shape = [&](int, int) {
    return models::activation_shape(config.model, config.microbatch_size);
  };
  eopts.dtype = config.model.dtype;
  eopts.device = device;
  eopts.receive_lookahead = config.receive_lookahead;
  eopts.cache_cpu_memory = true;  // the CPU's caching allocator (CUDA has its own)
  pipeline::Executor executor(sched, rank, stage, comm, eopts);

  // Parameters: this rank's tensors, and the replicas to sum across stages.
  std::vector<torch::Tensor> params;
  std::map<std::string, std::vector<torch::Tensor>> local_by_name;
  for (auto& [st, chunk] : chunks)
    for (const auto& item : chunk->named_parameters()) {
      params.push_back(item.value());
      local_by_name[item.key()].push_back(item.value());
    }
  auto all_holders = holders(config, sched);
  auto optimizer = make_optimizer(config, params);

  TrainResult result;
  result.items_per_step = data.items_per_microbatch() * m * config.dp;  // all copies
  result.p2p_backend = p2p_backend;
  result.p2p_note = p2p_note;
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
    auto probe = torch::zeros(models::activation_shape(config.model, config.microbatch_size),
                              torch::TensorOptions().dtype(config.model.dtype).device(device));
    comm_cost = distributed::one_way_latency(*comm, 0, 1, probe);
  }

  // NOTE [Memory measured against predicted]: every stage's mem_b and mem_w in bytes.
  std::vector<double> stage_bytes;
  // Not with --recompute: its hooks count every recompute of the run, and
  // what a checkpointed stage holds is another model (left out).
  if (device.is_cpu() && memory_tracker_installed() && !config.recompute) {
    stage_bytes = measure_activation_bytes(
        sched, rank, modules, loss_fn, eopts.input,
        models::activation_shape(config.model, config.microbatch_size),
        torch::TensorOptions().dtype(config.model.dtype).device(device), config.recompute, 1.0 / m);
    auto all_bytes = torch::tensor(stage_bytes, torch::kFloat64);
    comm->all_reduce(all_bytes);  // each stage lives on one rank of the pipeline
    stage_bytes.assign(all_bytes.data_ptr<double>(),
                       all_bytes.data_ptr<double>() + all_bytes.numel());
  }

  Progress progress(config.progress && rank == 0 && replica == 0, first, config.steps);
  pipeline::StepStats last;
  int64_t peak_bytes = 0;
  for (step = first; step < config.steps; ++step) {
    launch::fault_point(std::to_string(step));  // NOTE [Fault injection]
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
    if (reducer) reducer->begin_step();
    last = executor.run_step();
    if (reducer) reducer->finish_step();
    // Activation memory: the step's peak above its start (the weight
    // gradients were allocated before it).
    peak_bytes = std::max(peak_bytes, std::max<int64_t>(0, peak_memory_allocated() - base));

    sum_replica_gradients(rank, *comm, all_holders, local_by_name);
    optimizer->step();

    auto loss = torch::tensor({last.loss_sum}, torch::kFloat64);
    comm->all_reduce(loss);
    if (dp_comm) dp_comm->all_reduce(loss, distributed::ReduceOp::Avg);
    double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    result.losses.push_back(loss.item<double>());
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

  result.executed = last.executed;

  // Final parameters and a checksum that counts each model-wide name once.
  double own_sum = 0.0;
  for (auto& [name, tensors] : local_by_name) {
    result.parameters[name] = tensors[0].detach().to(torch::kCPU, /*non_blocking=*/false,
                                                     /*copy=*/true);
    if (*all_holders.at(name).begin() == rank)
      own_sum += tensors[0].detach().to(torch::kFloat64).sum().item<double>();
  }
  auto cs = torch::tensor({own_sum}, torch::kFloat64);
  comm->all_reduce(cs);
  result.checksum = cs.item<double>();

  // Gather the last step's measurements and timeline on rank 0.
  auto mine = torch::tensor({last.compute, last.comm_wait, last.overhead, double(peak_bytes)},
                            torch::kFloat64);
  std::vector<torch::Tensor> all(comm->world_size());
  for (auto& t : all)
    t = torch::empty_like(mine);
  comm->all_gather(all, mine);
  auto events = distributed::gather_rows(*comm, pack_events(last.events), 0);
  if (rank != 0 || replica != 0) return result;  // copy 0's rank 0 reports
  for (auto& t : all) {
    result.rank_compute.push_back(t[0].item<double>());
    result.rank_comm_wait.push_back(t[1].item<double>());
    result.rank_overhead.push_back(t[2].item<double>());
    result.rank_peak_bytes.push_back(t[3].item<double>());
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
