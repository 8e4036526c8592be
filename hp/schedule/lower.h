// hp/schedule/lower.h: lowering (adding SEND/RECV to compute-only action
// lists) and validation (counts, order, matched messages, no deadlock).
#pragma once

#include "hp/schedule/schedule.h"

namespace hp::schedule {

// NOTE [Lowering and message order]
// A cross-rank hand-off is one message: SEND_F(s, mb) on the rank of s after
// the F that produces it, RECV_F(next, mb) on the consumer's rank before the
// F that reads it (SEND_B/RECV_B likewise for the input gradient, from I, B
// or FB). Consecutive stages on one rank hand off locally: no message. Sends
// are asynchronous; a runtime posts each receive at its RECV (irecv) and waits
// at the consumer. On every channel (ordered pair of ranks) the receiver's
// RECVs come in the same order as the sender's SENDs, so a runtime may match
// messages by order alone (NCCL-style); a RECV is moved earlier if needed to
// keep that order. validate() then checks, with receives treated as blocking,
// that no rank waits forever.

/// Returns a copy of s with SEND/RECV actions added (s must be compute-only).
/// Throws std::invalid_argument if s is already lowered.
Schedule lower(const Schedule& s);

/// Checks a schedule (compute-only or lowered) and throws
/// std::invalid_argument naming the rank, the action index and the action:
/// placement of every action, exactly one F and one B (or one I and one W)
/// per (stage, microbatch) on its route, F before I before W (or B), and if
/// lowered every message sent once and received once, sends after their
/// producer, receives before their consumer, per-channel order consistent;
/// finally that execution with blocking receives cannot deadlock.
void validate(const Schedule& s);

}  // namespace hp::schedule
