// hyperparallel._C.moe: the C++ router, and token dispatch and combine over
// a torch.distributed group (hp/moe), for python/hyperparallel/moe.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <stdexcept>

#include "bindings.h"
#include "hp/distributed/comm.h"
#include "hp/distributed/lanes.h"
#include "hp/moe/dispatch.h"
#include "hp/moe/router.h"

namespace hp::python {

// NOTE [A failure reaches the expert-parallel peers]
// A rank whose step fails while its process lives on (a notebook, a
// try/except) sends nothing more, and its expert-parallel peers would wait
// inside an all-to-all until the timeout. So a TokenDispatcher's Comm and a
// Pipeline's data-parallel Comm (the same group) both go through
// with_failure_store over the group's own store, under one prefix per group
// name: a Pipeline whose step failed abandons its dp Comm too (hp/pipeline/
// pipeline.cpp), which leaves the reason there, and a peer waiting in a
// dispatch or combine over that group sees it within about 0.3 s and fails
// naming the rank (NOTE [A failed step reaches the peers] in
// hp/distributed/comm.h). A failure is final for the group: a later Pipeline
// or dispatcher over it fails at once. A stopped peer (NOTE [A stopped peer]
// in hp/distributed/comm_internal.h) is seen by a PeerMonitor over the group:
// one for a Pipeline's dp Comm, one that the dispatchers of an
// expert_parallel call share (exchanges_of), each under a store of its own
// (NOTE [The failure store of a Pipeline] in bind_pipeline.cpp).
c10::intrusive_ptr<c10d::Store> group_failure_store(const py::object& store,
                                                    const c10d::ProcessGroup& group) {
  auto s = store_of(store);
  if (!s) return {};
  return c10::make_intrusive<c10d::PrefixStore>("hyperparallel/group/" + group.getGroupName(), s);
}

distributed::LinkModel link_from_environment() {
  const char* text = std::getenv("HP_LINK");
  if (text == nullptr || *text == '\0') return {};
  try {
    return distributed::LinkModel::parse(text, "HP_LINK");
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

void bind_moe(py::module_& parent) {
  auto m = parent.def_submodule("moe", "Expert parallelism: routing, dispatch and combine");

  py::class_<moe::Dispatched>(m, "Dispatched",
                              "What dispatch hands this rank's experts, and what combine needs.")
      .def_readonly("tokens", &moe::Dispatched::tokens,
                    "[rows, hidden]: the rows of this rank's experts, by local expert")
      .def_readonly("tokens_per_expert", &moe::Dispatched::tokens_per_expert)
      .def_readonly("send_rows", &moe::Dispatched::send_rows)
      .def_readonly("recv_rows", &moe::Dispatched::recv_rows)
      .def_readonly("dropped", &moe::Dispatched::dropped,
                    "(token, slot) pairs of this rank an expert's capacity dropped");

  py::class_<moe::TokenDispatcher, std::shared_ptr<moe::TokenDispatcher>>(
      m, "TokenDispatcher",
      "Moves tokens to the ranks of an expert-parallel group that hold their experts and back "
      "(NOTE [Dispatch and combine] in hp/moe/dispatch.cpp). group=None: every expert local.")
      .def(py::init([](const py::object& group, int64_t num_experts, double capacity_factor,
                       double timeout_s, const py::object& failure_store,
                       const std::shared_ptr<moe::TokenDispatcher>& exchanges_of) {
             std::shared_ptr<distributed::Comm> comm;
             if (exchanges_of) {
               // The dispatchers of one expert_parallel call share one Comm,
               // and so one PeerMonitor (NOTE [A failure reaches the
               // expert-parallel peers]).
               auto pg = group.is_none() ? nullptr : process_group_of(group);
               if (!pg || !exchanges_of->group() || exchanges_of->placement().size != pg->getSize())
                 throw py::value_error(
                     "TokenDispatcher: exchanges_of must be a dispatcher over the same group");
               comm = exchanges_of->group();
             } else if (!group.is_none()) {
               distributed::CommOptions o;
               o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
               auto pg = process_group_of(group);
               auto failures = group_failure_store(failure_store, *pg);
               auto monitor = instance_store(failure_store, *pg, "ep");
               {
                 // The monitor's rendezvous waits on every rank of the group.
                 py::gil_scoped_release release;
                 comm = distributed::with_failure_store(
                     distributed::Comm::from_process_group(pg, o, monitor), failures);
               }
               // HP_LINK: the all-to-alls pay a modelled link (docs/overlap.md).
               comm = distributed::with_link_model(comm, link_from_environment());
               // Over Gloo in lanes, as hp train's expert groups (NOTE [Lanes] in
               // hp/distributed/lanes.cpp): a Pipeline's pairs may then take ready
               // turns, and a dispatch sends its counts at the head of its rows.
               if (comm->backend_name() == "gloo") {
                 py::gil_scoped_release release;  // the copies' rendezvous
                 comm = distributed::with_lanes(comm, distributed::kPairLanes);
               }
             }
             moe::DispatchOptions d;
             d.capacity_factor = capacity_factor;
             return std::make_shared<moe::TokenDispatcher>(comm, num_experts, d);
           }),
           py::arg("group"), py::arg("num_experts"), py::arg("capacity_factor") = 0.0,
           py::arg("timeout") = 300.0, py::arg("failure_store") = py::none(),
           py::arg("exchanges_of") = nullptr,
           "failure_store: the group's store, through which a failed step and a stopped peer "
           "are seen within seconds; exchanges_of: a dispatcher over the same group whose "
           "exchanges (and peer monitor) this one shares")
      .def("dispatch", &moe::TokenDispatcher::dispatch, py::arg("x"), py::arg("experts"),
           py::call_guard<py::gil_scoped_release>(),
           "x [tokens, hidden], experts [tokens, top_k] (int64): collective over the group")
      .def("combine", &moe::TokenDispatcher::combine, py::arg("y"), py::arg("dispatched"),
           py::arg("weights"), py::call_guard<py::gil_scoped_release>(),
           "y [rows, hidden] (the experts' output, row for row), weights [tokens, top_k] -> "
           "[tokens, hidden]: collective over the group")
      .def_property_readonly("rank",
                             [](const moe::TokenDispatcher& d) { return d.placement().rank; })
      .def_property_readonly("size",
                             [](const moe::TokenDispatcher& d) { return d.placement().size; })
      .def_property_readonly("local_experts",
                             [](const moe::TokenDispatcher& d) { return d.placement().local(); })
      .def_property_readonly("first_expert",
                             [](const moe::TokenDispatcher& d) { return d.placement().first(); });

  m.def(
      "route",
      [](const torch::Tensor& logits, int64_t top_k, const std::string& scoring, int64_t groups,
         int64_t top_groups, bool normalize, double scale,
         const c10::optional<torch::Tensor>& bias) {
        moe::RouterOptions o;
        o.num_experts = logits.dim() == 2 ? logits.size(1) : 0;
        o.top_k = top_k;
        o.scoring = scoring;
        o.groups = groups;
        o.top_groups = top_groups;
        o.normalize = normalize;
        o.scale = scale;
        auto r = moe::route(logits, o, bias.value_or(torch::Tensor()));
        return py::make_tuple(r.weights, r.experts, r.scores);
      },
      py::arg("logits"), py::arg("top_k"), py::arg("scoring") = "softmax", py::arg("groups") = 1,
      py::arg("top_groups") = 1, py::arg("normalize") = true, py::arg("scale") = 1.0,
      py::arg("selection_bias") = py::none(),
      "Top-k routing of logits [tokens, experts] -> (weights, experts, scores).");
}

}  // namespace hp::python
