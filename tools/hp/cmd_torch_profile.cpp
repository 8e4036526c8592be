// `hp profile`: measures one stage of a reference model (its F, I, W, a fused
// B, one transfer, activation memory) on the device it runs on, and predicts
// every schedule's step at a target p and m from those costs, beside the
// Zero Bubble paper's Table 5 (hp/train/profile.h).
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>

#include "hp/train/profile.h"
#include "tools/hp/commands.h"

namespace hp::cli {
namespace {

struct ProfileArgs {
  train::ProfileConfig config;
  std::string dtype = "float32";
  std::string schedules;  // comma separated; empty = all
};

void add_profile_command(CLI::App& app) {
  auto a = std::make_shared<ProfileArgs>();
  auto& c = a->config;
  c.model.layers = 8;
  c.model.d_model = 256;
  c.model.heads = 4;
  c.model.seq_len = 128;
  auto* t = app.add_subcommand(
      "profile",
      "measure a model's stage (F, I, W, transfer, activation memory) on this device and "
      "predict every schedule's step at a target p and m");
  t->add_option("--model", c.model.kind, "gpt or mlp")->check(CLI::IsMember({"gpt", "mlp"}));
  t->add_option("--layers", c.model.layers, "transformer blocks (gpt) or hidden layers (mlp)")
      ->capture_default_str();
  t->add_option("--d-model", c.model.d_model, "width")->capture_default_str();
  t->add_option("--heads", c.model.heads, "attention heads")->capture_default_str();
  t->add_option("--seq-len", c.model.seq_len, "tokens per sequence (gpt)")->capture_default_str();
  t->add_option("--in-features", c.model.in_features, "input width (mlp)");
  t->add_option("--dtype", a->dtype, "float32 or float64")->capture_default_str();
  t->add_option("--microbatch-size", c.microbatch_size, "rows per microbatch")
      ->capture_default_str();
  t->add_option("-p,--nproc", c.p, "target pipeline ranks (the model is cut into p chunks)")
      ->capture_default_str();
  t->add_option("-m,--microbatches", c.m, "target microbatches per step")->capture_default_str();
  t->add_option("--device", c.device, "cpu, cuda (the first GPU) or auto")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  t->add_option("--warmup", c.warmup, "untimed runs first")->capture_default_str();
  t->add_option("--repeats", c.repeats, "timed runs (medians are reported)")->capture_default_str();
  t->add_option("--comm", c.comm,
                "seconds per transfer of one activation (default: measured between two ranks of "
                "this machine)")
      ->check([](const std::string& v) -> std::string {
        double x = 0;
        try {
          x = std::stod(v);
        } catch (const std::exception&) {
          return "--comm must be a number of seconds";
        }
        return std::isfinite(x) && x >= 0 ? "" : "--comm must be a finite number of seconds >= 0";
      });
  t->add_option("--schedules", a->schedules, "comma-separated schedules (default: all)");
  t->add_option("--seed", c.seed, "seed of the weights and inputs");
  t->callback([a] {
    auto& c = a->config;
    if (a->dtype == "float64") {
      c.model.dtype = torch::kFloat64;
    } else if (a->dtype == "float32") {
      c.model.dtype = torch::kFloat32;
    } else {
      throw std::invalid_argument("--dtype must be float32 or float64, not '" + a->dtype + "'");
    }
    c.schedules.clear();
    std::string s = a->schedules;
    for (size_t start = 0; !s.empty() && start <= s.size();) {
      size_t end = s.find(',', start);
      if (end == std::string::npos) end = s.size();
      if (end > start) c.schedules.push_back(s.substr(start, end - start));
      start = end + 1;
    }
    auto result = train::profile_model(c);
    std::cout << train::profile_text(c, result) << std::flush;
  });
}

}  // namespace

HP_CLI_COMMAND(add_profile_command);

}  // namespace hp::cli
