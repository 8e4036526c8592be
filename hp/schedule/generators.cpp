// hp/schedule/generators.cpp: the hand-made schedules (naive, GPipe, 1F1B,
// interleaved, ZB-H1/H2, ZB-V, DualPipe, DualPipeV) and the name dispatch.
#include "hp/schedule/generators.h"

#include <algorithm>
#include <deque>
#include <stdexcept>
#include <utility>

#include "hp/schedule/fuse.h"
#include "hp/schedule/search/heuristics.h"
#include "hp/schedule/search/search.h"
#include "hp/schedule/vshape.h"

namespace hp::schedule {

namespace {

[[noreturn]] void unmet(const std::string& name, const std::string& what) {
  throw std::invalid_argument("schedule '" + name + "': " + what);
}

void check_basic(const std::string& name, int p, int m) {
  if (p < 1) unmet(name, "needs at least 1 rank (got p=" + std::to_string(p) + ")");
  if (m < 1) unmet(name, "needs at least 1 microbatch (got m=" + std::to_string(m) + ")");
}

Action A(Op op, int st, int mb) {
  return Action::make(op, st, mb);
}

Schedule naive(int p, int m) {
  Schedule s = make_loop_layout(p, p, m);
  s.name = "naive";
  for (int r = 0; r < p; ++r)
    for (int mb = 0; mb < m; ++mb) {
      s.actions[r].push_back(A(Op::F, r, mb));
      s.actions[r].push_back(A(Op::B, r, mb));
    }
  return s;
}

Schedule gpipe(int p, int m) {
  Schedule s = make_loop_layout(p, p, m);
  s.name = "gpipe";
  for (int r = 0; r < p; ++r) {
    for (int mb = 0; mb < m; ++mb)
      s.actions[r].push_back(A(Op::F, r, mb));
    for (int mb = 0; mb < m; ++mb)
      s.actions[r].push_back(A(Op::B, r, mb));
  }
  return s;
}

Schedule one_f_one_b(int p, int m) {
  Schedule s = make_loop_layout(p, p, m);
  s.name = "1f1b";
  for (int r = 0; r < p; ++r) {
    auto& out = s.actions[r];
    int warm = std::min(p - 1 - r, m);
    for (int i = 0; i < warm; ++i)
      out.push_back(A(Op::F, r, i));
    for (int i = 0; i < m - warm; ++i) {
      out.push_back(A(Op::F, r, warm + i));
      out.push_back(A(Op::B, r, i));
    }
    for (int i = m - warm; i < m; ++i)
      out.push_back(A(Op::B, r, i));
  }
  return s;
}

// Megatron's depth-first interleaved order over v chunks per rank: the k-th
// forward of rank r runs chunk (k/p)%v on microbatch (k/(pv))p + k%p, the
// k-th backward the same with the chunks reversed. Rank r warms up with
// warm_per_rank * (p-1-r) + (v-1)p forwards, then alternates one forward with
// one backward. With `split` each backward is an I, rank r's W trails its I
// by r I's, and the W's left over end the list.
Schedule depth_first(const std::string& name, int p, int m, int v, int warm_per_rank, bool split) {
  if (v < 1) unmet(name, "needs chunks v >= 1 (got v=" + std::to_string(v) + ")");
  if (m % p != 0)
    unmet(name, "needs microbatches divisible by ranks (m % p == 0); got m=" + std::to_string(m) +
                    ", p=" + std::to_string(p) + "; use m=" + std::to_string((m / p + 1) * p));
  Schedule s = make_loop_layout(p, p * v, m);
  s.name = name;
  const int total = m * v;
  auto act = [&](Op op, int r, int k) {
    int group = (k / p) % v, mb = (k / (p * v)) * p + k % p;
    int chunk = op == Op::F ? group : v - 1 - group;
    return A(op, chunk * p + r, mb);
  };
  for (int r = 0; r < p; ++r) {
    auto& out = s.actions[r];
    const int warm = std::min(warm_per_rank * (p - r - 1) + (v - 1) * p, total);
    int next_w = 0;  // the W of the next_w-th I is the next one due
    auto backward = [&](int k) {
      out.push_back(act(split ? Op::I : Op::B, r, k));
      if (split && k - next_w >= r) out.push_back(act(Op::W, r, next_w++));
    };
    for (int k = 0; k < warm; ++k)
      out.push_back(act(Op::F, r, k));
    for (int i = 0; i < total - warm; ++i) {
      out.push_back(act(Op::F, r, warm + i));
      backward(i);
    }
    for (int k = total - warm; k < total; ++k)
      backward(k);
    while (split && next_w < total)
      out.push_back(act(Op::W, r, next_w++));
  }
  return s;
}

// Megatron's interleaved 1F1B: two forwards of warmup per rank below, since
// its ranks exchange a forward and a backward in one blocking call.
Schedule interleaved(int p, int m, int v) {
  return depth_first("interleaved-1f1b", p, m, v, 2, false);
}

// Interleaved zero bubble (PyTorch's ScheduleInterleavedZeroBubble): the same
// order with every B split into I and W, one forward of warmup per rank below
// (sends are asynchronous), W deferred into the bubbles.
Schedule interleaved_zb(int p, int m, int v) {
  return depth_first("interleaved-zb", p, m, v, 1, true);
}

// Breadth-first (looped BFS): each rank runs all microbatches through one
// chunk before the next; backwards chunk by chunk in reverse.
Schedule interleaved_bfs(int p, int m, int v) {
  const std::string name = "interleaved-bfs";
  if (v < 1) unmet(name, "needs chunks v >= 1 (got v=" + std::to_string(v) + ")");
  Schedule s = make_loop_layout(p, p * v, m);
  s.name = name;
  for (int r = 0; r < p; ++r) {
    for (int c = 0; c < v; ++c)
      for (int mb = 0; mb < m; ++mb)
        s.actions[r].push_back(A(Op::F, c * p + r, mb));
    for (int c = v - 1; c >= 0; --c)
      for (int mb = 0; mb < m; ++mb)
        s.actions[r].push_back(A(Op::B, c * p + r, mb));
  }
  return s;
}

// Unit costs (F = I = W = 1) fix the structure of the hand-made ZB schedules
// independently of the cost model they are later simulated under.
CostModel unit_costs() {
  CostModel c;
  c.f = c.b = c.w = 1.0;
  c.comm = 0.0;
  c.mem_b = 1.0;
  c.mem_w = 0.5;
  return c;
}

// ZB-H1: 1F1B's warmup (p - r forwards before the first I on rank r), W
// deferred into the bubbles, never more than p microbatches in flight (F
// done, W not yet): 1F1B's peak memory.
Schedule zb_h1(int p, int m) {
  HeuristicParams hp;
  for (int r = 0; r < p; ++r) {
    hp.warmup.push_back(p - r);
    hp.max_inflight.push_back(p);
  }
  Schedule s = greedy_zero_bubble(p, m, unit_costs(), hp);
  s.name = "zb-h1";
  return s;
}

// ZB-H2: about twice the warmup forwards (2(p-r)-1 on rank r), W fills the
// rest; zero bubble when F = I = W, at most 2p microbatches in flight.
Schedule zb_h2(int p, int m) {
  HeuristicParams hp;
  for (int r = 0; r < p; ++r) {
    hp.warmup.push_back(2 * (p - r) - 1);
    hp.max_inflight.push_back(2 * p);
  }
  Schedule s = greedy_zero_bubble(p, m, unit_costs(), hp);
  s.name = "zb-h2";
  return s;
}

}  // namespace

// ZB-V: V placement (rank r holds stages r and 2p-1-r); warmup on the down
// leg, then alternating F I W on both legs, W deferred in the cooldown.
Schedule zbv(int p, int m) {
  check_basic("zbv", p, m);
  Schedule s = make_v_layout(p, m);
  s.name = "zbv";
  const int n = std::max(2 * p - 1, m);  // generate at least 2p-1, drop the extra ones
  for (int r = 0; r < p; ++r) {
    const int s0 = r, s1 = 2 * p - 1 - r;
    // Only microbatches below m are kept, and the loop stops once nothing
    // more would be (at p = 4096 the 2p - 1 took 200 million actions for m = 1).
    struct Kept {
      std::vector<Action>* out;
      int m;
      void push_back(const Action& a) {
        if (a.microbatch < m) out->push_back(a);
      }
    } ops{&s.actions[r], m};
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    for (int i = 0; i < 2 * (p - r) - 1; ++i)
      ops.push_back(A(Op::F, s0, f0++));
    for (int i = 0; i < r; ++i) {
      ops.push_back(A(Op::F, s1, f1++));
      ops.push_back(A(Op::F, s0, f0++));
    }
    for (int i = 0; i < p - r; ++i) {
      ops.push_back(A(Op::F, s1, f1++));
      ops.push_back(A(Op::I, s1, b1));
      ops.push_back(A(Op::W, s1, b1++));
    }
    bool rest_unkept = false;  // every counter at m: all that follows is dropped
    while (f1 < f0 || f0 < n) {
      if (f0 >= m && f1 >= m && b0 >= m && b1 >= m) {
        rest_unkept = true;
        break;
      }
      if (f0 < n) ops.push_back(A(Op::F, s0, f0++));
      ops.push_back(A(Op::I, s0, b0));
      ops.push_back(A(Op::W, s0, b0++));
      ops.push_back(A(Op::F, s1, f1++));
      ops.push_back(A(Op::I, s1, b1));
      ops.push_back(A(Op::W, s1, b1++));
    }
    if (rest_unkept) continue;
    int w0 = b0, w1 = b1;
    for (int i = 0; i < r; ++i) {
      ops.push_back(A(Op::I, s0, b0++));
      ops.push_back(A(Op::I, s1, b1++));
    }
    for (int i = 0; i < p - r; ++i) {
      ops.push_back(A(Op::I, s0, b0++));
      ops.push_back(A(Op::W, s0, w0++));
    }
    while (w1 < b1)
      ops.push_back(A(Op::W, s1, w1++));
    while (w0 < b0)
      ops.push_back(A(Op::W, s0, w0++));
  }
  return s;
}

namespace {

// DualPipe's eight steps, shared by DualPipe (two directions) and DualPipeV
// (one direction over a V). A rank owns two "phases" (its two stages); W of a
// zero-bubble backward goes to a FIFO drained by weight().
struct DualEmitter {
  DualEmitter(std::vector<Action>* o, int s0, int s1, int base0, int base1)
      : out(o), stage{s0, s1}, mb_base{base0, base1} {}
  std::vector<Action>* out;
  int stage[2];
  int mb_base[2];
  int next_f[2] = {0, 0};
  int next_b[2] = {0, 0};
  std::deque<std::pair<int, int>> w_queue;  // (stage, mb)

  void forward(int ph) { out->push_back(A(Op::F, stage[ph], mb_base[ph] + next_f[ph]++)); }
  void backward(int ph, bool zb) {
    int mb = mb_base[ph] + next_b[ph]++;
    if (zb) {
      out->push_back(A(Op::I, stage[ph], mb));
      w_queue.emplace_back(stage[ph], mb);
    } else {
      out->push_back(A(Op::B, stage[ph], mb));
    }
  }
  void weight() {
    if (w_queue.empty()) throw std::logic_error("dualpipe: weight() with an empty W queue");
    out->push_back(A(Op::W, w_queue.front().first, w_queue.front().second));
    w_queue.pop_front();
  }
  void forward_backward(int fph, int bph) {
    int fmb = mb_base[fph] + next_f[fph]++;
    int bmb = mb_base[bph] + next_b[bph]++;
    out->push_back(Action::overlap(stage[fph], fmb, stage[bph], bmb));
  }
};

// `half` ranks per direction-half and `chunks` microbatches per phase follow
// DeepSeek's dualpipe.py / dualpipev.py step counts.
void dual_steps(DualEmitter& e, int num_half, int half_rank, int half_chunks, int total_ranks,
                bool no_overlap_first) {
  for (int i = 0; i < (num_half - half_rank - 1) * 2; ++i)
    e.forward(0);                            // 1: nF0
  for (int i = 0; i < half_rank + 1; ++i) {  // 2: nF0F1
    e.forward(0);
    e.forward(1);
  }
  for (int i = 0; i < num_half - half_rank - 1; ++i) {  // 3: nB1W1F1
    e.backward(1, true);
    e.weight();
    e.forward(1);
  }
  int step4 = half_chunks - total_ranks + half_rank + 1;  // 4: nF0B1F1B0
  for (int i = 0; i < step4; ++i) {
    if (i == 0 && no_overlap_first) {
      e.forward(0);
      e.backward(1, false);
    } else {
      e.forward_backward(0, 1);
    }
    e.forward_backward(1, 0);
  }
  for (int i = 0; i < num_half - half_rank - 1; ++i) {  // 5: nB1F1B0
    e.backward(1, false);
    e.forward_backward(1, 0);
  }
  int step6 = half_rank + 1;  // 6: nB1B0, second half zero-bubble
  bool zb = false;
  for (int i = 0; i < step6; ++i) {
    if (i == step6 / 2 && half_rank % 2 == 1) zb = true;
    e.backward(1, zb);
    if (i == step6 / 2 && half_rank % 2 == 0) zb = true;
    e.backward(0, zb);
  }
  for (int i = 0; i < num_half - half_rank - 1; ++i) {  // 7: nWB0
    e.weight();
    e.backward(0, true);
  }
  for (int i = 0; i < half_rank + 1; ++i)
    e.weight();  // 8: nW
}

Schedule dualpipev(int p, int m) {
  const std::string name = "dualpipev";
  if (m < 2 * p)
    unmet(name, "needs microbatches >= 2 * ranks (m >= 2p); got m=" + std::to_string(m) +
                    ", p=" + std::to_string(p) + "; use m >= " + std::to_string(2 * p));
  Schedule s = make_v_layout(p, m);
  s.name = name;
  for (int r = 0; r < p; ++r) {
    DualEmitter e(&s.actions[r], r, 2 * p - 1 - r, 0, 0);
    dual_steps(e, p, r, m, 2 * p, r == p - 1);
  }
  return s;
}

Schedule dualpipe(int p, int m) {
  const std::string name = "dualpipe";
  if (p < 2 || p % 2 != 0)
    unmet(name, "needs an even number of ranks (p % 2 == 0, p >= 2); got p=" + std::to_string(p) +
                    "; use p=" + std::to_string(p < 2 ? 2 : p + 1));
  if (m % 2 != 0 || m < 2 * p)
    unmet(name,
          "needs an even number of microbatches, at least 2 * ranks (m % 2 == 0, m >= 2p); "
          "got m=" +
              std::to_string(m) + ", p=" + std::to_string(p) +
              "; use m=" + std::to_string(std::max(2 * p, m + (m % 2))));
  Schedule s = make_v_layout(p, m);  // rank r holds stages r and 2p-1-r
  s.name = name;
  s.num_chunks = p;
  for (int st = 0; st < 2 * p; ++st)
    s.stage_chunk[st] = st < p ? st : st - p;
  std::vector<int> down(p), up(p);
  for (int i = 0; i < p; ++i) {
    down[i] = i;
    up[i] = p + i;
  }
  s.routes = {down, up};
  for (int mb = 0; mb < m; ++mb)
    s.microbatch_route[mb] = mb < m / 2 ? 0 : 1;
  s.index_routes();
  const int half = p / 2;
  for (int r = 0; r < p; ++r) {
    const bool second = r >= half;
    const int half_rank = std::min(r, p - 1 - r);
    const int down_stage = r, up_stage = 2 * p - 1 - r;
    DualEmitter e(&s.actions[r], second ? up_stage : down_stage, second ? down_stage : up_stage,
                  second ? m / 2 : 0, second ? 0 : m / 2);
    const bool middle = (r == half - 1 || r == half);
    dual_steps(e, half, half_rank, m / 2, p, middle);
  }
  return s;
}

}  // namespace

const std::vector<std::string>& names() {
  static const std::vector<std::string> k = {"naive",
                                             "gpipe",
                                             "1f1b",
                                             "interleaved-1f1b",
                                             "interleaved-1f1b-fb",
                                             "interleaved-bfs",
                                             "interleaved-zb",
                                             "zb-h1",
                                             "zb-h2",
                                             "zbv",
                                             "zbv-fb",
                                             "dualpipe",
                                             "dualpipev",
                                             "zb-auto",
                                             "zbv-auto",
                                             "v-min",
                                             "v-half",
                                             "v-zb",
                                             "auto"};
  return k;
}

std::string describe(const std::string& name) {
  if (name == "naive") return "one microbatch at a time through all stages";
  if (name == "gpipe" || name == "afab") return "all forwards, then all backwards (AFAB)";
  if (name == "1f1b") return "warmup forwards, then one forward one backward (Megatron)";
  if (name == "interleaved-1f1b") return "v chunks per rank, depth-first 1F1B (Megatron)";
  if (name == "interleaved-1f1b-fb")
    return "interleaved-1f1b with steady-state F and B paired as overlapped FB";
  if (name == "interleaved-bfs") return "v chunks per rank, breadth-first (looped BFS)";
  if (name == "interleaved-zb")
    return "v chunks per rank, depth-first with W split off and deferred (PyTorch)";
  if (name == "zb-h1") return "1F1B with W split off into the bubbles, 1F1B memory";
  if (name == "zb-h2") return "zero bubble when F = B = W, about 2x 1F1B memory";
  if (name == "zbv") return "the Zero Bubble paper's ZB-V: V placement, zero bubble at F = B = W";
  if (name == "zbv-fb") return "ZB-V with steady-state F and I+W paired as overlapped FB";
  if (name == "dualpipe") return "two directions over mirrored stage copies (DeepSeek)";
  if (name == "dualpipev") return "DualPipe folded onto a V (one model copy)";
  if (name == "zb-auto")
    return "the Zero Bubble paper's search plus local search, under a memory limit";
  if (name == "zbv-auto")
    return "ZB-V searched under the costs (transfers covered), 1F1B memory by default";
  if (name == "v-min")
    return "V-shape block, about 1/3 of 1F1B's memory (controllable-memory paper)";
  if (name == "v-half")
    return "V-shape block, about 1/2 of 1F1B's memory (controllable-memory paper)";
  if (name == "v-zb")
    return "V-shape block, zero bubble at 1F1B's memory (controllable-memory paper)";
  if (name == "auto")
    return "the best schedule found under --mem-limit (default 1x), loop or V placement";
  return "";
}

namespace {
// A search's options from build()'s: zb-auto's and zbv-auto's work bound split
// between the candidates and the local search; auto's local search gets what
// the candidates left (NOTE [Budget of the memory search]).
SearchOptions search_options(Preset preset, const BuildOptions& o) {
  SearchOptions so;
  if (o.search_work > 0) {
    so.candidate_work = preset == Preset::Auto ? o.search_work : o.search_work / 2;
    if (preset != Preset::Auto) so.refine_work = o.search_work - so.candidate_work;
  }
  so.cut_note = o.search_note;
  return so;
}
}  // namespace

Schedule build(const std::string& name, int ranks, int microbatches, const BuildOptions& o) {
  check_basic(name, ranks, microbatches);
  // NOTE [One size rule]: the interleaved ones take o.chunks stages per rank,
  // the V and DualPipe ones two, the rest one.
  const bool interleaved_kind = name.rfind("interleaved", 0) == 0;
  const bool two = name == "zbv" || name == "zbv-fb" || name == "zbv-auto" || name == "dualpipe" ||
                   name == "dualpipev" || name.rfind("v-", 0) == 0 || name == "auto";
  check_schedule_size("schedule '" + name + "'", ranks, microbatches,
                      interleaved_kind ? std::max(1, o.chunks)
                      : two            ? 2
                                       : 1);
  Schedule s;
  if (name == "naive") {
    s = naive(ranks, microbatches);
  } else if (name == "gpipe" || name == "afab") {
    s = gpipe(ranks, microbatches);
  } else if (name == "1f1b") {
    s = one_f_one_b(ranks, microbatches);
  } else if (name == "interleaved-1f1b" || name == "interleaved") {
    s = interleaved(ranks, microbatches, o.chunks);
  } else if (name == "interleaved-1f1b-fb") {
    // NOTE [Pairs in interleaved 1F1B and ZB-V] in fuse.cpp
    s = fuse_pairs(interleaved(ranks, microbatches, o.chunks), o.costs);
  } else if (name == "interleaved-bfs") {
    s = interleaved_bfs(ranks, microbatches, o.chunks);
  } else if (name == "interleaved-zb") {
    s = interleaved_zb(ranks, microbatches, o.chunks);
  } else if (name == "zb-h1") {
    s = zb_h1(ranks, microbatches);
  } else if (name == "zb-h2") {
    s = zb_h2(ranks, microbatches);
  } else if (name == "zbv") {
    s = zbv(ranks, microbatches);
  } else if (name == "zbv-fb") {
    s = fuse_pairs(zbv(ranks, microbatches), o.costs);
  } else if (name == "dualpipe") {
    s = dualpipe(ranks, microbatches);
  } else if (name == "dualpipev") {
    s = dualpipev(ranks, microbatches);
  } else if (name == "zb-auto" || name == "zbv-auto" || name == "auto") {
    const Preset preset = name == "zb-auto"    ? Preset::ZbAuto
                          : name == "zbv-auto" ? Preset::ZbvAuto
                                               : Preset::Auto;
    s = search(preset, ranks, microbatches, o.costs, o.mem_limit, search_options(preset, o));
  } else if (name == "v-min") {
    s = v_block_schedule(VBlock::Min, ranks, microbatches);
  } else if (name == "v-half") {
    s = v_block_schedule(VBlock::Half, ranks, microbatches);
  } else if (name == "v-zb") {
    s = v_block_schedule(VBlock::ZB, ranks, microbatches);
  } else {
    std::string known;
    for (const auto& n : names())
      known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown schedule '" + name + "'; known: " + known);
  }
  s.check_layout();
  return s;
}

}  // namespace hp::schedule
