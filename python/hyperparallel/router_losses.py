"""A transformers MoE model's router load-balancing loss, trained through a
pipeline of split_model's chunks: ``moe_aux_losses`` and the router sums
that travel between the chunks (NOTE [MoE load balancing in a pipeline])."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from .losses import add_loss

__all__ = ["moe_aux_losses"]


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
# [Pytrees between stages] in pipeline/transfers.py): each chunk adds its
# layers' probability sums (differentiable), assignment counts and rows (forward
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
    """Trains a transformers Mixtral's (Qwen2-MoE's, Qwen3-MoE's) router load-balancing loss (times
    ``coef``, default the config's ``router_aux_loss_coef``) through a
    pipeline of :func:`split_model`'s chunks (NOTE [MoE load balancing in a
    pipeline]). ``form="model"``: the model's own term over all layers, as
    ``model(..., output_router_logits=True)`` adds it; the chunks hand on its
    running sums and the last adds it with ``add_loss``. ``form="layer"``:
    each MoE layer adds its own term with ``add_loss`` whenever its router
    runs (in one process too, inside ``collect_losses()``). Returns the
    routers' hook handles (``handle.remove()`` on each undoes it)."""
    if form not in ("model", "layer"):
        raise ValueError(f"moe_aux_losses: form must be 'model' or 'layer', got {form!r}")
    config = getattr(model, "config", None)
    # Mixtral's num_local_experts, Qwen2-MoE's and Qwen3-MoE's num_experts
    # (the same load_balancing_loss_func over their *TopKRouter logits).
    experts = getattr(config, "num_local_experts", None)
    if experts is None:
        experts = getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(experts, int) or not isinstance(top_k, int) or (
            coef is None and getattr(config, "router_aux_loss_coef", None) is None):
        raise ValueError(f"moe_aux_losses: {type(model).__name__} has no num_local_experts (or "
                         "num_experts), num_experts_per_tok and router_aux_loss_coef in its "
                         "config, as transformers' Mixtral, Qwen2-MoE and Qwen3-MoE have: it "
                         "trains no router load-balancing loss of that form")
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
