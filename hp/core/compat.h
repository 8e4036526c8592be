// LibTorch version compatibility: the ONLY place in hyperparallel that tests
// TORCH_VERSION_*. Everything else uses the names defined here. The targets
// are PyTorch 2.11 from pip and Debian 13's LibTorch 2.6
// (docs/torch_versions.md).
#pragma once

#include <torch/version.h>

#include <chrono>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

/// True when the LibTorch we build against is at least MAJOR.MINOR.
#define HP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||     \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace c10d {
class ProcessGroup;
}

namespace hp {

/// The LibTorch version we were built against, e.g. "2.11.0".
const char* torch_version();

namespace compat {

/// A subgroup of `group` over its ranks `ranks` (sorted, this rank among
/// them; only the members call it), through the backend's own split
/// (c10d::ProcessGroup::splitGroup, LibTorch 2.8 and later). On older
/// LibTorch it throws: split a group made by hp's own rendezvous instead.
c10::intrusive_ptr<c10d::ProcessGroup> split_process_group(c10d::ProcessGroup& group,
                                                           const std::vector<int>& ranks,
                                                           std::chrono::milliseconds timeout,
                                                           const std::string& name);

}  // namespace compat
}  // namespace hp
