// The differentiable all-to-all: a forward exchange, and an autograd node
// whose backward is the exchange the other way (NOTE [The all-to-all in the
// backward]).
#include "hp/moe/all_to_all.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "hp/autograd/split_plan.h"

#include <mutex>
#include <numeric>

namespace hp::moe {
namespace {

torch::Tensor exchange(distributed::Comm& group, const torch::Tensor& x,
                       const std::vector<int64_t>& send_rows,
                       const std::vector<int64_t>& recv_rows) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  torch::Tensor out = torch::empty(shape, x.options());
  group.all_to_all(out, recv_rows, x.contiguous(), send_rows);
  return out;
}

// An anchor: with a split backward its exchange runs in I, never in a W that
// may be deferred (NOTE [Anchors] in hp/autograd/split_plan.h).
struct AllToAllBackward : hp::autograd::AnchorNode {
  std::shared_ptr<distributed::Comm> group;
  std::vector<int64_t> send_rows, recv_rows;  // the forward's
  std::vector<int64_t> input_shape;
  c10::TensorOptions input_options;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::Tensor g = grads.at(0);
    if (!g.defined()) {
      // Still take part (NOTE [The all-to-all in the backward]).
      std::vector<int64_t> shape = input_shape;
      shape[0] = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
      g = torch::zeros(shape, input_options);
    }
    torch::autograd::variable_list out(1);
    out[0] = exchange(*group, g, recv_rows, send_rows);
    return out;
  }
  std::string name() const override { return "hp::moe::AllToAllBackward"; }
};

// Makes `out` the exchange of `x` in the graph: its backward sends the
// gradient's rows back (recv_rows and send_rows swapped).
void attach_backward(torch::Tensor& out, const torch::Tensor& x,
                     const std::shared_ptr<distributed::Comm>& group,
                     const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows) {
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) return;
  auto node =
      std::shared_ptr<AllToAllBackward>(new AllToAllBackward(), torch::autograd::deleteNode);
  node->group = group;
  node->send_rows = send_rows;
  node->recv_rows = recv_rows;
  node->input_shape = x.sizes().vec();
  node->input_options = x.options();
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(out, node);
}

// NOTE [Counts at the head of the rows]
// A rank cannot post the receive of a peer's rows before it knows how many
// come, so a plain dispatch exchanges the counts and waits, then the rows and
// waits again: two waits one latency apart, with almost nothing to compute
// between them. In an overlapped pair every wait is a turn (NOTE
// [Overlapped pairs] in hp/pipeline/overlap.cpp), and there the forward's
// two waits came back to back: the partner's node between them was too
// short to hide the second, and both halves waited in step. So
// all_to_all_sized sends each peer its counts and, right behind them, its
// rows, without waiting; the receiver posts the counts' receives, and
// inside the one wait, once the counts are in, the rows' receives. One wait
// and one latency: the rows leave with their counts, not a round trip later
// (a transport that holds a send until its receive is posted, as Gloo's
// does, lets it go at that post, on loopback at once; the link model's
// delay is the sender's: NOTE [The link model]). Point-to-point is matched
// in posting order per pair of ranks (NOTE [Point-to-point without tags]),
// so the rows' receives must be the next ones this thread posts on the
// group, and no other thread may post on it meanwhile: the halves of an
// overlapped pair post on lanes of their own (NOTE [Lanes] in
// hp/distributed/lanes.cpp). TokenDispatcher::dispatch takes this path on
// such a group only (distributed::lane_count), on the CPU; elsewhere the
// counts are exchanged, and read on the host, first.
struct SizedWork : distributed::Work::Impl {
  std::shared_ptr<distributed::Comm> group;
  std::vector<distributed::Work> sends;   // counts and rows, to every peer
  std::vector<distributed::Work> counts;  // the counts' receives
  std::vector<distributed::Work> rows;    // the rows' receives, posted in wait()
  std::vector<torch::Tensor> keep;        // what is sent, alive until the wait ends
  torch::Tensor recv_counts;              // [ranks, k]
  torch::Tensor own;                      // this rank's rows for itself
  std::vector<int64_t> trailing;          // the rows' shape past dim 0
  c10::TensorOptions options;
  torch::Tensor out;
  mutable std::mutex m;
  bool aborted = false;
  bool rows_posted = false;

  // The counts are there and this rank's sends left (distributed::
  // test_arrived), and the rows' receives, which the wait posts once it has
  // read the counts, have completed: the rows come after the counts by
  // their own transfer time, which a link model makes a millisecond.
  std::optional<bool> test() const override {
    const auto c = distributed::test_arrived(counts, sends);
    if (c != true) return c;
    std::lock_guard<std::mutex> lock(m);
    if (!rows_posted) return false;
    return distributed::test_all(rows);
  }
  void abort() override {
    std::lock_guard<std::mutex> lock(m);
    aborted = true;
    for (auto* works : {&sends, &counts, &rows})
      for (auto& w : *works)
        w.abort();
  }
  void wait() override {
    const int ranks = group->world_size(), me = group->rank();
    // The counts first, not the sends: a peer takes this rank's rows only
    // once it has this rank's counts, and the sends of a transport that
    // holds them until the receive is posted (Gloo) end only then.
    distributed::wait_all(counts);
    std::vector<int64_t> from(ranks), at(ranks + 1, 0);
    auto sums = recv_counts.sum(1);
    for (int q = 0; q < ranks; ++q) {
      from[q] = sums[q].item<int64_t>();
      TORCH_CHECK(from[q] >= 0, "all_to_all_sized: rank ", q, " sent a negative count");
      at[q + 1] = at[q] + from[q];
    }
    std::vector<int64_t> shape{at[ranks]};
    shape.insert(shape.end(), trailing.begin(), trailing.end());
    out = torch::empty(shape, options);
    if (from[me] > 0) out.narrow(0, at[me], from[me]).copy_(own);
    std::vector<distributed::P2POp> ops;
    for (int q = 0; q < ranks; ++q)
      if (q != me && from[q] > 0)
        ops.push_back(distributed::P2POp::recv(out.narrow(0, at[q], from[q]), q));
    {
      std::lock_guard<std::mutex> lock(m);
      if (!ops.empty()) rows = group->batch(ops);
      rows_posted = true;
      if (aborted)
        for (auto& w : rows)
          w.abort();
    }
    distributed::wait_all(rows);
    distributed::wait_all(sends);
    keep.clear();
  }
};

}  // namespace

torch::Tensor all_to_all(const std::shared_ptr<distributed::Comm>& group, const torch::Tensor& x,
                         const std::vector<int64_t>& send_rows,
                         const std::vector<int64_t>& recv_rows) {
  TORCH_CHECK(group != nullptr, "all_to_all: no expert-parallel group");
  TORCH_CHECK(x.dim() >= 1, "all_to_all: the rows must be a tensor of at least one dimension");
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = exchange(*group, x.detach(), send_rows, recv_rows);
  }
  attach_backward(out, x, group, send_rows, recv_rows);
  return out;
}

SizedRows all_to_all_sized(const std::shared_ptr<distributed::Comm>& group, const torch::Tensor& x,
                           const torch::Tensor& counts) {
  TORCH_CHECK(group != nullptr, "all_to_all_sized: no expert-parallel group");
  const int ranks = group->world_size(), me = group->rank();
  TORCH_CHECK(counts.dim() == 2 && counts.size(0) == ranks &&
                  counts.scalar_type() == torch::kLong && counts.device().is_cpu(),
              "all_to_all_sized: counts must be int64 [", ranks, ", k] on the CPU, got ",
              counts.sizes(), " ", counts.scalar_type(), " on ", counts.device());
  TORCH_CHECK(x.dim() >= 1,
              "all_to_all_sized: the rows must be a tensor of at least one dimension");
  auto c = counts.contiguous();
  auto sums = c.sum(1);
  std::vector<int64_t> send_rows(ranks), at(ranks + 1, 0);
  for (int q = 0; q < ranks; ++q) {
    send_rows[q] = sums[q].item<int64_t>();
    TORCH_CHECK(send_rows[q] >= 0, "all_to_all_sized: a negative count for rank ", q);
    at[q + 1] = at[q] + send_rows[q];
  }
  TORCH_CHECK(at[ranks] == x.size(0), "all_to_all_sized: the counts add up to ", at[ranks],
              " rows but there are ", x.size(0));
  auto work = std::make_shared<SizedWork>();
  work->group = group;
  work->recv_counts = torch::empty_like(c);
  work->recv_counts[me].copy_(c[me]);
  torch::Tensor in = x.detach().contiguous();
  work->own = in.narrow(0, at[me], send_rows[me]);
  work->trailing = in.sizes().slice(1).vec();
  work->options = in.options();
  // Per peer its counts, then its rows, then the counts' receives, peers in
  // rank order (NOTE [Sends before receives] in hp/schedule/lower.cpp).
  std::vector<distributed::P2POp> sends, receives;
  for (int q = 0; q < ranks; ++q) {
    if (q == me) continue;
    work->keep.push_back(c[q]);
    sends.push_back(distributed::P2POp::send(c[q], q));
    receives.push_back(distributed::P2POp::recv(work->recv_counts[q], q));
    if (send_rows[q] == 0) continue;
    work->keep.push_back(in.narrow(0, at[q], send_rows[q]));
    sends.push_back(distributed::P2POp::send(work->keep.back(), q));
  }
  if (!sends.empty()) {
    work->sends = group->batch(sends);
    work->counts = group->batch(receives);
  }
  distributed::Work(work).wait();
  std::vector<int64_t> recv_rows(ranks);
  auto got = work->recv_counts.sum(1);
  for (int q = 0; q < ranks; ++q)
    recv_rows[q] = got[q].item<int64_t>();
  SizedRows r{work->out, work->recv_counts};
  attach_backward(r.rows, x, group, send_rows, recv_rows);
  return r;
}

}  // namespace hp::moe
