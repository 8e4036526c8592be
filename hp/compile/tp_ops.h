// Tensor-parallel collectives as dispatcher operators (`hp::tp_copy`, Megatron's
// f, and `hp::tp_reduce`, its g) that a capture records and a replay runs, and
// the process-wide registry of named TP groups they look their Comm up in.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

namespace hp::distributed {
class Comm;
}

namespace hp::compile {

// NOTE [TP collectives as operators]
// Graph mode does not partition tensor parallelism: the model's forward,
// written by the layer above, already holds its TP collectives (seed 002 §9).
// A capture, though, records ATen operators only; an all-reduce made by a
// plain Comm call inside the forward (or inside an autograd Function's
// backward) would run once at capture and be missing from every replay. So
// the two collectives of Megatron's TP regions are dispatcher operators of
// their own, with an autograd formula:
//   hp::tp_copy(Tensor x, str group) -> Tensor    f: forward identity (a copy),
//                                                    backward all-reduce (sum)
//   hp::tp_reduce(Tensor x, str group) -> Tensor  g: forward all-reduce (sum),
//                                                    backward identity
// Their CompositeExplicitAutograd kernel does the work (any device the
// group's Comm carries); their Autograd kernel is a torch::autograd::Function
// whose backward calls the other operator through the dispatcher. The capture
// therefore records hp::tp_copy / hp::tp_reduce in the forward and the
// backward's hp::tp_reduce as ordinary Call nodes (they are not
// CompositeImplicit, so not transparent), and the replay, which dispatches
// below autograd, runs the kernel that communicates. The passes leave them
// alone: they are Calls, not Collectives, so FSDP does not shard around them
// and AutoOverlap does not move them; they run synchronously, in graph order,
// which every rank of the TP group shares.
//
// The group is an argument by *name*, looked up at each call in a
// process-wide registry (register_tp_group): a Comm is no IValue, and a name
// keeps the graph printable. GraphTrainer fills the registry from its
// MeshContext; ranks run as threads of one process use one name per rank.
// Why not the alternatives: a Collective node (the FSDP kind) would need a
// TP-aware pass to place it, which the seed leaves for later, and the capture
// could not record it from the forward; plain Comm calls are invisible to the
// capture (the reason for all this). The f copy (a fresh tensor rather than
// an alias) follows torch's rule for custom operators that return no alias of
// their inputs; it costs one activation copy per column-parallel layer.

/// Registers `comm` as the TP group `name` for this process (replacing any
/// Comm registered under that name). Throws on an empty name or a null Comm.
void register_tp_group(const std::string& name, std::shared_ptr<hp::distributed::Comm> comm);
/// Removes `name` (no-op when absent).
void unregister_tp_group(const std::string& name);
/// The Comm registered as `name`; throws naming the registered groups when
/// there is none.
std::shared_ptr<hp::distributed::Comm> tp_group(const std::string& name);
/// The Comm registered as `name`, or null.
std::shared_ptr<hp::distributed::Comm> find_tp_group(const std::string& name);

/// Megatron's f (the input of a column-parallel layer): returns a copy of
/// `x`; its gradient is the sum of the gradients over the TP group `group`.
at::Tensor tp_copy(const at::Tensor& x, const std::string& group);
/// Megatron's g (the output of a row-parallel layer): the sum of `x` over
/// the TP group `group`; its gradient passes through unchanged.
at::Tensor tp_reduce(const at::Tensor& x, const std::string& group);

/// The operators' schema names, as Graph Call nodes carry them.
inline constexpr const char* kTpCopyOp = "hp::tp_copy";
inline constexpr const char* kTpReduceOp = "hp::tp_reduce";

}  // namespace hp::compile
