// Executor: FB pairs (overlapped, through a pair function, or one half
// after the other), the W's deferred into their waits, and the sends a half
// posts as it ends. The rest of the walk is executor.cpp's.
#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "hp/distributed/lanes.h"
#include "hp/pipeline/executor_state.h"
#include "hp/pipeline/step_timer.h"

namespace hp::pipeline {

// An FB action: its F and its B, overlapped (NOTE [Overlapped pairs] in
// overlap.cpp), through a pair function, or one after the other.
void Executor::State::run_pair(const Action& a) {
  const Action b = Action::make(Op::B, a.stage2, a.microbatch2);
  auto run_f = [&] { forward(a.stage, a.microbatch, a); };
  const bool defer = opts.fb_overlap && opts.defer_wgrad;
  auto run_b = [&] {
    Message g = grad_for(b.stage, b.microbatch, b);
    if (!defer) {
      store_dx(b.stage, b.microbatch, stage.backward(b.stage, b.microbatch, g));
      return;
    }
    // NOTE [Weight gradients in the waits] in overlap.cpp
    store_dx(b.stage, b.microbatch, stage.backward_input(b.stage, b.microbatch, g));
    deferred_w.emplace_back(b.stage, b.microbatch);
  };
  // NOTE [Overlapped pairs] in overlap.cpp
  auto overlapped = [&] {
    if (!pairs) pairs = std::make_unique<PairRunner>(opts.device, opts.pair_first_ready);
    std::function<bool()> idle;
    // Each W its own event, while the partner waits: whole, or with ready
    // turns in parts (NOTE [Weight gradients until the message is there] in
    // overlap.cpp).
    const int parts = std::max(1, opts.deferred_w_parts);  // > 1 only with ready turns
    if (defer)
      idle = [this, parts] {
        if (deferred_w.empty()) return false;
        run_deferred_w_span(parts);
        return true;
      };
    in_pair = true;
    PairStats ps;
    // NOTE [A half's sends leave when it ends]
    const int pair_start = timer->mark();
    int f_end = 0, b_end = 0;
    auto f_then_send = [&] {
      run_f();
      f_end = timer->mark();
      post_ready_sends();
    };
    auto b_then_send = [&] {
      run_b();
      b_end = timer->mark();
      post_ready_sends();
    };
    try {
      // NOTE [The half that leads] in hp/schedule/fuse.cpp
      ps = a.backward_first ? pairs->run(b_then_send, f_then_send, idle, parts > 1)
                            : pairs->run(f_then_send, b_then_send, idle, parts > 1);
    } catch (...) {
      in_pair = false;
      throw;
    }
    in_pair = false;
    // NOTE [An overlapped pair's events] in step_timer.cpp
    const int lead = a.backward_first ? 1 : 0;  // ps.compute's index of the F half
    TimedSpan f_half{Action::make(Op::F, a.stage, a.microbatch),
                     pair_start,
                     f_end,
                     {},
                     ps.compute[lead],
                     ps.inner_waits[lead],
                     ps.inner_waited[lead],
                     ps.inner_waits[lead] > 0 ? ps.nodes[lead] : std::vector<double>{}};
    TimedSpan b_half{Action::make(defer ? Op::I : Op::B, b.stage, b.microbatch),
                     pair_start,
                     b_end,
                     {},
                     ps.compute[1 - lead],
                     ps.inner_waits[1 - lead],
                     ps.inner_waited[1 - lead],
                     ps.inner_waits[1 - lead] > 0 ? ps.nodes[1 - lead] : std::vector<double>{}};
    pair_halves = f_end <= b_end ? std::vector<TimedSpan>{f_half, b_half}
                                 : std::vector<TimedSpan>{b_half, f_half};
    ++stats.pairs;
    stats.pair_hidden += ps.hidden;
    stats.pair_exposed += ps.exposed;
    stats.pair_exposed_alone += ps.exposed_alone;
    stats.pair_reordered += ps.reordered;
    stats.chunk_wait += ps.chunk_idle;
    stats.deferred_w_in_waits += ps.filled;
  };
  if (opts.pair_function) {
    run_pair_function(opts.pair_function, a, run_f, run_b, overlapped,
                      [&](const auto& fn) { computed_pair(a, b, fn); });
  } else if (opts.fb_overlap) {
    overlapped();
  } else {
    run_f();
    run_b();
  }
}

// NOTE [A half's sends leave when it ends]
// The sends of an FB pair follow it in the list, so a pair run as F then B
// sends the F's output only after the B: the next stage waits for both
// halves. In an overlapped pair on the CPU each half posts, as it ends, the
// sends of the batch after the pair that are ready (the F's output, the
// B's input gradient), in list order per peer: a send goes only where no
// earlier send of that batch to the same peer is still waiting, so every
// channel's messages keep the order the receiver posted its receives in
// (NOTE [Point-to-point without tags]). The batch then posts the rest
// (posted_ahead marks those gone). The halves never run at once, so the
// executor's state is touched by one thread at a time. On a device the
// sends keep their place (NCCL runs a rank's operations in posting order).
// The simulator's overlapped pair lets each half's output leave as it
// ends (NOTE [An overlapped pair in the simulator]): the pair now runs so.
void Executor::State::post_ready_sends() {
  const size_t next = running + 1;
  if (!opts.device.is_cpu() || !batch_at.count(next)) return;
  const auto [first, end] = batches[batch_at.at(next)];
  std::set<int> held;  // peers with an earlier send still waiting
  for (size_t k = first; k < end; ++k) {
    const Action& a = actions[k];
    if (!is_send(a.op) || posted_ahead[k]) continue;
    const bool fwd = a.op == Op::SEND_F;
    const int peer = rank_of(fwd ? sched.next_stage(a.stage, a.microbatch)
                                 : sched.prev_stage(a.stage, a.microbatch));
    const bool ready = fwd ? stage.has_output(a.stage, a.microbatch)
                           : pending_dx.count({a.stage, a.microbatch}) > 0;
    if (!ready || held.count(peer)) {
      held.insert(peer);
      continue;
    }
    const int start = timer->mark();
    const auto began = std::chrono::steady_clock::now();
    std::function<void()> on_done;
    auto ops = send_ops(a, on_done);
    auto works = comm->batch(ops);
    for (size_t n = 0; n < ops.size(); ++n)
      reaper->add(works[n], ops[n].tensor,
                  n + 1 == ops.size() ? std::move(on_done) : std::function<void()>());
    posted_ahead[k] = 1;
    const int stop = timer->mark();
    comm_spans.emplace_back(start, stop);
    spans.push_back({a, start, stop});
    if (waits_of_running != nullptr) waits_of_running->emplace_back(start, stop);
    if (own_waits_of_running != nullptr && !in_pair)  // a posting, not the action's compute
      own_waits_of_running->exclude(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count());
  }
}

// An FB pair whose halves a pair function computes itself (PairCall::
// computed; NOTE [A pair that computes itself] in stage.cpp): both inputs
// first, then fn inside the F.
void Executor::State::computed_pair(const Action& a, const Action& b,
                                    const std::function<Message(const PairInputs&)>& fn) {
  std::vector<bool> takes_grad;
  Message input = forward_input(a.stage, a.microbatch, a, &takes_grad);
  Message g = grad_for(b.stage, b.microbatch, b);
  PairInputs p;
  p.forward_is_last = ends_in_loss(a.stage, a.microbatch);
  p.backward_is_last = ends_in_loss(b.stage, b.microbatch);
  std::tie(p.backward_roots, p.backward_grads) = stage.backward_roots(b.stage, b.microbatch, g);
  stage.forward_computed(a.stage, a.microbatch, input, takes_grad, p.forward_is_last,
                         [&](const Message& leaves) {
                           p.forward_input = leaves;
                           return fn(p);
                         });
  store_dx(b.stage, b.microbatch, stage.backward_computed(b.stage, b.microbatch));
}

// Runs the next of `parts` parts of the oldest deferred W (there is one),
// or the rest of it with parts 1; true once it is done (NOTE [Weight
// gradients in the waits]).
bool Executor::State::run_deferred_w(int parts) {
  const auto [s, mb] = deferred_w.front();
  // Its posts (the last W's gradient reduction) on a lane of their own,
  // wherever it runs (NOTE [Lanes] in hp/distributed/lanes.cpp).
  distributed::LaneScope lane(distributed::kDeferredLane);
  // Under ready turns where it runs depends on timing: an exchange there
  // (a recompute of an expert layer) could wait on peers that wait on this
  // rank (NOTE [Turns as messages arrive] in overlap.cpp), so it fails.
  std::optional<distributed::NoExchangeScope> no_exchange;
  if (opts.pair_first_ready)
    no_exchange.emplace(
        "a deferred W exchanged with its peers (it recomputed an expert layer's forward) while "
        "the pairs take turns as messages arrive, where it could wait on peers that wait on "
        "this rank; take fixed turns (pair_turns 'fixed', --pair-turns fixed), or keep the "
        "expert layers out of what a W recomputes");
  if (!stage.backward_weight_part(s, mb, parts)) return false;
  deferred_w.pop_front();
  return true;
}

// Runs the oldest deferred W (there is one), or the next of `parts` parts
// of it (NOTE [dw in parts] in hp/autograd/grad_function.cpp), as an action
// of its own: its event once done (one for its parts together, as long as
// their compute), its profiler range, its place in `executed`; errors name it.
void Executor::State::run_deferred_w_span(int parts) {
  const Action w = Action::make(Op::W, deferred_w.front().first, deferred_w.front().second);
  if (w_parts.start < 0) w_parts.start = timer->mark();
  const auto began = std::chrono::steady_clock::now();
  ChunkWaits own;  // its own, not the action's it runs in (NOTE [A chunk's own waits])
  bool done = false;
  try {
    ProfiledAction range(w);
    distributed::WaitObserverScope observe(&own);
    ReceiveScope not_a_receive(false);  // it may run in one's wait
    done = run_deferred_w(parts);
  } catch (const distributed::CommError& e) {
    throw e.with_context(where(w) + " (deferred): ");
  } catch (const std::exception& e) {
    const std::string refused = distributed::take_exchange_refusal();
    throw std::runtime_error(where(w) + " (deferred): " + (refused.empty() ? e.what() : refused));
  }
  own.finish();
  const double ran =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  if (own_waits_of_running != nullptr)  // not a node of the action it ran in
    own_waits_of_running->exclude(ran);
  WParts& wp = w_parts;
  ++wp.calls;
  wp.compute += ran - own.seconds;
  wp.waits += own.count;
  wp.waited += own.seconds;
  if (!done) return;
  if (wp.calls == 1)  // whole: its marks time it (on a device, its events)
    spans.push_back({w, wp.start, timer->mark(), {}, -1, own.count, own.seconds, own.nodes});
  else
    spans.push_back({w, wp.start, timer->mark(), {}, wp.compute, wp.waits, wp.waited, {}});
  stats.executed.push_back(w);
  wp = WParts{};
}

}  // namespace hp::pipeline
