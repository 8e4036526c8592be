// The communication patterns of collectives.h over Comm's point-to-point
// batches and collectives.
#include "hp/distributed/collectives.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <map>

namespace hp::distributed {

void sum_among_holders(Comm& comm, std::vector<at::Tensor>& values,
                       const std::vector<std::vector<int>>& holders) {
  TORCH_CHECK(values.size() == holders.size(), "sum_among_holders: ", values.size(), " values but ",
              holders.size(), " holder lists");
  const int me = comm.rank();
  std::map<int, std::vector<size_t>> shared_with;  // peer -> indices, in list order
  for (size_t i = 0; i < values.size(); ++i) {
    TORCH_CHECK(std::find(holders[i].begin(), holders[i].end(), me) != holders[i].end(),
                "sum_among_holders: value ", i, " is not held by this rank (", me, ")");
    for (int r : holders[i])
      if (r != me) shared_with[r].push_back(i);
  }
  if (shared_with.empty()) return;
  std::vector<P2POp> ops;
  std::map<int, at::Tensor> received;
  for (const auto& [peer, idx] : shared_with) {
    std::vector<at::Tensor> flat;
    for (size_t i : idx)
      flat.push_back(values[i].reshape({-1}));
    at::Tensor out = at::cat(flat);
    received[peer] = at::empty_like(out);
    ops.push_back(P2POp::send(out, peer));
    ops.push_back(P2POp::recv(received[peer], peer));
  }
  auto works = comm.batch(ops);
  wait_all(works);
  std::map<size_t, std::map<int, at::Tensor>> parts;  // value -> rank -> its part
  for (size_t i = 0; i < values.size(); ++i)
    if (holders[i].size() > 1) parts[i][me] = values[i];
  for (const auto& [peer, idx] : shared_with) {
    int64_t offset = 0;
    for (size_t i : idx) {
      const auto& like = values[i];
      parts[i][peer] = received[peer].narrow(0, offset, like.numel()).view(like.sizes());
      offset += like.numel();
    }
  }
  for (auto& [i, by_rank] : parts) {
    at::Tensor sum = by_rank.begin()->second.clone();
    for (auto it = std::next(by_rank.begin()); it != by_rank.end(); ++it)
      sum.add_(it->second);
    values[i] = sum;
  }
}

std::vector<at::Tensor> gather_rows(Comm& comm, const at::Tensor& rows_raw, int root) {
  at::Tensor rows = rows_raw.contiguous();
  TORCH_CHECK(rows.dim() >= 1, "gather_rows: the tensor needs a row dimension");
  const int n = comm.world_size(), me = comm.rank();
  // The counts travel where the rows do (a group over NCCL carries CUDA tensors only).
  auto count = at::tensor({rows.size(0)}, at::kLong).to(rows.device());
  auto counts = at::empty({n}, rows.options().dtype(at::kLong));
  comm.all_gather(counts, count);
  counts = counts.cpu();
  std::vector<at::Tensor> out;
  if (me != root) {
    if (rows.size(0) > 0) comm.send(rows, root);
    return out;
  }
  std::vector<P2POp> ops;
  for (int r = 0; r < n; ++r) {
    if (r == me) {
      out.push_back(rows);
      continue;
    }
    auto shape = rows.sizes().vec();
    shape[0] = counts[r].item<int64_t>();
    out.push_back(at::empty(shape, rows.options()));
    if (shape[0] > 0) ops.push_back(P2POp::recv(out.back(), r));
  }
  auto works = comm.batch(ops);
  wait_all(works);
  return out;
}

double one_way_latency(Comm& comm, int a, int b, const at::Tensor& probe, int trips) {
  const int me = comm.rank();
  if (me != a && me != b) return 0.0;
  TORCH_CHECK(a != b && trips >= 2, "one_way_latency: needs two ranks and at least two trips");
  using Clock = std::chrono::steady_clock;
  std::vector<double> times;
  for (int k = 0; k < trips; ++k) {
    auto t0 = Clock::now();
    if (me == a) {
      comm.send(probe, b);
      comm.recv(probe, b);
    } else {
      comm.recv(probe, a);
      comm.send(probe, a);
    }
    if (k > 0) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2] / 2;
}

}  // namespace hp::distributed
