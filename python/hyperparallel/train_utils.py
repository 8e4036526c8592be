"""Small pieces a training script around hyperparallel.pipeline needs: a
progress bar, the measured timeline of a step gathered from every rank, and
a JSON report written atomically, and the end of a run (summary, report,
trace) that examples/train_gpt.py and examples/train_hf.py share."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, TextIO

import torch.distributed as dist

from . import schedule as hs

__all__ = ["Progress", "gather_step_stats", "measured_timeline", "step_summary", "write_report",
           "finish_run"]


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


def finish_run(pipe, chunks: Mapping[int, Any], *, what: str, losses: Sequence[float],
               step_seconds: Sequence[float], items_per_step: int, report: Dict[str, Any],
               report_path: str = "", trace_path: str = "", unit: str = "tokens") -> None:
    """The end of a training script (a collective: every rank calls it):
    the last step's measurements from every rank and a checksum of the
    trained chunks (each chunk counted once, by the first rank holding it);
    rank 0 prints the summary, and writes ``report`` (completed with the
    losses, step times, throughput, checksum and last step) to
    ``report_path`` and the measured timeline to ``trace_path`` (Chrome
    trace) and ``trace_path + ".svg"``."""
    import statistics

    import torch

    sched, rank = pipe.schedule, pipe.rank
    per_rank = gather_step_stats(pipe.last_stats)
    holders: Dict[int, set] = {}
    for st, r in enumerate(sched.stage_rank):
        holders.setdefault(sched.stage_chunk[st], set()).add(r)
    mine = sum(q.detach().double().sum().item() for c, mod in chunks.items()
               if min(holders[c]) == rank for q in mod.parameters())
    checksum = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(checksum)
    if rank != 0:
        return
    timed = list(step_seconds[1:]) if len(step_seconds) > 1 else list(step_seconds)
    median = statistics.median(timed)
    last = step_summary(per_rank)
    report = dict(report)
    report.update({
        "loss": list(losses), "step_seconds": list(step_seconds), "median_step_seconds": median,
        f"{unit}_per_second": items_per_step / median, "parameter_checksum": checksum.item(),
        "last_step": last,
    })
    ranks_text = "\n".join(
        f"  rank {r['rank']}: compute {1e3 * r['compute']:.1f} ms, waiting "
        f"{1e3 * r['comm_wait']:.1f} ms, executor overhead {1e3 * r['overhead']:.2f} ms"
        for r in last["ranks"])
    print(f"{what}: {len(losses)} steps\n"
          f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}\n"
          f"  median step {1e3 * median:.1f} ms, {items_per_step / median:,.0f} {unit}/s; "
          f"bubble measured {100 * last.get('measured_bubble', 0.0):.1f} % (last step)\n"
          f"{ranks_text}\n  parameter checksum {checksum.item():.9f}")
    if report_path:
        write_report(report_path, report)
        print(f"  report: {report_path}")
    if trace_path:
        in_ms = [{**s, "events": [(act, 1e3 * b, 1e3 * e) for act, b, e in s["events"]]}
                 for s in per_rank]  # the renderers read one time unit as one millisecond
        timeline = measured_timeline(in_ms, f"{report.get('schedule', '')} (measured, last step)")
        with open(trace_path, "w") as f:
            f.write(hs.render_chrome_trace(timeline))
        with open(trace_path + ".svg", "w") as f:
            f.write(hs.render_svg(timeline))
        print(f"  trace: {trace_path} (chrome://tracing, ui.perfetto.dev) and {trace_path}.svg")
