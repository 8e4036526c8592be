"""A drop-in for torch.distributed.pipelining: the I/W split by GradFunction.

PyTorch's schedules that split the backward (ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV, any _PipelineScheduleRuntime action
list with I and W) run a stage's input gradient (I) and weight gradient (W)
through `stage_backward_input` / `stage_backward_weight`. Those count a
weight's gradient twice when one of its uses lies upstream of another on the
input path (`x @ w @ w`, pytorch/pytorch#180952). `PipelineStage` here is
torch's PipelineStage with that split replaced by hyperparallel's
`GradFunction`: I is `compute_input_grad`, W is `compute_weight_grad`, exact
in every graph and together the FLOPs of one backward (hp/autograd, NOTE [The
dx/dw split]). `use_split(stage)` does the same to a stage made another way
(e.g. `pipe.build_stage`). Blocks checkpointed with
hyperparallel.recompute.checkpoint are recomputed once per microbatch across
I and W (NOTE [Recompute sessions of a stage's I and W]). Everything else is
torch's own: schedules, communication, full backward (B), the first stage
(whose W is a full backward), and stages wrapped for data parallelism (DDP,
FSDP), which keep torch's split.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import torch
from torch.distributed import pipelining as _pp
from torch.distributed.pipelining import stage as _stage

from . import _C
from . import recompute as _rc

__all__ = ["PipelineStage", "use_split"]


def _data_parallel(module: torch.nn.Module) -> bool:
    kinds = tuple(
        k
        for k in (
            getattr(_stage, "DistributedDataParallel", None),
            getattr(_stage, "FSDPModule", None),
            getattr(_stage, "ReplicateModule", None),
        )
        if isinstance(k, type)
    )
    return bool(kinds) and isinstance(module, kinds)


# NOTE [Recompute sessions of a stage's I and W]
# Checkpointed blocks (hyperparallel.recompute.checkpoint) in a stage's module
# are recomputed once per microbatch only when the microbatch's I and W run in
# the same retaining recompute session. torch's schedules know nothing of
# sessions, so the stage opens one per I (a fresh id in a range of its own)
# and hands it with the GradFunction to W, which reuses and then clears it.
# Without checkpointed blocks a session is an empty record, opened and
# cleared. Sessions whose W never ran are cleared with the stage's runtime
# states (clear_runtime_states, at the start of every schedule step).
_SESSION_IDS = itertools.count(1)
_SESSION_BASE = 0xB0 << 56  # far from the ids users choose (stage << 32 | microbatch)


class _WeightPass:
    """What I hands to W (torch keeps it as the stage's "param_groups")."""

    __slots__ = ("grad_fn", "session")

    def __init__(self, grad_fn, session):
        self.grad_fn = grad_fn
        self.session = session

    def run(self):
        try:
            with _rc.RecomputeSession(self.session, retain_on_unpack=True):
                self.grad_fn.compute_weight_grad(False)  # accumulates into each .grad
        finally:
            _rc.clear_session(self.session)


def _backward_input(stage_outputs, output_grads, input_values, params):
    """I of one microbatch: dx for the stage's inputs; returns (grads per input, _WeightPass)."""
    if isinstance(stage_outputs, torch.Tensor):
        stage_outputs = (stage_outputs,)
    outputs, sens = [], []
    for i, out in enumerate(stage_outputs):
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            continue
        if output_grads is None:  # the last stage: `out` is the loss
            grad = torch.ones_like(out)
        else:
            grad = output_grads[i]
            if grad is None:  # no gradient came back for this output: it contributes nothing
                continue
        outputs.append(out)
        sens.append(grad)
    wants_dx = [isinstance(v, torch.Tensor) and v.requires_grad for v in input_values]
    inputs = [v for v, want in zip(input_values, wants_dx) if want]
    weights = [p for p in params if p.requires_grad]
    if not outputs or (not inputs and not weights):
        return tuple(None for _ in input_values), None
    grad_fn = _C.autograd.GradFunction(outputs, inputs, weights)
    session = _SESSION_BASE | next(_SESSION_IDS)
    try:
        with _rc.RecomputeSession(session, retain_on_unpack=True):
            dx = iter(grad_fn.compute_input_grad(sens))
    except BaseException:
        _rc.clear_session(session)
        raise
    return tuple(next(dx) if want else None for want in wants_dx), _WeightPass(grad_fn, session)


def _split_backward(stage, base, backward_type, bwd_kwargs, last_backward):
    if backward_type not in ("input", "weight") or _data_parallel(stage.submod):
        return base(backward_type, bwd_kwargs, last_backward=last_backward)
    pending = stage.__dict__.setdefault("_hp_pending_sessions", set())
    if backward_type == "input":
        # torch keeps the second value as "param_groups" and hands it back to W.
        grads, weight_pass = _backward_input(bwd_kwargs["stage_output"],
                                             bwd_kwargs["output_grads"],
                                             bwd_kwargs["input_values"], stage.submod.parameters())
        if weight_pass is not None:
            pending.add(weight_pass.session)
        return grads, weight_pass
    weight_pass = bwd_kwargs["param_groups"]
    if weight_pass is not None:
        pending.discard(weight_pass.session)
        weight_pass.run()
    return (), None


def _clear_pending(stage):
    for session in stage.__dict__.pop("_hp_pending_sessions", ()):
        _rc.clear_session(session)


class PipelineStage(_pp.PipelineStage):
    """torch.distributed.pipelining.PipelineStage whose backward split (I, then W) is
    hyperparallel's GradFunction: exact where torch's double counts (`x @ w @ w`), and
    I + W cost one backward. Same constructor and behaviour otherwise."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict,
                                   last_backward: bool = False) -> tuple[Any, Any]:
        return _split_backward(self, super().backward_maybe_with_nosync, backward_type,
                               bwd_kwargs, last_backward)

    def clear_runtime_states(self) -> None:
        _clear_pending(self)  # NOTE [Recompute sessions of a stage's I and W]
        super().clear_runtime_states()

    # NOTE [No warm-up message to oneself]
    # A schedule's first step sends one warm-up message between every pair of
    # neighbouring stages, also when both live on the same rank (ZB-V's turn,
    # DualPipeV); Gloo cannot send to its own rank ("Pair is not connected"),
    # so on Gloo torch's V schedules fail before their first action. The
    # schedules never communicate between same-rank stages after that (they
    # hand activations over in memory), so the warm-up ops to oneself are
    # dropped, in pairs (a stage's send to its same-rank neighbour and that
    # neighbour's receive).
    def _get_init_p2p_neighbors_ops(self):
        ops = super()._get_init_p2p_neighbors_ops()
        me = self.group_rank
        return [op for op in ops if getattr(op, "group_peer", None) != me]


def use_split(stage):
    """Gives an existing torch pipeline stage (any _PipelineStageBase, e.g. from
    `pipe.build_stage`) hyperparallel's backward split, in place; returns the stage."""
    if not isinstance(stage, _stage._PipelineStageBase):
        raise TypeError(
            "use_split needs a torch.distributed.pipelining stage, not "
            f"{type(stage).__name__}"
        )
    if isinstance(stage, PipelineStage) or getattr(stage, "_hp_split", False):
        return stage
    base = stage.backward_maybe_with_nosync
    base_clear = stage.clear_runtime_states

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        return _split_backward(self, base, backward_type, bwd_kwargs, last_backward)

    def clear_runtime_states(self):
        _clear_pending(self)
        base_clear()

    stage.backward_maybe_with_nosync = types.MethodType(backward_maybe_with_nosync, stage)
    stage.clear_runtime_states = types.MethodType(clear_runtime_states, stage)
    stage._hp_split = True
    return stage
