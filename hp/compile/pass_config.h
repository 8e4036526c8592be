// hp/compile's configuration model: `PassConfig` (which passes run, FSDP
// degree, informational TP fields) and `PassPlan` (which modules FSDP shards,
// by exact FQN or glob pattern) with its YAML form. Torch-free on purpose.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace hp::compile {

/// Which passes the graph pipeline runs and with what parallel degrees.
struct PassConfig {
  /// Runs AutoOverlapPass (waits move to just before their first use).
  bool enable_overlap = true;
  /// Runs FSDPPass; it does nothing on a world of one rank.
  bool fsdp_enabled = true;
  /// FSDP group size; unset means the Comm's world size.
  std::optional<int64_t> fsdp_degree;
  /// Informational (TP collectives live outside the graph); >= 1.
  int64_t tp_size = 1;
  /// Informational: sequence parallel on the TP axis.
  bool sequence_parallel = false;
  /// Informational: loss parallel on the TP axis.
  bool loss_parallel = false;

  /// Throws std::invalid_argument naming the bad field and what to do.
  void validate() const;
};

/// What FSDP does with one planned module. Only the name / pattern is read
/// from YAML today (see the seed §4.2: no dead fields).
struct FSDPModuleConfig {
  /// The exact FQN or the glob pattern this entry was registered under.
  std::string key;
};

/// Which modules FSDP shards: exact FQNs first, then glob patterns (fnmatch
/// semantics, `*` also matches '.') in insertion order.
class PassPlan {
 public:
  /// Registers (or replaces) an exact module FQN.
  PassPlan& add_module(const std::string& fqn);
  /// Registers (or replaces, keeping its position) a glob pattern.
  PassPlan& add_pattern(const std::string& pattern);

  /// The entry that plans module `module_fqn`: the exact entry if any, else
  /// the first pattern (in insertion order) that matches.
  std::optional<FSDPModuleConfig> lookup(const std::string& module_fqn) const;
  /// True when a module that owns parameter `param_fqn` (any proper prefix
  /// "a", "a.b", ... of "a.b.weight") or the parameter itself is planned.
  bool covers_parameter(const std::string& param_fqn) const;

  /// A new plan with this plan's entries and `other`'s; `other` wins on equal
  /// keys and on `enabled`. Neither plan is modified.
  PassPlan merge(const PassPlan& other) const;

  /// Explicit `fsdp.enabled`, else "any module or pattern registered".
  bool enabled() const;
  /// Sets `fsdp.enabled` explicitly.
  void set_enabled(bool on) { enabled_ = on; }
  /// `fsdp.enabled` when it was set explicitly (in YAML or by set_enabled).
  std::optional<bool> explicit_enabled() const { return enabled_; }

  const std::vector<std::pair<std::string, FSDPModuleConfig>>& modules() const { return modules_; }
  const std::vector<std::pair<std::string, FSDPModuleConfig>>& patterns() const {
    return patterns_;
  }

  /// The largest pass plan text (or file) read: a plan is a short list.
  static constexpr size_t kMaxYamlBytes = size_t(1) << 20;

  /// Parses the YAML of the seed §4.2 (`fsdp: {enabled, modules: [{name}],
  /// patterns: [{pattern}]}`); `source` names the text in errors. Strict:
  /// one document, no key but those, no key twice in a map, at most
  /// kMaxYamlBytes. Throws std::invalid_argument naming the source and the
  /// 1-based line, with untrusted bytes escaped and cut.
  static PassPlan from_yaml(const std::string& text, const std::string& source = "<yaml>");
  /// Reads (a regular file of at most kMaxYamlBytes) and parses a YAML file.
  static PassPlan load_yaml(const std::string& path);
  /// The YAML form that from_yaml reads back to an equal plan.
  std::string to_yaml() const;
  /// Writes to_yaml() to `path`.
  void save_yaml(const std::string& path) const;

  bool operator==(const PassPlan& other) const;

 private:
  std::vector<std::pair<std::string, FSDPModuleConfig>> modules_;
  std::vector<std::pair<std::string, FSDPModuleConfig>> patterns_;
  std::optional<bool> enabled_;
};

}  // namespace hp::compile
