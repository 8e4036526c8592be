// Training data for the reference models: a byte-level text corpus (by
// default the license texts every Debian system ships) for the gpt, a fixed
// random teacher for the mlp. Batches depend only on (seed, step, microbatch).
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "hp/models/models.h"

namespace hp::models {

/// Where the gpt's text comes from when no file is given.
constexpr const char* kDefaultCorpusDir = "/usr/share/common-licenses";

/// The largest corpus a Dataset loads: every rank holds the whole text in
/// memory (p copies on one machine), and a byte-level model this size of
/// text is plenty; larger inputs (and devices like /dev/zero) are refused
/// before anything is read.
constexpr int64_t kMaxCorpusBytes = int64_t(1) << 30;

/// Checks that `path` (a text file, or a folder whose regular files are the
/// corpus; empty = kDefaultCorpusDir) can be a gpt corpus: it exists, it is a
/// regular file or a folder (not a device, pipe or socket), its text fits in
/// kMaxCorpusBytes and is longer than `seq_len` + 1 bytes. Returns its size
/// in bytes; throws c10::Error saying what is wrong and what to do.
int64_t check_corpus(const std::string& path, int64_t seq_len);

/// One microbatch: the model input and the loss target.
struct Batch {
  torch::Tensor input;
  torch::Tensor target;
};

/// Deterministic batches: every rank (and the single-process reference) that
/// asks for (step, microbatch) gets the same tensors, without communication.
class Dataset {
 public:
  /// `path`: a text file or a folder of text files (sorted by name); empty uses
  /// kDefaultCorpusDir for the gpt. The mlp ignores it (synthetic task).
  Dataset(const ModelSpec& spec, const std::string& path, int64_t microbatch_size, uint64_t seed);
  Batch get(int64_t step, int64_t microbatch) const;
  /// Bytes of text loaded (0 for the synthetic task).
  size_t corpus_bytes() const { return corpus_.size(); }
  /// "the license texts in /usr/share/common-licenses (262 KB)", "synthetic teacher", ...
  const std::string& description() const { return description_; }
  /// Tokens (gpt) or samples (mlp) per microbatch.
  int64_t items_per_microbatch() const;

 private:
  ModelSpec spec_;
  int64_t rows_;
  uint64_t seed_;
  std::string corpus_;
  std::string description_;
  torch::Tensor teacher_;  // mlp: in_features x in_features
};

}  // namespace hp::models
