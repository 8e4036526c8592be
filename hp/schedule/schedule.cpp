// hp/schedule/schedule.cpp: route indexing, layout helpers and the CSV form of
// a Schedule.
#include "hp/schedule/schedule.h"

#include <cstdio>

#include <cmath>

#include <algorithm>
#include <istream>
#include <map>
#include <ostream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "hp/schedule/text.h"

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
    throw std::invalid_argument(where + ": expected a non-negative integer, got '" +
                                escape_bytes(text) + "'");
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

bool Schedule::has_pairs() const {
  for (const auto& row : actions)
    for (const auto& a : row)
      if (a.op == Op::FB) return true;
  return false;
}

std::vector<int> Schedule::stages_of_rank(int r) const {
  std::vector<int> out;
  for (int s = 0; s < num_stages; ++s)
    if (stage_rank[s] == r) out.push_back(s);
  return out;
}

std::vector<std::pair<int, int>> Schedule::rank_links() const {
  std::set<std::pair<int, int>> links;
  std::set<int> used(microbatch_route.begin(), microbatch_route.end());
  for (int r : used)
    for (size_t i = 0; i + 1 < routes.at(r).size(); ++i) {
      const auto& route = routes[r];
      const int a = stage_rank.at(route[i]), b = stage_rank.at(route[i + 1]);
      if (a != b) links.insert({std::min(a, b), std::max(a, b)});
    }
  return {links.begin(), links.end()};
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

// NOTE [Strict schedule CSV]
// A schedule file is either plain rows (one per rank, torch style) or the
// form write_csv produces: metadata lines, then rows. Everything the metadata
// says must agree with the rows: as many rows as ranks, every action's stage
// and microbatch inside the declared counts, placement, chunk and route lists
// of the declared sizes, no SEND/RECV in a file that says it is not lowered,
// each metadata key once (route may repeat). Errors name the source and the
// line and show the offending bytes escaped and cut (escape_bytes); input
// above kMaxInputBytes is refused before it is parsed.
Schedule read_csv(std::istream& in, const std::string& source) {
  std::string text;
  char buf[65536];
  while (in) {
    in.read(buf, sizeof buf);
    text.append(buf, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxInputBytes)
      throw std::invalid_argument(source + ": more than " + std::to_string(kMaxInputBytes) +
                                  " bytes; a schedule CSV must be smaller");
  }
  return from_csv(text, source);
}

Schedule from_csv(const std::string& text, const std::string& source) {
  if (text.size() > kMaxInputBytes)
    throw std::invalid_argument(source + ": " + std::to_string(text.size()) +
                                " bytes, more than the limit of " + std::to_string(kMaxInputBytes) +
                                " for a schedule CSV");
  Schedule s;
  bool have_ranks = false, have_stages = false, have_mbs = false, have_chunks = false,
       have_lowered = false;
  std::map<std::string, int> key_line;  // metadata key -> line it was given on
  std::vector<int> row_line;            // rank -> line of its row
  int line_no = 0;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    const std::string line = text.substr(pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    const std::string where = source + " line " + std::to_string(line_no);
    std::string t = trim(line);
    if (t.empty()) continue;
    if (t[0] == '#') {
      auto cells = split(t.substr(1), ',');
      std::string key = trim(cells[0]);
      if (cells.size() < 2)
        throw std::invalid_argument(where + ": metadata '" + escape_bytes(t) + "' has no value");
      if (key != "route" && key_line.count(key))
        throw std::invalid_argument(where + ": metadata '" + escape_bytes(key) +
                                    "' was already given on line " + std::to_string(key_line[key]) +
                                    "; give it once");
      if (!row_line.empty())
        throw std::invalid_argument(where +
                                    ": metadata after the rows of actions; put every '#' "
                                    "line before the first row");
      key_line[key] = line_no;
      if (key == "hp-schedule") {
        if (parse_int(cells[1], where) != 1)
          throw std::invalid_argument(where + ": unsupported hp-schedule version '" +
                                      escape_bytes(cells[1]) + "'");
      } else if (key == "name") {
        s.name = trim(cells[1]);
        if (s.name.size() > 200 || escape_bytes(s.name, s.name.size()) != s.name)
          throw std::invalid_argument(where + ": name '" + escape_bytes(s.name) +
                                      "' must be printable text of at most 200 characters");
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
        const int v = parse_int(cells[1], where);
        if (v > 1) throw std::invalid_argument(where + ": lowered must be 0 or 1");
        s.lowered = v != 0;
        have_lowered = true;
      } else if (key == "stage_rank") {
        s.stage_rank = parse_ints(cells, 1, where);
      } else if (key == "stage_chunk") {
        s.stage_chunk = parse_ints(cells, 1, where);
      } else if (key == "route") {
        s.routes.push_back(parse_ints(cells, 1, where));
      } else if (key == "microbatch_route") {
        s.microbatch_route = parse_ints(cells, 1, where);
      } else {
        throw std::invalid_argument(where + ": unknown metadata key '" + escape_bytes(key) + "'");
      }
      continue;
    }
    std::vector<Action> row;
    int rank = static_cast<int>(s.actions.size());
    for (const auto& cell : split(t, ',')) {
      if (trim(cell).empty()) continue;
      Action a;
      try {
        a = parse_action(cell);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(where + " (rank " + std::to_string(rank) + "): " + e.what());
      }
      if (a.stage > 1000000 || a.microbatch > 1000000 || a.stage2 > 1000000 ||
          a.microbatch2 > 1000000)
        throw std::invalid_argument(where + " (rank " + std::to_string(rank) + "): action '" +
                                    to_string(a) + "' has a stage or microbatch above 1000000");
      if (have_stages && std::max(a.stage, a.stage2) >= s.num_stages)
        throw std::invalid_argument(where + " (rank " + std::to_string(rank) + "): action '" +
                                    to_string(a) + "' names a stage outside the " +
                                    std::to_string(s.num_stages) + " stages of line " +
                                    std::to_string(key_line["stages"]));
      if (have_mbs && std::max(a.microbatch, a.microbatch2) >= s.num_microbatches)
        throw std::invalid_argument(where + " (rank " + std::to_string(rank) + "): action '" +
                                    to_string(a) + "' names a microbatch outside the " +
                                    std::to_string(s.num_microbatches) + " microbatches of line " +
                                    std::to_string(key_line["microbatches"]));
      if (have_lowered && !s.lowered && is_comm(a.op))
        throw std::invalid_argument(where + " (rank " + std::to_string(rank) + "): '" +
                                    to_string(a) + "' is communication but line " +
                                    std::to_string(key_line["lowered"]) +
                                    " says the schedule is not lowered");
      row.push_back(a);
    }
    if (have_ranks && rank >= s.num_ranks)
      throw std::invalid_argument(where + ": row " + std::to_string(rank + 1) +
                                  " of actions but line " + std::to_string(key_line["ranks"]) +
                                  " says " + std::to_string(s.num_ranks) +
                                  " ranks; give one row per rank");
    s.actions.push_back(std::move(row));
    row_line.push_back(line_no);
  }
  if (have_ranks && static_cast<int>(s.actions.size()) != s.num_ranks)
    throw std::invalid_argument(
        source + ": line " + std::to_string(key_line["ranks"]) + " says " +
        std::to_string(s.num_ranks) + " ranks but the file has " +
        std::to_string(s.actions.size()) +
        " rows of actions; give one row per rank (a rank without actions is a lone comma)");
  auto sized = [&](const std::vector<int>& v, const char* key, int want, const char* what) {
    if (!v.empty() && static_cast<int>(v.size()) != want)
      throw std::invalid_argument(source + " line " + std::to_string(key_line[key]) + ": " + key +
                                  " has " + std::to_string(v.size()) + " entries but there are " +
                                  std::to_string(want) + " " + what);
  };
  if (have_stages) {
    sized(s.stage_rank, "stage_rank", s.num_stages, "stages");
    sized(s.stage_chunk, "stage_chunk", s.num_stages, "stages");
  }
  if (have_mbs) sized(s.microbatch_route, "microbatch_route", s.num_microbatches, "microbatches");
  // Infer whatever the metadata did not say (a plain torch-style CSV has none).
  int max_stage = -1, max_mb = -1;
  bool has_comm = false;
  for (size_t r = 0; r < s.actions.size(); ++r)
    for (const auto& a : s.actions[r]) {
      max_stage = std::max({max_stage, a.stage, a.stage2});
      max_mb = std::max({max_mb, a.microbatch, a.microbatch2});
      has_comm = has_comm || is_comm(a.op);
    }
  if (!have_ranks) s.num_ranks = static_cast<int>(s.actions.size());
  if (!have_stages) s.num_stages = max_stage + 1;
  if (!have_mbs) s.num_microbatches = max_mb + 1;
  if (s.num_ranks < 1)
    throw std::invalid_argument(source + ": no rows (one row of actions per rank)");
  if (s.num_stages < 1)
    throw std::invalid_argument(source + ": no actions, cannot infer the stages");
  if (s.num_microbatches < 1)
    throw std::invalid_argument(source + ": no actions, cannot infer the microbatches");
  check_schedule_size(source, s.num_ranks, s.num_microbatches,
                      double(s.num_stages) / double(s.num_ranks));
  if (!have_lowered) s.lowered = has_comm;
  if (s.stage_rank.empty()) {
    // Infer placement from where each stage's compute actions sit.
    s.stage_rank.assign(s.num_stages, -1);
    for (size_t r = 0; r < s.actions.size(); ++r)
      for (const auto& a : s.actions[r]) {
        if (!is_compute(a.op)) continue;
        for (int st : {a.stage, a.stage2}) {
          if (st < 0) continue;
          if (s.stage_rank[st] >= 0 && s.stage_rank[st] != static_cast<int>(r))
            throw std::invalid_argument(source + " line " + std::to_string(row_line[r]) +
                                        ": stage " + std::to_string(st) + " has actions on rank " +
                                        std::to_string(s.stage_rank[st]) + " and rank " +
                                        std::to_string(r) + "; add a '# stage_rank,...' line");
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
  s.index_routes();
  try {
    s.check_layout();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(source + ": " + e.what());
  }
  return s;
}

void check_schedule_size(const std::string& what, int ranks, int microbatches,
                         double stages_per_rank) {
  if (ranks < 1 || microbatches < 1) return;  // the caller says what is wrong with those
  const double v = std::max(1.0, stages_per_rank);
  const double work = double(ranks) * (v * microbatches) * (v * microbatches);
  if (ranks <= kMaxScheduleRanks && work <= kMaxScheduleWork) return;
  const double m_max = std::floor(std::sqrt(kMaxScheduleWork / double(ranks)) / v);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.3g (limit %.3g)", work, kMaxScheduleWork);
  if (ranks > kMaxScheduleRanks)
    throw std::invalid_argument(what + ": " + std::to_string(ranks) + " ranks; at most " +
                                std::to_string(kMaxScheduleRanks));
  throw std::invalid_argument(
      what + ": " + std::to_string(ranks) + " ranks and " + std::to_string(microbatches) +
      " microbatches are too many to schedule in seconds: the work grows with ranks x "
      "(microbatches x stages per rank)^2 = " +
      buf + "; use at most " + std::to_string(static_cast<long long>(std::max(1.0, m_max))) +
      " microbatches at " + std::to_string(ranks) + " ranks (NOTE [One size rule])");
}

}  // namespace hp::schedule
