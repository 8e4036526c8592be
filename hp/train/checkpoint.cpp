// Checkpoint files (NOTE [Checkpoint integrity]): the header and its
// checksum, atomic writes, verification against the marker and this run's
// fingerprint, the resume plan, the folder lock; and the output-path checks.
#include "hp/train/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "hp/launch/launcher.h"
#include "hp/schedule/text.h"

namespace hp::train {
namespace {

namespace fs = std::filesystem;

constexpr const char* kMagic = "hyperparallel checkpoint v1";
constexpr const char* kMarkerMagic = "hyperparallel checkpoint complete v1";
constexpr size_t kMaxHeaderBytes = size_t(1) << 16;
constexpr const char* kTempInfix = ".tmp.";  // write_text_file's temporaries

std::string shown(const std::string& s) {
  return schedule::escape_bytes(s, 200);
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

bool parse_hex64(const std::string& s, uint64_t* v) {
  if (s.size() != 16) return false;
  uint64_t out = 0;
  for (char c : s) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    out = out << 4 | uint64_t(d);
  }
  *v = out;
  return true;
}

// A non-negative decimal integer that fits in int64, nothing else.
bool parse_count(const std::string& s, int64_t* v) {
  if (s.empty() || s.size() > 18) return false;
  int64_t out = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    out = out * 10 + (c - '0');
  }
  *v = out;
  return true;
}

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

std::string archive_key(const std::string& name) {
  std::string k = "p_";
  for (char ch : name)
    k += ch == '.' ? '_' : ch;  // archive keys may not hold '.'
  return k;
}

std::string error_text(int err) {
  return std::strerror(err);
}

// Checkpoint files are written whole (NOTE [Output files are whole] in
// hp/schedule/text.cpp); `halfway` is the fault point of a kill during a save.
void write_atomically(const std::string& path, const std::string& data,
                      const std::function<void()>& halfway = {}) {
  schedule::write_text_file(path, data, halfway);
}

// The whole file, or false when it cannot be opened.
bool read_whole(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return true;
}

std::string rank_file(const std::string& dir, int step, int rank) {
  return checkpoint_step_dir(dir, step) + "/rank-" + std::to_string(rank) + ".pt";
}

std::string marker_file(const std::string& dir, int step) {
  return checkpoint_step_dir(dir, step) + "/COMPLETE";
}

// The step-N folders of `dir`, newest first.
std::vector<int> list_steps(const std::string& dir) {
  std::vector<int> steps;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return steps;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    int64_t n = 0;
    if (name.rfind("step-", 0) == 0 && parse_count(name.substr(5), &n) && n > 0 &&
        n <= std::numeric_limits<int>::max() && e.is_directory(ec))
      steps.push_back(static_cast<int>(n));
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

// One rank's file, parsed.
struct RankFile {
  uint64_t checksum = 0;  // as stated in (and verified against) the file
  int64_t step = -1, rank = -1, world = -1;
  std::vector<std::pair<std::string, std::string>> must, note;
  std::string payload;
};

// The file's problem ("" when it verifies); fills `out`. Does not compare
// the fingerprint.
std::string read_rank_file(const std::string& path, int step, int rank, int world, RankFile* out) {
  const std::string name = fs::path(path).filename().string();
  std::string text;
  if (!read_whole(path, &text)) return name + " is missing";
  size_t eol1 = text.find('\n');
  if (eol1 == std::string::npos || text.compare(0, eol1, kMagic) != 0)
    return name + " does not start with a checkpoint header (damaged, or not written by hp)";
  size_t eol2 = text.find('\n', eol1 + 1);
  const std::string sum_line =
      eol2 == std::string::npos ? "" : text.substr(eol1 + 1, eol2 - eol1 - 1);
  if (sum_line.rfind("checksum ", 0) != 0 || !parse_hex64(sum_line.substr(9), &out->checksum))
    return name + " has a damaged header (no checksum line)";
  const std::string_view body(text.data() + eol2 + 1, text.size() - eol2 - 1);
  const uint64_t actual = checksum64(body);
  if (actual != out->checksum)
    return name + " is damaged: its checksum is " + hex64(actual) + ", the file says " +
           hex64(out->checksum);
  // The header lines, up to an empty line.
  size_t pos = 0;
  int64_t payload = -1;
  for (;;) {
    size_t eol = body.find('\n', pos);
    if (eol == std::string::npos || eol > kMaxHeaderBytes)
      return name + " has a damaged header (no end)";
    std::string line(body.substr(pos, eol - pos));
    pos = eol + 1;
    if (line.empty()) break;
    size_t sp = line.find(' ');
    const std::string key = line.substr(0, sp);
    const std::string value = sp == std::string::npos ? "" : line.substr(sp + 1);
    if (key == "must" || key == "note") {
      size_t sp2 = value.find(' ');
      (key == "must" ? out->must : out->note)
          .emplace_back(value.substr(0, sp2),
                        sp2 == std::string::npos ? "" : value.substr(sp2 + 1));
    } else if (key == "step" || key == "rank" || key == "world_size" || key == "payload") {
      int64_t v = 0;
      if (!parse_count(value, &v)) return name + " has a damaged header (" + key + ")";
      (key == "step"         ? out->step
       : key == "rank"       ? out->rank
       : key == "world_size" ? out->world
                             : payload) = v;
    }
  }
  if (payload < 0 || static_cast<size_t>(payload) != body.size() - pos)
    return name + " is truncated or has extra bytes";
  if (out->step != step)
    return name + " holds step " + std::to_string(out->step) + "'s state, not step " +
           std::to_string(step) + "'s (a stale copy?)";
  if (out->rank != rank)
    return name + " holds rank " + std::to_string(out->rank) + "'s state (a misplaced copy?)";
  (void)world;  // a different world size is a settings mismatch (--nproc), not damage
  out->payload = std::string(body.substr(pos));
  return "";
}

// The marker's problem for `rank`'s file ("" when it agrees).
std::string check_marker(const std::string& dir, int step, int world, int rank, uint64_t checksum) {
  std::string text;
  if (!read_whole(marker_file(dir, step), &text))
    return "its COMPLETE marker is missing (the save did not finish)";
  std::istringstream in(text);
  std::string line;
  int64_t s = -1, w = -1;
  std::map<int64_t, uint64_t> sums;
  if (!std::getline(in, line) || line != kMarkerMagic) return "its COMPLETE marker is damaged";
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string key, a, b;
    ls >> key >> a >> b;
    int64_t v = 0;
    uint64_t sum = 0;
    if (key == "step" && parse_count(a, &v)) {
      s = v;
    } else if (key == "world_size" && parse_count(a, &v)) {
      w = v;
    } else if (key == "rank" && parse_count(a, &v) && parse_hex64(b, &sum)) {
      sums[v] = sum;
    } else {
      return "its COMPLETE marker is damaged";
    }
  }
  if (s != step || w != world) return "its COMPLETE marker is damaged or belongs to another step";
  auto it = sums.find(rank);
  if (it == sums.end()) return "its COMPLETE marker does not list rank " + std::to_string(rank);
  if (it->second != checksum)
    return "rank-" + std::to_string(rank) +
           ".pt is not the file the checkpoint was completed with (its checksum differs from "
           "COMPLETE's record: a file copied in from elsewhere?)";
  return "";
}

// Throws when `file`'s `must` fields differ from this run's; appends a note
// per differing `note` field.
void compare_fingerprint(const std::string& path, const RankFile& file,
                         const CheckpointFingerprint& fp, std::vector<std::string>* notes) {
  auto saved_value = [](const std::vector<std::pair<std::string, std::string>>& list,
                        const std::string& key) -> const std::string* {
    for (const auto& [k, v] : list)
      if (k == key) return &v;
    return nullptr;
  };
  std::string diffs;
  int count = 0;
  for (const auto& [key, value] : fp.must) {
    const std::string* saved = saved_value(file.must, key);
    if (saved && *saved == value) continue;
    diffs += std::string(count++ ? "; " : "") + key + " " +
             (saved ? "was " + shown(*saved) : "was not recorded") + ", this run has " +
             shown(value);
  }
  // A setting the file records and this run does not (--documents is
  // recorded only where it is on).
  for (const auto& [key, saved] : file.must)
    if (saved_value(fp.must, key) == nullptr)
      diffs +=
          std::string(count++ ? "; " : "") + key + " was " + shown(saved) + ", this run has none";
  if (count > 0) {
    const std::string* sched = saved_value(file.note, "--schedule");
    throw std::invalid_argument(
        "cannot resume from " + shown(path) + ": it was saved with other settings: " + diffs +
        ". Resume with the settings it was saved with" +
        (sched ? " (it ran --schedule " + shown(*sched) + ")" : std::string()) +
        ", or start a new run in another --checkpoint-dir");
  }
  if (notes == nullptr) return;
  for (const auto& [key, value] : fp.note) {
    const std::string* saved = saved_value(file.note, key);
    if (saved && *saved != value)
      notes->push_back(key + " was " + shown(*saved) + " when the checkpoint was saved; this run " +
                       "uses " + shown(value));
  }
}

// Verifies every rank's file of `step` and the marker; returns the first
// problem ("" when the step is usable). Throws on a settings mismatch.
std::string verify_step(const std::string& dir, int step, int world,
                        const CheckpointFingerprint& fp, std::vector<std::string>* notes) {
  for (int r = 0; r < world; ++r) {
    RankFile f;
    const std::string path = rank_file(dir, step, r);
    std::string problem = read_rank_file(path, step, r, world, &f);
    if (!problem.empty()) return problem;
    compare_fingerprint(path, f, fp, r == 0 ? notes : nullptr);
    problem = check_marker(dir, step, world, r, f.checksum);
    if (!problem.empty()) return problem;
  }
  return "";
}

// The holder's "pid N: command line" for the lock file.
std::string holder_text() {
  std::string cmd;
  read_whole("/proc/self/cmdline", &cmd);
  std::replace(cmd.begin(), cmd.end(), '\0', ' ');
  return "pid " + std::to_string(::getpid()) + ": " + schedule::escape_bytes(cmd, 160);
}

// Removes "<name>.tmp.<...>" files in `dir` (not recursing).
void remove_temporaries(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().filename().string().find(kTempInfix) != std::string::npos && e.is_regular_file(ec))
      fs::remove(e.path(), ec);
  }
}

// The nearest existing ancestor of `p` (itself if it exists).
fs::path existing_ancestor(fs::path p) {
  std::error_code ec;
  if (p.is_relative()) p = fs::current_path(ec) / p;
  while (!fs::exists(p, ec) && p.has_parent_path() && p != p.parent_path())
    p = p.parent_path();
  return p;
}

// Creates and removes a file in `folder`; "" or the reason it failed.
std::string probe_folder(const fs::path& folder) {
  static std::atomic<int> counter{0};
  fs::path probe =
      folder / (".hp-probe-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return error_text(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return "";
}

}  // namespace

uint64_t checksum64(std::string_view data) {
  // Each step maps the state through a bijection (xor with the word, odd
  // multiplications, xor-shifts), so a change in one word is never undone.
  auto mix = [](uint64_t h) {
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 32;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 29;
    return h;
  };
  uint64_t h = 0x9e3779b97f4a7c15ULL ^ static_cast<uint64_t>(data.size());
  const size_t n = data.size();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, data.data() + i, 8);
    h = mix(h ^ w);
  }
  uint64_t tail = 0;
  std::memcpy(&tail, data.data() + i, n - i);
  h = mix(h ^ tail ^ (static_cast<uint64_t>(n - i) << 56));
  return mix(h);
}

std::string checkpoint_step_dir(const std::string& dir, int step) {
  return (fs::path(dir) / ("step-" + std::to_string(step))).string();
}

CheckpointFingerprint checkpoint_fingerprint(const TrainConfig& c, const schedule::Schedule& s) {
  CheckpointFingerprint fp;
  const auto& m = c.model;
  auto must = [&](const std::string& k, const std::string& v) { fp.must.emplace_back(k, v); };
  auto note = [&](const std::string& k, const std::string& v) { fp.note.emplace_back(k, v); };
  must("--model", m.kind);
  must("--layers", std::to_string(m.layers));
  must("--d-model", std::to_string(m.d_model));
  if (m.kind == "gpt") {
    must("--heads", std::to_string(m.heads));
    must("--seq-len", std::to_string(m.seq_len));
    must("vocab", std::to_string(m.vocab));
    must("--untied", m.tied_head ? "no" : "yes");
    if (m.documents) must("--documents", "yes");  // absent in checkpoints made before it
  } else {
    must("--in-features", std::to_string(m.in_features));
  }
  must("--dtype", m.dtype == torch::kFloat64 ? "float64" : "float32");
  must("--optimizer", c.optimizer);
  must("--nproc", std::to_string(c.nproc));
  // Which (stage, chunk) pairs each rank holds, in stage order: the order of
  // the parameters (and of the optimizer's state) on the rank.
  std::string placement;
  for (int r = 0; r < s.num_ranks; ++r) {
    placement += r ? " |" : "";
    for (int st : s.stages_of_rank(r))
      placement += " " + std::to_string(st) + ":" + std::to_string(s.stage_chunk[st]);
  }
  must("stages", std::to_string(s.num_stages) + " stages of " + std::to_string(s.num_chunks) +
                     " chunks, rank | stage:chunk:" + placement);
  note("--schedule", c.schedule);
  note("--lr", number(c.lr));
  note("--weight-decay", number(c.weight_decay));
  note("--seed", std::to_string(c.seed));
  note("--microbatches", std::to_string(c.microbatches));
  note("--microbatch-size", std::to_string(c.microbatch_size));
  if (m.kind == "gpt") note("--data", c.data.empty() ? "(the default corpus)" : c.data);
  for (auto* list : {&fp.must, &fp.note})
    for (auto& kv : *list)
      kv.second = schedule::escape_bytes(kv.second, 400);  // one line each
  return fp;
}

ResumePlan plan_resume(const TrainConfig& c, const CheckpointFingerprint& fp) {
  ResumePlan plan;
  const std::string& dir = c.checkpoint_dir;
  if (dir.empty()) return plan;
  const std::vector<int> steps = list_steps(dir);
  const std::string where = "--checkpoint-dir '" + shown(dir) + "'";
  if (!c.resume && !c.resume_or_start) {
    if (!steps.empty())
      throw std::invalid_argument(
          where + " already holds checkpoints (the newest is step-" + std::to_string(steps[0]) +
          "); pass --resume to continue from them, or move them away or pick another folder to "
          "start over (a new run never overwrites them)");
    return plan;
  }
  if (steps.empty()) {
    if (c.resume_or_start) {
      plan.notes.push_back("no checkpoint in " + shown(dir) + " yet: starting from step 0");
      return plan;
    }
    throw std::invalid_argument(
        "--resume: " + where +
        (fs::exists(dir) ? " holds no checkpoint (no step-N folder)" : " does not exist") +
        "; run without --resume to start, or pass --resume-or-start to start from step 0 when "
        "there is no checkpoint yet");
  }
  std::vector<std::string> skipped;
  for (int step : steps) {
    std::vector<std::string> notes;
    std::string problem = verify_step(dir, step, c.nproc, fp, &notes);
    if (!problem.empty()) {
      skipped.push_back("step-" + std::to_string(step) + ": " + problem);
      continue;
    }
    plan.step = step;
    for (const auto& s : skipped)
      plan.notes.push_back("skipped " + s);
    for (auto& n : notes)
      plan.notes.push_back(std::move(n));
    break;
  }
  if (plan.step == 0) {
    std::string why;
    for (const auto& s : skipped)
      why += "\n  " + s;
    throw std::invalid_argument("--resume: no usable checkpoint in " + where +
                                "; nothing was loaded:" + why +
                                "\nmove the damaged ones away to start from step 0");
  }
  std::string latest_text;
  int64_t latest = -1;
  if (read_whole((fs::path(dir) / "latest").string(), &latest_text)) {
    while (!latest_text.empty() && latest_text.back() == '\n')
      latest_text.pop_back();
    if (!parse_count(latest_text, &latest)) latest = -1;
  }
  if (latest < 0)
    plan.notes.push_back(
        "'latest' is missing or unreadable; the newest verified checkpoint is "
        "step-" +
        std::to_string(plan.step));
  else if (latest != plan.step && skipped.empty())
    plan.notes.push_back("'latest' names step-" + std::to_string(latest) + ", but step-" +
                         std::to_string(plan.step) + " is the newest verified checkpoint");
  if (plan.step >= c.steps)
    throw std::invalid_argument("the newest verified checkpoint in " + where + " is step-" +
                                std::to_string(plan.step) + " and --steps is " +
                                std::to_string(c.steps) +
                                ": nothing is left to train; pass a larger --steps");
  return plan;
}

int agree_on_first_step(const TrainConfig& config, const CheckpointFingerprint& fingerprint,
                        distributed::Comm& comm, std::unique_ptr<CheckpointLock>& lock) {
  if (config.checkpoint_step >= 0 || config.checkpoint_dir.empty())
    return std::max(config.checkpoint_step, 0);
  const int rank = comm.rank();
  if (rank == 0) lock = std::make_unique<CheckpointLock>(config.checkpoint_dir);
  ResumePlan plan = plan_resume(config, fingerprint);
  if (rank == 0)
    for (const auto& note : plan.notes)
      std::fprintf(stderr, "hp train: %s\n", note.c_str());
  auto mine = torch::tensor({int64_t(plan.step)}, torch::kInt64);
  std::vector<torch::Tensor> steps(comm.world_size());
  for (auto& t : steps)
    t = torch::empty_like(mine);
  comm.all_gather(steps, mine);
  for (int r = 0; r < comm.world_size(); ++r)
    TORCH_CHECK(steps[r].item<int64_t>() == plan.step, "rank ", r, " would resume from step ",
                steps[r].item<int64_t>(), " and rank ", rank, " from step ", plan.step,
                ": the ranks do not see the same --checkpoint-dir");
  return plan.step;
}

void save_checkpoint(const TrainConfig& c, const CheckpointFingerprint& fp, int step,
                     distributed::Comm& comm,
                     const std::map<std::string, std::vector<torch::Tensor>>& named,
                     torch::optim::Optimizer& optimizer) {
  const int rank = comm.rank(), world = comm.world_size();
  const std::string folder = checkpoint_step_dir(c.checkpoint_dir, step);
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec)
    throw std::runtime_error("cannot create the checkpoint folder '" + shown(folder) +
                             "': " + ec.message());
  // A marker an earlier run left for this step no longer describes it.
  if (rank == 0) fs::remove(marker_file(c.checkpoint_dir, step), ec);

  torch::serialize::OutputArchive ar;
  for (const auto& [name, tensors] : named)
    ar.write(archive_key(name), tensors[0].detach());
  torch::serialize::OutputArchive opt;
  optimizer.save(opt);
  ar.write("optimizer", opt);
  std::ostringstream payload;
  ar.save_to(payload);
  const std::string bytes = payload.str();

  std::string body = "step " + std::to_string(step) + "\nrank " + std::to_string(rank) +
                     "\nworld_size " + std::to_string(world) + "\n";
  for (const auto& [k, v] : fp.must)
    body += "must " + k + " " + v + "\n";
  for (const auto& [k, v] : fp.note)
    body += "note " + k + " " + v + "\n";
  body += "payload " + std::to_string(bytes.size()) + "\n\n";
  body += bytes;
  const uint64_t sum = checksum64(body);
  write_atomically(rank_file(c.checkpoint_dir, step, rank),
                   std::string(kMagic) + "\nchecksum " + hex64(sum) + "\n" + body,
                   [step] { launch::fault_point("save:" + std::to_string(step)); });

  // Every rank's checksum to rank 0, which commits the step.
  int64_t bits = 0;
  std::memcpy(&bits, &sum, sizeof bits);
  auto mine = torch::tensor({bits}, torch::kInt64);
  std::vector<torch::Tensor> all(world);
  for (auto& t : all)
    t = torch::empty_like(mine);
  comm.all_gather(all, mine);
  if (rank != 0) return;
  std::string marker = std::string(kMarkerMagic) + "\nstep " + std::to_string(step) +
                       "\nworld_size " + std::to_string(world) + "\n";
  for (int r = 0; r < world; ++r) {
    const int64_t b = all[r].item<int64_t>();
    uint64_t s = 0;
    std::memcpy(&s, &b, sizeof s);
    marker += "rank " + std::to_string(r) + " " + hex64(s) + "\n";
  }
  write_atomically(marker_file(c.checkpoint_dir, step), marker);
  write_atomically((fs::path(c.checkpoint_dir) / "latest").string(), std::to_string(step) + "\n");
}

void load_checkpoint(const TrainConfig& c, const CheckpointFingerprint& fp, int step, int rank,
                     std::map<std::string, std::vector<torch::Tensor>>& named,
                     torch::optim::Optimizer& optimizer) {
  const std::string path = rank_file(c.checkpoint_dir, step, rank);
  RankFile f;
  std::string problem = read_rank_file(path, step, rank, c.nproc, &f);
  if (problem.empty()) {
    compare_fingerprint(path, f, fp, nullptr);
    problem = check_marker(c.checkpoint_dir, step, c.nproc, rank, f.checksum);
  }
  if (!problem.empty())
    throw std::invalid_argument("cannot resume from " +
                                shown(checkpoint_step_dir(c.checkpoint_dir, step)) + ": " +
                                problem);
  auto bad = [&](const std::string& what) {
    return std::invalid_argument("cannot resume from " + shown(path) + ": " + what);
  };
  torch::serialize::InputArchive ar;
  try {
    ar.load_from(f.payload.data(), f.payload.size());
  } catch (const c10::Error& e) {
    throw bad(std::string("LibTorch cannot read its archive: ") + e.what_without_backtrace());
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, tensors] : named) {
    torch::Tensor saved;
    if (!ar.try_read(archive_key(name), saved)) throw bad("it has no parameter " + name);
    if (saved.sizes() != tensors[0].sizes() || saved.dtype() != tensors[0].dtype()) {
      std::ostringstream os;
      os << "parameter " << name << " is " << saved.dtype() << saved.sizes() << " there and "
         << tensors[0].dtype() << tensors[0].sizes() << " in this run's model";
      throw bad(os.str());
    }
    for (auto& t : tensors)
      t.copy_(saved);
  }
  torch::serialize::InputArchive opt;
  try {
    if (!ar.try_read("optimizer", opt)) throw bad("it has no optimizer state");
    optimizer.load(opt);
  } catch (const c10::Error& e) {
    throw bad(std::string("its optimizer state does not fit this run: ") +
              e.what_without_backtrace());
  }
  // This run's learning rate and weight decay, not the saved ones.
  for (auto& group : optimizer.param_groups()) {
    auto& o = group.options();
    o.set_lr(c.lr);
    if (auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(&o))
      adamw->weight_decay(c.weight_decay);
    if (auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&o)) sgd->weight_decay(c.weight_decay);
  }
}

CheckpointLock::CheckpointLock(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw std::runtime_error("cannot create --checkpoint-dir '" + shown(dir) +
                             "': " + ec.message());
  const std::string path = (fs::path(dir) / "LOCK").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw std::runtime_error("cannot create the lock file '" + shown(path) +
                             "': " + error_text(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    std::string holder;
    read_whole(path, &holder);
    while (!holder.empty() && holder.back() == '\n')
      holder.pop_back();
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK)
      throw std::runtime_error(
          "--checkpoint-dir '" + shown(dir) + "' is in use by another run (" +
          (holder.empty() ? std::string("its pid is not recorded") : shown(holder)) +
          "); wait for it to end, or pick another folder");
    throw std::runtime_error("cannot lock '" + shown(path) + "': " + error_text(err));
  }
  const std::string me = holder_text() + "\n";
  if (::ftruncate(fd_, 0) == 0) {
    ssize_t ignored = ::pwrite(fd_, me.data(), me.size(), 0);
    (void)ignored;
  }
  remove_temporaries(dir);
  for (int step : list_steps(dir))
    remove_temporaries(checkpoint_step_dir(dir, step));
}

CheckpointLock::~CheckpointLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

void check_output_file(const std::string& path, const std::string& option) {
  if (path.empty()) return;
  const std::string shown_path = option + " '" + shown(path) + "'";
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode))
      throw std::invalid_argument(shown_path + " is a folder; give a file name");
    if (!S_ISREG(st.st_mode))
      throw std::invalid_argument(shown_path +
                                  " is not a regular file (a device or pipe); give a file name "
                                  "(the file is replaced when the run ends)");
  }
  fs::path parent = fs::path(path).parent_path();
  if (parent.empty()) parent = ".";
  struct stat pst {};
  if (::stat(parent.c_str(), &pst) != 0 || !S_ISDIR(pst.st_mode))
    throw std::invalid_argument(shown_path + ": the folder '" + shown(parent.string()) +
                                "' does not exist; create it first");
  if (std::string why = probe_folder(parent); !why.empty())
    throw std::invalid_argument(shown_path + ": cannot write in the folder '" +
                                shown(parent.string()) + "': " + why);
}

void check_output_dir(const std::string& path, const std::string& option) {
  if (path.empty()) return;
  const std::string shown_path = option + " '" + shown(path) + "'";
  fs::path p = existing_ancestor(fs::path(path));
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw std::invalid_argument(shown_path + ": '" + shown(p.string()) +
                                "' is not a folder, so the folder cannot be created there");
  if (std::string why = probe_folder(p); !why.empty())
    throw std::invalid_argument(shown_path + ": cannot write in '" + shown(p.string()) +
                                "': " + why);
}

void write_file_atomically(const std::string& path, const std::string& data) {
  write_atomically(path, data);
}

void read_checkpoint_archive(const std::string& dir, int step, int rank, int world,
                             torch::serialize::InputArchive& archive) {
  RankFile f;
  const std::string path = rank_file(dir, step, rank);
  std::string problem = read_rank_file(path, step, rank, world, &f);
  if (problem.empty()) problem = check_marker(dir, step, world, rank, f.checksum);
  if (!problem.empty()) throw std::invalid_argument("checkpoint '" + shown(path) + "': " + problem);
  archive.load_from(f.payload.data(), f.payload.size());
}

}  // namespace hp::train
