// The tracking CPU allocator: forwards to the allocator it replaced and keeps
// a running byte count in the DataPtr's context, so frees are counted exactly.
#include "hp/core/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <malloc.h>

#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

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

// NOTE [The step cache]
// Within a StepCacheScope, blocks of the tracking allocator come from a pool
// of blocks that earlier tensors of such scopes freed, and go back to it when
// their tensors die (on any thread, in a scope or not). A pipeline step of a
// small model allocates and frees thousands of small tensors, each through
// glibc's posix_memalign (which cuts an aligned block out of a larger chunk
// and frees the rest back into its bins) and free, and the same sizes come
// back every microbatch: measured on 1F1B's last stage (d_model 32, one
// microbatch of 16 tokens), glibc's malloc and free were 10.7 % of the rank's
// CPU, a quarter of it tensor data. With the pool the busiest rank's CPU per
// step fell about 5 % against PyTorch's in the same processes
// (docs/benchmarks.md, "Earlier measurements that changed the code").
// The header's second word holds the block's size class (0: not the pool's).
// Classes: 64-byte steps up to 4 KiB, then eight per power of two (at most
// 12.5 % unused). Blocks over kLargest are never pooled, and the pool keeps
// at most kPoolLimit bytes of free blocks: the rest go back to malloc. The
// profiler's CPU memory events (profile_memory) see a pooled block once,
// when malloc first gave it.
constexpr size_t kLargest = size_t(64) << 20;
constexpr size_t kPoolLimit = size_t(1) << 30;
constexpr int kClasses = 64 + 14 * 8 + 1;  // index 0 unused; up to kLargest
thread_local int t_cache_depth = 0;

// The size class of n bytes (0 < n <= kLargest): its index and bytes.
std::pair<int, size_t> size_class(size_t n) {
  if (n <= 4096) {
    const size_t i = (n + 63) >> 6;
    return {static_cast<int>(i), i << 6};
  }
  const size_t m = n - 1;
  const int e = 63 - __builtin_clzll(static_cast<unsigned long long>(m));  // 2^e <= m < 2^(e+1)
  const size_t k = m >> (e - 3);                                           // 8..15
  return {64 + (e - 12) * 8 + static_cast<int>(k - 8) + 1, (k + 1) << (e - 3)};
}

struct Pool {
  std::mutex mutex;
  std::array<std::vector<char*>, kClasses> free;  // by class index
  size_t free_bytes = 0;
};
Pool& pool() {
  static auto* p = new Pool();  // outlives static destruction: tensors may die after it
  return *p;
}

void delete_with_header(void* data) {
  if (!data) return;
  char* block = static_cast<char*>(data) - kHeader;
  int64_t words[2];
  std::memcpy(words, block, sizeof words);
  g_current.fetch_sub(words[0]);
  if (words[1] != 0) {
    const auto [index, bytes] = size_class(static_cast<size_t>(words[1]));
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mutex);
    if (p.free_bytes + bytes <= kPoolLimit) {
      p.free[index].push_back(block);
      p.free_bytes += bytes;
      return;
    }
  }
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
      size_t cls = 0;  // the pooled block's bytes, 0: not pooled
      char* block = nullptr;
      if (t_cache_depth > 0 && n <= kLargest) {
        int index;
        std::tie(index, cls) = size_class(n);
        Pool& pl = pool();
        std::lock_guard<std::mutex> lock(pl.mutex);
        auto& blocks = pl.free[index];
        if (!blocks.empty()) {
          block = blocks.back();
          blocks.pop_back();
          pl.free_bytes -= cls;
        }
      }
      if (!block) {
        c10::DataPtr p = inner_->allocate((cls ? cls : n) + kHeader);
        block = static_cast<char*>(p.get());
        if (!block) return p;
        p.release_context();  // freed by delete_with_header through the raw deleter
      }
      const int64_t words[2] = {static_cast<int64_t>(n), static_cast<int64_t>(cls)};
      std::memcpy(block, words, sizeof words);
      add_bytes(words[0]);
      void* data = block + kHeader;
      return {data, data, &delete_with_header, c10::Device(c10::DeviceType::CPU)};
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

bool step_cache_active() {
  return t_cache_depth > 0;
}

StepCacheScope::StepCacheScope() {
  install_memory_tracker();
  ++t_cache_depth;
}
StepCacheScope::~StepCacheScope() {
  --t_cache_depth;
}

int64_t step_cache_free_bytes() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  return static_cast<int64_t>(p.free_bytes);
}

void empty_step_cache() {
  std::array<std::vector<char*>, kClasses> blocks;
  {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mutex);
    blocks.swap(p.free);
    p.free_bytes = 0;
  }
  for (auto& list : blocks)
    for (char* b : list)
      g_inner_raw_deleter(b);
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
