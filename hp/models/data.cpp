// Dataset: loads the corpus once, then cuts deterministic windows (gpt) or
// draws deterministic samples for a fixed random teacher (mlp).
#include "hp/models/data.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

namespace hp::models {
namespace {

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  TORCH_CHECK(in, "cannot read '", p.string(), "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

uint64_t mix(uint64_t seed, int64_t step, int64_t mb) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(step), static_cast<uint32_t>(mb)};
  std::vector<uint32_t> out(2);
  seq.generate(out.begin(), out.end());
  return (uint64_t(out[0]) << 32) | out[1];
}

}  // namespace

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
  namespace fs = std::filesystem;
  fs::path p = path.empty() ? fs::path(kDefaultCorpusDir) : fs::path(path);
  TORCH_CHECK(fs::exists(p), "data path '", p.string(),
              "' does not exist; pass a text file or a folder of text files with --data");
  if (fs::is_directory(p)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(p))
      if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files)
      corpus_ += read_file(f);
    description_ = std::to_string(files.size()) + " text files in " + p.string();
  } else {
    corpus_ = read_file(p);
    description_ = p.string();
  }
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
