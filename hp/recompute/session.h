// Recompute sessions: the per-process registry (keyed by a caller-chosen id)
// of recomputed checkpoint blocks waiting for their next consumer, the RAII
// guard that makes a session current for the backwards it starts (on this
// thread and on the autograd engine's device threads), explicit clear, and
// the counters tests and users read.
#pragma once

#include <torch/arg.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace hp::recompute {

/// A recompute session's id, chosen by the caller (e.g. stage * 2^32 + microbatch).
using SessionId = uint64_t;

/// Options of a recompute session (taken from the innermost open guard).
struct SessionOptions {
  /// Keep a block's recomputed graph after its first consumer (dx) for the next
  /// one (dw), so a split backward recomputes each block once. Off: the first
  /// consumer frees it (as an ordinary checkpoint does).
  TORCH_ARG(bool, retain_on_unpack) = false;
};

/// How much recompute work ran; process-wide (`counters()`) or per session.
struct RecomputeCounters {
  int64_t recomputes = 0;  ///< re-runs of a block's function for backward (prefetches included)
  int64_t prefetches = 0;  ///< those of them started by `RecomputeHandle::recompute`
  int64_t consumed = 0;    ///< backward requests (dx, dw or fused) served by a recomputed block
  int64_t reused = 0;      ///< of those, served from a cache (prefetched or retained) without
                           ///< recomputing
  int64_t cleared = 0;     ///< recomputed blocks dropped before their last consumer ran
};

/// What a session holds right now.
struct SessionStats {
  bool exists = false;         ///< opened by a guard and not cleared since
  size_t cached_blocks = 0;    ///< recomputed blocks waiting for a consumer
  RecomputeCounters counters;  ///< since the session was opened (reset by clear_session)
};

/// Makes session `id` current on this thread for its lifetime: every backward
/// started on this thread inside it (wherever the engine runs its nodes: on
/// this thread for CPU tensors, on its device threads for CUDA ones; NOTE
/// [Sessions reach the engine's threads]) and every
/// `RecomputeHandle::recompute` called here share the session's recomputed
/// blocks. Opens the session if it does not exist. Closing the guard keeps
/// what the session holds (dx and dw may run under two guards at different
/// times); `clear_session` drops it. Guards nest; the innermost one is
/// current. A guard must close on the thread that opened it.
class RecomputeSession {
 public:
  explicit RecomputeSession(SessionId id, SessionOptions options = {});
  ~RecomputeSession();
  RecomputeSession(const RecomputeSession&) = delete;
  RecomputeSession& operator=(const RecomputeSession&) = delete;

  SessionId id() const { return id_; }
  const SessionOptions& options() const { return options_; }

 private:
  struct Scope;  // the thread-local state that carries the session (session.cpp)
  SessionId id_;
  SessionOptions options_;
  std::unique_ptr<Scope> scope_;
};

/// Drops everything session `id` holds: recomputed tensors and graphs,
/// counters, flags. Safe at any time outside that session's own backward (after
/// an exception, a partial run, or when nothing was ever recomputed); a no-op
/// for an unknown id. Returns how many recomputed blocks were dropped unconsumed.
size_t clear_session(SessionId id);

/// Clears every session (e.g. when an executor tears down). Returns the blocks dropped.
size_t clear_all_sessions();

/// The state of session `id` (`exists == false` when unknown or cleared).
SessionStats session_stats(SessionId id);

/// Number of sessions opened and not cleared.
size_t num_sessions();

/// Process-wide counters since start or the last `reset_counters`.
RecomputeCounters counters();

/// Zeroes the process-wide counters.
void reset_counters();

}  // namespace hp::recompute
