"""The dx/dw split for any Python callable (seed 000, section 6).

`forward_and_gradfn` runs a function in Python, recording LibTorch's graph as
any forward does, and returns its output with a `GradFunction` built on that
already-run forward: `compute_input_grad` (dx, on a pipeline's critical path)
and `compute_weight_grad` (dw, free to move) run on LibTorch's own engine and
together do the work of one fused backward (hp/autograd, NOTE [The dx/dw
split]); `__call__` runs them fused.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import _C

__all__ = ["forward_and_gradfn", "GradFunction"]


def _module_of(fn) -> torch.nn.Module | None:
    """`fn` itself when it is an nn.Module, the module of a bound method of one, else None."""
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    if inspect.ismethod(fn) and isinstance(owner, torch.nn.Module):
        return owner
    return None


def _default_weights(fn) -> list[torch.Tensor]:
    module = _module_of(fn)
    if module is None:
        return []
    return [p for p in module.parameters() if p.requires_grad]


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _resolve_grad_position(grad_position, num_inputs: int):
    """(positions or None, single) for grad_position; raises TypeError/ValueError."""
    if grad_position is None:
        return None, False
    if isinstance(grad_position, bool):
        raise TypeError(
            "grad_position must be an int, a list/tuple of ints or None, not a bool"
        )
    if isinstance(grad_position, int):
        if grad_position == -1:
            return list(range(num_inputs)), False
        if not 0 <= grad_position < num_inputs:
            raise ValueError(
                f"grad_position {grad_position} is out of range for {num_inputs} input"
                f"{'' if num_inputs == 1 else 's'}; use an index in [0, {num_inputs}), -1 for "
                "all inputs or None for none"
            )
        return [grad_position], True
    if isinstance(grad_position, (list, tuple)):
        positions = []
        for p in grad_position:
            if isinstance(p, bool) or not isinstance(p, int):
                raise TypeError(
                    f"grad_position lists {p!r} of type {type(p).__name__}; list input "
                    "indices (ints)"
                )
            if not 0 <= p < num_inputs:
                raise ValueError(
                    f"grad_position lists input {p}, out of range for {num_inputs} input"
                    f"{'' if num_inputs == 1 else 's'}; use indices in [0, {num_inputs})"
                )
            if p in positions:
                raise ValueError(f"grad_position lists input {p} twice; list each input once")
            positions.append(p)
        return positions, False
    raise TypeError(
        "grad_position must be an int (-1: all inputs), a list/tuple of ints or None, not "
        f"{type(grad_position).__name__}"
    )


def _resolve_weights(fn, weights):
    """(list of tensors, keys or None): keys when weights is a mapping (dw comes back as a dict)."""
    if weights is None:
        return _default_weights(fn), None
    if isinstance(weights, torch.Tensor):
        raise TypeError(
            "weights must be a list/tuple of tensors (or an iterable such as "
            "module.parameters(), or a dict of them), not a single Tensor; wrap it: [w]"
        )
    keys = None
    if isinstance(weights, Mapping):
        keys = list(weights.keys())
        values = [weights[k] for k in keys]
    elif isinstance(weights, Iterable) and not isinstance(weights, (str, bytes)):
        values = list(weights)
    else:
        raise TypeError(
            "weights must be a list/tuple of tensors, an iterable such as module.parameters() "
            f"or a dict of tensors, not {type(weights).__name__}"
        )
    seen = {}
    for i, w in enumerate(values):
        name = f"weights[{keys[i]!r}]" if keys is not None else f"weights[{i}]"
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name} is a {type(w).__name__}, not a Tensor")
        if id(w) in seen:
            raise ValueError(
                f"{name} is {seen[id(w)]} again; list each weight once (its gradient would be "
                "counted twice)"
            )
        seen[id(w)] = name
    return values, keys


def _skeleton(obj, leaves: list):
    """obj's structure with each Tensor replaced by its index in `leaves` (appended)."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return len(leaves) - 1
    if isinstance(obj, (list, tuple)):  # namedtuples too
        return [_skeleton(o, leaves) for o in obj]
    if isinstance(obj, Mapping):
        return {k: _skeleton(v, leaves) for k, v in obj.items()}
    return None  # not a tensor: no gradient


def _describe(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a Tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, (list, tuple)):
        return f"a {type(obj).__name__} of {len(obj)}"
    if isinstance(obj, Mapping):
        return f"a dict with keys {sorted(map(str, obj.keys()))}"
    return f"a {type(obj).__name__}"


class GradFunction:
    """The backward of one forward run by `forward_and_gradfn`, split into dx and dw.

    Call `compute_input_grad(sens)` once, then `compute_weight_grad()` (again only
    after `keep_graph=True`); or `grad_fn(sens)` for one fused backward instead.
    dw is accumulated into each weight's `.grad` as `backward()` does; dx is
    returned only (as `torch.autograd.grad` does).
    """

    def __init__(self, impl, out_skeleton, out_meta, out_index, input_layout, single,
                 num_weights, weight_slots, weight_keys):
        self._impl = impl
        self._out_skeleton = out_skeleton  # output structure, tensor leaves -> leaf index
        self._out_meta = out_meta  # per leaf: (shape, dtype, device) or None (not differentiated)
        self._out_index = out_index  # differentiated leaf indices, in C++ output order
        self._input_layout = input_layout  # None, or per position: (treedef, [slot or None])
        self._single = single
        self._num_weights = num_weights
        self._weight_slots = weight_slots  # per weight: index in the C++ weight list or None
        self._weight_keys = weight_keys

    # ---- sens -------------------------------------------------------------------------------
    def _sens_list(self, sens) -> list[torch.Tensor]:
        if sens is None:
            return []
        given: dict[int, Any] = {}

        def walk(skel, s, path):
            if isinstance(skel, int):
                if s is not None and not isinstance(s, torch.Tensor):
                    raise TypeError(
                        f"sens{path} is {_describe(s)} but the output there is a Tensor; "
                        "pass a Tensor (or None)"
                    )
                given[skel] = s
            elif isinstance(skel, (list, tuple)):
                if not isinstance(s, (list, tuple)) or len(s) != len(skel):
                    raise ValueError(
                        f"sens{path} must be a list/tuple of {len(skel)} like the "
                        f"differentiated output, got {_describe(s)}"
                    )
                for i, (k, v) in enumerate(zip(skel, s)):
                    walk(k, v, f"{path}[{i}]")
            elif isinstance(skel, dict):
                if not isinstance(s, Mapping) or set(s.keys()) != set(skel.keys()):
                    raise ValueError(
                        f"sens{path} must be a dict with keys {sorted(map(str, skel.keys()))} "
                        f"like the differentiated output, got {_describe(s)}"
                    )
                for k in skel:
                    walk(skel[k], s[k], f"{path}[{k!r}]")
            # None: a non-tensor output leaf, whose sens is ignored

        walk(self._out_skeleton, sens, "")
        out = []
        for leaf in self._out_index:
            shape, dtype, device = self._out_meta[leaf]
            g = given.get(leaf)
            if g is None:  # no gradient for this output: it contributes nothing
                out.append(torch.zeros(shape, dtype=dtype, device=device))
                continue
            if tuple(g.shape) != shape:
                raise ValueError(
                    f"sens for output {leaf} has shape {tuple(g.shape)} but the output has shape "
                    f"{shape}"
                )
            if g.dtype != dtype:
                raise ValueError(
                    f"sens for output {leaf} has dtype {g.dtype} but the output has dtype {dtype}"
                )
            if g.device != device:
                raise ValueError(
                    f"sens for output {leaf} is on {g.device} but the output is on {device}"
                )
            out.append(g)
        return out

    # ---- shapes of the results --------------------------------------------------------------
    def _shape_dx(self, flat: list[torch.Tensor]):
        if self._input_layout is None:
            return None
        grads = []
        for spec, slots in self._input_layout:
            leaves = [None if s is None else flat[s] for s in slots]
            grads.append(pytree.tree_unflatten(leaves, spec))
        return grads[0] if self._single else tuple(grads)

    def _shape_dw(self, flat: list[torch.Tensor]):
        grads = [None if s is None else flat[s] for s in self._weight_slots]
        if self._weight_keys is not None:
            return dict(zip(self._weight_keys, grads))
        return tuple(grads)

    # ---- the API ----------------------------------------------------------------------------
    def compute_input_grad(self, sens=None):
        """dx, in the shape of the selected inputs: one gradient for an int grad_position, a
        tuple for a list (or -1), None for grad_position=None. `sens`: the gradient of the
        differentiated output, in its structure (default: ones; a None leaf: zeros).
        Captures what compute_weight_grad needs and frees what only dx needed."""
        return self._shape_dx(self._impl.compute_input_grad(self._sens_list(sens)))

    def compute_weight_grad(self, keep_graph=False, *, return_grads=True):
        """dw, one per weight (a tuple in the order of `weights`, a dict for a dict; None for a
        weight that does not require grad), also accumulated into each weight's `.grad`. Only
        after compute_input_grad; again only when the previous call passed keep_graph=True.

        `return_grads=False`: dw goes only into `.grad`, through the engine's own accumulation
        as `backward()` does (no copy of the first gradient; the weights' hooks run), and
        None is returned; this is the pipeline's W (NOTE [dw into .grad])."""
        if not isinstance(keep_graph, bool):
            raise TypeError(f"keep_graph must be a bool, not {type(keep_graph).__name__}")
        if not isinstance(return_grads, bool):
            raise TypeError(f"return_grads must be a bool, not {type(return_grads).__name__}")
        if not return_grads:
            self._impl.weight_grad_into_grad(keep_graph)
            return None
        return self._shape_dw(self._impl.compute_weight_grad(keep_graph))

    def __call__(self, sens=None, keep_graph=False):
        """One fused backward (no split). Returns what the configuration asks for: dx when
        forward_and_gradfn had no weights, dw when grad_position was None, else (dx, dw).
        dw is accumulated into `.grad` too."""
        if not isinstance(keep_graph, bool):
            raise TypeError(f"keep_graph must be a bool, not {type(keep_graph).__name__}")
        dx, dw = self._impl(self._sens_list(sens), keep_graph)
        if self._input_layout is None:
            return self._shape_dw(dw)
        if self._num_weights == 0:
            return self._shape_dx(dx)
        return self._shape_dx(dx), self._shape_dw(dw)

    def separate_dw_calls(self, on: bool = True) -> "GradFunction":
        """Run dw as one engine call per weight group (identical results; for comparison)."""
        self._impl.separate_dw_calls(bool(on))
        return self

    @property
    def stats(self):
        """What the split's analysis found (num_nodes, num_dx_nodes, num_join_nodes,
        num_groups); filled by compute_input_grad."""
        return self._impl.stats

    def __repr__(self):
        n_in = 0 if self._input_layout is None else len(self._input_layout)
        return f"GradFunction(inputs={n_in}, weights={self._num_weights})"


def forward_and_gradfn(fn, *inputs, weights=None, has_aux=False, grad_position=0, **kwargs):
    """Runs `fn(*inputs, **kwargs)` and returns `(forward_out, grad_fn)`.

    `fn` is any Python callable (a function, a lambda, an nn.Module, ...); its
    forward runs here, recording the graph, and `grad_fn` (a `GradFunction`)
    splits that graph's backward into dx and dw.

    - `grad_position`: which inputs get dx: an int (that input; dx comes back as
      one gradient), -1 (all inputs), a list/tuple of ints (those; dx comes back
      as a tuple) or None (no input). Each gradient has the shape of its input:
      a tensor for a tensor, the same list/tuple/dict for a nested input (None
      for its non-floating leaves). A selected tensor that does not require
      grad is passed to `fn` as a fresh leaf that does.
    - `weights`: the tensors differentiated by dw: a list/tuple, any iterable
      (e.g. `module.parameters()`) or a dict (dw then comes back as a dict).
      None (default): when `fn` is an nn.Module (or a bound method of one), its
      parameters that require grad, in `parameters()` order; otherwise none.
      A listed weight that does not require grad (frozen) gets None.
    - `has_aux`: `fn` returns `(out, aux...)`; only `out` is differentiated,
      `forward_out` is everything `fn` returned.
    - `kwargs` are passed to `fn` and not differentiated (names `weights`,
      `has_aux` and `grad_position` are this function's own).

    The output differentiated may be a tensor or a list/tuple/dict of them; its
    tensors that do not require grad are left out, and `sens` takes its shape.
    """
    if not callable(fn):
        raise TypeError(
            f"fn must be callable (a function or an nn.Module), not {type(fn).__name__}"
        )
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, not {type(has_aux).__name__}")
    positions, single = _resolve_grad_position(grad_position, len(inputs))
    weight_list, weight_keys = _resolve_weights(fn, weights)
    live_weights = [w for w in weight_list if w.requires_grad]
    if not positions and not live_weights:
        raise ValueError(
            "nothing to differentiate: grad_position selects no input and no weight requires "
            "grad; select inputs (grad_position) or pass weights"
        )
    weight_ids = {id(w) for w in live_weights}

    # The selected inputs: each floating leaf becomes a tensor that requires grad.
    call_inputs = list(inputs)
    dx_tensors: list[torch.Tensor] = []
    input_layout = None if positions is None else []
    for p in positions or []:
        leaves, spec = pytree.tree_flatten(inputs[p])
        new_leaves, slots = [], []
        for leaf in leaves:
            if _differentiable(leaf):
                if id(leaf) in weight_ids:
                    raise ValueError(
                        f"input {p} is also one of the weights; a tensor is differentiated either "
                        "as an input (dx) or as a weight (dw)"
                    )
                t = leaf if leaf.requires_grad else leaf.detach().requires_grad_(True)
                slots.append(len(dx_tensors))
                dx_tensors.append(t)
                new_leaves.append(t)
            else:
                slots.append(None)
                new_leaves.append(leaf)
        if all(s is None for s in slots):
            raise TypeError(
                f"input {p} is {_describe(inputs[p])} with no floating-point tensor, so it has no "
                "gradient; leave it out of grad_position"
            )
        call_inputs[p] = pytree.tree_unflatten(new_leaves, spec)
        input_layout.append((spec, slots))

    with torch.enable_grad():
        forward_out = fn(*call_inputs, **kwargs)

    if has_aux:
        if not isinstance(forward_out, (tuple, list)) or len(forward_out) == 0:
            raise TypeError(
                "has_aux=True needs fn to return a tuple (out, aux...); it returned "
                f"{_describe(forward_out)}"
            )
        differentiated = forward_out[0]
    else:
        differentiated = forward_out

    leaves: list[torch.Tensor] = []
    skeleton = _skeleton(differentiated, leaves)
    out_meta, out_index, out_tensors = [], [], []
    for i, t in enumerate(leaves):
        if t.requires_grad:
            out_meta.append((tuple(t.shape), t.dtype, t.device))
            out_index.append(i)
            out_tensors.append(t)
        else:
            out_meta.append(None)
    if not out_tensors:
        raise RuntimeError(
            "the output of fn does not require grad: it depends on no selected input and no "
            "weight that requires grad"
            + ("" if leaves else f" (fn returned {_describe(differentiated)}, no tensor)")
        )
    impl = _C.autograd.GradFunction(out_tensors, dx_tensors, live_weights)
    slots, k = [], 0
    for w in weight_list:
        if w.requires_grad:
            slots.append(k)
            k += 1
        else:
            slots.append(None)
    grad_fn = GradFunction(impl, skeleton, out_meta, out_index, input_layout, single,
                           len(weight_list), slots, weight_keys)
    return forward_out, grad_fn
