// `hp train`: checks the configuration, starts the ranks as real processes
// on this machine (or runs one rank when started by `hp launch`/torchrun with
// --worker), trains, and prints a summary; also `hp train reference`.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>

#include "hp/core/memory.h"
#include "hp/distributed/comm.h"
#include "hp/launch/launcher.h"
#include "hp/schedule/generators.h"
#include "hp/train/graph_train.h"
#include "hp/train/report.h"
#include "hp/train/trainer.h"
#include "tools/hp/commands.h"

namespace hp::cli {
namespace {

struct TrainArgs {
  train::TrainConfig config;
  std::string dtype = "float32";
  int64_t batch = 0;  // global batch rows; 0 = microbatches * microbatch_size
  bool worker = false;
  bool pin = false;
  bool untied = false;
  std::string p2p = "gloo";       // point-to-point transport between ranks of one host
  std::vector<std::string> argv;  // our own command line, for the ranks
};

void finish_config(TrainArgs& a) {
  auto& c = a.config;
  if (a.dtype == "float64") {
    c.model.dtype = torch::kFloat64;
  } else if (a.dtype == "float32") {
    c.model.dtype = torch::kFloat32;
  } else {
    throw std::invalid_argument("--dtype must be float32 or float64, not '" + a.dtype + "'");
  }
  c.model.tied_head = !a.untied;
  if (a.batch > 0) {
    if (a.batch % c.microbatches != 0)
      throw std::invalid_argument(
          "--batch " + std::to_string(a.batch) + " is not divisible by --microbatches " +
          std::to_string(c.microbatches) + "; pick a batch that is a multiple of it");
    c.microbatch_size = a.batch / c.microbatches;
  }
  if ((c.save_every > 0 || c.resume) && c.checkpoint_dir.empty())
    c.checkpoint_dir = "hp-checkpoints";
}

int run_worker(const TrainArgs& a) {
  // NOTE [A failed rank exits at once]
  // After a communication error Gloo's threads may keep the Comm's destructor
  // waiting for up to the timeout; a rank that failed has nothing left to
  // save, so it reports and leaves without unwinding.
  try {
    launch::apply_rank_pinning();
    keep_freed_memory_mapped();
    distributed::CommOptions opts;
    opts.timeout = std::chrono::seconds(a.config.timeout_s);
    auto comm = distributed::Comm::from_env(opts);
    if (a.p2p == "shm") comm = distributed::with_shared_memory_p2p(comm);
    auto result =
        a.config.graph ? train::run_graph_rank(a.config, comm) : train::run_rank(a.config, comm);
    if (comm->rank() == 0) std::cout << train::summary_text(a.config, result) << std::flush;
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(0);
  } catch (const std::exception& e) {
    std::string msg = e.what();
    auto cut = msg.find("\nException raised from");
    if (cut != std::string::npos) msg.resize(cut);
    const char* rank = std::getenv("RANK");
    std::fprintf(stderr, "hp train: rank %s failed: %s\n", rank ? rank : "?", msg.c_str());
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(1);
  }
}

int run_launcher(const TrainArgs& a) {
  const auto& c = a.config;
  std::fprintf(stderr, "hp train: %s, %d ranks, %s, %d microbatches of %lld, %d steps\n",
               c.model.kind.c_str(), c.nproc,
               c.graph ? "graph mode" : ("schedule " + c.schedule).c_str(), c.microbatches,
               (long long)c.microbatch_size, c.steps);
  launch::LaunchOptions lo;
  lo.nproc = c.nproc;
  lo.command = {self_executable()};
  lo.command.insert(lo.command.end(), a.argv.begin() + 1, a.argv.end());
  lo.command.push_back("--worker");
  lo.timeout = std::chrono::seconds(c.timeout_s);
  lo.pin_cores = a.pin;
  auto result = launch::launch_local(lo);
  if (!result.ok()) {
    std::cerr << "hp train: a rank failed:\n" << result.summary();
    return result.exit_code() == 0 ? 1 : result.exit_code();
  }
  return 0;
}

void add_train_command(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  auto& c = a->config;
  auto* t = app.add_subcommand("train", "train a model with pipeline parallelism on local ranks");
  t->add_option("--model", c.model.kind, "gpt or mlp")->check(CLI::IsMember({"gpt", "mlp"}));
  t->add_option("--layers", c.model.layers, "transformer blocks (gpt) or hidden layers (mlp)");
  t->add_option("--d-model", c.model.d_model, "width");
  t->add_option("--heads", c.model.heads, "attention heads");
  t->add_option("--seq-len", c.model.seq_len, "tokens per sequence (gpt)");
  t->add_option("--in-features", c.model.in_features, "input width (mlp)");
  t->add_flag("--untied", a->untied,
              "give the gpt its own output head (default: tied to the embedding)");
  t->add_option("--nproc,-p", c.nproc, "pipeline ranks (processes)");
  t->add_option(
      "--schedule,-s", c.schedule, "schedule: " + [] {
        std::string s;
        for (const auto& n : schedule::names())
          s += (s.empty() ? "" : ", ") + n;
        return s;
      }());
  t->add_option("--chunks,-v", c.chunks, "virtual stages per rank (interleaved schedules)");
  t->add_option("--microbatches,-m", c.microbatches, "microbatches per step");
  t->add_option("--microbatch-size", c.microbatch_size, "rows per microbatch");
  t->add_option("--batch", a->batch, "global batch rows (overrides --microbatch-size)");
  t->add_option("--steps", c.steps, "optimizer steps");
  t->add_option("--optimizer", c.optimizer, "adamw or sgd");
  t->add_option("--lr", c.lr, "learning rate");
  t->add_option("--weight-decay", c.weight_decay, "weight decay");
  t->add_option("--dtype", a->dtype, "float32 or float64");
  t->add_option("--seed", c.seed, "seed of the initial weights and the data");
  t->add_option("--data", c.data, "text file or folder (default: /usr/share/common-licenses)");
  t->add_option("--trace", c.trace, "write the executed timeline: Chrome trace FILE and FILE.svg");
  t->add_option("--report", c.report, "write a JSON report");
  t->add_option("--checkpoint-dir", c.checkpoint_dir, "folder of checkpoints");
  t->add_option("--save-every", c.save_every, "save a checkpoint every N steps");
  t->add_flag("--resume", c.resume, "continue from the latest complete checkpoint");
  t->add_flag("--recompute", c.recompute, "checkpoint every transformer block");
  t->add_option("--timeout", c.timeout_s, "seconds any communication may take");
  t->add_flag("--graph", c.graph,
              "graph mode: capture the train step once, replay it on every rank, FSDP over the "
              "ranks (data parallel; --schedule and --chunks do not apply)");
  t->add_flag(
      "--no-overlap", [&c](int64_t) { c.overlap = false; },
      "graph mode: keep each collective's wait next to it (no overlap pass)");
  t->add_flag(
      "--no-shard", [&c](int64_t) { c.shard = false; },
      "graph mode: replicate every parameter (plain data parallel, gradients all-reduced)");
  t->add_flag("--pin", a->pin, "pin each rank to one core with one intra-op thread");
  t->add_option("--p2p", a->p2p,
                "point-to-point transport between ranks of one host: gloo (loopback TCP) or shm "
                "(shared memory; collectives stay on Gloo)")
      ->check(CLI::IsMember({"gloo", "shm"}));
  t->add_flag(
      "--no-progress", [&c](int64_t) { c.progress = false; }, "no progress bar");
  t->add_flag("--worker", a->worker, "run as one rank (set by the launcher)")->group("");
  t->callback([a] {
    a->argv = command_line();
    finish_config(*a);
    a->config.validate();  // before any rank starts
    int rc = a->worker ? run_worker(*a) : run_launcher(*a);
    if (rc != 0) std::exit(rc);
  });
}

}  // namespace

HP_CLI_COMMAND(add_train_command);

}  // namespace hp::cli
