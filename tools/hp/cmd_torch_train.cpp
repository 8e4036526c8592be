// `hp train`: checks every option before any work (ranges, options that do
// not apply, output paths, memory), plans the checkpoints under the folder's
// lock, starts the ranks as real processes on this machine (or runs one rank
// when started by `hp launch`/torchrun with --worker), trains, and prints a
// summary.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>

#include "hp/core/memory.h"
#include "hp/distributed/comm.h"
#include "hp/launch/launcher.h"
#include "hp/schedule/generators.h"
#include "hp/train/checkpoint.h"
#include "hp/train/graph_train.h"
#include "hp/train/report.h"
#include "hp/train/trainer.h"
#include "tools/hp/commands.h"

namespace hp::cli {
namespace {

struct TrainArgs {
  train::TrainConfig config;
  std::string dtype = "float32";
  std::string model = "gpt";  // --model: gpt, moe or mlp
  int64_t batch = 0;          // global batch rows; 0 = microbatches * microbatch_size
  std::string seed = "0";
  std::string defer_wgrad = "auto";  // --defer-wgrad: on (the bare flag), off or auto
  CLI::App* app = nullptr;           // to ask which options were given
  bool worker = false;
  bool pin = false;
  bool untied = false;
  std::vector<std::string> argv;  // our own command line, for the ranks
};

// NOTE [Options that do not apply]
// An option that would change nothing in the chosen mode is refused, so a
// typo or a misunderstanding never passes silently: graph mode takes no
// schedule, chunks or point-to-point transport; the pipeline no graph-mode
// flags; --chunks only the interleaved schedules; the mlp no gpt shape or
// data; a checkpoint folder only with saving or resuming.
void refuse_options_that_do_not_apply(const TrainArgs& a) {
  const auto& c = a.config;
  auto given = [&](const char* name) { return a.app->count(name) > 0; };
  auto refuse = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (given("--schedule-file"))
    for (const char* o : {"--schedule", "--chunks"})
      if (given(o))
        refuse(std::string(o) +
               " does not apply with --schedule-file (the file is the "
               "schedule); drop one of them");
  if (c.graph) {
    for (const char* o : {"--schedule", "--chunks", "--p2p", "--schedule-file"})
      if (given(o))
        refuse(std::string(o) +
               " does not apply to --graph (graph mode is data parallel with "
               "FSDP: no pipeline schedule); drop it or --graph");
  } else {
    for (const char* o : {"--no-overlap", "--no-shard"})
      if (given(o)) refuse(std::string(o) + " applies only to --graph; drop it or add --graph");
    if (given("--chunks") && c.schedule.rfind("interleaved", 0) != 0)
      refuse(
          "--chunks applies only to the interleaved schedules (interleaved-1f1b, "
          "interleaved-bfs, interleaved-zb); '" +
          c.schedule + "' places its own stages; drop -v/--chunks");
  }
  if (a.model != "moe")
    for (const char* o : {"--experts", "--top-k", "--ep", "--capacity-factor", "--aux-coef"})
      if (given(o)) refuse(std::string(o) + " applies only to --model moe; drop it");
  if (c.model.kind == "mlp") {
    for (const char* o :
         {"--heads", "--seq-len", "--untied", "--data", "--recompute", "--documents"})
      if (given(o))
        refuse(std::string(o) +
               " applies only to --model gpt (the mlp learns a synthetic task and has no "
               "blocks); drop it");
  } else if (given("--in-features")) {
    refuse("--in-features applies only to --model mlp; drop it");
  }
  if (given("--batch") && given("--microbatch-size"))
    refuse(
        "--batch sets the microbatch size (batch / microbatches); give --batch or "
        "--microbatch-size, not both");
  if (given("--checkpoint-dir") && c.save_every == 0 && !c.resume && !c.resume_or_start)
    refuse(
        "--checkpoint-dir does nothing without --save-every N, --resume or "
        "--resume-or-start; add one or drop it");
  if (given("--checkpoint-step") && !a.worker)
    refuse("--checkpoint-step is set by hp train for its ranks; use --resume");
}

// A seed is a whole number from 0 to 2^64 - 1, written plainly.
uint64_t parse_seed(const std::string& text) {
  const bool digits = !text.empty() && text.size() <= 20 &&
                      text.find_first_not_of("0123456789") == std::string::npos;
  errno = 0;
  const unsigned long long v = digits ? std::strtoull(text.c_str(), nullptr, 10) : 0;
  if (!digits || errno == ERANGE)
    throw std::invalid_argument("--seed '" + text +
                                "' is not a whole number from 0 to 18446744073709551615");
  return v;
}

void finish_config(TrainArgs& a) {
  auto& c = a.config;
  // --model moe: the gpt whose blocks hold MoE layers (hp/moe).
  c.model.kind = a.model == "moe" ? "gpt" : a.model;
  if (a.model == "moe" && a.app->count("--experts") == 0) c.model.experts = 8;
  refuse_options_that_do_not_apply(a);
  // --ep E: the experts over the data-parallel copies (NOTE [Expert
  // gradients] in hp/pipeline/pipeline.cpp); --dp defaults to E.
  if (c.ep > 1 && a.app->count("--dp") == 0) c.dp = c.ep;
  if (!c.schedule_file.empty()) c.schedule = "file:" + c.schedule_file;  // its name in reports
  c.seed = parse_seed(a.seed);
  // NOTE [The deferred W's chosen in the run] in hp/pipeline/pipeline.cpp
  if (a.defer_wgrad != "on" && a.defer_wgrad != "off" && a.defer_wgrad != "auto")
    throw std::invalid_argument("--defer-wgrad '" + a.defer_wgrad +
                                "' is not one of: on (the flag alone), off, auto");
  c.defer_wgrad = a.defer_wgrad == "on";
  c.defer_wgrad_auto = a.defer_wgrad == "auto";
  if (a.app->count("--defer-wgrad") > 0 && !c.fb_overlap)
    throw std::invalid_argument(
        "--defer-wgrad defers the W of overlapped pairs: give --fb-overlap too");
  if (a.app->count("--batch") > 0 && a.batch < 1)
    throw std::invalid_argument("--batch must be at least 1, not " + std::to_string(a.batch));
  if (a.app->count("--save-every") > 0 && c.save_every < 1)
    throw std::invalid_argument("--save-every must be at least 1, not " +
                                std::to_string(c.save_every) + " (leave it out to never save)");
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
  if ((c.save_every > 0 || c.resume || c.resume_or_start) && c.checkpoint_dir.empty())
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
    launch::fault_point("connect");  // NOTE [Fault injection]
    auto comm = distributed::Comm::from_env(opts);
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
  c.check_memory(c.nproc * c.dp);  // all ranks on this machine
  // NOTE [Checkpoint integrity]: this process holds the folder's lock for the
  // whole run and tells the ranks which verified step to start from.
  std::unique_ptr<train::CheckpointLock> lock;
  int start_step = 0;
  if (!c.checkpoint_dir.empty()) {
    if (c.resume && !std::filesystem::exists(c.checkpoint_dir))
      throw std::invalid_argument("--resume: --checkpoint-dir '" + c.checkpoint_dir +
                                  "' does not exist; run without --resume to start, or pass "
                                  "--resume-or-start to start from step 0 when there is none");
    lock = std::make_unique<train::CheckpointLock>(c.checkpoint_dir);
    auto plan = train::plan_resume(c, train::checkpoint_fingerprint(c, c.build_schedule()));
    for (const auto& note : plan.notes)
      std::fprintf(stderr, "hp train: %s\n", note.c_str());
    if (plan.step > 0)
      std::fprintf(stderr, "hp train: resuming from %s (%d steps done)\n",
                   train::checkpoint_step_dir(c.checkpoint_dir, plan.step).c_str(), plan.step);
    start_step = plan.step;
  }
  const std::string ranks =
      c.dp > 1 ? std::to_string(c.nproc * c.dp) + " ranks (pp " + std::to_string(c.nproc) +
                     (c.ep > 1 ? " x ep " : " x dp ") + std::to_string(c.dp) + ")"
               : std::to_string(c.nproc) + " ranks";
  std::fprintf(stderr, "hp train: %s, %s, %s, %d microbatches of %lld, %d steps\n",
               (c.model.experts > 0 ? "moe (" + std::to_string(c.model.experts) + " experts, top " +
                                          std::to_string(c.model.top_k) + ")"
                                    : c.model.kind + (c.model.documents ? " (documents)" : ""))
                   .c_str(),
               ranks.c_str(), c.graph ? "graph mode" : ("schedule " + c.schedule).c_str(),
               c.microbatches, (long long)c.microbatch_size, c.steps);
  launch::LaunchOptions lo;
  lo.nproc = c.nproc * c.dp;
  lo.command = {self_executable()};
  lo.command.insert(lo.command.end(), a.argv.begin() + 1, a.argv.end());
  lo.command.push_back("--worker");
  if (lock) {
    lo.command.push_back("--checkpoint-step");
    lo.command.push_back(std::to_string(start_step));
  }
  // NOTE [Failing fast]: after a rank fails the others get 2 s to report the
  // lost peer, then they are stopped; hp ranks end at once on SIGTERM.
  lo.timeout = std::chrono::seconds(2);
  lo.kill_grace = std::chrono::seconds(1);
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
  t->add_option("--model", a->model, "gpt, moe (the gpt with MoE layers) or mlp")
      ->check(CLI::IsMember({"gpt", "moe", "mlp"}));
  t->add_option("--experts", c.model.experts, "--model moe: routed experts per layer (default 8)");
  t->add_option("--top-k", c.model.top_k, "--model moe: experts per token");
  t->add_option("--ep", c.ep,
                "--model moe: spread the experts over E ranks, the data-parallel copies "
                "(--pp x E processes; --dp, when given, must be E)");
  t->add_option("--capacity-factor", c.model.capacity_factor,
                "--model moe: rows an expert takes per rank, as a multiple of an even share "
                "(0: dropless)");
  t->add_option("--expert-compute", c.model.expert_compute,
                "--model moe: the local experts as a loop of products, one grouped product "
                "per projection (LibTorch 2.9+, float32/bfloat16), or auto (grouped where it "
                "can)")
      ->check(CLI::IsMember({"auto", "loop", "grouped"}));
  t->add_option("--aux-coef", c.model.aux_coef, "--model moe: weight of the load-balancing loss");
  t->add_option("--layers", c.model.layers, "transformer blocks (gpt) or hidden layers (mlp)");
  t->add_option("--d-model", c.model.d_model, "width");
  t->add_option("--heads", c.model.heads, "attention heads");
  t->add_option("--seq-len", c.model.seq_len, "tokens per sequence (gpt)");
  t->add_option("--in-features", c.model.in_features, "input width (mlp)");
  t->add_flag("--untied", a->untied,
              "give the gpt its own output head (default: tied to the embedding)");
  t->add_flag("--documents", c.model.documents,
              "gpt: attention stays inside each line of the text; the stages hand on each "
              "token's line number with the hidden states (a message of two tensors)");
  t->add_option("--nproc,-p,--pp", c.nproc, "pipeline ranks (processes per pipeline copy)");
  t->add_option("--schedule-file", c.schedule_file,
                "run this schedule CSV instead of --schedule (hp schedule recommend -o writes one; "
                "its ranks and microbatches must be --nproc and --microbatches)");
  t->add_option("--dp", c.dp,
                "copies of the pipeline, data parallel: --pp x --dp processes; each copy "
                "trains on its own --microbatches and the gradients are averaged over the "
                "copies (default 1)");
  t->add_flag("--fsdp", c.fsdp,
              "with --dp: shard each stage's parameters, gradients and optimizer state over "
              "the copies between steps (one all-gather before and one reduce-scatter after "
              "each step; equal to plain --dp)");
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
  t->add_option("--seed", a->seed, "seed of the initial weights and the data (0 to 2^64 - 1)");
  t->add_option("--data", c.data, "text file or folder (default: /usr/share/common-licenses)");
  t->add_option("--trace", c.trace, "write the executed timeline: Chrome trace FILE and FILE.svg");
  t->add_option("--report", c.report, "write a JSON report");
  t->add_option("--checkpoint-dir", c.checkpoint_dir, "folder of checkpoints");
  t->add_option("--save-every", c.save_every, "save a checkpoint every N steps");
  t->add_flag("--resume", c.resume,
              "continue from the newest verified checkpoint (none is an error)");
  t->add_flag("--resume-or-start", c.resume_or_start,
              "as --resume, but start from step 0 when the folder holds no checkpoint yet");
  t->add_option("--checkpoint-step", c.checkpoint_step, "set by the launcher for its ranks")
      ->group("");
  t->add_flag("--recompute", c.recompute, "checkpoint every transformer block");
  t->add_option("--device", c.device,
                "cpu, cuda (each rank on GPU LOCAL_RANK mod the GPU count; ranks sharing a GPU "
                "exchange through host memory) or auto (cuda when there is a GPU)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  t->add_option("--timeout", c.timeout_s, "seconds any communication may take");
  t->add_option("--receive-lookahead", c.receive_lookahead,
                "post receives N batches ahead of the schedule (default 0; Gloo only)");
  t->add_flag("--fb-overlap", c.fb_overlap,
              "run each FB pair (dualpipe, dualpipev) as a forward and a backward that compute "
              "while the other waits on communication");
  t->add_flag("--defer-wgrad{on}", a->defer_wgrad,
              "with --fb-overlap: each pair's backward runs its input gradient only and queues "
              "its weight gradient, which fills a later wait or runs at the step's end; "
              "--defer-wgrad=off never, --defer-wgrad=auto (the default) from the third step "
              "where the simulator predicts a shorter step under the second step's costs");
  t->add_option("--pair-turns", c.pair_turns,
                "with --fb-overlap: ready (a half takes the CPU as soon as its message arrived; "
                "CPU ranks), fixed (the halves alternate in the code's order) or auto (default: "
                "ready, fixed with --defer-wgrad, whose W's then keep their order and the sums "
                "their bits)")
      ->check(CLI::IsMember({"auto", "ready", "fixed"}));
  t->add_option("--w-parts", c.w_parts,
                "with --defer-wgrad --pair-turns ready: run each deferred W in N parts, which "
                "fill a wait until its message or the other half's is there (default 1: whole)");
  t->add_option("--link", c.link,
                "LATENCY_US,GBPS: give every transfer and expert all-to-all a network link's "
                "cost (CPU; for measuring overlap on one host)");
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
  t->add_option("--p2p", c.p2p,
                "point-to-point between the pipeline's ranks of one host: auto (default; "
                "shared-memory rings where every rank can have them, else the group's), shm (the "
                "rings, or an error) or group (the Gloo group's own: loopback TCP); "
                "collectives stay on Gloo")
      ->check(CLI::IsMember({"auto", "shm", "group"}));
  t->add_flag(
      "--no-progress", [&c](int64_t) { c.progress = false; }, "no progress bar");
  t->add_flag("--worker", a->worker, "run as one rank (set by the launcher)")->group("");
  a->app = t;
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
