// DeviceMesh: coordinates and the slices' Comms (NOTE [Mesh layout]).
#include "hp/distributed/mesh.h"

#include <c10/util/Exception.h>

#include <set>
#include <stdexcept>

namespace hp::distributed {

int MeshShape::world_size() const {
  int n = 1;
  for (int s : sizes)
    n *= s;
  return n;
}

int MeshShape::index_of(const std::string& name) const {
  for (size_t d = 0; d < names.size(); ++d)
    if (names[d] == name) return int(d);
  return -1;
}

std::string MeshShape::str() const {
  std::string s;
  for (size_t d = 0; d < names.size(); ++d)
    s += (d ? " x " : "") + names[d] + "=" + std::to_string(sizes[d]);
  return s.empty() ? "(no dimensions)" : s;
}

void MeshShape::check(int world) const {
  if (names.empty() || names.size() != sizes.size())
    throw std::invalid_argument("mesh: " + std::to_string(names.size()) + " names for " +
                                std::to_string(sizes.size()) +
                                " sizes; give one size per named "
                                "dimension");
  std::set<std::string> seen;
  for (size_t d = 0; d < names.size(); ++d) {
    if (names[d].empty()) throw std::invalid_argument("mesh: a dimension has no name");
    if (!seen.insert(names[d]).second)
      throw std::invalid_argument("mesh: dimension '" + names[d] + "' appears twice");
    if (sizes[d] < 1)
      throw std::invalid_argument("mesh: dimension " + names[d] + " has size " +
                                  std::to_string(sizes[d]) + "; sizes must be at least 1");
  }
  if (world_size() != world)
    throw std::invalid_argument("mesh " + str() + " holds " + std::to_string(world_size()) +
                                " ranks but there are " + std::to_string(world) +
                                "; the sizes' product must equal the number of ranks");
}

MeshShape training_mesh(int world, int pp, int dp, int ep) {
  const std::string sizes =
      "pp " + std::to_string(pp) + ", dp " + std::to_string(dp) + ", ep " + std::to_string(ep);
  if (pp < 1 || dp < 1 || ep < 1)
    throw std::invalid_argument("mesh: pp, dp and ep must be at least 1 (got " + sizes + ")");
  if (dp % ep != 0)
    throw std::invalid_argument("mesh: ep " + std::to_string(ep) + " does not divide dp " +
                                std::to_string(dp) +
                                ": the expert-parallel groups (ep consecutive data-parallel "
                                "copies each) must tile the copies; make dp a multiple of ep");
  if (int64_t(pp) * dp != world)
    throw std::invalid_argument("mesh: pp " + std::to_string(pp) + " x dp " + std::to_string(dp) +
                                " is " + std::to_string(int64_t(pp) * dp) +
                                " ranks but the world has " + std::to_string(world) +
                                "; start pp x dp ranks, or change pp or dp");
  return MeshShape{{"edp", "ep", "pp"}, {dp / ep, ep, pp}};
}

std::vector<int> DeviceMesh::coordinates_of(int rank) const {
  TORCH_CHECK(rank >= 0 && rank < world_size(), "mesh ", shape_.str(), ": rank ", rank,
              " is not in [0, ", world_size(), ")");
  std::vector<int> c(shape_.sizes.size());
  for (size_t d = shape_.sizes.size(); d-- > 0;) {
    c[d] = rank % shape_.sizes[d];
    rank /= shape_.sizes[d];
  }
  return c;
}

int DeviceMesh::rank_of(const std::vector<int>& coordinates) const {
  TORCH_CHECK(coordinates.size() == shape_.sizes.size(), "mesh ", shape_.str(), ": ",
              coordinates.size(), " coordinates for ", shape_.sizes.size(), " dimensions");
  int r = 0;
  for (size_t d = 0; d < coordinates.size(); ++d) {
    TORCH_CHECK(coordinates[d] >= 0 && coordinates[d] < shape_.sizes[d], "mesh ", shape_.str(),
                ": coordinate ", coordinates[d], " is outside dimension ", shape_.names[d]);
    r = r * shape_.sizes[d] + coordinates[d];
  }
  return r;
}

std::vector<int> DeviceMesh::slice_ranks(const std::string& name) const {
  const int d = shape_.index_of(name);
  if (d < 0) return {rank_};
  std::vector<int> c = coordinates_of(rank_), out;
  for (int k = 0; k < shape_.sizes[d]; ++k) {
    c[d] = k;
    out.push_back(rank_of(c));
  }
  return out;
}

DeviceMesh::DeviceMesh(std::shared_ptr<Comm> world, MeshShape shape)
    : shape_(std::move(shape)), world_(std::move(world)) {
  TORCH_CHECK(world_ != nullptr, "DeviceMesh: no Comm given");
  shape_.check(world_->world_size());
  rank_ = world_->rank();
  // One split per dimension, in dimension order: every rank splits its own
  // slice; the slices partition the world, so every split is matched.
  for (size_t d = 0; d < shape_.names.size(); ++d) {
    const auto ranks = slice_ranks(shape_.names[d]);
    groups_.push_back(ranks.size() == size_t(world_->world_size()) ? world_ : world_->split(ranks));
  }
}

DeviceMesh::DeviceMesh(MeshShape shape, int rank, std::vector<std::shared_ptr<Comm>> groups,
                       std::shared_ptr<Comm> world)
    : shape_(std::move(shape)), rank_(rank), world_(std::move(world)), groups_(std::move(groups)) {
  shape_.check(shape_.world_size());
  if (world_) shape_.check(world_->world_size());
  TORCH_CHECK(groups_.size() == shape_.names.size(), "DeviceMesh: ", groups_.size(), " groups for ",
              shape_.names.size(), " dimensions");
  const auto c = coordinates_of(rank_);
  for (size_t d = 0; d < groups_.size(); ++d) {
    TORCH_CHECK(groups_[d] != nullptr, "DeviceMesh: no group for dimension ", shape_.names[d]);
    TORCH_CHECK(groups_[d]->world_size() == shape_.sizes[d] && groups_[d]->rank() == c[d],
                "DeviceMesh: the group of dimension ", shape_.names[d], " has rank ",
                groups_[d]->rank(), " of ", groups_[d]->world_size(), " but mesh ", shape_.str(),
                " puts rank ", rank_, " at ", shape_.names[d], " = ", c[d], " of ", shape_.sizes[d],
                " (row-major, the last dimension fastest)");
  }
}

int DeviceMesh::size(const std::string& name) const {
  const int d = shape_.index_of(name);
  return d < 0 ? 1 : shape_.sizes[d];
}

int DeviceMesh::coordinate(const std::string& name) const {
  const int d = shape_.index_of(name);
  return d < 0 ? 0 : coordinates_of(rank_)[d];
}

std::shared_ptr<Comm> DeviceMesh::group(const std::string& name) const {
  const int d = shape_.index_of(name);
  TORCH_CHECK(d >= 0, "mesh ", shape_.str(), " has no dimension '", name, "'");
  return groups_[d];
}

}  // namespace hp::distributed
