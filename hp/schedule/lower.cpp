// hp/schedule/lower.cpp: lower() inserts SEND/RECV pairs in one message order
// that every rank follows; validate() checks a schedule end to end.
#include "hp/schedule/lower.h"

#include "hp/schedule/progress.h"
#include "hp/schedule/simulate.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

namespace hp::schedule {

namespace {

// A message: what travels, between which stages, and where it sits.
struct Msg {
  bool grad = false;  // false: activation (F), true: gradient (B)
  int src_stage = 0, dst_stage = 0, mb = 0;
  int src_rank = 0, dst_rank = 0;
  size_t consumer = 0;  // index of the consuming compute action on dst_rank
  Action send() const { return Action::make(grad ? Op::SEND_B : Op::SEND_F, src_stage, mb); }
  Action recv() const { return Action::make(grad ? Op::RECV_B : Op::RECV_F, dst_stage, mb); }
};

// Halves of a compute action: (is_backward, stage, mb, op) for F, I, W, B, FB;
// a pair's in running order, so that the lead's output is sent first (NOTE
// [The half that leads] in fuse.cpp).
struct Half {
  Op op;
  int stage, mb;
};
std::vector<Half> halves(const Action& a) {
  if (a.op == Op::FB) {
    const Half f{Op::F, a.stage, a.microbatch}, b{Op::B, a.stage2, a.microbatch2};
    if (a.backward_first) return {b, f};
    return {f, b};
  }
  return {{a.op, a.stage, a.microbatch}};
}

std::string at(int rank, size_t idx, const Action& a) {
  return "rank " + std::to_string(rank) + " action " + std::to_string(idx) + " (" + to_string(a) +
         ")";
}

[[noreturn]] void bad(const std::string& msg) {
  throw std::invalid_argument("invalid schedule: " + msg);
}

// The order in which one valid execution sends the messages: every rank
// runs its compute actions in list order as far as its inputs allow (a
// message counts as arrived once sent), ranks taken in turn; each message is
// numbered when its producer runs. Any execution would do; this one is
// deterministic, so every rank that lowers the same schedule derives the
// same order. Throws if the compute-only schedule cannot run at all.
std::map<std::tuple<bool, int, int>, long> message_order(
    const Schedule& s, const std::vector<std::vector<std::vector<Msg>>>& sends) {
  const int p = s.num_ranks;
  Progress progress(s);
  std::map<std::tuple<bool, int, int>, long> order;
  std::vector<size_t> pc(p, 0);
  long counter = 0;
  bool moved = true;
  while (moved) {
    moved = false;
    for (int r = 0; r < p; ++r) {
      while (pc[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][pc[r]];
        if (!progress.ready(a)) break;
        progress.finish(a);
        for (const auto& msg : sends[r][pc[r]])
          order[{msg.grad, msg.dst_stage, msg.mb}] = counter++;
        ++pc[r];
        moved = true;
      }
    }
  }
  for (int r = 0; r < p; ++r)
    if (pc[r] < s.actions[r].size())
      throw std::invalid_argument("lower: schedule '" + s.name +
                                  "' cannot run: " + at(r, pc[r], s.actions[r][pc[r]]) +
                                  " waits forever (validate() says more)");
  return order;
}

// NOTE [Batch order]
// A rank's runs of consecutive SEND/RECV actions are its batches. When each
// rank starts its batches one after the other, and a message completes only
// once the batches holding its two ends have both started (NCCL), message v
// must complete before message w can start whenever some rank holds v in an
// earlier batch than w. The ranks wait on each other forever exactly when
// these "before" relations form a cycle. `batches[r]` lists rank r's batches
// in order, each as message indices; returns the messages of one cycle, each
// with the rank that puts it before the next (the last before the first), or
// nothing.
std::vector<std::pair<int, int>> order_cycle(
    const std::vector<std::vector<std::vector<int>>>& batches, int num_messages) {
  std::vector<std::vector<std::pair<int, int>>> succ(num_messages);  // -> (message, rank)
  for (size_t r = 0; r < batches.size(); ++r)
    for (size_t b = 1; b < batches[r].size(); ++b)
      for (int v : batches[r][b - 1])
        for (int w : batches[r][b])
          succ[v].push_back({w, int(r)});
  std::vector<int> state(num_messages, 0), parent(num_messages, -1), parent_rank(num_messages, -1);
  for (int start = 0; start < num_messages; ++start) {
    if (state[start]) continue;
    std::vector<std::pair<int, size_t>> stack{{start, 0}};
    state[start] = 1;
    while (!stack.empty()) {
      auto& [v, k] = stack.back();
      if (k == succ[v].size()) {
        state[v] = 2;
        stack.pop_back();
        continue;
      }
      auto [w, by] = succ[v][k++];
      if (state[w] == 0) {
        state[w] = 1;
        parent[w] = v;
        parent_rank[w] = by;
        stack.push_back({w, 0});
      } else if (state[w] == 1) {
        // v -> w closes a cycle w -> ... -> v -> w.
        std::vector<std::pair<int, int>> cycle{{v, by}};
        for (int x = v; x != w; x = parent[x])
          cycle.push_back({parent[x], parent_rank[x]});
        std::reverse(cycle.begin(), cycle.end());
        return cycle;
      }
    }
  }
  return {};
}

// The strongly connected components of the "before" relation of `batches`
// (NOTE [Batch order]): comp[v] for every message, and for each component
// whether it holds a cycle. Iterative Tarjan, linear in the edges.
std::pair<std::vector<int>, std::vector<char>> order_components(
    const std::vector<std::vector<std::vector<int>>>& batches, int num_messages,
    std::vector<std::vector<std::pair<int, int>>>& succ) {
  succ.assign(num_messages, {});
  for (size_t r = 0; r < batches.size(); ++r)
    for (size_t b = 1; b < batches[r].size(); ++b)
      for (int v : batches[r][b - 1])
        for (int w : batches[r][b])
          succ[v].push_back({w, int(r)});
  std::vector<int> index(num_messages, -1), low(num_messages, 0), comp(num_messages, -1);
  std::vector<char> on_stack(num_messages, 0), cyclic;
  std::vector<int> stack;
  int next_index = 0;
  for (int start = 0; start < num_messages; ++start) {
    if (index[start] >= 0) continue;
    std::vector<std::pair<int, size_t>> call{{start, 0}};
    index[start] = low[start] = next_index++;
    stack.push_back(start);
    on_stack[start] = 1;
    while (!call.empty()) {
      auto& [v, k] = call.back();
      if (k < succ[v].size()) {
        int w = succ[v][k++].first;
        if (index[w] < 0) {
          index[w] = low[w] = next_index++;
          stack.push_back(w);
          on_stack[w] = 1;
          call.push_back({w, 0});
        } else if (on_stack[w]) {
          low[v] = std::min(low[v], index[w]);
        }
        continue;
      }
      if (low[v] == index[v]) {
        const int c = int(cyclic.size());
        int size = 0, x;
        do {
          x = stack.back();
          stack.pop_back();
          on_stack[x] = 0;
          comp[x] = c;
          ++size;
        } while (x != v);
        cyclic.push_back(size > 1);
      }
      const int done = v;
      call.pop_back();
      if (!call.empty()) low[call.back().first] = std::min(low[call.back().first], low[done]);
    }
  }
  return {comp, cyclic};
}

// Names a message by its RECV: "1RECV_F1".
std::string message_name(const std::tuple<Op, int, int>& id) {
  auto [op, st, mb] = id;
  return to_string(Action::make(op == Op::F ? Op::RECV_F : Op::RECV_B, st, mb));
}

void check_batch_order(const Schedule& s) {
  std::map<std::tuple<Op, int, int>, int> node;  // message -> index
  std::vector<std::tuple<Op, int, int>> names;
  std::vector<std::vector<std::vector<int>>> batches(s.num_ranks);
  for (int r = 0; r < s.num_ranks; ++r) {
    bool open = false;
    for (const Action& a : s.actions[r]) {
      if (!is_comm(a.op)) {
        open = false;
        continue;
      }
      bool is_send = a.op == Op::SEND_F || a.op == Op::SEND_B;
      bool fwd = a.op == Op::SEND_F || a.op == Op::RECV_F;
      int consumer = !is_send ? a.stage
                     : fwd    ? s.next_stage(a.stage, a.microbatch)
                              : s.prev_stage(a.stage, a.microbatch);
      auto id = std::make_tuple(fwd ? Op::F : Op::B, consumer, a.microbatch);
      auto [it, fresh] = node.emplace(id, int(names.size()));
      if (fresh) names.push_back(id);
      if (!open) batches[r].emplace_back();
      open = true;
      batches[r].back().push_back(it->second);
    }
  }
  auto cycle = order_cycle(batches, int(names.size()));
  if (cycle.empty()) return;
  std::string msg = "message order: the ranks post messages in a cycle (";
  for (size_t c = 0; c < cycle.size(); ++c)
    msg += message_name(names[cycle[c].first]) + " before " +
           message_name(names[cycle[(c + 1) % cycle.size()].first]) + " on rank " +
           std::to_string(cycle[c].second) + (c + 1 < cycle.size() ? ", " : "");
  msg +=
      "), so when each rank's operations run in posting order (NCCL) every rank waits on "
      "another; lower the compute-only schedule with lower(), which orders them "
      "(NOTE [Batch order])";
  bad(msg);
}

}  // namespace

Schedule lower(const Schedule& s) {
  if (s.lowered) throw std::invalid_argument("lower: schedule '" + s.name + "' is already lowered");
  const int p = s.num_ranks;
  // Outgoing messages per producing action, in production order per rank.
  std::vector<std::vector<std::vector<Msg>>> sends(p);
  for (int r = 0; r < p; ++r) {
    sends[r].resize(s.actions[r].size());
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      if (is_comm(a.op))
        throw std::invalid_argument("lower: rank " + std::to_string(r) +
                                    " already has communication (" + to_string(a) + ")");
      for (const Half& h : halves(a)) {
        if (h.op == Op::F) {
          int next = s.next_stage(h.stage, h.mb);
          if (next >= 0 && s.stage_rank[next] != r)
            sends[r][i].push_back(Msg{false, h.stage, next, h.mb, r, s.stage_rank[next], 0});
        } else if (h.op == Op::I || h.op == Op::B) {
          int prev = s.prev_stage(h.stage, h.mb);
          if (prev >= 0 && s.stage_rank[prev] != r)
            sends[r][i].push_back(Msg{true, h.stage, prev, h.mb, r, s.stage_rank[prev], 0});
        }
      }
    }
  }
  // Consumer position of every message.
  std::map<std::tuple<bool, int, int>, size_t> consumer_at;
  for (int r = 0; r < p; ++r)
    for (size_t i = 0; i < s.actions[r].size(); ++i)
      for (const Half& h : halves(s.actions[r][i])) {
        if (h.op == Op::F) consumer_at[{false, h.stage, h.mb}] = i;
        if (h.op == Op::I || h.op == Op::B) consumer_at[{true, h.stage, h.mb}] = i;
      }
  for (int r = 0; r < p; ++r)
    for (auto& list : sends[r])
      for (auto& msg : list) {
        auto it = consumer_at.find({msg.grad, msg.dst_stage, msg.mb});
        if (it == consumer_at.end())
          throw std::invalid_argument("lower: " + to_string(msg.send()) + " on rank " +
                                      std::to_string(r) + " has no consumer " +
                                      to_string(msg.recv()) + " on rank " +
                                      std::to_string(msg.dst_rank));
        msg.consumer = it->second;
      }
  // Every message, with where its ends sit (NOTE [Lowering and message order]).
  std::vector<Msg*> msgs;
  for (auto& per_rank : sends)
    for (auto& list : per_rank)
      for (auto& msg : list)
        msgs.push_back(&msg);
  const int n = int(msgs.size());
  std::map<std::tuple<bool, int, int>, int> index_of;
  for (int k = 0; k < n; ++k)
    index_of[{msgs[k]->grad, msgs[k]->dst_stage, msgs[k]->mb}] = k;
  // When a nominal run (unit costs) sends each message and runs each compute
  // action.
  SimResult sim = simulate(s, CostModel{});
  using ActionKey = std::tuple<int, int, int, int, int, int>;  // rank, op, stages, microbatches
  auto akey = [](int r, const Action& a) {
    return ActionKey{r, int(a.op), a.stage, a.microbatch, a.stage2, a.microbatch2};
  };
  std::map<ActionKey, std::pair<double, double>> span;  // -> start, end
  for (const Event& e : sim.timeline.events)
    span[akey(e.rank, e.action)] = {e.start, e.end};
  std::vector<double> sent_at(n);
  std::vector<size_t> send_slot(n);  // the SEND's slot: right after its producer
  for (int r = 0; r < p; ++r)
    for (size_t i = 0; i < s.actions[r].size(); ++i)
      for (auto& msg : sends[r][i]) {
        int k = index_of.at({msg.grad, msg.dst_stage, msg.mb});
        sent_at[k] = span.at(akey(r, s.actions[r][i])).second;
        send_slot[k] = i + 1;
      }
  // Slot j of a rank: just before its compute action j (j = size: the end).
  // Latest slot of each RECV: before its consumer and, as each channel is
  // received in send order, not after a later message of its channel.
  std::vector<size_t> latest(n), slot(n);
  std::map<std::pair<int, int>, std::vector<int>> channel;  // (src, dst) -> messages, sent order
  for (int r = 0; r < p; ++r)
    for (auto& list : sends[r])
      for (auto& msg : list)
        channel[{msg.src_rank, msg.dst_rank}].push_back(
            index_of.at({msg.grad, msg.dst_stage, msg.mb}));
  for (auto& [ch, list] : channel) {
    size_t limit = static_cast<size_t>(-1);
    for (size_t k = list.size(); k-- > 0;) {
      limit = std::min(limit, msgs[list[k]]->consumer);
      latest[list[k]] = limit;
    }
  }
  // First choice: post each RECV just before the receiver's first compute
  // action that ends after the message is sent, the compute during which
  // its data can arrive (never earlier: an early receive buys nothing and,
  // on NCCL, holds up the operations behind it).
  for (int k = 0; k < n; ++k) {
    const int r = msgs[k]->dst_rank;
    size_t j = 0;
    while (j < latest[k] && span.at(akey(r, s.actions[r][j])).second < sent_at[k])
      ++j;
    slot[k] = j;
  }
  for (auto& [ch, list] : channel)  // keep each channel's order
    for (size_t k = 1; k < list.size(); ++k)
      slot[list[k]] = std::max(slot[list[k]], slot[list[k - 1]]);
  // The batches (NOTE [Batch order]) of that placement, within a slot in
  // sending order, so that the two ends of a channel list it alike.
  auto order_in_slot = [&](int a, int b) {
    return sent_at[a] != sent_at[b] ? sent_at[a] < sent_at[b] : a < b;
  };
  auto batches_of = [&] {
    std::vector<std::vector<std::vector<int>>> slots(p);
    for (int r = 0; r < p; ++r)
      slots[r].resize(s.actions[r].size() + 1);
    for (int k = 0; k < n; ++k) {
      slots[msgs[k]->src_rank][send_slot[k]].push_back(k);
      slots[msgs[k]->dst_rank][slot[k]].push_back(k);
    }
    for (auto& per_rank : slots)
      for (auto& b : per_rank)
        std::sort(b.begin(), b.end(), order_in_slot);
    return slots;
  };
  auto nonempty = [](std::vector<std::vector<std::vector<int>>> slots) {
    for (auto& per_rank : slots)
      per_rank.erase(std::remove_if(per_rank.begin(), per_rank.end(),
                                    [](const std::vector<int>& b) { return b.empty(); }),
                     per_rank.end());
    return slots;
  };
  // Repair: while the ranks would wait on each other in a cycle, post one of
  // the cycle's receives later, in the batch of the message its rank orders
  // after it - the receive whose data comes last, whose early post is worth
  // least. Receives only move later and never past their latest slot, so
  // this ends; if a cycle has no receive left to move, fall back to one
  // global order for every message (always acyclic).
  bool ordered = true;
  std::vector<std::vector<std::pair<int, int>>> succ;
  for (;;) {
    auto [comp, cyclic] = order_components(nonempty(batches_of()), n, succ);
    // One receive per cyclic component moves in each round.
    std::vector<int> best(cyclic.size(), -1);
    std::vector<size_t> best_to(cyclic.size(), 0);
    bool any = false;
    for (int v = 0; v < n; ++v) {
      if (!cyclic[comp[v]]) continue;
      any = true;
      const int r = msgs[v]->dst_rank;
      if (slot[v] >= latest[v]) continue;
      for (auto [w, by] : succ[v]) {
        if (by != r || comp[w] != comp[v]) continue;  // only v's receive end can move
        size_t to = msgs[w]->dst_rank == r ? slot[w] : send_slot[w];
        to = std::min(std::max(to, slot[v] + 1), latest[v]);
        int& b = best[comp[v]];
        if (b < 0 || sent_at[v] > sent_at[b] || (sent_at[v] == sent_at[b] && v < b)) {
          b = v;
          best_to[comp[v]] = to;
        }
      }
    }
    if (!any) break;
    bool moved = false;
    for (size_t c = 0; c < cyclic.size(); ++c) {
      if (!cyclic[c]) continue;
      if (best[c] < 0) {  // a cycle with no receive left to move
        ordered = false;
        break;
      }
      const int v = best[c];
      slot[v] = std::max(slot[v], best_to[c]);
      moved = true;
      const auto& list = channel.at({msgs[v]->src_rank, msgs[v]->dst_rank});
      for (size_t k = 1; k < list.size(); ++k)
        slot[list[k]] = std::max(slot[list[k]], slot[list[k - 1]]);
    }
    if (!ordered || !moved) {
      ordered = false;
      break;
    }
  }
  if (!ordered) {
    // Fallback: every rank's SENDs and RECVs in one global order (the order
    // a valid execution sends them), each RECV as late as that order allows.
    auto key_of = message_order(s, sends);
    for (int r = 0; r < p; ++r) {
      std::vector<int> mine;
      for (int k = 0; k < n; ++k)
        if (msgs[k]->src_rank == r || msgs[k]->dst_rank == r) mine.push_back(k);
      auto key = [&](int k) { return key_of.at({msgs[k]->grad, msgs[k]->dst_stage, msgs[k]->mb}); };
      std::sort(mine.begin(), mine.end(), [&](int a, int b) { return key(a) < key(b); });
      size_t next = s.actions[r].size();
      for (size_t c = mine.size(); c-- > 0;) {
        int k = mine[c];
        if (msgs[k]->src_rank == r) {
          next = send_slot[k];
        } else {
          slot[k] = std::min(msgs[k]->consumer, next);
          next = slot[k];
        }
      }
      for (int k : mine)
        sent_at[k] = double(key(k));  // within a slot: the global order
    }
  }
  // NOTE [Sends before receives]
  // Within a batch the order of its operations changes nothing a peer sees
  // (each channel - one direction between two ranks - keeps its order, and a
  // batch starts as one), but on Gloo it decides how long posting takes.
  // Gloo's TCP transport hands a message over only once both ends posted it:
  // posting a receive writes a "ready" note, and the peer's event-loop thread
  // answers with the data at once if its send is already posted. That answer
  // lands on our event-loop thread, which shares the core with the posting
  // thread when ranks are pinned; it takes the connection's lock with a
  // try-lock and, failing, polls the socket again without sleeping. Posted
  // before a send, a receive's answer tends to arrive while the send still
  // holds that lock (a 128 KB activation's write takes tens of microseconds),
  // and the event loop then spins until the scheduler's next tick preempts
  // it: measured 2.5-4 ms per batch on the 4 ms tick of the benchmark host,
  // and an event-loop thread using 28 % of its core. Receives posted last
  // let the posting thread leave the transport before any answer comes.
  auto slots = batches_of();
  Schedule out = s;
  out.lowered = true;
  for (int r = 0; r < p; ++r) {
    auto& row = out.actions[r];
    row.clear();
    for (size_t j = 0; j <= s.actions[r].size(); ++j) {
      // A batch's SENDs first, then its RECVs (NOTE [Sends before receives]).
      for (int k : slots[r][j])
        if (msgs[k]->src_rank == r) row.push_back(msgs[k]->send());
      for (int k : slots[r][j])
        if (msgs[k]->src_rank != r) row.push_back(msgs[k]->recv());
      if (j < s.actions[r].size()) row.push_back(s.actions[r][j]);
    }
  }
  return out;
}

void validate(const Schedule& s) {
  s.check_layout();
  const int p = s.num_ranks, S = s.num_stages, m = s.num_microbatches;
  auto key = [m](int st, int mb) { return static_cast<size_t>(st) * m + mb; };
  const size_t n = static_cast<size_t>(S) * m;
  std::vector<int> nF(n, 0), nI(n, 0), nW(n, 0), nB(n, 0);
  // Position (rank-local index) of each half, for the order checks.
  std::vector<long> posF(n, -1), posG(n, -1), posW(n, -1);
  std::map<std::tuple<Op, int, int>, std::pair<int, size_t>> comm_at;  // action -> (rank, idx)

  for (int r = 0; r < p; ++r) {
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      auto check_stage = [&](int st, int mb) {
        if (st < 0 || st >= S || mb < 0 || mb >= m)
          bad(at(r, i, a) + ": stage or microbatch out of range (stages " + std::to_string(S) +
              ", microbatches " + std::to_string(m) + ")");
        if (s.stage_rank[st] != r)
          bad(at(r, i, a) + ": stage " + std::to_string(st) + " runs on rank " +
              std::to_string(s.stage_rank[st]) + ", not here");
        if (s.route_position(st, mb) < 0)
          bad(at(r, i, a) + ": microbatch " + std::to_string(mb) + " does not visit stage " +
              std::to_string(st));
      };
      if (is_comm(a.op)) {
        if (!s.lowered) bad(at(r, i, a) + ": communication in a schedule not marked lowered");
        check_stage(a.stage, a.microbatch);
        if (!comm_at.emplace(std::make_tuple(a.op, a.stage, a.microbatch), std::make_pair(r, i))
                 .second)
          bad(at(r, i, a) + ": duplicate " + std::string(op_name(a.op)));
        continue;
      }
      for (const Half& h : halves(a)) {
        check_stage(h.stage, h.mb);
        size_t k = key(h.stage, h.mb);
        auto dup = [&](const char* what) {
          bad(at(r, i, a) + ": second " + what + " of stage " + std::to_string(h.stage) +
              " microbatch " + std::to_string(h.mb));
        };
        switch (h.op) {
          case Op::F:
            if (nF[k]++) dup("F");
            posF[k] = static_cast<long>(i);
            break;
          case Op::I:
            if (nI[k]++ || nB[k]) dup("backward (I)");
            posG[k] = static_cast<long>(i);
            break;
          case Op::B:
            if (nB[k]++ || nI[k]) dup("backward (B)");
            posG[k] = static_cast<long>(i);
            break;
          case Op::W:
            if (nW[k]++ || nB[k]) dup("W");
            posW[k] = static_cast<long>(i);
            break;
          default:
            break;
        }
      }
    }
  }
  // Counts and order per (stage, microbatch).
  for (int st = 0; st < S; ++st)
    for (int mb = 0; mb < m; ++mb) {
      if (s.route_position(st, mb) < 0) continue;
      size_t k = key(st, mb);
      std::string who = "stage " + std::to_string(st) + " (rank " +
                        std::to_string(s.stage_rank[st]) + ") microbatch " + std::to_string(mb);
      if (nF[k] != 1) bad(who + ": no F");
      if (nB[k] == 0 && nI[k] == 0) bad(who + ": no backward (B, or I and W)");
      if (nI[k] == 1 && nW[k] == 0) bad(who + ": I without its W");
      if (nW[k] == 1 && nI[k] == 0) bad(who + ": W without its I");
      int r = s.stage_rank[st];
      if (posG[k] <= posF[k])
        bad(at(r, posG[k], s.actions[r][posG[k]]) + ": backward before its F at action " +
            std::to_string(posF[k]));
      if (nW[k] && posW[k] <= posG[k])
        bad(at(r, posW[k], s.actions[r][posW[k]]) + ": W before its I at action " +
            std::to_string(posG[k]));
    }
  // Messages (lowered only): each needed message sent once after its
  // producer, received once before its consumer, in consistent order.
  if (s.lowered) {
    std::map<std::pair<int, int>, std::vector<std::tuple<Op, int, int>>> sent, received;
    size_t needed = 0;
    for (int mb = 0; mb < m; ++mb) {
      const auto& route = s.route(mb);
      for (size_t j = 0; j + 1 < route.size(); ++j) {
        int a = route[j], b = route[j + 1];
        int ra = s.stage_rank[a], rb = s.stage_rank[b];
        if (ra == rb) {
          for (auto op : {Op::SEND_F, Op::RECV_F, Op::SEND_B, Op::RECV_B}) {
            // SEND_F and RECV_B name stage a; RECV_F and SEND_B name stage b.
            int st = (op == Op::SEND_F || op == Op::RECV_B) ? a : b;
            auto it = comm_at.find({op, st, mb});
            if (it != comm_at.end())
              bad(at(it->second.first, it->second.second,
                     s.actions[it->second.first][it->second.second]) +
                  ": local hand-off (stages " + std::to_string(a) + " and " + std::to_string(b) +
                  " share rank " + std::to_string(ra) + ") must not communicate");
          }
          continue;
        }
        needed += 4;
        auto need = [&](Op op, int st, int rank, long after, long before) {
          auto it = comm_at.find({op, st, mb});
          Action want = Action::make(op, st, mb);
          if (it == comm_at.end())
            bad("rank " + std::to_string(rank) + ": missing " + to_string(want));
          auto [rr, idx] = it->second;
          if (after >= 0 && static_cast<long>(idx) < after)
            bad(at(rr, idx, s.actions[rr][idx]) + ": sent before it is produced (action " +
                std::to_string(after) + ")");
          if (before >= 0 && static_cast<long>(idx) > before)
            bad(at(rr, idx, s.actions[rr][idx]) + ": received after its consumer (action " +
                std::to_string(before) + ")");
        };
        need(Op::SEND_F, a, ra, posF[key(a, mb)], -1);
        need(Op::RECV_F, b, rb, -1, posF[key(b, mb)]);
        need(Op::SEND_B, b, rb, posG[key(b, mb)], -1);
        need(Op::RECV_B, a, ra, -1, posG[key(a, mb)]);
      }
    }
    if (comm_at.size() != needed) {
      // Some SEND/RECV has no purpose: find it.
      for (const auto& [k, where] : comm_at) {
        auto [op, st, mb] = k;
        bool is_send = op == Op::SEND_F || op == Op::SEND_B;
        bool fwd = op == Op::SEND_F || op == Op::RECV_F;
        int peer_stage = (is_send == fwd) ? s.next_stage(st, mb) : s.prev_stage(st, mb);
        if (peer_stage < 0 || s.stage_rank[peer_stage] == s.stage_rank[st])
          bad(at(where.first, where.second, s.actions[where.first][where.second]) +
              ": no matching peer (nothing crosses ranks here)");
      }
    }
    // Per-channel order: the k-th send on (src -> dst) matches the k-th receive.
    for (int r = 0; r < p; ++r)
      for (size_t i = 0; i < s.actions[r].size(); ++i) {
        const Action& a = s.actions[r][i];
        if (!is_comm(a.op)) continue;
        bool is_send = a.op == Op::SEND_F || a.op == Op::SEND_B;
        bool fwd = a.op == Op::SEND_F || a.op == Op::RECV_F;
        int peer_stage = (is_send == fwd) ? s.next_stage(a.stage, a.microbatch)
                                          : s.prev_stage(a.stage, a.microbatch);
        int peer = s.stage_rank[peer_stage];
        // Identify the message by (forward?, consumer stage, mb).
        int consumer = is_send ? peer_stage : a.stage;
        auto id = std::make_tuple(fwd ? Op::F : Op::B, consumer, a.microbatch);
        if (is_send)
          sent[{r, peer}].push_back(id);
        else
          received[{peer, r}].push_back(id);
      }
    for (const auto& [ch, list] : sent) {
      const auto& got = received[ch];
      for (size_t k = 0; k < list.size() && k < got.size(); ++k)
        if (list[k] != got[k]) {
          auto [op, st, mb] = got[k];
          bad("channel rank " + std::to_string(ch.first) + " -> rank " + std::to_string(ch.second) +
              ": receive #" + std::to_string(k) + " on rank " + std::to_string(ch.second) +
              " expects " + (op == Op::F ? "RECV_F " : "RECV_B ") + "stage " + std::to_string(st) +
              " microbatch " + std::to_string(mb) + " but the sender's message #" +
              std::to_string(k) + " differs (order mismatch)");
        }
    }
  }
  // Batch order (NOTE [Batch order]): no cycle of ranks waiting on each
  // other when operations run in posting order.
  if (s.lowered) check_batch_order(s);
  // Deadlock: run with posts that never block and computes that wait for
  // their inputs (NOTE [What an action waits for]; a message is there once
  // its producer ran: its SEND follows right after it, and the order of
  // posts is checked above).
  Progress progress(s);
  std::vector<size_t> pc(p, 0);
  size_t remaining = 0;
  for (const auto& row : s.actions)
    remaining += row.size();
  bool moved = true;
  while (remaining > 0 && moved) {
    moved = false;
    for (int r = 0; r < p; ++r) {
      while (pc[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][pc[r]];
        if (!progress.ready(a)) break;
        progress.finish(a);
        ++pc[r];
        --remaining;
        moved = true;
      }
    }
  }
  if (remaining > 0) {
    std::string msg = "deadlock: no rank can proceed;";
    for (int r = 0; r < p; ++r)
      if (pc[r] < s.actions[r].size()) msg += " " + at(r, pc[r], s.actions[r][pc[r]]) + " waits;";
    bad(msg);
  }
}

}  // namespace hp::schedule
