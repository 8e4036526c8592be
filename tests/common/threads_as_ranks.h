// Test helper: runs `world` ranks as threads of this process, each with its
// own Comm over real Gloo (a FileStore rendezvous in a fresh temporary file),
// and rethrows the first rank's error after all joined.
//
// NOTE [SIGPIPE among ranks as threads]
// A rank thread that ends (a failed step's test) closes its Gloo sockets
// while a peer thread, or a Gloo thread it started, may still write to
// them; the write raises SIGPIPE, which ends the whole test process (seen
// once in a full run under load: PipelineStepHooks, "SIGPIPE"). Separate
// processes would each lose only the writer. So each rank thread blocks
// SIGPIPE before it makes its Comm (the threads Gloo starts inherit the
// mask): such a write fails with EPIPE instead, as an error of that rank.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hp/distributed/comm.h"

namespace hp::testing {

inline void run_ranks_as_threads(
    int world, const std::function<void(int, std::shared_ptr<distributed::Comm>)>& body,
    std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  static int counter = 0;
  const auto store =
      std::filesystem::temp_directory_path() /
      ("hp-test-store-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  std::filesystem::remove_all(store);
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      sigset_t pipe;  // NOTE [SIGPIPE among ranks as threads]
      sigemptyset(&pipe);
      sigaddset(&pipe, SIGPIPE);
      pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
      try {
        distributed::CommOptions opts;
        opts.timeout = timeout;
        body(r, distributed::Comm::from_file_store(store.string(), r, world, opts));
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads)
    t.join();
  std::filesystem::remove_all(store);
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace hp::testing
