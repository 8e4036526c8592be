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
                 titan=None):
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
        h = x
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
    return {c: ModelChunk(members[c], c, k, hf, titan) for c in schedule.chunks_of_rank(rank)}


# NOTE [MoE load balancing in a pipeline]
# transformers' Mixtral adds to its loss `router_aux_loss_coef` times a
# load-balancing term over the router logits of all layers concatenated:
# E * sum_e f_e * P_e, with f_e the share of top-k assignments to expert e
# and P_e its mean router probability, both over every layer's tokens. Its
# gradient at one layer's router is E * f_e / N: the assignments of every
# other layer, later stages' included, which a stage does not have when it
# runs its backward alone. So a pipeline trains the per-layer form that
# Switch Transformer's paper states and Megatron-LM uses: each MoE layer's
# own term (load_balancing_loss_func over that layer's logits alone), summed
# over layers, each added by its layer with hyperparallel.pipeline.add_loss
# (NOTE [Auxiliary losses] in pipeline.py) and so joined to its own stage's
# backward. `moe_aux_losses(model)` puts that on a model's routers (hooks on
# the model's own modules: the chunks of split_model share them), for a
# Pipeline and, inside collect_losses(), for one process alike.
def moe_aux_losses(model: nn.Module, coef: Optional[float] = None) -> list:
    """Adds each MoE layer's load-balancing loss (times ``coef``, default the
    config's ``router_aux_loss_coef``) with ``add_loss`` whenever its router
    runs (NOTE [MoE load balancing in a pipeline]). For transformers' Mixtral
    models; returns the hooks' handles (``handle.remove()`` undoes it)."""
    from .pipeline import add_loss

    config = getattr(model, "config", None)
    experts = getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(experts, int) or not isinstance(top_k, int):
        raise ValueError(f"moe_aux_losses: {type(model).__name__} has no num_local_experts and "
                         "num_experts_per_tok in its config (a transformers Mixtral model has)")
    coef = float(config.router_aux_loss_coef if coef is None else coef)
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    def hook(module, inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        add_loss(coef * load_balancing_loss_func((logits,), experts, top_k))

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if type(m).__name__.endswith("TopKRouter")]
    if not handles:
        raise ValueError(f"moe_aux_losses: no router (a *TopKRouter module) in "
                         f"{type(model).__name__}")
    return handles
