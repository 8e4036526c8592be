"""How split_model cuts a transformers decoder-only model: one probe finds its
units and checks that a cut at layer boundaries keeps its forward, and each
chunk runs the model's own forward with the other chunks' modules skipped
(NOTE [Cutting a transformers decoder])."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .losses import collect_losses

# NOTE [Cutting a transformers decoder]
# A decoder-only LM of transformers is an embedding, a row of decoder layers
# (the one nn.ModuleList of the base model with config.num_hidden_layers
# entries), a final norm and a head, but what its forward computes between
# them differs per model: Gemma scales the embedding, GPT-2 adds learned
# positions, Gemma 2 picks each layer's mask by config.layer_types[i] and
# caps the logits, MoE models record router outputs. Rather than restate
# each forward, a chunk runs the model's own forward, whole, with the other
# chunks' work skipped:
#   * a chunk without the embedding feeds placeholder token ids of the
#     hidden states' [batch, seq] (the masks, positions and rotary tables
#     the forward hands the layers depend on shapes, the padding mask and
#     position_ids only: checked); the embedding modules it does not hold
#     return zeros of their probed shape instead of running, the layers
#     before its first return their input unchanged (an instance `forward`
#     for the call), and a forward pre-hook on its first layer swaps the
#     hidden states for the ones received (a forward hook on the last layer
#     for a chunk of the tail alone);
#   * a chunk without the tail stops at the hidden states entering the
#     layer after its last (a forward pre-hook raises _Stop carrying them;
#     the last layer's forward hook for a chunk that ends with the layers);
#   * the chunk with the tail returns the forward's logits (last_hidden_state
#     for a base model).
# So every layer gets exactly the arguments the model's forward gives it, by
# whatever rule it picks them, and the head whatever follows the norm.
# What split_model checks once, on a probe run of two forwards over four
# tokens (grad on, RNG state restored, router losses collected and dropped),
# and refuses otherwise, naming the reason:
#   * each layer runs once, in order, its hidden states the first argument
#     (or hidden_states=) and its output a tensor or a tuple that starts
#     with them, and layer i + 1 receives exactly the object layer i
#     returned (nothing is computed between layers, no other state carried);
#   * every parameter a segment uses (autograd from the segment's output to
#     a leaf at its input: before the first layer, each layer, after the
#     last) belongs to that segment's modules: no module shared between
#     layers, no per-layer argument computed from the embedding (it would
#     lose its gradient), a head that only uses weights of the tail's
#     modules (a tied head holds the embedding's weight as its own);
#   * the layers' other arguments do not change with the token values (two
#     probes, different ids): they are rebuilt from placeholder ids;
#   * modules with parameters run before or after the layers, not both.
# Limits: randomness (dropout, router jitter) draws in another order than one
# process does; models whose forward needs inputs besides input_ids,
# attention_mask and position_ids (token_type_ids, pixel values) get only
# those three; encoder-decoders and models that carry state between layers
# (Gemma 3n's per-layer inputs, hybrid caches) are refused, not guessed.
# Chunks that do not run the embedding still run the forward's cheap parts
# before the layers (mask and rotary tables), as every layer needs them.


class _Stop(BaseException):
    """Raised inside the model's forward where a chunk ends (a BaseException:
    no `except Exception` of model code swallows it)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


def _hidden_in(args, kwargs):
    """(where, tensor): the hidden states among a layer's arguments."""
    if args and isinstance(args[0], torch.Tensor):
        return 0, args[0]
    h = kwargs.get("hidden_states")
    return ("hidden_states", h) if isinstance(h, torch.Tensor) else (None, None)


def _with_hidden(args, kwargs, where, h):
    if where == 0:
        return (h,) + tuple(args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["hidden_states"] = h
    return args, kwargs


def _hidden_out(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _same(a, b) -> bool:
    """Whether two layer arguments of the two probes are equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b)


class HfPlan:
    """What the probe found: the layers (their model names, where each takes
    its hidden states, the length of its tuple output or None), the units
    before and after them, and how to run a chunk."""

    def __init__(self, model: nn.Module, layer_names: List[str], layers: List[nn.Module],
                 where: List, out_len: List[Optional[int]], prefix, tail, unused, result: str):
        self.model, self.layer_names, self.layers = model, layer_names, layers
        self.where, self.out_len = where, out_len
        #: (name, module, (input dims, trailing output shape, dtype) or None)
        self.prefix = prefix
        self.tail: List[Tuple[str, nn.Module]] = tail
        #: modules with parameters the forward never ran (held by the first chunk)
        self.unused: List[Tuple[str, nn.Module]] = unused
        self.result = result  # "logits" or "last_hidden_state"

    def units(self):
        units = [(n, m, "embed") for n, m, _ in self.prefix] + [(n, m, "embed") for n, m in self.unused]
        units += [(n, m, "decoder") for n, m in zip(self.layer_names, self.layers)]
        return units + [(n, m, "tail") for n, m in self.tail]

    def run(self, x, has_embed: bool, lo: int, hi: int, has_tail: bool, attention_mask,
            position_ids):
        """The chunk from the hidden states entering layer ``lo`` (token ids
        when it has the embedding) to those entering layer ``hi`` (``hi`` =
        the number of layers: leaving the last; the output when it has the
        tail), by the model's own forward."""
        n = len(self.layers)
        hooks, forwards = [], []

        def skip(mod, fn):
            forwards.append((mod, mod.__dict__.get("forward")))
            mod.forward = fn

        try:
            if has_embed:
                ids = x
            else:
                h = x
                ids = torch.zeros(h.shape[:2], dtype=torch.long, device=h.device)
                for _, mod, spec in self.prefix:
                    if spec is not None:
                        skip(mod, _zeros_like_probe(spec))
                for i in range(min(lo, n)):
                    skip(self.layers[i], _pass_through(self.where[i], self.out_len[i]))
                if lo < n:
                    def swap(mod, args, kwargs, _w=self.where[lo]):
                        return _with_hidden(args, kwargs, _w, h)
                    hooks.append(self.layers[lo].register_forward_pre_hook(swap, with_kwargs=True))
                else:
                    def swap_out(mod, args, out):
                        return h if isinstance(out, torch.Tensor) else (h,) + tuple(out[1:])
                    hooks.append(self.layers[n - 1].register_forward_hook(swap_out))
            if not has_tail:
                if hi < n:
                    def stop(mod, args, kwargs):
                        raise _Stop(_hidden_in(args, kwargs)[1])
                    hooks.append(self.layers[hi].register_forward_pre_hook(stop, with_kwargs=True))
                else:
                    def stop_out(mod, args, out):
                        raise _Stop(_hidden_out(out))
                    hooks.append(self.layers[n - 1].register_forward_hook(stop_out))
            kw = {"input_ids": ids, "use_cache": False}
            if attention_mask is not None:
                kw["attention_mask"] = attention_mask
            if position_ids is not None:
                kw["position_ids"] = position_ids
            try:
                out = self.model(**kw)
            except _Stop as s:
                return s.hidden
            return getattr(out, self.result)
        finally:
            for hk in hooks:
                hk.remove()
            for mod, old in reversed(forwards):
                if old is None:
                    del mod.forward
                else:
                    mod.forward = old


def _pass_through(where, out_len):
    def forward(*args, **kwargs):
        h = args[0] if where == 0 else kwargs["hidden_states"]
        return h if out_len is None else (h,) + (None,) * (out_len - 1)
    return forward


def _zeros_like_probe(spec):
    dims, trailing, dtype = spec

    def forward(*args, **kwargs):
        inp = next(a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))
        return torch.zeros(tuple(inp.shape[:dims]) + trailing, dtype=dtype, device=inp.device)
    return forward


def _refuse(model: nn.Module, why: str) -> None:
    raise ValueError(
        f"split_model cannot cut {type(model).__name__} (model_type "
        f"{getattr(model.config, 'model_type', None)!r}) at its layers: {why}. Give its units by "
        "name (embed=, blocks=, tail=) only if each block takes and returns one tensor")


def probe(model: nn.Module) -> HfPlan:
    """Finds the units of a transformers decoder-only model and checks that
    a cut between its layers keeps its forward (NOTE [Cutting a transformers
    decoder]); raises ValueError naming what does not fit."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        _refuse(model, "it is an encoder-decoder model, not decoder-only")
    base = getattr(model, "base_model", None)
    base = base if isinstance(base, nn.Module) else model
    prefix = ""
    if base is not model:
        names = [n for n, m in model.named_children() if m is base]
        if not names:
            _refuse(model, "its base model is not a direct submodule")
        prefix = names[0] + "."
    n = getattr(config, "num_hidden_layers", None)
    if n == 0:
        raise ValueError(f"{type(model).__name__} has no blocks (0 layers, "
                         "config.num_hidden_layers) to cut into chunks: build it with at least "
                         "one layer per chunk")
    lists = [(nm, m) for nm, m in base.named_children()
             if isinstance(m, (nn.ModuleList, nn.Sequential)) and isinstance(n, int) and len(m) == n]
    if len(lists) != 1:
        _refuse(model, f"its base model has {len(lists)} module lists of config.num_hidden_layers "
                f"({n}) entries, not one row of decoder layers")
    cont_name, cont = lists[0]
    layers = list(cont)
    layer_names = [f"{prefix}{cont_name}.{i}" for i in range(n)]
    cands = [(prefix + nm, m) for nm, m in base.named_children() if m is not cont]
    if base is not model:
        cands += [(nm, m) for nm, m in model.named_children() if m is not base]
    for owner, oname in ((model, type(model).__name__), (base, prefix[:-1] or type(base).__name__)):
        own = [pn for pn, _ in owner.named_parameters(recurse=False)]
        if own:
            _refuse(model, f"{oname} holds parameters outside its modules ({', '.join(own)})")
    device = next((q.device for q in model.parameters()), torch.device("cpu"))
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    runs = []

    forks = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forks), torch.enable_grad(), collect_losses():
        for k in range(2):
            ids = ((torch.arange(4) + k * 3) % vocab).unsqueeze(0).to(device)
            runs.append(_probe_run(model, ids, layers, layer_names, cands, check=k == 0))
    first, second = runs
    for i in range(n):
        for key in first["args"][i]:
            if not _same(first["args"][i][key], second["args"][i].get(key)):
                _refuse(model, f"the argument {key} of {layer_names[i]} changes with the token "
                        "values, which a chunk without the embedding does not have")
    return HfPlan(model, layer_names, layers, first["where"], first["out_len"], first["prefix"],
                  first["tail"], first["unused"], first["result"])


def _probe_run(model, ids, layers, layer_names, cands, check: bool):
    n = len(layers)
    st = {"started": 0, "ended": 0, "prev": None, "x0": None, "seen": {}}
    rec: Dict[str, list] = {"where": [None] * n, "out_len": [None] * n, "args": [None] * n,
                            "outs": [None] * n, "leaves": [None] * n}
    problem: List[str] = []
    hooks = []

    def pre(i):
        def hook(mod, args, kwargs):
            if st["started"] != i or st["ended"] != i:
                problem.append(f"{layer_names[i]} ran out of order (or more than once)")
                return None
            st["started"] += 1
            where, h = _hidden_in(args, kwargs)
            if where is None:
                problem.append(f"{layer_names[i]} takes no hidden states tensor as its first "
                               "argument or hidden_states=")
                return None
            if i == 0:
                st["x0"] = h
            elif h is not st["prev"]:
                problem.append(f"the forward computes between {layer_names[i - 1]} and "
                               f"{layer_names[i]} (the second does not receive the first's output)")
            rec["where"][i] = where
            rest = dict(kwargs)
            rest.pop("hidden_states", None)
            rest.update({f"positional {j}": a for j, a in enumerate(args) if j or where != 0})
            rec["args"][i] = rest
            leaf = h.detach().requires_grad_(True)
            rec["leaves"][i] = leaf
            return _with_hidden(args, kwargs, where, leaf)
        return hook

    def post(i):
        def hook(mod, args, out):
            st["ended"] += 1
            h = _hidden_out(out)
            if h is None:
                problem.append(f"{layer_names[i]} returns {type(out).__name__}, not its hidden "
                               "states (a tensor, or a tuple starting with them)")
                return None
            rec["out_len"][i] = None if isinstance(out, torch.Tensor) else len(out)
            rec["outs"][i] = h
            st["prev"] = h
            if i == n - 1:  # the tail's segment starts at a leaf
                st["tail_leaf"] = leaf = h.detach().requires_grad_(True)
                st["prev"] = leaf
                return leaf if isinstance(out, torch.Tensor) else (leaf,) + tuple(out[1:])
            return None
        return hook

    def cand_pre(name):
        def hook(mod, args):
            phase = 0 if st["started"] == 0 else (2 if st["ended"] == n else 1)
            st["seen"].setdefault(name, set()).add(phase)
        return hook

    def cand_post(name):
        def hook(mod, args, out):
            inp = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if name not in st.get("spec", {}):
                spec = None
                if (inp is not None and isinstance(out, torch.Tensor)
                        and tuple(out.shape[:inp.dim()]) == tuple(inp.shape)):
                    spec = (inp.dim(), tuple(out.shape[inp.dim():]), out.dtype)
                st.setdefault("spec", {})[name] = spec
        return hook

    try:
        for i, layer in enumerate(layers):
            hooks.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
            hooks.append(layer.register_forward_hook(post(i)))
        for name, mod in cands:
            hooks.append(mod.register_forward_pre_hook(cand_pre(name)))
            hooks.append(mod.register_forward_hook(cand_post(name)))
        out = model(input_ids=ids, use_cache=False)
    finally:
        for hk in hooks:
            hk.remove()
    if problem:
        _refuse(model, problem[0])
    if st["ended"] != n:
        _refuse(model, f"its forward ran {st['ended']} of its {n} layers")
    result = "logits" if isinstance(getattr(out, "logits", None), torch.Tensor) else "last_hidden_state"
    final = getattr(out, result, None)
    if not isinstance(final, torch.Tensor):
        _refuse(model, "its forward returns neither logits nor last_hidden_state")
    prefix, tail, unused = [], [], []
    for name, mod in cands:
        if not any(True for _ in mod.parameters()):
            continue
        phases = st["seen"].get(name)
        if not phases:
            unused.append((name, mod))
        elif phases == {0}:
            prefix.append((name, mod, st["spec"].get(name)))
        elif phases == {2}:
            tail.append((name, mod))
        else:
            where = {0: "before", 1: "during", 2: "after"}
            _refuse(model, f"{name} runs {' and '.join(where[p] for p in sorted(phases))} "
                    "the layers")
    order = {name: k for k, name in enumerate(st["seen"])}
    prefix.sort(key=lambda u: order[u[0]])
    tail.sort(key=lambda u: order[u[0]])
    res = {"where": rec["where"], "out_len": rec["out_len"], "args": rec["args"], "prefix": prefix,
           "tail": tail, "unused": unused, "result": result}
    if check:
        _check_segments(model, layers, layer_names, prefix, unused, tail, st["x0"], rec["outs"],
                        final)
    return res


def _check_segments(model, layers, layer_names, prefix, unused, tail, x0, outs, final):
    """Every parameter a segment's output depends on is one of its modules'."""
    params = [q for q in dict.fromkeys(model.parameters()) if q.requires_grad]
    names = {}
    for pn, q in model.named_parameters():
        names.setdefault(id(q), pn)

    def used(out):
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return set()
        grads = torch.autograd.grad(out, params, grad_outputs=torch.ones_like(out),
                                    allow_unused=True, retain_graph=True)
        return {id(q) for q, g in zip(params, grads) if g is not None}

    def own(mods):
        return {id(q) for m in mods for q in m.parameters()}

    segments = [("before the first layer", x0, own([m for _, m, _ in prefix] + [m for _, m in unused]))]
    segments += [(layer_names[i], outs[i], own([layers[i]])) for i in range(len(layers))]
    segments.append(("after the last layer", final, own([m for _, m in tail])))
    for what, out, mine in segments:
        extra = used(out) - mine
        if extra:
            _refuse(model, f"the part {what} uses {names[next(iter(sorted(extra, key=lambda k: names[k])))]}, "
                    "a parameter of another part's modules (shared between layers, or an input of "
                    "the layers computed from the embedding)")
