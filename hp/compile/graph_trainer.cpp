// GraphTrainer: lazy compile, replay, gradient accumulation by FQN, a
// LibTorch optimizer with global-norm clipping over FSDP and TP shards; MeshContext
// and the checks of a mesh.
#include "hp/compile/graph_trainer.h"

#include <torch/torch.h>

#include <cmath>
#include <stdexcept>
#include <unordered_set>

#include "hp/compile/tp_ops.h"
#include "hp/distributed/comm.h"
#include "hp/distributed/mesh.h"

namespace hp::compile {

MeshContext MeshContext::from_mesh(std::shared_ptr<hp::distributed::DeviceMesh> mesh,
                                   const std::string& fsdp_dim, const std::string& tp_dim,
                                   std::string tp_group_name) {
  if (!mesh) throw std::invalid_argument("MeshContext::from_mesh: no mesh given");
  const auto& shape = mesh->shape();
  for (const std::string* dim : {&fsdp_dim, &tp_dim})
    if (!dim->empty() && shape.index_of(*dim) < 0)
      throw std::invalid_argument("mesh " + shape.str() + " has no dimension '" + *dim +
                                  "' for graph mode's " + (dim == &tp_dim ? "TP" : "FSDP") +
                                  " group; name one of its dimensions or pass \"\" for none");
  if (!fsdp_dim.empty() && fsdp_dim == tp_dim)
    throw std::invalid_argument("graph mode: TP and FSDP cannot both run along mesh dimension '" +
                                tp_dim + "'");
  for (size_t d = 0; d < shape.names.size(); ++d)
    if (shape.names[d] != fsdp_dim && shape.names[d] != tp_dim && shape.sizes[d] > 1)
      throw std::invalid_argument("graph mode on mesh " + shape.str() + ": dimension '" +
                                  shape.names[d] + "' has size " + std::to_string(shape.sizes[d]) +
                                  ", but graph mode parallelizes only over TP ('" + tp_dim +
                                  "') and FSDP ('" + fsdp_dim +
                                  "'); give that dimension size 1 (graph mode has no pipeline)");
  MeshContext m;
  m.mesh = mesh;
  if (!tp_dim.empty()) m.tp = mesh->group(tp_dim);
  if (!fsdp_dim.empty()) m.fsdp = mesh->group(fsdp_dim);
  m.tp_group_name = std::move(tp_group_name);
  return m;
}

int64_t MeshContext::tp_size() const {
  return tp ? tp->world_size() : 1;
}

int64_t MeshContext::fsdp_degree() const {
  return fsdp ? fsdp->world_size() : 1;
}

namespace {

MeshContext fsdp_only(std::shared_ptr<hp::distributed::Comm> comm) {
  MeshContext m;
  m.fsdp = std::move(comm);
  return m;
}

}  // namespace

GraphTrainer::GraphTrainer(std::shared_ptr<torch::nn::Module> model, TrainFn train_fn,
                           PassConfig config, std::optional<PassPlan> plan,
                           OptimizerConfig optimizer, std::shared_ptr<hp::distributed::Comm> comm)
    : GraphTrainer(std::move(model), std::move(train_fn), config, std::move(plan), optimizer,
                   fsdp_only(std::move(comm))) {}

GraphTrainer::GraphTrainer(std::shared_ptr<torch::nn::Module> model, TrainFn train_fn,
                           PassConfig config, std::optional<PassPlan> plan,
                           OptimizerConfig optimizer, MeshContext mesh)
    : model_(std::move(model)),
      train_fn_(std::move(train_fn)),
      config_(config),
      plan_(std::move(plan)),
      optimizer_(optimizer),
      mesh_(std::move(mesh)),
      comm_(mesh_.fsdp) {
  TORCH_CHECK(model_, "GraphTrainer: model is null");
  TORCH_CHECK(train_fn_, "GraphTrainer: train_fn is empty");
  TORCH_CHECK(optimizer_.lr > 0 && optimizer_.grad_clip >= 0 && optimizer_.weight_decay >= 0,
              "GraphTrainer: optimizer lr must be > 0, grad_clip >= 0 (0 turns clipping off) "
              "and weight_decay >= 0");
  config_.validate();
  // NOTE [Graph mode on a mesh]: the config's degrees come from the mesh.
  const int64_t tp = mesh_.tp_size(), fsdp = mesh_.fsdp_degree();
  if (mesh_.fsdp) {  // without a group FSDPPass does nothing, whatever the degree says
    if (config_.fsdp_degree && *config_.fsdp_degree != fsdp)
      throw std::invalid_argument("GraphTrainer: PassConfig::fsdp_degree is " +
                                  std::to_string(*config_.fsdp_degree) +
                                  " but the FSDP group has " + std::to_string(fsdp) +
                                  " ranks; leave fsdp_degree unset (the group fills it)");
    config_.fsdp_degree = fsdp;
  }
  if (config_.tp_size != 1 && config_.tp_size != tp)
    throw std::invalid_argument("GraphTrainer: PassConfig::tp_size is " +
                                std::to_string(config_.tp_size) + " but the mesh's TP group has " +
                                std::to_string(tp) +
                                " ranks; leave tp_size at 1 (the mesh fills it)");
  config_.tp_size = tp;
  if (tp > 1 && optimizer_.grad_clip > 0 && mesh_.tp_sharded.empty())
    throw std::invalid_argument(
        "GraphTrainer: gradient clipping over a TP group of " + std::to_string(tp) +
        " ranks needs MeshContext::tp_sharded (the parameters split over it) to count the "
        "global norm");
  {
    std::unordered_set<std::string> names;
    for (const auto& item : model_->named_parameters(true))
      names.insert(item.key());
    for (const auto& fqn : mesh_.tp_sharded)
      if (!names.count(fqn))
        throw std::invalid_argument("GraphTrainer: MeshContext::tp_sharded names '" + fqn +
                                    "', which is no parameter of the model");
  }
  // Parameters FSDPPass will shard must divide by the degree: say so now,
  // not after a capture (FSDPPass checks again, on the graph).
  const bool plan_on = !plan_ || plan_->enabled();
  if (config_.fsdp_enabled && fsdp > 1 && plan_on)
    for (const auto& item : model_->named_parameters(true)) {
      if (plan_ && !plan_->covers_parameter(item.key())) continue;
      const auto& p = item.value();
      if (p.dim() == 0 || p.size(0) % fsdp != 0)
        throw std::invalid_argument(
            "GraphTrainer: parameter '" + item.key() + "' has dim 0 of size " +
            std::to_string(p.dim() == 0 ? 0 : p.size(0)) + ", not divisible by the FSDP degree " +
            std::to_string(fsdp) + "; leave its module out of the PassPlan or change its size");
    }
  if (mesh_.tp) {
    auto held = find_tp_group(mesh_.tp_group_name);
    if (held && held != mesh_.tp)
      throw std::invalid_argument(
          "GraphTrainer: TP group name '" + mesh_.tp_group_name +
          "' is already registered to another Comm; give each TP group its own "
          "MeshContext::tp_group_name (ranks run as threads of one process need one per rank)");
    if (!held) {
      register_tp_group(mesh_.tp_group_name, mesh_.tp);
      registered_tp_ = true;
    }
  }
}

GraphTrainer::~GraphTrainer() {
  if (registered_tp_ && find_tp_group(mesh_.tp_group_name) == mesh_.tp)
    unregister_tp_group(mesh_.tp_group_name);
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
    // Squares by (FSDP shard?, split over TP?): FSDP shards summed over the
    // FSDP group, then TP-split ones over the TP group; replicas once.
    std::unordered_set<std::string> tp_split(mesh_.tp_sharded.begin(), mesh_.tp_sharded.end());
    std::unordered_set<const c10::TensorImpl*> on_tp;
    for (const auto& item : model_->named_parameters(true))
      if (tp_split.count(item.key())) on_tp.insert(item.value().unsafeGetTensorImpl());
    auto opts = torch::TensorOptions().dtype(torch::kFloat64);
    at::Tensor shard_sq = torch::zeros({2}, opts), rep_sq = torch::zeros({2}, opts);
    for (const auto& [p, is_shard] : params)
      (is_shard ? shard_sq : rep_sq)[on_tp.count(p.unsafeGetTensorImpl()) ? 0 : 1].add_(
          p.grad().to(torch::kFloat64).pow(2).sum());
    if (comm_ && comm_->world_size() > 1 && !sharded_.empty()) comm_->all_reduce(shard_sq);
    at::Tensor sq = shard_sq + rep_sq;  // [split over TP, replicated on TP]
    at::Tensor tp_part = sq.narrow(0, 0, 1).clone();
    if (mesh_.tp && mesh_.tp->world_size() > 1) mesh_.tp->all_reduce(tp_part);
    const double norm = std::sqrt(tp_part.item<double>() + sq[1].item<double>());
    const double coef = optimizer_.grad_clip / (norm + 1e-6);
    if (coef < 1.0)
      for (auto& [p, is_shard] : params)
        p.mutable_grad().mul_(coef);
  }
  if (params.empty()) return;
  // NOTE [Graph mode's optimizer]
  // The optimizer is LibTorch's, made at the first step that has gradients:
  // by then compile() has run and FSDPPass has swapped the live parameters
  // for this rank's shards, so the optimizer's state is per shard (a state
  // made before would hold the whole tensors). It holds every distinct
  // parameter of the model; one without a gradient in a step is skipped by
  // torch::optim as by torch.optim. Clipping stays here: the global norm
  // sums FSDP shards over the FSDP group and TP splits over the TP group,
  // which torch::nn::utils::clip_grad_norm_ cannot know.
  if (!optim_) {
    std::vector<at::Tensor> all;
    std::unordered_set<const c10::TensorImpl*> once;
    for (const auto& p : model_->parameters(true))
      if (once.insert(p.unsafeGetTensorImpl()).second) all.push_back(p);
    if (optimizer_.make) {
      optim_ = optimizer_.make(all);
      if (!optim_) throw std::invalid_argument("GraphTrainer: OptimizerConfig::make returned null");
      size_t held = 0;
      for (const auto& group : optim_->param_groups())
        for (const auto& p : group.params())
          held += once.count(p.unsafeGetTensorImpl());
      if (held == 0)
        throw std::invalid_argument(
            "GraphTrainer: the optimizer OptimizerConfig::make returned holds none of the "
            "model's parameters (make it over the tensors it is given)");
    } else if (optimizer_.sgd) {
      optim_ = std::make_unique<torch::optim::SGD>(
          all, torch::optim::SGDOptions(optimizer_.lr).weight_decay(optimizer_.weight_decay));
    } else {
      optim_ = std::make_unique<torch::optim::AdamW>(
          all, torch::optim::AdamWOptions(optimizer_.lr)
                   .betas({optimizer_.beta1, optimizer_.beta2})
                   .eps(optimizer_.eps)
                   .weight_decay(optimizer_.weight_decay));
    }
  }
  optim_->step();
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
