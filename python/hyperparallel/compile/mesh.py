"""MeshContext: graph mode on a DeviceMesh (seed 002 §5.1, §9).

The layer above builds the mesh and the TP shard of the model (TP
collectives live in the model's forward); graph mode adds the FSDP
dimension. MeshContext names which dimension of which mesh is FSDP's:
`fsdp_non_moe_mesh` (else `device_mesh`), dimension `fsdp_dim` (None: the
first of "fsdp_shard", "fsdp", "dp" the mesh has). GraphTrainer registers
that dimension's group as "fsdp" and fills PassConfig.fsdp_degree (and
tp_size) from it: with TP the FSDP group is a proper sub-group of the
world, so the world size would shard along the TP axis too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["MeshContext", "register_process_group"]

_FSDP_DIMS = ("fsdp_shard", "fsdp", "dp")


@dataclass
class MeshContext:
    device_mesh: Any
    fsdp_non_moe_mesh: Any = None
    fsdp_dim: Optional[str] = None
    tp_dim: Optional[str] = "tp"

    def _names(self, mesh) -> tuple:
        return tuple(getattr(mesh, "mesh_dim_names", None) or ())

    @property
    def fsdp_mesh(self):
        return self.fsdp_non_moe_mesh if self.fsdp_non_moe_mesh is not None else self.device_mesh

    def fsdp_dim_name(self) -> str:
        """The FSDP dimension; ValueError naming it (or the candidates) and the
        mesh's dimensions when the mesh has none."""
        names = self._names(self.fsdp_mesh)
        if self.fsdp_dim is not None:
            if self.fsdp_dim not in names:
                raise ValueError(f"MeshContext: the mesh has no dimension '{self.fsdp_dim}' "
                                 f"(its dimensions: {', '.join(names) or 'none named'})")
            return self.fsdp_dim
        for d in _FSDP_DIMS:
            if d in names:
                return d
        raise ValueError("MeshContext: the mesh has none of the FSDP dimensions "
                         f"{', '.join(repr(d) for d in _FSDP_DIMS)} (its dimensions: "
                         f"{', '.join(names) or 'none named'}); name one with fsdp_dim=")

    def tp_dim_name(self) -> Optional[str]:
        """The TP dimension of device_mesh, None when the mesh has none."""
        if self.tp_dim is None:
            return None
        return self.tp_dim if self.tp_dim in self._names(self.device_mesh) else None

    def validate(self) -> None:
        fsdp = self.fsdp_dim_name()
        tp = self.tp_dim_name()
        if tp is not None and tp == fsdp:
            raise ValueError(f"MeshContext: TP and FSDP are both on dimension '{fsdp}'; they "
                             "need two dimensions (e.g. a mesh with 'tp' and 'dp')")

    def fsdp_group(self):
        self.validate()
        return self.fsdp_mesh.get_group(self.fsdp_dim_name())

    def fsdp_degree(self) -> int:
        return self.fsdp_mesh.size(self._names(self.fsdp_mesh).index(self.fsdp_dim_name()))

    def tp_group(self):
        tp = self.tp_dim_name()
        return None if tp is None else self.device_mesh.get_group(tp)

    def tp_size(self) -> int:
        tp = self.tp_dim_name()
        return 1 if tp is None else self.device_mesh.size(self._names(self.device_mesh).index(tp))

    def register_fsdp_group(self, name: str = "fsdp") -> int:
        """Registers the FSDP dimension's group as `name`; returns its size."""
        register_process_group(name, self.fsdp_group())
        return self.fsdp_degree()


def register_process_group(name: str, group) -> None:
    """Registers `group` for functional collectives under `name`, replacing
    an earlier registration of that name."""
    c10d = torch._C._distributed_c10d
    try:
        c10d._resolve_process_group(name)
        c10d._unregister_process_group(name)
    except Exception:  # noqa: BLE001 - not registered yet
        pass
    c10d._register_process_group(name, group)
