// The files a training run writes and trusts: checkpoints (a header with a
// checksum, the step, the rank and the configuration's fingerprint in front
// of LibTorch's archive; atomic writes; verification; the choice of the step
// to resume from; the folder lock) and the output paths checked before any
// work starts.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hp/distributed/comm.h"
#include "hp/schedule/schedule.h"
#include "hp/train/config.h"

namespace hp::train {

// NOTE [Checkpoint integrity]
// A checkpoint is the folder DIR/step-N (N steps done): one file per rank,
// rank-R.pt, and a marker COMPLETE; DIR/latest names the newest step (a hint
// for people; the markers decide).
// * rank-R.pt: a text header, then LibTorch's archive (parameters by
//   model-wide name, optimizer state). The header's first line is a magic
//   line, its second a 64-bit checksum of everything after it; then the
//   step, the rank, the world size, the fingerprint (below) and the payload's
//   length. Any change confined to one 8-byte word of the file always changes
//   the checksum (each word goes through a bijective mix), so a flipped bit
//   or byte never loads.
// * The fingerprint lists the settings the files depend on: `must` fields
//   (the model's shape and dtype, the optimizer, the number of ranks and
//   which chunks of which stages each rank holds) must equal this run's, or
//   resuming is refused naming the file and the option; `note` fields (the
//   schedule's name, learning rate, weight decay, seed, microbatches, data)
//   may change, and each change is said on resume. The learning rate and
//   weight decay of this run replace the saved ones.
// * Writes are atomic: a temporary file in the same folder, fsync, rename,
//   fsync of the folder. Every rank writes its file; the ranks exchange their
//   files' checksums; rank 0 then writes COMPLETE (listing every rank's
//   checksum and length), then `latest`. A step counts only when COMPLETE
//   exists and agrees with every file, so a kill at any moment of a save
//   leaves the previous checkpoints intact and this one visibly incomplete.
// * Resuming takes the newest step whose files all verify (checksum, step,
//   rank, world size, the marker's record) and says which newer ones it
//   skipped and why. `--resume` with no usable checkpoint is an error;
//   `--resume-or-start` starts from step 0 when the folder holds none (not
//   when it holds only damaged ones). A run that saves without resuming
//   refuses a folder that already holds checkpoints, so none is overwritten.
// * One run per folder: the process that plans the checkpoints (the `hp
//   train` launcher, or rank 0 of ranks started otherwise) holds an exclusive
//   lock on DIR/LOCK for the whole run; a second run is refused at once,
//   naming the holder. The kernel drops the lock when the holder dies.
//   The holder also removes temporary files an interrupted save left.

/// The settings a checkpoint depends on (NOTE [Checkpoint integrity]):
/// (option, value) pairs, as `hp train` spells the option.
struct CheckpointFingerprint {
  /// Must equal this run's to resume.
  std::vector<std::pair<std::string, std::string>> must;
  /// May differ; a difference is reported.
  std::vector<std::pair<std::string, std::string>> note;
};

/// The fingerprint of `config` running `schedule` (its lowered form).
CheckpointFingerprint checkpoint_fingerprint(const TrainConfig& config,
                                             const schedule::Schedule& schedule);

/// A 64-bit checksum of `data` (word-wise; NOTE [Checkpoint integrity]).
uint64_t checksum64(std::string_view data);

/// DIR/step-N.
std::string checkpoint_step_dir(const std::string& dir, int step);

/// Where a run starts: the verified step to load (0 = from scratch) and what
/// the user should know (skipped checkpoints, changed settings).
struct ResumePlan {
  int step = 0;
  std::vector<std::string> notes;
};

/// Decides where `config` starts (NOTE [Checkpoint integrity]): without a
/// checkpoint folder, step 0; saving without --resume into a folder that
/// holds checkpoints is refused; --resume takes the newest verified step, or
/// throws std::invalid_argument listing why each one is unusable; a settings
/// mismatch throws naming the file and the option; a step at or past
/// --steps throws. Reads every rank's file of the steps it examines.
ResumePlan plan_resume(const TrainConfig& config, const CheckpointFingerprint& fingerprint);

class CheckpointLock;

/// Where a run starts, every rank of `comm` agreeing: --checkpoint-step when
/// the launcher chose it, else plan_resume under rank 0's lock (kept in
/// `lock` for the run), its notes printed by rank 0; throws on every rank
/// whose peers would resume from another step. Collective over `comm`
/// when it plans.
int agree_on_first_step(const TrainConfig& config, const CheckpointFingerprint& fingerprint,
                        distributed::Comm& comm, std::unique_ptr<CheckpointLock>& lock);

/// Saves checkpoint `step` (steps done): this rank's parameters (`named`:
/// model-wide name -> its copies on this rank; the first is saved) and the
/// optimizer's state. Every rank calls it (it communicates); rank 0 commits.
/// Throws std::runtime_error naming the file when a write fails.
void save_checkpoint(const TrainConfig& config, const CheckpointFingerprint& fingerprint, int step,
                     distributed::Comm& comm,
                     const std::map<std::string, std::vector<torch::Tensor>>& named,
                     torch::optim::Optimizer& optimizer);

/// Loads this rank's file of checkpoint `step` into `named` (every copy) and
/// `optimizer`, after verifying it as plan_resume does; then sets the
/// learning rate and weight decay of `config`. Throws std::invalid_argument
/// naming the file and what is wrong.
void load_checkpoint(const TrainConfig& config, const CheckpointFingerprint& fingerprint, int step,
                     int rank, std::map<std::string, std::vector<torch::Tensor>>& named,
                     torch::optim::Optimizer& optimizer);

/// An exclusive lock on a checkpoint folder (DIR/LOCK, flock), held while
/// the object lives; the kernel releases it when the process dies.
class CheckpointLock {
 public:
  /// Creates `dir` if needed and takes its lock, then removes temporary files
  /// an interrupted save left in it. Throws std::runtime_error naming the
  /// process that holds it ("in use by another run (pid N: ...)").
  explicit CheckpointLock(const std::string& dir);
  ~CheckpointLock();
  CheckpointLock(const CheckpointLock&) = delete;
  CheckpointLock& operator=(const CheckpointLock&) = delete;

 private:
  int fd_ = -1;
};

/// Checks, before any work, that `path` can be written as a file (`option`
/// names it in the error): a writable folder holds it and it is not itself
/// a folder. Creates nothing (a probe file is made and removed). Throws
/// std::invalid_argument.
void check_output_file(const std::string& path, const std::string& option);

/// Checks that `path` is a writable folder or could be created as one.
void check_output_dir(const std::string& path, const std::string& option);

/// Writes `data` to `path` atomically (temporary file, fsync, rename);
/// throws std::runtime_error naming the path on any failure (no space, ...).
void write_file_atomically(const std::string& path, const std::string& data);

/// Opens rank `rank`'s archive of checkpoint `step` in `dir` (a run of
/// `world` ranks) after verifying the file and the marker, without comparing
/// settings: for tools and tests that read checkpoints.
void read_checkpoint_archive(const std::string& dir, int step, int rank, int world,
                             torch::serialize::InputArchive& archive);

}  // namespace hp::train
