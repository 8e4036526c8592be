// What both ways of making a Gloo group share (NOTE [Making a Gloo group]):
// a c10d::ProcessGroup that carries a Gloo backend for CPU tensors.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "hp/distributed/comm_internal.h"

namespace hp::distributed::detail {

c10::intrusive_ptr<c10d::ProcessGroup> wrap_gloo_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
    c10::intrusive_ptr<c10d::Backend> backend) {
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world_size);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  return pg;
}

// NOTE [A Gloo group's connect, agreed]
// Gloo's connectFullMesh (torch 2.11's) now and then fails on one member
// with "Connection closed by peer" while the other members finish the same
// group: about 1 run in 25 of DistSharedMemory.ChoosingThePointToPoint-
// AgreesOnEveryRank with two busy loops beside it, each time a subgroup made
// right after its parent, the port it names outside the kernel's ephemeral
// range (so no listener of Gloo's). The failed member cannot simply try
// again: its peers hold a group they believe whole. So every member writes
// whether its connect succeeded under the group's store, and reads all the
// others' (a barrier through the store); where a member's connect was
// closed or reset by its peer, all drop their group and make it again under
// a new prefix, at most three times. Any other failure (a member that never
// came, a timeout) ends every member at once, naming the member and its
// error, as it did before: nothing waits a second timeout for a member that
// reported. HP_FAULT_GLOO_CONNECT (below) fails a connect so, for tests.
namespace {

// HP_FAULT_GLOO_CONNECT=MEMBER:TRY,...: the connect of that member of a
// group, at that try (0-based), fails as Gloo's does (closed by its peer),
// for the tests of the agreement below.
bool injected_close(int member, int attempt) {
  const char* env = std::getenv("HP_FAULT_GLOO_CONNECT");
  if (env == nullptr) return false;
  const std::string want = std::to_string(member) + ":" + std::to_string(attempt);
  std::string list = std::string(",") + env + ",";
  return list.find("," + want + ",") != std::string::npos;
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> make_agreed_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
    const GlooEndpoint& endpoint, std::chrono::milliseconds timeout) {
  if (world_size == 1) return make_gloo_group(store, rank, world_size, endpoint, timeout);
  constexpr int kTries = 3;
  auto transient = [](const std::string& e) {
    return e.find("closed by peer") != std::string::npos ||
           e.find("reset by peer") != std::string::npos;
  };
  for (int attempt = 0;; ++attempt) {
    c10::intrusive_ptr<c10d::Store> attempt_store = store;
    if (attempt > 0)
      attempt_store =
          c10::make_intrusive<c10d::PrefixStore>("connect-again/" + std::to_string(attempt), store);
    c10::intrusive_ptr<c10d::ProcessGroup> pg;
    std::string error;
    try {
      pg = make_gloo_group(attempt_store, rank, world_size, endpoint, timeout);
      if (injected_close(rank, attempt)) {
        pg.reset();
        error = "Connection closed by peer (injected by HP_FAULT_GLOO_CONNECT)";
      }
    } catch (const std::exception& e) {
      error = e.what();
      if (error.empty()) error = "unknown error";
    }
    const std::string key = "connected/" + std::to_string(attempt) + "/";
    const std::string mine = error.empty() ? "ok" : error;
    store->set(key + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
    // A failure no new try can cure: the others learn of it from the store.
    if (!error.empty() && !transient(error)) throw std::runtime_error(error);
    std::vector<std::string> keys;
    for (int r = 0; r < world_size; ++r)
      keys.push_back(key + std::to_string(r));
    store->wait(keys, timeout);
    // The failure that decides: one no new try can cure, else the first.
    int failed = -1;
    std::string why;
    for (int r = 0; r < world_size; ++r) {
      const auto v = store->get(keys[r]);
      const std::string text(v.begin(), v.end());
      if (text != "ok" && (failed < 0 || (transient(why) && !transient(text))))
        failed = r, why = text;
    }
    if (failed < 0) return pg;
    pg.reset();
    if (transient(why) && attempt + 1 < kTries && rank == 0)
      std::fprintf(stderr,
                   "hp: member %d's connect of a Gloo group of %d was closed by its peer; every "
                   "member makes the group again (try %d of %d)\n",
                   failed, world_size, attempt + 2, kTries);
    if (!transient(why) || attempt + 1 == kTries)
      throw std::runtime_error(
          failed == rank
              ? error
              : "member " + std::to_string(failed) + " of the group could not connect" +
                    (attempt > 0 ? " (try " + std::to_string(attempt + 1) + ")" : "") + ": " + why);
  }
}

}  // namespace hp::distributed::detail
