// Graph mode, measured side by side in one run:
//  1. one process, one intra-op thread: the gradient computation of a train
//     step as eager autograd (forward + loss.backward()) vs the captured
//     graph's replay (GraphTrainer::train_step), on the MLP and the GPT,
//     alternating rounds so machine noise hits both alike;
//  2. two rank processes (`hp train --graph --pin`): FSDP vs plain data
//     parallel, each with and without the overlap pass: step time, parameter
//     bytes per rank, time blocked on communication, share of it hidden.
// Usage: bench_graph [--rounds R] [--steps S] [--markdown FILE] [--skip-ranks]
#include <torch/torch.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "hp/compile/graph_trainer.h"
#include "hp/core/memory.h"
#include "hp/core/subprocess.h"
#include "hp/models/data.h"
#include "hp/models/models.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct ReplayRow {
  std::string model;
  double eager_ms = 0, graph_ms = 0;
  size_t nodes = 0;
};

// Per-step median of eager autograd and of graph replay on one model.
ReplayRow replay_vs_eager(const hp::models::ModelSpec& spec, int64_t rows, int rounds, int steps) {
  hp::models::Dataset data(spec, "", rows, 1);
  auto batch = data.get(0, 0);
  auto eager = hp::models::build_chunk(spec, 0, 1, 1);
  std::shared_ptr<torch::nn::Module> captured = hp::models::build_chunk(spec, 0, 1, 1);
  hp::compile::PassConfig pc;
  pc.fsdp_enabled = false;
  hp::compile::GraphTrainer trainer(
      captured,
      [spec](torch::nn::Module& m, const at::Tensor& x, const at::Tensor& y) {
        return hp::models::loss(spec, static_cast<hp::models::Chunk&>(m).forward(x), y);
      },
      pc);
  trainer.compile(batch.input, batch.target);
  std::vector<double> e, g;
  // Eager and replay alternate step by step, so load that comes and goes
  // on a shared machine lands on both alike.
  for (int s = 0; s < rounds * steps; ++s) {
    for (auto& p : eager->parameters())
      p.mutable_grad() = at::Tensor();
    auto t0 = Clock::now();
    hp::models::loss(spec, eager->forward(batch.input), batch.target).backward();
    e.push_back(seconds_since(t0));
    trainer.zero_grad();
    t0 = Clock::now();
    trainer.train_step(batch.input, batch.target);
    g.push_back(seconds_since(t0));
  }
  // The replay must compute what autograd computes (same weights, same batch).
  for (size_t k = 0; k < eager->parameters().size(); ++k) {
    auto a = eager->parameters()[k].grad(), b = captured->parameters()[k].grad();
    double err = (a - b).abs().max().item<double>() / std::max(1e-30, a.abs().max().item<double>());
    if (err > 1e-4) {
      std::fprintf(stderr, "bench_graph: replay gradient %zu differs from eager (%g)\n", k, err);
      std::exit(1);
    }
  }
  return {spec.kind, 1e3 * median(e), 1e3 * median(g), trainer.graph().nodes().size()};
}

struct RankRow {
  RankRow(std::string l, std::string f) : label(std::move(l)), flags(std::move(f)) {}
  std::string label, flags;
  std::vector<double> step_ms, wait_ms, hidden;
  double param_mib = 0;
};

void run_ranks(RankRow& row, const std::string& report, int steps) {
  std::ostringstream cmd;
  cmd << HP_BIN << " train --graph --pin --no-progress -p 2 --model gpt --layers 8 --d-model 128"
      << " --heads 4 --seq-len 64 -m 8 --microbatch-size 2 --steps " << steps << " --report "
      << report << " " << row.flags;
  int rc = 0;
  std::string out = hp::run_and_capture(cmd.str(), &rc);
  if (rc != 0) {
    std::fprintf(stderr, "bench_graph: %s failed:\n%s\n", cmd.str().c_str(), out.c_str());
    std::exit(1);
  }
  std::ifstream in(report);
  auto j = nlohmann::json::parse(in);
  auto s = j["step_seconds"].get<std::vector<double>>();
  if (s.size() > 1) s.erase(s.begin());
  row.step_ms.push_back(1e3 * median(s));
  double wait = 0, hidden = 1;
  for (const auto& r : j["ranks"]) {
    wait = std::max(wait, r["comm_wait_seconds"].get<double>());
    hidden = std::min(hidden, r["hidden_comm_fraction"].get<double>());
    row.param_mib = r["parameter_bytes"].get<double>() / 1048576.0;
  }
  row.wait_ms.push_back(1e3 * wait);
  row.hidden.push_back(hidden);
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 5, steps = 10;
  bool skip_ranks = false;
  std::string markdown;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else if (a == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (a == "--markdown" && i + 1 < argc) {
      markdown = argv[++i];
    } else if (a == "--skip-ranks") {
      skip_ranks = true;
    } else {
      std::fprintf(stderr,
                   "usage: bench_graph [--rounds R] [--steps S] [--markdown FILE] "
                   "[--skip-ranks]\n");
      return 2;
    }
  }
  at::set_num_threads(1);
  hp::keep_freed_memory_mapped();
  std::ostringstream md;

  hp::models::ModelSpec mlp;
  mlp.kind = "mlp";
  mlp.layers = 4;
  mlp.d_model = 512;
  mlp.in_features = 256;
  hp::models::ModelSpec gpt;
  gpt.layers = 4;
  gpt.d_model = 128;
  gpt.seq_len = 64;
  gpt.tied_head = true;
  std::printf("%-6s %10s %10s %8s %6s\n", "model", "eager ms", "replay ms", "ratio", "nodes");
  md << "| model | eager fwd+bwd ms | graph replay ms | replay / eager | graph nodes |\n"
     << "|---|---|---|---|---|\n";
  for (auto [spec, rows] : {std::make_pair(mlp, int64_t(64)), std::make_pair(gpt, int64_t(8))}) {
    ReplayRow r = replay_vs_eager(spec, rows, rounds, steps);
    std::printf("%-6s %10.2f %10.2f %8.3f %6zu\n", r.model.c_str(), r.eager_ms, r.graph_ms,
                r.graph_ms / r.eager_ms, r.nodes);
    char line[256];
    std::snprintf(line, sizeof line, "| %s | %.2f | %.2f | %.3f | %zu |\n", r.model.c_str(),
                  r.eager_ms, r.graph_ms, r.graph_ms / r.eager_ms, r.nodes);
    md << line;
  }

  if (!skip_ranks) {
    std::vector<RankRow> rows = {{"FSDP + overlap", ""},
                                 {"FSDP, no overlap", "--no-overlap"},
                                 {"data parallel + overlap", "--no-shard"},
                                 {"data parallel, no overlap", "--no-shard --no-overlap"}};
    auto dir =
        std::filesystem::temp_directory_path() / ("hp-bench-graph-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    for (int r = 0; r < rounds; ++r)
      for (auto& row : rows) {
        std::fprintf(stderr, "\rround %d/%d: %-28s", r + 1, rounds, row.label.c_str());
        run_ranks(row, (dir / "report.json").string(), steps);
      }
    std::fprintf(stderr, "\n");
    std::filesystem::remove_all(dir);
    const double base = median(rows[2].step_ms);
    std::printf("\n%-26s %9s %9s %11s %9s %9s\n", "2 ranks, gpt", "step ms", "vs DP", "params MiB",
                "wait ms", "hidden");
    md << "\n| 2 ranks, gpt | step ms | vs data parallel | parameters MiB per rank | "
          "blocked on comm ms | comm hidden |\n|---|---|---|---|---|---|\n";
    for (const auto& row : rows) {
      const double t = median(row.step_ms);
      std::printf("%-26s %9.1f %9.3f %11.2f %9.1f %8.0f%%\n", row.label.c_str(), t, t / base,
                  row.param_mib, median(row.wait_ms), 100 * median(row.hidden));
      char line[256];
      std::snprintf(line, sizeof line, "| %s | %.1f | %.3f | %.2f | %.1f | %.0f %% |\n",
                    row.label.c_str(), t, t / base, row.param_mib, median(row.wait_ms),
                    100 * median(row.hidden));
      md << line;
    }
  }
  if (!markdown.empty()) std::ofstream(markdown) << md.str();
  return 0;
}
