// The progress line rank 0 prints while training: a bar, the step, the
// loss, throughput and ETA; one updating line on a terminal, every tenth of
// the run otherwise.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

namespace hp::train {

class Progress {
 public:
  Progress(bool enabled, int first, int total) : enabled_(enabled), first_(first), total_(total) {
    tty_ = enabled && ::isatty(2);
    start_ = std::chrono::steady_clock::now();
  }
  void update(int step, double loss, double items_per_s) {
    if (!enabled_) return;
    int done = step - first_ + 1, todo = total_ - first_;
    double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    double eta = done > 0 ? elapsed / done * (todo - done) : 0;
    const int width = 24;
    int filled = todo > 0 ? width * done / todo : width;
    std::string bar(filled, '#');
    bar.resize(width, '.');
    char line[256];
    std::snprintf(line, sizeof line, "[%s] step %d/%d  loss %.4f  %.0f items/s  ETA %.0fs",
                  bar.c_str(), step + 1, total_, loss, items_per_s, eta);
    if (tty_) {
      std::fprintf(stderr, "\r%s", line);
      if (done == todo) std::fprintf(stderr, "\n");
    } else if (done == todo || done % std::max(1, todo / 10) == 0) {
      std::fprintf(stderr, "%s\n", line);
    }
    std::fflush(stderr);
  }
  /// A line of its own above the bar (printed whether or not the bar is).
  void note(const std::string& text) {
    std::fprintf(stderr, tty_ ? "\r\033[K%s\n" : "%s\n", text.c_str());
    std::fflush(stderr);
  }

 private:
  bool enabled_, tty_ = false;
  int first_, total_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace hp::train
