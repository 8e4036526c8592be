// Token dispatch and combine over an expert-parallel group (NOTE [Dispatch
// and combine]).
#include "hp/moe/dispatch.h"

#include <cmath>

#include "hp/distributed/lanes.h"
#include "hp/moe/all_to_all.h"

namespace hp::moe {

// NOTE [Dispatch and combine]
// A token chooses top_k experts; each (token, slot) pair is one row to
// compute. Dispatch:
// 1. Sort the T * top_k pairs by expert, stably (so an expert sees its
//    tokens in token order; with a capacity, the earliest are kept). Experts
//    are placed on ranks in consecutive blocks, so sorting by expert also
//    sorts by destination rank: the rows for rank q are one slice.
// 2. Exchange the counts: every rank tells every other how many rows it
//    sends to each of that rank's experts (one small all-to-all of int64s;
//    the host reads them, since the shapes of what follows depend on them).
// 3. Send the rows: one all-to-all with those counts as splits
//    (all_to_all.h, differentiable). On the CPU, over a group in lanes,
//    2 and 3 are one exchange with one wait: the counts go at the head of
//    the rows (NOTE [Counts at the head of the rows] in all_to_all.cpp).
// 4. Regroup the received rows, which come by source rank and then by
//    expert, into one slice per local expert (by_expert), so each expert
//    runs one product over all its rows.
// Combine runs the steps backwards: the experts' rows back to source order
// (by_source), one all-to-all with the splits swapped, then each pair's row
// times its router weight added into its token, experts in ascending order
// (the order a single process's loop over experts adds them). Every step is
// an autograd operation (index_select, the exchange, index_add), so the
// backward moves gradients the same way back, and the dx/dw split keeps the
// exchanges in dx (NOTE [The all-to-all in the backward]).

void ExpertPlacement::check() const {
  TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "expert placement: rank ", rank,
              " of a group of ", size);
  TORCH_CHECK(num_experts >= 1 && num_experts % size == 0, "the ", num_experts,
              " experts do not divide over the ", size,
              " ranks of the expert-parallel group: use an expert-parallel size that divides ",
              num_experts);
}

TokenDispatcher::TokenDispatcher(std::shared_ptr<distributed::Comm> group, int64_t num_experts,
                                 DispatchOptions options)
    : group_(std::move(group)), options_(options) {
  placement_.num_experts = num_experts;
  placement_.rank = group_ ? group_->rank() : 0;
  placement_.size = group_ ? group_->world_size() : 1;
  placement_.check();
  TORCH_CHECK(options_.capacity_factor >= 0 && std::isfinite(options_.capacity_factor),
              "capacity_factor must be 0 (dropless) or positive, got ", options_.capacity_factor);
}

Dispatched TokenDispatcher::dispatch(const torch::Tensor& x, const torch::Tensor& experts) const {
  const int64_t E = placement_.num_experts, L = placement_.local();
  const int ep = placement_.size;
  if (ep > 1) distributed::check_exchange_allowed("an expert dispatch");
  TORCH_CHECK(x.dim() == 2, "dispatch: tokens must be [tokens, hidden], got ", x.sizes());
  TORCH_CHECK(
      experts.dim() == 2 && experts.size(0) == x.size(0) && experts.scalar_type() == torch::kLong,
      "dispatch: experts must be int64 [tokens, top_k] for ", x.size(0), " tokens, got ",
      experts.sizes(), " ", experts.scalar_type());
  Dispatched d;
  d.num_tokens = x.size(0);
  d.top_k = experts.size(1);
  auto flat = experts.reshape({-1});
  if (flat.numel() > 0) {
    const int64_t lo = flat.min().item<int64_t>(), hi = flat.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < E, "dispatch: an expert id ", lo < 0 ? lo : hi, " is outside [0, ",
                E, ")");
  }
  // 1. Pairs by expert (stable), counts per expert, the capacity.
  torch::Tensor order =
      std::get<1>(flat.sort(/*stable=*/std::optional<bool>(true), /*dim=*/0, /*descending=*/false));
  torch::Tensor counts = torch::bincount(flat, /*weights=*/{}, /*minlength=*/E);
  if (options_.capacity_factor > 0) {
    const auto cap = static_cast<int64_t>(
        std::ceil(options_.capacity_factor * double(flat.numel()) / double(E)));
    auto sorted_expert = flat.index_select(0, order);
    auto start = counts.cumsum(0) - counts;
    auto position =
        torch::arange(flat.numel(), flat.options()) - start.index_select(0, sorted_expert);
    auto keep = position < cap;
    d.dropped = flat.numel() - keep.sum().item<int64_t>();
    order = order.masked_select(keep);
    counts = counts.clamp_max(cap);
  }
  d.order = order;
  // 2. The counts per (rank, local expert), exchanged, and 3. the rows,
  // sent: with their counts at their head on a group whose every posting
  // thread has a lane of its own (NOTE [Counts at the head of the rows] in
  // all_to_all.cpp), else the counts first.
  torch::Tensor rows = x.index_select(0, order.div(d.top_k, "floor"));
  torch::Tensor got, received;
  if (ep == 1) {
    got = counts.view({ep, L}).cpu();
  } else if (x.device().is_cpu() && distributed::lane_count(*group_) >= distributed::kPairLanes) {
    SizedRows s = all_to_all_sized(group_, rows, counts.view({ep, L}).contiguous());
    got = s.counts;
    received = s.rows;
  } else {
    torch::Tensor recv_counts = torch::empty({ep, L}, counts.options());
    std::vector<int64_t> ones(ep, 1);
    comm_for(x.device())->all_to_all(recv_counts, ones, counts.view({ep, L}).contiguous(), ones);
    got = recv_counts.cpu();
  }
  auto sent = counts.view({ep, L}).sum(1).cpu();
  d.send_rows.assign(sent.data_ptr<int64_t>(), sent.data_ptr<int64_t>() + ep);
  d.recv_rows.resize(ep);
  d.tokens_per_expert.assign(L, 0);
  const int64_t* g = got.data_ptr<int64_t>();
  for (int q = 0; q < ep; ++q)
    for (int64_t e = 0; e < L; ++e) {
      d.recv_rows[q] += g[q * L + e];
      d.tokens_per_expert[e] += g[q * L + e];
    }
  if (ep == 1) {
    d.tokens = rows;
    return d;
  }
  if (!received.defined())
    received = all_to_all(comm_for(x.device()), rows, d.send_rows, d.recv_rows);
  // 4. Regrouped by local expert.
  std::vector<int64_t> source_start(ep + 1, 0);
  for (int q = 0; q < ep; ++q)
    source_start[q + 1] = source_start[q] + d.recv_rows[q];
  std::vector<int64_t> index;
  index.reserve(source_start[ep]);
  for (int64_t e = 0; e < L; ++e)
    for (int q = 0; q < ep; ++q) {
      int64_t at = source_start[q];
      for (int64_t f = 0; f < e; ++f)
        at += g[q * L + f];
      for (int64_t i = 0; i < g[q * L + e]; ++i)
        index.push_back(at + i);
    }
  auto long_on = torch::TensorOptions().dtype(torch::kLong);
  d.by_expert = torch::tensor(index, long_on).to(x.device());
  d.by_source = torch::empty_like(d.by_expert);
  if (!index.empty())
    d.by_source.index_copy_(0, d.by_expert,
                            torch::arange(int64_t(index.size()), long_on.device(x.device())));
  d.tokens = received.index_select(0, d.by_expert);
  return d;
}

torch::Tensor TokenDispatcher::combine(const torch::Tensor& y, const Dispatched& d,
                                       const torch::Tensor& weights) const {
  TORCH_CHECK(y.dim() == 2 && y.size(0) == d.tokens.size(0),
              "combine: the experts' output must "
              "have one row per dispatched row (",
              d.tokens.size(0), "), got ", y.sizes());
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == d.num_tokens && weights.size(1) == d.top_k,
              "combine: weights must be [", d.num_tokens, ", ", d.top_k, "], got ",
              weights.sizes());
  // A rank whose experts got no rows may hand back rows outside the graph
  // (a model's experts return zeros when none was hit): tie them to the
  // dispatched rows, so this rank's backward still takes part in both
  // exchanges (NOTE [The all-to-all in the backward]).
  torch::Tensor back = y;
  if (!y.requires_grad() && d.tokens.requires_grad() && torch::GradMode::is_enabled())
    back = y + d.tokens.sum() * 0;
  torch::Tensor local = back;
  if (placement_.size > 1)
    back = all_to_all(comm_for(y.device()), local.index_select(0, d.by_source), d.recv_rows,
                      d.send_rows);
  // Each row times its weight in the promoted dtype, then in the rows' own
  // (a float32 router over bfloat16 experts rounds once, as the models do).
  auto w = weights.reshape({-1}).index_select(0, d.order);
  auto out = torch::zeros({d.num_tokens, y.size(1)}, y.options());
  return out.index_add(0, d.order.div(d.top_k, "floor"),
                       (back * w.unsqueeze(-1)).to(y.scalar_type()));
}

}  // namespace hp::moe
