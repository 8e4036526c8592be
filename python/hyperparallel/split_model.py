"""Cutting one model into a schedule's chunks by module names.

``split_model(model, schedule, rank)`` returns ``{chunk: module}`` for
``schedule.chunks_of_rank(rank)``, what :class:`hyperparallel.pipeline.Pipeline`
takes. The model is a sequence of *units*: its embedding module(s), the
blocks of one container (``nn.ModuleList``, ``nn.Sequential`` or
``nn.ModuleDict``) and its tail module(s) (final norm, head). Each chunk is a
consecutive run of units; the embedding goes with the first chunk and the
tail with the last unless the chunks' names are given. A chunk is a
:class:`ModelChunk`: a new ``nn.Module`` that holds the model's own submodules
(no copies: its ``parameters()`` are the model's parameter objects, so an
optimizer over either steps both).

Three kinds of model:

* transformers' decoder-only language models (``LlamaForCausalLM``,
  ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and their
  base models), found without being told: units ``model.embed_tokens``,
  ``model.layers.<i>``, ``model.norm``, ``lm_head``. A chunk's forward takes
  the hidden states (token ids on the first chunk), and before its first
  decoder layer computes what the model's own forward would hand the layers:
  the position ids (given, or ``0..T-1``), the rotary embedding
  (``model.model.rotary_emb``) and the causal mask (full or sliding-window,
  per layer type) from the hidden states' shape and the padding mask
  (``attention_mask``, given or none). The Pipeline hands both to every chunk
  as keyword arguments of ``step``. The last chunk returns the logits.
* torchtitan's Llama 3 ``Transformer`` (``torchtitan.models.llama3``), found
  without being told: units ``tok_embeddings``, ``layers.<k>`` (its
  ``nn.ModuleDict``), ``norm``, ``output`` (those of them that are not
  None). A chunk hands each block what the model's forward does: the model's
  own ``freqs_cis`` buffer (read from the model at each call; the block
  slices it to the sequence length, or indexes it by ``positions``) and the
  model's keyword arguments ``attention_masks`` and ``positions`` (given to
  ``step``, or None). The last chunk returns the logits.
* any model whose blocks each take and return one tensor, given by names:
  ``embed=[...]``, ``blocks="name"``, ``tail=[...]``; a chunk calls its units
  in order, ``h = unit(h)``.

Every rank builds the whole model the same way (the same seed) and keeps the
chunks of its stages; a chunk that the schedule gives to two ranks
(DualPipe's mirrored copies) is then a module over each rank's own model
instance, with equal initial weights, as the runtime needs.
"""

from __future__ import annotations

import difflib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["split_model", "ModelChunk", "moe_aux_losses"]

# transformers' model types whose base model's forward is exactly
# embed_tokens -> layers (with rotary embeddings and a causal mask) -> norm,
# and whose causal LM's forward is lm_head over that (checked against the
# model's own forward: tests/python/test_split_model.py).
_HF_DECODERS = ("llama", "mistral", "mixtral", "qwen2", "qwen3")

# torchtitan's model classes (module, name) whose forward is exactly
# tok_embeddings -> layers.values() (each given the model's freqs_cis,
# attention_masks and positions) -> norm -> output (the same check).
_TITAN_MODELS = (("torchtitan.models.llama3.model.model", "Transformer"),)

# A unit: (name in the model, module, kind) with kind "embed", "block",
# "decoder" (a transformers or torchtitan decoder layer) or "tail".
_Unit = Tuple[str, nn.Module, str]


class ModelChunk(nn.Module):
    """One chunk of a model cut by :func:`split_model`: the model's own
    submodules ``units`` (named ``module_names`` in the model), run in order.

    ``forward(x)``: ``x`` is what the chunk before hands on (the hidden
    states), or the model's input on the first chunk (token ids)."""

    def __init__(self, units: Sequence[_Unit], index: int, num_chunks: int, hf=None,
                 titan=None, owner: Optional[nn.Module] = None):
        super().__init__()
        self.index, self.num_chunks = index, num_chunks
        #: the model's names of this chunk's units, in order
        self.module_names: List[str] = [n for n, _, _ in units]
        self._kinds: List[str] = [k for _, _, k in units]
        self.units = nn.ModuleList([m for _, m, _ in units])
        self._hf = hf  # (config, layer types per decoder unit) for transformers models
        if hf is not None and "decoder" in self._kinds:
            self.rotary_emb = hf[2]  # buffers only; the model's own module
        # torchtitan: the whole model, in a tuple so that it is not a
        # submodule (the chunk's parameters stay its units'), for the
        # freqs_cis buffer it owns: read at each call, so the chunk follows
        # the model's own (init_weights recomputes it, .to() moves it).
        self._titan = (titan,) if titan is not None else None
        # The whole model (not a submodule either), for its router sums (NOTE
        # [MoE load balancing in a pipeline]).
        self._owner = (owner,) if owner is not None else None

    def named_model_parameters(self):
        """``(name in the model, parameter)`` of this chunk's parameters: the
        names of ``model.named_parameters()`` (for checkpoints)."""
        for name, mod in zip(self.module_names, self.units):
            for n, q in mod.named_parameters():
                yield f"{name}.{n}", q

    def _decoder_inputs(self, h: torch.Tensor, attention_mask, position_ids):
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        config = self._hf[0]
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        kw = dict(config=config, inputs_embeds=h, attention_mask=attention_mask,
                  past_key_values=None, position_ids=position_ids)
        masks = {}
        for t in set(self._hf[1].values()):
            fn = create_sliding_window_causal_mask if t == "sliding_attention" else create_causal_mask
            masks[t] = fn(**kw)
        return position_ids, self.rotary_emb(h, position_ids), masks

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, *, attention_masks=None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``attention_mask`` (``[batch, seq]``, 1 for tokens, 0 for padding)
        and ``position_ids`` are the model's own arguments, for the decoder
        layers of a transformers model (the Pipeline hands them to every
        stage: ``pipe.step(ids, targets, attention_mask=mask)``); without
        them, every sequence is full length from position 0.
        ``attention_masks`` and ``positions`` are those of a torchtitan
        model, handed to its blocks as its forward hands them; the other
        model's names are refused rather than ignored."""
        other = ((("attention_mask", attention_mask), ("position_ids", position_ids))
                 if self._titan else (("attention_masks", attention_masks), ("positions", positions))
                 if self._hf else ())
        for n, v in other:
            if v is not None:
                raise TypeError(f"{n}= is no argument of this model's forward ({self.extra_repr()})")
        sums = getattr(self._owner[0], "_hp_router_sums", None) if self._owner else None
        if sums is None or sums.form != "model" or not sums.active():
            return self._units_forward(x, attention_mask, position_ids, attention_masks, positions)
        # NOTE [MoE load balancing in a pipeline]: the router sums travel.
        if self.index == 0:
            zeros = torch.zeros(sums.experts, dtype=torch.float32, device=x.device)
            h, carry = x, (zeros, zeros, 0.0)
        elif isinstance(x, tuple) and len(x) == 4:
            h, carry = x[0], x[1:]
        else:
            raise TypeError(f"{self.extra_repr()}: with the model's router loss on "
                            "(moe_aux_losses) a chunk takes (hidden states, probability sums, "
                            f"assignment counts, rows) from the chunk before, got {type(x).__name__}")
        outer = getattr(_router_logits, "sink", None)
        _router_logits.sink = logits = []
        try:
            h = self._units_forward(h, attention_mask, position_ids, attention_masks, positions)
        finally:
            _router_logits.sink = outer
        prob_sum, tok_sum, rows = _add_router_sums(sums, logits, carry, attention_mask)
        if self.index < self.num_chunks - 1:
            return h, prob_sum, tok_sum, rows
        from .pipeline import add_loss

        # load_balancing_loss_func's last lines, on the sums of every layer
        tokens_per_expert = tok_sum / rows
        router_prob_per_expert = prob_sum / rows
        overall = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
        add_loss(sums.coef * (overall * sums.experts))
        return h

    def _units_forward(self, h, attention_mask, position_ids, attention_masks, positions):
        decoder = None
        for name, kind, mod in zip(self.module_names, self._kinds, self.units):
            if kind == "decoder" and self._titan is not None:
                h = mod(h, self._titan[0].freqs_cis, attention_masks=attention_masks,
                        positions=positions)
            elif kind == "decoder":
                if decoder is None:
                    decoder = self._decoder_inputs(h, attention_mask, position_ids)
                position_ids, position_embeddings, masks = decoder
                h = mod(h, attention_mask=masks[self._hf[1][name]], position_ids=position_ids,
                        position_embeddings=position_embeddings)
                if isinstance(h, tuple):  # older transformers return (hidden_states, ...)
                    h = h[0]
            else:
                h = mod(h)
        return h

    def extra_repr(self) -> str:
        return f"chunk {self.index} of {self.num_chunks}: {', '.join(self.module_names)}"


def _fail_name(model: nn.Module, name: str, what: str) -> None:
    names = [n for n, _ in model.named_modules() if n]
    close = difflib.get_close_matches(name, names, n=3)
    hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
    raise ValueError(f"{what}: {type(model).__name__} has no module named {name!r}{hint}")


def _module(model: nn.Module, name: str, what: str) -> nn.Module:
    if not isinstance(name, str):
        raise TypeError(f"{what}: module names are strs, got {name!r}")
    mods = dict(model.named_modules())
    if name not in mods or not name:
        _fail_name(model, name, what)
    return mods[name]


def _block_names(model: nn.Module, blocks: str) -> List[Tuple[str, nn.Module]]:
    container = _module(model, blocks, "blocks")
    if isinstance(container, (nn.ModuleList, nn.Sequential)):
        items = [(str(i), m) for i, m in enumerate(container)]
    elif isinstance(container, nn.ModuleDict):
        items = list(container.items())
    else:
        raise ValueError(
            f"blocks: {blocks!r} is a {type(container).__name__}, not an nn.ModuleList, "
            "nn.Sequential or nn.ModuleDict of the model's blocks"
        )
    if not items:
        raise ValueError(f"blocks: {blocks!r} holds no blocks")
    return [(f"{blocks}.{k}", m) for k, m in items]


def _hf_units(model: nn.Module):
    """The units of a transformers decoder-only model and (config, layer type
    of each decoder, rotary embedding), or None when ``model`` is not one."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None or not hasattr(config, "to_dict"):
        return None
    if model_type not in _HF_DECODERS:
        raise ValueError(
            f"split_model knows the forward of transformers' {', '.join(_HF_DECODERS)} models, "
            f"not of {type(model).__name__} (model_type {model_type!r}), whose forward may do "
            "more between its modules (e.g. scale the embedding) than a cut by names keeps. "
            "Give its units by name (embed=, blocks=, tail=) only if each block takes and "
            "returns one tensor"
        )
    prefix = ""
    base = model
    if not hasattr(model, "layers"):
        inner = getattr(model, getattr(model, "base_model_prefix", "model") or "model", None)
        if inner is None:
            inner = getattr(model, "model", None)
        if not isinstance(inner, nn.Module) or not hasattr(inner, "layers"):
            return None
        prefix = [n for n, m in model.named_children() if m is inner][0] + "."
        base = inner
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not isinstance(getattr(base, attr, None), nn.Module):
            raise ValueError(f"{type(model).__name__}: no module {prefix}{attr}, which "
                             "a transformers decoder-only model has")
    units: List[_Unit] = [(prefix + "embed_tokens", base.embed_tokens, "embed")]
    layer_types = {}
    types = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None)
    for i, layer in enumerate(base.layers):
        name = f"{prefix}layers.{i}"
        units.append((name, layer, "decoder"))
        if types:
            layer_types[name] = types[i]
        else:
            layer_types[name] = "full_attention" if sliding is None else "sliding_attention"
    units.append((prefix + "norm", base.norm, "tail"))
    head = getattr(model, "lm_head", None)
    if prefix and isinstance(head, nn.Module):
        units.append(("lm_head", head, "tail"))
    return units, (config, layer_types, base.rotary_emb)


def _titan_units(model: nn.Module) -> Optional[List[_Unit]]:
    """The units of torchtitan's Llama 3 Transformer, or None when ``model``
    is not a torchtitan model."""
    cls = type(model)
    if not cls.__module__.startswith("torchtitan."):
        return None
    if (cls.__module__, cls.__name__) not in _TITAN_MODELS:
        raise ValueError(
            f"split_model knows the forward of torchtitan's Llama 3 Transformer, not of "
            f"{cls.__module__}.{cls.__name__}, whose forward may hand its blocks more (or "
            "other) than a cut by names keeps. Give its units by name (embed=, blocks=, "
            "tail=) only if each block takes and returns one tensor"
        )
    if not isinstance(getattr(model, "freqs_cis", None), torch.Tensor):
        raise ValueError(f"{cls.__name__}: no freqs_cis buffer, which torchtitan's Llama 3 has")
    # The forward skips the modules set to None (torchtitan's own pipeline cut).
    units: List[_Unit] = [("tok_embeddings", model.tok_embeddings, "embed")
                          ] if model.tok_embeddings is not None else []
    units += [(n, m, "decoder") for n, m in _block_names(model, "layers")]
    return units + [(n, getattr(model, n), "tail") for n in ("norm", "output")
                    if getattr(model, n) is not None]


def _cuts_by_parameters(costs: List[int], first: int, last: int, k: int) -> List[int]:
    """Blocks per chunk: consecutive groups of at least one block minimizing
    the largest chunk's parameter count (the first chunk counts the
    embedding's too, the last the tail's)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(chunk, i, j):  # blocks i..j-1 in chunk `chunk`
        return (prefix[j] - prefix[i] + (first if chunk == 0 else 0)
                + (last if chunk == k - 1 else 0))

    inf = float("inf")
    # best[c][j]: the smallest largest cost of chunks 0..c holding blocks 0..j-1
    best = [[inf] * (n + 1) for _ in range(k)]
    back = [[0] * (n + 1) for _ in range(k)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for c in range(1, k):
        for j in range(c + 1, n + 1):
            for i in range(c, j):
                v = max(best[c - 1][i], cost(c, i, j))
                if v < best[c][j]:
                    best[c][j], back[c][j] = v, i
    counts, j = [], n
    for c in range(k - 1, 0, -1):
        i = back[c][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return counts[::-1]


def _numel(mod: nn.Module) -> int:
    return sum(q.numel() for q in mod.parameters())


def split_model(
    model: nn.Module,
    schedule,
    rank: int,
    *,
    layers_per_chunk: Optional[Sequence[int]] = None,
    by: str = "layers",
    modules: Optional[Sequence[Sequence[str]]] = None,
    embed: Optional[Sequence[str]] = None,
    blocks: Optional[str] = None,
    tail: Optional[Sequence[str]] = None,
) -> Dict[int, ModelChunk]:
    """Cuts ``model`` into ``schedule.num_chunks`` consecutive chunks and
    returns ``{chunk: ModelChunk}`` for ``schedule.chunks_of_rank(rank)``.

    The cut (one of): ``modules``, a list per chunk of the model's module
    names it holds (blocks such as ``"model.layers.3"``, and where wanted the
    embedding and tail modules: an embedding or tail module left out goes with
    the first or last chunk; a chunk may hold the embedding or the tail alone);
    ``layers_per_chunk``, the blocks of each chunk; ``by="layers"`` (default:
    as even as can be, the earlier chunks taking the remainder) or
    ``by="parameters"`` (the largest chunk's parameter count, embedding and
    tail included, as small as can be).

    The model: a transformers decoder-only LM or torchtitan's Llama 3
    ``Transformer`` (see the module's doc), found by itself, or the names
    ``embed`` (modules run first, in order), ``blocks``
    (the container of the blocks) and ``tail`` (modules run last). Parameters
    shared by modules of two chunks (tied embeddings) are refused: the
    pipeline would not sum their gradients.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    k = getattr(schedule, "num_chunks", None)
    if not isinstance(k, int) or not callable(getattr(schedule, "chunks_of_rank", None)):
        raise TypeError(f"schedule must be a PipelineSchedule, got {type(schedule).__name__}")
    num_ranks = schedule.num_ranks
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be an int in [0, {num_ranks}), got {rank!r}")
    if by not in ("layers", "parameters"):
        raise ValueError(f"by must be 'layers' or 'parameters', got {by!r}")
    given = [a for a, v in (("layers_per_chunk", layers_per_chunk), ("modules", modules)) if v is not None]
    if len(given) > 1 or (given and by != "layers"):
        raise ValueError(f"give one cut: {', '.join(given + (['by'] if by != 'layers' else []))}")

    hf = titan = None
    if blocks is None:
        if embed is not None or tail is not None:
            raise ValueError("embed= and tail= need blocks= (the name of the blocks' container)")
        found = _hf_units(model)
        if found is not None:
            units, hf = found
        else:
            units = _titan_units(model)
            titan = model if units is not None else None
        if units is None:
            raise ValueError(
                f"cannot find the blocks of {type(model).__name__}: it is not a transformers "
                "decoder-only model nor torchtitan's Llama 3; give embed= (module names run "
                "first), blocks= (the name of its nn.ModuleList/nn.ModuleDict of blocks) and "
                "tail= (module names run last)"
            )
    else:
        units = [(n, _module(model, n, "embed"), "embed") for n in (embed or [])]
        units += [(n, m, "block") for n, m in _block_names(model, blocks)]
        units += [(n, _module(model, n, "tail"), "tail") for n in (tail or [])]
        seen = set()
        for n, _, _ in units:
            if n in seen:
                raise ValueError(f"module {n!r} is named twice")
            seen.add(n)
    index = {n: i for i, (n, _, _) in enumerate(units)}
    block_pos = [i for i, (_, _, kind) in enumerate(units) if kind in ("block", "decoder")]
    container = units[block_pos[0]][0].rsplit(".", 1)[0]
    nb = len(block_pos)
    heads = block_pos[0]  # units before the first block
    tails = len(units) - block_pos[-1] - 1

    if modules is not None:
        if isinstance(modules, (str, bytes)) or len(modules) != k:
            raise ValueError(f"modules must be a list of {k} lists of module names (one per chunk "
                             f"of the schedule), got {modules!r}")
        where: Dict[str, int] = {}
        for c, names in enumerate(modules):
            if isinstance(names, (str, bytes)):
                raise TypeError(f"modules[{c}] must be a list of module names, got {names!r}")
            for n in names:
                if n not in index:
                    _module(model, n, f"modules[{c}]")  # raises for a name the model lacks
                    raise ValueError(
                        f"modules[{c}]: {n!r} is a module of the model but not one a cut "
                        f"places: name the blocks ({units[block_pos[0]][0]}, ...) or the "
                        f"embedding/tail modules ({', '.join(u[0] for u in units if u[2] in ('embed', 'tail'))})"
                    )
                if n in where:
                    raise ValueError(f"module {n!r} is in chunk {where[n]} and chunk {c}")
                where[n] = c
        for i, (n, _, kind) in enumerate(units):
            if n not in where:
                if kind == "embed":
                    where[n] = 0
                elif kind == "tail":
                    where[n] = k - 1
                else:
                    raise ValueError(f"block {n!r} is in no chunk of modules=")
        for i in range(1, len(units)):
            a, b = units[i - 1][0], units[i][0]
            if where[b] < where[a]:
                raise ValueError(
                    f"chunks hold consecutive modules: {b!r} (chunk {where[b]}) comes after "
                    f"{a!r} (chunk {where[a]}) in the model"
                )
        for c in range(k):
            if not any(where[n] == c for n in where):
                raise ValueError(f"modules[{c}] names no module: chunk {c} would be empty")
        members = [[u for u in units if where[u[0]] == c] for c in range(k)]
    else:
        if nb < k:
            raise ValueError(
                f"cannot cut {container!r} ({nb} blocks) into the schedule's {k} chunks: each "
                "chunk needs at least one block. Use a schedule with fewer chunks, or give "
                "modules= with the embedding or the norm and head alone in a chunk"
            )
        if layers_per_chunk is not None:
            counts = list(layers_per_chunk)
            if len(counts) != k or any(
                not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in counts
            ) or sum(counts) != nb:
                raise ValueError(
                    f"layers_per_chunk must be {k} ints >= 1 (the schedule's chunks) summing to "
                    f"the {nb} blocks of {container!r}, got {list(layers_per_chunk)!r}"
                )
        elif by == "layers":
            q, r = divmod(nb, k)
            counts = [q + (1 if c < r else 0) for c in range(k)]
        else:
            counts = _cuts_by_parameters(
                [_numel(units[i][1]) for i in block_pos],
                sum(_numel(m) for _, m, _ in units[:heads]),
                sum(_numel(m) for _, m, _ in units[len(units) - tails:]),
                k,
            )
        members, start = [], 0
        for c, n in enumerate(counts):
            lo = 0 if c == 0 else heads + start
            hi = len(units) if c == k - 1 else heads + start + n
            members.append(units[lo:hi])
            start += n

    # Parameters shared across chunks (tied embeddings) would get two
    # gradients the pipeline never sums.
    owner: Dict[int, Tuple[int, str]] = {}
    for c, mem in enumerate(members):
        for n, m, _ in mem:
            for pn, q in m.named_parameters():
                prev = owner.setdefault(id(q), (c, f"{n}.{pn}"))
                if prev[0] != c:
                    raise ValueError(
                        f"{n}.{pn} is the parameter {prev[1]} (shared, e.g. tied embeddings: "
                        f"tie_word_embeddings) but the two are in chunks {prev[0]} and {c}: the "
                        "pipeline would not sum their gradients. Untie them, or put both "
                        "modules in one chunk"
                    )
    owner = model if hf is not None else None
    return {c: ModelChunk(members[c], c, k, hf, titan, owner)
            for c in schedule.chunks_of_rank(rank)}


# NOTE [MoE load balancing in a pipeline]
# transformers' Mixtral adds to its loss `router_aux_loss_coef` times a
# load-balancing term over the router logits of all layers together:
# E * sum_e f_e * P_e, with f_e the share of top-k assignments to expert e
# and P_e its mean router probability, both over every layer's tokens
# (load_balancing_loss_func sums counts and probabilities layer by layer,
# then divides by the rows of all layers). Its gradient at one layer's
# router is E * f_e / N: the assignments of every layer, later stages'
# included, which a stage does not have when it runs its forward. So the
# sums travel with the activations, as a structure between stages (NOTE
# [Pytrees between stages] in pipeline.py): each chunk adds its layers'
# probability sums (differentiable), assignment counts and rows (forward
# only) to what it received, in layer order and with the model's own
# operations and dtypes (float32), and the model's last chunk forms the
# term and adds it with add_loss (NOTE [Auxiliary losses]). Its gradient
# flows back through the probability sums, across stages, to every router:
# the model's own loss, exactly, on any schedule. That is form="model", the
# default of `moe_aux_losses(model)` (routers report their logits to the
# running ModelChunk). form="layer" is the per-layer form that Switch
# Transformer's paper states and Megatron-LM uses: each MoE layer adds its
# own term (load_balancing_loss_func over that layer's logits alone) when
# its router runs, in a Pipeline and, inside collect_losses(), in one
# process alike; nothing travels.
class _RouterSums:
    """What moe_aux_losses(form="model") set on a model: the term's
    constants and the routers' hooks (NOTE [MoE load balancing in a
    pipeline])."""

    def __init__(self, experts: int, top_k: int, coef: float, form: str):
        self.experts, self.top_k, self.coef, self.form = experts, top_k, coef, form
        self.hooks: list = []  # (router, handle)

    def active(self) -> bool:
        """Whether the hooks are still on (handle.remove() ends it)."""
        return bool(self.hooks) and all(h.id in m._forward_hooks for m, h in self.hooks)


_router_logits = __import__("threading").local()  # .sink: the running chunk's list


def _add_router_sums(spec: _RouterSums, logits: List[torch.Tensor], carry, attention_mask):
    """The carried sums with `logits`' layers added, as transformers'
    load_balancing_loss_func accumulates them (same operations, same order)."""
    prob_sum, tok_sum, rows = carry
    device = prob_sum.device
    histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
    flat_mask = None
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_gate in logits:
        routing_weights = torch.nn.functional.softmax(layer_gate.to(device), dim=-1)
        _, selected = torch.topk(routing_weights, spec.top_k, dim=-1)
        if flat_mask is None:
            tok_sum = tok_sum + torch.histc(selected.reshape(-1).to(histc_dtype),
                                            bins=spec.experts, min=0, max=spec.experts)
            prob_sum = prob_sum + routing_weights.float().sum(dim=0)
            rows = rows + routing_weights.shape[0]
        else:
            tok_sum = tok_sum + torch.zeros(spec.experts, dtype=torch.float32, device=device
                                            ).scatter_add_(0, selected.reshape(-1),
                                                           flat_mask.repeat_interleave(spec.top_k))
            prob_sum = prob_sum + (routing_weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + flat_mask.sum()
    return prob_sum, tok_sum, rows


def moe_aux_losses(model: nn.Module, coef: Optional[float] = None, form: str = "model") -> list:
    """Trains a transformers Mixtral's router load-balancing loss (times
    ``coef``, default the config's ``router_aux_loss_coef``) through a
    pipeline of :func:`split_model`'s chunks (NOTE [MoE load balancing in a
    pipeline]). ``form="model"``: the model's own term over all layers, as
    ``model(..., output_router_logits=True)`` adds it; the chunks hand on its
    running sums and the last adds it with ``add_loss``. ``form="layer"``:
    each MoE layer adds its own term with ``add_loss`` whenever its router
    runs (in one process too, inside ``collect_losses()``). Returns the
    routers' hook handles (``handle.remove()`` on each undoes it)."""
    from .pipeline import add_loss

    if form not in ("model", "layer"):
        raise ValueError(f"moe_aux_losses: form must be 'model' or 'layer', got {form!r}")
    config = getattr(model, "config", None)
    experts = getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(experts, int) or not isinstance(top_k, int):
        raise ValueError(f"moe_aux_losses: {type(model).__name__} has no num_local_experts and "
                         "num_experts_per_tok in its config (a transformers Mixtral model has)")
    if isinstance(getattr(model, "_hp_router_sums", None), _RouterSums) and \
            model._hp_router_sums.active():
        raise ValueError("moe_aux_losses: this model's routers already add their loss; remove "
                         "the handles it returned first")
    coef = float(config.router_aux_loss_coef if coef is None else coef)
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    def per_layer(module, inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        add_loss(coef * load_balancing_loss_func((logits,), experts, top_k))

    def report(module, inputs, output):
        sink = getattr(_router_logits, "sink", None)
        if sink is not None:
            sink.append(output[0] if isinstance(output, tuple) else output)

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        raise ValueError(f"moe_aux_losses: no router (a *TopKRouter module) in "
                         f"{type(model).__name__}")
    handles = [m.register_forward_hook(per_layer if form == "layer" else report)
               for m in routers]
    spec = _RouterSums(experts, top_k, coef, form)
    spec.hooks = list(zip(routers, handles))
    model._hp_router_sums = spec
    return handles
