"""Expert parallelism: a model's mixture-of-experts layers with their experts
spread over an expert-parallel (EP) group of ranks.

``expert_parallel(model, ep_group)`` converts a transformers Mixtral,
Qwen2-MoE, Qwen3-MoE or DeepSeek-V3 in place: each MoE block keeps its own
router and shared experts, and its experts collection keeps this rank's slice
of the model's own expert weights, with tokens sent to the ranks that hold
their experts and back by the C++ dispatcher (hp/moe; NOTE [Dispatch and
combine] in hp/moe/dispatch.cpp). Train it with a Pipeline whose
``dp_group`` is the EP group (expert parallelism is carved out of data
parallelism: NOTE [Expert gradients] in hp/pipeline/pipeline.cpp).
"""

from .convert import (  # noqa: F401
    ExpertParallelError,
    expert_parallel,
    expert_parameters,
    is_expert_parameter,
)
from .. import _C

TokenDispatcher = _C.moe.TokenDispatcher
route = _C.moe.route

__all__ = [
    "expert_parallel",
    "expert_parameters",
    "is_expert_parameter",
    "ExpertParallelError",
    "TokenDispatcher",
    "route",
]
