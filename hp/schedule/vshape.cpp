// hp/schedule/vshape.cpp: V-Min, V-Half and V-ZB from the controllable-memory
// paper's building blocks (repeat, fill W, squeeze, read off the order).
#include "hp/schedule/vshape.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <limits>
#include <stdexcept>

namespace hp::schedule {

// NOTE [V-shape building blocks]
// Qi et al. (arXiv 2405.15362) build a schedule by repeating one microbatch's
// pattern, its *building block*, every 6 slots (a slot is one op of one V
// stage; a rank runs 6 ops per microbatch: F, I and W of its two stages). The
// block says, per rank r, in which slot the down forward (stage r), the up
// forward (stage 2p-1-r) and the two input gradients (up stage first: the
// backward comes back down the V) run. The block's *lifespan* on a rank (first
// F to last W of one microbatch) decides the peak memory: about lifespan / 6
// microbatches are alive at once. With a the spacing of the down forwards
// between neighbouring ranks, b that of the up input gradients and u that of
// the up forwards and down input gradients:
//
//   f_down(r) = a r
//   f_up(r)   = a (p-1) + 1 + u (p-1-r)          (the V turns on rank p-1)
//   i_up(r)   = f_up(0) + 1 + g1 + b r            (the loss is on rank 0)
//   i_down(r) = i_up(p-1) + 1 + g2 + u (p-1-r)
//
// V-Min is a = b = u = 1 (g1 = 2 when 3 divides p, else 0; g2 = 0): rank 0's
// lifespan is about 4p slots, (p+4)/3 microbatches of activations in the
// paper's count (memory held until W). V-Half is a = b = 2, u = 1 (g1 = 3 when
// p is even, else 0; g2 = 1): about 6p slots, (p+2)/2 microbatches. (Both
// are the paper's code's offsets.) V-ZB is a = b = 4, u = 2, g1 = g2 = 0: about
// 12p slots, p microbatches, and zero bubble at F = B = W from m = 3p on (below
// that the steady state is never reached; the schedule is still valid). The
// g's keep a rank's four offsets distinct modulo 6 (two ops never share a
// slot); V-ZB's are for every p (even offsets 4r and 2 + 4r, odd ones 1 - 2r
// and 3 - 2r modulo 6).
//
// From the block to a schedule (as the paper's code does): the ops of m
// microbatches at offset + 6k, W's in the free slots in the order of their
// I's; then the *squeeze*: walking all ops in slot order, an op of the warmup
// (before rank 0's first down I) or of the cooldown (from the first forward
// of the last microbatch on) moves to the earliest free slot after its inputs
// where no rank's peak memory grows; the same again without the W's (the
// cooldown only), and the W's placed again. Each rank's order is its ops by
// slot; simulate() then runs them as early as their inputs allow under any
// costs (with transfers), which closes the remaining gaps.

// NOTE [Stretched blocks]
// Below V-Min's memory no block of period 6 fits: V-Min's lifespan (about 4p
// slots on rank 0, the round trip of one microbatch) is the shortest a V can
// have. Repeating the same block every P > 6 slots keeps the lifespan and
// holds about 6/P as many microbatches in flight, at 6/P of the throughput in
// the steady state: e.g. p = 8, m = 24 at a third of 1F1B's memory (2.67 of
// V-Min's 4) gives a bubble rate of about 0.45 (V-Min itself: 0.16). The
// search `auto` (search/search.h) tries V-Min's block at several periods.

namespace {

constexpr int kTypes = 4;  // f_down, f_up, i_up, i_down; W's are kept apart

std::vector<BlockOffsets> family(int p, int a, int b, int u, int g1, int g2) {
  std::vector<BlockOffsets> out(p);
  const int f_up0 = a * (p - 1) + 1 + u * (p - 1);
  const int i_up_last = f_up0 + 1 + g1 + b * (p - 1);
  for (int r = 0; r < p; ++r) {
    out[r].f_down = a * r;
    out[r].f_up = a * (p - 1) + 1 + u * (p - 1 - r);
    out[r].i_up = f_up0 + 1 + g1 + b * r;
    out[r].i_down = i_up_last + 1 + g2 + u * (p - 1 - r);
  }
  return out;
}

bool distinct_mod(const std::vector<BlockOffsets>& b, int period) {
  for (const auto& o : b) {
    const int v[4] = {o.f_down % period, o.f_up % period, o.i_up % period, o.i_down % period};
    for (int i = 0; i < 4; ++i)
      for (int j = i + 1; j < 4; ++j)
        if (v[i] == v[j]) return false;
  }
  return true;
}

// The slots of one V block schedule, per rank: ops[r][t][k] for the four
// types, and the W's (w[r]: slot, with the I it follows).
struct Slots {
  int p = 0, m = 0;
  std::vector<std::array<std::vector<int>, kTypes>> ops;
  std::vector<std::vector<int>> w;  // W slots per rank, in the order of their I's
};

// One slot of peak_of's scan: `cur` (memory) and `pending` (I's whose W has
// not run) after slot type `t`.
inline void peak_step(int t, bool explicit_w, int& cur, int& pending) {
  if (t == 0 || t == 1) {
    ++cur;
  } else if (t == 2 || t == 3) {
    ++pending;
  } else if (t == 4) {
    --cur;
  } else if (!explicit_w && pending > 0) {
    --cur;
    --pending;
  }
}

// Memory on a rank over its slots, in half-microbatch units as the paper
// counts it: F +1, W -1 (I changes nothing); without explicit W's, a pending
// W runs in each free slot.
int peak_of(const std::vector<int>& occ, bool explicit_w) {
  int cur = 0, res = 0, pending = 0;
  for (int t : occ) {
    peak_step(t, explicit_w, cur, pending);
    res = std::max(res, cur);
  }
  return res;
}

// NOTE [Squeeze without rescans]
// The squeeze tries, for every op, the free slots before it from the earliest
// its inputs allow, and keeps the first that leaves the rank's peak memory
// within the block's; it used to scan the whole row (peak_of) per slot tried:
// at p = 4096 rows are 16 thousand slots long and v-zb took 50 s. Moving an op
// from slot `from` to an earlier `cand` changes nothing before `cand`, and
// after `from` the scan's state (memory, pending W's) meets the old one again
// within a few slots, from where the row is what it was. The row's state after
// every slot is kept, so a try scans only from `cand` until the states meet
// (failing as soon as memory passes the peak: the row before `cand` and after
// the meeting point is within it already), and an accepted move updates the
// kept states over the same stretch. The same moves are accepted as before.
class RowScan {
 public:
  RowScan(const std::vector<int>& occ, bool explicit_w) : explicit_w_(explicit_w) {
    cur_.resize(occ.size());
    pend_.resize(occ.size());
    int cur = 0, pending = 0;
    for (size_t i = 0; i < occ.size(); ++i) {
      peak_step(occ[i], explicit_w_, cur, pending);
      cur_[i] = cur;
      pend_[i] = pending;
    }
  }

  /// Memory after slot `i`.
  int memory_after(int i) const { return cur_[i]; }

  /// Whether moving the op of `occ` at slot `from` to the free slot `cand`
  /// (cand < from) keeps the row's memory within `peak` (the row is within it
  /// now).
  bool fits(const std::vector<int>& occ, int cand, int from, int peak) const {
    return rescan(occ, cand, from, peak, nullptr);
  }
  /// Records that move (before the caller makes it in `occ`).
  void move(const std::vector<int>& occ, int cand, int from) {
    rescan(occ, cand, from, std::numeric_limits<int>::max(), this);
  }

 private:
  // The scan of the moved row from `cand` until its state meets the kept one
  // past `from` (or the row ends); false once memory passes `peak`. With
  // `into`, writes the new states there.
  bool rescan(const std::vector<int>& occ, int cand, int from, int peak, RowScan* into) const {
    int cur = cand > 0 ? cur_[cand - 1] : 0, pending = cand > 0 ? pend_[cand - 1] : 0;
    const int n = static_cast<int>(occ.size());
    for (int i = cand; i < n; ++i) {
      const int t = i == cand ? occ[from] : i == from ? -1 : occ[i];
      peak_step(t, explicit_w_, cur, pending);
      if (cur > peak) return false;
      const bool met = i >= from && cur == cur_[i] && pending == pend_[i];
      if (into) {
        into->cur_[i] = cur;
        into->pend_[i] = pending;
      }
      if (met) return true;
    }
    return true;
  }

  bool explicit_w_;
  std::vector<int> cur_, pend_;
};

// W's in the free slots, in the order of the I's (up stage's first when
// `split`, as the paper's code places them at the end).
std::vector<int> place_w(const std::array<std::vector<int>, kTypes>& ops, bool split,
                         std::vector<int>* w_type) {
  int bound = 0;
  for (const auto& v : ops)
    for (int x : v)
      bound = std::max(bound, x);
  std::vector<int> occ(bound + 1, -1);
  for (int t = 0; t < kTypes; ++t)
    for (int x : ops[t])
      occ[x] = t;
  std::vector<int> out;
  std::deque<int> fifo;  // types of the I's waiting for their W
  int pend[2] = {0, 0};
  w_type->clear();
  auto take = [&](int slot) {
    int t;
    if (split) {
      t = pend[0] > 0 ? 2 : 3;
      --pend[t - 2];
    } else {
      t = fifo.front();
      fifo.pop_front();
      --pend[t - 2];
    }
    out.push_back(slot);
    w_type->push_back(t);
  };
  for (int i = 0; i <= bound; ++i) {
    if (occ[i] >= 0) {
      if (occ[i] >= 2) {
        fifo.push_back(occ[i]);
        ++pend[occ[i] - 2];
      }
    } else if (pend[0] + pend[1] > 0) {
      take(i);
    }
  }
  int i = bound;
  while (pend[0] + pend[1] > 0)
    take(++i);
  return out;
}

// The squeeze of NOTE [V-shape building blocks] (one pass). With `with_w`,
// w holds explicit W slots that move too, warmup included; without, only the
// cooldown moves and W's are implicit.
void squeeze(Slots& s, bool with_w) {
  const int p = s.p, m = s.m;
  const int types = with_w ? kTypes + 1 : kTypes;
  auto slot_ref = [&](int r, int t, int k) -> int& {
    return t < kTypes ? s.ops[r][t][k] : s.w[r][k];
  };
  auto count = [&](int r, int t) {
    return t < kTypes ? static_cast<int>(s.ops[r][t].size()) : static_cast<int>(s.w[r].size());
  };
  std::vector<std::vector<int>> occ(p);
  int peak = 0;
  for (int r = 0; r < p; ++r) {
    int bound = 0;
    for (int t = 0; t < types; ++t)
      for (int k = 0; k < count(r, t); ++k)
        bound = std::max(bound, slot_ref(r, t, k));
    occ[r].assign(bound + 1, -1);
    for (int t = 0; t < types; ++t)
      for (int k = 0; k < count(r, t); ++k)
        occ[r][slot_ref(r, t, k)] = t;
    peak = std::max(peak, peak_of(occ[r], with_w));
  }
  struct Item {
    int slot, r, t, k;
  };
  std::vector<Item> items;
  for (int r = 0; r < p; ++r)
    for (int t = 0; t < types; ++t)
      for (int k = 0; k < count(r, t); ++k)
        items.push_back({slot_ref(r, t, k), r, t, k});
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.slot != b.slot) return a.slot < b.slot;
    if (a.r != b.r) return a.r < b.r;
    if (a.t != b.t) return a.t < b.t;
    return a.k < b.k;
  });
  std::vector<RowScan> scans;
  scans.reserve(p);
  for (int r = 0; r < p; ++r)
    scans.emplace_back(occ[r], with_w);
  int phase = 0;
  std::vector<int> b_sorted;
  for (const Item& it : items) {
    const int r = it.r, t = it.t, k = it.k;
    if (phase == 0 && t == 3 && r == 0) phase = 1;
    if (phase == 1) {
      if (t == 0 && k == m - 1) phase = 2;
      continue;
    }
    if (phase == 0 && !with_w) continue;
    int dep = -1;
    if (t == 0 || t == 2) {
      if (r > 0) dep = std::max(dep, s.ops[r - 1][t][k]);
    } else if (t == 1 || t == 3) {
      if (r + 1 < p) dep = std::max(dep, s.ops[r + 1][t][k]);
    }
    if (t > 0 && t < kTypes) dep = std::max(dep, s.ops[r][t - 1][k]);
    if (t == kTypes) {
      b_sorted.assign(s.ops[r][2].begin(), s.ops[r][2].end());
      b_sorted.insert(b_sorted.end(), s.ops[r][3].begin(), s.ops[r][3].end());
      std::nth_element(b_sorted.begin(), b_sorted.begin() + k, b_sorted.end());
      dep = std::max(dep, b_sorted[k]);
    }
    if (k > 0) dep = std::max(dep, slot_ref(r, t, k - 1));
    int& cur = slot_ref(r, t, k);
    const int from = cur;
    // NOTE [Squeeze without rescans]
    int to = -1;
    if (with_w) {
      // Explicit W's: memory between `to` and `from` goes up by one for an F,
      // stays for an I, goes down for a W; the earliest free slot that keeps
      // it within the peak, found in one pass back from `from`.
      int most = std::numeric_limits<int>::min();
      for (int cand = from - 1; cand > dep; --cand) {
        if (t == 0 || t == 1) {
          most = std::max(most, scans[r].memory_after(cand));
          if (most + 1 > peak) break;
        }
        if (occ[r][cand] < 0) to = cand;
      }
    } else {
      for (int cand = dep + 1; cand < from && to < 0; ++cand)
        if (occ[r][cand] < 0 && scans[r].fits(occ[r], cand, from, peak)) to = cand;
    }
    if (to >= 0) {
      scans[r].move(occ[r], to, from);
      occ[r][from] = -1;
      occ[r][to] = t;
      cur = to;
    }
  }
}

}  // namespace

std::vector<BlockOffsets> v_block_offsets(VBlock kind, int p) {
  if (p < 1) throw std::invalid_argument("V block: needs p >= 1 (got p=" + std::to_string(p) + ")");
  if (kind == VBlock::Min) return family(p, 1, 1, 1, p % 3 == 0 ? 2 : 0, 0);
  if (kind == VBlock::Half) return family(p, 2, 2, 1, p % 2 == 0 ? 3 : 0, 1);
  return family(p, 4, 4, 2, 0, 0);
}

std::vector<BlockOffsets> v_block_family(int p, int a, int b, int u, int period) {
  if (p < 1 || a < 1 || b < 1 || u < 1 || period < 6)
    throw std::invalid_argument(
        "V block: needs p >= 1, spacings a, b, u >= 1 and period >= 6 (got p=" + std::to_string(p) +
        ", a=" + std::to_string(a) + ", b=" + std::to_string(b) + ", u=" + std::to_string(u) +
        ", period=" + std::to_string(period) + ")");
  for (int sum = 0; sum <= 2 * period; ++sum)
    for (int g1 = 0; g1 <= sum; ++g1) {
      auto blk = family(p, a, b, u, g1, sum - g1);
      if (distinct_mod(blk, period)) return blk;
    }
  throw std::invalid_argument("V block: no offsets distinct modulo " + std::to_string(period) +
                              " for spacings a=" + std::to_string(a) + ", b=" + std::to_string(b) +
                              ", u=" + std::to_string(u));
}

long long v_block_work(const std::vector<BlockOffsets>& block, int p, int m, int period) {
  long long row = 0;  // the longest row: the last block offset, m periods, the W's after
  for (const BlockOffsets& o : block)
    row = std::max<long long>(row, std::max({o.f_down, o.f_up, o.i_up, o.i_down}));
  row += static_cast<long long>(period) * m + 2LL * m + 1;
  // A slot of the squeeze costs about 1/64 of a simulated action (measured:
  // 2.3 ns against 150 ns).
  return 2 * 6LL * p * m + static_cast<long long>(p) * 5 * m * row / 64;
}

Schedule schedule_from_v_block(const std::vector<BlockOffsets>& block, int p, int m,
                               const std::string& name, int period) {
  if (p < 1 || m < 1)
    throw std::invalid_argument("schedule '" + name + "': needs p >= 1 and m >= 1 (got p=" +
                                std::to_string(p) + ", m=" + std::to_string(m) + ")");
  if (static_cast<int>(block.size()) != p)
    throw std::invalid_argument("schedule '" + name + "': the block has " +
                                std::to_string(block.size()) +
                                " ranks, not p=" + std::to_string(p));
  for (int r = 0; r < p; ++r) {
    const auto& o = block[r];
    std::vector<BlockOffsets> one = {o};
    if (period < 6 || !distinct_mod(one, period) || o.f_down < 0)
      throw std::invalid_argument("schedule '" + name + "': rank " + std::to_string(r) +
                                  "'s block offsets (" + std::to_string(o.f_down) + ", " +
                                  std::to_string(o.f_up) + ", " + std::to_string(o.i_up) + ", " +
                                  std::to_string(o.i_down) +
                                  ") must be non-negative and distinct modulo the period " +
                                  std::to_string(period) + " (>= 6; two ops on one slot)");
  }
  Slots s;
  s.p = p;
  s.m = m;
  s.ops.resize(p);
  s.w.resize(p);
  std::vector<int> wt;
  for (int r = 0; r < p; ++r) {
    const int off[kTypes] = {block[r].f_down, block[r].f_up, block[r].i_up, block[r].i_down};
    for (int t = 0; t < kTypes; ++t)
      for (int k = 0; k < m; ++k)
        s.ops[r][t].push_back(off[t] + period * k);
    s.w[r] = place_w(s.ops[r], false, &wt);
  }
  squeeze(s, true);
  squeeze(s, false);
  Schedule out = make_v_layout(p, m);
  out.name = name;
  for (int r = 0; r < p; ++r) {
    const int dn = r, up = 2 * p - 1 - r;
    std::vector<std::pair<int, Action>> seq;
    for (int k = 0; k < m; ++k) {
      seq.emplace_back(s.ops[r][0][k], Action::make(Op::F, dn, k));
      seq.emplace_back(s.ops[r][1][k], Action::make(Op::F, up, k));
      seq.emplace_back(s.ops[r][2][k], Action::make(Op::I, up, k));
      seq.emplace_back(s.ops[r][3][k], Action::make(Op::I, dn, k));
    }
    const std::vector<int> w = place_w(s.ops[r], true, &wt);
    int next[2] = {0, 0};
    for (size_t j = 0; j < w.size(); ++j) {
      const int t = wt[j];
      seq.emplace_back(w[j], Action::make(Op::W, t == 2 ? up : dn, next[t - 2]++));
    }
    std::stable_sort(seq.begin(), seq.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (auto& [slot, a] : seq)
      out.actions[r].push_back(a);
  }
  return out;
}

Schedule v_block_schedule(VBlock kind, int p, int m) {
  const char* name = kind == VBlock::Min ? "v-min" : kind == VBlock::Half ? "v-half" : "v-zb";
  if (p < 1 || m < 1)
    throw std::invalid_argument(std::string("schedule '") + name +
                                "': needs p >= 1 and m >= 1 (got p=" + std::to_string(p) +
                                ", m=" + std::to_string(m) + ")");
  return schedule_from_v_block(v_block_offsets(kind, p), p, m, name);
}

}  // namespace hp::schedule
