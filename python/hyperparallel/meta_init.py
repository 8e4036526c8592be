"""A transformers model built on the meta device, made real one rank's part
at a time (NOTE [A model built on the meta device]).

``materialize(model, seed)`` gives every parameter of a meta-built model
storage and the values its own initialization draws; ``split_model`` does the
same for the parameters of one rank's chunks only, so a rank holds its chunks
and never the whole model.
"""

from __future__ import annotations

import zlib
from typing import Iterable, Optional

import torch
from torch import nn

# NOTE [A model built on the meta device]
# A model built under torch.device("meta") has shapes and no storage. The
# cut needs a forward (the probe of split_model_hf.py) and each rank needs
# real values for its own chunks only, the same on every rank that holds a
# copy and the same as a full model made real by the same call:
#   * skeleton: every meta parameter becomes a zero of its dtype expanded to
#     its shape (stride 0: one element of storage), so the probe's forward
#     runs and its autograd finds which parameters each part uses (values
#     are not what it checks). Buffers (rotary tables, Gemma's embedding
#     scale, DeepSeek's router bias) are small and made real on every rank
#     by the model's own _init_weights, under a forked RNG.
#   * materialize: each module that holds a wanted parameter is initialized
#     by its model's _init_weights (the nearest transformers PreTrainedModel
#     above it, as transformers' own initialize_weights dispatches), children
#     before parents, from its own generator seed: seed mixed with the
#     module's name (crc32). So a module's values do not depend on which
#     other modules a rank makes real, and a rank makes real only the modules
#     of its chunks: the module's other parameters (not this rank's) get
#     scratch storage for the call and go back to the skeleton. A parameter
#     two modules hold (tied embeddings) is initialized once, by its first
#     holder in that order, on every rank; transformers' guarded init
#     functions skip it in the second (it is flagged _is_hf_initialized for
#     the call).
# The values are those of the model's own initialization, but not the same
# draws as building the model on a real device: there the construction's own
# draws and the order of the whole model's modules decide the stream. The
# reference for a meta-built model is materialize(model, seed) on one
# process, which the pipeline's chunks equal exactly.
# Limits: transformers models only (their _init_weights is the contract);
# an _init_weights that writes a module's tensors with plain tensor methods
# (not transformers.initialization's functions) would re-initialize a tied
# parameter in its second holder.

_SKELETON = "_hp_skeleton"


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def _init_owner(model: nn.Module):
    """The model's per-module initializer, or None for a model that has none."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a test dependency
        return None
    return PreTrainedModel if isinstance(model, PreTrainedModel) else None


def _refuse(model: nn.Module) -> None:
    raise ValueError(
        f"{type(model).__name__} is built on the meta device, and only a transformers model "
        "(a PreTrainedModel, whose _init_weights initializes each module) can be made real "
        "one rank's chunks at a time: build it on a real device, or load its weights into "
        "chunks you make real yourself")


def skeleton(model: nn.Module) -> None:
    """Meta parameters -> stride-0 zeros on the CPU; meta buffers -> their
    real values from the model's _init_weights (NOTE [A model built on the
    meta device])."""
    if _init_owner(model) is None:
        _refuse(model)
    swapped = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in swapped:
                q = nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape),
                                 requires_grad=p.requires_grad)
                setattr(q, _SKELETON, True)
                swapped[id(p)] = q
            mod._parameters[name] = swapped[id(p)]
    for path, mod, owner in _modules_in_init_order(model):
        if not any(b is not None and b.is_meta for b in mod._buffers.values()):
            continue
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                mod._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)
        with _scratch(mod, set()), torch.random.fork_rng(devices=[]):
            owner._init_weights(mod)


def _modules_in_init_order(model: nn.Module):
    """(name, module, PreTrainedModel that initializes it), children before
    parents, as transformers' initialize_weights (smart_apply) visits them."""
    from transformers import PreTrainedModel

    out = []

    def walk(prefix, mod, owner):
        for name, child in mod.named_children():
            walk(f"{prefix}{name}.", child, child if isinstance(child, PreTrainedModel) else owner)
        out.append((prefix[:-1], mod, owner))

    walk("", model, model)
    return out


class _scratch:
    """For one module's initialization: its own skeleton parameters get
    storage (those whose id is in ``keep`` keep it after the block); its
    descendants' skeleton parameters (other ranks' units) are swapped for meta
    ones for the block, so that an initializer writing them neither fails nor
    allocates."""

    def __init__(self, mod: nn.Module, keep: set):
        self.mod, self.keep, self.back, self.swapped = mod, keep, [], []

    def __enter__(self):
        for p in self.mod.parameters(recurse=False):
            if getattr(p, _SKELETON, False):
                self.back.append(p)
                p.data = torch.empty(p.shape, dtype=p.dtype)
        for child in self.mod.children():
            for sub in child.modules():
                for name, p in sub._parameters.items():
                    if p is not None and getattr(p, _SKELETON, False):
                        self.swapped.append((sub, name, p))
                        sub._parameters[name] = nn.Parameter(
                            torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
        return self

    def __exit__(self, *exc):
        for sub, name, p in self.swapped:
            sub._parameters[name] = p
        for p in self.back:
            if id(p) in self.keep and exc[0] is None:
                delattr(p, _SKELETON)
            else:
                p.data = torch.zeros((), dtype=p.dtype).expand(p.shape)


def _module_seed(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def materialize(model: nn.Module, seed: Optional[int] = None,
                params: Optional[Iterable[nn.Parameter]] = None,
                device: Optional[torch.device] = None) -> nn.Module:
    """Makes real the parameters ``params`` (default: all) of a model built
    on the meta device, each module initialized by the model's own
    ``_init_weights`` from a generator of ``seed`` (default
    ``torch.initial_seed()``) and its name, then moved to ``device`` (default
    the CPU). Equal on every rank and to the whole model made real by the same
    call (NOTE [A model built on the meta device]). Returns the model."""
    if any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers()):
        skeleton(model)
    if _init_owner(model) is None:
        _refuse(model)
    from transformers import initialization as hf_init

    seed = torch.initial_seed() if seed is None else int(seed)
    wanted = {id(p) for p in (model.parameters() if params is None else params)
              if getattr(p, _SKELETON, False)}
    first: dict = {}  # id(parameter) -> the name of the module that initialized it
    done = []
    try:
        with torch.no_grad(), hf_init.guard_torch_init_functions():
            for name, mod, owner in _modules_in_init_order(model):
                mine = [p for p in mod.parameters() if id(p) in wanted]
                if not mine:
                    continue
                # A parameter that a module outside this one initialized (a
                # tied one's first holder) is skipped by the guarded init
                # functions; one of a descendant is this module's to redo
                # (GPT-2's scaled c_proj).
                under = name + "." if name else ""
                for p in mine:
                    if id(p) in first:
                        inside = first[id(p)] == name or first[id(p)].startswith(under)
                        if inside:
                            p.__dict__.pop("_is_hf_initialized", None)
                        else:
                            p._is_hf_initialized = True
                with _scratch(mod, wanted), torch.random.fork_rng(devices=[]):
                    torch.manual_seed(_module_seed(seed, name))
                    owner._init_weights(mod)
                for p in mine:
                    if id(p) not in first:
                        first[id(p)] = name
                        done.append(p)
    finally:
        for p in done:
            p.__dict__.pop("_is_hf_initialized", None)
    if device is not None and torch.device(device).type != "cpu":
        for p in done:
            p.data = p.data.to(device)
        for b in model.buffers():
            b.data = b.data.to(device)
    return model
