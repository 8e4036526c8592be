// hyperparallel._C.schedule: bindings of hp/schedule for the Python package.
//
// The C++ types are bound as they are (Action, Schedule, CostModel, Timeline,
// SimResult); hyperparallel/schedule.py re-exports them with a few Python
// conveniences. Every C++ error that is the caller's fault is a
// std::invalid_argument, which pybind11 raises as ValueError with the same
// message; wrong argument types are pybind11's TypeError.
//
// NOTE [No crash from Python]
// hp/schedule trusts its callers (generators build consistent schedules,
// read_csv checks what it reads). Python can hand it anything: a Schedule
// whose fields were set one by one, a Timeline with events on rank 99. So
// every entry point that walks a schedule checks it first (validate, which
// also runs check_layout), every renderer checks its timeline, and the sizes
// the generators are asked for are bounded. Functions that take a while (the
// generators, lower, validate, simulate, the readers and renderers) copy their
// inputs while holding the GIL and release it while they run.
#include <cmath>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "hp/schedule/action.h"
#include "hp/schedule/budget.h"
#include "hp/schedule/cost_file.h"
#include "hp/schedule/formulas.h"
#include "hp/schedule/generators.h"
#include "hp/schedule/lower.h"
#include "hp/schedule/render.h"
#include "hp/schedule/schedule.h"
#include "hp/schedule/search/search.h"
#include "hp/schedule/simulate.h"
#include "hp/schedule/text.h"

namespace hp::python {

namespace hs = hp::schedule;

namespace {

using GilRelease = py::gil_scoped_release;

[[noreturn]] void value_error(const std::string& msg) {
  throw std::invalid_argument(msg);
}

// Largest sizes a generator is asked for (NOTE [No crash from Python]): the
// one rule every entry point checks (NOTE [One size rule]).
void check_sizes(const std::string& name, int ranks, int microbatches, int chunks) {
  if (chunks > 1000)
    value_error("schedule '" + name + "': chunks " + std::to_string(chunks) + "; at most 1000");
  // build() checks again with the schedule's own stages per rank.
  hs::check_schedule_size("schedule '" + name + "'", ranks, microbatches, 1);
}

// A timeline a renderer can draw: events on existing ranks, finite times.
void check_timeline(const hs::Timeline& t) {
  if (t.num_ranks < 0 || t.num_ranks > 100000)
    value_error("timeline: num_ranks must be in [0, 100000], got " + std::to_string(t.num_ranks));
  for (size_t i = 0; i < t.events.size(); ++i) {
    const auto& e = t.events[i];
    const std::string where = "timeline: event " + std::to_string(i) + " (rank " +
                              std::to_string(e.rank) + ", " + hs::to_string(e.action) + ")";
    if (e.rank < 0 || e.rank >= t.num_ranks)
      value_error(where + " is on a rank outside [0, " + std::to_string(t.num_ranks) + ")");
    if (!std::isfinite(e.start) || !std::isfinite(e.end) || e.end < e.start)
      value_error(where + " has start " + std::to_string(e.start) + " and end " +
                  std::to_string(e.end) + "; times must be finite with start <= end");
  }
}

// index_routes() allocates routes x num_stages entries: keep that bounded.
void check_stage_count(const hs::Schedule& s) {
  if (s.num_stages > 100000)
    value_error("Schedule: num_stages must be at most 100000, got " + std::to_string(s.num_stages));
}

hs::Action make_action(hs::Op op, int stage, int microbatch) {
  if (op == hs::Op::FB)
    value_error(
        "an FB action has two halves: use Action.overlap(f_stage, f_microbatch, "
        "b_stage, b_microbatch)");
  if (stage < 0 || microbatch < 0)
    value_error("action " + std::string(hs::op_name(op)) + ": stage and microbatch must be >= 0, " +
                "got stage " + std::to_string(stage) + ", microbatch " +
                std::to_string(microbatch));
  return hs::Action::make(op, stage, microbatch);
}

// An action from Python: an Action or its text form ("2F0", "3F1+5B0").
hs::Action action_from(py::handle h) {
  if (py::isinstance<hs::Action>(h)) return h.cast<hs::Action>();
  if (py::isinstance<py::str>(h)) return hs::parse_action(h.cast<std::string>());
  throw py::type_error("an action must be an Action or its text form like '2F0', got " +
                       std::string(py::str(py::type::of(h).attr("__name__"))));
}

// Per-rank lists from Python: a list of rows, each a list of actions (Action
// or text) or one string of actions separated by spaces or commas.
std::vector<std::vector<hs::Action>> actions_from(py::handle rows) {
  if (py::isinstance<py::str>(rows) || !py::isinstance<py::sequence>(rows))
    throw py::type_error("actions must be a list with one row per rank, got " +
                         std::string(py::str(py::type::of(rows).attr("__name__"))));
  std::vector<std::vector<hs::Action>> out;
  for (py::handle row : rows) {
    std::vector<hs::Action> list;
    if (py::isinstance<py::str>(row)) {
      std::string text = row.cast<std::string>();
      for (char& c : text)
        if (c == ',') c = ' ';
      std::istringstream in(text);
      std::string tok;
      while (in >> tok)
        list.push_back(hs::parse_action(tok));
    } else if (py::isinstance<py::sequence>(row)) {
      for (py::handle a : row)
        list.push_back(action_from(a));
    } else {
      throw py::type_error("a row of actions must be a list or a string, got " +
                           std::string(py::str(py::type::of(row).attr("__name__"))));
    }
    out.push_back(std::move(list));
  }
  return out;
}

py::list actions_to_py(const std::vector<std::vector<hs::Action>>& rows) {
  py::list out;
  for (const auto& row : rows) {
    py::list r;
    for (const auto& a : row)
      r.append(py::cast(a));
    out.append(r);
  }
  return out;
}

std::string num(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

std::string ints(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i)
    s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string doubles(const std::vector<double>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i)
    s += (i ? ", " : "") + num(v[i]);
  return s + "]";
}

std::string schedule_repr(const hs::Schedule& s) {
  size_t n = 0;
  for (const auto& row : s.actions)
    n += row.size();
  return "<Schedule '" + hs::escape_bytes(s.name) + "' ranks=" + std::to_string(s.num_ranks) +
         " stages=" + std::to_string(s.num_stages) +
         " microbatches=" + std::to_string(s.num_microbatches) +
         " chunks=" + std::to_string(s.num_chunks) + " routes=" + std::to_string(s.routes.size()) +
         " actions=" + std::to_string(n) + (s.lowered ? " lowered" : "") + ">";
}

// The schedule as text: its layout, then one line per rank.
std::string schedule_str(const hs::Schedule& s) {
  std::string out = schedule_repr(s) + "\n  stage_rank " + ints(s.stage_rank) + "\n  stage_chunk " +
                    ints(s.stage_chunk) + "\n";
  for (size_t r = 0; r < s.routes.size(); ++r)
    out += "  route " + std::to_string(r) + " " + ints(s.routes[r]) + "\n";
  if (s.routes.size() > 1) out += "  microbatch_route " + ints(s.microbatch_route) + "\n";
  for (size_t r = 0; r < s.actions.size(); ++r)
    out += "  rank " + std::to_string(r) + ": " + hs::format_actions(s.actions[r]) + "\n";
  return out;
}

bool schedule_equal(const hs::Schedule& a, const hs::Schedule& b) {
  return a.name == b.name && a.num_ranks == b.num_ranks && a.num_stages == b.num_stages &&
         a.num_microbatches == b.num_microbatches && a.num_chunks == b.num_chunks &&
         a.stage_rank == b.stage_rank && a.stage_chunk == b.stage_chunk && a.routes == b.routes &&
         a.microbatch_route == b.microbatch_route && a.actions == b.actions &&
         a.lowered == b.lowered;
}

std::string cost_repr(const hs::CostModel& c) {
  std::string s = "CostModel(f=" + num(c.f) + ", b=" + num(c.b) + ", w=" + num(c.w) +
                  ", comm=" + num(c.comm) + ", send=" + num(c.send) + ", mem_b=" + num(c.mem_b) +
                  ", mem_w=" + num(c.mem_w);
  auto vec = [&s](const char* n, const std::vector<double>& v) {
    if (!v.empty()) s += std::string(", ") + n + "=" + doubles(v);
  };
  vec("stage_f", c.stage_f);
  vec("stage_b", c.stage_b);
  vec("stage_w", c.stage_w);
  vec("stage_mem_b", c.stage_mem_b);
  vec("stage_mem_w", c.stage_mem_w);
  vec("stage_comm", c.stage_comm);
  vec("stage_send", c.stage_send);
  if (!c.stage_inner.empty()) {
    s += ", stage_inner=[";
    for (size_t i = 0; i < c.stage_inner.size(); ++i) {
      const hs::InnerComm& in = c.stage_inner[i];
      s += std::string(i ? ", " : "") + "InnerComm(" + std::to_string(in.f_waits) + ", " +
           num(in.f) + ", " + std::to_string(in.i_waits) + ", " + num(in.i) + ", " +
           std::to_string(in.w_waits) + ", " + num(in.w) + ")";
    }
    s += "]";
  }
  return s + ")";
}

using Vec = std::optional<std::vector<double>>;

// summary_text indexes rank_idle and peak_memory by rank, but timeline_stats
// leaves the memory fields empty (a measured timeline has no memory): pad a
// copy so every per-rank list has one entry per rank.
hs::SimResult padded(const hs::SimResult& r) {
  hs::SimResult c = r;
  const size_t p = c.rank_busy.size();
  c.rank_idle.resize(p, 0.0);
  c.rank_span.resize(p, 0.0);
  c.peak_memory.resize(p, 0.0);
  return c;
}
std::string summary_text_of(const hs::SimResult& r) {
  return hs::summary_text(padded(r));
}
std::string summary_json_of(const hs::SimResult& r, const std::string& name) {
  return hs::summary_json(padded(r), name);
}

}  // namespace

void bind_schedule(py::module_& m) {
  auto sub = m.def_submodule(
      "schedule",
      "Pipeline schedules as data (hp/schedule): the Action IR, Schedule, the generators, "
      "lower, validate, simulate, the renderers and the CSV form.");

  // ---- Op and Action ------------------------------------------------------
  py::enum_<hs::Op>(sub, "Op", "What an action does (F, I = dx, W = dw, B = I+W, FB, SEND/RECV).")
      .value("F", hs::Op::F)
      .value("I", hs::Op::I)
      .value("W", hs::Op::W)
      .value("B", hs::Op::B)
      .value("FB", hs::Op::FB)
      .value("SEND_F", hs::Op::SEND_F)
      .value("RECV_F", hs::Op::RECV_F)
      .value("SEND_B", hs::Op::SEND_B)
      .value("RECV_B", hs::Op::RECV_B)
      .def_property_readonly("is_compute", [](hs::Op op) { return hs::is_compute(op); })
      .def_property_readonly("is_comm", [](hs::Op op) { return hs::is_comm(op); });

  py::class_<hs::Action>(sub, "Action",
                         "One action of one rank, immutable. Action('2F0') parses the text form; "
                         "Action(Op.F, 2, 0) builds it; Action.overlap(3, 1, 5, 0) is '3F1+5B0'.")
      .def(py::init([](const std::string& text) { return hs::parse_action(text); }),
           py::arg("text"))
      .def(py::init(&make_action), py::arg("op"), py::arg("stage"), py::arg("microbatch"))
      .def_static(
          "overlap",
          [](int fs, int fmb, int bs, int bmb, bool backward_first) {
            if (fs < 0 || fmb < 0 || bs < 0 || bmb < 0)
              value_error("Action.overlap: stages and microbatches must be >= 0");
            return hs::Action::overlap(fs, fmb, bs, bmb, backward_first);
          },
          py::arg("f_stage"), py::arg("f_microbatch"), py::arg("b_stage"), py::arg("b_microbatch"),
          py::arg("backward_first") = false,
          "An FB pair: the F of (f_stage, f_microbatch) beside the B of (b_stage, b_microbatch); "
          "backward_first: the B half leads ('5B0+3F1').")
      .def_static(
          "parse", [](const std::string& t) { return hs::parse_action(t); }, py::arg("text"))
      .def_property_readonly("op", [](const hs::Action& a) { return a.op; })
      .def_property_readonly("stage", [](const hs::Action& a) { return a.stage; })
      .def_property_readonly("microbatch", [](const hs::Action& a) { return a.microbatch; })
      .def_property_readonly(
          "stage2", [](const hs::Action& a) { return a.stage2; },
          "FB only: the stage of the B half (-1 otherwise).")
      .def_property_readonly(
          "microbatch2", [](const hs::Action& a) { return a.microbatch2; },
          "FB only: the microbatch of the B half (-1 otherwise).")
      .def_property_readonly(
          "backward_first", [](const hs::Action& a) { return a.backward_first; },
          "FB only: the B half leads the overlapped pair (written '5B0+3F1').")
      .def_property_readonly("is_compute", [](const hs::Action& a) { return hs::is_compute(a.op); })
      .def_property_readonly("is_comm", [](const hs::Action& a) { return hs::is_comm(a.op); })
      .def_property_readonly(
          "halves",
          [](const hs::Action& a) {
            py::list out;
            if (a.op == hs::Op::FB) {
              out.append(hs::Action::make(hs::Op::F, a.stage, a.microbatch));
              out.append(hs::Action::make(hs::Op::B, a.stage2, a.microbatch2));
            } else {
              out.append(a);
            }
            return py::tuple(out);
          },
          "(F half, B half) of an FB pair; (self,) for any other action.")
      .def("__str__", [](const hs::Action& a) { return hs::to_string(a); })
      .def("__repr__", [](const hs::Action& a) { return "Action('" + hs::to_string(a) + "')"; })
      .def("__eq__", [](const hs::Action& a, const hs::Action& b) { return a == b; })
      .def("__eq__", [](const hs::Action&, py::object) { return false; })
      .def("__hash__",
           [](const hs::Action& a) {
             return py::hash(py::make_tuple(static_cast<int>(a.op), a.stage, a.microbatch, a.stage2,
                                            a.microbatch2, a.backward_first));
           })
      .def(py::pickle([](const hs::Action& a) { return hs::to_string(a); },
                      [](const std::string& t) { return hs::parse_action(t); }));

  // ---- Schedule -----------------------------------------------------------
  py::class_<hs::Schedule> sched(
      sub, "Schedule",
      "A pipeline schedule as data: placement of virtual stages on ranks, model chunks, "
      "microbatch routes and one ordered action list per rank. Fields return copies: to "
      "change a list, assign it back (s.actions = rows).");
  sched.def(
      py::init([](int num_ranks, int num_microbatches, py::object actions,
                  std::optional<int> num_stages, std::optional<std::vector<int>> stage_rank,
                  std::optional<std::vector<int>> stage_chunk,
                  std::optional<std::vector<std::vector<int>>> routes,
                  std::optional<std::vector<int>> microbatch_route, std::optional<int> num_chunks,
                  std::string name, std::optional<bool> lowered) {
        hs::Schedule s;
        s.name = std::move(name);
        s.num_ranks = num_ranks;
        s.num_microbatches = num_microbatches;
        s.actions =
            actions.is_none()
                ? std::vector<std::vector<hs::Action>>(static_cast<size_t>(std::max(num_ranks, 0)))
                : actions_from(actions);
        int S = 0;
        if (num_stages) {
          S = *num_stages;
        } else {
          // The stages the actions name, or as many as stage_rank places.
          for (const auto& row : s.actions)
            for (const auto& a : row)
              S = std::max({S, a.stage + 1, a.stage2 + 1});
          if (stage_rank) S = std::max(S, static_cast<int>(stage_rank->size()));
        }
        s.num_stages = S;
        if (S < 1 || S > 100000)
          value_error("Schedule: num_stages must be in [1, 100000], got " + std::to_string(S) +
                      " (give num_stages, stage_rank or actions)");
        if (num_ranks < 1 || num_ranks > 100000)
          value_error("Schedule: num_ranks must be in [1, 100000], got " +
                      std::to_string(num_ranks));
        if (num_microbatches < 1 || num_microbatches > 1000000)
          value_error("Schedule: num_microbatches must be in [1, 1000000], got " +
                      std::to_string(num_microbatches));
        if (stage_rank) {
          s.stage_rank = *stage_rank;
        } else {
          for (int i = 0; i < S; ++i)
            s.stage_rank.push_back(i % num_ranks);
        }
        if (stage_chunk) {
          s.stage_chunk = *stage_chunk;
        } else {
          for (int i = 0; i < S; ++i)
            s.stage_chunk.push_back(i);
        }
        if (num_chunks) {
          s.num_chunks = *num_chunks;
        } else {
          for (int c : s.stage_chunk)
            s.num_chunks = std::max(s.num_chunks, c + 1);
        }
        if (routes) {
          s.routes = *routes;
        } else {
          std::vector<int> r(S);
          for (int i = 0; i < S; ++i)
            r[i] = i;
          s.routes = {r};
        }
        s.microbatch_route =
            microbatch_route ? *microbatch_route : std::vector<int>(num_microbatches, 0);
        bool comm = false;
        for (const auto& row : s.actions)
          for (const auto& a : row)
            comm = comm || hs::is_comm(a.op);
        s.lowered = lowered ? *lowered : comm;
        s.index_routes();
        s.check_layout();
        return s;
      }),
      py::arg("num_ranks"), py::arg("num_microbatches"), py::arg("actions") = py::none(),
      py::kw_only(), py::arg("num_stages") = py::none(), py::arg("stage_rank") = py::none(),
      py::arg("stage_chunk") = py::none(), py::arg("routes") = py::none(),
      py::arg("microbatch_route") = py::none(), py::arg("num_chunks") = py::none(),
      py::arg("name") = "", py::arg("lowered") = py::none(),
      "A schedule from its parts. Defaults: stages from the actions (and stage_rank), loop "
      "placement "
      "(stage s on rank s % num_ranks), chunk s for stage s, one route through every "
      "stage in order, lowered when the actions hold SEND/RECV. Rows of actions are lists "
      "of Action or text ('0F0'), or one string ('0F0 0F1 0B0 ...'). The layout is "
      "checked (ValueError); validate() checks the lists.");

  // Fields: a setter re-indexes the routes so the schedule stays usable;
  // validate() says whether the new value is consistent.
#define HP_FIELD(name, doc)                                 \
  def_property(                                             \
      #name, [](const hs::Schedule& s) { return s.name; },  \
      [](hs::Schedule& s, decltype(hs::Schedule::name) v) { \
        hs::Schedule t = s;                                 \
        t.name = std::move(v);                              \
        check_stage_count(t);                               \
        t.index_routes();                                   \
        s = std::move(t);                                   \
      },                                                    \
      doc)
  sched.HP_FIELD(name, "generator name, informative only")
      .HP_FIELD(num_ranks, "pipeline ranks p")
      .HP_FIELD(num_stages, "virtual stages S")
      .HP_FIELD(num_microbatches, "microbatches m")
      .HP_FIELD(num_chunks, "distinct model chunks")
      .HP_FIELD(stage_rank, "[S] the rank that runs each stage")
      .HP_FIELD(stage_chunk, "[S] the model chunk each stage computes")
      .HP_FIELD(routes, "the distinct routes, each the ordered stages a microbatch visits")
      .HP_FIELD(microbatch_route, "[m] index into routes")
      .HP_FIELD(lowered, "True once SEND/RECV were added");
#undef HP_FIELD
  sched
      .def_property(
          "actions", [](const hs::Schedule& s) { return actions_to_py(s.actions); },
          [](hs::Schedule& s, py::object rows) { s.actions = actions_from(rows); },
          "[p] each rank's ordered list of Action (a copy; assign a new list to change it)")
      .def(
          "route", [](const hs::Schedule& s, int mb) { return s.route(mb); }, py::arg("microbatch"),
          "The stages microbatch mb visits, in forward order.")
      .def("route_position", &hs::Schedule::route_position, py::arg("stage"), py::arg("microbatch"),
           "Position of stage on the microbatch's route, or -1.")
      .def("next_stage", &hs::Schedule::next_stage, py::arg("stage"), py::arg("microbatch"),
           "The stage after `stage` on the microbatch's route, or -1.")
      .def("prev_stage", &hs::Schedule::prev_stage, py::arg("stage"), py::arg("microbatch"),
           "The stage before `stage` on the microbatch's route, or -1.")
      .def(
          "stages_of_rank",
          [](const hs::Schedule& s, int r) {
            s.check_layout();
            return s.stages_of_rank(r);
          },
          py::arg("rank"), "The stages rank r holds, in increasing order.")
      .def(
          "chunks_of_rank",
          [](const hs::Schedule& s, int r) {
            s.check_layout();
            std::set<int> chunks;
            for (int st : s.stages_of_rank(r))
              chunks.insert(s.stage_chunk[st]);
            return std::vector<int>(chunks.begin(), chunks.end());
          },
          py::arg("rank"),
          "The model chunks rank r must hold (one module each), in increasing order. A chunk "
          "held by several ranks (DualPipe's mirrored copies) is a replica: give every holder "
          "the same initial weights; their gradients are summed.")
      .def_property_readonly(
          "first_stages",
          [](const hs::Schedule& s) {
            std::vector<int> out;
            for (const auto& r : s.routes)
              if (!r.empty()) out.push_back(r.front());
            return out;
          },
          "The first stage of each route (reads the microbatch inputs).")
      .def_property_readonly(
          "last_stages",
          [](const hs::Schedule& s) {
            std::vector<int> out;
            for (const auto& r : s.routes)
              if (!r.empty()) out.push_back(r.back());
            return out;
          },
          "The last stage of each route (computes the loss).")
      .def(
          "needs_inputs",
          [](const hs::Schedule& s, int r) {
            for (const auto& route : s.routes)
              if (!route.empty() && s.stage_rank.at(route.front()) == r) return true;
            return false;
          },
          py::arg("rank"), "Whether rank r runs the first stage of a route (reads inputs).")
      .def(
          "needs_targets",
          [](const hs::Schedule& s, int r) {
            for (const auto& route : s.routes)
              if (!route.empty() && s.stage_rank.at(route.back()) == r) return true;
            return false;
          },
          py::arg("rank"), "Whether rank r runs the last stage of a route (computes losses).")
      .def_property_readonly(
          "has_split",
          [](const hs::Schedule& s) {
            for (const auto& row : s.actions)
              for (const auto& a : row)
                if (a.op == hs::Op::I || a.op == hs::Op::W) return true;
            return false;
          },
          "Whether the schedule splits backwards into I (dx) and W (dw) actions.")
      .def("check_layout", &hs::Schedule::check_layout,
           "Raises ValueError if the placement fields are inconsistent.")
      .def(
          "to_csv", [](const hs::Schedule& s) { return hs::to_csv(s); },
          "The schedule's CSV form (from_csv reads it back exactly).")
      .def_static(
          "from_csv",
          [](const py::object& text, const std::string& source) {
            if (!py::isinstance<py::str>(text))
              throw py::type_error("from_csv: text must be a str, got " +
                                   std::string(py::str(py::type::of(text))));
            const std::string csv = text.cast<std::string>();
            GilRelease nogil;
            return hs::from_csv(csv, source);
          },
          py::arg("text"), py::arg("source") = "csv",
          "A schedule from its CSV text (hyperparallel.schedule.from_csv).")
      .def("copy", [](const hs::Schedule& s) { return s; })
      .def("__copy__", [](const hs::Schedule& s) { return s; })
      .def(
          "__deepcopy__", [](const hs::Schedule& s, py::dict) { return s; }, py::arg("memo"))
      .def("__eq__",
           [](const hs::Schedule& a, const hs::Schedule& b) { return schedule_equal(a, b); })
      .def("__eq__", [](const hs::Schedule&, py::object) { return false; })
      .def("__repr__", &schedule_repr)
      .def("__str__", &schedule_str)
      .def(py::pickle([](const hs::Schedule& s) { return hs::to_csv(s); },
                      [](const std::string& csv) { return hs::from_csv(csv, "pickle"); }));
  sched.attr("__hash__") = py::none();

  // ---- Costs, timelines, results ------------------------------------------
  py::class_<hs::InnerComm>(sub, "InnerComm",
                            "A stage's waits on communication inside its chunk (an expert "
                            "layer's dispatch and combine), per F, I and W: how many, and the "
                            "seconds each is in flight (NOTE [Waits inside a chunk]).")
      .def(py::init([](int f_waits, double f, int i_waits, double i, int w_waits, double w) {
             return hs::InnerComm{f_waits, f, i_waits, i, w_waits, w};
           }),
           py::arg("f_waits") = 0, py::arg("f") = 0.0, py::arg("i_waits") = 0, py::arg("i") = 0.0,
           py::arg("w_waits") = 0, py::arg("w") = 0.0)
      .def_readwrite("f_waits", &hs::InnerComm::f_waits)
      .def_readwrite("f", &hs::InnerComm::f)
      .def_readwrite("i_waits", &hs::InnerComm::i_waits)
      .def_readwrite("i", &hs::InnerComm::i)
      .def_readwrite("w_waits", &hs::InnerComm::w_waits)
      .def_readwrite("w", &hs::InnerComm::w)
      .def_readwrite("f_nodes", &hs::InnerComm::f_nodes,
                     "each node's share of F's compute (f_waits + 1), or [] for equal shares")
      .def_readwrite("i_nodes", &hs::InnerComm::i_nodes)
      .def_readwrite("w_nodes", &hs::InnerComm::w_nodes)
      .def(py::pickle(
          [](const hs::InnerComm& c) {
            return py::make_tuple(c.f_waits, c.f, c.i_waits, c.i, c.w_waits, c.w, c.f_nodes,
                                  c.i_nodes, c.w_nodes);
          },
          [](const py::tuple& t) {
            if (t.size() != 9) value_error("InnerComm: bad pickle state");
            hs::InnerComm c{t[0].cast<int>(),    t[1].cast<double>(), t[2].cast<int>(),
                            t[3].cast<double>(), t[4].cast<int>(),    t[5].cast<double>()};
            c.f_nodes = t[6].cast<std::vector<double>>();
            c.i_nodes = t[7].cast<std::vector<double>>();
            c.w_nodes = t[8].cast<std::vector<double>>();
            return c;
          }));

  py::class_<hs::CostModel>(
      sub, "CostModel",
      "Per-op costs and activation memory for one rank's share of the model. b is the cost "
      "of I (dx, the Zero Bubble paper's B); a fused B costs b + w. The stage_* lists, when "
      "given, hold one absolute value per stage of the schedule they are used with.")
      .def(py::init([](double f, double b, double w, double comm, double send, double mem_b,
                       double mem_w, Vec stage_f, Vec stage_b, Vec stage_w, Vec stage_mem_b,
                       Vec stage_mem_w, Vec stage_comm, Vec stage_send) {
             hs::CostModel c;
             c.f = f;
             c.b = b;
             c.w = w;
             c.comm = comm;
             c.send = send;
             c.mem_b = mem_b;
             c.mem_w = mem_w;
             c.stage_f = stage_f.value_or(std::vector<double>{});
             c.stage_b = stage_b.value_or(std::vector<double>{});
             c.stage_w = stage_w.value_or(std::vector<double>{});
             c.stage_mem_b = stage_mem_b.value_or(std::vector<double>{});
             c.stage_mem_w = stage_mem_w.value_or(std::vector<double>{});
             c.stage_comm = stage_comm.value_or(std::vector<double>{});
             c.stage_send = stage_send.value_or(std::vector<double>{});
             c.check();
             return c;
           }),
           py::arg("f") = 1.0, py::arg("b") = 1.0, py::arg("w") = 1.0, py::kw_only(),
           py::arg("comm") = 0.0, py::arg("send") = 0.0, py::arg("mem_b") = 1.0,
           py::arg("mem_w") = 0.5, py::arg("stage_f") = py::none(), py::arg("stage_b") = py::none(),
           py::arg("stage_w") = py::none(), py::arg("stage_mem_b") = py::none(),
           py::arg("stage_mem_w") = py::none(), py::arg("stage_comm") = py::none(),
           py::arg("stage_send") = py::none())
      .def_readwrite("f", &hs::CostModel::f, "forward")
      .def_readwrite("b", &hs::CostModel::b, "input gradient I (the paper's B)")
      .def_readwrite("w", &hs::CostModel::w, "weight gradient W")
      .def_readwrite("comm", &hs::CostModel::comm, "latency of one cross-rank transfer")
      .def_readwrite("send", &hs::CostModel::send,
                     "time the sender stays busy posting one cross-rank transfer (NOTE [Sending "
                     "occupies the sender])")
      .def_readwrite("mem_b", &hs::CostModel::mem_b, "memory held from F until I (or B)")
      .def_readwrite("mem_w", &hs::CostModel::mem_w, "memory held from I until W")
      .def_readwrite("stage_f", &hs::CostModel::stage_f)
      .def_readwrite("stage_b", &hs::CostModel::stage_b)
      .def_readwrite("stage_w", &hs::CostModel::stage_w)
      .def_readwrite("stage_mem_b", &hs::CostModel::stage_mem_b)
      .def_readwrite("stage_mem_w", &hs::CostModel::stage_mem_w)
      .def_readwrite("stage_comm", &hs::CostModel::stage_comm)
      .def_readwrite("stage_send", &hs::CostModel::stage_send)
      .def_readwrite("stage_inner", &hs::CostModel::stage_inner,
                     "per stage, an InnerComm: the waits inside its chunk (NOTE [Waits inside "
                     "a chunk]); assign a whole list")
      .def(
          "check", [](const hs::CostModel& c) { c.check(); },
          "Raises ValueError unless costs are positive and finite, comm and memory >= 0.")
      .def(
          "check", [](const hs::CostModel& c, int n) { c.check(n); }, py::arg("num_stages"),
          "check(), and that every per-stage list has num_stages entries.")
      .def_property_readonly("per_stage", &hs::CostModel::per_stage)
      .def("__repr__", &cost_repr)
      .def(py::pickle(
          [](const hs::CostModel& c) {
            return py::make_tuple(c.f, c.b, c.w, c.comm, c.mem_b, c.mem_w, c.stage_f, c.stage_b,
                                  c.stage_w, c.stage_mem_b, c.stage_mem_w, c.stage_comm, c.send,
                                  c.stage_send, c.stage_inner);
          },
          [](const py::tuple& t) {
            if (t.size() != 15) value_error("CostModel: bad pickle state");
            hs::CostModel c;
            c.f = t[0].cast<double>();
            c.b = t[1].cast<double>();
            c.w = t[2].cast<double>();
            c.comm = t[3].cast<double>();
            c.mem_b = t[4].cast<double>();
            c.mem_w = t[5].cast<double>();
            c.stage_f = t[6].cast<std::vector<double>>();
            c.stage_b = t[7].cast<std::vector<double>>();
            c.stage_w = t[8].cast<std::vector<double>>();
            c.stage_mem_b = t[9].cast<std::vector<double>>();
            c.stage_mem_w = t[10].cast<std::vector<double>>();
            c.stage_comm = t[11].cast<std::vector<double>>();
            c.send = t[12].cast<double>();
            c.stage_send = t[13].cast<std::vector<double>>();
            c.stage_inner = t[14].cast<std::vector<hs::InnerComm>>();
            return c;
          }));

  py::class_<hs::Event>(sub, "Event", "One timed action of one rank (simulated or measured).")
      .def(py::init(
               [](int rank, py::object action, double start, double end, int waits, double waited) {
                 hs::Event e;
                 e.rank = rank;
                 e.action = action_from(action);
                 e.start = start;
                 e.end = end;
                 e.waits = waits;
                 e.waited = waited;
                 return e;
               }),
           py::arg("rank"), py::arg("action"), py::arg("start"), py::arg("end"), py::kw_only(),
           py::arg("waits") = 0, py::arg("waited") = 0.0)
      .def_readwrite("rank", &hs::Event::rank)
      .def_readwrite("action", &hs::Event::action)
      .def_readwrite("start", &hs::Event::start)
      .def_readwrite("end", &hs::Event::end)
      .def_readwrite("waits", &hs::Event::waits,
                     "waits on communication inside the action besides its input's (NOTE "
                     "[Waits inside a chunk])")
      .def_readwrite("waited", &hs::Event::waited, "their seconds in flight, in all")
      .def("__repr__", [](const hs::Event& e) {
        return "Event(rank=" + std::to_string(e.rank) + ", action=Action('" +
               hs::to_string(e.action) + "'), start=" + num(e.start) + ", end=" + num(e.end) + ")";
      });

  py::class_<hs::Timeline>(sub, "Timeline",
                           "Timed events over ranks: what every renderer draws. `events` is a "
                           "copy; add events with add() or assign a new list.")
      .def(py::init([](int num_ranks, std::vector<hs::Event> events, std::string title) {
             hs::Timeline t;
             t.num_ranks = num_ranks;
             t.events = std::move(events);
             t.title = std::move(title);
             return t;
           }),
           py::arg("num_ranks") = 0, py::arg("events") = std::vector<hs::Event>{},
           py::arg("title") = "")
      .def_readwrite("num_ranks", &hs::Timeline::num_ranks)
      .def_readwrite("events", &hs::Timeline::events)
      .def_readwrite("title", &hs::Timeline::title)
      .def(
          "add",
          [](hs::Timeline& t, int rank, py::object action, double start, double end) {
            hs::Event e;
            e.rank = rank;
            e.action = action_from(action);
            e.start = start;
            e.end = end;
            t.events.push_back(e);
          },
          py::arg("rank"), py::arg("action"), py::arg("start"), py::arg("end"))
      .def("makespan", &hs::Timeline::makespan, "Latest end over all events (0 when empty).")
      .def("__len__", [](const hs::Timeline& t) { return t.events.size(); })
      .def("__repr__", [](const hs::Timeline& t) {
        return "<Timeline '" + hs::escape_bytes(t.title) +
               "' ranks=" + std::to_string(t.num_ranks) +
               " events=" + std::to_string(t.events.size()) + " makespan=" + num(t.makespan()) +
               ">";
      });

  py::class_<hs::SimResult>(
      sub, "SimResult",
      "What simulate() reports. bubble_rate is the Zero Bubble paper's ((span - work) / span "
      "of the longest rank); idle_fraction is total idle / (p x makespan).")
      .def_readonly("makespan", &hs::SimResult::makespan, "latest op end (one step's time)")
      .def_readonly("span", &hs::SimResult::span, "max over ranks of first-F-start to last end")
      .def_readonly("work", &hs::SimResult::work, "max over ranks of busy time")
      .def_readonly("bubble_rate", &hs::SimResult::bubble_rate, "(span - work) / span")
      .def_readonly("idle_fraction", &hs::SimResult::idle_fraction, "sum of idle / (p * makespan)")
      .def_readonly("rank_busy", &hs::SimResult::rank_busy)
      .def_readonly("rank_idle", &hs::SimResult::rank_idle)
      .def_readonly("rank_span", &hs::SimResult::rank_span)
      .def_readonly("peak_memory", &hs::SimResult::peak_memory, "[p] peak activation memory")
      .def_readonly("max_peak_memory", &hs::SimResult::max_peak_memory)
      .def_readonly("comm_volume", &hs::SimResult::comm_volume, "cross-rank transfers")
      .def_readonly("rank_pair_hidden", &hs::SimResult::rank_pair_hidden,
                    "[p] with fb_overlap: the pairs' waits while the rank computed")
      .def_readonly("rank_pair_exposed", &hs::SimResult::rank_pair_exposed,
                    "[p] with fb_overlap: the pairs' waits while it did not")
      .def_readonly("timeline", &hs::SimResult::timeline)
      .def("summary", &summary_text_of, "The statistics as aligned text.")
      .def("to_json", &summary_json_of, py::arg("name") = "", "The statistics as JSON text.")
      .def("__str__", &summary_text_of)
      .def("__repr__", [](const hs::SimResult& r) {
        return "SimResult(makespan=" + num(r.makespan) + ", bubble_rate=" + num(r.bubble_rate) +
               ", idle_fraction=" + num(r.idle_fraction) +
               ", max_peak_memory=" + num(r.max_peak_memory) +
               ", comm_volume=" + std::to_string(r.comm_volume) + ")";
      });

  py::class_<hs::ClosedForm>(sub, "ClosedForm", "A closed-form bubble of a classic schedule.")
      .def_readonly("known", &hs::ClosedForm::known)
      .def_readonly("bubble", &hs::ClosedForm::bubble)
      .def_readonly("ideal", &hs::ClosedForm::ideal)
      .def_readonly("ratio", &hs::ClosedForm::ratio)
      .def_readonly("bubble_rate", &hs::ClosedForm::bubble_rate)
      .def_readonly("formula", &hs::ClosedForm::formula)
      .def_readonly("matches_simulator", &hs::ClosedForm::matches_simulator)
      .def("__repr__", [](const hs::ClosedForm& c) {
        return "ClosedForm(known=" + std::string(c.known ? "True" : "False") + ", formula='" +
               c.formula + "', bubble=" + num(c.bubble) + ", bubble_rate=" + num(c.bubble_rate) +
               ")";
      });

  // ---- Functions ----------------------------------------------------------
  sub.def("names", &hs::names, "Every generator name build() accepts, in a stable order.");
  sub.def("describe", &hs::describe, py::arg("name"), "One line saying what the schedule is.");
  sub.def(
      "build",
      [](const std::string& name, int ranks, int microbatches, int chunks, hs::CostModel costs,
         double mem_limit) {
        check_sizes(name, ranks, microbatches, chunks);
        if (!(mem_limit >= 0) || !std::isfinite(mem_limit))
          value_error("schedule '" + name + "': mem_limit must be a finite number >= 0 (0: the " +
                      "generator's default), got " + num(mem_limit));
        hs::BuildOptions o;
        o.chunks = chunks;
        o.costs = std::move(costs);
        o.mem_limit = mem_limit;
        GilRelease nogil;
        return hs::build(name, ranks, microbatches, o);
      },
      py::arg("name"), py::arg("ranks"), py::arg("microbatches"), py::kw_only(),
      py::arg("chunks") = 2, py::arg("costs") = hs::CostModel{}, py::arg("mem_limit") = 0.0,
      "Builds the named schedule (compute actions only). chunks: v of interleaved-*; costs and "
      "mem_limit: what zb-auto, zbv-auto and auto search under (0: their default limit). "
      "ValueError states any unmet constraint and a value that works.");
  sub.def(
      "zb_auto",
      [](int ranks, int microbatches, hs::CostModel costs, double mem_limit,
         long long refine_work) {
        check_sizes("zb-auto", ranks, microbatches, 1);
        if (!(mem_limit >= 0) || !std::isfinite(mem_limit))
          value_error("zb-auto: mem_limit must be a finite number >= 0, got " + num(mem_limit));
        if (refine_work < 0) value_error("zb-auto: refine_work must be >= 0");
        if (ranks < 1 || microbatches < 1)
          value_error("zb-auto: needs ranks >= 1 and microbatches >= 1, got " +
                      std::to_string(ranks) + " and " + std::to_string(microbatches));
        hs::SearchOptions o;
        o.refine_work = refine_work;
        GilRelease nogil;
        return hs::zb_auto(ranks, microbatches, costs, mem_limit, o);
      },
      py::arg("ranks"), py::arg("microbatches"), py::arg("costs") = hs::CostModel{}, py::kw_only(),
      py::arg("mem_limit") = 0.0, py::arg("refine_work") = 20000000LL,
      "zb-auto with its search budget: refine_work simulated actions of local search (0: none).");
  sub.def(
      "span_lower_bound",
      [](int ranks, int microbatches, hs::CostModel costs, double mem_limit) {
        check_sizes("span_lower_bound", ranks, microbatches, 1);
        if (ranks < 1 || microbatches < 1)
          value_error("span_lower_bound: needs ranks >= 1 and microbatches >= 1");
        if (!(mem_limit > 0) || !std::isfinite(mem_limit))
          value_error("span_lower_bound: mem_limit must be a positive finite number, got " +
                      num(mem_limit));
        GilRelease nogil;
        return hs::span_lower_bound(ranks, microbatches, costs, mem_limit);
      },
      py::arg("ranks"), py::arg("microbatches"), py::arg("costs"), py::arg("mem_limit"),
      "A lower bound on the longest rank's span of every loop F/I/W schedule within mem_limit.");
  sub.def(
      "recommend",
      [](int ranks, int microbatches, hs::CostModel costs, double mem_limit) {
        check_sizes("recommend", ranks, microbatches, 1);
        if (!(mem_limit >= 0) || !std::isfinite(mem_limit))
          value_error("recommend: mem_limit must be a finite number >= 0, got " + num(mem_limit));
        std::vector<std::pair<std::string, std::string>> skipped;
        std::vector<hs::Recommendation> rows;
        {
          GilRelease nogil;
          rows = hs::recommend(ranks, microbatches, costs, mem_limit, &skipped);
        }
        py::list out;
        for (auto& r : rows)
          out.append(py::make_tuple(r.name, std::move(r.schedule), std::move(r.result), r.fits));
        return py::make_tuple(out, skipped);
      },
      py::arg("ranks"), py::arg("microbatches"), py::arg("costs"), py::arg("mem_limit"),
      "([(name, schedule, result, fits)] fitting first, then by step time; [(name, why "
      "skipped)]): every schedule and the memory-budget search `auto` (hp schedule recommend).");
  sub.def(
      "validate",
      [](hs::Schedule s) {
        GilRelease nogil;
        hs::validate(s);
      },
      py::arg("schedule"),
      "Raises ValueError naming the rank, the action index and the action unless the lists "
      "are consistent and cannot deadlock.");
  sub.def(
      "lower",
      [](hs::Schedule s) {
        GilRelease nogil;
        hs::validate(s);
        return hs::lower(s);
      },
      py::arg("schedule"),
      "A copy with SEND/RECV added (the schedule must be compute-only and valid).");
  sub.def(
      "simulate",
      [](hs::Schedule s, hs::CostModel costs, bool record_timeline, bool fb_overlap,
         bool defer_wgrad, const std::string& pair_turns, int w_parts) {
        const bool first_ready = hs::pair_turns_ready(pair_turns, defer_wgrad);
        if ((defer_wgrad || pair_turns != "auto") && !fb_overlap)
          throw py::value_error(
              "defer_wgrad and pair_turns describe overlapped pairs: pass fb_overlap=True too");
        GilRelease nogil;
        hs::validate(s);
        hs::SimOptions o;
        o.record_timeline = record_timeline;
        o.deferred_w_parts = w_parts;
        // As hp schedule show's --fb-overlap, --defer-wgrad and --pair-turns.
        o.overlap_pairs = fb_overlap;
        o.defer_wgrad = defer_wgrad;
        o.pair_first_ready = first_ready;
        return hs::simulate(s, costs, o);
      },
      py::arg("schedule"), py::arg("costs") = hs::CostModel{}, py::kw_only(),
      py::arg("record_timeline") = true, py::arg("fb_overlap") = false,
      py::arg("defer_wgrad") = false, py::arg("pair_turns") = "auto", py::arg("w_parts") = 1,
      "Runs the schedule (validated first) under the cost model: timings, bubble rate, idle "
      "fraction, peak memory, communication volume and the timeline. fb_overlap runs each FB "
      "pair as hp train --fb-overlap does (defer_wgrad, pair_turns, w_parts as its flags).");
  sub.attr("DEFERRED_W_GAIN") = hs::kDeferredWGain;
  sub.def("pair_turns_ready", &hs::pair_turns_ready, py::arg("pair_turns"), py::arg("defer_wgrad"),
          "Whether turns spelt 'auto', 'ready' or 'fixed' take ready turns (on CPU ranks), with "
          "or without deferred W's; ValueError for another spelling.");
  sub.def(
      "choose_deferred_w",
      [](hs::Schedule s, hs::CostModel costs, const std::string& pair_turns, bool cpu,
         bool recompute, double gain) {
        GilRelease nogil;
        hs::validate(s);
        const hs::DeferredWChoice c =
            hs::choose_deferred_w(s, costs, pair_turns, cpu, recompute, gain);
        return std::make_tuple(c.defer, c.step_without, c.step_with, c.peak_without, c.peak_with);
      },
      py::arg("schedule"), py::arg("costs") = hs::CostModel{}, py::kw_only(),
      py::arg("pair_turns") = "auto", py::arg("cpu") = true, py::arg("recompute") = false,
      py::arg("gain") = hs::kDeferredWGain,
      "(defer, step_without, step_with, peak_without, peak_with): the overlapped pairs "
      "simulated without and with deferred W's, as hp train's --defer-wgrad auto decides.");
  sub.def(
      "timeline_stats",
      [](hs::Timeline t) {
        check_timeline(t);
        return hs::timeline_stats(t);
      },
      py::arg("timeline"), "Bubble statistics of any (e.g. measured) timeline.");
  sub.def(
      "comm_volume",
      [](hs::Schedule s) {
        s.check_layout();
        return hs::comm_volume(s);
      },
      py::arg("schedule"), "Cross-rank transfers the schedule implies.");
  sub.def(
      "closed_form",
      [](const std::string& name, int p, int m, int v, const hs::CostModel& costs) {
        if (p < 1 || m < 1 || v < 1) value_error("closed_form: p, m and v must be >= 1");
        return hs::closed_form(name, p, m, v, costs);
      },
      py::arg("name"), py::arg("p"), py::arg("m"), py::arg("v") = 1,
      py::arg("costs") = hs::CostModel{},
      "The closed-form bubble of a classic schedule (known=False when there is none).");

  sub.def(
      "render_ascii",
      [](hs::Timeline t, int max_width, bool color) {
        check_timeline(t);
        if (max_width < 1 || max_width > 100000)
          value_error("render_ascii: max_width must be in [1, 100000], got " +
                      std::to_string(max_width));
        hs::AsciiOptions o;
        o.max_width = max_width;
        o.color = color;
        GilRelease nogil;
        return hs::render_ascii(t, o);
      },
      py::arg("timeline"), py::kw_only(), py::arg("max_width") = 160, py::arg("color") = false,
      "One text row per rank, each action as its letter and microbatch, bubbles as '.'.");
  sub.def(
      "render_svg",
      [](std::vector<hs::Timeline> ts, double width, double row_height, bool labels) {
        for (const auto& t : ts)
          check_timeline(t);
        if (!(width > 0 && width <= 1e6) || !(row_height > 0 && row_height <= 1e4))
          value_error("render_svg: width must be in (0, 1e6] and row_height in (0, 1e4]");
        hs::SvgOptions o;
        o.width = width;
        o.row_height = row_height;
        o.microbatch_labels = labels;
        GilRelease nogil;
        return hs::render_svg(ts, o);
      },
      py::arg("timelines"), py::kw_only(), py::arg("width") = 1200.0, py::arg("row_height") = 22.0,
      py::arg("microbatch_labels") = true,
      "An SVG picture of one or more timelines stacked on one time scale.");
  sub.def(
      "render_chrome_trace",
      [](hs::Timeline t) {
        check_timeline(t);
        GilRelease nogil;
        return hs::render_chrome_trace(t);
      },
      py::arg("timeline"), "Chrome / Perfetto trace JSON (one time unit = 1 ms).");
  sub.def("summary_text", &summary_text_of, py::arg("result"),
          "The statistics as aligned text (step time, idle, bubble rate, per rank).");
  sub.def("summary_json", &summary_json_of, py::arg("result"), py::arg("name") = "",
          "The statistics as a JSON object (no timeline).");

  sub.def(
      "to_csv", [](const hs::Schedule& s) { return hs::to_csv(s); }, py::arg("schedule"),
      "The CSV form: '#' metadata lines, then one row of actions per rank.");
  sub.def(
      "from_csv",
      [](const std::string& text, const std::string& source) {
        GilRelease nogil;
        return hs::from_csv(text, source);
      },
      py::arg("text"), py::arg("source") = "csv",
      "Reads a CSV written by to_csv, or plain rows (one per rank, torch style). Strict: "
      "ValueError names the source, the line, the rank and the text.");
  sub.def(
      "read_csv",
      [](const std::string& path) {
        GilRelease nogil;
        return hs::from_csv(hs::read_input_file(path), path);
      },
      py::arg("path"), "from_csv of a file (a regular file of at most 16 MiB).");
  sub.def(
      "parse_stage_costs",
      [](const std::string& json, const std::string& source) {
        return hs::parse_stage_costs(json, source);
      },
      py::arg("json_text"), py::arg("source") = "costs",
      "A CostModel from a stage cost file ({\"stages\": [{\"f\":..., \"i\":..., \"w\":...}]}).");
  sub.attr("MAX_INPUT_BYTES") = py::int_(hs::kMaxInputBytes);
}

}  // namespace hp::python
