// The differentiable all-to-all: a forward exchange, and an autograd node
// whose backward is the exchange the other way (NOTE [The all-to-all in the
// backward]).
#include "hp/moe/all_to_all.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <numeric>

namespace hp::moe {
namespace {

torch::Tensor exchange(distributed::Comm& group, const torch::Tensor& x,
                       const std::vector<int64_t>& send_rows,
                       const std::vector<int64_t>& recv_rows) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  torch::Tensor out = torch::empty(shape, x.options());
  group.all_to_all(out, recv_rows, x.contiguous(), send_rows);
  return out;
}

struct AllToAllBackward : torch::autograd::Node {
  std::shared_ptr<distributed::Comm> group;
  std::vector<int64_t> send_rows, recv_rows;  // the forward's
  std::vector<int64_t> input_shape;
  c10::TensorOptions input_options;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::Tensor g = grads.at(0);
    if (!g.defined()) {
      // Still take part (NOTE [The all-to-all in the backward]).
      std::vector<int64_t> shape = input_shape;
      shape[0] = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
      g = torch::zeros(shape, input_options);
    }
    torch::autograd::variable_list out(1);
    out[0] = exchange(*group, g, recv_rows, send_rows);
    return out;
  }
  std::string name() const override { return "hp::moe::AllToAllBackward"; }
};

}  // namespace

torch::Tensor all_to_all(const std::shared_ptr<distributed::Comm>& group, const torch::Tensor& x,
                         const std::vector<int64_t>& send_rows,
                         const std::vector<int64_t>& recv_rows) {
  TORCH_CHECK(group != nullptr, "all_to_all: no expert-parallel group");
  TORCH_CHECK(x.dim() >= 1, "all_to_all: the rows must be a tensor of at least one dimension");
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = exchange(*group, x.detach(), send_rows, recv_rows);
  }
  if (torch::GradMode::is_enabled() && x.requires_grad()) {
    auto node =
        std::shared_ptr<AllToAllBackward>(new AllToAllBackward(), torch::autograd::deleteNode);
    node->group = group;
    node->send_rows = send_rows;
    node->recv_rows = recv_rows;
    node->input_shape = x.sizes().vec();
    node->input_options = x.options();
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(out, node);
  }
  return out;
}

}  // namespace hp::moe
