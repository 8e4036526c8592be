"""Small pieces a training script around hyperparallel.pipeline needs: a
progress bar, the measured timeline of a step gathered from every rank, and
a JSON report written atomically (what examples/train_gpt.py uses)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, TextIO

import torch.distributed as dist

from . import schedule as hs

__all__ = ["Progress", "gather_step_stats", "measured_timeline", "step_summary", "write_report"]


class Progress:
    """One updating line on a terminal: a bar, the step, the loss, throughput
    and the time left. Prints nothing when ``enabled`` is false or ``stream``
    is not a terminal (logs stay clean); :meth:`close` ends the line."""

    def __init__(self, total: int, *, enabled: bool = True, stream: Optional[TextIO] = None,
                 unit: str = "tokens", width: int = 24):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(enabled) and callable(isatty) and isatty()
        self.total, self.unit, self.width = total, unit, width
        self.done = 0
        self.start = time.monotonic()
        self._open = False

    def update(self, step: int, loss: float, items_per_second: float) -> None:
        """Shows that step ``step`` (0-based) ended with ``loss``."""
        self.done = step + 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        filled = self.width * self.done // self.total if self.total > 0 else self.width
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(
            f"\r[{bar}] step {self.done}/{self.total}  loss {loss:.4f}  "
            f"{items_per_second:,.0f} {self.unit}/s  ETA {left:.0f}s\x1b[K"
        )
        self.stream.flush()
        self._open = True
        if self.done >= self.total:
            self.close()

    def close(self) -> None:
        """Ends the line (once)."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def gather_step_stats(stats: Mapping[str, Any], group: Optional[dist.ProcessGroup] = None
                      ) -> List[Dict[str, Any]]:
    """Every rank's ``Pipeline.last_stats`` (wall, compute, comm_wait, overhead,
    events), in rank order, on every rank of ``group`` (a collective: call it
    on all of them)."""
    keys = ("wall", "compute", "comm_wait", "overhead", "events")
    mine = {k: stats[k] for k in keys if k in stats}
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def measured_timeline(per_rank: Sequence[Mapping[str, Any]],
                      title: str = "measured") -> hs.Timeline:
    """The step's executed actions as a :class:`hyperparallel.schedule.Timeline`
    (seconds from each rank's step start; start the step after a barrier so
    the ranks' clocks line up). Draw it with ``schedule.render_svg`` or
    ``render_chrome_trace``; ``schedule.timeline_stats`` measures its bubble."""
    events = [hs.Event(r, action, start, end)
              for r, s in enumerate(per_rank) for action, start, end in s.get("events", [])]
    return hs.Timeline(num_ranks=len(per_rank), events=events, title=title)


def step_summary(per_rank: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Per-rank seconds of one step (compute, comm_wait, overhead, wall) and the
    measured bubble of its compute actions (``timeline_stats``)."""
    out: Dict[str, Any] = {
        "ranks": [{"rank": r, **{k: s.get(k) for k in ("wall", "compute", "comm_wait", "overhead")}}
                  for r, s in enumerate(per_rank)],
    }
    timeline = measured_timeline(per_rank)
    if len(timeline):
        st = hs.timeline_stats(timeline)  # compute actions only
        out["measured_bubble"] = st.bubble_rate
        out["measured_makespan_seconds"] = st.makespan
    return out


def write_report(path: str | os.PathLike, report: Mapping[str, Any]) -> None:
    """Writes ``report`` as indented JSON; a reader never sees half a file."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
