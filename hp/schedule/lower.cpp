// hp/schedule/lower.cpp: lower() inserts SEND/RECV pairs in a deadlock-free,
// per-channel-consistent order; validate() checks a schedule end to end.
#include "hp/schedule/lower.h"

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

// Halves of a compute action: (is_backward, stage, mb, op) for F, I, W, B, FB.
struct Half {
  Op op;
  int stage, mb;
};
std::vector<Half> halves(const Action& a) {
  if (a.op == Op::FB) return {{Op::F, a.stage, a.microbatch}, {Op::B, a.stage2, a.microbatch2}};
  return {{a.op, a.stage, a.microbatch}};
}

std::string at(int rank, size_t idx, const Action& a) {
  return "rank " + std::to_string(rank) + " action " + std::to_string(idx) + " (" + to_string(a) +
         ")";
}

[[noreturn]] void bad(const std::string& msg) {
  throw std::invalid_argument("invalid schedule: " + msg);
}

}  // namespace

Schedule lower(const Schedule& s) {
  if (s.lowered) throw std::invalid_argument("lower: schedule '" + s.name + "' is already lowered");
  const int p = s.num_ranks;
  // Outgoing messages per producing action, in production order per rank.
  std::vector<std::vector<std::vector<Msg>>> sends(p);
  std::map<std::tuple<bool, int, int>, Msg*> by_key;  // (grad, dst_stage, mb) -> msg
  std::vector<std::vector<Msg>> storage;
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
  // Per channel (src -> dst), messages in send order; place receives.
  std::map<std::pair<int, int>, std::vector<Msg>> channel;
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
        channel[{msg.src_rank, msg.dst_rank}].push_back(msg);
      }
  // recv_before[r][i]: receives to post before compute action i of rank r.
  std::vector<std::vector<std::vector<Msg>>> recv_before(p);
  for (int r = 0; r < p; ++r)
    recv_before[r].resize(s.actions[r].size() + 1);
  for (auto& [key, msgs] : channel) {
    size_t limit = static_cast<size_t>(-1);
    std::vector<size_t> pos(msgs.size());
    for (size_t k = msgs.size(); k-- > 0;) {
      limit = std::min(limit, msgs[k].consumer);
      pos[k] = limit;
    }
    for (size_t k = 0; k < msgs.size(); ++k)
      recv_before[key.second][pos[k]].push_back(msgs[k]);
  }
  Schedule out = s;
  out.lowered = true;
  for (int r = 0; r < p; ++r) {
    auto& row = out.actions[r];
    row.clear();
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      for (const auto& msg : recv_before[r][i])
        row.push_back(msg.recv());
      row.push_back(s.actions[r][i]);
      for (const auto& msg : sends[r][i])
        row.push_back(msg.send());
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
  // Deadlock: run with blocking receives (sends never block).
  std::vector<char> f_done(n, 0), g_done(n, 0), i_done(n, 0);
  std::map<std::tuple<Op, int, int>, char> sent_done;  // (F/B, consumer stage, mb)
  std::vector<size_t> pc(p, 0);
  size_t remaining = 0;
  for (const auto& row : s.actions)
    remaining += row.size();
  auto f_ok = [&](int st, int mb) {
    int prev = s.prev_stage(st, mb);
    return prev < 0 || f_done[key(prev, mb)];
  };
  auto g_ok = [&](int st, int mb) {
    if (!f_done[key(st, mb)]) return false;
    int next = s.next_stage(st, mb);
    return next < 0 || g_done[key(next, mb)];
  };
  bool progress = true;
  while (remaining > 0 && progress) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      while (pc[r] < s.actions[r].size()) {
        const Action& a = s.actions[r][pc[r]];
        bool ok = true;
        switch (a.op) {
          case Op::F:
            ok = f_ok(a.stage, a.microbatch);
            break;
          case Op::I:
          case Op::B:
            ok = g_ok(a.stage, a.microbatch);
            break;
          case Op::W:
            ok = i_done[key(a.stage, a.microbatch)];
            break;
          case Op::FB:
            ok = f_ok(a.stage, a.microbatch) && g_ok(a.stage2, a.microbatch2);
            break;
          case Op::RECV_F:
            ok = sent_done.count({Op::F, a.stage, a.microbatch}) > 0;
            break;
          case Op::RECV_B:
            ok = sent_done.count({Op::B, a.stage, a.microbatch}) > 0;
            break;
          case Op::SEND_F:
            sent_done[{Op::F, s.next_stage(a.stage, a.microbatch), a.microbatch}] = 1;
            break;
          case Op::SEND_B:
            sent_done[{Op::B, s.prev_stage(a.stage, a.microbatch), a.microbatch}] = 1;
            break;
        }
        if (!ok) break;
        for (const Half& h : is_compute(a.op) ? halves(a) : std::vector<Half>{}) {
          size_t k = key(h.stage, h.mb);
          if (h.op == Op::F) f_done[k] = 1;
          if (h.op == Op::I) i_done[k] = 1;
          if (h.op == Op::I || h.op == Op::B) g_done[k] = 1;
        }
        ++pc[r];
        --remaining;
        progress = true;
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
