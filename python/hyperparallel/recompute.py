"""Activation checkpointing that works with the dx/dw split (hp/recompute).

`checkpoint(fn, *args)` runs a block without keeping its activations and
recomputes it for backward. Inside a `RecomputeSession` that retains
(`retain_on_unpack=True`), the dx and the dw of a split backward
(`forward_and_gradfn`, or hyperparallel's pipeline stages) share **one**
recompute of each block; handles collected during forward
(`HandleCollector`) let a scheduler start a recompute early (`prefetch`).
Counters say how much recompute work ran. See docs/python.md, "Recompute".
"""

from __future__ import annotations

import inspect

import torch
from torch.utils import _pytree as pytree

from . import _C
from .losses import _collecting

_R = _C.recompute

RecomputeSession = _R.RecomputeSession
HandleCollector = _R.HandleCollector
RecomputeHandle = _R.RecomputeHandle
RecomputeCounters = _R.RecomputeCounters
SessionStats = _R.SessionStats
prefetch = _R.prefetch
clear_session = _R.clear_session
clear_all_sessions = _R.clear_all_sessions
session_stats = _R.session_stats
num_sessions = _R.num_sessions
counters = _R.counters
reset_counters = _R.reset_counters

__all__ = [
    "checkpoint",
    "RecomputeSession",
    "HandleCollector",
    "RecomputeHandle",
    "RecomputeCounters",
    "SessionStats",
    "prefetch",
    "clear_session",
    "clear_all_sessions",
    "session_stats",
    "num_sessions",
    "counters",
    "reset_counters",
]


_TENSOR = object()  # where a tensor goes in a flattened structure


def _module_weights(fn) -> list[torch.Tensor]:
    module = fn if isinstance(fn, torch.nn.Module) else None
    owner = getattr(fn, "__self__", None)
    if module is None and inspect.ismethod(fn) and isinstance(owner, torch.nn.Module):
        module = owner
    return [] if module is None else list(module.parameters())


def checkpoint(fn, *args, weights=None, preserve_rng_state=True, check_versions=True, **kwargs):
    """Runs `fn(*args, **kwargs)` without keeping its activations; returns what `fn` returns.

    Its backward recomputes `fn` (or takes a prefetched or retained recompute of
    the current `RecomputeSession`) and runs the block's own dx/dw split, so a
    split backward inside a retaining session recomputes the block once.

    - Tensors in `args`/`kwargs` (nested in lists, tuples, dicts too) are block
      inputs, except weights passed as arguments: those listed in `weights` and
      every nn.Parameter. Gradients flow to those that require grad.
    - `weights`: the tensors requiring grad that `fn` uses as weights (typically
      the parameters it captures). None (default): the parameters of `fn` when
      it is an nn.Module (or a bound method of one), else none; nn.Parameter
      arguments are added. Gradients of tensors `fn` uses without getting them
      as arguments or in `weights` are NOT computed. A split backward inside a
      retaining session recomputes a block once only when the block has
      weights (a plain tensor passed as an argument is an input, not a weight).
    - `preserve_rng_state`: the recompute replays the forward's random numbers
      (CPU and the inputs' CUDA devices). `check_versions`: the recompute fails
      (RuntimeError) when an input or weight was modified in place since.
    - `fn` must return the same structure every time; its floating-point
      tensors get gradients, anything else is returned as computed.
    """
    if not callable(fn):
        raise TypeError(f"checkpoint: fn must be callable, not {type(fn).__name__}")
    if weights is None:
        weight_list = _module_weights(fn)
    elif isinstance(weights, torch.Tensor):
        raise TypeError("checkpoint: weights must be a list/iterable of tensors, not a Tensor; "
                        "wrap it: [w]")
    else:
        weight_list = list(weights)
        for i, w in enumerate(weight_list):
            if not isinstance(w, torch.Tensor):
                raise TypeError(f"checkpoint: weights[{i}] is a {type(w).__name__}, not a Tensor")

    unique = {}
    for w in weight_list:  # a weight listed twice would be counted twice
        unique.setdefault(id(w), w)
    weight_list = list(unique.values())
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    weight_ids = set(unique)
    # NOTE [Weights passed as arguments]
    # The block's backward node tells dx (its inputs' slots) from dw (its
    # weights' slots), and only a block with weights keeps its recompute for
    # dw. So a tensor argument that is a weight (listed in `weights`, or an
    # nn.Parameter) stays a weight: the block is called with the tensor itself,
    # and the C++ checkpoint sees it among its weights, not its inputs.
    tensor_at, inputs = [], []
    template = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and (
                id(leaf) in weight_ids or isinstance(leaf, torch.nn.Parameter)):
            if id(leaf) not in weight_ids:
                weight_ids.add(id(leaf))
                weight_list.append(leaf)
            template.append(leaf)
        elif isinstance(leaf, torch.Tensor):
            # The block keeps its own detached aliases of the inputs: the template
            # must not hold them (nor, through them, the graph that made them).
            tensor_at.append(i)
            inputs.append(leaf)
            template.append(_TENSOR)
        else:
            template.append(leaf)
    out_state: dict = {}

    def block(tensors):
        full = list(template)
        for i, t in zip(tensor_at, tensors):
            full[i] = t
        a, k = pytree.tree_unflatten(full, in_spec)
        out = fn(*a, **k)
        out_leaves, out_spec = pytree.tree_flatten(out)
        if "spec" not in out_state:
            out_state["spec"] = out_spec
            out_state["template"] = [
                _TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in out_leaves
            ]
        elif out_spec != out_state["spec"]:
            raise RuntimeError(
                "checkpoint: the recompute of the block returned another structure than its "
                "forward; a checkpointed function must return the same outputs every time"
            )
        return [leaf for leaf in out_leaves if isinstance(leaf, torch.Tensor)]

    # Its forward runs without autograd: add_loss there would train nothing
    # (NOTE [Auxiliary losses] in losses.py), so it fails.
    outer = getattr(_collecting, "in_checkpoint", False)
    _collecting.in_checkpoint = True
    try:
        outs = _R.checkpoint(block, inputs, weight_list, preserve_rng_state, check_versions)
    finally:
        _collecting.in_checkpoint = outer
    it = iter(outs)
    full = [next(it) if leaf is _TENSOR else leaf for leaf in out_state["template"]]
    return pytree.tree_unflatten(full, out_state["spec"])
