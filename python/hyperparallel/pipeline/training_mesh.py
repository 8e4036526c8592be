"""The training mesh: the process groups of pipeline, data-parallel and
expert-parallel ranks, laid out as ``hp train`` lays them out (NOTE [The
training mesh] in hp/distributed/mesh.h)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch.distributed as dist

from .. import _C


@dataclass(frozen=True)
class TrainingMesh:
    """This rank's groups of a mesh made by :func:`mesh` (None where a
    dimension has one rank, as ``Pipeline``'s arguments take them)."""

    pp: dist.ProcessGroup  #: the pipeline's ranks (``Pipeline(group=...)``)
    dp: Optional[dist.ProcessGroup]  #: the copies of this stage (``dp_group``)
    ep: Optional[dist.ProcessGroup]  #: the copies the experts spread over
    expert_dp: Optional[dist.ProcessGroup]  #: the copies holding this rank's experts
    stage_rank: int  #: this rank's rank in its pipeline
    copy: int  #: which copy of the pipeline it is in (its part of the global batch)
    shape: Tuple[Tuple[str, int], ...]  #: (name, size) outermost first: edp, ep, pp


def mesh_shape(world: int, pp: int, dp: int = 1, ep: int = 1) -> List[Tuple[str, int]]:
    """[(name, size)] of the training mesh over ``world`` ranks, outermost
    first (edp = dp / ep, ep, pp); ValueError saying what to change (the
    same words as ``hp train``'s)."""
    for name, v in (("world", world), ("pp", pp), ("dp", dp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    return [tuple(d) for d in _C.pipeline.training_mesh(world, pp, dp, ep)]


def _slices(sizes: List[int], dims: List[int]) -> List[List[int]]:
    """Every slice of the row-major mesh along `dims` (the ranks that share
    all other coordinates), in order of the other coordinates."""
    n = 1
    for s in sizes:
        n *= s
    groups = {}
    for r in range(n):
        c, rest = [], r
        for s in reversed(sizes):
            c.append(rest % s)
            rest //= s
        c.reverse()
        key = tuple(x for d, x in enumerate(c) if d not in dims)
        groups.setdefault(key, []).append(r)
    return [groups[k] for k in sorted(groups)]


def mesh(pp: int, dp: int = 1, ep: int = 1) -> TrainingMesh:
    """Makes the groups of ``pp`` ranks per pipeline, ``dp`` copies and
    experts over ``ep`` consecutive copies over torch.distributed's world
    (collective: every rank calls it, with the same sizes). Rank r is stage
    rank ``r % pp`` of copy ``r // pp``; the copies ``[a * ep, (a + 1) *
    ep)`` form an expert-parallel group; ``expert_dp`` joins the copies with
    the same position in theirs. So::

        m = hp.pipeline.mesh(pp=2, dp=4, ep=2)
        hp.moe.expert_parallel(model, m.ep)
        Pipeline(chunks, sched, loss_fn=..., group=m.pp, dp_group=m.dp,
                 expert_dp_group=m.expert_dp)
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call "
                           "torch.distributed.init_process_group first")
    world, me = dist.get_world_size(), dist.get_rank()
    shape = mesh_shape(world, pp, dp, ep)
    sizes = [s for _, s in shape]  # edp, ep, pp

    def mine(dims):
        # Every rank makes every slice's group, in one order; keeps its own.
        slices = _slices(sizes, dims)
        if len(slices[0]) == world:
            return dist.group.WORLD
        got, _ = dist.new_subgroups_by_enumeration(slices)
        return got

    pp_group = mine([2])
    dp_group = mine([0, 1]) if dp > 1 else None
    ep_group = (dp_group if ep == dp else mine([1])) if ep > 1 else None
    edp_group = mine([0]) if 1 < ep < dp else None
    return TrainingMesh(pp=pp_group, dp=dp_group, ep=ep_group, expert_dp=edp_group,
                        stage_rank=me % pp, copy=me // pp, shape=tuple(shape))
