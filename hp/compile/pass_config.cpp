// PassConfig validation, PassPlan lookup/merge and the YAML reader/writer
// (yaml-cpp). Torch-free: errors are std::invalid_argument.
#include "hp/compile/pass_config.h"

#include <fnmatch.h>
#include <yaml-cpp/yaml.h>

#include <fstream>
#include <sstream>
#include <stdexcept>

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

[[noreturn]] void fail(const std::string& source, const YAML::Mark& mark, const std::string& what) {
  std::ostringstream os;
  os << "pass plan " << source;
  if (mark.line >= 0) os << " line " << mark.line + 1;
  os << ": " << what;
  throw std::invalid_argument(os.str());
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
    const std::string key = entry[field].as<std::string>();
    if (key.empty())
      fail(source, entry[field].Mark(),
           std::string("fsdp.") + section + " entry has an empty " + field);
    add(key);
  }
}

}  // namespace

PassPlan PassPlan::from_yaml(const std::string& text, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    fail(source, e.mark, "malformed YAML: " + e.msg);
  }
  PassPlan plan;
  if (!root || root.IsNull()) return plan;
  if (!root.IsMap()) fail(source, root.Mark(), "the top level must be a map with an 'fsdp' key");
  const YAML::Node fsdp = root["fsdp"];
  if (!fsdp || fsdp.IsNull()) return plan;
  if (!fsdp.IsMap())
    fail(source, fsdp.Mark(), "'fsdp' must be a map with enabled / modules / patterns");
  for (const auto& kv : fsdp) {
    const auto key = kv.first.as<std::string>();
    if (key != "enabled" && key != "modules" && key != "patterns")
      fail(source, kv.first.Mark(),
           "unknown key fsdp." + key + " (known: enabled, modules, patterns)");
  }
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
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("pass plan: cannot open '" + path + "' for reading");
  std::stringstream ss;
  ss << in.rdbuf();
  return from_yaml(ss.str(), path);
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
