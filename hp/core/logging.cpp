// Logging implementation: one global level and rank, one write per message.
#include "hp/core/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace hp {
namespace {

LogLevel level_from_env() {
  const char* env = std::getenv("HP_LOG_LEVEL");
  if (!env) return LogLevel::Info;
  if (!std::strcmp(env, "debug")) return LogLevel::Debug;
  if (!std::strcmp(env, "warn")) return LogLevel::Warn;
  if (!std::strcmp(env, "error")) return LogLevel::Error;
  return LogLevel::Info;
}

std::atomic<int>& level_storage() {
  static std::atomic<int> level{static_cast<int>(level_from_env())};
  return level;
}

std::atomic<int> g_rank{-1};

}  // namespace

LogLevel log_level() {
  return static_cast<LogLevel>(level_storage().load());
}
void set_log_level(LogLevel level) {
  level_storage().store(static_cast<int>(level));
}
void set_log_rank(int rank) {
  g_rank.store(rank);
}

void log_message(LogLevel level, const std::string& message) {
  static const char* names[] = {"debug", "info", "warn", "error"};
  std::string line;
  int rank = g_rank.load();
  if (rank >= 0) line += "[rank " + std::to_string(rank) + "] ";
  line += names[static_cast<int>(level)];
  line += ": ";
  line += message;
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace hp
