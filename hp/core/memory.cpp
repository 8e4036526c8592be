// The tracking CPU allocator: forwards to the allocator it replaced and keeps
// a running byte count in the DataPtr's context, so frees are counted exactly.
#include "hp/core/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <malloc.h>

#include <atomic>
#include <cstring>
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
// data pointer, so the context cannot carry our bookkeeping. When the
// allocator we replace frees through a raw deleter (LibTorch's default CPU
// allocator does), each block is allocated kHeader bytes larger: the header
// holds the requested size, the tensor's data starts after it (kHeader keeps
// the 64-byte alignment), and our deleter reads the size back and hands the
// block's start to that raw deleter. No lock and no lookup per allocation: a
// map of live blocks, used before, cost about 3 % of a step of a small
// model's pipeline (a mutex, a hash and a node allocation per tensor). An
// allocator without a raw deleter gets that map as the fallback: each block
// is recorded with its original DataPtr, which the deleter drops.
constexpr size_t kHeader = 64;
c10::DeleterFnPtr g_inner_raw_deleter = nullptr;

void delete_with_header(void* data) {
  if (!data) return;
  char* block = static_cast<char*>(data) - kHeader;
  int64_t bytes;
  std::memcpy(&bytes, block, sizeof bytes);
  g_current.fetch_sub(bytes);
  g_inner_raw_deleter(block);
}

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

// Forwards to the allocator it replaced and counts the bytes in and out.
class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* inner)
      : inner_(inner), header_(inner->raw_deleter() != nullptr) {
    if (header_) g_inner_raw_deleter = inner->raw_deleter();
  }
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return inner_->allocate(0);  // nothing to count
    if (header_) {
      c10::DataPtr p = inner_->allocate(n + kHeader);
      char* block = static_cast<char*>(p.get());
      if (!block) return p;
      c10::Device device = p.device();
      p.release_context();  // freed by delete_with_header through the raw deleter
      const int64_t bytes = static_cast<int64_t>(n);
      std::memcpy(block, &bytes, sizeof bytes);
      add_bytes(bytes);
      void* data = block + kHeader;
      return {data, data, &delete_with_header, device};
    }
    c10::DataPtr p = inner_->allocate(n);
    void* data = p.get();
    c10::Device device = p.device();
    if (!data) return p;
    {
      std::lock_guard<std::mutex> lock(g_map_mutex);
      live()[data] = Entry{std::move(p), static_cast<int64_t>(n)};
    }
    add_bytes(static_cast<int64_t>(n));
    return {data, data, &delete_tracked, device};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return header_ ? &delete_with_header : &delete_tracked;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* inner_;
  bool header_;
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
