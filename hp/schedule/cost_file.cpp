// hp/schedule/cost_file.cpp: strict reading of per-stage cost files (NOTE
// [Stage cost file]) and bounded reading of input files.
#include "hp/schedule/cost_file.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <vector>

#include "hp/schedule/text.h"

namespace hp::schedule {

namespace {

using nlohmann::json;

// Parses JSON and refuses duplicate keys in any object (nlohmann keeps the
// last one silently).
json parse_strict(const std::string& text, const std::string& source) {
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  json::parser_callback_t cb = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      keys.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (event == json::parse_event_t::key && !keys.empty()) {
      const std::string k = parsed.get<std::string>();
      if (!keys.back().insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text, cb);
  } catch (const json::exception& e) {
    throw std::invalid_argument(source + ": not valid JSON (" + escape_bytes(e.what(), 200) + ")");
  }
  if (!duplicate.empty())
    throw std::invalid_argument(source + ": key '" + escape_bytes(duplicate) +
                                "' appears twice in one object; keep one");
  return j;
}

double number(const json& stage, const char* key, double dflt, bool required,
              const std::string& where) {
  auto it = stage.find(key);
  if (it == stage.end()) {
    if (required)
      throw std::invalid_argument(where + ": missing \"" + key +
                                  "\" (f, i and w are required per stage)");
    return dflt;
  }
  if (!it->is_number())
    throw std::invalid_argument(where + ": \"" + key + "\" must be a number, got " +
                                escape_bytes(it->dump(), 40));
  const double v = it->get<double>();
  // Above kMaxCost a step's sums of costs leave the doubles' range (1e308
  // made `tune` print "inf -nan%").
  if (!std::isfinite(v) || v < 0 || (required && !(v > 0)) || v > kMaxCost)
    throw std::invalid_argument(where + ": \"" + key + "\" must be " +
                                (required ? "positive" : "non-negative") +
                                " and at most 1e12, got " + escape_bytes(it->dump(), 40));
  return v;
}

}  // namespace

CostModel parse_stage_costs(const std::string& text, const std::string& source) {
  if (text.size() > kMaxCostFileBytes)
    throw std::invalid_argument(source + ": " + std::to_string(text.size()) +
                                " bytes; a cost file is at most " +
                                std::to_string(kMaxCostFileBytes) + " (one short entry per stage)");
  json doc = parse_strict(text, source);
  if (!doc.is_object())
    throw std::invalid_argument(source +
                                ": expected a JSON object with \"stages\" (or \"stage_costs\")");
  const json* obj = &doc;
  if (doc.contains("stage_costs")) {
    obj = &doc["stage_costs"];
    if (!obj->is_object())
      throw std::invalid_argument(source + ": \"stage_costs\" must be an object with \"stages\"");
  }
  for (auto it = obj->begin(); it != obj->end(); ++it)
    if (it.key() != "stages" && it.key() != "unit")
      throw std::invalid_argument(source + ": unknown key '" + escape_bytes(it.key()) +
                                  "' (expected \"stages\", optionally \"unit\")");
  auto st = obj->find("stages");
  if (st == obj->end() || !st->is_array() || st->empty())
    throw std::invalid_argument(source +
                                ": \"stages\" must be a non-empty array, one object per "
                                "pipeline stage");
  if (st->size() > static_cast<size_t>(kMaxScheduleRanks))  // NOTE [One size rule]
    throw std::invalid_argument(source + ": " + std::to_string(st->size()) +
                                " stages (one per rank); at most " +
                                std::to_string(kMaxScheduleRanks));
  CostModel c;
  c.f = c.b = c.w = c.mem_b = c.mem_w = 0;
  int index = 0;
  for (const json& s : *st) {
    const std::string where = source + ": stage " + std::to_string(index++);
    if (!s.is_object()) throw std::invalid_argument(where + ": expected an object");
    static const std::set<std::string> kKeys = {
        "f",       "i",      "b",       "w",       "comm",   "send",    "mem_b",
        "mem_w",   "stage",  "name",    "f_waits", "f_wait", "i_waits", "i_wait",
        "w_waits", "w_wait", "f_nodes", "i_nodes", "w_nodes"};
    for (auto it = s.begin(); it != s.end(); ++it)
      if (!kKeys.count(it.key()))
        throw std::invalid_argument(
            where + ": unknown key '" + escape_bytes(it.key()) +
            "' (known: f, i (or b), w, comm, send, mem_b, mem_w, "
            "f_waits, f_wait, i_waits, i_wait, w_waits, w_wait, f_nodes, i_nodes, w_nodes, "
            "stage, name)");
    if (s.contains("i") && s.contains("b"))
      throw std::invalid_argument(where + ": give \"i\" or \"b\" (the same cost), not both");
    const double f = number(s, "f", 0, true, where);
    const double i = number(s, s.contains("b") ? "b" : "i", 0, true, where);
    const double w = number(s, "w", 0, true, where);
    const double comm = number(s, "comm", 0, false, where);
    const double send = number(s, "send", 0, false, where);
    const double mem_b = number(s, "mem_b", 1.0, false, where);
    const double mem_w = number(s, "mem_w", 0.5, false, where);
    // NOTE [Waits inside a chunk] in simulate.h: how many, and each one's seconds.
    auto count = [&](const char* key) {
      const double v = number(s, key, 0, false, where);
      if (v != std::floor(v) || v > 1e6)
        throw std::invalid_argument(where + ": \"" + key +
                                    "\" must be a whole number of waits, got " +
                                    escape_bytes(s[key].dump(), 40));
      return static_cast<int>(v);
    };
    InnerComm inner{count("f_waits"), number(s, "f_wait", 0, false, where),
                    count("i_waits"), number(s, "i_wait", 0, false, where),
                    count("w_waits"), number(s, "w_wait", 0, false, where)};
    auto shares = [&](const char* key, std::vector<double>& out) {
      auto it = s.find(key);
      if (it == s.end()) return;
      if (!it->is_array() || it->size() > 1000000)
        throw std::invalid_argument(where + ": \"" + key +
                                    "\" must be an array of each node's share of the compute");
      for (const json& v : *it) {
        if (!v.is_number() || !(v.get<double>() >= 0) || !std::isfinite(v.get<double>()))
          throw std::invalid_argument(where + ": \"" + key +
                                      "\" must hold non-negative numbers, got " +
                                      escape_bytes(v.dump(), 40));
        out.push_back(v.get<double>());
      }
    };
    shares("f_nodes", inner.f_nodes);
    shares("i_nodes", inner.i_nodes);
    shares("w_nodes", inner.w_nodes);
    if (!c.stage_inner.empty() || inner.f_waits > 0 || inner.i_waits > 0 || inner.w_waits > 0) {
      c.stage_inner.resize(index - 1);  // the stages before it had none
      c.stage_inner.push_back(inner);
    }
    c.stage_f.push_back(f);
    c.stage_b.push_back(i);
    c.stage_w.push_back(w);
    c.stage_comm.push_back(comm);
    c.stage_send.push_back(send);
    c.stage_mem_b.push_back(mem_b);
    c.stage_mem_w.push_back(mem_w);
    c.f = std::max(c.f, f);
    c.b = std::max(c.b, i);
    c.w = std::max(c.w, w);
    c.comm = std::max(c.comm, comm);
    c.send = std::max(c.send, send);
    c.mem_b = std::max(c.mem_b, mem_b);
    c.mem_w = std::max(c.mem_w, mem_w);
  }
  c.check(static_cast<int>(c.stage_f.size()));
  return c;
}

std::string read_input_file(const std::string& path, std::size_t max_bytes) {
  struct stat st {};
  const std::string shown = "'" + escape_bytes(path, 200) + "'";
  if (::stat(path.c_str(), &st) != 0)
    throw std::invalid_argument("cannot read " + shown + ": no such file");
  if (!S_ISREG(st.st_mode))
    throw std::invalid_argument("cannot read " + shown +
                                ": not a regular file (a directory, device or pipe); give a file");
  if (static_cast<unsigned long long>(st.st_size) > max_bytes)
    throw std::invalid_argument("cannot read " + shown + ": " + std::to_string(st.st_size) +
                                " bytes, more than the limit of " + std::to_string(max_bytes) +
                                " bytes for an input file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("cannot read " + shown + ": permission denied?");
  std::string text;
  text.resize(max_bytes + 1);
  in.read(&text[0], static_cast<std::streamsize>(text.size()));
  const std::size_t got = static_cast<std::size_t>(in.gcount());
  if (got > max_bytes)
    throw std::invalid_argument("cannot read " + shown + ": grew beyond the limit of " +
                                std::to_string(max_bytes) + " bytes while reading");
  text.resize(got);
  return text;
}

}  // namespace hp::schedule
