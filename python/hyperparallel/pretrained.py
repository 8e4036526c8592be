"""Weights in and out of one rank's chunks (``split_model``'s ModelChunks),
by the model's own names (NOTE [Checkpoints of a rank's chunks]).

* ``load_pretrained(chunks, folder)``: a Hugging Face checkpoint folder
  (``model.safetensors``, or shards with ``model.safetensors.index.json``)
  into this rank's chunks, reading only their tensors;
* ``save_pretrained(chunks, folder)``: the chunks of every rank saved as one
  Hugging Face checkpoint (each rank writes its shard, rank 0 the index and
  ``config.json``) that ``AutoModelForCausalLM.from_pretrained`` reads;
* ``save_checkpoint`` / ``load_checkpoint``: the chunks and their
  optimizer's state with ``torch.distributed.checkpoint`` (DCP), for resume,
  on the same or another pipeline size.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Dict, Mapping, Optional

import torch
import torch.distributed as dist

# NOTE [Checkpoints of a rank's chunks]
# Every tensor is named as in the whole model (model.named_parameters(), a
# tied weight under its first name: what transformers' save_pretrained
# writes) plus the chunks' units' persistent buffers (DeepSeek-V3's router
# bias). So a checkpoint does not depend on the cut:
#   * Hugging Face format: each rank writes the tensors it is the lowest
#     rank to hold (a tied weight on two ranks, DualPipe's mirrored copies:
#     written once) to model-<r+1>-of-<ranks>.safetensors (a rank with none
#     writes no file), and rank 0, after all have written, the index that
#     maps each name to its file, then config.json. Files are written under
#     a temporary name and renamed, the index last: a folder whose index is
#     there is whole. Loading reads the index (or the single file), opens
#     only the files that hold this rank's names and reads only those
#     tensors (safetensors reads a tensor at a time).
#   * DCP: one state dict {"model": {name: tensor}, "optim": {name + "/" +
#     key: value}} per rank; DCP writes each name once (replicas are
#     deduplicated by name) and loads by name, so a checkpoint saved at one
#     pipeline size loads at another, or into the whole model on one
#     process. The optimizer's per-parameter state is keyed by the
#     parameter's model name; before loading, an optimizer without state is
#     stepped once with zero gradients and learning rate 0 so that its state
#     tensors exist to be filled.

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _tensors(chunks) -> Dict[str, torch.Tensor]:
    """{model name: tensor} of the chunks' parameters and persistent buffers."""
    out: Dict[str, torch.Tensor] = {}
    for chunk in _chunk_list(chunks):
        for n, q in chunk.named_model_parameters():
            out.setdefault(n, q)
        params = {id(q) for q in chunk.parameters()}
        for name, unit in zip(chunk.module_names, chunk.units):
            for k, t in unit.state_dict(keep_vars=True).items():
                if id(t) not in params:
                    out.setdefault(f"{name}.{k}", t)
    return out


def _chunk_list(chunks):
    if isinstance(chunks, Mapping):
        chunks = [chunks[c] for c in sorted(chunks)]
    chunks = list(chunks)
    for c in chunks:
        if not callable(getattr(c, "named_model_parameters", None)):
            raise TypeError(f"expected split_model's chunks, got {type(c).__name__}")
    return chunks


def _safetensors():
    try:
        import safetensors.torch  # noqa: F401
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - a dependency of transformers
        raise ImportError("Hugging Face checkpoints need the safetensors package "
                          "(pip install safetensors)") from e
    return safe_open


def load_pretrained(chunks, folder: str) -> Dict[str, str]:
    """Loads this rank's chunks from a Hugging Face checkpoint folder,
    reading only their tensors; returns ``{name: file}`` of what it read.
    A name the checkpoint lacks or a shape that differs is a ValueError
    naming it (NOTE [Checkpoints of a rank's chunks])."""
    safe_open = _safetensors()
    index = os.path.join(folder, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    elif os.path.isfile(os.path.join(folder, _SINGLE)):
        with safe_open(os.path.join(folder, _SINGLE), framework="pt") as f:
            weight_map = {k: _SINGLE for k in f.keys()}
    else:
        raise FileNotFoundError(f"{folder} holds neither {_INDEX} nor {_SINGLE}: not a Hugging "
                                "Face safetensors checkpoint folder")
    mine = _tensors(chunks)
    from torch.distributed.tensor import DTensor

    sharded = sorted(n for n, t in mine.items() if isinstance(t, DTensor))
    if sharded:
        raise ValueError(f"load_pretrained: {sharded[0]} is already sharded (a DTensor): load the "
                         "checkpoint into the chunks first, then fully_shard them")
    owner = _owner_of(chunks)
    wanted = sorted(_to_checkpoint(owner, {n: t.detach() for n, t in mine.items()}))
    missing = [n for n in wanted if n not in weight_map]
    if missing:
        raise ValueError(f"{folder} lacks {len(missing)} tensor(s) of this rank's chunks: "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    by_file: Dict[str, list] = {}
    for n in wanted:
        by_file.setdefault(weight_map[n], []).append(n)
    read: Dict[str, torch.Tensor] = {}
    for fname, names in sorted(by_file.items()):
        with safe_open(os.path.join(folder, fname), framework="pt") as f:
            for n in names:
                read[n] = f.get_tensor(n)
    loaded = _from_checkpoint(owner, read)
    with torch.no_grad():
        for n, dst in mine.items():
            t = loaded.get(n)
            if t is None:
                raise ValueError(f"{folder}: no tensor of {n} after transformers' conversion of "
                                 "the checkpoint's names")
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"{n} in {folder} has shape {tuple(t.shape)}, the chunk's "
                                 f"{tuple(dst.shape)}: a checkpoint of another config")
            dst.copy_(t)
    return {n: weight_map[n] for n in wanted}


def _owner_of(chunks):
    for c in _chunk_list(chunks):
        owner = getattr(c, "_owner", None)
        if owner:
            return owner[0]
    return None


def _to_checkpoint(model, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Model names -> the checkpoint's (transformers 5 fuses some weights,
    MoE experts for one, and saves them unfused): its own save conversion."""
    if model is None:
        return dict(tensors)
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(tensors))


def _from_checkpoint(model, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The checkpoint's names -> the model's: transformers' load conversion
    (renamings, then at most one converter per key), for these keys only."""
    if model is None:
        return dict(tensors)
    from copy import deepcopy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (PrefixChange, WeightConverter, WeightRenaming,
                                                 rename_source_key)

    transforms = [t for t in get_model_conversion_mapping(model, add_legacy=False)
                  if not isinstance(t, PrefixChange)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {k: c for c in converters for k in c.source_patterns}
    pending: Dict[str, object] = {}
    for key, tensor in sorted(tensors.items()):
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is not None:
            step = pending.setdefault(name, deepcopy(by_pattern[pattern]))
        else:
            step = pending.setdefault(name, WeightRenaming(key, name))
            pattern = key
        step.add_tensor(name, key, pattern, tensor)
    out = {}
    for name, step in pending.items():
        for target, value in step.convert(name, model=model, config=model.config).items():
            out[target] = value[0] if isinstance(value, list) else value
    return out


def _gather(obj, group):
    if not dist.is_available() or not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _rank_alone() -> bool:
    """No process group: a checkpoint of one process (the whole model)."""
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _alone_quietly():
    """DCP warns that it assumes one process even when told so: not here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable "
                                "or uninitialized")
        yield


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def save_pretrained(chunks, folder: str, group=None) -> Optional[str]:
    """Saves the chunks of every rank of ``group`` (default: the whole
    world; call it on every rank) as one Hugging Face checkpoint folder:
    this rank's shard, and on rank 0 the index and the model's
    ``config.json``. Returns the shard this rank wrote (None if it held only
    tensors a lower rank writes)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    mine = _tensors(chunks)
    names = _gather(sorted(mine), group)
    rank, n = _rank(group), len(names)
    writer: Dict[str, int] = {}
    for r, ns in enumerate(names):
        for name in ns:
            writer.setdefault(name, r)
    fname = f"model-{rank + 1:05d}-of-{n:05d}.safetensors"
    from torch.distributed.tensor import DTensor

    # FSDP2's shards gathered whole (a collective over their mesh: every rank
    # of it holds the same names, in the same order).
    full = {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu")
            for k, t in mine.items()}
    own = _to_checkpoint(_owner_of(chunks), {k: t for k, t in full.items() if writer[k] == rank})
    own = {k: t.contiguous().clone() for k, t in own.items()}
    written = _gather(sorted(own), group)
    if own:
        tmp = os.path.join(folder, fname + ".tmp")
        save_file(own, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(folder, fname))
    sizes = _gather(sum(t.numel() * t.element_size() for t in own.values()), group)
    if rank == 0:
        index = {"metadata": {"total_size": sum(sizes)},
                 "weight_map": {k: f"model-{r + 1:05d}-of-{n:05d}.safetensors"
                                for r, ks in enumerate(written) for k in ks}}
        owner = _owner_of(chunks)
        if owner is not None:
            owner.config.save_pretrained(folder)
        tmp = os.path.join(folder, _INDEX + ".tmp")
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2)
        os.replace(tmp, os.path.join(folder, _INDEX))
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group)
    return fname if own else None


def _optim_state(chunks, optimizer) -> Dict[str, object]:
    names = {id(t): n for n, t in _tensors(chunks).items()}
    out = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not one of the "
                                 "chunks': give it the chunks' parameters only")
            for k, v in optimizer.state.get(p, {}).items():
                out[f"{names[id(p)]}/{k}"] = v
    return out


def _init_state(optimizer) -> None:
    """An optimizer's per-parameter state made to exist (zero gradients,
    learning rate 0, one step), so that a checkpoint can fill it."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    saved_grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    for p, gr in zip(params, saved_grads):
        p.grad = gr


def save_checkpoint(chunks, optimizer, folder: str, group=None) -> None:
    """The chunks (and ``optimizer``'s state, if given) saved with
    ``torch.distributed.checkpoint`` by the model's names; every rank calls
    it (NOTE [Checkpoints of a rank's chunks])."""
    import torch.distributed.checkpoint as dcp

    state = {"model": dict(_tensors(chunks))}
    if optimizer is not None:
        state["optim"] = _optim_state(chunks, optimizer)
    with _alone_quietly():
        dcp.save(state, checkpoint_id=folder, process_group=group, no_dist=_rank_alone())


def load_checkpoint(chunks, optimizer, folder: str, group=None) -> None:
    """Loads what :func:`save_checkpoint` saved, at this or another pipeline
    size (or into the whole model's one chunk on one process)."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such checkpoint folder")
    state: Dict[str, Dict[str, object]] = {"model": dict(_tensors(chunks))}
    if optimizer is not None:
        _init_state(optimizer)
        state["optim"] = _optim_state(chunks, optimizer)
    with torch.no_grad():
        with _alone_quietly():
            dcp.load(state, checkpoint_id=folder, process_group=group, no_dist=_rank_alone())
    if optimizer is not None:  # scalars (not tensors) come back by value
        names = {id(t): n for n, t in _tensors(chunks).items()}
        for g in optimizer.param_groups:
            for p in g["params"]:
                st = optimizer.state.get(p, {})
                for k in list(st):
                    v = state["optim"][f"{names[id(p)]}/{k}"]
                    if not isinstance(st[k], torch.Tensor):
                        st[k] = v
