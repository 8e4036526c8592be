// hp/schedule/action.cpp: printing and parsing of the Action IR's short text
// form (`2F0`, `0SEND_B2`, `3F1+5B0`).
#include "hp/schedule/action.h"

#include <array>
#include <limits>
#include <stdexcept>
#include <utility>

#include "hp/schedule/text.h"

namespace hp::schedule {

namespace {
constexpr std::array<std::string_view, 9> kOpNames = {"F",      "I",      "W",      "B",     "FB",
                                                      "SEND_F", "RECV_F", "SEND_B", "RECV_B"};

std::string_view trim(std::string_view s) {
  while (!s.empty() &&
         (s.front() == ' ' || s.front() == '\t' || s.front() == '\r' || s.front() == '\n'))
    s.remove_prefix(1);
  while (!s.empty() &&
         (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n'))
    s.remove_suffix(1);
  return s;
}

[[noreturn]] void fail(std::string_view text, const std::string& why) {
  throw std::invalid_argument("cannot parse action '" + escape_bytes(text) + "': " + why +
                              " (expected e.g. 2F0, 1I3, 0W1, 0B2, 0SEND_B2, 3F1+5B0)");
}

// Reads a non-negative decimal integer at s[pos]; advances pos.
bool read_int(std::string_view s, size_t& pos, int& out) {
  size_t start = pos;
  long long v = 0;
  while (pos < s.size() && s[pos] >= '0' && s[pos] <= '9') {
    v = v * 10 + (s[pos] - '0');
    if (v > std::numeric_limits<int>::max()) return false;
    ++pos;
  }
  if (pos == start) return false;
  out = static_cast<int>(v);
  return true;
}

// Parses `<stage><OP><mb>` where OP is one of kOpNames but not FB.
Action parse_simple(std::string_view whole, std::string_view s) {
  size_t pos = 0;
  Action a;
  if (!read_int(s, pos, a.stage)) fail(whole, "missing or too large stage number");
  size_t op_start = pos;
  while (pos < s.size() && ((s[pos] >= 'A' && s[pos] <= 'Z') || s[pos] == '_'))
    ++pos;
  std::string_view op = s.substr(op_start, pos - op_start);
  bool found = false;
  for (size_t i = 0; i < kOpNames.size(); ++i) {
    if (kOpNames[i] == op && static_cast<Op>(i) != Op::FB) {
      a.op = static_cast<Op>(i);
      found = true;
    }
  }
  if (!found) fail(whole, "unknown op '" + escape_bytes(op) + "'");
  if (!read_int(s, pos, a.microbatch)) fail(whole, "missing or too large microbatch number");
  if (pos != s.size())
    fail(whole, "unexpected trailing text '" + escape_bytes(s.substr(pos)) + "'");
  return a;
}
}  // namespace

bool is_compute(Op op) {
  return op <= Op::FB;
}
bool is_comm(Op op) {
  return op > Op::FB;
}
std::string_view op_name(Op op) {
  return kOpNames[static_cast<size_t>(op)];
}

std::string to_string(const Action& a) {
  if (a.op == Op::FB) {
    const std::string f = std::to_string(a.stage) + "F" + std::to_string(a.microbatch);
    const std::string b = std::to_string(a.stage2) + "B" + std::to_string(a.microbatch2);
    return a.backward_first ? b + "+" + f : f + "+" + b;
  }
  return std::to_string(a.stage) + std::string(op_name(a.op)) + std::to_string(a.microbatch);
}

Action parse_action(std::string_view text) {
  std::string_view s = trim(text);
  if (s.empty()) fail(text, "empty");
  size_t plus = s.find('+');
  if (plus == std::string_view::npos) return parse_simple(text, s);
  Action f = parse_simple(text, s.substr(0, plus));
  Action b = parse_simple(text, s.substr(plus + 1));
  const bool backward_first = f.op == Op::B && b.op == Op::F;
  if (backward_first) std::swap(f, b);
  if (f.op != Op::F || b.op != Op::B)
    fail(text,
         "an overlapped pair is written <stage>F<mb>+<stage>B<mb> (or <stage>B<mb>+<stage>F<mb> "
         "when its B leads)");
  return Action::overlap(f.stage, f.microbatch, b.stage, b.microbatch, backward_first);
}

}  // namespace hp::schedule
