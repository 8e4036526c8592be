// PassConfig validation, PassPlan lookup/merge and the YAML reader/writer
// (yaml-cpp), strict as documented: one document, known keys only, no key
// twice, bounded input. Torch-free: errors are std::invalid_argument.
#include "hp/compile/pass_config.h"

#include <fnmatch.h>
#include <sys/stat.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace hp::compile {

void PassConfig::validate() const {
  if (tp_size < 1)
    throw std::invalid_argument("PassConfig: tp_size is " + std::to_string(tp_size) +
                                "; it must be >= 1 (1 means no tensor parallelism)");
  if (fsdp_degree && *fsdp_degree < 1)
    throw std::invalid_argument("PassConfig: fsdp_degree is " + std::to_string(*fsdp_degree) +
                                "; it must be a positive integer, or unset to use the world size");
}

namespace {

void upsert(std::vector<std::pair<std::string, FSDPModuleConfig>>& list, const std::string& key,
            FSDPModuleConfig config) {
  for (auto& [k, v] : list)
    if (k == key) {
      v = std::move(config);
      return;
    }
  list.emplace_back(key, std::move(config));
}

}  // namespace

PassPlan& PassPlan::add_module(const std::string& fqn) {
  upsert(modules_, fqn, FSDPModuleConfig{fqn});
  return *this;
}

PassPlan& PassPlan::add_pattern(const std::string& pattern) {
  upsert(patterns_, pattern, FSDPModuleConfig{pattern});
  return *this;
}

std::optional<FSDPModuleConfig> PassPlan::lookup(const std::string& module_fqn) const {
  for (const auto& [k, v] : modules_)
    if (k == module_fqn) return v;
  for (const auto& [k, v] : patterns_)
    if (fnmatch(k.c_str(), module_fqn.c_str(), 0) == 0) return v;
  return std::nullopt;
}

bool PassPlan::covers_parameter(const std::string& param_fqn) const {
  for (size_t pos = param_fqn.find('.'); pos != std::string::npos;
       pos = param_fqn.find('.', pos + 1))
    if (lookup(param_fqn.substr(0, pos))) return true;
  return lookup(param_fqn).has_value();  // the parameter named itself
}

PassPlan PassPlan::merge(const PassPlan& other) const {
  PassPlan out = *this;
  for (const auto& [k, v] : other.modules_)
    upsert(out.modules_, k, v);
  for (const auto& [k, v] : other.patterns_)
    upsert(out.patterns_, k, v);
  if (other.enabled_) out.enabled_ = other.enabled_;
  return out;
}

bool PassPlan::enabled() const {
  if (enabled_) return *enabled_;
  return !modules_.empty() || !patterns_.empty();
}

bool PassPlan::operator==(const PassPlan& other) const {
  auto keys = [](const std::vector<std::pair<std::string, FSDPModuleConfig>>& l) {
    std::vector<std::string> k;
    for (const auto& e : l)
      k.push_back(e.first);
    return k;
  };
  return keys(modules_) == keys(other.modules_) && keys(patterns_) == keys(other.patterns_) &&
         enabled() == other.enabled();
}

namespace {

// Untrusted bytes (keys, file names) as printable ASCII for an error
// message: \n \t \\ and every non-printable byte escaped (\xNN), cut at
// `max_chars` bytes with the total length; never stops at a NUL byte.
std::string shown(const std::string& text, size_t max_chars = 60) {
  std::string out;
  const size_t n = std::min(text.size(), max_chars);
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c < 0x20 || c > 0x7e) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > max_chars) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}

[[noreturn]] void fail(const std::string& source, const YAML::Mark& mark, const std::string& what) {
  std::ostringstream os;
  os << "pass plan " << shown(source, 200);
  if (mark.line >= 0) os << " line " << mark.line + 1;
  os << ": " << what;
  throw std::invalid_argument(os.str());
}

// Every map in the tree has scalar keys, each at most once; at most
// kMaxNodes nodes are visited (aliases count each time they are used) and
// at most kMaxDepth levels deep (an alias may refer to its own ancestor).
constexpr int kMaxNodes = 100000;
constexpr int kMaxDepth = 32;

void check_keys(const YAML::Node& node, const std::string& source, int depth, int* visited) {
  if (++*visited > kMaxNodes)
    fail(source, node.Mark(),
         "more than " + std::to_string(kMaxNodes) +
             " YAML nodes (aliases counted each time they are used); a pass plan is a short list");
  if (depth > kMaxDepth)
    fail(source, node.Mark(),
         "nested deeper than " + std::to_string(kMaxDepth) +
             " levels (or an alias refers to itself); a pass plan is at most four levels deep");
  if (node.IsSequence()) {
    for (const auto& item : node)
      check_keys(item, source, depth + 1, visited);
  } else if (node.IsMap()) {
    std::map<std::string, int> seen;  // key -> 1-based line
    for (const auto& kv : node) {
      if (!kv.first.IsScalar())
        fail(source, kv.first.Mark(), "keys must be plain strings, not lists or maps");
      const auto key = kv.first.Scalar();
      auto [it, inserted] = seen.emplace(key, kv.first.Mark().line + 1);
      if (!inserted)
        fail(source, kv.first.Mark(),
             "duplicate key '" + shown(key) + "' (first on line " + std::to_string(it->second) +
                 "); give each key once");
      check_keys(kv.second, source, depth + 1, visited);
    }
  }
}

// Refuses every key of `map` not in `known`: "unknown key '<prefix><key>'<where>".
void only_keys(const YAML::Node& map, const std::vector<std::string>& known,
               const std::string& prefix, const std::string& where, const std::string& source) {
  for (const auto& kv : map) {
    const auto key = kv.first.Scalar();
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string list;
    for (const auto& k : known)
      list += (list.empty() ? "" : ", ") + k;
    fail(source, kv.first.Mark(),
         "unknown key '" + prefix + shown(key) + "'" + where + " (known: " + list + ")");
  }
}

// Reads a list of `{<field>: string}` maps; each entry's key goes to `add`.
template <class Add>
void read_entries(const YAML::Node& list, const char* section, const char* field,
                  const std::string& source, Add add) {
  if (!list || list.IsNull()) return;
  if (!list.IsSequence())
    fail(source, list.Mark(),
         std::string("fsdp.") + section + " must be a list of {" + field + ": ...} entries");
  for (const auto& entry : list) {
    if (!entry.IsMap() || !entry[field] || !entry[field].IsScalar())
      fail(source, entry.Mark(),
           std::string("each fsdp.") + section + " entry needs a string '" + field + "' (e.g. - " +
               field + ": layers.0)");
    only_keys(entry, {field}, "", std::string(" in an fsdp.") + section + " entry", source);
    const std::string key = entry[field].as<std::string>();
    if (key.empty())
      fail(source, entry[field].Mark(),
           std::string("fsdp.") + section + " entry has an empty " + field);
    for (char c : key)
      if (c < 0x20 || c > 0x7e)
        fail(source, entry[field].Mark(),
             std::string("fsdp.") + section + " entry '" + shown(key) +
                 "' holds a byte that is not printable ASCII; module names and patterns are "
                 "printable ASCII (e.g. layers.0, layers.*)");
    add(key);
  }
}

// What yaml-cpp would never return from (NOTE [yaml-cpp loops on a stray
// comma]): where (0-based) and why; line -1 when there is nothing.
struct Refusal {
  int line = -1, column = -1;
  const char* why = "";
};

// True when the line at text[i] is a well-formed "%YAML 1.x" directive.
bool yaml_version_directive(const std::string& text, size_t i) {
  static const std::regex kVersion(R"(%YAML[ \t]+1\.[0-9]+[ \t]*(#.*)?\r?)");
  const size_t end = text.find('\n', i);
  return std::regex_match(text.substr(i, end == std::string::npos ? end : end - i), kVersion);
}

// The first ',' outside flow collections ([ ], { }), quotes and comments,
// and the first directive line other than "%YAML 1.x". Which '[', '{' and
// quotes open one needs YAML's tokens: in block context a token starts a
// line, or follows "- ", "? ", ": ", a closed quote or collection, or an
// anchor, tag or alias; anything else that starts there is a plain scalar,
// whose brackets and quotes are its own characters up to the next ": " or
// " #" (in "a[[b # c\n," both '[' are the scalar's and the ',' stands where
// a token starts; yaml-cpp loops on it). YAML would take a ',' inside a
// plain scalar, and quotes and flow collections over several lines; they are
// refused all the same, as a pass plan needs none of them (yaml-cpp loops on
// "'a\n,b", and on "a\n{\n# c\n,x", where the '{' continues the scalar).
Refusal refused_before_yaml(const std::string& text) {
  auto blank = [&](size_t i) {
    return i >= text.size() || text[i] == ' ' || text[i] == '\t' || text[i] == '\n' ||
           text[i] == '\r';
  };
  int line = 0, col = 0, depth = 0;
  char quote = 0;
  bool comment = false, plain = false, word = false;  // word: in an anchor, tag or alias
  char prev = '\n';
  for (size_t i = 0; i < text.size(); ++i, ++col) {
    const char c = text[i];
    if (c == '\n') {
      if (quote)
        return {line, col,
                "a quoted scalar that goes on past its line; a pass plan needs none (close the "
                "quote on the line it opens)"};
      if (depth > 0)
        return {line, col,
                "malformed YAML: a [ ] or { } not closed on its line; a pass plan closes each "
                "on the line it opens (or uses a block list)"};
      comment = plain = word = false;
      ++line;
      col = -1;
      prev = c;
      continue;
    }
    if (comment) continue;
    if (prev == '\n' && !quote && depth == 0 && c == '%' && !yaml_version_directive(text, i))
      return {line, col,
              "a directive (a line starting with '%') other than %YAML 1.x; a pass plan needs "
              "none (quote a value that starts with '%')"};
    if (quote) {
      if (quote == '"' && c == '\\' && i + 1 < text.size() && text[i + 1] != '\n') {
        ++i, ++col;  // an escaped character
      } else if (c == quote) {
        if (quote == '\'' && i + 1 < text.size() && text[i + 1] == '\'') {
          ++i, ++col;  // '' inside single quotes
        } else {
          quote = 0;
        }
      }
      prev = c;
      continue;
    }
    const bool after_blank = prev == '\n' || prev == ' ' || prev == '\t';
    if (c == '#' && after_blank) {
      comment = true;
    } else if (depth > 0) {
      // Flow context: a token starts after a blank or an indicator.
      const bool token_start =
          after_blank || prev == ':' || prev == '[' || prev == '{' || prev == ',';
      if ((c == '"' || c == '\'') && token_start) {
        quote = c;
      } else if (c == '[' || c == '{') {
        ++depth;
      } else if (c == ']' || c == '}') {
        --depth;
      }
    } else if (c == ',') {
      return {line, col,
              "a ',' outside [ ], { } and quotes; a pass plan has none there (quote the value)"};
    } else if (word) {
      word = !blank(i);
    } else if (plain) {
      if (c == ':' && blank(i + 1)) plain = false;  // the key ends; its value follows
    } else if (c == ' ' || c == '\t' || c == '\r') {
    } else if ((c == '-' || c == '?' || c == ':') && blank(i + 1)) {
    } else if (c == '&' || c == '!' || c == '*') {
      word = true;
    } else if (c == '"' || c == '\'') {
      quote = c;
    } else if (c == '[' || c == '{') {
      depth = 1;
    } else {
      plain = true;
    }
    prev = c;
  }
  return {};
}

// The 0-based line where the second document of `text` starts: its '---'
// line (a '---' before any content opens the first document), else -1.
int second_document_line(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  bool content = false;
  for (int n = 0; std::getline(in, line); ++n) {
    const bool marker = line.rfind("---", 0) == 0 &&
                        (line.size() == 3 || line[3] == ' ' || line[3] == '\t' || line[3] == '\r');
    if (marker && content) return n;
    if (marker) {
      content = true;  // the first document's explicit start
      continue;
    }
    const auto first = line.find_first_not_of(" \t\r");
    if (first != std::string::npos && line[first] != '#') content = true;
  }
  return -1;
}

}  // namespace

PassPlan PassPlan::from_yaml(const std::string& text, const std::string& source) {
  if (text.size() > kMaxYamlBytes)
    fail(source, YAML::Mark::null_mark(),
         std::to_string(text.size()) + " bytes, more than the limit of " +
             std::to_string(kMaxYamlBytes) + " bytes for a pass plan");
  // NOTE [yaml-cpp loops on a stray comma]
  // yaml-cpp 0.7 (Debian 12 and 13) never returns from LoadAll, growing its
  // memory as it goes, when a ',' stands where block context expects a token
  // (",x", "# c\n,x", "!a ,:", "a[[b # c\n,": the brackets there belong to
  // a plain scalar) and after some directive lines that are not %YAML's
  // ("%aY: .a [x, ..." with flow collections below it). The fuzzer in
  // tests/compile found each; the last two grew past 2 GiB before libFuzzer
  // stopped them. A pass plan needs commas only inside [ ] or { } or quotes,
  // and no directive, so the text is refused before yaml-cpp sees it.
  if (Refusal r = refused_before_yaml(text); r.line >= 0) {
    YAML::Mark mark = YAML::Mark::null_mark();
    mark.line = r.line;
    mark.column = r.column;
    fail(source, mark, r.why);
  }
  std::vector<YAML::Node> docs;
  try {
    docs = YAML::LoadAll(text);
  } catch (const YAML::Exception& e) {
    fail(source, e.mark, "malformed YAML: " + shown(e.msg, 200));
  }
  if (docs.size() > 1) {
    YAML::Mark mark = docs[1].Mark();
    if (int line = second_document_line(text); line >= 0) mark.line = line;
    fail(source, mark,
         "a second YAML document starts here; a pass plan is one document (remove the '---' "
         "and what follows, or merge it into the first)");
  }
  PassPlan plan;
  if (docs.empty()) return plan;
  const YAML::Node root = docs[0];
  if (!root || root.IsNull()) return plan;
  if (!root.IsMap()) fail(source, root.Mark(), "the top level must be a map with an 'fsdp' key");
  int visited = 0;
  check_keys(root, source, 0, &visited);
  only_keys(root, {"fsdp"}, "", "", source);
  const YAML::Node fsdp = root["fsdp"];
  if (!fsdp || fsdp.IsNull()) return plan;
  if (!fsdp.IsMap())
    fail(source, fsdp.Mark(), "'fsdp' must be a map with enabled / modules / patterns");
  only_keys(fsdp, {"enabled", "modules", "patterns"}, "fsdp.", "", source);
  if (const YAML::Node en = fsdp["enabled"]) {
    bool on = false;
    if (!en.IsScalar() || !YAML::convert<bool>::decode(en, on))
      fail(source, en.Mark(), "fsdp.enabled must be true or false");
    plan.set_enabled(on);
  }
  read_entries(fsdp["modules"], "modules", "name", source,
               [&](const std::string& k) { plan.add_module(k); });
  read_entries(fsdp["patterns"], "patterns", "pattern", source,
               [&](const std::string& k) { plan.add_pattern(k); });
  return plan;
}

PassPlan PassPlan::load_yaml(const std::string& path) {
  const std::string where = "'" + shown(path, 200) + "'";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw std::invalid_argument("pass plan: cannot open " + where + " for reading: no such file");
  if (!S_ISREG(st.st_mode))
    throw std::invalid_argument("pass plan: cannot read " + where +
                                ": not a regular file (a directory, device or pipe); give a file");
  if (static_cast<unsigned long long>(st.st_size) > kMaxYamlBytes)
    throw std::invalid_argument("pass plan: " + where + " has " + std::to_string(st.st_size) +
                                " bytes, more than the limit of " + std::to_string(kMaxYamlBytes) +
                                " bytes for a pass plan");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("pass plan: cannot open " + where + " for reading");
  std::string text(kMaxYamlBytes + 1, '\0');
  in.read(&text[0], static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  return from_yaml(text, path);  // a file that grew past the limit is refused there
}

std::string PassPlan::to_yaml() const {
  YAML::Emitter out;
  out << YAML::BeginMap << YAML::Key << "fsdp" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "enabled" << YAML::Value << enabled();
  out << YAML::Key << "modules" << YAML::Value << YAML::BeginSeq;
  for (const auto& e : modules_)
    out << YAML::BeginMap << YAML::Key << "name" << YAML::Value << e.first << YAML::EndMap;
  out << YAML::EndSeq;
  out << YAML::Key << "patterns" << YAML::Value << YAML::BeginSeq;
  for (const auto& e : patterns_)
    out << YAML::BeginMap << YAML::Key << "pattern" << YAML::Value << e.first << YAML::EndMap;
  out << YAML::EndSeq << YAML::EndMap << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

void PassPlan::save_yaml(const std::string& path) const {
  std::ofstream out(path);
  if (!out) throw std::invalid_argument("pass plan: cannot open '" + path + "' for writing");
  out << to_yaml();
}

}  // namespace hp::compile
