// TrainConfig's checks (ranges, memory, outputs, the schedule's size) and
// what it resolves to: the device of a rank, the lowered schedule.
#include "hp/train/config.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>

#include "hp/distributed/comm.h"
#include "hp/distributed/mesh.h"
#include "hp/models/data.h"
#include "hp/schedule/cost_file.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/simulate.h"
#include "hp/train/checkpoint.h"

namespace hp::train {
namespace {

std::string c10_message(const c10::Error& e) {
  return e.what_without_backtrace();
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

}  // namespace

void TrainConfig::check_memory(int local_ranks) const {
  const auto& m = model;
  const double d = double(m.d_model), L = double(m.layers),
               bytes = m.dtype == torch::kFloat64 ? 8 : 4;
  double params = 0, activations = 0;
  if (m.kind == "gpt") {
    const double T = double(m.seq_len), V = double(m.vocab), H = double(m.heads);
    // A MoE layer holds `experts` MLPs, this rank's share of them under --ep.
    const double mlps = m.experts > 0 ? double(m.experts) / double(ep) : 1.0;
    params =
        L * ((4 + 8 * mlps) * d * d + 13 * d) + (V + T) * d + 2 * d + (m.tied_head ? 0 : V * d);
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

void TrainConfig::validate() const {
  try {
    model.check();
  } catch (const c10::Error& e) {
    throw std::invalid_argument(c10_message(e));
  }
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  need(p2p == "group" || p2p == "shm" || p2p == "auto",
       "--p2p must be group, shm or auto, not '" + p2p + "'");
  need(p2p != "shm" || device == "cpu",
       "--p2p shm moves CPU tensors between the ranks of one host; with --device " + device +
           " use --p2p auto (the rings where the ranks are on the CPU) or group");
  if (!link.empty()) {
    try {
      distributed::LinkModel::parse(link, "--link");
    } catch (const std::invalid_argument& e) {
      need(false, e.what());
    }
    need(device != "cuda", "--link models the network for CPU ranks; --device is " + device);
    need(p2p != "shm",
         "--link delays the group's point-to-point; --p2p shm would bypass it "
         "(use --p2p auto or group)");
  }
  need(pair_turns == "auto" || pair_turns == "ready" || pair_turns == "fixed",
       "--pair-turns '" + pair_turns + "' is not one of: auto, ready, fixed");
  // NOTE [Turns as messages arrive] in hp/pipeline/overlap.cpp
  need(!(pair_turns == "ready" && defer_wgrad && recompute),
       "--pair-turns ready with --defer-wgrad and --recompute: a first stage's deferred W "
       "recomputes its forward, expert exchanges included, wherever it runs, and could wait "
       "on peers that wait on this rank; use --pair-turns auto or fixed");
  need(!defer_wgrad || fb_overlap,
       "--defer-wgrad defers the W of overlapped pairs: give --fb-overlap too");
  need(defer_wgrad_gain >= -1.0 && defer_wgrad_gain <= 1.0,
       "defer_wgrad_gain " + std::to_string(defer_wgrad_gain) +
           " is out of range: a share of the step from -1 to 1");
  need(w_parts >= 1, "--w-parts " + std::to_string(w_parts) + " is out of range: 1 or more");
  need(w_parts == 1 || (defer_wgrad && pairs_take_ready_turns()),
       "--w-parts cuts the deferred W's that fill the waits of ready turns: give "
       "--defer-wgrad and --pair-turns ready too (CPU ranks)");
  need(receive_lookahead >= 0, "--receive-lookahead " + std::to_string(receive_lookahead) +
                                   " is out of range: a number of batches (0: none ahead)");
  need(nproc >= 1 && nproc <= kMaxRanks, "--nproc " + std::to_string(nproc) +
                                             " is out of range: 1 to " + std::to_string(kMaxRanks) +
                                             " ranks (each rank is a process)");
  need(dp >= 1 && double(dp) * nproc <= kMaxRanks,
       "--dp " + std::to_string(dp) + " is out of range: at least 1, and --pp x --dp (" +
           std::to_string(double(dp) * nproc) + ") at most " + std::to_string(kMaxRanks) +
           " processes");
  need(ep >= 1, "--ep must be at least 1, not " + std::to_string(ep));
  if (ep > 1) {
    need(model.experts > 0, "--ep spreads a MoE's experts over ranks: use --model moe");
    need(model.experts % ep == 0, "--experts " + std::to_string(model.experts) +
                                      " do not divide over --ep " + std::to_string(ep) +
                                      " ranks: use an --ep that divides the experts");
    try {  // NOTE [The training mesh] in hp/distributed/mesh.h
      distributed::training_mesh(nproc * dp, nproc, dp, ep);
    } catch (const std::invalid_argument& e) {
      need(false, std::string(e.what()) + " (--ep, --dp)");
    }
    need(!graph, "--graph does not run expert parallelism; drop --ep or --graph");
  }
  need(!model.documents || !graph,
       "--graph traces the gpt without documents; drop --documents or --graph");
  need(model.experts == 0 || !graph,
       "--graph runs the dense gpt only; drop --model moe or --graph");
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
  need(!fsdp || dp > 1,
       "--fsdp shards the stages over the data-parallel copies: give --dp 2 or more (with "
       "--dp 1 there is nothing to shard)");
  need(!fsdp || !graph,
       "--graph shards with its own FSDP pass already; drop --fsdp (or --graph for PP x FSDP)");
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

bool TrainConfig::pairs_take_ready_turns() const {
  // On a device the halves' waits only order their streams: the fixed order.
  return fb_overlap && resolve_device(0).is_cpu() &&
         schedule::pair_turns_ready(pair_turns, defer_wgrad);
}

schedule::Schedule TrainConfig::build_schedule() const {
  if (!schedule_file.empty()) {
    // A schedule someone made (hp schedule recommend -o): read strictly, checked
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

}  // namespace hp::train
