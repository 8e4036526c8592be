// Dataset: loads the corpus once (bounded: regular files only, at most
// kMaxCorpusBytes), then cuts deterministic windows (gpt) or draws
// deterministic samples for a fixed random teacher (mlp).
#include "hp/models/data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>

namespace hp::models {
namespace {

namespace fs = std::filesystem;

std::string limit_text() {
  return std::to_string(kMaxCorpusBytes >> 20) + " MiB";
}

// The corpus files of `p` (the file itself, or a folder's regular files
// sorted by name) and their total size; refuses devices, pipes and sockets
// and a total above kMaxCorpusBytes.
std::vector<fs::path> corpus_files(const fs::path& p, int64_t* total) {
  struct stat st {};
  TORCH_CHECK(::stat(p.c_str(), &st) == 0, "data path '", p.string(),
              "' does not exist; pass a text file or a folder of text files with --data");
  std::vector<fs::path> files;
  if (S_ISDIR(st.st_mode)) {
    for (const auto& e : fs::directory_iterator(p)) {
      struct stat fst {};
      if (::stat(e.path().c_str(), &fst) == 0 && S_ISREG(fst.st_mode)) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
  } else {
    TORCH_CHECK(S_ISREG(st.st_mode), "data path '", p.string(),
                "' is not a regular file or folder (a device, pipe or socket would never end); "
                "pass a text file or a folder of text files with --data");
    files.push_back(p);
  }
  *total = 0;
  for (const auto& f : files) {
    struct stat fst {};
    TORCH_CHECK(::stat(f.c_str(), &fst) == 0, "cannot read '", f.string(), "'");
    *total += fst.st_size;
    TORCH_CHECK(*total <= kMaxCorpusBytes, "the corpus '", p.string(), "' holds more than ",
                limit_text(),
                " of text, the limit (every rank keeps the whole corpus in memory); "
                "pass a smaller file or folder with --data");
  }
  return files;
}

// Appends `p` to `out`, never past kMaxCorpusBytes (a file may grow while
// we read it, and some report a size of 0).
void append_file(const fs::path& p, std::string& out) {
  std::ifstream in(p, std::ios::binary);
  TORCH_CHECK(in, "cannot read '", p.string(), "'");
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto got = static_cast<size_t>(in.gcount());
    TORCH_CHECK(out.size() + got <= static_cast<size_t>(kMaxCorpusBytes), "the corpus grew past ",
                limit_text(), " while '", p.string(),
                "' was read; pass a smaller file with --data");
    out.append(buf.data(), got);
  }
}

uint64_t mix(uint64_t seed, int64_t step, int64_t mb) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(step), static_cast<uint32_t>(mb)};
  std::vector<uint32_t> out(2);
  seq.generate(out.begin(), out.end());
  return (uint64_t(out[0]) << 32) | out[1];
}

}  // namespace

int64_t check_corpus(const std::string& path, int64_t seq_len) {
  fs::path p = path.empty() ? fs::path(kDefaultCorpusDir) : fs::path(path);
  if (path.empty())
    TORCH_CHECK(fs::exists(p), "the default corpus ", kDefaultCorpusDir,
                " is missing; pass a text file with --data");
  int64_t total = 0;
  corpus_files(p, &total);
  TORCH_CHECK(total > seq_len + 1, "the corpus '", p.string(), "' has ", total,
              " bytes; it needs more than seq_len + 1 = ", seq_len + 1);
  return total;
}

Dataset::Dataset(const ModelSpec& spec, const std::string& path, int64_t microbatch_size,
                 uint64_t seed)
    : spec_(spec), rows_(microbatch_size), seed_(seed) {
  TORCH_CHECK(microbatch_size >= 1, "microbatch size must be at least 1, got ", microbatch_size);
  if (spec.kind == "mlp") {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed ^ 0x5eedull);
    teacher_ = torch::empty({spec.in_features, spec.in_features}, torch::kFloat64)
                   .normal_(0, 1.0 / std::sqrt(double(spec.in_features)), gen)
                   .to(spec.dtype);
    description_ = "synthetic task: y = sin(x A) for a fixed random A";
    return;
  }
  fs::path p = path.empty() ? fs::path(kDefaultCorpusDir) : fs::path(path);
  int64_t total = 0;
  const std::vector<fs::path> files = corpus_files(p, &total);
  corpus_.reserve(static_cast<size_t>(total));
  for (const auto& f : files)
    append_file(f, corpus_);
  description_ = fs::is_directory(p) ? std::to_string(files.size()) + " text files in " + p.string()
                                     : p.string();
  description_ += " (" + std::to_string(corpus_.size() / 1024) + " KiB)";
  TORCH_CHECK(static_cast<int64_t>(corpus_.size()) > spec.seq_len + 1, "the corpus '", p.string(),
              "' has ", corpus_.size(),
              " bytes; it needs more than seq_len + 1 = ", spec.seq_len + 1);
}

int64_t Dataset::items_per_microbatch() const {
  return spec_.kind == "gpt" ? rows_ * spec_.seq_len : rows_;
}

Batch Dataset::get(int64_t step, int64_t microbatch) const {
  const uint64_t s = mix(seed_, step, microbatch);
  if (spec_.kind == "mlp") {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(s);
    auto x = torch::empty({rows_, spec_.in_features}, torch::kFloat64).normal_(0, 1, gen);
    x = x.to(spec_.dtype);
    return {x, torch::sin(x.matmul(teacher_))};
  }
  std::mt19937_64 rng(s);
  const int64_t T = spec_.seq_len;
  std::uniform_int_distribution<int64_t> pick(0, static_cast<int64_t>(corpus_.size()) - T - 2);
  auto input = torch::empty({rows_, T}, torch::kLong);
  auto target = torch::empty({rows_, T}, torch::kLong);
  auto in_a = input.accessor<int64_t, 2>();
  auto tg_a = target.accessor<int64_t, 2>();
  for (int64_t r = 0; r < rows_; ++r) {
    int64_t off = pick(rng);
    for (int64_t t = 0; t < T; ++t) {
      in_a[r][t] = static_cast<unsigned char>(corpus_[off + t]) % spec_.vocab;
      tg_a[r][t] = static_cast<unsigned char>(corpus_[off + t + 1]) % spec_.vocab;
    }
  }
  return {input, target};
}

}  // namespace hp::models
