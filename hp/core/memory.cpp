// The tracking CPU allocator: forwards to the allocator it replaced and keeps
// a running byte count in the DataPtr's context, so frees are counted exactly.
#include "hp/core/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <malloc.h>

#include <atomic>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "hp/core/compat.h"

namespace hp {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<bool> g_installed{false};

void add_bytes(int64_t n) {
  int64_t now = g_current.fetch_add(n) + n;
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

// NOTE [Tracking allocator contexts]
// LibTorch's raw_allocate path asserts that a DataPtr's context equals its
// data pointer, so the context cannot carry our bookkeeping. Each allocation
// is instead recorded in a map from data pointer to (original DataPtr, size);
// the deleter looks it up, counts the bytes back and drops the original,
// which frees the memory through the allocator we replaced.
struct Entry {
  c10::DataPtr inner;
  int64_t bytes;
};
std::mutex g_map_mutex;
std::unordered_map<void*, Entry>& live() {
  static auto* m = new std::unordered_map<void*, Entry>();  // outlives static destruction
  return *m;
}

void delete_tracked(void* data) {
  if (!data) return;
  Entry e;
  {
    std::lock_guard<std::mutex> lock(g_map_mutex);
    auto it = live().find(data);
    if (it == live().end()) return;
    e = std::move(it->second);
    live().erase(it);
  }
  g_current.fetch_sub(e.bytes);
  // e.inner frees the memory here, outside the lock.
}

class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) HP_ALLOCATOR_CONST override {
    c10::DataPtr p = inner_->allocate(n);
    void* data = p.get();
    c10::Device device = p.device();
    if (!data) return p;  // zero bytes: nothing to count
    {
      std::lock_guard<std::mutex> lock(g_map_mutex);
      live()[data] = Entry{std::move(p), static_cast<int64_t>(n)};
    }
    add_bytes(static_cast<int64_t>(n));
    return {data, data, &delete_tracked, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_tracked; }
  HP_ALLOCATOR_EXTRA_OVERRIDES

 private:
  c10::Allocator* inner_;
};

}  // namespace

// NOTE [glibc malloc and page faults]
// LibTorch's CPU allocator is glibc malloc. By default a block above the mmap
// threshold is mmap'ed and munmap'ed on free, so the next tensor of that size
// pays a page fault per 4 KiB on first touch. A backward allocates and frees
// many such blocks: measured here, a transformer block's backward ran 10-25 %
// slower from page faults alone, and a split backward (which keeps more alive
// at once, so reuses less) more so than a fused one. Raising the mmap
// threshold to its maximum and never trimming keeps freed blocks in the heap
// for reuse, as PyTorch users get from jemalloc or tcmalloc.
void keep_freed_memory_mapped() {
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);  // glibc's maximum on 64-bit
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
}

void install_memory_tracker() {
  static std::once_flag once;
  std::call_once(once, [] {
    static TrackingAllocator tracker(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&tracker, /*priority=*/100);
    g_installed = true;
  });
}

bool memory_tracker_installed() {
  return g_installed.load();
}
int64_t memory_allocated() {
  return g_current.load();
}
int64_t peak_memory_allocated() {
  return g_peak.load();
}
void reset_peak_memory() {
  g_peak.store(g_current.load());
}

}  // namespace hp
