// hyperparallel._C.compile: the pass plan's YAML reader of hp/compile
// (PassPlan::from_yaml, load_yaml), so that hyperparallel.compile and the C++
// graph mode accept and refuse the same files with the same messages. Built
// where hp/compile is (not in an HP_EXTENSION_ONLY build, NOTE [A build with
// nothing but torch]); hyperparallel.compile then says what is missing.
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "hp/compile/pass_config.h"

namespace hp::python {
namespace {

using PlanTuple =
    std::tuple<std::optional<bool>, std::vector<std::string>, std::vector<std::string>>;

PlanTuple as_tuple(const compile::PassPlan& plan) {
  std::vector<std::string> modules, patterns;
  for (const auto& [name, config] : plan.modules())
    modules.push_back(name);
  for (const auto& [pattern, config] : plan.patterns())
    patterns.push_back(pattern);
  return {plan.explicit_enabled(), std::move(modules), std::move(patterns)};
}

}  // namespace

void bind_compile(py::module_& m) {
  auto sub = m.def_submodule("compile", "the pass plan's YAML reader of graph mode (hp/compile)");
  // std::invalid_argument reaches Python as ValueError with the C++ message.
  sub.def(
      "parse_pass_plan_yaml",
      [](const std::string& text, const std::string& source) {
        return as_tuple(compile::PassPlan::from_yaml(text, source));
      },
      py::arg("text"), py::arg("source") = "<yaml>",
      "(enabled or None, module names, patterns) of a pass plan's YAML text.");
  sub.def(
      "load_pass_plan_yaml",
      [](const std::string& path) { return as_tuple(compile::PassPlan::load_yaml(path)); },
      py::arg("path"), "(enabled or None, module names, patterns) of a pass plan's YAML file.");
}

}  // namespace hp::python
