// Logging for the library and the CLI: leveled messages to stderr, with the
// rank (when one is set) in front, so interleaved ranks stay readable.
#pragma once

#include <sstream>
#include <string>

namespace hp {

enum class LogLevel { Debug = 0, Info = 1, Warn = 2, Error = 3 };

/// Messages below this level are dropped. Default Info; HP_LOG_LEVEL=debug|info|warn|error.
LogLevel log_level();
void set_log_level(LogLevel level);
/// The rank printed in front of every message; -1 (the default) prints none.
void set_log_rank(int rank);
void log_message(LogLevel level, const std::string& message);

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& value, const Rest&... rest) {
  os << value;
  append(os, rest...);
}
}  // namespace detail

/// log(LogLevel::Info, "stage ", s, " ready") concatenates its arguments like TORCH_CHECK.
template <typename... Args>
void log(LogLevel level, const Args&... args) {
  if (level < log_level()) return;
  std::ostringstream os;
  detail::append(os, args...);
  log_message(level, os.str());
}

}  // namespace hp
