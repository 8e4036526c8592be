// hp/schedule/timeline.h: timed actions of ranks - a simulated run or one a
// runtime measured - the common input of the renderers and of
// timeline_stats (simulate.h).
#pragma once

#include <string>
#include <vector>

#include "hp/schedule/action.h"

namespace hp::schedule {

/// One timed action of one rank: simulated, or measured by a runtime.
struct Event {
  int rank = 0;
  Action action;
  double start = 0.0;
  double end = 0.0;
};

/// A set of timed events over ranks: the common input of every renderer.
/// The runtime feeds its measured timeline here too.
struct Timeline {
  int num_ranks = 0;
  std::vector<Event> events;  ///< in any order
  std::string title;          ///< shown by renderers when not empty
  /// Latest end over all events (0 when empty).
  double makespan() const;
};

}  // namespace hp::schedule
