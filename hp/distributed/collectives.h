// Communication patterns the other rooms need, built on Comm so that no other
// room posts point-to-point messages of its own: sums over the ranks that
// hold a value, gathering rows of varying count, timing a round trip.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "hp/distributed/comm.h"

namespace hp::distributed {

/// values[i] is held by the ranks holders[i] (sorted, this rank among them).
/// Afterwards every holder's values[i] is the sum over its holders, added in
/// rank order, so every holder gets the same bits. Everything this rank shares
/// with one peer travels in one message, all peers in one batch. Every rank
/// calls it with lists that agree (a rank lists a value iff it holds it).
void sum_among_holders(Comm& comm, std::vector<at::Tensor>& values,
                       const std::vector<std::vector<int>>& holders);

/// On `root`: every rank's `rows` (any number of rows, the same trailing
/// shape and dtype everywhere), in rank order; elsewhere: empty. Collective.
std::vector<at::Tensor> gather_rows(Comm& comm, const at::Tensor& rows, int root);

/// Sends `probe` from rank a to rank b and back `trips` times and returns half
/// the median round trip in seconds, on a and b (0 elsewhere; every rank of
/// the group may call it, only a and b communicate). The first trip, which
/// may connect, is not counted.
double one_way_latency(Comm& comm, int a, int b, const at::Tensor& probe, int trips = 9);

}  // namespace hp::distributed
