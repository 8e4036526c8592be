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
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ._collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, output_list
from .base import GraphPass

__all__ = ["FSDPPass", "planned_parameters", "resolve_group"]


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


class FSDPPass(GraphPass):
    name = "fsdp"

    def __init__(self, plan=None, degree: Optional[int] = None,
                 reshard_after_forward: bool = False):
        self.plan = plan
        self.degree = degree
        self.reshard_after_forward = reshard_after_forward

    def __repr__(self) -> str:
        return (f"FSDPPass(plan={self.plan!r}, degree={self.degree}, "
                f"reshard_after_forward={self.reshard_after_forward})")

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

        # 1. All-gather after the placeholders; every other use reads the gather.
        gathered = {}
        anchor = last_ph
        for fqn in grad_fqns:
            if fqn not in planned:
                continue
            ph = by_fqn[fqn]
            with graph.inserting_after(anchor):
                ag = graph.call_function(ALL_GATHER, (ph, degree, fsdp_group_name))
            with graph.inserting_after(ag):
                w = graph.call_function(WAIT, (ag,))
            ph.replace_all_uses_with(w, delete_user_cb=lambda u, ag=ag: u is not ag)
            gathered[fqn] = (ph, w)
            anchor = w

        # 2. Gradients: reduce-scatter (planned) or all-reduce (replicated),
        #    issued where the gradient is produced.
        for j, fqn in enumerate(grad_fqns):
            g = outs[1 + j]
            with graph.inserting_after(g):
                if fqn in planned:
                    c = graph.call_function(torch.ops.aten.contiguous.default, (g,))
                    with graph.inserting_after(c):
                        coll = graph.call_function(REDUCE_SCATTER,
                                                   (c, "avg", degree, fsdp_group_name))
                else:
                    coll = graph.call_function(ALL_REDUCE, (g, "avg", fsdp_group_name))
            with graph.inserting_after(coll):
                w = graph.call_function(WAIT, (coll,))
            outs[1 + j] = w
        out_node.args = (outs,)

        if self.reshard_after_forward:
            for fqn, (ph, w) in gathered.items():
                _regather_for_backward(graph, ph, w, outs[0], degree, fsdp_group_name)

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
    """Gives the backward its own all-gather of `ph` and its own copies of
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
        ag = graph.call_function(ALL_GATHER, (ph, degree, group_name))
        copy = {w: graph.call_function(WAIT, (ag,))}
        for n in chain[1:]:
            copy[n] = graph.node_copy(n, lambda a: copy[a])
    for c, users in bwd_users.items():
        for u in users:
            u.replace_input_with(c, copy[c])
    for n in reversed(chain[1:]):
        if not copy[n].users:
            graph.erase_node(copy[n])
