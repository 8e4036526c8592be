// hp/schedule/schedule.cpp: route indexing, layout helpers and the CSV form of
// a Schedule.
#include "hp/schedule/schedule.h"

#include <algorithm>
#include <istream>
#include <ostream>
#include <sstream>
#include <stdexcept>

namespace hp::schedule {

namespace {
std::string join_ints(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i)
    s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

std::vector<std::string> split(const std::string& line, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : line) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

int parse_int(const std::string& text, const std::string& where) {
  std::string t = trim(text);
  if (t.empty() || t.size() > 9 || t.find_first_not_of("0123456789") != std::string::npos)
    throw std::invalid_argument(where + ": expected a non-negative integer, got '" + text + "'");
  return std::stoi(t);
}

std::vector<int> parse_ints(const std::vector<std::string>& cells, size_t from,
                            const std::string& where) {
  std::vector<int> v;
  for (size_t i = from; i < cells.size(); ++i) {
    if (trim(cells[i]).empty()) continue;
    v.push_back(parse_int(cells[i], where));
  }
  return v;
}
}  // namespace

int Schedule::route_position(int stage, int mb) const {
  if (mb < 0 || mb >= static_cast<int>(microbatch_route.size())) return -1;
  const auto& pos = route_pos_.at(microbatch_route[mb]);
  if (stage < 0 || stage >= static_cast<int>(pos.size())) return -1;
  return pos[stage];
}

int Schedule::next_stage(int stage, int mb) const {
  int p = route_position(stage, mb);
  if (p < 0) return -1;
  const auto& r = route(mb);
  return p + 1 < static_cast<int>(r.size()) ? r[p + 1] : -1;
}

int Schedule::prev_stage(int stage, int mb) const {
  int p = route_position(stage, mb);
  if (p <= 0) return -1;
  return route(mb)[p - 1];
}

std::vector<int> Schedule::stages_of_rank(int r) const {
  std::vector<int> out;
  for (int s = 0; s < num_stages; ++s)
    if (stage_rank[s] == r) out.push_back(s);
  return out;
}

void Schedule::index_routes() {
  route_pos_.assign(routes.size(), std::vector<int>(std::max(num_stages, 0), -1));
  for (size_t r = 0; r < routes.size(); ++r)
    for (size_t i = 0; i < routes[r].size(); ++i) {
      int s = routes[r][i];
      if (s >= 0 && s < num_stages) route_pos_[r][s] = static_cast<int>(i);
    }
}

void Schedule::check_layout() const {
  auto bad = [](const std::string& m) { throw std::invalid_argument("schedule layout: " + m); };
  if (num_ranks < 1) bad("num_ranks must be >= 1, got " + std::to_string(num_ranks));
  if (num_stages < 1) bad("num_stages must be >= 1, got " + std::to_string(num_stages));
  if (num_microbatches < 1)
    bad("num_microbatches must be >= 1, got " + std::to_string(num_microbatches));
  if (static_cast<int>(stage_rank.size()) != num_stages)
    bad("stage_rank has " + std::to_string(stage_rank.size()) + " entries, expected " +
        std::to_string(num_stages));
  if (static_cast<int>(stage_chunk.size()) != num_stages)
    bad("stage_chunk has " + std::to_string(stage_chunk.size()) + " entries, expected " +
        std::to_string(num_stages));
  for (int s = 0; s < num_stages; ++s) {
    if (stage_rank[s] < 0 || stage_rank[s] >= num_ranks)
      bad("stage " + std::to_string(s) + " placed on rank " + std::to_string(stage_rank[s]) +
          ", outside [0, " + std::to_string(num_ranks) + ")");
    if (stage_chunk[s] < 0 || stage_chunk[s] >= num_chunks)
      bad("stage " + std::to_string(s) + " computes chunk " + std::to_string(stage_chunk[s]) +
          ", outside [0, " + std::to_string(num_chunks) + ")");
  }
  if (static_cast<int>(microbatch_route.size()) != num_microbatches)
    bad("microbatch_route has " + std::to_string(microbatch_route.size()) + " entries, expected " +
        std::to_string(num_microbatches));
  for (int mb = 0; mb < num_microbatches; ++mb)
    if (microbatch_route[mb] < 0 || microbatch_route[mb] >= static_cast<int>(routes.size()))
      bad("microbatch " + std::to_string(mb) + " uses route " +
          std::to_string(microbatch_route[mb]) + " but there are " + std::to_string(routes.size()) +
          " routes");
  for (size_t r = 0; r < routes.size(); ++r) {
    if (routes[r].empty()) bad("route " + std::to_string(r) + " is empty");
    std::vector<bool> seen(num_stages, false);
    for (int s : routes[r]) {
      if (s < 0 || s >= num_stages)
        bad("route " + std::to_string(r) + " visits stage " + std::to_string(s) + ", outside [0, " +
            std::to_string(num_stages) + ")");
      if (seen[s])
        bad("route " + std::to_string(r) + " visits stage " + std::to_string(s) + " twice");
      seen[s] = true;
    }
  }
  if (static_cast<int>(actions.size()) != num_ranks)
    bad("actions has " + std::to_string(actions.size()) + " rows, expected one per rank (" +
        std::to_string(num_ranks) + ")");
  if (route_pos_.size() != routes.size()) bad("index_routes() was not called");
}

Schedule make_loop_layout(int ranks, int stages, int microbatches) {
  Schedule s;
  s.num_ranks = ranks;
  s.num_stages = stages;
  s.num_microbatches = microbatches;
  s.num_chunks = stages;
  for (int i = 0; i < stages; ++i) {
    s.stage_rank.push_back(i % ranks);
    s.stage_chunk.push_back(i);
  }
  std::vector<int> route(stages);
  for (int i = 0; i < stages; ++i)
    route[i] = i;
  s.routes = {route};
  s.microbatch_route.assign(microbatches, 0);
  s.actions.assign(ranks, {});
  s.index_routes();
  return s;
}

Schedule make_v_layout(int ranks, int microbatches) {
  Schedule s = make_loop_layout(ranks, 2 * ranks, microbatches);
  for (int i = 0; i < 2 * ranks; ++i)
    s.stage_rank[i] = i < ranks ? i : 2 * ranks - 1 - i;
  return s;
}

std::string format_actions(const std::vector<Action>& actions) {
  std::string out;
  for (size_t i = 0; i < actions.size(); ++i)
    out += (i ? " " : "") + to_string(actions[i]);
  return out;
}

void write_csv(const Schedule& s, std::ostream& out) {
  out << "# hp-schedule,1\n";
  out << "# name," << s.name << "\n";
  out << "# ranks," << s.num_ranks << "\n";
  out << "# stages," << s.num_stages << "\n";
  out << "# microbatches," << s.num_microbatches << "\n";
  out << "# chunks," << s.num_chunks << "\n";
  out << "# lowered," << (s.lowered ? 1 : 0) << "\n";
  out << "# stage_rank," << join_ints(s.stage_rank) << "\n";
  out << "# stage_chunk," << join_ints(s.stage_chunk) << "\n";
  for (const auto& r : s.routes)
    out << "# route," << join_ints(r) << "\n";
  out << "# microbatch_route," << join_ints(s.microbatch_route) << "\n";
  for (const auto& row : s.actions) {
    // A rank without actions is written as a lone comma: blank lines are skipped.
    if (row.empty()) out << ",";
    for (size_t i = 0; i < row.size(); ++i)
      out << (i ? "," : "") << to_string(row[i]);
    out << "\n";
  }
}

std::string to_csv(const Schedule& s) {
  std::ostringstream os;
  write_csv(s, os);
  return os.str();
}

Schedule read_csv(std::istream& in) {
  Schedule s;
  bool have_meta = false, have_ranks = false, have_stages = false, have_mbs = false,
       have_chunks = false;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    std::string where = "csv line " + std::to_string(line_no);
    std::string t = trim(line);
    if (t.empty()) continue;
    if (t[0] == '#') {
      auto cells = split(t.substr(1), ',');
      std::string key = trim(cells[0]);
      if (cells.size() < 2)
        throw std::invalid_argument(where + ": metadata '" + t + "' has no value");
      have_meta = true;
      if (key == "hp-schedule") {
        if (parse_int(cells[1], where) != 1)
          throw std::invalid_argument(where + ": unsupported hp-schedule version '" + cells[1] +
                                      "'");
      } else if (key == "name") {
        s.name = trim(cells[1]);
      } else if (key == "ranks") {
        s.num_ranks = parse_int(cells[1], where);
        have_ranks = true;
      } else if (key == "stages") {
        s.num_stages = parse_int(cells[1], where);
        have_stages = true;
      } else if (key == "microbatches") {
        s.num_microbatches = parse_int(cells[1], where);
        have_mbs = true;
      } else if (key == "chunks") {
        s.num_chunks = parse_int(cells[1], where);
        have_chunks = true;
      } else if (key == "lowered") {
        s.lowered = parse_int(cells[1], where) != 0;
      } else if (key == "stage_rank") {
        s.stage_rank = parse_ints(cells, 1, where);
      } else if (key == "stage_chunk") {
        s.stage_chunk = parse_ints(cells, 1, where);
      } else if (key == "route") {
        s.routes.push_back(parse_ints(cells, 1, where));
      } else if (key == "microbatch_route") {
        s.microbatch_route = parse_ints(cells, 1, where);
      } else {
        throw std::invalid_argument(where + ": unknown metadata key '" + key + "'");
      }
      continue;
    }
    std::vector<Action> row;
    int rank = static_cast<int>(s.actions.size());
    for (const auto& cell : split(t, ',')) {
      if (trim(cell).empty()) continue;
      try {
        row.push_back(parse_action(cell));
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(where + " (rank " + std::to_string(rank) + "): " + e.what());
      }
    }
    s.actions.push_back(std::move(row));
  }
  // Infer whatever the metadata did not say (a plain torch-style CSV has none).
  int max_stage = -1, max_mb = -1;
  bool has_comm = false;
  std::vector<int> seen_rank;
  for (size_t r = 0; r < s.actions.size(); ++r)
    for (const auto& a : s.actions[r]) {
      if (a.stage > 1000000 || a.microbatch > 1000000 || a.stage2 > 1000000 ||
          a.microbatch2 > 1000000)
        throw std::invalid_argument("csv rank " + std::to_string(r) + ": action '" + to_string(a) +
                                    "' has a stage or microbatch above 1000000");
      max_stage = std::max({max_stage, a.stage, a.stage2});
      max_mb = std::max({max_mb, a.microbatch, a.microbatch2});
      has_comm = has_comm || is_comm(a.op);
    }
  if (!have_ranks) s.num_ranks = static_cast<int>(s.actions.size());
  if (!have_stages) s.num_stages = max_stage + 1;
  if (!have_mbs) s.num_microbatches = max_mb + 1;
  if (s.num_ranks < 1) throw std::invalid_argument("csv: no rows (one row of actions per rank)");
  if (s.num_stages < 1) throw std::invalid_argument("csv: no actions, cannot infer the stages");
  if (s.num_microbatches < 1)
    throw std::invalid_argument("csv: no actions, cannot infer the microbatches");
  if (s.num_stages > 100000 || s.num_microbatches > 1000000 || s.num_ranks > 100000 ||
      static_cast<long long>(s.num_stages) * s.num_microbatches > 100000000LL)
    throw std::invalid_argument("csv: sizes too large (stages " + std::to_string(s.num_stages) +
                                ", microbatches " + std::to_string(s.num_microbatches) + ")");
  if (!have_meta) s.lowered = has_comm;
  if (s.stage_rank.empty()) {
    // Infer placement from where each stage's compute actions sit.
    s.stage_rank.assign(s.num_stages, -1);
    for (size_t r = 0; r < s.actions.size(); ++r)
      for (const auto& a : s.actions[r]) {
        if (!is_compute(a.op)) continue;
        for (int st : {a.stage, a.stage2}) {
          if (st < 0) continue;
          if (s.stage_rank[st] >= 0 && s.stage_rank[st] != static_cast<int>(r))
            throw std::invalid_argument("csv: stage " + std::to_string(st) +
                                        " has actions on rank " + std::to_string(s.stage_rank[st]) +
                                        " and rank " + std::to_string(r) +
                                        "; add a '# stage_rank,...' line");
          s.stage_rank[st] = static_cast<int>(r);
        }
      }
    for (int st = 0; st < s.num_stages; ++st)
      if (s.stage_rank[st] < 0) s.stage_rank[st] = st % s.num_ranks;
  }
  if (s.stage_chunk.empty()) {
    for (int st = 0; st < s.num_stages; ++st)
      s.stage_chunk.push_back(st);
  }
  if (!have_chunks) {
    s.num_chunks = 0;
    for (int c : s.stage_chunk)
      s.num_chunks = std::max(s.num_chunks, c + 1);
  }
  if (s.routes.empty()) {
    std::vector<int> route(s.num_stages);
    for (int i = 0; i < s.num_stages; ++i)
      route[i] = i;
    s.routes.push_back(route);
  }
  if (s.microbatch_route.empty()) s.microbatch_route.assign(s.num_microbatches, 0);
  if (static_cast<int>(s.actions.size()) < s.num_ranks) s.actions.resize(s.num_ranks);
  s.index_routes();
  s.check_layout();
  return s;
}

Schedule from_csv(const std::string& text) {
  std::istringstream is(text);
  return read_csv(is);
}

}  // namespace hp::schedule
