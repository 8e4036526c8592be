// run_rank and train_reference: the training loop around the Executor
// (replica gradient sums, optimizer, metrics gathering, checkpoints) and the
// single-process oracle it must equal.
#include "hp/train/trainer.h"

#include <unistd.h>

#include <csignal>
#include <cstdlib>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "hp/core/memory.h"
#include "hp/distributed/collectives.h"
#include "hp/models/data.h"
#include "hp/pipeline/executor.h"
#include "hp/pipeline/stage.h"
#include "hp/recompute/checkpoint.h"
#include "hp/recompute/session.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/render.h"
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

std::string archive_key(const std::string& name) {
  std::string k = "p_";
  for (char ch : name)
    k += ch == '.' ? '_' : ch;  // archive keys may not hold '.'
  return k;
}

fs::path step_dir(const TrainConfig& c, int step) {
  return fs::path(c.checkpoint_dir) / ("step-" + std::to_string(step));
}

// Last step with a complete checkpoint (every rank's file and the marker), or 0.
int latest_checkpoint(const TrainConfig& c) {
  std::ifstream in(fs::path(c.checkpoint_dir) / "latest");
  int step = 0;
  if (!(in >> step)) return 0;
  return fs::exists(step_dir(c, step) / "COMPLETE") ? step : 0;
}

void write_atomically(const fs::path& path, const std::function<void(const std::string&)>& write) {
  fs::path tmp = path;
  tmp += ".tmp." + std::to_string(::getpid());
  write(tmp.string());
  fs::rename(tmp, path);
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

// Per-stage F, I, W costs measured from a timeline (B and FB split evenly
// where I and W were never measured apart), for the simulator.
schedule::CostModel measured_costs(const schedule::Schedule& s,
                                   const std::vector<schedule::Event>& events, double comm) {
  const int S = s.num_stages;
  std::vector<double> f(S, 0), i(S, 0), w(S, 0), b(S, 0);
  std::vector<int> nf(S, 0), ni(S, 0), nw(S, 0), nb(S, 0);
  for (const auto& e : events) {
    double d = e.end - e.start;
    int st = e.action.stage;
    switch (e.action.op) {
      case schedule::Op::F:
        f[st] += d, nf[st]++;
        break;
      case schedule::Op::I:
        i[st] += d, ni[st]++;
        break;
      case schedule::Op::W:
        w[st] += d, nw[st]++;
        break;
      case schedule::Op::B:
        b[st] += d, nb[st]++;
        break;
      case schedule::Op::FB:  // F beside B: one third F, two thirds B
        f[st] += d / 3, nf[st]++;
        b[e.action.stage2] += 2 * d / 3, nb[e.action.stage2]++;
        break;
      default:
        break;
    }
  }
  schedule::CostModel c;
  c.comm = comm;
  c.stage_f.resize(S), c.stage_b.resize(S), c.stage_w.resize(S);
  for (int st = 0; st < S; ++st) {
    double favg = nf[st] ? f[st] / nf[st] : 1e-6;
    double iavg = ni[st] ? i[st] / ni[st] : 0, wavg = nw[st] ? w[st] / nw[st] : 0;
    double bavg = nb[st] ? b[st] / nb[st] : iavg + wavg;
    if (!ni[st] || !nw[st]) iavg = wavg = bavg / 2;
    c.stage_f[st] = std::max(favg, 1e-9);
    c.stage_b[st] = std::max(iavg, 1e-9);
    c.stage_w[st] = std::max(wavg, 1e-9);
  }
  return c;
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

// NOTE [Fault injection]
// HP_FAULT_KILL=RANK:STEP makes that rank kill itself (SIGKILL) when it starts
// that step: the end-to-end tests use it to check that the other ranks fail
// fast, naming the lost peer, and that the launcher says which rank died.
std::pair<int, int> fault_injection() {
  const char* env = std::getenv("HP_FAULT_KILL");
  int r = -1, s = -1;
  if (env && std::sscanf(env, "%d:%d", &r, &s) != 2) r = s = -1;
  return {r, s};
}

}  // namespace

void TrainConfig::validate() const {
  try {
    model.check();
  } catch (const c10::Error& e) {
    throw std::invalid_argument(c10_message(e));
  }
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  need(nproc >= 1, "--nproc must be at least 1");
  need(microbatches >= 1, "--microbatches must be at least 1");
  need(microbatch_size >= 1, "--microbatch-size must be at least 1");
  need(steps >= 1, "--steps must be at least 1");
  need(optimizer == "adamw" || optimizer == "sgd",
       "unknown optimizer '" + optimizer + "'; use adamw or sgd");
  need(lr > 0, "--lr must be positive");
  need(timeout_s >= 1, "--timeout must be at least 1 second");
  need(!(save_every > 0 || resume) || !checkpoint_dir.empty(),
       "--save-every and --resume need --checkpoint-dir");
  if (model.kind == "gpt" && !data.empty())
    need(fs::exists(data), "data path '" + data + "' does not exist");
  if (model.kind == "gpt" && data.empty())
    need(fs::exists(models::kDefaultCorpusDir), std::string("the default corpus ") +
                                                    models::kDefaultCorpusDir +
                                                    " is missing; pass a text file with --data");
  if (graph) {
    need(microbatches % nproc == 0,
         "--graph gives every rank the same number of microbatches: --microbatches " +
             std::to_string(microbatches) + " does not divide by --nproc " + std::to_string(nproc) +
             "; use a multiple of it");
    need(!recompute, "--graph does not checkpoint blocks; drop --recompute");
    need(save_every == 0 && !resume,
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

schedule::Schedule TrainConfig::build_schedule() const {
  schedule::BuildOptions opts;
  opts.chunks = chunks;
  schedule::Schedule s = schedule::lower(schedule::build(schedule, nproc, microbatches, opts));
  schedule::validate(s);
  return s;
}

TrainResult run_rank(const TrainConfig& config, std::shared_ptr<distributed::Comm> comm) {
  config.validate();
  const int rank = comm->rank();
  TORCH_CHECK(comm->world_size() == config.nproc, "the Comm has ", comm->world_size(),
              " ranks but the config asks for --nproc ", config.nproc);
  install_memory_tracker();
  const schedule::Schedule sched = config.build_schedule();
  const int m = config.microbatches;

  // Model chunks of this rank's stages, data, loss.
  std::map<int, std::shared_ptr<models::Chunk>> chunks;
  std::map<int, pipeline::StageModule> modules;
  for (int st : sched.stages_of_rank(rank)) {
    auto chunk =
        models::build_chunk(config.model, sched.stage_chunk[st], sched.num_chunks, config.seed);
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
  auto loss_fn = [&](const torch::Tensor& out, int mb) {
    return models::loss(config.model, out, data.get(step, mb).target) / m;
  };
  pipeline::PipelineStage stage(modules, loss_fn,
                                config.recompute ? recompute_hooks() : pipeline::StageHooks{});
  pipeline::ExecutorOptions eopts;
  eopts.input = [&](int mb) { return data.get(step, mb).input; };
  eopts.activation_shape = [&](int, int) {
    return models::activation_shape(config.model, config.microbatch_size);
  };
  eopts.dtype = config.model.dtype;
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
  int64_t grad_bytes = 0;
  for (const auto& p : params)
    grad_bytes += p.numel() * static_cast<int64_t>(p.element_size());
  auto optimizer = make_optimizer(config, params);

  TrainResult result;
  result.items_per_step = data.items_per_microbatch() * m;
  int first = 0;
  if (config.resume && (first = latest_checkpoint(config)) > 0) {
    torch::serialize::InputArchive ar;
    ar.load_from((step_dir(config, first) / ("rank-" + std::to_string(rank) + ".pt")).string());
    torch::NoGradGuard g;
    for (auto& [name, tensors] : local_by_name) {
      torch::Tensor saved;
      ar.read(archive_key(name), saved);
      for (auto& t : tensors)
        t.copy_(saved);
    }
    torch::serialize::InputArchive opt;
    ar.read("optimizer", opt);
    optimizer->load(opt);
  }
  result.first_step = first;

  // Round trips of an activation between ranks 0 and 1 estimate the
  // communication cost: half the median round trip (the first connects).
  double comm_cost = 0.0;
  if (config.nproc > 1) {
    auto probe = torch::zeros(models::activation_shape(config.model, config.microbatch_size),
                              config.model.dtype);
    comm_cost = distributed::one_way_latency(*comm, 0, 1, probe);
  }

  Progress progress(config.progress && rank == 0, first, config.steps);
  pipeline::StepStats last;
  int64_t peak_bytes = 0;
  const auto fault = fault_injection();
  for (step = first; step < config.steps; ++step) {
    if (fault.first == rank && fault.second == step) ::raise(SIGKILL);
    for (auto& p : params)
      p.mutable_grad() = torch::Tensor();
    comm->barrier();  // aligns the ranks' clocks for the timeline
    const int64_t base = memory_allocated();
    reset_peak_memory();
    auto t0 = Clock::now();
    last = executor.run_step();
    // Activation memory: the step's peak above its start, less the weight
    // gradients the step allocates (they are not activations).
    peak_bytes =
        std::max(peak_bytes, std::max<int64_t>(0, peak_memory_allocated() - base - grad_bytes));

    sum_replica_gradients(rank, *comm, all_holders, local_by_name);
    optimizer->step();

    auto loss = torch::tensor({last.loss_sum}, torch::kFloat64);
    comm->all_reduce(loss);
    double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    result.losses.push_back(loss.item<double>());
    result.step_seconds.push_back(secs);
    progress.update(step, result.losses.back(), result.items_per_step / secs);

    if (config.save_every > 0 &&
        ((step + 1) % config.save_every == 0 || step + 1 == config.steps)) {
      fs::create_directories(step_dir(config, step + 1));
      write_atomically(step_dir(config, step + 1) / ("rank-" + std::to_string(rank) + ".pt"),
                       [&](const std::string& path) {
                         torch::serialize::OutputArchive ar;
                         for (auto& [name, tensors] : local_by_name)
                           ar.write(archive_key(name), tensors[0].detach());
                         torch::serialize::OutputArchive opt;
                         optimizer->save(opt);
                         ar.write("optimizer", opt);
                         ar.save_to(path);
                       });
      comm->barrier();
      if (rank == 0) {
        write_atomically(step_dir(config, step + 1) / "COMPLETE",
                         [](const std::string& p) { std::ofstream(p) << "ok\n"; });
        write_atomically(fs::path(config.checkpoint_dir) / "latest",
                         [&](const std::string& p) { std::ofstream(p) << step + 1 << "\n"; });
      }
    }
  }

  result.executed = last.executed;

  // Final parameters and a checksum that counts each model-wide name once.
  double own_sum = 0.0;
  for (auto& [name, tensors] : local_by_name) {
    result.parameters[name] = tensors[0].detach().clone();
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
  if (rank != 0) return result;
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
  auto sim = schedule::simulate(sched, measured_costs(sched, result.timeline.events, comm_cost));
  result.simulated_bubble = sim.bubble_rate;
  result.simulated_makespan = sim.makespan;

  if (!config.trace.empty()) {
    // The renderers read one time unit as one millisecond.
    schedule::Timeline ms = result.timeline;
    for (auto& e : ms.events)
      e.start *= 1e3, e.end *= 1e3;
    std::ofstream(config.trace) << schedule::render_chrome_trace(ms);
    std::ofstream(config.trace + ".svg") << schedule::render_svg(ms);
  }
  if (!config.report.empty()) write_report(config, result, config.report);
  return result;
}

TrainResult train_reference(const TrainConfig& config) {
  config.model.check();
  auto model = models::build_chunk(config.model, 0, 1, config.seed);
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
      auto loss = models::loss(config.model, model->forward(batch.input), batch.target) /
                  config.microbatches;
      loss.backward();
      loss_sum += loss.item<double>();
    }
    optimizer->step();
    result.losses.push_back(loss_sum);
  }
  double sum = 0.0;
  for (const auto& item : model->named_parameters()) {
    result.parameters[item.key()] = item.value().detach().clone();
    sum += item.value().detach().to(torch::kFloat64).sum().item<double>();
  }
  result.checksum = sum;
  return result;
}

}  // namespace hp::train
