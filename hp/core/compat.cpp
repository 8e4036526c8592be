// LibTorch version compatibility (see compat.h).
#include "hp/core/compat.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>
#include <mutex>
#include <utility>

namespace hp {

const char* torch_version() {
  return TORCH_VERSION;
}

namespace compat {

c10::intrusive_ptr<c10d::ProcessGroup> split_process_group(c10d::ProcessGroup& group,
                                                           const std::vector<int>& ranks,
                                                           std::chrono::milliseconds timeout,
                                                           const std::string& name) {
#if HP_TORCH_AT_LEAST(2, 8)
  auto sub = group.splitGroup(ranks, timeout, std::nullopt, name, name);
  TORCH_CHECK(sub, "splitting the ", group.getBackendName(), " process group over ", ranks.size(),
              " ranks gave no group (is this rank in the list?)");
  return sub;
#else
  (void)group;
  (void)ranks;
  (void)timeout;
  TORCH_CHECK(false, "splitting a process group made outside hyperparallel (", name,
              ") needs LibTorch 2.8 or later; this is ", TORCH_VERSION,
              ". Make the subgroup with torch.distributed.new_group and pass it instead");
#endif
}

bool has_grouped_mm(c10::ScalarType dtype, c10::Device device) {
#if HP_TORCH_AT_LEAST(2, 9)
  static std::mutex mu;
  static std::map<std::pair<int, std::string>, bool> known;
  const auto key = std::make_pair(static_cast<int>(dtype), device.str());
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  bool ok = false;
  try {
    // Two groups, one of them empty, forward and backward: what a layer
    // whose router skipped an expert asks of it.
    torch::AutoGradMode grad_on(true);
    auto o = torch::TensorOptions().dtype(dtype).device(device);
    auto a = torch::ones({4, 8}, o).requires_grad_(true);
    auto b = torch::ones({2, 8, 8}, o).requires_grad_(true);
    auto offs = torch::tensor({0, 4}, torch::TensorOptions().dtype(torch::kInt).device(device));
    auto y = at::_grouped_mm(a, b, offs);
    auto g = torch::autograd::grad({y}, {a, b}, {torch::ones_like(y)});
    ok = g[0].defined() && g[1].defined();
  } catch (const std::exception&) {
    ok = false;
  }
  known[key] = ok;
  return ok;
#else
  (void)dtype;
  (void)device;
  return false;
#endif
}

at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
#if HP_TORCH_AT_LEAST(2, 9)
  return at::_grouped_mm(a, b, offs);
#else
  (void)a;
  (void)b;
  (void)offs;
  TORCH_CHECK(false, "a grouped matrix product needs LibTorch 2.9 or later; this is ",
              TORCH_VERSION);
#endif
}

}  // namespace compat
}  // namespace hp
