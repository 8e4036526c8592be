// hp/schedule/schedule.h: the Schedule, a pipeline schedule as plain data
// (placement of virtual stages, model chunks, microbatch routes, per-rank
// action lists), and its CSV form.
#pragma once

#include <cstddef>
#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

#include "hp/schedule/action.h"

namespace hp::schedule {

// NOTE [Schedule data model]
// A Schedule is self-describing: a runtime executes one rank's list without
// knowing which generator made it.
//
// - `num_ranks` ranks run `num_stages` *virtual stages*. `stage_rank[s]` is the
//   rank that runs stage s (loop placement: s % p; V placement: rank r holds
//   stages r and 2p-1-r).
// - `stage_chunk[s]` is the *model chunk* stage s computes (the model is cut
//   into `num_chunks` consecutive chunks). Usually chunk == stage. DualPipe
//   runs two mirrored copies of the model: stage s (s < p) computes chunk s on
//   rank s and stage p+j computes chunk j on rank p-1-j. Two virtual stages
//   with the same chunk hold copies of the same weights: the runtime must sum
//   their weight gradients (and keep the weights identical).
// - every microbatch follows a *route*: the ordered list of virtual stages it
//   flows through, forward in route order, backward in reverse. `routes`
//   holds the distinct routes and `microbatch_route[mb]` indexes into it.
//   Normally there is one route 0..S-1; DualPipe sends microbatches
//   [0, m/2) down route 0..p-1 and [m/2, m) up route p..2p-1.
// - the first stage of a route reads the microbatch's input; the last stage
//   computes the loss and starts the backward from it.
// - `actions[r]` is rank r's ordered list. Compute actions only after
//   `build`; `lower` adds SEND/RECV (then `lowered` is true). Each (stage, mb)
//   on a route gets exactly one F and either one B or one I and one W (an FB
//   counts as the F of its first half and the B of its second half).
// - A hand-off between consecutive route stages on the same rank (V
//   placement's turn) is local: no SEND/RECV.

/// A pipeline schedule as data (see NOTE [Schedule data model]).
struct Schedule {
  std::string name;                          ///< generator name, informative only
  int num_ranks = 0;                         ///< pipeline ranks p
  int num_stages = 0;                        ///< virtual stages S
  int num_microbatches = 0;                  ///< microbatches m
  int num_chunks = 0;                        ///< distinct model chunks
  std::vector<int> stage_rank;               ///< [S] rank that runs each stage
  std::vector<int> stage_chunk;              ///< [S] model chunk each stage computes
  std::vector<std::vector<int>> routes;      ///< distinct routes (lists of stages)
  std::vector<int> microbatch_route;         ///< [m] index into routes
  std::vector<std::vector<Action>> actions;  ///< [p] ordered action list per rank
  bool lowered = false;                      ///< true once SEND/RECV were added

  /// The route (ordered stages) of microbatch mb.
  const std::vector<int>& route(int mb) const { return routes.at(microbatch_route.at(mb)); }
  /// Position of `stage` on mb's route, or -1 if the microbatch does not visit it.
  int route_position(int stage, int mb) const;
  /// The stage after `stage` on mb's route, or -1 at the route's end.
  int next_stage(int stage, int mb) const;
  /// The stage before `stage` on mb's route, or -1 at the route's start.
  int prev_stage(int stage, int mb) const;
  /// Stages held by rank r, in increasing order.
  std::vector<int> stages_of_rank(int r) const;
  /// The pairs of ranks (lower first, sorted) that the schedule's transfers
  /// join: a stage's rank and the rank of the next stage on a microbatch's
  /// route, where they differ. Activations go one way, gradients the other.
  std::vector<std::pair<int, int>> rank_links() const;
  /// Whether some rank's list holds an FB pair (what `--fb-overlap` overlaps).
  bool has_pairs() const;

  /// Checks the placement fields (sizes, ranges, routes); throws
  /// std::invalid_argument saying what is inconsistent. Called by generators
  /// and by read_csv; validate() checks the action lists.
  void check_layout() const;
  /// Rebuilds the route-position index after routes changed (generators and
  /// read_csv call it; it makes next_stage/prev_stage O(1)).
  void index_routes();

  std::vector<std::vector<int>> route_pos_;  ///< [route][stage] -> position or -1
};

/// Loop placement: stage s on rank s % p, chunk s, one route 0..S-1.
Schedule make_loop_layout(int ranks, int stages, int microbatches);
/// V placement: rank r holds stages r and 2p-1-r, chunk s, one route 0..2p-1.
Schedule make_v_layout(int ranks, int microbatches);

/// Writes the schedule as CSV: `#` metadata lines (name, placement, chunks,
/// routes) then one row per rank, its actions comma-separated.
void write_csv(const Schedule& s, std::ostream& out);
/// The CSV as a string.
std::string to_csv(const Schedule& s);
/// Largest schedule CSV (or cost file) the readers accept: 16 MiB.
constexpr std::size_t kMaxInputBytes = std::size_t{16} << 20;

// NOTE [One size rule]
// Lowering and validating a schedule take time growing with ranks x
// (microbatches x stages per rank)^2 (measured: 8 x 1024^2, about 2.5 s on
// two cores), and a generator asked for 1e9 microbatches grew its action
// lists by about 1.2 GB/s. So every entry point - the generators
// (`build`), the CSV reader, `hp schedule`, `hp train -s` and
// `--schedule-file`, `hp profile`, the Python bindings - checks one rule
// before any work: at most kMaxScheduleRanks ranks, and ranks x
// (microbatches x stages per rank)^2 at most kMaxScheduleWork.
constexpr int kMaxScheduleRanks = 4096;
constexpr double kMaxScheduleWork = double(1 << 23);
/// Throws std::invalid_argument naming `what`, the sizes and the largest
/// microbatch count allowed at these ranks when the rule above is broken.
void check_schedule_size(const std::string& what, int ranks, int microbatches,
                         double stages_per_rank);

/// Reads a CSV written by write_csv. Without metadata lines (plain rows of
/// actions, one row per rank) it infers a loop layout from the actions.
/// Strict (NOTE [Strict schedule CSV]): throws std::invalid_argument naming
/// `source`, the line, the rank and the text (escaped) on any disagreement.
Schedule read_csv(std::istream& in, const std::string& source = "csv");
/// read_csv from a string.
Schedule from_csv(const std::string& text, const std::string& source = "csv");

/// One rank's actions as a single line ("0F0 0F1 0B0 ..."), for messages and tests.
std::string format_actions(const std::vector<Action>& actions);

}  // namespace hp::schedule
