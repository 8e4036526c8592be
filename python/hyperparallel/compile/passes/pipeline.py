"""PassPipeline and the basic passes (seed 002 §5, §8).

Fixed order: DeadCodeElimination -> CanonicalizeGraph -> [FSDPPass] ->
[AutoOverlapPass] -> [backend]. Torch-free at import: the passes import
torch.fx when they run."""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

from .base import GraphPass

__all__ = ["PassPipeline", "DeadCodeElimination", "CanonicalizeGraph"]


class DeadCodeElimination(GraphPass):
    """Drops nodes nobody reads. Mutating and random operators stay
    (torch.fx's is_impure); unread collectives and waits go (every rank runs
    the same pass on the same graph, so they go everywhere)."""

    name = "dce"

    def run(self, gm, **context):
        from ._collectives import is_collective, is_wait

        changed = True
        while changed:
            changed = False
            for node in reversed(list(gm.graph.nodes)):
                if node.op in ("placeholder", "output") or node.users:
                    continue
                if is_collective(node) or is_wait(node) or not node.is_impure():
                    gm.graph.erase_node(node)
                    changed = True
        gm.graph.lint()
        gm.recompile()
        return gm


class CanonicalizeGraph(GraphPass):
    """Drops aten.detach and aten.alias: under torch.no_grad() they are the
    identity, and they hide a value's real producer from later passes."""

    name = "canonicalize"

    def run(self, gm, **context):
        import torch

        identities = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in identities:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()
        return gm


class PassPipeline:
    """Runs passes in order; `backend` (None, a torch.compile backend name
    such as "inductor", or a callable) compiles the result: `compile(gm)`
    returns what the trainer calls."""

    def __init__(self, passes: Sequence[GraphPass] = (), backend: Any = None):
        self.passes: List[GraphPass] = list(passes)
        self.backend = backend

    @classmethod
    def from_config(cls, config, plan=None) -> "PassPipeline":
        """The seed's fixed order: dce -> canonicalize -> [fsdp] -> [auto_overlap]."""
        config.validate()
        passes: List[GraphPass] = [DeadCodeElimination(), CanonicalizeGraph()]
        if config.fsdp_enabled:
            from .fsdp import FSDPPass

            passes.append(FSDPPass(plan, degree=config.fsdp_degree,
                                   reshard_after_forward=config.reshard_after_forward,
                                   bucket=config.bucket))
        if config.enable_overlap:
            from .overlap import AutoOverlapPass

            passes.append(AutoOverlapPass(prefetch=config.prefetch))
        return cls(passes, backend=config.backend)

    @property
    def names(self) -> List[str]:
        return [p.name for p in self.passes]

    def run(self, gm, **context):
        """Every pass in order (context: model=, fsdp_group_name="fsdp", ...)."""
        for p in self.passes:
            gm = p.run(gm, **context)
        return gm

    def compile(self, gm) -> Callable:
        """The backend's compiled callable (the GraphModule itself without one).

        NOTE [Graphs compiled without dynamo]
        A captured graph is already ATen, traced with the shapes and strides
        it will run with, so the backend (inductor's compile_fx, or any
        torch.compile backend: fn(gm, example_inputs) -> callable) compiles it
        directly, with the placeholders' traced values as example inputs.
        Through torch.compile, dynamo would trace it again and check a guard
        per input at every call: on a GraphStage's dx graph (51 inputs) that
        was 0.15 ms of cache lookup per call, paid twice by a split backward.
        The caller keeps what dynamo's guards kept: a call whose inputs differ
        from the traced ones in shape, dtype or strides captures anew."""
        if self.backend is None:
            return gm
        import torch
        from torch._dynamo import lookup_backend

        examples = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        if not all(isinstance(v, torch.Tensor) for v in examples):
            # A pass made a placeholder with no traced value: dynamo traces it.
            return torch.compile(gm, backend=self.backend, fullgraph=True, dynamic=False)
        backend = lookup_backend(self.backend) if isinstance(self.backend, str) else self.backend
        with torch.no_grad():
            return backend(gm, [v.detach() for v in examples])

    def __repr__(self) -> str:
        return f"PassPipeline({' -> '.join(self.names)}, backend={self.backend!r})"
