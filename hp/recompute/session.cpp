// The recompute session registry: sessions keyed by id behind one mutex, the
// thread-local stack of open guards, explicit clear and the counters.
#include "hp/recompute/session.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "hp/recompute/session_registry.h"

namespace hp::recompute {
namespace {

// NOTE [Session state and locking]
// A session is a record in one process-wide map (id -> cache of recomputed
// blocks + counters), guarded by `registry_mutex()`. The lock is held only to
// move a cached block in or out of the map, never while a block recomputes or
// a backward runs: a block's backward may recompute nested checkpoints that
// use the registry again (reentrant backward on the same thread). A block in
// use is therefore out of the map, so two threads never use one recomputed
// graph at once. Which session a backward belongs to is thread-local (the
// guard stack below): LibTorch's CPU engine runs a backward's nodes on the
// thread that called it. Recomputed blocks are destroyed outside the lock.

struct SessionRecord {
  std::unordered_map<uint64_t, detail::RecomputedPtr> cache;
  RecomputeCounters counters;
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<SessionId, SessionRecord>& registry() {
  static std::unordered_map<SessionId, SessionRecord> r;
  return r;
}

struct GlobalCounters {
  std::atomic<int64_t> recomputes{0}, prefetches{0}, consumed{0}, reused{0}, cleared{0};
};
GlobalCounters& global() {
  static GlobalCounters g;
  return g;
}

std::vector<detail::CurrentSession>& guard_stack() {
  static thread_local std::vector<detail::CurrentSession> stack;
  return stack;
}

void bump(RecomputeCounters& c, detail::Event event) {
  switch (event) {
    case detail::Event::Recompute:
      c.recomputes++;
      break;
    case detail::Event::Prefetch:
      c.prefetches++;
      break;
    case detail::Event::Consume:
      c.consumed++;
      break;
    case detail::Event::Reuse:
      c.reused++;
      break;
    case detail::Event::Clear:
      c.cleared++;
      break;
  }
}

}  // namespace

namespace detail {

const CurrentSession* current_session() {
  auto& stack = guard_stack();
  return stack.empty() ? nullptr : &stack.back();
}

RecomputedPtr take_cached(SessionId id, uint64_t block_id) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(id);
  if (it == registry().end()) return nullptr;
  auto entry = it->second.cache.find(block_id);
  if (entry == it->second.cache.end()) return nullptr;
  RecomputedPtr value = std::move(entry->second);
  it->second.cache.erase(entry);
  return value;
}

bool has_cached(SessionId id, uint64_t block_id) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(id);
  return it != registry().end() && it->second.cache.count(block_id) > 0;
}

void put_cached(SessionId id, uint64_t block_id, RecomputedPtr value) {
  RecomputedPtr replaced;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& slot = registry()[id].cache[block_id];
  replaced = std::move(slot);
  slot = std::move(value);
}

void record(const SessionId* session, Event event) {
  auto& g = global();
  switch (event) {
    case Event::Recompute:
      g.recomputes++;
      break;
    case Event::Prefetch:
      g.prefetches++;
      break;
    case Event::Consume:
      g.consumed++;
      break;
    case Event::Reuse:
      g.reused++;
      break;
    case Event::Clear:
      g.cleared++;
      break;
  }
  if (session == nullptr) return;
  std::lock_guard<std::mutex> lock(registry_mutex());
  bump(registry()[*session].counters, event);
}

}  // namespace detail

RecomputeSession::RecomputeSession(SessionId id, SessionOptions options)
    : id_(id), options_(options) {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry()[id];  // opens the session
  }
  guard_stack().push_back({id, options});
}

RecomputeSession::~RecomputeSession() {
  auto& stack = guard_stack();
  TORCH_INTERNAL_ASSERT(!stack.empty() && stack.back().id == id_,
                        "RecomputeSession guards must close in reverse order of opening");
  stack.pop_back();
}

size_t clear_session(SessionId id) {
  std::unordered_map<uint64_t, detail::RecomputedPtr> dropped;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(id);
    if (it == registry().end()) return 0;
    dropped = std::move(it->second.cache);
    registry().erase(it);
  }
  global().cleared += static_cast<int64_t>(dropped.size());
  return dropped.size();  // the recomputed graphs die here, outside the lock
}

size_t clear_all_sessions() {
  std::unordered_map<SessionId, SessionRecord> dropped;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    dropped.swap(registry());
  }
  size_t n = 0;
  for (auto& [id, record] : dropped)
    n += record.cache.size();
  global().cleared += static_cast<int64_t>(n);
  return n;
}

SessionStats session_stats(SessionId id) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  SessionStats stats;
  auto it = registry().find(id);
  if (it == registry().end()) return stats;
  stats.exists = true;
  stats.cached_blocks = it->second.cache.size();
  stats.counters = it->second.counters;
  return stats;
}

size_t num_sessions() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  return registry().size();
}

RecomputeCounters counters() {
  auto& g = global();
  RecomputeCounters c;
  c.recomputes = g.recomputes;
  c.prefetches = g.prefetches;
  c.consumed = g.consumed;
  c.reused = g.reused;
  c.cleared = g.cleared;
  return c;
}

void reset_counters() {
  auto& g = global();
  g.recomputes = 0;
  g.prefetches = 0;
  g.consumed = 0;
  g.reused = 0;
  g.cleared = 0;
}

}  // namespace hp::recompute
