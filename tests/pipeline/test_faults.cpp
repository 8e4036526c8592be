// Fault injection (issue 15): checkpoints with flipped bits, stale copies,
// missing markers, a kill during a save; kill -9 of the launcher; a rank dead
// before the ranks connect; a port in use; a second run on the same folder;
// a NaN loss; and every bad input of the issue refused at once. Each case
// checks the error, the exit code and that nothing was lost: training
// resumed from what survived equals single-process training (float64).
// Ranks are threads where the case allows (one Python start for all), real
// `hp` processes where it needs a process to die.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "hp/models/data.h"
#include "hp/models/models.h"
#include "hp/schedule/generators.h"
#include "hp/train/checkpoint.h"
#include "hp/train/trainer.h"
#include "tests/common/hp_cli.h"
#include "tests/common/threads_as_ranks.h"

namespace fs = std::filesystem;
using hp::testing::HpRun;
using hp::testing::run_hp;
using hp::testing::train_flags;
using hp::train::TrainConfig;
using hp::train::TrainResult;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

fs::path fresh_dir(const std::string& name) {
  auto d = fs::temp_directory_path() / ("hp-faults-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

TrainConfig small(int steps = 4) {
  TrainConfig c;
  c.model.kind = "gpt";
  c.model.layers = 4;
  c.model.d_model = 16;
  c.model.heads = 2;
  c.model.seq_len = 8;
  c.model.dtype = torch::kFloat64;
  c.model.tied_head = false;
  c.nproc = 2;
  c.schedule = "zb-h1";
  c.microbatches = 4;
  c.microbatch_size = 2;
  c.steps = steps;
  c.lr = 1e-2;
  c.seed = 5;
  c.timeout_s = 20;
  c.progress = false;
  return c;
}

std::vector<TrainResult> run_threads(const TrainConfig& c) {
  std::vector<TrainResult> out(c.nproc);
  hp::testing::run_ranks_as_threads(
      c.nproc, [&](int r, auto comm) { out[r] = hp::train::run_rank(c, comm); });
  return out;
}

hp::train::CheckpointFingerprint fingerprint(const TrainConfig& c) {
  return hp::train::checkpoint_fingerprint(c, c.build_schedule());
}

hp::train::ResumePlan plan(const TrainConfig& c) {
  return hp::train::plan_resume(c, fingerprint(c));
}

bool has_note(const hp::train::ResumePlan& p, const std::string& text) {
  for (const auto& n : p.notes)
    if (n.find(text) != std::string::npos) return true;
  return false;
}

std::string notes_of(const hp::train::ResumePlan& p) {
  std::string all;
  for (const auto& n : p.notes)
    all += n + "\n";
  return all;
}

// A float64 relative comparison of losses and final parameters with the
// single-process reference (steps `first` .. end).
void expect_equals_reference(const std::vector<double>& losses, int first, double checksum,
                             const TrainResult& ref) {
  ASSERT_EQ(losses.size() + first, ref.losses.size());
  for (size_t s = 0; s < losses.size(); ++s)
    EXPECT_NEAR(losses[s], ref.losses[s + first], 1e-9 * std::abs(ref.losses[s + first]))
        << "step " << s + first;
  EXPECT_NEAR(checksum, ref.checksum, 1e-9 * std::max(1.0, std::abs(ref.checksum)));
}

// ---- checkpoints, ranks as threads ---------------------------------------

// One folder with checkpoints step-2 and step-4 of `small()`, made once; each
// test copies it and damages the copy.
const fs::path& pristine_checkpoints() {
  static fs::path dir = [] {
    auto d = fresh_dir("pristine");
    TrainConfig c = small();
    c.checkpoint_dir = (d / "ckpt").string();
    c.save_every = 2;
    run_threads(c);
    return d / "ckpt";
  }();
  return dir;
}

struct Damaged {
  TrainConfig config;
  fs::path dir;
  explicit Damaged(const std::string& name) {
    dir = fresh_dir(name) / "ckpt";
    fs::copy(pristine_checkpoints(), dir, fs::copy_options::recursive);
    config = small(6);  // more steps than saved: something is left to train
    config.checkpoint_dir = dir.string();
    config.resume = true;
  }
  fs::path file(int step, int rank) const {
    return dir / ("step-" + std::to_string(step)) / ("rank-" + std::to_string(rank) + ".pt");
  }
  void flip_byte(const fs::path& p, size_t offset) const {
    std::string t = read_text(p);
    ASSERT_LT(offset, t.size());
    t[offset] = static_cast<char>(t[offset] ^ 0x10);
    write_text(p, t);
  }
};

TEST(CheckpointFaults, IntactFolderResumesFromTheNewestStep) {
  Damaged d("intact");
  auto p = plan(d.config);
  EXPECT_EQ(p.step, 4);
  EXPECT_TRUE(p.notes.empty()) << notes_of(p);
}

TEST(CheckpointFaults, AFlippedBitAnywhereFallsBackToTheNewestVerifiedStep) {
  for (size_t where : {size_t(40), size_t(100), size_t(0)}) {  // header line, header, payload
    Damaged d("flip" + std::to_string(where));
    const auto f = d.file(4, 1);
    const size_t offset = where == 0 ? fs::file_size(f) / 2 : where;
    d.flip_byte(f, offset);
    auto p = plan(d.config);
    EXPECT_EQ(p.step, 2) << "byte " << offset;
    EXPECT_TRUE(has_note(p, "skipped step-4: rank-1.pt")) << notes_of(p);
  }
  // A flipped bit in the payload: the checksum names it.
  Damaged d("flip-sum");
  d.flip_byte(d.file(4, 0), fs::file_size(d.file(4, 0)) - 100);
  auto p = plan(d.config);
  EXPECT_EQ(p.step, 2);
  EXPECT_TRUE(has_note(p, "rank-0.pt is damaged: its checksum is")) << notes_of(p);
}

TEST(CheckpointFaults, StaleAndForeignFilesAreNotLoaded) {
  {  // An older step's rank file copied into the newest step.
    Damaged d("stale");
    fs::copy_file(d.file(2, 0), d.file(4, 0), fs::copy_options::overwrite_existing);
    auto p = plan(d.config);
    EXPECT_EQ(p.step, 2);
    EXPECT_TRUE(has_note(p, "holds step 2's state, not step 4's (a stale copy?)")) << notes_of(p);
  }
  {  // Another rank's file in its place.
    Damaged d("misplaced");
    fs::copy_file(d.file(4, 0), d.file(4, 1), fs::copy_options::overwrite_existing);
    auto p = plan(d.config);
    EXPECT_EQ(p.step, 2);
    EXPECT_TRUE(has_note(p, "holds rank 0's state")) << notes_of(p);
  }
  {  // A file the marker does not vouch for (a copy from another run of the same step).
    Damaged d("foreign");
    std::string marker = read_text(d.dir / "step-4" / "COMPLETE");
    auto at = marker.find("rank 1 ") + 7;
    marker[at] = marker[at] == '0' ? '1' : '0';
    write_text(d.dir / "step-4" / "COMPLETE", marker);
    auto p = plan(d.config);
    EXPECT_EQ(p.step, 2);
    EXPECT_TRUE(has_note(p, "not the file the checkpoint was completed with")) << notes_of(p);
  }
  {  // A truncated file.
    Damaged d("truncated");
    fs::resize_file(d.file(4, 1), fs::file_size(d.file(4, 1)) - 10);
    EXPECT_EQ(plan(d.config).step, 2);
  }
}

TEST(CheckpointFaults, MissingMarkersAndLatestAreSaid) {
  {
    Damaged d("no-marker");
    fs::remove(d.dir / "step-4" / "COMPLETE");
    auto p = plan(d.config);
    EXPECT_EQ(p.step, 2);
    EXPECT_TRUE(has_note(p, "COMPLETE marker is missing (the save did not finish)")) << notes_of(p);
  }
  {  // 'latest' unreadable or naming a missing step: the markers decide.
    Damaged d("latest");
    write_text(d.dir / "latest", "\x01garbage");
    auto p = plan(d.config);
    EXPECT_EQ(p.step, 4);
    EXPECT_TRUE(has_note(p, "'latest' is missing or unreadable")) << notes_of(p);
    write_text(d.dir / "latest", "9\n");
    p = plan(d.config);
    EXPECT_EQ(p.step, 4);
    EXPECT_TRUE(has_note(p, "'latest' names step-9")) << notes_of(p);
  }
  {  // Nothing usable: an error that lists each step's problem, never step 0.
    Damaged d("none");
    fs::remove(d.dir / "step-4" / "COMPLETE");
    fs::remove(d.file(2, 1));
    std::string e = error_of([&] { plan(d.config); });
    EXPECT_NE(e.find("no usable checkpoint"), std::string::npos) << e;
    EXPECT_NE(e.find("step-4: its COMPLETE marker is missing"), std::string::npos) << e;
    EXPECT_NE(e.find("step-2: rank-1.pt is missing"), std::string::npos) << e;
    d.config.resume = false;
    d.config.resume_or_start = true;  // damaged checkpoints are not "none"
    EXPECT_NE(error_of([&] { plan(d.config); }).find("no usable checkpoint"), std::string::npos);
  }
}

TEST(CheckpointFaults, OtherSettingsAreRefusedNamingFileAndOption) {
  struct Case {
    std::function<void(TrainConfig&)> change;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {[](TrainConfig& c) { c.model.heads = 4; }, "--heads was 2, this run has 4"},
      {[](TrainConfig& c) { c.model.d_model = 32; }, "--d-model was 16, this run has 32"},
      {[](TrainConfig& c) { c.model.layers = 8; }, "--layers was 4, this run has 8"},
      {[](TrainConfig& c) { c.optimizer = "sgd"; }, "--optimizer was adamw, this run has sgd"},
      {[](TrainConfig& c) { c.model.dtype = torch::kFloat32; },
       "--dtype was float64, this run has float32"},
      {[](TrainConfig& c) { c.nproc = 4; }, "--nproc was 2, this run has 4"},
      {[](TrainConfig& c) { c.model.tied_head = true; }, "--untied was yes, this run has no"},
      {[](TrainConfig& c) {
         c.schedule = "dualpipev";
         c.microbatches = 4;
       },
       "stages was"},
  };
  Damaged d("settings");
  for (const auto& k : cases) {
    TrainConfig c = d.config;
    k.change(c);
    std::string e = error_of([&] { plan(c); });
    EXPECT_NE(e.find(k.expected), std::string::npos) << e;
    EXPECT_NE(e.find("step-4/rank-0.pt"), std::string::npos) << e;
  }
  // What may change is said, and the learning rate of this run is used.
  TrainConfig c = d.config;
  c.lr = 0.5;
  c.schedule = "1f1b";  // the same stages on the same ranks
  c.seed = 6;
  auto p = plan(c);
  EXPECT_EQ(p.step, 4);
  EXPECT_TRUE(has_note(p, "--lr was 0.01")) << notes_of(p);
  EXPECT_TRUE(has_note(p, "--schedule was zb-h1")) << notes_of(p);
  EXPECT_TRUE(has_note(p, "--seed was 5")) << notes_of(p);
  auto sched = c.build_schedule();
  std::map<std::string, std::vector<torch::Tensor>> named;
  std::vector<torch::Tensor> params;
  for (int st : sched.stages_of_rank(0))
    for (const auto& item :
         hp::models::build_chunk(c.model, sched.stage_chunk[st], sched.num_chunks, c.seed)
             ->named_parameters()) {
      named[item.key()].push_back(item.value());
      params.push_back(item.value());
    }
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(c.lr));
  hp::train::load_checkpoint(c, fingerprint(c), 4, 0, named, opt);
  EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 0.5);
  torch::serialize::InputArchive saved;
  hp::train::read_checkpoint_archive(d.dir.string(), 4, 0, 2, saved);
  for (auto& [name, t] : named) {
    std::string key = "p_" + std::regex_replace(name, std::regex("\\."), "_");
    torch::Tensor s;
    ASSERT_TRUE(saved.try_read(key, s)) << name;
    EXPECT_TRUE(torch::equal(s, t[0])) << name;
  }
}

// The fallback loses nothing: resuming from the newest verified step (after
// the newest was damaged) trains on to exactly the single-process result.
TEST(CheckpointFaults, ResumingAfterDamageEqualsSingleProcessTraining) {
  Damaged d("resume");
  d.flip_byte(d.file(4, 0), fs::file_size(d.file(4, 0)) / 2);
  TrainConfig c = d.config;
  c.steps = 6;
  c.save_every = 2;
  auto ranks = run_threads(c);
  EXPECT_EQ(ranks[0].first_step, 2);
  TrainConfig whole = small(6);
  expect_equals_reference(ranks[0].losses, 2, ranks[0].checksum, hp::train::train_reference(whole));
  // The damaged step was saved again, and the folder resumes from step 6.
  c.steps = 7;
  auto p = plan(c);
  EXPECT_EQ(p.step, 6);
  EXPECT_TRUE(p.notes.empty()) << notes_of(p);
}

TEST(CheckpointFaults, ResumeNeedsACheckpointUnlessAskedToStartFresh) {
  auto dir = fresh_dir("empty") / "ckpt";
  TrainConfig c = small();
  c.checkpoint_dir = dir.string();
  c.resume = true;
  std::string e = error_of([&] { plan(c); });
  EXPECT_NE(e.find("--resume: --checkpoint-dir"), std::string::npos) << e;
  EXPECT_NE(e.find("does not exist"), std::string::npos) << e;
  EXPECT_NE(e.find("--resume-or-start"), std::string::npos) << e;
  fs::create_directories(dir);
  EXPECT_NE(error_of([&] { plan(c); }).find("holds no checkpoint"), std::string::npos);
  c.resume = false;
  c.resume_or_start = true;
  auto p = plan(c);
  EXPECT_EQ(p.step, 0);
  EXPECT_TRUE(has_note(p, "starting from step 0")) << notes_of(p);
  // A run that saves without resuming never overwrites checkpoints.
  Damaged d("no-overwrite");
  d.config.resume = false;
  d.config.save_every = 2;
  e = error_of([&] { plan(d.config); });
  EXPECT_NE(e.find("already holds checkpoints (the newest is step-4)"), std::string::npos) << e;
  // Nothing left to train.
  d.config.resume = true;
  e = error_of([&] {
    TrainConfig done = d.config;
    done.steps = 4;
    plan(done);
  });
  EXPECT_NE(e.find("nothing is left to train"), std::string::npos) << e;
}

TEST(CheckpointFaults, OneRunPerFolderAndLeftoversOfAKilledSaveRemoved) {
  auto dir = fresh_dir("lock") / "ckpt";
  fs::create_directories(dir / "step-2");
  write_text(dir / "step-2" / "rank-0.pt.tmp.12345-0", "half a file");
  {
    hp::train::CheckpointLock first(dir.string());
    EXPECT_FALSE(fs::exists(dir / "step-2" / "rank-0.pt.tmp.12345-0"));
    std::string e = error_of([&] { hp::train::CheckpointLock second(dir.string()); });
    EXPECT_NE(e.find("is in use by another run (pid " + std::to_string(::getpid())),
              std::string::npos)
        << e;
  }
  EXPECT_NO_THROW(hp::train::CheckpointLock again(dir.string()));  // released with its holder
}

TEST(CheckpointFaults, ANonFiniteLossStopsTheRunNamingTheStep) {
  TrainConfig c = small(8);
  c.optimizer = "sgd";
  c.lr = 1e12;  // diverges within a few steps
  auto dir = fresh_dir("nan");
  c.checkpoint_dir = (dir / "ckpt").string();
  c.save_every = 1;
  std::string e = error_of([&] { run_threads(c); });
  std::smatch m;
  ASSERT_TRUE(std::regex_search(e, m, std::regex("step ([0-9]+): the loss is (nan|inf|-inf)")))
      << e;
  const int step = std::stoi(m[1]);
  EXPECT_LT(step, 8) << e;
  // Every step before it was saved; the one that diverged was not.
  EXPECT_TRUE(fs::exists(dir / "ckpt" / ("step-" + std::to_string(step - 1)) / "COMPLETE") ||
              step == 1);
  EXPECT_FALSE(fs::exists(dir / "ckpt" / ("step-" + std::to_string(step))));
}

// ---- inputs checked before any work, in process ----------------------------

TEST(InputFaults, ConfigurationBoundsSayTheLimitAndWhy) {
  struct Case {
    std::function<void(TrainConfig&)> change;
    std::string expected;
  };
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<Case> cases = {
      {[&](TrainConfig& c) { c.lr = inf; }, "--lr must be a finite positive number"},
      {[](TrainConfig& c) { c.lr = std::nan(""); }, "--lr must be a finite positive number"},
      {[](TrainConfig& c) { c.lr = -1; }, "--lr must be a finite positive number"},
      {[&](TrainConfig& c) { c.weight_decay = inf; }, "--weight-decay must be a finite"},
      {[](TrainConfig& c) { c.nproc = 100000; }, "--nproc 100000 is out of range"},
      {[](TrainConfig& c) { c.microbatches = 1000000000; }, "too many to schedule in seconds"},
      {[](TrainConfig& c) {
         c.schedule = "interleaved-1f1b";
         c.chunks = 1000000;
       },
       "too many to schedule in seconds"},
      {[](TrainConfig& c) { c.save_every = -1; }, "--save-every must be at least 1"},
      {[](TrainConfig& c) { c.timeout_s = 0; }, "--timeout must be 1 to 604800 seconds"},
      {[](TrainConfig& c) { c.data = "/dev/zero"; }, "is not a regular file or folder"},
      {[](TrainConfig& c) { c.trace = "/nonexistent-hp-folder/t.json"; },
       "--trace '/nonexistent-hp-folder/t.json': the folder '/nonexistent-hp-folder' does not "
       "exist"},
      {[](TrainConfig& c) { c.report = fs::temp_directory_path().string(); },
       "is a folder; give a file name"},
      {[](TrainConfig& c) { c.report = "/dev/null"; }, "is not a regular file"},
      {[](TrainConfig& c) {
         c.resume = true;
         c.resume_or_start = true;
         c.checkpoint_dir = "x";
       },
       "exclude each other"},
  };
  for (const auto& k : cases) {
    TrainConfig c = small();
    k.change(c);
    auto t0 = Clock::now();
    std::string e = error_of([&] { c.validate(); });
    EXPECT_NE(e.find(k.expected), std::string::npos) << e;
    EXPECT_LT(seconds_since(t0), 1.0) << e;
  }
  // Memory: a lower bound against what the machine has.
  TrainConfig huge = small();
  huge.model.d_model = 1 << 20;
  huge.model.heads = 1;
  std::string e = error_of([&] { huge.check_memory(2); });
  EXPECT_NE(e.find("this run needs at least"), std::string::npos) << e;
  EXPECT_NE(e.find("is available"), std::string::npos) << e;
  EXPECT_NO_THROW(small().check_memory(2));
}

TEST(InputFaults, DataIsBoundedAndDevicesAreRefusedUnread) {
  auto dir = fresh_dir("data");
  const std::string fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& p : {std::string("/dev/zero"), std::string("/dev/urandom"), fifo}) {
    std::string e = error_of([&] { hp::models::check_corpus(p, 8); });
    EXPECT_NE(e.find("is not a regular file or folder"), std::string::npos) << p << ": " << e;
    hp::models::ModelSpec spec;
    e = error_of([&] { hp::models::Dataset(spec, p, 2, 0); });
    EXPECT_NE(e.find("is not a regular file or folder"), std::string::npos) << p << ": " << e;
  }
  // A sparse file one byte over the limit: refused by its size, unread.
  const auto big = dir / "big.txt";
  write_text(big, "x");
  fs::resize_file(big, hp::models::kMaxCorpusBytes + 1);
  auto t0 = Clock::now();
  std::string e = error_of([&] { hp::models::check_corpus(big.string(), 8); });
  EXPECT_NE(e.find("holds more than 1024 MiB of text, the limit"), std::string::npos) << e;
  EXPECT_LT(seconds_since(t0), 1.0);
  fs::remove_all(dir);
}

// ---- real processes ----------------------------------------------------

// The "Why" list of issue 15, re-run: each a clear error, exit code 1, no rank
// started, well within 5 s (the time includes loading LibTorch into `hp`).
TEST(InputFaults, EveryBadInputOfTheIssueIsRefusedAtOnce) {
  struct Case {
    std::string args, expected;
  };
  // `hp train` flags of small(2) changed by `change`, then `extra`.
  auto with = [](const std::function<void(TrainConfig&)>& change, const std::string& extra) {
    TrainConfig c = small(2);
    change(c);
    return train_flags(c) + extra;
  };
  auto same = [](TrainConfig&) {};
  const std::vector<Case> cases = {
      {with([](TrainConfig& c) { c.microbatches = 1000000000; }, ""),
       "too many to schedule in seconds"},
      {with([](TrainConfig& c) { c.nproc = 100000; }, ""),
       "--nproc 100000 is out of range: 1 to 4096 ranks"},
      {with(
           [](TrainConfig& c) {
             c.nproc = 1000;
             c.model.layers = 1000;
             c.schedule = "gpipe";
           },
           ""),
       "1000 rank processes take"},
      {with(same, " --data /dev/zero"), "'/dev/zero' is not a regular file or folder"},
      {with(same, " --trace /nonexistent-hp/trace.json"),
       "the folder '/nonexistent-hp' does not exist"},
      {with(same, " --report /dev/full"), "is not a regular file"},
      {with([](TrainConfig& c) { c.lr = std::numeric_limits<double>::infinity(); }, ""),
       "--lr must be a finite positive number, not inf"},
      {with(same, " --weight-decay nan"), "--weight-decay must be a finite number"},
      {"train --seed -1", "--seed '-1' is not a whole number from 0 to 18446744073709551615"},
      {"train --seed 18446744073709551616", "is not a whole number"},
      {"train --batch -8", "--batch must be at least 1, not -8"},
      {with(same, " --save-every -1 --checkpoint-dir /tmp"),
       "--save-every must be at least 1, not -1"},
      {with([](TrainConfig& c) { c.schedule = "1f1b"; }, " -v 3"),
       "--chunks applies only to the interleaved schedules"},
      {"train --graph -s foo", "--schedule does not apply to --graph"},
      {"train --no-shard", "--no-shard applies only to --graph"},
      {"train --model mlp --heads 4", "--heads applies only to --model gpt"},
      {with(same, " --checkpoint-dir /tmp/x"), "--checkpoint-dir does nothing without"},
      {with(same, " --resume --checkpoint-dir /nonexistent-hp/ckpt"), "does not exist"},
  };
  // What `hp` itself takes to start (loading LibTorch and its CUDA
  // libraries: seconds on a loaded two-core machine): each refusal must come
  // within 5 s of that.
  const double startup = run_hp("train --help").seconds;
  // Two at a time: each run is mostly the start of `hp`.
  for (size_t i = 0; i < cases.size(); i += 2) {
    std::vector<std::future<HpRun>> runs;
    for (size_t k = i; k < std::min(cases.size(), i + 2); ++k)
      runs.push_back(std::async(std::launch::async, [&, k] { return run_hp(cases[k].args); }));
    for (size_t k = i; k < std::min(cases.size(), i + 2); ++k) {
      HpRun r = runs[k - i].get();
      EXPECT_EQ(r.exit_code, 1) << cases[k].args << "\n" << r.output;
      EXPECT_NE(r.output.find("hp: error: "), std::string::npos) << r.output;
      EXPECT_NE(r.output.find(cases[k].expected), std::string::npos) << cases[k].args << "\n"
                                                                     << r.output;
      EXPECT_EQ(r.output.find("hp train: gpt,"), std::string::npos) << "no rank may start";
      EXPECT_LT(r.seconds, startup + 5.0) << cases[k].args << " (start-up " << startup << " s)";
    }
  }
}

// A kill while rank 1 writes checkpoint step-4: the run fails naming it; the
// next --resume says step-4 is incomplete, resumes from step-2, removes the
// half-written file and trains on to the single-process result; resuming
// with other settings is refused before any rank starts.
TEST(ProcessFaults, KillDuringSaveLosesNothing) {
  TrainConfig c = small(4);
  auto dir = fresh_dir("kill-save");
  const std::string ckpt = (dir / "ckpt").string();
  HpRun killed =
      run_hp(train_flags(c) + " --save-every 2 --checkpoint-dir " + ckpt, "HP_FAULT_KILL=1:save:4");
  EXPECT_EQ(killed.exit_code, 128 + SIGKILL) << killed.output;
  EXPECT_TRUE(
      std::regex_search(killed.output, std::regex("rank 1 \\(pid [0-9]+\\): killed by SIGKILL")))
      << killed.output;
  EXPECT_TRUE(fs::exists(dir / "ckpt" / "step-2" / "COMPLETE"));
  EXPECT_FALSE(fs::exists(dir / "ckpt" / "step-4" / "COMPLETE"));
  bool leftover = false;
  for (const auto& e : fs::directory_iterator(dir / "ckpt" / "step-4"))
    leftover |= e.path().filename().string().find(".tmp.") != std::string::npos;
  EXPECT_TRUE(leftover) << "the kill should leave a half-written temporary file";

  HpRun resumed = run_hp(train_flags(c) + " --resume --checkpoint-dir " + ckpt + " --report " +
                         (dir / "report.json").string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("skipped step-4: its COMPLETE marker is missing"),
            std::string::npos)
      << resumed.output;
  EXPECT_NE(resumed.output.find("resuming from"), std::string::npos) << resumed.output;
  std::ifstream in(dir / "report.json");
  auto report = nlohmann::json::parse(in);
  EXPECT_EQ(report["first_step"].get<int>(), 2);
  auto ref = hp::train::train_reference(c);
  expect_equals_reference(report["loss"].get<std::vector<double>>(), 2,
                          report["parameter_checksum"].get<double>(), ref);
  for (const auto& e : fs::recursive_directory_iterator(dir / "ckpt"))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();

  // Other settings on resume: refused before any rank starts, naming file and option.
  TrainConfig heads = c;
  heads.steps = 6;
  heads.model.heads = 4;
  TrainConfig longer = c;
  longer.steps = 6;
  for (const auto& [args, expected] : std::vector<std::pair<std::string, std::string>>{
           {train_flags(heads), "--heads was 2, this run has 4"},
           {train_flags(longer) + " --optimizer sgd", "--optimizer was adamw, this run has sgd"}}) {
    HpRun r = run_hp(args + " --resume --checkpoint-dir " + ckpt);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("step-4/rank-0.pt"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("hp train: gpt,"), std::string::npos) << r.output;
  }
  fs::remove_all(dir);
}

// A child we can read, signal and wait for.
struct Child {
  pid_t pid = -1;
  int out = -1;  // its stdout and stderr
  std::string output;
  void read_until(const std::string& text, double timeout_s) {
    auto t0 = Clock::now();
    while (output.find(text) == std::string::npos) {
      const int left = int((timeout_s - seconds_since(t0)) * 1000);
      pollfd p{out, POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, left) <= 0) return;
      char buf[4096];
      ssize_t n = ::read(out, buf, sizeof buf);
      if (n <= 0) return;
      output.append(buf, size_t(n));
    }
  }
};

Child spawn(const std::vector<std::string>& args) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  Child c;
  c.pid = ::fork();
  if (c.pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    std::vector<char*> argv;
    for (const auto& a : args)
      argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  c.out = fds[0];
  return c;
}

std::vector<pid_t> children_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  std::vector<pid_t> out;
  pid_t p;
  while (in >> p)
    out.push_back(p);
  return out;
}

// Waits (poll on a pidfd, no sleeping) until `pid` has exited; false after
// `timeout_ms`.
bool wait_exit(int pidfd, int timeout_ms) {
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, timeout_ms) == 1;
}

std::vector<std::string> split_args(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  std::string w;
  while (in >> w)
    out.push_back(w);
  return out;
}

// kill -9 of `hp train` while its ranks train: a second run on the same
// folder is refused at once while the first lives; after the kill both ranks
// are gone within a second (they die with their parent) and the folder still
// resumes from a verified step.
TEST(ProcessFaults, KillOfTheLauncherLeavesNoOrphanAndTheLockRefusesASecondRun) {
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);  // orphans come to us, to be timed
  TrainConfig c = small(100000);
  auto dir = fresh_dir("orphans");
  const std::string ckpt = (dir / "ckpt").string();
  std::vector<std::string> args = {HP_BIN};
  for (const auto& a : split_args(train_flags(c) + " --save-every 1 --checkpoint-dir " + ckpt))
    args.push_back(a);
  Child run = spawn(args);
  run.read_until("hp train: gpt,", 30);  // printed once the folder is locked
  ASSERT_NE(run.output.find("hp train: gpt,"), std::string::npos) << run.output;

  const double startup = run_hp("train --help").seconds;  // hp's own start (LibTorch)
  HpRun second = run_hp(train_flags(small(4)) + " --save-every 1 --checkpoint-dir " + ckpt);
  EXPECT_EQ(second.exit_code, 1) << second.output;
  EXPECT_NE(second.output.find("is in use by another run (pid " + std::to_string(run.pid)),
            std::string::npos)
      << second.output;
  EXPECT_LT(second.seconds, startup + 5.0) << "start-up " << startup << " s";

  // Wait for the first checkpoint: the ranks are training.
  const auto marker = dir / "ckpt" / "step-1" / "COMPLETE";
  auto t0 = Clock::now();
  while (!fs::exists(marker) && seconds_since(t0) < 60)
    run.read_until("\x01", 0.05);  // waits on the child's output, 50 ms at a time
  ASSERT_TRUE(fs::exists(marker)) << run.output;
  std::vector<pid_t> ranks = children_of(run.pid);
  ASSERT_EQ(ranks.size(), 2u) << run.output;
  std::vector<int> pidfds;
  for (pid_t r : ranks)
    pidfds.push_back(int(::syscall(SYS_pidfd_open, r, 0)));

  ::kill(run.pid, SIGKILL);
  auto killed_at = Clock::now();
  ::waitpid(run.pid, nullptr, 0);
  for (size_t i = 0; i < ranks.size(); ++i) {
    ASSERT_GE(pidfds[i], 0);
    EXPECT_TRUE(wait_exit(pidfds[i], 5000)) << "rank " << i << " outlived its launcher";
    ::close(pidfds[i]);
    ::waitpid(ranks[i], nullptr, 0);  // ours now (subreaper)
  }
  const double gone = seconds_since(killed_at);
  EXPECT_LT(gone, 1.0) << "ranks must die with their parent";
  ::close(run.out);
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 0), 0);

  // Nothing lost: the folder resumes from a verified step.
  TrainConfig again = c;
  again.checkpoint_dir = ckpt;
  again.resume = true;
  EXPECT_GE(plan(again).step, 1);
  fs::remove_all(dir);
}

// A rank that dies before the ranks connect stops the run within seconds of
// its death, not after the 60 s communication timeout.
TEST(ProcessFaults, ARankDeadBeforeConnectingStopsTheRunAtOnce) {
  TrainConfig c = small(2);
  c.timeout_s = 60;
  HpRun r = run_hp(train_flags(c), "HP_FAULT_KILL=1:connect");
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.output;
  std::smatch died, stopped;
  ASSERT_TRUE(std::regex_search(
      r.output, died, std::regex("rank 1 \\(pid [0-9]+\\): killed by SIGKILL after ([0-9.]+) s")))
      << r.output;
  ASSERT_TRUE(std::regex_search(r.output, stopped,
                                std::regex("rank 0 \\(pid [0-9]+\\): .* after ([0-9.]+) s")))
      << r.output;
  EXPECT_LT(std::stod(stopped[1]) - std::stod(died[1]), 5.0) << r.output;
  EXPECT_LT(r.seconds, 20.0) << r.output;
}

int listening_socket(int* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 4) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    return -1;
  *port = ntohs(a.sin_port);
  return fd;
}

// `hp launch`: a taken port is refused before any rank starts; a failed rank
// stops the others within the grace period; kill -9 of the launcher takes its
// ranks with it.
TEST(ProcessFaults, LaunchFailsFastAndLeavesNoOrphan) {
  const double startup = run_hp("launch --help").seconds;  // hp's own start (LibTorch)
  int port = 0;
  int fd = listening_socket(&port);
  ASSERT_GE(fd, 0);
  HpRun taken = run_hp("launch -n 2 --port " + std::to_string(port) + " -- sleep 60");
  ::close(fd);
  EXPECT_EQ(taken.exit_code, 1) << taken.output;
  EXPECT_NE(taken.output.find("port " + std::to_string(port) + " on 127.0.0.1 is in use"),
            std::string::npos)
      << taken.output;
  EXPECT_LT(taken.seconds, startup + 5.0) << "start-up " << startup << " s";

  HpRun failed =
      run_hp("launch -n 2 -- sh -c 'if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 60'");
  EXPECT_EQ(failed.exit_code, 3) << failed.output;
  EXPECT_NE(failed.output.find("rank 1 failed (exit 3); the other ranks were stopped"),
            std::string::npos)
      << failed.output;
  EXPECT_NE(failed.output.find("terminated by the launcher (SIGTERM)"), std::string::npos)
      << failed.output;
  EXPECT_LT(failed.seconds, startup + 10.0) << failed.output;

  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  Child launch = spawn({HP_BIN, "launch", "-n", "2", "--", "sleep", "60"});
  std::vector<pid_t> ranks;
  auto t0 = Clock::now();
  while (ranks.size() < 2 && seconds_since(t0) < 20) {
    launch.read_until("\x01", 0.02);
    ranks = children_of(launch.pid);
  }
  ASSERT_EQ(ranks.size(), 2u);
  std::vector<int> pidfds;
  for (pid_t r : ranks)
    pidfds.push_back(int(::syscall(SYS_pidfd_open, r, 0)));
  ::kill(launch.pid, SIGKILL);
  ::waitpid(launch.pid, nullptr, 0);
  for (size_t i = 0; i < ranks.size(); ++i) {
    EXPECT_TRUE(wait_exit(pidfds[i], 2000)) << "rank " << i << " outlived hp launch";
    ::close(pidfds[i]);
    ::waitpid(ranks[i], nullptr, 0);
  }
  ::close(launch.out);
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 0), 0);
}

}  // namespace
