// DeviceMesh: ranks arranged on named dimensions ("dp", "pp", "tp", ...), the
// one place that knows rank <-> coordinates, with a Comm for this rank's
// slice along each dimension.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hp/distributed/comm.h"

namespace hp::distributed {

// NOTE [Mesh layout]
// Dimensions are listed outermost first and ranks are laid out row-major,
// the last dimension fastest, as torch.distributed.device_mesh lays them out:
// with dims (dp = 2, pp = 3), rank = dp * 3 + pp, so the 3 ranks of one
// pipeline are consecutive. The slice of a rank along a dimension is the set
// of ranks that share all its other coordinates; the slices along one
// dimension partition the world.

/// Named dimensions and their sizes, outermost first.
struct MeshShape {
  std::vector<std::string> names;
  std::vector<int> sizes;
  /// The product of the sizes.
  int world_size() const;
  /// Index of `name`, or -1.
  int index_of(const std::string& name) const;
  /// Throws std::invalid_argument unless names are unique and non-empty,
  /// sizes positive, and their product is `world` (saying which differs).
  void check(int world) const;
  /// "dp=2 x pp=3".
  std::string str() const;
};

// NOTE [The training mesh]
// One description of how a training run's ranks are laid out, for `hp
// train` and for Python's hyperparallel.pipeline.mesh: pp ranks per
// pipeline, dp copies of it (data parallel), and the experts spread over ep
// consecutive copies (expert parallelism, carved out of data parallelism).
// Dimensions, outermost first: edp = dp / ep (the copies holding the same
// experts), ep, pp; so the ranks of one pipeline are consecutive, and copy d
// = edp * ep + e is in EP group edp with expert slice e. The data-parallel
// group of a rank is its slice along edp and ep together.

/// The training mesh's shape over `world` ranks (NOTE [The training mesh]);
/// std::invalid_argument saying what to change when a size is below 1, ep
/// does not divide dp, or pp x dp is not the world.
MeshShape training_mesh(int world, int pp, int dp, int ep);

/// A mesh of ranks with a Comm per dimension for this rank's slice.
class DeviceMesh {
 public:
  /// Splits `world` into the slices of every dimension (every rank of
  /// `world` calls it, with the same shape). Throws std::invalid_argument
  /// when the shape does not match the world size.
  DeviceMesh(std::shared_ptr<Comm> world, MeshShape shape);
  /// A mesh whose slices someone else made (e.g. Python's DeviceMesh):
  /// `groups[d]` is this rank's group along dimension d, `rank` its rank in
  /// the world. Checks that each group's size and rank agree with the shape.
  DeviceMesh(MeshShape shape, int rank, std::vector<std::shared_ptr<Comm>> groups,
             std::shared_ptr<Comm> world = nullptr);

  const MeshShape& shape() const { return shape_; }
  int rank() const { return rank_; }
  int world_size() const { return shape_.world_size(); }
  /// Size of dimension `name`; 1 for a dimension the mesh does not have.
  int size(const std::string& name) const;
  /// This rank's coordinate along `name` (0 for a dimension it does not have).
  int coordinate(const std::string& name) const;
  /// Coordinates of `rank` (one per dimension) and back.
  std::vector<int> coordinates_of(int rank) const;
  int rank_of(const std::vector<int>& coordinates) const;
  /// The world ranks of this rank's slice along `name`, in slice order.
  std::vector<int> slice_ranks(const std::string& name) const;
  /// The Comm of this rank's slice along `name` (its rank there is
  /// coordinate(name)). Throws naming the mesh's dimensions if absent.
  std::shared_ptr<Comm> group(const std::string& name) const;
  /// The whole mesh's Comm (null when the mesh was built from groups only).
  std::shared_ptr<Comm> world() const { return world_; }

 private:
  MeshShape shape_;
  int rank_ = 0;
  std::shared_ptr<Comm> world_;
  std::vector<std::shared_ptr<Comm>> groups_;
};

}  // namespace hp::distributed
