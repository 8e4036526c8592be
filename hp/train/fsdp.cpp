#include "hp/train/fsdp.h"

#include <utility>

namespace hp::train {

FsdpShards::FsdpShards(std::shared_ptr<distributed::Comm> dp, std::vector<torch::Tensor> params)
    : dp_(std::move(dp)), params_(std::move(params)) {
  TORCH_CHECK(dp_ != nullptr, "--fsdp needs the data-parallel group (--dp 2 or more)");
  world_ = dp_->world_size(), rank_ = dp_->rank();
  for (const auto& p : params_) {
    TORCH_CHECK(p.is_contiguous(), "--fsdp: a parameter is not contiguous");
    const int64_t n = p.numel(), s = (n + world_ - 1) / world_;
    shapes_.push_back(p.sizes().vec());
    numel_.push_back(n);
    shard_numel_.push_back(s);
    offset_.push_back(total_);
    total_ += s;
    auto flat = torch::zeros({s * world_}, p.options());
    flat.narrow(0, 0, n).copy_(p.detach().reshape({-1}));
    shards_.push_back(flat.narrow(0, rank_ * s, s).clone().set_requires_grad(true));
  }
}

void FsdpShards::gather() {
  if (params_.empty()) return;
  std::vector<torch::Tensor> mine;
  for (const auto& s : shards_)
    mine.push_back(s.detach());
  auto in = torch::cat(mine);
  auto out = torch::empty({total_ * world_}, in.options());
  dp_->all_gather(out, in);
  auto rows = out.view({world_, total_});
  for (size_t i = 0; i < params_.size(); ++i) {
    auto whole = rows.narrow(1, offset_[i], shard_numel_[i])
                     .reshape({-1})
                     .narrow(0, 0, numel_[i])
                     .reshape(shapes_[i])
                     .clone();
    params_[i].set_data(whole);
  }
}

void FsdpShards::scatter() {
  if (params_.empty()) return;
  auto in = torch::zeros({world_, total_}, shards_[0].options().requires_grad(false));
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& g = params_[i].grad();
    TORCH_CHECK(g.defined(), "--fsdp: a parameter has no gradient after the step");
    auto padded = torch::zeros({shard_numel_[i] * world_}, g.options());
    padded.narrow(0, 0, numel_[i]).copy_(g.reshape({-1}));
    in.narrow(1, offset_[i], shard_numel_[i]).copy_(padded.view({world_, shard_numel_[i]}));
  }
  auto out = torch::empty({total_}, in.options());
  dp_->reduce_scatter(out, in.view({-1}), distributed::ReduceOp::Avg);
  for (size_t i = 0; i < params_.size(); ++i) {
    shards_[i].mutable_grad() = out.narrow(0, offset_[i], shard_numel_[i]).clone();
    // Between steps this copy holds its shards only.
    params_[i].mutable_grad() = torch::Tensor();
    params_[i].set_data(torch::empty({0}, params_[i].options()));
  }
}

int64_t FsdpShards::shard_bytes() const {
  int64_t b = 0;
  for (const auto& s : shards_)
    b += s.numel() * s.element_size();
  return b;
}

}  // namespace hp::train
