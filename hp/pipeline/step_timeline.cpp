// A step's measured events gathered on rank 0 (see the header).
#include "hp/pipeline/step_timeline.h"

#include "hp/distributed/collectives.h"

#include <algorithm>

namespace hp::pipeline {
namespace {

// Serialises measured events for the trip to rank 0.
torch::Tensor pack_events(const std::vector<schedule::Event>& events) {
  auto t = torch::empty({static_cast<int64_t>(events.size()), 9}, torch::kFloat64);
  auto a = t.accessor<double, 2>();
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    a[i][0] = static_cast<double>(e.action.op);
    a[i][1] = e.action.stage;
    a[i][2] = e.action.microbatch;
    a[i][3] = e.action.stage2;
    a[i][4] = e.action.microbatch2;
    a[i][5] = e.start;
    a[i][6] = e.end;
    a[i][7] = e.waits;
    a[i][8] = e.waited;
  }
  return t;
}

// Each event's nodes (NOTE [A chunk's own waits]) as rows (event, node, seconds).
torch::Tensor pack_nodes(const std::vector<schedule::Event>& events) {
  std::vector<double> flat;
  for (size_t i = 0; i < events.size(); ++i)
    for (size_t k = 0; k < events[i].nodes.size(); ++k)
      flat.insert(flat.end(), {double(i), double(k), events[i].nodes[k]});
  return torch::tensor(flat, torch::kFloat64).view({-1, 3});
}

void unpack_nodes(const torch::Tensor& t, schedule::Event* events) {
  auto a = t.accessor<double, 2>();
  for (int64_t row = 0; row < t.size(0); ++row) {
    auto& nodes = events[static_cast<size_t>(a[row][0])].nodes;
    nodes.resize(std::max(nodes.size(), static_cast<size_t>(a[row][1]) + 1));
    nodes[static_cast<size_t>(a[row][1])] = a[row][2];
  }
}

void unpack_events(const torch::Tensor& t, int rank, std::vector<schedule::Event>& out) {
  auto a = t.accessor<double, 2>();
  for (int64_t i = 0; i < t.size(0); ++i) {
    schedule::Event e;
    e.rank = rank;
    e.action.op = static_cast<schedule::Op>(static_cast<int>(a[i][0]));
    e.action.stage = static_cast<int>(a[i][1]);
    e.action.microbatch = static_cast<int>(a[i][2]);
    e.action.stage2 = static_cast<int>(a[i][3]);
    e.action.microbatch2 = static_cast<int>(a[i][4]);
    e.start = a[i][5];
    e.end = a[i][6];
    e.waits = static_cast<int>(a[i][7]);
    e.waited = a[i][8];
    out.push_back(e);
  }
}

}  // namespace

schedule::Timeline gather_step_timeline(const StepStats& last, distributed::Comm& comm,
                                        const std::string& title, const torch::Device& device) {
  auto events = distributed::gather_rows(comm, pack_events(last.events).to(device), 0);
  auto nodes = distributed::gather_rows(comm, pack_nodes(last.events).to(device), 0);
  schedule::Timeline timeline;
  timeline.num_ranks = comm.world_size();
  timeline.title = title;
  if (comm.rank() != 0) return timeline;
  for (int r = 0; r < timeline.num_ranks; ++r) {
    const size_t first = timeline.events.size();
    unpack_events(events[r].cpu(), r, timeline.events);
    unpack_nodes(nodes[r].cpu(), timeline.events.data() + first);
  }
  return timeline;
}

}  // namespace hp::pipeline
