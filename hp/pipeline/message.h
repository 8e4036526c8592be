// Message: what one transfer between stages carries - a list of tensors,
// each in its own dtype and shape - and its Layout, what the receiver of a
// transfer must expect (NOTE [Messages between stages]).
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

namespace hp::pipeline {

/// What a stage hands the next (forward) or the previous (backward): tensors
/// in their own dtypes and shapes. A one-tensor activation is a one-element
/// Message.
using Message = std::vector<torch::Tensor>;

/// One tensor of a message as its receiver must expect it.
struct Leaf {
  torch::Dtype dtype = torch::kFloat32;
  std::vector<int64_t> shape;
  /// Takes a gradient: a leaf whose sender's tensor requires grad. Only such
  /// leaves' gradients travel back (NOTE [Messages between stages]).
  bool grad = true;

  bool operator==(const Leaf& o) const {
    return dtype == o.dtype && shape == o.shape && grad == o.grad;
  }
  bool operator!=(const Leaf& o) const { return !(*this == o); }
};
using Layout = std::vector<Leaf>;

// NOTE [Messages between stages]
// A stage's output is a Message: a list of tensors, each sent as it is (its
// own dtype, its own shape, no cast, no packing: an int64 of 2^40 + 1 and a
// bfloat16 arrive bit for bit), the list's tensors posted together in the
// transfer's batch (one coalesced group on NCCL). A leaf whose tensor
// requires grad takes a gradient: the receiving stage gets it as a leaf that
// requires grad, and the backward message holds the gradients of exactly
// those leaves, in order (a gradient autograd left undefined, a leaf the
// next stage did not use, travels as zeros). Leaves that take no gradient
// (masks, ids, position tables) travel forward only. The receiver posts its
// receive before the sender computed the message, so it must know the
// Layout: ExecutorOptions::layout(stage, mb) says what stage `stage` outputs
// for microbatch `mb`, and the sender checks its output against it (a
// mismatch names the stage, microbatch and leaf).

/// The layout of `m` as its sender sees it.
inline Layout layout_of(const Message& m) {
  Layout out;
  out.reserve(m.size());
  for (const torch::Tensor& t : m)
    out.push_back({t.scalar_type(), t.sizes().vec(), t.requires_grad()});
  return out;
}

/// "[float32 [2, 8] grad, int64 [2] ]": for errors.
inline std::string to_string(const Leaf& l) {
  std::string s = std::string(c10::toString(l.dtype)) + " [";
  for (size_t i = 0; i < l.shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(l.shape[i]);
  return s + "]" + (l.grad ? " grad" : "");
}

inline std::string to_string(const Layout& layout) {
  std::string s = "[";
  for (size_t i = 0; i < layout.size(); ++i)
    s += (i ? ", " : "") + to_string(layout[i]);
  return s + "]";
}

}  // namespace hp::pipeline
