// Reference models that cut into pipeline chunks: an MLP and a small GPT.
// Every layer is initialised from (seed, layer index), so a chunk built alone
// on one rank equals the same layers of the whole model built in one process.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace hp::distributed {
class Comm;
}

namespace hp::models {

/// The shape of a reference model.
struct ModelSpec {
  std::string kind = "gpt";  ///< "gpt" or "mlp"
  int64_t layers = 4;        ///< transformer blocks (gpt) or hidden layers (mlp)
  int64_t d_model = 64;      ///< width
  int64_t heads = 4;         ///< attention heads (gpt)
  int64_t vocab = 256;       ///< byte-level vocabulary (gpt)
  int64_t seq_len = 32;      ///< tokens per sample (gpt)
  int64_t in_features = 32;  ///< input and output width (mlp)
  bool tied_head = false;    ///< gpt: the head reuses the token embedding
  /// gpt: routed experts of each block's MoE layer in place of its MLP (0: a
  /// dense MLP); `hp train --model moe`. Each expert is a GELU MLP of
  /// 4 * d_model, `top_k` of them per token (hp/moe).
  int64_t experts = 0;
  int64_t top_k = 2;
  double aux_coef = 0.01;        ///< the load-balancing loss's weight (0: none)
  double capacity_factor = 0.0;  ///< 0: dropless (hp/moe DispatchOptions)
  /// How the experts are computed: "auto", "loop" or "grouped" (hp/moe's
  /// ExpertCompute, NOTE [Grouped expert products]).
  std::string expert_compute = "auto";
  /// gpt: attention stays inside each document, a document ending at each
  /// newline byte; the chunks hand on each token's document number with the
  /// hidden states (NOTE [Documents in the reference GPT] in models.cpp).
  bool documents = false;
  torch::Dtype dtype = torch::kFloat32;

  /// Throws c10::Error saying what to change when the spec is inconsistent.
  void check() const;
  /// Layers that can be cut between: gpt: blocks; mlp: hidden layers + 1.
  int64_t cuttable_layers() const;
};

/// One consecutive piece of the model: its forward maps the previous chunk's
/// output (or the model input for chunk 0) to the next chunk's input (or the
/// model output for the last chunk).
class Chunk : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
  // NOTE [Model-wide parameter names]
  // named_parameters() of a chunk are model-wide ("block3.fc.weight",
  // "embed.wte"): two chunks that hold the same name hold copies of one
  // parameter (a tied head, or DualPipe's mirrored copies), whose gradients
  // the runtime sums.

  /// Modules of this chunk that a `--recompute` run may checkpoint (gpt blocks).
  virtual std::vector<std::shared_ptr<torch::nn::Module>> blocks() { return {}; }
  /// Runs one block: given the block's forward, its module and its input
  /// (e.g. to checkpoint it). The forward is a copyable function object.
  using BlockForward = std::function<torch::Tensor(const torch::Tensor&)>;
  using BlockRunner = std::function<torch::Tensor(
      const BlockForward& block, torch::nn::Module& module, const torch::Tensor& x)>;
  /// Runs the chunk with `run_block` applied around each block (gpt blocks;
  /// chunks without blocks ignore it).
  virtual torch::Tensor forward_with(const torch::Tensor& x, const BlockRunner& run_block) {
    return forward(x);
  }
  /// What the chunk hands the next chunk, from what the previous handed it
  /// (the model input for chunk 0): one tensor, or with the gpt's
  /// `documents` the hidden states and each token's document number (int64,
  /// no gradient). The last chunk returns the model output alone. An empty
  /// `run_block` runs each block as it is.
  virtual std::vector<torch::Tensor> forward_message(const std::vector<torch::Tensor>& in,
                                                     const BlockRunner& run_block = {}) {
    TORCH_CHECK(in.size() == 1, "this chunk takes one tensor, not ", in.size());
    return {run_block ? forward_with(in[0], run_block) : forward(in[0])};
  }
  /// The experts this chunk holds of its MoE layers (sharded over the
  /// expert-parallel group: NOTE [Expert gradients] in hp/pipeline/pipeline.cpp).
  virtual std::vector<torch::Tensor> expert_parameters() { return {}; }
  /// The gradient each MoE layer's load-balancing loss (times aux_coef)
  /// gets in the backward: the weight of one microbatch's loss (1 / the
  /// microbatches it is averaged over). NOTE [The load-balancing loss of the
  /// reference MoE] in models.cpp.
  virtual void set_aux_scale(double scale) { (void)scale; }
  /// Sum of the load-balancing losses (times aux_coef) of the last forward.
  virtual double last_aux_loss() const { return 0.0; }
};

/// Builds chunk `index` of `num_chunks` (layers cut as evenly as possible,
/// earlier chunks take the remainder). Throws when num_chunks exceeds the
/// cuttable layers.
/// A MoE gpt (spec.experts > 0) spreads its experts over `ep` (null: every
/// expert local): rank r of ep holds experts [r * E / n, (r + 1) * E / n),
/// with the values the unsharded model gives them.
std::shared_ptr<Chunk> build_chunk(const ModelSpec& spec, int64_t index, int64_t num_chunks,
                                   uint64_t seed, std::shared_ptr<distributed::Comm> ep = nullptr);

/// The loss of the last chunk's output against the targets (mean over the
/// microbatch): cross-entropy over tokens (gpt), mean squared error (mlp).
torch::Tensor loss(const ModelSpec& spec, const torch::Tensor& output, const torch::Tensor& target);

/// Shape of the activation chunk `index` outputs for a microbatch of `rows`
/// (what the next stage receives, and the gradient it sends back).
std::vector<int64_t> activation_shape(const ModelSpec& spec, int64_t rows);

/// The document number of each token of `tokens` ([rows, seq] int64): the
/// newline bytes before it in its row (NOTE [Documents in the reference GPT]).
torch::Tensor document_numbers(const torch::Tensor& tokens);

/// Number of parameters of the whole model.
int64_t parameter_count(const ModelSpec& spec);

}  // namespace hp::models
