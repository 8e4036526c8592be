// GraphTrainer: lazy compile, replay, gradient accumulation by FQN, the
// built-in Adam with global-norm clipping over FSDP shards.
#include "hp/compile/graph_trainer.h"

#include <torch/torch.h>

#include <cmath>
#include <unordered_set>

#include "hp/distributed/comm.h"

namespace hp::compile {

GraphTrainer::GraphTrainer(std::shared_ptr<torch::nn::Module> model, TrainFn train_fn,
                           PassConfig config, std::optional<PassPlan> plan,
                           OptimizerConfig optimizer, std::shared_ptr<hp::distributed::Comm> comm)
    : model_(std::move(model)),
      train_fn_(std::move(train_fn)),
      config_(config),
      plan_(std::move(plan)),
      optimizer_(optimizer),
      comm_(std::move(comm)) {
  TORCH_CHECK(model_, "GraphTrainer: model is null");
  TORCH_CHECK(train_fn_, "GraphTrainer: train_fn is empty");
  TORCH_CHECK(optimizer_.lr > 0 && optimizer_.grad_clip >= 0 && optimizer_.weight_decay >= 0,
              "GraphTrainer: optimizer lr must be > 0, grad_clip >= 0 (0 turns clipping off) "
              "and weight_decay >= 0");
  config_.validate();
}

void GraphTrainer::compile(const at::Tensor& input, const at::Tensor& label) {
  TORCH_CHECK(!compiled_, "GraphTrainer: already compiled (shapes are frozen at compile)");
  graph_ = capture_train_step(*model_, train_fn_, input, label);
  PassPipeline pipeline = PassPipeline::from_config(config_);
  PassContext ctx;
  ctx.model = model_.get();
  ctx.comm = comm_.get();
  ctx.plan = plan_ ? &*plan_ : nullptr;
  ctx.config = config_;
  pipeline.run(graph_, ctx);
  pass_names_ = pipeline.names();
  sharded_ = ctx.sharded;
  compiled_ = true;
}

const Graph& GraphTrainer::graph() const {
  TORCH_CHECK(compiled_, "GraphTrainer: no graph yet; call compile() or train_step() first");
  return graph_;
}

namespace {

// NOTE [Stealing a replayed gradient]
// Like autograd's AccumulateGrad, a first gradient becomes the .grad itself
// when nothing else can see its memory (one reference to the tensor and to
// its storage, dense): copying it cost the MLP's replay 10 % of a step.
// Anything shared (a gradient returned under two FQNs, a view of another
// value, a placeholder) is copied, so a later add_ can never write through.
bool sole_owner(const at::Tensor& t) {
  return t.use_count() == 1 && t.has_storage() && t.storage().use_count() == 1 &&
         t.is_contiguous() && t.storage_offset() == 0 &&
         t.numel() * static_cast<int64_t>(t.element_size()) ==
             static_cast<int64_t>(t.storage().nbytes());
}

}  // namespace

// NOTE [Gradients by FQN]
// The graph returns one gradient per parameter FQN; a tensor shared under
// several FQNs gets the same (already summed) gradient under each, so it is
// added into .grad once. The FQN count must equal the live model's: a model
// that grew or lost parameters since compile is an error, never a silent zip.
double GraphTrainer::train_step(const at::Tensor& input, const at::Tensor& label) {
  if (!compiled_) compile(input, label);
  auto outs = replay(graph_, placeholder_values(graph_, *model_, input, label), comm_.get(),
                     record_trace_ ? &trace_ : nullptr);
  const auto& names = graph_.output().output_names;
  auto named = model_->named_parameters(true);
  TORCH_CHECK(outs.size() == names.size() && named.size() + 1 == outs.size(),
              "GraphTrainer: the graph returns ", outs.size() - 1, " gradients but the model has ",
              named.size(), " parameters; did the model change after compile()?");
  torch::NoGradGuard no_grad;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (size_t k = 1; k < outs.size(); ++k) {
    const at::Tensor* p = named.find(names[k]);
    TORCH_CHECK(p, "GraphTrainer: the graph's gradient '", names[k],
                "' names no parameter of the model");
    if (!seen.insert(p->unsafeGetTensorImpl()).second) continue;
    TORCH_CHECK(outs[k].sizes() == p->sizes(), "GraphTrainer: gradient of ", names[k],
                " has shape ", outs[k].sizes(), ", parameter ", p->sizes());
    at::Tensor& g = const_cast<at::Tensor&>(*p).mutable_grad();
    if (g.defined())
      g.add_(outs[k]);
    else if (sole_owner(outs[k]))
      g = std::move(outs[k]);
    else
      g = outs[k].clone();
  }
  return outs[0].item<double>();
}

void GraphTrainer::zero_grad() {
  for (auto& p : model_->parameters())
    p.mutable_grad() = at::Tensor();
}

void GraphTrainer::optimizer_step() {
  torch::NoGradGuard no_grad;
  std::unordered_set<std::string> sharded(sharded_.begin(), sharded_.end());
  std::vector<std::pair<at::Tensor, bool>> params;  // distinct, with "is a shard"
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : model_->named_parameters(true))
    if (item.value().grad().defined() && seen.insert(item.value().unsafeGetTensorImpl()).second)
      params.emplace_back(item.value(), sharded.count(item.key()) > 0);
  if (optimizer_.grad_clip > 0) {
    // Shards are summed over the ranks; replicated gradients counted once.
    auto opts = torch::TensorOptions().dtype(torch::kFloat64);
    at::Tensor shard_sq = torch::zeros({1}, opts), rep_sq = torch::zeros({1}, opts);
    for (const auto& [p, is_shard] : params)
      (is_shard ? shard_sq : rep_sq).add_(p.grad().to(torch::kFloat64).pow(2).sum());
    if (comm_ && comm_->world_size() > 1 && !sharded_.empty()) comm_->all_reduce(shard_sq);
    const double norm = std::sqrt((shard_sq + rep_sq).item<double>());
    const double coef = optimizer_.grad_clip / (norm + 1e-6);
    if (coef < 1.0)
      for (auto& [p, is_shard] : params)
        p.mutable_grad().mul_(coef);
  }
  for (auto& [p, is_shard] : params) {
    if (optimizer_.sgd) {
      at::Tensor g = p.grad();
      if (optimizer_.weight_decay > 0) g = g.add(p, optimizer_.weight_decay);
      p.add_(g, -optimizer_.lr);
      continue;
    }
    AdamState& s = adam_[p.unsafeGetTensorImpl()];
    if (!s.exp_avg.defined()) {
      s.exp_avg = torch::zeros_like(p);
      s.exp_avg_sq = torch::zeros_like(p);
    }
    const at::Tensor& g = p.grad();
    if (optimizer_.weight_decay > 0) p.mul_(1 - optimizer_.lr * optimizer_.weight_decay);
    ++s.step;
    s.exp_avg.mul_(optimizer_.beta1).add_(g, 1 - optimizer_.beta1);
    s.exp_avg_sq.mul_(optimizer_.beta2).addcmul_(g, g, 1 - optimizer_.beta2);
    const double bc1 = 1 - std::pow(optimizer_.beta1, s.step);
    const double bc2 = 1 - std::pow(optimizer_.beta2, s.step);
    at::Tensor denom = (s.exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(optimizer_.eps);
    p.addcdiv_(s.exp_avg, denom, -optimizer_.lr / bc1);
  }
  zero_grad();
}

std::vector<double> GraphTrainer::train(const std::vector<std::pair<at::Tensor, at::Tensor>>& data,
                                        int64_t max_steps, int64_t log_interval,
                                        const std::function<void(int64_t, double)>& log_fn) {
  std::vector<double> losses;
  for (const auto& [x, y] : data) {
    if (max_steps >= 0 && static_cast<int64_t>(losses.size()) >= max_steps) break;
    losses.push_back(train_step(x, y));
    optimizer_step();
    const int64_t step = static_cast<int64_t>(losses.size()) - 1;
    if (log_fn && log_interval > 0 && (step + 1) % log_interval == 0) log_fn(step, losses.back());
  }
  return losses;
}

}  // namespace hp::compile
