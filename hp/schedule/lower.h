// hp/schedule/lower.h: lowering (adding SEND/RECV to compute-only action
// lists) and validation (counts, order, matched messages, no deadlock).
#pragma once

#include "hp/schedule/schedule.h"

namespace hp::schedule {

// NOTE [Lowering and message order]
// A cross-rank hand-off is one message: SEND_F(s, mb) on the rank of s after
// the F that produces it, RECV_F(next, mb) on the consumer's rank before the
// F that reads it (SEND_B/RECV_B likewise for the input gradient, from I, B
// or FB). Consecutive stages on one rank hand off locally: no message.
// A runtime posts SEND and RECV actions exactly where they stand, in list
// order, each run of them between two compute actions as one batch, and
// matches messages by order alone - no tags (NCCL ignores them) - and on
// NCCL a rank's operations even run one after the other on one stream, a
// send finishing only with its receive. So lower() gives the messages one
// global order, the order in which one valid execution sends them, and
// every rank's SENDs and RECVs follow it: then the two ranks of every pair
// agree on their messages' order, and no cycle of ranks waiting on each
// other can form. Each RECV is placed one compute action before its
// consumer when that order allows (so its data arrives while the rank
// computes), later when it must; a batch lists its SENDs before its RECVs
// (NOTE [Sends before receives] in lower.cpp). validate() checks
// per-channel order, that no cycle can form with operations run in posting
// order (NOTE [Batch order]), and that no rank waits forever for its inputs.

/// Returns a copy of s with SEND/RECV actions added (s must be compute-only).
/// Throws std::invalid_argument if s is already lowered.
Schedule lower(const Schedule& s);

/// Checks a schedule (compute-only or lowered) and throws
/// std::invalid_argument naming the rank, the action index and the action:
/// placement of every action, exactly one F and one B (or one I and one W)
/// per (stage, microbatch) on its route, F before I before W (or B), and if
/// lowered every message sent once and received once, sends after their
/// producer, receives before their consumer, per-channel order consistent,
/// no cycle when each rank's SEND/RECV runs start in posting order (NOTE
/// [Lowering and message order]); finally that execution with blocking
/// receives cannot deadlock.
void validate(const Schedule& s);

}  // namespace hp::schedule
