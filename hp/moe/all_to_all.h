// hp/moe/all_to_all.h: rows exchanged over an expert-parallel group as an
// operation of the autograd graph: its backward sends the gradient's rows
// back the way they came (NOTE [The all-to-all in the backward]).
#pragma once

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "hp/distributed/comm.h"

namespace hp::moe {

// NOTE [The all-to-all in the backward]
// Dispatch and combine move rows between the ranks of an expert-parallel
// (EP) group, and so must their gradients: the backward of an exchange that
// sent send_rows[q] rows to each q and received recv_rows[q] is the exchange
// with the two lists swapped. Being a node of LibTorch's graph, it runs
// wherever the engine reaches it: in a fused B, or in the I of a split
// backward (the exchange lies on the path from a stage's output to its
// input, so the input gradient needs it), never in W: an expert's weight
// gradient needs only the rows its rank already holds. A node whose gradient
// the engine left undefined still exchanges (zeros): the peers run the same
// graph and wait for this rank's rows, so a rank must never skip its part.
// Every EP peer runs the same nodes in the same order (the same model, the
// same schedule: agreed when a Pipeline is made), which is what keeps the
// exchanges matched without tags. The data must not change that: an
// exchange whose input needs no gradient on one rank gets no node there, so
// a rank whose experts received no rows, and whose experts' module then
// returned zeros outside the graph, would skip the backward exchanges its
// peers wait in (seen as a Gloo size mismatch: a count message met by rows).
// combine ties such rows to the dispatched ones (TokenDispatcher::combine),
// so every rank's exchanges lie on the same paths of its graph.

/// Rows of `x` sent over `group`: `send_rows[q]` rows (in order) to each rank
/// q, and `recv_rows[q]` received from each, in rank order (see
/// Comm::all_to_all_async). Differentiable in `x`. `recv_rows[q]` here must
/// be `send_rows[rank]` on q.
torch::Tensor all_to_all(const std::shared_ptr<distributed::Comm>& group, const torch::Tensor& x,
                         const std::vector<int64_t>& send_rows,
                         const std::vector<int64_t>& recv_rows);

/// What all_to_all_sized returns: the rows received and, per source rank,
/// the counts it sent with them.
struct SizedRows {
  torch::Tensor rows;    ///< recv_counts[q].sum() rows from each rank q, in rank order
  torch::Tensor counts;  ///< [ranks, k] int64 on the CPU: the counts each rank sent this one
};

/// The counts travel with their rows (NOTE [Counts at the head of the
/// rows]): `counts` [ranks, k] (int64 on the CPU) says what `x`'s rows are,
/// counts[q].sum() of them (in order) for each rank q; each rank receives
/// what the others sent it, counts and rows, in one wait. Differentiable in
/// `x` as all_to_all. Only where no other thread posts on the same group
/// (lane) between the call's start and its end: the rows' receives are
/// posted inside its wait, once their counts have arrived.
SizedRows all_to_all_sized(const std::shared_ptr<distributed::Comm>& group, const torch::Tensor& x,
                           const torch::Tensor& counts);

}  // namespace hp::moe
