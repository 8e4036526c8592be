"""Pipeline schedules as data: list, build, validate, lower, simulate, render, CSV.

The types and most functions are hyperparallel's C++ schedule room
(``hp/schedule``) as they are; this module adds the Python conveniences:
keyword arguments, memory limits as multiples (``mem_limit="2x"``), renderers
that take a schedule, a simulation result or a timeline, and files.

Every error that is the caller's fault is a ``ValueError`` with the C++
message (which names the constraint, the rank, the action or the CSV line);
wrong argument types are ``TypeError``.

>>> from hyperparallel import schedule as hs
>>> s = hs.build("zb-h1", ranks=4, microbatches=8)
>>> r = hs.simulate(s, hs.CostModel(f=1, b=1, w=1))
>>> round(r.bubble_rate, 4)   # the Zero Bubble paper's (p-1)(F+B-W) / span
0.1111
"""

from __future__ import annotations

import os
from typing import Iterable, List, NamedTuple, Sequence, Tuple, Union

from ._C import schedule as _C

# The C++ types and the functions that need nothing more.
Op = _C.Op
Action = _C.Action
Schedule = _C.Schedule
CostModel = _C.CostModel
InnerComm = _C.InnerComm
Event = _C.Event
Timeline = _C.Timeline
SimResult = _C.SimResult
ClosedForm = _C.ClosedForm

names = _C.names
describe = _C.describe
validate = _C.validate
lower = _C.lower
comm_volume = _C.comm_volume
timeline_stats = _C.timeline_stats
closed_form = _C.closed_form
span_lower_bound = _C.span_lower_bound
to_csv = _C.to_csv
from_csv = _C.from_csv
parse_stage_costs = _C.parse_stage_costs
summary_text = _C.summary_text
summary_json = _C.summary_json
MAX_INPUT_BYTES = _C.MAX_INPUT_BYTES

__all__ = [
    "Op",
    "Action",
    "Schedule",
    "CostModel",
    "InnerComm",
    "Event",
    "Timeline",
    "SimResult",
    "ClosedForm",
    "names",
    "describe",
    "build",
    "zb_auto",
    "recommend",
    "Recommendation",
    "span_lower_bound",
    "validate",
    "lower",
    "simulate",
    "DeferredWChoice",
    "choose_deferred_w",
    "comm_volume",
    "timeline_stats",
    "closed_form",
    "render_ascii",
    "render_svg",
    "render_chrome_trace",
    "summary_text",
    "summary_json",
    "to_csv",
    "from_csv",
    "read_csv",
    "write_csv",
    "read_stage_costs",
    "parse_stage_costs",
    "mem_limit_value",
]

MemLimit = Union[None, int, float, str]


def mem_limit_value(mem_limit: MemLimit, ranks: int, costs: CostModel | None = None) -> float:
    """A memory limit as the number the C++ generators take.

    ``None`` or 0: the generator's default (zb-auto: 2 p mem_b, the Zero
    Bubble paper's ZB-2p; zbv-auto and auto: p mem_b). A number: that limit,
    in the units of ``costs.mem_b``. A string ``"Kx"``: K times ``ranks *
    costs.mem_b``, as the CLI's ``--mem-limit 2x`` (``"1x"`` is the paper's
    ZB-1p)."""
    if mem_limit is None:
        return 0.0
    if isinstance(mem_limit, bool):
        raise TypeError("mem_limit must be a number or a string like '2x', got bool")
    if isinstance(mem_limit, (int, float)):
        return float(mem_limit)
    if isinstance(mem_limit, str):
        text = mem_limit.strip()
        if text.endswith("x"):
            try:
                k = float(text[:-1])
            except ValueError:
                raise ValueError(
                    f"mem_limit {mem_limit!r}: expected a number or a multiple like '2x'"
                ) from None
            if not k > 0:
                raise ValueError(f"mem_limit {mem_limit!r}: the multiple must be positive")
            mem_b = (costs if costs is not None else CostModel()).mem_b
            return k * ranks * mem_b
        try:
            return float(text)
        except ValueError:
            raise ValueError(
                f"mem_limit {mem_limit!r}: expected a number or a multiple like '2x'"
            ) from None
    raise TypeError(f"mem_limit must be a number or a string like '2x', got {type(mem_limit).__name__}")


def build(
    name: str,
    ranks: int,
    microbatches: int,
    *,
    chunks: int = 2,
    costs: CostModel | None = None,
    mem_limit: MemLimit = None,
) -> Schedule:
    """Builds the named schedule (compute actions only; ``lower`` adds SEND/RECV).

    ``chunks`` is v, the stages per rank of the interleaved schedules;
    ``costs`` and ``mem_limit`` are what the searches (zb-auto, zbv-auto, auto)
    search under (see :func:`mem_limit_value`). ``names()`` lists the generators. An unmet
    constraint is a ValueError that says what to change, e.g. ``needs
    microbatches divisible by ranks (m % p == 0); got m=6, p=4; use m=8``."""
    costs = costs if costs is not None else CostModel()
    return _C.build(
        name,
        ranks,
        microbatches,
        chunks=chunks,
        costs=costs,
        mem_limit=mem_limit_value(mem_limit, ranks, costs),
    )


def zb_auto(
    ranks: int,
    microbatches: int,
    costs: CostModel | None = None,
    *,
    mem_limit: MemLimit = None,
    refine_work: int = 20_000_000,
) -> Schedule:
    """zb-auto with its search budget: the Zero Bubble paper's heuristics under
    ``costs`` within ``mem_limit`` (default 2 p mem_b), then ``refine_work``
    simulated actions of local search (0 turns it off). Deterministic."""
    costs = costs if costs is not None else CostModel()
    return _C.zb_auto(
        ranks,
        microbatches,
        costs,
        mem_limit=mem_limit_value(mem_limit, ranks, costs),
        refine_work=refine_work,
    )


class Recommendation(NamedTuple):
    """One row of :func:`recommend`: a schedule, its simulated step under the
    costs (``result.makespan``, ``result.peak_memory`` per rank) and whether
    its peak fits the memory limit."""

    name: str
    schedule: Schedule
    result: SimResult
    fits: bool


def recommend(
    ranks: int,
    microbatches: int,
    costs: CostModel | None = None,
    *,
    mem_limit: MemLimit = "1x",
) -> Tuple[List[Recommendation], List[Tuple[str, str]]]:
    """Which schedule should I run? Every schedule we have and ``auto`` (the
    best schedule the memory-budget search finds within ``mem_limit``; see
    :func:`mem_limit_value`, default 1F1B's memory), built for ``ranks`` and
    ``microbatches`` and simulated under ``costs`` (e.g.
    :func:`read_stage_costs` of an ``hp train --report``): the ones within the
    limit first, each group by step time. Returns the rows and the generators
    whose constraints these sizes do not meet, with why (``hp schedule
    recommend``; ``write_csv(rows[0].schedule, path)`` writes one that ``hp
    train --schedule-file`` runs)."""
    costs = costs if costs is not None else CostModel()
    rows, skipped = _C.recommend(ranks, microbatches, costs,
                                 mem_limit_value(mem_limit, ranks, costs))
    return [Recommendation(*row) for row in rows], list(skipped)


def simulate(
    schedule: Schedule,
    costs: CostModel | None = None,
    *,
    record_timeline: bool = True,
    fb_overlap: bool = False,
    defer_wgrad: bool = False,
    pair_turns: str = "auto",
    w_parts: int = 1,
) -> SimResult:
    """Runs the schedule (validated first) under ``costs`` (unit costs by default).

    ``fb_overlap`` runs each FB pair as ``hp train --fb-overlap`` does, its
    halves taking turns at their waits; ``defer_wgrad``, ``pair_turns``
    ("auto", "ready", "fixed") and ``w_parts`` (each deferred W in that many
    parts under ready turns) as that command's flags. The result's
    ``rank_pair_hidden`` / ``rank_pair_exposed`` then count the pairs' waits
    (NOTE [What a pair hides, predicted] in hp/schedule/simulate.cpp)."""
    return _C.simulate(schedule, costs if costs is not None else CostModel(),
                       record_timeline=record_timeline, fb_overlap=fb_overlap,
                       defer_wgrad=defer_wgrad, pair_turns=pair_turns, w_parts=w_parts)


class DeferredWChoice(NamedTuple):
    """What :func:`choose_deferred_w` predicts: the steps (makespans) and
    peak memory without and with deferred W's, and whether they are taken."""

    defer: bool
    step_without: float
    step_with: float
    peak_without: float
    peak_with: float


def choose_deferred_w(
    schedule: Schedule,
    costs: CostModel | None = None,
    *,
    pair_turns: str = "auto",
    cpu: bool = True,
    recompute: bool = False,
    gain: float = _C.DEFERRED_W_GAIN,
) -> DeferredWChoice:
    """The choice ``hp train --fb-overlap`` and ``Pipeline(fb_overlap=True)``
    make after their second step, under any costs: the schedule's
    overlapped pairs simulated without deferred W's and with them, each with
    the turns ``pair_turns`` takes for it (on CPU ranks; on a device the
    turns are fixed); ``defer`` where the step with them is ``gain`` (3 %)
    shorter (NOTE [Deferred W's where they lower the step] in
    hp/schedule/simulate.cpp). Ready turns with ``recompute`` take no
    deferred W's: ``step_with`` is 0 then."""
    return DeferredWChoice(*_C.choose_deferred_w(
        schedule, costs if costs is not None else CostModel(), pair_turns=pair_turns, cpu=cpu,
        recompute=recompute, gain=gain))


Drawable = Union[Timeline, SimResult, Schedule]


def _timeline(what: Drawable, costs: CostModel | None) -> Timeline:
    if isinstance(what, Timeline):
        return what
    if isinstance(what, SimResult):
        if not what.timeline.events and what.makespan > 0:
            raise ValueError("this SimResult has no timeline: simulate with record_timeline=True")
        return what.timeline
    if isinstance(what, Schedule):
        return simulate(what, costs).timeline
    raise TypeError(
        f"expected a Timeline, a SimResult or a Schedule, got {type(what).__name__}"
    )


def render_ascii(
    what: Drawable, *, costs: CostModel | None = None, max_width: int = 160, color: bool = False
) -> str:
    """One text row per rank (``F3``, ``I0``, ``W2``; ``.`` for bubbles).

    ``what`` is a Timeline, a SimResult, or a Schedule (simulated under
    ``costs``, unit costs by default)."""
    return _C.render_ascii(_timeline(what, costs), max_width=max_width, color=color)


def render_svg(
    what: Drawable | Sequence[Drawable],
    *,
    costs: CostModel | None = None,
    width: float = 1200,
    row_height: float = 22,
    microbatch_labels: bool = True,
) -> str:
    """An SVG picture (F blue, I amber, W green, B red); a list of timelines,
    results or schedules is stacked on one time scale."""
    if isinstance(what, (Timeline, SimResult, Schedule)):
        items: Iterable[Drawable] = [what]
    elif isinstance(what, (list, tuple)):
        items = what
    else:
        raise TypeError(
            "expected a Timeline, a SimResult, a Schedule or a list of them, "
            f"got {type(what).__name__}"
        )
    timelines = [_timeline(x, costs) for x in items]
    return _C.render_svg(
        timelines, width=width, row_height=row_height, microbatch_labels=microbatch_labels
    )


def render_chrome_trace(what: Drawable, *, costs: CostModel | None = None) -> str:
    """Chrome / Perfetto trace JSON (``traceEvents``; one time unit = 1 ms)."""
    return _C.render_chrome_trace(_timeline(what, costs))


def read_csv(path: str | os.PathLike) -> Schedule:
    """Reads a schedule CSV file (our form or plain torch-style rows; a regular
    file of at most 16 MiB). Errors name the path, the line and the text."""
    return _C.read_csv(os.fspath(path))


def write_csv(schedule: Schedule, path: str | os.PathLike) -> None:
    """Writes the schedule's CSV form (``read_csv`` reads it back exactly)."""
    text = to_csv(schedule)
    with open(path, "w", newline="") as f:
        f.write(text)


def read_stage_costs(path: str | os.PathLike) -> CostModel:
    """A CostModel from a stage cost file (``hp schedule recommend --costs``)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        raise ValueError(f"{path}: more than {MAX_INPUT_BYTES} bytes; a cost file must be smaller")
    return parse_stage_costs(data.decode("utf-8", errors="replace"), path)
