// The MLP and the small GPT, cut into chunks. Each layer draws its initial
// values from its own generator seeded by (seed, layer index), so how the
// model is cut never changes its values.
#include "hp/models/models.h"

#include <unistd.h>

#include "hp/moe/moe_layer.h"

#include <algorithm>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

namespace hp::models {
namespace {

namespace nn = torch::nn;

at::Generator layer_generator(uint64_t seed, int64_t layer) {
  return at::make_generator<at::CPUGeneratorImpl>(seed * 1000003ull + 7919ull * (layer + 1));
}

void init_linear(nn::Linear& l, at::Generator& gen, double std) {
  torch::NoGradGuard g;
  l->weight.normal_(0.0, std, gen);
  if (l->bias.defined()) l->bias.zero_();
}

// Which of `total` layers chunk `index` of `n` holds: [begin, end).
std::pair<int64_t, int64_t> layer_range(int64_t total, int64_t index, int64_t n) {
  int64_t base = total / n, extra = total % n;
  int64_t begin = index * base + std::min(index, extra);
  return {begin, begin + base + (index < extra ? 1 : 0)};
}

// NOTE [The load-balancing loss of the reference MoE]
// Each MoE block's load-balancing loss (times aux_coef) joins the backward
// where the block's output does: attach_loss hands the output on unchanged
// and gives the loss the gradient `aux_scale`, the weight of one
// microbatch's loss (1/m in a pipeline whose copy averages m microbatches,
// 1/(all microbatches) in the one-process reference), so the gradients are
// those of mean(loss + aux) over the microbatches wherever the schedule
// runs the block's backward (B, or I then W), as Megatron's
// MoEAuxLossAutoScaler does and as add_loss does in Python.
struct AttachLoss : torch::autograd::Function<AttachLoss> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& out,
                               const torch::Tensor& loss, double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["loss"] = loss.detach();  // dtype and device of its gradient
    return out.view_as(out);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto loss = ctx->saved_data["loss"].toTensor();
    return {grads[0], torch::full({}, ctx->saved_data["scale"].toDouble(), loss.options()),
            torch::Tensor()};
  }
};

// Pre-norm transformer block: causal self-attention and a GELU MLP, or a MoE
// layer in its place (spec.experts > 0, experts spread over `ep`).
struct BlockImpl : nn::Module {
  BlockImpl(const ModelSpec& s, at::Generator gen, uint64_t moe_seed = 0,
            std::shared_ptr<distributed::Comm> ep = nullptr)
      : heads(s.heads),
        aux_coef(s.aux_coef),
        ln1(nn::LayerNormOptions({s.d_model})),
        ln2(nn::LayerNormOptions({s.d_model})),
        qkv(s.d_model, 3 * s.d_model),
        proj(s.d_model, s.d_model),
        fc(nullptr),
        fc2(nullptr) {
    register_module("ln1", ln1);
    register_module("qkv", qkv);
    register_module("proj", proj);
    register_module("ln2", ln2);
    const double residual_std = 0.02 / std::sqrt(2.0 * s.layers);
    init_linear(qkv, gen, 0.02);
    init_linear(proj, gen, residual_std);
    if (s.experts > 0) {
      moe::MoELayerOptions o;
      o.d_model = s.d_model;
      o.hidden = 4 * s.d_model;
      o.router.num_experts = s.experts;
      o.router.top_k = s.top_k;
      o.dispatch.capacity_factor = s.capacity_factor;
      o.experts = moe::expert_compute_from_string(s.expert_compute);
      experts =
          register_module("moe", moe::MoELayer(o, std::move(ep), moe_seed, 0.02, residual_std));
      return;
    }
    fc = register_module("fc", nn::Linear(s.d_model, 4 * s.d_model));
    fc2 = register_module("fc2", nn::Linear(4 * s.d_model, s.d_model));
    init_linear(fc, gen, 0.02);
    init_linear(fc2, gen, residual_std);
  }
  /// `documents`: each token's document number ([B, T] int64), or undefined.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& documents = {}) {
    const int64_t B = x.size(0), T = x.size(1), D = x.size(2), hd = D / heads;
    auto parts = qkv(ln1(x)).split(D, -1);
    auto split_heads = [&](const torch::Tensor& t) {
      return t.view({B, T, heads, hd}).transpose(1, 2);
    };
    auto q = split_heads(parts[0]), k = split_heads(parts[1]), v = split_heads(parts[2]);
    auto mask =
        torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
    if (documents.defined())  // [B, 1, T, T]: no query sees another document's keys
      mask = mask.logical_or(documents.unsqueeze(2).ne(documents.unsqueeze(1))).unsqueeze(1);
    auto att = q.matmul(k.transpose(-2, -1)).mul(1.0 / std::sqrt(double(hd)));
    att = att.masked_fill(mask, -std::numeric_limits<double>::infinity()).softmax(-1);
    auto y = att.matmul(v).transpose(1, 2).reshape({B, T, D});
    auto h = x + proj(y);
    if (experts.is_empty()) return h + fc2(torch::gelu(fc(ln2(h))));
    auto out = h + experts->forward(ln2(h));
    if (aux_coef == 0.0) return out;
    auto aux = experts->last_balance_loss() * aux_coef;
    last_aux = aux.detach();
    return AttachLoss::apply(out, aux, aux_scale);
  }
  int64_t heads;
  double aux_coef = 0.0, aux_scale = 1.0;
  torch::Tensor last_aux;  ///< the last forward's weighted load-balancing loss
  nn::LayerNorm ln1, ln2;
  nn::Linear qkv, proj, fc, fc2;
  moe::MoELayer experts{nullptr};
};
TORCH_MODULE(Block);

// Token and position embeddings (the gpt's chunk 0 starts with them).
struct EmbedImpl : nn::Module {
  EmbedImpl(const ModelSpec& s, at::Generator gen, bool with_positions) {
    torch::NoGradGuard g;
    wte = register_parameter("wte", torch::empty({s.vocab, s.d_model}).normal_(0, 0.02, gen));
    if (with_positions)
      wpe = register_parameter("wpe", torch::empty({s.seq_len, s.d_model}).normal_(0, 0.01, gen));
  }
  torch::Tensor wte, wpe;
};
TORCH_MODULE(Embed);

struct FinalImpl : nn::Module {
  FinalImpl(const ModelSpec& s, at::Generator gen) : ln(nn::LayerNormOptions({s.d_model})) {
    register_module("ln", ln);
    if (!s.tied_head) {
      torch::NoGradGuard g;
      head = register_parameter("head", torch::empty({s.vocab, s.d_model}).normal_(0, 0.02, gen));
    }
  }
  nn::LayerNorm ln;
  torch::Tensor head;
};
TORCH_MODULE(Final);

class GptChunk : public Chunk {
 public:
  GptChunk(const ModelSpec& s, int64_t index, int64_t n, uint64_t seed,
           std::shared_ptr<distributed::Comm> ep) {
    auto [begin, end] = layer_range(s.layers, index, n);
    const bool first = index == 0, last = index == n - 1;
    // Layer ids: 0 embedding, 1..L blocks, L+1 final.
    if (first || (last && s.tied_head))
      embed_ = register_module("embed", Embed(s, layer_generator(seed, 0), first));
    for (int64_t b = begin; b < end; ++b) {
      // A MoE layer's experts draw from generators of their own, seeded by
      // (seed, layer), so that any rank's slice equals the unsharded model's.
      blocks_.push_back(register_module(
          "block" + std::to_string(b),
          Block(s, layer_generator(seed, b + 1), seed * 1000003ull + 7919ull * (b + 1), ep)));
    }
    if (last) final_ = register_module("final", Final(s, layer_generator(seed, s.layers + 1)));
    first_ = first;
    documents_ = s.documents;
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    return forward_with(
        x, [](const BlockForward& block, nn::Module&, const torch::Tensor& h) { return block(h); });
  }
  torch::Tensor forward_with(const torch::Tensor& x, const BlockRunner& run_block) override {
    TORCH_CHECK(first_ || !documents_,
                "this chunk of the gpt takes hidden states and their document numbers "
                "(--documents): call forward_message");
    return run(x, torch::Tensor(), run_block)[0];
  }
  std::vector<torch::Tensor> forward_message(const std::vector<torch::Tensor>& in,
                                             const BlockRunner& run_block) override {
    const size_t want = first_ || !documents_ ? 1 : 2;
    TORCH_CHECK(in.size() == want, "this chunk of the gpt takes ", want, " tensor(s), not ",
                in.size());
    if (!run_block) return forward_message(in, plain_runner());
    return run(in[0], want == 2 ? in[1] : torch::Tensor(), run_block);
  }
  std::vector<std::shared_ptr<nn::Module>> blocks() override {
    std::vector<std::shared_ptr<nn::Module>> out;
    for (auto& b : blocks_)
      out.push_back(b.ptr());
    return out;
  }
  std::vector<torch::Tensor> expert_parameters() override {
    std::vector<torch::Tensor> out;
    for (auto& b : blocks_)
      if (!b->experts.is_empty())
        for (const auto& t : b->experts->expert_parameters())
          out.push_back(t);
    return out;
  }
  void set_aux_scale(double scale) override {
    for (auto& b : blocks_)
      b->aux_scale = scale;
  }
  double last_aux_loss() const override {
    double sum = 0;
    for (const auto& b : blocks_)
      if (b->last_aux.defined()) sum += b->last_aux.item<double>();
    return sum;
  }

 private:
  static BlockRunner plain_runner() {
    return [](const BlockForward& block, nn::Module&, const torch::Tensor& h) { return block(h); };
  }
  // The chunk from its input (tokens, or hidden states and, with documents,
  // their document numbers) to what it hands on.
  std::vector<torch::Tensor> run(const torch::Tensor& x, torch::Tensor documents,
                                 const BlockRunner& run_block) {
    torch::Tensor h = x;
    if (first_) {
      auto positions = embed_->wpe.narrow(0, 0, x.size(1));
      h = torch::embedding(embed_->wte, x) + positions;
      if (documents_) documents = document_numbers(x);
    }
    for (auto& b : blocks_) {
      std::shared_ptr<BlockImpl> impl = b.ptr();
      h = run_block(
          [impl, documents](const torch::Tensor& in) { return impl->forward(in, documents); },
          *impl, h);
    }
    if (final_) {
      const auto& head = final_->head.defined() ? final_->head : embed_->wte;
      return {torch::matmul(final_->ln(h), head.t())};
    }
    if (documents_) return {h, documents};
    return {h};
  }

  bool first_ = false;
  bool documents_ = false;
  Embed embed_{nullptr};
  std::vector<Block> blocks_;
  Final final_{nullptr};
};

// MLP: in -> d (tanh) -> ... -> d (tanh) -> in. Layers 0..L, layer L is the output layer.
class MlpChunk : public Chunk {
 public:
  MlpChunk(const ModelSpec& s, int64_t index, int64_t n, uint64_t seed) {
    auto [begin, end] = layer_range(s.layers + 1, index, n);
    for (int64_t l = begin; l < end; ++l) {
      int64_t in = l == 0 ? s.in_features : s.d_model;
      int64_t out = l == s.layers ? s.in_features : s.d_model;
      auto gen = layer_generator(seed, l);
      nn::Linear lin(in, out);
      init_linear(lin, gen, 1.0 / std::sqrt(double(in)));
      layers_.push_back(register_module("layer" + std::to_string(l), lin));
      activation_.push_back(l != s.layers);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) override {
    torch::Tensor h = x;
    for (size_t i = 0; i < layers_.size(); ++i) {
      h = layers_[i](h);
      if (activation_[i]) h = torch::tanh(h);
    }
    return h;
  }

 private:
  std::vector<nn::Linear> layers_;
  std::vector<bool> activation_;
};

}  // namespace

void ModelSpec::check() const {
  TORCH_CHECK(kind == "gpt" || kind == "mlp", "unknown model '", kind, "'; use gpt or mlp");
  TORCH_CHECK(layers >= 1, "the model needs at least one layer, got ", layers);
  TORCH_CHECK(d_model >= 1, "d_model must be positive, got ", d_model);
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kFloat64,
              "dtype must be float32 or float64");
  if (kind == "gpt") {
    TORCH_CHECK(heads >= 1 && d_model % heads == 0, "d_model ", d_model,
                " must be divisible by the number of heads ", heads);
    TORCH_CHECK(vocab >= 2 && seq_len >= 1, "gpt needs vocab >= 2 and seq_len >= 1");
    if (experts > 0) {
      moe::RouterOptions r;
      r.num_experts = experts;
      r.top_k = top_k;
      r.check();
      TORCH_CHECK(capacity_factor >= 0 && aux_coef >= 0 && std::isfinite(aux_coef),
                  "the MoE's capacity factor and load-balancing weight must be >= 0");
      (void)moe::expert_compute_from_string(expert_compute);
    }
  } else {
    TORCH_CHECK(!documents, "documents are for the gpt, not the mlp");
    TORCH_CHECK(in_features >= 1, "mlp needs in_features >= 1");
    TORCH_CHECK(experts == 0, "experts are for the gpt (--model moe), not the mlp");
  }
  // A size no run can hold is an error before anything is allocated (a raw
  // allocator message otherwise, or a machine swapping): the weights alone,
  // counted in double so that no product overflows.
  const double d = double(d_model), width = kind == "gpt" ? d : std::max(d, double(in_features));
  const double mlp_copies = experts > 0 ? double(experts) : 1.0;
  const double params = kind == "gpt" ? double(layers) * (4.0 + 8.0 * mlp_copies) * d * d +
                                            double(vocab + seq_len) * d * 2
                                      : double(layers + 1) * width * width;
  const double bytes = params * double(c10::elementSize(dtype));
  const double memory = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  TORCH_CHECK(memory <= 0 || bytes <= memory, "the ", kind, "'s weights alone (about ", params,
              " parameters, ", bytes / double(1ull << 30), " GiB) exceed this machine's ",
              memory / double(1ull << 30), " GiB of memory: use a smaller --d-model or --layers");
}

int64_t ModelSpec::cuttable_layers() const {
  return kind == "gpt" ? layers : layers + 1;
}

std::shared_ptr<Chunk> build_chunk(const ModelSpec& spec, int64_t index, int64_t num_chunks,
                                   uint64_t seed, std::shared_ptr<distributed::Comm> ep) {
  spec.check();
  TORCH_CHECK(num_chunks >= 1 && index >= 0 && index < num_chunks, "chunk ", index, " of ",
              num_chunks, " does not exist");
  TORCH_CHECK(num_chunks <= spec.cuttable_layers(), "cannot cut a ", spec.kind, " with ",
              spec.cuttable_layers(), spec.kind == "gpt" ? " blocks" : " layers", " into ",
              num_chunks, " chunks: use fewer stages or more layers (--layers ", num_chunks,
              spec.kind == "gpt" ? ")" : " - 1)");
  std::shared_ptr<Chunk> chunk;
  if (spec.kind == "gpt") {
    chunk = std::make_shared<GptChunk>(spec, index, num_chunks, seed, std::move(ep));
  } else {
    chunk = std::make_shared<MlpChunk>(spec, index, num_chunks, seed);
  }
  chunk->to(spec.dtype);
  return chunk;
}

torch::Tensor loss(const ModelSpec& spec, const torch::Tensor& output,
                   const torch::Tensor& target) {
  if (spec.kind == "gpt")
    return torch::nn::functional::cross_entropy(output.reshape({-1, output.size(-1)}),
                                                target.reshape({-1}));
  return torch::mse_loss(output, target);
}

std::vector<int64_t> activation_shape(const ModelSpec& spec, int64_t rows) {
  if (spec.kind == "gpt") return {rows, spec.seq_len, spec.d_model};
  return {rows, spec.d_model};
}

// NOTE [Documents in the reference GPT]
// With ModelSpec::documents the text is a run of documents, each ending at a
// newline byte (the newline is its document's last token), and a token
// attends only to earlier tokens of its own document, as packed sequences
// are trained. Chunk 0 numbers each token's document from the tokens (the
// newlines before it in its row) and every chunk but the last hands the
// numbers on with the hidden states: a message of two tensors, the numbers
// int64 and needing no gradient, so they travel forward only (NOTE
// [Messages between stages] in hp/pipeline/message.h). The whole model in
// one chunk takes tokens, as without documents.
torch::Tensor document_numbers(const torch::Tensor& tokens) {
  auto ends = tokens.eq(int64_t('\n')).to(torch::kLong);
  return ends.cumsum(1) - ends;
}

int64_t parameter_count(const ModelSpec& spec) {
  auto whole = build_chunk(spec, 0, 1, 0);
  int64_t n = 0;
  for (const auto& p : whole->parameters())
    n += p.numel();
  return n;
}

}  // namespace hp::models
