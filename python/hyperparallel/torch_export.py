"""Our schedules in torch.distributed.pipelining's action runtime.

PyTorch's ``_PipelineScheduleRuntime`` (torch/distributed/pipelining/schedules.py)
runs any per-rank list of its ``_Action`` s: F, I (BACKWARD_INPUT), W
(BACKWARD_WEIGHT), B (FULL_BACKWARD), OVERLAP_F_B, and SEND_F/RECV_F/SEND_B/
RECV_B. Its action text is ours (``2F0``, ``1I3``, ``0SEND_B2``: SEND names the
producing stage, RECV the consuming one), so a schedule PyTorch does not ship
(zb-auto, ZB-H2, DualPipeV, zbv-auto: our cost-searched ZB-V, ...) runs there
as it is:

>>> from hyperparallel import schedule as hs, torch_export as te
>>> s = hs.build("zb-auto", ranks=2, microbatches=8, mem_limit="1x")
>>> runtime = te.make_torch_runtime(s, stages, loss_fn)    # doctest: +SKIP
>>> runtime.step(x, target=y, losses=losses)               # doctest: +SKIP

Two formats, as the runtime's own ``_load_csv`` takes them:

- ``"compute_only"`` (default): our compute actions; torch adds SEND/RECV
  (its ``_add_send_recv``), REDUCE_GRAD and, for FSDP stages, UNSHARD/RESHARD.
- ``"compute_comms"``: our lowered lists (``hs.lower``: SEND right after the
  producer, RECV one compute action before the consumer, one message order on
  every channel), plus REDUCE_GRAD after each stage's last backward, placed as
  torch's ``_add_reduce_grad`` places it. No UNSHARD/RESHARD: use
  ``compute_only`` with FSDP.

NOTE [What torch's runtime can run]
The runtime knows one stage order: microbatches flow through stages 0, 1, ...,
S-1 (stage s hands its output to s+1; ``stage.is_first``/``is_last`` are
stage 0 and S-1), each stage holds its own weights, and the last stage's
losses are kept in a list in the order its forwards run and read back by
microbatch index (``_maybe_compute_loss`` / ``_maybe_get_loss``). So a
schedule exports when it (1) is valid, (2) has one route, 0..S-1, (3) gives
every stage its own chunk, and (4) runs the last stage's forwards in
microbatch order. DualPipe fails (2) and (3): it sends half the microbatches
up a second route through mirrored copies of the model whose gradients must
be summed; ``to_torch_actions`` refuses it with a ValueError that says so.
Every other generator in ``hs.names()`` exports (any placement: loop,
interleaved, V).
"""

from __future__ import annotations

import csv
import io
import os
from typing import Any, Callable, Mapping, Sequence

from . import schedule as hs

__all__ = [
    "FORMATS",
    "torch_export_problem",
    "check_torch_exportable",
    "to_torch_actions",
    "to_torch_csv",
    "write_torch_csv",
    "load_into_runtime",
    "skip_local_handshake",
    "make_torch_runtime",
    "from_torch_actions",
]

FORMATS = ("compute_only", "compute_comms")


def _pipelining():
    """torch's private schedule IR, imported when first needed."""
    try:
        from torch.distributed.pipelining import schedules as ts
    except ImportError as e:  # a torch built without distributed
        raise ImportError(
            "torch.distributed.pipelining is not available in this torch build: "
            f"{e}. The export needs a torch with distributed support."
        ) from e
    for name in ("_Action", "_ComputationType", "_PipelineScheduleRuntime"):
        if not hasattr(ts, name):
            raise ImportError(
                f"torch.distributed.pipelining.schedules has no {name} in this torch "
                "version; the export was written against torch 2.11's action runtime"
            )
    return ts


def torch_export_problem(schedule: hs.Schedule) -> str | None:
    """Why torch's ``_PipelineScheduleRuntime`` cannot run this schedule, or None.

    See NOTE [What torch's runtime can run] in this module."""
    if not isinstance(schedule, hs.Schedule):
        raise TypeError(f"expected a hyperparallel Schedule, got {type(schedule).__name__}")
    hs.validate(schedule)
    s = schedule
    name = f"schedule '{s.name}'" if s.name else "this schedule"
    S = s.num_stages
    replicas: dict[int, list[int]] = {}
    for stage, chunk in enumerate(s.stage_chunk):
        replicas.setdefault(chunk, []).append(stage)
    copies = [stages for stages in replicas.values() if len(stages) > 1]
    if len(s.routes) > 1:
        routes = "; ".join(
            f"route {i}: stages {r} (microbatches "
            f"{[mb for mb in range(s.num_microbatches) if s.microbatch_route[mb] == i]})"
            for i, r in enumerate(s.routes)
        )
        why = (
            f"{name} has {len(s.routes)} routes ({routes}), but torch's "
            "_PipelineScheduleRuntime sends every microbatch through stages 0..S-1 in order"
        )
        if copies:
            why += (
                f", and its stages {copies} hold copies of the same model chunk whose weight "
                "gradients must be summed, which torch's runtime has no notion of"
            )
        return why + " (DualPipe's two directions cannot be expressed; DualPipeV can)"
    if s.routes[0] != list(range(S)):
        return (
            f"{name} routes its microbatches through stages {s.routes[0]}, but torch's "
            f"_PipelineScheduleRuntime sends stage s's output to stage s+1 (0..{S - 1}); "
            "number the stages in route order"
        )
    if copies:
        return (
            f"{name} computes the same model chunk on stages {copies}; torch's "
            "_PipelineScheduleRuntime gives each stage its own weights and sums no replicas"
        )
    last = S - 1
    rank = s.stage_rank[last]
    order = [
        h.microbatch
        for a in s.actions[rank]
        for h in a.halves
        if h.op == hs.Op.F and h.stage == last
    ]
    if order != sorted(order):
        return (
            f"{name} runs the forwards of its last stage {last} (rank {rank}) in microbatch "
            f"order {order}; torch's _PipelineScheduleRuntime keeps the losses in the order "
            "the last stage's forwards run and reads them back by microbatch index, so they "
            "must run in increasing microbatch order"
        )
    return None


def check_torch_exportable(schedule: hs.Schedule) -> None:
    """Raises ValueError saying why torch's runtime cannot run the schedule."""
    why = torch_export_problem(schedule)
    if why is not None:
        raise ValueError(f"cannot export to torch.distributed.pipelining: {why}")


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")


def _torch_action(a: hs.Action, ts) -> Any:
    A, C = ts._Action, ts._ComputationType
    if a.op == hs.Op.FB:
        return A(
            -1,
            C.OVERLAP_F_B,
            None,
            (A(a.stage, C.FORWARD, a.microbatch), A(a.stage2, C.FULL_BACKWARD, a.microbatch2)),
        )
    op = {
        hs.Op.F: C.FORWARD,
        hs.Op.I: C.BACKWARD_INPUT,
        hs.Op.W: C.BACKWARD_WEIGHT,
        hs.Op.B: C.FULL_BACKWARD,
        hs.Op.SEND_F: C.SEND_F,
        hs.Op.RECV_F: C.RECV_F,
        hs.Op.SEND_B: C.SEND_B,
        hs.Op.RECV_B: C.RECV_B,
    }[a.op]
    return A(a.stage, op, a.microbatch)


def _with_reduce_grad(actions: list, m: int, ts) -> list:
    """REDUCE_GRAD after each stage's m-th W or B, as torch's _add_reduce_grad."""
    C = ts._ComputationType
    out, count = [], {}
    for a in actions:
        out.append(a)
        leaves = a.sub_actions if a.sub_actions is not None else (a,)
        for leaf in leaves:
            if leaf.computation_type in (C.BACKWARD_WEIGHT, C.FULL_BACKWARD):
                count[leaf.stage_index] = count.get(leaf.stage_index, 0) + 1
                if count[leaf.stage_index] == m:
                    out.append(ts._Action(leaf.stage_index, C.REDUCE_GRAD, None))
    return out


def to_torch_actions(schedule: hs.Schedule, *, format: str = "compute_only") -> dict[int, list]:
    """The schedule as torch's pipeline order: ``{rank: [_Action, ...]}``.

    ``compute_only`` takes the compute actions (a lowered schedule's SEND/RECV
    are dropped; torch adds its own); ``compute_comms`` takes our lowered
    lists (the schedule is lowered here when it is not) with REDUCE_GRAD
    added. Raises ValueError when torch's runtime cannot run the schedule
    (NOTE [What torch's runtime can run])."""
    _check_format(format)
    check_torch_exportable(schedule)
    ts = _pipelining()
    s = schedule
    if format == "compute_comms" and not s.lowered:
        s = hs.lower(s)
    out = {}
    for rank, row in enumerate(s.actions):
        acts = [_torch_action(a, ts) for a in row if format == "compute_comms" or a.is_compute]
        if format == "compute_comms":
            acts = _with_reduce_grad(acts, s.num_microbatches, ts)
        out[rank] = acts
    return out


def to_torch_csv(schedule: hs.Schedule, *, format: str = "compute_only") -> str:
    """The rows torch's ``_PipelineScheduleRuntime._load_csv(path, format)`` reads:
    one row per rank, actions as torch prints them (``0F0``, ``(0F3;3B1)OVERLAP_F_B``)."""
    actions = to_torch_actions(schedule, format=format)
    buf = io.StringIO()
    writer = csv.writer(buf)
    for rank in range(schedule.num_ranks):
        writer.writerow([str(a) for a in actions[rank]])
    return buf.getvalue()


def write_torch_csv(schedule: hs.Schedule, path: str | os.PathLike, *, format: str = "compute_only") -> None:
    """Writes :func:`to_torch_csv` to ``path`` (for ``runtime._load_csv(path, format)``)."""
    text = to_torch_csv(schedule, format=format)
    with open(path, "w", newline="") as f:
        f.write(text)


def _check_stages(schedule: hs.Schedule, stages: Sequence[Any]) -> None:
    if not isinstance(stages, (list, tuple)) or not stages:
        raise TypeError("stages must be a non-empty list of this rank's torch PipelineStage objects")
    for st in stages:
        for attr in ("stage_index", "num_stages", "group_rank", "group_size"):
            if not hasattr(st, attr):
                raise TypeError(
                    f"stages must be torch.distributed.pipelining PipelineStage objects; "
                    f"{type(st).__name__} has no {attr}"
                )
    rank, size = stages[0].group_rank, stages[0].group_size
    if size != schedule.num_ranks:
        raise ValueError(
            f"the schedule has {schedule.num_ranks} ranks but the stages' process group has {size}"
        )
    for st in stages:
        if st.num_stages != schedule.num_stages:
            raise ValueError(
                f"stage {st.stage_index} was made with num_stages={st.num_stages} but the "
                f"schedule has {schedule.num_stages} stages"
            )
    mine = sorted(st.stage_index for st in stages)
    want = schedule.stages_of_rank(rank)
    if mine != want:
        raise ValueError(
            f"rank {rank} was given stages {mine} but the schedule places stages {want} on it "
            f"(stage_rank {schedule.stage_rank})"
        )


# NOTE [Gloo and the V turn]
# On its first step torch's runtime "initializes the P2P communicators": every
# stage sends a dummy tensor to the ranks of stages s-1 and s+1 and receives
# one back (PipelineStage._get_init_p2p_neighbors_ops, torch 2.11). On a V
# placement (zbv, dualpipev, torch's own ScheduleZBVZeroBubble) the stages at
# the turn (p-1 and p on rank p-1) are neighbours on one rank, so the rank
# sends to itself, which Gloo cannot do: "Pair is not connected". Messages
# between stages of one rank are never needed (the runtime hands those
# activations over locally), so skip_local_handshake drops exactly those
# handshake operations; the ones between ranks stay. hyperparallel.pipelining's
# PipelineStage does the same for its own stages (NOTE [No warm-up message to
# oneself]); this one works on any stage object.


def skip_local_handshake(stages: Sequence[Any]) -> None:
    """Makes torch's first-step neighbour handshake skip stages on this same
    rank (NOTE [Gloo and the V turn]): needed for V placements over Gloo,
    harmless otherwise. make_torch_runtime does it; call it yourself before
    ``runtime._load_csv`` or with torch's own V schedules on Gloo."""
    for st in stages:
        orig = getattr(st, "_get_init_p2p_neighbors_ops", None)
        if orig is None or getattr(orig, "_hp_skips_local", False):
            continue

        def ops(orig=orig, st=st):
            return [op for op in orig() if getattr(op, "group_peer", None) != st.group_rank]

        ops._hp_skips_local = True
        st._get_init_p2p_neighbors_ops = ops


def load_into_runtime(runtime: Any, schedule: hs.Schedule, *, format: str = "compute_only") -> None:
    """Loads the schedule into an existing ``_PipelineScheduleRuntime``, as its
    ``_load_csv(path, format)`` would load our CSV."""
    _check_format(format)
    ts = _pipelining()
    if not isinstance(runtime, ts._PipelineScheduleRuntime):
        raise TypeError(
            f"expected a torch _PipelineScheduleRuntime, got {type(runtime).__name__}"
        )
    if runtime._n_microbatches != schedule.num_microbatches:
        raise ValueError(
            f"the runtime was made for {runtime._n_microbatches} microbatches but the schedule "
            f"has {schedule.num_microbatches}"
        )
    _check_stages(schedule, runtime._stages)
    actions = to_torch_actions(schedule, format=format)
    skip_local_handshake(runtime._stages)
    if format == "compute_only":
        runtime.pipeline_order = actions
        runtime._prepare_schedule_with_comms(runtime.pipeline_order)
    else:
        runtime._prepare_schedule_with_comms(actions, format="compute_comms")


def make_torch_runtime(
    schedule: hs.Schedule,
    stages: Sequence[Any],
    loss_fn: Callable | None,
    *,
    format: str = "compute_only",
    **kwargs: Any,
) -> Any:
    """A torch ``_PipelineScheduleRuntime`` over this rank's ``stages`` that runs
    ``schedule``. ``stages`` are ``torch.distributed.pipelining.PipelineStage``
    objects made with ``stage_index`` = our stage and ``num_stages`` =
    ``schedule.num_stages``, one for each of ``schedule.stages_of_rank(rank)``;
    ``kwargs`` go to the runtime (``scale_grads``, ``args_chunk_spec``, ...).
    Then ``runtime.step(...)`` as with any torch schedule."""
    _check_format(format)
    ts = _pipelining()
    check_torch_exportable(schedule)
    _check_stages(schedule, stages)
    runtime = ts._PipelineScheduleRuntime(
        list(stages), schedule.num_microbatches, loss_fn=loss_fn, **kwargs
    )
    load_into_runtime(runtime, schedule, format=format)
    return runtime


def from_torch_actions(
    actions: Mapping[int, Sequence[Any]], *, num_microbatches: int | None = None, name: str = "torch"
) -> hs.Schedule:
    """A torch pipeline order (``{rank: [_Action | None, ...]}``, e.g. a torch
    schedule's ``pipeline_order``) as our Schedule, to validate, simulate or
    draw it. Placement comes from where each stage's actions sit; UNSHARD,
    RESHARD and REDUCE_GRAD are dropped (they are not pipeline order). An
    OVERLAP_F_B must be an F beside a full backward B."""
    ts = _pipelining()
    C = ts._ComputationType
    if not isinstance(actions, Mapping):
        raise TypeError(f"expected a dict {{rank: [actions]}}, got {type(actions).__name__}")
    ranks = sorted(actions)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"ranks must be 0..p-1, got {ranks}")
    simple = {
        C.FORWARD: hs.Op.F,
        C.BACKWARD_INPUT: hs.Op.I,
        C.BACKWARD_WEIGHT: hs.Op.W,
        C.FULL_BACKWARD: hs.Op.B,
        C.SEND_F: hs.Op.SEND_F,
        C.RECV_F: hs.Op.RECV_F,
        C.SEND_B: hs.Op.SEND_B,
        C.RECV_B: hs.Op.RECV_B,
    }
    skipped = (C.UNSHARD, C.RESHARD, C.REDUCE_GRAD)
    rows, stage_rank, max_mb = [], {}, -1
    for rank in ranks:
        row = []
        for a in actions[rank]:
            if a is None or a.computation_type in skipped:
                continue
            if a.computation_type == C.OVERLAP_F_B:
                subs = a.sub_actions or ()
                kinds = tuple(x.computation_type for x in subs)
                if kinds != (C.FORWARD, C.FULL_BACKWARD):
                    raise ValueError(
                        f"rank {rank}: {a} overlaps {kinds}; only an F beside a full "
                        "backward B has an equivalent (our FB)"
                    )
                ours = hs.Action.overlap(
                    subs[0].stage_index, subs[0].microbatch_index,
                    subs[1].stage_index, subs[1].microbatch_index,
                )
            elif a.computation_type in simple:
                if a.microbatch_index is None:
                    raise ValueError(f"rank {rank}: {a} has no microbatch")
                ours = hs.Action(simple[a.computation_type], a.stage_index, a.microbatch_index)
            else:
                raise ValueError(f"rank {rank}: {a} has no equivalent in our schedules")
            for h in ours.halves:
                max_mb = max(max_mb, h.microbatch)
                if h.is_compute:
                    if stage_rank.setdefault(h.stage, rank) != rank:
                        raise ValueError(
                            f"stage {h.stage} has actions on rank {stage_rank[h.stage]} and "
                            f"rank {rank}"
                        )
            row.append(ours)
        rows.append(row)
    if not stage_rank:
        raise ValueError("no compute actions")
    num_stages = max(stage_rank) + 1
    if sorted(stage_rank) != list(range(num_stages)):
        missing = sorted(set(range(num_stages)) - set(stage_rank))
        raise ValueError(f"stages {missing} have no actions")
    m = num_microbatches if num_microbatches is not None else max_mb + 1
    s = hs.Schedule(
        len(ranks),
        m,
        rows,
        num_stages=num_stages,
        stage_rank=[stage_rank[i] for i in range(num_stages)],
        name=name,
    )
    hs.validate(s)
    return s
