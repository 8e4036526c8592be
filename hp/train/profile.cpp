// Costs from the real device (see profile.h): measure_stage times F, I, W and
// a fused B with the pipeline's own step timer, profile_model measures the
// reference models' chunks and one transfer, and predict_schedules runs the
// simulator on what was measured.
#include "hp/train/profile.h"

#include <c10/core/DeviceGuard.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "hp/autograd/grad_function.h"
#include "hp/core/memory.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/comm.h"
#include "hp/pipeline/executor.h"
#include "hp/schedule/generators.h"
#include "hp/train/trainer.h"

namespace hp::train {
namespace {

double median(std::vector<double> v) {
  TORCH_INTERNAL_ASSERT(!v.empty());
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int64_t bytes_of(const torch::Tensor& t) {
  return t.defined() && t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
}

void clear_grads(const std::vector<torch::Tensor>& params) {
  for (auto p : params)
    p.mutable_grad() = torch::Tensor();
}

// One stage's inputs and what roots its backward, for chunk `index` of
// `chunks`: data for the first, random activations (and output gradients)
// elsewhere, random targets for the last.
StageSample sample_of(const ProfileConfig& c, std::shared_ptr<models::Chunk> chunk, int index,
                      int chunks, torch::Device device) {
  const auto& spec = c.model;
  const int64_t rows = c.microbatch_size;
  auto on = torch::TensorOptions().device(device);
  torch::manual_seed(static_cast<uint64_t>(c.seed) * 131 + index);
  StageSample s;
  s.module.forward = [chunk](const torch::Tensor& x) { return chunk->forward(x); };
  if (spec.documents && index > 0) {
    // One document per row (NOTE [Documents in the reference GPT]).
    auto documents = torch::zeros({rows, spec.seq_len}, on.dtype(torch::kLong));
    s.module.forward = [chunk, documents](const torch::Tensor& x) {
      return chunk->forward_message({x, documents})[0];
    };
  }
  s.module.parameters = chunk->parameters();
  const bool gpt = spec.kind == "gpt";
  if (index == 0) {
    s.input_needs_grad = false;
    s.input = gpt ? torch::randint(0, spec.vocab, {rows, spec.seq_len}, on.dtype(torch::kLong))
                  : torch::randn({rows, spec.in_features}, on.dtype(spec.dtype));
  } else {
    s.input = torch::randn(models::activation_shape(spec, rows), on.dtype(spec.dtype));
  }
  if (index == chunks - 1) {
    torch::Tensor target =
        gpt ? torch::randint(0, spec.vocab, {rows, spec.seq_len}, on.dtype(torch::kLong))
            : torch::randn({rows, spec.in_features}, on.dtype(spec.dtype));
    models::ModelSpec copy = spec;
    s.loss = [copy, target](const torch::Tensor& out) { return models::loss(copy, out, target); };
  } else {
    s.grad_output = torch::randn(models::activation_shape(spec, rows), on.dtype(spec.dtype));
  }
  return s;
}

// Half the median round trip of one activation between two threads of this
// process over Gloo (a FileStore rendezvous), staged through host memory when
// the activation lives on a device: the transport two ranks of one machine use.
double measure_transfer(const torch::Tensor& probe, std::chrono::milliseconds timeout) {
  static std::atomic<int> counter{0};
  const auto store =
      std::filesystem::temp_directory_path() /
      ("hp-profile-store-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  std::filesystem::remove_all(store);
  std::vector<double> one_way(2, 0.0);
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::optional<c10::OptionalDeviceGuard> guard;
        if (!probe.device().is_cpu()) guard.emplace(probe.device());
        distributed::CommOptions o;
        o.timeout = timeout;
        auto comm = distributed::Comm::from_file_store(store.string(), r, 2, o);
        comm = distributed::for_device(comm, probe.device());
        one_way[r] = distributed::one_way_latency(*comm, 0, 1, probe.clone());
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads)
    t.join();
  std::filesystem::remove_all(store);
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return one_way[0];
}

std::string ms(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", seconds * 1e3);
  return buf;
}

std::string mib(double bytes) {
  if (bytes < 0) return "n/a";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", bytes / (1 << 20));
  return buf;
}

std::string rate(double r) {
  if (r < 0) return "  -   ";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4f", r);
  return buf;
}

}  // namespace

StageCosts measure_stage(const StageSample& sample, const MeasureOptions& options) {
  TORCH_CHECK(sample.module.forward, "measure_stage: the stage has no forward function");
  TORCH_CHECK(sample.input.defined(), "measure_stage: the stage has no input");
  TORCH_CHECK(sample.loss || sample.grad_output.defined(),
              "measure_stage: give the last stage's loss, or the output gradient of another "
              "stage");
  TORCH_CHECK(options.repeats >= 1 && options.warmup >= 0,
              "measure_stage: repeats must be at least 1 and warmup at least 0");
  const torch::Device device = sample.input.device();
  c10::OptionalDeviceGuard on_device;
  if (!device.is_cpu()) on_device.reset_device(device);
  std::function<int64_t()> allocated = options.memory_allocated;
  if (!allocated && device.is_cpu() && memory_tracker_installed()) allocated = memory_allocated;
  if (!options.measure_memory) allocated = nullptr;
  auto timer = device.is_cpu() ? pipeline::make_host_timer() : pipeline::make_device_timer(device);
  const auto& params = sample.module.parameters;
  autograd::TensorList grads_out;
  if (!sample.loss) grads_out.push_back(sample.grad_output);

  std::vector<double> f, i, w, b;
  StageCosts costs;
  for (int run = 0; run < options.warmup + options.repeats; ++run) {
    clear_grads(params);
    timer->start();
    const int64_t before = allocated ? allocated() : 0;
    const int m0 = timer->mark();
    torch::Tensor x =
        sample.input_needs_grad ? sample.input.detach().requires_grad_(true) : sample.input;
    torch::Tensor out = sample.module.forward(x);
    if (sample.loss) out = sample.loss(out);
    std::optional<autograd::GradFunction> gf;
    gf.emplace(autograd::TensorList{out},
               sample.input_needs_grad ? autograd::TensorList{x} : autograd::TensorList{}, params);
    const int m1 = timer->mark();
    const int64_t after_f = allocated ? allocated() : 0;
    autograd::TensorList dx = gf->compute_input_grad(grads_out);
    const int m2 = timer->mark();
    const int64_t after_i = allocated ? allocated() : 0;
    gf->compute_weight_grad();
    const int m3 = timer->mark();
    // The same stage with one fused backward.
    gf.reset();
    torch::Tensor x2 =
        sample.input_needs_grad ? sample.input.detach().requires_grad_(true) : sample.input;
    torch::Tensor out2 = sample.module.forward(x2);
    if (sample.loss) out2 = sample.loss(out2);
    autograd::GradFunction fused(
        autograd::TensorList{out2},
        sample.input_needs_grad ? autograd::TensorList{x2} : autograd::TensorList{}, params);
    const int m4 = timer->mark();
    fused(grads_out);
    const int m5 = timer->mark();
    if (run < options.warmup) continue;
    f.push_back(timer->seconds(m1) - timer->seconds(m0));
    i.push_back(timer->seconds(m2) - timer->seconds(m1));
    w.push_back(timer->seconds(m3) - timer->seconds(m2));
    b.push_back(timer->seconds(m5) - timer->seconds(m4));
    if (allocated) {
      const int64_t sent_out = sample.loss ? 0 : bytes_of(out);
      const int64_t sent_dx = dx.empty() ? 0 : bytes_of(dx[0]);
      costs.mem_b = std::max<int64_t>(0, after_f - before - sent_out);
      costs.mem_w = std::max<int64_t>(0, after_i - before - sent_out - sent_dx);
    }
  }
  clear_grads(params);
  costs.f = median(f);
  costs.i = median(i);
  costs.w = median(w);
  costs.b = median(b);
  return costs;
}

std::vector<std::string> default_prediction_schedules() {
  std::vector<std::string> out;
  for (const auto& n : schedule::names())
    if (n != "naive") out.push_back(n);
  return out;
}

namespace {

// NOTE [Per-stage costs of other cuts]
// Costs measured for p stages (the model cut into p chunks) describe a
// schedule that cuts it into n = v p stages too: a stage of n holds p/n of a
// middle chunk's layers, and the first and last stages also hold what makes
// chunk 0 and chunk p-1 differ from a middle one (embedding, head and loss).
// So stage s of n costs middle * p/n, plus first - middle when s = 0 and
// last - middle when s = n-1 (memory alike). Scaling the first and last
// chunks whole instead would halve the head's cost under a V schedule, and
// one rank's share for every stage would drop it altogether.
schedule::CostModel costs_for_stages(const schedule::CostModel& c, int p, int n) {
  if (!c.per_stage() || n == p) return c;
  schedule::CostModel out = c;
  const double scale = double(p) / n;
  auto spread = [&](const std::vector<double>& v, double mid, double floor) {
    std::vector<double> r(n);
    for (int s = 0; s < n; ++s) {
      double x = mid * scale;
      if (s == 0 && !v.empty()) x += v.front() - mid;
      if (s == n - 1 && !v.empty()) x += v.back() - mid;
      r[s] = std::max(x, floor);
    }
    return r;
  };
  out.stage_f = spread(c.stage_f, c.f, 1e-9);
  out.stage_b = spread(c.stage_b, c.b, 1e-9);
  out.stage_w = spread(c.stage_w, c.w, 1e-9);
  out.stage_mem_b = spread(c.stage_mem_b, c.mem_b, 0.0);
  out.stage_mem_w = spread(c.stage_mem_w, c.mem_w, 0.0);
  out.stage_comm.assign(n, c.comm);
  return out;
}

}  // namespace

std::vector<SchedulePrediction> predict_schedules(const schedule::CostModel& costs, int p, int m,
                                                  const std::vector<std::string>& names) {
  if (p < 1 || m < 1) throw std::invalid_argument("p and m must be at least 1");
  schedule::CostModel scalar = costs;  // one rank's share, scaled by the simulator
  scalar.stage_f.clear(), scalar.stage_b.clear(), scalar.stage_w.clear();
  scalar.stage_mem_b.clear(), scalar.stage_mem_w.clear(), scalar.stage_comm.clear();
  costs.check();
  if (costs.per_stage()) costs.check(p);
  schedule::SimOptions quiet;
  quiet.record_timeline = false;
  std::vector<SchedulePrediction> out;
  for (const auto& name : names) {
    SchedulePrediction pr;
    pr.schedule = name;
    try {
      // Built on one rank's share first (to learn its number of stages), then
      // on the per-stage costs of its own cut (zb-auto and zbv-auto search under
      // them; NOTE [Per-stage costs of other cuts]).
      schedule::BuildOptions o;
      o.costs = scalar;
      schedule::Schedule s = schedule::build(name, p, m, o);
      const schedule::CostModel c = costs_for_stages(costs, p, s.num_stages);
      if (costs.per_stage()) {
        o.costs = c;
        s = schedule::build(name, p, m, o);
      }
      schedule::SimResult r = schedule::simulate(s, c, quiet);
      pr.ok = true;
      pr.num_stages = s.num_stages;
      pr.step_seconds = r.makespan;
      pr.bubble_rate = r.bubble_rate;
      pr.peak_memory = r.max_peak_memory;
    } catch (const std::exception& e) {
      pr.error = e.what();
    }
    out.push_back(pr);
  }
  return out;
}

std::vector<schedule::PaperRow> paper_rows(int p, int m) {
  std::vector<schedule::PaperRow> out;
  for (const auto& r : schedule::paper_table5())
    if (r.p == p && r.m == m) out.push_back(r);
  return out;
}

schedule::CostModel stage_cost_model(const StageCosts& first, const StageCosts& middle,
                                     const StageCosts& last, double comm, int p) {
  if (p < 1) throw std::invalid_argument("p must be at least 1");
  const bool memory = first.mem_b >= 0 && middle.mem_b >= 0 && last.mem_b >= 0;
  auto mem_b = [&](const StageCosts& s) { return memory ? std::max<double>(s.mem_b, 1) : 1.0; };
  auto mem_w = [&](const StageCosts& s) { return memory ? std::max<double>(s.mem_w, 0) : 0.5; };
  schedule::CostModel c;
  c.f = middle.f, c.b = middle.i, c.w = middle.w, c.comm = comm;
  c.mem_b = mem_b(middle), c.mem_w = mem_w(middle);
  for (int s = 0; s < p; ++s) {
    const StageCosts& k = s == 0 ? first : s == p - 1 ? last : middle;
    c.stage_f.push_back(std::max(k.f, 1e-9));
    c.stage_b.push_back(std::max(k.i, 1e-9));
    c.stage_w.push_back(std::max(k.w, 1e-9));
    c.stage_mem_b.push_back(mem_b(k));
    c.stage_mem_w.push_back(mem_w(k));
    c.stage_comm.push_back(comm);
  }
  c.f = std::max(c.f, 1e-9), c.b = std::max(c.b, 1e-9), c.w = std::max(c.w, 1e-9);
  return c;
}

ProfileResult profile_model(const ProfileConfig& config) {
  const int p = config.p;
  if (p < 1 || config.m < 1) throw std::invalid_argument("-p and -m must be at least 1");
  // NOTE [One size rule]: the predictions build every schedule at p and m
  // (DualPipe's and the V ones with two stages per rank), so refuse before
  // measuring anything.
  schedule::check_schedule_size("hp profile", p, config.m, 2);
  if (config.warmup < 0 || config.repeats < 1)
    throw std::invalid_argument("--repeats must be at least 1 and --warmup at least 0");
  if (config.microbatch_size < 1)
    throw std::invalid_argument("--microbatch-size must be at least 1");
  try {
    config.model.check();
  } catch (const c10::Error& e) {
    throw std::invalid_argument(e.what_without_backtrace());
  }
  if (config.model.cuttable_layers() < p)
    throw std::invalid_argument("-p " + std::to_string(p) + " cuts the " + config.model.kind +
                                " into " + std::to_string(p) + " chunks but it has only " +
                                std::to_string(config.model.cuttable_layers()) +
                                " cuttable layers; use more --layers");
  TrainConfig device_of;  // the same device rules as hp train (NOTE [Ranks on devices])
  device_of.device = config.device;
  if (config.device != "cpu" && config.device != "cuda" && config.device != "auto")
    throw std::invalid_argument("--device must be cpu, cuda or auto, not '" + config.device + "'");
  const torch::Device device = device_of.resolve_device(0);
  c10::OptionalDeviceGuard on_device;
  if (!device.is_cpu()) on_device.reset_device(device);
  if (device.is_cpu()) install_memory_tracker();

  ProfileResult result;
  result.device = device.str();
  result.chunks = {0};
  if (p > 2) result.chunks.push_back(p / 2);
  if (p > 1) result.chunks.push_back(p - 1);
  MeasureOptions mo;
  mo.warmup = config.warmup;
  mo.repeats = config.repeats;
  for (int index : result.chunks) {
    auto chunk = models::build_chunk(config.model, index, p, config.seed);
    chunk->to(device);
    result.measured.push_back(measure_stage(sample_of(config, chunk, index, p, device), mo));
  }
  if (config.comm >= 0) {
    result.comm = config.comm;
  } else if (p > 1) {
    auto probe = torch::randn(models::activation_shape(config.model, config.microbatch_size),
                              torch::TensorOptions().dtype(config.model.dtype).device(device));
    result.comm = measure_transfer(probe, std::chrono::seconds(60));
    result.comm_measured = true;
  }
  const StageCosts& first = result.measured.front();
  const StageCosts& last = result.measured.back();
  const StageCosts& middle = result.measured.size() > 2 ? result.measured[1] : last;
  result.costs = stage_cost_model(first, middle, last, result.comm, p);
  result.predictions = predict_schedules(
      result.costs, p, config.m,
      config.schedules.empty() ? default_prediction_schedules() : config.schedules);
  std::sort(result.predictions.begin(), result.predictions.end(),
            [](const SchedulePrediction& a, const SchedulePrediction& b) {
              if (a.ok != b.ok) return a.ok;
              return a.step_seconds < b.step_seconds;
            });
  result.paper = paper_rows(p, config.m);
  if (!result.paper.empty())
    result.paper_predictions =
        predict_schedules(result.costs, p, config.m, {"1f1b", "zb-h1", "zb-h2", "zb-auto"});
  const int64_t rows = config.microbatch_size * config.m;
  result.items_per_step = config.model.kind == "gpt" ? rows * config.model.seq_len : rows;
  return result;
}

std::string profile_text(const ProfileConfig& config, const ProfileResult& r) {
  std::ostringstream os;
  const auto& spec = config.model;
  os << "hp profile: " << spec.kind << " (" << spec.layers << " layers, d_model " << spec.d_model
     << ", " << c10::toString(spec.dtype) << "), microbatches of " << config.microbatch_size
     << ", on " << r.device << "\n\n";
  os << "measured per microbatch (median of " << config.repeats
     << "), one chunk of p = " << config.p << ":\n";
  char line[256];
  std::snprintf(line, sizeof line, "%-8s %10s %10s %10s %10s %9s %12s %12s\n", "chunk", "F ms",
                "I ms", "W ms", "B ms", "(I+W)/B", "mem_b MiB", "mem_w MiB");
  os << line;
  for (size_t k = 0; k < r.chunks.size(); ++k) {
    const StageCosts& c = r.measured[k];
    std::snprintf(line, sizeof line, "%-8d %10s %10s %10s %10s %9.3f %12s %12s\n", r.chunks[k],
                  ms(c.f).c_str(), ms(c.i).c_str(), ms(c.w).c_str(), ms(c.b).c_str(),
                  c.b > 0 ? (c.i + c.w) / c.b : 0.0, mib(double(c.mem_b)).c_str(),
                  mib(double(c.mem_w)).c_str());
    os << line;
  }
  os << "transfer of one activation: " << ms(r.comm) << " ms"
     << (r.comm_measured ? " (measured: two ranks of this machine over Gloo"
                         : " (given with --comm")
     << (r.comm_measured && r.device != "cpu" ? ", staged through host memory)" : ")") << "\n\n";
  const bool bytes = r.measured.front().mem_b >= 0;
  os << "predicted step at p = " << config.p << ", m = " << config.m << " (simulator on these costs"
     << (bytes ? "" : "; memory in units of one stage's activations") << "):\n";
  std::snprintf(line, sizeof line, "%-18s %12s %9s %14s %14s\n", "schedule", "step ms", "bubble",
                bytes ? "peak act. MiB" : "peak act.", "items/s");
  os << line;
  for (const auto& p : r.predictions) {
    if (!p.ok) {
      std::snprintf(line, sizeof line, "%-18s not at this p and m: ", p.schedule.c_str());
      os << line << p.error.substr(0, 120) << "\n";
      continue;
    }
    std::snprintf(line, sizeof line, "%-18s %12s %8.2f%% %14s %14.0f\n", p.schedule.c_str(),
                  ms(p.step_seconds).c_str(), 100 * p.bubble_rate,
                  bytes ? mib(p.peak_memory).c_str() : std::to_string(p.peak_memory).c_str(),
                  p.step_seconds > 0 ? double(r.items_per_step) / p.step_seconds : 0.0);
    os << line;
  }
  if (r.paper.empty()) {
    os << "\nthe Zero Bubble paper's Table 5 has no row at p = " << config.p << ", m = " << config.m
       << " (its rows: p = 8 with m = 24, 32, 64; 16 with 48, 64, 128; 32 with 96, "
       << "128, 256)\n";
    return os.str();
  }
  os << "\nthe Zero Bubble paper's Table 5 at p = " << config.p << ", m = " << config.m
     << " (bubble rate; the paper's rows on its profiled costs, the last on yours; zb-auto is "
        "its ZB-2p):\n";
  std::snprintf(line, sizeof line, "%-12s %-18s %8s %8s %8s %8s\n", "model", "F : I : W", "1F1B",
                "ZB-H1", "ZB-H2", "ZB-2p");
  os << line;
  for (const auto& row : r.paper) {
    char ratio[64];
    std::snprintf(ratio, sizeof ratio, "1 : %.2f : %.2f", row.b / row.f, row.w / row.f);
    std::snprintf(line, sizeof line, "%-12s %-18s %8s %8s %8s %8s\n",
                  ("paper " + row.model).c_str(), ratio, rate(row.r_1f1b).c_str(),
                  rate(row.r_zbh1).c_str(), rate(row.r_zbh2).c_str(), rate(row.r_zb2p).c_str());
    os << line;
  }
  const auto& c = r.costs;
  char ratio[64];
  std::snprintf(ratio, sizeof ratio, "1 : %.2f : %.2f", c.b / c.f, c.w / c.f);
  double got[4] = {-1, -1, -1, -1};
  for (size_t k = 0; k < r.paper_predictions.size() && k < 4; ++k)
    if (r.paper_predictions[k].ok) got[k] = r.paper_predictions[k].bubble_rate;
  std::snprintf(line, sizeof line, "%-12s %-18s %8s %8s %8s %8s\n", "measured", ratio,
                rate(got[0]).c_str(), rate(got[1]).c_str(), rate(got[2]).c_str(),
                rate(got[3]).c_str());
  os << line;
  return os.str();
}

}  // namespace hp::train
