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

* transformers' decoder-only language models (any ``...ForCausalLM`` or base
  model whose forward is an embedding, a row of decoder layers, a final norm
  and a head: llama, mistral, mixtral, qwen2, qwen3, qwen2_moe, qwen3_moe,
  deepseek_v3, gemma, gemma2, phi3, gpt2, gpt_neox, olmo2, ...), found without
  being told by a probe run (split_model_hf.py): units the modules with
  parameters that run before the layers (``model.embed_tokens``; GPT-2's
  ``transformer.wte`` and ``transformer.wpe``), the layers
  (``model.layers.<i>``) and the modules that run after them
  (``model.norm``, ``lm_head``). A chunk runs the model's own forward with
  the other chunks' modules skipped, so every layer gets what the forward
  hands it (masks, positions, rotary tables, per-layer attention types) and
  the head whatever follows it (NOTE [Cutting a transformers decoder]). Its
  forward takes the hidden states (token ids on the first chunk) and the
  model's ``attention_mask`` and ``position_ids``, which the Pipeline hands
  to every chunk as keyword arguments of ``step``. The last chunk returns the
  logits.
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
instance, with equal initial weights, as the runtime needs. So is a
parameter that units of two chunks share (tied input and output
embeddings): each holder's copy, summed over its holders after each step
(NOTE [Parameters shared by chunks]).
"""

from __future__ import annotations

import difflib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .losses import add_loss
from .meta_init import materialize, on_meta, skeleton
from .router_losses import _add_router_sums, _router_logits, moe_aux_losses

__all__ = ["split_model", "ModelChunk", "moe_aux_losses"]

# torchtitan's model classes (module, name) whose forward is exactly
# tok_embeddings -> layers.values() (each given the model's freqs_cis,
# attention_masks and positions) -> norm -> output (the same check).
_TITAN_MODELS = (("torchtitan.models.llama3.model.model", "Transformer"),)

# A unit: (name in the model, module, kind) with kind "embed", "block",
# "decoder" (a transformers or torchtitan decoder layer) or "tail".

# NOTE [Parameters shared by chunks]
# A parameter held by units of two chunks (tied input and output embeddings:
# the head's weight is the embedding's) is one model-wide parameter: each
# chunk reports it under the model's own name (the first of
# model.named_parameters()), and `shared_parameters` names the chunks that
# hold it. Chunks of one rank share the one object (autograd adds both
# gradients into its .grad); chunks on different ranks hold each rank's own
# copy, equal at the start (every rank builds the model from one seed), and
# the Pipeline sums the copies' gradients over their ranks after each step,
# in rank order, so the copies get the same bits and stay equal: the
# gradient one process computes. The C++ Pipeline does the sum, as for any
# parameter held under one name on several ranks (the runtime names each
# shared parameter by its model-wide name: _parameter_names in
# pipeline/runtime.py).
_Unit = Tuple[str, nn.Module, str]


class ModelChunk(nn.Module):
    """One chunk of a model cut by :func:`split_model`: the model's own
    submodules ``units`` (named ``module_names`` in the model), run in order.

    ``forward(x)``: ``x`` is what the chunk before hands on (the hidden
    states), or the model's input on the first chunk (token ids)."""

    def __init__(self, units: Sequence[_Unit], index: int, num_chunks: int, hf=None,
                 titan=None, owner: Optional[nn.Module] = None,
                 names: Optional[Dict[int, str]] = None,
                 holders: Optional[Dict[int, Tuple[int, ...]]] = None):
        super().__init__()
        self.index, self.num_chunks = index, num_chunks
        #: the model's names of this chunk's units, in order
        self.module_names: List[str] = [n for n, _, _ in units]
        self._kinds: List[str] = [k for _, _, k in units]
        self.units = nn.ModuleList([m for _, m, _ in units])
        # transformers: the probe's HfPlan (not a module) and this chunk's
        # span of layers (NOTE [Cutting a transformers decoder]).
        self._hf = hf
        if hf is not None:
            pos = {n: i for i, n in enumerate(hf.layer_names)}
            mine = [pos[n] for n in self.module_names if n in pos]
            has_embed = "embed" in self._kinds
            lo = mine[0] if mine else (0 if has_embed else len(pos))
            hi = mine[-1] + 1 if mine else lo
            self._span = (has_embed, lo, hi, "tail" in self._kinds)
        # torchtitan: the whole model, in a tuple so that it is not a
        # submodule (the chunk's parameters stay its units'), for the
        # freqs_cis buffer it owns: read at each call, so the chunk follows
        # the model's own (init_weights recomputes it, .to() moves it).
        self._titan = (titan,) if titan is not None else None
        # The whole model (not a submodule either), for its router sums (NOTE
        # [MoE load balancing in a pipeline] in router_losses.py).
        self._owner = (owner,) if owner is not None else None
        # Model-wide names by parameter (the model's first name for a shared
        # one) and the parameters other chunks hold too (NOTE [Parameters
        # shared by chunks]).
        self._names = names or {}
        holders = holders or {}
        #: ``{name in the model: chunks holding it}`` of this chunk's
        #: parameters that other chunks hold too (tied embeddings)
        self.shared_parameters: Dict[str, Tuple[int, ...]] = {
            n: holders[id(q)] for n, q in self.named_model_parameters() if id(q) in holders}
        # The shared parameter objects themselves: one replaced in a holder
        # (fully_shard on its module) is refused by the Pipeline's checks.
        self._shared_objects = {n: q for n, q in self.named_model_parameters() if id(q) in holders}

    def named_model_parameters(self):
        """``(name in the model, parameter)`` of this chunk's parameters: the
        names of ``model.named_parameters()`` (for checkpoints), each once; a
        parameter shared with another unit (a tied head) under the model's
        first name for it."""
        seen = set()
        for name, mod in zip(self.module_names, self.units):
            for n, q in mod.named_parameters():
                if id(q) not in seen:
                    seen.add(id(q))
                    yield self._names.get(id(q), f"{name}.{n}"), q

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
        # load_balancing_loss_func's last lines, on the sums of every layer
        tokens_per_expert = tok_sum / rows
        router_prob_per_expert = prob_sum / rows
        overall = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
        add_loss(sums.coef * (overall * sums.experts))
        return h

    def _units_forward(self, h, attention_mask, position_ids, attention_masks, positions):
        if self._hf is not None:
            return self._hf.run(h, *self._span[:3], self._span[3], attention_mask, position_ids)
        for kind, mod in zip(self._kinds, self.units):
            if kind == "decoder":  # torchtitan
                h = mod(h, self._titan[0].freqs_cis, attention_masks=attention_masks,
                        positions=positions)
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
    """The units of a transformers decoder-only model and the probe's plan
    (NOTE [Cutting a transformers decoder]), or None when ``model`` is not a
    transformers model; ValueError naming the reason when it cannot be cut."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) is None or not hasattr(config, "to_dict"):
        return None
    from .split_model_hf import probe

    plan = probe(model)
    return plan.units(), plan


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
    seed: Optional[int] = None,
    device=None,
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
    (the container of the blocks) and ``tail`` (modules run last). A
    parameter shared by modules of two chunks (tied embeddings) is reported
    by both under one model-wide name, its gradient summed over its holders
    after each step (NOTE [Parameters shared by chunks]).

    A transformers model built on the meta device (``with
    torch.device("meta")``) is cut the same way and only this rank's chunks
    are made real, by the model's own initialization from ``seed`` (default
    ``torch.initial_seed()``) on ``device`` (default the CPU): equal to
    ``materialize(model, seed)`` of the whole model (NOTE [A model built on
    the meta device] in meta_init.py).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(getattr(model, "_orig_mod", None), nn.Module) and \
            type(model).__name__ == "OptimizedModule":
        raise TypeError(
            "split_model was given torch.compile(model): cut the model itself "
            "(split_model(model, ...), or the compiled one's ._orig_mod), then compile "
            "each chunk if you like (torch.compile(chunk))")
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

    meta = on_meta(model)
    if meta:
        skeleton(model)  # refuses a model that is not a transformers one
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
        try:  # a transformers decoder that its own forward can cut
            cut_by_forward = _hf_units(model) is not None
        except ValueError:
            cut_by_forward = False  # the probe's refusal leaves the names to the caller
        if cut_by_forward:
            raise ValueError(
                f"{type(model).__name__} is a transformers model: its decoder layers take more "
                "than the hidden states (position embeddings, masks), which a cut by names "
                "(embed=, blocks=, tail=) does not hand them. Give none of those: split_model "
                "cuts a transformers decoder by its own forward (modules= or "
                "layers_per_chunk= choose the cut)")
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
    if not block_pos:
        raise ValueError(
            f"{type(model).__name__} has no blocks (0 layers) to cut into the schedule's {k} "
            "chunks: build it with at least one layer per chunk")
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

    if hf is not None:
        # The model's forward computes between its embedding modules (GPT-2
        # adds wte's and wpe's) and between its tail's: each kind in one chunk.
        for kind in ("embed", "tail"):
            held = sorted({c for c, mem in enumerate(members) for _, _, kd in mem if kd == kind})
            if len(held) > 1:
                names = [n for n, _, kd in units if kd == kind]
                raise ValueError(
                    f"the {kind} modules {', '.join(names)} of {type(model).__name__} are in "
                    f"chunks {held}: its forward computes between them, so they go in one chunk")
    # NOTE [Parameters shared by chunks]
    names: Dict[int, str] = {}
    for n, q in model.named_parameters():
        names.setdefault(id(q), n)
    where: Dict[int, set] = {}
    for c, mem in enumerate(members):
        for _, m, _ in mem:
            for q in m.parameters():
                where.setdefault(id(q), set()).add(c)
    holders = {i: tuple(sorted(cs)) for i, cs in where.items() if len(cs) > 1}
    ranks_of = _chunk_ranks(schedule)
    for i, cs in holders.items():
        sets = [ranks_of[c] for c in cs]
        if any(s != sets[0] for s in sets) and any(len(s) > 1 for s in sets):
            raise ValueError(
                f"{names[i]} is shared by chunks {list(cs)}, held by ranks "
                f"{[sorted(s) for s in sets]}: the schedule replicates some of them and not "
                "the others, whose gradient sums would count copies twice. Use a schedule "
                "whose chunks are not replicated (zbv, dualpipev, 1f1b, ...), or untie them")
    if meta:
        materialize(model, seed, [q for c in schedule.chunks_of_rank(rank)
                                  for _, m, _ in members[c] for q in m.parameters()], device)
    owner = model if hf is not None else None
    return {c: ModelChunk(members[c], c, k, hf, titan, owner, names, holders)
            for c in schedule.chunks_of_rank(rank)}


def _chunk_ranks(schedule) -> Dict[int, set]:
    ranks: Dict[int, set] = {}
    for st, c in enumerate(schedule.stage_chunk):
        ranks.setdefault(c, set()).add(schedule.stage_rank[st])
    return ranks
