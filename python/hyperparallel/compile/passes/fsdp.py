"""FSDPPass: dim-0 sharding of planned parameters inside the joint graph
(seed 002 §7).

For every planned parameter placeholder an all-gather (Shard -> Replicate)
and its wait follow the placeholders, and every use of the parameter reads
the gathered value; its gradient output is reduce-scattered (averaged: the
ranks' batches are data parallel) right where the gradient is produced.
Unplanned trainable parameters stay replicated and their gradients are
all-reduced (averaged). The live model's planned parameters are sharded in
place (`param.data` becomes this rank's dim-0 chunk, same Parameter object),
so `model.parameters()` are the local shards and an optimizer built on them
knows nothing of FSDP.

reshard_after_forward: the forward's gathered value (and the parameter-only
views of it, such as its transpose) is released after its last forward use;
the backward gathers the parameter again and recomputes those views.

bucket: "module" (default) gathers and reduce-scatters the parameters of one
module together, as FSDP2 does per `fully_shard`ed module (NOTE [FSDP
buckets]); "parameter" issues one collective per parameter (the seed's form).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ._collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, output_list
from .base import GraphPass

__all__ = ["FSDPPass", "planned_parameters", "resolve_group"]

aten = torch.ops.aten


def resolve_group(name: str):
    """The process group registered under `name` (None when there is none)."""
    try:
        return torch._C._distributed_c10d._resolve_process_group(name)
    except Exception:  # noqa: BLE001 - torch raises RuntimeError or ValueError by version
        return None


def planned_parameters(model: torch.nn.Module, plan, degree: int,
                       full_shapes: Optional[Dict[str, tuple]] = None) -> List[str]:
    """The trainable parameters (first FQN of each distinct tensor) FSDP shards
    under `plan` (None: all), checked shardable (full_shapes: FQN -> (full
    shape, degree) of the parameters already sharded): ValueError naming a
    parameter whose dim 0 `degree` does not divide."""
    full_shapes = full_shapes or {}
    aliases: Dict[int, List[str]] = {}
    first: Dict[int, str] = {}
    params: Dict[str, torch.Tensor] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in first:
            first[id(p)] = fqn
            params[fqn] = p
        aliases.setdefault(id(p), []).append(fqn)
    out = []
    for fqn, p in params.items():
        if not p.requires_grad:
            continue
        if plan is not None and not (plan.enabled and any(
                plan.covers_parameter(name) for name in aliases[id(p)])):
            continue
        shape = full_shapes[fqn][0] if fqn in full_shapes else p.shape
        if len(shape) == 0 or shape[0] % degree != 0:
            raise ValueError(
                f"FSDPPass: parameter '{fqn}' has shape {tuple(shape)}; FSDP shards dim 0 over "
                f"{degree} ranks, which needs dim 0 divisible by {degree}. Leave its module out "
                "of the PassPlan (it then stays replicated) or change the FSDP degree")
        out.append(fqn)
    return out


# NOTE [FSDP buckets]
# One collective per parameter cost graph mode most of its step against
# FSDP2 on Gloo (26 against 10 ms of communication per step on the small
# GPT, 58 collectives against 6: docs/benchmarks.md): a collective's fixed
# cost, not its bytes, dominates at these sizes. So the parameters of one
# module go together, as FSDP2 groups a `fully_shard`ed module's:
#   * the bucket of a parameter is the module the PassPlan covered it by
#     (the shortest planned prefix of its FQN); without a plan, its FQN up
#     to the first list index ("model.layers.3"), else its first name
#     ("block0", "lm_head"); one dtype per bucket;
#   * forward: each shard flattened, concatenated, one all-gather; the
#     result viewed as (ranks, bucket numel) and each parameter's columns
#     reshaped to its full shape (dim-0 shards concatenate row-wise, so
#     rank r's slice is rows r * d0 / n onward), each just before the first
#     node that reads the parameter, so the wait sinks there;
#   * backward: once the bucket's last gradient is produced, each gradient
#     viewed as (ranks, numel / ranks), concatenated along dim 1, flattened,
#     one reduce-scatter ("avg"); the shard gradients are views of its
#     result, made just before the output so the wait sinks to the end.
# A bucket of one parameter is the per-parameter form. The collectives'
# order is the graph's, the same on every rank. With reshard_after_forward
# the backward concatenates a bucket's shards again and unpacks each
# parameter just before its first reader, so the forward's buffers die with
# the forward; still, a module's gathered parameters live together, so the
# peak is a module's, as FSDP2's is (bucket="parameter": one parameter's,
# at many more collectives; docs/benchmarks.md).


def _bucket_key(fqn: str, plan) -> str:
    """The module a parameter is gathered with (NOTE [FSDP buckets])."""
    parts = fqn.split(".")
    if plan is not None:
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if plan.lookup(prefix) is not None:
                return prefix
        return fqn
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0] if len(parts) > 1 else fqn


class FSDPPass(GraphPass):
    name = "fsdp"

    def __init__(self, plan=None, degree: Optional[int] = None,
                 reshard_after_forward: bool = False, bucket: str = "module"):
        if bucket not in ("module", "parameter"):
            raise ValueError(f"FSDPPass: bucket is {bucket!r}; give 'module' or 'parameter'")
        self.plan = plan
        self.degree = degree
        self.reshard_after_forward = reshard_after_forward
        self.bucket = bucket

    def __repr__(self) -> str:
        return (f"FSDPPass(plan={self.plan!r}, degree={self.degree}, "
                f"reshard_after_forward={self.reshard_after_forward}, bucket={self.bucket!r})")

    def run(self, gm, model: Optional[torch.nn.Module] = None, fsdp_group_name: str = "fsdp",
            **context):
        gm.fsdp_fqns = []
        # Early exit (seed §5.2): no torch.distributed or a group of one rank
        # is plain graph mode.
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return gm
        group = resolve_group(fsdp_group_name)
        if group is None:
            raise ValueError(f"FSDPPass: no process group is registered as '{fsdp_group_name}' "
                             "(GraphTrainer registers one; elsewhere use torch._C._distributed_"
                             "c10d._register_process_group)")
        size, rank = group.size(), group.rank()
        degree = self.degree if self.degree is not None else size
        if degree != size:
            raise ValueError(f"FSDPPass: fsdp_degree is {degree} but the group "
                             f"'{fsdp_group_name}' has {size} ranks; they must be equal")
        if size == 1:
            return gm
        if model is None:
            raise ValueError("FSDPPass: run(gm, model=...) needs the live model to shard")
        sharded = model.__dict__.setdefault("_hp_fsdp_full_shapes", {})
        planned = set(planned_parameters(model, self.plan, degree, sharded))
        grad_fqns = list(gm.grad_fqns)

        graph = gm.graph
        nodes = list(graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        by_fqn = {n.meta.get("hp_fqn"): n for n in placeholders if n.meta.get("hp_role") == "param"}
        last_ph = placeholders[-1]
        out_node, outs = output_list(gm)

        # Buckets of planned parameters, in gradient order (NOTE [FSDP buckets]).
        buckets: Dict[tuple, List[str]] = {}
        for fqn in grad_fqns:
            if fqn in planned:
                ph = by_fqn[fqn]
                key = (fqn if self.bucket == "parameter" else _bucket_key(fqn, self.plan),
                       ph.meta["val"].dtype)
                buckets.setdefault(key, []).append(fqn)
        index = {n: i for i, n in enumerate(nodes)}

        # 1. All-gather after the placeholders; every other use reads the gather.
        gathered = {}
        anchor = last_ph
        for fqns in buckets.values():
            phs = [by_fqn[f] for f in fqns]
            if len(phs) == 1:
                ph = phs[0]
                with graph.inserting_after(anchor):
                    ag = graph.call_function(ALL_GATHER, (ph, degree, fsdp_group_name))
                with graph.inserting_after(ag):
                    w = graph.call_function(WAIT, (ag,))
                ph.replace_all_uses_with(w, delete_user_cb=lambda u, ag=ag: u is not ag)
                gathered[fqns[0]] = (ph, w)
                anchor = w
                continue
            flats = []
            for ph in phs:
                with graph.inserting_after(anchor):
                    anchor = graph.call_function(aten.reshape.default, (ph, [-1]))
                flats.append(anchor)
            with graph.inserting_after(anchor):
                cat = graph.call_function(aten.cat.default, (flats,))
            with graph.inserting_after(cat):
                ag = graph.call_function(ALL_GATHER, (cat, degree, fsdp_group_name))
            with graph.inserting_after(ag):
                w = graph.call_function(WAIT, (ag,))
            anchor = w
            # (meta "val" holds the full shape: the graph was traced unsharded)
            sizes = [ph.meta["val"].numel() // degree for ph in phs]
            users = [u for ph in phs for u in ph.users if u not in flats]
            first = min(users, key=lambda u: index[u]) if users else None
            if first is None:
                continue
            with graph.inserting_before(first):
                rows = graph.call_function(aten.view.default, (w, [degree, sum(sizes)]))
            offset = 0
            for ph, size, flat in zip(phs, sizes, flats):
                readers = [u for u in ph.users if u is not flat]
                full_shape = list(ph.meta["val"].shape)
                if readers:
                    at = min(readers, key=lambda u: index[u])
                    with graph.inserting_before(at):
                        cols = graph.call_function(aten.slice.Tensor,
                                                   (rows, 1, offset, offset + size))
                        full = graph.call_function(aten.reshape.default, (cols, full_shape))
                    ph.replace_all_uses_with(full, delete_user_cb=lambda u, f=flat: u is not f)
                offset += size
            for fqn, ph in zip(fqns, phs):
                gathered[fqn] = (cat, w)

        # 2. Gradients: reduce-scatter (planned) or all-reduce (replicated),
        #    issued where the gradient is produced.
        index = {n: i for i, n in enumerate(graph.nodes)}
        position = {fqn: 1 + j for j, fqn in enumerate(grad_fqns)}
        for j, fqn in enumerate(grad_fqns):
            if fqn in planned:
                continue
            g = outs[1 + j]
            with graph.inserting_after(g):
                coll = graph.call_function(ALL_REDUCE, (g, "avg", fsdp_group_name))
            with graph.inserting_after(coll):
                w = graph.call_function(WAIT, (coll,))
            outs[1 + j] = w
        for fqns in buckets.values():
            grads = [outs[position[f]] for f in fqns]
            if len(fqns) == 1:
                g = grads[0]
                with graph.inserting_after(g):
                    c = graph.call_function(torch.ops.aten.contiguous.default, (g,))
                with graph.inserting_after(c):
                    coll = graph.call_function(REDUCE_SCATTER,
                                               (c, "avg", degree, fsdp_group_name))
                with graph.inserting_after(coll):
                    w = graph.call_function(WAIT, (coll,))
                outs[position[fqns[0]]] = w
                continue
            last = max(grads, key=lambda g: index[g])
            fulls = [by_fqn[f].meta["val"].shape for f in fqns]
            shards = [[s[0] // degree, *s[1:]] for s in fulls]
            sizes = [by_fqn[f].meta["val"].numel() // degree for f in fqns]
            anchor = last
            parts = []
            for g, size in zip(grads, sizes):
                with graph.inserting_after(anchor):
                    anchor = graph.call_function(aten.reshape.default, (g, [degree, size]))
                parts.append(anchor)
            with graph.inserting_after(anchor):
                cat = graph.call_function(aten.cat.default, (parts, 1))
            with graph.inserting_after(cat):
                flat = graph.call_function(aten.reshape.default, (cat, [-1]))
            with graph.inserting_after(flat):
                coll = graph.call_function(REDUCE_SCATTER,
                                           (flat, "avg", degree, fsdp_group_name))
            with graph.inserting_after(coll):
                w = graph.call_function(WAIT, (coll,))
            offset = 0
            with graph.inserting_before(out_node):
                for fqn, t, size in zip(fqns, shards, sizes):
                    piece = graph.call_function(aten.slice.Tensor, (w, 0, offset, offset + size))
                    outs[position[fqn]] = graph.call_function(aten.view.default, (piece, t))
                    offset += size
        out_node.args = (outs,)

        if self.reshard_after_forward:
            done = set()
            for fqn, (src, w) in gathered.items():
                if w not in done:
                    done.add(w)
                    _regather_for_backward(graph, src, w, outs[0], degree, fsdp_group_name)

        graph.lint()
        gm.recompile()

        # 3. The live model: planned parameters become this rank's dim-0 shard.
        params = dict(model.named_parameters())
        for fqn in sorted(planned):
            p = params[fqn]
            if fqn in sharded:
                if sharded[fqn][1] != degree:
                    raise ValueError(f"FSDPPass: '{fqn}' is already sharded {sharded[fqn][1]} "
                                     f"ways; cannot shard it {degree} ways")
                continue
            sharded[fqn] = (torch.Size(p.shape), degree)
            with torch.no_grad():
                p.data = p.data.chunk(degree, dim=0)[rank].clone().contiguous()
        gm.fsdp_fqns = [f for f in grad_fqns if f in planned]
        gm.fsdp_degree = degree
        gm.fsdp_group_name = fsdp_group_name
        return gm


def _regather_for_backward(graph, ph, w, loss, degree, group_name):
    """Gives the backward its own all-gather of `ph` (a placeholder, or a
    bucket's concatenated shards) and its own copies of
    the parameter-only nodes derived from the forward's gather `w`, so the
    forward's values die after their last forward use."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    # The backward starts at the first node that reads the loss (the seed of
    # the gradient, ones_like(loss)), in graph order.
    seen, stack = set(), [loss]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in seen and u.op != "output":
                seen.add(u)
                stack.append(u)
    if not seen:
        return
    boundary = min(index[n] for n in seen)
    # Forward nodes computed from the gathered parameter alone (views, t()).
    chain = [w]
    members = {w}
    for n in graph.nodes:
        if index[n] >= boundary:
            break
        if n.op != "call_function" or n in members:
            continue
        ins = n.all_input_nodes
        if ins and all(i in members for i in ins):
            chain.append(n)
            members.add(n)
    bwd_users = {c: [u for u in c.users if u.op != "output" and index[u] >= boundary]
                 for c in chain}
    first = [u for users in bwd_users.values() for u in users]
    if not first:
        return
    at = min(first, key=lambda u: index[u])
    with graph.inserting_before(at):
        src = ph
        if ph.op != "placeholder":
            # A bucket: its shards concatenated again here, so the forward's
            # concatenation dies with the forward's gather.
            made, todo = set(), [ph]
            while todo:
                n = todo.pop()
                if n.op != "placeholder" and n not in made:
                    made.add(n)
                    todo.extend(n.all_input_nodes)
            again = {}
            for n in sorted(made, key=lambda n: index[n]):
                again[n] = graph.node_copy(n, lambda a: again.get(a, a))
            src = again[ph]
        ag = graph.call_function(ALL_GATHER, (src, degree, group_name))
        copy = {w: graph.call_function(WAIT, (ag,))}
        for n in chain[1:]:
            copy[n] = graph.node_copy(n, lambda a: copy[a])
    for c, users in bwd_users.items():
        for u in users:
            u.replace_input_with(c, copy[c])
    for n in reversed(chain[1:]):
        if not copy[n].users:
            graph.erase_node(copy[n])
    # Each copied node (a bucket's parameter unpacked, its t()) just before
    # its first reader, the last first: a module's parameters come whole one
    # by one as the backward reaches them, not all at its first.
    for n in reversed(chain[1:]):
        c = copy[n]
        if c.users:
            order = {m: i for i, m in enumerate(graph.nodes)}
            first_user = min(c.users, key=lambda u: order[u])
            if order[first_user] > order[c] + 1:
                first_user.prepend(c)
