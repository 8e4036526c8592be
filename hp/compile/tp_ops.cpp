// hp::tp_copy and hp::tp_reduce: their schemas, their communicating kernels,
// their autograd formulas (NOTE [TP collectives as operators] in tp_ops.h)
// and the registry of named TP groups.
#include "hp/compile/tp_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <sstream>

#include "hp/distributed/comm.h"

namespace hp::compile {
namespace {

using hp::distributed::Comm;

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

std::map<std::string, std::shared_ptr<Comm>>& registry() {
  static std::map<std::string, std::shared_ptr<Comm>> r;
  return r;
}

using OpSignature = at::Tensor(const at::Tensor&, c10::string_view);

const c10::TypedOperatorHandle<OpSignature>& copy_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(kTpCopyOp, "").typed<OpSignature>();
  return op;
}

const c10::TypedOperatorHandle<OpSignature>& reduce_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(kTpReduceOp, "").typed<OpSignature>();
  return op;
}

// The kernels that do the work (below autograd: what a replay runs).
at::Tensor copy_kernel(const at::Tensor& x, c10::string_view group) {
  (void)tp_group(std::string(group));  // an unknown group fails here, not in backward
  return x.clone(at::MemoryFormat::Contiguous);
}

at::Tensor reduce_kernel(const at::Tensor& x, c10::string_view group) {
  auto comm = tp_group(std::string(group));
  at::Tensor y = x.clone(at::MemoryFormat::Contiguous);
  if (comm->world_size() > 1) comm->all_reduce(y, hp::distributed::ReduceOp::Sum);
  return y;
}

// The autograd formulas: each backward is the other operator, called through
// the dispatcher so that a capture records it.
struct CopyFunction : torch::autograd::Function<CopyFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const std::string& group) {
    ctx->saved_data["group"] = group;
    at::AutoDispatchBelowADInplaceOrView below;
    return copy_op().call(x, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::string group = ctx->saved_data["group"].toStringRef();
    return {reduce_op().call(grads[0], group), at::Tensor()};
  }
};

struct ReduceFunction : torch::autograd::Function<ReduceFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x,
                            const std::string& group) {
    at::AutoDispatchBelowADInplaceOrView below;
    return reduce_op().call(x, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

at::Tensor copy_autograd(const at::Tensor& x, c10::string_view group) {
  return CopyFunction::apply(x, std::string(group));
}

at::Tensor reduce_autograd(const at::Tensor& x, c10::string_view group) {
  return ReduceFunction::apply(x, std::string(group));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hp, m) {
  m.def("tp_copy(Tensor x, str group) -> Tensor");
  m.def("tp_reduce(Tensor x, str group) -> Tensor");
}

TORCH_LIBRARY_IMPL(hp, CompositeExplicitAutograd, m) {
  m.impl("tp_copy", &copy_kernel);
  m.impl("tp_reduce", &reduce_kernel);
}

TORCH_LIBRARY_IMPL(hp, Autograd, m) {
  m.impl("tp_copy", &copy_autograd);
  m.impl("tp_reduce", &reduce_autograd);
}

void register_tp_group(const std::string& name, std::shared_ptr<Comm> comm) {
  TORCH_CHECK(!name.empty(), "register_tp_group: the group name is empty; name the TP group");
  TORCH_CHECK(comm != nullptr, "register_tp_group: no Comm given for TP group '", name, "'");
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[name] = std::move(comm);
}

void unregister_tp_group(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(name);
}

std::shared_ptr<Comm> find_tp_group(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : it->second;
}

std::shared_ptr<Comm> tp_group(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(name);
  if (it != registry().end()) return it->second;
  std::ostringstream known;
  for (const auto& [k, v] : registry())
    known << (known.tellp() > 0 ? ", " : "") << "'" << k << "'";
  TORCH_CHECK(false, "TP group '", name, "' is not registered (registered: ",
              known.tellp() > 0 ? known.str() : std::string("none"),
              "); give GraphTrainer a MeshContext with this tp_group_name, or call "
              "hp::compile::register_tp_group before running the model");
}

at::Tensor tp_copy(const at::Tensor& x, const std::string& group) {
  return copy_op().call(x, group);
}

at::Tensor tp_reduce(const at::Tensor& x, const std::string& group) {
  return reduce_op().call(x, group);
}

}  // namespace hp::compile
