// hp/schedule/render.cpp: ASCII, SVG and Chrome-trace renderers of a Timeline
// and the text/JSON statistics of a SimResult.
#include "hp/schedule/render.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

namespace hp::schedule {

namespace {

struct Segment {
  Op op;  // F, I, W, B
  int mb;
  double start, end;
};

// An event as drawable segments (an FB pair is drawn as its F then its B half).
std::vector<Segment> segments(const Event& e) {
  if (e.action.op == Op::FB) {
    double mid = e.start + (e.end - e.start) / 3.0;  // F is about a third of F+I+W
    return {{Op::F, e.action.microbatch, e.start, mid}, {Op::B, e.action.microbatch2, mid, e.end}};
  }
  return {{e.action.op, e.action.microbatch, e.start, e.end}};
}

const char* ansi_color(Op op) {
  switch (op) {
    case Op::F:
      return "\x1b[44;97m";
    case Op::I:
      return "\x1b[43;30m";
    case Op::W:
      return "\x1b[42;30m";
    case Op::B:
      return "\x1b[41;97m";
    default:
      return "";
  }
}

const char* svg_color(Op op) {
  switch (op) {
    case Op::F:
      return "#4e79a7";
    case Op::I:
      return "#f2b447";
    case Op::W:
      return "#59a14f";
    case Op::B:
      return "#e15759";
    default:
      return "#bab0ac";
  }
}

std::string fmt(double v, int prec = 4) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", prec, v);
  return buf;
}

std::string escape_xml(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else if (c == '&')
      o += "&amp;";
    else if (c == '"')
      o += "&quot;";
    else
      o += c;
  }
  return o;
}

}  // namespace

std::string render_ascii(const Timeline& t, const AsciiOptions& opts) {
  std::ostringstream os;
  if (!t.title.empty()) os << t.title << "\n";
  const double span = t.makespan();
  if (t.events.empty() || span <= 0) {
    os << "(empty timeline)\n";
    return os.str();
  }
  double unit = span;
  int max_mb = 0;
  for (const auto& e : t.events)
    for (const auto& s : segments(e)) {
      if (s.end - s.start > 1e-12) unit = std::min(unit, s.end - s.start);
      max_mb = std::max(max_mb, s.mb);
    }
  const int label_len = 1 + static_cast<int>(std::to_string(max_mb).size());
  const int max_width = std::max(opts.max_width, 10);
  // Characters per time unit: room for a label in the shortest action if it fits.
  double cpu = label_len + 1;
  if (span / unit * cpu > max_width) cpu = max_width * unit / span;
  const int width = std::max(1, static_cast<int>(std::ceil(span / unit * cpu - 1e-9)));
  auto col = [&](double time) { return static_cast<int>(std::lround(time / unit * cpu)); };
  const int label_w = static_cast<int>(std::to_string(std::max(t.num_ranks - 1, 0)).size());
  // Each rank's events, found once (a scan of every event per rank took 4 s
  // at 4096 ranks).
  std::vector<std::vector<const Event*>> by_rank(std::max(t.num_ranks, 0));
  for (const auto& e : t.events)
    if (e.rank >= 0 && e.rank < t.num_ranks) by_rank[e.rank].push_back(&e);
  for (int r = 0; r < t.num_ranks; ++r) {
    std::vector<char> cells(width, '.');
    std::vector<signed char> kind(width, -1);
    for (const Event* ep : by_rank[r]) {
      const auto& e = *ep;
      for (const auto& s : segments(e)) {
        int a = std::clamp(col(s.start), 0, width), b = std::clamp(col(s.end), 0, width);
        if (b <= a) {
          if (a >= width) continue;
          b = a + 1;  // every action gets at least one cell
        }
        std::string label = std::string(op_name(s.op)) + std::to_string(s.mb);
        if (static_cast<int>(label.size()) > b - a) label = std::string(op_name(s.op));
        for (int c = a; c < b; ++c) {
          int i = c - a;
          cells[c] = i < static_cast<int>(label.size()) ? label[i] : ' ';
          kind[c] = static_cast<signed char>(s.op);
        }
        if (b - a >= 2 && b - a > static_cast<int>(label.size())) cells[b - 1] = ' ';
      }
    }
    std::string pad(label_w - std::to_string(r).size(), ' ');
    os << "rank " << pad << r << " |";
    int cur = -1;
    for (int c = 0; c < width; ++c) {
      if (opts.color && kind[c] != cur) {
        os << "\x1b[0m";
        if (kind[c] >= 0) os << ansi_color(static_cast<Op>(kind[c]));
        cur = kind[c];
      }
      os << cells[c];
    }
    if (opts.color) os << "\x1b[0m";
    os << "|\n";
  }
  os << "time: 0 .. " << fmt(span) << " (one column = " << fmt(unit / cpu) << ")";
  os << "   F forward, I input grad, W weight grad, B = I+W, . bubble\n";
  return os.str();
}

std::string render_svg(const std::vector<Timeline>& timelines, const SvgOptions& o) {
  const double left = 70, right = 20, top = 10, title_h = 22, gap = 16, legend_h = 30;
  double max_span = 0;
  for (const auto& t : timelines)
    max_span = std::max(max_span, t.makespan());
  if (max_span <= 0) max_span = 1;
  const double scale = (o.width - left - right) / max_span;
  double height = top;
  for (const auto& t : timelines)
    height += title_h + t.num_ranks * o.row_height + gap;
  height += legend_h;
  std::ostringstream os;
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << fmt(o.width, 8) << "\" height=\""
     << fmt(height, 8) << "\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"11\">\n";
  os << "<rect x=\"0\" y=\"0\" width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  double y = top;
  for (const auto& t : timelines) {
    os << "<text x=\"4\" y=\"" << fmt(y + 15, 8) << "\" font-size=\"14\" font-weight=\"bold\">"
       << escape_xml(t.title) << "</text>\n";
    y += title_h;
    for (int r = 0; r < t.num_ranks; ++r) {
      double ry = y + r * o.row_height;
      os << "<text x=\"" << fmt(left - 6, 8) << "\" y=\"" << fmt(ry + o.row_height * 0.68, 8)
         << "\" text-anchor=\"end\">rank " << r << "</text>\n";
      os << "<rect x=\"" << fmt(left, 8) << "\" y=\"" << fmt(ry + 1, 8) << "\" width=\""
         << fmt(t.makespan() * scale, 8) << "\" height=\"" << fmt(o.row_height - 2, 8)
         << "\" fill=\"none\" stroke=\"#dddddd\"/>\n";
    }
    for (const auto& e : t.events) {
      double ry = y + e.rank * o.row_height;
      for (const auto& s : segments(e)) {
        double x = left + s.start * scale, w = (s.end - s.start) * scale;
        os << "<rect x=\"" << fmt(x, 8) << "\" y=\"" << fmt(ry + 1, 8) << "\" width=\""
           << fmt(std::max(w, 0.5), 8) << "\" height=\"" << fmt(o.row_height - 2, 8) << "\" fill=\""
           << svg_color(s.op) << "\" stroke=\"white\" stroke-width=\"0.5\"><title>"
           << escape_xml(to_string(e.action)) << " [" << fmt(e.start) << ", " << fmt(e.end)
           << ")</title></rect>\n";
        std::string label = std::to_string(s.mb);
        if (o.microbatch_labels && w >= 7.0 * label.size() + 2)
          os << "<text x=\"" << fmt(x + w / 2, 8) << "\" y=\"" << fmt(ry + o.row_height * 0.68, 8)
             << "\" text-anchor=\"middle\" fill=\""
             << (s.op == Op::I || s.op == Op::W ? "black" : "white") << "\">" << label
             << "</text>\n";
      }
    }
    y += t.num_ranks * o.row_height + gap;
  }
  // Legend.
  double x = left;
  const std::pair<Op, const char*> items[] = {{Op::F, "F forward"},
                                              {Op::I, "I input grad (dx)"},
                                              {Op::W, "W weight grad (dw)"},
                                              {Op::B, "B = I+W"}};
  for (const auto& [op, text] : items) {
    os << "<rect x=\"" << fmt(x, 8) << "\" y=\"" << fmt(y + 4, 8)
       << "\" width=\"14\" height=\"14\" fill=\"" << svg_color(op) << "\"/>";
    os << "<text x=\"" << fmt(x + 18, 8) << "\" y=\"" << fmt(y + 15, 8) << "\">" << text
       << "</text>\n";
    x += 150;
  }
  os << "<text x=\"" << fmt(x, 8) << "\" y=\"" << fmt(y + 15, 8)
     << "\">blank = bubble; FB = F beside B</text>\n";
  os << "</svg>\n";
  return os.str();
}

std::string render_svg(const Timeline& t, const SvgOptions& o) {
  return render_svg(std::vector<Timeline>{t}, o);
}

std::string render_chrome_trace(const Timeline& t) {
  nlohmann::json events = nlohmann::json::array();
  for (int r = 0; r < t.num_ranks; ++r)
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", r},
                      {"args", {{"name", "rank " + std::to_string(r)}}}});
  for (const auto& e : t.events) {
    nlohmann::json args = {{"stage", e.action.stage}, {"microbatch", e.action.microbatch}};
    if (e.action.op == Op::FB) {
      args["stage2"] = e.action.stage2;
      args["microbatch2"] = e.action.microbatch2;
    }
    if (e.waits > 0) {  // NOTE [Waits inside a chunk] in simulate.h (time unit: ms)
      args["waits"] = e.waits;
      args["waited"] = e.waited;
    }
    events.push_back({{"name", to_string(e.action)},
                      {"cat", std::string(op_name(e.action.op))},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", e.rank},
                      {"ts", e.start * 1000.0},
                      {"dur", (e.end - e.start) * 1000.0},
                      {"args", args}});
  }
  nlohmann::json doc = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  if (!t.title.empty()) doc["otherData"] = {{"title", t.title}};
  return doc.dump();
}

std::string summary_text(const SimResult& r) {
  std::ostringstream os;
  os << "step time      " << fmt(r.makespan) << "  (makespan: first op to last op, all ranks)\n";
  os << "idle fraction  " << fmt(100 * r.idle_fraction) << " %  (idle time / (p x step time))\n";
  os << "bubble rate    " << fmt(100 * r.bubble_rate) << " %  (Zero Bubble paper: longest rank's "
     << "(span - work) / span; span " << fmt(r.span) << ", work " << fmt(r.work) << ")\n";
  os << "comm volume    " << r.comm_volume << " transfers\n";
  double hidden = 0.0, exposed = 0.0;  // NOTE [What a pair hides, predicted] in simulate.cpp
  for (size_t i = 0; i < r.rank_pair_hidden.size(); ++i)
    hidden += r.rank_pair_hidden[i], exposed += r.rank_pair_exposed.at(i);
  if (hidden + exposed > 0)
    os << "pairs' waits   " << fmt(100 * hidden / (hidden + exposed)) << " % hidden (hidden "
       << fmt(hidden) << ", exposed " << fmt(exposed) << ": the overlapped pairs' waits)\n";
  os << "peak memory    " << fmt(r.max_peak_memory) << " (max over ranks)\n";
  os << "rank   busy      idle      peak-mem\n";
  for (size_t i = 0; i < r.rank_busy.size(); ++i) {
    char line[128];
    std::snprintf(line, sizeof line, "%-6zu %-9.4g %-9.4g %-9.4g\n", i, r.rank_busy[i],
                  r.rank_idle[i], r.peak_memory[i]);
    os << line;
  }
  return os.str();
}

std::string summary_json(const SimResult& r, const std::string& name) {
  nlohmann::json j = {{"bubble_rate", r.bubble_rate},
                      {"makespan", r.makespan},
                      {"span", r.span},
                      {"work", r.work},
                      {"idle_fraction", r.idle_fraction},
                      {"rank_busy", r.rank_busy},
                      {"rank_idle", r.rank_idle},
                      {"rank_span", r.rank_span},
                      {"peak_memory", r.peak_memory},
                      {"max_peak_memory", r.max_peak_memory},
                      {"comm_volume", r.comm_volume}};
  if (!r.rank_pair_hidden.empty()) {  // NOTE [What a pair hides, predicted] in simulate.cpp
    j["rank_pair_hidden"] = r.rank_pair_hidden;
    j["rank_pair_exposed"] = r.rank_pair_exposed;
  }
  if (!name.empty()) j["name"] = name;
  return j.dump(2);
}

}  // namespace hp::schedule
