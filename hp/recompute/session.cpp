// The recompute session registry: sessions keyed by id behind one mutex, the
// open guards carried in LibTorch's thread-local state (so that they reach
// the engine's device threads), explicit clear and the counters.
#include "hp/recompute/session.h"

#include <c10/util/Exception.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

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
// graph at once. Which session a backward belongs to travels with the
// thread's state (NOTE [Sessions reach the engine's threads]). Recomputed
// blocks are destroyed outside the lock.

// NOTE [Sessions reach the engine's threads]
// The session must be known where a backward's nodes run. LibTorch's engine
// runs the nodes of CPU tensors on the thread that called it, but those of
// CUDA (or other device) tensors on its worker thread for that device. Every
// graph task captures the caller's at::ThreadLocalState when it starts, and
// a worker installs it around each node it runs (ThreadLocalStateGuard in
// Engine::thread_main); a reentrant backward started inside a node captures
// it again. A C++ thread_local is not part of that state (a session kept in
// one was invisible on the device thread, so dx and dw recomputed every
// block twice on CUDA); c10::ThreadLocalDebugInfo is, and is meant for
// exactly this (c10/util/ThreadLocalDebugInfo.h: "propagated across the
// forward ... and backward passes"). So a guard pushes its session as debug
// info of our own kind, kSessionInfo, a value LibTorch's DebugInfoKind does
// not name (lookups compare kinds; nothing indexes by them), and
// current_session() reads it on whatever thread runs the node. One caveat of
// c10's stack: a profiler enabled outside a session guard and disabled inside
// it (DebugInfoKind::PROFILER_STATE is popped, not scoped) fails; enable and
// disable profilers on one side of a guard. Tested on the CPU by running dx
// and dw on another thread under the state captured on the caller, as the
// device threads do (RecomputeTest.SessionReachesTheThreadThatRunsTheBackward),
// and on CUDA by scripts/gpu_check.sh.
constexpr auto kSessionInfo = static_cast<c10::DebugInfoKind>(0x68);

struct SessionInfo : c10::DebugInfoBase {
  explicit SessionInfo(detail::CurrentSession c) : current(c) {}
  detail::CurrentSession current;
};

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
  auto* info = static_cast<SessionInfo*>(c10::ThreadLocalDebugInfo::get(kSessionInfo));
  return info == nullptr ? nullptr : &info->current;
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

struct RecomputeSession::Scope {
  explicit Scope(std::shared_ptr<SessionInfo> i) : info(i), guard(kSessionInfo, i) {}
  std::shared_ptr<SessionInfo> info;
  c10::DebugInfoGuard guard;  // restores the thread's previous debug info when destroyed
};

RecomputeSession::RecomputeSession(SessionId id, SessionOptions options)
    : id_(id), options_(options) {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry()[id];  // opens the session
  }
  scope_ =
      std::make_unique<Scope>(std::make_shared<SessionInfo>(detail::CurrentSession{id, options}));
}

RecomputeSession::~RecomputeSession() {
  TORCH_INTERNAL_ASSERT(c10::ThreadLocalDebugInfo::get(kSessionInfo) == scope_->info.get(),
                        "RecomputeSession guards must close on the thread that opened them, in "
                        "reverse order of opening");
  scope_.reset();
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
