// hp/schedule/render.h: pictures of a Timeline (simulated or measured):
// ASCII for the terminal, SVG for slides, Chrome/Perfetto trace JSON; and the
// statistics of a simulation as text and JSON.
#pragma once

#include <string>
#include <vector>

#include "hp/schedule/simulate.h"

namespace hp::schedule {

/// Options of render_ascii().
struct AsciiOptions {
  int max_width = 160;  ///< maximum characters of the timeline part of a row
  bool color = false;   ///< ANSI background colours per op
};

/// One row per rank: each action drawn over its duration as its op letter and
/// microbatch (`F3`, `I0`, `W2`, `B1`; an FB pair as its F half then its B
/// half), bubbles as `.`. Time is scaled so the shortest action still shows
/// its label when the width allows.
std::string render_ascii(const Timeline& t, const AsciiOptions& opts = {});

/// Options of render_svg().
struct SvgOptions {
  double width = 1200;     ///< picture width in pixels
  double row_height = 22;  ///< pixels per rank row
  bool microbatch_labels = true;
};

/// An SVG picture: one row per rank (labelled), F, I, W, B in distinct
/// colours (FB as F beside B), microbatch numbers in the boxes, bubbles blank,
/// a legend. Several timelines are stacked on one shared time scale, each
/// under its title.
std::string render_svg(const std::vector<Timeline>& timelines, const SvgOptions& opts = {});
/// render_svg of one timeline.
std::string render_svg(const Timeline& t, const SvgOptions& opts = {});

/// Chrome / Perfetto trace JSON ("traceEvents", complete events, one thread
/// per rank). One time unit of the timeline is written as 1 ms.
std::string render_chrome_trace(const Timeline& t);

/// The statistics of a simulation as aligned text, what a user picks by
/// first: step time (makespan), idle fraction, then the paper's bubble rate,
/// communication volume, peak memory, and busy/idle/peak memory per rank.
std::string summary_text(const SimResult& r);
/// The statistics as a JSON object (no timeline).
std::string summary_json(const SimResult& r, const std::string& name = "");

}  // namespace hp::schedule
