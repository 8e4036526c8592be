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
  /// Waits on communication inside the action besides its input's (an
  /// expert layer's dispatch and combine), and their seconds in flight in
  /// all (NOTE [Waits inside a chunk] in simulate.h). A compute event's span
  /// holds its compute only, so those waits are outside it.
  int waits = 0;
  double waited = 0.0;
  /// Where measured: its compute between those waits, in order (waits + 1
  /// nodes); empty otherwise.
  std::vector<double> nodes{};
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
