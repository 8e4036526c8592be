"""GraphPass: one transformation of a captured joint graph (seed 002 §3).

Torch-free at import (torch.fx only for type checking), like the pipeline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch.fx

__all__ = ["GraphPass"]


class GraphPass:
    """A pass takes the GraphModule and the run's context (model=,
    fsdp_group_name=, ...) and returns the GraphModule it made (the same
    object, changed in place, or a new one carrying the same metadata)."""

    name = "pass"

    def run(self, gm: "torch.fx.GraphModule", **context: Any) -> "torch.fx.GraphModule":
        raise NotImplementedError(f"{type(self).__name__}.run")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
