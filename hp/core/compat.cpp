// LibTorch version compatibility (see compat.h).
#include "hp/core/compat.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

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

}  // namespace compat
}  // namespace hp
