// LibTorch version compatibility: the ONLY place in hyperparallel that tests
// TORCH_VERSION_*. Everything else uses the names defined here. The targets
// are PyTorch 2.11 from pip and Debian 13's LibTorch 2.6
// (docs/torch_versions.md).
#pragma once

#include <torch/version.h>

#include <chrono>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
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

/// True where this LibTorch has a grouped matrix product
/// (`at::_grouped_mm`, 2.9 and later) that takes `dtype` on `device`,
/// backward included: probed once per (dtype, device) with a small product
/// (float32 and bfloat16 on the CPU in 2.11; never float64). False on older
/// LibTorch (NOTE [Grouped expert products] in hp/moe/moe_layer.cpp).
bool has_grouped_mm(c10::ScalarType dtype, c10::Device device);

/// out[offs[g-1]:offs[g]] = a[offs[g-1]:offs[g]] @ b[g] for each group g:
/// `a` [rows, k], `b` [groups, k, n], `offs` int32 [groups], the running
/// row ends. Only where has_grouped_mm; throws elsewhere.
at::Tensor grouped_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs);

}  // namespace compat
}  // namespace hp
