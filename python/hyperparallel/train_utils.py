"""Small pieces a training script around hyperparallel.pipeline needs: a
progress bar, the measured timeline of a step gathered from every rank, and
a JSON report written atomically, and the end of a run (summary, report,
trace) that examples/train_gpt.py and examples/train_hf.py share."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple

import torch.distributed as dist

from . import schedule as hs

__all__ = ["Progress", "gather_step_stats", "measured_timeline", "step_summary", "write_report",
           "finish_run", "positive", "positive_float", "add_pipeline_arguments",
           "check_pipeline_arguments", "require_torchrun", "EXAMPLE_SCHEDULES"]

#: The schedules the example scripts offer (every generator but afab, gpipe's alias).
EXAMPLE_SCHEDULES = ["naive", "gpipe", "1f1b", "interleaved-1f1b", "interleaved-1f1b-fb",
                     "interleaved-bfs", "interleaved-zb", "zb-h1", "zb-h2", "zbv", "zbv-fb",
                     "dualpipe", "dualpipev", "zb-auto",
                     "zbv-auto", "v-min", "v-half", "v-zb", "auto"]


def positive(what: str):
    """An argparse type: a whole number >= 1, the error naming ``what``."""
    import argparse

    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number, got '{text}'")
        if v < 1:
            raise argparse.ArgumentTypeError(f"{what} must be at least 1, got {v}")
        return v
    return parse


def positive_float(what: str):
    """An argparse type: a finite number > 0, the error naming ``what``."""
    import argparse
    import math

    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got '{text}'")
        if not (v > 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"{what} must be a positive number, got {text}")
        return v
    return parse


def add_pipeline_arguments(ap, *, microbatch_size_help: str = "sequences per microbatch") -> None:
    """The options every example takes: the schedule, its size, the run's
    length, outputs and timeout."""
    ap.add_argument("--schedule", "-s", default="zbv", metavar="NAME",
                    help="any hyperparallel schedule: " + ", ".join(EXAMPLE_SCHEDULES)
                    + " (default zbv)")
    ap.add_argument("--chunks", "-v", type=positive("--chunks"), default=2,
                    help="virtual stages per rank of the interleaved schedules (default 2)")
    ap.add_argument("--steps", type=positive("--steps"), default=20,
                    help="optimizer steps (default 20)")
    ap.add_argument("--microbatches", "-m", type=positive("--microbatches"), default=8,
                    help="microbatches per step (default 8)")
    ap.add_argument("--microbatch-size", type=positive("--microbatch-size"), default=4,
                    help=f"{microbatch_size_help} (default 4)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data")
    ap.add_argument("--report", default="", metavar="FILE",
                    help="write losses, step times and the last step's measurements as JSON")
    ap.add_argument("--trace", default="", metavar="FILE",
                    help="write the last step's measured timeline: Chrome trace FILE and FILE.svg")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--timeout", type=positive_float("--timeout"), default=300.0,
                    help="seconds any communication may wait (default 300)")


def require_torchrun(ap, script: str, argv) -> Tuple[int, int]:
    """(rank, world size) from torchrun's variables, else one clear error;
    on ranks other than 0 errors exit quietly (rank 0 says the same)."""
    if os.environ.get("RANK", "0") != "0":
        ap.error = lambda message: sys.exit(2)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        ap.error(f"start this script with torchrun, one process per pipeline rank: "
                 f"torchrun --nproc-per-node 2 {script} "
                 + " ".join(sys.argv[1:] if argv is None else argv))
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def check_pipeline_arguments(ap, a, world: int):
    """What add_pipeline_arguments' options must satisfy before the ranks
    talk (the same answer on every rank): a known schedule that this many
    ranks and microbatches can run, output folders that exist. Returns the
    schedule."""
    if a.schedule not in EXAMPLE_SCHEDULES:
        ap.error(f"--schedule: unknown schedule '{a.schedule}'; use one of "
                 f"{', '.join(EXAMPLE_SCHEDULES)}")
    if not 0 <= a.seed < 2**64:
        ap.error(f"--seed must be in [0, 2**64), got {a.seed}")
    from . import _C, pipeline

    # Before any training: a folder that is missing, read-only or full of
    # the wrong kind of thing fails now, not after the run.
    for flag, path in (("--report", a.report), ("--trace", a.trace),
                       ("--trace", a.trace + ".svg" if a.trace else "")):
        if path:
            try:
                _C.text.check_output_path(path, flag)
            except ValueError as e:
                ap.error(str(e))

    try:
        return pipeline.schedule(a.schedule, ranks=world, microbatches=a.microbatches,
                                 chunks=a.chunks)
    except ValueError as e:
        ap.error(f"--schedule {a.schedule} with {world} ranks and {a.microbatches} "
                 f"microbatches: {e}")


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
    """Writes ``report`` as indented JSON as hp writes its files: a reader
    never sees half a file, a failed write leaves no temporary and the old
    file as it was, and a device, FIFO or symlink at the path stays what it
    is (NOTE [Output files are whole] in hp/schedule/text.cpp)."""
    from . import _C

    _C.text.write_text_file(os.fspath(path), json.dumps(report, indent=1) + "\n")


def finish_run(pipe, chunks: Mapping[int, Any], *, what: str, losses: Sequence[float],
               step_seconds: Sequence[float], items_per_step: int, report: Dict[str, Any],
               report_path: str = "", trace_path: str = "", unit: str = "tokens",
               group: Optional[dist.ProcessGroup] = None) -> None:
    """The end of a training script (a collective: every rank calls it):
    the last step's measurements from every rank and a checksum of the
    trained chunks (each chunk counted once, by the first rank holding it);
    rank 0 prints the summary, and writes ``report`` (completed with the
    losses, step times, throughput, checksum and last step) to
    ``report_path`` and the measured timeline to ``trace_path`` (Chrome
    trace) and ``trace_path + ".svg"``. ``group``: the pipeline's ranks
    when there are several copies of it (data parallel; the copies' weights
    are equal, FSDP2's shards are gathered); the world's rank 0 prints."""
    import statistics

    import torch

    sched, rank = pipe.schedule, pipe.rank
    per_rank = gather_step_stats(pipe.last_stats, group)
    holders: Dict[int, set] = {}
    for st, r in enumerate(sched.stage_rank):
        holders.setdefault(sched.stage_chunk[st], set()).add(r)
    from torch.distributed.tensor import DTensor

    mine = sum((q.full_tensor() if isinstance(q, DTensor) else q).detach().double().sum().item()
               for c, mod in chunks.items() if min(holders[c]) == rank for q in mod.parameters())
    checksum = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(checksum, group=group)
    if dist.get_rank() != 0:
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
        from . import _C

        _C.text.write_text_file(trace_path, hs.render_chrome_trace(timeline))
        _C.text.write_text_file(trace_path + ".svg", hs.render_svg(timeline))
        print(f"  trace: {trace_path} (chrome://tracing, ui.perfetto.dev) and {trace_path}.svg")


def end_rank(code: int = 0) -> None:
    """Ends a rank's process once its work is done and written, without the
    interpreter's shutdown (the last call of a rank's script).

    NOTE [Gloo work freed during shutdown]: a Gloo group's worker thread
    frees a finished collective (e.g. the last barrier, which keeps the
    collectives before it) after the waiting Python thread has moved on; a
    group still referenced (by a DeviceMesh, FSDP2, a Pipeline) outlives
    destroy_process_group and is freed during the interpreter's shutdown.
    When that collective holds a tensor made in Python, freeing it takes the
    GIL; if the interpreter is finalizing by then, the thread is made to
    exit inside C++ that may not unwind, and the process aborts ("terminate
    called without an active exception", a core of a
    ProcessGroupGloo::runLoop thread in PyEval_AcquireThread). It hit 3 of
    63 runs of bench/peers/paired.py, and a rank of
    bench/python/bench_graph_fsdp.py once in a full test run. The rank has
    nothing left to do, so it leaves at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
