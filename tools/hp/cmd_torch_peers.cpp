// `hp peers export`: writes the work of one `hp train` run (the whole
// model's initial parameters and every step's microbatches) to a folder that
// another framework can read with nothing but its own tensor library, so the
// same training can be run there and compared step by step
// (bench/peers/torch_pipelining.py reads it).
//
// NOTE [Peers export format]
// DIR/manifest.json describes DIR/tensors.bin, one flat file of raw
// little-endian tensors, each C-contiguous, one after another at 64-byte
// aligned offsets:
//   {"format": "hp-peers-1", "byte_order": "little", "data": "tensors.bin",
//    "model": {kind, layers, d_model, heads, vocab, seq_len, in_features,
//              tied_head, dtype},
//    "microbatches": M, "microbatch_size": B, "steps": S, "seed": X,
//    "corpus": "what the batches were cut from",
//    "parameters": [{"name", "dtype", "shape", "offset", "bytes"}, ...],
//    "batches": [{"step", "microbatch", "input": {dtype, shape, offset, bytes},
//                 "target": {...}}, ...]}
// dtype is "float32", "float64" or "int64". Parameter names are model-wide
// (NOTE [Model-wide parameter names]): the whole model built as one chunk, in
// its named_parameters() order; every chunk of any cut holds the same values
// under the same names. Batches are in (step, microbatch) order, exactly what
// `Dataset(spec, data, microbatch_size, seed).get(step, microbatch)` gives
// every rank of `hp train`.
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>

#include "hp/models/data.h"
#include "hp/models/models.h"
#include "hp/schedule/text.h"
#include "tools/hp/commands.h"

namespace hp::cli {
namespace {

struct PeersExportArgs {
  models::ModelSpec spec;
  bool untied = false;
  std::string dtype = "float32";
  int microbatches = 4;
  int64_t microbatch_size = 4;
  int steps = 10;
  uint64_t seed = 0;
  std::string data;
  std::string out;
};

const char* dtype_name(torch::Dtype d) {
  switch (d) {
    case torch::kFloat32:
      return "float32";
    case torch::kFloat64:
      return "float64";
    case torch::kInt64:
      return "int64";
    default:
      throw std::invalid_argument("cannot export a tensor of dtype " +
                                  std::string(c10::toString(d)));
  }
}

// Appends tensors to one file at 64-byte aligned offsets; returns their
// manifest entries.
class TensorWriter {
 public:
  explicit TensorWriter(const std::filesystem::path& path) : out_(path, std::ios::binary) {
    if (!out_) throw std::runtime_error("cannot write '" + path.string() + "'");
  }
  nlohmann::json write(const torch::Tensor& t) {
    auto c = t.detach().contiguous().cpu();
    static_assert(sizeof(float) == 4 && sizeof(double) == 8, "IEEE floats expected");
    const uint16_t probe = 1;
    uint8_t low = 0;
    std::memcpy(&low, &probe, 1);
    if (low != 1) throw std::runtime_error("hp peers export writes little-endian tensors only");
    while (offset_ % 64 != 0) {
      out_.put('\0');
      ++offset_;
    }
    const int64_t bytes = c.numel() * static_cast<int64_t>(c.element_size());
    nlohmann::json j = {{"dtype", dtype_name(c.scalar_type())},
                        {"shape", c.sizes().vec()},
                        {"offset", offset_},
                        {"bytes", bytes}};
    out_.write(static_cast<const char*>(c.data_ptr()), bytes);
    offset_ += bytes;
    return j;
  }
  void close() {
    out_.close();
    if (!out_) throw std::runtime_error("writing the tensors failed");
  }

 private:
  std::ofstream out_;
  int64_t offset_ = 0;
};

void run_export(PeersExportArgs a) {
  auto& s = a.spec;
  s.tied_head = !a.untied;
  if (a.dtype == "float32") {
    s.dtype = torch::kFloat32;
  } else if (a.dtype == "float64") {
    s.dtype = torch::kFloat64;
  } else {
    throw std::invalid_argument("--dtype must be float32 or float64, not '" + a.dtype + "'");
  }
  s.check();
  if (a.microbatches < 1 || a.microbatch_size < 1 || a.steps < 1)
    throw std::invalid_argument("--microbatches, --microbatch-size and --steps must be >= 1");
  namespace fs = std::filesystem;
  fs::create_directories(a.out);
  const fs::path dir(a.out);

  TensorWriter w(dir / "tensors.bin");
  nlohmann::json m;
  m["format"] = "hp-peers-1";
  m["byte_order"] = "little";
  m["data"] = "tensors.bin";
  m["model"] = {{"kind", s.kind},
                {"layers", s.layers},
                {"d_model", s.d_model},
                {"heads", s.heads},
                {"vocab", s.vocab},
                {"seq_len", s.seq_len},
                {"in_features", s.in_features},
                {"tied_head", s.tied_head},
                {"dtype", dtype_name(s.dtype)}};
  m["microbatches"] = a.microbatches;
  m["microbatch_size"] = a.microbatch_size;
  m["steps"] = a.steps;
  m["seed"] = a.seed;

  // The whole model as one chunk: model-wide names, the values every cut has.
  auto whole = models::build_chunk(s, 0, 1, a.seed);
  nlohmann::json params = nlohmann::json::array();
  int64_t count = 0;
  for (const auto& item : whole->named_parameters()) {
    auto e = w.write(item.value());
    e["name"] = item.key();
    params.push_back(e);
    count += item.value().numel();
  }
  m["parameters"] = params;

  models::Dataset data(s, a.data, a.microbatch_size, a.seed);
  m["corpus"] = data.description();
  nlohmann::json batches = nlohmann::json::array();
  for (int step = 0; step < a.steps; ++step)
    for (int mb = 0; mb < a.microbatches; ++mb) {
      auto b = data.get(step, mb);
      batches.push_back({{"step", step},
                         {"microbatch", mb},
                         {"input", w.write(b.input)},
                         {"target", w.write(b.target)}});
    }
  m["batches"] = batches;
  w.close();

  hp::schedule::write_text_file((dir / "manifest.json").string(), m.dump(1) + "\n");
  std::cout << "hp peers export: " << params.size() << " parameters (" << count << " values), "
            << a.steps * a.microbatches << " microbatches of " << a.microbatch_size << " from "
            << data.description() << " -> " << (dir / "manifest.json").string() << "\n";
}

void add_peers_command(CLI::App& app) {
  auto* peers = app.add_subcommand(
      "peers", "hand the work of an `hp train` run to another framework (see bench/peers)");
  peers->require_subcommand(1);
  auto a = std::make_shared<PeersExportArgs>();
  auto* e = peers->add_subcommand(
      "export",
      "write the whole model's initial parameters and every (step, microbatch) batch as raw "
      "little-endian tensors plus manifest.json (NOTE [Peers export format])");
  e->add_option("--model", a->spec.kind, "gpt or mlp")->check(CLI::IsMember({"gpt", "mlp"}));
  e->add_option("--layers", a->spec.layers, "transformer blocks (gpt) or hidden layers (mlp)");
  e->add_option("--d-model", a->spec.d_model, "width");
  e->add_option("--heads", a->spec.heads, "attention heads");
  e->add_option("--seq-len", a->spec.seq_len, "tokens per sequence (gpt)");
  e->add_option("--in-features", a->spec.in_features, "input width (mlp)");
  e->add_flag("--untied", a->untied, "give the gpt its own output head (as hp train --untied)");
  e->add_option("--dtype", a->dtype, "float32 or float64");
  e->add_option("--microbatches,-m", a->microbatches, "microbatches per step");
  e->add_option("--microbatch-size", a->microbatch_size, "rows per microbatch");
  e->add_option("--steps", a->steps, "steps whose batches to write");
  e->add_option("--seed", a->seed, "seed of the initial weights and the data");
  e->add_option("--data", a->data, "text file or folder (default: /usr/share/common-licenses)");
  e->add_option("--out", a->out, "folder to write manifest.json and tensors.bin into")->required();
  e->callback([a] { run_export(*a); });
}

HP_CLI_COMMAND(add_peers_command);

}  // namespace
}  // namespace hp::cli
