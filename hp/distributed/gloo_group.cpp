// What both ways of making a Gloo group share (NOTE [Making a Gloo group]):
// a c10d::ProcessGroup that carries a Gloo backend for CPU tensors.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "hp/distributed/comm_internal.h"

namespace hp::distributed::detail {

c10::intrusive_ptr<c10d::ProcessGroup> wrap_gloo_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
    c10::intrusive_ptr<c10d::Backend> backend) {
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world_size);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  return pg;
}

}  // namespace hp::distributed::detail
