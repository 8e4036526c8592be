"""The graph passes: GraphPass, PassPipeline, DCE, canonicalize, FSDP, overlap."""

from .base import GraphPass
from .pipeline import CanonicalizeGraph, DeadCodeElimination, PassPipeline
from .fsdp import FSDPPass
from .overlap import AutoOverlapPass

__all__ = ["GraphPass", "PassPipeline", "DeadCodeElimination", "CanonicalizeGraph",
           "FSDPPass", "AutoOverlapPass"]
