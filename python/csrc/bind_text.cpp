// hyperparallel._C.text: output files written as the hp tool writes them
// (hp/schedule/text.h), for the Python package's reports and traces.
#include <string>

#include "bindings.h"
#include "hp/schedule/text.h"

namespace hp::python {

void bind_text(py::module_& parent) {
  auto m = parent.def_submodule("text",
                                "Output files written whole, or in place where the "
                                "path is a device, FIFO or descriptor");
  m.def(
      "write_text_file",
      [](const std::string& path, const std::string& data) {
        schedule::write_text_file(path, data);  // std::runtime_error: RuntimeError
      },
      py::arg("path"), py::arg("data"), py::call_guard<py::gil_scoped_release>(),
      "Writes `data` to `path`: a regular file (or a symlink's final target) whole through a "
      "temporary and a rename, anything else in place, every write checked (NOTE [Output files "
      "are whole] in hp/schedule/text.cpp). RuntimeError naming the path and the reason.");
  m.def(
      "check_output_path",
      [](const std::string& path, const std::string& option) {
        try {
          schedule::check_output_path(path, option);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("path"), py::arg("option") = "",
      "ValueError when write_text_file could not write `path` (a missing or read-only folder, a "
      "folder given as the file, ...), naming `option`.");
}

}  // namespace hp::python
