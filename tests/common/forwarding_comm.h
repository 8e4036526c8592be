// Test helper: a Comm that hands every call to the Comm it wraps. Test
// decorators derive from it and override only what they observe or change
// (a batch's posts, the works' kind, whether early receives are free).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "hp/distributed/comm.h"

namespace hp::testing {

class ForwardingComm : public distributed::Comm {
 public:
  explicit ForwardingComm(std::shared_ptr<distributed::Comm> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  std::string backend_name() const override { return inner_->backend_name(); }
  bool early_receives_are_free() const override { return inner_->early_receives_are_free(); }
  // Single operations go through batch(), so a decorator sees every post there.
  distributed::Work isend(const at::Tensor& t, int dst) override {
    return batch({distributed::P2POp::send(t, dst)})[0];
  }
  distributed::Work irecv(const at::Tensor& t, int src) override {
    return batch({distributed::P2POp::recv(t, src)})[0];
  }
  std::vector<distributed::Work> batch(const std::vector<distributed::P2POp>& ops) override {
    return inner_->batch(ops);
  }
  void all_reduce(const at::Tensor& t, distributed::ReduceOp op) override {
    inner_->all_reduce(t, op);
  }
  void all_gather(std::vector<at::Tensor>& out, const at::Tensor& in) override {
    inner_->all_gather(out, in);
  }
  void broadcast(const at::Tensor& t, int root) override { inner_->broadcast(t, root); }
  void barrier() override { inner_->barrier(); }
  std::shared_ptr<distributed::Comm> split(const std::vector<int>& ranks) override {
    return inner_->split(ranks);
  }

 protected:
  std::shared_ptr<distributed::Comm> inner_;
};

}  // namespace hp::testing
