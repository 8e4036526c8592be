// Internal to hp/recompute: what checkpoint.cpp needs from the session
// registry (the current session of this thread, the per-session cache of
// recomputed blocks, counting). Not part of the public API.
#pragma once

#include <cstdint>
#include <memory>

#include "hp/recompute/session.h"

namespace hp::recompute::detail {

struct Recomputed;  // a recomputed block (checkpoint.cpp)
using RecomputedPtr = std::shared_ptr<Recomputed>;

/// The innermost open RecomputeSession guard of this thread.
struct CurrentSession {
  SessionId id;
  SessionOptions options;
};
/// nullptr when no guard is open on this thread.
const CurrentSession* current_session();

/// Removes and returns the recomputed block `block_id` cached in session `id` (or nullptr).
RecomputedPtr take_cached(SessionId id, uint64_t block_id);
/// Whether session `id` caches a recomputed block `block_id`.
bool has_cached(SessionId id, uint64_t block_id);
/// Caches `value` for `block_id` in session `id` (opening the session if it was cleared).
void put_cached(SessionId id, uint64_t block_id, RecomputedPtr value);

enum class Event { Recompute, Prefetch, Consume, Reuse, Clear };
/// Counts `event` process-wide and, when `session` is given, in that session.
void record(const SessionId* session, Event event);

}  // namespace hp::recompute::detail
