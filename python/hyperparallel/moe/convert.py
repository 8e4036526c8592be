"""Converts a model's MoE experts in place to expert parallelism: the experts
collection of every sparse MoE block keeps this rank's slice of the model's
own weights and runs between a dispatch and a combine over the EP group."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import _C

__all__ = ["expert_parallel", "expert_parameters", "is_expert_parameter", "ExpertParallelError"]

# NOTE [Which experts are converted]
# transformers (5.x) gives Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 one
# shape of experts: a module with 3-D weights gate_up_proj [E, 2I, H] and
# down_proj [E, H, I], called by its block as experts(hidden [T, H],
# top_k_index [T, k], top_k_weights [T, k]) -> [T, H], the weighted sum of
# each token's experts. The block around it (router, shared experts, their
# gate, residuals) differs per model and is left as it is, so the router's
# hooks (moe_aux_losses) and the model's own arithmetic stay; only the
# experts collection changes: its class becomes a subclass whose forward
# dispatches the rows, calls the model's own forward on this rank's experts
# (local ids, weight 1), and combines with the router's weights. Its
# parameters keep their names and hold rows [first, first + E / ep) of the
# model's, so an expert-parallel run starts from the unsharded model's
# values. torchtitan's GroupedExperts (w1, w2, w3 [E, ...], called with the
# rows already sorted by expert and the count per expert) is converted the
# same way: each row is one pair of weight 1. A model with no module of
# either shape is refused, naming the modules called like experts.

_EXPERT_ATTR = "_hp_expert_group"


class ExpertParallelError(ValueError):
    """A model or group that expert parallelism cannot take, with the reason."""


def is_expert_parameter(p: torch.Tensor) -> bool:
    """True for a parameter that expert_parallel sharded over an EP group:
    data parallelism over that group must not average it (NOTE [Expert
    gradients] in hp/pipeline/pipeline.cpp)."""
    return getattr(p, _EXPERT_ATTR, None) is not None


def expert_parameters(module: nn.Module) -> List[torch.Tensor]:
    """The sharded expert parameters of `module` (see is_expert_parameter)."""
    return [p for p in module.parameters() if is_expert_parameter(p)]


def _experts_style(m: nn.Module) -> Optional[str]:
    """"hf" (transformers: experts(hidden, top_k_index, top_k_weights)),
    "titan" (torchtitan's GroupedExperts: experts(rows sorted by expert,
    num_tokens_per_expert)) or None."""
    def cube(name):
        t = getattr(m, name, None)
        return isinstance(t, torch.Tensor) and t.dim() == 3
    if not isinstance(getattr(m, "num_experts", None), int):
        return None
    if cube("gate_up_proj") and cube("down_proj"):
        return "hf"
    if cube("w1") and cube("w2") and cube("w3"):
        return "titan"
    return None


def _hf_forward(self, hidden_states, top_k_index, top_k_weights):
    # NOTE [Which experts are converted]: dispatch, the model's own experts
    # on this rank's rows (local ids, weight 1), combine by the router's weights.
    d = self._hp_dispatcher.dispatch(hidden_states, top_k_index)
    self.last_dropped = d.dropped
    counts = torch.tensor(d.tokens_per_expert, dtype=torch.long, device=hidden_states.device)
    local = torch.repeat_interleave(
        torch.arange(len(d.tokens_per_expert), device=hidden_states.device), counts)
    ones = torch.ones(local.shape[0], 1, dtype=top_k_weights.dtype, device=hidden_states.device)
    y = self._hp_base_forward(d.tokens, local.unsqueeze(1), ones)
    return self._hp_dispatcher.combine(y, d, top_k_weights)


def _titan_forward(self, x, num_tokens_per_expert):
    # torchtitan hands its experts every (token, slot) row sorted by expert:
    # each row is one pair with weight 1 (the MoE scores around the call).
    counts = num_tokens_per_expert.to(torch.long)
    ids = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
    d = self._hp_dispatcher.dispatch(x, ids.unsqueeze(1))
    self.last_dropped = d.dropped
    local = torch.tensor(d.tokens_per_expert, dtype=torch.long, device=x.device)
    y = self._hp_base_forward(d.tokens, local)
    return self._hp_dispatcher.combine(y, d, torch.ones(x.shape[0], 1, dtype=y.dtype, device=x.device))


_classes: Dict[type, type] = {}


def _ep_class(cls: type, style: str) -> type:
    if cls not in _classes:
        _classes[cls] = type(
            f"ExpertParallel{cls.__name__}",
            (cls,),
            {
                "forward": _hf_forward if style == "hf" else _titan_forward,
                "_hp_base_forward": cls.forward,
                "__doc__": f"{cls.__name__} holding this rank's experts of an expert-parallel "
                           "group (hyperparallel.moe.expert_parallel).",
            },
        )
    return _classes[cls]


def _group_ranks(group) -> List[int]:
    return list(dist.get_process_group_ranks(group))


def expert_parallel(model: nn.Module, ep_group: Optional[dist.ProcessGroup],
                    capacity_factor: float = 0.0, timeout: float = 300.0) -> nn.Module:
    """Spreads the experts of every MoE block of `model` over `ep_group` in
    place and returns the model (NOTE [Which experts are converted]). Rank
    r of the group keeps experts [r * E / n, (r + 1) * E / n) of each block,
    with the model's own values. Every rank of the group converts the same
    model and must then run the same layers in the same order (a Pipeline
    agrees on it when made). `capacity_factor` > 0 caps the rows an expert
    takes from each rank (dropped pairs are counted in each experts module's
    `last_dropped`); 0 is dropless. `ep_group=None` keeps every expert local
    (the same code path, no exchange)."""
    if ep_group is not None and not isinstance(ep_group, dist.ProcessGroup):
        raise TypeError(f"ep_group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(ep_group).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"expert_parallel converts an nn.Module, got {type(model).__name__}")
    found = [(name, m) for name, m in model.named_modules() if _experts_style(m)]
    if not found:
        named = [name for name, m in model.named_modules() if name.endswith("experts")]
        raise ExpertParallelError(
            f"expert_parallel: {type(model).__name__} has no experts collection of the shape "
            "it converts (3-D gate_up_proj and down_proj, num_experts: transformers' Mixtral, "
            "Qwen2-MoE, Qwen3-MoE, DeepSeek-V3; 3-D w1, w2, w3: torchtitan's GroupedExperts)"
            + (f"; modules named like experts: {named[:4]}" if named else ""))
    size = ep_group.size() if ep_group is not None else 1
    ranks = tuple(_group_ranks(ep_group)) if ep_group is not None else (0,)
    for name, m in found:
        if getattr(m, "_hp_dispatcher", None) is not None:
            raise ExpertParallelError(f"expert_parallel: {name} is already expert-parallel")
        if m.num_experts % size:
            raise ExpertParallelError(
                f"expert_parallel: {name} has {m.num_experts} experts, which do not divide over "
                f"the {size} ranks of the expert-parallel group: use a group size that divides "
                f"{m.num_experts}")
    # NOTE [A failure reaches the expert-parallel peers] in python/csrc/bind_moe.cpp:
    # the group's store carries a failed step; the dispatchers share one
    # Comm, whose monitor sees a stopped peer.
    store = (None if ep_group is None else
             dist.distributed_c10d._world.pg_map.get(ep_group, (None, None))[1])
    first_dispatcher = None
    for name, m in found:
        dispatcher = _C.moe.TokenDispatcher(ep_group, m.num_experts, float(capacity_factor),
                                            float(timeout), failure_store=store,
                                            exchanges_of=first_dispatcher)
        if ep_group is not None:
            first_dispatcher = first_dispatcher or dispatcher
        # The same Parameter objects keep this rank's rows: whatever holds
        # them already (split_model's chunks and their names, an optimizer)
        # sees the slice.
        first, local = dispatcher.first_expert, dispatcher.local_experts
        for p in m._parameters.values():
            if p is not None and p.dim() >= 1 and p.shape[0] == m.num_experts:
                with torch.no_grad():
                    p.data = p.data[first:first + local].clone()
                if p.grad is not None:
                    p.grad = None
                setattr(p, _EXPERT_ATTR, ranks)
        m.num_experts = local
        m._hp_dispatcher = dispatcher
        m.last_dropped = 0
        m.__class__ = _ep_class(type(m), _experts_style(m))
    return model

