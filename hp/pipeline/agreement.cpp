// agree_on_the_pipeline: every rank's pipeline was made, with the same
// schedule and dtype, or every rank fails together (NOTE [Ranks agree on the
// pipeline]).
#include "hp/pipeline/agreement.h"

#include <string>
#include <vector>

namespace hp::pipeline {
namespace {

// NOTE [Ranks agree on the pipeline]
// A rank whose pipeline could not be made (a bad option, a missing stage), or
// that was made with another schedule than its peers (another microbatch
// count, another schedule file), used to fail alone or not at all, and its
// peers waited for its first message until the timeout. So a Pipeline
// gathers, when it is made, whether each rank could make its own and a
// fingerprint of its schedule and dtype, and every rank fails together,
// naming the rank that differs, before any step. The same all-gather carries
// what the Pipeline needs from every rank afterwards (how many parameter
// names it holds; over the data-parallel group, what each copy holds), so a
// Pipeline agrees once over its group and once over `dp`: the Executor it
// makes afterwards agrees on nothing (it was made by every rank, from what
// they agreed on, and its own checks are the Pipeline's checks again).
uint64_t mix(uint64_t h, int64_t v) {
  h ^= static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

std::vector<int64_t> fingerprint(const schedule::Schedule& s, torch::Dtype dtype,
                                 bool layout_carried, int64_t pairs, bool ok) {
  uint64_t h = 1469598103934665603ull;
  for (int v : s.stage_rank)
    h = mix(h, v);
  for (int v : s.stage_chunk)
    h = mix(h, v);
  for (int v : s.microbatch_route)
    h = mix(h, v);
  for (const auto& list : s.actions)
    for (const auto& a : list) {
      h = mix(h, static_cast<int64_t>(a.op));
      h = mix(mix(mix(mix(h, a.stage), a.microbatch), a.stage2), a.microbatch2);
    }
  return {ok ? 0 : 1,
          s.num_ranks,
          s.num_stages,
          s.num_microbatches,
          s.num_chunks,
          static_cast<int64_t>(dtype),
          layout_carried ? 1 : 0,
          pairs,
          static_cast<int64_t>(h & 0x7fffffffffffffffull)};
}

}  // namespace

int64_t pairs_word(bool fb_overlap, bool defer_wgrad, bool pair_first_ready, int w_parts) {
  return (fb_overlap ? 1 : 0) | (defer_wgrad ? 2 : 0) | (pair_first_ready ? 4 : 0) |
         (static_cast<int64_t>(w_parts) << 8);
}

std::vector<std::vector<int64_t>> agree_on_the_pipeline(distributed::Comm& comm,
                                                        const schedule::Schedule& schedule,
                                                        torch::Dtype dtype, bool layout_carried,
                                                        int64_t pairs, const torch::Device& device,
                                                        int rank, bool ok,
                                                        const std::vector<int64_t>& extra) {
  std::vector<int64_t> mine = fingerprint(schedule, dtype, layout_carried, pairs, ok);
  const int64_t checked = static_cast<int64_t>(mine.size());
  mine.insert(mine.end(), extra.begin(), extra.end());
  const int n = comm.world_size();
  const int64_t k = static_cast<int64_t>(mine.size());
  auto out = torch::empty({n * k}, torch::TensorOptions().dtype(torch::kLong).device(device));
  comm.all_gather(out, torch::tensor(mine, torch::kLong).to(device));
  out = out.cpu();
  const int64_t* all = out.data_ptr<int64_t>();
  static const char* kField[] = {"",      "ranks",    "stages", "microbatches", "model chunks",
                                 "dtype", "messages", "pairs"};
  auto text = [](int64_t f, int64_t v) {
    if (f == 7)  // pairs_word
      return "fb_overlap " + std::to_string(v & 1) + ", defer_wgrad " + std::to_string(v >> 1 & 1) +
             ", ready turns " + std::to_string(v >> 2 & 1) + ", W parts " + std::to_string(v >> 8);
    if (f == 6)  // NOTE [Messages that describe themselves] in frames.h
      return std::string(v ? "that carry their layout" : "of a declared layout");
    return f == 5 ? std::string(c10::toString(static_cast<torch::Dtype>(v))) : std::to_string(v);
  };
  for (int q = 0; q < n; ++q) {
    if (q == rank || mine[0] != 0) continue;  // a rank that failed throws its own error
    const int64_t* theirs = all + q * k;
    TORCH_CHECK(theirs[0] == 0, "rank ", rank, ": rank ", q,
                " could not make its pipeline (its own error says why); no rank starts");
    for (int64_t f = 1; f < checked; ++f) {
      if (theirs[f] == mine[f]) continue;
      TORCH_CHECK(f != 6, "rank ", rank, ": rank ", q, "'s pipeline has messages ",
                  text(f, theirs[f]), " where this rank's are ", text(f, mine[f]),
                  ": declare the layout (activation_shape or layout) on every rank or on none");
      TORCH_CHECK(f != 7, "rank ", rank, ": rank ", q, "'s pairs run with ", text(f, theirs[f]),
                  " where this rank's run with ", text(f, mine[f]),
                  ": the peers of a pair post alike, so every rank must be given the same "
                  "fb_overlap, defer_wgrad, pair_turns and w_parts");
      if (f + 1 < checked)
        TORCH_CHECK(false, "rank ", rank, ": rank ", q, "'s pipeline has ", kField[f], " ",
                    text(f, theirs[f]), " where this rank's has ", text(f, mine[f]),
                    ": every rank must be given the same schedule and dtype");
      TORCH_CHECK(false, "rank ", rank, ": rank ", q,
                  "'s schedule differs from this rank's (another order of actions): every rank "
                  "must be given the same schedule");
    }
  }
  std::vector<std::vector<int64_t>> extras(n);
  for (int q = 0; q < n; ++q)
    extras[q].assign(all + q * k + checked, all + (q + 1) * k);
  return extras;
}

}  // namespace hp::pipeline
