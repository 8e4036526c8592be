"""The graph passes: GraphPass, PassPipeline, DCE, canonicalize, FSDP, overlap, column sums."""

from .base import GraphPass
from .pipeline import CanonicalizeGraph, DeadCodeElimination, PassPipeline
from .fsdp import FSDPPass
from .overlap import AutoOverlapPass
from .column_sums import ColumnSumsAsProducts

__all__ = ["GraphPass", "PassPipeline", "DeadCodeElimination", "CanonicalizeGraph",
           "FSDPPass", "AutoOverlapPass", "ColumnSumsAsProducts"]
