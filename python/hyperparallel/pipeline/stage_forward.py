"""A chunk's forward as the runtime calls it (_StageForward), with the step's
keyword arguments it takes (_StepKwargs, _accepted_kwargs) and what the
ranks compare of them before a step (_kwargs_signature, _describe_kwargs)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Dict, List

import torch

from ..losses import _AuxiliarySum, _WithAuxiliary, _collecting
from .transfers import _from_message, _to_message


# NOTE [Keyword arguments of every stage]
# Real model code gives its blocks more than the hidden states: position ids,
# an attention mask. `step(inputs, targets, **kwargs)` takes them once for
# the step: a tensor is split into the microbatches along dim 0 (as inputs
# are; a batch that does not divide is a ValueError naming it), anything
# else is a constant. Every rank is given them (its script is the same), so
# they never travel between ranks: each stage's forward gets, beside its
# activation, the ones it accepts (by its signature: all of them where it
# takes **kwargs), for the microbatch it runs (the runtime passes the
# microbatch with each F). So they carry no gradient back; a kwarg that
# requires grad is refused.
class _StepKwargs:
    """The keyword arguments of the running step, per microbatch (NOTE
    [Keyword arguments of every stage])."""

    def __init__(self):
        self.per_microbatch: List[Dict[str, object]] = []
        self.constant: Dict[str, object] = {}

    def of(self, mb: int, accepts) -> Dict[str, object]:
        if not self.per_microbatch and not self.constant:
            return {}
        kw = dict(self.constant)
        if self.per_microbatch:
            kw.update(self.per_microbatch[mb])
        if accepts is None:
            return kw
        return {k: v for k, v in kw.items() if k in accepts}


def _accepted_kwargs(fn) -> Optional[frozenset]:
    """The keyword arguments `fn` (a module's forward, or a callable) takes
    beside its first argument: None for all of them (``**kwargs``)."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return frozenset()
    names, positional = set(), 0
    for prm in sig.parameters.values():
        if prm.kind is prm.VAR_KEYWORD:
            return None
        if prm.kind in (prm.POSITIONAL_ONLY, prm.POSITIONAL_OR_KEYWORD) and positional == 0:
            positional += 1  # the activation
            continue
        if prm.kind in (prm.POSITIONAL_OR_KEYWORD, prm.KEYWORD_ONLY):
            names.add(prm.name)
    return frozenset(names)


# NOTE [Arguments of a step]
# Every rank calls step() with its own arguments, and a rank's checks of
# them (a batch that does not divide, targets missing, a keyword argument no
# stage takes) used to fail on that rank alone: its peers, already in the
# step, waited for it until the process exited (a notebook's never does) or
# Gloo's own 30 minutes. And keyword arguments were never compared: a mask
# given to one rank only trained another model without a word. Now:
#  - A key that no chunk of the pipeline takes, on any rank (the ranks
#    exchange their chunks' keyword arguments when the Pipeline is made), is
#    an error on the rank given it, before any communication: a misspelt
#    attn_mask= for attention_mask= is no longer dropped.
#  - The ranks agree on the step's keyword arguments: a fingerprint of their
#    keys, tensors' shapes and dtypes and constants' values (plain numbers,
#    strings and tuples of them; other objects by type) goes through one
#    all-reduce (MAX) of every rank's fingerprint and error flag; ranks that
#    differ are one ValueError on every rank, naming each rank's arguments,
#    before any rank runs the step. Tensors' values are not compared (nor
#    are the inputs'). With nothing declared (no activation_shape) every
#    step runs that all-reduce (2 x ranks integers: tens of microseconds on
#    Gloo), so every step is checked. With a declared shape
#    the agreement runs on the first step and on a step whose fingerprint
#    differs from this rank's previous one, so a steady loop pays nothing;
#    the cost is that a change on one rank alone, after the first step, waits
#    in the agreement until the timeout (its peers are in the step).
#  - A rank whose own checks fail while its peers take part in the agreement
#    sends its error flag there: every rank raises (the failed rank its
#    error, the others naming it) and the Pipeline stays usable. Otherwise
#    (a declared shape, nothing changed) its peers may already wait in the
#    step: it tells them through the runtime's abandon (the rings and store
#    of NOTE [A failed step reaches the peers] in hp/distributed/comm.h), so
#    they fail within a fraction of a second naming it, and the Pipeline is
#    done on every rank, as after a failed step.
#  - Every collective of the Python side (the agreement, the check of the
#    arguments) waits at most the Pipeline's timeout.
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _kwargs_signature(kwargs) -> tuple:
    """What the ranks compare of a step's keyword arguments (NOTE [Arguments
    of a step]): per key, a tensor's shape and dtype, a plain value's repr
    (tuples and lists of them too), another object's type."""

    def plain(v) -> bool:
        return isinstance(v, _PLAIN) or (isinstance(v, (tuple, list)) and len(v) <= 64
                                         and all(isinstance(x, _PLAIN) for x in v))

    out = []
    for key in sorted(kwargs):
        v = kwargs[key]
        if isinstance(v, torch.Tensor):
            out.append((key, "tensor", tuple(v.shape), str(v.dtype).replace("torch.", "")))
        elif plain(v):
            text = repr(v)
            out.append((key, type(v).__name__, text if len(text) <= 100 else
                        text[:100] + f"... ({len(text)} characters)"))
        else:
            out.append((key, type(v).__name__))
    return tuple(out)


def _describe_kwargs(signature) -> str:
    if not signature:
        return "no keyword arguments"
    parts = []
    for item in signature:
        if item[1] == "tensor":
            parts.append(f"{item[0]}=tensor{list(item[2])} {item[3]}")
        elif len(item) == 3:
            parts.append(f"{item[0]}={item[2]}")
        else:
            parts.append(f"{item[0]}=<{item[1]}>")
    return ", ".join(parts)


class _StageForward:
    """A chunk's forward as the runtime calls it, ``(x, microbatch, stage)``:
    hands the module the step's keyword arguments it accepts (NOTE [Keyword
    arguments of every stage]), collects the auxiliary losses it adds and
    ties them to its output (NOTE [Auxiliary losses]). With `messages` (no
    declared shape) `x` and the result are messages: lists of tensors that
    hold a tensor or a structure (NOTE [Pytrees between stages])."""

    def __init__(self, fn: Callable, aux: _AuxiliarySum, kwargs: _StepKwargs, accepts):
        self.fn = fn
        self.aux = aux
        self.kwargs = kwargs
        self.accepts = accepts
        self.messages = False
        self.schedule = None
        self.last_outputs: Dict[int, object] = {}  # mb -> a last stage's structure

    def __call__(self, x, mb: int, stage: int):
        x = self.argument(x)
        with collecting_aux() as added:
            out = self.fn(x, **self.kwargs.of(mb, self.accepts))
        return self.message(out, mb, stage, added)

    def argument(self, x):
        """What the chunk is called with, from the runtime's input."""
        return _from_message(x) if self.messages else x

    def message(self, out, mb: int, stage: int, added: List[torch.Tensor]):
        """The runtime's output from the chunk's, with the auxiliary losses
        it added tied to it."""
        if not isinstance(out, (torch.Tensor, tuple, list, dict)):
            raise TypeError(
                f"stage {stage} microbatch {mb}: a stage's forward must return a torch.Tensor "
                f"or a tuple, list or dict of them, got {type(out).__name__}")
        if not isinstance(out, torch.Tensor) and self.schedule.next_stage(stage, mb) < 0:
            # A last stage's structure goes to the loss function as it is.
            self.last_outputs[mb] = out
            out = torch.zeros(0)
        elif not isinstance(out, torch.Tensor) and not self.messages:
            raise TypeError(
                f"stage {stage} microbatch {mb}: the forward returned a "
                f"{type(out).__name__}; a structure of tensors between stages travels "
                "without a declared shape (Pipeline without activation_shape)")
        message = _to_message(out, stage, mb) if self.messages else [out]
        self.tie_aux(message, added)
        return message if self.messages else message[0]

    def tie_aux(self, message: List[torch.Tensor], added: List[torch.Tensor]) -> None:
        """Ties the auxiliary losses `added` to the first tensor of `message`
        that takes a gradient (NOTE [Auxiliary losses])."""
        if added:
            total = added[0]
            for t in added[1:]:  # the dtypes may differ (a router's float32 term)
                total = total + t
            for t in added:  # reported in float64, each as it was added
                self.aux.add(t)
            # Tied to the first tensor that takes a gradient.
            at = next((i for i, t in enumerate(message) if t.requires_grad), None)
            if total.requires_grad and at is not None:
                message[at] = _WithAuxiliary.apply(message[at], total, self.aux.scale)


@contextlib.contextmanager
def collecting_aux():
    """Collects the auxiliary losses add_loss() is given inside (a list)."""
    outer = getattr(_collecting, "sink", None)
    added: List[torch.Tensor] = []
    _collecting.sink = added
    try:
        yield added
    finally:
        _collecting.sink = outer
