"""Capture of a whole train step as one joint FX graph (seed 002 §6).

`trace_model_graph(model, train_fn, input, label)` traces
`train_fn(model, input, label) -> loss` and `torch.autograd.grad(loss,
params)` with make_fx into one GraphModule:

    placeholders: every distinct parameter, then every distinct buffer (the
                  "state", static inputs, never get_attr), then the tensor
                  leaves of (input, label) in pytree order
    output:       [loss, grad of each trainable parameter in state order]

and attaches the metadata the passes and the trainer read: `state_fqns`,
`state_is_param`, `state_aliases` (other FQNs of a tied tensor), `grad_fqns`
(the FQN of each gradient output), `input_spec` and `input_constants` (the
pytree of (input, label) and its non-tensor leaves, frozen into the graph).

Stock torch 2.11 traces autograd.grad under make_fx (no patched engine
needed) when the backward runs on the tracing thread:
`torch.autograd.set_multithreading_enabled(False)` (seed §6.2).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module

__all__ = ["LEAF_TYPES", "check_leaf_types", "trace_model_graph", "input_signature"]

# The leaf types a (input, label) pytree may hold (seed §6.4). Anything else
# (a callable, a custom object) goes into train_fn's closure, or is
# registered as a pytree node (GraphTrainer.set_pytree_pre_hook).
LEAF_TYPES = (torch.Tensor, int, float, bool, str, type(None))


def check_leaf_types(tree: Any, what: str) -> Tuple[List[Any], Any]:
    """Flattens `tree`; TypeError naming the first leaf of another type."""
    leaves, spec = pytree.tree_flatten(tree)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, LEAF_TYPES):
            try:  # a type registered without flatten_with_keys_fn has no key path
                where = what + pytree.keystr(pytree.tree_flatten_with_path(tree)[0][i][0])
            except ValueError:
                where = f"leaf {i} of {what}"
            raise TypeError(
                f"graph mode: {where} is a {type(leaf).__qualname__}; the "
                "leaves of a train step's input and label must be Tensor, int, float, bool, str "
                "or None. Capture other objects in train_fn's closure, or register the type as "
                "a pytree node (torch.utils._pytree.register_pytree_node) from a hook given to "
                "GraphTrainer.set_pytree_pre_hook")
    return leaves, spec


def input_signature(input: Any, label: Any) -> Tuple:
    """What a compiled graph is specialised on: the pytree structure, each
    tensor leaf's shape, dtype and device, and each other leaf's value."""
    leaves, spec = check_leaf_types((input, label), "(input, label)")
    sig = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sig.append(("T", tuple(leaf.shape), leaf.dtype, str(leaf.device)))
        else:
            sig.append((type(leaf).__name__, leaf))
    return (str(spec), tuple(sig))


def run_reparametrized(model, fqns, aliases, state, leaves, tensor_pos, tensors, spec, fn):
    """`fn(tree)` with `model`'s state replaced by `state` (one tensor per
    FQN in `fqns`, each also under its `aliases`), where `tree` is the pytree
    `spec` of `leaves` with the positions `tensor_pos` replaced by `tensors`:
    what a capture traces."""
    full = list(leaves)
    for pos, t in zip(tensor_pos, tensors):
        full[pos] = t
    tree = pytree.tree_unflatten(full, spec)
    mapping = {name: t for fqn, t in zip(fqns, state) for name in [fqn] + aliases[fqn]}
    with _reparametrize_module(model, mapping):
        return fn(tree)


def _distinct(named) -> Tuple[List[str], List[torch.Tensor], Dict[str, List[str]]]:
    fqns, tensors, aliases, first_of = [], [], {}, {}
    for fqn, t in named:
        if id(t) in first_of:
            aliases[first_of[id(t)]].append(fqn)
            continue
        first_of[id(t)] = fqn
        fqns.append(fqn)
        tensors.append(t)
        aliases[fqn] = []
    return fqns, tensors, aliases


def trace_model_graph(model: torch.nn.Module, train_fn: Callable, input: Any, label: Any, *,
                      tracing_mode: str = "fake",
                      state_overrides: Optional[Dict[str, torch.Tensor]] = None
                      ) -> torch.fx.GraphModule:
    """The joint forward + backward graph of one train step (module docstring).

    state_overrides: FQN -> a tensor to trace with instead of the live one
    (the trainer passes full-shape tensors for parameters FSDP already
    sharded, to compile for a new input shape)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"graph mode: model must be a torch.nn.Module, not {type(model).__name__}")
    if not callable(train_fn):
        raise TypeError("graph mode: train_fn must be callable as train_fn(model, input, label)")
    leaves, spec = check_leaf_types((input, label), "(input, label)")
    overrides = state_overrides or {}

    p_fqns, p_tensors, p_alias = _distinct(model.named_parameters(remove_duplicate=False))
    b_fqns, b_tensors, b_alias = _distinct(model.named_buffers(remove_duplicate=False))
    state_fqns = p_fqns + b_fqns
    state_is_param = [True] * len(p_fqns) + [False] * len(b_fqns)
    aliases = {**p_alias, **b_alias}
    live = p_tensors + b_tensors
    samples = []
    for fqn, t, is_param in zip(state_fqns, live, state_is_param):
        s = overrides.get(fqn, t).detach()
        samples.append(s.requires_grad_(True) if is_param and t.requires_grad else s)
    grad_idx = [i for i, (is_param, t) in enumerate(zip(state_is_param, live))
                if is_param and t.requires_grad]
    if not grad_idx:
        raise ValueError("graph mode: the model has no trainable parameter (requires_grad)")
    tensor_pos = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    n_state = len(state_fqns)

    def joint(*args):
        state = args[:n_state]
        loss = run_reparametrized(model, state_fqns, aliases, state, leaves, tensor_pos,
                                  args[n_state:], spec, lambda xy: train_fn(model, *xy))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.dim() != 0 \
                or not loss.is_floating_point():
            what = (f"a {type(loss).__name__}" if not isinstance(loss, torch.Tensor) else
                    f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}")
            raise ValueError(f"graph mode: train_fn must return the loss as a floating-point "
                             f"scalar tensor (0-dim); it returned {what}")
        if not loss.requires_grad:
            raise ValueError("graph mode: train_fn's loss does not depend on any trainable "
                             "parameter (it needs no gradient); check train_fn and requires_grad")
        grads = torch.autograd.grad(loss, [state[i] for i in grad_idx], allow_unused=True)
        grads = [torch.zeros_like(state[i]) if g is None else g for i, g in zip(grad_idx, grads)]
        return [loss, *grads]

    flat_inputs = [leaves[i] for i in tensor_pos]
    with torch.autograd.set_multithreading_enabled(False), _train_mode_kept(model):
        gm = make_fx(joint, tracing_mode=tracing_mode, _allow_non_fake_inputs=True)(
            *samples, *flat_inputs)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        if i < n_state:
            node.meta["hp_role"] = "param" if state_is_param[i] else "buffer"
            node.meta["hp_fqn"] = state_fqns[i]
        else:
            node.meta["hp_role"] = "input"
    gm.state_fqns = state_fqns
    gm.state_is_param = state_is_param
    gm.state_aliases = aliases
    gm.grad_fqns = [state_fqns[i] for i in grad_idx]
    gm.input_spec = spec
    gm.input_constants = [leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)]
    return gm


@contextlib.contextmanager
def _train_mode_kept(model):
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, training in modes:
            m.train(training)
