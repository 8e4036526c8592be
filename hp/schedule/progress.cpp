// hp/schedule/progress.cpp: what a compute action reads and when it may run
// (NOTE [What an action waits for]).
#include "hp/schedule/progress.h"

#include <algorithm>

namespace hp::schedule {
namespace {
constexpr double kNotDone = -1.0;
}

InputSource forward_input(const Schedule& s, int stage, int mb) {
  const int prev = s.prev_stage(stage, mb);
  if (prev < 0) return {InputSource::Kind::Data, -1};
  return {s.stage_rank[prev] == s.stage_rank[stage] ? InputSource::Kind::Local
                                                    : InputSource::Kind::Remote,
          prev};
}

InputSource backward_input(const Schedule& s, int stage, int mb) {
  const int next = s.next_stage(stage, mb);
  if (next < 0) return {InputSource::Kind::Loss, -1};
  return {s.stage_rank[next] == s.stage_rank[stage] ? InputSource::Kind::Local
                                                    : InputSource::Kind::Remote,
          next};
}

Progress::Progress(const Schedule& s) : s_(s), m_(s.num_microbatches) {
  const size_t n = static_cast<size_t>(s.num_stages) * s.num_microbatches;
  f_done_.assign(n, kNotDone);
  g_done_.assign(n, kNotDone);
  i_done_.assign(n, kNotDone);
}

bool Progress::in_range(int stage, int mb) const {
  return stage >= 0 && stage < s_.num_stages && mb >= 0 && mb < m_ &&
         s_.route_position(stage, mb) >= 0;
}

double Progress::f_ready(int stage, int mb, const Transfer& transfer) const {
  if (!in_range(stage, mb)) return kNotDone;
  const InputSource in = forward_input(s_, stage, mb);
  if (in.kind == InputSource::Kind::Data) return 0.0;
  const double t = f_done_[key(in.stage, mb)];
  if (t < 0) return kNotDone;
  return in.kind == InputSource::Kind::Remote && transfer ? t + transfer(in.stage, stage) : t;
}

double Progress::g_ready(int stage, int mb, const Transfer& transfer) const {
  if (!in_range(stage, mb)) return kNotDone;
  const double own_f = f_done_[key(stage, mb)];
  if (own_f < 0) return kNotDone;
  const InputSource in = backward_input(s_, stage, mb);
  if (in.kind == InputSource::Kind::Loss) return own_f;
  const double t = g_done_[key(in.stage, mb)];
  if (t < 0) return kNotDone;
  return std::max(
      own_f, in.kind == InputSource::Kind::Remote && transfer ? t + transfer(stage, in.stage) : t);
}

double Progress::ready_at(const Action& a, const Transfer& transfer) const {
  switch (a.op) {
    case Op::F:
      return f_ready(a.stage, a.microbatch, transfer);
    case Op::I:
    case Op::B:
      return g_ready(a.stage, a.microbatch, transfer);
    case Op::W:
      return in_range(a.stage, a.microbatch) ? i_done_[key(a.stage, a.microbatch)] : kNotDone;
    case Op::FB: {
      const double x = f_ready(a.stage, a.microbatch, transfer);
      const double y = g_ready(a.stage2, a.microbatch2, transfer);
      return (x < 0 || y < 0) ? kNotDone : std::max(x, y);
    }
    default:
      return 0.0;  // SEND/RECV never wait
  }
}

void Progress::finish(const Action& a, double end) {
  auto done_f = [&](int st, int mb) {
    if (in_range(st, mb)) f_done_[key(st, mb)] = end;
  };
  auto done_g = [&](int st, int mb) {
    if (in_range(st, mb)) g_done_[key(st, mb)] = end;
  };
  switch (a.op) {
    case Op::F:
      done_f(a.stage, a.microbatch);
      break;
    case Op::I:
      done_g(a.stage, a.microbatch);
      if (in_range(a.stage, a.microbatch)) i_done_[key(a.stage, a.microbatch)] = end;
      break;
    case Op::B:
      done_g(a.stage, a.microbatch);
      break;
    case Op::FB:
      done_f(a.stage, a.microbatch);
      done_g(a.stage2, a.microbatch2);
      break;
    default:
      break;
  }
}

}  // namespace hp::schedule
