"""hyperparallel.compile: graph mode for Python models (seed 002).

Capture a whole train step (forward + backward) of an nn.Module as one joint
FX graph, transform it with passes (DCE, canonicalize, FSDP, overlap) and
replay it under torch.no_grad() from a GraphTrainer. See docs/graph_mode.md.
"""

from .parallel_config import PassConfig
from .sharding_config import FSDPModuleConfig, PassPlan, create_sharding_plan_from_yaml
from .tracer import LEAF_TYPES, trace_model_graph
from .passes import (AutoOverlapPass, CanonicalizeGraph, ColumnSumsAsProducts,
                     DeadCodeElimination, FSDPPass, GraphPass, PassPipeline)
from .mesh import MeshContext
from .trainer import GraphTrainer
from .stage import GraphStage, SplitGraphs, split_joint_graph

__all__ = [
    "PassConfig", "PassPlan", "FSDPModuleConfig", "create_sharding_plan_from_yaml",
    "trace_model_graph", "LEAF_TYPES", "GraphPass", "PassPipeline", "DeadCodeElimination",
    "CanonicalizeGraph", "FSDPPass", "AutoOverlapPass", "ColumnSumsAsProducts", "MeshContext",
    "GraphTrainer",
    "GraphStage", "SplitGraphs", "split_joint_graph",
]
