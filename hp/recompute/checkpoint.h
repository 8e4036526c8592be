// Activation checkpointing that works with the dx/dw split: `checkpoint` drops
// a block's activations in forward and recomputes them for backward, sharing
// one recompute between dx and dw inside a RecomputeSession; handles collected
// during forward let a scheduler start a recompute early (prefetch).
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "hp/recompute/session.h"

namespace hp::recompute {

using TensorList = std::vector<torch::Tensor>;
/// A checkpointed block: block inputs -> block outputs. Weights are used
/// through the closure (see `checkpoint`).
using BlockFn = std::function<TensorList(const TensorList&)>;

/// Options of `checkpoint`.
struct CheckpointOptions {
  /// Replay the forward's random numbers in the recompute (saves the default
  /// generator's state of every device the inputs live on).
  TORCH_ARG(bool, preserve_rng_state) = true;
  /// Fail the recompute when an input or weight was modified in place since the
  /// forward (the recompute would silently differ).
  TORCH_ARG(bool, check_versions) = true;
};

/// Runs `fn(inputs)` without keeping its activations and returns its outputs,
/// attached to one backward node whose next edges are the inputs and the
/// `weights` (so the dx/dw split sees it as the joining node). Its backward
/// recomputes `fn` (or takes a prefetched / retained recompute of the current
/// session) and runs the block's own split: dx for a dx request, dw for a dw
/// request, both fused for a plain backward.
///
/// `weights` must list every tensor requiring grad that `fn` uses other than
/// `inputs` (typically the parameters it captures): gradients of unlisted ones
/// are not computed. Floating-point outputs get gradients; others are
/// returned as computed. Under NoGradGuard, or when nothing requires grad, this
/// is plainly `fn(inputs)`.
///
/// Without a session or prefetch this is an ordinary checkpoint: each backward
/// that reaches the block recomputes it and frees the result afterwards (so a
/// split backward, dx then dw, recomputes twice).
TensorList checkpoint(const BlockFn& fn, const TensorList& inputs, const TensorList& weights = {},
                      const CheckpointOptions& options = {});

struct Block;  // implementation detail of checkpoint.cpp

/// One checkpointed block, as seen by a scheduler. Cheap to copy; does not keep
/// the block alive (it lives as long as its backward graph).
class RecomputeHandle {
 public:
  /// Recomputes the block now (prefetch) unless a recompute is already waiting.
  /// Inside a RecomputeSession the result goes to that session; otherwise to
  /// the block itself. The next backward of the block consumes it.
  void recompute() const;
  /// Whether a recomputed result is waiting (in the current session, or on the
  /// block when no session is current).
  bool is_recomputed() const;
  /// Drops a result prefetched outside any session (results prefetched in a
  /// session are dropped by `clear_session`).
  void release() const;
  /// False once the block's graph is gone (its last backward ran or its outputs died).
  bool alive() const;
  /// The block's process-unique id.
  uint64_t block_id() const { return block_id_; }

 private:
  friend TensorList checkpoint(const BlockFn&, const TensorList&, const TensorList&,
                               const CheckpointOptions&);
  RecomputeHandle(std::weak_ptr<Block> block, uint64_t id)
      : block_(std::move(block)), block_id_(id) {}
  std::weak_ptr<Block> block_;
  uint64_t block_id_ = 0;
};

/// While alive, gathers one handle per block that `checkpoint` creates on this
/// thread (blocks created by a recompute, e.g. nested ones, are not
/// collected). Collectors nest; the innermost one collects.
class HandleCollector {
 public:
  HandleCollector();
  ~HandleCollector();
  HandleCollector(const HandleCollector&) = delete;
  HandleCollector& operator=(const HandleCollector&) = delete;

  /// The handles gathered so far, in creation order.
  const std::vector<RecomputeHandle>& handles() const { return handles_; }
  /// Moves the gathered handles out (the collector keeps collecting).
  std::vector<RecomputeHandle> take();

 private:
  friend TensorList checkpoint(const BlockFn&, const TensorList&, const TensorList&,
                               const CheckpointOptions&);
  std::vector<RecomputeHandle> handles_;
};

/// `handle.recompute()` for each handle, in order.
void prefetch(const std::vector<RecomputeHandle>& handles);

}  // namespace hp::recompute
