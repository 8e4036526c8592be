"""The losses a Pipeline's step trains on besides its model's output: the
auxiliary losses a stage adds (``add_loss``, ``collect_losses``, and their
tie to the stage's backward) and the loss of one microbatch.

Outside the pipeline package: split_model, the MoE router losses and
hyperparallel.compile add losses here without importing the runtime."""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional

import torch

__all__ = ["add_loss", "collect_losses"]


# NOTE [Auxiliary losses]
# A stage may add scalar losses of its own beside its output (a MoE router's
# load-balancing loss): `add_loss(t)` inside its forward. The Pipeline runs
# each chunk's forward through _StageForward (pipeline/stage_forward.py),
# which collects them for that (stage, microbatch) and ties their sum to the
# output with _WithAuxiliary:
# the output unchanged forward; backward, the output's gradient passes
# through and the sum gets the step's loss scale (1/m, the weight of one
# microbatch's loss, NOTE [The loss scale is the backward's seed] in
# hp/pipeline/stage.cpp) as its gradient. So the auxiliary term joins the
# backward of the stage that made it, wherever the schedule runs it and
# however it splits it (B, or I then W: the node is on the path from the
# output to the input and the weights alike), and the gradients are those
# of loss + sum(aux) averaged over the microbatches, as one process computes
# them. Each rank sums its auxiliary values (detached) over the step; the
# runtime reduces that sum in the same collective as the loss
# (PipelineOptions::extra_sum) and `last_stats["aux_loss"]` reports it as
# the mean over microbatches. Outside a Pipeline, `collect_losses()` gathers
# them for a single-process run of the same model code.
#
# A checkpointed region (torch.utils.checkpoint, hyperparallel.recompute)
# runs its forward again inside the backward, and so its add_loss: that
# term is the forward's, which already joined the loss. So add_loss inside
# the autograd engine (a graph task running) adds nothing; before, a
# checkpointed MoE layer failed the Pipeline's I ("outside a Pipeline
# stage's forward"). A hyperparallel.recompute.checkpoint block's own
# forward runs without autograd, where a loss would train nothing: add_loss
# there fails.
_collecting = threading.local()


def add_loss(loss: torch.Tensor) -> None:
    """Adds a scalar auxiliary loss (e.g. a MoE load-balancing loss) from
    inside a stage's forward: it joins that stage's backward with the step's
    loss scale and is reported per step as ``pipe.last_stats["aux_loss"]``
    (NOTE [Auxiliary losses]). Outside a Pipeline's forward, inside
    ``with collect_losses() as aux:`` it is appended to ``aux``; in a
    checkpointed region's recompute (inside a backward) it adds nothing;
    elsewhere it is an error."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"add_loss: an auxiliary loss must be a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"add_loss: an auxiliary loss must be a scalar (one element), got shape "
            f"{tuple(loss.shape)}"
        )
    if torch._C._current_graph_task_id() != -1:  # a recompute (NOTE [Auxiliary losses])
        return
    if getattr(_collecting, "in_checkpoint", False):
        raise RuntimeError(
            "add_loss inside hyperparallel.recompute.checkpoint: the block's forward runs "
            "without autograd, so its loss would train nothing; return the loss from the "
            "block and add it outside, or checkpoint with torch.utils.checkpoint")
    sink = getattr(_collecting, "sink", None)
    if sink is None:
        raise RuntimeError(
            "add_loss was called outside a Pipeline stage's forward and outside "
            "hyperparallel.pipeline.collect_losses(): nothing would train on it"
        )
    sink.append(loss.reshape(()))


class collect_losses:
    """``with collect_losses() as aux: out = model(x)``: the auxiliary losses
    that ``add_loss`` adds inside, in a list (a single-process run of the
    model code a Pipeline trains)."""

    def __enter__(self) -> List[torch.Tensor]:
        self._outer = getattr(_collecting, "sink", None)
        self.losses: List[torch.Tensor] = []
        _collecting.sink = self.losses
        return self.losses

    def __exit__(self, *exc) -> None:
        _collecting.sink = self._outer


class _WithAuxiliary(torch.autograd.Function):
    """The output unchanged; backward, the auxiliary sum's gradient is the
    loss scale (NOTE [Auxiliary losses])."""

    @staticmethod
    def forward(ctx, output, aux, scale: float):
        ctx.scale = scale
        ctx.aux_meta = (aux.dtype, aux.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        dtype, device = ctx.aux_meta
        return grad_output, torch.full((), ctx.scale, dtype=dtype, device=device), None


class _AuxiliarySum:
    """One rank's auxiliary losses of the running step (detached)."""

    def __init__(self, scale: float):
        self.scale = scale
        self.total: Optional[torch.Tensor] = None

    def add(self, t: torch.Tensor) -> None:
        t = t.detach().to(torch.float64)
        self.total = t if self.total is None else self.total + t

    def take(self) -> float:
        """The step's sum times the scale (its mean over microbatches), reset."""
        total, self.total = self.total, None
        return 0.0 if total is None else total.item() * self.scale


class _LossOfMicrobatch:
    """The loss of one microbatch: ``loss_fn(output, targets[mb])`` with the
    targets of the step that runs."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.loss_fn = loss_fn
        self.targets: List[torch.Tensor] = []
        self.rank = -1
        self.last_outputs: Dict[int, object] = {}

    def __call__(self, output: torch.Tensor, mb: int) -> torch.Tensor:
        output = self.last_outputs.pop(mb, output)  # NOTE [Pytrees between stages]
        return self.loss_fn(output, self.target(mb))

    def target(self, mb: int) -> torch.Tensor:
        """The running step's target of microbatch `mb`."""
        if not self.targets:
            raise ValueError(
                f"rank {self.rank} runs the last stage of microbatch {mb}'s route: give step() "
                "the targets"
            )
        return self.targets[mb]
