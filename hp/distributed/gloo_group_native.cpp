// make_gloo_group where LibTorch ships Gloo's headers (Debian's packages):
// c10d's ProcessGroupGloo constructed directly (NOTE [Making a Gloo group]).
// ProcessGroupGloo.hpp is empty without USE_C10D_GLOO; Debian's LibTorch does
// not define it for its users, so it is defined here only (the shared
// precompiled header stays the same for every file).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "hp/distributed/comm_internal.h"

namespace hp::distributed::detail {

c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                       int rank, int world_size,
                                                       const GlooEndpoint& endpoint,
                                                       std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(
      endpoint.interface_name.empty()
          ? c10d::ProcessGroupGloo::createDeviceForHostname(endpoint.address)
          : c10d::ProcessGroupGloo::createDeviceForInterface(endpoint.interface_name));
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, options);
  return wrap_gloo_backend(store, rank, world_size, backend);
}

}  // namespace hp::distributed::detail
