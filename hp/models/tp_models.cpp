// The TP-sharded GPT chunk (NOTE [TP layout of the reference GPT]): blocks
// with column/row-parallel linears around Megatron's f and g, replicated
// embeddings, norms and head; values cut from the plain chunk.
#include "hp/models/tp_models.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <unordered_map>

namespace hp::models {
namespace {

namespace nn = torch::nn;

std::string str(int64_t v) {
  return std::to_string(v);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A linear layer's two parameters, shaped by the caller (a shard or the full
// tensor); the block applies them.
struct ParamsImpl : nn::Module {
  ParamsImpl(std::vector<int64_t> weight_shape, std::vector<int64_t> bias_shape) {
    weight = register_parameter("weight", torch::empty(weight_shape));
    bias = register_parameter("bias", torch::empty(bias_shape));
  }
  torch::Tensor weight, bias;
};
TORCH_MODULE(Params);

// A pre-norm block of the plain GPT, split over the TP group.
struct TpBlockImpl : nn::Module {
  TpBlockImpl(const ModelSpec& s, const TensorParallel& tp)
      : tp(tp),
        heads(s.heads / tp.size),
        head_dim(s.d_model / s.heads),
        ln1(nn::LayerNormOptions({s.d_model})),
        ln2(nn::LayerNormOptions({s.d_model})) {
    const int64_t D = s.d_model, t = tp.size;
    register_module("ln1", ln1);
    qkv = register_module(
        "qkv", Params(std::vector<int64_t>{3 * D / t, D}, std::vector<int64_t>{3 * D / t}));
    proj = register_module("proj", Params(std::vector<int64_t>{D, D / t}, std::vector<int64_t>{D}));
    register_module("ln2", ln2);
    fc = register_module(
        "fc", Params(std::vector<int64_t>{4 * D / t, D}, std::vector<int64_t>{4 * D / t}));
    fc2 =
        register_module("fc2", Params(std::vector<int64_t>{D, 4 * D / t}, std::vector<int64_t>{D}));
  }
  torch::Tensor copy(const torch::Tensor& x) const {
    return tp.size > 1 ? tp.copy_to_region(x) : x;
  }
  torch::Tensor reduce(const torch::Tensor& x) const {
    return tp.size > 1 ? tp.reduce_from_region(x) : x;
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), local = heads * head_dim;
    auto parts = torch::linear(copy(ln1(x)), qkv->weight, qkv->bias).split(local, -1);
    auto split_heads = [&](const torch::Tensor& t) {
      return t.view({B, T, heads, head_dim}).transpose(1, 2);
    };
    auto q = split_heads(parts[0]), k = split_heads(parts[1]), v = split_heads(parts[2]);
    auto mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool)).triu(1);
    auto att = q.matmul(k.transpose(-2, -1)).mul(1.0 / std::sqrt(double(head_dim)));
    att = att.masked_fill(mask, -std::numeric_limits<double>::infinity()).softmax(-1);
    auto y = att.matmul(v).transpose(1, 2).reshape({B, T, local});
    auto h = x + (reduce(torch::linear(y, proj->weight)) + proj->bias);
    auto u = torch::gelu(torch::linear(copy(ln2(h)), fc->weight, fc->bias));
    return h + (reduce(torch::linear(u, fc2->weight)) + fc2->bias);
  }
  TensorParallel tp;
  int64_t heads, head_dim;
  nn::LayerNorm ln1, ln2;
  Params qkv{nullptr}, proj{nullptr}, fc{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TpBlock);

struct EmbedImpl : nn::Module {
  EmbedImpl(const ModelSpec& s, bool with_positions) {
    wte = register_parameter("wte", torch::empty({s.vocab, s.d_model}));
    if (with_positions) wpe = register_parameter("wpe", torch::empty({s.seq_len, s.d_model}));
  }
  torch::Tensor wte, wpe;
};
TORCH_MODULE(Embed);

struct FinalImpl : nn::Module {
  explicit FinalImpl(const ModelSpec& s) : ln(nn::LayerNormOptions({s.d_model})) {
    register_module("ln", ln);
    if (!s.tied_head) head = register_parameter("head", torch::empty({s.vocab, s.d_model}));
  }
  nn::LayerNorm ln;
  torch::Tensor head;
};
TORCH_MODULE(Final);

// The plain GptChunk's structure and forward, with TpBlocks; same FQNs.
class TpGptChunk : public Chunk {
 public:
  TpGptChunk(const ModelSpec& s, int64_t index, int64_t n, const TensorParallel& tp) {
    const int64_t total = s.layers, base = total / n, extra = total % n;
    const int64_t begin = index * base + std::min(index, extra);
    const int64_t end = begin + base + (index < extra ? 1 : 0);
    const bool first = index == 0, last = index == n - 1;
    if (first || (last && s.tied_head)) embed_ = register_module("embed", Embed(s, first));
    for (int64_t b = begin; b < end; ++b)
      blocks_.push_back(register_module("block" + str(b), TpBlock(s, tp)));
    if (last) final_ = register_module("final", Final(s));
    first_ = first;
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return forward_with(
        x, [](const BlockForward& block, nn::Module&, const torch::Tensor& h) { return block(h); });
  }
  torch::Tensor forward_with(const torch::Tensor& x, const BlockRunner& run_block) override {
    torch::Tensor h = x;
    if (first_) h = torch::embedding(embed_->wte, x) + embed_->wpe.narrow(0, 0, x.size(1));
    for (auto& b : blocks_) {
      std::shared_ptr<TpBlockImpl> impl = b.ptr();
      h = run_block([impl](const torch::Tensor& in) { return impl->forward(in); }, *impl, h);
    }
    if (final_) {
      const auto& head = final_->head.defined() ? final_->head : embed_->wte;
      h = torch::matmul(final_->ln(h), head.t());
    }
    return h;
  }
  std::vector<std::shared_ptr<nn::Module>> blocks() override {
    std::vector<std::shared_ptr<nn::Module>> out;
    for (auto& b : blocks_)
      out.push_back(b.ptr());
    return out;
  }

 private:
  bool first_ = false;
  Embed embed_{nullptr};
  std::vector<TpBlock> blocks_;
  Final final_{nullptr};
};

}  // namespace

void TensorParallel::check(const ModelSpec& spec) const {
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument("tensor parallel rank " + str(rank) + " of " + str(size) +
                                " does not exist; the TP size must be >= 1 and the rank in [0, " +
                                "size)");
  if (size > 1 && (!copy_to_region || !reduce_from_region))
    throw std::invalid_argument(
        "tensor parallel over " + str(size) +
        " ranks needs copy_to_region and reduce_from_region (e.g. hp::compile::tp_copy and "
        "tp_reduce over the TP group)");
  if (spec.kind != "gpt")
    throw std::invalid_argument("the tensor-parallel reference model is the gpt, not '" +
                                spec.kind + "'; use --model gpt");
  if (spec.heads < 1 || spec.heads % size != 0)
    throw std::invalid_argument("a TP size of " + str(size) + " does not divide the " +
                                str(spec.heads) +
                                " attention heads; choose a TP size that divides --heads");
  if (spec.d_model % size != 0)
    throw std::invalid_argument("a TP size of " + str(size) + " does not divide the model width " +
                                str(spec.d_model) + "; choose a TP size that divides --d-model");
}

std::shared_ptr<Chunk> build_tp_chunk(const ModelSpec& spec, int64_t index, int64_t num_chunks,
                                      uint64_t seed, const TensorParallel& tp) {
  tp.check(spec);
  if (spec.documents)
    throw std::invalid_argument("the tensor-parallel gpt has no documents; drop them");
  auto plain = build_chunk(spec, index, num_chunks, seed);  // checks spec, index and the cut
  std::unordered_map<std::string, torch::Tensor> full;
  for (const auto& item : plain->named_parameters())
    full[item.key()] = item.value();
  auto chunk = std::make_shared<TpGptChunk>(spec, index, num_chunks, tp);
  torch::NoGradGuard no_grad;
  for (auto& item : chunk->named_parameters()) {
    const torch::Tensor& want = full.at(item.key());
    torch::Tensor shard = tp_shard(want, tp_split(item.key()), tp.rank, tp.size);
    TORCH_INTERNAL_ASSERT(shard.sizes() == item.value().sizes(), "TP shard of ", item.key(),
                          " has shape ", shard.sizes(), ", the module ", item.value().sizes());
    item.value().set_data(shard);
  }
  return chunk;
}

TpSplit tp_split(const std::string& fqn) {
  if (fqn.rfind("block", 0) != 0) return TpSplit::Replicated;
  if (ends_with(fqn, ".qkv.weight") || ends_with(fqn, ".qkv.bias")) return TpSplit::QkvRows;
  if (ends_with(fqn, ".fc.weight") || ends_with(fqn, ".fc.bias")) return TpSplit::Rows;
  if (ends_with(fqn, ".proj.weight") || ends_with(fqn, ".fc2.weight")) return TpSplit::Columns;
  return TpSplit::Replicated;
}

torch::Tensor tp_shard(const torch::Tensor& full, TpSplit split, int64_t rank, int64_t size) {
  switch (split) {
    case TpSplit::Replicated:
      return full.clone();
    case TpSplit::Rows:
      return full.chunk(size, 0)[rank].clone();
    case TpSplit::Columns:
      return full.chunk(size, 1)[rank].contiguous().clone();
    case TpSplit::QkvRows: {
      std::vector<torch::Tensor> parts;
      for (const auto& third : full.chunk(3, 0))
        parts.push_back(third.chunk(size, 0)[rank]);
      return torch::cat(parts, 0);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown TpSplit");
}

torch::Tensor tp_unshard(const std::vector<torch::Tensor>& shards, TpSplit split) {
  TORCH_CHECK(!shards.empty(), "tp_unshard: no shards given");
  switch (split) {
    case TpSplit::Replicated:
      return shards[0];
    case TpSplit::Rows:
      return torch::cat(shards, 0);
    case TpSplit::Columns:
      return torch::cat(shards, 1);
    case TpSplit::QkvRows: {
      std::vector<torch::Tensor> parts;
      for (int64_t third = 0; third < 3; ++third)
        for (const auto& s : shards)
          parts.push_back(s.chunk(3, 0)[third]);
      return torch::cat(parts, 0);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown TpSplit");
}

}  // namespace hp::models
