"""PassConfig: which graph passes run and with what parallel degrees (seed 002 §4.1).

Torch-free on purpose (a plain dataclass): whether torch.distributed is
initialized is decided by FSDPPass at run time, never here. The fields and
messages are those of the C++ `hp::compile::PassConfig` (hp/compile/pass_config.h).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["PassConfig"]


@dataclass
class PassConfig:
    """Drives PassPipeline.from_config.

    enable_overlap: run AutoOverlapPass (waits sink to their first use,
        all-gathers are issued ahead of their use).
    fsdp_enabled: run FSDPPass; it does nothing when torch.distributed is not
        initialized or the FSDP group has one rank (plain graph mode).
    fsdp_degree: the FSDP group's size; None means "filled at run time" (the
        mesh's FSDP dimension with a MeshContext, else the world size).
    tp_size, sequence_parallel, loss_parallel: informational (TP collectives
        live in the model's own forward); tp_size >= 1.
    reshard_after_forward: with FSDP, free each gathered parameter after its
        last forward use and gather it again for the backward (less memory,
        twice the all-gather traffic). Python only (the C++ graph holds them).
    backend: None (replay the FX graph as it is) or a torch.compile backend
        ("inductor", "aot_eager", or a callable) applied after the passes.
    bucket: "module" (FSDP's collectives carry a module's parameters
        together, as FSDP2 per fully_shard'ed module) or "parameter" (one
        collective each, the seed's form). Python only.
    prefetch: how many all-gathers AutoOverlapPass keeps in flight ahead of
        the one being waited for (>= 1); None issues every all-gather at the
        top of the graph (most overlap, every gathered parameter held).
    """

    enable_overlap: bool = True
    fsdp_enabled: bool = True
    fsdp_degree: Optional[int] = None
    tp_size: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    reshard_after_forward: bool = False
    backend: Any = None
    prefetch: Optional[int] = 1
    bucket: str = "module"

    def validate(self) -> None:
        """Raises ValueError naming the bad field and what to do."""
        for name in ("enable_overlap", "fsdp_enabled", "sequence_parallel", "loss_parallel",
                     "reshard_after_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PassConfig: {name} is {getattr(self, name)!r}; it must be "
                                 "True or False")
        if not _is_int(self.tp_size) or self.tp_size < 1:
            raise ValueError(f"PassConfig: tp_size is {self.tp_size!r}; it must be >= 1 "
                             "(1 means no tensor parallelism)")
        if self.fsdp_degree is not None and (not _is_int(self.fsdp_degree)
                                             or self.fsdp_degree < 1):
            raise ValueError(f"PassConfig: fsdp_degree is {self.fsdp_degree!r}; it must be a "
                             "positive integer, or None to use the world size")
        if self.prefetch is not None and (not _is_int(self.prefetch) or self.prefetch < 1):
            raise ValueError(f"PassConfig: prefetch is {self.prefetch!r}; it must be a positive "
                             "integer, or None to issue every all-gather at the top of the graph")
        if self.bucket not in ("module", "parameter"):
            raise ValueError(f"PassConfig: bucket is {self.bucket!r}; give 'module' (a "
                             "module's parameters in one collective) or 'parameter'")
        if self.backend is not None and not (isinstance(self.backend, str)
                                             or callable(self.backend)):
            raise ValueError(f"PassConfig: backend is {self.backend!r}; give None, a "
                             "torch.compile backend name (e.g. 'inductor') or a callable")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
