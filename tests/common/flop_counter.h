// Test helper: counts the multiply-add FLOPs of the matrix products (mm,
// addmm, bmm) that run on this thread while a FlopCounter is alive, through
// at::RecordFunction callbacks.
#pragma once

#include <ATen/record_function.h>

#include <cstdint>
#include <memory>
#include <string>

namespace hp::testing {

class FlopCounter {
 public:
  FlopCounter() {
    flops() = 0;
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&FlopCounter::on_start).needsInputs(true));
  }
  ~FlopCounter() { at::removeCallback(handle_); }
  FlopCounter(const FlopCounter&) = delete;
  FlopCounter& operator=(const FlopCounter&) = delete;
  /// FLOPs counted on this thread since the newest counter was made.
  static int64_t& flops() {
    static thread_local int64_t count = 0;
    return count;
  }

 private:
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    std::string name = fn.name();
    auto in = fn.inputs();
    auto dims = [&](size_t i) { return in[i].toTensor().sizes(); };
    if (name == "aten::mm") {
      flops() += 2 * dims(0)[0] * dims(0)[1] * dims(1)[1];
    } else if (name == "aten::addmm") {
      flops() += 2 * dims(1)[0] * dims(1)[1] * dims(2)[1];
    } else if (name == "aten::bmm") {
      flops() += 2 * dims(0)[0] * dims(0)[1] * dims(0)[2] * dims(1)[2];
    }
    return nullptr;
  }
  at::CallbackHandle handle_;
};

}  // namespace hp::testing
